from __future__ import annotations

import pytest

from engine.core.fit import LinearFit


def test_a_line_is_recovered_and_extrapolated() -> None:
    f = LinearFit(decay=1.0)
    for x in (1, 2, 4, 8):
        f.add(x, 0.002 + 0.001 * x)
    assert f.slope() == pytest.approx(0.001)
    assert f(57) == pytest.approx(0.002 + 0.057)


def test_one_x_value_gives_the_mean_and_no_slope() -> None:
    f = LinearFit(decay=1.0)
    assert not f.ready
    for y in (1.0, 2.0, 3.0):
        f.add(5, y)
    assert f.ready and f.slope() == 0.0 and f(100) == pytest.approx(2.0)


def test_recent_samples_weigh_more_and_the_slope_is_never_negative() -> None:
    f = LinearFit(decay=0.5, floor=0.1)
    f.add(1, 10.0)
    for _ in range(20):
        f.add(1, 2.0)
    assert f(1) == pytest.approx(2.0, abs=1e-4)
    g = LinearFit(decay=1.0, floor=0.1)
    g.add(1, 5.0)
    g.add(9, 1.0)
    assert g.slope() == 0.0 and g(9) == pytest.approx(3.0)
    h = LinearFit(decay=1.0, floor=0.5)
    h.add(3, 0.0)
    assert h(3) == 0.5


def test_the_tiers_fetch_line_never_has_a_negative_part() -> None:
    """Fetches of 1 block in 1 ms and of 10 in 19 ms fit -1 ms + 2 ms a block: the heartbeat
    (whose times are never negative) gets a fixed part of 0."""
    from kvstore.tier_meters import FetchTimes

    times = FetchTimes()
    assert times.lines == [None, None]
    times.observe(False, 1, 0.001)
    assert times.lines[0] == (pytest.approx(0.001), 0.0)  # one size: its mean, no slope yet
    times.observe(False, 10, 0.019)
    a, b = times.lines[0]  # type: ignore[misc]
    assert a == 0.0 and b == pytest.approx(0.002, rel=1e-3) and times.lines[1] is None


def test_the_ratio_is_the_samples_y_over_their_x() -> None:
    f = LinearFit(decay=1.0)
    assert f.ratio() == 0.0
    for x, y in ((2, 1.0), (6, 1.0)):
        f.add(x, y)
    assert f.ratio() == pytest.approx(2.0 / 8.0)
