"""Build a tiny Llama that has learned one tool-using conversation, so that tool calling can be
tested end to end with a real model served by the real engine: offline, on the CPU, in seconds,
deterministic (fixed seeds). Its tokenizer is trained here; its chat template is one of
scripts/tool_chat_formats.py's (Hermes-style, or Llama 3.1's JSON calls). Trained only on these
replies (greedy decoding repeats them):

- the weather question, with the tools  -> a call of get_weather for Paris
- the same after the tool's result      -> the final answer (Hermes: after <think>...</think>)
- a greeting, with the tools            -> plain text (no call)

    python -m scripts.build_tool_model [--format hermes|llama3_json] [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from scripts.tool_chat_formats import FORMATS, GREETING, QUESTION, TOOL_RESULT, TOOLS, ChatFormat

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "corpus.txt")
MODELS = os.path.join(os.path.dirname(HERE), "models")
STEPS, SEED = 200, 0


def build_tokenizer(out_dir: str, fmt: ChatFormat):
    """A byte-level BPE trained on the corpus and the conversations, with the format's turn
    markers (special) and its tool and thinking tags (added, not special: they stay in decoded
    text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=list(fmt.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    # The conversations' own pieces, repeated, so that they become few tokens (short prompts
    # train and serve faster).
    pieces = [json.dumps(TOOLS), fmt.template, TOOL_RESULT] + [m["content"] for m in QUESTION + GREETING]
    texts = [corpus] + (pieces + [reply for _, reply in fmt.examples()]) * 8
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fmt.tags])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fmt.eos, pad_token=fmt.eos,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = fmt.template
    fast.save_pretrained(out_dir)
    return fast


def build(out_dir: str, fmt: ChatFormat, steps: int = STEPS) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    # One thread: the model is tiny, and on a busy machine threads that wait for each other
    # made the same build forty times slower.
    torch.set_num_threads(1)
    # Built beside its place and renamed: a build cut short leaves no half model there.
    final_dir, out_dir = out_dir, out_dir.rstrip("/") + f".building-{os.getpid()}"
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    tok = build_tokenizer(out_dir, fmt)
    rows = []
    for messages, reply in fmt.examples():
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        p = tok.encode(prompt, add_special_tokens=False)
        r = tok.encode(reply + fmt.eos, add_special_tokens=False)
        rows.append((p, r))
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), tok.eos_token_id)
    labels = torch.full((len(rows), length), -100)
    for i, (p, r) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p):len(p) + len(r)] = torch.tensor(r)  # the loss is on the replies only
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for step in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    _check_memorized(model, tok, rows)
    model.save_pretrained(out_dir)
    shutil.rmtree(final_dir, ignore_errors=True)
    os.rename(out_dir, final_dir)
    print(f"built {final_dir}: {steps} steps, final loss {loss.item():.4f}, "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return final_dir


def _check_memorized(model, tok, rows) -> None:
    """Greedy decoding must give each reply exactly, with a clear margin at every token (so
    that another engine's arithmetic picks the same tokens)."""
    import torch

    with torch.no_grad():
        for p, r in rows:
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
            top2 = logits.topk(2, dim=-1)
            got = top2.indices[:, 0].tolist()
            if got != r:
                raise RuntimeError(f"the model did not learn {tok.decode(r)!r}: it says {tok.decode(got)!r}")
            margin = (top2.values[:, 0] - top2.values[:, 1]).min().item()
            if margin < 2.0:
                raise RuntimeError(f"the model learned {tok.decode(r)!r} by a margin of only {margin:.2f}")


def ensure(parser: str = "hermes") -> str:
    """The model of that format (models/tiny-tool-llama for hermes), built when missing."""
    fmt = FORMATS[parser]
    out_dir = os.path.join(MODELS, fmt.model_dir)
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        build(out_dir, fmt)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="hermes", choices=sorted(FORMATS))
    parser.add_argument("--out", help="default: models/tiny-tool-llama (hermes), models/tiny-tool-llama3")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    fmt = FORMATS[args.format]
    out = args.out or os.path.join(MODELS, fmt.model_dir)
    if os.path.isfile(os.path.join(out, "config.json")) and not args.force:
        print(f"{out} already exists")
        return 0
    build(out, fmt, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
