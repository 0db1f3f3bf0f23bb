"""The kernels compile for sm_90 (the H200) without spilling, within shared memory, and on tensor
cores where they should. The interpreter cannot see compile errors, so CI compiles for real: the
engine's default configs here, every tuned config under `long` (each is a build of its own)."""

import pytest
from kernel_checks import ON_GPU, assert_fits_without_spills, compile_for_hopper


@pytest.fixture(scope="module")
def compiled():
    return compile_for_hopper("hopper_compile.py")


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile and run every kernel for real")
def test_kernels_compile_for_hopper(compiled):
    labels = {c["case"] for c in compiled}
    assert {"decode torch.bfloat16 splits=4", "prefill torch.bfloat16", "rms_norm", "rotary",
            "silu_and_mul", "store_kv_cache", "quantize_fp8", "greedy_sample", "apply_penalties", "fp8_matmul",
            "rotary and kv store torch.bfloat16", "rotary and kv store torch.float8_e4m3fn"} <= labels
    split = [c for c in compiled if c["case"] == "prefill torch.bfloat16 chunk tma, prefix split"]
    for c in compiled:
        # The long-chunk default (128-query tiles on 4 warps, the fastest on an H100 under the
        # GPU machine's Triton) spills a few bytes under the Triton CI pins; more is a regression.
        assert_fits_without_spills(c, stack_limit=128 if c in split else 0)
    # The prefix's launch through the block table, then the chunk's through TMA.
    assert len(split) == 2 and all(c["wgmma"] for c in split) and not split[0]["tma"] and split[1]["tma"], split
    by_kernel = {(c["case"], c["kernel"]): c for c in compiled}
    assert by_kernel[("decode torch.bfloat16 splits=1", "_decode_kernel")]["mma"]
    assert by_kernel[("decode torch.bfloat16 splits=4", "_merge_kernel")]
    assert by_kernel[("prefill torch.bfloat16", "_prefill_kernel")]["wgmma"]
    # The chunk's keys and values through TMA boxes (cp.async.bulk.tensor), or plain loads.
    tma = by_kernel[("prefill torch.bfloat16 chunk tma", "_prefill_kernel")]
    direct = by_kernel[("prefill torch.bfloat16 chunk direct", "_prefill_kernel")]
    assert tma["wgmma"] and tma["tma"] and direct["wgmma"] and not direct["tma"], (tma, direct)
    assert not by_kernel[("prefill torch.bfloat16", "_prefill_kernel")]["tma"]
    assert by_kernel[("decode fp8 cache", "_decode_kernel")]["mma"]
    assert by_kernel[("prefill fp8 cache", "_prefill_kernel")]["wgmma"]
    # Verification chunks with GQA heads packed: 32-row tiles, on tensor cores (mma), TMA boxes
    # for a 16-bit cache's chunk.
    packed = by_kernel[("prefill torch.bfloat16 chunk tma, GQA heads packed", "_prefill_kernel")]
    assert packed["mma"] and packed["tma"], packed
    assert by_kernel[("prefill fp8 cache, GQA heads packed", "_prefill_kernel")]["mma"]
    # A sliding window with soft-capped scores: the same tensor-core paths, without spills.
    windowed = [by_kernel[("decode torch.bfloat16 window softcap splits=4", "_decode_kernel")],
                by_kernel[("decode torch.bfloat16 window softcap splits=4", "_merge_kernel")],
                by_kernel[("prefill torch.bfloat16 chunk tma window softcap", "_prefill_kernel")],
                by_kernel[("prefill fp8 cache window softcap", "_prefill_kernel")]]
    for c in windowed:
        assert_fits_without_spills(c)
    assert windowed[0]["mma"] and windowed[2]["wgmma"] and windowed[2]["tma"] and windowed[3]["wgmma"], windowed
    assert by_kernel[("store_kv_cache fp8", "_store_kv_kernel")]
    assert by_kernel[("fused_moe bf16 M=16", "_gate_up_kernel")]["mma"]
    assert ("moe_align M=16", "_align_kernel") in by_kernel  # decode's one-launch alignment
    assert ("topk_softmax 128 experts", "_topk_softmax_kernel") in by_kernel
    assert by_kernel[("fused_moe bf16 M=8192", "_gate_up_kernel")]["wgmma"]
    assert by_kernel[("fused_moe bf16 M=8192", "_down_kernel")]["wgmma"]
    fp8 = by_kernel[("fp8_matmul", "_fp8_matmul_kernel")]
    assert fp8["mma"] or fp8["wgmma"], fp8  # FP8 tensor cores, not a scalar loop
    # Swapped, both FP8 tiles go from shared memory into an FP8 wgmma (no widening to 16 bits).
    assert by_kernel[("fp8_matmul swapped", "_fp8_matmul_kernel")]["wgmma"]


@pytest.mark.long
@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel tests run the tuned configs for real")
def test_tuned_fp8_matmul_configs_compile_for_hopper():
    """Every tuned config in kernels/configs/fp8_matmul.json compiles within shared memory,
    without spills, on tensor cores."""
    tuned = [c for c in compile_for_hopper("hopper_compile.py", "--tuned") if c["kernel"] == "_fp8_matmul_kernel"]
    assert len(tuned) >= 6 and all(c["mma"] or c["wgmma"] for c in tuned), tuned
    for c in tuned:
        assert_fits_without_spills(c)
