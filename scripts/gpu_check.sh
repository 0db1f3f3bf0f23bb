#!/usr/bin/env bash
# One device call that checks and profiles the GPU path: the kernel tests and the engine's
# Hugging Face parity tests compiled on CUDA, the kernel benchmark, and an engine step profile
# at Llama-3-8B shapes (dummy weights). Run from the repo root with $OUT set and
# models/tiny-llama carried:  bash scripts/gpu_check.sh [quick|full|engine|profile]
set -uo pipefail
export PYTHONUNBUFFERED=1
MODE="${1:-quick}"
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$MODE" = quick ] || [ "$MODE" = full ]; then
stamp "kernel tests (CUDA)"
timeout 200 python3 -m pytest tests/kernels --confcutdir=tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/kernel_tests.txt"
fi
if [ "$MODE" != profile ]; then
stamp "engine tests (CUDA, float32 kernels vs HF)"
timeout 200 python3 -m pytest tests/engine/test_hf_parity.py tests/engine/test_sampling.py \
    --confcutdir=tests/engine -q -x -p no:cacheprovider 2>&1 | tail -12 | tee "$OUT/engine_tests.txt"
fi
if [ "$MODE" = quick ] || [ "$MODE" = full ]; then
stamp "kernel benchmark"
if [ "$MODE" = full ]; then KB=""; else KB="--quick"; fi
timeout 240 python3 scripts/bench_kernels.py $KB --out "$OUT/kernels.json" 2>&1 | tail -45
fi
stamp "engine profile, workload A-like (256 x 512 in, 64 out)"
timeout 240 python3 scripts/profile_engine.py --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
    --num-requests 256 --input-len 512 --output-len 64 --json "$OUT/profile_a.json" 2>&1 | tail -30
stamp "engine profile, workload B (1 x 512 in, 128 out)"
timeout 120 python3 scripts/profile_engine.py --model models/configs/llama-3-8b --tokenizer models/tiny-llama \
    --num-requests 1 --input-len 512 --output-len 128 --json "$OUT/profile_b.json" 2>&1 | tail -30
stamp "done"
