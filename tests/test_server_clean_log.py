"""Issue 24: starting and stopping the server on a CPU machine prints nothing an operator reads
as a failure (no error lines, tracebacks, leak reports or warnings from the engine), and the
engine's process is reaped (no <defunct> child)."""
import os
import re
import signal
import time

from triton_server import TEST_ENGINE_ARGS, http_request, start_server, wait_until, write_model_repository

# Lines that mean trouble, from Triton (E...), Python, nanobind (the Triton compiler's libraries).
_BAD = re.compile(r"^E\d{4} |Traceback|Error|error:|leaked|RuntimeWarning|KeyboardInterrupt|WARNING")
# Known and harmless, and not ours to silence: tritonserver 2.51 logs this on any machine
# without a CUDA driver, whatever its flags.
_ALLOWED = ("CudaDriverHelper has not been initialized",)


def _bad_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if _BAD.search(line) and not any(a in line for a in _ALLOWED)]


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            out.append((int(child), stat[0]))
    return out


def test_start_serve_stop_prints_no_error_lines(tiny_model, tmp_path):
    repo = write_model_repository(str(tmp_path / "repo"), {"model": tiny_model, **TEST_ENGINE_ARGS})
    server = start_server(repo, str(tmp_path / "tritonserver.log"))
    stubs: list[int] = []
    try:
        status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                    {"text_input": "hello", "max_tokens": 4})
        assert status == 200, body
        children = _children(server.proc.pid)
        assert [pid for pid, state in children if state == "Z"] == []  # no <defunct> child
        stubs = [pid for pid, _ in children]
        # the stub's own children: the engine process, never a zombie while it serves
        assert wait_until(lambda: all(state != "Z" for s in stubs for _, state in _children(s)), 5)
    finally:
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C: the whole group in a terminal
        for pid in stubs:
            for child, _ in _children(pid):
                try:
                    os.kill(child, signal.SIGINT)
                except ProcessLookupError:
                    pass
        server.proc.wait(timeout=60)
        server.stop()
    log = server.log_tail(100000)
    assert "tritium: unloaded in" in log
    assert _bad_lines(log) == [], "\n".join(_bad_lines(log))
    print(f"stopped in {time.monotonic() - start:.1f} s")
