#!/usr/bin/env bash
# Streaming throughput through the real tritonserver for several stream_interval values, one
# server life each, alternately (ROUNDS rounds): the default model with max_num_seqs=256 and
# 256 streams of 32 prompt / 128 output tokens from client/bench.py. Prints the client's figures
# and the model's unload log (responses sent, the sender's and receiver's busy time). Edits
# model_repository/llm/config.pbtxt while it runs and restores it. Run from a checkout with
# `make venv model` done:
#
#   ROUNDS=2 scripts/probes/bench_stream_interval.sh 1 16
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROUNDS="${ROUNDS:-2}" PORT="${PORT:-18000}"
cfg=model_repository/llm/config.pbtxt
orig=$(mktemp)
cp "$cfg" "$orig"
trap 'cp "$orig" "$cfg"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for si in "$@"; do
    cp "$orig" "$cfg"
    sed -i 's/key: "max_num_seqs" value { string_value: "[0-9]*" }/key: "max_num_seqs" value { string_value: "256" }/' "$cfg"
    echo "parameters { key: \"stream_interval\" value { string_value: \"$si\" } }" >> "$cfg"
    log=$(mktemp)
    scripts/tritonserver --model-repository=model_repository --http-port="$PORT" \
        --grpc-port=$((PORT + 1)) --metrics-port=$((PORT + 2)) > "$log" 2>&1 &
    server=$!
    for _ in $(seq 1 90); do sleep 2; grep -q "Started GRPCInferenceService" "$log" && break; done
    .venv/bin/python -m client.bench --url "localhost:$((PORT + 1))" --num-requests 256 --input-len 32 \
        --output-len 128 --vocab-range 2:500 --procs 1 --no-progress 2>&1 \
        | grep -E "output tok/s|TTFT|ITL" | sed "s/^/round $round stream_interval=$si: /"
    pkill -INT -f "tritonserver.*--grpc-port=$((PORT + 1))"
    wait "$server"
    grep -o "sender thread: .*" "$log" | sed "s/^/round $round stream_interval=$si: /"
    rm -f "$log"
  done
done
