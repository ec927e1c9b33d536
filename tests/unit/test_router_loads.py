"""LoadBook: merging the router's own bookkeeping with heartbeats, and telling a worker that stopped."""
from __future__ import annotations

from cluster.registry import Heartbeat
from router.loads import LoadBook


def beat(worker_id: str, free: int = 10, cached: int = 0, running: int = 0, queued: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, "decode", num_total_blocks=20, num_free_blocks=free, num_cached_blocks=cached,
                     num_running=running, queued_prefill_tokens=queued)


def test_own_and_heartbeat_merge_conservatively() -> None:
    book = LoadBook({"d0": 20})
    book.start("d0", prefill_tokens=30, blocks=4)
    assert (book.load("d0").num_free_blocks, book.load("d0").num_active) == (16, 1)
    book.set_heartbeats({"d0": beat("d0", free=5, cached=3, running=4, queued=10)})
    load = book.load("d0")
    assert (load.num_free_blocks, load.num_active, load.queued_prefill_tokens) == (8, 4, 30)
    book.prefilled("d0", 30)
    book.end("d0", 4)
    assert book.load("d0").queued_prefill_tokens == 10


def test_gone_only_after_a_seen_heartbeat_expires() -> None:
    book = LoadBook({"d0": 20, "d1": 20})
    book.set_heartbeats({})
    assert not book.gone("d0")  # never seen: still starting, not gone
    book.set_heartbeats({"d0": beat("d0"), "d1": beat("d1")})
    book.set_heartbeats({"d1": beat("d1")})
    assert book.gone("d0") and not book.gone("d1")
    book.set_heartbeats({"d0": beat("d0"), "d1": beat("d1")})  # back (restarted)
    assert not book.gone("d0")


def test_registry_away_forgets_everything() -> None:
    book = LoadBook({"d0": 20})
    book.set_heartbeats({"d0": beat("d0", free=2)})
    book.set_heartbeats(None)
    assert not book.gone("d0")
    assert book.load("d0").num_free_blocks == 20
