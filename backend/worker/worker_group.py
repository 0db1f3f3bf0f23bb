"""WorkerGroup: rank 0's side of tensor parallelism. It starts ranks 1..N-1 as processes
(`python -m tritium.worker.tp_worker`), joins their torch.distributed group, and sends them the
engine's work: each step as the scheduler made it (a `StepCall`: the `SchedulerOutput` itself,
and the directories of adapters it loads), which every rank applies to its own states and runs
the same way, and each LM-head call of rank 0 (a `LogitsCall`). A message is pickled once and
sent down every rank's pipe; the collectives of that work follow, which every rank runs in the
same order. The pipes are the control plane (start-up handshakes, steps, errors, shutdown), the
process group the data plane (the step's input ids, activations, hidden states). Ranks fail
loudly: a rank that dies makes every later call raise RankFailed, naming it."""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from ..engine_config import EngineConfig
from ..layers.moe import check_block_fp8_experts
from ..layers.parallel_state import destroy_tp_group, init_tp_group, tp_broadcast
from ..layers.quantization import fp8_weight_block_size
from ..python_env import python_executable
from ..step import SchedulerOutput

logger = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 10.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank failed or died; the engine must be reloaded."""


# ---- messages rank 0 -> ranks (after start-up) ------------------------------------------------
@dataclass
class Exchange:
    """A start-up handshake: each rank sends its value; rank 0 answers with all of them."""
    tag: str
    value: Any


@dataclass
class Failed:
    rank: int
    error: str


@dataclass
class StepCall:
    """A step for every rank: the scheduler's output (as rank 0's runner receives it, less the
    guided rows' masks, which only the sampler reads) and the directory of each adapter it
    loads into a slot, which the ranks read themselves."""
    step: SchedulerOutput
    adapter_dirs: dict[str, str]


@dataclass
class LogitsCall:
    """One LM-head call on `rows` hidden states, which rank 0 broadcasts."""
    rows: int


@dataclass
class Stop:
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tp_shapes(hf_config: dict, tp: int) -> None:
    """ValueError unless the model's heads and MLP split over `tp` ranks."""
    heads = hf_config["num_attention_heads"]
    kv = hf_config.get("num_key_value_heads") or heads
    inter = hf_config["intermediate_size"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_attention_heads={heads}.")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads={kv}: "
                         f"one must divide the other (kv heads are split, or replicated when fewer).")
    if inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"intermediate_size={inter}.")
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = (hf_config.get(name) or 0) if experts else 0
        if size % tp:  # experts shard their intermediate dimension, as the dense MLP does
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={size}.")
    if experts and fp8_weight_block_size(hf_config.get("quantization_config")):
        check_block_fp8_experts(hf_config.get("moe_intermediate_size") or inter, tp)


class _Ranks:
    """What a WorkerGroup holds outside Python: the ranks' processes, their pipes, rank 0's place
    in the process group. `release` is the group's finalizer, so that an engine that is only
    collected frees them too, and a new tensor-parallel engine can start in this process."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.joined = False  # this group's init_tp_group succeeded: the process group is ours

    def kill(self) -> None:
        """Stop the ranks by force: for a group that never formed, whose ranks may wait in
        init_tp_group for rank 0, where no Stop reaches them."""
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def release(self) -> None:
        """Stop the ranks (politely, then by force), close the pipes, leave the process group."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(Stop()))
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        if self.joined:  # never another engine's group (one that made init_tp_group refuse this one)
            self.joined = False
            destroy_tp_group()


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine, driven by rank 0 (this process)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        tp = config.parallel_config.tensor_parallel_size
        check_tp_shapes(config.model_config.hf_config, tp)
        if device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; "
                             f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES).")
        self.size = tp
        self.device = device
        self.failure: str | None = None
        port = free_port()
        self._ranks = _Ranks()
        self.procs, self.conns = self._ranks.procs, self._ranks.conns
        self._finalizer = weakref.finalize(self, self._ranks.release)
        for rank in range(1, tp):
            parent, child = socket.socketpair()
            self.procs.append(subprocess.Popen(
                [python_executable(), "-m", "tritium.worker.tp_worker", str(child.fileno()), str(rank),
                 str(tp), str(port)], pass_fds=[child.fileno()]))
            child.close()
            conn = Connection(parent.detach())
            conn.send(config)
            self.conns.append(conn)
        try:
            self.exchange("hello", os.getpid())  # every rank runs before the group forms
            init_tp_group(0, tp, port, device)
            self._ranks.joined = True
        except BaseException:
            # No group formed: a polite stop would only wait out its timeout for ranks that
            # are joining a group rank 0 never opened.
            self._ranks.kill()
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks over %s (pids %s)", tp,
                    "nccl" if device.type == "cuda" else "gloo", [p.pid for p in self.procs])

    # ---- start-up handshakes ----------------------------------------------------------------------
    def exchange(self, tag: str, value: Any) -> list[Any]:
        """Every rank's value for `tag`, rank 0's first; RankFailed with a rank's error."""
        values = [value]
        for rank, conn in enumerate(self.conns, start=1):
            try:
                message = conn.recv()
            except (EOFError, OSError):
                raise RankFailed(self._describe_exit(rank, "at start-up")) from None
            if isinstance(message, Failed):
                raise RankFailed(f"tensor-parallel rank {message.rank} failed: {message.error}")
            if not isinstance(message, Exchange) or message.tag != tag:
                raise RankFailed(f"tensor-parallel rank {rank}: expected {tag!r}, got {message!r}")
            values.append(message.value)
        for conn in self.conns:
            conn.send(Exchange(tag, values))
        return values

    # ---- the work of every rank -----------------------------------------------------------------
    def _send(self, message: Any) -> None:
        self.check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def step(self, step: SchedulerOutput, adapter_dirs: dict[str, str]) -> None:
        """Send the step to the ranks, which run it as rank 0 does (`ModelRunner.follow_step`)."""
        if step.grammar_bitmask is not None:
            step = dataclasses.replace(step, grammar_bitmask=None)
        self._send(StepCall(step, adapter_dirs))

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The LM head split over the vocabulary: every rank computes its part of the logits
        from rank 0's hidden states, which are broadcast to them."""
        try:
            self._send(LogitsCall(hidden.shape[0]))
            return head(tp_broadcast(hidden.contiguous()))
        except RankFailed:
            raise
        except Exception as exc:  # the ranks' collectives are out of step from here on
            raise self.failed(exc) from exc

    # ---- faults -----------------------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is None and any(p.poll() is not None for p in self.procs):
            self.failure = self._describe_failure()
        if self.failure is not None:
            raise RankFailed(self.failure)

    def failed(self, exc: BaseException) -> RankFailed:
        """The RankFailed to raise for an error in rank 0's part of a collective or a send."""
        if self.failure is None:
            for proc in self.procs:  # a rank that died closes its sockets a moment before it is reaped
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
            self.failure = self._describe_failure(exc)
        return RankFailed(self.failure)

    def _describe_failure(self, exc: BaseException | None = None) -> str:
        reasons = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                while conn.poll():
                    message = conn.recv()
                    if isinstance(message, Failed):
                        reasons.append(f"rank {rank} failed: {message.error}")
            except (EOFError, OSError):
                pass
            if proc.poll() is not None:
                reasons.append(self._describe_exit(rank, "while serving"))
        if not reasons:
            reasons.append(f"rank 0's collective failed: {exc}")
        return ("tensor-parallel worker lost (" + "; ".join(reasons) +
                "); the model must be reloaded")

    def _describe_exit(self, rank: int, when: str) -> str:
        proc = self.procs[rank - 1]
        try:
            code = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"tensor-parallel rank {rank} (pid {proc.pid}) closed its pipe {when}"
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"tensor-parallel rank {rank} (pid {proc.pid}) died {when} ({how})"

    def shutdown(self) -> None:
        """Stop every rank and leave the process group; idempotent."""
        self._finalizer()
