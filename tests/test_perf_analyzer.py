"""Must-show 7: perf_analyzer runs the documented configuration against the CPU server and
reports throughput."""
import os
import re
import subprocess

from triton_server import ROOT

PERF_ANALYZER = os.path.join(ROOT, ".perf_analyzer", "perf_analyzer")


def test_perf_analyzer_streams_against_the_server(llm_server):
    if not os.path.exists(PERF_ANALYZER):  # `make test` installs it; a plain pytest run may not have
        subprocess.run([os.path.join(ROOT, "scripts", "install_perf_analyzer.sh")], check=True)
    out = subprocess.run([PERF_ANALYZER, "-m", "llm", "-u", llm_server.grpc_url, "-i", "grpc", "--async",
                          "--streaming", "--input-data", os.path.join(ROOT, "perf_analyzer_configs", "prompts.json"),
                          "--concurrency-range", "4", "--measurement-interval", "2000",
                          # Stability is the CI machine's, not the server's: a busy 2-core runner
                          # once gave three windows more than 2x apart (a 100% limit) ten times over.
                          "--stability-percentage", "500", "--max-trials", "20"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    throughput = float(re.search(r"^\s*Throughput: ([\d.]+) infer/sec", out.stdout, re.M).group(1))
    responses = float(re.search(r"Response Throughput: ([\d.]+) infer/sec", out.stdout).group(1))
    assert throughput > 0
    # 32 tokens per request, one streamed response each: about 32 responses per request.
    assert 16 * throughput < responses < 48 * throughput
