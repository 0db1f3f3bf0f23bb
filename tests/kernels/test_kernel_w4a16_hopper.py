"""w4a16_matmul compiles for sm_90 (the H200) without spilling, within shared memory: the GEMV for
one row, mma.sync for the 16-row tile, wgmma for the 64-row tile, the dequantizing kernel for
more rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_checks import ON_GPU

HERE = Path(__file__).resolve().parent
H100_MAX_SHARED = 232448


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests compile and run it for real")
def test_w4a16_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "hopper_compile_w4a16.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [c for c in map(json.loads, done.stdout.splitlines()) if c]
    compiled = {}
    for c in launches:  # a case's matmul kernel; K slices are summed by a second launch after it
        compiled.setdefault(c["case"], c)
    assert {"w4a16 m=1", "w4a16 m=16", "w4a16 m=64", "w4a16 m=256", "w4a16 m=4096",
            "w4a16 m=1 act-order", "w4a16 m=1 fused reduce", "w4a16 m=1 wide tiles", "w4a16 m=4 rows gemv",
            "w4a16 m=4096 fp16",
            "w8a16 m=16"} <= set(compiled)
    for c in launches:
        assert c["shared"] <= H100_MAX_SHARED and c["local_bytes"] == 0 and c["stack_bytes"] == 0, c
    assert any(c["kernel"] == "_sum_slices_kernel" for c in launches), launches
    for case in ("w4a16 m=16", "w8a16 m=16"):
        assert compiled[case]["kernel"] == "_w4a16_kernel" and compiled[case]["mma"], compiled[case]
    assert compiled["w4a16 m=64"]["wgmma"], compiled["w4a16 m=64"]
    # One row: the GEMV on the CUDA cores, whose fields are denormal floats (no flush to zero).
    # Many rows: the weight dequantized for cuBLAS.
    assert compiled["w4a16 m=4 rows gemv"]["kernel"] == "_w4a16_gemv_rows_kernel", compiled["w4a16 m=4 rows gemv"]
    assert not compiled["w4a16 m=4 rows gemv"]["ftz"], compiled["w4a16 m=4 rows gemv"]
    for case in ("w4a16 m=1", "w4a16 m=1 act-order", "w4a16 m=1 fused reduce", "w4a16 m=1 wide tiles"):
        assert compiled[case]["kernel"] == "_w4a16_gemv_kernel" and not compiled[case]["mma"], compiled[case]
        assert not compiled[case]["ftz"], compiled[case]
    for case in ("w4a16 m=256", "w4a16 m=4096", "w4a16 m=4096 fp16"):
        assert compiled[case]["kernel"] == "_w4a16_dequantize_kernel", compiled[case]
