"""cuBLASLt through ctypes, for one thing torch does not expose: choosing the GEMM algorithm
(used by scripts/probe_cublaslt.py; the engine does not use it: row 36 of the notes).

torch's `F.linear` takes cuBLAS's first heuristic choice. cuBLASLt's heuristic returns a ranked
list of algorithms for a shape, and at the engine's shapes the first is not always the fastest
(tile counts that leave the last wave of SMs part idle, split-K choices). `CublasLt` asks for that
list, runs any entry, and so lets a benchmark (or the engine at start-up) time them and keep the
best one per shape. Only bf16 / fp16 `y = x @ w.T` (torch's `F.linear` without bias) is covered.

The library is the one torch already loaded (found in /proc/self/maps), so the versions match.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

_CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_32F = 2, 14, 0
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t, for describing an algorithm in logs
_CONFIG_NAMES = {0: "id", 1: "tile", 2: "splitk", 3: "reduction", 4: "swizzle", 5: "custom",
                 6: "stages", 7: "inner_shape", 8: "cluster_shape"}
_DATA_TYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@dataclass
class Algorithm:
    """One entry of cuBLASLt's heuristic list for a shape."""
    index: int            # rank in the heuristic list (0 is what cuBLASLt would pick)
    algo: _Algo
    workspace_size: int
    waves_count: float
    config: dict[str, int]

    def describe(self) -> str:
        parts = [f"#{self.index}", f"waves={self.waves_count:.2f}"]
        parts += [f"{k}={v}" for k, v in self.config.items()]
        return " ".join(parts)


def _library_path() -> str:
    """The libcublasLt that torch loaded (a CUDA matmul loads it)."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in os.path.basename(path):
                return path
    raise CublasLtError("libcublasLt is not loaded in this process (no CUDA torch?)")


class _Lib:
    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        signatures = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, ctypes.c_uint64,
                                           ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32,
                                               ctypes.POINTER(_HeuristicResult), ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                               ctypes.POINTER(_Algo), vp, sz, vp],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz,
                                                     ctypes.POINTER(sz)],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name, fn)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cuBLAS status {status}")


class _Problem:
    """Descriptors for y[m, n] = x[m, k] @ w[n, k].T, in cuBLASLt's column-major terms:
    y.T (n x m, ld n) = w (k x n col-major, transposed) @ x.T (k x m col-major)."""

    def __init__(self, lib: _Lib, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        self.m, self.n, self.k = m, n, k
        dt = _DATA_TYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                   "cublasLtMatmulDescSetAttribute")
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, rows, cols, ld in ((self.a, k, n, k), (self.b, k, m, k), (self.c, n, m, n)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")


class CublasLt:
    """A cuBLASLt handle with a fixed workspace; `algorithms` lists candidates for a shape and
    `linear` runs one (capturable in CUDA graphs: no allocation, host-side alpha/beta)."""

    def __init__(self, workspace_bytes: int = 32 << 20, device: torch.device | str = "cuda") -> None:
        self.path = _library_path()
        self.lib = _Lib(self.path)
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)),
               "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        _check(self.lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES,
                                                             ctypes.byref(limit), 8),
               "cublasLtMatmulPreferenceSetAttribute")
        self._problems: dict[tuple, _Problem] = {}
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _problem(self, m: int, n: int, k: int, dtype: torch.dtype) -> _Problem:
        key = (m, n, k, dtype)
        if key not in self._problems:
            self._problems[key] = _Problem(self.lib, m, n, k, dtype)
        return self._problems[key]

    def _config(self, algo: _Algo) -> dict[str, int]:
        config = {}
        for attr, name in _CONFIG_NAMES.items():
            size = ctypes.c_size_t()
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0,
                                                             ctypes.byref(size)) or size.value > 8:
                continue
            buf = ctypes.c_uint64(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr,
                                                             ctypes.byref(buf), size.value,
                                                             ctypes.byref(size)) == 0:
                config[name] = int(buf.value)
        return config

    def algorithms(self, m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                   count: int = 32) -> list[Algorithm]:
        """cuBLASLt's heuristic list for y[m, n] = x[m, k] @ w[n, k].T, best guess first."""
        p = self._problem(m, n, k, dtype)
        results = (_HeuristicResult * count)()
        returned = ctypes.c_int(0)
        _check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, p.desc, p.a, p.b, p.c, p.c,
                                                       self.pref, count, results,
                                                       ctypes.byref(returned)),
               "cublasLtMatmulAlgoGetHeuristic")
        out = []
        for i in range(returned.value):
            r = results[i]
            if r.state != 0:
                continue
            algo = _Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(r.algo), ctypes.sizeof(_Algo))
            out.append(Algorithm(i, algo, int(r.workspace_size), float(r.waves_count),
                                 self._config(algo)))
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, algorithm: Algorithm,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ weight.T with the given algorithm, on torch's current stream."""
        m, k = x.shape
        n = weight.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        p = self._problem(m, n, k, x.dtype)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(self.lib.cublasLtMatmul(self.handle, p.desc, ctypes.byref(self._alpha),
                                       ctypes.c_void_p(weight.data_ptr()), p.a,
                                       ctypes.c_void_p(x.data_ptr()), p.b,
                                       ctypes.byref(self._beta),
                                       ctypes.c_void_p(out.data_ptr()), p.c,
                                       ctypes.c_void_p(out.data_ptr()), p.c,
                                       ctypes.byref(algorithm.algo),
                                       ctypes.c_void_p(self.workspace.data_ptr()),
                                       self.workspace.numel(), ctypes.c_void_p(stream)),
               "cublasLtMatmul")
        return out
