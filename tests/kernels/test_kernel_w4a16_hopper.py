"""w4a16_matmul compiles for sm_90 (the H200) without spilling, within shared memory: the GEMV for
one row, mma.sync for the 16-row tile, wgmma for the 64-row tile and for a 256-row tile with the
operands swapped, the dequantizing kernel for more rows; every tuned config under `long`."""

import pytest
from kernel_checks import ON_GPU, assert_fits_without_spills, compile_for_hopper


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests compile and run it for real")
def test_w4a16_compiles_for_hopper():
    launches = compile_for_hopper("hopper_compile_w4a16.py")
    compiled = {}
    for c in launches:  # a case's matmul kernel; K slices are summed by a second launch after it
        compiled.setdefault(c["case"], c)
    assert {"w4a16 m=1", "w4a16 m=16", "w4a16 m=64", "w4a16 m=256", "w4a16 m=4096",
            "w4a16 m=1 act-order", "w4a16 m=1 fused reduce", "w4a16 m=1 wide tiles", "w4a16 m=4 rows gemv",
            "w4a16 m=4096 fp16", "w4a16 m=256 swapped",
            "w8a16 m=16"} <= set(compiled)
    for c in launches:
        assert_fits_without_spills(c)
    assert any(c["kernel"] == "_sum_slices_kernel" for c in launches), launches
    for case in ("w4a16 m=16", "w8a16 m=16"):
        assert compiled[case]["kernel"] == "_w4a16_kernel" and compiled[case]["mma"], compiled[case]
    assert compiled["w4a16 m=64"]["wgmma"], compiled["w4a16 m=64"]
    # The weight as wgmma's register operand, out^T = W^T x^T.
    assert compiled["w4a16 m=256 swapped"]["kernel"] == "_w4a16_kernel", compiled["w4a16 m=256 swapped"]
    assert compiled["w4a16 m=256 swapped"]["wgmma"], compiled["w4a16 m=256 swapped"]
    # One row: the GEMV on the CUDA cores, whose fields are denormal floats (no flush to zero).
    # Many rows: the weight dequantized for cuBLAS.
    assert compiled["w4a16 m=4 rows gemv"]["kernel"] == "_w4a16_gemv_rows_kernel", compiled["w4a16 m=4 rows gemv"]
    assert not compiled["w4a16 m=4 rows gemv"]["ftz"], compiled["w4a16 m=4 rows gemv"]
    for case in ("w4a16 m=1", "w4a16 m=1 act-order", "w4a16 m=1 fused reduce", "w4a16 m=1 wide tiles"):
        assert compiled[case]["kernel"] == "_w4a16_gemv_kernel" and not compiled[case]["mma"], compiled[case]
        assert not compiled[case]["ftz"], compiled[case]
    for case in ("w4a16 m=256", "w4a16 m=4096", "w4a16 m=4096 fp16"):
        assert compiled[case]["kernel"] == "_w4a16_dequantize_kernel", compiled[case]


@pytest.mark.long
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests run the tuned configs for real")
def test_tuned_w4a16_configs_compile_for_hopper():
    """Every tuned config in kernels/configs/w4a16.json compiles within shared memory, without
    spills; each case's matmul is its config's method."""
    from tritium.kernels.w4a16 import TUNED_CONFIGS, load_tuned_configs
    launches = compile_for_hopper("hopper_compile_w4a16.py", "--tuned")
    for c in launches:
        assert_fits_without_spills(c)
    first = {}
    for c in launches:
        first.setdefault(c["case"], c)
    methods = {"gemv": "_w4a16_gemv_kernel", "mma": "_w4a16_kernel"}
    expected = {f"w4a16 tuned {gpu} {key}": cfg.method
                for gpu, entries in load_tuned_configs(TUNED_CONFIGS).items() for key, cfg in entries.items()}
    assert set(first) == set(expected)
    for case, method in expected.items():
        if method in methods:
            assert first[case]["kernel"] in (methods[method], "_w4a16_gemv_rows_kernel"), first[case]
