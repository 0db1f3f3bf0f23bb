#!/usr/bin/env bash
# Before/after on one GPU: the in-process workloads of scripts/gpu_run.sh for this tree and for
# other source trees, alternately (this, other, this, other, ...), so that a machine's drift
# (clocks, temperature) falls on both sides. Machines differ by several percent, so only runs
# made one after the other on one GPU are compared.
#
#   git archive <rev> | tar -x -C oldtree    (here; oldtree ignored through .git/info/exclude)
#   OUT=... ROUNDS=2 bash scripts/gpu_compare_trees.sh oldtree [more trees] [-- gpu_run.sh args]
#
# Carry gpu_bundle and the trees. Writes $OUT/compare.txt (one line per run) and each run's
# results.json as $OUT/<round>_<tree>.json.
set -uo pipefail
OUT="${OUT:?set OUT}" ROUNDS="${ROUNDS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TREES=(".") ARGS=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; ARGS=("$@"); break; fi
    TREES+=("$1"); shift
done
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--models llama-3-8b --phases offline)
mkdir -p "$OUT"
S="$OUT/compare.txt"
for round in $(seq 1 "$ROUNDS"); do
    for tree in "${TREES[@]}"; do
        name="${round}_$(basename "$(cd "$ROOT/$tree" && pwd)")"
        dir=$(mktemp -d)
        (cd "$ROOT/$tree" && TRITIUM_BUNDLE="$ROOT/gpu_bundle" OUT="$dir" \
            bash scripts/gpu_run.sh "${ARGS[@]}" > "$dir/run.log" 2>&1)
        { echo "round $round tree=$tree ${ARGS[*]}"
          grep -E "workload [A-Z]:|output tok/s|TTFT p50" "$dir/run.log" | sed 's/^/  /'; } | tee -a "$S"
        cp "$dir/results.json" "$OUT/$name.json" 2>/dev/null
        rm -rf "$dir"
    done
done
