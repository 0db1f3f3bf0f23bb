"""Compile every kernel for sm_90 (H100/H200) on a machine without a GPU and print one JSON line
per kernel: registers, spill bytes, shared memory, which matrix instructions the PTX uses and
whether it flushes denormal floats to zero anywhere.

Run as a script, without TRITON_INTERPRET (compiling needs Triton's compiled mode). It intercepts
the kernel launch inside each wrapper, so the wrappers choose constexprs and launch options
exactly as on the GPU, and compiles with the same argument specialisation Triton would use
there. It leans on Triton internals (binder, _pack_args), so it is a CI aid for the pinned
Triton, not part of the kernels.

By default it compiles what the engine launches on its default configs, one case per path;
`--tuned` compiles every tuned config in kernels/configs/ instead (a long test's work: each is
a separate build). The launches are recorded first, then built on `--jobs` processes, since ptxas and
LLVM use one core each.
"""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from torch.overrides import TorchFunctionMode
from triton.runtime.jit import JITFunction, create_function_from_signature


TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
launches = []


def _record(self, *args, grid, warmup, **kwargs):
    launches.append((self, args, kwargs))


def compile_kernel(fn, args, kwargs):
    """The sm_90 build of one recorded launch (its .asm holds ptx and cubin, .metadata the rest)."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def compile_launch(fn, args, kwargs) -> dict:
    kernel = compile_kernel(fn, args, kwargs)
    info = {"kernel": fn.__name__, "shared": kernel.metadata.shared,
            "wgmma": "wgmma.mma_async" in kernel.asm["ptx"], "mma": "mma.sync" in kernel.asm["ptx"],
            "tma": "cp.async.bulk.tensor" in kernel.asm["ptx"], "ftz": ".ftz" in kernel.asm["ptx"]}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    if m := re.search(r"REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", usage):
        info["registers"], info["stack_bytes"], info["local_bytes"] = (int(v) for v in m.groups())
    return info


def cases():
    """(label, call) pairs at the benchmark's Llama-3-8B shapes (bf16: the serving dtype; the
    float32 variants compile for real when the tests run on a GPU)."""
    from tritium import kernels
    from tritium.kernels.decode_attention import DecodeConfig
    e = torch.empty
    for dtype in (torch.bfloat16,):
        q, cache = e(2, 32, 128, dtype=dtype), e(64, 16, 8, 128, dtype=dtype)
        bt, cl = torch.zeros(2, 32, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        for splits in (1, 4):
            yield (f"decode {dtype} splits={splits}",
                   lambda: kernels.paged_decode_attention.triton(q, cache, cache, bt, cl, 0.1,
                                                          config=DecodeConfig(num_splits=splits)))
        cu = torch.tensor([0, 512], dtype=torch.int32)
        qp = e(512, 32, 128, dtype=dtype)
        yield (f"prefill {dtype}",
               lambda: kernels.paged_prefill_attention.triton(qp, cache, cache, bt[:1], cu, cl[:1], 512, 0.1))
        # The chunk's keys and values from the fused projection output, plain loads and TMA.
        from tritium.kernels.prefill_attention import PrefillConfig
        qkv = e(512, (32 + 2 * 8) * 128, dtype=dtype)
        key, value = qkv[:, 4096:5120].view(512, 8, 128), qkv[:, 5120:].view(512, 8, 128)
        for tma in (False, True):
            yield (f"prefill {dtype} chunk {'tma' if tma else 'direct'}",
                   lambda tma=tma: kernels.paged_prefill_attention.triton(
                       qp, cache, cache, bt[:1], cu, cl[:1], 512, 0.1, key=key, value=value,
                       config=PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                            kv_tma=tma)))
        # A chunk of over 1,024 tokens: the prefix in a launch of its own, then the chunk.
        q2k, cu2k = e(2048, 32, 128, dtype=dtype), torch.tensor([0, 2048], dtype=torch.int32)
        qkv2k = e(2048, (32 + 2 * 8) * 128, dtype=dtype)
        yield (f"prefill {dtype} chunk tma, prefix split",
               lambda: kernels.paged_prefill_attention.triton(
                   q2k, cache, cache, bt[:1], cu2k, cl[:1], 2048, 0.1,
                   key=qkv2k[:, 4096:5120].view(2048, 8, 128), value=qkv2k[:, 5120:].view(2048, 8, 128)))
        # Verification chunks of speculative decoding (k + 1 = 5 rows): GQA heads packed.
        cu5 = torch.tensor([0, 5, 10], dtype=torch.int32)
        yield (f"prefill {dtype} chunk tma, GQA heads packed",
               lambda: kernels.paged_prefill_attention.triton(qp[:10], cache, cache, bt, cu5, cl, 5, 0.1,
                                                       key=key[:10], value=value[:10]))
        # A sliding window with soft-capped scores (Gemma 2's local layers), split decode and
        # the engine's default prefill of a 512-token chunk.
        window = dict(sliding_window=4096, logit_softcap=50.0)
        yield (f"decode {dtype} window softcap splits=4",
               lambda: kernels.paged_decode_attention.triton(q, cache, cache, bt, cl, 0.1,
                                                      config=DecodeConfig(num_splits=4), **window))
        yield (f"prefill {dtype} chunk tma window softcap",
               lambda: kernels.paged_prefill_attention.triton(qp, cache, cache, bt[:1], cu, cl[:1], 512, 0.1,
                                                       key=key, value=value, **window))
    h = e(16, 4096, dtype=torch.bfloat16)
    yield "rms_norm", lambda: kernels.rms_norm.triton(h, h[0], 1e-5, h)
    yield "rms_norm_quant_fp8", lambda: kernels.rms_norm_quant_fp8.triton(h, h[0], 1e-5, h)
    yield "rms_norm of split-K slices", lambda: kernels.rms_norm_quant_fp8.triton(e(3, 16, 4096), h[0], 1e-5, h)
    yield "rotary", lambda: kernels.apply_rotary_emb.triton(e(16, 4096, dtype=torch.bfloat16),
                                                     e(16, 1024, dtype=torch.bfloat16),
                                                     torch.zeros(16, dtype=torch.int64), e(64, 128))
    yield "rotary with head norms", lambda: kernels.apply_rotary_emb.triton(
        e(16, 4096, dtype=torch.bfloat16), e(16, 1024, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64),
        e(64, 128), 128, e(128, dtype=torch.bfloat16), e(128, dtype=torch.bfloat16), 1e-6)
    # Rotary that also stores the keys and values, into a 16-bit and into an FP8 cache.
    qkv = e(16, 6144, dtype=torch.bfloat16)
    for cache_dtype, v_shape in ((torch.bfloat16, (4, 16, 8, 128)), (torch.float8_e4m3fn, (4, 8, 128, 16))):
        yield (f"rotary and kv store {cache_dtype}", lambda cache_dtype=cache_dtype, v_shape=v_shape:
               kernels.apply_rotary_emb.triton(qkv[:, :4096], qkv[:, 4096:5120], torch.zeros(16, dtype=torch.int64),
                                        e(64, 128), 128, value=qkv[:, 5120:],
                                        k_cache=e(4, 16, 8, 128, dtype=cache_dtype),
                                        v_cache=e(*v_shape, dtype=cache_dtype),
                                        slot_mapping=torch.zeros(16, dtype=torch.int64), k_scale=0.5, v_scale=2.0))
    yield "silu_and_mul", lambda: kernels.silu_and_mul.triton(e(16, 2 * 14336, dtype=torch.bfloat16))
    yield "silu_and_mul of split-K slices", lambda: kernels.silu_and_mul.triton(
        e(3, 16, 2 * 14336), e(16, 14336, dtype=torch.bfloat16))
    yield "silu_and_mul_quant_fp8", lambda: kernels.silu_and_mul_quant_fp8.triton(e(16, 2 * 14336, dtype=torch.bfloat16))
    yield "quantize_fp8", lambda: kernels.quantize_fp8_per_token.triton(e(16, 14336, dtype=torch.bfloat16))
    yield "greedy_sample", lambda: kernels.greedy_sample.triton(e(256, 128256, dtype=torch.bfloat16))
    rows, f32 = torch.zeros(8, dtype=torch.int64), e(8)
    yield "apply_penalties", lambda: kernels.apply_penalties.triton(
        e(256, 128256), rows, rows, e(256, 128256, dtype=torch.int16), e(256, 128256, dtype=torch.bool), f32, f32, f32)
    fp8 = torch.float8_e4m3fn
    yield "fp8_matmul", lambda: kernels.fp8_matmul_few_rows.triton(e(1, 4096, dtype=fp8), e(1, 1), e(6144, 4096, dtype=fp8),
                                                            e(1, 6144), torch.bfloat16)
    from tritium.kernels.fp8_matmul import Fp8MatmulConfig
    yield "fp8_matmul swapped", lambda: kernels.fp8_matmul_few_rows.triton(
        e(1, 4096, dtype=fp8), e(1, 1), e(6144, 4096, dtype=fp8), e(1, 6144), torch.bfloat16,
        config=Fp8MatmulConfig(swap_ab=True))
    kv = e(16, 8, 128, dtype=torch.bfloat16)
    yield "store_kv_cache", lambda: kernels.store_kv_cache.triton(kv, kv, e(4, 16, 8, 128, dtype=torch.bfloat16),
                                                           e(4, 16, 8, 128, dtype=torch.bfloat16),
                                                           torch.zeros(16, dtype=torch.int64))
    # kv_cache_dtype=fp8: the store rounds by hand, the attention kernels widen FP8 tiles.
    c8, v8 = e(64, 16, 8, 128, dtype=fp8), e(64, 8, 128, 16, dtype=fp8)  # values transposed per block
    yield "store_kv_cache fp8", lambda: kernels.store_kv_cache.triton(kv, kv, c8, v8, torch.zeros(16, dtype=torch.int64),
                                                               0.5, 2.0)
    q, bt, cl = e(256, 32, 128, dtype=torch.bfloat16), torch.zeros(256, 8, dtype=torch.int32), e(256, dtype=torch.int32)
    yield "decode fp8 cache", lambda: kernels.paged_decode_attention.triton(q, c8, v8, bt, cl, 0.1, k_scale=0.5, v_scale=2.0)
    qp, cu = e(512, 32, 128, dtype=torch.bfloat16), torch.tensor([0, 512], dtype=torch.int32)
    yield "prefill fp8 cache", lambda: kernels.paged_prefill_attention.triton(qp, c8, v8, bt[:1], cu, cl[:1], 512, 0.1,
                                                                       k_scale=0.5, v_scale=2.0)
    # Mixture of experts at Qwen3-30B-A3B's shapes (128 experts, top-8, H 2048, I 768): a decode
    # batch (16-row tiles, mma) and a prefill chunk (64 x 128 tiles, two accumulators, wgmma).
    for rows in (16, 8192):
        yield (f"fused_moe bf16 M={rows}", lambda rows=rows: kernels.fused_moe.triton(
            e(rows, 2048, dtype=torch.bfloat16), e(128, 1536, 2048, dtype=torch.bfloat16),
            e(128, 2048, 768, dtype=torch.bfloat16), e(rows, 8), torch.zeros(rows, 8, dtype=torch.int32)))
    yield "topk_softmax 128 experts", lambda: kernels.topk_softmax.triton(e(64, 128, dtype=torch.bfloat16), 8, True,
                                                                   torch.bfloat16)
    # The decode batch's alignment in one program (here the tensors are on the CPU, so say so).
    yield "moe_align M=16", lambda: kernels.moe_align_block_size(torch.zeros(16, 8, dtype=torch.int32), 128, 16,
                                                                 use_kernel=True)
    cu5 = torch.tensor([0, 5, 10], dtype=torch.int32)
    yield "prefill fp8 cache, GQA heads packed", lambda: kernels.paged_prefill_attention.triton(
        qp[:10], c8, v8, bt[:2], cu5, cl[:2], 5, 0.1, k_scale=0.5, v_scale=2.0)
    # A window over an FP8 cache: every key through the block table, transposed values from lo's run.
    yield "prefill fp8 cache window softcap", lambda: kernels.paged_prefill_attention.triton(
        qp, c8, v8, bt[:1], cu, cl[:1], 512, 0.1, k_scale=0.5, v_scale=2.0, sliding_window=4096,
        logit_softcap=50.0)


def tuned_cases():
    """Every tuned fp8_matmul config, at its own shape."""
    from tritium import kernels
    from tritium.kernels.fp8_matmul import TUNED_CONFIGS, load_tuned_configs
    e, fp8 = torch.empty, torch.float8_e4m3fn
    for gpu, shapes in load_tuned_configs(TUNED_CONFIGS).items():
        for shape, cfg in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            yield (f"fp8_matmul tuned {gpu} {shape}",
                   lambda n=n, k=k, cfg=cfg: kernels.fp8_matmul_few_rows.triton(
                       e(16, k, dtype=fp8), e(16, 1), e(n, k, dtype=fp8), e(1, n), torch.bfloat16, config=cfg))


def _compile_recorded(index: int) -> dict:
    """In a pool worker forked after recording: the build of recorded launch `index`."""
    label, fn, args, kwargs = _recorded[index]
    return {"case": label, **compile_launch(fn, args, kwargs)}


_recorded: list[tuple] = []


_PRODUCTS = (torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm)


class _NoHostProducts(TorchFunctionMode):
    """While launches are recorded, a matrix product a wrapper computes with torch (the
    dequantizing path's cuBLAS product; on this machine a CPU product of hundreds of GFLOP)
    returns an uninitialised result of its shape: only the launches are wanted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            a, b = args[0], args[1]
            return torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype)
        return func(*args, **(kwargs or {}))


def compile_cases(labelled_calls, jobs: int) -> None:
    """Record the launch(es) of each (label, call), then build them all on `jobs` forked
    processes and print one JSON line per launch, in the order they were recorded."""
    JITFunction.run = _record
    with _NoHostProducts():
        for label, call in labelled_calls:
            launches.clear()
            call()
            _recorded.extend((label, *launch) for launch in launches)
    with multiprocessing.get_context("fork").Pool(max(1, jobs)) as pool:
        for info in pool.imap(_compile_recorded, range(len(_recorded))):
            print(json.dumps(info), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tuned", action="store_true", help="every tuned config instead of the default cases")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compile processes")
    return parser.parse_args()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    args = parse_args()
    for module in ("decode_attention", "prefill_attention", "norm", "rotary", "activation", "kv_store",
                   "quant", "sampling", "fp8_matmul", "moe", "moe_router"):
        __import__(f"tritium.kernels.{module}", fromlist=["_"]).check_runnable = lambda op, t: None
    compile_cases(tuned_cases() if args.tuned else cases(), args.jobs)


if __name__ == "__main__":
    main()
