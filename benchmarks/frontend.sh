#!/usr/bin/env bash
# The OpenAI frontend's cost, in one go: start tritonserver on a model repository and the frontend
# beside it, then run benchmarks/loadgen/bench.py for each workload over gRPC directly and through
# the frontend (streaming completions of the same shape of token-id prompts), and compare output
# tok/s.
#
#   benchmarks/frontend.sh --repo DIR --out-dir DIR [--workloads A] [--log FILE]
#                             [--port-base 8000] [--frontend-workers 4] [--ready-timeout 600]
#                             [-- BENCH_ARGS...]
#
# The frontend run uses other prompts (--seed 1) than the gRPC run (--seed 0), so that neither
# finds the other's prompts in the prefix cache. TRITIUM_VENV selects the environment (default
# .venv): it needs the frontend's packages (requirements.txt). Writes OUT_DIR/frontend_grpc_<w>.json,
# OUT_DIR/frontend_openai_<w>.json and OUT_DIR/frontend_vs_grpc.json (the ratios).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REPO="" OUT_DIR="" WORKLOADS="A" LOG="" PORT=8000 WORKERS=4 READY_TIMEOUT=600 BENCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --repo) REPO="$2"; shift 2 ;;
        --out-dir) OUT_DIR="$2"; shift 2 ;;
        --workloads) WORKLOADS="$2"; shift 2 ;;
        --log) LOG="$2"; shift 2 ;;
        --port-base) PORT="$2"; shift 2 ;;
        --frontend-workers) WORKERS="$2"; shift 2 ;;
        --ready-timeout) READY_TIMEOUT="$2"; shift 2 ;;
        --) shift; BENCH_ARGS=("$@"); break ;;
        *) echo "benchmarks/frontend.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$REPO" ] && [ -n "$OUT_DIR" ] || { echo "benchmarks/frontend.sh: --repo and --out-dir are required" >&2; exit 2; }
VENV="${TRITIUM_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
mkdir -p "$OUT_DIR"
LOG="${LOG:-$OUT_DIR/tritonserver.log}"
FRONTEND_LOG="$OUT_DIR/frontend.log"
FRONTEND_PORT=$((PORT + 3))

source benchmarks/lib/serve.sh
start_tritonserver "$REPO" "$PORT" "$LOG"
FRONTEND_PID=""
stop_all() {
    [ -n "$FRONTEND_PID" ] && kill -TERM "$FRONTEND_PID" 2>/dev/null
    stop_tritonserver
}
trap stop_all EXIT
trap 'exit 143' TERM INT
wait_until_ok tritonserver "http://127.0.0.1:$PORT/v2/models/llm/ready" "$SERVER_PID" "$READY_TIMEOUT" "$LOG" || exit 1

"$PY" -m frontend --triton-grpc "127.0.0.1:$((PORT + 1))" --host 127.0.0.1 --port "$FRONTEND_PORT" \
    --model llm --workers "$WORKERS" >"$FRONTEND_LOG" 2>&1 &
FRONTEND_PID=$!
echo "frontend pid $FRONTEND_PID ($WORKERS workers), log $FRONTEND_LOG"
# Its workers load the tokenizer (transformers, torch) at start-up: let that finish before the
# gRPC run, so that it does not share the CPU with it. /health answers 200 once every worker is up.
wait_until_ok frontend "http://127.0.0.1:$FRONTEND_PORT/health" "$FRONTEND_PID" "$READY_TIMEOUT" "$FRONTEND_LOG" || exit 1

rc=0
for w in ${WORKLOADS//,/ }; do
    "$PY" -m benchmarks.loadgen.bench --url "127.0.0.1:$((PORT + 1))" --model llm --workload "$w" --seed 0 \
        "${BENCH_ARGS[@]}" --json "$OUT_DIR/frontend_grpc_$w.json" || rc=$?
    "$PY" -m benchmarks.loadgen.bench --openai "http://127.0.0.1:$FRONTEND_PORT/v1" --wait-ready 120 --model llm \
        --workload "$w" --seed 1 "${BENCH_ARGS[@]}" --json "$OUT_DIR/frontend_openai_$w.json" || rc=$?
done
"$PY" - "$OUT_DIR" "$WORKLOADS" <<'PYEOF'
import json, os, sys
out, rows = sys.argv[1], {}
for w in sys.argv[2].split(","):
    try:
        g, o = (json.load(open(os.path.join(out, f"frontend_{k}_{w}.json")))["summary"] for k in ("grpc", "openai"))
    except (OSError, KeyError, ValueError) as e:
        print(f"workload {w}: no comparison ({e})"); continue
    ratio = o["output_tok_s"] / g["output_tok_s"]
    rows[w] = {"grpc_output_tok_s": g["output_tok_s"], "openai_output_tok_s": o["output_tok_s"],
               "ratio": ratio, "grpc_ttft_ms": g.get("ttft_ms"), "openai_ttft_ms": o.get("ttft_ms"),
               "grpc_itl_ms": g.get("itl_ms"), "openai_itl_ms": o.get("itl_ms"),
               "failed": [g["failed"], o["failed"]]}
    print(f"workload {w}: gRPC direct {g['output_tok_s']:,.1f} tok/s, through the frontend "
          f"{o['output_tok_s']:,.1f} tok/s: {ratio:.3f}x (the frontend costs {(1 - ratio) * 100:.1f}%)")
json.dump(rows, open(os.path.join(out, "frontend_vs_grpc.json"), "w"), indent=1)
PYEOF
exit "$rc"
