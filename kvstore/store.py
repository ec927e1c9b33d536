"""A host's KV store: full blocks by their chained hash in one shared-memory pool, written by
the workers' offloads and read by their fetches, both through kvfabric.

    offload  Offer(hashes) -> slots for those it lacks, under a kvfabric reservation
             -> the worker pushes them -> KVArrived: indexed, fetchable from now on;
                TransferFailed: the slots go back (held first while the writer may still write)
    fetch    Lookup(hashes) -> the leading run it holds
             Fetch(ticket, hashes) -> the slots pinned, pushed into the worker's reservation,
                `ready` acknowledged, unpinned

Hashes are keyed with the cluster secret and salted per model and tenant (engine/core/hashing.py),
so a block is found only by the prompt of its own tenant. The store keeps blocks in least
recently used order, a chain touched last block first: its first blocks, which every longer
prompt of the conversation needs (a lookup is a leading run), are the last to go. A slot is
never reused while an offload may write it or a fetch reads it. The store holds no request
and answers for nothing but cached bytes: when it dies the workers compute what they would
have fetched.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import KVEvent, KVEventKind
from engine.types import BlockHash
from kvfabric import (
    BlockRegion,
    FabricError,
    FabricLayout,
    FabricReceiver,
    FabricSender,
    KVArrived,
    ReceiverConfig,
    SenderConfig,
    ShmSegment,
    Ticket,
    TransferFailed,
    settle,
)
from kvfabric.region import CopyBytes
from kvstore.disk import DiskTier

logger = logging.getLogger(__name__)

MAX_HASHES = 1 << 16
"""Most hashes one call may name (a 1M-token prompt at 16 tokens a block)."""


@dataclass
class StoreStats:
    num_offered: int = 0
    num_stored: int = 0
    num_lookups: int = 0
    num_hit_blocks: int = 0
    num_fetched: int = 0
    num_evicted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    num_fetch_failures: int = 0
    num_spilled: int = 0
    """Blocks memory evicted into the spill file (kvstore/disk.py)."""
    num_unspilled: int = 0
    """Blocks a fetch read back from it."""


class KVStore:
    def __init__(self, layout: FabricLayout, num_blocks: int, receiver: ReceiverConfig | None = None,
                 sender: SenderConfig | None = None, copy: CopyBytes = ctypes.memmove, store_id: str = "",
                 disk: DiskTier | None = None) -> None:
        """`copy` moves a fetch's bytes into a worker's shared pool (see kvfabric's `CopyBytes`);
        `store_id`: the member id its KV events are published under (routers index them);
        `disk`: where blocks evicted from memory go on living (None: they leave the store)."""
        self.store_id = store_id
        self.disk = disk
        if num_blocks <= 0:
            raise ValueError(f"a KV store holds at least one block, got {num_blocks}")
        if layout.world != 1:
            raise ValueError("a KV store holds whole blocks (every KV head): its layout has one rank")
        self.layout, self.capacity = layout, num_blocks
        self.segment = ShmSegment.create(num_blocks * layout.block_bytes)
        self.region = BlockRegion(self.segment.data.reshape(num_blocks, layout.block_bytes))
        self.receiver = FabricReceiver(layout, self.region, receiver, shm=self.segment)
        self.sender = FabricSender(layout, self.region, sender, copy)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Hash -> slot, least recently used first."""
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        """Slots a fetch is reading."""
        self._incoming: dict[str, tuple[list[int], list[bytes]]] = {}
        """Offer id -> the slots reserved for it and their hashes, until it arrives or fails."""
        self._arriving: set[bytes] = set()
        self._quarantine: dict[str, list[int]] = {}
        """Failed offers whose writer may still write: their slots, until it is fenced."""
        self._ids = itertools.count(1)
        self._events_out: list[KVEvent] = []
        """`stored` / `removed` events for the routers' index of the tiers, numbered without gaps."""
        self._next_event_id = 0
        self._stop = threading.Event()
        self._events = threading.Thread(target=self._apply_events, name="kvstore-events", daemon=True)
        self._events.start()

    # -- offload ---------------------------------------------------------------------------
    def offer(self, hashes: Sequence[bytes]) -> tuple[Ticket | None, list[int]]:
        """The positions of `hashes` the store lacks and has room for (the chain's first ones
        first), and a reservation to push them into; (None, []) when it wants none."""
        _check_hashes(hashes)
        with self._lock:
            self.stats.num_offered += len(hashes)
            wanted = [i for i, h in enumerate(hashes) if not self._holds(h) and h not in self._arriving]
            self._touch([h for h in hashes if self._holds(h)])
            slots = self._take(len(wanted))
            wanted = wanted[:len(slots)]
            if not wanted:
                return None, []
            offer_id = f"offer-{next(self._ids)}"
            chosen = [hashes[i] for i in wanted]
            self._incoming[offer_id] = (slots, chosen)
            self._arriving.update(chosen)
        return self.receiver.expect(offer_id, slots, 0), wanted

    # -- fetch -----------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading hashes the store holds (touched: they were wanted)."""
        _check_hashes(hashes)
        with self._lock:
            n = 0
            while n < len(hashes) and self._holds(hashes[n]):
                n += 1
            self._touch(hashes[:n])
            self.stats.num_lookups += 1
            self.stats.num_hit_blocks += n
        return n

    def fetch(self, ticket: Ticket, hashes: Sequence[bytes]) -> str:
        """Pushes the blocks of `hashes` into the reservation `ticket` (one block each, none
        skipped); "" once the receiver accepted them, else why not (it then has nothing)."""
        _check_hashes(hashes)
        if len(ticket.block_ids) != len(hashes) or ticket.num_skip_blocks:
            return f"a fetch of {len(hashes)} blocks needs a reservation of as many, none skipped"
        with self._lock:
            missing = next((i for i, h in enumerate(hashes) if not self._holds(h)), None)
            if missing is not None:
                self.stats.num_fetch_failures += 1
                return f"block {missing} of {len(hashes)} is no longer in the store"
            self._touch(hashes)  # first: making room for the spilled ones drops others from the file
            self._pins.update(self._index[h] for h in hashes if h in self._index)
            try:
                self._unspill([h for h in hashes if h not in self._index])
            except (OSError, ValueError, KeyError) as e:
                self._pins.subtract(self._index[h] for h in hashes if h in self._index)
                self._pins += Counter()
                self.stats.num_fetch_failures += 1
                return f"the spilled blocks could not be read back: {e}"
            held = [self._index[h] for h in hashes]
        try:
            transfer = self.sender.open(ticket)
            try:
                transfer.push(held, 0)
                transfer.finish(0, len(held) * self.layout.block_size)
            except BaseException:
                transfer.abort("the store's push failed")
                raise
        except (FabricError, ValueError) as e:
            with self._lock:
                self.stats.num_fetch_failures += 1
            return str(e)
        finally:
            with self._lock:
                self._pins.subtract(held)
                self._pins += Counter()  # drops the zeros
        with self._lock:
            self.stats.num_fetched += len(held)
            self.stats.bytes_out += len(held) * self.layout.block_bytes
        return ""

    # -- state -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    def check(self) -> None:
        """Every slot is exactly one of: free, indexed, reserved for an offer, quarantined."""
        with self._lock:
            owned = [*self._free, *self._index.values(), *(s for slots, _ in self._incoming.values() for s in slots),
                     *(s for slots in self._quarantine.values() for s in slots)]
            if sorted(owned) != list(range(self.capacity)):
                raise AssertionError(f"the store's {self.capacity} slots are not accounted for once each")
            if any(n < 0 for n in self._pins.values()):
                raise AssertionError("a slot unpinned more often than pinned")
            if self.disk is not None:
                self.disk.check()
                if any(h in self.disk for h in self._index):
                    raise AssertionError("a block both in memory and in the spill file")

    def close(self) -> None:
        self._stop.set()
        self._events.join(2)
        self.sender.close()
        self.receiver.close()
        self.segment.close()
        if self.disk is not None:
            self.disk.close()

    def take_events(self) -> list[KVEvent]:
        """The `stored` / `removed` events since the last call (the routers' index of the tiers)."""
        with self._lock:
            events, self._events_out = self._events_out, []
        return events

    # -- internals ---------------------------------------------------------------------------
    def _emit(self, kind: KVEventKind, hashes: list[bytes]) -> None:
        """Under the lock. A store's blocks are no chain of one prompt: no parent is named."""
        self._events_out.append(KVEvent(self._next_event_id, kind, [BlockHash(h) for h in hashes]))
        self._next_event_id += 1

    def _holds(self, h: bytes) -> bool:
        return h in self._index or (self.disk is not None and h in self.disk)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Most recently used, the chain's first block last (evicted after its later ones)."""
        for h in reversed(hashes):
            if h in self._index:
                self._index.move_to_end(h)
            elif self.disk is not None and h in self.disk:
                self.disk.touch(h)

    def _unspill(self, hashes: list[bytes]) -> None:
        """Spilled blocks read back into memory slots and pinned (a fetch's; its memory-resident
        blocks are pinned already, so making room never spills them)."""
        if not hashes:
            return
        assert self.disk is not None
        slots = self._take(len(hashes))
        if len(slots) < len(hashes):
            self._free.extend(sorted(slots, reverse=True))
            raise ValueError(f"no room in memory for {len(hashes)} spilled blocks (the rest are being read)")
        try:
            self.disk.take_many(hashes, [self.region.array[slot] for slot in slots])
        except OSError:  # what was read is lost with the rest (a cache): the slots go back
            self._free.extend(sorted(slots, reverse=True))
            raise
        for h, slot in zip(hashes, slots, strict=True):
            self._index[h] = slot
            self._pins[slot] += 1
        self.stats.num_unspilled += len(hashes)

    def _take(self, n: int) -> list[int]:
        """Up to `n` slots: free ones, then the least recently used blocks not being read."""
        taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(taken) < n:
            victims = []
            for h, slot in self._index.items():
                if len(taken) + len(victims) == n:
                    break
                if not self._pins[slot]:
                    victims.append(h)
            gone = []
            for h in victims:
                slot = self._index.pop(h)
                taken.append(slot)
                if self.disk is None:
                    gone.append(h)
                    continue
                dropped = self.disk.put(h, self.region.array[slot])  # lives on in the file
                self.stats.num_spilled += 1
                if dropped is not None:
                    gone.append(dropped)
            self.stats.num_evicted += len(gone)
            if gone:
                self._emit("removed", gone)
        return taken

    def _apply_events(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.receiver.poll(0.2)
            except Exception:  # noqa: BLE001  (closed under us)
                return
            with self._lock:
                settle(events, self)

    # -- kvfabric.EventOwner: the receiver's events, under the lock ----------------------------
    def arrived(self, ev: KVArrived) -> None:
        slots, hashes = self._landed(ev.request_id)
        for h, slot in zip(hashes, slots, strict=True):
            self._index[h] = slot
        self._touch(hashes)
        self._emit("stored", hashes)
        self.stats.num_stored += len(slots)
        self.stats.bytes_in += len(slots) * self.layout.block_bytes

    def failed(self, ev: TransferFailed) -> None:
        self._free.extend(sorted(self._landed(ev.request_id)[0], reverse=True))

    def quarantined(self, ev: TransferFailed) -> None:
        self._quarantine[ev.request_id] = self._landed(ev.request_id)[0]

    def fenced(self, request_id: str) -> None:
        self._free.extend(sorted(self._quarantine.pop(request_id, []), reverse=True))

    def _landed(self, request_id: str) -> tuple[list[int], list[bytes]]:
        """An offer's slots and hashes, no longer arriving."""
        slots, hashes = self._incoming.pop(request_id)
        self._arriving.difference_update(hashes)
        return slots, hashes


def _check_hashes(hashes: Sequence[bytes]) -> None:
    if len(hashes) > MAX_HASHES:
        raise ValueError(f"{len(hashes)} hashes in one call; at most {MAX_HASHES}")
    if any(not isinstance(h, bytes) or not 8 <= len(h) <= 64 for h in hashes):
        raise ValueError("a block hash is 8 to 64 bytes")
