"""Where the Triton stub's sender thread spends its time under a burst of streams: start
tritonserver on the tiny model (the tests' settings), run client/bench.py against it, stop the
server and print the sender's own account (rounds, time in send(), time publishing metrics
before final responses). CPU machine; the question of docs/performance_notes.md row 72.

    python3 -m scripts.probes.sender_time [--num-requests 256] [--concurrency 64]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from triton_server import TEST_ENGINE_ARGS, ensure_default_model, start_server, write_model_repository  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    log = os.path.join(tmp, "tritonserver.log")
    repo = write_model_repository(os.path.join(tmp, "repo"), {"model": ensure_default_model(), **TEST_ENGINE_ARGS})
    server = start_server(repo, log)
    try:
        out = subprocess.run([sys.executable, os.path.join(ROOT, "client", "bench.py"), "--url", server.grpc_url,
                              "--model", "llm", "--num-requests", str(args.num_requests), "--input-len", "32",
                              "--output-len", "16", "--concurrency", str(args.concurrency), "--procs", "1",
                              "--no-progress"], capture_output=True, text=True, check=True)
        print("\n".join(line for line in out.stdout.splitlines() if "tok/s" in line or " ms " in line))
    finally:
        server.stop()
    with open(log, encoding="utf-8") as f:
        for line in f:
            if "tritium: sender thread" in line:
                print(line[line.index("tritium: sender thread"):].rstrip().rstrip('"'))


if __name__ == "__main__":
    main()
