"""LinearFit: y ≈ a + b·x over recent samples (exponentially weighted least squares, pure).

The newest sample weighs 1 and each older one `decay` times less than the next, so the fit
follows a cluster whose speed changes. Until the samples' x values spread (variance under
`MIN_X_VARIANCE`) the slope is unknown and the fit is their weighted mean; the slope is never
negative (more load is never faster), and a value is never below `floor`.
"""
from __future__ import annotations

MIN_X_VARIANCE = 0.25


class LinearFit:
    def __init__(self, decay: float, floor: float = 0.0) -> None:
        self.decay, self.floor = decay, floor
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        return self._w > 0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w, self._x, self._y = self._w * d + 1, self._x * d + x, self._y * d + y
        self._xx, self._xy = self._xx * d + x * x, self._xy * d + x * y

    def slope(self) -> float:
        if not self.ready:
            return 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        return max((self._xy / self._w - mx * my) / var, 0.0) if var >= MIN_X_VARIANCE else 0.0

    def __call__(self, x: float) -> float:
        """The fitted y at x (the samples' mean before x spreads; `floor` before any sample)."""
        if not self.ready:
            return self.floor
        mx, my = self._x / self._w, self._y / self._w
        return max(my + self.slope() * (x - mx), self.floor)
