"""Build a tiny Llama that has learned one tool-using conversation, so that tool calling can be
tested end to end with a real model served by the real engine: offline, on the CPU, in seconds,
deterministic (fixed seeds). Its tokenizer is trained here; its chat template is Hermes-style
(Qwen2.5's layout: tools in the system turn, calls in <tool_call> tags, results in
<tool_response> tags). Trained only on these replies (greedy decoding repeats them):

- the weather question, with the tools  -> <tool_call>{"name": "get_weather", ...}</tool_call>
- the same after the tool's result      -> <think>...</think> and the final answer
- a greeting, with the tools            -> plain text (no call)

    python scripts/build_tool_model.py [--out models/tiny-tool-llama] [--force]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "corpus.txt")
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "models", "tiny-tool-llama")
STEPS, SEED = 200, 0

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Hermes-style, in the shape of Qwen2.5's template (shortened): what the frontend renders.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call: <tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif message.role != 'system' %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The request's tools as the frontend hands them to the template (its fields in this order).
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
CALL_ARGUMENTS = {"city": "Paris"}
TOOL_CALL = ("<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": CALL_ARGUMENTS})
             + "\n</tool_call>")
TOOL_RESULT = json.dumps({"temperature": 22, "condition": "sunny"})
REASONING = "The tool says 22 and sunny."
ANSWER = "It is sunny and 22 degrees in Paris."
GREETING = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"}]
GREETING_REPLY = "Hello! Ask me about the weather."


def after_call(call_id: str = "call_0") -> list[dict]:
    """The conversation once the assistant has called get_weather and the tool has answered."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


def examples() -> list[tuple[list[dict], str]]:
    """(messages, the assistant's reply) the model learns."""
    return [(QUESTION, TOOL_CALL), (after_call(), f"<think>{REASONING}</think>{ANSWER}"),
            (GREETING, GREETING_REPLY)]


def build_tokenizer(out_dir: str):
    """A byte-level BPE trained on the corpus and the conversations, with Qwen's turn markers
    (special) and the tool and thinking tags (added, not special: they stay in decoded text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=[IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    # The conversations' own pieces, repeated, so that they become few tokens (short prompts
    # train and serve faster).
    pieces = [json.dumps(TOOLS), CHAT_TEMPLATE, TOOL_RESULT] + [m["content"] for m in QUESTION + GREETING]
    texts = [corpus] + (pieces + [reply for _, reply in examples()]) * 8
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=IM_END,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build(out_dir: str, steps: int = STEPS) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    # Built beside its place and renamed: a build cut short leaves no half model there.
    final_dir, out_dir = out_dir, out_dir.rstrip("/") + f".building-{os.getpid()}"
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    tok = build_tokenizer(out_dir)
    rows = []
    for messages, reply in examples():
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        p = tok.encode(prompt, add_special_tokens=False)
        r = tok.encode(reply + IM_END, add_special_tokens=False)
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


def ensure(out_dir: str = DEFAULT_OUT) -> str:
    """The model, built when missing."""
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        build(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.force:
        print(f"{args.out} already exists")
        return 0
    build(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
