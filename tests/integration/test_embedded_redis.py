"""The embedded redis-server (a real one) when its port is taken between choosing and binding."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

import cluster.redis_server as redis_server
from cluster.redis_server import EmbeddedRedis, PortTaken


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_given_port_in_use_is_refused_and_nothing_is_left_running(held_port: int) -> None:
    with pytest.raises(PortTaken, match="in use"):
        EmbeddedRedis(port=held_port)


def test_a_chosen_port_taken_before_redis_binds_it_is_chosen_again(held_port: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = redis_server.free_port
    picks = iter([held_port])
    monkeypatch.setattr(redis_server, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    server = EmbeddedRedis()
    try:
        assert server.port != held_port
        client = redis.Redis.from_url(server.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        client.close()
    finally:
        server.stop()


def test_another_redis_on_the_port_is_not_mistaken_for_ours() -> None:
    first = EmbeddedRedis()
    try:
        with pytest.raises(PortTaken):
            EmbeddedRedis(port=first.port)
    finally:
        first.stop()


def test_the_embedded_redis_refuses_a_client_without_its_password() -> None:
    from pathlib import Path

    from cluster.processes import redacted

    server = EmbeddedRedis()
    try:
        assert redis.Redis.from_url(server.url, socket_timeout=2).ping()  # the url carries the password
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        password = server.url.split(":")[2].split("@")[0]
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        assert password not in cmdline  # not on a command line (any local user could read it)
        assert password not in redacted(server.url) and "***" in redacted(server.url)
    finally:
        server.stop()


def test_bound_to_every_interface_its_url_names_the_machines_address_and_still_needs_the_password() -> None:
    address = redis_server.route_address(redis_server.DEFAULT_ROUTE_PROBE)
    if address.startswith("127."):
        pytest.skip("this machine has no default route: no address other hosts could dial")
    server = EmbeddedRedis(host="0.0.0.0")
    try:
        assert f"@{address}:{server.port}/" in server.url  # what workers on other nodes dial
        assert redis.Redis.from_url(server.url, socket_timeout=2).ping()
        anonymous = redis.Redis(host=address, port=server.port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
    finally:
        server.stop()


def test_with_a_members_identity_it_speaks_only_tls_of_the_cluster_ca() -> None:
    """As a cluster's Redis reached beyond loopback: `rediss://` carrying the cluster CA, which
    any process given the URL verifies the server with (no secret needed); a plain client, a
    TLS client trusting only the system's CAs, and one trusting another cluster's CA all fail
    before a password is sent."""
    from control.redis_url import CA_PARAM, readable, with_ca
    from control.tls import member_tls

    server = EmbeddedRedis(host="0.0.0.0", tls=member_tls(b"redis-tls-test-secret"))
    try:
        assert server.url.startswith("rediss://") and f"{CA_PARAM}=" in server.url
        client = redis.Redis.from_url(readable(server.url), socket_timeout=2)
        assert client.ping() and client.set("k", b"v") and client.get("k") == b"v"
        client.close()
        bare = server.url.split("?")[0]
        other_ca = with_ca(bare, member_tls(b"another-cluster-secret").ca_pem)
        for url in ("redis" + bare[len("rediss"):], bare, readable(other_ca)):
            stranger = redis.Redis.from_url(url, socket_timeout=2)
            with pytest.raises(redis.ConnectionError):
                stranger.ping()
            stranger.close()
    finally:
        server.stop()


def test_with_the_deployments_own_certificate_its_url_carries_that_ca_bundle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`serve --tls-ca/--tls-cert/--tls-key` on a Ray head: the embedded Redis serves the given
    certificate, and its URL carries the given CA bundle whole (any of its CAs verifies)."""
    from control.redis_url import readable
    from control.tls import given_tls
    from tests.pki import make_ca

    old, ca = make_ca("old"), make_ca("current")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(old.write(tmp_path / "old.pem").read_bytes() + ca.write(tmp_path / "ca.pem").read_bytes())
    server = EmbeddedRedis(host="0.0.0.0", tls=given_tls(str(bundle), *map(str, ca.issue(tmp_path, "head"))))
    try:
        client = redis.Redis.from_url(readable(server.url), socket_timeout=2)
        assert client.ping()
        client.close()
    finally:
        server.stop()
