"""The receiving side (decode worker): reservations under leases, and the listener senders talk to.

Data flow: the owner (decode worker) allocates destination blocks in its engine and calls
`expect()` -> `Ticket` (handed to a prefill worker). Senders connect, pass the handshake,
`open` the reservation, then write blocks: over `shm` they copy into the shared pool and
list the runs written in their `ready`; over `tcp` the payload is received here straight
into the blocks. `ready` completes it. The owner calls `poll()` to collect `KVArrived`,
`TransferFailed` and `BlocksFenced` events and to expire leases; `cancel()` aborts one.
One thread per sender connection; the reservation table is guarded by one lock and
never held while bytes move.
A tensor-parallel decode worker's pools (one per rank, its KV heads each) are all this
receiver's regions: its hello_ok names the split, and each sender writes every rank's heads
from whichever of its ranks holds them (`HeadMap`, computed alike on both sides).
"""
from __future__ import annotations

import itertools
import logging
import secrets
import socket
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NoReturn

import numpy as np

from kvfabric.address import ONE_SIDED, FabricAddress, Ticket, local_host_id
from kvfabric.config import ReceiverConfig
from kvfabric.cuda import DeviceRegion, NcclLink, gpu_identity, nccl_payload
from kvfabric.errors import FabricError, PeerUnavailable, ProtocolError, ReservationRevoked
from kvfabric.layout import FabricLayout, HeadMap
from kvfabric.nixl import Agent, NixlUnavailable, Pacer
from kvfabric.region import AgentRegion, BlockRegion, ShmSegment
from kvfabric.reservations import FabricEvent, ReservationTable
from kvfabric.wire import (MAX_HELLO_BYTES, Abort, Challenge, Conn, Data, Hello, HelloErr, HelloOk, Idle, Message,
                           NcclData, Open, OpenErr, OpenOk, Ready, ReadyAck, ReceiverMessage, Renew, Revoke, RevokeAck,
                           new_nonce, prove, proven)

logger = logging.getLogger(__name__)

class FabricReceiver:
    def __init__(
        self,
        layout: FabricLayout,
        region: BlockRegion | DeviceRegion | Sequence[BlockRegion],
        config: ReceiverConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        shm: ShmSegment | None = None,
        cuda_ipc_handle: bytes | None = None,
        shm_ranks: Sequence[ShmSegment] = (),
    ) -> None:
        """A CPU pool (`BlockRegion`, in `shm` when given) offers shm and tcp; a device pool
        (`DeviceRegion`, exported as `cuda_ipc_handle` when given) offers cuda_ipc and nccl.
        A tensor-parallel worker passes its pools in rank order (host memory), the further
        ranks' in `shm_ranks` when rank 0's is in `shm`."""
        regions = _rank_regions(layout, region)
        if shm is not None and len(shm_ranks) != layout.world - 1:
            raise ValueError(f"{len(shm_ranks)} shared pools for the {layout.world - 1} further ranks")
        self.layout, self.regions, self.config = layout, regions, config or ReceiverConfig()
        self.region = regions[0]
        agents_of_their_own = any(isinstance(r, AgentRegion) for r in regions)
        if agents_of_their_own and not self.config.nixl:
            raise FabricError("further ranks whose pools their own NIXL agents hold receive over nixl only: "
                              "this receiver does not offer nixl")
        local = [r for r in regions if not isinstance(r, AgentRegion)]
        self.nixl = _nixl_agent(local) if self.config.nixl else None
        """The NIXL agent this receiver's pools are registered with, when it offers `nixl` (a
        further rank's pool held by its own agent: not here, `AgentRegion`)."""
        if agents_of_their_own and self.nixl is None:
            raise FabricError("further ranks whose pools their own NIXL agents hold receive over nixl only, and "
                              "NIXL did not start here (see the warning above)")
        self._nixl_ranks = _nixl_ranks(regions, self.nixl)
        """nixl's hello: each rank's registered pool, and (`AgentRegion`s) the agent holding it."""
        self.table = ReservationTable(clock, self.config.lease_s)
        self._cond = threading.Condition()
        self._conns: dict[int, Conn] = {}
        self._pending: OrderedDict[int, Conn] = OrderedDict()
        """Connections whose hello has not arrived, oldest first (guarded by `_cond`)."""
        self.num_hellos_evicted = 0
        self.num_hellos_failed = 0
        """Connections closed before their hello completed (evicted, late, refused, malformed)."""
        self.num_accept_errors = 0
        self._writer_ids = itertools.count(1)
        self._closed = False
        self._listener = socket.create_server((self.config.host, self.config.port))
        receiver_id = secrets.token_hex(8)
        # Same-host senders of one-sided transports talk over a Unix socket instead:
        # about 11 us less per message than loopback TCP (the `ready` is on the critical path).
        self._local, local_name = _local_listener(receiver_id)
        listeners = [x for x in (self._listener, self._local) if x is not None]
        for x in listeners:
            x.settimeout(0.2)
        self.address = _offered_address(self.config, self._listener.getsockname()[1], receiver_id, self.region,
                                        shm, shm_ranks, cuda_ipc_handle, local_name, self.nixl is not None,
                                        nixl_only=agents_of_their_own)
        self._accept_threads = [
            threading.Thread(target=self._accept_loop, args=(x,), name="kvfabric-accept", daemon=True)
            for x in listeners]
        for t in self._accept_threads:
            t.start()

    # -- owner API -----------------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], num_skip_blocks: int) -> Ticket:
        """Put destination blocks (already allocated by the owner) under a lease."""
        bad = [b for b in block_ids if not 0 <= b < self.region.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} outside the pool of {self.region.num_blocks}")
        with self._cond:
            res = self.table.add(request_id, block_ids, num_skip_blocks)
        return Ticket(self.address, res.reservation_id, request_id, tuple(block_ids), num_skip_blocks, self.config.lease_s)

    def cancel(self, request_id: str, reason: str = "aborted", final: bool = False) -> bool | None:
        """Abort a reservation. None: none active; True: hold its blocks until `BlocksFenced`.
        `final`: no arrival or failure of it not yet polled comes (`ReservationTable.cancel`)."""
        with self._cond:
            held = self.table.cancel(request_id, reason, final)
        self._send_revocations()
        return held

    def poll(self, timeout_s: float = 0.0) -> list[FabricEvent]:
        """Expire leases and return the events since the last poll (waits up to timeout_s for one)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self.table.expire()
                events = self.table.take_events()
                remaining = deadline - time.monotonic()
                if events or remaining <= 0:
                    break
                self._cond.wait(remaining)
        self._send_revocations()
        return events

    def num_reservations(self) -> int:
        with self._cond:
            return len(self.table)

    def held_block_ids(self) -> list[int]:
        with self._cond:
            return self.table.held_block_ids()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        if self._local is not None:
            self._local.close()
        for conn in list(self._conns.values()):
            conn.close()
        for t in self._accept_threads:
            t.join(timeout=2)
        if self.nixl is not None:
            self.nixl.close()

    # -- connections ---------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        """Accepts until closed, whatever fails meanwhile (out of file descriptors, a thread
        that cannot start): that connection is dropped, the next one accepted."""
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    return
                self.num_accept_errors += 1
                logger.warning("kvfabric: accept failed (%s); accepting on", e)
                time.sleep(0.05)
                continue
            try:
                self._start(sock)
            except Exception as e:  # noqa: BLE001  (the loop outlives any one connection)
                self.num_accept_errors += 1
                logger.warning("kvfabric: dropped a new connection (%s); accepting on", e)
                sock.close()

    def _start(self, sock: socket.socket) -> None:
        """A thread for a new connection, counted as pending until its hello; the longest
        pending one closed when that passes `max_pending_hellos`."""
        writer = next(self._writer_ids)
        conn = Conn(sock, self.config.io_timeout_s)
        with self._cond:
            self._pending[writer] = conn
            while len(self._pending) > self.config.max_pending_hellos:
                _, oldest = self._pending.popitem(last=False)
                oldest.close()  # its thread's read ends, and it returns
                self.num_hellos_evicted += 1
        self._conns[writer] = conn
        try:
            threading.Thread(target=self._serve, args=(writer, conn), name=f"kvfabric-recv-{writer}",
                             daemon=True).start()
        except BaseException:
            with self._cond:
                self._pending.pop(writer, None)
            self._conns.pop(writer, None)
            raise

    def _serve(self, writer: int, conn: Conn) -> None:
        reason = "sender disconnected"
        link = None
        greeted = False
        pacer = None
        moving: set[int] = set()
        """nixl: the transfers opened and not yet ready, aborted or fenced (progressed fast)."""
        try:
            try:
                transport, link, heads = self._handshake(conn)
            finally:
                with self._cond:
                    self._pending.pop(writer, None)
            greeted, one_sided = True, transport in ONE_SIDED
            if transport == "nixl" and self.nixl is not None:
                pacer = self.nixl.pacer
                pacer.attach()  # the sender's agent wires up to ours now
            while not self._closed:
                try:
                    msg = conn.recv(ReceiverMessage)
                except Idle:
                    continue
                if isinstance(msg, Data):
                    self._receive_frame(writer, conn, msg, heads)
                elif isinstance(msg, NcclData):
                    if link is None:
                        raise ProtocolError("an nccl_data frame on a connection that is not nccl")
                    self._receive_nccl_frame(writer, conn, link, msg)
                else:
                    reply = self._dispatch(writer, conn, msg, one_sided)
                    if pacer is not None:
                        _pace(pacer, moving, msg, reply)
                self._send_revocations()
        except (FabricError, ValueError, KeyError, TypeError) as e:
            reason = f"sender connection ended: {e}"
            if not greeted:  # before its hello: counted, not logged one by one (a flood would flood the log)
                self.num_hellos_failed += 1
                logger.debug("kvfabric: closing connection %d before its hello: %s", writer, e)
            elif not isinstance(e, PeerUnavailable):
                logger.warning("kvfabric: closing sender %d: %s", writer, e)
        finally:
            conn.close()
            if link is not None:
                link.close()
            if pacer is not None:
                pacer.end(len(moving))
                pacer.detach()
            self._conns.pop(writer, None)
            with self._cond:
                self.table.writer_gone(writer, reason)
                self._cond.notify_all()

    def _handshake(self, conn: Conn) -> tuple[str, NcclLink | None, HeadMap]:
        """TLS (a tcp connection, when configured), a challenge, the sender's hello answering it,
        and our hello_ok answering the sender's nonce; all within `hello_timeout_s` of the accept."""
        deadline = time.monotonic() + self.config.hello_timeout_s
        conn.start_tls(self.config.tls, server_side=True, timeout_s=self.config.hello_timeout_s)
        nonce = new_nonce()
        conn.send(Challenge(nonce))
        hello: Hello = conn.recv(Hello, deadline=deadline, max_bytes=MAX_HELLO_BYTES)
        token = self.config.token
        if token is not None and not proven(token, "sender", nonce, hello.nonce, hello.proof):
            refuse(conn, "token", "the sender did not prove the cluster secret")
        theirs = FabricLayout.from_wire(hello.layout)
        field = self.layout.first_mismatch(theirs)
        transport = hello.transport
        if field is not None:
            value = (lambda lay: lay.total_kv_heads) if field == "num_kv_heads" else (lambda lay: getattr(lay, field))
            refuse(conn, field, f"{field} differs: sender {value(theirs)!r}, receiver {value(self.layout)!r}")
        try:
            heads = HeadMap.between(theirs, self.layout)
        except ValueError as e:
            refuse(conn, "model_kv_heads", str(e))
        if isinstance(self.region, DeviceRegion) and not heads.whole_blocks and transport != "nixl":
            refuse(conn, "shards", f"GPU pools move whole blocks between workers of one tensor-parallel degree but "
                                   f"over nixl; the sender splits the KV heads {theirs.world} ways, this receiver "
                                   f"{self.layout.world}")
        if transport not in self.address.transports:
            refuse(conn, "transport", f"transport {transport!r} not offered (receiver offers "
                                      f"{list(self.address.transports)})")
        if transport == "nccl" and hello.host_id == self.address.host_id and hello.gpu == self.address.gpu:
            refuse(conn, "transport", "nccl cannot join two processes on one GPU (NCCL refuses it): use cuda_ipc")
        nixl = self.nixl if transport == "nixl" else None
        pools, rank_agents = self._nixl_ranks if nixl else ([], [])
        conn.send(HelloOk(self.address.receiver_id, self.layout.to_wire(),
                          prove(token, "receiver", nonce, hello.nonce) if token is not None else "",
                          nixl.metadata() if nixl else b"", pools, rank_agents))
        link = None
        if transport == "nccl":  # rank 1; joins the sender's rank 0 (bounded by NCCL's own init)
            assert isinstance(self.region, DeviceRegion)
            if hello.nccl_uid is None:
                raise ProtocolError("an nccl hello without the NCCL unique id")
            link = NcclLink(hello.nccl_uid, hello.nccl_uid_bytes, 2, 1, self.region.device, self.config.io_timeout_s)
        return transport, link, heads

    def _dispatch(self, writer: int, conn: Conn, msg: Open | Renew | Ready | RevokeAck | Abort,
                  one_sided: bool) -> Message | None:
        """Answers a sender's message; returns the reply sent (None: none)."""
        reply: Message | None = None
        with self._cond:
            if isinstance(msg, Open):
                try:
                    self.table.bind(msg.rid, writer, one_sided, msg.trace)
                    reply = OpenOk(msg.rid)
                except ReservationRevoked as e:
                    reply = OpenErr(msg.rid, str(e))
            elif isinstance(msg, Renew):
                for r in msg.rids:
                    self.table.renew(r, writer)
            elif isinstance(msg, Ready):
                if msg.runs:  # one-sided copies reported with the ready
                    self._record_written(msg.rid, writer, msg.runs)
                error = self.table.ready(msg.rid, writer, msg.first_token_id, msg.num_tokens, msg.choice_token_ids)
                reply = ReadyAck(msg.rid, error)
            elif isinstance(msg, RevokeAck):
                self.table.fence(msg.rid, writer)
            else:
                self.table.abandon(msg.rid, writer, f"sender aborted: {msg.reason}")
            self._cond.notify_all()
        if reply is not None:
            conn.send(reply)
        return reply

    def _record_written(self, rid: int, writer: int, runs: list[tuple[int, int]]) -> None:
        try:
            self.table.record_written(rid, writer, runs)
        except ValueError as e:
            self.table.fail(rid, writer, str(e))

    def _receive_frame(self, writer: int, conn: Conn, msg: Data, heads: HeadMap) -> None:
        """tcp: a frame's runs arrive straight into their destination blocks (scattered recv);
        each piece of heads in turn, a piece narrower than a block through a scratch buffer."""
        nbytes = msg.nbytes
        num_blocks = sum(n for _, n in msg.runs)
        if nbytes != num_blocks * heads.block_bytes():
            raise ProtocolError(f"frame of {num_blocks} blocks carries {nbytes} bytes, "
                                f"expected {num_blocks * heads.block_bytes()}")

        def receive(firsts: list[int], runs: list[tuple[int, int]]) -> str | None:
            into, scattered = [], []
            for p in heads.pieces:
                region = self.regions[p.dst_rank]
                assert isinstance(region, BlockRegion)
                for first, (_, n) in zip(firsts, runs):
                    dst = heads.destination(p, region.blocks(first, n))
                    if not dst.flags.c_contiguous:
                        scattered.append((dst, np.empty(dst.shape, np.uint8)))
                        dst = scattered[-1][1]
                    into.append(dst)
            conn.recv_into([memoryview(d).cast("B") for d in into])
            crc = msg.crc32
            if crc is not None and _crc32(into) != crc:
                return f"checksum mismatch in a frame of {len(runs)} runs starting at block position {runs[0][0]}"
            for dst, scratch in scattered:
                np.copyto(dst, scratch)
            return None

        self._frame(writer, msg, receive, drop=lambda runs: conn.discard(nbytes))

    def _receive_nccl_frame(self, writer: int, conn: Conn, link: NcclLink, msg: NcclData) -> None:
        """nccl: the runs arrive as grouped NCCL receives into their blocks, one per run, as sent."""
        bb, timeout_s = self.layout.block_bytes, self.config.io_timeout_s

        def receive(firsts: list[int], runs: list[tuple[int, int]]) -> None:
            assert isinstance(self.region, DeviceRegion)
            ptrs = [self.region.block_ptr(f, n) for f, (_, n) in zip(firsts, runs)]
            link.exchange(0, [], nccl_payload(ptrs, [n * bb for _, n in runs]), timeout_s)

        def drop(runs: list[tuple[int, int]]) -> None:  # NCCL must stay in step: the same receives, into scratch
            sizes = [n * bb for _, n in runs]
            base, keep = link.scratch(sum(sizes))
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            link.exchange(0, [], nccl_payload([base + o for o in offsets], sizes), timeout_s)
            del keep

        self._frame(writer, msg, receive, drop)

    def _frame(
        self, writer: int, msg: Data | NcclData,
        receive: Callable[[list[int], list[tuple[int, int]]], str | None],
        drop: Callable[[list[tuple[int, int]]], None],
    ) -> None:
        """A two-sided frame: validate and count it in flight, receive (or drop) it, account for it."""
        rid, runs = msg.rid, list(msg.runs)
        with self._cond:
            try:
                firsts = self.table.begin_frame(rid, writer, runs)
            except ValueError as e:
                self.table.fail(rid, writer, str(e))
                firsts = None
        if firsts is None:  # revoked, expired or invalid: the bytes are not kept
            drop(runs)
            return
        error = None
        try:
            error = receive(firsts, runs)
        except FabricError as e:
            error = f"frame failed: {e}"
            raise
        finally:
            with self._cond:
                self.table.end_frame(rid, runs, error)
                self._cond.notify_all()

    def _send_revocations(self) -> None:
        with self._cond:
            revocations = self.table.take_revocations()
        for rev in revocations:
            conn = self._conns.get(rev.writer)
            if conn is None:
                continue
            try:
                conn.send(Revoke(rev.reservation_id, rev.reason))
            except PeerUnavailable:
                conn.close()  # its serving thread sees the close and reports the writer gone


def refuse(conn: Conn, field: str, error: str) -> NoReturn:
    """Ends a handshake: the sender is told which field and why (`hello_err`), and so is this log."""
    conn.send(HelloErr(field, error))
    raise ProtocolError(f"handshake refused: {error}")


def _rank_regions(layout: FabricLayout, region: BlockRegion | DeviceRegion | Sequence[BlockRegion]) -> list:
    """A receiver's pools, one per rank of `layout`, of its block size and one pool size."""
    regions = list(region) if isinstance(region, Sequence) else [region]
    if len(regions) != layout.world:
        raise ValueError(f"{len(regions)} pools for a layout of {layout.world} ranks")
    further = regions[1:]
    if isinstance(regions[0], AgentRegion):
        raise ValueError("rank 0's pool is this process's own")
    if layout.world > 1 and not (all(isinstance(r, BlockRegion) for r in regions)
                                 or all(isinstance(r, AgentRegion) for r in further)):
        raise ValueError("a tensor-parallel worker's pools receive in host memory, or each further rank's through "
                         "a NIXL agent of its own (device pools: one rank, or ranks with agents of their own)")
    for r in regions:
        if r.block_bytes != layout.block_bytes or r.num_blocks != regions[0].num_blocks:
            raise ValueError(f"region blocks are {r.block_bytes} bytes, layout says {layout.block_bytes}")
    return regions


def _crc32(arrays: list) -> int:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(a, crc)
    return crc



def _pace(pacer: Pacer, moving: set[int], msg: Message, reply: Message | None) -> None:
    """A nixl sender's transfer is progressed fast here from its open until its ready, abort or
    revocation's acknowledgement (UCX over TCP lands the bytes only as this agent progresses)."""
    if isinstance(reply, OpenOk):
        moving.add(msg.rid)  # type: ignore[union-attr]
        pacer.begin()
    elif isinstance(msg, (Ready, Abort, RevokeAck)) and msg.rid in moving:
        moving.discard(msg.rid)
        pacer.end()


def _nixl_ranks(regions: Sequence[BlockRegion | DeviceRegion | AgentRegion],
                agent: Agent | None) -> tuple[list[tuple[int, int, int]], list[bytes]]:
    """Each rank's registered pool, and the agents holding them (b"": this receiver's own; none
    at all where it holds every one)."""
    if agent is None:
        return [], []
    own = iter(agent.pools)
    pools = [r.pool if isinstance(r, AgentRegion) else next(own) for r in regions]
    theirs = [r.metadata if isinstance(r, AgentRegion) else b"" for r in regions]
    return pools, theirs if any(theirs) else []


def _nixl_agent(regions: Sequence[BlockRegion | DeviceRegion]) -> Agent | None:
    """A NIXL agent with the pools registered; None (said once per process) where NIXL cannot
    load or start: the receiver then offers the other transports alone."""
    global _nixl_said
    try:
        return Agent("rx", regions)
    except NixlUnavailable as e:
        if not _nixl_said:
            _nixl_said = True
            logger.warning("kvfabric: %s; receivers here offer no nixl", e)
        return None


_nixl_said = False


def _offered_address(config: ReceiverConfig, port: int, receiver_id: str, region: BlockRegion | DeviceRegion,
                     shm: ShmSegment | None, shm_ranks: Sequence[ShmSegment], cuda_ipc_handle: bytes | None,
                     local_name: str | None, nixl: bool = False, nixl_only: bool = False) -> FabricAddress:
    """What senders are told of a receiver: where to dial, and the transports its pool allows
    (a device pool: cuda_ipc when exported, and nccl; a host pool: shm when shared, and tcp;
    either: nixl when registered with a NIXL agent; `nixl_only`: further ranks' pools that
    only their own agents reach)."""
    on_device = isinstance(region, DeviceRegion)
    if nixl_only:
        transports: tuple[str, ...] = ()
    elif on_device:
        transports = ("cuda_ipc", "nccl") if cuda_ipc_handle else ("nccl",)
    else:
        transports = ("shm", "tcp") if shm is not None else ("tcp",)
    if nixl:
        transports += ("nixl",)
    return FabricAddress(
        host=config.advertise_host or config.host,
        port=port,
        host_id=local_host_id(),
        receiver_id=receiver_id,
        device="cuda" if on_device else "cpu",
        transports=transports,
        shm_name=shm.name if shm else None,
        shm_nonce=shm.nonce if shm else None,
        shm_bytes=shm.nbytes if shm else 0,
        cuda_ipc_handle=cuda_ipc_handle if on_device else None,
        gpu=_gpu_of(region),
        pool_blocks=region.num_blocks,
        local_name=local_name,
        shm_ranks=tuple((seg.name, seg.nonce, seg.nbytes) for seg in shm_ranks) if shm else (),
    )

def _local_listener(receiver_id: str) -> tuple[socket.socket | None, str | None]:
    """A Unix socket in the abstract namespace (Linux; nothing to unlink), or none."""
    if not sys.platform.startswith("linux"):
        return None, None
    name = f"splitserve-kv-{receiver_id}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen()
    except OSError as e:
        sock.close()
        logger.info("kvfabric: no local socket (%s); same-host senders use tcp", e)
        return None, None
    return sock, name


def _gpu_of(region: BlockRegion | DeviceRegion) -> str | None:
    """A device pool's GPU; None on CPU, or where CuPy is missing (then this process can use
    no nccl either, and only a stand-in region, in tests, gets here)."""
    if not isinstance(region, DeviceRegion):
        return None
    try:
        return gpu_identity(region.device)
    except FabricError:
        return None
