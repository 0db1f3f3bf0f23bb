"""Tokenizer loading, incremental detokenization and stop-string handling."""
from __future__ import annotations

import json
import logging
import os
import weakref

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Prompt tokens decoded together with the first generated ones, so that tokenizers which drop a
# leading space at the start of a decode (SentencePiece) keep it for the first generated token.
_PROMPT_CONTEXT_TOKENS = 5


# config.json model types (of those this engine serves) whose tokenizer AutoTokenizer takes from
# tokenizer_config.json's tokenizer_class; for qwen2 and phi3 it builds a class of its own
# whatever that says (tests/engine/test_tokenizer_loading.py checks the list against transformers).
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
                                 "gemma3_text")


def _is_generic_fast_tokenizer(path: str) -> bool:
    """Whether AutoTokenizer would build transformers' generic TokenizersBackend from `path`: its
    tokenizer_config.json names that class, with no remote code, and any config.json there has a
    model type above. Importing that class alone skips seconds of AutoTokenizer's imports."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
        model_type = None
        if os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (isinstance(tokenizer_config, dict) and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config and os.path.isfile(os.path.join(path, "tokenizer.json"))
            and (model_type is None or model_type in GENERIC_TOKENIZER_MODEL_TYPES))


def import_tokenizer_classes(path: str | None = None) -> None:
    """Imports what load_tokenizer(path) needs (seconds of transformers' import), so that a
    caller can do it on a thread while it waits for something else; the import lock makes a
    later load_tokenizer wait for it to finish."""
    try:
        if path is not None and _is_generic_fast_tokenizer(path):
            from transformers import TokenizersBackend  # noqa: F401
        else:
            from transformers import AutoTokenizer  # noqa: F401
    except ImportError:
        try:
            from transformers import PreTrainedTokenizerFast  # noqa: F401
        except ImportError:
            pass  # load_tokenizer reports it, with the path it was loading


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer: directory {path!r} does not exist.")
    try:
        if _is_generic_fast_tokenizer(path):
            # What AutoTokenizer would build, without importing AutoTokenizer's module (which
            # imports transformers' model and generation code).
            from transformers import TokenizersBackend
            return TokenizersBackend.from_pretrained(path, local_files_only=True)
        try:
            from transformers import AutoTokenizer
        except ImportError:
            # AutoTokenizer drags in transformers' generation code and, through it, scikit-learn
            # and SciPy; where those are built for another NumPy (the GPU image's SciPy wants
            # NumPy 2, the Triton stub needs NumPy 1) that import fails. tokenizer.json alone
            # describes a fast tokenizer completely.
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise
            logger.warning("transformers.AutoTokenizer cannot be imported here; loading %s/tokenizer.json "
                           "as a PreTrainedTokenizerFast", path)
            from transformers import PreTrainedTokenizerFast
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
            tokenizer.chat_template = tokenizer.chat_template or _chat_template(path)
            return tokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types; the user needs the path and cause
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r}: {exc}") from exc


def _chat_template(path: str) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        return template if isinstance(template, str) else None
    return None


_TOKEN_CLASSES: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, frozenset[int]]]" = \
    weakref.WeakKeyDictionary()


def _token_classes(tokenizer: PreTrainedTokenizerBase) -> tuple[int, frozenset[int]]:
    """(vocabulary size with added tokens, special token ids), computed once per tokenizer."""
    found = _TOKEN_CLASSES.get(tokenizer)
    if found is None:
        found = _TOKEN_CLASSES[tokenizer] = (len(tokenizer), frozenset(tokenizer.all_special_ids))
    return found


def fill_decoded_tokens(tokenizer: PreTrainedTokenizerBase, entries) -> None:
    """Set `decoded_token` of every Logprob in `entries` (dicts of token id -> Logprob, or None)
    to its token's own text, as vLLM does: the token string made readable
    (`convert_tokens_to_string` of the one token). Ids the tokenizer does not know keep None."""
    todo = [(tid, lp) for entry in entries if entry for tid, lp in entry.items() if lp.decoded_token is None]
    if not todo:
        return
    size, _ = _token_classes(tokenizer)
    known = [(tid, lp) for tid, lp in todo if 0 <= tid < size]
    pieces = tokenizer.convert_ids_to_tokens([tid for tid, _ in known])
    for (_, lp), piece in zip(known, pieces):
        if piece is not None:
            lp.decoded_token = tokenizer.convert_tokens_to_string([piece])


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    Each call returns the new text since the previous call. Text is held back while the decoded
    window ends in an incomplete UTF-8 sequence (U+FFFD), so a multi-byte character split
    across tokens is emitted whole, once its last byte arrives; the pieces concatenate to the
    decode of all generated tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # Fast tokenizers: call the Rust decoder directly (a third of the cost of the Python
        # wrapper, which adds nothing here since we never clean up spaces).
        self._rust = getattr(tokenizer, "_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # A window of token ids: decoding it whole keeps spaces and multi-byte characters that a
        # decode of the newest token alone would lose. Tokens before _read_offset are emitted.
        self._vocab_size, special_ids = _token_classes(tokenizer)
        self._skipped_ids = special_ids if skip_special_tokens else frozenset()
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)  # cached decode of the emitted part

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._rust is not None:
            return self._rust.decode(ids, self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        if self._shows_nothing(token_id):
            return ""
        self._ids.append(token_id)
        text = self._emit(self._decode(self._ids))
        if text:
            self._prefix_text = self._decode(self._ids)
        return text

    def _shows_nothing(self, token_id: int) -> bool:
        """An id beyond the tokenizer's vocabulary (as when a model's vocabulary is larger) or a
        skipped special token shows nothing in any context. In the window it would only make
        every later decode longer, quadratically over a long run of such tokens."""
        return token_id >= self._vocab_size or token_id in self._skipped_ids

    def _emit(self, new_text: str) -> str:
        """The decode of the window (its newest token appended) -> the text beyond what was
        emitted, or "" while nothing printable came (a partial character, a token with no
        text). When there is text, the window slides: the next decode starts at the tokens just
        emitted, and the caller sets `_prefix_text` to the decode of the new window."""
        prefix_len = len(self._prefix_text)
        if len(new_text) <= prefix_len or new_text[-1] == "\ufffd":
            return ""
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        return new_text[prefix_len:]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), as the full decode has it."""
        new_text = self._decode(self._ids)
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        self._ids = []
        self._prefix_text = ""
        self._read_offset = 0
        return delta


def detokenize_many(items: list[tuple[IncrementalDetokenizer, list[int]]]) -> list[str]:
    """The text of each detokenizer's new tokens (`add_token` of each in turn, the pieces
    joined; several tokens are decoded at once, so a piece may come a call later than
    add_token would give it), with every window decoded in one call of the Rust tokenizer per
    kind of detokenizer: `decode_batch` runs without the GIL, so the thread making text for
    many streams at once (the Triton stub's receiver) leaves the interpreter to the thread
    sending responses meanwhile. A detokenizer may appear only once."""
    texts = [""] * len(items)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (det, tokens) in enumerate(items):
        shown = [t for t in tokens if not det._shows_nothing(t)]
        if not shown:
            continue
        if det._rust is None:  # a slow tokenizer: one by one
            texts[i] = "".join([det.add_token(t) for t in shown])
            continue
        det._ids.extend(shown)
        groups.setdefault((id(det._rust), det.skip_special_tokens), []).append(i)
    for indices in groups.values():
        first = items[indices[0]][0]
        rust, skip = first._rust, first.skip_special_tokens
        windows = [items[i][0]._ids for i in indices]
        slid = []
        for i, new_text in zip(indices, rust.decode_batch(windows, skip)):
            det = items[i][0]
            texts[i] = det._emit(new_text)
            if texts[i]:
                slid.append(det)
        if slid:
            for det, prefix in zip(slid, rust.decode_batch([d._ids for d in slid], skip)):
                det._prefix_text = prefix
    return texts


def find_stop_string(text: str, new_chars: int, stop: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last `new_chars` characters of `text`."""
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def partial_stop_suffix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: text
    that must not be streamed yet, because the next token may complete the stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
