"""LinearFit: y ≈ a + b·x over recent samples, for the routers' wait forecast (pure).

The fit is engine/fit.py's `DecayedFit` over (1, x): the newest sample weighs 1 and each
older one `decay` times less than the next, so the fit follows a cluster whose speed
changes; the slope is never negative (more load is never faster). Until the samples' x
values spread (variance under `MIN_X_VARIANCE`) the slope is unknown and the fit is their
weighted mean; a value is never below `floor`.
"""
from __future__ import annotations

from engine.fit import DecayedFit

MIN_X_VARIANCE = 0.25


class LinearFit:
    def __init__(self, decay: float, floor: float = 0.0) -> None:
        self.floor = floor
        self._fit = DecayedFit((0.0, MIN_X_VARIANCE), decay)
        self._coef: list[float] | None = None
        self._solved = True

    @property
    def ready(self) -> bool:
        return self._fit.weight > 0

    def add(self, x: float, y: float) -> None:
        self._fit.add((1.0, x), y)
        self._solved = False

    def _line(self) -> list[float] | None:
        if not self._solved:  # solved once per change, read many times
            self._coef, self._solved = self._fit.solve(), True
        return self._coef

    def slope(self) -> float:
        coef = self._line()
        return 0.0 if coef is None else coef[1]

    def __call__(self, x: float) -> float:
        """The fitted y at x (the samples' mean before x spreads; `floor` before any sample)."""
        if not self.ready:
            return self.floor
        coef = self._line()
        return max(self._fit.mean() if coef is None else coef[0] + coef[1] * x, self.floor)
