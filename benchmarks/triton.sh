#!/usr/bin/env bash
# One model through the real tritonserver: start it on a model repository, wait until the model
# is ready, run benchmarks/loadgen/bench.py for each workload, stop it (also when killed: a
# deadline's TERM reaches the whole process group).
#
#   benchmarks/triton.sh --repo DIR --out-dir DIR [--workloads A,B] [--log FILE]
#                           [--port-base 8000] [--ready-timeout 600] [-- BENCH_ARGS...]
#
# TRITIUM_VENV selects the environment scripts/tritonserver runs (default: .venv). Writes
# OUT_DIR/triton_<workload>.json.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REPO="" OUT_DIR="" WORKLOADS="A,B" LOG="" PORT=8000 READY_TIMEOUT=600 BENCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --repo) REPO="$2"; shift 2 ;;
        --out-dir) OUT_DIR="$2"; shift 2 ;;
        --workloads) WORKLOADS="$2"; shift 2 ;;
        --log) LOG="$2"; shift 2 ;;
        --port-base) PORT="$2"; shift 2 ;;
        --ready-timeout) READY_TIMEOUT="$2"; shift 2 ;;
        --) shift; BENCH_ARGS=("$@"); break ;;
        *) echo "benchmarks/triton.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$REPO" ] && [ -n "$OUT_DIR" ] || { echo "benchmarks/triton.sh: --repo and --out-dir are required" >&2; exit 2; }
VENV="${TRITIUM_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
LOG="${LOG:-$OUT_DIR/tritonserver.log}"
mkdir -p "$OUT_DIR"

source benchmarks/lib/serve.sh
start_tritonserver "$REPO" "$PORT" "$LOG"
trap stop_tritonserver EXIT
trap 'exit 143' TERM INT
wait_until_ok tritonserver "http://127.0.0.1:$PORT/v2/models/llm/ready" "$SERVER_PID" "$READY_TIMEOUT" "$LOG" || exit 1

rc=0
for w in ${WORKLOADS//,/ }; do
    "$PY" -m benchmarks.loadgen.bench --url "127.0.0.1:$((PORT + 1))" --model llm --workload "$w" \
        "${BENCH_ARGS[@]}" --json "$OUT_DIR/triton_$w.json" || rc=$?
done
exit "$rc"
