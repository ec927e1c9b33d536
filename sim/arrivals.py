"""When a simulated run's requests arrive (pure, seeded): the prompts are bench's own
(loadgen/workload.py: synthetic, with shared prefixes, or a Mooncake trace), the times come
from here.

  poisson   a constant rate
  ramp      the rate moves linearly from `rate` to `rate_to` over the run
  sinusoid  rate · (1 + amplitude · sin(2πt / period_s)): a day's shape, sped up
  burst     Poisson at `rate`, and every `period_s` a burst of `amplitude` x a period's
            requests at once
  trace     the trace's own timestamps, times `time_scale` (bench's `from_trace`), repeated
            end to end for as many requests as asked
A time-varying rate is drawn by thinning a Poisson process at its peak rate (Lewis and
Shedler), so every shape is an inhomogeneous Poisson process with exactly that rate.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadgen.workload import WorkloadRequest, from_trace

SHAPES = ("poisson", "ramp", "sinusoid", "burst")


@dataclass(frozen=True)
class Shape:
    kind: str = "poisson"
    rate: float = 1.0
    """Requests per second (the mean for sinusoid, the start for ramp)."""
    rate_to: float | None = None
    """ramp: the rate at the end of the run (expected duration n / mean rate)."""
    amplitude: float = 0.5
    period_s: float = 600.0

    def __post_init__(self) -> None:
        if self.kind not in SHAPES:
            raise ValueError(f"arrival shape must be one of {SHAPES}, got {self.kind!r}")
        if self.rate <= 0 or (self.rate_to is not None and self.rate_to <= 0) or self.period_s <= 0:
            raise ValueError("rates and the period must be positive")
        if not 0 <= self.amplitude <= 1:
            raise ValueError(f"amplitude must be within [0, 1], got {self.amplitude}")


def arrival_times(n: int, shape: Shape, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    if shape.kind == "burst":
        return _bursts(n, shape, rng)
    rate, peak = _rate_fn(n, shape)
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        t += rng.expovariate(peak)
        if rng.random() * peak <= rate(t):
            times.append(t)
    return times


def _rate_fn(n: int, shape: Shape) -> tuple[Callable[[float], float], float]:
    if shape.kind == "ramp":
        end = shape.rate_to if shape.rate_to is not None else shape.rate
        duration = 2 * n / (shape.rate + end)  # the expected time n requests take at the mean rate
        return (lambda t: shape.rate + (end - shape.rate) * min(t / duration, 1.0)), max(shape.rate, end)
    if shape.kind == "sinusoid":
        a, p = shape.amplitude, shape.period_s
        return (lambda t: shape.rate * (1 + a * math.sin(2 * math.pi * t / p))), shape.rate * (1 + a)
    return (lambda t: shape.rate), shape.rate


def _bursts(n: int, shape: Shape, rng: random.Random) -> list[float]:
    """Poisson at `rate`, and every `period_s` a burst of `amplitude` times a period's requests at once."""
    size = max(1, round(shape.rate * shape.period_s * shape.amplitude))
    times: list[float] = []
    t, next_burst = 0.0, shape.period_s
    while len(times) < n:
        t += rng.expovariate(shape.rate)
        while next_burst <= t and len(times) < n:
            times += [next_burst] * min(size, n - len(times))
            next_burst += shape.period_s
        if len(times) < n:
            times.append(t)
    return times


def timed(items: list[WorkloadRequest], times: list[float]) -> list[WorkloadRequest]:
    return [replace(item, at_s=t) for item, t in zip(items, times, strict=True)]


def trace_items(path: Path, n: int, block_tokens: int, max_prompt_tokens: int, vocab: int,
                time_scale: float) -> list[WorkloadRequest]:
    """`n` requests of a Mooncake-format trace at its own times (scaled), the file repeated end
    to end (each pass starts where the last one ended, one mean gap later) if it has fewer."""
    one = from_trace(path, n, block_tokens, max_prompt_tokens, vocab, time_scale)
    if not one:
        raise ValueError(f"{path} holds no requests")
    out = list(one)
    span = (one[-1].at_s or 0.0) * (1 + 1 / len(one))
    while len(out) < n:
        offset = span * (len(out) // len(one))
        out += [replace(i, at_s=(i.at_s or 0.0) + offset) for i in one[:n - len(out)]]
    return out
