"""benchmarks/response_path/run.py runs a small workload in-process and through a real
tritonserver with the synthetic executor, and its JSON holds every figure of the breakdown."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRITON_FIELDS = {"tok_s", "wall_s", "output_tokens", "failed", "responses", "send_s", "send_ms_per_response",
                 "sender_busy_s", "receiver_busy_s", "messages", "message_bytes", "outputs", "steps",
                 "step_loop_s", "step_cpu_s", "device_wait_s", "intake_s", "engine_span_s", "tail_s",
                 "stub_cpu_s", "server_cpu_s", "engine_cpu_s"}


def test_response_path_harness_runs_and_reports_its_breakdown(tmp_path):
    out = tmp_path / "rp.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.response_path.run", "--num-requests", "8",
                        "--input-len", "32", "--output-len", "8", "--repeats", "1", "--step-ms", "2",
                        "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Triton tok/s" in r.stdout and "median" in r.stdout
    result = json.loads(out.read_text())
    assert result["workload"] == {"num_requests": 8, "input_len": 32, "output_len": 8}
    assert result["engine_args"]["distributed_executor_backend"] == \
        "benchmarks.response_path.synthetic_executor.SyntheticExecutor"
    assert result["step_ms"] == "2.0"
    [run] = result["runs"]
    assert run["inprocess"]["output_tokens"] == run["triton"]["output_tokens"] == 64
    assert TRITON_FIELDS <= set(run["triton"]) and run["triton"]["failed"] == 0
    # Every streamed token crossed from the engine's process (warm-up requests included).
    assert run["triton"]["outputs"] >= 64 and run["triton"]["messages"] >= 1 and run["triton"]["message_bytes"] > 0
    assert 1 <= run["triton"]["responses"] <= run["triton"]["outputs"]
    assert run["triton"]["engine_span_s"] > 0 and run["triton"]["tail_s"] >= 0
    assert set(result["median"]["triton"]) >= TRITON_FIELDS - {"failed"} and "lost_pct" in result["median"]
