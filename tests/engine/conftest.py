"""Tiny random-weight models of real architectures, built once per test session."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.build_default_model import build_model  # noqa: E402
from tiny_moe import MOE_FAMILIES  # noqa: E402

# Llama with GQA (4 query / 2 kv heads), untied embeddings and Llama-3 rope scaling whose
# original context (64) is shorter than our prompts, so the scaled frequencies matter.
LLAMA = dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
# Qwen2 with qkv bias, tied embeddings, 4:1 GQA, sharded checkpoint with an index file.
QWEN2 = dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
             max_shard_size="200KB")


# Qwen3: per-head q/k RMSNorm, head_dim (32) apart from hidden_size / heads (16), tied
# embeddings, no qkv bias.
QWEN3 = dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
             head_dim=32)


# Phi-3: the checkpoint's q/k/v and gate/up already fused, half of each head rotating, 4:1 GQA.
PHI3 = dict(arch="phi3", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny-llama")), seed=1, **LLAMA)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny-qwen2")), seed=2, **QWEN2)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny-qwen3")), seed=3, **QWEN3)


@pytest.fixture(scope="session")
def phi3_dir(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny-phi3")), seed=4, **PHI3)


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3", "phi3"])
def model_dir(request, llama_dir, qwen2_dir, qwen3_dir, phi3_dir) -> str:
    return {"llama": llama_dir, "qwen2": qwen2_dir, "qwen3": qwen3_dir, "phi3": phi3_dir}[request.param]


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: build_model(str(tmp_path_factory.mktemp(f"tiny-{name}")), seed=seed, **spec)
            for name, (spec, seed) in MOE_FAMILIES.items()}


@pytest.fixture(scope="session", params=list(MOE_FAMILIES))
def moe_model_dir(request, moe_dirs) -> str:
    return moe_dirs[request.param]
