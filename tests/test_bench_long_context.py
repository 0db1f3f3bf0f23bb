"""The long-context benchmark workloads (C, L): their sizes, quick runs of them, which models can
serve them and the max_model_len they need (benchmarks/loadgen/workload_plan.py), every runner
and benchmarks/gpu.sh e2e accepting them, and the report's table of their figures."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.loadgen.bench_report import collect, derive, render_table  # noqa: E402
from benchmarks.loadgen.workload_plan import model_context_limit, plan, repository_max_model_len  # noqa: E402
from benchmarks.loadgen.workloads import WORKLOADS, Workload, parse_workload_names, with_overrides  # noqa: E402

CONFIGS = os.path.join(ROOT, "models", "configs")


def test_long_context_workloads():
    assert WORKLOADS["C"] == Workload("C", num_requests=8, input_len=16384, output_len=256)
    assert WORKLOADS["L"] == Workload("L", num_requests=1, input_len=32640, output_len=128)
    assert WORKLOADS["C"].max_seq_len == 16640
    assert WORKLOADS["L"].max_seq_len == 32768  # fits a model of 32,768 positions exactly
    assert list(WORKLOADS) == ["A", "B", "C", "L"]


def test_quick_sizes_make_the_long_workloads_tiny():
    assert with_overrides("C", 16, 64, 16) == Workload("C", 16, 64, 16)
    assert with_overrides("L", 16, 64, 16) == Workload("L", 1, 64, 16)
    assert with_overrides("L", None, 100) == Workload("L", 1, 100, 128)


def test_workload_names_are_checked():
    assert parse_workload_names(" A, C,L ") == ["A", "C", "L"]
    with pytest.raises(ValueError, match=r"^unknown workload 'D'; known: A, B, C, L\.$"):
        parse_workload_names("A,D")
    with pytest.raises(ValueError, match="no workload named"):
        parse_workload_names(" , ")


def test_plan_skips_what_a_model_cannot_hold_and_raises_max_model_len():
    why = "max_position_embeddings=8192"
    p = plan(["A", "B", "C", "L"], 8192, why, 2048)
    assert (p.run, p.max_model_len) == (["A", "B"], None)
    assert p.skipped == {"C": "16,384 + 256 tokens exceed max_position_embeddings=8192",
                         "L": "32,640 + 128 tokens exceed max_position_embeddings=8192"}
    # A and B alone keep the repository's max_model_len.
    assert plan(["A", "B"], 32768, "", 2048).max_model_len is None
    # C is run with the same engine whether L shares the call or not.
    assert plan(["C"], 32768, "", 2048).max_model_len == 32768
    assert plan(["A", "C", "L"], 131072, "", 2048).max_model_len == 32768
    # A model that holds C but not L: the engine is sized for C.
    p = plan(["C", "L"], 20000, "sliding_window=20000", 2048)
    assert (p.run, list(p.skipped), p.max_model_len) == (["C"], ["L"], 16640)
    # Quick sizes: everything fits the repository as it is.
    p = plan(["A", "B", "C", "L"], 2048, "", 2048, 16, 64, 16)
    assert (p.run, p.skipped, p.max_model_len) == (["A", "B", "C", "L"], {}, None)
    # A max_model_len given with --engine-arg is kept; workloads longer than it are skipped.
    p = plan(["A", "C", "L"], 32768, "", 2048, given_len=20000)
    assert (p.run, p.skipped["L"], p.max_model_len) == (
        ["A", "C"], "32,640 + 128 tokens exceed the max_model_len=20000 given", None)


def test_model_context_limits():
    assert repository_max_model_len() == 2048
    limits = {name: model_context_limit(os.path.join(CONFIGS, name))
              for name in ("llama-3-8b", "llama-3.1-8b", "phi-3-mini-4k", "qwen2.5-7b")}
    assert limits == {"llama-3-8b": (8192, "max_position_embeddings=8192"),
                      "llama-3.1-8b": (131072, "max_position_embeddings=131072"),
                      "phi-3-mini-4k": (4096, "max_position_embeddings=4096"),
                      "qwen2.5-7b": (32768, "max_position_embeddings=32768")}


def _gpu_e2e(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "IMAGE_PYTHON": sys.executable}
    return subprocess.run(["bash", "benchmarks/gpu.sh", "e2e", "--dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_e2e_plans_long_workloads_per_model():
    r = _gpu_e2e("--models", "llama-3-8b,qwen2.5-7b", "--workloads", "A,B,C,L")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run: llama-3-8b: run A,B, skip C,L, engine as configured" in r.stdout
    assert "dry run: qwen2.5-7b: run A,B,C,L, skip -, engine --set max_model_len=32768" in r.stdout
    assert "L: 32,640 + 128 tokens exceed max_position_embeddings=8192" in r.stderr
    # A quick rehearsal on the tiny model (2,048 positions) runs C and L at its sizes.
    r = _gpu_e2e("--models", "models/tiny-llama", "--workloads", "C,L", "--num-requests", "4",
                 "--input-len", "64", "--output-len", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run: tiny-llama: run C,L, skip -, engine as configured" in r.stdout
    r = _gpu_e2e("--models", "llama-3-8b", "--workloads", "A,X")
    assert r.returncode == 2 and "gpu.sh e2e: ValueError: unknown workload 'X'" in r.stderr, r.stderr


def test_runners_accept_the_long_workloads(tmp_path):
    """The in-process bench and the HF anchor run C and L at quick sizes on the tiny model; the
    HF anchor's request cap (gpu.sh e2e's --hf-requests) does not inflate C; the Triton client
    offers them."""
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.loadgen.bench", "--help"], cwd=ROOT,
                               check=True, capture_output=True, text=True, timeout=60).stdout
    assert "--workload {A,B,C,L}" in help_text
    sizes = ["--workloads", "C,L", "--input-len", "16", "--output-len", "3"]
    subprocess.run([sys.executable, "-m", "benchmarks.offline", "--model", "models/tiny-llama",
                    "--engine-arg", "device=cpu", "--engine-arg", "dtype=float32", "--num-requests", "3",
                    "--warmup", "1", "--warmup-output-len", "2", *sizes, "--json", str(tmp_path / "off.json")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "benchmarks.hf", "--config", "models/tiny-llama", "--device", "cpu",
                    "--dtype", "float32", "--batch-size", "4", "--max-requests", "256", *sizes,
                    "--json", str(tmp_path / "hf.json")], cwd=ROOT, check=True, capture_output=True, timeout=300)
    for name, c_requests in (("off.json", 3), ("hf.json", 8)):
        runs = json.loads((tmp_path / name).read_text())["workloads"]
        assert {k: (v["workload"]["num_requests"], v["workload"]["input_len"], v["summary"]["completed"])
                for k, v in runs.items()} == {"C": (c_requests, 16, c_requests), "L": (1, 16, 1)}, name
        assert runs["C"]["summary"]["output_tokens"] == 3 * c_requests


def test_report_has_a_table_for_the_long_workloads(tmp_path):
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "triton_C.json").write_text(json.dumps({"summary": {
        "output_tok_s": 900.0, "ttft_ms": {"p50": 2100.0, "p99": 3900.0}}}))
    (model / "triton_L.json").write_text(json.dumps({"summary": {"decode_tok_s": 150.0, "ttft_ms": {"p50": 2500.0}}}))
    (model / "offline.json").write_text(json.dumps({"runner": "offline-llm", "workloads": {
        "C": {"summary": {"output_tok_s": 1000.0}}, "L": {"summary": {"decode_tok_s": 160.0}}}}))
    other = tmp_path / "llama-3-8b"
    other.mkdir()
    (other / "triton_A.json").write_text(json.dumps({"summary": {"output_tok_s": 10000.0}}))
    (other / "workload_plan.json").write_text(json.dumps({"skipped": {"L": "too long"}}))
    results = collect(str(tmp_path))
    d = results["models"]["qwen2.5-7b"]["derived"]
    assert d["C_serving_overhead"] == pytest.approx(0.1) and d["L_decode_tok_s_offline"] == 160.0
    assert math.isnan(d["C_ratio_triton_vs_hf"]) and math.isnan(d["A_out_tok_s_triton"])
    table = render_table(results).splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("| model | C Triton"))
    # Only the model that ran C or L has a row.
    assert [line for line in table[start + 2:] if line.startswith("| ")] == [
        "| qwen2.5-7b | 900 | 1,000 | - | 10.0% | 2100 / 3900 | 150 / 160 / - | 2500 / - / - |"]
    assert "llama-3-8b: workload L skipped (too long)" in table
    # A run without C or L prints no second table.
    assert "C Triton" not in render_table({"models": {"m": {"derived": derive({}, {}, {})}}})


def test_prefill_32k_benchmark_rehearses_on_the_cpu(tmp_path):
    """benchmarks/kernels/prefill_32k.py at a tiny size in the interpreter: the chunks, as the
    engine splits a prompt, together give SDPA's causal attention over the whole prompt."""
    out = tmp_path / "prefill.json"
    subprocess.run([sys.executable, "benchmarks/kernels/prefill_32k.py", "--device", "cpu", "--dtype", "float32",
                    "--tokens", "40", "--chunk", "16", "--configs", "", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    d = json.loads(out.read_text())
    (row,) = d["variants"]
    assert [(c["start"], c["end"]) for c in row["chunks"]] == [(0, 16), (16, 32), (32, 40)]
    assert row["config"] == "default" and row["rel_err"] < 1e-5


def test_gpu_sh_accepts_every_set_it_runs():
    """Every set with a branch in benchmarks/gpu.sh's case statement is in its list of known sets,
    and every known set has a branch (a set missing from the list is refused on the GPU machine)."""
    import re
    text = open(os.path.join(ROOT, "benchmarks", "gpu.sh"), encoding="utf-8").read()
    known = set(re.search(r'^SETS=" (.*) "$', text, re.M).group(1).split())
    body = text[text.index('case "$SET" in'):]
    branches = set(re.findall(r"^([a-z0-9-]+)\)$", body, re.M))
    assert branches, "no case branches found"
    assert branches - {"e2e"} <= known, branches - known
    assert known - {"e2e"} <= branches, known - branches
    r = subprocess.run(["bash", "benchmarks/gpu.sh", "nope"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OUT": "/tmp/unused"}, timeout=30)
    assert r.returncode == 2 and "unknown set 'nope'" in r.stderr, r.stderr
