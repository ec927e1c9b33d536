"""The KV store's bookkeeping without a worker: slots, LRU order, pins, and the events the
routers index it by (stored on arrival, removed on eviction, numbered without gaps)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvfabric import BlockRegion, FabricLayout, FabricSender, KVArrived
from kvstore.store import KVStore

LAYOUT = FabricLayout("store-test", "float32", 1, 4, 1, 4, 4)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def offer_and_push(store: KVStore, sender: FabricSender, hashes: list[bytes]) -> list[int]:
    ticket, wanted = store.offer(hashes)
    if ticket is not None:
        t = sender.open(ticket)
        t.push(list(range(len(wanted))), 0)
        t.finish(0, len(wanted) * LAYOUT.block_size)
        deadline = time.monotonic() + 5
        while store.receiver.num_reservations() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # its events thread indexes the arrival
    return wanted


def test_store_events_and_lru_order() -> None:
    store = KVStore(LAYOUT, 4)
    source = BlockRegion(np.arange(8 * LAYOUT.block_bytes, dtype=np.uint8).reshape(8, -1))
    sender = FabricSender(LAYOUT, source)
    try:
        assert offer_and_push(store, sender, [h(1), h(2), h(3)]) == [0, 1, 2]
        assert offer_and_push(store, sender, [h(1), h(2), h(3)]) == []  # held already: none wanted
        [stored] = store.take_events()
        assert (stored.event_id, stored.kind, stored.block_hashes) == (0, "stored", [h(1), h(2), h(3)])
        assert offer_and_push(store, sender, [h(7), h(8)]) == [0, 1]  # one slot free: the chain's 3rd block goes
        removed, stored = store.take_events()
        assert (removed.event_id, removed.kind, removed.block_hashes) == (1, "removed", [h(3)])
        assert (stored.event_id, stored.block_hashes) == (2, [h(7), h(8)])
        assert store.lookup([h(1), h(2), h(3)]) == 2 and store.lookup([h(7), h(8)]) == 2
        assert not any(isinstance(e, KVArrived) for e in store.take_events())
        store.check()
    finally:
        sender.close()
        store.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_blocks_memory_evicts_live_on_in_the_spill_file_and_come_back_byte_for_byte(tmp_path, monkeypatch,
                                                                                    direct: bool) -> None:
    """Memory of 2 blocks, a spill file of 2: a third block spills the least recently used one,
    which a fetch reads back (spilling another); only a block dropped from the file leaves the
    store (its `removed` event). Fetched bytes equal the offered ones. A disk that fails a
    read costs that fetch, and the memory slot it took comes back."""
    from kvfabric import FabricReceiver, ShmSegment
    from kvstore.disk import DiskTier

    store = KVStore(LAYOUT, 2, disk=DiskTier(tmp_path, 2, LAYOUT.block_bytes, direct=direct))  # 128-byte blocks: bounced
    assert not list(tmp_path.iterdir())  # the spill file is unlinked at once
    rng = np.random.default_rng(4)
    source = BlockRegion(rng.integers(0, 256, (8, LAYOUT.block_bytes), dtype=np.uint8))
    sender = FabricSender(LAYOUT, source)
    seg = ShmSegment.create(8 * LAYOUT.block_bytes)
    pool = BlockRegion(seg.data.reshape(8, -1))
    receiver = FabricReceiver(LAYOUT, pool, shm=seg)

    def offer(hashes: list[bytes], first_source: int) -> None:
        ticket, wanted = store.offer(hashes)
        assert ticket is not None and wanted == list(range(len(hashes)))
        t = sender.open(ticket)
        t.push(list(range(first_source, first_source + len(hashes))), 0)
        t.finish(0, len(hashes) * LAYOUT.block_size)
        deadline = time.monotonic() + 5
        while not all(store._holds(h) for h in hashes):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        offer([h(1), h(2)], 0)  # memory full; h(1) most recently used (a chain's first block last to go)
        offer([h(3)], 2)        # h(2) spills
        assert store.stats.num_spilled == 1 and len(store.disk) == 1 and store.lookup([h(1), h(2)]) == 2
        assert [e.kind for e in store.take_events()] == ["stored", "stored"]  # a spill is no removal
        ticket = receiver.expect("f1", [5, 6], 0)
        assert store.fetch(ticket, [h(1), h(2)]) == ""  # h(2) read back (h(3) spills to make room)
        assert store.stats.num_unspilled == 1
        assert np.array_equal(pool.array[[5, 6]], source.array[[0, 1]])
        offer([h(4)], 3)
        offer([h(5)], 4)  # each spills one more: the file of 2 drops its least recently used
        events = store.take_events()
        assert [e.kind for e in events] == ["stored", "removed", "stored"] and events[1].block_hashes == [h(3)]
        assert store.lookup([h(3)]) == 0 and store.stats.num_evicted == 1
        store.check()

        def failing(*args: object) -> int:
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(os, "preadv", failing)  # the disk fails under a fetch of a spilled block
        spilled = next(x for x in (h(1), h(2), h(4)) if x in store.disk)
        assert "could not be read back" in store.fetch(receiver.expect("f2", [7], 0), [spilled])
        monkeypatch.undo()
        store.check()  # that fetch only: the memory slot it took is free again, nothing pinned
    finally:
        receiver.close()
        sender.close()
        store.close()
        seg.close()
