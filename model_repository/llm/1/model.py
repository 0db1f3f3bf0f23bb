"""Triton python-backend adapter for the Tritium engine (decoupled).

execute() parses each request and hands it to the engine, which runs on its own thread; it never
waits for generation and returns None. One sender thread sends every response and, between
sends, aborts requests whose client cancelled or went away. Sending from several threads, even
with each request owned by one thread, broke the 2.51 python backend: responses went missing, a
model sometimes could not unload (a request left unreleased), and asking is_cancelled() while
another thread sent that request's FINAL response crashed the server (docs/performance_notes.md,
row 32). A metrics thread publishes EngineStats as vLLM's metrics. Every request gets exactly one
FINAL response, also when the model is unloaded.
"""
import functools
import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any


def _repo_root() -> str:
    """The Tritium checkout: $TRITIUM_ROOT (scripts/tritonserver sets it), else above this file."""
    if os.environ.get("TRITIUM_ROOT"):
        return os.environ["TRITIUM_ROOT"]
    d = os.path.dirname(os.path.realpath(__file__))
    while d != os.path.dirname(d):
        if os.path.isfile(os.path.join(d, "backend", "serving", "triton_request.py")):
            return d
        d = os.path.dirname(d)
    raise RuntimeError("cannot find the Tritium repository: set TRITIUM_ROOT")


_ROOT = _repo_root()
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import triton_python_backend_utils as pb_utils  # noqa: E402

# The engine (torch, transformers: seconds to import) is imported in initialize(), not here:
# Triton also imports this file in a short-lived stub just to auto-complete the config.

_CANCEL_CHECK_S = 0.02  # how often in-flight requests are checked for cancellation
_UNLOAD_CHECK_S = 0.25  # with requests in flight: how often to check that the model is loaded
_METRICS_INTERVAL_S = 0.2
_CANCEL_CHECKS_PER_ROUND = 16  # requests asked is_cancelled() per round of _CANCEL_CHECK_S
_MAX_DRAIN = 4096  # queue items folded into one round of sends
_STOP = object()


@dataclass
class _InFlight:
    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    builder: Any  # backend.serving.triton_request.ResponseBuilder
    cancelled: bool = False
    unloading: bool = False  # aborted because the model is being unloaded
    failure: str | None = None  # set when building its responses failed


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from backend import EngineProcess
        from backend.serving import triton_metrics, triton_request
        from backend.serving.handoff import Handoff
        from backend.serving.triton_config import engine_args_from_model_config

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the llm model must be decoupled: set "
                                                "model_transaction_policy { decoupled: true }")
        engine_args = engine_args_from_model_config(
            config.get("parameters", {}), _ROOT,
            version_dir=os.path.join(args["model_repository"], args["model_version"]))
        self._labels = {"model": args["model_name"], "version": args["model_version"]}
        self._model = (args["model_name"], args["model_version"])
        self._requests = triton_request
        # The engine runs in a process of its own unless TRITIUM_ENGINE_PROCESS=0: this stub's
        # threads (sending responses above all) would otherwise take GIL time from its steps.
        separate = os.environ.get("TRITIUM_ENGINE_PROCESS", "1") != "0"
        if separate:
            self._engine = EngineProcess(engine_args)
        else:
            from backend import StreamingEngine  # imports torch into this process
            self._engine = StreamingEngine(engine_args)
        self._max_n = self._engine.engine_args.max_num_seqs
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}
        # Work for the sender thread: outputs (one per token of every stream), rejected
        # requests, _STOP; a put is a deque append, not a lock and a notify.
        self._pending = Handoff()
        self._closing = False
        self._stopping = False
        self._cancel_cursor = 0
        from backend import EngineShutdownError
        self._shutdown_error = EngineShutdownError
        # The engine thread must get the GIL back quickly from the sender and metrics threads
        # when a step's results arrive: hand it over every 1 ms instead of every 5 ms.
        sys.setswitchinterval(0.001)
        # Where the sender thread's time goes, logged at unload (rounds of sends; time building
        # and sending; of it, inside pb_utils' send of non-final responses).
        self._send_stats = {"rounds": 0, "responses": 0, "busy_s": 0.0, "send_s": 0.0}
        self._sender_thread = threading.Thread(target=self._send_loop, name="tritium-sender")
        self._sender_thread.start()
        # The lock is per server (its pid) and model version: instances of one server share it.
        lock = f"tritium-metrics-{os.getppid()}-{args['model_name']}-{args['model_version']}"
        self._metrics = triton_metrics.MetricsPublisher(pb_utils, self._labels, lock)
        self._metrics_stop = threading.Event()
        try:  # now, so that the metrics exist when the model reports ready (the loop retries)
            self._metrics.open()
        except pb_utils.TritonModelException:
            pass  # metrics are off: the loop says so and stops
        self._metrics_thread = threading.Thread(target=self._metrics_loop, name="tritium-metrics")
        self._metrics_thread.start()
        pb_utils.Logger.log_info(f"tritium: serving {engine_args.model} as {args['model_name']}")

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in self._requests.INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = self._requests.parse_request(inputs, request.parameters(), max_n=self._max_n)
            # Clients' request ids may be empty or repeat: the engine gets its own.
            state = _InFlight(str(next(self._ids)), sender, self._requests.ResponseBuilder(parsed))
            with self._lock:
                self._inflight[state.request_id] = state
            try:
                self._engine.add_request(state.request_id, parsed.prompt, parsed.sampling_params,
                                         functools.partial(self._on_output, state.request_id),
                                         priority=parsed.priority, lora_request=parsed.lora_name)
            except BaseException:
                with self._lock:
                    self._inflight.pop(state.request_id, None)
                raise
        except ValueError as e:
            self._pending.put((sender, str(e), pb_utils.TritonError.INVALID_ARG))
        except self._shutdown_error as e:  # a request racing the model's unload
            self._pending.put((sender, str(e), pb_utils.TritonError.UNAVAILABLE))
        except Exception as e:  # the server and the other requests carry on
            pb_utils.Logger.log_error(f"tritium: request failed: {traceback.format_exc()}")
            self._pending.put((sender, f"internal error: {e}", pb_utils.TritonError.INTERNAL))

    def _on_output(self, request_id: str, output: Any) -> None:
        # On the engine thread: only enqueue. The callback holds the id, not the response sender,
        # so that the engine, which may keep a finished request's callback alive for a while,
        # never keeps a Triton request alive (and with it the model, at unload).
        self._pending.put((request_id, output))

    def _send_loop(self) -> None:
        next_check = next_unload_check = 0.0
        while True:
            item = self._pending.take(_CANCEL_CHECK_S)
            if item is _STOP:
                return
            if item is not None:
                start = time.perf_counter()
                for merged in self._coalesce(item):
                    try:
                        self._handle(*merged)
                    except Exception:
                        pb_utils.Logger.log_error(f"tritium: sending failed: {traceback.format_exc()}")
                self._send_stats["rounds"] += 1
                self._send_stats["busy_s"] += time.perf_counter() - start
                if self._stopping:
                    return
            now = time.monotonic()
            if now >= next_check:
                check_unload = now >= next_unload_check
                try:
                    self._abort_cancelled(check_unload)
                except Exception:  # this thread must live on: it sends every response
                    pb_utils.Logger.log_error(f"tritium: abort check failed: {traceback.format_exc()}")
                next_check = now + _CANCEL_CHECK_S
                if check_unload:
                    next_unload_check = now + _UNLOAD_CHECK_S

    def _coalesce(self, first: Any) -> list:
        """`first` and everything queued behind it, with each request's outputs folded into one
        (in order): a send costs far more than a token (about 0.1-0.2 ms of IPC), so when this
        thread falls behind, a response carries several tokens instead of the backlog growing."""
        items = [first] + self._pending.drain(_MAX_DRAIN - 1)
        outputs, rejected = [], []
        for item in items:
            if item is _STOP:
                self._stopping = True
            elif len(item) == 3:  # a rejected request: (sender, message, code)
                rejected.append(item)
            else:
                outputs.append(item)
        return rejected + self._requests.fold_outputs(outputs)

    def _handle(self, *item: Any) -> None:
        if len(item) == 3:  # a rejected request: (sender, message, code)
            sender, message, code = item
            _send_error(sender, message, code)
            return
        request_id, output = item
        with self._lock:
            state = self._inflight.get(request_id)
        if state is None:
            return
        response = None
        if state.failure is None:
            try:
                response = state.builder.add(output)
            except Exception as e:  # this request fails; the engine and the others carry on
                pb_utils.Logger.log_error(f"tritium: bad engine output: {traceback.format_exc()}")
                state.failure = f"internal error: {e}"
                self._engine.abort(state.request_id)
        if state.failure is not None:
            if output.finished:
                self._finish(state)
                _send_error(state.sender, state.failure, pb_utils.TritonError.INTERNAL)
            return
        if response is None:
            return
        if not response.final:
            if response.outputs:
                start = time.perf_counter()
                state.sender.send(_response(response.outputs))
                self._send_stats["send_s"] += time.perf_counter() - start
                self._send_stats["responses"] += 1
            return
        self._finish(state)
        if state.cancelled:
            _send_error(state.sender, "Request was cancelled", pb_utils.TritonError.CANCELLED)
        elif state.unloading:
            _send_error(state.sender, "The model is being unloaded.", pb_utils.TritonError.UNAVAILABLE)
        elif response.error is not None:
            code = pb_utils.TritonError.UNAVAILABLE if self._closing else pb_utils.TritonError.INTERNAL
            _send_error(state.sender, response.error, code)
        else:
            state.sender.send(_response(response.outputs),
                              flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _finish(self, state: _InFlight) -> None:
        with self._lock:
            self._inflight.pop(state.request_id, None)

    def _abort_cancelled(self, check_unload: bool) -> None:
        """Abort the requests whose client cancelled or went away; with check_unload, all of
        them when the model is being unloaded (Triton finalizes the model only after every
        request has ended, so in-flight requests would otherwise delay the unload)."""
        with self._lock:
            states = [s for s in self._inflight.values() if not (s.cancelled or s.unloading)]
        if not states:
            return
        unloading = check_unload and self._being_unloaded()
        if not unloading:
            # is_cancelled() is an IPC round trip (about 0.07 ms): look at a few requests per
            # round, in turn, so that checking never crowds out sending.
            start = self._cancel_cursor % len(states)
            states = (states[start:] + states[:start])[:_CANCEL_CHECKS_PER_ROUND]
            self._cancel_cursor = start + len(states)
        for state in states:
            if unloading:
                state.unloading = True
                self._engine.abort(state.request_id)  # its final "abort" output ends it
            elif state.sender.is_cancelled():
                state.cancelled = True
                self._engine.abort(state.request_id)

    def _being_unloaded(self) -> bool:
        name, version = self._model
        try:
            return not pb_utils.is_model_ready(model_name=name, model_version=version)
        except Exception:  # cannot tell: keep serving
            return False

    def _metrics_loop(self) -> None:
        waiting_logged = False
        while not self._metrics_stop.wait(_METRICS_INTERVAL_S):
            try:
                if not self._metrics.open():
                    if not waiting_logged:
                        waiting_logged = True
                        pb_utils.Logger.log_info("tritium: metrics start once the previous "
                                                 "instance of the model has unloaded")
                    continue
                self._metrics.publish(self._engine.get_stats())
            except pb_utils.TritonModelException as e:  # e.g. the server runs with --allow-metrics=false
                pb_utils.Logger.log_warn(f"tritium: no metrics: {e}")
                self._metrics.close()
                return
            except Exception:
                pb_utils.Logger.log_error(f"tritium: metrics failed: {traceback.format_exc()}")

    def finalize(self) -> None:
        pb_utils.Logger.log_info("tritium: unloading")
        self._closing = True
        self._metrics_stop.set()
        self._metrics_thread.join()
        # Each in-flight request gets its final output (with an error) from the engine...
        self._engine.shutdown()
        self._pending.put(_STOP)
        self._sender_thread.join()
        st, rx = self._send_stats, getattr(self._engine, "receiver_stats", None)
        pb_utils.Logger.log_info(
            f"tritium: sender thread: {st['rounds']} rounds, {st['responses']} streamed responses, "
            f"{st['busy_s']:.2f} s busy, of which {st['send_s']:.2f} s in send()"
            + (f"; engine receiver thread: {rx['messages']} messages, {rx['outputs']} outputs, "
               f"{rx['busy_s']:.2f} s busy" if rx else ""))
        # ...and any the engine did not finish gets one here.
        with self._lock:
            leftover, self._inflight = list(self._inflight.values()), {}
        for state in leftover:
            _send_error(state.sender, "the model was unloaded", pb_utils.TritonError.UNAVAILABLE)
        self._metrics.close()
        self._engine = None
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        pb_utils.Logger.log_info("tritium: unloaded")


def _response(outputs: dict) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])


def _send_error(sender: Any, message: str, code: Any) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
