"""LoadBook: merging the router's own bookkeeping with heartbeats, and telling a worker that stopped."""
from __future__ import annotations

from control.heartbeat import Heartbeat
from router.loads import LoadBook
from tests.unit.helpers import heartbeat


def beat(worker_id: str, free: int = 10, cached: int = 0, running: int = 0, queued: int = 0) -> Heartbeat:
    return heartbeat(worker_id, "decode", num_total_blocks=20, num_free_blocks=free, num_cached_blocks=cached,
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


def test_registry_away_forgets_loads_but_not_who_has_gone() -> None:
    book = LoadBook({"d0": 20, "d1": 20})
    book.set_heartbeats({"d0": beat("d0", free=2), "d1": beat("d1")})
    book.set_heartbeats({"d1": beat("d1")})
    assert book.reachable and book.alive("d1") and book.gone("d0")
    book.set_heartbeats(None)
    assert book.gone("d0") and not book.gone("d1")  # the view survives the outage
    assert not book.reachable and not book.alive("d1")  # busy or dead cannot be told apart now
    assert book.load("d1").num_free_blocks == 20  # load: the router's own view only


def loads(book: LoadBook, worker_id: str) -> tuple[int, int, int]:
    load = book.load(worker_id)
    return load.num_active, load.queued_prefill_tokens, load.num_free_blocks


def test_a_remote_prefill_booking_settles_each_entry_once() -> None:
    book = LoadBook({"d0": 20, "p0": 1 << 30})
    booking = book.book("d0", "p0", prompt_tokens=48, blocks=4)
    assert loads(book, "d0") == (1, 0, 16) and loads(book, "p0") == (1, 48, 1 << 30)
    booking.prefilled()
    booking.prefilled()  # the first token is counted once
    assert loads(book, "p0") == (1, 0, 1 << 30)
    booking.end()
    booking.end()
    assert loads(book, "d0") == (0, 0, 20) and loads(book, "p0") == (0, 0, 1 << 30)


def test_an_attempt_ended_before_its_first_token_frees_its_queued_prompt() -> None:
    """A prefill worker that died mid-prefill must not keep the prompt queued in the book:
    when it comes back it would look busy forever."""
    book = LoadBook({"d0": 20, "p0": 1 << 30})
    book.book("d0", "p0", prompt_tokens=48, blocks=4).end()
    assert loads(book, "p0") == (0, 0, 1 << 30) and loads(book, "d0") == (0, 0, 20)


def test_a_local_prefill_queues_its_prompt_on_the_decode_worker() -> None:
    book = LoadBook({"d0": 20})
    booking = book.book("d0", None, prompt_tokens=30, blocks=2)
    assert loads(book, "d0") == (1, 30, 18)
    booking.prefilled()
    assert loads(book, "d0") == (1, 0, 18)
    booking.end()
    assert loads(book, "d0") == (0, 0, 20)
