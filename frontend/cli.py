"""The frontend's command line: its arguments and the app they configure (shared by the main
process and the worker processes of `frontend.workers`)."""
from __future__ import annotations

import argparse
import json
import os

from tritium.frontend.app import FrontendConfig, create_app
from tritium.frontend.chat_output import ChatParsing
from tritium.frontend.reasoning import REASONING_PARSERS
from tritium.frontend.tool_parsers import TOOL_PARSERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m frontend",
                                 description="python -m frontend --triton-grpc localhost:8001 --port 9000")
    ap.add_argument("--triton-grpc", default="localhost:8001", help="tritonserver's gRPC address")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--model", action="append", default=[], dest="models",
                    help="a Triton model to serve (repeatable; default: every ready model)")
    ap.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                    help="vLLM's: the names the one --model is served under (e.g. its Hugging Face "
                         "id); the first is reported in responses' model, each is accepted in "
                         "requests (default: the Triton model's name)")
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: none)")
    ap.add_argument("--chat-template", help="a Jinja chat template file, used over the model's own")
    ap.add_argument("--tokenizer", help="tokenizer directory, over the one the model's config names")
    ap.add_argument("--workers", type=int, default=1,
                    help="server processes, each with its own gRPC channels (for high token rates)")
    ap.add_argument("--grpc-channels", type=int, default=None,
                    help="gRPC channels to Triton per worker, requests spread over them in turn "
                         "(default: TritonGateway's)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="let the model decide when to call tools (tool_choice 'auto', the default "
                         "with tools); needs --tool-call-parser")
    ap.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                    help="the format of the served model's tool calls: hermes (Qwen2.5, Qwen3, "
                         "Hermes), llama3_json (Llama 3.1/3.2), mistral, pythonic (Llama 3.2/4's "
                         "Python list of calls) or qwen3_coder (Qwen3-Coder's XML)")
    ap.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                    help="leave the request's tools out of the chat template under tool_choice "
                         "'none' (default: the template gets them, as in vLLM)")
    ap.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                    help="put the model's <think>...</think> in reasoning_content: qwen3 or deepseek_r1")
    ap.add_argument("--triton-metrics", default=None, metavar="URL",
                    help="Triton's metrics endpoint, whose vllm: families GET /metrics passes on "
                         "(default: http://<gRPC host>:8002/metrics; '' for none)")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                    help="uvicorn's event loop (auto: uvloop where installed)")
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> FrontendConfig:
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    try:
        parsing = ChatParsing(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser,
                              args.exclude_tools_when_tool_choice_none)
    except ValueError as e:
        raise SystemExit(f"python -m frontend: {e}") from None
    if args.served_model_name and len(args.models) != 1:
        raise SystemExit("python -m frontend: --served-model-name names one Triton model: give it "
                         f"with one --model (got {len(args.models)})")
    return FrontendConfig(args.triton_grpc, tuple(args.models), args.api_key, template, args.tokenizer,
                          args.grpc_channels, parsing, args.triton_metrics,
                          served_model_names=tuple(args.served_model_name))


def app_factory():  # uvicorn's factory for worker processes: the config travels in the env
    return create_app(config_from(parse_args(json.loads(os.environ["TRITIUM_FRONTEND_ARGV"]))))
