"""A split worker's further ranks over NIXL: each rank's pool held by an agent of its own.

On GPUs a further tensor-parallel rank's KV pool is private to its process (CUDA memory is
not shared the way the CPU ranks' shared memory is). `RankPool` registers it with a NIXL
agent in the rank's own process and exports the agent's metadata (the worker's receiver
names it to senders: `kvfabric.region.AgentRegion`), so a sender writes that rank's heads
straight into it. On the sending side, a further rank's `RankPoster` posts the writes of its
own heads from its own agent, asked by rank 0's `RankClient` over an abstract Unix socket
(typed msgspec calls, answered only after the token the rank exported); `NixlLink` routes
each piece of heads through the rank that holds it.
"""
from __future__ import annotations

import hmac
import itertools
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvfabric.errors import PeerUnavailable, ProtocolError
from kvfabric.nixl import POLL_S, Agent, NixlUnavailable


class RankPool:
    """A further tensor-parallel rank's KV allocator (engine/parallel/tp_followers.py) whose pool
    only NIXL reaches: private memory (huge pages on the host, the rank's own GPU) registered
    with a NIXL agent of the rank's own, which `export` names to the worker's receiver
    (`kvfabric.region.AgentRegion`), so a sender writes the rank's heads straight into it.
    The agent is paced idly (`IDLE_S`) for its whole life: UCX completes a sender's wire-up
    only as both ends progress, and nothing tells this process when a sender connects (the
    first write of a new sender waited ~70 ms on these turns, ~15 ms once the sender starts
    the wire-up as it adds the agent, `Agent.add_remote`; later writes none)."""

    def __init__(self) -> None:
        self.tensor: Any = None
        self.agent: Agent | None = None
        self.poster: RankPoster | None = None

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: str) -> Any:
        from engine.model.kv_pool import TensorAllocator

        if self.tensor is not None:
            raise ValueError("a RankPool backs exactly one pool")
        self.tensor = TensorAllocator().allocate(shape, dtype, device)
        return self.tensor

    def export(self) -> dict[str, Any]:
        """{"nixl": the agent's metadata, "nixl_pool": (base, bytes, device)}; where NIXL cannot
        start here, {"nixl_error": why} (the worker's receiver says it)."""
        if self.tensor is None:
            return {}
        if self.agent is None:
            from kvfabric.pools import pool_region

            try:
                self.agent = Agent("rank", [pool_region(self.tensor)])
            except NixlUnavailable as e:
                return {"nixl_error": str(e)}
            self.agent.pacer.attach()
            self.poster = RankPoster(self.agent)
        return {"nixl": self.agent.metadata(), "nixl_pool": list(self.agent.pools[0]),
                "nixl_post": self.poster.name, "nixl_token": self.poster.token}

    def close(self) -> None:
        if self.poster is not None:
            self.poster.close()
            self.poster = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.tensor = None


class _Add(msgspec.Struct, tag="add"):
    metadata: bytes


class _Write(msgspec.Struct, tag="write"):
    remote: str
    src: bytes
    """[n, 3] int64 (address, bytes, device), in this rank's pool."""
    dst: bytes


class _Check(msgspec.Struct, tag="check"):
    handle: int
    wait_s: float = 0.0
    """Answered once the write completed, failed, or this long passed (polled there, not here)."""


class _Release(msgspec.Struct, tag="release"):
    handles: list[int]


class _Drop(msgspec.Struct, tag="drop"):
    remote: str


_Call = _Add | _Write | _Check | _Release | _Drop
_decode_call = msgspec.msgpack.Decoder(_Call).decode


class _Answer(msgspec.Struct):
    value: str | int = 0
    error: str = ""


_decode_answer = msgspec.msgpack.Decoder(_Answer).decode
_encode = msgspec.msgpack.Encoder().encode
RANK_CHECK_S = 0.005
"""How long a rank's poster polls a write it posted before answering a check (one call per
5 ms while a rank's writes are in flight, not one per `POLL_S`)."""
MAX_POST_FRAME = 64 << 20
"""The largest call a rank's poster reads (a piece narrower than a block: a descriptor per row)."""


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv_frame(sock: socket.socket) -> bytes:
    head = _recv_exact(sock, 4)
    (n,) = struct.unpack("<I", head)
    if n > MAX_POST_FRAME:
        raise ProtocolError(f"a {n}-byte frame from a rank's poster peer (at most {MAX_POST_FRAME})")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise PeerUnavailable("the rank's poster connection closed")
        data += chunk
    return bytes(data)


class RankPoster:
    """A further rank's writes, posted from its own agent for the worker's sender (rank 0),
    which names them: its `RankClient` asks, over a Unix socket of this process (abstract,
    answered only after the `token` it was given through the rank's export), to add a
    receiver's agent, post a WRITE from this rank's pool (every source descriptor checked to
    lie in it), check or release one, or drop the receiver's agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.token = secrets.token_hex(32)
        self.name = f"splitserve-rank-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(4)
        self._sock.settimeout(0.2)
        self._handles: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvfabric-rank-poster", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvfabric-rank-post", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10.0)
                if not hmac.compare_digest(_recv_frame(conn), self.token.encode()):
                    return
                conn.settimeout(None)
                while not self._closed:
                    try:
                        answer = self._answer(_decode_call(_recv_frame(conn)))
                    except (msgspec.ValidationError, msgspec.DecodeError) as e:
                        answer = _Answer(error=f"not a call: {e}")
                    _send_frame(conn, _encode(answer))
            except (OSError, PeerUnavailable, ProtocolError):
                return

    def _answer(self, call: _Call) -> _Answer:
        try:
            if isinstance(call, _Add):
                return _Answer(self.agent.add_remote(call.metadata))
            if isinstance(call, _Drop):
                self.agent.drop_remote(call.remote)
                return _Answer()
            if isinstance(call, _Write):
                return self._write(call)
            if isinstance(call, _Check):
                deadline = time.monotonic() + min(max(call.wait_s, 0.0), 1.0)
                while (answer := self._check(call.handle)).value == "PROC" and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                return answer
            self._release(call.handles)
            return _Answer()
        except Exception as e:  # noqa: BLE001 - nixlBind's own errors travel back to rank 0 as text
            return _Answer(error=str(e) or type(e).__name__)

    def _write(self, call: _Write) -> _Answer:
        src = np.frombuffer(call.src, np.int64).reshape(-1, 3)
        dst = np.frombuffer(call.dst, np.int64).reshape(-1, 3)
        base, nbytes, device = self.agent.pools[0]
        if len(src) != len(dst) or not len(src) or (src[:, 0] < base).any() or \
                (src[:, 0] + src[:, 1] > base + nbytes).any() or (src[:, 2] != device).any():
            return _Answer(error="source descriptors outside this rank's pool")
        nixl = self.agent.live()
        with self.agent.calls:
            handle = nixl.initialize_xfer("WRITE", nixl.get_xfer_descs(src, self.agent.kind),
                                          nixl.get_xfer_descs(dst, self.agent.kind), call.remote)
            state = nixl.transfer(handle)
            if state in ("ERR", "DONE"):
                handle.release()
        if state == "ERR":
            return _Answer(error="failed at posting")
        if state == "DONE":
            return _Answer("DONE")
        hid = next(self._ids)
        self._handles[hid] = handle
        self.agent.pacer.begin()
        return _Answer(hid)

    def _check(self, hid: int) -> _Answer:
        handle = self._handles.get(hid)
        if handle is None:
            return _Answer(error=f"no write {hid} in flight")
        with self.agent.calls:
            state = self.agent.live().check_xfer_state(handle)
            if state == "DONE":
                handle.release()
        if state in ("DONE", "ERR"):
            self._handles.pop(hid, None)
            self.agent.pacer.end()
        return _Answer(state) if state != "ERR" else _Answer(error="the write failed")

    def _release(self, hids: Sequence[int]) -> None:
        for hid in hids:
            handle = self._handles.pop(hid, None)
            if handle is None:
                continue
            with self.agent.calls:
                try:
                    handle.release()
                except Exception:  # noqa: BLE001 - an in-flight request may refuse release; nothing more to do
                    pass
            self.agent.pacer.end()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(timeout=2)


class RankClient:
    """Rank 0's side of a further rank's `RankPoster`: one connection, one call at a time."""

    def __init__(self, name: str, token: str, timeout_s: float = 10.0) -> None:
        self.name, self._token, self.timeout_s = name, token, timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def call(self, call: _Call) -> str | int:
        """The answer's value; PeerUnavailable with the rank's error, or when it is gone."""
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect("\0" + self.name)
                    _send_frame(sock, self._token.encode())
                    self._sock = sock
                _send_frame(self._sock, _encode(call))
                answer = _decode_answer(_recv_frame(self._sock))
            except (OSError, ProtocolError, msgspec.DecodeError, msgspec.ValidationError) as e:
                self._close()
                raise PeerUnavailable(f"tensor-parallel rank's poster {self.name}: {e}") from e
        if answer.error:
            raise PeerUnavailable(f"tensor-parallel rank's poster {self.name}: {answer.error}")
        return answer.value

    def add_remote(self, metadata: bytes) -> str:
        return str(self.call(_Add(metadata)))

    def drop_remote(self, name: str) -> None:
        self.call(_Drop(name))

    def write(self, remote: str, src: np.ndarray, dst: np.ndarray) -> int | str:
        """A posted write's id, or "DONE" where it completed at posting."""
        return self.call(_Write(remote, np.ascontiguousarray(src, np.int64).tobytes(),
                                np.ascontiguousarray(dst, np.int64).tobytes()))

    def check(self, hid: int, wait_s: float = RANK_CHECK_S) -> str:
        """The write's state once it completed, or after `wait_s` (the rank polls it meanwhile)."""
        return str(self.call(_Check(hid, wait_s)))

    def release(self, hids: Sequence[int]) -> None:
        if hids:
            self.call(_Release(list(hids)))

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()
