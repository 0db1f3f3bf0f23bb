"""The `tritium` Triton backend (decoupled), installed as <backend-directory>/tritium/model.py.

execute() hands each parsed request to the engine (a process of its own) and returns None; one
sender thread sends every response (backend/serving/response_sender.py), a metrics thread
publishes vLLM's metrics. Every request gets exactly one FINAL response, also at unload.
"""
import functools
import gc
import itertools
import json
import os
import sys
import time
import traceback


import triton_python_backend_utils as pb_utils

from tritium.serving.model_config_check import auto_complete, check_model_config

# Where a relative `model` path in config.pbtxt starts: $TRITIUM_ROOT (scripts/tritonserver sets the
# checkout, the container /opt/tritium), else the directory the server was started from.
_ROOT = os.environ.get("TRITIUM_ROOT") or os.getcwd()

# The engine (torch, transformers: seconds to import) is imported in initialize(), not here:
# Triton also imports this file in a short-lived stub just to auto-complete the config.


_FINALIZE_STEP_S = 20.0  # the most each step of an unload waits


def _log(level: str, message: str) -> None:
    getattr(pb_utils.Logger, {"error": "log_error", "warn": "log_warn"}.get(level, "log_info"))(message)


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        # A config.pbtxt may say only `backend` and `instance_group`, as Triton's vLLM backend's sample.
        return auto_complete(auto_complete_model_config)

    def initialize(self, args: dict) -> None:
        from tritium import EngineProcess, errors
        from tritium.serving.engine_supervisor import EngineSupervisor
        from tritium.serving import triton_request
        from tritium.serving.response_sender import InFlight, ResponseSender
        from tritium.serving.retirement import InstanceToken
        from tritium.serving.triton_config import serving_config
        from tritium.serving.triton_metrics import MetricsLoop

        config = json.loads(args["model_config"])
        notes = check_model_config(config)
        from tritium.serving.disagg_router import DisaggregatedRouter, router_targets
        targets = router_targets(config.get("parameters", {}))
        self._router = DisaggregatedRouter(pb_utils, *targets, pb_utils.Logger.log_info) if targets else None
        if self._router is not None:  # disaggregated prefill's entry point: no engine of its own
            return
        # config.pbtxt parameters and 1/model.json (Triton's vLLM backend's engine arguments)
        serving = serving_config(config.get("parameters", {}), _ROOT,
                                 version_dir=os.path.join(args["model_repository"], args["model_version"]))
        health = ["tritium: ENABLE_VLLM_HEALTH_CHECK: the engine is checked before each batch of requests"]
        for note in notes + serving.notes + (health if serving.health_check else []):
            pb_utils.Logger.log_info(note)
        if serving.gpu_device_ids is not None:  # the engine's process inherits it
            os.environ["CUDA_VISIBLE_DEVICES"] = serving.gpu_device_ids
        engine_args, self._health_check, self._healthy = serving.engine_args, serving.health_check, True
        self._loras = list(engine_args.lora_modules or ()) if engine_args.enable_lora else None
        self._requests, self._in_flight, self._errors = triton_request, InFlight, errors
        # The engine runs in a process of its own unless TRITIUM_ENGINE_PROCESS=0: this stub's
        # threads (sending responses above all) would otherwise take GIL time from its steps.
        # A supervisor restarts it when it dies, unless ENABLE_VLLM_HEALTH_CHECK asks for the
        # vLLM backend's answer (unload the model).
        if os.environ.get("TRITIUM_ENGINE_PROCESS", "1") != "0":
            self._engine = EngineSupervisor(lambda on_exit: EngineProcess(engine_args, on_exit=on_exit),
                                            _log, max_restarts=0 if serving.health_check else 5)
        else:
            from tritium import StreamingEngine  # imports torch into this process
            self._engine = StreamingEngine(engine_args)
        self._ids = itertools.count()
        # The answer to a MODEL_INFO request (the OpenAI frontend's /v1/models and /tokenize).
        self._model_info = triton_request.model_info_outputs(engine_args, self._engine.config.model_config)
        # The engine thread must get the GIL back quickly from the sender and metrics threads
        # when a step's results arrive: hand it over every 1 ms instead of every 5 ms.
        sys.setswitchinterval(0.001)
        name, version = args["model_name"], args["model_version"]
        self._name = name
        # The lock is per server (its pid) and model version: instances of one server share it.
        self._metrics = MetricsLoop(pb_utils, {"model": name, "version": version}, f"tritium-metrics-{os.getppid()}-"
                                    f"{name}-{version}", self._engine.get_stats, self._engine.pushed_stats
                                    ) if serving.report_metrics else None
        self._token, self._released = InstanceToken(os.getppid(), args["model_instance_name"]), False
        # Metrics are current when a request's final response leaves (the sender publishes first).
        self._sender = ResponseSender(pb_utils, self._engine, (name, version),
                                      before_final=self._metrics.flush if self._metrics else None,
                                      drain_timeout_s=serving.drain_timeout_s,
                                      replaced=self._token.replaced, on_retired=self._release)
        self._token.claim()  # last, once this instance can serve: one it replaces then drains
        pb_utils.Logger.log_info(f"tritium: serving {engine_args.model} as {name}")

    def execute(self, requests: list) -> None:
        if self._router is not None:
            return self._router.execute(requests)
        if self._sender.draining:  # the model is being unloaded: no new work
            error = self._errors.unavailable("The model is being unloaded.")
            for request in requests:
                self._sender.reject(request.get_response_sender(), error, self._details(request))
            return None
        if self._health_check and not self._engine.is_healthy():
            self._unhealthy(requests)
            return None
        for request in requests:
            self._submit(request)
        return None

    def _details(self, request) -> bool:
        """Whether the request asks for its errors as JSON (triton_request.ERROR_DETAILS)."""
        return self._requests.error_details_asked(request.parameters())

    def _submit(self, request) -> None:
        sender, details = request.get_response_sender(), False
        try:
            details = self._details(request)
            if self._requests.model_info_asked(request.parameters()):  # a description, no generation
                self._sender.answer(sender, self._model_info)
                return
            # Every input the request carries: one that is declared but not Tritium's is refused.
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            parsed = self._requests.parse_request(inputs, request.parameters())
            self._requests.check_lora(parsed.lora_name, self._loras, pb_utils.Logger.log_info)
            # Clients' request ids may be empty or repeat: the engine gets its own.
            state = self._in_flight(str(next(self._ids)), sender, self._requests.ResponseBuilder(parsed),
                                    error_details=details)
            self._sender.track(state)
            try:
                self._engine.add_request(state.request_id, parsed.prompt, parsed.sampling_params,
                                         functools.partial(self._sender.on_output, state.request_id),
                                         priority=parsed.priority, lora_request=parsed.lora_name,
                                         deadline=self._requests.deadline(
                                             request.timeout() if hasattr(request, "timeout") else 0))
            except BaseException:
                self._sender.untrack(state.request_id)
                raise
        except Exception as e:  # refused with its kind; the server and the other requests carry on
            error = self._errors.request_error(e)
            if error.kind is self._errors.ErrorKind.INTERNAL:
                pb_utils.Logger.log_error(f"tritium: request failed: {traceback.format_exc()}")
            self._sender.reject(sender, error, details)

    def _unhealthy(self, requests: list) -> None:
        """ENABLE_VLLM_HEALTH_CHECK, as the vLLM backend: refuse, and have the model unloaded."""
        from tritium.serving.health import refuse_unhealthy
        refuse_unhealthy(pb_utils, self._name, self._healthy, self._sender, self._errors, requests, self._details)
        self._healthy = False

    def _release(self) -> None:
        """Stop the metrics and the engine, once: when the sender finds the model retired, or at finalize."""
        if self._released:
            return
        self._released = True
        if self._metrics is not None:
            self._metrics.stop()
        self._engine.shutdown(timeout=_FINALIZE_STEP_S)

    def finalize(self) -> None:
        # Triton calls this once every request has ended (the sender drained them). Every step
        # below is bounded, so that an unload ends whatever the clients do.
        if self._router is not None:
            return self._router.finalize(_FINALIZE_STEP_S)
        start = time.monotonic()
        pb_utils.Logger.log_info("tritium: unloading")
        self._sender.closing = True
        self._release()  # each in-flight request gets its final output (with an error)...
        leftover = self._sender.stop(timeout=_FINALIZE_STEP_S)
        self._token.release()
        self._sender.log_stats(getattr(self._engine, "receiver_stats", None))
        # ...and any the engine did not finish gets one here.
        self._sender.fail(leftover, self._errors.unavailable("the model was unloaded"))
        self._engine = None
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        since = self._sender.draining_since
        pb_utils.Logger.log_info(f"tritium: unloaded in {time.monotonic() - start:.2f} s"
                                 + (f"; the unload began {start - since:.2f} s before (the drain, then waiting "
                                    f"for clients' streams to close)" if since else ""))
