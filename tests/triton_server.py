"""Start the real tritonserver (scripts/tritonserver) on free ports, for tests; talk to it."""
from __future__ import annotations

import json
import os
import queue
import threading
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "tiny-llama")
MODEL_PY = os.path.join(ROOT, "backend", "serving", "model.py")
CONFIG_PBTXT = os.path.join(ROOT, "model_repository", "llm", "config.pbtxt")
# A CPU-sized engine for the tiny model: enough KV blocks for 64 concurrent short requests, and a
# max_model_len long enough for requests that run for seconds (the cancellation tests need those).
TEST_ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": "512", "block_size": "16",
                    "max_num_seqs": "64", "max_model_len": "1024"}


def ensure_default_model() -> str:
    """The tiny default model (as `make model` builds it)."""
    if not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_default_model.py"),
                        "--out", DEFAULT_MODEL], check=True)
    return DEFAULT_MODEL


def write_model_repository(dest: str, engine_args: dict[str, str], name: str = "llm",
                           own_model_py: bool = False) -> str:
    """A model repository with the project's llm model and these engine arguments: served by
    the installed `tritium` backend, or (own_model_py) by a copy of model.py in 1/ run by
    the python backend."""
    model_dir = os.path.join(dest, name)
    os.makedirs(os.path.join(model_dir, "1"), exist_ok=True)
    if own_model_py:
        shutil.copy(MODEL_PY, os.path.join(model_dir, "1", "model.py"))
    write_config(model_dir, engine_args, backend="python" if own_model_py else "tritium")
    return dest


def write_config(model_dir: str, engine_args: dict[str, str], backend: str = "tritium") -> None:
    """config.pbtxt of the project's model with its parameters replaced by `engine_args`, but
    for REPORT_CUSTOM_METRICS (the tests read the vllm: metrics) unless `engine_args` sets it."""
    with open(CONFIG_PBTXT, encoding="utf-8") as f:
        text = f.read()
    kept = "" if "REPORT_CUSTOM_METRICS" in engine_args else '(?!"REPORT_CUSTOM_METRICS")'
    text = re.sub(rf"^parameters \{{ key: {kept}.*\}}\n", "", text, flags=re.M)
    text = re.sub(r'^backend: "\w+"', f'backend: "{backend}"', text, flags=re.M)
    def quoted(v: str) -> str:  # a text-format string (JSON values carry quotes)
        return v.replace("\\", "\\\\").replace('"', '\\"')
    text += "".join(f'parameters {{ key: "{k}" value {{ string_value: "{quoted(v)}" }} }}\n'
                    for k, v in engine_args.items())
    # Written next to the repository and renamed: poll mode must see neither half a file nor
    # a temporary one in the model directory (each change it sees is a reload).
    tmp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(model_dir))), "config.pbtxt.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, os.path.join(model_dir, "config.pbtxt"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class TritonServer:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: str

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, lines: int = 200) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def is_ready(self, model: str | None = None) -> bool:
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        try:
            return http_request(self.http_url + path)[0] == 200
        except OSError:
            return False

    def metrics(self) -> str:
        return http_request(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series (summed over series that match the given labels)."""
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total, found = total + float(m.group(3)), True
        if not found:
            raise KeyError(f"no metric {name} {labels}")
        return total

    def stop_in_background(self) -> None:
        """stop() on a thread, for fixtures' teardown: the next test need not wait out Triton's
        shutdown, which polls its models once a second; the session's end waits for every one
        (wait_for_stopping_servers, from conftest)."""
        thread = threading.Thread(target=self.stop, name=f"stop-tritonserver-{self.proc.pid}", daemon=True)
        thread.start()
        _STOPPING.append(thread)

    def stop(self) -> None:
        """SIGTERM (the model is unloaded, finalize runs), then SIGKILL the process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover stubs of this server only
        except ProcessLookupError:
            pass
        self.proc.wait()


_STOPPING: list[threading.Thread] = []


def wait_for_stopping_servers() -> None:
    while _STOPPING:
        _STOPPING.pop().join()


def start_server(model_repository: str, log_path: str, *extra_args: str,
                 wait_for: str | None = "llm", timeout: float = 240.0,
                 cwd: str | None = None) -> TritonServer:
    """Start scripts/tritonserver on free ports (in directory `cwd`); wait until it (and model
    `wait_for`) is ready."""
    http, grpc, metrics = _free_ports(3)
    cmd = [os.path.join(ROOT, "scripts", "tritonserver"), f"--model-repository={model_repository}",
           f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
           "--exit-timeout-secs=10", *extra_args]
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=cwd)
    log.close()
    server = TritonServer(proc, http, grpc, metrics, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if server.is_ready() and (wait_for is None or server.is_ready(wait_for)):
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"tritonserver did not become ready; its log ({log_path}):\n{server.log_tail()}")


def http_request(url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, str]:
    """(status, body) of a GET, or of a POST when `body` is given (JSON-encoded unless bytes)."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8")


def sse_events(text: str) -> list[dict]:
    """The JSON objects of a generate_stream (server-sent events) body."""
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


# ---- the server's processes, read from /proc -------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    session: int
    comm: str
    cmdline: str


def processes() -> list[Proc]:
    """Every live (not zombie) process on the machine."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm", encoding="utf-8") as f:
                comm = f.read().strip()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            found.append(Proc(int(entry), int(fields[1]), int(fields[3]), comm, cmdline))
    return found


def stub_pids(server_pid: int) -> list[int]:
    """The server's python backend stubs (one per loaded model instance, while it lives)."""
    return [p.pid for p in processes() if p.ppid == server_pid and p.comm.startswith("triton_python")]


def engine_pids(server_pid: int, model: str | None = None) -> list[int]:
    """The engine processes in the server's session (it is started in a session of its own); with
    `model`, only the one whose stub (its parent) serves that model."""
    procs = processes()
    by_pid = {p.pid: p for p in procs}
    return [p.pid for p in procs if p.session == server_pid and "tritium.drivers.process_main" in p.cmdline
            and (model is None or model in getattr(by_pid.get(p.ppid), "cmdline", ""))]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    procs, found, frontier = processes(), [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p.pid for p in procs if p.ppid == parent]
        found += children
        frontier += children
    return found


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def grpc_inputs(prompt: str | bytes | None = None, *, sampling: dict | str | None = None,
                input_ids: list[int] | None = None, **flags: bool) -> list:
    """tritonclient gRPC inputs in the vLLM backend's interface."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = []
    if prompt is not None:
        raw = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
        inputs.append(tensor("text_input", np.array([raw], dtype=np.object_), "BYTES"))
    if input_ids is not None:
        inputs.append(tensor("input_ids", np.array(input_ids, dtype=np.int32), "INT32"))
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(tensor("sampling_parameters", np.array([text.encode()], dtype=np.object_), "BYTES"))
    for name, value in flags.items():
        inputs.append(tensor(name, np.array([value], dtype=bool), "BOOL"))
    return inputs


@dataclass
class StreamResult:
    texts: list[str] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, str]] = field(default_factory=list)  # (response index, JSON)
    kv_transfer_params: list[dict] = field(default_factory=list)  # a prefill instance's (disaggregated prefill)
    finals: int = 0
    after_final: int = 0  # responses that came after the FINAL one: must stay 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


class StreamCollector:
    """One gRPC bidirectional stream; collects the responses of each request by request id.
    Error responses carry no request id (2.51), so they are collected apart, in order."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.results: dict[str, StreamResult] = {}
        self.finish_order: list[str] = []  # request ids, in the order their FINAL came
        self.errors: queue.Queue = queue.Queue()
        self._finished: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.client.start_stream(callback=self._callback)

    def send(self, request_id: str, inputs: list, model: str = "llm", **kwargs: Any) -> None:
        """kwargs: more of async_stream_infer's arguments (e.g. timeout, in microseconds)."""
        with self._lock:
            self.results[request_id] = StreamResult()
            self._finished[request_id] = threading.Event()
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       enable_empty_final_response=True, **kwargs)

    def _callback(self, result, error) -> None:
        if error is not None:
            self.errors.put(str(error))
            return
        response = result.get_response()
        with self._lock:
            r = self.results[response.id]
            if r.finals:
                r.after_final += 1
            final = response.parameters["triton_final_response"].bool_param
            if any(o.name == "text_output" for o in response.outputs):
                r.texts.append(result.as_numpy("text_output")[0].decode("utf-8"))
            if any(o.name == "num_output_tokens" for o in response.outputs):
                r.num_output_tokens.append(int(result.as_numpy("num_output_tokens")[0]))
            if any(o.name == "finish_reason" for o in response.outputs):
                r.finish_reasons.append(result.as_numpy("finish_reason")[0].decode())
            if any(o.name == "kv_transfer_params" for o in response.outputs):
                r.kv_transfer_params.append(json.loads(result.as_numpy("kv_transfer_params")[0]))
            if any(o.name == "prompt_logprobs" for o in response.outputs):
                r.prompt_logprobs.append((len(r.texts) - 1, result.as_numpy("prompt_logprobs")[0].decode()))
            if final:
                r.finals += 1
                self.finish_order.append(response.id)
                self._finished[response.id].set()

    def wait(self, request_id: str, timeout: float = 120.0) -> StreamResult:
        if not self._finished[request_id].wait(timeout):
            raise TimeoutError(f"request {request_id} got no FINAL response in {timeout} s")
        return self.results[request_id]

    def next_error(self, timeout: float = 60.0) -> str:
        return self.errors.get(timeout=timeout)

    def close(self, cancel: bool = False, timeout: float = 90.0) -> None:
        """Close the stream; a stream that does not close in `timeout` s fails the test with a
        clear error instead of hanging it (the closing thread is left behind)."""
        closing = threading.Thread(target=self.client.stop_stream, kwargs={"cancel_requests": cancel}, daemon=True)
        closing.start()
        closing.join(timeout)
        if closing.is_alive():
            unfinished = [rid for rid, done in self._finished.items() if not done.is_set()]
            raise TimeoutError(f"the gRPC stream did not close within {timeout:g} s (requests without a FINAL "
                               f"response: {unfinished or 'none'})")
        self.client.close()
