"""Run the tritonserver bundled in the nvidia-pytriton wheel with Tritium as its `tritium` backend,
in this Python environment. Every argument is passed to tritonserver unchanged:

    python -m tritium.launch.tritonserver --model-repository=DIR [--http-port=8000 ...]

The process becomes tritonserver (exec), so its pid is the server's. The backend directory it
assembles lives in $TRITIUM_CACHE_DIR (the checkout's scripts/tritonserver: <repo>/.tritonserver),
else $XDG_CACHE_HOME/tritium or ~/.cache/tritium.
"""
from __future__ import annotations

import filecmp
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Callable

CACHE_DIR_ENV = "TRITIUM_CACHE_DIR"
# Tritium's Triton adapter in this installation, next to this package.
MODEL_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving", "model.py")


class LaunchError(RuntimeError):
    """The server cannot be started from this environment (the message says why)."""


@dataclass(frozen=True)
class ServerCommand:
    """What runs tritonserver: its binary, its whole argument list and its environment."""

    binary: str
    argv: list[str]
    env: dict[str, str]


def cache_dir() -> str:
    """Where the backend directory is assembled: writable, outside any installed package."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tritium")


def server_command(args: list[str]) -> ServerCommand:
    """tritonserver with `args`, the backend directory (assembled when missing or stale) and the
    environment its python backend's stub needs. Raises LaunchError."""
    spec = importlib.util.find_spec("pytriton")  # found, not imported: importing it takes long
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("nvidia-pytriton is not installed in this environment (it bundles tritonserver)")
    pytriton = os.path.join(list(spec.submodule_search_locations)[0], "tritonserver")
    version = "%d.%d" % sys.version_info[:2]
    stub = os.path.join(pytriton, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.access(stub, os.X_OK):
        raise LaunchError(f"nvidia-pytriton has no python backend stub for Python {version}")
    backends = assemble_backends(pytriton, stub, version)
    env = dict(os.environ)
    # The copied stub and libtriton_python.so find their libraries (hash-named, so they shadow
    # nothing) through their rpath only next to the wheel's nvidia_pytriton.libs. The stub links
    # libpython3.X.so: it must be this environment's own (a system libpython of another patch
    # release fails on the environment's extension modules, e.g. _ssl).
    libs = [sysconfig.get_config_var("LIBDIR") or "",
            os.path.join(os.path.dirname(os.path.dirname(pytriton)), "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*libs, env.get("LD_LIBRARY_PATH", "")]))
    # The stub runs the interpreter whose bin/ comes first on PATH: this one (a venv's bin/ holds
    # links to the base interpreter, so its own path, not the resolved one). The stub has no
    # locale: make Python's default encoding UTF-8.
    env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(sys.executable)),
                                                env.get("PATH", "")]))
    env["PYTHONUTF8"] = "1"
    # No __pycache__ next to model.py: in poll mode a new file in the model directory means a reload.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    binary = os.path.join(pytriton, "bin", "tritonserver")
    return ServerCommand(binary, [binary, f"--backend-directory={backends}", *cpu_only_flags(args), *args], env)


def cpu_only_flags(args: list[str]) -> list[str]:
    """Without a GPU, the pinned-memory pool (CUDA) and GPU metrics (NVML, DCGM) can only fail, and
    their error lines read as failures to an operator: leave them off unless asked for."""
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"):
        return []
    defaults = {"--pinned-memory-pool-byte-size": "0", "--allow-gpu-metrics": "false"}
    return [f"{flag}={value}" for flag, value in defaults.items()
            if not any(a.startswith(flag + "=") for a in args)]


def assemble_backends(pytriton: str, stub: str, version: str) -> str:
    """A backend directory for this environment: pytriton's backends with the stub for this
    Python next to libtriton_python.so (the python backend looks for it there; the wheel keeps
    one per Python version apart), and Tritium's model.py as the `tritium` backend."""
    # One directory per environment and installation: another one's model.py link would
    # otherwise be replaced under a server that still loads models through it.
    key = hashlib.sha256(f"{sys.prefix}\0{MODEL_PY}".encode()).hexdigest()[:12]
    root = cache_dir()
    backends = os.path.join(root, f"backends-{version}-{key}")
    library = os.path.join(pytriton, "backends", "python", "libtriton_python.so")

    def up_to_date() -> bool:
        return (_same(library, os.path.join(backends, "python", "libtriton_python.so"))
                and _same(stub, os.path.join(backends, "python", "triton_python_backend_stub")))

    if not up_to_date():
        _rebuild(os.path.join(pytriton, "backends"), stub, backends, root, up_to_date)
    _link_model_py(backends)
    return backends


def _same(a: str, b: str) -> bool:
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _rebuild(source: str, stub: str, backends: str, root: str, up_to_date: Callable[[], bool]) -> None:
    # Built whole (the link included) in a temporary directory and renamed into place: several
    # servers may start at the same time, and one must not move aside what another just placed.
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tmp.", dir=root)
    old = f"{backends}.old.{os.getpid()}"
    try:
        staged = os.path.join(tmp, "backends")
        shutil.copytree(source, staged, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, os.path.join(staged, "python"))
        _link_model_py(staged)
        if up_to_date():
            return  # another server's, just placed
        try:
            os.rename(backends, old)
        except OSError:
            pass  # none yet, or another server moved it
        try:
            os.rename(staged, backends)
        except OSError:
            pass  # another server won the race: its directory is as good
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _link_model_py(backends: str) -> None:
    # Tritium as a Python-based backend (as Triton's vLLM backend is installed): a model whose
    # config.pbtxt says backend: "tritium" runs <backends>/tritium/model.py, served by the python
    # backend. A link to the installed file (in a checkout, edits apply at the next load); one
    # installation per directory, so it changes only when the installation moved.
    link = os.path.join(backends, "tritium", "model.py")
    try:
        if os.readlink(link) == MODEL_PY:
            return
    except OSError:
        pass
    os.makedirs(os.path.dirname(link), exist_ok=True)
    staged = f"{link}.{os.getpid()}"
    if os.path.lexists(staged):
        os.remove(staged)
    os.symlink(MODEL_PY, staged)
    os.replace(staged, link)


def main(argv: list[str] | None = None) -> int:
    """Exec tritonserver with `argv` (default: this process's arguments); returns only on error."""
    args = sys.argv[1:] if argv is None else argv
    try:
        command = server_command(args)
    except (LaunchError, OSError) as e:
        print(f"tritium: {e}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.binary, command.argv, command.env)
    return 1  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
