"""The autoscaler's load forecast: Holt's linear trend (double exponential smoothing) of a
pool's demand, read at the time a worker launched now would be serving (pure, no I/O).

Why a trend model and not a seasonal one: what a scale-up must see coming is the load of the
next start-up time (tens of seconds to minutes), over which even a diurnal curve is a line;
a seasonal model (Holt-Winters) needs a period named in advance and several periods of
history (days, for a day's cycle) before it forecasts at all, and it is wrong on the ramps
that matter most (a launch, an incident, a batch job), which a trend follows in seconds.
Smoothing with irregular ticks: each observation x at time t after `dt` since the last,

    level' = a x + (1 - a) (level + trend dt)
    trend' = b (level' - level) / dt + (1 - b) trend

and the forecast `h` seconds on is level' + trend' h.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Trend:
    level: float
    trend: float
    """Change per second."""
    at: float
    """When it was last updated."""

    def at_time(self, t: float) -> float:
        """The forecast for time `t` (never below 0: a demand)."""
        return max(0.0, self.level + self.trend * (t - self.at))


def observe(prior: Trend | None, x: float, now: float, alpha: float, beta: float) -> Trend:
    """`prior` updated with the observation `x` at `now` (None: the first, no trend yet)."""
    if prior is None:
        return Trend(x, 0.0, now)
    dt = now - prior.at
    if dt <= 0:
        return prior
    level = alpha * x + (1 - alpha) * (prior.level + prior.trend * dt)
    trend = beta * (level - prior.level) / dt + (1 - beta) * prior.trend
    return Trend(level, trend, now)
