"""load_tokenizer builds what AutoTokenizer builds. Where the tokenizer's config names
transformers' generic TokenizersBackend (as tokenizers saved by transformers 5 do) it imports
that class alone, skipping seconds of AutoTokenizer's imports on every model load; the result
must be the same tokenizer, and anything else still goes through AutoTokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

from tritium.engine.tokenizer import GENERIC_TOKENIZER_MODEL_TYPES, _is_generic_fast_tokenizer, load_tokenizer
from tritium.models import MODEL_CLASSES

TEXTS = ["Hello world", " leading space and\nnew lines\t\ttabs", "ünïcödé ✓ 漢字", "<s> literal specials </s>"]


def test_the_generic_model_types_are_the_served_ones_transformers_leaves_to_the_tokenizer_config():
    served = {t for cls in MODEL_CLASSES for t in cls.model_types}
    assert set(GENERIC_TOKENIZER_MODEL_TYPES) == served - MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def test_load_tokenizer_gives_autotokenizer_s_tokenizer(model_dir, tiny_model):
    """The fast path for the tiny default model and the tiny Llama and Qwen3; AutoTokenizer
    itself for Qwen2 and Phi-3, whose tokenizer classes transformers picks by model type."""
    for path in (model_dir, tiny_model):
        with open(f"{path}/config.json", encoding="utf-8") as f:
            model_type = json.load(f)["model_type"]
        assert _is_generic_fast_tokenizer(path) == (model_type in ("llama", "qwen3")), path
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert type(ours) is type(auto)
        assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
        assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
               (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id)
        for text in TEXTS:
            assert ours(text)["input_ids"] == auto(text)["input_ids"]
            ids = auto(text)["input_ids"]
            assert ours.decode(ids) == auto.decode(ids)
        assert ours.chat_template == auto.chat_template


def _copy_with(src: str, dest, tokenizer_config: dict | None = None, model_type: str | None = None) -> str:
    shutil.copytree(src, dest)
    if tokenizer_config is not None:
        path = dest / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    if model_type is not None:
        path = dest / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": model_type}))
    return str(dest)


@pytest.mark.parametrize("change", ["other class", "remote code", "other model type"])
def test_anything_else_goes_through_autotokenizer(tiny_model, tmp_path, change):
    changed = {"other class": dict(tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast"}),
               "remote code": dict(tokenizer_config={"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),
               "other model type": dict(model_type="llava")}[change]
    assert not _is_generic_fast_tokenizer(_copy_with(tiny_model, tmp_path / "tok", **changed))
