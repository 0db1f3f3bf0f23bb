"""ResponseSender: the one thread that sends every Triton response of a model.

Sending from several threads, even with each request owned by one thread, broke the 2.51
python backend: responses went missing, a model sometimes could not unload (a request left
unreleased), and asking is_cancelled() while another thread sent that request's FINAL response
crashed the server. So engine outputs and rejected requests are handed to this thread
(`Handoff`), which builds and sends the responses and, between sends, aborts requests whose
client cancelled or went away. Every request gets exactly one FINAL response.

`pb_utils` (triton_python_backend_utils) is passed in by model.py: nothing here imports it.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ErrorKind, RequestError
from ..outputs import RequestOutput
from .handoff import Handoff
from .output_folding import fold_outputs
from .triton_request import ResponseBuilder

_CANCEL_CHECK_S = 0.02  # how often in-flight requests are checked for cancellation
_UNLOAD_CHECK_S = 0.25  # with requests in flight: how often to check that the model is loaded
_RETIRE_AFTER_S = 5.0  # idle and unloaded this long without finalize: Triton keeps the instance
_REPLACED_GRACE_S = 2.0  # after a reload's new instance initialized, Triton swaps to it
_CANCEL_CHECKS_PER_ROUND = 16  # requests asked is_cancelled() per round of _CANCEL_CHECK_S
# Each error kind's pb_utils.TritonError code (by name: read off pb_utils when sent). The 2.51
# stub has no code for a deadline: a request that ran out of time is UNAVAILABLE, which clients
# retry, as before kinds existed (a client that asks for the error's JSON reads "timeout").
TRITON_CODES = {ErrorKind.INVALID_ARGUMENT: "INVALID_ARG", ErrorKind.UNAVAILABLE: "UNAVAILABLE",
                ErrorKind.TIMEOUT: "UNAVAILABLE", ErrorKind.CANCELLED: "CANCELLED",
                ErrorKind.INTERNAL: "INTERNAL"}
CANCELLED = RequestError("Request was cancelled", ErrorKind.CANCELLED)


@dataclass
class InFlight:
    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    builder: ResponseBuilder
    cancelled: bool = False
    unloading: bool = False  # aborted because the model is being unloaded
    failure: RequestError | None = None  # set when building its responses failed
    error_details: bool = False  # its client asked for errors as JSON (triton_request.ERROR_DETAILS)


@dataclass(frozen=True)
class Rejection:
    """A request refused before it reached the engine: one FINAL error response."""
    sender: Any
    error: RequestError
    error_details: bool


@dataclass(frozen=True)
class Answer:
    """A request answered without the engine (a MODEL_INFO request): one FINAL response."""
    sender: Any
    outputs: dict  # output name -> numpy array


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    output: RequestOutput


class _Stop:
    pass


class ResponseSender:
    def __init__(self, pb_utils: Any, engine: Any, model: tuple[str, str],
                 before_final: Callable[[], None] | None = None, drain_timeout_s: float = 0.0,
                 replaced: Callable[[], bool] | None = None,
                 on_retired: Callable[[], None] | None = None) -> None:
        """engine: EngineProcess or StreamingEngine (abort). model: (name, version), to tell
        when the model is being unloaded. before_final: called (on this thread) before a round
        of sends that ends a request, e.g. to publish metrics, so that a client that reads them
        after its last response sees its request counted. drain_timeout_s: once the model is
        being unloaded, how long running requests may still finish before they are aborted.
        replaced: whether a reload started a newer instance (then this one drains as at an
        unload). on_retired: called once, on this thread, when the model is unloaded or
        replaced and no request is left (backend/serving/retirement.py says why)."""
        self._pb = pb_utils
        self._before_final = before_final
        self._replaced = replaced
        self._replaced_since: float | None = None
        # Only an instance that got requests can be kept by Triton after its unload; and asking
        # is_model_ready() while the model loads crashed a 2.51 stub.
        self._served = False
        self._idle_since: float | None = None  # monotonic time the last request ended
        self._on_retired = on_retired
        self.retired = False
        self._engine = engine
        self._model = model
        self._lock = threading.Lock()
        self._inflight: dict[str, InFlight] = {}
        # Engine outputs (one per token of every stream), rejections, the stop mark; a put is
        # a deque append, not a lock and a notify.
        self._pending = Handoff()
        self._cancel_cursor = 0
        self._stopping = False
        self.closing = False  # the model is unloading (finalize has begun)
        self.drain_timeout_s = drain_timeout_s
        self.draining_since: float | None = None  # monotonic time the unload was noticed
        self._drain_logged = False
        # Where the thread's time goes, logged at unload (rounds of sends; time building and
        # sending; of it, inside pb_utils' send of non-final responses, and publishing metrics
        # before rounds that end a request).
        self.stats = {"rounds": 0, "responses": 0, "busy_s": 0.0, "send_s": 0.0, "flushes": 0, "flush_s": 0.0}
        self._thread = threading.Thread(target=self._loop, name="tritium-sender")
        self._thread.start()

    # ---- from any thread -------------------------------------------------------------------------
    def track(self, state: InFlight) -> None:
        with self._lock:
            self._inflight[state.request_id] = state
            self._served = True

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._inflight.pop(request_id, None)

    def reject(self, sender: Any, error: RequestError, error_details: bool = False) -> None:
        self._pending.put(Rejection(sender, error, error_details))

    def answer(self, sender: Any, outputs: dict) -> None:
        self._pending.put(Answer(sender, outputs))

    def on_output(self, request_id: str, output: RequestOutput) -> None:
        # On the engine's thread: only enqueue. Holding the id, not the response sender, means
        # an engine that keeps a finished request's callback a while never keeps a Triton
        # request (and with it the model, at unload) alive.
        self._pending.put(EngineOutput(request_id, output))

    def stop(self, timeout: float = 30.0) -> list[InFlight]:
        """Send what is queued, stop the thread (waiting at most `timeout`: an unload must end
        whatever a client does); returns the requests that got no FINAL."""
        self._pending.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._pb.Logger.log_error(f"tritium: the sender thread did not stop within {timeout:.0f} s")
        with self._lock:
            leftover, self._inflight = list(self._inflight.values()), {}
        return leftover

    def log_stats(self, receiver_stats: dict | None) -> None:
        """Where this thread's time went (and the engine receiver thread's), for the unload log."""
        st, rx = self.stats, receiver_stats
        self._pb.Logger.log_info(
            f"tritium: sender thread: {st['rounds']} rounds, {st['responses']} streamed responses, "
            f"{st['busy_s']:.2f} s busy, of which {st['send_s']:.2f} s in send() and {st['flush_s']:.2f} s "
            f"publishing metrics before {st['flushes']} rounds with a final response"
            + (f"; engine receiver thread: {rx['messages']} messages, {rx['outputs']} outputs, "
               f"{rx['busy_s']:.2f} s busy" if rx else ""))

    def send_error(self, sender: Any, error: RequestError, error_details: bool = False) -> None:
        """The request's FINAL response: `error` with its kind's Triton code, its message alone
        or (error_details) the error as JSON."""
        pb = self._pb
        code = getattr(pb.TritonError, TRITON_CODES[error.kind])
        message = error.to_json() if error_details else error.message
        sender.send(pb.InferenceResponse(error=pb.TritonError(message, code)),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def fail(self, states: list[InFlight], error: RequestError) -> None:
        """The FINAL response of requests the engine did not finish (at unload): `error`."""
        for state in states:
            try:
                self.send_error(state.sender, error, state.error_details)
            except Exception as e:  # (its client went away)
                self._pb.Logger.log_warn(f"tritium: unload: a final response could not be sent: {e}")

    # ---- the sender thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        next_check = next_unload_check = 0.0
        log_error = self._pb.Logger.log_error
        while True:
            item = self._pending.take(_CANCEL_CHECK_S)
            if item is not None:
                start = time.perf_counter()
                merged_items = self._coalesce(item)
                if self._before_final is not None and any(
                        isinstance(m, EngineOutput) and m.output.finished for m in merged_items):
                    flush_start = time.perf_counter()
                    try:
                        self._before_final()
                    except Exception:
                        log_error(f"tritium: publishing before a final response failed: "
                                  f"{traceback.format_exc()}")
                    self.stats["flushes"] += 1
                    self.stats["flush_s"] += time.perf_counter() - flush_start
                for merged in merged_items:
                    try:
                        self._handle(merged)
                    except Exception:
                        log_error(f"tritium: sending failed: {traceback.format_exc()}")
                self.stats["rounds"] += 1
                self.stats["busy_s"] += time.perf_counter() - start
                if self._stopping:
                    return
            now = time.monotonic()
            if now >= next_check:
                check_unload = now >= next_unload_check
                try:
                    self._abort_cancelled(check_unload)
                    if check_unload and self._served and not self.retired and self._on_retired is not None:
                        self._retire_if_idle()
                except Exception:  # this thread must live on: it sends every response
                    log_error(f"tritium: abort check failed: {traceback.format_exc()}")
                next_check = now + _CANCEL_CHECK_S
                if check_unload:
                    next_unload_check = now + _UNLOAD_CHECK_S

    def _coalesce(self, first: Any) -> list[Rejection | Answer | EngineOutput]:
        """`first` and everything queued behind it, with each request's outputs folded into one
        (in order): a send costs far more than a token, so when this thread falls behind, a
        response carries several tokens instead of the backlog growing. Everything: with a cap
        on the items of a round, a round slower than the cap's worth of steps left a backlog
        that grew from round to round, each sending a response per request for part of it."""
        items = [first] + self._pending.drain()
        outputs, rejected = [], []
        for item in items:
            if isinstance(item, _Stop):
                self._stopping = True
            elif isinstance(item, (Rejection, Answer)):
                rejected.append(item)
            else:
                outputs.append((item.request_id, item.output))
        return rejected + [EngineOutput(rid, out) for rid, out in fold_outputs(outputs)]

    def _handle(self, item: Rejection | Answer | EngineOutput) -> None:
        pb = self._pb
        if isinstance(item, Rejection):
            self.send_error(item.sender, item.error, item.error_details)
            return
        if isinstance(item, Answer):
            item.sender.send(self._response(item.outputs), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        output = item.output
        with self._lock:
            state = self._inflight.get(item.request_id)
        if state is None:
            return
        response = None
        if state.failure is None:
            try:
                response = state.builder.add(output)
            except Exception as e:  # this request fails; the engine and the others carry on
                pb.Logger.log_error(f"tritium: bad engine output: {traceback.format_exc()}")
                state.failure = RequestError(f"internal error: {e}", ErrorKind.INTERNAL)
                self._engine.abort(state.request_id)
        if state.failure is not None:
            if output.finished:
                self.untrack(state.request_id)
                self.send_error(state.sender, state.failure, state.error_details)
            return
        if response is None:
            return
        if not response.final:
            if response.outputs:
                start = time.perf_counter()
                state.sender.send(self._response(response.outputs))
                self.stats["send_s"] += time.perf_counter() - start
                self.stats["responses"] += 1
            return
        self.untrack(state.request_id)
        if state.cancelled:
            self.send_error(state.sender, CANCELLED, state.error_details)
            pb.Logger.log_info(f"[vllm] Successfully cancelled the request (tritium request {state.request_id})")
        elif state.unloading:
            self.send_error(state.sender, unload_error(self.drain_timeout_s), state.error_details)
        elif response.error is not None:
            self.send_error(state.sender, RequestError.of(response.error), state.error_details)
        else:
            state.sender.send(self._response(response.outputs), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, outputs: dict) -> Any:
        pb = self._pb
        return pb.InferenceResponse(output_tensors=[pb.Tensor(name, array) for name, array in outputs.items()])

    def _abort_cancelled(self, check_unload: bool) -> None:
        """Abort the requests whose client cancelled or went away; with check_unload, once the
        model is being unloaded and drain_timeout_s has passed, all of them (Triton finalizes
        the model only after every request has ended: they would delay the unload)."""
        with self._lock:
            states = [s for s in self._inflight.values() if not (s.cancelled or s.unloading)]
            left = len(self._inflight)
        if self.draining_since is not None and not left and not self._drain_logged:
            self._drain_logged = True
            self._pb.Logger.log_info(f"tritium: unload: drained in {time.monotonic() - self.draining_since:.2f} s")
        if not states:
            return
        # Once noticed, an unload is not asked about again (an IPC round trip each time).
        unloading = check_unload and (self.draining_since is not None or self._being_unloaded())
        if unloading:
            now = time.monotonic()
            if self.draining_since is None:
                self.draining_since = now
                self._pb.Logger.log_info(f"tritium: unload: {len(states)} running requests may finish "
                                         f"within drain_timeout_s={self.drain_timeout_s:g} s")
            if now - self.draining_since < self.drain_timeout_s:
                unloading = False  # they run on; cancellations are still honoured
            elif not self._drain_logged:
                self._drain_logged = True
                self._pb.Logger.log_warn(f"tritium: unload: aborting {len(states)} requests still running "
                                         f"after {now - self.draining_since:.2f} s")
        if not unloading:
            # is_cancelled() is an IPC round trip: look at a few requests per round, in turn,
            # so that checking never crowds out sending.
            start = self._cancel_cursor % len(states)
            states = (states[start:] + states[:start])[:_CANCEL_CHECKS_PER_ROUND]
            self._cancel_cursor = start + len(states)
        for state in states:
            if unloading:
                state.unloading = True
                self._engine.abort(state.request_id)  # its final "abort" output ends it
            elif state.sender.is_cancelled():
                # The vLLM backend's log line (tests and operators grep for it), then which one.
                self._pb.Logger.log_info(f"[vllm] Cancelling the request (tritium request {state.request_id})")
                state.cancelled = True
                self._engine.abort(state.request_id)

    def _retire_if_idle(self) -> None:
        """Once no request is left of a model that was unloaded or replaced, and Triton has not
        finalized the instance for _RETIRE_AFTER_S, release the engine and the metrics
        (on_retired): Triton may keep this instance long after (see above). The wait keeps an
        ordinary unload to finalize alone (publishing from this thread while Triton finalizes
        the instance crashed a 2.51 server)."""
        now = time.monotonic()
        with self._lock:
            if self._inflight or self.closing:
                self._idle_since = None
                return  # _abort_cancelled drains them first; finalize has begun
            self._idle_since = self._idle_since or now
        if self.draining_since is None:
            # Idle, only the token is read: is_model_ready() from this thread while the server
            # shuts down crashed a 2.51 stub. An unload is noticed while requests run.
            if not self._replaced_long_enough(now):
                return
            self.draining_since = now
        if now - max(self.draining_since, self._idle_since) < _RETIRE_AFTER_S:
            return
        self.retired = self.closing = True
        self._pb.Logger.log_info("tritium: unload: no request left; stopping the engine now (Triton "
                                 "finalizes this instance once every client stream that reached it "
                                 "has closed)")
        self._on_retired()

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def _replaced_long_enough(self, now: float) -> bool:
        if self._replaced is None or not self._replaced():
            return False
        self._replaced_since = self._replaced_since or now
        return now - self._replaced_since >= _REPLACED_GRACE_S

    def _being_unloaded(self) -> bool:
        """Whether Triton no longer routes requests here (asked only while requests run): the
        version is not ready (an unload), or a newer instance has taken over for some time
        (Triton still routes here a moment after it initialized)."""
        if self._replaced_long_enough(time.monotonic()):
            return True
        name, version = self._model
        try:
            return not self._pb.is_model_ready(model_name=name, model_version=version)
        except Exception:  # cannot tell: keep serving
            return False


def unload_error(drain_timeout_s: float) -> RequestError:
    return RequestError(f"The model is being unloaded. The request did not finish within its "
                        f"drain_timeout_s ({drain_timeout_s:g} s).", ErrorKind.UNAVAILABLE)
