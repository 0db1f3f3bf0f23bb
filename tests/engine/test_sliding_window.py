"""Models with a sliding attention window (Mistral, Phi-3; Qwen2/3 with use_sliding_window on the
layers their layer_types name) are served past their window, with Hugging Face's tokens under
chunked prefill and prefix caching; and a model the engine cannot run exactly is refused with its
reason."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import hf_greedy_generate
from transformers import AutoModelForCausalLM

from tritium import EngineArgs, LLMEngine, SamplingParams
from scripts.build_default_model import build_model


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(dst)


def _greedy_staggered(model_dir: str, prompts: list[list[int]], max_new: int, **engine) -> list[list[int]]:
    """Greedy tokens with chunked prefill (16-token budget), prefix caching and staggered arrivals."""
    e = LLMEngine(EngineArgs(model=model_dir, dtype="float32", max_num_batched_tokens=16, block_size=16,
                             enable_prefix_caching=True, **engine))
    params = SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or e.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            e.add_request(str(i), p, params)
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert e.block_manager.prefix_cache_hits > 0
    return [got[str(i)] for i in range(len(prompts))]


def _window_prompts() -> list[list[int]]:
    """Prompts of 20-70 tokens, two sharing a 48-token prefix (three full blocks)."""
    gen = torch.Generator().manual_seed(50)
    shared = torch.randint(3, 500, (48,), generator=gen).tolist()
    return [shared + [7, 9], shared + [11, 13, 17], torch.randint(3, 500, (70,), generator=gen).tolist(),
            torch.randint(3, 500, (20,), generator=gen).tolist()]


@pytest.mark.parametrize("window", [16, 23])
def test_mistral_window_is_served_past_it_and_matches_hf(tmp_path, window):
    """Every layer windowed (Mistral): prompts plus outputs span several windows; the engine
    serves the whole max_position_embeddings."""
    d = build_model(str(tmp_path / "mistral"), arch="mistral", seed=9, sliding_window=window)
    engine = LLMEngine(EngineArgs(model=d, dtype="float32"))
    assert engine.config.model_config.max_model_len == 2048
    assert engine.executor.worker.model.config.layer_windows == (window, window)
    prompts = _window_prompts()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert _greedy_staggered(d, prompts, 40) == hf_greedy_generate(hf, prompts, 40)


def test_phi3_window_matches_hf_past_it(phi3_dir, tmp_path):
    d = _with_config(phi3_dir, tmp_path / "phi3-window", sliding_window=24)
    prompts = _window_prompts()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert _greedy_staggered(d, prompts, 30) == hf_greedy_generate(hf, prompts, 30)


def test_qwen2_windows_only_with_use_sliding_window_on_the_layers_it_names(qwen2_dir, tmp_path):
    """Qwen2 applies its window only with use_sliding_window, and then to the layers layer_types
    names (here the second of two): one windowed layer, one global, as HF runs them."""
    off = _with_config(qwen2_dir, tmp_path / "off", sliding_window=16, use_sliding_window=False)
    on = _with_config(qwen2_dir, tmp_path / "on", sliding_window=16, use_sliding_window=True,
                      layer_types=["full_attention", "sliding_attention"])
    assert LLMEngine(EngineArgs(model=off, dtype="float32")).executor.worker.model.config.layer_windows == (0, 0)
    assert LLMEngine(EngineArgs(model=on, dtype="float32")).executor.worker.model.config.layer_windows == (0, 16)
    prompts = _window_prompts()
    hf = AutoModelForCausalLM.from_pretrained(on, dtype=torch.float32)
    ref = hf_greedy_generate(hf, prompts, 30)
    assert _greedy_staggered(on, prompts, 30) == ref
    assert _greedy_staggered(off, prompts, 30) != ref  # the window changes the outputs


def test_other_activations_are_refused(llama_dir, tmp_path):
    d = _with_config(llama_dir, tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"^model: hidden_act 'gelu' is not supported \(silu and gelu_pytorch_tanh are\)$"):
        LLMEngine(EngineArgs(model=d, dtype="float32"))


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 2.1, 3.5], "long_factor": [1.5, 2.5, 4.0, 8.0]}


def _generate(engine, prompts, max_tokens):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.outputs[0].token_ids
    return [got[str(i)] for i in range(len(prompts))]


def test_longrope_short_factors_by_default_up_to_the_original_length(phi3_dir, tmp_path):
    """Phi-3.5 / Phi-4-mini's LongRoPE: by default max_model_len is original_max_position_embeddings,
    where the short factors and the attention factor (sqrt(1 + ln 32 / ln 64) here) equal
    transformers'."""
    d = _with_config(phi3_dir, tmp_path / "longrope", rope_parameters=LONGROPE, rope_scaling=None,
                     original_max_position_embeddings=64, max_position_embeddings=2048)
    engine = LLMEngine(EngineArgs(model=d, dtype="float32"))
    assert engine.config.model_config.max_model_len == 64
    assert not engine.executor.worker.model.config.long_rope
    prompts = [list(range(5, 35)), list(range(100, 112))]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert _generate(engine, prompts, 30) == hf_greedy_generate(hf, prompts, 30)


def test_longrope_long_factors_past_the_original_length(phi3_dir, tmp_path):
    """A max_model_len past original_max_position_embeddings rotates every position with the long
    factors (vLLM's rule: one set for the cache's whole life). Transformers switches to them once a
    sequence passes the original length, so prompts longer than it match exactly, chunked too."""
    d = _with_config(phi3_dir, tmp_path / "longrope", rope_parameters=LONGROPE, rope_scaling=None,
                     original_max_position_embeddings=64, max_position_embeddings=2048)
    engine = LLMEngine(EngineArgs(model=d, dtype="float32", max_model_len=256, max_num_batched_tokens=48,
                                  enable_prefix_caching=False))
    assert engine.config.model_config.max_model_len == 256 and engine.executor.worker.model.config.long_rope
    prompts = [list(range(5, 75)), list(range(100, 190))]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    want = hf_greedy_generate(hf, prompts, 20)
    assert _generate(engine, prompts, 20) == want
    # The short factors (the default engine, max_model_len 64) would give other tokens for the
    # same prompts, had they fit: the two sets differ where it matters.
    short = LLMEngine(EngineArgs(model=d, dtype="float32")).executor.worker.model.model.layers[0].self_attn.rotary_emb
    long = engine.executor.worker.model.model.layers[0].self_attn.rotary_emb
    assert not torch.allclose(short.cos_sin_cache[:64], long.cos_sin_cache[:64])


def test_su_is_longrope_under_its_first_name():
    from tritium.layers.rotary import RotaryEmbedding
    from tritium.models import longrope_original_length
    from tritium.models.decoder_config import DecoderConfig

    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=2048, original_max_position_embeddings=64,
                model_type="phi3")
    factors = dict(short_factor=[1.0, 1.3, 2.1, 3.5, 1.1, 1.2, 1.4, 1.5],
                   long_factor=[1.5, 2.5, 4.0, 8.0, 2.0, 2.0, 2.0, 2.0])
    caches = []
    for kind in ("longrope", "su"):
        config = {**base, "rope_scaling": {"type": kind, **factors}}
        assert longrope_original_length(config) == 64
        a = DecoderConfig.from_hf_config(config)
        caches.append(RotaryEmbedding(a.head_dim, 128, a.rope_theta, a.rope_scaling).cos_sin_cache)
    assert torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], RotaryEmbedding(16, 128, 10000.0, None).cos_sin_cache)
