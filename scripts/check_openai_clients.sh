#!/usr/bin/env bash
# Drive the OpenAI frontend with two load tools written elsewhere, aiperf and genai-perf (chat,
# streaming; genai-perf through perf_analyzer), and fail on a failed request or on any warning of
# theirs other than those about the machine (no GPU telemetry, a slow event loop): a warning about
# the responses, such as aiperf's for a missing usage.prompt_tokens_details.cached_tokens, fails.
# Each tool lives in its own venv (their pins clash with the project's):
#
#   python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
#   python3 -m venv /tmp/genai-venv && /tmp/genai-venv/bin/pip install genai-perf==0.0.16
#   scripts/check_openai_clients.sh http://localhost:9000 [MODEL]     # MODEL: llm
#
# AIPERF_VENV, GENAI_PERF_VENV and TOKENIZER (default models/tiny-llama) override the defaults.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
URL="${1:?usage: scripts/check_openai_clients.sh URL [MODEL]}"
MODEL="${2:-llm}"
AIPERF="${AIPERF_VENV:-/tmp/aiperf-venv}/bin/aiperf"
GENAI_PERF="${GENAI_PERF_VENV:-/tmp/genai-venv}/bin/genai-perf"
TOKENIZER="${TOKENIZER:-$ROOT/models/tiny-llama}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
LOAD=(--concurrency 4 --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0
      --output-tokens-mean 16 --request-count 16 --tokenizer "$TOKENIZER")
# Warnings about this machine, not about the server's responses.
MACHINE='GPU Telemetry|Event loop for .* is taking too long|Skipping unreachable metrics|localhost:940[01]'
failed=0

check() {  # check NAME LOG: print the log's warnings and errors; fail on those not about the machine
    local name="$1" log="$2" found
    found="$(grep -E 'WARNING|ERROR|Traceback' "$log" | grep -Ev "$MACHINE" || true)"
    if [ -n "$found" ]; then
        echo "$name: warnings or errors:"; echo "$found"; failed=1
    else
        echo "$name: no warnings about the responses"
    fi
}

(cd "$OUT" && "$AIPERF" profile -m "$MODEL" --endpoint-type chat --streaming -u "$URL" "${LOAD[@]}" \
    --extra-inputs ignore_eos:true --use-server-token-count --ui-type none > aiperf.log 2>&1) \
    || { echo "aiperf failed:"; tail -30 "$OUT/aiperf.log"; failed=1; }
grep -q "errors=0" "$OUT/aiperf.log" || { echo "aiperf: some requests failed"; failed=1; }
grep -q "Usage Prompt Cache Read Tokens" "$OUT/aiperf.log" \
    || { echo "aiperf: no prompt-cache read tokens (usage.prompt_tokens_details.cached_tokens)"; failed=1; }
check aiperf "$OUT/aiperf.log"

(cd "$OUT" && PATH="$ROOT/.perf_analyzer:$PATH" "$GENAI_PERF" profile -m "$MODEL" --endpoint-type chat \
    --streaming -u "${URL#http://}" "${LOAD[@]}" > genai-perf.log 2>&1) \
    || { echo "genai-perf failed:"; tail -30 "$OUT/genai-perf.log"; failed=1; }
check genai-perf "$OUT/genai-perf.log"
exit $failed
