"""Soak test: a tritonserver of our own (tiny model, loopback, explicit model control) under a mix of
good, malformed, cancelled, disconnected, over-deadline and over-capacity requests, with reloads and
an engine kill, bounded in time (--duration-s) and requests (--max-requests).

Checks: every request ends with exactly one terminal response (a FINAL, or one error) and nothing
after it; at each quiet point (traffic paused, in-flight requests ended) the engine's running and
waiting gauges and KV usage are back to 0; the server's process tree does not grow in processes,
threads or RSS from the first quiet point to the last. The episodes (reload, overcapacity, kill)
report what they observed. Prints a report; writes JSON (--json-out).
Exit status 1 when an invariant fails.

    .venv/bin/python -m benchmarks.soak --duration-s 600 --json-out docs/results/soak.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict

import psutil

from benchmarks.soak_requests import Outcome, grpc_request, run_request
from tests.triton_server import (TEST_ENGINE_ARGS, TritonServer, ensure_default_model, grpc_inputs,
                                 start_server, write_model_repository)

REQUEST_KINDS = ("good", "malformed", "cancel", "disconnect", "deadline")
EPISODES = ("overcapacity", "reload", "kill")
SCENARIOS = REQUEST_KINDS + EPISODES
MAX_WAITING = 8  # max_waiting_requests with the overcapacity scenario
MAX_NUM_SEQS = 16
def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # a zombie has none
        return ""


def process_tree(server: TritonServer) -> dict:
    """The server and its descendants: processes (zombies too), threads, RSS, what they are."""
    root = psutil.Process(server.proc.pid)
    procs, threads, rss, names = [root] + root.children(recursive=True), 0, 0, collections.Counter()
    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                names["zombie"] += 1
                continue
            threads += p.num_threads()
            rss += p.memory_info().rss
            cmd = _cmdline(p)
            names["engine" if "process_main" in cmd else os.path.basename(cmd.split(" ")[0]) or p.name()] += 1
        except psutil.NoSuchProcess:
            pass
    return {"processes": len(procs), "threads": threads, "rss_mb": round(rss / 2**20, 1), "names": dict(names)}


class Soak:
    def __init__(self, server: TritonServer, args: argparse.Namespace) -> None:
        self.server, self.args = server, args
        self.kinds = [k for k in REQUEST_KINDS if k in args.scenarios]
        self.weights = [{"good": 10, "malformed": 2, "cancel": 2, "disconnect": 1, "deadline": 1}[k] for k in self.kinds]
        self.outcomes: list[Outcome] = []
        self.episodes: list[dict] = []
        self.quiet_points: list[dict] = []
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop = threading.Event()
        self.in_flight = 0
        self.issued = 0
        self.start = time.monotonic()

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            if not self.running.wait(0.2):
                continue
            with self.lock:  # pause() clears `running`, then waits for in_flight to reach 0
                go = self.running.is_set() and self.issued < self.args.max_requests
                if go:
                    self.issued += 1
                    self.in_flight += 1
            if not go:
                time.sleep(0.05)
                continue
            try:
                kind = rng.choices(self.kinds, self.weights)[0]
                try:
                    out = run_request(kind, self.server, rng)
                except Exception as e:  # noqa: BLE001 - the soak reports it, it does not stop
                    out = Outcome(kind, ended="client exception", errors=[f"{type(e).__name__}: {e}"])
                with self.lock:
                    self.outcomes.append(out)
                if out.ended in ("error", "client exception") and kind != "malformed":
                    time.sleep(0.1)  # the model is away (reload, kill): retry as a client would
            finally:
                with self.lock:
                    self.in_flight -= 1

    def pause(self) -> None:
        self.running.clear()
        while self.in_flight:
            time.sleep(0.05)

    def metric(self, name: str) -> float | None:
        try:
            return self.server.metric(name)
        except (KeyError, OSError):
            return None  # no instance publishing (unloaded)

    def quiet_point(self, label: str) -> dict:
        """Traffic paused: wait for the engine's gauges to reach 0, then sample the process tree."""
        self.pause()
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        deadline, values = time.monotonic() + 20, {}
        while True:
            values = {n.split(":")[1]: self.metric(n) for n in names}
            if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        point = {"t_s": round(time.monotonic() - self.start, 1), "after": label, **values,
                 **process_tree(self.server)}
        self.quiet_points.append(point)
        return point

    def good_request_works(self) -> bool:
        out = run_request("good", self.server, random.Random(0))
        return out.ended == "final"

    def reload(self) -> dict:
        """Unload and load under traffic, over gRPC: running requests end with an error. (A load
        over HTTP holds one of tritonserver's HTTP threads for the whole load; an HTTP stream on
        that thread whose client leaves meanwhile is never released by tritonserver 2.51, and
        keeps the old instance's stub until the server stops: see README, "Reloading".)"""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.running.set()
        time.sleep(1.0)
        t0 = time.monotonic()
        client, failure = grpcclient.InferenceServerClient(self.server.grpc_url), None
        try:
            client.unload_model("llm")
            client.load_model("llm")
        except InferenceServerException as e:
            failure = str(e)
        finally:
            client.close()
        ready = self.server.is_ready("llm")
        return {"episode": "reload", "failure": failure, "ready": ready, "seconds": round(time.monotonic() - t0, 1),
                "finding": "reloaded" if ready else f"model not ready after load: {failure}"}

    def overcapacity(self) -> dict:
        """A burst of max_num_seqs + 3 x max_waiting_requests long requests at once."""
        burst = MAX_NUM_SEQS + 3 * MAX_WAITING
        results: list[Outcome] = []
        def one(i: int) -> None:
            out = grpc_request(self.server.grpc_url, "overcapacity", grpc_inputs(
                f"burst {i}", sampling={"max_tokens": 64, "ignore_eos": True}, stream=True))
            with self.lock:
                results.append(out)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self.lock:
            self.outcomes += results
        refused = [o for o in results if o.errors and ("busy" in o.errors[0] or "UNAVAILABLE" in o.errors[0])]
        codes = collections.Counter(o.errors[0][:60] if o.errors else o.ended for o in results)
        return {"episode": "overcapacity", "burst": burst, "refused": len(refused), "outcomes": dict(codes),
                "finding": (f"{len(refused)} of {burst} refused as busy"
                            + (", answered INTERNAL ('internal error: ...'), not UNAVAILABLE"
                               if any("internal error" in o.errors[0] for o in refused) else "")
                            if refused else "no request refused: over-capacity refusal not observed")}

    def kill(self) -> dict:
        """SIGKILL the engine process under traffic; does the model recover by itself?"""
        engines = [p for p in psutil.Process(self.server.proc.pid).children(recursive=True)
                   if "process_main" in _cmdline(p)]
        if not engines:
            return {"episode": "kill", "finding": "no engine process found (TRITIUM_ENGINE_PROCESS=0?)"}
        self.running.set()
        time.sleep(1.0)
        t0 = time.monotonic()
        for p in engines:
            p.send_signal(signal.SIGKILL)
        time.sleep(3.0)
        self.pause()
        recovered_s = None
        while time.monotonic() - t0 < self.args.recover_s:
            if self.good_request_works():
                recovered_s = round(time.monotonic() - t0, 1)
                break
            time.sleep(1.0)
        # What a readiness probe on /v2/models/llm/ready would see meanwhile.
        ready = self.server.is_ready("llm")
        result = {"episode": "kill", "killed_pids": [p.pid for p in engines], "recovered_s": recovered_s,
                  "model_ready_while_failing": ready if recovered_s is None else None}
        if recovered_s is not None:
            result["finding"] = f"recovered by itself in {recovered_s} s"
        else:
            result["reload"] = self.reload()
            self.pause()
            works = self.good_request_works()
            result["finding"] = (f"the model did not recover in {self.args.recover_s:.0f} s"
                                 + (" (its ready endpoint said 200 all along)" if ready else "")
                                 + ("; a reload restored it" if works else "; a reload did not restore it"))
        return result

    def run(self) -> dict:
        workers = [threading.Thread(target=self.worker, args=(self.args.seed + i,), daemon=True)
                   for i in range(self.args.concurrency)]
        for w in workers:
            w.start()
        episodes = [e for e in ("overcapacity", "reload", "kill") if e in self.args.scenarios]
        end = self.start + self.args.duration_s
        self.running.set()
        time.sleep(min(10.0, self.args.duration_s / 6))
        self.quiet_point("warm-up")
        next_episode, n = time.monotonic() + self.args.episode_every_s, 0
        while time.monotonic() < end and self.issued < self.args.max_requests:
            self.running.set()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            if episodes and time.monotonic() >= next_episode and time.monotonic() < end - 5:
                name = episodes[n % len(episodes)]
                n += 1
                if name == "kill" and any(e["episode"] == "kill" for e in self.episodes):
                    continue  # once per run
                self.quiet_point(f"before {name}")
                self.episodes.append({"t_s": round(time.monotonic() - self.start, 1), **getattr(self, name)()})
                self.quiet_point(name)
                next_episode = time.monotonic() + self.args.episode_every_s
        self.quiet_point("end")
        self.stop.set()
        for w in workers:
            w.join()
        return self.report()

    def report(self) -> dict:
        per_kind: dict[str, dict] = {}
        for o in self.outcomes:
            k = per_kind.setdefault(o.kind, {"requests": 0, "ended": collections.Counter(),
                                             "errors": collections.Counter(), "seconds": []})
            k["requests"] += 1
            k["ended"][o.ended] += 1
            for e in o.errors[:1]:
                k["errors"][e.split("\n")[0][:90]] += 1
            k["seconds"].append(o.seconds)
        for k in per_kind.values():
            s = sorted(k.pop("seconds"))
            k["p50_s"], k["max_s"] = round(s[len(s) // 2], 3), round(s[-1], 3)
            k["ended"], k["errors"] = dict(k["ended"]), dict(k["errors"].most_common(6))
        deadline = [o for o in self.outcomes if o.kind == "deadline"]
        findings = [e["finding"] for e in self.episodes]
        if deadline:
            ends = collections.Counter(f"finish_reason {o.finish_reason}" if o.ended == "final"
                                       else o.errors[0][:50] if o.errors else o.ended for o in deadline)
            full = sorted(o.seconds for o in deadline if o.finish_reason == "length")
            findings.append(f"deadline (300 ms timeout, 400 tokens), {len(deadline)} requests: {dict(ends)}"
                            + (f"; {len(full)} ran all 400 tokens (median {full[len(full) // 2]:.2f} s): "
                               f"the timeout is not enforced" if full else ""))
        for q in self.quiet_points:
            if q["processes"] > self.quiet_points[0]["processes"]:
                findings.append(f"quiet point at {q['t_s']} s (after {q['after']}): {q['processes']} processes "
                                f"{q['names']}, {q['threads']} threads, {q['rss_mb']} MB")
        first, last = self.quiet_points[0], self.quiet_points[-1]
        one_terminal = [o for o in self.outcomes if o.ended not in ("cancelled", "disconnected") and (
            o.ended in ("no final", "client exception") or o.terminals != 1 or o.after_terminal)]
        not_quiet = [q for q in self.quiet_points if any(q[n] != 0 for n in
                                                          ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))]
        invariants = {
            "one terminal response per request": not one_terminal,
            "engine idle and KV usage 0 at every quiet point": not not_quiet,
            "process count not grown": last["processes"] <= first["processes"],
            f"threads within +{self.args.threads_tolerance}": last["threads"] <= first["threads"] + self.args.threads_tolerance,
            f"RSS within +{self.args.rss_tolerance_mb} MB": last["rss_mb"] <= first["rss_mb"] + self.args.rss_tolerance_mb,
        }
        return {"duration_s": round(time.monotonic() - self.start, 1), "requests": len(self.outcomes),
                "scenarios": self.args.scenarios, "per_kind": per_kind, "episodes": self.episodes,
                "findings": findings, "quiet_points": self.quiet_points, "invariants": invariants,
                "violations": [asdict(o) for o in one_terminal[:20]], "not_quiet": not_quiet,
                "passed": all(invariants.values())}


def print_report(r: dict) -> None:
    print(f"\nsoak: {r['requests']} requests in {r['duration_s']} s; scenarios {','.join(r['scenarios'])}")
    print(f"\n{'kind':<13} {'requests':>8} {'p50 s':>7} {'max s':>7}  ended")
    for kind, k in sorted(r["per_kind"].items()):
        print(f"{kind:<13} {k['requests']:>8} {k['p50_s']:>7} {k['max_s']:>7}  "
              + ", ".join(f"{e} {n}" for e, n in sorted(k["ended"].items())))
        for e, n in k["errors"].items():
            print(f"{'':<13} {n:>8} x {e}")
    print(f"\n{'t s':>6} {'after':<20} {'run':>4} {'wait':>4} {'kv':>5} {'procs':>5} {'threads':>7} {'rss MB':>8}")
    for q in r["quiet_points"]:
        print(f"{q['t_s']:>6} {q['after']:<20} {q['num_requests_running']!s:>4} {q['num_requests_waiting']!s:>4} "
              f"{q['kv_cache_usage_perc']!s:>5} {q['processes']:>5} {q['threads']:>7} {q['rss_mb']:>8}")
    print("\nfindings:")
    for f in r["findings"]:
        print(f"  - {f}")
    print("\ninvariants:")
    for name, ok in r["invariants"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}")
    p.add_argument("--episode-every-s", type=float, default=20.0, help="reload / overcapacity / kill, in turn")
    p.add_argument("--recover-s", type=float, default=30.0, help="how long an engine kill may take to recover")
    p.add_argument("--threads-tolerance", type=int, default=8)
    p.add_argument("--rss-tolerance-mb", type=float, default=256.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    p.add_argument("--workdir", help="model repository and server log (default: a temporary directory)")
    args = p.parse_args()
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown or not any(k in args.scenarios for k in REQUEST_KINDS):
        p.error(f"scenarios: unknown {sorted(unknown)}, or no request kind among them")
    workdir = args.workdir or tempfile.mkdtemp(prefix="tritium-soak-")
    # A short drain: a reload under traffic is about what the old instance leaves behind, so it
    # should be gone by the next quiet point (the drain itself has its own tests).
    engine_args = {"model": ensure_default_model(), **TEST_ENGINE_ARGS, "max_num_seqs": str(MAX_NUM_SEQS),
                   "drain_timeout_s": "1"}
    if "overcapacity" in args.scenarios:
        engine_args["max_waiting_requests"] = str(MAX_WAITING)
    repo = write_model_repository(os.path.join(workdir, "repo"), engine_args)
    log = os.path.join(workdir, "tritonserver.log")
    # SIGTERM (a CI timeout, kill) unwinds through `finally`, so the server goes with the soak.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = start_server(repo, log, "--model-control-mode=explicit", "--load-model=llm")
    try:
        report = Soak(server, args).run()
    finally:
        server.stop()
    report["server_log"] = log
    print_report(report)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
