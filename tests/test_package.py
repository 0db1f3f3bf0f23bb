"""The product as a user installs it: a wheel built from this checkout, installed into a fresh
virtualenv outside it, whose `tritium serve` serves the tiny model (OpenAI chat, Triton gRPC
streaming, `tritium bench`) and stops with everything it started on SIGTERM; bad arguments exit 2
before anything starts.

The fresh virtualenv sees the dependencies already installed in this checkout's environment
(a path line in a .pth file), but not the checkout itself: that environment's editable install
is itself a .pth file, which a path line does not process, and the wheel is installed over its
metadata (--ignore-installed). Nothing runs with TRITIUM_ROOT or PYTHONPATH, or from the checkout.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass

import psutil
import pytest

from frontend_server import chat_model
from triton_server import (ROOT, TEST_ENGINE_ARGS, StreamCollector, _free_ports, grpc_inputs, processes,
                           wait_until)

# What the wheel is built from: the design's folders and the files pyproject.toml reads.
SOURCES = ("backend", "kernels", "frontend", "client", os.path.join("benchmarks", "loadgen"),
           "pyproject.toml", "setup.py", "requirements.txt", "requirements-test.txt",
           "requirements-nixl.txt", "README.md")
READY_TIMEOUT_S = 240.0


@dataclass
class Installed:
    venv: str
    env: dict[str, str]
    workdir: str  # outside the checkout: every command runs here

    def tritium(self, *args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([os.path.join(self.venv, "bin", "tritium"), *args], cwd=self.workdir,
                                env=self.env, stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = str(tmp_path_factory.mktemp("package"))
    # Built from a copy, so that the build leaves nothing (build/, *.egg-info) in the checkout.
    src = os.path.join(tmp, "src")
    for name in SOURCES:
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(src, name),
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(os.path.join(ROOT, name), os.path.join(src, name))
    wheels = os.path.join(tmp, "wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", wheels, src], cwd=tmp, check=True, timeout=300)
    (wheel,) = glob.glob(os.path.join(wheels, "tritium-*.whl"))
    _check_wheel(wheel)

    venv = os.path.join(tmp, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    site = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    with open(os.path.join(site, "checkout-dependencies.pth"), "w", encoding="utf-8") as f:
        f.write("".join(f"{path}\n" for path in deps))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITIUM_ROOT", "TRITIUM_CACHE_DIR", "TRITIUM_VENV", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin")] + [
        p for p in env.get("PATH", "").split(os.pathsep) if p and not os.path.abspath(p).startswith(ROOT)])
    env["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")  # the backend directory, in this test's own
    workdir = os.path.join(tmp, "work")
    os.makedirs(workdir)
    python = os.path.join(venv, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                    wheel], cwd=workdir, env=env, check=True, timeout=300)
    where = subprocess.run([python, "-c", "import tritium, tritium.bench, tritium.cli, tritium.kernels; "
                            "print(tritium.__file__)"], cwd=workdir, env=env, check=True,
                           capture_output=True, text=True, timeout=60).stdout.strip()
    assert where == os.path.join(site, "tritium", "__init__.py"), where
    return Installed(venv, env, workdir)


def _check_wheel(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert re.search(r"^tritium = tritium\.cli:main$", z.read(entry_points).decode(), flags=re.M)
    configs = {f"tritium/kernels/configs/{os.path.basename(p)}"
               for p in glob.glob(os.path.join(ROOT, "kernels", "configs", "*.json"))}
    assert configs and configs <= names, configs - names
    for module in ("serving/model.py", "launch/tritonserver.py", "cli/__init__.py", "bench/bench.py",
                   "frontend/__main__.py", "client/__init__.py"):
        assert f"tritium/{module}" in names, module
    assert not any(n.startswith(("backend/", "benchmarks/", "tests/")) for n in names)


@pytest.fixture(scope="module")
def served(installed, tiny_model, tmp_path_factory):
    """`tritium serve` on the tiny chat model, started, not waited for: the checks of bad
    arguments run while it loads. (process, ports, log path)"""
    model = chat_model(tiny_model, str(tmp_path_factory.mktemp("model")))
    ports = _free_ports(4)
    flags = {**TEST_ENGINE_ARGS, "host": "127.0.0.1",
             **dict(zip(("port", "http_port", "grpc_port", "metrics_port"), map(str, ports)))}
    log_path = os.path.join(installed.workdir, "serve.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = installed.tritium("serve", model, *(a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", v)),
                                 stdout=log, stderr=subprocess.STDOUT)
    yield proc, ports, log_path
    if proc.poll() is None:  # a failed test: leave nothing running
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for child in started:
            child.kill()
        proc.wait()


def test_bad_arguments_exit_2_before_anything_starts(installed, served, tmp_path):
    env = {**installed.env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cases = {("serve", str(tmp_path / "no-such-model")): "model: directory",
             ("serve", os.path.join(ROOT, "models", "tiny-llama"), "--speculative-config", "{'method'"):
                 "argument --speculative-config: not valid JSON",
             ("serve", "--max-model-len", "12x"): "argument --max-model-len: invalid int value"}
    runs = {args: installed.tritium(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in cases}
    for args, expected in cases.items():
        out, err = runs[args].communicate(timeout=60)
        assert runs[args].returncode == 2, (args, out, err)
        assert err.startswith("tritium serve: error: ") and expected in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "cache")  # no backend directory: no server was started


def test_serve_writes_the_engine_arguments_the_backend_reads(tiny_model, tmp_path):
    """The flags (vLLM's names, JSON for dicts) become config.pbtxt parameters that Triton parses
    and the backend turns into the same engine arguments (MODEL_DIR made absolute); a served name
    with a '/' names a Triton model without one."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from tritium.cli.engine_flags import engine_arguments, ignored_arguments
    from tritium.cli.model_repository import triton_model_name, write_model_repository
    from tritium.cli.serve import parser
    from tritium.serving.triton_config import serving_config

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    args = parser().parse_args([os.path.relpath(tiny_model), "--max-model-len", "256", "--no-enable-prefix-caching",
                                "--speculative-config", spec, "-tp", "1", "--dtype", "float32",
                                "--served-model-name", "org/tiny", "--trust-remote-code"])
    name = triton_model_name(args.served_model_name[0])
    assert name == "org_tiny"
    write_model_repository(str(tmp_path), name, {**engine_arguments(args, args.model_dir), **ignored_arguments(args)})
    with open(tmp_path / name / "config.pbtxt", encoding="utf-8") as f:
        config = json_format.MessageToDict(text_format.Parse(f.read(), model_config_pb2.ModelConfig()),
                                           preserving_proto_field_name=True)
    assert config["backend"] == "tritium"
    serving = serving_config(config["parameters"], root="/nonexistent")
    engine = serving.engine_args
    assert any("trust_remote_code" in note for note in serving.notes), serving.notes  # vLLM's, ignored
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching, engine.dtype) == (
        tiny_model, 256, False, "float32")
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def _wait_for_urls(proc: subprocess.Popen, log_path: str) -> dict[str, str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if "Ctrl-C stops both" in text:
            return dict(re.findall(r"^  ([A-Za-z ]+):\s+(\S+)$", text, flags=re.M))
        time.sleep(0.2)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        pytest.fail(f"tritium serve did not print its URLs (exit status {proc.poll()}):\n{f.read()[-6000:]}")


def test_tritium_serve_from_the_wheel(installed, served):
    from openai import OpenAI

    proc, (port, http_port, grpc_port, metrics_port), log_path = served
    urls = _wait_for_urls(proc, log_path)
    assert urls == {"OpenAI API": f"http://127.0.0.1:{port}/v1", "Triton HTTP": f"http://localhost:{http_port}",
                    "Triton gRPC": f"localhost:{grpc_port}", "Metrics": f"http://localhost:{metrics_port}/metrics"}
    tree = {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)}
    commands = {pid: p.cmdline() for pid, p in tree.items()}
    # tritonserver and the frontend, the model's stub and the engine process: the engine's and the
    # frontend's interpreter is the fresh environment's.
    assert any(os.path.basename(c[0]) == "tritonserver" for c in commands.values()), commands
    assert any(c[0].startswith(installed.venv) and c[1:3] == ["-m", "tritium.frontend"] for c in commands.values())
    assert any(c[0].startswith(installed.venv) and "tritium.drivers.process_main" in c for c in commands.values())
    (link,) = glob.glob(os.path.join(installed.env["XDG_CACHE_HOME"], "tritium", "backends-*", "tritium", "model.py"))
    assert os.readlink(link).startswith(installed.venv), os.readlink(link)

    # `tritium bench` (the load generator) runs beside the other clients.
    bench = installed.tritium("bench", "--url", f"127.0.0.1:{grpc_port}", "--num-requests", "2", "--input-len", "8",
                              "--output-len", "3", "--procs", "1", "--warmup", "0", "--no-progress",
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chat = OpenAI(api_key="none", base_url=urls["OpenAI API"]).chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0, chat

    stream = StreamCollector(f"127.0.0.1:{grpc_port}")
    try:
        stream.send("r1", grpc_inputs("Hello", sampling={"max_tokens": 8, "temperature": 0, "ignore_eos": True},
                                      stream=True))
        result = stream.wait("r1", timeout=60)
    finally:
        stream.close()
    # Streamed: several responses (a token that ends inside a UTF-8 character waits for the next),
    # then exactly one final one.
    assert len(result.texts) > 1 and result.text and result.finals == 1 and result.after_final == 0, result
    bench_out = bench.communicate(timeout=120)[0]
    assert bench.returncode == 0 and "triton-grpc workload custom" in bench_out, bench_out

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    alive = lambda: {p.pid for p in processes()} & set(tree)  # noqa: E731 - zombies do not count
    assert wait_until(lambda: not alive(), timeout=10), {pid: commands[pid] for pid in alive()}
    with open(log_path, encoding="utf-8", errors="replace") as f:
        assert "tritium: unloaded" in f.read()  # the model was unloaded, not killed
