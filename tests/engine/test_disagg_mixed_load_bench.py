"""benchmarks/engine/disagg_mixed_load.py end to end on the CPU: both configurations run, each
with finite TTFT and inter-token percentiles for the streams and the long prompts, the decode
engine read the prompts' blocks through NIXL, and the greedy tokens of the two are equal, under load
and for the probes sent alone afterwards."""
from __future__ import annotations

import json
import math
import subprocess
import sys


def test_the_benchmark_runs_both_configurations_with_equal_tokens(llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.engine.disagg_mixed_load", "--device", "cpu", "--model", llama_dir,
           "--streams", "3", "--stream-output-len", "10", "--long-prompts", "2", "--long-output-len", "5",
           "--warmup", "0", "--probes", "2", "--probe-output-len", "4", "--timeout-s", "60", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    configs = result["configurations"]
    assert set(configs) == {"colocated", "disaggregated"} and result["device"] == "cpu"
    for name, figures in configs.items():
        for metric in ("long_ttft", "long_itl", "stream_ttft", "stream_itl"):
            for p in ("p50", "p99"):
                value = figures[f"{metric}_{p}_ms"]
                assert math.isfinite(value) and value >= 0, (name, metric, p, value)
        assert figures["long_requests"] == 2 and figures["output_tok_s"] > 0 and not figures["errors"]
    transfer = configs["disaggregated"]["transfer"]
    assert transfer["transfers"] >= 2 and transfer["blocks"] > 0 and transfer["bytes"] > 0
    assert transfer["prefills_without_params"] == 0
    check = result["tokens_check"]
    assert check["ok"] and check["longs_compared"] == 2 and check["equal"] == check["compared"] >= 2
    assert check["probes_equal"] == check["probes_compared"] == 2 and check["colocated_unstable"] == []
    probes = result["probe_tokens"]
    assert set(probes["colocated"]) == {"w-q0", "q0", "r0", "w-q1", "q1", "r1"} and set(probes["disaggregated"]) == {"q0", "q1"}
    assert probes["colocated"]["q1"] == probes["colocated"]["r1"] == probes["disaggregated"]["q1"]
    assert len(probes["colocated"]["q0"]) == 4
    assert "greedy tokens (exact): probes alone 2/2 equal" in run.stdout and ": OK" in run.stdout
