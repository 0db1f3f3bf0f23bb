"""CompileWatch against Triton's real JIT hooks: installed on Triton's knobs, it counts and
logs each compile with the variant's description and its time. (Whether start-up leaves
anything to compile is tested on the GPU: test_gpu_engine.py.)"""
from __future__ import annotations

import logging

import pytest

from tritium.worker.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def restore_hooks():
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_compiles_are_counted_timed_and_logged(restore_hooks, caplog):
    watch = CompileWatch()
    assert watch.install() and watch.installed
    variant = "_merge_kernel[num_warps=4, num_ctas=1, num_stages=3](num_splits: i32D16)"
    # Triton calls the hooks with keyword arguments only (runtime/jit.py `_call_hook`).
    with caplog.at_level(logging.WARNING, logger="tritium.worker.compile_watch"):
        assert knobs.runtime.jit_cache_hook(key=("k",), repr=variant, fn=None, compile={},
                                            is_manual_warmup=False, already_compiled=False) is False
        knobs.runtime.jit_post_compile_hook(key=("k",), repr=variant, fn=None, compile={},
                                            is_manual_warmup=False, already_compiled=False)
    assert watch.compiles == 1 and 0 <= watch.seconds < 1
    assert [r.getMessage() for r in caplog.records] == [
        "Triton is compiling a kernel variant while serving (the step waits for it; start-up did "
        f"not cover it): {variant}",
        f"Triton compiled _merge_kernel in {watch.seconds * 1000:.0f} ms"]


def test_remove_hooks_unhooks_every_watch(restore_hooks):
    CompileWatch().install()
    CompileWatch.remove_hooks()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
