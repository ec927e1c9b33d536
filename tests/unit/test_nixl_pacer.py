"""kvfabric's NIXL agents progress their UCX worker from a `Pacer` (kvfabric/nixl.py) instead of
NIXL's own progress thread, which spins on a core for the agent's whole life: not at all
without peers, fast while a peer wires up or writes are in flight, slowly while peers are
attached. A counting progress function stands in for the agent."""
from __future__ import annotations

import threading
import time

import pytest

from kvfabric import nixl
from kvfabric.nixl import Pacer


class Turns:
    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n += 1

    def over(self, seconds: float) -> int:
        """Progress calls made in the next `seconds`."""
        before = self.n
        time.sleep(seconds)
        return self.n - before

    def quiet(self) -> None:
        """Until a call under way when the pace changed has been made (a loaded machine may
        run the thread late): no call for 0.1 s, within 5 s."""
        deadline = time.monotonic() + 5
        while self.over(0.1) and time.monotonic() < deadline:
            pass


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(nixl, "WARM_S", 0.3)
    monkeypatch.setattr(nixl, "IDLE_S", 0.1)
    t = Turns()
    pacer = Pacer("test", t)
    yield pacer, t
    pacer.stop()


def test_no_peer_no_progress_call(turns) -> None:  # type: ignore[no-untyped-def]
    pacer, t = turns
    assert t.over(0.3) == 0
    pacer.begin()  # writes in flight (a sender without a peer yet): progressed
    assert t.over(0.2) >= 20  # every FAST_S (200 us)
    pacer.end()
    t.quiet()
    assert t.over(0.3) == 0


def test_a_peer_is_progressed_fast_while_it_wires_up_then_slowly_and_fast_again_while_writes_fly(
        turns) -> None:  # type: ignore[no-untyped-def]
    pacer, t = turns
    pacer.attach()
    assert t.over(0.2) >= 20  # within WARM_S of the attach
    time.sleep(0.2)  # the warm-up is over: every IDLE_S (0.1 s)
    assert 1 <= t.over(0.55) <= 8
    pacer.begin(2)
    assert t.over(0.2) >= 20
    pacer.end()  # one of two writes is still in flight
    assert t.over(0.2) >= 20
    pacer.end()
    time.sleep(0.15)
    assert 1 <= t.over(0.55) <= 8
    pacer.detach()
    time.sleep(0.1)  # the last idle wait ends
    t.quiet()
    assert t.over(0.3) == 0


def test_a_failing_progress_call_is_logged_once_and_paced_on(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("NIXL_ERR_BACKEND")
    pacer = Pacer("test", broken)
    try:
        pacer.begin()
        time.sleep(0.2)
    finally:
        pacer.stop()
    assert len(calls) >= 20
    said = [r.getMessage() for r in caplog.records if "NIXL progress failed" in r.getMessage()]
    assert said == ["kvfabric: NIXL progress failed (NIXL_ERR_BACKEND); pacing on"]


def test_stop_ends_the_thread_at_once_whatever_the_pace(
        turns, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    pacer, t = turns
    monkeypatch.setattr(nixl, "IDLE_S", 30.0)
    pacer.attach()
    time.sleep(0.5)  # past the warm-up: waiting up to IDLE_S
    began = time.monotonic()
    pacer.stop()
    assert time.monotonic() - began < 5 and not pacer._thread.is_alive()
    n = t.n
    time.sleep(0.15)
    assert t.n == n
