"""The response path's cost on the CPU: one workload in-process and through a real tritonserver,
both with the engine stand-in of synthetic_executor.py (tokens at a GPU's rate, no model), so
that the difference is what serving adds: the engine process's messages, the Triton stub's
receiver (text) and sender (`send()`), gRPC and the client.

    .venv/bin/python -m benchmarks.response_path.run --repeats 3 --json /tmp/response_path.json
    .venv/bin/python -m benchmarks.response_path.run --num-requests 64 --input-len 128 --output-len 64

Each repeat runs the in-process engine (benchmarks/offline.py) and then a fresh server (a server
logs its threads' time when its model unloads, so one life per repeat gives one breakdown).
Prints a table of each repeat and the medians; --json writes them. --py-spy PATH records the
stub process's threads (py-spy on the PATH) during the Triton run of the first repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.triton_server import ROOT, TritonServer, processes, start_server, write_model_repository

EXECUTOR = "benchmarks.response_path.synthetic_executor.SyntheticExecutor"
STEP_MS_ENV, TOKEN_US_ENV = "TRITIUM_SYNTHETIC_STEP_MS", "TRITIUM_SYNTHETIC_TOKEN_US"
TIMELINE_ENV = "TRITIUM_SYNTHETIC_TIMELINE"
SENDER_LINE = re.compile(
    r"sender thread: (?P<rounds>\d+) rounds, (?P<responses>\d+) streamed responses, (?P<sender_busy_s>[\d.]+) s "
    r"busy, of which (?P<send_s>[\d.]+) s in send\(\).*?engine receiver thread: (?P<rx_messages>\d+) messages, "
    r"(?P<rx_outputs>\d+) outputs, (?P<receiver_busy_s>[\d.]+) s busy")
ENGINE_LINE = re.compile(
    r"engine process: (?P<steps>\d+) steps in (?P<step_loop_s>[\d.]+) s \((?P<step_cpu_s>[\d.]+) s of CPU.*?"
    r"over (?P<engine_busy_s>[\d.]+) s busy, of which (?P<device_wait_s>[\d.]+) s waiting for the device; "
    r"(?P<outputs>\d+) outputs in (?P<messages>\d+) messages \((?P<message_bytes>\d+) bytes\), "
    r"(?P<outbox_send_s>[\d.]+) s packing and sending")


def engine_args(args: argparse.Namespace) -> dict[str, str]:
    values = {"model": args.model, "distributed_executor_backend": EXECUTOR,
              "max_num_seqs": str(min(256, args.num_requests)), "block_size": "16",
              "max_model_len": str(args.input_len + args.output_len + 16)}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        values[key] = value
    return values


def workload_args(args: argparse.Namespace) -> list[str]:
    return ["--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


def run_in_process(args: argparse.Namespace, env: dict[str, str], workdir: str, i: int) -> dict[str, Any]:
    out = os.path.join(workdir, f"offline_{i}.json")
    cmd = [sys.executable, "-m", "benchmarks.offline", "--workloads", "A",
           *workload_args(args), "--model", args.model, "--json", out]
    for key, value in engine_args(args).items():
        if key != "model":
            cmd += ["--engine-arg", f"{key}={value}"]
    timeline = os.path.join(workdir, f"timeline_offline_{i}.json")
    subprocess.run(cmd, cwd=ROOT, env={**env, TIMELINE_ENV: timeline}, check=True, stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        s = json.load(f)["workloads"]["A"]["summary"]
    return {"tok_s": s["output_tok_s"], "wall_s": s["wall_s"], "output_tokens": s["output_tokens"]}


def phases(timeline_path: str, start: float, end: float) -> dict[str, float]:
    """The Triton run against the engine's steps (one clock): from the first send to the first
    step launched after it (intake), to the end of the last step (the engine's span), to the
    last response (delivery tail)."""
    with open(timeline_path, encoding="utf-8") as f:
        steps = [s for s in json.load(f)["steps"] if s[0] >= start]
    if not steps:
        return {}
    first, last = steps[0][0], max(s[1] for s in steps)
    return {"intake_s": first - start, "engine_span_s": last - first, "tail_s": end - last,
            "measured_steps": len(steps)}


def stub_pid(server: TritonServer) -> int | None:
    """The python backend stub serving the model (a child of the server)."""
    for p in processes():
        if p.ppid == server.proc.pid and "triton_python_backend_stub" in p.cmdline:
            return p.pid
    return None


def server_pids(server: TritonServer) -> dict[str, int]:
    """tritonserver, the model's stub and the engine's process (the stub's child)."""
    pids = {"server": server.proc.pid}
    stub = stub_pid(server)
    if stub is not None:
        pids["stub"] = stub
        for p in processes():
            if p.ppid == stub and "tritium.drivers.process_main" in p.cmdline:
                pids["engine"] = p.pid
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process's own threads (its children not counted)."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_triton(args: argparse.Namespace, env: dict[str, str], workdir: str, i: int | str) -> dict[str, Any]:
    repo = write_model_repository(os.path.join(workdir, f"repo_{i}"), engine_args(args))
    log = os.path.join(workdir, f"tritonserver_{i}.log")
    old_env = dict(os.environ)
    timeline = os.path.join(workdir, f"timeline_triton_{i}.json")
    os.environ.update(env)
    os.environ[TIMELINE_ENV] = timeline  # the server, its stub and the engine process inherit the timing
    try:
        # A longer exit timeout than the tests': see UNLOAD_RETRIES.
        server = start_server(repo, log, "--exit-timeout-secs=25")
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    spy = None
    try:
        out = os.path.join(workdir, f"triton_{i}.json")
        pids = server_pids(server)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if args.py_spy and i == 0 and (pid := stub_pid(server)) is not None:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--threads",
                                    *(["--gil"] if args.py_spy_gil else []), "--format", "raw", "--output", args.py_spy],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        client = subprocess.run([sys.executable, "-m", "benchmarks.loadgen.bench",
                                 "--url", server.grpc_url, *workload_args(args), "--procs", str(args.procs),
                                 "--no-progress", "--json", out],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if client.returncode != 0:
            raise RuntimeError(f"benchmarks/loadgen/bench.py failed ({client.returncode}): {client.stderr[-3000:]}")
        cpu = {f"{name}_cpu_s": cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            spy.wait()
        server.stop()
    with open(out, encoding="utf-8") as f:
        s = json.load(f)["summary"]
    with open(log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    result: dict[str, Any] = {"tok_s": s["output_tok_s"], "wall_s": s["wall_s"],
                              "output_tokens": s["output_tokens"], "failed": s.get("failed", 0), "log": log}
    for pattern in (SENDER_LINE, ENGINE_LINE):
        m = pattern.search(text)
        if m is None:
            raise UnloadTimeout(f"no {pattern.pattern[:30]!r} line in {log}")
        result.update({k: float(v) if "." in v else int(v) for k, v in m.groupdict().items()})
    result["send_ms_per_response"] = 1e3 * result["send_s"] / max(1, result["responses"])
    result.update(phases(timeline, s["start_time"], s["end_time"]))
    result.update(cpu)
    return result


# Some server lives did not finalize the model after the run (tritonserver waited out its exit
# timeout with the model live, in the trees before and after the response-path changes alike),
# so its threads' log lines are missing: such a repeat is run again, and counted.
UNLOAD_RETRIES = 2


class UnloadTimeout(RuntimeError):
    pass


def run_triton_retrying(args: argparse.Namespace, env: dict[str, str], workdir: str, i: int) -> dict[str, Any]:
    for attempt in range(UNLOAD_RETRIES + 1):
        try:
            result = run_triton(args, env, workdir, i if attempt == 0 else f"{i}_retry{attempt}")
            result["unload_timeouts"] = attempt
            return result
        except UnloadTimeout as e:
            print(f"repeat {i + 1}: {e}; running it again", flush=True)
    raise RuntimeError(f"repeat {i + 1}: the model did not unload in {UNLOAD_RETRIES + 1} server lives")


def machine_load() -> list[float]:
    return list(os.getloadavg())


COLUMNS = [("in-process tok/s", "inprocess", "tok_s", "{:,.0f}"), ("Triton tok/s", "triton", "tok_s", "{:,.0f}"),
           ("lost %", None, "lost_pct", "{:.1f}"), ("in-process s", "inprocess", "wall_s", "{:.2f}"),
           ("Triton s", "triton", "wall_s", "{:.2f}"), ("intake s", "triton", "intake_s", "{:.2f}"),
           ("engine s", "triton", "engine_span_s", "{:.2f}"), ("tail s", "triton", "tail_s", "{:.2f}"),
           ("responses", "triton", "responses", "{:,}"),
           ("send() s", "triton", "send_s", "{:.2f}"), ("ms/send", "triton", "send_ms_per_response", "{:.3f}"),
           ("sender busy s", "triton", "sender_busy_s", "{:.2f}"),
           ("rx busy s", "triton", "receiver_busy_s", "{:.2f}"), ("msgs", "triton", "messages", "{:,}"),
           ("MB", "triton", "message_bytes", "{:.2f}"), ("steps", "triton", "steps", "{:,}"),
           ("loop s", "triton", "step_loop_s", "{:.2f}"), ("loop CPU s", "triton", "step_cpu_s", "{:.2f}"),
           ("device wait s", "triton", "device_wait_s", "{:.2f}"),
           ("stub CPU s", "triton", "stub_cpu_s", "{:.2f}"), ("server CPU s", "triton", "server_cpu_s", "{:.2f}"),
           ("engine CPU s", "triton", "engine_cpu_s", "{:.2f}")]


def cell(row: dict[str, Any], part: str | None, key: str, fmt: str) -> str:
    value = row.get(key) if part is None else row[part].get(key)
    if key == "message_bytes" and value is not None:
        value = value / 1e6
    return fmt.format(value) if value is not None else "-"


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, Any] = {"inprocess": {}, "triton": {}}
    for part in ("inprocess", "triton"):
        for key, value in rows[0][part].items():
            if isinstance(value, (int, float)):
                med[part][key] = statistics.median(r[part][key] for r in rows)
    med["lost_pct"] = statistics.median(r["lost_pct"] for r in rows)
    return med


def table(rows: list[dict[str, Any]], med: dict[str, Any]) -> str:
    head = ["run"] + [c[0] for c in COLUMNS]
    lines = [head] + [[str(i + 1)] + [cell(r, *c[1:]) for c in COLUMNS] for i, r in enumerate(rows)]
    lines.append(["median"] + [cell(med, *c[1:]) for c in COLUMNS])
    widths = [max(len(line[j]) for line in lines) for j in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-llama"),
                    help="its config.json and tokenizer (the stand-in loads no weights)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, help="a step's fixed device time (synthetic_executor.py's default)")
    ap.add_argument("--token-us", type=float, help="device time per batched token")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=1, help="client processes (benchmarks/loadgen/bench.py --procs)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--py-spy", metavar="PATH", help="record the stub's threads during the first Triton run "
                    "(py-spy's raw format; with --py-spy-gil only the thread holding the GIL)")
    ap.add_argument("--py-spy-gil", action="store_true")
    ap.add_argument("--workdir", help="server logs and JSON of each run (default: a temporary directory)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    if args.step_ms is not None:
        env[STEP_MS_ENV] = str(args.step_ms)
    if args.token_us is not None:
        env[TOKEN_US_ENV] = str(args.token_us)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tritium-response-path-")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for i in range(args.repeats):
        load_before = machine_load()
        inproc = run_in_process(args, env, workdir, i)
        triton = run_triton_retrying(args, env, workdir, i)
        row = {"inprocess": inproc, "triton": triton, "load_avg": [load_before, machine_load()],
               "lost_pct": 100.0 * (1.0 - triton["tok_s"] / inproc["tok_s"])}
        rows.append(row)
        print(f"repeat {i + 1}: in-process {inproc['tok_s']:,.0f} tok/s, Triton {triton['tok_s']:,.0f} tok/s "
              f"({row['lost_pct']:.1f}% lost), load average {load_before[0]:.2f}", flush=True)
    med = median_row(rows)
    print(table(rows, med))
    if args.json:
        result = {"runner": "response-path", "workload": {"num_requests": args.num_requests,
                                                          "input_len": args.input_len, "output_len": args.output_len},
                  "engine_args": engine_args(args), "step_ms": env.get(STEP_MS_ENV), "token_us": env.get(TOKEN_US_ENV),
                  "cpus": os.cpu_count(), "runs": rows, "median": med}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
