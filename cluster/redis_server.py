"""The cluster's Redis on this machine: a real `redis-server` child process (Debian's package,
which `./dev` installs; any redis-server on PATH), on a free loopback port, with a password
and persistence off. Ray-free: `splitserve serve` (cluster/local.py) and plain-process
clusters (benchmarks/gpu/gpu_serve.py on a machine without Ray) both start it from here.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from control.redis_url import readable, with_ca
from control.tls import MemberTLS
from control.worker_config import route_address

DEFAULT_ROUTE_PROBE = "192.0.2.1"
"""An address (TEST-NET-1, never dialled) whose route names the interface of the default route."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The port was in use when redis-server tried to bind it."""


class EmbeddedRedis:
    """A real redis-server child process that requires a password (generated here, handed to
    the server in a 0600 config file, never on a command line); `url` carries it. It binds
    `host`: loopback by default; on a Ray cluster's head, the head's private address (or
    0.0.0.0, and then `url` names this machine's address on its default route), so workers
    on other nodes reach it. With `tls` (a cluster member's identity, control/tls.py) it
    speaks only TLS, with that certificate, and `url` (rediss://) carries the cluster's CA
    (control/redis_url.py): the password never crosses a network in clear."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", tls: MemberTLS | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (Debian: apt-get install redis-server; "
                               "./dev does this on first run) or pass --redis-url")
        self._binary = binary
        self._dir = tempfile.mkdtemp(prefix="splitserve-redis-")
        self._log = os.path.join(self._dir, "redis.log")
        self._password = secrets.token_urlsafe(24)
        conf = Path(self._dir) / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {self._password}\n" + (self._tls_conf(tls) if tls else ""))
        self._conf = str(conf)
        self.tls = tls
        self.host = host
        dial = route_address(DEFAULT_ROUTE_PROBE) if host in ("0.0.0.0", "::", "") else host
        for attempt in (1, 2, 3):
            self.port = port or free_port(host)
            self.url = f"redis://:{self._password}@{dial}:{self.port}/0"
            if tls:
                self.url = with_ca("rediss" + self.url[len("redis"):], tls.ca_pem)
            try:
                self._spawn()
                return
            except PortTaken:
                # a free port found by binding and closing can be taken before redis binds it
                if port or attempt == 3:
                    self.stop()
                    raise

    def _tls_conf(self, tls: MemberTLS) -> str:
        """TLS only (no plain port), with the member's certificate; clients show the password."""
        files = {}
        for name, pem in (("ca", tls.ca_pem), ("cert", tls.cert_pem), ("key", tls.key_pem)):
            path = Path(self._dir) / f"{name}.pem"
            path.touch(mode=0o600)
            path.write_bytes(pem)
            files[name] = path
        return (f"tls-cert-file {files['cert']}\ntls-key-file {files['key']}\ntls-ca-cert-file {files['ca']}\n"
                "tls-auth-clients no\ntls-protocols TLSv1.3\n")

    def _spawn(self) -> None:
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        self._proc = subprocess.Popen(
            [self._binary, self._conf, *ports, "--bind", self.host, "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--loglevel", "warning", "--logfile", self._log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # no pipe that nobody drains
        self._wait_ready(timeout_s=10.0)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def restart(self) -> None:
        """The server died: a new one on the same port (empty: workers re-publish their heartbeats
        at once and the KV events they buffered meanwhile; routers reconnect on their own)."""
        self._proc.wait(timeout=5)
        for attempt in (1, 2, 3, 4, 5):
            try:
                self._spawn()
                return
            except PortTaken:  # the old socket may linger a moment
                if attempt == 5:
                    raise
                time.sleep(0.5)

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(readable(self.url), socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                err = self._last_log_lines(2)
                kind = PortTaken if "in use" in err else RuntimeError
                raise kind(f"redis-server exited at start (code {self._proc.returncode}): {err}")
            try:
                # whoever answers must be our child, not a server that held the port first
                if int(client.info("server")["process_id"]) == self._proc.pid:
                    client.close()
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.05)

    def _last_log_lines(self, n: int) -> str:
        try:
            with open(self._log, errors="replace") as f:
                lines = [line.split("# ", 1)[-1].strip() for line in f if line.strip()]
        except OSError:
            return ""
        return " ".join(lines[-n:])

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)
