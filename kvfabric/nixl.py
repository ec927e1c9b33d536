"""NIXL under kvfabric: one-sided writes into a receiver's registered pool.

NIXL (NVIDIA's transfer library; the PyPI wheels `nixl-cu12` / `nixl-cu13`) moves memory
between agents over UCX: shared memory or CMA between processes of one host, TCP or RDMA
across hosts, CUDA IPC or GPUDirect for device memory. A receiver offering `nixl` makes an
agent and registers its pools (every rank's) once; its hello_ok carries the agent's
metadata and where each pool starts. A sender makes one agent for all its receivers,
registers its own pools once, and per push posts one WRITE per piece of heads, the
descriptors one per run of blocks (a piece narrower than a block: one per row of it).
Posted writes complete on NIXL's progress thread; the sender checks them (no thread per
transfer) before its `ready`, which reports the runs as shm's does, and before it
acknowledges a revocation or sends an abort, so no byte lands after the fence.

Only the sender writes; the receiver's agent takes no part past its registration.
"""
from __future__ import annotations

import importlib
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kvfabric.cuda import DeviceRegion
from kvfabric.errors import FabricError, PeerUnavailable
from kvfabric.layout import HeadMap, Run
from kvfabric.region import BlockRegion

logger = logging.getLogger(__name__)

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
"""The Python packages NIXL's wheels install (one per CUDA major version), in order tried: the
gpu-cu13 extra adds nixl-cu13 beside the nixl-cu12 every install has."""
POLL_S = 50e-6
"""Between two looks at a posted write that has not completed."""

Pool = tuple[int, int, int]
"""A registered pool: (base address, bytes, device index; 0 on the host)."""

_lock = threading.Lock()
_module: ModuleType | None = None
_why: str | None = None


def module() -> ModuleType:
    """NIXL's Python module, imported once; NixlUnavailable says why not."""
    global _module, _why
    with _lock:
        if _module is None and _why is None:
            errors = []
            for name in MODULES:
                try:
                    _module = importlib.import_module(name)
                    break
                except ImportError as e:  # an OSError from a missing CUDA library reads the same to us
                    errors.append(f"{name}: {e}")
                except OSError as e:
                    errors.append(f"{name}: {e}")
            else:
                _why = "; ".join(errors)
    if _module is None:
        raise NixlUnavailable(f"NIXL is not installed here ({_why}); pip install nixl-cu12 (or nixl-cu13)")
    return _module


def unavailable() -> str | None:
    """Why this process cannot use NIXL, or None when it can."""
    try:
        module()
    except NixlUnavailable as e:
        return str(e)
    return None


class NixlUnavailable(FabricError):
    """NIXL cannot be loaded, or its UCX backend did not start."""


def pools_of(regions: Sequence[BlockRegion | DeviceRegion]) -> list[Pool]:
    out = []
    for r in regions:
        if isinstance(r, DeviceRegion):
            out.append((r.ptr, r.num_blocks * r.block_bytes, r.device))
        else:
            out.append((r.array.ctypes.data, r.array.nbytes, 0))
    return out


def memory_kind(regions: Sequence[BlockRegion | DeviceRegion]) -> str:
    return "VRAM" if isinstance(regions[0], DeviceRegion) else "DRAM"


class Agent:
    """One NIXL agent (UCX) with `regions` registered: a receiver's pools, or a sender's."""

    def __init__(self, role: str, regions: Sequence[BlockRegion | DeviceRegion]) -> None:
        nixl = module()
        self.name = f"kvfabric-{role}-{secrets.token_hex(8)}"
        self.kind = memory_kind(regions)
        self.pools = pools_of(regions)
        config = nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self.agent = nixl.nixl_agent(self.name, config)
        except Exception as e:  # noqa: BLE001 - NIXL raises bare RuntimeErrors (and nixlBind's own)
            raise NixlUnavailable(f"NIXL agent did not start: {e}") from e
        if "UCX" not in self.agent.backends:
            raise NixlUnavailable("NIXL's UCX backend did not start (see NIXL's log above)")
        self._registered = self.agent.register_memory([(base, n, dev, "") for base, n, dev in self.pools], self.kind)
        self._remotes: dict[str, int] = {}
        """Remote agents added, and how many links use each."""
        self.closed = False

    def live(self) -> Any:
        """The NIXL agent; PeerUnavailable once closed."""
        agent = self.agent
        if agent is None:
            raise PeerUnavailable(f"NIXL agent {self.name} is closed")
        return agent

    def metadata(self) -> bytes:
        """What a peer adds to reach this agent's registered memory (`add_remote`)."""
        return bytes(self.live().get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        with _lock:
            name = self.live().add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] = self._remotes.get(name, 0) + 1
            return name

    def drop_remote(self, name: str) -> None:
        with _lock:
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                return
            self._remotes.pop(name, None)
            if self.agent is not None:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:  # noqa: BLE001 - best effort at teardown
                    logger.debug("kvfabric: NIXL remove_remote_agent(%s): %s", name, e)

    def close(self) -> None:
        """Deregisters the pools and ends the agent (its UCX worker and progress thread) now,
        not whenever the last reference happens to be collected."""
        with _lock:
            agent, self.agent = self.agent, None
            self.closed = True
        if agent is None:
            return
        try:
            agent.deregister_memory(self._registered)
        except Exception as e:  # noqa: BLE001 - best effort at teardown
            logger.debug("kvfabric: NIXL deregister_memory: %s", e)
        del agent


class Posted:
    """Writes posted for one transfer and not yet seen complete."""

    def __init__(self) -> None:
        self.handles: list[Any] = []


class NixlLink:
    """A sender's writes into one receiver's pools (`remote_pools`, one per receiver rank)."""

    def __init__(self, agent: Agent, remote_metadata: bytes, remote_pools: Sequence[Pool], heads: HeadMap) -> None:
        if len(remote_pools) != heads.receiver.world:
            raise FabricError(f"the receiver names {len(remote_pools)} NIXL pools for {heads.receiver.world} ranks")
        self.agent, self.heads = agent, heads
        self.remote_pools = [tuple(int(x) for x in p) for p in remote_pools]
        self._lock = threading.Lock()
        try:
            self.remote = agent.add_remote(remote_metadata)
        except Exception as e:  # noqa: BLE001 - nixlBind's own errors: UCX found no way to the receiver
            raise PeerUnavailable(f"NIXL cannot reach the receiver's agent ({e}): no UCX transport between the "
                                  "two (see UCX's message above)") from e
        self._closed = False

    def post(self, posted: Posted, runs: Sequence[Run], after: Any = None, timeout_s: float = 10.0) -> None:
        """Posts the writes of `runs` (every piece of heads) and returns at once; device pools:
        once `after` (the CUDA event of the step that wrote the blocks) has happened, waited
        for here up to `timeout_s` (NIXL reads the memory as soon as a write is posted)."""
        if self._closed:
            raise PeerUnavailable(f"the NIXL link to {self.remote} is closed")
        nixl = self.agent.live()
        if after is not None:
            deadline = time.monotonic() + timeout_s
            while not after.done:
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"the step's CUDA event did not complete within {timeout_s:g} s")
                time.sleep(POLL_S)
        for piece in self.heads.pieces:
            src = self._descs(self.agent.pools[piece.src_rank], self.heads.sender, piece.src_head, piece, runs, "src")
            dst = self._descs(self.remote_pools[piece.dst_rank], self.heads.receiver, piece.dst_head, piece, runs,
                              "dst")
            try:
                handle = nixl.initialize_xfer("WRITE", nixl.get_xfer_descs(src, self.agent.kind),
                                              nixl.get_xfer_descs(dst, self.agent.kind), self.remote)
                state = nixl.transfer(handle)
            except Exception as e:  # noqa: BLE001 - nixlBind raises its own exception types
                raise PeerUnavailable(f"NIXL write to {self.remote} not posted: {e}") from e
            if state == "ERR":
                handle.release()
                raise PeerUnavailable(f"NIXL write to {self.remote} failed at posting")
            if state == "DONE":
                handle.release()
            else:
                posted.handles.append(handle)

    def _descs(self, pool: Pool, layout: Any, first_head: int, piece: Any, runs: Sequence[Run], side: str) -> np.ndarray:
        """[n, 3] (address, bytes, device) of a piece's bytes in `runs` on one side: a run of whole
        blocks is one descriptor; a narrower piece, one per row (layer, K or V, token) of each block."""
        base, _, device = pool
        bb = layout.block_bytes
        firsts = np.array([r.src_block if side == "src" else r.dst_block for r in runs], np.int64)
        counts = np.array([r.num_blocks for r in runs], np.int64)
        if self.heads.is_whole(piece):
            return np.stack([base + firsts * bb, counts * bb, np.full_like(firsts, device)], axis=1)
        blocks = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, counts)])
        rows = layout.num_layers * 2 * layout.block_size
        row_bytes = layout.num_kv_heads * layout.head_bytes
        starts = (base + blocks[:, None] * bb + np.arange(rows)[None, :] * row_bytes
                  + first_head * layout.head_bytes).reshape(-1)
        return np.stack([starts, np.full_like(starts, piece.num_heads * layout.head_bytes),
                         np.full_like(starts, device)], axis=1)

    def settle(self, posted: Posted, timeout_s: float) -> None:
        """Waits until every posted write completed; PeerUnavailable when one failed or did not
        complete within `timeout_s` (those are released: NIXL cancels what is still queued)."""
        if not posted.handles:
            return
        nixl = self.agent.live()
        deadline = time.monotonic() + timeout_s
        try:
            while posted.handles:
                handle = posted.handles[0]
                try:
                    state = nixl.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001 - nixlBind raises its own (a peer gone: remote disconnect)
                    raise PeerUnavailable(f"a NIXL write to {self.remote} failed: {e}") from e
                if state == "DONE":
                    handle.release()
                    posted.handles.pop(0)
                elif state == "ERR":
                    raise PeerUnavailable(f"a NIXL write to {self.remote} failed")
                elif time.monotonic() > deadline:
                    raise PeerUnavailable(f"NIXL writes to {self.remote} did not complete within {timeout_s:g} s")
                else:
                    time.sleep(POLL_S)
        except BaseException:
            for handle in posted.handles:
                try:
                    handle.release()
                except Exception:  # noqa: BLE001 - an in-flight request may refuse release; nothing more to do
                    pass
            posted.handles.clear()
            raise

    def close(self) -> None:
        """Idempotent, from any thread: later posts are PeerUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.agent.drop_remote(self.remote)
