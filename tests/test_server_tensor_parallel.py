"""tensor_parallel_size through the real tritonserver (CPU, gloo), set as the vLLM backend's
multi-GPU CI sets it (1/model.json, "distributed_executor_backend": "ray"): the same greedy text
as one rank; a rank killed while requests stream ends each of them once with an error, and an
unload/load serves again with no tensor-parallel process left behind."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from triton_server import (TEST_ENGINE_ARGS, StreamCollector, grpc_inputs, http_request, start_server,
                           wait_until, write_model_repository)

from scripts.build_default_model import build_model

PROMPTS = ["The engine streams tokens", "A cache block of the kernel", "Hello"]
MAX_TOKENS = 12


def _tp_workers(server_pid: int) -> set[int]:
    """The tensor-parallel rank processes started under this server (stub -> engine -> rank)."""
    parents, ranks = {}, set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(pid)] = int(fields[1])
        if b"tritium.worker.tp_worker" in cmd and fields[0] != "Z":
            ranks.add(int(pid))

    def under_server(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == server_pid:
                return True
        return False
    return {pid for pid in ranks if under_server(pid)}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tp-llama")), seed=1, arch="llama",
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tp_server(gqa_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_server")
    repo = write_model_repository(str(tmp / "repo"), {"model": gqa_model, **TEST_ENGINE_ARGS})
    with open(tmp / "repo" / "llm" / "1" / "model.json", "w", encoding="utf-8") as f:
        json.dump({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, f)
    server = start_server(repo, str(tmp / "tritonserver.log"), "--model-control-mode=explicit",
                          "--load-model=llm")
    yield server
    server.stop_in_background()


def _generate(server, prompt: str) -> str:
    status, body = http_request(f"{server.http_url}/v2/models/llm/generate",
                                {"text_input": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                 "temperature": 0, "exclude_input_in_output": True})
    assert status == 200, body
    return json.loads(body)["text_output"]


def test_greedy_text_matches_one_rank(tp_server, gqa_model):
    from tritium import LLM, SamplingParams
    llm = LLM(gqa_model, dtype="float32")
    want = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert [_generate(tp_server, p) for p in PROMPTS] == want


def test_ray_runs_the_ranks_as_tritiums_processes(tp_server):
    with open(tp_server.log_path, encoding="utf-8") as f:
        assert ("tritium: distributed_executor_backend=ray: the 2 tensor-parallel ranks run as Tritium's own "
                "processes on this host ('mp'), not as Ray workers") in f.read()
    assert len(_tp_workers(tp_server.proc.pid)) == 1  # rank 1; rank 0 is the engine's process


def test_killed_rank_fails_streams_once_and_reload_serves(tp_server):
    workers = _tp_workers(tp_server.proc.pid)
    assert len(workers) == 1  # rank 1
    stream = StreamCollector(tp_server.grpc_url)
    n = 3
    try:
        for i in range(n):
            stream.send(f"k{i}", grpc_inputs("killed while streaming", stream=True,
                                             sampling={"max_tokens": 1000, "ignore_eos": True}))
        assert wait_until(lambda: all(stream.results[f"k{i}"].texts for i in range(n)), 60)
        os.kill(workers.pop(), signal.SIGKILL)
        errors = [stream.next_error(timeout=60) for _ in range(n)]
        assert all("tensor-parallel rank 1" in e and "killed by signal 9" in e for e in errors), errors
        assert all(r.finals == 0 and r.after_final == 0 for r in stream.results.values())
    finally:
        stream.close()
    for action in ("unload", "load"):
        status, body = http_request(f"{tp_server.http_url}/v2/repository/models/llm/{action}", {},
                                    timeout=240)
        assert status == 200, body
    # No orphan: the one rank process under the server is the reloaded engine's rank 1.
    assert len(_tp_workers(tp_server.proc.pid)) == 1
    assert _generate(tp_server, "after reload")
