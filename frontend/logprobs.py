"""The vLLM backend's logprobs (per token: {token_id: {"logprob", "rank", "decoded_token"}},
holding the sampled token and the top k) -> OpenAI's chat and completions shapes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Entry = dict[str, dict[str, Any]]


def sampled_key(entry: Entry, k: int, text: str) -> str:
    """The sampled token's id in an entry. The engine adds the sampled token after the top k, so
    an entry of k + 1 tokens ends with it; when it is among the top k, the interface does not say
    which one it is: the one whose text comes next in the output is taken (greedy: rank 1)."""
    keys = list(entry)
    if len(keys) > k:
        return keys[-1]
    matches = [t for t in keys if entry[t]["decoded_token"] and text.startswith(entry[t]["decoded_token"])]
    pool = matches or keys
    return min(pool, key=lambda t: entry[t]["rank"] or 0)


def _top(entry: Entry, k: int) -> list[tuple[str, dict[str, Any]]]:
    ranked = sorted(((t, v) for t, v in entry.items() if v["rank"] is not None and v["rank"] <= k),
                    key=lambda tv: tv[1]["rank"])
    return ranked[:k]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _token(tid: str, value: dict[str, Any], as_ids: bool) -> str:
    """A token as logprobs show it: its text, or vLLM's return_tokens_as_token_ids form (for
    tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{tid}" if as_ids else value["decoded_token"] or ""


def chat_logprobs(entries: list[Entry], k: int, text: str, as_ids: bool = False) -> list[dict[str, Any]]:
    """choices[].logprobs.content for the tokens of `text` (the text these entries produced).
    As vLLM: with `as_ids`, a sampled token's bytes stay its text's, the top tokens' are those
    of their "token_id:N" strings."""
    content, cursor = [], 0
    for entry in entries:
        tid = sampled_key(entry, k, text[cursor:])
        text_of_token = entry[tid]["decoded_token"] or ""
        cursor += len(text_of_token)
        top = []
        for t, v in _top(entry, k):
            token = _token(t, v, as_ids)
            top.append({"token": token, "logprob": v["logprob"], "bytes": _bytes(token)})
        content.append({"token": _token(tid, entry[tid], as_ids), "logprob": entry[tid]["logprob"],
                        "bytes": _bytes(text_of_token), "top_logprobs": top})
    return content


@dataclass
class CompletionLogprobs:
    """choices[].logprobs of a completion, built up as tokens arrive."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # where the next token starts in the choice's text
    # vLLM's return_tokens_as_token_ids: tokens are "token_id:N", and, as in vLLM, text_offset
    # counts the lengths of those strings.
    as_ids: bool = False

    def add_prompt(self, prompt_ids: list[int], token_texts: list[str],
                   entries: list[Entry | None], k: int) -> None:
        """The echoed prompt: its tokens (known by id), the first one without a logprob."""
        for tid, token, entry in zip(prompt_ids, token_texts, entries):
            own = None if entry is None else entry.get(str(tid))
            self._add(f"token_id:{tid}" if self.as_ids else token, None if own is None else own["logprob"],
                      None if entry is None else self._top_dict(entry, k))

    def add_output(self, entries: list[Entry], k: int, text: str) -> None:
        cursor = 0
        for entry in entries:
            tid = sampled_key(entry, k, text[cursor:])
            cursor += len(entry[tid]["decoded_token"] or "")
            self._add(_token(tid, entry[tid], self.as_ids), entry[tid]["logprob"], self._top_dict(entry, k))

    def _top_dict(self, entry: Entry, k: int) -> dict[str, float]:
        return {_token(t, v, self.as_ids): v["logprob"] for t, v in _top(entry, k)}

    def _add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        """The OpenAI object, from token `start` on (a stream sends each chunk's tokens)."""
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}
