"""python -m frontend --triton-grpc localhost:8001 --port 9000"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile

from tritium.frontend.cli import config_from, parse_args
from tritium.frontend.metrics import MULTIPROC_DIR


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config_from(args)  # fail now on a bad --chat-template
    os.environ["TRITIUM_FRONTEND_ARGV"] = json.dumps(argv)
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 -> Triton gRPC {args.triton_grpc}",
          flush=True)
    if args.workers > 1 and MULTIPROC_DIR not in os.environ:
        # Each worker writes its metrics there, and any of them answers /metrics with the sum.
        os.environ[MULTIPROC_DIR] = tempfile.mkdtemp(prefix="tritium-frontend-metrics-")
        try:
            return _serve(args, argv)
        finally:
            shutil.rmtree(os.environ.pop(MULTIPROC_DIR), ignore_errors=True)
    return _serve(args, argv)


def _serve(args: argparse.Namespace, argv: list[str]) -> int:
    if args.workers > 1 and hasattr(socket, "SO_REUSEPORT") and sys.platform.startswith("linux"):
        from tritium.frontend.workers import serve_workers

        return serve_workers(argv, args.workers)
    import uvicorn

    # One worker; or where SO_REUSEPORT does not spread connections: uvicorn's own workers.
    uvicorn.run("tritium.frontend.cli:app_factory", factory=True, host=args.host, port=args.port,
                workers=args.workers, loop=args.loop, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
