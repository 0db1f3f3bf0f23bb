"""The interpreter that child processes (the engine process, tensor-parallel ranks) run."""
from __future__ import annotations

import os
import shutil
import sys


def python_executable() -> str:
    """This environment's interpreter (inside Triton's stub, sys.executable is not Python)."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    candidate = os.path.join(sys.prefix, "bin", "python3")
    return candidate if os.path.exists(candidate) else (shutil.which("python3") or "python3")
