"""Framing on a stream socket: [u32 big-endian header length][msgpack map][optional payload].

A header is a msgpack map with a type `t`: every message either side sends is a msgspec
Struct here, tagged by `t` (a receiver reads `Hello` then `ReceiverMessage`s; a sender reads
`Challenge`, `HelloReply` then `SenderMessage`s), encoded by `Conn.send` and decoded, every
field checked, by `Conn.recv` (`decode`); a data header carries `nbytes` and the raw payload
follows it, received with `recv_into` straight into destination memory. No pickle ever. Sends are serialised by a lock so a frame is never interleaved; every
blocking call is bounded by the socket's timeout (`io_timeout_s`), except waiting idle
for the next header, which the caller's loop may repeat.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvfabric.errors import PeerUnavailable, ProtocolError

MAX_HEADER_BYTES = 1 << 20
MAX_HELLO_BYTES = 64 << 10
"""A hello's most bytes: read (and decoded) before the sender has proved anything, so small."""
_MAX_IOV = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)
_LEN = struct.Struct(">I")
_SOCKET_BUFFER_BYTES = 4 << 20
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 4, 1, 3
"""A TCP connection silent this long is probed; unanswered probes end it (about 7 s), as does
data unacknowledged as long (TCP_USER_TIMEOUT): a peer behind a cut link is known gone in
bounded time, so the reservations of a one-sided writer (nixl across hosts) are fenced and
freed rather than held while the connection idles."""


def tune(sock: socket.socket, io_timeout_s: float) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES))
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


Runs = Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_RUNS)]
"""Block runs (position in the reservation, number of blocks)."""


MAX_NIXL_METADATA = 1 << 19
"""A NIXL agent's metadata, at most (its UCX worker address and memory keys: a few KiB)."""
MAX_CHOICE_TOKENS = 15
"""First tokens of a request's other choices a `ready` carries (engine/core/request.py MAX_CHOICES - 1)."""


class Message(msgspec.Struct, frozen=True, tag_field="t", omit_defaults=True):
    """A header: a map whose `t` names its type (each subclass's tag); fields left at their
    default are not sent."""


# -- sender -> receiver -------------------------------------------------------------------
class Open(Message, tag="open"):
    rid: int
    trace: str = ""
    """The sender's W3C traceparent (empty: none)."""


class Renew(Message, tag="renew"):
    rids: Annotated[list[int], msgspec.Meta(max_length=MAX_RUNS)]


class Ready(Message, tag="ready"):
    rid: int
    first_token_id: int
    num_tokens: int
    runs: Runs = msgspec.field(default_factory=list)
    """One-sided: the runs copied since the last report."""
    choice_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_CHOICE_TOKENS)] = msgspec.field(
        default_factory=list)
    """A request of n choices: the other choices' first tokens (engine/core/forks.py)."""


class RevokeAck(Message, tag="revoke_ack"):
    rid: int


class Abort(Message, tag="abort"):
    rid: int
    reason: str = ""


class Data(Message, tag="data"):
    """tcp: the header of a frame whose `nbytes` of payload follow it."""

    rid: int
    runs: Runs
    nbytes: int
    crc32: int | None = None


class NcclData(Message, tag="nccl_data"):
    """nccl: the runs that arrive as grouped NCCL receives."""

    rid: int
    runs: Runs


ReceiverMessage = Open | Renew | Ready | RevokeAck | Abort | Data | NcclData
"""What a sender may send a receiver after the handshake."""


class Hello(Message, tag="hello"):
    layout: dict[str, Any]
    transport: str
    host_id: str = ""
    nonce: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """The sender's own nonce, which the receiver's hello_ok answers (each side proves itself)."""
    proof: str = ""
    """`prove(token, "sender", the challenge's nonce, nonce)`: the cluster secret shown for this
    connection alone (a recorded hello proves nothing on another)."""
    gpu: str | None = None
    nccl_uid: bytes | list[int] | None = None
    nccl_uid_bytes: bool = False


# -- receiver -> sender -------------------------------------------------------------------
class Challenge(Message, tag="challenge"):
    """The receiver's first words on a connection: a fresh nonce the sender's hello must answer."""

    nonce: Annotated[str, msgspec.Meta(max_length=64)]


class HelloOk(Message, tag="hello_ok"):
    receiver_id: str
    layout: dict[str, Any]
    """The receiver's layout (`FabricLayout.to_wire`): its split of the KV heads."""
    proof: str = ""
    """`prove(token, "receiver", the challenge's nonce, the hello's nonce)`."""
    nixl_agent: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)] = b""
    """nixl: the receiver's NIXL agent metadata (kvfabric/nixl.py `Agent.metadata`)."""
    nixl_pools: Annotated[list[tuple[int, int, int]], msgspec.Meta(max_length=256)] = msgspec.field(
        default_factory=list)
    """nixl: each receiver rank's registered pool (base address, bytes, device)."""
    nixl_rank_agents: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)]],
                                msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)
    """nixl, a split receiver whose further ranks registered their pools with NIXL agents of
    their own (pools private to their processes, as GPU ranks' are): the metadata of the agent
    holding each rank's pool, b"" where `nixl_agent` holds it; empty: `nixl_agent` holds all."""


class HelloErr(Message, tag="hello_err"):
    """The hello refused: which field, and why (the sender raises HandshakeError with both)."""

    field: str
    error: str


HelloReply = HelloOk | HelloErr


class OpenOk(Message, tag="open_ok"):
    rid: int


class OpenErr(Message, tag="open_err"):
    rid: int
    error: str


class ReadyAck(Message, tag="ready_ack"):
    rid: int
    error: str | None
    """None: the reservation took the ready; else why it refused it (sent either way)."""


class Revoke(Message, tag="revoke"):
    """Stop writing this reservation; the receiver frees its blocks once the `revoke_ack` comes."""

    rid: int
    reason: str = "revoked"


SenderMessage = OpenOk | OpenErr | ReadyAck | Revoke
"""What a receiver may send a sender after the handshake."""


def new_nonce() -> str:
    return secrets.token_hex(32)


def prove(token: str, side: str, receiver_nonce: str, sender_nonce: str) -> str:
    """One side's proof that it holds the cluster's token on the connection of these two
    nonces (an HMAC keyed by the token: the token itself never travels)."""
    text = f"kvfabric v2 {side} {receiver_nonce} {sender_nonce}".encode()
    return hmac.new(token.encode(), text, hashlib.sha256).hexdigest()


def proven(token: str, side: str, receiver_nonce: str, sender_nonce: str, shown: object) -> bool:
    return isinstance(shown, str) and hmac.compare_digest(shown.encode(),
                                                          prove(token, side, receiver_nonce, sender_nonce).encode())


def start_tls(sock: socket.socket, context: ssl.SSLContext | None, server_side: bool,
              timeout_s: float) -> socket.socket:
    """`sock` under TLS when `context` (a TCP connection's; a Unix socket stays on its host and
    is returned as it is), the handshake bounded by `timeout_s`. Raises PeerUnavailable."""
    if context is None or sock.family == socket.AF_UNIX:
        return sock
    sock.settimeout(timeout_s)
    try:
        return context.wrap_socket(sock, server_side=server_side)
    except (ssl.SSLError, OSError) as e:
        sock.close()
        raise PeerUnavailable(f"TLS handshake failed: {e}") from e


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode(body: bytes | bytearray | memoryview, kind: Any) -> Any:
    """`body` as the typed message `kind` (a Message or a union of them) says, every field
    checked; else a ProtocolError naming the bad field (the connection ends, nothing else)."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"malformed message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable header: {e}") from None


class Idle(Exception):
    """No frame started within the timeout (not an error)."""


class Conn:
    def __init__(self, sock: socket.socket, io_timeout_s: float) -> None:
        tune(sock, io_timeout_s)
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        """TLS carries no scatter/gather: each buffer goes on its own."""
        self.io_timeout_s = io_timeout_s
        self._send_lock = threading.Lock()
        self._hdr = bytearray(_LEN.size)
        self.closed = False

    def start_tls(self, context: ssl.SSLContext | None, server_side: bool, timeout_s: float) -> None:
        """Continue under TLS (`start_tls`); before anything else is sent or received."""
        self.sock = start_tls(self.sock, context, server_side, timeout_s)
        self.sock.settimeout(self.io_timeout_s)
        self.tls = isinstance(self.sock, ssl.SSLSocket)

    # -- sending -------------------------------------------------------------------------
    def send(self, msg: Message, payload: Sequence[memoryview] = ()) -> None:
        """One frame: the header, then the payload buffers back to back (gathered, no copy)."""
        body = encode(msg)
        bufs = [memoryview(_LEN.pack(len(body)) + body), *payload]
        with self._send_lock:
            try:
                if self.tls:
                    for buf in bufs:
                        self.sock.sendall(buf)
                else:
                    while bufs:
                        sent = self.sock.sendmsg(bufs[:_MAX_IOV])
                        bufs = _advance(bufs, sent)
            except (TimeoutError, OSError) as e:
                self.close()
                raise PeerUnavailable(f"send failed: {e}") from e

    # -- receiving -----------------------------------------------------------------------
    def recv(self, kind: Any, deadline: float | None = None, max_bytes: int = MAX_HEADER_BYTES) -> Any:
        """The next header, of at most `max_bytes`, as the message `kind` (`decode`). Raises
        Idle when none started in time, PeerUnavailable on EOF; with a `deadline`
        (time.monotonic()), ProtocolError when the whole header has not arrived by then,
        however it trickles in."""
        self._read_into(memoryview(self._hdr), idle_ok=deadline is None, deadline=deadline)
        (n,) = _LEN.unpack(self._hdr)
        if not 0 < n <= max_bytes:
            raise ProtocolError(f"header length {n} outside (0, {max_bytes}]")
        body = bytearray(n)
        self._read_into(memoryview(body), idle_ok=False, deadline=deadline)
        return decode(body, kind)

    def recv_into(self, views: list[memoryview]) -> None:
        """Exactly fill `views` in order (scattered, no copy); a short stream is a ProtocolError."""
        total, got = sum(len(v) for v in views), 0
        while views:
            try:
                n = self.sock.recv_into(views[0]) if self.tls else self.sock.recvmsg_into(views[:_MAX_IOV])[0]
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

    def _read_into(self, view: memoryview, idle_ok: bool, deadline: float | None = None) -> None:
        got = 0
        while got < len(view):
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProtocolError(f"the frame did not arrive by its deadline ({got} of {len(view)} bytes)")
                self.sock.settimeout(min(self.io_timeout_s, remaining))
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
        if deadline is not None:
            self.sock.settimeout(self.io_timeout_s)

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
