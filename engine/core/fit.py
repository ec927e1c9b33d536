"""DecayedFit: the one least-squares fit of the project (pure). The engine's step model and
the speculator's step cost fit decode steps with it, the start-up profile draws its lines,
the simulator fits a CPU engine's step cost with it (sim/cpu_fit.py: no decay, each sample
weighted), and `LinearFit` (y ≈ a + b·x over recent samples) is it on one load: the routers' wait
forecast, the engine's prefill cost per token and the KV tier's fetch times.

LinearFit: the newest sample weighs 1 and each older one `decay` times less than the next,
so the fit follows a cluster whose speed changes; the slope is never negative (more load is
never faster). Until the samples' x values spread (variance under `MIN_X_VARIANCE`) the
slope is unknown and the fit is their weighted mean; a value is never below `floor`.
"""
from __future__ import annotations

from collections.abc import Sequence

RIDGE = 1e-9
"""Added to the normalised normal equations' diagonal: a solvable system whatever the samples."""


class DecayedFit:
    """Exponentially weighted least squares of y on x = (1, load, ...): the newest sample
    weighs 1 and each older one `decay` times less (1: all the same). Slopes are kept at or
    above zero (more load is never faster; a slope the samples cannot show yet is zero, and
    the others are refitted without it). A term is fitted once its load's weighted variance
    reaches `min_variance[i]`; no fit at all (None) before the first load (x[1]) has varied."""

    def __init__(self, min_variance: tuple[float, ...], decay: float) -> None:
        n = len(min_variance)
        self.min_variance, self.decay = min_variance, decay
        self._m = [[0.0] * n for _ in range(n)]
        """Weighted sums of x·xᵀ."""
        self._v = [0.0] * n
        """Weighted sums of x·y."""

    def add(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """A sample; `weight` scales it on top of the decay (a batch fit's own weights)."""
        d = self.decay
        for i in range(len(x)):
            self._v[i] = self._v[i] * d + weight * x[i] * y
            for j in range(len(x)):
                self._m[i][j] = self._m[i][j] * d + weight * x[i] * x[j]

    def observe(self, x: tuple[float, ...], y: float) -> list[float] | None:
        """Adds a sample; returns the coefficients now."""
        self.add(x, y)
        return self.solve()

    @property
    def weight(self) -> float:
        """The samples' total weight (0: none yet)."""
        return self._m[0][0]

    def mean(self) -> float:
        """The samples' weighted mean y (0 before any)."""
        return self._v[0] / self._m[0][0] if self._m[0][0] > 0 else 0.0

    def mean_x(self, i: int) -> float:
        """The samples' weighted mean of load x[i] (0 before any)."""
        return self._m[0][i] / self._m[0][0] if self._m[0][0] > 0 else 0.0

    def solve(self) -> list[float] | None:
        w = max(self._m[0][0], 1e-30)
        free = [0] + [i for i in range(1, len(self._v))
                      if self._m[i][i] / w - (self._m[0][i] / w) ** 2 >= self.min_variance[i]]
        if 1 not in free:
            return None
        while True:
            coef = _solve_subset(self._m, self._v, free)
            negative = [i for i in free[1:] if coef[i] < 0]
            if not negative:
                return coef
            free.remove(negative[0])


def _solve_subset(m: list[list[float]], v: list[float], free: list[int]) -> list[float]:
    """Gaussian elimination on the normal equations of the `free` coefficients (the others 0)."""
    k = len(free)
    scale = [max(m[i][i], 1e-30) for i in free]
    a = [[m[free[r]][free[c]] / (scale[r] * scale[c]) ** 0.5 + (RIDGE if r == c else 0.0) for c in range(k)]
         + [v[free[r]] / scale[r] ** 0.5] for r in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-12:
            continue
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    out = [0.0] * len(v)
    for r in range(k):
        if abs(a[r][r]) >= 1e-12:
            out[free[r]] = a[r][k] / a[r][r] / scale[r] ** 0.5
    return out


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

    def ratio(self) -> float:
        """The samples' weighted mean y over their weighted mean x (0 while x is 0)."""
        x = self._fit.mean_x(1)
        return self._fit.mean() / x if x > 0 else 0.0

    def line(self) -> tuple[float, float] | None:
        """(a, b): y = a + b·x; b 0 while the slope is unknown (a: the mean); None before any sample."""
        if not self.ready:
            return None
        coef = self._line()
        return (self._fit.mean(), 0.0) if coef is None else (coef[0], coef[1])

    def __call__(self, x: float) -> float:
        """The fitted y at x (the samples' mean before x spreads; `floor` before any sample)."""
        line = self.line()
        return self.floor if line is None else max(line[0] + line[1] * x, self.floor)
