#!/usr/bin/env bash
# Benchmarks and GPU checks on a GPU machine, one named set per call (each fits a 10-minute
# device call). Run from the repository root with $OUT set, carrying gpu_bundle/ (built by
# scripts/package_gpu_bundle.sh) and models/tiny-llama (make model):
#
#   OUT=/tmp/out bash benchmarks/gpu.sh SET [ARGS...]
#
#   e2e ARGS...      models x runners x workloads (benchmarks/lib/e2e.sh; its flags: --models,
#                    --phases triton,offline,hf,frontend, --workloads A,B,C,L, --engine-arg K=V,
#                    --dry-run ...); writes $OUT/results.json and $OUT/logs.tar.gz
#   serving          Llama-3-8B, Qwen2.5-7B, Qwen2.5-1.5B bf16, workloads A and B through Triton and
#                    in-process (the serving overhead)
#   fp8              Llama-3-8B A and B through Triton: bf16, FP8 weights, FP8 weights + FP8 KV
#                    cache, one after the other on one GPU; then the FP8 matmul table
#   w4a16            the W4A16 kernel and AWQ/GPTQ engine tests ($W4_TESTS to choose, "none"), the config
#                    sweep per group of row counts in $W4_SWEEP_ROWS ("1,8,16 64,256 512,4096"; "" for
#                    none), each within $W4_SWEEP_LIMIT s (280; its configs used from then on), the
#                    table of every path at the seven row counts ($W4_TABLE_LIMIT s, 240), then
#                    Llama-3-8B AWQ, GPTQ act-order and bf16 A and B through Triton (NO_GPU_STEPS=1
#                    skips tests, sweep and table, NO_E2E=1 stops after them: one call cannot hold both)
#   long-context     Qwen2.5-7B bf16 workloads C and L through Triton and the Hugging Face anchor
#   frontend         Llama-3-8B workload A over gRPC directly and through the OpenAI frontend
#   lora             Llama-3-8B A through Triton: no adapters, 4 adapters, 4 adapters on 2 slots,
#                    no adapters again
#   spec-decode      n-gram speculative decoding in-process, batches $SPEC_BATCHES (1,8,16,32)
#   draft-spec       a one-layer draft model and an EAGLE-3 head of $LLAMA's shape, workload B
#                    in-process: draft and verification time per step, forced acceptance 1 and 0
#   offload          a multi-turn chat past a device cache of $OFFLOAD_BLOCKS (2048) blocks, $LLAMA bf16
#                    in-process, without and with swap_space=$OFFLOAD_SWAP (24) GiB (the prefix
#                    cache's host tier): TTFT, throughput, hit rates; then the copy bandwidth
#   window-kv        the KV memory one long request holds with and without the window-aware cache,
#                    each NAME:TOKENS in $WINDOW_MODELS (mistral-7b-v0.1:32768 gemma-2-9b:8192),
#                    bf16 in-process
#   sampling         the sampler's per-step cost, then penalties' cost on workload A in-process,
#                    for this tree, then for each tree in $TREES (carried)
#   stream-interval  Qwen2.5-1.5B A through Triton, stream_interval 1 and 16, alternately, twice
#   kernels [--full] the long-context attention tests and the kernel table (decode and prefill
#                    against PyTorch SDPA; --full adds the config sweeps)
#   tests            the GPU tests: kernels, the engine against Hugging Face and the CPU engine,
#                    LoRA, FP8, AWQ/GPTQ, structured outputs (xgrammar from gpu_extras/)
#   profile [ARGS]   where a step's time goes at Llama-3-8B shapes: host and GPU time per step
#                    (workload A-like and B), GPU time per kernel (ARGS go to both profilers)
#   compare-trees TREE... [-- E2E_ARGS]  this tree against others (`git archive REV | tar -x -C
#                    oldtree`, carried), in-process by default, run alternately ROUNDS (2) times
#   disagg           disaggregated prefill on one GPU (needs gpu_nixl/nixl_slim.tar.xz, carried): the
#                    NIXL block read between two processes against the card's copy rate, then a mixed
#                    load (64 streams decoding, 32 prompts of 4,096 tokens arriving), $LLAMA bf16,
#                    colocated and then prefill + decode engines in two processes: TTFT/ITL p50/p99
#                    (further ARGS to the mixed load; NO_MIXED_LOAD=1: the reads alone)
#   ncu-attention    attention kernel variants timed, then Nsight Compute sections per case
#   round3           performance round 3's table in one call: $QWEN A through Triton and in-process,
#                    paged decode at 1 x 32k against SDPA (the default and a few configs),
#                    $QWEN7 L through Triton and Hugging Face, $LLAMA FP8 weights + FP8 KV A via Triton
#   l-ttft           where $QWEN7's workload L TTFT goes: the whole 32k prefill kernel by kernel
#                    in-process, prefill attention in the engine's chunks against SDPA on the whole
#                    prompt, then L through Triton, in-process and Hugging Face
#   swap-sweeps      the swapped-operand W4A16 and FP8 few-row kernels: GPU tests, the W4A16 sweep at
#                    $W4_SWEEP_ROWS (256,512,4096), the FP8 default against the swapped configs; both
#                    config tables written to $OUT; then the W4A16 table of every path
#   quant-e2e        the quantized paths end to end in one call: GPU tests of the fused FP8
#                    quantizations, the FP8 matmul and split-K slices, then $LLAMA A and B through Triton in bf16,
#                    AWQ (random 4-bit weights, groups of 128) and FP8 weights, on the same card
#   w4a16-fragment   the W4A16 kernel on words in wgmma's fragment order: its GPU tests, then its table
#                    against cuBLAS bf16 and the packed layout's path at 1-4096 rows; the table of the
#                    shapes where it wins written to $OUT/w4a16_fragment_configs.json ($FRAGMENT_ROWS,
#                    $FRAGMENT_LAYERS: fewer row counts or projections for a short call)
#   ncu-w4a16        the W4A16 matmul at Llama-3-8B's projections (rows $W4_ROWS, 1 by default)
#                    with the configs the engine picks: timed against cuBLAS bf16, then Nsight
#                    Compute sections per projection (occupancy, bytes in flight, stall reasons)
#
# Sets other than e2e and compare-trees pass further ARGS to each e2e call. $OUT/summary.txt
# keeps the lines that matter; each e2e call's results.json is kept as $OUT/<name>_results.json.
# Environment: COMMIT (recorded in results.json), IMAGE_PYTHON (python3), LLAMA, QWEN, QWEN7
# (model shapes: names under models/configs or directories). A rehearsal on a CPU machine:
#   LLAMA=models/tiny-llama QWEN=models/tiny-llama QWEN7=models/tiny-llama NO_GPU_STEPS=1
#   IMAGE_PYTHON=.venv/bin/python TRITIUM_BUNDLE=/tmp/bundle311 OUT=/tmp/out bash benchmarks/gpu.sh
#   serving --device cpu --dtype float32 --num-requests 16 --input-len 64 --output-len 16
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SET="${1:?usage: benchmarks/gpu.sh SET [ARGS...] (the sets are listed at the top of this file)}"; shift

# No `pip install -e .` on the GPU machine (no network): Python finds a tree's `tritium` through links laid out as setup.py maps its folders.
PYTHONPATH_GIVEN="${PYTHONPATH:-}"
packaged() { [ -f "$1/setup.py" ] || [ -f "$1/pyproject.toml" ]; }  # TREE: false for a tree from before the tritium package
use_tree() {  # TREE: export the PYTHONPATH that runs TREE's code (a tree from before the package finds its own modules)
    local tree links
    tree=$(cd "$1" && pwd)
    if ! packaged "$tree"; then
        if [ -n "$PYTHONPATH_GIVEN" ]; then export PYTHONPATH="$PYTHONPATH_GIVEN"; else unset PYTHONPATH; fi
        return 0
    fi
    # One directory per layout, named by its links and made under a temporary name, so that runs
    # at the same time (or of several trees) never change links another one is importing through.
    links=$("${IMAGE_PYTHON:-python3}" - "$tree" "${TMPDIR:-/tmp}/tritium-import" <<'PYEOF'
import ast, hashlib, os, shutil, sys, tempfile
tree, root = sys.argv[1:]
setup = ast.parse(open(os.path.join(tree, "setup.py"), encoding="utf-8").read())
folders = next(ast.literal_eval(node.value) for node in setup.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["FOLDERS"])
links = []  # (link, target): the package's folder entry by entry, each subpackage's folder whole
for name, folder in sorted(folders.items(), key=lambda item: item[0].count(".")):
    path, source = os.path.join(*name.split(".")), os.path.join(tree, folder)
    if "." not in name:
        links += [(os.path.join(path, entry), os.path.join(source, entry)) for entry in sorted(os.listdir(source))]
    elif any(link == os.path.dirname(path) for link, _ in links):
        sys.exit(f"{name}: its parent package is a link into the checkout")
    else:
        links.append((path, source))
final = os.path.join(root, hashlib.sha256(repr(links).encode()).hexdigest()[:16])
if not os.path.isdir(final):
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(dir=root)
    for link, target in links:
        os.makedirs(os.path.dirname(os.path.join(work, link)), exist_ok=True)
        os.symlink(target, os.path.join(work, link))
    try:
        os.rename(work, final)
    except OSError:  # another run made the same links first
        shutil.rmtree(work)
print(final)
PYEOF
) || return 1
    export PYTHONPATH="$links${PYTHONPATH_GIVEN:+:$PYTHONPATH_GIVEN}"
}
use_tree . || { echo "benchmarks/gpu.sh: cannot lay out the tritium package's links" >&2; exit 1; }

if [ "$SET" = e2e ]; then  # its own default for OUT: bench_out/
    TRITIUM_COMMIT="${TRITIUM_COMMIT:-${COMMIT:-}}" exec bash benchmarks/lib/e2e.sh "$@"
fi
OUT="${OUT:?set OUT}" COMMIT="${COMMIT:-unknown}" PY="${IMAGE_PYTHON:-python3}"
LLAMA="${LLAMA:-llama-3-8b}" QWEN="${QWEN:-qwen2.5-1.5b}" QWEN7="${QWEN7:-qwen2.5-7b}"
SETS=" e2e serving round3 l-ttft fp8 quant-e2e w4a16 swap-sweeps w4a16-fragment ncu-w4a16 long-context frontend lora spec-decode draft-spec offload window-kv disagg sampling stream-interval kernels tests profile compare-trees ncu-attention "
[[ "$SETS" == *" $SET "* ]] || { echo "benchmarks/gpu.sh: unknown set '$SET' (one of:$SETS)" >&2; exit 2; }
mkdir -p "$OUT"

t0=$(date +%s); S="$OUT/summary.txt"
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$S"; }
logs() {  # the engine process's and the stub's own accounts of an e2e call
    local d; d=$(mktemp -d); tar -C "$d" -xzf "$1/logs.tar.gz" 2>/dev/null
    grep -rh -E "engine process:|sender thread|KV cache:|Triton (is )?compil" "$d" | cut -c1-900 >> "$S"; rm -rf "$d"
}
EXTRA=()
e2e() {  # name, e2e arguments...: keeps results.json and the summary lines
    local name="$1"; shift
    TRITIUM_COMMIT="$COMMIT" OUT="$OUT/$name" bash benchmarks/lib/e2e.sh "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1
    grep -E "workload [A-Z]:|output tok/s|TTFT" "$OUT/$name.log" >> "$S"
    logs "$OUT/$name"
    mv "$OUT/$name/results.json" "$OUT/${name}_results.json" 2>/dev/null
    # A phase that failed keeps its logs, and its errors go to the summary.
    if grep -q '"rc": [1-9]' "$OUT/${name}_results.json" 2>/dev/null; then
        mv "$OUT/$name/logs.tar.gz" "$OUT/${name}_logs.tar.gz" 2>/dev/null
        local d; d=$(mktemp -d); tar -C "$d" -xzf "$OUT/${name}_logs.tar.gz" 2>/dev/null
        echo "-- $name: a phase failed; its logs are in ${name}_logs.tar.gz; the errors:" >> "$S"
        grep -rh -E -A3 "Error|Traceback|error:" "$d" | grep -v "Warning" | tail -40 | cut -c1-400 >> "$S"; rm -rf "$d"
    fi
    rm -rf "${OUT:?}/$name" "$OUT/$name.log"
}
gpu_tests() {  # seconds, lines kept, pytest arguments...
    local limit=$1 lines=$2; shift 2
    timeout "$limit" "$PY" -m pytest "$@" -q -p no:cacheprovider --tb=short 2>&1 \
        | grep -v "^  warnings.warn\|Warning" | tail -"$lines" | cut -c1-900 >> "$S"
}
model_path() {  # a name under models/configs, or a directory
    if [ -d "$1" ]; then echo "$1"; else echo "models/configs/$1"; fi
}
with_xgrammar() {  # structured outputs need xgrammar, built by scripts/package_gpu_extras.sh
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/extras \
        gpu_extras/*.whl 2>&1 | tail -2 >> "$S"
    PYTHONPATH="/tmp/extras${PYTHONPATH:+:$PYTHONPATH}" "$@"
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv 2>&1 | tee -a "$S"

case "$SET" in
serving)
    EXTRA=("$@")
    for spec in "$LLAMA:llama" "$QWEN7:qwen7" "$QWEN:qwen15"; do
        stamp "${spec%%:*} bf16 A and B: Triton and in-process"
        e2e "${spec##*:}" --models "${spec%%:*}" --phases triton,offline --workloads A,B
    done ;;
fp8)
    EXTRA=("$@")
    stamp "$LLAMA bf16 A and B through Triton"
    e2e llama_bf16 --models "$LLAMA" --phases triton --workloads A,B
    stamp "$LLAMA FP8 weights A and B through Triton"
    e2e llama_fp8 --models "$LLAMA" --phases triton --workloads A,B --engine-arg quantization=fp8
    stamp "$LLAMA FP8 weights and FP8 KV cache A and B through Triton"
    e2e llama_fp8_kv_fp8 --models "$LLAMA" --phases triton --workloads A,B \
        --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        stamp "FP8 matmul against torch._scaled_mm and bf16 (rows 1, 4, 16)"
        timeout 240 "$PY" benchmarks/kernels/fp8_matmul.py --json "$OUT/fp8_matmul.json" 2>&1 | tail -30 >> "$S"
    fi ;;
quant-e2e)
    EXTRA=("$@")
    stamp "GPU tests: the fused FP8 quantizations, the FP8 few-row matmul, split-K slices left unsummed"
    gpu_tests 180 8 tests/kernels/test_kernel_fused_fp8_quant.py tests/kernels/test_kernel_fp8_matmul.py \
        tests/kernels/test_kernel_w4a16.py::test_unsummed_slices_add_up_to_the_output \
        tests/kernels/test_kernel_w4a16_fragment.py::test_unsummed_slices_add_up_to_the_output --confcutdir=tests
    stamp "$LLAMA bf16 A and B through Triton"
    e2e llama_bf16 --models "$LLAMA" --phases triton --workloads A,B
    stamp "$LLAMA AWQ (random 4-bit weights, groups of 128) A and B through Triton"
    e2e llama_awq --models "$LLAMA" --phases triton --workloads A,B --engine-arg quantization=awq
    stamp "$LLAMA FP8 weights A and B through Triton"
    e2e llama_fp8 --models "$LLAMA" --phases triton --workloads A,B --engine-arg quantization=fp8 ;;
swap-sweeps)
    # The swapped-operand kernels (W4A16 and the FP8 few-row matmul), one short call: their GPU
    # tests, the W4A16 sweep at $W4_SWEEP_ROWS (256,512,4096) and the FP8 default against its
    # swapped configs at $LLAMA's shapes; both config tables come back in $OUT (copy them into
    # kernels/configs/ to keep them), then the W4A16 table of every path at the chosen configs.
    stamp "GPU tests of the swapped kernels"
    gpu_tests 200 12 tests/kernels/test_kernel_w4a16.py tests/kernels/test_kernel_fp8_matmul.py \
        -k "swapped or matches_float64" --confcutdir=tests
    cp kernels/configs/w4a16.json "$OUT/w4a16_configs.json"
    stamp "W4A16 sweep, rows ${W4_SWEEP_ROWS:-256,512,4096}"
    timeout "${W4_SWEEP_LIMIT:-200}" "$PY" benchmarks/kernels/w4a16.py --sweep --rows "${W4_SWEEP_ROWS:-256,512,4096}" \
        --json "$OUT/w4a16_swap_sweep.json" --write-configs "$OUT/w4a16_configs.json" --no-repack 2>&1 \
        | grep -v "^  skip\|warm-up failed" | tail -20 | cut -c1-240 >> "$S"
    cp kernels/configs/fp8_matmul.json "$OUT/fp8_configs.json"
    stamp "FP8 few-row matmul: the default against the swapped configs, $LLAMA's shapes, rows 1, 4, 16"
    timeout "${FP8_SWEEP_LIMIT:-120}" "$PY" benchmarks/kernels/fp8_matmul.py --models "$LLAMA" --swapped-only \
        --json "$OUT/fp8_swap_sweep.json" --write-configs "$OUT/fp8_configs.json" 2>&1 | tail -20 >> "$S"
    cp "$OUT/w4a16_configs.json" kernels/configs/w4a16.json
    stamp "W4A16 table: every path at the configs now chosen"
    timeout "${W4_TABLE_LIMIT:-150}" "$PY" benchmarks/kernels/w4a16.py --paths --no-repack --json "$OUT/w4a16_paths.json" \
        2>&1 | grep -v "warm-up failed" | tail -32 >> "$S"
    stamp done ;;
w4a16-fragment)
    # The W4A16 kernel on fragment-ordered words: its GPU tests, then its table against cuBLAS
    # bf16 and the packed layout's path at every row count; the shapes where it wins go into
    # $OUT/w4a16_fragment_configs.json (copy it into kernels/configs/ to keep them).
    stamp "GPU tests of the fragment-order W4A16 kernel"
    gpu_tests 200 8 tests/kernels/test_kernel_w4a16_fragment.py --confcutdir=tests
    stamp "fragment-order W4A16 against cuBLAS bf16 and the engine's W4A16 path"
    cp kernels/configs/w4a16_fragment.json "$OUT/w4a16_fragment_configs.json" 2>/dev/null
    timeout "${FRAGMENT_LIMIT:-300}" "$PY" benchmarks/kernels/w4a16_fragment.py --rows "${FRAGMENT_ROWS:-1,8,16,64,256,512,4096}" ${FRAGMENT_LAYERS:+--layers "$FRAGMENT_LAYERS"} --json "$OUT/w4a16_fragment.json" \
        --write-configs "$OUT/w4a16_fragment_configs.json" 2>&1 | grep -v "Warning\|warnings.warn" | tail -36 >> "$S"
    stamp done ;;
w4a16)
    EXTRA=("$@")
    if [ -z "${NO_GPU_STEPS:-}" ]; then
        if [ "${W4_TESTS:-}" != none ]; then
            stamp "GPU tests: the W4A16 kernel (gemv, mma and dequant paths) and the AWQ/GPTQ engine"
            # shellcheck disable=SC2086
            gpu_tests 300 20 ${W4_TESTS:-tests/kernels/test_kernel_w4a16.py tests/kernels/test_kernel_split_k.py tests/engine/test_awq_gptq.py} --confcutdir=tests
        fi
        # In two halves of the row counts, each with its own limit, so that one that runs out
        # of time still leaves the other's table and configs (--write-configs merges into a copy
        # of the table, so other cards' entries stay).
        cp kernels/configs/w4a16.json "$OUT/w4a16_configs.json"
        for rows in ${W4_SWEEP_ROWS-1,8,16 64,256 512,4096}; do
            stamp "W4A16 table and sweep, rows $rows (kernels/configs/w4a16.json's entries written to \$OUT)"
            timeout "${W4_SWEEP_LIMIT:-280}" "$PY" benchmarks/kernels/w4a16.py --sweep --rows "$rows" --json "$OUT/w4a16_m${rows//,/_}.json" \
                --write-configs "$OUT/w4a16_configs.json" 2>&1 | grep -v "^  skip" | tail -40 | cut -c1-240 >> "$S"
        done
        # The swept configs serve the runs below (copy them into kernels/configs to keep them).
        [ -f "$OUT/w4a16_configs.json" ] && cp "$OUT/w4a16_configs.json" kernels/configs/w4a16.json
        stamp "W4A16 table: every path (gemv, mma, dequant) at the configs now chosen, against cuBLAS bf16"
        timeout "${W4_TABLE_LIMIT:-240}" "$PY" benchmarks/kernels/w4a16.py --paths --no-repack --json "$OUT/w4a16_paths.json" \
            2>&1 | grep -v "warm-up failed" | tail -30 >> "$S"
    fi
    [ -n "${NO_E2E:-}" ] && { stamp done; exit 0; }
    stamp "$LLAMA AWQ (random 4-bit weights, groups of 128) A and B through Triton"
    e2e llama_awq --models "$LLAMA" --phases triton --workloads A,B --engine-arg quantization=awq
    # An act-order checkpoint's shape: config.json declares GPTQ with desc_act, so the random
    # weights spread each group over K and the kernel gathers its inputs.
    ACT_ORDER=/tmp/$(basename "$LLAMA")-gptq-act-order
    rm -rf "$ACT_ORDER" && cp -r "$(model_path "$LLAMA")" "$ACT_ORDER"
    "$PY" - "$ACT_ORDER/config.json" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
json.dump(c, open(sys.argv[1], "w"), indent=1)
PYEOF
    stamp "$LLAMA GPTQ act-order (random 4-bit weights, groups of 128 spread over K) A and B through Triton"
    e2e llama_gptq_act_order --models "$ACT_ORDER" --phases triton --workloads A,B
    stamp "$LLAMA bf16 A and B through Triton (the same machine)"
    e2e llama_bf16 --models "$LLAMA" --phases triton --workloads A,B ;;
l-ttft)
    EXTRA=("$@")
    stamp "where workload L's TTFT goes: $QWEN7's 32,640-token prefill in-process, kernel by kernel"
    timeout 200 "$PY" -m benchmarks.engine.profile_kernels --model "$(model_path "$QWEN7")" \
        --tokenizer models/tiny-llama --num-requests 1 --input-len 32640 --output-len 16 \
        --skip-decode-steps 2 --whole-prefill --json "$OUT/profile_L.json" 2>&1 | grep -v "warn" | tail -40 >> "$S"
    stamp "prefill attention, 32,640 tokens in 8,192-token chunks, against SDPA on the whole prompt"
    timeout 150 "$PY" benchmarks/kernels/prefill_32k.py --json "$OUT/prefill_32k.json" 2>&1 | tail -8 >> "$S"
    stamp "$QWEN7 bf16 L through Triton, in-process and the Hugging Face anchor"
    e2e qwen7_l --models "$QWEN7" --phases triton,offline,hf --workloads L ;;
round3)
    EXTRA=("$@")
    stamp "$QWEN bf16 A: Triton and in-process (the response path's cost)"
    e2e qwen15_a --models "$QWEN" --phases triton,offline --workloads A
    stamp "paged decode, 1 x 32k, against SDPA on contiguous K/V (CUDA graph replays after an L2 flush)"
    timeout 120 "$PY" benchmarks/kernels/decode_32k.py --block-n 64,128 --warps 2,4 --stages 3 --splits 32,64 \
        --json "$OUT/decode_32k.json" 2>&1 | tail -12 >> "$S"
    stamp "$QWEN7 bf16 L: Triton and the Hugging Face anchor"
    e2e qwen7_l --models "$QWEN7" --phases triton,hf --workloads L
    stamp "$LLAMA FP8 weights and FP8 KV cache A through Triton"
    e2e llama_fp8_kv_fp8_a --models "$LLAMA" --phases triton --workloads A \
        --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8 ;;
long-context)
    EXTRA=("$@")
    stamp "$QWEN7 bf16 C and L: Triton and the Hugging Face anchor"
    e2e qwen7_long --models "$QWEN7" --phases triton,hf --workloads C,L ;;
frontend)
    EXTRA=("$@")
    stamp "$LLAMA bf16 A: gRPC direct, then the OpenAI frontend (one server)"
    e2e llama_frontend --models "$LLAMA" --phases frontend --workloads A ;;
lora)
    EXTRA=("$@")
    ADAPTERS="${LORA_DIR:-/tmp/tritium-lora-adapters}"
    stamp "writing 4 random rank-16 adapters for $LLAMA in $ADAPTERS"
    MODULES=$("$PY" - "$LLAMA" "$ADAPTERS" <<'EOF'
import json, os, sys
from tests.engine.lora_adapters import write_adapter
model = sys.argv[1] if os.path.isdir(sys.argv[1]) else os.path.join("models/configs", sys.argv[1])
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
paths = {f"a{i}": write_adapter(os.path.join(sys.argv[2], f"a{i}"), model, targets, 16, 32, seed=i, scale=0.01)
         for i in range(4)}
print(json.dumps(paths, separators=(",", ":")))
EOF
)
    echo "lora_modules=$MODULES" >> "$S"
    LORA=(--engine-arg enable_lora=true --engine-arg "lora_modules=$MODULES" --engine-arg max_lora_rank=16)
    stamp "$LLAMA bf16 A through Triton, no adapters (first)"
    e2e llama_base1 --models "$LLAMA" --phases triton --workloads A
    stamp "$LLAMA bf16 A through Triton, requests over 4 adapters, 4 slots"
    e2e llama_lora4 --models "$LLAMA" --phases triton --workloads A "${LORA[@]}" --lora-names a0,a1,a2,a3
    stamp "$LLAMA bf16 A through Triton, requests over 4 adapters, max_loras=2"
    e2e llama_lora4_slots2 --models "$LLAMA" --phases triton --workloads A "${LORA[@]}" \
        --engine-arg max_loras=2 --lora-names a0,a1,a2,a3
    stamp "$LLAMA bf16 A through Triton, no adapters (last)"
    e2e llama_base2 --models "$LLAMA" --phases triton --workloads A ;;
spec-decode)
    # SPEC_GRAPH_SEQS: most sequences that speculate (default: the engine's); SPEC_PARAMS: JSON
    # sampling parameters for every request, e.g. '{"repetition_penalty": 1.1}'.
    stamp "speculative decoding, $LLAMA bf16 in-process"
    timeout 540 "$PY" -m benchmarks.engine.spec_decode --model "$(model_path "$LLAMA")" --tokenizer models/tiny-llama \
        --k 4 --batch-sizes "${SPEC_BATCHES:-1,8,16,32}" ${SPEC_GRAPH_SEQS:+--spec-graph-seqs "$SPEC_GRAPH_SEQS"} \
        ${SPEC_PARAMS:+--params "$SPEC_PARAMS"} --json "$OUT/bench_spec_decode.json" "$@" 2>&1 \
        | grep -v "Warning\|warnings.warn" | tail -20 >> "$S" ;;
draft-spec)
    stamp "speculation with a draft model and an EAGLE-3 head, $LLAMA bf16 in-process, workload B"
    timeout 540 "$PY" -m benchmarks.engine.draft_speculation --model "$(model_path "$LLAMA")" \
        --tokenizer models/tiny-llama --k 4 --drafts draft_model,eagle3 --tau 2.08,3.53 \
        --json "$OUT/bench_draft_speculation.json" "$@" 2>&1 | grep -v "Warning\|warnings.warn" | tail -14 >> "$S" ;;
offload)
    stamp "multi-turn chat past the device cache, $LLAMA bf16 in-process: without and with swap_space"
    timeout 560 "$PY" -m benchmarks.engine.multi_turn_offload --model "$(model_path "$LLAMA")" \
        --tokenizer models/tiny-llama --engine-arg "num_kv_blocks=${OFFLOAD_BLOCKS:-2048}" \
        --swap-space "${OFFLOAD_SWAP:-24}" --json "$OUT/bench_multi_turn_offload.json" "$@" 2>&1 \
        | grep -v "Warning\|warnings.warn" | tail -8 >> "$S" ;;
window-kv)
    # name:tokens (Gemma-2-9B holds 8,192 positions)
    for spec in ${WINDOW_MODELS:-mistral-7b-v0.1:32768 gemma-2-9b:8192}; do
        m=${spec%%:*}; n=${spec##*:}
        stamp "KV memory of one $n-token request, $m bf16 in-process: window-aware, then every block kept"
        timeout 280 "$PY" -m benchmarks.engine.window_kv_memory --model "$(model_path "$m")" \
            --tokenizer models/tiny-llama --tokens "$n" "$@" \
            --json "$OUT/window_kv_memory_$m.json" 2>&1 | grep -v "Warning\|warnings.warn" | tail -6 >> "$S"
    done ;;
disagg)
    # nixl-cu12 for the image's Python 3.12, without its unused plugins, with the CUDA 12 runtime its
    # UCX CUDA module links (the image's torch brings CUDA 13's only): the wheel is over a call's size.
    mkdir -p /tmp/nixl-site && tar -xJf "${NIXL_TARBALL:-gpu_nixl/nixl_slim.tar.xz}" -C /tmp/nixl-site \
        || { echo "disagg: no NIXL archive (gpu_nixl/nixl_slim.tar.xz)" | tee -a "$S"; exit 1; }
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/nixl-site"
    stamp "NIXL block reads between two processes on one card against its copy rate (Llama-3-8B's cache shape)"
    timeout 150 "$PY" benchmarks/kernels/nixl_blocks.py --json "$OUT/nixl_blocks.json" 2>&1 \
        | grep -v -E "NIXL INFO|Warning|warnings.warn" | tail -20 >> "$S"
    [ -n "${NO_MIXED_LOAD:-}" ] && exit 0  # (the reads alone: a short call)
    stamp "mixed load, $LLAMA bf16, one GPU: colocated, then prefill and decode engines in two processes (NIXL)"
    timeout 420 "$PY" -m benchmarks.engine.disagg_mixed_load --model "$(model_path "$LLAMA")" \
        --tokenizer models/tiny-llama --check quiet --json "$OUT/disagg_mixed_load.json" "$@" \
        > "$OUT/disagg_mixed_load.log" 2>&1
    echo "disagg_mixed_load exit $?" >> "$S"
    grep -v -E "NIXL INFO|Warning|warnings.warn|^INFO:" "$OUT/disagg_mixed_load.log" | tail -16 >> "$S"
    grep -E "KV cache:" "$OUT/disagg_mixed_load.log" >> "$S" ;;
sampling)
    stamp "the sampler's host and device time per step (256 rows x 640 tokens)"
    timeout 120 "$PY" benchmarks/kernels/sampler.py --device "${SAMPLER_DEVICE:-cuda}" \
        --json "$OUT/bench_sampler.json" 2>&1 | tail -12 >> "$S"
    # TREES: other source trees (e.g. `git archive REV`), each measured after this one.
    MODEL=$(cd "$(model_path "$LLAMA")" && pwd) TOKENIZER=$(cd models/tiny-llama && pwd)  # before each cd into a tree
    for tree in . ${TREES:-}; do
        name=this; [ "$tree" = . ] || name=$(basename "$tree")
        # An older tree runs this tree's benchmark (it uses only the engine's public API); one from
        # before the tritium package runs its own, as this one imports the engine by that name.
        COST=(-m benchmarks.engine.sampling_cost)
        if [ "$tree" != . ] && packaged "$tree"; then
            mkdir -p "$tree/benchmarks/engine" "$tree/benchmarks/loadgen"
            cp benchmarks/offline.py "$tree/benchmarks/"
            cp benchmarks/engine/sampling_cost.py "$tree/benchmarks/engine/"
            cp benchmarks/loadgen/*.py "$tree/benchmarks/loadgen/"
        elif [ "$tree" != . ]; then
            COST=(benchmarks/engine/sampling_cost.py)
        fi
        stamp "sampling cost, $LLAMA bf16 A in-process, tree $name"
        (cd "$tree" && use_tree . && timeout "${COST_TIMEOUT:-200}" "$PY" "${COST[@]}" \
            --model "$MODEL" --tokenizer "$TOKENIZER" --rounds 2 \
            --variant 'pen_all:1:repetition_penalty=1.1,presence_penalty=0.1,frequency_penalty=0.1' \
            --variant 'pen_1in8:8:repetition_penalty=1.1' "$@" --json "$OUT/sampling_cost_$name.json" \
            2>&1 | grep -v "^  warnings.warn\|Warning" | tail -12 >> "$S")
    done ;;
stream-interval)
    EXTRA=("$@")
    for round in 1 2; do
        for si in 1 16; do
            stamp "$QWEN bf16 A through Triton, stream_interval=$si (round $round)"
            e2e "qwen15_si${si}_r${round}" --models "$QWEN" --phases triton --workloads A \
                --engine-arg stream_interval=$si
        done
    done ;;
kernels)
    stamp "GPU tests: attention kernels at long context"
    gpu_tests 240 20 tests/kernels/test_kernel_long_context_attention.py --confcutdir=tests/kernels
    stamp "kernel table (decode up to 1 x 32k and prefill, against PyTorch SDPA in the same run)"
    if [ "${1:-}" = --full ]; then KB=(); else KB=(--quick); fi
    timeout 480 "$PY" benchmarks/kernels/kernel_table.py "${KB[@]}" --out "$OUT/kernels.json" 2>&1 | tail -45 >> "$S" ;;
tests)
    stamp "GPU tests: the kernels"
    gpu_tests 240 8 tests/kernels --confcutdir=tests/kernels -x
    stamp "GPU tests: the engine against Hugging Face and the CPU engine; sampling, FP8, LoRA, compiles"
    gpu_tests 400 40 tests/engine/test_hf_parity.py tests/engine/test_sampling.py tests/engine/test_gpu_engine.py \
        tests/engine/test_fp8_kv_cache.py tests/engine/test_lora.py tests/engine/test_compile_watch.py \
        tests/engine/test_awq_gptq.py --confcutdir=tests/engine
    stamp "GPU tests: structured outputs"
    with_xgrammar gpu_tests 240 20 tests/engine/test_structured_output.py --confcutdir=tests/engine ;;
profile)
    for w in "A:256:64" "B:1:128"; do
        IFS=: read -r name n len <<<"$w"
        stamp "engine profile, workload $name-like ($n x 512 in, $len out)"
        timeout 240 "$PY" -m benchmarks.engine.profile_engine --model "$(model_path "$LLAMA")" --tokenizer models/tiny-llama \
            --num-requests "$n" --input-len 512 --output-len "$len" "$@" --json "$OUT/profile_$name.json" 2>&1 | tail -30 >> "$S"
    done
    stamp "GPU time per kernel per step, workload A"
    timeout 240 "$PY" -m benchmarks.engine.profile_kernels --model "$(model_path "$LLAMA")" --tokenizer models/tiny-llama \
        "$@" --json "$OUT/step_kernels.json" 2>&1 | tail -60 | cut -c1-160 >> "$S" ;;
compare-trees)
    # Machines differ by several percent, so only runs made one after the other on one GPU are
    # compared; alternating puts a machine's drift (clocks, temperature) on both sides.
    TREES=(".") ARGS=()
    while [ $# -gt 0 ]; do
        if [ "$1" = "--" ]; then shift; ARGS=("$@"); break; fi
        TREES+=("$1"); shift
    done
    [ ${#ARGS[@]} -gt 0 ] || ARGS=(--models "$LLAMA" --phases offline)
    ROOT=$(pwd)
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for tree in "${TREES[@]}"; do
            name="${round}_$(basename "$(cd "$tree" && pwd)")" dir=$(mktemp -d)
            # A tree from before benchmarks/ existed has the same runner as scripts/gpu_run.sh.
            runner=benchmarks/lib/e2e.sh; [ -f "$tree/$runner" ] || runner=scripts/gpu_run.sh
            (cd "$tree" && use_tree . && TRITIUM_BUNDLE="$ROOT/gpu_bundle" TRITIUM_COMMIT="$COMMIT" OUT="$dir" \
                bash "$runner" "${ARGS[@]}" > "$dir/run.log" 2>&1)
            { echo "round $round tree=$tree ${ARGS[*]}"
              grep -E "workload [A-Z]:|output tok/s|TTFT p50" "$dir/run.log" | sed 's/^/  /'; } | tee -a "$S"
            cp "$dir/results.json" "$OUT/$name.json" 2>/dev/null
            rm -rf "$dir"
        done
    done ;;
ncu-attention)
    # --time uses do_bench through the kernel's Python wrapper, so short kernels include its
    # host time; the ncu durations are the kernels' own.
    for args in "fp8_decode" "fp8_decode --sequential" "bf16_decode" "bf16_decode --sequential" \
        "fp8_decode --config block_n=256,num_warps=8,num_stages=2" \
        "fp8_decode --config block_n=128,num_warps=8,num_stages=2" \
        "fp8_decode --config block_n=64,num_warps=2,num_stages=3" "bf16_prefill" "fp8_prefill"; do
        # shellcheck disable=SC2086
        "$PY" benchmarks/kernels/ncu_attention.py $args --time 2>&1 | tail -3 >> "$S"
    done
    SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
              --section LaunchStats --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis)
    for c in fp8_decode bf16_decode bf16_prefill fp8_prefill; do
        k=_decode_kernel; [[ $c == *prefill ]] && k=_prefill_kernel
        timeout 150 ncu --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 "${SECTIONS[@]}" \
            "$PY" benchmarks/kernels/ncu_attention.py "$c" --iters 5 > "$OUT/ncu_$c.txt" 2>&1
        echo "ncu $c rc=$?" >> "$S"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Stall|Issue Slots" \
            "$OUT/ncu_$c.txt" | head -30 >> "$S"
    done ;;
ncu-w4a16)
    SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
              --section LaunchStats --section InstructionStats --section SchedulerStats --section SourceCounters)
    for rows in ${W4_ROWS:-1}; do
        for layer in qkv o gate_up down; do
            "$PY" benchmarks/kernels/ncu_w4a16.py "$layer" --rows "$rows" --time "$@" 2>&1 | tail -2 >> "$S"
            timeout 150 ncu --clock-control none -k "regex:_w4a16" --launch-skip 3 --launch-count 1 "${SECTIONS[@]}" \
                "$PY" benchmarks/kernels/ncu_w4a16.py "$layer" --rows "$rows" --iters 5 "$@" > "$OUT/ncu_${layer}_m$rows.txt" 2>&1
            echo "ncu $layer m$rows rc=$?" >> "$S"
            grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Issue Slots|Executed Ipc|L2 Hit|Warp Cycles Per Issued" \
                "$OUT/ncu_${layer}_m$rows.txt" | head -40 >> "$S"
        done
    done ;;
esac
stamp done
