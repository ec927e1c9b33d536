"""The KV store's bookkeeping without a worker: slots, LRU order, pins, and the events the
routers index it by (stored on arrival, removed on eviction, numbered without gaps)."""
from __future__ import annotations

import time

import numpy as np

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
