"""EngineProcess: the engine in a process of its own, behind the drivers' one interface
(`EngineClient`, as StreamingEngine).

A server's threads (receiving requests, sending responses, metrics) and the engine's step loop
share one GIL when they share a process; under load the engine then waits for the GIL while the
GPU waits for the engine. Here the parent only validates and tokenizes requests and hands
outputs to callbacks; the child (`python -m tritium.drivers.process_main FD`) runs the step loop (an EngineCore).
They talk over a socket pair: commands one way, one message of outputs per step the other.
The child exits when told to, and on its own when the parent goes away (the socket closes).
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

from ..config import EngineArgs
from ..engine.input_processor import InputProcessor
from ..engine.output_detokenizer import OutputDetokenizer
from ..engine.request import Request
from ..engine.tokenizer import (IncrementalDetokenizer, detokenize_many, fill_decoded_tokens,
                                import_tokenizer_classes, load_tokenizer)
from ..engine_config import EngineConfig
from ..errors import ENGINE_SHUTTING_DOWN, EngineShutdownError, ErrorKind, ParameterError, RequestError
from ..lora_request import LoRARequest
from ..outputs import CompletionOutput, OutputCallback, RequestOutput
from ..python_env import python_executable
from ..sampling_params import SamplingParams
from .client import EngineClient, deliver_output
from .messages import (Bye, CheckGrammar, Command, GrammarChecked, Outputs, PackedOutput, Ready, Reply, Shutdown,
                       StartupFailed, StatsReply, TokenDelta, TokenRun, error_output, token_completions,
                       unpack_output)

logger = logging.getLogger(__name__)
ENGINE_EXITED = RequestError("The engine process exited unexpectedly; the request did not finish.",
                             ErrorKind.UNAVAILABLE)
# A first spec waits for xgrammar's start-up in the engine's process (seconds on a small CPU).
_GRAMMAR_CHECK_TIMEOUT_S = 60.0


# id -> (request, callback, its OutputDetokenizer or None when the engine makes the text)
_Entry = tuple[Request, OutputCallback, OutputDetokenizer | None]


class EngineProcess(EngineClient[_Entry]):
    """An EngineClient whose engine loop runs in a process of its own."""

    stats_timeout_s = 30.0

    def __init__(self, args: EngineArgs, on_exit: Callable[[], None] | None = None) -> None:
        """on_exit: called (on the receiver thread) when the engine's process dies unasked, after
        its in-flight requests got their error output (a supervisor restarts it)."""
        self._on_exit = on_exit
        parent, child = socket.socketpair()
        self._proc = subprocess.Popen([python_executable(), "-m", "tritium.drivers.process_main", str(child.fileno())],
                                      pass_fds=[child.fileno()])
        child.close()
        self._conn = Connection(parent.detach())
        self._send_lock = threading.Lock()
        # The engine's process takes seconds to start (torch, the model); this side's tokenizer
        # imports transformers meanwhile instead of after it, which shortens every model load.
        preload = threading.Thread(target=import_tokenizer_classes, args=(args.tokenizer or args.model,),
                                   name="tritium-tokenizer-import", daemon=True)
        preload.start()
        self._conn.send(args)
        try:
            reply: Reply = self._conn.recv()
        except EOFError:
            self._proc.wait()
            raise RuntimeError(f"the engine process exited during start-up (code {self._proc.returncode})") from None
        if isinstance(reply, StartupFailed):
            self._proc.wait()
            raise ValueError(reply.message)
        assert isinstance(reply, Ready), reply
        # The engine's configuration as the engine's process resolved it: the model's part
        # comes back with Ready, the rest this side resolves from its own `args`.
        self.config: EngineConfig = args.create_engine_config(reply.model_config)
        self.tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        # The receiver thread's own copy, for output text: a Rust tokenizer borrowed by two
        # threads at once (an encode that releases the GIL, a decode) raises "Already borrowed".
        self._output_tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self._processor = InputProcessor(self.config, self.tokenizer, reply.limits,
                                         check_structured_outputs=self._check_structured_outputs)
        super().__init__(self.config.scheduler_config.max_waiting_requests)
        # Structured-output specs checked by the engine's process: id -> error (None: it compiles)
        self._grammar_checks: dict[int, str | None] = {}
        self._grammar_check_ids = itertools.count()
        self._grammar_checked = threading.Condition(self._lock)
        # Where the receiver thread's time goes (logged by servers at unload): if it cannot keep
        # up, the engine process blocks sending and the engine slows down.
        self.receiver_stats = {"messages": 0, "outputs": 0, "busy_s": 0.0}
        self._receiver = threading.Thread(target=self._receive_loop, name="tritium-engine-rx", daemon=True)
        self._receiver.start()

    # ---- EngineClient: this driver's requests, commands and life ------------------------------------
    def _make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                      lora_request: LoRARequest | str | None, deadline: float | None) -> Request:
        return self._processor.process(request_id, prompt, params, priority=priority,
                                       lora_request=lora_request, deadline=deadline)

    def _entry(self, req: Request, on_output: OutputCallback) -> _Entry:
        return req, on_output, None if req.params.stop else OutputDetokenizer(self._output_tokenizer, req)

    def _check_structured_outputs(self, spec: dict) -> None:
        """Has the engine's process compile the spec (xgrammar needs torch, which this side
        never imports) and raises ValueError with the reason when it does not compile, so that
        the request is refused before it is accepted. The compiled spec stays in that
        process's cache for the request itself."""
        token = next(self._grammar_check_ids)
        self._send(CheckGrammar(token, spec))
        with self._lock:
            self._grammar_checked.wait_for(
                lambda: token in self._grammar_checks or self._stopped, _GRAMMAR_CHECK_TIMEOUT_S)
            if token not in self._grammar_checks:
                if self._stopped:
                    raise EngineShutdownError("The engine is shut down.")
                raise ParameterError(f"structured_outputs: the engine did not check the spec within "
                                     f"{_GRAMMAR_CHECK_TIMEOUT_S:.0f} s.", "structured_outputs")
            error = self._grammar_checks.pop(token)
        if error is not None:
            raise ParameterError(error, "structured_outputs")

    def is_healthy(self) -> bool:
        """Whether the engine still serves: its process lives and it was not shut down."""
        return not self._stopped and self._receiver.is_alive() and self._proc.poll() is None

    def exit_code(self) -> int | None:
        """The engine process's exit status (negative: the signal that ended it); None while it runs."""
        return self._proc.poll()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Every in-flight request gets a final output with an error; the child exits. Bounded:
        a child that does not exit within `timeout` is killed; it is always reaped."""
        with self._lock:
            first = not self._stopped
            self._stopped = True
            self._grammar_checked.notify_all()
        self._stats.wake()
        if first:
            self._send(Shutdown())
        self._receiver.join(timeout)
        try:
            self._proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not exit within %.0f s: killing it", timeout)
            self._proc.kill()
            self._proc.wait()
        if self._receiver.is_alive():  # the socket unblocks it; its requests fail
            self._conn.close()
            self._receiver.join(5.0)
        else:
            self._conn.close()

    def _send(self, message: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the child is gone: the receiver thread fails the requests
            pass

    # ---- the receiver thread ------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            try:
                reply: Reply = self._conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    unasked = not self._stopped
                self._fail_all(ENGINE_EXITED if unasked else ENGINE_SHUTTING_DOWN)
                if unasked and self._on_exit is not None:
                    self._on_exit()
                return
            if isinstance(reply, Outputs):
                start = time.perf_counter()
                self._deliver(reply.outputs)
                stats = self.receiver_stats
                stats["busy_s"] += time.perf_counter() - start
                stats["messages"] += 1
                stats["outputs"] += len(reply.outputs)
            elif isinstance(reply, StatsReply):
                self._stats.put(reply.stats)
            elif isinstance(reply, GrammarChecked):
                with self._lock:
                    self._grammar_checks[reply.token] = reply.error
                    self._grammar_checked.notify_all()
            elif isinstance(reply, Bye):
                self._fail_all(ENGINE_SHUTTING_DOWN)
                return

    def _deliver(self, payload: list) -> None:
        """One message's outputs (one or more engine steps), in order per request, to their
        callbacks. The common outputs' text is made in batches (`detokenize_many`: one Rust
        decode per batch, without the GIL); a request's next output waits for its batch."""
        with self._lock:  # once per message: finished requests leave the table
            self._admission.started(p.request_id for p in payload)
            requests = self._requests
            entries = [requests.pop(p.request_id, None) if type(p) is PackedOutput and p.finished
                       else requests.get(p.request_id) for p in payload]
        batch: list[tuple[IncrementalDetokenizer, list[int]]] = []
        waiting: list[tuple[CompletionOutput, Callable[[RequestOutput], None], RequestOutput]] = []
        in_batch: set[int] = set()  # id() of the OutputDetokenizers with a token in the batch

        def flush() -> None:
            for (c, callback, out), text in zip(waiting, detokenize_many(batch)):
                c.text = text
                deliver_output(callback, out)
            batch.clear()
            waiting.clear()
            in_batch.clear()

        for p, entry in zip(payload, entries):
            if entry is None:
                continue
            req, callback, detok = entry
            kind = type(p)
            if kind is TokenDelta or kind is TokenRun:  # the common output, built at once
                completions = token_completions(p)
                out = RequestOutput(p.request_id, req.prompt, req.prompt_token_ids, completions, False,
                                    num_cached_tokens=p.num_cached_tokens, metrics=req.metrics)
            else:
                o = unpack_output(p)
                completions = o.completions
                out = RequestOutput(o.request_id, req.prompt, req.prompt_token_ids, completions, o.finished,
                                    num_cached_tokens=o.num_cached_tokens, error=o.error, metrics=req.metrics,
                                    prompt_logprobs=o.prompt_logprobs, kv_transfer_params=o.kv_transfer_params)
                if o.prompt_logprobs or any(c.logprobs for c in completions):
                    fill_decoded_tokens(self._output_tokenizer, out.logprob_entries())
            if detok is not None:
                if id(detok) in in_batch:
                    flush()  # this request's previous output first
                det = detok.batchable(completions)
                if det is not None:
                    batch.append((det, completions[0].token_ids))
                    waiting.append((completions[0], callback, out))
                    in_batch.add(id(detok))
                    continue
                detok.fill(completions)
            deliver_output(callback, out)
        flush()

    def _fail_all(self, error: RequestError) -> None:
        with self._lock:
            self._stopped = True
            entries, self._requests = list(self._requests.values()), {}
            self._admission.not_started.clear()
            self._grammar_checked.notify_all()
        self._stats.wake()
        for req, callback, _ in entries:
            deliver_output(callback, error_output(req, error))
