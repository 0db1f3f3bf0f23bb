"""Disaggregated prefill on the engine's side (vLLM's `kv_transfer_config` with NixlConnector):
a producer engine prefills a prompt and keeps its blocks for a consumer; the consumer reads them
instead of computing the prompt, then decodes.

A request steers it through `SamplingParams.extra_args["kv_transfer_params"]`, as vLLM's proxy
does: `{"do_remote_decode": true}` on the producer (with max_tokens=1); the producer's final
output carries `kv_transfer_params` for the consumer (its engine id, the block ids holding the
prompt, the prompt's length, its NIXL metadata, the key it holds the blocks under), which the
proxy passes on unchanged. The consumer admits the request with blocks for the prompt but its
last token, reads the part its own prefix cache lacks through NIXL while other sequences keep
decoding, tells the producer when done (the producer frees the blocks then, or after
`abort_timeout_s`), and runs the last prompt token itself for its logits.
"""
from __future__ import annotations

import base64
import logging
import time
from typing import Any, Callable

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..core.sequence import RemotePrefill, Sequence, SequenceStatus
from ..engine_config import KVTransferConfig
from ..errors import ErrorKind, RequestError
from ..kv_transfer.nixl_blocks import NixlBlockTransfer
from .request import Request

logger = logging.getLogger(__name__)

_PRODUCED = ("remote_engine_id", "remote_block_ids", "remote_num_tokens", "remote_metadata", "remote_request_key")


def kv_transfer_params(params) -> dict[str, Any] | None:
    extra = params.extra_args or {}
    value = extra.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise ValueError("extra_args.kv_transfer_params must be an object.")
    return value


class KVConnector:
    def __init__(self, config: KVTransferConfig, transfer: NixlBlockTransfer, scheduler: Scheduler,
                 block_manager: BlockManager, requests: dict[str, Request],
                 fail: Callable[[str, RequestError], None]) -> None:
        self.config = config
        self.transfer = transfer
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.requests = requests
        self._fail = fail  # ends a request with an error (the engine's abort_request)
        self.engine_id = transfer.name
        self._metadata = base64.b64encode(transfer.metadata()).decode("ascii")
        self._peers: dict[str, str] = {}  # producer engine id -> NIXL peer name
        self._holds: dict[str, float] = {}  # producer: key -> when its blocks go back unread
        self._loads: dict[int, tuple[Any, Sequence, float]] = {}  # consumer: seq id -> (read, sequence, start)
        self._orphans: dict[str, Any] = {}  # consumer: reads whose sequence ended first, by hold key
        self.num_transfers = 0
        self.num_blocks_transferred = 0
        self.transfer_seconds = 0.0
        g = transfer.geometry
        self.block_bytes = 2 * g.num_layers * g.region_bytes
        scheduler.on_finish = self._on_finish

    # ---- requests -----------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """At enqueue: a consumer's request gets its remote prefill; a wrong one a clear error."""
        params = kv_transfer_params(seq.params)
        if not params or not params.get("do_remote_prefill"):
            if params and params.get("do_remote_decode") and not self.config.is_producer:
                raise ValueError(f"kv_transfer_params.do_remote_decode needs a producer engine "
                                 f"(kv_role kv_producer or kv_both), this one is {self.config.kv_role}.")
            return
        if not self.config.is_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill needs a consumer engine "
                             f"(kv_role kv_consumer or kv_both), this one is {self.config.kv_role}.")
        missing = [k for k in _PRODUCED if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}: pass on what the "
                             f"producer's output returned.")
        if params["remote_num_tokens"] != seq.num_prompt_tokens:
            raise ValueError(f"kv_transfer_params: the producer computed {params['remote_num_tokens']} prompt "
                             f"tokens, this request has {seq.num_prompt_tokens}: not the same prompt.")
        block_ids, needed = params["remote_block_ids"], self.block_manager.blocks_needed(seq.num_prompt_tokens)
        if (not isinstance(block_ids, list) or len(block_ids) != needed
                or not all(type(b) is int and b >= 0 for b in block_ids)):
            raise ValueError(f"kv_transfer_params: remote_block_ids must be the {needed} block ids the "
                             f"producer returned for this prompt.")
        if not all(isinstance(params[k], str) for k in ("remote_engine_id", "remote_metadata", "remote_request_key")):
            raise ValueError("kv_transfer_params: remote_engine_id, remote_metadata and remote_request_key "
                             "must be the strings the producer returned.")
        if seq.params.n != 1:
            raise ValueError("kv_transfer_params.do_remote_prefill serves n=1 requests.")
        seq.remote_prefill = RemotePrefill(params["remote_engine_id"], list(params["remote_block_ids"]),
                                           params["remote_num_tokens"], params["remote_metadata"],
                                           params["remote_request_key"])

    def _on_finish(self, seq: Sequence) -> None:
        """Producer: a request that asked for a remote decode keeps its prompt's blocks, and its
        output says where they are. Also a consumer's sequence ending while its read runs."""
        if seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self._orphan(seq)
            return
        params = kv_transfer_params(seq.params)
        if (not self.config.is_producer or not params or not params.get("do_remote_decode")
                or seq.finish_reason not in ("length", "stop")):
            return
        n = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        if seq.num_computed_tokens < seq.num_prompt_tokens - 1 or seq.num_released_blocks or len(seq.block_table) < n:
            return  # (its prompt's blocks are not all there: the consumer prefills)
        key = f"{self.engine_id}/{seq.request_id}/{seq.seq_id}"
        block_ids = seq.block_table[:n]
        self.block_manager.hold(key, block_ids)
        self._holds[key] = time.monotonic() + self.config.abort_timeout_s
        req = self.requests.get(seq.request_id)
        if req is not None:
            req.kv_transfer_params = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": block_ids, "remote_num_tokens": seq.num_prompt_tokens,
                "remote_metadata": self._metadata, "remote_request_key": key}

    # ---- every step ---------------------------------------------------------------------------
    def poll(self) -> None:
        """Before a step: free what consumers have read (or nobody read in time), and let the
        sequences whose reads are done run."""
        for message in self.transfer.notifications():
            self._release(message.decode("utf-8", "replace"))
        now = time.monotonic()
        for key in [k for k, deadline in self._holds.items() if deadline <= now]:
            logger.warning("disaggregated prefill: blocks held under %s were not read within %.0f s; freed",
                           key, self.config.abort_timeout_s)
            self._release(key)
        for key, handle in list(self._orphans.items()):
            if self._done(handle):
                del self._orphans[key]
                self.block_manager.release(key)
        self._finish_reads()

    def _finish_reads(self) -> None:
        for seq_id, (handle, seq, started) in list(self._loads.items()):
            try:
                done = self.transfer.poll(handle)
            except RuntimeError as exc:
                del self._loads[seq_id]
                self._fail(seq.request_id, RequestError(
                    f"Reading the prompt's KV cache from engine {seq.remote_prefill.engine_id} failed: {exc}",
                    ErrorKind.UNAVAILABLE))
                continue
            if done:
                del self._loads[seq_id]
                self.transfer_seconds += time.perf_counter() - started
                self.scheduler.finish_remote_load(seq)

    def start_reads(self) -> None:
        """Start reading the blocks of the sequences the last `schedule` admitted (a read that
        ends at once lets its sequence run in the next step)."""
        for seq in self.scheduler.take_remote_loads():
            self._start(seq)
        self._finish_reads()

    def _start(self, seq: Sequence) -> None:
        remote = seq.remote_prefill
        try:
            peer = self._peer(remote)
            last = self.block_manager.blocks_needed(remote.end)
            local = seq.block_table[remote.first_block:last]
            if not local:  # this engine's prefix cache held it all
                self.transfer.notify(peer, remote.key.encode())
                self.scheduler.finish_remote_load(seq)
                return
            handle = self.transfer.read(peer, remote.block_ids[remote.first_block:last], local, remote.key.encode())
        except (ValueError, RuntimeError) as exc:
            self._fail(seq.request_id, RequestError(
                f"Reading the prompt's KV cache from engine {remote.engine_id} failed: {exc}", ErrorKind.UNAVAILABLE))
            return
        self.num_transfers += 1
        self.num_blocks_transferred += len(local)
        self._loads[seq.seq_id] = (handle, seq, time.perf_counter())

    def _peer(self, remote: RemotePrefill) -> str:
        peer = self._peers.get(remote.engine_id)
        if peer is None:
            peer = self._peers[remote.engine_id] = self.transfer.add_peer(base64.b64decode(remote.metadata))
        return peer

    def _orphan(self, seq: Sequence) -> None:
        """A consumer's sequence ended while its blocks are read: they stay held until the read
        ends, as NIXL still writes into them."""
        entry = self._loads.pop(seq.seq_id, None)
        if entry is None:
            return
        key = f"read/{seq.seq_id}"
        self.block_manager.hold(key, seq.block_table[seq.num_released_blocks:])
        self._orphans[key] = entry[0]

    def _done(self, handle) -> bool:
        try:
            return self.transfer.poll(handle)
        except RuntimeError:
            return True

    def _release(self, key: str) -> None:
        if self._holds.pop(key, None) is not None:
            self.block_manager.release(key)

    def stats(self) -> dict[str, int | float]:
        """Counters, as EngineStats names them."""
        return {"kv_transfers": self.num_transfers, "kv_transfer_blocks": self.num_blocks_transferred,
                "kv_transfer_bytes": self.num_blocks_transferred * self.block_bytes,
                "kv_transfer_seconds": self.transfer_seconds}

    @property
    def busy(self) -> bool:
        """Reads still running or blocks still held: the engine keeps stepping to see them end."""
        return bool(self._loads or self._orphans)
