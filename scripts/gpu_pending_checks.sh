#!/usr/bin/env bash
# One device call for what the CPU machine could not measure at the session of 2026-12-01:
#  1. the GPU tests of the FP8 path (the dispatch test, tests/engine/test_fp8.py, has never run);
#  2. FP8 workload B with the tuned matmul table (kernels/configs/fp8_matmul.json);
#  3. Qwen2.5-1.5B through Triton and in-process, with the receiver's batched text (d3d221f) and
#     the engine process's busy-time log (e77c013);
#  4. optionally (SWEEP=1) a fresh FP8 matmul sweep that rewrites the table for this GPU.
# Run from the repo root with $OUT set, carrying gpu_bundle and models/tiny-llama:
#   COMMIT=<sha> bash scripts/gpu_pending_checks.sh
# Arguments go to every gpu_run.sh call; with LLAMA/QWEN naming other models it rehearses on the
# CPU machine, e.g. LLAMA=models/tiny-llama QWEN=models/tiny-llama IMAGE_PYTHON=.venv/bin/python
#   TRITIUM_BUNDLE=/tmp/bundle311 OUT=/tmp/pending bash scripts/gpu_pending_checks.sh --device cpu
#   --dtype float32 --num-requests 16 --input-len 64 --output-len 16
# Leaves at most 8 files in $OUT: summary.txt (the lines that matter), the results.json of each
# gpu_run.sh call, and the sweep's outputs.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:?set OUT}" COMMIT="${COMMIT:-unknown}" PY="${IMAGE_PYTHON:-python3}"
LLAMA="${LLAMA:-llama-3-8b}" QWEN="${QWEN:-qwen2.5-1.5b}" EXTRA=("$@")
mkdir -p "$OUT"
t0=$(date +%s); S="$OUT/summary.txt"
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$S"; }
logs() {  # the engine process's and the stub's own accounts of a gpu_run.sh call
    local d; d=$(mktemp -d); tar -C "$d" -xzf "$1/logs.tar.gz" 2>/dev/null
    grep -rh -E "engine process:|sender thread" "$d" >> "$S"; rm -rf "$d"
}
run() {  # name, gpu_run.sh arguments...; keeps results.json and the summary lines
    local name="$1"; shift
    TRITIUM_COMMIT="$COMMIT" OUT="$OUT/$name" bash scripts/gpu_run.sh "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1
    grep -E "workload [AB]:|output tok/s|TTFT" "$OUT/$name.log" >> "$S"
    logs "$OUT/$name"
    mv "$OUT/$name/results.json" "$OUT/${name}_results.json" 2>/dev/null
    rm -rf "${OUT:?}/$name" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv 2>&1 | tee -a "$S"
stamp "GPU tests: kernels, then the FP8 engine path"
timeout 240 "$PY" -m pytest tests/kernels --confcutdir=tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -4 >> "$S"
timeout 150 "$PY" -m pytest tests/engine/test_fp8.py --confcutdir=tests/engine -q -p no:cacheprovider 2>&1 | tail -4 >> "$S"
if [ "${SWEEP:-0}" = 1 ]; then
    stamp "FP8 matmul sweep, rewriting the table for this GPU"
    timeout 330 "$PY" scripts/bench_fp8_matmul.py --json "$OUT/fp8_sweep.json" \
        --write-configs kernels/configs/fp8_matmul.json > "$OUT/fp8_sweep.txt" 2>&1
    grep -E "chosen|wrote" "$OUT/fp8_sweep.txt" >> "$S"; cp kernels/configs/fp8_matmul.json "$OUT/"
fi
stamp "FP8 workload B with the tuned table"
run fp8_b --models "$LLAMA,$QWEN" --phases triton,offline --workloads B --engine-arg quantization=fp8
stamp "Qwen2.5-1.5B bf16 through Triton and in-process"
run qwen15 --models "$QWEN" --phases triton,offline
stamp done
