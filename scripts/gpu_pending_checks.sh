#!/usr/bin/env bash
# One device call for what the CPU machine cannot measure, in two parts (kv_cache_dtype=fp8,
# session of 2026-12-01):
#   part 1: the GPU tests of the attention kernels and the FP8 cache; the attention sweep over an
#           FP8 cache at workload A's shapes (float16 and bf16 dots); Llama-3-8B with an FP8
#           cache (bf16 weights, then FP8 weights) and Qwen2.5-1.5B with an FP8 cache, through
#           Triton and in-process;
#   part 2: Qwen2.5-7B with an FP8 cache, through Triton and in-process; Llama-3-8B with an FP8
#           cache through Triton again.
# Run from the repo root with $OUT set, carrying gpu_bundle and models/tiny-llama:
#   COMMIT=<sha> bash scripts/gpu_pending_checks.sh 1|2
# Further arguments go to every gpu_run.sh call; with LLAMA/QWEN/QWEN7 naming other models it
# rehearses on the CPU machine, e.g. LLAMA=models/tiny-llama QWEN=models/tiny-llama
#   QWEN7=models/tiny-llama IMAGE_PYTHON=.venv/bin/python TRITIUM_BUNDLE=/tmp/bundle311
#   NO_GPU_STEPS=1 OUT=/tmp/pending bash scripts/gpu_pending_checks.sh 1 --device cpu
#   --dtype float32 --num-requests 16 --input-len 64 --output-len 16
# Leaves at most 8 files in $OUT: summary.txt (the lines that matter), the results.json of each
# gpu_run.sh call, and the sweep's JSON.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:?set OUT}" COMMIT="${COMMIT:-unknown}" PY="${IMAGE_PYTHON:-python3}"
PART="${1:?part 1 or 2}"; shift
LLAMA="${LLAMA:-llama-3-8b}" QWEN="${QWEN:-qwen2.5-1.5b}" QWEN7="${QWEN7:-qwen2.5-7b}" EXTRA=("$@")
mkdir -p "$OUT"
t0=$(date +%s); S="$OUT/summary.txt"
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$S"; }
logs() {  # the engine process's and the stub's own accounts of a gpu_run.sh call
    local d; d=$(mktemp -d); tar -C "$d" -xzf "$1/logs.tar.gz" 2>/dev/null
    grep -rh -E "engine process:|sender thread|KV cache:" "$d" >> "$S"; rm -rf "$d"
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
KV=(--engine-arg kv_cache_dtype=fp8)
if [ "$PART" = 1 ]; then
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "GPU tests: the attention kernels and the FP8 cache, then its engine path"
        timeout 240 "$PY" -m pytest tests/kernels/test_kernel_fp8_kv_cache.py tests/kernels/test_kernel_decode_attention.py \
            tests/kernels/test_kernel_prefill_attention.py tests/kernels/test_kernel_store_kv.py \
            --confcutdir=tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -4 >> "$S"
        timeout 200 "$PY" -m pytest tests/engine/test_fp8_kv_cache.py \
            --confcutdir=tests/engine -q -p no:cacheprovider 2>&1 | tail -6 >> "$S"
        stamp "attention sweep over an FP8 cache at workload A's shapes"
        timeout 200 "$PY" scripts/sweep_attention.py --kv-cache-dtype fp8 --small --jobs 0 \
            --decode-cases 256:512:768,1:32768:32768 --prefill-cases 16:512 \
            --out "$OUT/sweep_fp8.json" 2>&1 | grep -v "^$" | head -40 >> "$S"
    fi
    stamp "Llama-3-8B bf16 weights, FP8 cache: Triton and in-process"
    run llama_kv8 --models "$LLAMA" --phases triton,offline "${KV[@]}"
    stamp "Llama-3-8B FP8 weights, FP8 cache: Triton and in-process"
    run llama_fp8_kv8 --models "$LLAMA" --phases triton,offline --engine-arg quantization=fp8 "${KV[@]}"
    stamp "Qwen2.5-1.5B bf16, FP8 cache: Triton and in-process"
    run qwen15_kv8 --models "$QWEN" --phases triton,offline "${KV[@]}"
else
    stamp "Qwen2.5-7B bf16, FP8 cache: Triton and in-process"
    run qwen7_kv8 --models "$QWEN7" --phases triton,offline "${KV[@]}"
    stamp "Llama-3-8B bf16 weights, FP8 cache, again: Triton (a second machine's figure)"
    run llama_kv8_again --models "$LLAMA" --phases triton "${KV[@]}"
fi
stamp done
