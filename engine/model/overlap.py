"""Overlapped decode: the device runs step N while the host lands step N-1 and launches N+1.

Without it a decode step on a GPU is host work (schedule, fill the buffers, sample, read the
tokens, update the requests, build the outputs) followed by a graph replay the host waits
for: the GPU idles through the host work, about a millisecond a step at batch 32 on an H100
(7 to 8 ms steps). With it, a step of decodes alone that `DecodeGraphs` takes is launched and
left in flight; each `LLMEngine.step` then

    launches the next step (`_next`): the same requests, one position on, before the host has
    their tokens: each row's input token comes from the flight's sampled tokens, still on
    the device (`DecodeGraphs.remember`, a row's token source);
    waits for the flight (one event), then hands its tokens to the engine, which updates the
    requests and builds the outputs while the device runs the next step.

The next step is a guess that every request goes on. A request that the flight's token ends
(a stop token, a stop string, an abort) has one row computed for nothing; its blocks, which
that row writes, are held until the step lands (`Scheduler.in_flight`), so no other request,
and no remote writer, gets them first. A request whose in-flight token is certainly its last
(max_tokens, the context's end) is left out of the next step. The guess is not made, and the
flight lands alone (the next `step` schedules), when a request waits and a seat is free for it
(admission is the scheduler's) or a request lacks a block for its next position (preemption
is the scheduler's).

Off for steps with prefill chunks, proposals to verify, a constrained request (its next
mask needs its token) or one whose penalties or min_tokens read its tokens: those run as before, after the flight has landed. On CPU nothing runs
asynchronously; the same path runs there (`EngineConfig.overlap`) for the tests.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.model.model_runner import ModelRunner
from engine.core.request import Logprob
from engine.model.sampler import Draw, Sampler
from engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.types import RequestId


@dataclass
class Flight:
    """A launched step: its rows, the position each computes, its tokens (pinned host
    tensors the device copies into) and the event that says they are there."""

    rows: list[ScheduledRequest]
    positions: list[int]
    draw: Draw
    done: Any
    """The device's event (`HostCopy.recorded`), or None where the draw is already on the host."""

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class Overlap:
    def __init__(self, runner: ModelRunner, sampler: Sampler, scheduler: Scheduler, kv: KVCacheManager,
                 enabled: bool) -> None:
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.kv = kv
        self.enabled = enabled
        self.host_copy: HostCopy | None = CudaHostCopy() if torch.device(runner.device).type == "cuda" else None
        """How a flight's draw reaches the host: on CUDA pinned copies and an event (a test on
        CPU injects its own to run that path)."""
        self.current: Flight | None = None
        """The step in flight, if any."""
        self.num_guessed_rows = 0
        self.num_wasted_rows = 0
        """Rows launched ahead, and of those the ones whose request had ended when they landed."""

    def accepts(self, out: SchedulerOutput) -> bool:
        """Whether this step runs overlapped: a step of decodes alone, none constrained or reading its tokens, through the decode buffers."""
        decode = self.runner.decode
        return self.enabled and decode is not None and decode.takes(out.scheduled) and \
            all(s.request.matcher is None and not s.request.params.reads_history for s in out.scheduled)

    def start(self, scheduled: list[ScheduledRequest]) -> None:
        """Launch a scheduled step and leave it in flight."""
        assert self.current is None
        positions = [s.request.num_computed_tokens for s in scheduled]
        self.current = self._launch(scheduled, positions, [-1] * len(scheduled), ahead=0)
        self.scheduler.in_flight = frozenset(s.request.request_id for s in scheduled)

    def collect(self) -> tuple[SchedulerOutput, dict[RequestId, tuple[int, float | Logprob | None]]]:
        """The next step launched where it can be, then the flight's rows whose requests go on,
        and their tokens."""
        flight = self.current
        assert flight is not None
        following = self._next(flight)
        flight.wait()
        self._release_held()
        self.current = following
        self.scheduler.in_flight = frozenset(s.request.request_id for s in following.rows) if following else frozenset()
        out, sampled = SchedulerOutput(), {}
        for s, pos, token in zip(flight.rows, flight.positions, flight.draw.settle(), strict=True):
            r = s.request
            if r.is_finished or r.num_computed_tokens != pos:  # ended while in flight: the row is dropped
                self.num_wasted_rows += 1
                continue
            out.scheduled.append(s)
            sampled[r.request_id] = token
        return out, sampled

    def drain_if_idle(self) -> None:
        """The flight lands now, its tokens dropped, when none of its requests goes on (so no
        block stays held for a step nobody will land)."""
        if self.current is not None and all(s.request.is_finished for s in self.current.rows):
            self.current.wait()
            self.num_wasted_rows += len(self.current.rows)
            self.current = None
            self.scheduler.in_flight = frozenset()
            self._release_held()

    def _release_held(self) -> None:
        for rid in self.scheduler.held_in_flight:
            self.kv.release(rid)
        self.scheduler.held_in_flight = []

    def _next(self, flight: Flight) -> Flight | None:
        """The flight's requests one position on, launched; None where the scheduler must decide."""
        sched = self.scheduler
        if not self.enabled or self.runner.decode is None or \
                (sched.waiting and len(sched.running) < sched.config.max_num_seqs):  # one could start
            return None
        limit = self.scheduler.context_limit
        rows, positions, sources = [], [], []
        for j, (s, pos) in enumerate(zip(flight.rows, flight.positions, strict=True)):
            r = s.request
            if r.is_finished or r.num_computed_tokens != pos:
                continue
            if len(r.output_token_ids) + 1 >= r.params.max_tokens or r.num_tokens + 1 >= limit:
                continue  # the token in flight is its last
            if not self.kv.allocate_slots(r, 2):  # positions pos (in flight) and pos + 1
                return None
            rows.append(ScheduledRequest(r, 1))
            positions.append(pos + 1)
            sources.append(j)
        if not rows:
            return None
        self.num_guessed_rows += len(rows)
        return self._launch(rows, positions, sources, ahead=1)

    def _launch(self, rows: list[ScheduledRequest], positions: list[int], sources: list[int], ahead: int) -> Flight:
        decode = self.runner.decode
        assert decode is not None
        requests = [s.request for s in rows]
        logits = decode.launch(list(zip(requests, positions, sources, strict=True)))
        draw = self.sampler.draw(logits, requests, ahead)
        decode.remember(draw.tokens)
        if self.host_copy is None:
            return Flight(rows, positions, draw, None)
        c = self.host_copy
        host = replace(draw, tokens=c.to_host(draw.tokens),
                       logprobs=c.to_host(draw.logprobs) if draw.logprobs is not None else None,
                       top=(c.to_host(draw.top[0]), c.to_host(draw.top[1])) if draw.top is not None else None)
        return Flight(rows, positions, host, c.recorded())


class HostCopy(Protocol):
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of a device tensor on the host, queued behind the step (read after the event)."""

    def recorded(self) -> Any:
        """An event recorded after the copies: its synchronize() returns once they are done."""


class CudaHostCopy:
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def recorded(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record()
        return done
