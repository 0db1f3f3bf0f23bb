"""Build a byte-level BPE tokenizer with exactly a model's vocabulary size, for benchmarks.

The benchmarks run real model shapes with random weights and no model hub, so there is no real
tokenizer. Prompts are token ids, but every generated token is turned into text on the serving
path; with a tokenizer smaller than the model's vocabulary most generated ids would have no text
and that work would be skipped. Here every id below `--vocab-size` decodes to text, as in a real
vocabulary: words of ASCII letters (some with a leading space) grown one letter at a time by BPE
merges, on top of the 256 byte tokens, plus two special tokens at the end. Deterministic.

    python scripts/build_bench_tokenizer.py --vocab-size 128256 --out /tmp/tok-128256
"""
from __future__ import annotations

import argparse
import os
import random
import string

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def build(out_dir: str, vocab_size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS]
    target = vocab_size - len(specials)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    if target < len(alphabet) + 1:
        raise ValueError(f"vocab size must be at least {len(alphabet) + len(specials) + 1}, got {vocab_size}")
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    letters = list(string.ascii_lowercase + string.ascii_uppercase)
    space = "\u0120"  # how ByteLevel writes a space
    stems = letters + [space + c for c in letters]
    for stem in stems[len(letters):]:  # " a" ... as merges of the space byte and a letter
        vocab[stem] = len(vocab)
        merges.append((space, stem[1]))
    rng = random.Random(seed)
    grown = list(stems)
    while len(vocab) < target:
        base = grown[rng.randrange(len(grown))]
        if len(base) >= 12:
            continue
        c = letters[rng.randrange(len(letters))]
        word = base + c
        if word in vocab:
            continue
        vocab[word] = len(vocab)
        merges.append((base, c))
        grown.append(word)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=False)
    if len(fast) != vocab_size:
        raise RuntimeError(f"built {len(fast)} tokens, wanted {vocab_size}")
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tok = build(a.out, a.vocab_size, a.seed)
    print(f"{a.out}: {len(tok)} tokens; e.g. {tok.decode(list(range(1000, 1010)))!r}")


if __name__ == "__main__":
    main()
