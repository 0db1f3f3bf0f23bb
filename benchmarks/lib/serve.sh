# Sourced by the benchmark scripts: start tritonserver in the background and wait for a URL.
# Expects ROOT and PY to be set. start_tritonserver leaves its pid in SERVER_PID; stop_tritonserver
# ends it (TERM, then KILL after a minute).

start_tritonserver() {  # REPO PORT_BASE LOG: HTTP on PORT_BASE, gRPC +1, metrics +2
    bash "$ROOT/scripts/tritonserver" --model-repository="$1" --http-port="$2" --grpc-port="$(($2 + 1))" \
        --metrics-port="$(($2 + 2))" >"$3" 2>&1 &
    SERVER_PID=$!
    echo "tritonserver pid $SERVER_PID, log $3"
}

stop_tritonserver() {
    kill -TERM "$SERVER_PID" 2>/dev/null || return 0
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    wait_for_idle_gpu
}

# The next run sizes its KV cache from the GPU memory free when it starts: a process of this one
# still holding memory (a stub or engine process outliving a killed server) would shrink or fail
# it. Memory in use, not the process list: inside a container that list can be empty.
wait_for_idle_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    local used
    for _ in $(seq 60); do
        used="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)"
        [ -z "$used" ] || [ "$used" -lt 2048 ] && return 0
        sleep 1
    done
    echo "a minute after tritonserver stopped the GPU still has $used MiB in use"
}
wait_until_ok() {  # WHAT URL PID TIMEOUT_S LOG: poll URL until it answers 200 or PID exits
    local what="$1" url="$2" pid="$3" timeout="$4" log="$5" t0
    t0=$(date +%s)
    until "$PY" -c "import urllib.request as u; u.urlopen('$url', timeout=2)" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "$what exited before $url answered; its log ends:"; tail -n 60 "$log"; return 1
        fi
        if [ $(($(date +%s) - t0)) -gt "$timeout" ]; then
            echo "$url did not answer within ${timeout}s; the $what log ends:"; tail -n 60 "$log"; return 1
        fi
        sleep 1
    done
    echo "$what ready after $(($(date +%s) - t0))s"
}
