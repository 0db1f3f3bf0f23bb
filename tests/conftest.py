"""Shared fixtures: one real tritonserver serving the tiny model, for every test that needs it."""
import os

# Triton fixes interpreter mode when it is first imported, and some library in the session may
# import it before tests/kernels runs: without a GPU, decide it here, before anything else.
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
# One thread per process for torch's operations (and numpy's), here and in every process a test
# starts (servers, engines, tensor-parallel ranks): the models are tiny and each test runs several
# processes on few cores, where the threads of one operation wait for each other whole time
# slices whenever another process holds a core.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from triton_server import (TEST_ENGINE_ARGS, TritonServer, ensure_default_model, start_server,
                           wait_for_stopping_servers, write_model_repository)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return ensure_default_model()


@pytest.fixture(scope="session")
def llm_server(chat_stack) -> TritonServer:
    """tritonserver with the llm model (tiny model, CPU-sized KV cache) on free ports: chat_stack's,
    whose model is the tiny model with a chat template added (the same weights and tokenizer), so
    that the session starts one server for both."""
    return chat_stack[0]


@pytest.fixture(scope="session")
def chat_stack(tiny_model, tmp_path_factory):
    """tritonserver serving the tiny chat model as 'llm' and the OpenAI frontend in front of it:
    (server, frontend, model directory, a scratch directory), shared by the frontend tests that
    need no server options of their own (starting one costs ~15 s on the CPU)."""
    from frontend_server import start_stack
    tmp = tmp_path_factory.mktemp("chat_stack")
    server, frontend, model = start_stack(tiny_model, str(tmp))
    yield server, frontend, model, tmp
    frontend.stop()
    server.stop_in_background()


@pytest.fixture(scope="session")
def tool_stack(tmp_path_factory):
    """One tritonserver serving the tiny tool models (scripts/build_tool_model.py), the
    Hermes-format one as 'llm' and the Llama 3.1-format one as 'llama'; a frontend for each, with
    its parser: (server, hermes frontend, llama frontend). Shared by the tool-calling tests of
    chat and of /v1/responses."""
    from frontend_server import start_frontend
    from scripts import build_tool_model
    auto = ("--enable-auto-tool-choice", "--tool-call-parser")
    tmp = tmp_path_factory.mktemp("tools")
    repo = str(tmp / "repo")
    write_model_repository(repo, {"model": build_tool_model.ensure("hermes"), **TEST_ENGINE_ARGS})
    write_model_repository(repo, {"model": build_tool_model.ensure("llama3_json"), **TEST_ENGINE_ARGS},
                           name="llama")
    server = start_server(repo, str(tmp / "tritonserver.log"))
    frontends = []
    try:
        frontends.append(start_frontend(server.grpc_url, str(tmp / "hermes.log"), "--model", "llm",
                                        *auto, "hermes", "--reasoning-parser", "qwen3"))
        frontends.append(start_frontend(server.grpc_url, str(tmp / "llama.log"), "--model", "llama",
                                        *auto, "llama3_json"))
        yield server, *frontends
    finally:
        for frontend in frontends:
            frontend.stop()
        server.stop_in_background()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, show the log of the server the test used."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, TritonServer) and os.path.exists(value.log_path):
                report.sections.append((f"tritonserver log ({value.log_path})", value.log_tail()))


def pytest_sessionfinish(session, exitstatus):
    """Servers that fixtures stopped in the background have exited before pytest does."""
    wait_for_stopping_servers()
