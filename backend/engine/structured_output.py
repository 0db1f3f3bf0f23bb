"""Structured outputs (vLLM's `structured_outputs`, formerly `guided_decoding`): the output
follows a JSON schema, any JSON object, a regular expression, one of given strings, or an EBNF
grammar.

xgrammar (vLLM's default back end) compiles the spec against the vocabulary once per distinct
spec. Each sequence keeps a matcher; before a step samples it, the matcher takes the tokens
sampled since, and fills the bitmask of the tokens that keep the output valid; the sampler masks
the others. Once the grammar is complete only EOS is allowed, so the output ends there."""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..step import GrammarBitmask, SchedulerOutput
from ..structured_output_spec import KINDS, check_spec  # noqa: F401 (check_spec: public here)

if TYPE_CHECKING:  # this module is imported where torch is not (the Triton stub's side)
    import torch

_CACHE_SIZE = 256  # compiled specs kept per process
logger = logging.getLogger(__name__)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed.") from None
    except Exception as e:  # e.g. built for another NumPy than the one installed
        raise ValueError(f"structured_outputs needs the xgrammar package, which failed to import: {e}") from None
    return xgrammar


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+?:\d+: ")  # "[12:52:16] /project/cpp/x.cc:94: "


class StructuredOutputManager:
    """Compiles specs against one tokenizer's vocabulary (thread-safe; compiled specs are
    cached, so a spec sent again, or checked in one process and used in another, costs once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 tokenizer_path: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler = None  # built by warm_up_in_background, or on first use
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._warm_up_thread: threading.Thread | None = None

    def warm_up_in_background(self) -> None:
        """Import xgrammar and read the vocabulary on a thread of its own, now: with a large
        vocabulary that takes seconds (2-3 s on a small CPU), which the first structured request
        would otherwise wait for, holding the GIL that the engine's step loop needs. The thread
        reads its own copy of the tokenizer: one tokenizer used by two threads at once can fail.
        Without xgrammar installed it does nothing (a structured request then gets an error)."""
        if self._tokenizer_path is None:
            return
        # Not a daemon: a process that exits (an engine process shut down right after start)
        # while xgrammar builds its compiler would kill the thread inside C++, which aborts the
        # process ("terminate called without an active exception"); exit waits for it instead.
        self._warm_up_thread = threading.Thread(target=self._warm_up, name="tritium-grammar-warm-up",
                                                daemon=False)
        self._warm_up_thread.start()

    def join_warm_up(self, timeout: float | None = None) -> None:
        """Wait for the warm-up thread, if one runs (an engine that shuts down leaves none behind)."""
        if self._warm_up_thread is not None:
            self._warm_up_thread.join(timeout)

    @property
    def warm(self) -> bool:
        """Whether the vocabulary has been read (compiling a spec is then quick)."""
        return self._compiler is not None

    def _warm_up(self) -> None:
        try:
            import xgrammar  # noqa: F401
        except Exception:
            return  # optional: a structured request says why it cannot be served
        try:
            from .tokenizer import load_tokenizer
            with self._lock:
                if self._compiler is None:
                    self._compiler = self._build_compiler(load_tokenizer(self._tokenizer_path))
        except Exception:  # first use builds it again and reports what fails
            logger.warning("structured outputs: warm-up failed", exc_info=True)

    def compile(self, spec: dict[str, Any]):
        """The compiled grammar of a spec that passed `check_spec`; ValueError when its content
        is invalid (a bad regex, an unsupported schema, an EBNF syntax error)."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._get_compiler()
        kind = next(k for k in KINDS if k in spec)
        value = spec[kind]
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(
                    json.dumps(value), any_whitespace=not spec["disable_any_whitespace"])
            elif kind == "json_object":
                # An object, as vLLM compiles it (the builtin JSON grammar also takes arrays
                # and scalars).
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not spec["disable_any_whitespace"])
            elif kind == "regex":
                compiled = compiler.compile_regex(value)
            elif kind == "choice":
                # EBNF string literals take JSON's escapes.
                compiled = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
            else:
                compiled = compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
            raise ValueError(f"structured_outputs: invalid {kind}: {message}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self):
        if self._compiler is None:
            self._compiler = self._build_compiler(self._tokenizer)
        return self._compiler

    def _build_compiler(self, tokenizer):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size,
                                                  stop_token_ids=list(self._eos_token_ids))
        return xgr.GrammarCompiler(info)


def grammar_bitmask(step: SchedulerOutput, seqs: dict[int, Any], vocab_size: int) -> GrammarBitmask | None:
    """The masks of the step's guided sample rows from their sequences' grammars (`seqs`: the
    step's sequences by id), as they stand (every token before the rows taken): a verification
    run's rows from its first row, one mask after each of its proposals (`Grammar.fill_bitmasks`)."""
    grammars = [seqs[row.seq_id].grammar for row in step.sample_rows]
    guided = [i for i, grammar in enumerate(grammars) if grammar is not None]
    if not guided:
        return None
    import torch

    proposals = {run.first_row: run.proposed for run in step.spec_runs}
    later = {run.first_row + j for run in step.spec_runs for j in range(1, len(run.proposed) + 1)}
    bitmask = torch.empty((len(guided), (vocab_size + 31) // 32), dtype=torch.int32)
    for j, i in enumerate(guided):
        if i not in later:  # a later row of a verification run is filled with its first
            grammars[i].fill_bitmasks(bitmask, j, proposals.get(i, []))
    return GrammarBitmask(guided, bitmask)


class Grammar:
    """One sequence's place in its grammar."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def fresh(self, output_token_ids: list[int]) -> "Grammar":
        """For a sibling sample forked with these output tokens (its parent's, which the same
        grammar has taken already): the same grammar, moved past them."""
        grammar = Grammar(self.compiled)
        for token in output_token_ids:
            grammar.matcher.accept_token(token)
        return grammar

    def accept(self, token: int) -> bool:
        """Take the sequence's next sampled token; False, and the token not taken, when the
        grammar rejects it (only a grammar that allows nothing more lets such a token be
        sampled: the engine ends that request)."""
        return self.matcher.accept_token(token)

    def fill_bitmasks(self, bitmask: "torch.Tensor", first_row: int, proposals: list[int]) -> None:
        """Speculative decoding's verification rows: row first_row + j allows what the grammar
        allows after proposals[:j]; the matcher is left where it was. Past a proposal the
        grammar does not take, rows repeat the mask before it: the row before cannot sample
        that proposal, so their tokens are never kept."""
        taken = 0
        for j in range(len(proposals) + 1):
            if j > taken:  # past a rejected proposal: the mask before it, not asked for again
                bitmask[first_row + j] = bitmask[first_row + j - 1]
                continue
            self.fill_bitmask(bitmask, first_row + j)
            if j < len(proposals) and self.matcher.accept_token(proposals[j]):
                taken += 1
        if taken:
            self.matcher.rollback(taken)

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Row `row` of an int32 bitmask [rows, ceil(vocab / 32)]: bit j of word i allows token
        32 i + j. A grammar that has taken its stop token allows everything: its sequence has
        ended, and a step launched before the engine knew it samples a token nobody takes."""
        if self.matcher.is_terminated():
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

