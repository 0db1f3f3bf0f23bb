"""`tritium serve MODEL_DIR [engine flags]`: tritonserver serving one model with the `tritium`
backend, and the OpenAI-compatible frontend beside it, stopped together.

Exit status: 0 once both have stopped after Ctrl-C or SIGTERM; 1 when either exits unasked (the
other is then stopped) or cannot be started; 2 for bad arguments, before anything starts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from typing import NoReturn

from tritium.launch.tritonserver import LaunchError, server_command
from . import processes
from .engine_flags import add_engine_flags, check_engine_arguments, engine_arguments, ignored_arguments
from .model_repository import triton_model_name, write_model_repository

PROG = "tritium serve"
_ANY_ADDRESS = ("0.0.0.0", "::", "")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line: the usage of several dozen engine flags would bury the message.
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, allow_abbrev=False, description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                    help="a Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
    ap.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="the names the model is served under (the first names the Triton model, "
                         "with any character Triton does not allow replaced; default: llm)")
    ap.add_argument("--model-repository", metavar="DIR",
                    help="serve this Triton model repository as it is, instead of MODEL_DIR")
    ap.add_argument("--host", default="0.0.0.0", help="the OpenAI frontend's address")
    ap.add_argument("--port", type=int, default=9000, help="the OpenAI frontend's port")
    ap.add_argument("--http-port", type=int, default=8000, help="tritonserver's HTTP port")
    ap.add_argument("--grpc-port", type=int, default=8001, help="tritonserver's gRPC port")
    ap.add_argument("--metrics-port", type=int, default=8002, help="tritonserver's metrics port")
    add_engine_flags(ap)
    return ap


def main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.model_repository:
        if args.model_dir or args.served_model_name or _engine_flags_given(args):
            ap.error("--model-repository serves a repository as it is: it takes no MODEL_DIR, "
                     "--served-model-name or engine flags (its config.pbtxt files hold them)")
        if not os.path.isdir(args.model_repository):
            ap.error(f"--model-repository: no directory {args.model_repository!r}")
        return _serve(args, os.path.abspath(args.model_repository), None)
    if not args.model_dir:
        ap.error("give MODEL_DIR (a Hugging Face model directory) or --model-repository DIR")
    arguments = engine_arguments(args, args.model_dir)
    try:
        check_engine_arguments(arguments)
    except ValueError as e:
        ap.error(str(e))
    names = args.served_model_name or []
    name = triton_model_name(names[0] if names else None)
    repository = tempfile.mkdtemp(prefix="tritium-serve-")
    try:
        write_model_repository(repository, name, {**arguments, **ignored_arguments(args)})
        return _serve(args, repository, name)
    finally:
        shutil.rmtree(repository, ignore_errors=True)


def _engine_flags_given(args: argparse.Namespace) -> bool:
    # Engine flags appear in the namespace only when given (add_engine_flags).
    own = {"model_dir", "served_model_name", "model_repository", "host", "port", "http_port",
           "grpc_port", "metrics_port"}
    return any(key not in own for key in vars(args))


def _serve(args: argparse.Namespace, repository: str, model: str | None) -> int:
    """Run both until a signal or until either exits. `model`: the one model of a repository
    written here (None: a given repository, whose every model must be ready)."""
    def log(line: str) -> None:
        print(f"{PROG}: {line}", flush=True)

    try:
        server = server_command([f"--model-repository={repository}", f"--http-port={args.http_port}",
                                 f"--grpc-port={args.grpc_port}", f"--metrics-port={args.metrics_port}"])
    except LaunchError as e:
        log(f"cannot start tritonserver: {e}")
        return 1
    supervisor = processes.Supervisor(log)
    supervisor.install_signal_handlers()
    triton = f"http://127.0.0.1:{args.http_port}"
    ready = f"{triton}/v2/models/{model}/ready" if model else f"{triton}/v2/health/ready"
    frontend_host = "127.0.0.1" if args.host in _ANY_ADDRESS else args.host
    try:
        supervisor.children.append(processes.start("tritonserver", server.argv, ready, server.env, server.binary))
        frontend = [sys.executable, "-m", "tritium.frontend", "--triton-grpc", f"127.0.0.1:{args.grpc_port}",
                    "--host", args.host, "--port", str(args.port),
                    "--triton-metrics", f"http://127.0.0.1:{args.metrics_port}/metrics"]
        if model:
            frontend += ["--model", model]
            if args.served_model_name and args.served_model_name != [model]:
                frontend += ["--served-model-name", *args.served_model_name]
        supervisor.children.append(processes.start("the OpenAI frontend", frontend,
                                                   f"http://{_url_host(frontend_host)}:{args.port}/health"))
        if supervisor.wait_until_ready():
            _print_urls(args, model, repository)
        dead = supervisor.watch()
    except OSError as e:  # a process that cannot be started
        log(f"cannot start: {e}")
        supervisor.stop()
        return 1
    if dead is not None:
        log(f"{dead.name} exited unasked (status {dead.exited()}): stopping the rest")
        supervisor.stop()
        return 1
    log("stopping tritonserver and the OpenAI frontend")
    supervisor.stop(supervisor.stop_signal or signal.SIGTERM)
    return 0


def _print_urls(args: argparse.Namespace, model: str | None, repository: str) -> None:
    host = "localhost" if args.host in _ANY_ADDRESS else _url_host(args.host)
    served = args.served_model_name[0] if args.served_model_name else model
    what = f"model '{served}' ({args.model_dir})" if model else f"the models of {repository}"
    print(f"{PROG}: serving {what}\n"
          f"  OpenAI API:   http://{host}:{args.port}/v1\n"
          f"  Triton HTTP:  http://localhost:{args.http_port}\n"
          f"  Triton gRPC:  localhost:{args.grpc_port}\n"
          f"  Metrics:      http://localhost:{args.metrics_port}/metrics\n"
          f"Ctrl-C stops both.", flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
