"""The frontend's command line: its arguments and the app they configure (shared by the main
process and the worker processes of `frontend.workers`)."""
from __future__ import annotations

import argparse
import json
import os

from frontend.app import FrontendConfig, create_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m frontend",
                                 description="python -m frontend --triton-grpc localhost:8001 --port 9000")
    ap.add_argument("--triton-grpc", default="localhost:8001", help="tritonserver's gRPC address")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--model", action="append", default=[], dest="models",
                    help="a Triton model to serve (repeatable; default: every ready model)")
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: none)")
    ap.add_argument("--chat-template", help="a Jinja chat template file, used over the model's own")
    ap.add_argument("--tokenizer", help="tokenizer directory, over the one the model's config names")
    ap.add_argument("--workers", type=int, default=1,
                    help="server processes, each with its own gRPC channels (for high token rates)")
    ap.add_argument("--grpc-channels", type=int, default=None,
                    help="gRPC channels to Triton per worker, requests spread over them in turn "
                         "(default: TritonGateway's)")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                    help="uvicorn's event loop (auto: uvloop where installed)")
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> FrontendConfig:
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    return FrontendConfig(args.triton_grpc, tuple(args.models), args.api_key, template, args.tokenizer,
                          args.grpc_channels)


def app_factory():  # uvicorn's factory for worker processes: the config travels in the env
    return create_app(config_from(parse_args(json.loads(os.environ["TRITIUM_FRONTEND_ARGV"]))))
