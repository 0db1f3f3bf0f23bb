#!/usr/bin/env bash
# The end-to-end benchmark (users run it as `benchmarks/gpu.sh e2e`), in one call: for each model shape, the real tritonserver with
# the Tritium model (dummy weights) driven by benchmarks/loadgen/bench.py over gRPC streaming, the
# same workloads through the engine in-process (benchmarks/offline.py), and the Hugging Face anchor
# (benchmarks/hf.py). Run from the repository root with gpu_bundle/ carried along
# (scripts/package_gpu_bundle.sh builds it) and $OUT set:
#
#   benchmarks/gpu.sh e2e [--models llama-3-8b,qwen2.5-7b,qwen2.5-1.5b] [--phases triton,offline,hf]
#                      [--workloads A,B] [--hf-requests 256] [--budget 560] [--engine-arg K=V]...
#                      [--tokenizer vocab|DIR] [--device cuda] [--dtype bfloat16]
#                      [--num-requests N --input-len N --output-len N]   (smaller runs, all runners)
#                      [--lora-names a,b]   (Triton runner only: requests spread over these adapters)
#                      [--dry-run]   (print each model's workload plan and stop)
#   Workloads (benchmarks/loadgen/workloads.py): A throughput, B latency, C long-context
#   throughput, L batch-1 decode at 32k context. Per model, benchmarks/loadgen/workload_plan.py
#   skips those longer than the model serves and raises max_model_len when one needs more than the
#   repository's 2,048 (to 32,768 for C or L on a model that holds L); A and B alone keep the
#   defaults.
#   Phase `frontend` (not in the default list): benchmarks/frontend.sh, gRPC direct then the
#   OpenAI frontend in one server (FRONTEND_WORKERS, default 6; BENCH_PROCS client processes, 4).
#
# A model is a directory name under models/configs or a path to a model directory.
# Writes $OUT/results.json (every figure, ratios, targets) and $OUT/logs.tar.gz (all logs and
# per-run JSON), both refreshed after every phase so that a run cut off at its time limit still
# returns what it measured. Phases that would start after --budget seconds are skipped.
# Environment: IMAGE_PYTHON (python3: the interpreter holding torch), TRITIUM_BUNDLE
# (gpu_bundle), TRITIUM_BENCH_DIR (/tmp/tritium-bench), TRITIUM_PORT_BASE (8000), TRITIUM_COMMIT
# (recorded in results.json; the device copy has no .git).
# --num-requests etc. apply to every runner (HF too, overriding --hf-requests, which only caps
# the HF anchor's request count per workload).
set -uo pipefail
export PYTHONUNBUFFERED=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$(date +%s)
OUT="${OUT:-$ROOT/bench_out}"
BUNDLE="${TRITIUM_BUNDLE:-$ROOT/gpu_bundle}"
BASE="${TRITIUM_BENCH_DIR:-/tmp/tritium-bench}"
IMAGE_PY="${IMAGE_PYTHON:-python3}"
PORT="${TRITIUM_PORT_BASE:-8000}"

MODELS="llama-3-8b,qwen2.5-7b,qwen2.5-1.5b" PHASES="triton,offline,hf" WORKLOADS="A,B"
HF_REQUESTS=256 BUDGET=560 TOKENIZER="vocab" DEVICE=cuda DTYPE=bfloat16
SIZES=() ENGINE_SETS=() LORA_ARGS=() DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --models) MODELS="$2"; shift 2 ;;
        --phases) PHASES="$2"; shift 2 ;;
        --workloads) WORKLOADS="$2"; shift 2 ;;
        --hf-requests) HF_REQUESTS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --engine-arg) ENGINE_SETS+=(--set "$2"); shift 2 ;;
        --num-requests|--input-len|--output-len) SIZES+=("$1" "$2"); shift 2 ;;
        --lora-names) LORA_ARGS=(--lora-names "$2"); shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        *) echo "gpu.sh e2e: unknown argument $1" >&2; exit 2 ;;
    esac
done
# A misspelt workload stops the call here, not after the setup and once per model.
if ! err=$("$IMAGE_PY" -c 'import sys; from benchmarks.loadgen.workloads import parse_workload_names as p
p(sys.argv[1])' "$WORKLOADS" 2>&1); then
    echo "gpu.sh e2e: ${err##*$'\n'}" >&2; exit 2
fi

elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[gpu.sh e2e $(elapsed)s] $*"; }

model_dir() {  # a name under models/configs, or a path
    if [ -d "models/configs/$1" ]; then (cd "models/configs/$1" && pwd); else (cd "$1" 2>/dev/null && pwd); fi
}

# plan_workloads MODEL_DIR [JSON]: sets RUN_W (the workloads this model can serve), SKIP_W and
# LONG_SETS (a raised max_model_len for the repository, or nothing); the reasons go to stderr.
plan_workloads() {
    local line mml
    line=$("$IMAGE_PY" -m benchmarks.loadgen.workload_plan --model-dir "$1" --workloads "$WORKLOADS" "${SIZES[@]}" \
        "${ENGINE_SETS[@]}" ${2:+--json "$2"}) || return 1
    IFS=$'\t' read -r RUN_W SKIP_W mml <<<"$line"
    LONG_SETS=()
    [ "$mml" = "-" ] || LONG_SETS=(--set max_model_len="$mml")
}

if [ "$DRY_RUN" = 1 ]; then
    for spec in ${MODELS//,/ }; do
        MDIR="$(model_dir "$spec")" || true
        [ -n "$MDIR" ] || { say "no model directory for $spec"; continue; }
        plan_workloads "$MDIR" || { say "no workload plan for $spec"; exit 2; }
        say "dry run: $(basename "$spec"): run ${RUN_W}, skip ${SKIP_W}, engine ${LONG_SETS[*]:-as configured}"
    done
    exit 0
fi

WORK="$BASE/work" LOGS="$BASE/work/logs" V="$BASE/venv"
rm -rf "$WORK" && mkdir -p "$WORK" "$LOGS" "$OUT"

publish() {  # results.json + logs.tar.gz into $OUT, after every phase
    "$V/bin/python" -m benchmarks.loadgen.bench_report --work "$WORK" --out "$OUT/results.json" --quiet \
        >>"$LOGS/report.log" 2>&1
    tar -C "$WORK" -czf "$OUT/logs.tar.gz.part" . 2>/dev/null && mv "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
}

# phase MODEL NAME MAX_SECONDS COMMAND...: run with a deadline, log, record its status.
phase() {
    local model="$1" name="$2" cap="$3"; shift 3
    local left=$((BUDGET - $(elapsed) - 10))
    if [ "$left" -lt 30 ]; then
        say "SKIP $model/$name: budget spent"
        echo "{\"model\": \"$model\", \"phase\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": true}" >>"$WORK/phases.jsonl"
        return 1
    fi
    [ "$left" -lt "$cap" ] && cap=$left
    local t0 rc
    t0=$(date +%s.%N)
    say "START $model/$name (limit ${cap}s)"
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$LOGS/$model-$name.log"
    rc=${PIPESTATUS[0]}
    local dt
    dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    say "END $model/$name: ${dt}s, exit $rc"
    echo "{\"model\": \"$model\", \"phase\": \"$name\", \"rc\": $rc, \"seconds\": $dt, \"start\": $t0, \"end\": $(date +%s.%N)}" >>"$WORK/phases.jsonl"
    publish
    return "$rc"
}

setup() {  # once per machine: server unpacked into a venv whose numpy is 1.26
    [ -x "$V/bin/python" ] && [ -f "$V/.tritium-ready" ] && return 0
    rm -rf "$V"
    "$IMAGE_PY" -m venv "$V" || return 1
    local site image_site
    site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    image_site=$("$IMAGE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$V/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        "$BUNDLE"/numpy-1.26.4-*.whl "$BUNDLE"/tritonclient-*.whl "$BUNDLE"/python_rapidjson-*.whl || return 1
    # The OpenAI frontend and aiohttp (the frontend phase), when the bundle has them.
    if ls "$BUNDLE"/frontend-wheels/*.whl >/dev/null 2>&1; then
        "$V/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
            "$BUNDLE"/frontend-wheels/*.whl || return 1
    fi
    # The image's packages (torch, triton, transformers) after the venv's own: numpy 1.26 wins.
    echo "import site; site.addsitedir('$image_site')" >"$site/zz_image_site.pth"
    # Python's tarfile rather than tar -J: the image need not have xz.
    "$V/bin/python" -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' \
        "$BUNDLE"/tritonserver-2.51.0-py*.tar.xz "$site" || return 1
    # Exec bits: the archive keeps them, but be safe against unpackers that do not.
    chmod +x "$site/pytriton/tritonserver/bin/tritonserver" \
        "$site"/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub
    touch "$V/.tritium-ready"
}

tokenizer_dir() {  # $1: the model directory. Prompts are token ids; outputs become text.
    if [ "$TOKENIZER" = "vocab" ]; then
        # A byte-level BPE tokenizer of the model's vocabulary size, so that every generated
        # token has text to make, as with the model's real tokenizer (none is reachable here).
        local n dir
        n=$("$IMAGE_PY" -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["vocab_size"])' "$1") || return 1
        dir="$BASE/tokenizer-$n"
        if [ ! -f "$dir/tokenizer.json" ]; then
            say "building a $n-token tokenizer in $dir" >&2
            "$IMAGE_PY" scripts/build_bench_tokenizer.py --vocab-size "$n" --out "$dir" \
                >>"$LOGS/build_tokenizer.log" 2>&1 || return 1
        fi
        echo "$dir"
        return
    fi
    if [ ! -d "$TOKENIZER" ] && [ "$TOKENIZER" = "models/tiny-llama" ] && [ -f scripts/build_default_model.py ]; then
        say "building $TOKENIZER" >&2
        "$IMAGE_PY" scripts/build_default_model.py --out "$TOKENIZER" >"$LOGS/build_tokenizer.log" 2>&1
    fi
    (cd "$TOKENIZER" 2>/dev/null && pwd)
}

write_meta() {
    "$IMAGE_PY" - "$WORK/meta.json" "$MODELS" "$PHASES" "$WORKLOADS" "$HF_REQUESTS" "$DEVICE" "$DTYPE" \
        "$TOKENIZER" "${ENGINE_SETS[*]:-}" "${SIZES[*]:-}" "${LORA_ARGS[1]:-}" <<'EOF' || true
import json, os, platform, subprocess, sys, time
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return f"unavailable: {e}"
keys = ["models", "phases", "workloads", "hf_requests", "device", "dtype", "tokenizer", "engine_args", "sizes",
        "lora_names"]
meta = dict(zip(keys, sys.argv[2:]))
meta.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host=platform.node(), python=platform.python_version(),
            git_commit=os.environ.get("TRITIUM_COMMIT") or sh("git rev-parse HEAD 2>/dev/null") or "unknown (no .git)",
            gpu=sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
            torch=sh(f"{sys.executable} -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'"))
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
}

say "setup (bundle $BUNDLE)"
if ! setup >"$LOGS/setup.log" 2>&1; then
    cat "$LOGS/setup.log"; say "setup failed"; tar -C "$WORK" -czf "$OUT/logs.tar.gz" .; exit 1
fi
write_meta
export TRITIUM_VENV="$V"  # scripts/tritonserver runs the server in it
# The python backend's stub runs an isolated Python, blind to PYTHONPATH (gpu.sh's links to this
# tree's `tritium`): the venv names those directories in a .pth file, rewritten for each run's tree.
V_SITE=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tr ':' '\n' <<<"${PYTHONPATH:-}" | grep '^/' >"$V_SITE/zz_pythonpath.pth"
say "setup done"
# Clocks and power every 200 ms, summarized per phase in results.json
# (benchmarks/loadgen/gpu_telemetry.py).
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 200 >"$WORK/gpu_telemetry.csv" 2>/dev/null &
    TELEMETRY_PID=$!
    trap 'kill $TELEMETRY_PID 2>/dev/null' EXIT
fi

for spec in ${MODELS//,/ }; do
    MDIR="$(model_dir "$spec")" || true
    m="$(basename "$spec")"
    [ -n "$MDIR" ] || { say "no model directory for $spec"; continue; }
    TOK="$(tokenizer_dir "$MDIR")" || true
    [ -n "$TOK" ] || { say "no tokenizer for $spec ($TOKENIZER)"; continue; }
    mkdir -p "$WORK/$m"
    if ! plan_workloads "$MDIR" "$WORK/$m/workload_plan.json" 2>"$LOGS/$m-workload_plan.log"; then
        cat "$LOGS/$m-workload_plan.log"; say "no workload plan for $spec"; continue
    fi
    say "plan: $(cat "$LOGS/$m-workload_plan.log")"
    [ "$RUN_W" != "-" ] || { say "no workload of $WORKLOADS fits $m"; continue; }
    REPO="$BASE/repo-$m"
    # One configuration for both: the offline bench reads this config.pbtxt back. A given
    # --engine-arg comes last and wins.
    "$V/bin/python" -m benchmarks.loadgen.bench_model_repo --dest "$REPO" --set model="$MDIR" --set tokenizer="$TOK" \
        --set load_format=dummy --set dtype="$DTYPE" --set device="$DEVICE" --set max_num_seqs=256 \
        "${LONG_SETS[@]}" "${ENGINE_SETS[@]}" | tee "$WORK/$m/engine_args.txt"
    for p in ${PHASES//,/ }; do
        case "$p" in
            triton) phase "$m" triton 420 bash benchmarks/triton.sh --repo "$REPO" \
                --out-dir "$WORK/$m" --workloads "$RUN_W" --log "$LOGS/$m-tritonserver.log" \
                --port-base "$PORT" -- "${SIZES[@]}" "${LORA_ARGS[@]}" ;;
            frontend) phase "$m" frontend 480 bash benchmarks/frontend.sh --repo "$REPO" \
                --out-dir "$WORK/$m" --workloads "$RUN_W" --log "$LOGS/$m-frontend-tritonserver.log" \
                --port-base "$PORT" --frontend-workers "${FRONTEND_WORKERS:-6}" -- "${SIZES[@]}" \
                --procs "${BENCH_PROCS:-4}" --no-progress ;;
            offline) phase "$m" offline 300 "$V/bin/python" -m benchmarks.offline \
                --model-config "$REPO/llm/config.pbtxt" --workloads "$RUN_W" "${SIZES[@]}" \
                --json "$WORK/$m/offline.json" ;;
            hf) phase "$m" hf 300 "$IMAGE_PY" -m benchmarks.hf --config "$MDIR" --device "$DEVICE" \
                --dtype "$DTYPE" --workloads "$RUN_W" --max-requests "$HF_REQUESTS" "${SIZES[@]}" \
                --json "$WORK/$m/hf.json" ;;
            *) say "unknown phase $p" ;;
        esac
    done
done

publish
"$V/bin/python" -m benchmarks.loadgen.bench_report --work "$WORK" --out "$OUT/results.json"
say "done: $OUT/results.json, $OUT/logs.tar.gz"
