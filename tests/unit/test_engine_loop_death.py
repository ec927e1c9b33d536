"""An engine loop whose step raises ends, fails every pending call, and says so once
(`on_death`: a worker exits then, as a crashed one would)."""
from __future__ import annotations

import concurrent.futures
import threading

import pytest

from engine.engine_loop import EngineLoop
from engine.types import EngineStopped


class Broken:
    """An engine whose next step fails as a lost tensor-parallel rank's collective does."""

    def has_schedulable(self) -> bool:
        return True

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")


def test_a_failed_step_ends_the_loop_and_calls_on_death_once() -> None:
    died: list[BaseException] = []
    done = threading.Event()

    def on_death(e: BaseException) -> None:
        died.append(e)
        done.set()

    loop = EngineLoop(Broken(), lambda outputs: None, on_death=on_death)  # type: ignore[arg-type]
    loop.start()
    assert done.wait(5)
    assert len(died) == 1 and "Connection closed by peer" in str(died[0]) and loop.error is died[0]
    with pytest.raises((EngineStopped, concurrent.futures.CancelledError)):
        loop.call(lambda e: 1).result(5)
    loop.stop()
