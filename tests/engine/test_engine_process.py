"""EngineProcess: the engine in a child process behind StreamingEngine's interface."""
from __future__ import annotations

import os
import re
import signal
import pickle
import threading
import time

import pytest

from tritium import LLM, EngineArgs, EngineProcess, EngineShutdownError, SamplingParams
from tritium.engine.request import accumulate


class Collector:
    def __init__(self) -> None:
        self.total = None
        self.finals = 0
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.total = accumulate(self.total, out)
        if out.finished:
            self.finals += 1
            self.done.set()


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = EngineProcess(EngineArgs(model=llama_dir, max_model_len=128))
    yield eng
    eng.shutdown()


def test_outputs_equal_the_in_process_engine(engine, llama_dir):
    prompts = [[0, 3, 9, 27], [0, 81, 243], [0, 5]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    collectors = [Collector() for _ in prompts]
    for i, (p, c) in enumerate(zip(prompts, collectors)):
        engine.add_request(f"p{i}", p, params, c)
    ref = LLM(llama_dir, max_model_len=128).generate(prompts, params)
    for c, r in zip(collectors, ref):
        assert c.done.wait(60) and c.finals == 1
        got = c.total.outputs[0]
        assert got.token_ids == r.outputs[0].token_ids and got.text == r.outputs[0].text
        assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in r.outputs[0].logprobs]
        assert c.total.prompt_token_ids == r.prompt_token_ids and got.finish_reason == "length"
    stats = engine.get_stats()
    assert stats.generation_tokens >= 60 and stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_the_statistics_arrive_ahead_of_each_final_output(engine):
    """What a metrics flush before a final response publishes comes without asking the engine:
    when the final output reaches its callback, the pushed statistics already count it."""
    engine.get_stats()  # what came before
    seen = []

    def on_output(out) -> None:
        if out.finished:
            stats = engine.pushed_stats()
            seen.append(None if stats is None else (sum(stats.request_success.values()),
                                                    len(stats.e2e_request_latency), stats.generation_tokens))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = engine.get_stats()
    for i in range(3):
        done = Collector()
        engine.add_request(f"pushed{i}", [0, 7, i + 1], params, lambda out, done=done: (on_output(out), done(out)))
        assert done.done.wait(60)
    finished = sum(before.request_success.values())
    assert seen == [(finished + i + 1, 1, before.generation_tokens + 6 * (i + 1)) for i in range(3)]
    assert engine.pushed_stats() is None  # each was taken once


def test_statistics_not_taken_yet_merge_and_keep_every_sample():
    from tritium.engine.metrics import EngineStats, StatsMailbox
    box = StatsMailbox()
    box.put(EngineStats(num_running=2, generation_tokens=5, e2e_request_latency=[0.5], iteration_tokens=[3]))
    box.put(EngineStats(num_running=1, generation_tokens=9, e2e_request_latency=[0.25]))
    stats = box.take()
    assert (stats.num_running, stats.generation_tokens) == (1, 9)
    assert stats.e2e_request_latency == [0.5, 0.25] and stats.iteration_tokens == [3]
    assert box.take() is None
    # An answer asked for: only one that arrives after the question ends the wait.
    box.put(EngineStats(generation_tokens=10))
    answer = box.ask(lambda: threading.Timer(0.2, box.put, [EngineStats(generation_tokens=11)]).start(),
                     lambda: False, 5)
    assert answer.generation_tokens == 11


def test_bad_input_is_rejected_in_the_caller(engine):
    with pytest.raises(ValueError, match="The prompt has 200 tokens, but max_model_len is 128"):
        engine.add_request("long", list(range(200)), SamplingParams(), Collector())
    with pytest.raises(ValueError, match="The prompt is empty."):
        engine.add_request("empty", "", SamplingParams(), Collector())


def test_abort_ends_the_request(engine):
    c = Collector()
    engine.add_request("ab", [0, 1], SamplingParams(max_tokens=100, ignore_eos=True), c)
    engine.abort("ab")
    assert c.done.wait(30)
    assert c.total.outputs[0].finish_reason == "abort" and len(c.total.outputs[0].token_ids) < 100


def test_shutdown_and_a_dead_child_end_every_request(llama_dir):
    eng = EngineProcess(EngineArgs(model=llama_dir))
    c = Collector()
    eng.add_request("x", [0, 1], SamplingParams(max_tokens=2000, ignore_eos=True), c)
    eng.shutdown()
    assert c.done.is_set() and c.finals == 1
    assert c.total.error == "The engine is shutting down."
    assert eng._proc.returncode == 0
    with pytest.raises(EngineShutdownError):
        eng.add_request("y", [0, 1], SamplingParams(), Collector())

    eng = EngineProcess(EngineArgs(model=llama_dir))
    c = Collector()
    eng.add_request("z", [0, 1], SamplingParams(max_tokens=2000, ignore_eos=True), c)
    os.kill(eng._proc.pid, signal.SIGKILL)
    assert c.done.wait(30)
    assert c.total.error == "The engine process exited unexpectedly; the request did not finish."
    # The socket closes as the child dies; its exit status comes a moment later.
    deadline = time.monotonic() + 10
    while eng.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.exit_code() == -signal.SIGKILL
    eng.shutdown()


def test_engine_errors_at_start_reach_the_caller(llama_dir):
    with pytest.raises(ValueError, match="max_model_len=100000 is larger than the model's"):
        EngineProcess(EngineArgs(model=llama_dir, max_model_len=100000))


def test_the_stub_side_of_the_engine_does_not_import_torch():
    """The Triton stub imports these to talk to the engine's process; torch (seconds and
    hundreds of MB per model load) belongs to that process only."""
    import subprocess
    import sys
    code = ("import sys; import tritium, tritium.drivers.engine_process, tritium.serving.triton_request, "
            "tritium.serving.triton_metrics, tritium.serving.triton_config, tritium.engine.request; "
            "from tritium import EngineProcess, EngineShutdownError, SamplingParams; "
            "print(sorted(m for m in ('torch', 'triton', 'tritium.kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_engine_process_logs_its_step_and_send_time_at_exit(llama_dir, capfd):
    eng = EngineProcess(EngineArgs(model=llama_dir, max_model_len=128))
    c = Collector()
    eng.add_request("t", [0, 1], SamplingParams(max_tokens=4, ignore_eos=True), c)
    assert c.done.wait(60)
    eng.shutdown()
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "engine process:" in x)
    steps, step_s, cpu_s, busy_s, outputs, messages, nbytes = re.search(
        r"engine process: (\d+) steps in ([\d.]+) s \(([\d.]+) s of CPU on the step loop's thread\) "
        r"over ([\d.]+) s busy, of which [\d.]+ s waiting for the device; (\d+) outputs in (\d+) "
        r"messages \((\d+) bytes\), [\d.]+ s packing and sending them", line).groups()
    assert int(steps) >= 4 and int(outputs) >= 4
    assert 1 <= int(messages) <= int(outputs) and int(nbytes) > 40 * int(messages)  # a pickled Outputs each
    assert float(cpu_s) <= float(step_s) + 0.01  # a thread's CPU time cannot exceed its wall time
    assert float(step_s) <= float(busy_s) + 0.01  # the steps happen within the busy time


def test_text_made_in_the_parent_equals_the_engines(engine, llama_dir):
    """The engine process sends token ids only (except for requests with stop strings) and the
    parent detokenizes: text, streamed piece by piece, must equal the in-process engine's, with
    special tokens kept or skipped, a stop token's text left out, and n samples apart."""
    llm = LLM(llama_dir, max_model_len=128)
    prompt = [0, 7, 300, 41, 2]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    stop_id = ids[6]  # a token this prompt generates: the request ends there with reason "stop"
    words = free.outputs[0].text
    stop_str = words[len(words) // 2:len(words) // 2 + 3]
    cases = {
        "plain": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        "specials": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                   skip_special_tokens=False, spaces_between_special_tokens=False),
        "stop_id": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
        "n2": SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=16, ignore_eos=True),
        "stop_str": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_str]),
    }
    collectors = {name: Collector() for name in cases}
    for name, params in cases.items():
        engine.add_request(f"text-{name}", prompt, params, collectors[name])
    for name, params in cases.items():
        ref = llm.generate([prompt], params)[0]
        c = collectors[name]
        assert c.done.wait(60) and c.finals == 1, name
        got = sorted(c.total.outputs, key=lambda o: o.index)
        assert len(got) == params.n
        for g, r in zip(got, sorted(ref.outputs, key=lambda o: o.index)):
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
                   (r.token_ids, r.text, r.finish_reason, r.stop_reason), name
    assert collectors["stop_id"].total.outputs[0].finish_reason == "stop"
    assert collectors["stop_id"].total.outputs[0].token_ids[-1] == stop_id
    assert collectors["stop_str"].total.outputs[0].stop_reason == stop_str


def test_an_engine_that_leaves_text_to_its_reader(llama_dir):
    from tritium import LLMEngine
    eng = LLMEngine(EngineArgs(model=llama_dir, max_model_len=128), detokenize=False)
    eng.add_request("ids", [0, 7, 300], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.add_request("stop", [0, 7, 300], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                         stop=["never-generated"]))
    totals = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            totals[d.request_id] = accumulate(totals.get(d.request_id), d)
    assert len(totals["ids"].outputs[0].token_ids) == 8 and totals["ids"].outputs[0].text == ""
    assert totals["stop"].outputs[0].text != ""  # stop strings need the text in the engine


def _outbox_sends(items: list) -> tuple[list, dict]:
    """Queue `items` and a Bye in an Outbox before its thread can drain (its queue's mutex held
    meanwhile), and return what the other end receives, up to the Bye, and the outbox's stats."""
    import socket
    from multiprocessing.connection import Connection

    from tritium.drivers.messages import Bye
    from tritium.drivers.process_main import Outbox

    a, b = socket.socketpair()
    tx, rx = Connection(a.detach()), Connection(b.detach())
    outbox = Outbox(tx)
    with outbox._queue.mutex:
        outbox._queue.queue.extend(items)
        outbox._queue.queue.append(Bye())
        outbox._queue.not_empty.notify()
    received = []
    while not received or not isinstance(received[-1], Bye):
        received.append(rx.recv())
    outbox.close()
    return received, outbox.stats


def test_outbox_sends_in_order_and_merges_queued_outputs():
    """The engine process's sender thread: every output arrives, in order, with other messages
    in their place; outputs queued while it was busy share a message."""
    from tritium.drivers.messages import Bye, Outputs, StatsReply
    from tritium.outputs import CompletionOutput, RequestOutput

    def out(i):
        return RequestOutput(f"r{i}", None, [1], [CompletionOutput(0, "", [i], None, None)], False)

    received, stats = _outbox_sends([[out(i)] for i in range(5)] + [StatsReply("S"), [out(5), out(6)]])
    assert [type(m) for m in received] == [Outputs, StatsReply, Outputs, Bye]
    assert [p.request_id for p in received[0].outputs] == ["r0", "r1", "r2", "r3", "r4"]
    assert [p.request_id for p in received[2].outputs] == ["r5", "r6"]
    assert stats["messages"] == 2 and stats["outputs"] == 7


def test_outbox_folds_each_requests_tokens_when_steps_queued():
    """Steps that queued while the parent read slowly travel as one message in which each
    request's successive one-token outputs are one TokenRun; a final output, or any output
    other than a token, closes the run (its request's order is kept); one step alone is not
    folded."""
    from tritium.drivers.messages import Bye, Outputs, PackedOutput, TokenDelta, TokenRun, unpack_output
    from tritium.outputs import CompletionOutput, RequestOutput

    def out(rid, token, finish=None):
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "", [token], -float(token), None, finish)],
                             finish is not None, num_cached_tokens=4)

    steps = [[out("a", 1), out("b", 2)], [out("a", 3), out("b", 4, "length")], [out("a", 5)], [out("a", 6)]]
    received, stats = _outbox_sends(steps)
    assert [type(m) for m in received] == [Outputs, Bye]
    packed = received[0].outputs
    assert [type(p) for p in packed] == [TokenRun, TokenDelta, PackedOutput]
    assert packed[0] == TokenRun("a", [1, 3, 5, 6], -6.0, 4) and packed[1] == TokenDelta("b", 2, -2.0, 4)
    assert unpack_output(packed[0]).completions == [CompletionOutput(0, "", [1, 3, 5, 6], -6.0, None)]
    assert stats["outputs"] == 6 and stats["messages"] == 1


def test_fold_token_deltas_keeps_each_requests_order():
    from tritium.drivers.messages import PackedOutput, TokenDelta, TokenRun, fold_token_deltas

    final = PackedOutput("a", True, None, 0, [], None)
    packed = [TokenDelta("a", 1, None, 0), TokenDelta("b", 2, None, 0), TokenDelta("a", 3, None, 0), final,
              TokenDelta("a", 5, None, 0), TokenDelta("b", 6, None, 0)]
    assert fold_token_deltas(packed) == [TokenRun("a", [1, 3], None, 0), TokenRun("b", [2, 6], None, 0), final,
                                         TokenDelta("a", 5, None, 0)]
    assert fold_token_deltas(packed[:2]) == packed[:2]


def test_packed_outputs_round_trip():
    """What crosses the socket: the common one-token output as a TokenDelta, anything else as a
    PackedOutput; unpacking gives back the same fields either way."""
    from tritium.drivers.messages import PackedOutput, TokenDelta, pack_output, unpack_output
    from tritium.outputs import CompletionOutput, Logprob, RequestOutput

    def out(completions, finished=False, error=None, prompt_logprobs=None):
        return RequestOutput("r", None, [1], completions, finished, num_cached_tokens=16, error=error,
                             prompt_logprobs=prompt_logprobs)

    cases = [
        (out([CompletionOutput(0, "", [7], -1.5, None)]), TokenDelta),
        (out([CompletionOutput(0, "hi", [7], -1.5, None)]), PackedOutput),  # text made in the engine
        (out([CompletionOutput(0, "", [7, 8], -1.5, None)]), PackedOutput),  # two tokens
        (out([CompletionOutput(0, "", [7], -1.5, [{7: -1.5}])]), PackedOutput),  # logprobs
        (out([CompletionOutput(0, "", [7], -1.5, None, "length")], finished=True), PackedOutput),
        (out([CompletionOutput(0, "", [], None, None, "abort")], finished=True, error="boom"), PackedOutput),
        (out([CompletionOutput(0, "", [7], -1.0, None), CompletionOutput(1, "", [9], -2.0, None)]), PackedOutput),
        (out([CompletionOutput(1, "", [7], -1.0, None)]), PackedOutput),  # the second sample alone
        (out([CompletionOutput(0, "", [7], -1.5, None)],  # the first token and the prompt's logprobs
             prompt_logprobs=[None, {3: Logprob(-0.5, rank=2)}]), PackedOutput),
    ]
    for original, kind in cases:
        packed = pack_output(original)
        assert type(packed) is kind, original
        got = unpack_output(pickle.loads(pickle.dumps(packed)))
        assert (got.request_id, got.finished, got.error, got.num_cached_tokens) == (
            "r", original.finished, original.error, 16)
        assert got.completions == original.outputs
        assert got.prompt_logprobs == original.prompt_logprobs


def test_receiver_batches_text_but_keeps_each_requests_order(llama_dir):
    """One message holding two engine steps (the engine process merges queued steps): the
    receiver makes the common outputs' text in batches, yet each request sees its outputs in
    order with the text add_token gives one by one, and a final output flushes what came
    before it."""
    from transformers import AutoTokenizer

    from tritium.drivers.admission import Admission
    from tritium.drivers.messages import pack_output
    from tritium.engine.output_detokenizer import OutputDetokenizer
    from tritium.outputs import CompletionOutput, RequestOutput
    from tritium.engine.tokenizer import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok("日本語 🚀 ok", add_special_tokens=False)["input_ids"][:6]
    eng = EngineProcess.__new__(EngineProcess)
    eng._lock = threading.Lock()
    eng.receiver_stats = {"messages": 0, "outputs": 0, "busy_s": 0.0}
    seen: list[tuple[str, list[int], str, bool]] = []
    params = SamplingParams(max_tokens=8)
    eng._requests = {}
    eng._admission = Admission(None)
    for rid in ("a", "b"):
        req = type("Req", (), {"params": params, "prompt": None, "prompt_token_ids": [1, 2],
                               "metrics": None})()
        eng._requests[rid] = (req, lambda out: seen.append((out.request_id, out.outputs[0].token_ids,
                                                            out.outputs[0].text, out.finished)),
                              OutputDetokenizer(tok, req))
    steps = [("a", ids[0]), ("b", ids[3]), ("a", ids[1]), ("b", ids[4]), ("a", ids[2])]
    payload = [pack_output(RequestOutput(r, None, [1, 2], [CompletionOutput(0, "", [t], -1.0, None)], False))
               for r, t in steps]
    payload.append(pack_output(RequestOutput("b", None, [1, 2], [CompletionOutput(0, "", [ids[5]], -1.0, None,
                                                                                   "length")], True)))
    eng._deliver(payload)
    for rid, toks in (("a", ids[:3]), ("b", ids[3:6])):
        got = [(t, text) for r, t, text, _ in seen if r == rid]
        ref = IncrementalDetokenizer(tok, [1, 2])
        want = [([t], ref.add_token(t)) for t in toks]
        want[-1] = (want[-1][0], want[-1][1] + (ref.flush() if rid == "b" else ""))
        assert got == want, rid
    assert [f for r, _, _, f in seen if r == "b"] == [False, False, True]
    assert "b" not in eng._requests and "a" in eng._requests


def test_receiver_makes_the_text_of_a_token_run_in_its_batch(llama_dir):
    """A TokenRun (the engine process folded several steps) gets the text of all its tokens in
    one output, the same text add_token gives them one by one, next to one-token outputs
    (runs that end inside a character: test_detokenize_many_with_several_tokens_...)."""
    from transformers import AutoTokenizer

    from tritium.drivers.admission import Admission
    from tritium.drivers.messages import TokenDelta, TokenRun
    from tritium.engine.output_detokenizer import OutputDetokenizer
    from tritium.engine.tokenizer import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok("the quick brown fox", add_special_tokens=False)["input_ids"][:7]
    eng = EngineProcess.__new__(EngineProcess)
    eng._lock = threading.Lock()
    eng._admission = Admission(None)
    seen: list[tuple[str, list[int], str]] = []
    params = SamplingParams(max_tokens=16)
    eng._requests = {}
    for rid in ("a", "b"):
        req = type("Req", (), {"params": params, "prompt": None, "prompt_token_ids": [1, 2], "metrics": None})()
        eng._requests[rid] = (req, lambda o: seen.append((o.request_id, o.outputs[0].token_ids, o.outputs[0].text)),
                              OutputDetokenizer(tok, req))
    eng._deliver([TokenRun("a", ids[:4], -1.0, 0), TokenDelta("b", ids[4], -1.0, 0)])
    eng._deliver([TokenRun("a", ids[4:], -1.0, 0)])
    ref = IncrementalDetokenizer(tok, [1, 2])
    want_a = "".join(ref.add_token(t) for t in ids)
    got_a = [(t, text) for r, t, text in seen if r == "a"]
    assert [t for t, _ in got_a] == [ids[:4], ids[4:]] and "".join(text for _, text in got_a) == want_a
    assert [(t, text) for r, t, text in seen if r == "b"] == [([ids[4]], IncrementalDetokenizer(tok, [1, 2]).add_token(ids[4]))]


def test_structured_outputs_are_checked_and_served_by_the_engine_process(engine, llama_dir):
    """The spec is compiled in the engine's process (this side never imports xgrammar, which
    needs torch): a bad one is refused at add_request with the reason, a good one is served
    as the in-process engine serves it."""
    pytest.importorskip("xgrammar")
    with pytest.raises(ValueError) as info:
        engine.add_request("bad", [0, 5], SamplingParams(structured_outputs={"regex": "a{2"}), Collector())
    assert str(info.value) == ("structured_outputs: invalid regex: Regex parsing error at position 4: "
                               "Invalid repetition count.")
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["alpha", "beta"]})
    c = Collector()
    engine.add_request("good", [0, 5, 9], params, c)
    assert c.done.wait(60)
    want = LLM(llama_dir, max_model_len=128).generate([[0, 5, 9]], params)[0].outputs[0]
    assert c.total.outputs[0].text == want.text and want.text in ("alpha", "beta")
    assert c.total.outputs[0].finish_reason == "stop"
