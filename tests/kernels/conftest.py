"""Kernel tests run compiled on CUDA when a GPU is present, else in Triton's interpreter on CPU.

Triton fixes interpreter mode at its first import, so TRITON_INTERPRET is set here, before any
test module runs a kernel. kernels/ imports Triton only on its first kernel call, so other test
directories that import `kernels` (through backend/) earlier in the session do not fix the mode.
On a GPU machine the variable is left alone and the same tests run compiled on device "cuda".
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

