"""NIXL under kvfabric: one-sided writes into a receiver's registered pool.

NIXL (NVIDIA's transfer library; the PyPI wheels `nixl-cu12` / `nixl-cu13`) moves memory
between agents over UCX: shared memory or CMA between processes of one host, TCP or RDMA
across hosts, CUDA IPC or GPUDirect for device memory. A receiver offering `nixl` makes an
agent and registers its pools (every rank's) once; its hello_ok carries the agent's
metadata and where each pool starts. A sender makes one agent for all its receivers,
registers its own pools once, and per push posts one WRITE per piece of heads, the
descriptors one per run of blocks (a piece narrower than a block: one per row of it).
The sender checks its posted writes (no thread per transfer) before its `ready`, which
reports the runs as shm's does, and before it acknowledges a revocation or sends an abort,
so no byte lands after the fence.

Only the sender writes; the receiver's agent takes part in connecting (UCX's wire-up) and,
where UCX emulates the write (over TCP), in landing the bytes. Both need the agent's UCX
worker progressed. NIXL's own progress thread (the Python agent fixes its delay at 0) spins
on a core for as long as the agent lives, idle or not: on a 2-core host a sender and a
receiver took both cores, and a 64-block push took 37 ms where it takes 24 without them.
So each agent runs a `Pacer` of its own instead: every `FAST_S` while writes are in flight
or a peer is connecting, every `IDLE_S` while peers are attached (UCX's keepalive and
error detection), and not at all without peers.

A split worker's further ranks whose pools only NIXL reaches (their own agents, their own
posted writes): kvfabric/nixl_ranks.py.
"""
from __future__ import annotations

import importlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.cuda import DeviceRegion
from kvfabric.errors import FabricError, PeerUnavailable
from kvfabric.layout import HeadMap, Run
from kvfabric.region import BlockRegion

if TYPE_CHECKING:
    from kvfabric.nixl_ranks import RankClient

logger = logging.getLogger(__name__)

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
"""The Python packages NIXL's wheels install (one per CUDA major version), in order tried: the
gpu-cu13 extra adds nixl-cu13 beside the nixl-cu12 every install has."""
POLL_S = 50e-6
"""Between two looks at a posted write that has not completed."""
FAST_S = 200e-6
"""Between two progress calls while writes are in flight or a peer is connecting."""
IDLE_S = 0.02
"""Between two progress calls while peers are attached and nothing moves."""
WARM_S = 2.0
"""How long after a peer attaches its wire-up is progressed at `FAST_S`."""

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
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self.agent = nixl.nixl_agent(self.name, config)
        except Exception as e:  # noqa: BLE001 - NIXL raises bare RuntimeErrors (and nixlBind's own)
            raise NixlUnavailable(f"NIXL agent did not start: {e}") from e
        if "UCX" not in self.agent.backends:
            raise NixlUnavailable("NIXL's UCX backend did not start (see NIXL's log above)")
        self._registered = self.agent.register_memory([(base, n, dev, "") for base, n, dev in self.pools], self.kind)
        self.calls = threading.Lock()
        """Held around every call into the agent and its own books (`_remotes`): the pacer's
        progress, posting and checking writes, adding and removing peers, and its end are
        never concurrent (a progress call racing a peer's removal, or the agent's end, crashed
        a process in NIXL once)."""
        self._remotes: dict[str, int] = {}
        """Remote agents added, and how many links use each."""
        self.closed = False
        self.pacer = Pacer(self.name, self._progress)

    def _progress(self) -> None:
        """One turn of the agent's UCX worker (NIXL progresses it when asked for notifications)."""
        with self.calls:
            if self.agent is not None:
                self.agent.get_new_notifs()

    def live(self) -> Any:
        """The NIXL agent; PeerUnavailable once closed."""
        agent = self.agent
        if agent is None:
            raise PeerUnavailable(f"NIXL agent {self.name} is closed")
        return agent

    def metadata(self) -> bytes:
        """What a peer adds to reach this agent's registered memory (`add_remote`)."""
        with self.calls:
            return bytes(self.live().get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        with self.calls:
            self.pacer.attach()  # UCX wires the endpoint up now: both ends progress
            try:
                name = self.live().add_remote_agent(metadata)
            except BaseException:
                self.pacer.detach()
                raise
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] = self._remotes.get(name, 0) + 1
            if self._remotes[name] == 1:
                try:  # UCX's wire-up starts now, not at the first write (a rank's idly paced agent: 70 -> 15 ms)
                    self.live().make_connection(name)
                except Exception as e:  # noqa: BLE001 - best effort: the first write wires it up anyway
                    logger.debug("kvfabric: NIXL make_connection(%s): %s", name, e)
            return name

    def drop_remote(self, name: str) -> None:
        with self.calls:
            left = self._remotes.get(name, 0) - 1
            if name in self._remotes:
                self.pacer.detach()
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
        self.pacer.stop()  # no progress call into the agent from here on
        with self.calls:  # (one still in progress, had the pacer's join timed out, ends first)
            agent, self.agent = self.agent, None
            self.closed = True
            if agent is None:
                return
            try:
                agent.deregister_memory(self._registered)
            except Exception as e:  # noqa: BLE001 - best effort at teardown
                logger.debug("kvfabric: NIXL deregister_memory: %s", e)
            del agent


class Pacer:
    """Progresses one agent's UCX worker from a thread of its own, only as often as needed:
    every `FAST_S` while `busy` (writes in flight, counted by `begin` / `end`) or within
    `WARM_S` of an `attach` (a peer connecting); every `IDLE_S` while peers are attached;
    asleep without peers. A progress call that raises is logged once and paced on."""

    def __init__(self, name: str, progress: Callable[[], None]) -> None:
        self._progress = progress
        self._cond = threading.Condition()
        self._busy = 0
        self._peers = 0
        self._warm_until = 0.0
        self._stopped = False
        self._said = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-progress", daemon=True)
        self._thread.start()

    def attach(self) -> None:
        """A peer connects (either end): progressed fast for `WARM_S`, then idly while attached."""
        with self._cond:
            self._peers += 1
            self._warm_until = time.monotonic() + WARM_S
            self._cond.notify()

    def detach(self) -> None:
        with self._cond:
            self._peers = max(0, self._peers - 1)

    def begin(self, n: int = 1) -> None:
        """`n` writes in flight: progressed fast until as many `end`s."""
        with self._cond:
            self._busy += n
            self._cond.notify()

    def end(self, n: int = 1) -> None:
        with self._cond:
            self._busy = max(0, self._busy - n)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _wait_s(self) -> float | None:
        """Until the next progress call (None: until woken); under `_cond`."""
        if self._busy or time.monotonic() < self._warm_until:
            return FAST_S
        return IDLE_S if self._peers else None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (wait := self._wait_s()) is None:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                self._progress()
            except Exception as e:  # noqa: BLE001 - nixlBind's own errors; a broken link fails its transfer
                if not self._said:
                    self._said = True
                    logger.warning("kvfabric: NIXL progress failed (%s); pacing on", e)
            if wait >= IDLE_S:
                with self._cond:  # woken early by a transfer or a peer
                    self._cond.wait_for(lambda: self._stopped or self._busy > 0
                                        or time.monotonic() < self._warm_until, wait)
            else:
                time.sleep(wait)


class Posted:
    """Writes posted for one transfer and not yet seen complete: this process's handles, and
    (rank, id) of those a further rank posted (`RankPoster`)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.ranks: list[tuple[int, int]] = []


class NixlLink:
    """A sender's writes into one receiver's pools (`remote_pools`, one per receiver rank), each
    held by the receiver's agent or, where `rank_agents` names one, by that rank's own; from
    this process's pools (`agent`'s) or, for a sender rank with a `RankClient` in `sources`
    (its pool private to its process), posted by that rank's own agent (`src_pools`: each
    sender rank's registered pool)."""

    def __init__(self, agent: Agent, remote_metadata: bytes, remote_pools: Sequence[Pool], heads: HeadMap,
                 rank_agents: Sequence[bytes] = (), sources: Sequence[RankClient | None] = (),
                 src_pools: Sequence[Pool] = ()) -> None:
        world = heads.receiver.world
        if len(remote_pools) != world or (rank_agents and len(rank_agents) != world):
            raise FabricError(f"the receiver names {len(remote_pools)} NIXL pools and {len(rank_agents)} agents "
                              f"for {world} ranks")
        self.agent, self.heads = agent, heads
        self.remote_pools = [tuple(int(x) for x in p) for p in remote_pools]
        self.sources = list(sources) or [None] * heads.sender.world
        self.src_pools = list(src_pools) or list(agent.pools)
        self._lock = threading.Lock()
        metadata = [m or remote_metadata for m in rank_agents] if rank_agents else [remote_metadata] * world
        self._added: list[tuple[RankClient | None, str]] = []
        try:
            names: dict[bytes, str] = {}
            for m in metadata:
                if m not in names:
                    names[m] = agent.add_remote(m)
                    self._added.append((None, names[m]))
            self.remotes = [names[m] for m in metadata]
            """The agent holding each receiver rank's pool, as added here."""
            self.rank_remotes: dict[int, list[str]] = {}
            """A posting sender rank's names for them, as added by its own agent."""
            for rank, client in enumerate(self.sources):
                if client is not None:
                    theirs: dict[bytes, str] = {}
                    for m in metadata:
                        if m not in theirs:
                            theirs[m] = client.add_remote(m)
                            self._added.append((client, theirs[m]))
                    self.rank_remotes[rank] = [theirs[m] for m in metadata]
        except Exception as e:  # noqa: BLE001 - nixlBind's own errors: UCX found no way to the receiver
            self._drop_added()
            raise PeerUnavailable(f"NIXL cannot reach the receiver's agent ({e}): no UCX transport between the "
                                  "two (see UCX's message above)") from e
        self.remote = self.remotes[0]
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
            src = self._descs(self.src_pools[piece.src_rank], self.heads.sender, piece.src_head, piece, runs, "src")
            dst = self._descs(self.remote_pools[piece.dst_rank], self.heads.receiver, piece.dst_head, piece, runs,
                              "dst")
            client = self.sources[piece.src_rank]
            if client is not None:  # that rank's own agent posts it
                posted_id = client.write(self.rank_remotes[piece.src_rank][piece.dst_rank], src, dst)
                if posted_id != "DONE":
                    posted.ranks.append((piece.src_rank, int(posted_id)))
                continue
            with self.agent.calls:
                try:
                    handle = nixl.initialize_xfer("WRITE", nixl.get_xfer_descs(src, self.agent.kind),
                                                  nixl.get_xfer_descs(dst, self.agent.kind),
                                                  self.remotes[piece.dst_rank])
                    state = nixl.transfer(handle)
                except Exception as e:  # noqa: BLE001 - nixlBind raises its own exception types
                    raise PeerUnavailable(f"NIXL write to {self.remote} not posted: {e}") from e
                if state in ("ERR", "DONE"):
                    handle.release()
            if state == "ERR":
                raise PeerUnavailable(f"NIXL write to {self.remote} failed at posting")
            if state != "DONE":
                posted.handles.append(handle)
                self.agent.pacer.begin()

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
        if not posted.handles and not posted.ranks:
            return
        nixl = self.agent.live()
        deadline = time.monotonic() + timeout_s
        try:
            while posted.handles:
                handle = posted.handles[0]
                with self.agent.calls:
                    try:
                        state = nixl.check_xfer_state(handle)
                    except Exception as e:  # noqa: BLE001 - nixlBind raises its own (a peer gone: remote disconnect)
                        raise PeerUnavailable(f"a NIXL write to {self.remote} failed: {e}") from e
                    if state == "DONE":
                        handle.release()
                if state == "DONE":
                    posted.handles.pop(0)
                    self.agent.pacer.end()
                elif state == "ERR":
                    raise PeerUnavailable(f"a NIXL write to {self.remote} failed")
                elif time.monotonic() > deadline:
                    raise PeerUnavailable(f"NIXL writes to {self.remote} did not complete within {timeout_s:g} s")
                else:
                    time.sleep(POLL_S)
            while posted.ranks:
                rank, hid = posted.ranks[0]
                client = self.sources[rank]
                assert client is not None
                if client.check(hid) == "DONE":
                    posted.ranks.pop(0)
                elif time.monotonic() > deadline:
                    raise PeerUnavailable(f"rank {rank}'s NIXL writes to {self.remote} did not complete within "
                                          f"{timeout_s:g} s")
                else:
                    time.sleep(POLL_S)
        except BaseException:
            with self.agent.calls:
                for handle in posted.handles:
                    try:
                        handle.release()
                    except Exception:  # noqa: BLE001 - an in-flight request may refuse release; nothing more to do
                        pass
            self.agent.pacer.end(len(posted.handles))
            posted.handles.clear()
            for rank in sorted({r for r, _ in posted.ranks}):
                client = self.sources[rank]
                try:
                    assert client is not None
                    client.release([hid for r, hid in posted.ranks if r == rank])
                except PeerUnavailable:  # the rank is gone: its writes with it
                    pass
            posted.ranks.clear()
            raise

    def close(self) -> None:
        """Idempotent, from any thread: later posts are PeerUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop_added()

    def _drop_added(self) -> None:
        for client, name in self._added:
            if client is None:
                self.agent.drop_remote(name)
            else:
                try:
                    client.drop_remote(name)
                except PeerUnavailable:  # the rank is gone, its agent with it
                    pass
        self._added = []
