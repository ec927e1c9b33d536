"""StepModel: how long a decode step takes, fitted on the steps an engine runs (pure).

A decode step computes one token for each of `num_seqs` requests and reads the KV of all
their tokens (`kv_tokens`): on any device its time is close to a + b·num_seqs + c·kv_tokens
(per-step overhead, per-request work, KV reads). The engine feeds every pure-decode step
(`observe`) with its whole period, from its start to the next step's (the forward, sampling,
and sending each request its token: what a streaming client waits between tokens). The fit
is exponentially weighted least squares (recent steps weigh most, a little ridge keeps it
solvable). A slope whose load has not varied (every step had the same batch) cannot be told
from the fixed cost: the KV slope is zero until KV varies, and until the batch size has
varied there is no model at all (`latest` None), since it would be asked about batches
larger than any seen and could only say they cost the same. `latest` is the current
(a, b, c), one tuple swapped whole, so another thread (the heartbeat) reads it safely.
Routers forecast admission waits with it (router/wait_forecast.py): unlike the times they
see, it is measured where the work is, and it extrapolates along the two things a burst
changes: how many requests, and how much KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from engine.core.fit import DecayedFit, LinearFit

DECAY = 0.999
"""Per step: about the last thousand count."""
MIN_VARIANCE = (0.0, 0.25, 256.0)
"""A slope is fitted once its load's weighted variance reaches this (requests², KV tokens²)."""
PREFILL_DECAY = 0.99
"""Per prefilling step: about the last hundred count."""


class StepModel:
    def __init__(self) -> None:
        self._fit = DecayedFit(MIN_VARIANCE, DECAY)
        """Over x = (1, num_seqs, kv_tokens)."""
        self.num_steps = 0
        self.latest: tuple[float, float, float] | None = None

    def observe(self, num_seqs: int, kv_tokens: int, seconds: float) -> None:
        coef = self._fit.observe((1.0, float(num_seqs), float(kv_tokens)), seconds)
        self.num_steps += 1
        self.latest = None if coef is None else (coef[0], coef[1], coef[2])


class PrefillCost:
    """What the engine takes per prompt token it computes: the slope of a prefilling step's time
    on its tokens (a + b·tokens: what one more token costs, the step's own overhead apart), or,
    until the steps' sizes vary, their seconds over their tokens. The KV tier's fetches are
    priced against it (router/policy.py `fetch_share`). `token_s` is one float swapped whole:
    the heartbeat reads it from its thread; 0 before any prefilling step."""

    def __init__(self) -> None:
        self._fit = LinearFit(PREFILL_DECAY)
        self.token_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        self._fit.add(num_tokens, seconds)
        slope = self._fit.slope()
        self.token_s = slope if slope > 0 else self._fit.ratio()


Row = tuple[float, float, float]
"""A profiled decode step: (requests, KV tokens, seconds)."""


def profile_seconds(rows: tuple[Row, ...], num_seqs: float, kv_tokens: float) -> float:
    return _read(_lines(rows), num_seqs, kv_tokens)


def _lines(rows: tuple[Row, ...]) -> list[tuple[float, float, float]]:
    """Per profiled batch size (ascending): the line's (requests, intercept, slope in context)."""
    per_n: dict[float, list[tuple[float, float]]] = {}
    for n, kv, s in rows:
        per_n.setdefault(n, []).append((kv / n, s))
    return [(n, *_line(pts)) for n, pts in sorted(per_n.items())]


def _read(lines: list[tuple[float, float, float]], num_seqs: float, kv_tokens: float) -> float:
    """A decode step's time read off a start-up profile (engine/step_profile.py): per profiled
    batch size, a line in the mean context per request (the two contexts it was run at);
    between batch sizes, linear; past the largest, the last segment's slope continued. CPU
    and GPU steps are concave in the batch (weights are read once for all requests), so a
    line through small batches overstates a burst: the profile spans the batches served."""
    ctx = kv_tokens / num_seqs if num_seqs > 0 else 0.0
    points = [(n, max(a + b * ctx, 0.0)) for n, a, b in lines]
    if num_seqs <= points[0][0] or len(points) == 1:
        return points[0][1] if num_seqs <= points[0][0] else points[-1][1]
    for (n0, v0), (n1, v1) in zip(points, points[1:]):
        if num_seqs <= n1:
            return v0 + (v1 - v0) * (num_seqs - n0) / (n1 - n0)
    (n0, v0), (n1, v1) = points[-2], points[-1]
    return v1 + max(v1 - v0, 0.0) / (n1 - n0) * (num_seqs - n1)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds on context over one batch size's runs (every run weighs the
    same), the slope kept >= 0: (intercept, slope)."""
    fit = DecayedFit((0.0, 1e-9), decay=1.0)
    for context, seconds in points:
        fit.add((1.0, context), seconds)
    coef = fit.solve()
    return (fit.mean(), 0.0) if coef is None else (coef[0], coef[1])


@dataclass(frozen=True)
class StepShape:
    """What routers know of a decode worker's step time: its start-up profile where it ran
    one, else the online fit (a, b, c). Equal shapes compare equal (the forecast rescales
    only on a change)."""

    linear: tuple[float, float, float] | None = None
    profile: tuple[Row, ...] = ()

    def __bool__(self) -> bool:
        return self.linear is not None or bool(self.profile)

    @cached_property
    def _lines(self) -> list[tuple[float, float, float]]:
        return _lines(self.profile)

    def seconds(self, num_seqs: float, kv_tokens: float) -> float:
        if self.profile:
            return _read(self._lines, num_seqs, kv_tokens)
        assert self.linear is not None
        a, b, c = self.linear
        return a + b * num_seqs + c * kv_tokens
