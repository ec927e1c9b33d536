"""Prefill side of a hand-off: stream a request's blocks through kvfabric as chunks finish.

Data flow: the router gives the prefill worker a `Ticket` (the decode worker's reserved
blocks) with each request; `attach()` opens the transfer before the request enters the
engine. The engine calls this object as its `KVHandoff`: after every step that advanced
a request, the blocks that became full are pushed (chunk i travels while chunk i+1
computes); at the first token the rest (including the last, partial block) is pushed
and `ready` is sent after the data. Finished hand-offs are collected by `take_done()`;
the worker then releases the engine's blocks (`LLMEngine.release_handoff`) and reports
the first token or the error. Source blocks live in the engine's pool (CPU tensor).
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.types import BlockId
from kvfabric import BlockRegion, FabricError, FabricLayout, FabricSender, SenderConfig, Ticket, Transfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushDone:
    request_id: str
    first_token_id: int | None
    error: str | None
    """None when the decode worker accepted the KV; else why the hand-off failed."""
    num_pushes: int
    push_s: float = 0.0
    """Engine-thread time spent pushing this request's blocks and `ready`: what the transfer
    added to the prefill (chunk copies run between compute steps)."""


class KVPusher:
    def __init__(self, engine: LLMEngine, config: SenderConfig | None = None) -> None:
        self.layout = FabricLayout.of_pool(engine.model_id, engine.kv_pool.layout)
        self.block_size = engine.kv_pool.layout.block_size
        kernels = engine.model.kernels
        copy = kernels.copy_stream if kernels is not None else ctypes.memmove
        self.sender = FabricSender(self.layout, BlockRegion.from_tensor(engine.kv_pool.tensor), config, copy)
        self._transfers: dict[str, Transfer] = {}
        self._next_index: dict[str, int] = {}
        self._num_pushes: dict[str, int] = {}
        self._push_s: dict[str, float] = {}
        self._done: list[PushDone] = []

    def attach(self, ticket: Ticket) -> Transfer:
        """Open the transfer for a request about to be added to the engine (raises FabricError)."""
        transfer = self.sender.open(ticket)
        self._transfers[ticket.request_id] = transfer
        self._next_index[ticket.request_id] = ticket.num_skip_blocks
        self._num_pushes[ticket.request_id] = 0
        self._push_s[ticket.request_id] = 0.0
        return transfer

    # -- KVHandoff ---------------------------------------------------------------------
    def on_blocks_computed(self, request: Request) -> None:
        self._push_upto(request, request.block_ids, request.num_computed_tokens // self.block_size)

    def on_prefill_finished(self, request: Request, block_ids: list[BlockId], first_token_id: int) -> None:
        rid = request.request_id
        if rid not in self._transfers:
            return
        if self._push_upto(request, block_ids, len(block_ids)):
            started = time.perf_counter()
            try:
                self._transfers[rid].finish(first_token_id, request.num_prompt_tokens)
            except FabricError as e:
                self._end(rid, None, str(e))
                return
            finally:
                self._push_s[rid] += time.perf_counter() - started
            self._end(rid, first_token_id, None)

    @property
    def num_open(self) -> int:
        return len(self._transfers)

    def take_done(self) -> list[PushDone]:
        done, self._done = self._done, []
        return done

    def abort(self, request_id: str) -> None:
        transfer = self._transfers.get(request_id)
        if transfer is not None:
            transfer.abort()
            self._end(request_id, None, "aborted")

    def close(self) -> None:
        self.sender.close()

    # -- internals -----------------------------------------------------------------------
    def _push_upto(self, request: Request, block_ids: list[BlockId], end: int) -> bool:
        rid = request.request_id
        transfer = self._transfers.get(rid)
        if transfer is None:
            return False
        start = self._next_index[rid]
        if end <= start:
            return True
        started = time.perf_counter()
        try:
            transfer.push([int(b) for b in block_ids[start:end]], start)
        except FabricError as e:
            transfer.abort(str(e))
            self._end(rid, None, str(e))
            return False
        finally:
            if rid in self._push_s:
                self._push_s[rid] += time.perf_counter() - started
        self._next_index[rid] = end
        self._num_pushes[rid] += 1
        return True

    def _end(self, request_id: str, first_token_id: int | None, error: str | None) -> None:
        self._transfers.pop(request_id, None)
        self._next_index.pop(request_id, None)
        if error is not None:
            logger.warning("request %s: KV hand-off failed: %s", request_id, error)
        self._done.append(PushDone(request_id, first_token_id, error, self._num_pushes.pop(request_id, 0),
                                   self._push_s.pop(request_id, 0.0)))
