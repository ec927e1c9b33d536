from __future__ import annotations

import random

from control.kv_events import event_from_bytes, event_to_bytes
from engine.core.block_pool import KVEvent
from router.kv_index import KVIndex


def h(i: int) -> bytes:
    return bytes([i]) * 16


def stored(eid: int, *blocks: int) -> KVEvent:
    return KVEvent(eid, "stored", [h(b) for b in blocks])


def test_overlap_counts_leading_blocks_only(clock) -> None:
    idx = KVIndex(clock)
    idx.apply("d0", stored(0, 1, 2, 3))
    idx.apply("d1", stored(0, 1, 3))
    assert idx.overlap([h(1), h(2), h(3)], ["d0", "d1", "d2"]) == {"d0": 3, "d1": 1, "d2": 0}


def test_removed(clock) -> None:
    idx = KVIndex(clock)
    idx.apply("d0", stored(0, 1, 2))
    idx.apply("d0", KVEvent(1, "removed", [h(2)]))
    assert idx.overlap([h(1), h(2)], ["d0"]) == {"d0": 1}
    assert idx.num_blocks("d0") == 1


def test_event_gap_drops_the_workers_entries(clock) -> None:
    idx = KVIndex(clock)
    idx.apply("d0", stored(0, 1, 2))
    idx.apply("d1", stored(0, 1))
    idx.apply("d0", stored(5, 7))  # events 1..4 lost
    assert idx.num_gaps == 1
    assert idx.overlap([h(1)], ["d0", "d1"]) == {"d0": 0, "d1": 1}
    assert idx.overlap([h(7)], ["d0"]) == {"d0": 1}
    idx.apply("d0", stored(6, 8))  # the stream goes on from 5: no gap
    assert idx.num_gaps == 1 and idx.overlap([h(7), h(8)], ["d0"]) == {"d0": 2}


def test_predicted_entries_expire(clock) -> None:
    idx = KVIndex(clock, predicted_ttl_s=2.0)
    idx.apply("d0", stored(0, 1))
    idx.predict("d1", [h(1), h(2)])
    assert idx.overlap([h(1), h(2)], ["d0", "d1"]) == {"d0": 1, "d1": 2}
    clock.advance(2.0)
    assert idx.overlap([h(1), h(2)], ["d0", "d1"]) == {"d0": 1, "d1": 0}
    idx.expire_predictions()
    assert idx.predicted("d1") == {}


def test_expiry_keeps_a_prediction_renewed_since_and_drops_each_entry_once(clock) -> None:
    idx = KVIndex(clock, predicted_ttl_s=2.0)
    renewed_until = clock() + 3.0
    idx.predict("d0", [h(1), h(2)])
    clock.advance(1.0)
    idx.predict("d0", [h(2), h(3)])  # h(2) renewed
    idx.predict("d1", [h(1)])
    idx.retract("d1", [h(1)])
    clock.advance(1.0)
    idx.expire_predictions()
    assert idx.predicted("d0") == {h(2): renewed_until, h(3): renewed_until}
    assert idx.predicted("d1") == {}
    clock.advance(1.0)
    idx.expire_predictions()
    assert idx.predicted("d0") == {} and not idx._expiries and not idx._predicted


def test_retract_drops_only_that_workers_predictions(clock) -> None:
    idx = KVIndex(clock, predicted_ttl_s=2.0)
    idx.apply("d0", stored(0, 1))
    idx.predict("d0", [h(1), h(2)])
    idx.predict("d1", [h(1), h(2)])
    idx.retract("d0", [h(1), h(2)])
    assert idx.overlap([h(1), h(2)], ["d0", "d1"]) == {"d0": 1, "d1": 2}
    idx.retract("d1", [h(1), h(2)])
    assert idx.predicted("d0") == idx.predicted("d1") == {} and not idx._predicted
    assert idx.overlap([h(1), h(2)], ["d0", "d1"]) == {"d0": 1, "d1": 0}


def test_the_workers_own_events_replace_its_predictions(clock) -> None:
    idx = KVIndex(clock, predicted_ttl_s=60.0)
    idx.predict("d0", [h(1), h(2), h(3)])
    idx.apply("d0", stored(0, 1, 2))
    assert idx.predicted("d0") == {h(3): clock() + 60.0}
    idx.apply("d0", KVEvent(1, "removed", [h(2)]))
    assert idx.overlap([h(1), h(2), h(3)], ["d0"]) == {"d0": 1}  # evicted: no longer counted for 60 s


def test_forget_worker_and_wire_round_trip(clock) -> None:
    idx = KVIndex(clock)
    ev = stored(0, 4, 5)
    assert event_from_bytes(event_to_bytes(ev)) == ev
    with_parent = KVEvent(3, "stored", [h(6)], h(5))
    assert event_from_bytes(event_to_bytes(with_parent)) == with_parent
    idx.apply("d0", ev)
    idx.predict("d0", [h(9)])
    idx.forget_worker("d0")
    assert idx.overlap([h(4)], ["d0"]) == {"d0": 0}
    idx.apply("d0", stored(0, 4))  # a restarted worker starts again at 0 without a gap
    assert idx.num_gaps == 0


def test_overlap_equals_a_walk_of_each_prompt_block_by_block(clock) -> None:
    """The per-worker sets and prediction maps against the definition: a worker's overlap is
    the run of leading blocks it holds or has predicted and unexpired, whatever the events
    (400 random events and lookups; about half the lookups find a run of 1-7 blocks)."""
    rng = random.Random(7)
    idx = KVIndex(clock, predicted_ttl_s=1.0)
    workers = ["d0", "d1", "d2"]
    held: dict[str, set[bytes]] = {w: set() for w in workers}
    until: dict[str, dict[bytes, float]] = {w: {} for w in workers}
    eids = dict.fromkeys(workers, 0)
    for _ in range(400):
        w, blocks = rng.choice(workers), [h(rng.randrange(12)) for _ in range(rng.randrange(1, 6))]
        kind = rng.choice(["stored", "removed", "predict", "advance"])
        if kind == "predict":
            idx.predict(w, blocks)
            until[w].update(dict.fromkeys(blocks, clock() + 1.0))
        elif kind == "advance":
            clock.advance(0.3)
            idx.expire_predictions()
        else:
            idx.apply(w, KVEvent(eids[w], kind, blocks))  # type: ignore[arg-type]
            eids[w] += 1
            (held[w].update if kind == "stored" else held[w].difference_update)(blocks)
            for b in blocks:
                until[w].pop(b, None)
        prompt = [h(rng.randrange(12)) for _ in range(rng.randrange(1, 8))]
        expected = {}
        for v in workers:
            n = 0
            while n < len(prompt) and (prompt[n] in held[v] or until[v].get(prompt[n], 0.0) > clock()):
                n += 1
            expected[v] = n
        assert idx.overlap(prompt, workers) == expected
