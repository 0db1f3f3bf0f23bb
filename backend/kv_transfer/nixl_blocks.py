"""An engine's paged KV cache registered with NIXL, so that another engine reads whole blocks of
it (disaggregated prefill: the decode instance pulls a prompt's blocks from the prefill instance).

The cache is the worker's [2, layers, num_blocks, ...] tensor: each (K or V, layer, block) is one
contiguous region, so a block is 2 x layers regions at fixed offsets. Each side prepares its own
regions once (`prep_xfer_dlist`); a read names blocks by index into those lists, and NIXL merges
what is contiguous. The peer learns the cache's place and shape from `metadata()` (its NIXL agent
metadata and the cache's geometry) through whatever channel the two engines share. NIXL moves
DRAM and VRAM alike (UCX, within a host or across it); on the CPU machine the caches are DRAM.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch


def _nixl():
    """NIXL's Python API: the `nixl` package, else a build of it installed alone (nixl-cu12)."""
    try:
        from nixl import _api
    except ImportError:
        from nixl_cu12 import _api
    return _api


@dataclass(frozen=True)
class CacheGeometry:
    """Where a cache is and how it is cut: what a peer needs to address its blocks."""
    base: int  # address of region 0
    num_layers: int
    num_blocks: int
    region_bytes: int  # one (K or V, layer, block)
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def region_addresses(self) -> np.ndarray:
        """[2 * layers * blocks, 3] (address, length, device id), region (kv, layer, block) at
        index (kv * layers + layer) * blocks + block."""
        n = 2 * self.num_layers * self.num_blocks
        out = np.empty((n, 3), dtype=np.uint64)
        out[:, 0] = self.base + np.arange(n, dtype=np.uint64) * np.uint64(self.region_bytes)
        out[:, 1] = self.region_bytes
        out[:, 2] = self.device_id
        return out

    def region_indices(self, block_ids: list[int]) -> np.ndarray:
        """The regions of these blocks, (K or V, layer) plane by plane, the blocks in the given
        order within each: the same order on both sides pairs them up, and a run of consecutive
        blocks on both sides is adjacent in memory, which NIXL merges into one operation."""
        planes = np.arange(2 * self.num_layers, dtype=np.int64)[:, None] * self.num_blocks
        return (planes + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


def _parse_metadata(metadata: bytes) -> tuple[bytes, CacheGeometry]:
    try:
        d = json.loads(metadata)
        g = d["geometry"]
        ints = {k: g[k] for k in ("base", "num_layers", "num_blocks", "region_bytes", "device_id")}
        if not all(type(v) is int and v >= 0 for v in ints.values()) or g["mem_type"] not in ("DRAM", "VRAM"):
            raise ValueError
        return base64.b64decode(d["agent"], validate=True), CacheGeometry(mem_type=g["mem_type"], **ints)
    except (ValueError, KeyError, TypeError):
        raise ValueError("the peer's KV transfer metadata is not what a Tritium engine sends") from None


def cache_geometry(kv_cache: torch.Tensor) -> CacheGeometry:
    if kv_cache.dim() < 3 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [2, layers, num_blocks, ...] tensor, "
                         f"got shape {tuple(kv_cache.shape)}")
    region = kv_cache[0, 0, 0]
    return CacheGeometry(kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2],
                         region.numel() * region.element_size(),
                         "VRAM" if kv_cache.is_cuda else "DRAM",
                         (kv_cache.device.index or 0) if kv_cache.is_cuda else 0)


# NIXL's progress thread waits this long between rounds. Its Python API starts it with no wait,
# which spins a whole core per engine even when nothing moves; a tenth of a millisecond keeps a
# transfer's added latency below that of one decode step.
PROGRESS_THREAD_DELAY_US = 100
_AGENT_LOCK = threading.Lock()


def _agent(api, name: str, num_threads: int):
    """A NIXL agent on UCX whose progress thread sleeps between rounds: the API gives no option
    for that, so the agent's config is amended on its way to the binding's constructor. Its
    calls are locked for readers and writers: reads are posted from a thread of their own."""
    with _AGENT_LOCK:
        make = api.nixlBind.nixlAgent

        def paced(agent_name, config):
            config.pthrDelay = PROGRESS_THREAD_DELAY_US
            return make(agent_name, config)

        api.nixlBind.nixlAgent = paced
        try:
            return api.nixl_agent(name, api.nixl_agent_config(
                backends=["UCX"], num_threads=num_threads, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW))
        finally:
            api.nixlBind.nixlAgent = make


# UCX workers a GPU cache's reads are split across (vLLM's NixlConnector default): posting a read
# costs a few microseconds per region, and a long prompt has thousands of regions.
GPU_NUM_THREADS = 4


class NixlBlockTransfer:
    """One engine's side: its cache registered, its regions prepared, the peers it reads from.
    Reads are posted on a thread of this object's, so that the engine's step loop never waits
    for NIXL to hand a long prompt's regions to UCX."""

    def __init__(self, kv_cache: torch.Tensor, name: str | None = None, num_threads: int | None = None) -> None:
        api = _nixl()
        self.geometry = cache_geometry(kv_cache)
        self.name = name or f"tritium-{uuid.uuid4().hex[:12]}"
        if num_threads is None:
            num_threads = GPU_NUM_THREADS if kv_cache.is_cuda else 0
        if kv_cache.is_cuda:
            # The consumer reads (a remote GET). UCX's cuda_ipc transport turns GET off on a GPU
            # with no active NVLink (a single card, PCIe pairs), and the reads then crawl over
            # TCP; an operator's own setting wins. (Without CUDA, UCX warns of the unused key.)
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        self.agent = _agent(api, self.name, num_threads)
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="nixl-reads")
        self._cache = kv_cache  # registered memory must outlive the agent's use of it
        self._registered = self.agent.register_memory(kv_cache)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.geometry.region_addresses(),
                                                 self.geometry.mem_type)
        self._peers: dict[str, tuple[CacheGeometry, object]] = {}

    def metadata(self) -> bytes:
        """What a peer passes to `add_peer` to read this cache: JSON (it travels through clients
        and proxies, so it must never be anything a reader would execute)."""
        return json.dumps({"agent": base64.b64encode(self.agent.get_agent_metadata()).decode("ascii"),
                           "geometry": dataclasses.asdict(self.geometry)}).encode("utf-8")

    def add_peer(self, metadata: bytes) -> str:
        """Accept a peer's `metadata()`; returns its name for `read`. Its cache must be cut as
        this one is (the same model, dtype and block size on both sides)."""
        agent_metadata, geometry = _parse_metadata(metadata)
        if (geometry.num_layers, geometry.region_bytes) != (self.geometry.num_layers, self.geometry.region_bytes):
            raise ValueError(
                f"the peer's KV cache has {geometry.num_layers} layers of {geometry.region_bytes}-byte blocks, "
                f"this one {self.geometry.num_layers} of {self.geometry.region_bytes}: not the same model, "
                f"dtype or block size")
        try:
            peer = self.agent.add_remote_agent(agent_metadata)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            remote = self.agent.prep_xfer_dlist(peer, geometry.region_addresses(), geometry.mem_type)
        except Exception as exc:  # (NIXL's own exception types: the peer unreachable or gone)
            raise RuntimeError(f"NIXL could not reach the peer: {exc}") from exc
        self._peers[peer] = (geometry, remote)
        return peer

    def read(self, peer: str, remote_blocks: list[int], local_blocks: list[int], notification: bytes = b"") -> Future:
        """Start copying the peer's blocks into this cache's (pairwise); returns a handle for
        `poll`. The peer receives `notification` once the copy is done. Bad block ids raise here;
        NIXL's own failures come from `poll`."""
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones")
        geometry, remote = self._peers[peer]
        for name, ids, limit in (("remote", remote_blocks, geometry.num_blocks),
                                 ("local", local_blocks, self.geometry.num_blocks)):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise ValueError(f"{name} block ids {bad} are outside 0..{limit - 1}")
        return self._poster.submit(self._post, peer, remote, geometry, remote_blocks, local_blocks, notification)

    def _post(self, peer: str, remote, geometry: CacheGeometry, remote_blocks: list[int], local_blocks: list[int],
              notification: bytes):
        try:
            handle = self.agent.make_prepped_xfer("READ", self._local, self.geometry.region_indices(local_blocks),
                                                  remote, geometry.region_indices(remote_blocks), notification)
        except Exception as exc:  # (NIXL's own exception types: the peer gone, a backend error)
            raise RuntimeError(f"NIXL could not prepare a read of {len(remote_blocks)} blocks from {peer}: "
                               f"{exc}") from exc
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:
            state = f"{exc}"
        if state not in ("DONE", "PROC"):
            handle.release()
            raise RuntimeError(f"NIXL could not read {len(remote_blocks)} blocks from {peer}: {state}")
        return handle

    def poll(self, read: Future) -> bool:
        """True once the read is done (NIXL's handle is released then); raises if it failed."""
        if not read.done():
            return False
        handle = read.result()  # (raises what posting raised)
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:  # (the peer gone mid-read)
            state = f"{exc}"
        if state == "PROC":
            return False
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"a NIXL read of KV blocks failed: {state}")
        return True

    def notify(self, peer: str, message: bytes) -> None:
        """Send a peer a notification without a read (nothing of its cache was needed)."""
        self.agent.send_notif(peer, message)

    def notifications(self) -> list[bytes]:
        """Notifications peers sent since the last call (a reader's `notification` when its read
        of this cache's blocks is done: the blocks can be freed)."""
        return [m for messages in self.agent.get_new_notifs().values() for m in messages]

    def close(self) -> None:
        """Forget the peers, unregister the cache and end the agent (a peer's read then fails
        at once, as if this engine had died)."""
        if self.agent is None:
            return
        self._poster.shutdown(wait=True)  # (a read being posted still names the peers' lists)
        for peer, (_, remote) in list(self._peers.items()):
            remote.release()
            self.agent.remove_remote_agent(peer)
        self._peers.clear()
        self._local.release()
        self.agent.deregister_memory(self._registered)
        self.agent = self._local = self._registered = None  # (the agent ends with its last reference)
