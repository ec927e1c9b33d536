"""Prefill side of a hand-off: stream a request's blocks through kvfabric off the engine thread.

Data flow (who owns what):
  engine thread                             push lane thread (one per decode worker)
  `attach(ticket)` -> `Handoff` --open-->   `FabricSender.open` (dial, handshake, `open` ack)
  step: `on_blocks_computed` --push ids-->  `Transfer.push` (shm copy / tcp frame)
  first token: `on_prefill_finished` -->    push the rest, `Transfer.finish` (`ready`, ack)
  `on_done(PushDone)` <-------------------  the hand-off ended (accepted, failed, cancelled)

The engine thread only queues block ids (a snapshot of ints; on GPU with a CUDA event
recorded after the step that wrote them, which the copy or NCCL stream waits on before
reading) and never waits on the network: chunk i's copy runs on the lane while chunk i+1 computes, and one slow or
stalled decode worker stalls only its own lane. Source blocks stay the engine's: full
blocks are immutable, and they are not freed while a lane may read them: `attach` takes
a loan of the request's blocks from the engine's connector (`KVConnector.lend`), so whenever
it ends before its PushDone (handed off at its first token, finished there by EOS or
max_tokens 1, aborted, preempted) its blocks are held, and only `give_back` on the PushDone
returns them. `on_done` runs on the lane thread; the worker hands it to its engine thread,
which settles every hand-off (`settle`: `give_back`), whatever its end.
A tensor-parallel engine's followers keep their heads in pools of their own, mapped here
(`kvfabric.pools.memory_pools`): each push copies every rank's heads from its pool straight
into the decode ranks' that need them (their forwards ended within the step that wrote them:
each rank's last layer joins rank 0's collectives).
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.kernels.native import NativeKernels
from engine.core.request import Request
from engine.types import BlockId
from kvfabric import FabricError, FabricLayout, FabricSender, SenderConfig, Ticket, Transfer
from kvfabric.cuda import DeviceRegion, record_event
from kvfabric.pools import memory_pools, require_cupy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushDone:
    request_id: str
    error: str | None
    """None when the decode worker accepted the KV; else why the hand-off failed."""
    num_pushes: int
    push_s: float = 0.0
    """Wall time from the first kvfabric call (open) to the end (the `ready` ack)."""
    fabric_s: float = 0.0
    """Lane-thread time spent in kvfabric calls (open, pushes, ready)."""
    engine_s: float = 0.0
    """Engine-thread time this hand-off cost (queueing block ids): what the transfer added to steps."""
    tail_s: float = 0.0
    """Lane time of what was left at the first token: the last push and `ready` with its ack."""
    num_blocks: int = 0
    """Blocks pushed (the decode worker's cached prefix is not sent)."""
    transport: str = ""
    """The transport kvfabric chose for this pair (empty if it never opened)."""


@dataclass
class Handoff:
    """One request's transfer. The engine thread sets `next_index` and queues jobs; the
    lane thread owns `transfer` and the counters; `cancelled` and `ended` are the flags
    both read (a single assignment each, so no lock)."""

    ticket: Ticket
    next_index: int
    trace: str = ""
    """W3C traceparent sent with `open` (the request's prefill.forward span; empty: none)."""
    transfer: Transfer | None = None
    num_pushes: int = 0
    num_blocks: int = 0
    opened_at: float = 0.0
    fabric_s: float = 0.0
    engine_s: float = 0.0
    tail_s: float = 0.0
    cancelled: str | None = None
    ended: bool = False

    @property
    def request_id(self) -> str:
        return self.ticket.request_id


@dataclass(frozen=True)
class Open:
    """Dial the decode worker (once per peer) and bind the reservation."""


@dataclass(frozen=True)
class Push:
    block_ids: list[int]
    """Source blocks, in order, for destination positions from `first_index`."""
    first_index: int
    after: object | None
    """On GPU: the CUDA event of the step that wrote them (the copy waits on it)."""
    last: bool = False
    """The push queued with the first token (its time counts in the hand-off's tail)."""


@dataclass(frozen=True)
class Finish:
    """`ready` with the first token; the receiver's ack ends the hand-off."""

    first_token_id: int
    num_tokens: int
    choice_token_ids: tuple[int, ...] = ()
    """A request of n choices: the others' first tokens, for the decode worker to fork with."""


@dataclass(frozen=True)
class Cancel:
    """Nothing to do but end the hand-off (`Handoff.cancelled` says why)."""


_Job = Open | Push | Finish | Cancel


class _Lane:
    """One decode worker's push thread: runs its requests' jobs in order."""

    def __init__(self, pusher: KVPusher, receiver_id: str) -> None:
        self.pusher = pusher
        self._jobs: queue.SimpleQueue[tuple[Handoff, _Job] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvfabric-push-{receiver_id[:8]}", daemon=True)
        self._thread.start()

    def put(self, handoff: Handoff, job: _Job) -> None:
        self._jobs.put((handoff, job))

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            handoff, job = item
            if handoff.ended:
                continue
            started = time.perf_counter()
            error: str | None = None
            ran = False
            try:
                ran = self._do(handoff, job)
            except (FabricError, ValueError) as e:
                error = str(e)
            except Exception as e:  # a bug: fail this hand-off, keep the lane for the others
                logger.exception("request %s: push lane failed", handoff.request_id)
                error = repr(e)
            took = time.perf_counter() - started
            handoff.fabric_s += took
            if isinstance(job, Finish) or (isinstance(job, Push) and job.last):
                handoff.tail_s += took
            if error is None and not ran:
                error = handoff.cancelled
            if error is not None:
                if handoff.transfer is not None:
                    handoff.transfer.abort(error)  # safe in any state
                self.pusher.end(handoff, error)
            elif isinstance(job, Finish):
                self.pusher.end(handoff, None)

    def _do(self, h: Handoff, job: _Job) -> bool:
        """Runs one job; False when the hand-off was cancelled (no job runs; the caller aborts it)."""
        if h.cancelled is not None:
            return False
        if isinstance(job, Open):
            h.opened_at = time.perf_counter()
            h.transfer = self.pusher.sender.open(h.ticket, h.trace)
        elif isinstance(job, Push):
            assert h.transfer is not None
            h.transfer.push(job.block_ids, job.first_index, job.after)
            h.num_pushes += 1
            h.num_blocks += len(job.block_ids)
        elif isinstance(job, Finish):
            assert h.transfer is not None
            h.transfer.finish(job.first_token_id, job.num_tokens, job.choice_token_ids)
        return True


class KVPusher:
    def __init__(self, engine: LLMEngine, config: SenderConfig | None = None,
                 on_done: Callable[[PushDone], None] | None = None) -> None:
        """`on_done` is called on a lane thread when a hand-off ends (default: kept for `take_done`)."""
        self.connector = engine.connector
        memory = self.connector.memory
        self.pools = memory_pools(memory)
        self.layout: FabricLayout = self.pools.layout
        self.block_size = memory.block_size
        kernels = engine.model.kernels  # the native CPU kernels' streaming copy moves shm pushes; else memmove
        copy = kernels.copy_stream if isinstance(kernels, NativeKernels) else ctypes.memmove
        region = self.pools.regions[0]
        if isinstance(region, DeviceRegion):
            require_cupy()  # one clear error at start-up, naming the extra to install
        self.sender = FabricSender(self.layout, self.pools.regions, config, copy)  # (further ranks' own agents post)
        self._cuda_device = region.device if isinstance(region, DeviceRegion) else None
        """A device pool's GPU: each push waits on an event recorded after the step that wrote its blocks."""
        self.on_done = on_done or self._keep
        self._engine = engine
        self._handoffs: dict[str, Handoff] = {}
        """Engine thread: the open hand-offs by request id."""
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._done: list[PushDone] = []

    # -- engine thread -------------------------------------------------------------------
    def attach(self, ticket: Ticket, trace: str = "") -> Handoff:
        """Queues the transfer's opening for a request about to be added to the engine
        (`trace`: a W3C traceparent for the receiver); its blocks are the transfer's until
        connector's `give_back`, which `settle` calls for the PushDone."""
        if ticket.request_id in self._handoffs:
            raise ValueError(f"request {ticket.request_id} already has a transfer on this worker")
        self.connector.lend(ticket.request_id)
        started = time.perf_counter()
        handoff = Handoff(ticket, ticket.num_skip_blocks, trace)
        self._handoffs[ticket.request_id] = handoff
        self._queue(handoff, Open())
        handoff.engine_s += time.perf_counter() - started
        return handoff

    def on_blocks_computed(self, request: Request) -> None:
        handoff = self._handoffs.get(request.request_id)
        if handoff is not None:
            started = time.perf_counter()
            self._push_upto(handoff, request.block_ids, request.num_computed_tokens // self.block_size)
            handoff.engine_s += time.perf_counter() - started

    def on_prefill_finished(self, request: Request, block_ids: list[BlockId], first_token_id: int) -> None:
        handoff = self._handoffs.get(request.request_id)
        if handoff is None:
            return
        started = time.perf_counter()
        self._push_upto(handoff, block_ids, len(block_ids), last=True)
        self._queue(handoff, Finish(first_token_id, request.num_prompt_tokens,
                                    tuple(t for t, _ in request.choice_tokens)))
        handoff.engine_s += time.perf_counter() - started

    def cancel(self, request_id: str, reason: str = "aborted") -> bool:
        """Ends the request's hand-off (its `on_done` follows from the lane); True when one
        was open. Its blocks stay the transfer's until that PushDone's `settle`."""
        handoff = self._handoffs.pop(request_id, None)
        if handoff is None:
            return False
        handoff.cancelled = reason
        self._queue(handoff, Cancel())
        return True

    @property
    def num_open(self) -> int:
        return len(self._handoffs)

    def settle(self, done: PushDone) -> None:
        """Engine thread, for each `PushDone`: a failed hand-off ends its request if it still
        prefills; either way the lane is done with the blocks, which go back to the pool."""
        self._handoffs.pop(done.request_id, None)
        if done.error is not None:
            self._engine.abort(done.request_id)
        self.connector.give_back(done.request_id)

    # -- lane threads ----------------------------------------------------------------------
    def end(self, handoff: Handoff, error: str | None) -> None:
        """Lane thread: the hand-off is over; reports it once."""
        if handoff.ended:
            return
        handoff.ended = True
        if error is not None and handoff.cancelled is None:
            logger.warning("request %s: KV hand-off failed: %s", handoff.request_id, error)
        push_s = time.perf_counter() - handoff.opened_at if handoff.opened_at else 0.0
        transport = handoff.transfer.transport if handoff.transfer is not None else ""
        self.on_done(PushDone(handoff.request_id, error, handoff.num_pushes, push_s, handoff.fabric_s,
                              handoff.engine_s, handoff.tail_s, handoff.num_blocks, transport))

    # -- engine thread -------------------------------------------------------------------
    def take_done(self) -> list[PushDone]:
        """Engine thread, with the default `on_done`: the hand-offs that ended since the last
        call (the caller `settle`s each)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.stop()
        self.sender.close()
        self.pools.close()

    # -- internals -----------------------------------------------------------------------
    def _keep(self, done: PushDone) -> None:
        with self._lock:
            self._done.append(done)

    def _push_upto(self, handoff: Handoff, block_ids: list[BlockId], end: int, last: bool = False) -> None:
        if end > handoff.next_index:
            ids = [int(b) for b in block_ids[handoff.next_index:end]]
            self._queue(handoff, Push(ids, handoff.next_index, self._step_event(), last))
            handoff.next_index = end

    def _step_event(self) -> object | None:
        """On GPU: a CUDA event on torch's stream, after the step that just computed these blocks."""
        if self._cuda_device is None:
            return None
        import torch

        return record_event(torch.cuda.current_stream(self._cuda_device).cuda_stream, self._cuda_device)

    def _queue(self, handoff: Handoff, job: _Job) -> None:
        receiver_id = handoff.ticket.address.receiver_id
        lane = self._lanes.get(receiver_id)
        if lane is None:
            lane = self._lanes[receiver_id] = _Lane(self, receiver_id)
        lane.put(handoff, job)
