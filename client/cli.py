"""Command-line client: streams tokens from the `llm` model as they arrive.

    python -m client "The capital of France is"                 # gRPC stream, localhost:8001
    python -m client --http --url localhost:8000 "Hello"         # HTTP generate_stream (SSE)
    python -m client --temperature 0 --max-tokens 64 --stop "." "Once upon a time"

It speaks the request interface of Triton's vLLM backend, so it also works with that backend.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    p.add_argument("--url", help="server address (default localhost:8001, or localhost:8000 with --http)")
    p.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC")
    p.add_argument("--model", default="llm", help="model name (default: llm)")
    p.add_argument("--no-stream", action="store_true", help="one response with the whole completion")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--lora", help="the LoRA adapter to run with (the model's multi_lora.json names)")
    p.add_argument("--sampling", default="{}", help="more sampling parameters as a JSON object")
    return p.parse_args(argv)


def sampling_parameters(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.ignore_eos:
        params["ignore_eos"] = True
    if args.lora:
        params["lora_name"] = args.lora
    params.update(json.loads(args.sampling))
    return params


def stream_grpc(url: str, model: str, prompt: str, params: dict, stream: bool, out: TextIO) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: Any, dtype: str):
        array = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), "BYTES"), tensor("stream", stream, "BOOL"),
              tensor("sampling_parameters", json.dumps(params).encode("utf-8"), "BYTES"),
              tensor("exclude_input_in_output", True, "BOOL")]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    cancel = True
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get()
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if any(o.name == "text_output" for o in response.outputs):
                out.write(result.as_numpy("text_output")[0].decode("utf-8"))
                out.flush()
            if response.parameters["triton_final_response"].bool_param:
                cancel = False
                return
    finally:  # on Ctrl-C the server aborts the request and frees its KV blocks
        client.stop_stream(cancel_requests=cancel)
        client.close()


def stream_http(url: str, model: str, prompt: str, params: dict, stream: bool, out: TextIO) -> None:
    endpoint = "generate_stream" if stream else "generate"
    body = json.dumps({"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
                       "parameters": params}).encode("utf-8")
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as response:
            if not stream:
                out.write(json.loads(response.read())["text_output"])
                return
            for line in response:  # server-sent events, one per response
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(event["error"])
                out.write(event.get("text_output", ""))
                out.flush()
    except urllib.error.HTTPError as e:
        raise RuntimeError(json.loads(e.read() or b"{}").get("error", str(e))) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = sampling_parameters(args)
    except json.JSONDecodeError as e:
        print(f"error: --sampling is not valid JSON: {e}", file=sys.stderr)
        return 2
    url = args.url or ("localhost:8000" if args.http else "localhost:8001")
    send = stream_http if args.http else stream_grpc
    try:
        send(url, args.model, prompt, params, not args.no_stream, sys.stdout)
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print()
    return 0
