"""The checks a router makes before it trusts a caller or a heartbeat: API keys, Host
names, worker addresses, and heartbeat sizes."""
from __future__ import annotations

import msgpack
import pytest

from control.heartbeat import BadEntry, Heartbeat, ModelFacts
from router.api_keys import MISSING, WRONG, ApiKeys, Unauthenticated
from router.http_guard import HttpGuard, _host_name
from router.members import Members, WorkerNetworks
from tests.unit.helpers import heartbeat


def test_a_key_is_checked_against_every_digest_and_names_its_tenant() -> None:
    keys = ApiKeys.parse(["sk-aaaaaaaaaa", "sk-bbbbbbbbbb:acme"])
    assert keys.check("Bearer sk-aaaaaaaaaa").tenant is None
    assert keys.check("bearer  sk-bbbbbbbbbb ").tenant == "acme"
    for value, message in ((None, MISSING), ("", MISSING), ("Basic sk-aaaaaaaaaa", MISSING), ("Bearer", MISSING),
                           ("Bearer sk-cccccccccc", WRONG), ("Bearer sk-aaaaaaaaa", WRONG)):
        with pytest.raises(Unauthenticated, match=message):
            keys.check(value)
    assert "sk-" not in repr(keys) and all(len(d) == 32 for d, _ in keys.digests)
    for bad, message in (("short", "API key 1"), ("sk-with space", "API key 1"), ("sk-aaaaaaaaaa:te nant", "tenant")):
        with pytest.raises(ValueError, match=message):
            ApiKeys.parse([bad])


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("LOCALHOST", "localhost"),
                                         ("127.0.0.1:80", "127.0.0.1"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                         ("api.example.com", "api.example.com"), ("::1", "::1")])
def test_a_host_headers_name_is_read_without_its_port(header: str, name: str) -> None:
    assert _host_name(header) == name


def test_a_loopback_router_answers_loopback_names_and_a_wider_one_its_list() -> None:
    assert set(HttpGuard.for_bind("127.0.0.1", None, (), ()).allowed_hosts or ()) == {"localhost", "127.0.0.1", "::1"}
    assert "api.local" in (HttpGuard.for_bind("::1", None, (), ("API.local",)).allowed_hosts or ())
    assert HttpGuard.for_bind("0.0.0.0", None, (), ()).allowed_hosts is None
    assert HttpGuard.for_bind("0.0.0.0", None, (), ("a.example",)).allowed_hosts == ("a.example",)


def test_worker_addresses_outside_the_networks_are_skipped_and_counted_once() -> None:
    facts = dict(model_id="m", block_size=16, vocab_size=1000, max_model_len=256, num_total_blocks=64)
    members = Members()
    beats = {"d0": heartbeat("d0", "decode", address="10.1.2.3:5000", **facts),
             "d1": heartbeat("d1", "decode", address="8.8.8.8:5000", **facts),
             "d2": heartbeat("d2", "decode", address="worker.example:5000", **facts)}
    for _ in range(3):
        members.update(beats)
    assert members.serving("decode") == ["d0"] and members.num_refused_addresses == 2
    named = Members(("10.0.0.0/8", "worker.example"))
    named.update(beats)
    assert named.serving("decode") == ["d0", "d2"]
    assert not WorkerNetworks().allows("127.0.0.1:0") and not WorkerNetworks().allows("127.0.0.1")
    assert WorkerNetworks(("*",)).allows("8.8.8.8:1")


def test_a_serving_worker_without_model_facts_gets_no_requests() -> None:
    facts = dict(model_id="m", block_size=16, vocab_size=1000, max_model_len=256, num_total_blocks=64)
    members = Members()
    members.update({"d0": heartbeat("d0", "decode", address="10.0.0.1:1", **facts),
                    "d1": heartbeat("d1", "decode", address="10.0.0.2:1", **{**facts, "block_size": 0})})
    assert members.facts is not None and members.facts.block_size == 16
    assert members.serving("decode") == ["d0"]
    lone = Members()
    lone.update({"d1": heartbeat("d1", "decode", address="10.0.0.2:1", **{**facts, "block_size": 0})})
    assert lone.facts is None and lone.decode_kv_tokens() == 0  # no facts: no request is divided by a size of 0


@pytest.mark.parametrize("field,value", [("block_size", -1), ("block_size", 1 << 20), ("vocab_size", 1 << 30),
                                         ("num_total_blocks", -5), ("max_model_len", 1 << 40)])
def test_heartbeats_with_sizes_out_of_range_are_malformed(field: str, value: int) -> None:
    good = msgpack.unpackb(Heartbeat("d0", "decode", "10.0.0.2:5000", facts=ModelFacts("m", 16, 1000, 512, 64)).to_wire())
    Heartbeat.from_wire(msgpack.packb(good))
    with pytest.raises(BadEntry, match=f"{field}={value} is outside"):
        Heartbeat.from_wire(msgpack.packb({**good, "facts": {**good["facts"], field: value}}))
    load = {**good["load"], "num_free_blocks": -1}
    with pytest.raises(BadEntry, match="negative count"):
        Heartbeat.from_wire(msgpack.packb({**good, "load": load}))


def test_secrets_stay_out_of_config_reprs() -> None:
    from control.worker_config import WorkerConfig
    from engine.config import CacheConfig
    from kvfabric.config import ReceiverConfig, SenderConfig
    from router.config import RouterConfig

    for config in (RouterConfig(cluster_secret=b"s3cr3t-value"), WorkerConfig(model_dir="m", cluster_secret=b"s3cr3t-value"),
                   CacheConfig(cluster_secret=b"s3cr3t-value"), ReceiverConfig(token="s3cr3t-value"),
                   SenderConfig(token="s3cr3t-value")):
        assert "s3cr3t" not in repr(config), type(config).__name__
