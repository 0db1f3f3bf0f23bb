"""The benchmark harness's pure parts: workloads, statistics, response parsing, model-repository
rewriting and the report's ratios; and one small run of benchmarks/loadgen/bench.py against the real
server."""
import json
import math
import os
import struct
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.loadgen.bench import _split, lora_names_for, sampling_parameters  # noqa: E402
from benchmarks.loadgen.bench_model_repo import get_parameters, parse_assignments, set_parameters  # noqa: E402
from benchmarks.loadgen.bench_report import check_targets, derive, render_table  # noqa: E402
from benchmarks.loadgen.bench_stats import RequestTrace, percentile, summarize, tokens_in_response  # noqa: E402
from benchmarks.loadgen.workloads import (WORKLOADS, Workload, make_prompts, parse_vocab_range,  # noqa: E402
                                          resolve_workload, with_overrides)


# --- workloads -------------------------------------------------------------------------------

def test_the_issue_workloads():
    assert WORKLOADS["A"] == Workload("A", num_requests=256, input_len=512, output_len=256)
    assert WORKLOADS["B"] == Workload("B", num_requests=1, input_len=512, output_len=128)
    assert WORKLOADS["A"].total_output_tokens == 65536


def test_prompts_have_exact_lengths_and_range():
    prompts = make_prompts(256, 512, seed=0, tag="A", vocab_low=100, vocab_high=500)
    assert len(prompts) == 256
    assert {len(p) for p in prompts} == {512}
    assert min(min(p) for p in prompts) >= 100 and max(max(p) for p in prompts) < 500
    assert len({tuple(p) for p in prompts}) == 256


def test_prompts_are_reproducible_across_machines():
    # String-seeded random: the same ids in every process, whatever PYTHONHASHSEED is.
    assert make_prompts(1, 8, seed=0, tag="A")[0] == make_prompts(1, 8, seed=0, tag="A")[0]
    code = ("from benchmarks.loadgen.workloads import make_prompts; print(make_prompts(2, 6, seed=3, tag='B'))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert outs == {f"{make_prompts(2, 6, seed=3, tag='B')}\n"}


def test_prompt_sets_of_one_run_do_not_share_prefixes():
    # B's prompt must not be A's first prompt: prefix caching would make B's prefill free.
    a = make_prompts(256, 512, seed=0, tag="A")
    b = make_prompts(1, 512, seed=0, tag="B")[0]
    warm = make_prompts(4, 512, seed=0, tag="warmup")
    assert all(p[:16] != b[:16] for p in a + warm)
    assert make_prompts(1, 16, seed=0, tag="A") != make_prompts(1, 16, seed=1, tag="A")


def test_workload_overrides_keep_the_latency_workload_at_one_request():
    assert with_overrides("A", 16, 64, 8) == Workload("A", 16, 64, 8)
    assert with_overrides("B", 16, 64, 8) == Workload("B", 1, 64, 8)
    assert resolve_workload("A", None, None, None) == WORKLOADS["A"]
    assert resolve_workload(None, 3, 4, 5) == Workload("custom", 3, 4, 5)
    with pytest.raises(ValueError, match="give --num-requests"):
        resolve_workload(None, 3, None, 5)
    with pytest.raises(ValueError, match="unknown workload 'Z'; known: A, B, C, L"):
        resolve_workload("Z", None, None, None)


def test_invalid_workloads_and_ranges_are_rejected():
    with pytest.raises(ValueError, match="output_len must be a positive integer"):
        Workload("x", 1, 1, 0)
    assert parse_vocab_range("100:500") == (100, 500)
    with pytest.raises(ValueError, match="LOW:HIGH"):
        parse_vocab_range("100-500")
    with pytest.raises(ValueError, match="0 <= low < high"):
        parse_vocab_range("500:100")


def test_sampling_parameters_ask_for_exactly_n_greedy_tokens():
    assert json.loads(sampling_parameters(256)) == {"max_tokens": 256, "ignore_eos": True, "temperature": 0}
    assert json.loads(sampling_parameters(8, "sql"))["lora_name"] == "sql"
    assert lora_names_for(5, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    assert lora_names_for(2, []) == [None, None]


def test_requests_are_split_evenly_over_client_processes():
    assert _split(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert _split(1, 4) == [(0, 1)]
    assert _split(256, 4)[-1] == (192, 256)


# --- statistics ------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile must be in"):
        percentile(xs, 101)


def _trace(rid: str, send: float, events: list[tuple[float, int]], end: float | None) -> RequestTrace:
    t = RequestTrace(rid, send_time=send)
    for at, n in events:
        t.add_response(at, n)
    if end is not None:
        t.end_time = end
    return t


def test_trace_latencies():
    # Responses of 1 and 2 tokens, then an empty final response.
    t = _trace("r", 10.0, [(10.1, 1), (10.3, 2), (10.4, 0)], 10.4)
    assert t.output_tokens == 3
    assert t.ttft == pytest.approx(0.1)
    assert t.itls() == pytest.approx([0.1, 0.1])  # 0.2 s for 2 tokens: one sample per token
    assert t.e2e == pytest.approx(0.4)
    assert t.tpot == pytest.approx(0.15)


def test_summary_throughput_and_failures():
    ok1 = _trace("a", 0.0, [(0.5, 1), (1.0, 1), (1.5, 1), (2.0, 1)], 2.0)
    ok2 = _trace("b", 1.0, [(2.0, 2), (4.0, 2)], 4.0)
    failed = _trace("c", 0.0, [(0.1, 1)], None)
    failed.error = "boom"
    s = summarize([ok1, ok2, failed], expected_output_len=4)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 8)
    assert s["wall_s"] == 4.0  # first send 0.0 to last final 4.0
    assert s["output_tok_s"] == 2.0
    assert s["requests_s"] == 0.5
    assert s["ttft_ms"]["p50"] == pytest.approx(750.0)  # TTFTs 0.5 and 1.0 s
    assert s["e2e_ms"]["p99"] == pytest.approx(2990.0)  # 2.0 and 3.0 s
    # ITL samples: a: 0.5 x3; b: 1.0 x2 -> sorted [.5,.5,.5,1,1]
    assert s["itl_ms"]["p50"] == pytest.approx(500.0)
    assert s["decode_tok_s"] == pytest.approx((3 / 1.5 + 3 / 2.0) / 2)
    assert s["wrong_length_requests"] == 0
    short = summarize([_trace("d", 0.0, [(1.0, 3)], 1.0)], expected_output_len=4)
    assert short["wrong_length_requests"] == 1


def test_summary_with_nothing_completed():
    t = RequestTrace("x", send_time=0.0, error="refused")
    s = summarize([t])
    assert s["completed"] == 0 and s["failed"] == 1 and math.isnan(s["output_tok_s"])


# --- response parsing ------------------------------------------------------------------------

def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def test_tokens_counted_from_num_output_tokens():
    assert tokens_in_response(["text_output", "num_output_tokens"],
                              [_bytes_tensor(b"abc"), struct.pack("<I", 3)]) == 3
    assert tokens_in_response(["num_output_tokens"], [struct.pack("<2I", 2, 5)]) == 7
    assert tokens_in_response(["num_output_tokens"], [struct.pack("<I", 0)]) == 0


def test_tokens_counted_by_response_without_the_count():
    assert tokens_in_response(["text_output"], [_bytes_tensor(b"hello world")]) == 1
    assert tokens_in_response(["text_output"], [_bytes_tensor(b"")]) == 0  # empty final response
    assert tokens_in_response([], []) == 0


def test_malformed_count_is_an_error():
    with pytest.raises(ValueError, match="not a whole number of INT32"):
        tokens_in_response(["num_output_tokens"], [b"\x01\x00\x00"])


# --- model repository ------------------------------------------------------------------------

PBTXT = """backend: "python"
parameters { key: "model" value { string_value: "models/tiny-llama" } }
parameters { key: "max_num_seqs" value { string_value: "64" } }
instance_group [ { count: 1 kind: KIND_MODEL } ]
"""


def test_parameters_replaced_in_place_and_appended():
    out = set_parameters(PBTXT, {"max_num_seqs": "256", "load_format": "dummy", "model": '/a "b"'})
    assert get_parameters(out) == {"model": '/a "b"', "max_num_seqs": "256", "load_format": "dummy"}
    assert out.index("max_num_seqs") < out.index("instance_group") < out.index("load_format")
    assert 'backend: "python"' in out and out.count("parameters") == 3
    assert set_parameters(PBTXT, {}) == PBTXT


def test_assignments():
    assert parse_assignments(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_assignments(["novalue"])


# --- report ----------------------------------------------------------------------------------

def test_ratios_and_targets():
    triton = {"A": {"output_tok_s": 12000.0, "requests_s": 46.9, "ttft_ms": {"p50": 900.0, "p99": 1800.0},
                    "itl_ms": {"p50": 20.0, "p99": 40.0}},
              "B": {"decode_tok_s": 210.0, "ttft_ms": {"p50": 30.0}, "itl_ms": {"p50": 4.7, "p99": 5.0}}}
    offline = {"A": {"output_tok_s": 12500.0}, "B": {"decode_tok_s": 220.0, "ttft_ms": {"p50": 25.0}}}
    hf = {"A": {"output_tok_s": 2000.0}, "B": {"decode_tok_s": 35.0, "ttft_ms": {"p50": 60.0}}}
    d = derive(triton, offline, hf)
    assert d["A_ratio_triton_vs_hf"] == 6.0
    assert d["A_ratio_offline_vs_hf"] == 6.25
    assert d["serving_overhead"] == pytest.approx(0.04)
    assert d["B_ratio_triton_vs_hf"] == 6.0
    assert check_targets(d) == {"A_out_tok_s": True, "B_decode_tok_s": True, "serving_overhead": True,
                                "B_ttft_ms": True}
    slow = derive({"A": {"output_tok_s": 9000.0}, "B": {"decode_tok_s": 150.0, "ttft_ms": {"p50": 45.0}}},
                  offline, {})
    assert math.isnan(slow["A_ratio_triton_vs_hf"])
    assert check_targets(slow) == {"A_out_tok_s": False, "B_decode_tok_s": False, "serving_overhead": False,
                                   "B_ttft_ms": False}
    assert check_targets(derive({}, {}, {}))["A_out_tok_s"] is None


def test_targets_are_checked_only_for_the_bf16_configuration(tmp_path):
    """A run with an FP8 KV cache, FP8 weights, another dtype or other sizes is not the targets'
    configuration: no pass/fail, and the table says why."""
    from benchmarks.loadgen.bench_report import collect, off_target_reason
    assert off_target_reason({"dtype": "bfloat16", "device": "cuda", "engine_args": "", "sizes": ""}) is None
    assert off_target_reason({"dtype": "bfloat16", "engine_args": "--set max_model_len=2047 --set kv_cache_dtype=auto"}) is None
    assert off_target_reason({"dtype": "bfloat16", "engine_args": "--set kv_cache_dtype=fp8"}) == "kv_cache_dtype=fp8"
    assert off_target_reason({"dtype": "bfloat16", "engine_args": "--set enable_lora=true", "lora_names": "a0,a1"}) \
        == "LoRA adapters a0,a1"
    assert off_target_reason({"dtype": "float16", "engine_args": "--set quantization=fp8",
                              "sizes": "--num-requests 8"}) == (
        "dtype=float16, quantization=fp8, workload sizes --num-requests 8")
    model = tmp_path / "llama-3-8b"
    model.mkdir()
    (model / "triton_A.json").write_text(json.dumps({"summary": {"output_tok_s": 11500.0}}))
    for engine_args, checked in (("", True), ("--set kv_cache_dtype=fp8", False)):
        (tmp_path / "meta.json").write_text(json.dumps({"dtype": "bfloat16", "engine_args": engine_args}))
        results = collect(str(tmp_path))
        table = render_table(results)
        if checked:
            assert results["models"]["llama-3-8b"]["targets_met"]["A_out_tok_s"] is True
            assert "A >= 11,000 tok/s met" in table
        else:
            assert results["models"]["llama-3-8b"]["targets_met"] is None
            assert table.endswith("Targets (llama-3-8b): not checked, they are for bf16 weights and a bf16 KV "
                                  "cache at the issue's sizes; this run: kv_cache_dtype=fp8")


def test_table_marks_missing_figures():
    results = {"models": {"qwen2.5-1.5b": {"derived": derive({}, {"A": {"output_tok_s": 5000.0}}, {})}}}
    row = render_table(results).splitlines()[2]
    assert row.startswith("| qwen2.5-1.5b | - | 5,000 | - | - | - |")


def test_gpu_telemetry_per_phase(tmp_path):
    """gpu_run.sh's nvidia-smi log, summarized over each phase's busy samples (>= 200 W)."""
    from benchmarks.loadgen.bench_report import collect
    from benchmarks.loadgen.gpu_telemetry import describe
    start = time.mktime(time.strptime("2026/12/01 07:12:00", "%Y/%m/%d %H:%M:%S"))
    rows = ["timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",
            "2026/12/01 07:12:00.100, 345 MHz, 80.00 W, 0x0000000000000001",    # idle: left out
            "2026/12/01 07:12:01.300, 1980 MHz, 350.50 W, 0x0000000000000000",
            "2026/12/01 07:12:01.500, 1650 MHz, 690.00 W, 0x0000000000000004",
            "2026/12/01 07:12:01.700, 1500 MHz, 699.00 W, 0x0000000000000004",
            "2026/12/01 07:12:01.900, [N/A], [N/A], [N/A]",                        # unreadable
            "2026/12/01 07:12:05.000, 1700 MHz, 680.00 W, 0x0000000000000004",    # second phase
            "2026/12/01 07:12:05.2"]                                              # cut off by kill
    (tmp_path / "gpu_telemetry.csv").write_text("\n".join(rows) + "\n")
    phases = [{"model": "m", "phase": "triton", "rc": 0, "seconds": 3.0, "start": start, "end": start + 3.0},
              {"model": "m", "phase": "offline", "rc": 0, "seconds": 2.0, "start": start + 4.0, "end": start + 6.0},
              {"model": "m", "phase": "hf", "rc": None, "seconds": 0, "skipped": True}]
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in phases))
    got = collect(str(tmp_path))["phases"]
    assert got[0]["gpu"] == {"busy_samples": 3, "sm_clock_mhz_median": 1650.0, "sm_clock_mhz_min": 1500.0,
                             "sm_clock_mhz_max": 1980.0, "power_w_median": 690.0, "power_w_max": 699.0,
                             "power_capped_fraction": pytest.approx(2 / 3)}
    assert got[1]["gpu"]["busy_samples"] == 1 and got[1]["gpu"]["power_capped_fraction"] == 1.0
    assert "gpu" not in got[2]
    assert describe(got[0]) == ("GPU during m/triton: SM clock median 1,650 MHz (1,500-1,980), power median "
                                "690 W (max 699), power cap holding the clock in 67% of 3 busy samples")
    # no log (a CPU rehearsal): phases get no figures
    os.remove(tmp_path / "gpu_telemetry.csv")
    assert collect(str(tmp_path))["phases"][0]["gpu"] is None


# --- against the real server (tiny model on the CPU) -----------------------------------------

def test_bench_client_against_the_server(llm_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen.bench",
         "--url", f"127.0.0.1:{llm_server.grpc_port}",
         "--num-requests", "6", "--input-len", "24", "--output-len", "5", "--procs", "2", "--warmup", "1",
         "--no-progress", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"], s["wrong_length_requests"]) == (6, 0, 30, 0)
    assert result["per_request"]["output_tokens"] == [5] * 6
    assert all(0 < t <= e for t, e in zip(result["per_request"]["ttft_ms"], result["per_request"]["e2e_ms"]))
    assert s["output_tok_s"] == pytest.approx(30 / s["wall_s"])


def test_bench_tokenizer_has_text_for_every_id_of_the_vocabulary(tmp_path):
    """scripts/build_bench_tokenizer.py: exactly the asked vocabulary size, every non-special id
    decodes to text, and streamed detokenization gives the full decode (what the benchmark's
    serving path does with each generated token)."""
    import random
    from scripts import build_bench_tokenizer

    from tritium.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
    build_bench_tokenizer.build(str(tmp_path), 700)
    tok = load_tokenizer(str(tmp_path))
    assert len(tok) == 700
    assert all(tok.decode([i]) for i in range(256, 698))
    assert set(tok.all_special_ids) == {698, 699}
    rng = random.Random(1)
    ids = [rng.randrange(700) for _ in range(300)]
    d = IncrementalDetokenizer(tok, [300, 301])
    text = "".join(d.add_token(t) for t in ids) + d.flush()
    assert text == tok.decode([300, 301] + ids, skip_special_tokens=True)[len(tok.decode([300, 301])):]


def test_benchmark_sampling_options():
    """benchmarks/offline.py --sampling / benchmarks/engine/sampling_cost.py --variant: vLLM's
    names with JSON values."""
    from benchmarks.engine.sampling_cost import parse_variant
    from benchmarks.offline import parse_sampling
    assert parse_sampling(["repetition_penalty=1.1", "stop=[\"x\"]", "bad_words=oops"]) == {
        "repetition_penalty": 1.1, "stop": ["x"], "bad_words": "oops"}
    assert parse_variant("pen:8:repetition_penalty=1.2,presence_penalty=0.1") == (
        "pen", 8, {"repetition_penalty": 1.2, "presence_penalty": 0.1})
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        parse_sampling(["repetition_penalty"])
    with pytest.raises(SystemExit, match="NAME:EVERY"):
        parse_variant("pen:0:repetition_penalty=1.2")


@pytest.mark.parametrize("spec", [False, True])
def test_profile_engine_and_bench_spec_decode_run_on_the_cpu(tmp_path, spec):
    """The in-process benchmarks run end to end on the tiny model: profile_engine times every
    part of a step (proposals only when speculating); bench_spec_decode gives the plain run's
    tokens in every mode (float32)."""
    out = tmp_path / "profile.json"
    args = ["--model", "models/tiny-llama", "--num-requests", "3", "--input-len", "24", "--output-len", "6",
            "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--json", str(out)]
    if spec:
        args += ["--engine-arg", 'speculative_config={"method": "ngram", "num_speculative_tokens": 2}']
    subprocess.run([sys.executable, "-m", "benchmarks.engine.profile_engine", *args], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert d["output_tok_s"] > 0 and d["steps"] >= 6 and len(d["lone_request_ttft_ms"]) == 3
    assert {"schedule_and_rest", "book_and_launch", "wait", "tokens", "text"} <= set(d["phase_ms_mean"])
    assert ("propose" in d["phase_ms_mean"]) == spec
    if not spec:
        return
    out = tmp_path / "spec.json"
    subprocess.run([sys.executable, "-m", "benchmarks.engine.spec_decode", "--model", "models/tiny-llama",
                    "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--batch-sizes", "1,3",
                    "--input-len", "16", "--output-len", "8", "--rounds", "1", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert {(r["batch"], r["mode"]) for r in d["summary"]} == {
        (b, m) for b in (1, 3) for m in ("plain", "ngram", "oracle", "wrong")}
    assert all(r["tokens_equal_plain"] for r in d["summary"])
    oracle = [r for r in d["rows"] if r["mode"] == "oracle"]
    assert all(r["accepted"] == r["draft_tokens"] > 0 for r in oracle)
    # Seeded sampling with penalties: each token drawn as in the plain run, so the plain run's
    # tokens again, and an oracle of them always right.
    subprocess.run([sys.executable, "-m", "benchmarks.engine.spec_decode", "--model", "models/tiny-llama",
                    "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--batch-sizes", "3",
                    "--input-len", "16", "--output-len", "8", "--rounds", "1", "--modes", "oracle,wrong",
                    "--params", '{"temperature": 1.0, "seed": 5, "repetition_penalty": 1.2}', "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    assert d["params"]["seed"] == 5 and all(r["tokens_equal_plain"] for r in d["summary"])
    assert all(r["accepted"] == r["draft_tokens"] > 0 for r in d["rows"] if r["mode"] == "oracle")


def test_bench_ngram_proposer_runs_every_kind_of_output(tmp_path):
    out = tmp_path / "proposer.json"
    subprocess.run([sys.executable, "benchmarks/kernels/ngram_proposer.py", "--seqs", "2", "--prompt-lens", "64,128",
                    "--steps", "5", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    d = json.loads(out.read_text())
    assert [(r["prompt_len"], r["outputs"]) for r in d["rows"]] == [
        (n, kind) for n in (64, 128) for kind in ("run", "cycle3", "random")]
    assert all(r["ms_per_step"] > 0 and r["first_step_ms"] > 0 for r in d["rows"])


def test_bench_spec_decode_refuses_params_that_are_not_a_json_object():
    for bad, message in (("[1]", "a JSON object of sampling parameters, got '[1]'"), ("{bad", "not JSON")):
        r = subprocess.run([sys.executable, "-m", "benchmarks.engine.spec_decode", "--model", "x", "--params", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"argument --params: {message}" in r.stderr, r.stderr


def test_bench_multi_turn_offload_runs_on_the_cpu(tmp_path):
    """benchmarks/engine/multi_turn_offload.py on the tiny model: four conversations in a device
    cache smaller than they are; with swap_space the evicted prefixes come back from the host
    tier (fewer prompt tokens computed), the replies are the device-only run's, and the
    bandwidth probe times both directions."""
    out = tmp_path / "offload.json"
    subprocess.run([sys.executable, "-m", "benchmarks.engine.multi_turn_offload", "--model", "models/tiny-llama",
                    "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--engine-arg", "num_kv_blocks=16",
                    "--engine-arg", "block_size=16", "--swap-space", "0.001", "--conversations", "4", "--turns", "3",
                    "--system-len", "40", "--user-len", "8", "--output-len", "4", "--concurrency", "2",
                    "--probe-blocks", "8", "--probe-rounds", "2", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    d = json.loads(out.read_text())
    base, swap = d["runs"]["device only"], d["runs"]["swap_space=0.001"]
    assert base["requests"] == swap["requests"] == 12 and d["replies_equal"]
    assert base["host_hit_rate"] == 0.0 and base["blocks_reloaded"] == 0 and base["host_blocks"] == 0
    assert swap["host_hit_rate"] > 0 and swap["blocks_reloaded"] > 0 and swap["host_blocks"] > 0
    assert swap["computed_prompt_tokens"] < base["computed_prompt_tokens"]
    assert swap["ttft_p99_ms"] >= swap["ttft_p50_ms"] > 0 and swap["output_tok_s"] > 0
    bw = d["bandwidth"]
    assert bw["blocks"] == 8 and bw["bytes"] == 8 * bw["block_bytes"]
    served = swap["copies_while_serving"]  # every copy of the run: the tier's (nothing was preempted)
    assert swap["preemptions"] == 0 and served["swap_in_gb_s"] > 0 and served["swap_out_gb_s"] > 0
    assert served["swap_in_bytes"] == swap["blocks_reloaded"] * bw["block_bytes"]
    assert served["swap_out_bytes"] == swap["blocks_offloaded"] * bw["block_bytes"]
    assert min(bw["swap_out_gb_s"], bw["swap_in_gb_s"], bw["link_d2h_gb_s"], bw["link_h2d_gb_s"]) > 0
