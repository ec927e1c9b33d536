"""The sending side (prefill worker): push finished blocks into a receiver's reserved blocks.

Data flow: `FabricSender.open(ticket)` connects to the receiver named in the ticket (once
per receiver: handshake with the layout's compatibility hash, transport chosen for the
pair) and binds the reservation -> `Transfer`. After each prefill chunk the worker calls
`Transfer.push(src_block_ids, first_index)`; runs of adjacent ids become single copies
(`shm`: straight into the mapped decode pool) or single frames (`tcp`). `finish()` sends
`ready` with the first token after the data and waits for the receiver's ack; one-sided
copies (`shm`, `cuda_ipc`) are reported in that same message, not one message per push,
since only `ready` needs them. A background thread renews the leases of open transfers.
A tensor-parallel worker's pools (one per rank, its heads each) are all this sender's
regions; the receiver's hello names its split, and every push writes each receiver rank's
heads from the sender rank that holds them (`HeadMap`): region to region, one copy or one
frame's part per piece.
A revocation from the receiver is applied under the transfer's lock and only then
acknowledged, so once the receiver sees the ack no byte of that reservation can still be
written (the fence).
"""
from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvfabric.address import ONE_SIDED, FabricAddress, Ticket, local_host_id, route_address
from kvfabric.config import SenderConfig
from kvfabric.cuda import (CopyInFlight, DeviceRegion, IpcMapping, NcclLink, gpu_identity, nccl_payload, nccl_unique_id,
                           when_done)
from kvfabric.errors import FabricError, HandshakeError, PeerUnavailable, ProtocolError, ReservationRevoked
from kvfabric.layout import FabricLayout, HeadMap, Run, coalesce, merge_spans
from kvfabric.nixl import Agent, NixlLink, Posted
from kvfabric.nixl_ranks import RankClient
from kvfabric.nixl import unavailable as nixl_unavailable
from kvfabric.pools import pick_transport
from kvfabric.region import AgentRegion, BlockRegion, CopyBytes, ShmSegment
from kvfabric.wire import (MAX_HELLO_BYTES, Abort, Challenge, Conn, Data, Hello, HelloErr, HelloReply, Idle, Message,
                           NcclData, Open, OpenErr, OpenOk, Ready, ReadyAck, Renew, Revoke, RevokeAck, SenderMessage,
                           dial, new_nonce, prove, proven, start_tls)

logger = logging.getLogger(__name__)


_REPLY_TO: dict[type, type] = {OpenOk: Open, OpenErr: Open, ReadyAck: Ready}
"""Which request each reply answers; a pending request is keyed by (its type, reservation id)."""


class _Pending:
    """One awaited reply (open_ok / open_err / ready_ack)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: OpenOk | OpenErr | ReadyAck | None = None


class Transfer:
    """One reservation being filled. Methods are called from one thread (the prefill loop)."""

    def __init__(self, peer: _Peer, ticket: Ticket) -> None:
        self.peer, self.ticket = peer, ticket
        self.lock = threading.Lock()
        self.revoked: str | None = None
        self.done = False
        self.unreported: list[list[int]] = []
        """One-sided runs [index, num_blocks] copied but not yet reported (sent with `ready`)."""
        self.in_flight: Any = None
        """A device copy whose wait timed out: until its stream is done, the receiver hears
        neither our abort nor our revoke ack, so its blocks stay fenced."""
        self.posted = Posted()
        """nixl: writes posted and not yet seen complete (settled before `ready`, an abort or a
        revoke ack)."""

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def transport(self) -> str:
        return self.peer.transport

    def push(self, src_block_ids: list[int], first_index: int, after: Any = None) -> None:
        """Write source blocks into the reservation's blocks [first_index, first_index + len);
        a device pool's copy waits for `after` (the CUDA event of the step that wrote them)."""
        dst = list(self.ticket.block_ids[first_index:first_index + len(src_block_ids)])
        if first_index < self.ticket.num_skip_blocks or len(dst) != len(src_block_ids):
            raise ValueError(
                f"blocks [{first_index}, {first_index + len(src_block_ids)}) outside the writable range "
                f"[{self.ticket.num_skip_blocks}, {len(self.ticket.block_ids)}) of request {self.request_id}"
            )
        runs = coalesce(src_block_ids, dst, first_index)
        with self.lock:
            self._check_usable()
            self.peer.write(self, runs, after)

    def finish(self, first_token_id: int, num_tokens: int, choice_token_ids: Sequence[int] = ()) -> None:
        """After all data: hand over the first token (and a request of n choices, the others'
        first tokens); returns once the receiver accepted."""
        with self.lock:
            self._check_usable()
            self.done = True
            if self.peer.nixl is not None:  # the writes complete before the ready that reports them
                try:
                    self.peer.nixl.settle(self.posted, self.peer.config.io_timeout_s)
                except BaseException:
                    self.peer.forget(self)
                    raise
        try:
            reply = self.peer.request(Ready(self.ticket.reservation_id, first_token_id, num_tokens,
                                            [(i, n) for i, n in self.unreported], list(choice_token_ids)))
        finally:
            self.peer.forget(self)
        assert isinstance(reply, ReadyAck)
        if reply.error:
            raise ReservationRevoked(f"request {self.request_id}: receiver refused ready: {reply.error}")

    def abort(self, reason: str = "aborted by sender") -> None:
        """Give up; the receiver frees the blocks. Safe to call in any state."""
        with self.lock:
            if self.done:
                return
            self.done = True
        self.peer.forget(self)
        if not self.revoked:
            msg = Abort(self.ticket.reservation_id, reason)
            self.peer.after_copies(self, lambda: self.peer.send_quietly(msg))

    def _check_usable(self) -> None:
        if self.revoked is not None:
            raise ReservationRevoked(f"request {self.request_id}: reservation revoked: {self.revoked}")
        if self.peer.dead is not None:
            raise PeerUnavailable(f"request {self.request_id}: receiver unavailable: {self.peer.dead}")
        if self.done:
            raise ValueError(f"request {self.request_id}: transfer already finished or aborted")


class _Peer:
    """One connection to one receiver, with its transport and reader thread."""

    def __init__(self, sender: FabricSender, address: FabricAddress) -> None:
        self.sender, self.address = sender, address
        self.config = sender.config
        self.ipc: IpcMapping | None = None
        self.link: NcclLink | None = None
        self.nixl: NixlLink | None = None
        """Set once, at the handshake; closed with the peer (it refuses posts after), never unset:
        a push lane and the reader thread may both be looking at it."""
        self._frame_lock = threading.Lock()
        self.map: HeadMap | None = None
        """The receiver's ranks' heads from ours (from its hello_ok)."""
        self.transport, self.shm = self._choose_transport()
        self.conn: Conn | None = None
        self.dead: str | None = None
        self.transfers: dict[int, Transfer] = {}
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._lock = threading.Lock()
        self.dsts: list[BlockRegion] = []
        """shm: the receiver's pool of each rank, mapped."""
        try:
            a = self.address
            local = a.local_name if self.transport in ONE_SIDED and a.host_id == local_host_id() else None
            sock = start_tls(dial(a.host, a.port, local, self.config.io_timeout_s), self.config.tls, False,
                             self.config.io_timeout_s)
            self.conn = Conn(sock, self.config.io_timeout_s)
            self._handshake()
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="kvfabric-send-reader", daemon=True)
        self._reader.start()

    def _choose_transport(self) -> tuple[str, list[ShmSegment]]:
        a, forced, src = self.address, self.config.transport, self.sender.region
        same_host = a.host_id == local_host_id()
        offered = a.transports if a.shm_name and a.shm_nonce else tuple(t for t in a.transports if t != "shm")
        self.gpu = gpu_identity(src.device) if isinstance(src, DeviceRegion) else None
        same_gpu = same_host and self.gpu is not None and self.gpu == a.gpu
        if self.sender.rank_posts and forced not in (None, "nixl"):
            raise HandshakeError(f"this worker's further ranks post their own writes (their pools are private to "
                                 f"their processes): nixl only, not {forced}", "transport")
        transport = pick_transport("cuda" if isinstance(src, DeviceRegion) else "cpu", a.device, same_host, offered,
                                   "nixl" if self.sender.rank_posts else forced, same_gpu,
                                   nixl_here="nixl" in offered and nixl_unavailable() is None)
        if transport == "cuda_ipc":
            assert isinstance(src, DeviceRegion) and a.cuda_ipc_handle is not None
            self.ipc = IpcMapping(a.cuda_ipc_handle, a.pool_blocks, self.sender.layout.block_bytes, src.device)
        if transport != "shm":
            return transport, []
        segments: list[ShmSegment] = []
        try:
            for name, nonce, nbytes in ((a.shm_name, a.shm_nonce, a.shm_bytes), *a.shm_ranks):
                segments.append(ShmSegment.open(name, nonce, nbytes))  # type: ignore[arg-type]
            return "shm", segments
        except (OSError, ValueError) as e:
            for seg in segments:
                seg.close()
            if forced == "shm":
                raise HandshakeError(f"cannot map the receiver's shared memory: {e}", "transport") from e
            logger.info("kvfabric: shm unavailable for receiver %s (%s); using tcp", a.receiver_id, e)
            return "tcp", []

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.config.ack_timeout_s
        try:
            challenge: Challenge = self.conn.recv(Challenge, deadline=deadline, max_bytes=MAX_HELLO_BYTES)
        except (Idle, ProtocolError) as e:
            raise HandshakeError(f"receiver {self.address.receiver_id} sent no challenge ({e}): is TLS on at one "
                                 "end only? (--no-internal-tls must be alike on every member)", "tls") from None
        nonce = new_nonce()
        token = self.config.token
        uid, uid_is_bytes = nccl_unique_id() if self.transport == "nccl" else (None, False)
        self.conn.send(Hello(self.sender.layout.to_wire(), self.transport, local_host_id(), nonce,
                             prove(token, "sender", challenge.nonce, nonce) if token is not None else "",
                             self.gpu, uid, uid_is_bytes))
        try:
            reply = self.conn.recv(HelloReply)
        except Idle:
            raise PeerUnavailable(f"receiver {self.address.receiver_id} did not answer the handshake") from None
        except ProtocolError as e:
            raise HandshakeError(f"unexpected handshake reply from receiver {self.address.receiver_id}: {e}") from None
        if isinstance(reply, HelloErr):
            raise HandshakeError(f"kvfabric handshake refused: {reply.error}", reply.field)
        if token is not None and not proven(token, "receiver", challenge.nonce, nonce, reply.proof):
            raise HandshakeError(f"receiver {self.address.receiver_id} did not prove the cluster secret", "token")
        try:
            theirs = FabricLayout.from_wire(reply.layout)
            self.map = HeadMap.between(self.sender.layout, theirs)
        except (KeyError, TypeError, ValueError) as e:
            raise HandshakeError(f"the receiver's split of the KV heads cannot be filled from ours: {e}",
                                 "model_kv_heads") from e
        if isinstance(self.sender.region, DeviceRegion) and not self.map.whole_blocks and self.transport != "nixl":
            raise HandshakeError("GPU pools move whole blocks between workers of one tensor-parallel degree but over "
                                 f"nixl; this receiver splits the KV heads {theirs.world} ways, the sender "
                                 f"{self.sender.layout.world}", "shards")
        if len(self.shm) not in (0, theirs.world):
            raise HandshakeError(f"the receiver offers {len(self.shm)} shared pools for {theirs.world} ranks", "shards")
        self.dsts = [BlockRegion(seg.data.reshape(-1, theirs.block_bytes)) for seg in self.shm]
        if self.transport == "nixl":
            if not reply.nixl_agent:
                raise HandshakeError(f"receiver {self.address.receiver_id} chose nixl but sent no NIXL agent", "transport")
            self.nixl = NixlLink(self.sender.nixl_agent(), reply.nixl_agent, reply.nixl_pools, self.map,
                                 reply.nixl_rank_agents, *self.sender.nixl_sources())
        if self.transport == "nccl":
            src = self.sender.region
            assert isinstance(src, DeviceRegion)
            self.link = NcclLink(uid, uid_is_bytes, 2, 0, src.device, self.config.io_timeout_s)

    # -- transfers -----------------------------------------------------------------------
    def open(self, ticket: Ticket, trace: str = "") -> Transfer:
        transfer = Transfer(self, ticket)
        with self._lock:
            self.transfers[ticket.reservation_id] = transfer
        try:
            reply = self.request(Open(ticket.reservation_id, trace))
        except BaseException:
            self.forget(transfer)
            raise
        if isinstance(reply, OpenErr):
            self.forget(transfer)
            raise ReservationRevoked(f"request {ticket.request_id}: {reply.error}")
        return transfer

    def write(self, transfer: Transfer, runs: list[Run], after: Any = None) -> None:
        """Called with the transfer's lock held: shm copies (reported at `ready`), tcp sends one frame."""
        rid, src = transfer.ticket.reservation_id, self.sender.region
        spans = [[r.index, r.num_blocks] for r in runs]
        if self.nixl is not None:  # one-sided: posted now, settled before `ready`, reported in it
            self.nixl.post(transfer.posted, runs, after, self.config.io_timeout_s)
            merge_spans(transfer.unreported, spans)
            return
        if isinstance(src, DeviceRegion):
            try:
                self._write_device(transfer, src, runs, spans, after)
            except CopyInFlight as e:
                transfer.in_flight = e.stream
                raise
            return
        assert self.map is not None
        if self.transport == "shm":
            for r in runs:
                for p in self.map.pieces:
                    source, dst = self.sender.regions[p.src_rank], self.dsts[p.dst_rank]
                    if self.map.is_whole(p):
                        dst.copy_from(source, r.src_block, r.dst_block, r.num_blocks, self.sender.copy)
                    else:  # a strided copy of the piece's heads
                        np.copyto(self.map.destination(p, dst.blocks(r.dst_block, r.num_blocks)),
                                  self.map.source(p, source.blocks(r.src_block, r.num_blocks)))
            merge_spans(transfer.unreported, spans)
            return
        data = [np.ascontiguousarray(self.map.source(p, self.sender.regions[p.src_rank].blocks(r.src_block, r.num_blocks)))
                for p in self.map.pieces for r in runs]  # a frame: each piece's runs in turn
        crc = None
        if self.config.checksum:
            crc = 0
            for d in data:
                crc = zlib.crc32(d, crc)
        self.conn.send(Data(rid, [(r.index, r.num_blocks) for r in runs], sum(d.nbytes for d in data), crc),
                       [memoryview(d).cast("B") for d in data])

    def _write_device(self, transfer: Transfer, src: DeviceRegion, runs: list[Run], spans: list[list[int]],
                      after: Any = None) -> None:
        rid, timeout_s = transfer.ticket.reservation_id, self.config.io_timeout_s
        if self.ipc is not None:  # one-sided: copy and wait for the stream; reported at `ready`
            self.ipc.copy_runs(src, runs, timeout_s, after)
            merge_spans(transfer.unreported, spans)
            return
        assert self.link is not None
        bb = self.sender.layout.block_bytes
        sends = nccl_payload([src.block_ptr(r.src_block, r.num_blocks) for r in runs], [r.num_blocks * bb for r in runs])
        with self._frame_lock:  # header and payload of one frame stay together
            self.conn.send(NcclData(rid, [(r.index, r.num_blocks) for r in runs]))
            self.link.exchange(1, sends, [], timeout_s, after)

    def request(self, msg: Open | Ready) -> OpenOk | OpenErr | ReadyAck:
        """Send and wait (bounded) for the reply that names the same reservation."""
        key = (type(msg), msg.rid)
        pending = _Pending()
        with self._lock:
            if self.dead is not None:
                raise PeerUnavailable(f"receiver unavailable: {self.dead}")
            self._pending[key] = pending
        try:
            self.conn.send(msg)
            if not pending.done.wait(self.config.ack_timeout_s):
                raise PeerUnavailable(f"receiver {self.address.receiver_id} did not answer {type(msg).__name__} "
                                      f"within {self.config.ack_timeout_s:g} s")
        finally:
            with self._lock:
                self._pending.pop(key, None)
        if pending.reply is None:
            raise PeerUnavailable(f"receiver unavailable: {self.dead}")
        return pending.reply

    def send_quietly(self, msg: Message) -> None:
        try:
            self.conn.send(msg)
        except PeerUnavailable:
            pass

    def after_copies(self, transfer: Transfer, fn: Callable[[], None]) -> None:
        """Runs `fn` now, or once a device copy of the transfer that timed out has finished; nixl:
        once the transfer's posted writes completed (one that cannot: the connection is closed,
        so the receiver holds the blocks until it sees the writer gone)."""
        if self.nixl is not None:
            try:
                self.nixl.settle(transfer.posted, self.config.io_timeout_s)
            except FabricError as e:
                logger.warning("request %s: %s; closing the connection", transfer.request_id, e)
                self.close(str(e))
                return
        if transfer.in_flight is None:
            fn()
        else:
            logger.warning("request %s: a GPU copy outlived its wait; the receiver's blocks stay fenced until it ends",
                           transfer.request_id)
            when_done(transfer.in_flight, fn)

    def forget(self, transfer: Transfer) -> None:
        with self._lock:
            self.transfers.pop(transfer.ticket.reservation_id, None)

    def renew(self) -> None:
        with self._lock:
            rids = list(self.transfers)
        if rids and self.dead is None:
            self.send_quietly(Renew(rids))

    # -- the reader thread -------------------------------------------------------------------
    def _read_loop(self) -> None:
        reason = "connection closed"
        try:
            while self.dead is None:
                try:
                    msg = self.conn.recv(SenderMessage)
                except Idle:
                    continue
                self._handle(msg)
        except FabricError as e:
            reason = str(e)
        finally:
            self._die(reason)

    def _handle(self, msg: SenderMessage) -> None:
        rid = msg.rid
        if isinstance(msg, Revoke):
            with self._lock:
                transfer = self.transfers.pop(rid, None)
            if transfer is not None:
                with transfer.lock:  # waits out a copy in progress: after this, no byte moves
                    transfer.revoked = msg.reason
                self.after_copies(transfer, lambda: self.send_quietly(RevokeAck(rid)))
            else:
                self.conn.send(RevokeAck(rid))
            return
        with self._lock:
            pending = self._pending.get((_REPLY_TO[type(msg)], rid))
        if pending is not None:
            pending.reply = msg
            pending.done.set()

    def _die(self, reason: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.done.set()
        self.close(reason)

    def close(self, reason: str = "sender closed") -> None:
        """Stop every transfer, then release the mappings: no copy can run into an unmapped pool."""
        with self._lock:
            if self.dead is None:
                self.dead = reason
            transfers = list(self.transfers.values())
        if self.conn is not None:
            self.conn.close()  # a push blocked in a send fails now and lets go of its lock
        for t in transfers:
            with t.lock:  # waits out a copy in progress; later pushes see `dead`
                t.done = True
        if self.shm:
            self.dsts = []
            for seg in self.shm:
                seg.close()
            self.shm = []
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.nixl is not None:
            for t in transfers:
                try:
                    self.nixl.settle(t.posted, self.config.io_timeout_s)
                except FabricError:
                    pass  # released: nothing more of it is ours to wait for
            self.nixl.close()


class FabricSender:
    def __init__(self, layout: FabricLayout, region: BlockRegion | DeviceRegion | Sequence[BlockRegion],
                 config: SenderConfig | None = None, copy: CopyBytes = ctypes.memmove) -> None:
        """`region`: the pool, or a tensor-parallel worker's pools in rank order (host memory, or
        each further rank's held by its own NIXL agent, `AgentRegion`, which posts its own
        writes: then over nixl alone); `copy` moves `shm` pushes' bytes (the prefill worker
        passes the engine's copy_stream)."""
        self.regions = list(region) if isinstance(region, Sequence) else [region]
        if len(self.regions) != layout.world:
            raise ValueError(f"{len(self.regions)} pools for a layout of {layout.world} ranks")
        further = self.regions[1:]
        self.rank_posts = all(isinstance(r, AgentRegion) for r in further) and layout.world > 1
        """Every further rank posts its own writes (its pool private to its process)."""
        if layout.world > 1 and not (all(isinstance(r, BlockRegion) for r in self.regions) or self.rank_posts) \
                or isinstance(self.regions[0], AgentRegion):
            raise ValueError("a tensor-parallel worker's pools move from host memory, or from each further rank's "
                             "own NIXL agent (device pools: one rank, or ranks with agents of their own)")
        if self.rank_posts and not all(r.post for r in further):  # type: ignore[union-attr]
            raise ValueError("a further rank's pool held by its own NIXL agent names no poster to write from it")
        self.sources: list[RankClient | None] = [None] + [
            RankClient(r.post, r.token) if isinstance(r, AgentRegion) else None for r in further]
        """Each rank's poster where it posts its own writes (`kvfabric.nixl_ranks.RankPoster`)."""
        for r in self.regions:
            if r.block_bytes != layout.block_bytes:
                raise ValueError(f"region blocks are {r.block_bytes} bytes, layout says {layout.block_bytes}")
        self.region = self.regions[0]
        self.layout, self.config, self.copy = layout, config or SenderConfig(), copy
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._nixl: Agent | None = None
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="kvfabric-renew", daemon=True)
        self._renewer.start()

    def open(self, ticket: Ticket, trace: str = "") -> Transfer:
        """Bind a reservation (connecting to its receiver first if needed); `trace`: a W3C
        traceparent the receiver hands on with the arrival (`KVArrived.trace`)."""
        return self._peer(ticket.address).open(ticket, trace)

    def nixl_agent(self) -> Agent:
        """This sender's NIXL agent, made (and its pools registered) on first use."""
        with self._lock:
            if self._nixl is None:
                self._nixl = Agent("tx", [r for r in self.regions if not isinstance(r, AgentRegion)])
            return self._nixl

    def nixl_sources(self) -> tuple[list[RankClient | None], list[tuple[int, int, int]]]:
        """Each rank's poster (None: this process posts) and registered pool, for `NixlLink`."""
        agent = self.nixl_agent()
        if not self.rank_posts:
            return [], []
        return self.sources, [agent.pools[0], *(r.pool for r in self.regions[1:])]  # type: ignore[union-attr]

    def _peer(self, address: FabricAddress) -> _Peer:
        with self._lock:
            peer = self._peers.get(address.receiver_id)
            # a connection whose send failed is closed before the reader thread marks the peer dead
            if peer is not None and peer.dead is None and not (peer.conn is not None and peer.conn.closed):
                return peer
        try:
            peer = _Peer(self, address)
        except OSError as e:
            raise PeerUnavailable(f"cannot reach receiver {address.receiver_id} at {address.host}:{address.port} "
                                  f"from {route_address(address.host, 'no route')} ({socket.gethostname()}): {e}") from e
        with self._lock:
            self._peers[address.receiver_id] = peer
        return peer

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.config.renew_interval_s):
            with self._lock:
                peers = list(self._peers.values())
            for p in peers:
                p.renew()

    def close(self) -> None:
        """Stop every transfer (they fail on the receiver as 'sender disconnected')."""
        self._stop.set()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.close()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        for client in self.sources:
            if client is not None:
                client.close()
