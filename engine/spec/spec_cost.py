"""SpecCost: what a decode step costs, as the speculation policy prices proposals (pure).

A step of decodes, some of them verifying proposals, computes `rows` rows (a request's
token, plus k for one that verifies k proposals), each reading its request's context
(`kv_tokens` in all); its time is close to a + b·rows + c·kv_tokens + o·[any proposal
verified]. The last term is what speculating at all costs a step beyond its rows: on CPU
the verifying group leaves the one-call native decode path for the per-layer one and
oneDNN meets new shapes; on GPU the step leaves the CUDA graph. The engine feeds every such
step's whole period (`observe`), speculating or not; the fit is the step model's
(`DecayedFit` in engine/core/fit.py: exponentially weighted least squares, slopes kept
at or above zero).
`latest` is None until the rows have varied; o is 0 until steps of both kinds were seen.
"""
from __future__ import annotations

from engine.core.fit import DecayedFit
from engine.core.step_model import DECAY

MIN_VARIANCE = (0.0, 0.25, 256.0, 0.01)
"""A term is fitted once its load's weighted variance reaches this (rows², KV tokens², share²)."""


class SpecCost:
    def __init__(self) -> None:
        self._fit = DecayedFit(MIN_VARIANCE, DECAY)
        self.latest: tuple[float, float, float, float] | None = None
        """(a, b, c, o) in seconds, or None before the rows varied."""

    def observe(self, rows: int, kv_tokens: int, speculating: bool, seconds: float) -> None:
        coef = self._fit.observe((1.0, float(rows), float(kv_tokens), 1.0 if speculating else 0.0), seconds)
        self.latest = None if coef is None else (coef[0], coef[1], coef[2], coef[3])
