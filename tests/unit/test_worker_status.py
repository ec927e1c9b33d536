"""The one map from a worker-side failure to its gRPC status (control/worker_host.py
`status_for`), and the refusal of a new call, which goes through it."""
from __future__ import annotations

import grpc

from control.heartbeat import ModelFacts
from control.worker_config import WorkerConfig
import pytest

from control.worker_host import NoRoom, NotHere, Stalled, WorkerHost, status_for
from router.attempt import WorkerFailed
from router.clients import failure_for
from engine.types import EngineStopped, InvalidRequestError
from kvfabric.errors import PeerUnavailable


def test_each_failure_maps_to_the_status_the_router_acts_on() -> None:
    assert status_for(InvalidRequestError("prompt too long")) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
    assert status_for(PeerUnavailable("reset")) == (grpc.StatusCode.ABORTED, "KV transfer failed: reset")
    assert status_for(EngineStopped()) == (grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
    assert status_for(KeyError("x")) == (grpc.StatusCode.INTERNAL, "KeyError: 'x'")
    assert status_for(NoRoom("full")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert status_for(NotHere("no pushed KV")) == (grpc.StatusCode.FAILED_PRECONDITION, "no pushed KV")
    assert status_for(Stalled("idle")) == (grpc.StatusCode.DEADLINE_EXCEEDED, "idle")


@pytest.mark.parametrize("failure", [InvalidRequestError("bad"), PeerUnavailable("reset"), KeyError("x"),
                                     NoRoom("full"), NotHere("no pushed KV"), Stalled("idle")])
def test_a_worker_that_answers_with_a_status_is_not_taken_for_gone(failure: Exception) -> None:
    """A decode worker that takes no pushed KV once answered FAILED_PRECONDITION, which the
    router's map did not know: it marked the worker down. Only a stopping worker is down."""
    code, message = status_for(failure)
    seen = failure_for("decode-0", code, message)
    assert not isinstance(seen, WorkerFailed) or not seen.down
    stopping = failure_for("decode-0", *status_for(EngineStopped()))
    assert isinstance(stopping, WorkerFailed) and stopping.down


def test_a_new_call_is_refused_for_a_bad_id_and_while_the_worker_does_not_serve() -> None:
    host = WorkerHost("decode-0", "decode", WorkerConfig(model_dir="unused", serve_metrics=False), ModelFacts(),
                      lambda: None, None, "t")
    assert host.refusal("r1", {}) == (grpc.StatusCode.UNAVAILABLE, "decode-0 is starting: try another worker")
    host.state = "serving"
    assert host.refusal("r1", {}) is None
    assert host.refusal("r1", {"r1": object()}) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request id 'r1' is empty or already running here")
    assert host.refusal("", {})[0] == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[index]
    host.state = "draining"
    assert host.refusal("r2", {}) == (grpc.StatusCode.UNAVAILABLE, "decode-0 is draining: try another worker")
    assert host.num_late_calls == 1


def test_the_heartbeats_load_never_waits_for_a_busy_engine() -> None:
    """The publisher once waited up to 2 s per beat for the engine thread; on a busy machine
    beats then outlived their TTL. Now a read asks, and returns the newest answer it has."""
    import concurrent.futures
    import time

    from control.worker_host import latest_load_reader
    from engine.types import EngineLoad

    class Loop:
        def __init__(self) -> None:
            self.asked: list[concurrent.futures.Future] = []

        def call(self, fn: object) -> concurrent.futures.Future:
            self.asked.append(concurrent.futures.Future())
            return self.asked[-1]

    loop = Loop()
    read = latest_load_reader(loop)
    load = EngineLoad(**{**{f: 0 for f in EngineLoad.__dataclass_fields__}, "num_total_blocks": 8})
    t0 = time.monotonic()
    assert read() is None and len(loop.asked) == 1  # the first beat waits (bounded) for the first load
    loop.asked[0].set_result(load)
    assert read() is load and len(loop.asked) == 2  # answered: the newest load, and the next asked for
    t0 = time.monotonic()
    for _ in range(5):  # the engine is busy: nothing answers, nothing waits, the last load stands
        assert read() is load
    assert time.monotonic() - t0 < 0.1 and len(loop.asked) == 2
