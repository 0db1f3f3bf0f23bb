#!/usr/bin/env bash
# One device call for what the CPU machine cannot measure, one part per call:
#   part 1: the GPU tests of the attention kernels (TMA boxes on the real hardware); the prefill
#           sweep over the three ways of reading the chunk (cache, direct, tma) at 16 x 512,
#           2 x 4096 and 1 x 8192; Llama-3-8B bf16 in-process (A and B);
#   part 2: Llama-3-8B bf16 through Triton and in-process; Qwen2.5-7B and Qwen2.5-1.5B bf16
#           through Triton and in-process;
#   part 3: the structured-output tests on CUDA (xgrammar from gpu_extras/, built by
#           scripts/package_gpu_extras.sh: carry it too); workload A through Triton with
#           stream_interval 1 and 16, alternately, for Qwen2.5-1.5B (host-bound) and once each
#           for Llama-3-8B (GPU-bound);
#   part 4: the LoRA kernel and engine tests on CUDA (graphs with adapters per row), the
#           structured-output tests (failures in full); with BENCH=1, scripts/bench_lora.py on
#           Llama-3-8B shapes (what adapters cost per variant);
#   part 5: LoRA through the real server: Llama-3-8B bf16 workload A through Triton without
#           adapters, with requests spread over 4 random rank-16 adapters (one device slot each),
#           the same with max_loras=2 (adapters take turns), and without adapters again;
#   part 6: kernel variants compiled while serving (backend/worker/compile_watch.py): the attention and
#           LoRA kernel tests, the GPU engine tests (one asserts no compile after start-up), the
#           LoRA expand's row blocks at 16, 64 and 256 tokens, and Llama-3-8B bf16 A and B
#           through Triton twice (the first server compiles on an empty cache);
#   part 7: after part 6's fixes: the LoRA kernel tests and GPU engine tests again, what LoRA
#           adapters cost in-process (bench_lora.py) and Llama-3-8B bf16 A and B through Triton.
#   part 8: what sampling parameters cost the batch (penalties on every request, on one in
#           eight): scripts/probes/bench_sampler.py on CUDA, then scripts/bench_sampling_cost.py on
#           Llama-3-8B bf16 in-process for this tree and each source tree in $TREES (carried,
#           e.g. a `git archive` of an older commit); with TESTS=1 then the sampling kernel tests and
#           the engine tests in $TEST_FILES (default: sampling, GPU engine, structured
#           outputs) on CUDA (xgrammar from gpu_extras/).
#   part 9: speculative decoding: the GPU engine tests and LoRA speculation (verification through the Triton prefill
#           kernel against the CPU engine), the structured-output tests (deferred sampling, and
#           guided requests speculating), scripts/bench_spec_decode.py on
#           Llama-3-8B bf16 (batches of $SPEC_BATCHES, default 1, 8, 16 and 32; proposals from the
#           n-gram proposer, always right, always wrong; SPEC_GRAPH_SEQS: most sequences that
#           speculate, default the engine's; SPEC_PARAMS: JSON sampling parameters for every
#           request, e.g. '{"repetition_penalty": 1.1}'), and unless NO_TRITON is set
#           Llama-3-8B bf16 A and B through Triton.
#   part 10: where a verification step's time goes: scripts/profile_engine.py on Llama-3-8B bf16,
#           32 and 16 requests of 512 -> 128 tokens, plainly and with n-gram speculation (the
#           verification graphs sized for the batch): host time per part of a step, GPU busy
#           time per step.
#   part 11: the kernels of verification steps against decode steps: scripts/profile_kernels.py
#           on Llama-3-8B bf16, 16 and 32 requests, plainly and speculating.
#   part 12: issue 27's table, first half: the long-context attention tests on CUDA; the kernel
#           table (decode 1 x 32k against SDPA in the same run); Qwen2.5-1.5B bf16 A through
#           Triton and in-process; Llama-3-8B FP8 weights + FP8 KV cache A and B through Triton.
#   part 13: issue 27's long-context workloads: Qwen2.5-7B bf16 C and L through Triton with the
#           Hugging Face anchor in the same call (max_model_len 32,768 for both).
#   part 14: issue 28: the W4A16 kernel and AWQ/GPTQ engine tests on CUDA; scripts/bench_w4a16.py
#           with --sweep (every path: gemv, mma, dequant), its best configs written to
#           $OUT/w4a16_configs.json and used by Llama-3-8B AWQ A and B through Triton after it.
# Run from the repo root with $OUT set, carrying gpu_bundle and models/tiny-llama:
#   COMMIT=<sha> bash scripts/gpu_pending_checks.sh PART
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
PART="${1:?part 1 to 14}"; shift
LLAMA="${LLAMA:-llama-3-8b}" QWEN="${QWEN:-qwen2.5-1.5b}" QWEN7="${QWEN7:-qwen2.5-7b}" EXTRA=("$@")
mkdir -p "$OUT"
t0=$(date +%s); S="$OUT/summary.txt"
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$S"; }
logs() {  # the engine process's and the stub's own accounts of a gpu_run.sh call
    local d; d=$(mktemp -d); tar -C "$d" -xzf "$1/logs.tar.gz" 2>/dev/null
    grep -rh -E "engine process:|sender thread|KV cache:|Triton (is )?compil" "$d" | cut -c1-900 >> "$S"; rm -rf "$d"
}
run() {  # name, gpu_run.sh arguments...; keeps results.json and the summary lines
    local name="$1"; shift
    TRITIUM_COMMIT="$COMMIT" OUT="$OUT/$name" bash scripts/gpu_run.sh "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1
    grep -E "workload [A-Z]:|output tok/s|TTFT" "$OUT/$name.log" >> "$S"
    logs "$OUT/$name"
    mv "$OUT/$name/results.json" "$OUT/${name}_results.json" 2>/dev/null
    rm -rf "${OUT:?}/$name" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv 2>&1 | tee -a "$S"
PREFILL_CONFIGS=64:64:4:2,64:64:4:3,128:64:8:2,128:64:8:3,128:128:8:2,128:128:8:3,64:128:4:2,128:64:4:2
if [ "$PART" = 1 ]; then
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "GPU tests: the attention kernels"
        timeout 240 "$PY" -m pytest tests/kernels/test_kernel_prefill_attention.py tests/kernels/test_kernel_decode_attention.py \
            tests/kernels/test_kernel_fp8_kv_cache.py tests/kernels/test_kernel_store_kv.py \
            --confcutdir=tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -4 >> "$S"
        timeout 200 "$PY" -m pytest tests/engine/test_gpu_engine.py tests/engine/test_fp8_kv_cache.py -k gpu \
            --confcutdir=tests/engine -q -p no:cacheprovider 2>&1 | tail -6 >> "$S"
        stamp "prefill sweep: the chunk read through the cache, directly, through TMA"
        timeout 300 "$PY" scripts/sweep_attention.py --jobs 0 --decode-cases "" \
            --prefill-cases 16:512,2:4096,1:8192 --prefill-configs "$PREFILL_CONFIGS" \
            --chunk-kv cache,direct,tma --out "$OUT/sweep_prefill.json" 2>&1 | grep -v "^$" | head -60 >> "$S"
    fi
    stamp "Llama-3-8B bf16 in-process"
    run llama_offline --models "$LLAMA" --phases offline
elif [ "$PART" = 4 ]; then
    stamp "GPU tests: LoRA kernels and engine"
    timeout 200 "$PY" -m pytest tests/kernels/test_kernel_lora.py --confcutdir=tests/kernels -q \
        -p no:cacheprovider 2>&1 | tail -4 >> "$S"
    timeout 400 "$PY" -m pytest tests/engine/test_lora.py --confcutdir=tests/engine -q \
        -p no:cacheprovider --tb=short 2>&1 | tail -40 >> "$S"
    stamp "GPU tests: structured outputs"
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/extras \
        gpu_extras/*.whl 2>&1 | tail -2 >> "$S"
    PYTHONPATH=/tmp/extras timeout 240 "$PY" -m pytest tests/engine/test_structured_output.py \
        --confcutdir=tests/engine -q -p no:cacheprovider --tb=short 2>&1 | tail -60 >> "$S"
    if [ -n "${BENCH:-}" ]; then
        stamp "add_lora launch configs at Llama-3-8B's projections"
        timeout 240 "$PY" scripts/sweep_lora_kernel.py --model models/configs/llama-3-8b \
            --json "$OUT/sweep_lora_kernel.json" 2>&1 | tail -40 >> "$S"
    fi
    [ -n "${BENCH:-}" ] && stamp "LoRA cost, Llama-3-8B bf16 in-process" && timeout 420 "$PY" scripts/bench_lora.py --model models/configs/llama-3-8b --adapters 4 --rank 16 \
        --num-requests 256 --input-len 512 --output-len 128 --json "$OUT/bench_lora_llama.json" 2>&1 | tail -12 >> "$S"
elif [ "$PART" = 7 ]; then
    stamp "GPU tests: LoRA kernels; the engine (no compile while serving), LoRA"
    timeout 120 "$PY" -m pytest tests/kernels/test_kernel_lora.py --confcutdir=tests/kernels -q -p no:cacheprovider \
        2>&1 | tail -2 >> "$S"
    timeout 300 "$PY" -m pytest tests/engine/test_gpu_engine.py tests/engine/test_lora.py tests/engine/test_compile_watch.py \
        --confcutdir=tests/engine -q -p no:cacheprovider --tb=short 2>&1 | tail -30 | cut -c1-900 >> "$S"
    stamp "LoRA cost, Llama-3-8B bf16 in-process"
    timeout 300 "$PY" scripts/bench_lora.py --model models/configs/llama-3-8b --adapters 4 --rank 16 \
        --num-requests 256 --input-len 512 --output-len 128 --json "$OUT/bench_lora_llama.json" 2>&1 | tail -8 >> "$S"
    stamp "Llama-3-8B bf16 A and B through Triton"
    run llama --models "$LLAMA" --phases triton --workloads A,B
elif [ "$PART" = 8 ]; then
    stamp "the sampler's host and device time per step (256 rows x 640 tokens)"
    timeout 120 "$PY" -m scripts.probes.bench_sampler --device "${SAMPLER_DEVICE:-cuda}" --json "$OUT/bench_sampler_cuda.json" 2>&1 | tail -12 >> "$S"
    HERE=$(pwd)
    for tree in . ${TREES:-}; do
        name=this; [ "$tree" = . ] || name=$(basename "$tree")
        # An older tree runs this tree's benchmark scripts (they use only the engine's public API).
        [ "$tree" = . ] || cp scripts/bench_offline.py scripts/bench_sampling_cost.py "$tree/scripts/"
        stamp "sampling cost, Llama-3-8B bf16 A in-process, tree $name"
        (cd "$tree" && timeout "${COST_TIMEOUT:-200}" "$PY" scripts/bench_sampling_cost.py \
            --model "$HERE/models/configs/$LLAMA" --tokenizer "$HERE/models/tiny-llama" --rounds 2 \
            --variant 'pen_all:1:repetition_penalty=1.1,presence_penalty=0.1,frequency_penalty=0.1' \
            --variant 'pen_1in8:8:repetition_penalty=1.1' "${EXTRA[@]}" --json "$OUT/sampling_cost_$name.json" \
            2>&1 | grep -v "^  warnings.warn\|Warning" | tail -12 >> "$S")
    done
    if [ -n "${TESTS:-}" ]; then
        stamp "GPU tests: the sampling kernels"
        timeout 120 "$PY" -m pytest tests/kernels/test_kernel_sampling.py --confcutdir=tests/kernels -q \
            -p no:cacheprovider 2>&1 | tail -3 >> "$S"
        stamp "GPU tests: ${TEST_FILES:=tests/engine/test_sampling.py tests/engine/test_gpu_engine.py tests/engine/test_structured_output.py}"
        "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/extras \
            gpu_extras/*.whl 2>&1 | tail -2 >> "$S"
        # shellcheck disable=SC2086
        PYTHONPATH=/tmp/extras timeout "${TESTS_TIMEOUT:-280}" "$PY" -m pytest $TEST_FILES --confcutdir=tests/engine \
            -q -p no:cacheprovider --tb=short 2>&1 | grep -v "^  warnings.warn\|Warning" | tail -40 | cut -c1-900 >> "$S"
    fi
elif [ "$PART" = 9 ]; then
    stamp "GPU tests: the engine (speculative decoding, penalties, LoRA, no compile while serving)"
    timeout 240 "$PY" -m pytest tests/engine/test_gpu_engine.py "tests/engine/test_lora.py::test_speculating_requests_keep_their_adapters" \
        --confcutdir=tests/engine -q -p no:cacheprovider \
        --tb=short 2>&1 | grep -v "^  warnings.warn\|Warning" | tail -30 | cut -c1-900 >> "$S"
    stamp "GPU tests: structured outputs (xgrammar from gpu_extras)"
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/extras \
        gpu_extras/*.whl 2>&1 | tail -2 >> "$S"
    PYTHONPATH=/tmp/extras timeout 200 "$PY" -m pytest tests/engine/test_structured_output.py \
        --confcutdir=tests/engine -q -p no:cacheprovider --tb=short 2>&1 | tail -8 >> "$S"
    stamp "speculative decoding, Llama-3-8B bf16 in-process"
    timeout 320 "$PY" scripts/bench_spec_decode.py --model "models/configs/$LLAMA" --tokenizer models/tiny-llama \
        --k 4 --batch-sizes "${SPEC_BATCHES:-1,8,16,32}" ${SPEC_GRAPH_SEQS:+--spec-graph-seqs "$SPEC_GRAPH_SEQS"} \
        ${SPEC_PARAMS:+--params "$SPEC_PARAMS"} --json "$OUT/bench_spec_decode.json" 2>&1 | grep -v "Warning\|warnings.warn" | tail -20 >> "$S"
    [ -n "${NO_TRITON:-}" ] || { stamp "Llama-3-8B bf16 A and B through Triton"
                                 run llama --models "$LLAMA" --phases triton --workloads A,B; }
elif [ "$PART" = 10 ] || [ "$PART" = 11 ]; then
  SPEC='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
  with_spec_seqs() {  # script, most speculating sequences, its arguments...: the engine's limit set
    local script=$1 seqs=$2; shift 2
    timeout 150 "$PY" -c "import sys, runpy; sys.path.insert(0, 'scripts'); from backend.worker import model_runner; \
model_runner.SPEC_GRAPH_MAX_SEQS = $seqs; sys.argv = ['$script'] + sys.argv[1:]; \
runpy.run_path('scripts/$script', run_name='__main__')" --model "models/configs/$LLAMA" \
        --tokenizer models/tiny-llama --engine-arg enable_prefix_caching=false "$@"
  }
  if [ "$PART" = 10 ]; then
    prof() {  # name, most speculating sequences, requests, engine arguments...
        local name=$1 seqs=$2 n=$3; shift 3
        stamp "profile_engine: $name"
        with_spec_seqs profile_engine.py "$seqs" --num-requests "$n" --input-len 512 --output-len 128 "$@" \
            --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        "$PY" -c "
import json; d = json.load(open('$OUT/$name.json'))
print({k: d[k] for k in ('wall_s', 'output_tok_s', 'steps', 'loop_thread_cpu_s')})
print('  gpu busy', d.get('gpu_busy_ms'), 'idle', d.get('gpu_idle_after_step_ms'), d.get('steps_by_phase'))
print('  host ms mean', {k: round(v, 3) for k, v in d['phase_ms_mean'].items()})
print('  host ms total', {k: round(v, 1) for k, v in d['phase_ms_total'].items()})" >> "$S" 2>&1 || tail -5 "$OUT/$name.log" >> "$S"
        rm -f "$OUT/$name.log"
    }
    prof plain32 32 32
    prof spec32 32 32 --engine-arg "speculative_config=$SPEC"
    prof spec16 16 16 --engine-arg "speculative_config=$SPEC"
    prof plain16 16 16
  else
    kern() {  # name, most speculating sequences, requests, engine arguments...
        local name=$1 seqs=$2 n=$3; shift 3
        stamp "profile_kernels: $name"
        with_spec_seqs profile_kernels.py "$seqs" --num-requests "$n" --output-len 256 --skip-decode-steps 12 \
            "$@" --json "$OUT/k_$name.json" > "$OUT/k_$name.log" 2>&1
        if [ -s "$OUT/k_$name.json" ]; then sed -n '/== decode_phase/,$p' "$OUT/k_$name.log" | cut -c1-160 >> "$S"
        else grep -v "Warning\|warnings.warn" "$OUT/k_$name.log" | tail -8 >> "$S"; fi
        rm -f "$OUT/k_$name.log"
    }
    kern plain16 16 16
    kern spec16 16 16 --engine-arg "speculative_config=$SPEC"
    kern plain32 32 32
    kern spec32 32 32 --engine-arg "speculative_config=$SPEC"
  fi
elif [ "$PART" = 6 ]; then
    stamp "GPU tests: attention and LoRA kernels"
    timeout 240 "$PY" -m pytest tests/kernels/test_kernel_decode_attention.py tests/kernels/test_kernel_prefill_attention.py \
        tests/kernels/test_kernel_lora.py --confcutdir=tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -4 >> "$S"
    stamp "GPU tests: the engine (no compile while serving), LoRA"
    timeout 300 "$PY" -m pytest tests/engine/test_gpu_engine.py tests/engine/test_lora.py tests/engine/test_compile_watch.py \
        --confcutdir=tests/engine -q -p no:cacheprovider --tb=short 2>&1 | grep -v "^  warnings.warn\|Warning" | tail -50 | cut -c1-900 >> "$S"
    stamp "add_lora row blocks at 16, 64 and 256 tokens"
    timeout 120 "$PY" scripts/sweep_lora_kernel.py --model models/configs/llama-3-8b --tokens 16,64,256 \
        --json "$OUT/sweep_lora_kernel_small.json" 2>&1 | tail -45 >> "$S"
    for round in 1 2; do
        stamp "Llama-3-8B bf16 A and B through Triton (server $round)"
        run "llama_r$round" --models "$LLAMA" --phases triton --workloads A,B
    done
elif [ "$PART" = 5 ]; then
    ADAPTERS="${LORA_DIR:-/tmp/tritium-lora-adapters}"
    stamp "writing 4 random rank-16 adapters for $LLAMA in $ADAPTERS"
    MODULES=$(PYTHONPATH=tests/engine "$PY" - "$LLAMA" "$ADAPTERS" <<'EOF'
import json, os, sys
from lora_adapters import write_adapter
model = sys.argv[1] if os.path.isdir(sys.argv[1]) else os.path.join("models/configs", sys.argv[1])
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
paths = {f"a{i}": write_adapter(os.path.join(sys.argv[2], f"a{i}"), model, targets, 16, 32, seed=i, scale=0.01)
         for i in range(4)}
print(json.dumps(paths, separators=(",", ":")))
EOF
)
    echo "lora_modules=$MODULES" >> "$S"
    LORA=(--engine-arg enable_lora=true --engine-arg "lora_modules=$MODULES" --engine-arg max_lora_rank=16)
    stamp "Llama-3-8B bf16 A through Triton, no adapters (first)"
    run llama_base1 --models "$LLAMA" --phases triton --workloads A
    stamp "Llama-3-8B bf16 A through Triton, requests over 4 adapters, 4 slots"
    run llama_lora4 --models "$LLAMA" --phases triton --workloads A "${LORA[@]}" --lora-names a0,a1,a2,a3
    stamp "Llama-3-8B bf16 A through Triton, requests over 4 adapters, max_loras=2"
    run llama_lora4_slots2 --models "$LLAMA" --phases triton --workloads A "${LORA[@]}" \
        --engine-arg max_loras=2 --lora-names a0,a1,a2,a3
    stamp "Llama-3-8B bf16 A through Triton, no adapters (last)"
    run llama_base2 --models "$LLAMA" --phases triton --workloads A
elif [ "$PART" = 12 ]; then
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "GPU tests: attention kernels at long context"
        timeout 240 "$PY" -m pytest tests/kernels/test_kernel_long_context_attention.py --confcutdir=tests/kernels \
            -q -p no:cacheprovider --tb=short 2>&1 | tail -20 | cut -c1-600 >> "$S"
        stamp "kernel table (decode 1 x 32k against SDPA in the same run)"
        timeout 240 "$PY" scripts/bench_kernels.py --quick --out "$OUT/kernels.json" 2>&1 | tail -40 >> "$S"
    fi
    stamp "Qwen2.5-1.5B bf16 A: Triton and in-process"
    run qwen15 --models "$QWEN" --phases triton,offline --workloads A
    stamp "Llama-3-8B FP8 weights and KV cache, A and B through Triton"
    run llama_fp8 --models "$LLAMA" --phases triton --workloads A,B \
        --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8
elif [ "$PART" = 13 ]; then
    stamp "Qwen2.5-7B bf16 C and L: Triton and the HF anchor"
    run qwen7_long --models "$QWEN7" --phases triton,hf --workloads C,L
elif [ "$PART" = 14 ]; then
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "GPU tests: W4A16 kernel (gemv, mma and dequant paths, bf16) and the AWQ/GPTQ engine"
        timeout 300 "$PY" -m pytest tests/kernels/test_kernel_w4a16.py tests/engine/test_awq_gptq.py \
            --confcutdir=tests -q -p no:cacheprovider --tb=short 2>&1 | tail -20 | cut -c1-600 >> "$S"
        stamp "W4A16 table and sweep (writes kernels/configs/w4a16.json's entries to \$OUT)"
        timeout 600 "$PY" scripts/bench_w4a16.py --sweep --json "$OUT/w4a16.json" \
            --write-configs "$OUT/w4a16_configs.json" 2>&1 | grep -v "^  skip" | tail -60 >> "$S"
        [ -f "$OUT/w4a16_configs.json" ] && mkdir -p kernels/configs && cp "$OUT/w4a16_configs.json" kernels/configs/w4a16.json
    fi
    stamp "Llama-3-8B AWQ (dummy 4-bit weights) A and B through Triton, the swept configs in use"
    run llama_awq --models "$LLAMA" --phases triton --workloads A,B --engine-arg quantization=awq
elif [ "$PART" = 3 ]; then
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "GPU tests: structured outputs (xgrammar from gpu_extras)"
        "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/extras \
            gpu_extras/*.whl 2>&1 | tail -2 >> "$S"
        PYTHONPATH=/tmp/extras timeout 240 "$PY" -m pytest tests/engine/test_structured_output.py \
            --confcutdir=tests/engine -q -p no:cacheprovider 2>&1 | tail -8 >> "$S"
    fi
    for round in 1 2; do
        for si in 1 16; do
            stamp "Qwen2.5-1.5B bf16 A through Triton, stream_interval=$si (round $round)"
            run "qwen15_si${si}_r${round}" --models "$QWEN" --phases triton --workloads A \
                --engine-arg stream_interval=$si
        done
    done
    for si in 16 1; do
        stamp "Llama-3-8B bf16 A through Triton, stream_interval=$si"
        run "llama_si${si}" --models "$LLAMA" --phases triton --workloads A --engine-arg stream_interval=$si
    done
else
    stamp "Llama-3-8B bf16: Triton and in-process"
    run llama --models "$LLAMA" --phases triton,offline
    stamp "Qwen2.5-7B bf16: Triton and in-process"
    run qwen7 --models "$QWEN7" --phases triton,offline
    stamp "Qwen2.5-1.5B bf16: Triton and in-process"
    run qwen15 --models "$QWEN" --phases triton,offline
fi
stamp done
