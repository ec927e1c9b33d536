"""kvfabric's NCCL link without a GPU: CuPy replaced by a stand-in of the few calls it makes,
to pin what does not need the hardware: the NCCL bindings are imported (not reached as an
attribute `import cupy` never sets), a group is posted start to end on one thread, and a
group end that waits for a peer that never comes is bounded and aborts the communicator."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from typing import Any

import pytest

from kvfabric import cuda
from kvfabric.errors import FabricError, PeerUnavailable


class FakeComm:
    def __init__(self, nranks: int, uid: Any, rank: int) -> None:
        self.posted: list[tuple[str, int, int, int]] = []
        self.aborted = threading.Event()

    def send(self, ptr: int, n: int, dtype: int, peer: int, stream: int) -> None:
        self.posted.append(("send", ptr, n, peer))

    def recv(self, ptr: int, n: int, dtype: int, peer: int, stream: int) -> None:
        self.posted.append(("recv", ptr, n, peer))

    def abort(self) -> None:
        self.aborted.set()

    def destroy(self) -> None:
        pass


class FakeStream:
    done = True
    ptr = 7

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


def fake_cupy(monkeypatch: pytest.MonkeyPatch, group_end: Any) -> types.ModuleType:
    """A `cupy` package whose `cuda.nccl` exists only once `import cupy.cuda.nccl` ran, as CuPy's."""
    cp, cuda_mod, nccl_mod = (types.ModuleType(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.nccl"))
    cp.__path__, cuda_mod.__path__ = [], []  # packages, so the submodule import goes through sys.modules
    cp.cuda = cuda_mod  # type: ignore[attr-defined]
    cuda_mod.Device = lambda index: contextlib.nullcontext()  # type: ignore[attr-defined]
    cuda_mod.Stream = FakeStream  # type: ignore[attr-defined]
    nccl_mod.groups = []  # type: ignore[attr-defined]  # (thread, "start" | "end")
    nccl_mod.NCCL_UINT8 = 0  # type: ignore[attr-defined]
    nccl_mod.NcclCommunicator = FakeComm  # type: ignore[attr-defined]
    nccl_mod.get_unique_id = lambda: bytes(range(128))  # type: ignore[attr-defined]
    nccl_mod.groupStart = lambda: nccl_mod.groups.append((threading.get_ident(), "start"))  # type: ignore[attr-defined]

    def end() -> None:
        nccl_mod.groups.append((threading.get_ident(), "end"))  # type: ignore[attr-defined]
        group_end()

    nccl_mod.groupEnd = end  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda_mod)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl_mod)
    return nccl_mod


def test_the_nccl_bindings_are_imported_not_reached_as_an_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy(monkeypatch, lambda: None)
    assert not hasattr(sys.modules["cupy"].cuda, "nccl")  # what `import cupy` leaves, as CuPy 13-14 do
    uid, uid_is_bytes = cuda.nccl_unique_id()
    assert uid == list(range(128)) and uid_is_bytes


def test_missing_nccl_bindings_are_one_fabric_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy(monkeypatch, lambda: None)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)  # import raises ImportError
    with pytest.raises(FabricError, match=r"needs CuPy's NCCL bindings \(cupy.cuda.nccl\)"):
        cuda.nccl_unique_id()
    fake_cupy(monkeypatch, lambda: None).available = False  # type: ignore[attr-defined]
    with pytest.raises(FabricError, match="cannot load"):
        cuda.NcclLink([1, 2], True, 1, 0, 0, 1.0)


def test_a_group_is_posted_whole_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_cupy(monkeypatch, lambda: None)
    link = cuda.NcclLink(list(range(128)), True, 2, 0, 0, 1.0)
    link.exchange(1, [(100, 16), (200, 32)], [(300, 8)], timeout_s=1.0)
    assert link.comm.posted == [("send", 100, 16, 1), ("send", 200, 32, 1), ("recv", 300, 8, 1)]
    [(start_thread, start), (end_thread, end)] = module.groups  # type: ignore[attr-defined]
    assert (start, end) == ("start", "end") and start_thread == end_thread != threading.get_ident()
    link.close()


def test_a_group_end_waiting_for_an_absent_peer_is_bounded_and_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    fake_cupy(monkeypatch, lambda: release.wait(10))
    link = cuda.NcclLink(list(range(128)), True, 2, 0, 0, 1.0)
    began = time.monotonic()
    with pytest.raises(PeerUnavailable, match="posting an NCCL group did not complete within 0.2 s"):
        link.exchange(1, [(100, 16)], [], timeout_s=0.2)
    # bounded by its 0.2 s, not by the peer (10 s here, forever in life)
    assert 0.2 <= time.monotonic() - began < 8.0 and link.comm.aborted.is_set()
    release.set()
    link.close()


def test_one_nccl_operation_at_a_time_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two links driven from two threads: the second group is posted only after the first
    one's stream is done (kernels of two communicators may not run side by side)."""
    inside = threading.Event()
    overlapped = []

    def end() -> None:
        overlapped.append(inside.is_set())

    fake_cupy(monkeypatch, end)
    links = [cuda.NcclLink(list(range(128)), True, 2, 0, 0, 1.0) for _ in range(2)]
    real_wait = cuda.wait_stream

    def slow_wait(stream: Any, timeout_s: float, on_timeout: Any = None) -> None:
        inside.set()
        time.sleep(0.05)
        inside.clear()
        real_wait(stream, timeout_s, on_timeout)

    monkeypatch.setattr(cuda, "wait_stream", slow_wait)
    threads = [threading.Thread(target=lk.exchange, args=(1, [(1, 1)], [], 1.0)) for lk in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert overlapped == [False, False]


class _Stream:
    """A stream that finishes after `queries` polls, or never."""

    def __init__(self, queries: int | None) -> None:
        self.queries, self.polls = queries, 0

    @property
    def done(self) -> bool:
        self.polls += 1
        return self.queries is not None and self.polls > self.queries


def test_a_short_copy_is_waited_for_without_sleeping_and_a_stuck_one_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(cuda.time, "sleep", sleeps.append)
    stream = _Stream(3)
    cuda.wait_stream(stream, 1.0)
    assert stream.polls == 4 and sleeps == []  # polled within the spin window: no 60 us sleep on a 14 us copy
    clock = iter(x * 1e-4 for x in range(10**6))  # 100 us a poll
    monkeypatch.setattr(cuda.time, "monotonic", lambda: next(clock))
    aborted = []
    with pytest.raises(cuda.CopyInFlight, match="within 0.01 s"):
        cuda.wait_stream(_Stream(None), 0.01, on_timeout=lambda: aborted.append(True))
    assert aborted == [True]
    assert sleeps[:4] == [20e-6, 40e-6, 80e-6, 160e-6] and max(sleeps) == 1e-3  # past the spin: backing off to 1 ms
