"""Framing on a stream socket: [u32 big-endian header length][msgpack map][optional payload].

A header is a msgpack map with a type `t`; a data header carries `nbytes` and the raw
payload follows it, received with `recv_into` straight into destination memory. No
pickle ever. Sends are serialised by a lock so a frame is never interleaved; every
blocking call is bounded by the socket's timeout (`io_timeout_s`), except waiting idle
for the next header, which the caller's loop may repeat.
"""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvfabric.errors import PeerUnavailable, ProtocolError

MAX_HEADER_BYTES = 1 << 20
_MAX_IOV = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)
_LEN = struct.Struct(">I")
_SOCKET_BUFFER_BYTES = 4 << 20


def tune(sock: socket.socket, io_timeout_s: float) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
    sock.settimeout(io_timeout_s)


def dial(host: str, port: int, local_name: str | None, timeout_s: float) -> socket.socket:
    """Connect to a receiver: its abstract Unix socket when given (same host; about 11 us
    less per message than loopback TCP), else TCP. A Unix socket that can't be reached
    (another network namespace) falls back to TCP."""
    if local_name:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + local_name)
            return sock
        except OSError:
            sock.close()
    return socket.create_connection((host, port), timeout=timeout_s)


MAX_RUNS = 1 << 16
"""Most block runs one message may name."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)


def _is_runs(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_RUNS and all(
        isinstance(r, list | tuple) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) for r in v)


_FIELD_CHECKS: dict[str, Callable[[object], bool]] = {
    "int": _is_int, "str": lambda v: isinstance(v, str), "runs": _is_runs, "map": lambda v: isinstance(v, dict),
    "ints": lambda v: isinstance(v, list) and len(v) <= MAX_RUNS and all(_is_int(x) for x in v)}
RECEIVER_MESSAGES: dict[str, dict[str, str]] = {
    # type -> field -> kind; a trailing "?" marks an optional field
    "open": {"rid": "int", "trace?": "str"},
    "renew": {"rids": "ints"},
    "ready": {"rid": "int", "first_token_id": "int", "num_tokens": "int", "runs?": "runs"},
    "revoke_ack": {"rid": "int"},
    "abort": {"rid": "int", "reason?": "str"},
    "data": {"rid": "int", "runs": "runs", "nbytes": "int", "crc32?": "int"},
    "nccl_data": {"rid": "int", "runs": "runs"},
}
"""What a sender may send a receiver after the handshake."""
HELLO = {"hello": {"layout": "map", "transport": "str", "token?": "str", "gpu?": "str"}}


def check_message(msg: dict[str, Any], schema: dict[str, dict[str, str]]) -> dict[str, Any]:
    """`msg` if its type is in `schema` and every field it needs has the right kind; else a
    ProtocolError naming the first bad field (the connection ends, nothing else)."""
    fields = schema.get(msg["t"])
    if fields is None:
        raise ProtocolError(f"unknown message type {msg['t']!r:.40}")
    for name, kind in fields.items():
        key = name.rstrip("?")
        if key not in msg and name.endswith("?"):
            continue
        if key not in msg or not _FIELD_CHECKS[kind](msg[key]):
            raise ProtocolError(f"{msg['t']!r} message: field {key!r} missing or not a valid {kind}")
    return msg


class Idle(Exception):
    """No frame started within the timeout (not an error)."""


class Conn:
    def __init__(self, sock: socket.socket, io_timeout_s: float) -> None:
        tune(sock, io_timeout_s)
        self.sock = sock
        self._send_lock = threading.Lock()
        self._hdr = bytearray(_LEN.size)
        self.closed = False

    # -- sending -------------------------------------------------------------------------
    def send(self, msg: dict[str, Any], payload: Sequence[memoryview] = ()) -> None:
        """One frame: the header, then the payload buffers back to back (gathered, no copy)."""
        body = msgpack.packb(msg)
        bufs = [memoryview(_LEN.pack(len(body)) + body), *payload]
        with self._send_lock:
            try:
                while bufs:
                    sent = self.sock.sendmsg(bufs[:_MAX_IOV])
                    bufs = _advance(bufs, sent)
            except (TimeoutError, OSError) as e:
                self.close()
                raise PeerUnavailable(f"send failed: {e}") from e

    # -- receiving -----------------------------------------------------------------------
    def recv(self) -> dict[str, Any]:
        """The next header. Raises Idle when none started in time, PeerUnavailable on EOF."""
        self._read_into(memoryview(self._hdr), idle_ok=True)
        (n,) = _LEN.unpack(self._hdr)
        if not 0 < n <= MAX_HEADER_BYTES:
            raise ProtocolError(f"header length {n} outside (0, {MAX_HEADER_BYTES}]")
        body = bytearray(n)
        self._read_into(memoryview(body), idle_ok=False)
        try:
            msg = msgpack.unpackb(body, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable header: {e}") from e
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise ProtocolError("a header must be a map with a string 't'")
        return msg

    def recv_into(self, views: list[memoryview]) -> None:
        """Exactly fill `views` in order (scattered, no copy); a short stream is a ProtocolError."""
        total, got = sum(len(v) for v in views), 0
        while views:
            try:
                n = self.sock.recvmsg_into(views[:_MAX_IOV])[0]
            except TimeoutError:
                raise ProtocolError(f"peer stalled mid-frame ({got} of {total} payload bytes)") from None
            except OSError as e:
                raise PeerUnavailable(f"connection lost: {e}") from e
            if n == 0:
                raise ProtocolError(f"truncated frame: connection closed after {got} of {total} payload bytes")
            got += n
            views = _advance(views, n)

    def discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            n = min(nbytes, len(scratch))
            self._read_into(scratch[:n], idle_ok=False)
            nbytes -= n

    def _read_into(self, view: memoryview, idle_ok: bool) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if idle_ok and got == 0:
                    raise Idle from None
                raise ProtocolError(f"peer stalled mid-frame ({got} of {len(view)} bytes)") from None
            except OSError as e:
                raise PeerUnavailable(f"connection lost: {e}") from e
            if n == 0:
                if got == 0 and idle_ok:
                    raise PeerUnavailable("connection closed by peer")
                raise ProtocolError(f"truncated frame: connection closed after {got} of {len(view)} bytes")
            got += n

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _advance(bufs: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first nbytes from a list of buffers."""
    i = 0
    while i < len(bufs) and nbytes >= len(bufs[i]):
        nbytes -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if rest and nbytes:
        rest[0] = rest[0][nbytes:]
    return rest
