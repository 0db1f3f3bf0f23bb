#!/usr/bin/env bash
# Attention diagnostics on the GPU: timings of variants, then Nsight Compute sections per case.
# Run from anywhere with $OUT set: bash scripts/gpu_probe_attention.sh (about two minutes).
# --time uses do_bench through the kernel's Python wrapper, so short kernels include its host
# time; the ncu durations are the kernels' own.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
T=$OUT/attention_timings.txt
for args in "fp8_decode" "fp8_decode --sequential" "bf16_decode" "bf16_decode --sequential" \
    "fp8_decode --config block_n=256,num_warps=8,num_stages=2" \
    "fp8_decode --config block_n=256,num_warps=4,num_stages=2" \
    "fp8_decode --config block_n=128,num_warps=8,num_stages=2" \
    "fp8_decode --config block_n=128,num_warps=2,num_stages=2" \
    "fp8_decode --config block_n=64,num_warps=2,num_stages=3" \
    "bf16_prefill" "fp8_prefill"; do
  python3 -m scripts.probes.ncu_attention $args --time 2>&1 | tail -3 | tee -a $T
done
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis"
for c in fp8_decode bf16_decode bf16_prefill fp8_prefill; do
  k=_decode_kernel; [[ $c == *prefill ]] && k=_prefill_kernel
  timeout 150 ncu --clock-control none -k regex:$k --launch-skip 3 --launch-count 1 $SECTIONS \
      python3 -m scripts.probes.ncu_attention $c --iters 5 > $OUT/ncu_$c.txt 2>&1
  echo "ncu $c rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Warp Cycles Per Issued|Issue Slots|Block Limit" $OUT/ncu_$c.txt | head -30
done
