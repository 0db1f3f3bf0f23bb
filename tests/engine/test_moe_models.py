"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), built from transformers' own
config classes with random weights: greedy tokens equal Hugging Face's (float32, CPU) under
chunked prefill, prefix-cache hits and preemption; with FP8 experts against the same fake
quantization; with n-gram speculation and a guided request; on two tensor-parallel ranks; LoRA on
attention served and LoRA on experts refused; checkpoint and config errors said clearly."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_reference import hf_greedy_generate
from lora_adapters import merged_hf_model, write_adapter
from safetensors.torch import load_file, save_file
from test_fp8 import fake_quant_linear
from test_hf_parity import hf_greedy, make_prompts, run_staggered
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritium import LLM, EngineArgs, LLMEngine, SamplingParams
from tritium.layers.moe import FusedMoE, SparseMoeBlock
from tritium.models import get_model_class
from tritium.worker.worker_group import check_tp_shapes
from tritium.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

MAX_NEW = 12


@pytest.fixture(scope="module")
def moe_expected(moe_dirs):
    refs = {}
    for name, model_dir in moe_dirs.items():
        prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir))
        refs[name] = (prompts, hf_greedy(model_dir, prompts))
    return refs


def _family(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)["model_type"]


def test_moe_matches_hf_under_chunking_prefix_hits_and_preemption(moe_model_dir, moe_expected):
    prompts, ref = moe_expected[_family(moe_model_dir)]
    engine = LLMEngine(EngineArgs(model=moe_model_dir, dtype="float32", max_num_batched_tokens=16,
                                  num_kv_blocks=24, block_size=16, enable_prefix_caching=True))
    model = engine.executor.worker.model
    assert model.config.is_moe
    assert any(isinstance(m, SparseMoeBlock) for m in model.modules())
    got = run_staggered(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0
    for i in range(len(prompts)):
        assert got[str(i)] == ref[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
    # The outputs depend on the routing: not one token repeated for every prompt.
    assert len({tuple(r) for r in ref}) > len(ref) // 2
    engine.block_manager.check_integrity([])


def test_family_blocks_follow_the_config(moe_dirs):
    """Qwen2-MoE keeps its mlp_only_layers dense and has a shared expert; Mixtral and Qwen3-MoE
    route every layer and have none; the routing weights renormalise as each family says."""
    shapes = {}
    for name, model_dir in moe_dirs.items():
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        with torch.device("meta"):
            model = get_model_class(config)(config, torch.float32)
        mlps = [layer.mlp for layer in model.model.layers]
        shapes[name] = ([type(m).__name__ for m in mlps], model.config.norm_topk_prob,
                        [m.shared_expert is not None for m in mlps if isinstance(m, SparseMoeBlock)])
    assert shapes == {
        "mixtral": (["SparseMoeBlock"] * 2, True, [False, False]),
        "qwen2_moe": (["SparseMoeBlock", "GatedMLP", "SparseMoeBlock"], False, [True, True]),
        "qwen3_moe": (["SparseMoeBlock"] * 2, True, [False, False]),
    }


def _fake_quant_experts(experts: nn.Module) -> int:
    """HF's stacked experts ([E, out, in] parameters) rounded to FP8 with one scale per expert and
    output row, then dequantized: the engine's W8A16 experts."""
    count = 0
    for name, param in experts.named_parameters():
        w = param.data.float()
        scale = (w.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        param.data.copy_((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale)
        count += 1
    return count


def test_fp8_moe_matches_hf_with_the_same_fake_quantization(moe_model_dir):
    """quantization="fp8": experts in FP8 (activations 16-bit), attention and the shared expert
    as FP8 linear layers; router gates stay unquantized, as vLLM keeps them."""
    tok = AutoTokenizer.from_pretrained(moe_model_dir)
    prompts = [tok(p)["input_ids"] for p in ("The engine streams tokens", "x",
                                             "GPU kernels read the cache in place while users wait")]
    model = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        for lin in layer.self_attn.children():
            if isinstance(lin, nn.Linear):
                fake_quant_linear(lin)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            assert _fake_quant_experts(mlp.experts) == 2
            for lin in getattr(mlp, "shared_expert", nn.Module()).children():
                if isinstance(lin, nn.Linear):
                    fake_quant_linear(lin)
        else:
            for lin in mlp.children():
                if isinstance(lin, nn.Linear):
                    fake_quant_linear(lin)
    ref = hf_greedy_generate(model, prompts, MAX_NEW)
    llm = LLM(moe_model_dir, dtype="float32", quantization="fp8")
    experts = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(e.w13_weight.dtype == FP8_DTYPE and e.w2_scale.shape == (8, 64) for e in experts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_ngram_speculation_and_a_guided_request_on_a_moe_model(moe_dirs, moe_expected):
    model_dir = moe_dirs["qwen3_moe"]
    prompts, ref = moe_expected["qwen3_moe"]
    llm = LLM(model_dir, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_max": 3})
    outs = llm.generate(prompts[:6], SamplingParams(temperature=0, max_tokens=20, min_tokens=20))
    assert [o.outputs[0].token_ids for o in outs] == ref[:6]
    guided = llm.generate(["Choose one:"], SamplingParams(temperature=0, max_tokens=10,
                                                          structured_outputs={"choice": ["yes", "no", "maybe so"]}))
    assert guided[0].outputs[0].text in ("yes", "no", "maybe so")


def test_preemption_by_swap_and_a_draft_model_on_a_moe_model(moe_dirs, moe_expected, llama_dir):
    """Mixtral with preempted sequences swapped to host memory and back, then Qwen3-MoE
    speculating with the tiny Llama (same tokenizer) as its draft model."""
    prompts, ref = moe_expected["mixtral"]
    engine = LLMEngine(EngineArgs(model=moe_dirs["mixtral"], dtype="float32", max_num_batched_tokens=16,
                                  num_kv_blocks=24, block_size=16, swap_space=0.01, preemption_mode="swap"))
    got = run_staggered(engine, prompts)
    stats = engine.get_stats()
    assert stats.num_swapped_preemptions > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out > 0
    assert [got[str(i)] for i in range(len(prompts))] == ref
    prompts, ref = moe_expected["qwen3_moe"]
    llm = LLM(moe_dirs["qwen3_moe"], dtype="float32",
              speculative_config={"model": llama_dir, "num_speculative_tokens": 3})
    outs = llm.generate(prompts[:6], SamplingParams(temperature=0, max_tokens=20, min_tokens=20))
    assert [o.outputs[0].token_ids for o in outs] == ref[:6]


def test_two_tensor_parallel_ranks_match_hf(moe_dirs, moe_expected):
    """Qwen2-MoE on two gloo ranks: each holds half of every expert's, the shared expert's and the
    dense layer's intermediate dimension, and one kv head."""
    prompts, ref = moe_expected["qwen2_moe"]
    engine = LLMEngine(EngineArgs(model=moe_dirs["qwen2_moe"], dtype="float32", max_num_batched_tokens=32,
                                  enable_prefix_caching=True, tensor_parallel_size=2))
    try:
        got = run_staggered(engine, prompts[:8])
        for i in range(8):
            assert got[str(i)] == ref[i], f"prompt {i} differs from HF on two ranks"
    finally:
        engine.shutdown()


def test_attention_lora_on_a_moe_model_matches_the_merged_model(moe_dirs, tmp_path):
    model_dir = moe_dirs["qwen3_moe"]
    adapter = write_adapter(str(tmp_path / "attn"), model_dir, ["q_proj", "v_proj", "o_proj"], 4, 8, seed=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in ("The cache streams a batch", "A kernel decodes")]
    ref = hf_greedy_generate(merged_hf_model(model_dir, adapter), prompts, MAX_NEW)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, lora_modules={"attn": adapter}, max_lora_rank=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW),
                        lora_request="attn")
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_lora_on_experts_is_refused_clearly(moe_dirs, tmp_path):
    model_dir = moe_dirs["qwen3_moe"]
    key = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
    adapter = write_adapter(str(tmp_path / "experts"), model_dir, ["q_proj"], 4, 8, seed=3,
                            extra_tensors={key: torch.zeros(4, 64)})
    with pytest.raises(ValueError, match=(
            rf"^LoRA adapter 'experts': tensor '{key}' targets an expert of a mixture-of-experts "
            r"layer; LoRA on experts is not supported \(on attention and dense MLP projections it is\)\.$")):
        LLM(model_dir, dtype="float32", enable_lora=True, lora_modules={"experts": adapter}, max_lora_rank=4)


def _copy_with(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    save_file(edit(tensors), os.path.join(dst, "model.safetensors"))
    return dst


def test_checkpoint_with_an_expert_too_many_is_refused(moe_dirs, tmp_path):
    def add_expert(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = t["model.layers.0.mlp.experts.7.up_proj.weight"].clone()
        return t
    model_dir = _copy_with(moe_dirs["qwen3_moe"], str(tmp_path / "nine"), add_expert)
    with pytest.raises(ValueError, match=r"^model: checkpoint expert 8 is not one of the model's 8 experts$"):
        LLM(model_dir, dtype="float32")


def test_checkpoint_missing_an_expert_is_refused(moe_dirs, tmp_path):
    """Stacked experts load as one parameter: a checkpoint without one expert's projection must
    not leave that expert's rows uninitialised."""
    def drop(t):
        del t["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
        return t
    model_dir = _copy_with(moe_dirs["mixtral"], str(tmp_path / "seven"), drop)
    with pytest.raises(ValueError, match=r"^model: checkpoint lacks layer 1 expert 5's down projection "
                                         r"\(model\.layers\.1\.mlp\.experts\.w2_weight\)$"):
        LLM(model_dir, dtype="float32")


def test_config_errors_are_clear(moe_dirs):
    with open(os.path.join(moe_dirs["mixtral"], "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with pytest.raises(ValueError, match=r"^model: num_experts_per_tok=9 must lie in 1\.\.8 \(num_experts\)$"):
        get_model_class(config).read_config({**config, "num_experts_per_tok": 9})
    qwen_moe = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "num_experts": 8,
                "moe_intermediate_size": 30, "shared_expert_intermediate_size": 64}
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=4 does not divide the model's moe_intermediate_size=30\.$"):
        check_tp_shapes(qwen_moe, 4)
    check_tp_shapes(qwen_moe, 2)
