"""The benchmark's model shapes (models/configs) build in the engine with exactly Hugging Face's
parameter count: a wrong head_dim, a missed q/k norm or an untied LM head would change it."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tritium.models import get_model_class

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "models", "configs")
NAMES = sorted(d for d in os.listdir(CONFIGS) if os.path.isfile(os.path.join(CONFIGS, d, "config.json")))


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once


@pytest.mark.parametrize("name", NAMES)
def test_engine_model_has_hf_parameter_count(name):
    path = os.path.join(CONFIGS, name)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with torch.device("meta"):
        ours = get_model_class(config)(config, torch.bfloat16)
        theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert _count(ours) == _count(theirs)


def test_all_ten_shapes_are_there():
    assert NAMES == ["gemma-2-9b", "llama-3-8b", "llama-3.1-8b", "mistral-7b-v0.1", "mixtral-8x7b", "phi-3-mini-4k",
                     "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-30b-a3b", "qwen3-8b"]


@pytest.mark.parametrize("name,total", [("qwen3-30b-a3b", 30_532_122_624), ("mixtral-8x7b", 46_702_792_704),
                                        ("gemma-2-9b", 9_241_705_984), ("mistral-7b-v0.1", 7_241_732_096)])
def test_models_have_their_published_size(name, total):
    """Qwen3-30B-A3B's 30.5B and Mixtral-8x7B's 46.7B parameters (experts stacked), Gemma-2-9B's
    9.24B (its config.json leaves the embeddings tied by default), Mistral-7B-v0.1's 7.24B."""
    with open(os.path.join(CONFIGS, name, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with torch.device("meta"):
        assert _count(get_model_class(config)(config, torch.bfloat16)) == total


def test_phi3_mini_has_its_published_size():
    with open(os.path.join(CONFIGS, "phi-3-mini-4k", "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with torch.device("meta"):
        assert _count(get_model_class(config)(config, torch.bfloat16)) == 3_821_079_552
