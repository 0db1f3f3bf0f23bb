"""AWQ (AutoAWQ GEMM) and GPTQ checkpoints of the test architectures, made here by quantizing
their weights and packing them as the formats define (this file packs with loops over the bit
fields and dequantizes with a loop-free formula; the engine's unpacker is in
backend/layers/int4.py): the engine holds exactly the weights the reference dequantizer reads,
and its greedy tokens equal Hugging Face's on a checkpoint of those dequantized float32 weights.
Group sizes 32 / 64 / 128 and one group over K, asymmetric and symmetric zeros, GPTQ's desc_act
with a shuffled g_idx, 8-bit GPTQ; bad or unsupported checkpoints fail naming the field."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import zlib

import pytest
import torch
from hf_reference import hf_greedy_generate
from lora_adapters import write_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tritium import LLM, SamplingParams
from tritium.layers.int4 import dequantized_weight

# checkpoint projection -> which input it reads (projections of one input share GPTQ's act order)
INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "qkv_proj": "attn", "o_proj": "o",
          "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "down"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # slot i of an AWQ word holds column 8c + AWQ_ORDER[i]
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], list(range(3, 40)), [5]]
MAX_NEW = 12


# ---- quantizing and packing (the formats' definitions) ------------------------------------------
def quantize(w: torch.Tensor, group: int, bits: int, sym: bool, order: torch.Tensor):
    """w [N, K] -> integer q [N, K], zeros [N, G], fp16 scales [N, G] and g_idx [K]: groups are
    runs of `group` input channels taken in `order` (GPTQ's act order; AWQ: 0..K-1)."""
    n, k = w.shape
    maxq = 2**bits - 1
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    q = torch.empty(n, k, dtype=torch.int64)
    zeros, scales = torch.empty(n, k // group, dtype=torch.int64), torch.empty(n, k // group)
    for g in range(k // group):
        cols = (g_idx == g).nonzero().view(-1)
        part = w[:, cols].float()
        if sym:
            scale = (2 * part.abs().amax(dim=1) / maxq).clamp(min=1e-6).half().float()
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-6).half().float()
            zero = torch.round(-lo / scale).long().clamp(0, maxq)
        q[:, cols] = (torch.round(part / scale[:, None]).long() + zero[:, None]).clamp(0, maxq)
        zeros[:, g], scales[:, g] = zero, scale
    return q, zeros, scales.half(), g_idx


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(q, zeros, scales) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N / 8], qzeros [G, N / 8] (columns in AWQ order), scales [G, N]."""
    def pack(v):  # v [rows, N] -> [rows, N / 8]
        words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
        for slot, col in enumerate(AWQ_ORDER):
            words |= v[:, col::8] << (4 * slot)
        return _int32(words)
    return {"qweight": pack(q.t()), "qzeros": pack(zeros.t()), "scales": scales.t().contiguous()}


def gptq_pack(q, zeros, scales, g_idx, bits) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight [K / P, N] (rows in order), qzeros [G, N / P] holding zero - 1 (in `bits`
    bits), scales [G, N], g_idx [K]."""
    per_word, maxq = 32 // bits, 2**bits - 1
    qt = q.t()
    qweight = torch.zeros(qt.shape[0] // per_word, qt.shape[1], dtype=torch.int64)
    for i in range(per_word):
        qweight |= qt[i::per_word] << (bits * i)
    zt = (zeros.t() - 1) & maxq
    qzeros = torch.zeros(zt.shape[0], zt.shape[1] // per_word, dtype=torch.int64)
    for i in range(per_word):
        qzeros |= zt[:, i::per_word] << (bits * i)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros),
            "scales": scales.t().contiguous(), "g_idx": g_idx}


# ---- the reference dequantizer (loop-free, from the definitions) ------------------------------
def dequantize(fmt: str, t: dict[str, torch.Tensor], bits: int, group: int) -> torch.Tensor:
    """A checkpoint projection's tensors -> its float32 weight [N, K]."""
    maxq = 2**bits - 1
    if fmt == "awq":
        slot_of_column = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
        def unpack(words):  # [rows, N / 8] -> [rows, N]
            return ((words[:, :, None] >> (4 * slot_of_column)) & 15).reshape(words.shape[0], -1)
        q, z = unpack(t["qweight"]), unpack(t["qzeros"])
        g = torch.arange(q.shape[0]) // group
    else:
        shifts = bits * torch.arange(32 // bits)
        q = ((t["qweight"][:, None, :] >> shifts[None, :, None]) & maxq).reshape(-1, t["qweight"].shape[1])
        z = (((t["qzeros"][:, :, None] >> shifts) & maxq).reshape(t["qzeros"].shape[0], -1) + 1) & maxq
        g = t["g_idx"].long()
    return ((q - z[g]).float() * t["scales"].float()[g]).t().contiguous()


# ---- checkpoints ------------------------------------------------------------------------------
def _projection(name: str) -> str | None:
    parts = name.split(".")
    return parts[-2] if parts[-1] == "weight" and parts[-2] in INPUTS else None


def make_checkpoints(src: str, root: str, fmt: str, bits: int = 4, group: int = 32,
                     sym: bool = False, desc_act: bool = False, declare: dict | None = None):
    """(quantized checkpoint dir, dequantized float32 checkpoint dir, {projection name: its
    quantized tensors})."""
    qdir, ddir = os.path.join(root, fmt), os.path.join(root, "dequantized")
    shutil.copytree(src, qdir)
    shutil.copytree(src, ddir)
    packed_all = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors = load_file(path)
        quant, deq = {}, {}
        for name, w in tensors.items():
            proj = _projection(name)
            if proj is None:
                quant[name] = deq[name] = w
                continue
            k = w.shape[1]
            g = k if group == -1 else group
            seed = zlib.crc32(f"{name.split('.')[2]}.{INPUTS[proj]}".encode())
            order = (torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act
                     else torch.arange(k))
            q, zeros, scales, g_idx = quantize(w, g, bits, sym, order)
            packed = awq_pack(q, zeros, scales) if fmt == "awq" else gptq_pack(q, zeros, scales, g_idx, bits)
            prefix = name[:-len("weight")]
            quant.update({prefix + key: t for key, t in packed.items()})
            deq[name] = dequantize(fmt, packed, bits, g)
            # the packer and the reference dequantizer agree with the quantizer's own numbers
            gi = g_idx.long()
            assert torch.equal(deq[name], ((q - zeros[:, gi]).float() * scales.float()[:, gi])), name
            packed_all[prefix[:-1]] = packed
        base = os.path.basename(path)
        save_file(quant, os.path.join(qdir, base), metadata={"format": "pt"})
        save_file(deq, os.path.join(ddir, base), metadata={"format": "pt"})
    config_path = os.path.join(qdir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    if declare is None:
        declare = ({"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                    "version": "gemm"} if fmt == "awq" else
                   {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                    "sym": sym, "checkpoint_format": "gptq"})
    config["quantization_config"] = declare
    with open(config_path, "w") as f:
        json.dump(config, f)
    return qdir, ddir, packed_all


def engine_tokens(model_dir: str, **engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = LLM(model_dir, device="cpu", dtype="float32", **engine).generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs]


def hf_tokens(model_dir: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf_greedy_generate(model, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory) -> str:
    """A Llama whose every projection has K >= 128, for 128-wide groups."""
    from scripts.build_default_model import build_model
    return build_model(str(tmp_path_factory.mktemp("wide-llama")), seed=5, hidden_size=128,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


# (format, bits, group size, sym, desc_act)
FORMATS = {"awq-g32": ("awq", 4, 32, False, False),
           "gptq-g32-act-order": ("gptq", 4, 32, False, True)}
LLAMA_FORMATS = {"awq-g64": ("awq", 4, 64, False, False),
                 "gptq-g64-sym": ("gptq", 4, 64, True, False),
                 "gptq-8bit-per-channel-act-order": ("gptq", 8, -1, False, True)}
WIDE_FORMATS = {"awq-g128": ("awq", 4, 128, False, False),
                "gptq-g128-sym-act-order": ("gptq", 4, 128, True, True)}


def _check_engine_against_hf(src: str, root: str, fmt, bits, group, sym, desc_act) -> None:
    qdir, ddir, packed = make_checkpoints(src, root, fmt, bits, group, sym, desc_act)
    worker = LLM(qdir, device="cpu", dtype="float32").engine.executor.worker
    assert worker.quantization == fmt
    _assert_engine_weights(worker.model, packed, fmt, bits, group)
    assert engine_tokens(qdir) == hf_tokens(ddir)


@pytest.mark.parametrize("case", FORMATS, ids=list(FORMATS))
def test_every_architecture_serves_its_dequantized_weights(model_dir, tmp_path, case):
    _check_engine_against_hf(model_dir, str(tmp_path), *FORMATS[case])


@pytest.mark.parametrize("case", LLAMA_FORMATS, ids=list(LLAMA_FORMATS))
def test_group_sizes_zeros_and_bits(llama_dir, tmp_path, case):
    _check_engine_against_hf(llama_dir, str(tmp_path), *LLAMA_FORMATS[case])


@pytest.mark.parametrize("case", WIDE_FORMATS, ids=list(WIDE_FORMATS))
def test_groups_of_128(wide_llama_dir, tmp_path, case):
    _check_engine_against_hf(wide_llama_dir, str(tmp_path), *WIDE_FORMATS[case])


@pytest.mark.parametrize("case", WIDE_FORMATS, ids=list(WIDE_FORMATS))
def test_the_fragment_layout_serves_the_same_weights_and_tokens(wide_llama_dir, tmp_path, monkeypatch, case):
    """Where a card's table picks the fragment layout (kernels/w4a16_fragment_layout.py), every
    4-bit projection is repacked into it, holds the checkpoint's weights, act-order rows included,
    and the engine generates what Hugging Face does on the dequantized checkpoint."""
    from tritium.layers import int4
    fmt, bits, group, sym, desc_act = WIDE_FORMATS[case]
    qdir, ddir, packed = make_checkpoints(wide_llama_dir, str(tmp_path), fmt, bits, group, sym, desc_act)
    monkeypatch.setattr(int4, "uses_fragment_layout", lambda n, k, bits, group, device: True)
    llm = LLM(qdir, device="cpu", dtype="float32")
    model = llm.engine.executor.worker.model
    layouts = [(m.fragment_layout, m.qweight.dim()) for m in model.modules() if hasattr(m, "fragment_layout")]
    assert layouts == [(True, 4)] * (4 * len(model.model.layers))
    _assert_engine_weights(model, packed, fmt, bits, group)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == hf_tokens(ddir)


def _assert_engine_weights(model, packed, fmt, bits, group) -> None:
    """Each projection (q/k/v and gate/up fused in order) holds exactly the weight that the
    reference dequantizer reads from the checkpoint's parts."""
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = 0
    for i, layer in enumerate(model.model.layers):
        for block, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(module, name, None)
                if linear is None:
                    continue
                prefix = f"model.layers.{i}.{block}."
                names = [prefix + name] if prefix + name in packed else \
                    [prefix + p for p in parts.get(name, (name,))]
                k = linear.in_features
                want = torch.cat([dequantize(fmt, packed[n], bits, k if group == -1 else group)
                                  for n in names])
                got = dequantized_weight(linear, bits)
                assert torch.equal(got, want), names[0]
                checked += 1
    assert checked == 4 * len(model.model.layers)


def test_modules_kept_in_16_bits_outside_the_decoder_are_accepted(llama_dir, tmp_path):
    qdir, ddir, _ = make_checkpoints(llama_dir, str(tmp_path), "awq", 4, 32, declare={
        "quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM",
        "modules_to_not_convert": ["lm_head", "visual"]})
    assert engine_tokens(qdir) == hf_tokens(ddir)


def test_an_explicit_quantization_argument_reads_the_declared_layout(llama_dir, tmp_path):
    qdir, ddir, _ = make_checkpoints(llama_dir, str(tmp_path), "gptq", 4, 64, False, True)
    assert engine_tokens(qdir, quantization="gptq") == hf_tokens(ddir)


@pytest.fixture(scope="module")
def llama_adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"qv": write_adapter(str(root / "qv"), llama_dir, ["q_proj", "v_proj"], 8, 16, seed=1),
            "mlp": write_adapter(str(root / "mlp"), llama_dir, ["gate_proj", "down_proj"], 4, 4, seed=3)}


def test_speculative_decoding_and_lora_on_quantized_layers(llama_dir, llama_adapters, tmp_path):
    """Proposals verified by the quantized model, and adapters added on top of quantized
    projections, give the tokens of the dequantized checkpoint."""
    qdir, ddir, _ = make_checkpoints(llama_dir, str(tmp_path), "awq", 4, 32)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    assert engine_tokens(qdir, speculative_config=spec) == engine_tokens(ddir, speculative_config=spec)
    # The AWQ checkpoint as the draft model of its dequantized twin: its own quantization, the
    # same weights, so its proposals are nearly all right.
    llm = LLM(ddir, device="cpu", dtype="float32", speculative_config={"model": qdir, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == engine_tokens(ddir)
    assert llm.engine.executor.worker.drafter.model.model.layers[0].mlp.gate_up_proj.linear_method is not None
    st = llm.engine.get_stats()
    assert st.spec_decode_num_accepted_tokens >= 0.9 * st.spec_decode_num_draft_tokens > 0
    lora = dict(enable_lora=True, lora_modules=llama_adapters, device="cpu", dtype="float32")
    names = sorted(llama_adapters)[:2]
    outs = [[o.outputs[0].token_ids for o in LLM(d, **lora).generate(
        PROMPTS[:2], params, lora_request=names)] for d in (qdir, ddir)]
    assert outs[0] == outs[1]


def test_dummy_weights_with_quantization_awq(wide_llama_dir):
    """Random packed weights of the default layout (4 bits, groups of 128): what the GPU
    benchmark runs at Llama-3-8B's shapes."""
    worker = LLM(wide_llama_dir, device="cpu", load_format="dummy", quantization="awq").engine.executor.worker
    proj = worker.model.model.layers[0].mlp.gate_up_proj
    assert proj.qweight.dtype == torch.int32 and proj.qweight.shape == (proj.in_features, proj.out_features // 8)
    assert proj.scales.dtype == torch.float16 and proj.perm is None
    out = LLM(wide_llama_dir, device="cpu", load_format="dummy", quantization="gptq").generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_dummy_weights_of_an_act_order_checkpoint_gather_their_inputs(wide_llama_dir, tmp_path):
    """config.json declaring GPTQ with desc_act and load_format=dummy: each projection's groups
    are spread over K as a real act-order checkpoint's are, so the GPU benchmark measures the
    kernel's gathered path."""
    d = str(tmp_path / "act-order")
    shutil.copytree(wide_llama_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(d, device="cpu", load_format="dummy")
    proj = llm.engine.executor.worker.model.model.layers[0].mlp.down_proj
    k = proj.in_features
    assert proj.perm is not None and sorted(proj.perm.tolist()) == list(range(k))
    assert proj.perm.tolist() != list(range(k))
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def _declared(llama_dir, tmp_path, declare, fmt="gptq"):
    qdir, _, _ = make_checkpoints(llama_dir, str(tmp_path), fmt, 4, 32, declare=declare)
    return qdir


@pytest.mark.parametrize("declare, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32},
     "model: quantization_config.bits is 3; Tritium serves GPTQ checkpoints of 4 or 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "model: quantization_config.checkpoint_format is 'marlin'; Tritium reads the GPTQ (v1) layout "
     "that AutoGPTQ and GPTQModel write by default, not marlin, bitblas, exllama-v2-only or "
     "gptq_v2 layouts"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True},
     "model: quantization_config.lm_head is True; Tritium keeps the LM head in 16 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 24},
     "model: quantization_config.group_size is 24; it must be -1 or a power of two of at least 16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
     "model: quantization_config.version is 'gemv'; Tritium reads AutoAWQ's GEMM layout ('gemm'); "
     "re-export the checkpoint with version='gemm'"),
    ({"quant_method": "awq", "w_bit": 8, "q_group_size": 32},
     "model: quantization_config.bits is 8; Tritium serves 4-bit AWQ checkpoints"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp"]},
     "model: quantization_config.modules_to_not_convert is ['mlp']; Tritium quantizes every "
     "decoder projection alike"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64},  # packed with groups of 32
     "model: model.layers.0.mlp.down_proj.qzeros is torch.int32 (4, 8); gptq stores it as "
     "torch.int32 [G = 2, N * 4 / 32]"),
])
def test_unsupported_or_inconsistent_checkpoints_name_the_field(llama_dir, tmp_path, declare, message):
    qdir = _declared(llama_dir, tmp_path, declare)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(qdir, device="cpu")


def test_fused_parts_with_different_act_orders_are_refused(llama_dir, tmp_path):
    qdir, _, _ = make_checkpoints(llama_dir, str(tmp_path), "gptq", 4, 32, desc_act=True)
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.self_attn.v_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("model: the parts of a fused projection (q/k/v "
                                                   "or gate/up) have different g_idx")):
        LLM(qdir, device="cpu")


@pytest.mark.parametrize("engine, message", [
    (dict(quantization="fp8"), "quantization='fp8', but the checkpoint is quantized with 'awq': "
                               "leave quantization unset or set it to 'awq'"),
])
def test_a_conflicting_quantization_argument_is_refused(llama_dir, tmp_path, engine, message):
    qdir, _, _ = make_checkpoints(llama_dir, str(tmp_path), "awq", 4, 32)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(qdir, device="cpu", **engine)


def test_a_16_bit_checkpoint_with_quantization_awq_is_refused(llama_dir):
    with pytest.raises(ValueError, match="^" + re.escape(
            "quantization='awq' reads AWQ checkpoints (their config.json declares it in "
            "quantization_config); for random weights use load_format=dummy") + "$"):
        LLM(llama_dir, device="cpu", quantization="awq")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-act-order"])
def test_gpu_projections_run_the_kernel_on_the_loaded_layout(llama_dir, tmp_path, case, dtype):
    """On CUDA each loaded projection (fused parts, act-order rows) multiplies through
    kernels.w4a16_matmul as the dequantized float32 weight does, for decode and prefill rows;
    and the engine with CUDA graphs generates."""
    fmt, bits, group, sym, desc_act = FORMATS[case]
    qdir, _, _ = make_checkpoints(llama_dir, str(tmp_path), fmt, bits, group, sym, desc_act)
    _check_gpu_projections(qdir, bits, dtype, (1, 5, 40, 300), fragment=False)


def _check_gpu_projections(qdir: str, bits: int, dtype: torch.dtype, rows: tuple[int, ...], fragment: bool) -> None:
    """Each projection of the engine loaded on CUDA, in the layout expected, multiplies `rows`
    rows as its dequantized weight does; then the engine generates."""
    llm = LLM(qdir, device="cuda", dtype=str(dtype).split(".")[1], num_kv_blocks=256)
    for layer in llm.engine.executor.worker.model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert linear.fragment_layout is fragment and (linear.qweight.dim() == 4) is fragment
            w = dequantized_weight(linear, bits)
            for m in rows:
                x = torch.randn(m, linear.in_features, device="cuda").to(dtype)
                got = linear.linear_method.apply(linear, x, None).float()
                want = x.float() @ w.t()
                assert ((got - want).norm() / want.norm()).item() < 1e-2, (m, linear)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in out)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", WIDE_FORMATS, ids=list(WIDE_FORMATS))
def test_gpu_projections_in_the_fragment_layout(wide_llama_dir, tmp_path, monkeypatch, case, dtype):
    """The fragment layout forced on (as a card's table would choose it): each projection, act-order
    rows included, multiplies through kernels.w4a16_fragment_linear as its dequantized weight does,
    at one row, a few, and prefill's many (the dequantize-then-GEMM bucket); the engine generates."""
    from tritium.layers import int4
    fmt, bits, group, sym, desc_act = WIDE_FORMATS[case]
    qdir, _, _ = make_checkpoints(wide_llama_dir, str(tmp_path), fmt, bits, group, sym, desc_act)
    monkeypatch.setattr(int4, "uses_fragment_layout", lambda n, k, bits, group, device: True)
    _check_gpu_projections(qdir, bits, dtype, (1, 5, 40, 300, 1500), fragment=True)

