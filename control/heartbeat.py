"""A worker's heartbeat: who it is, where to reach it, what model it serves, how loaded it is.

Workers write one every `heartbeat_interval_s` under a TTL key, so a missing key is a
gone worker; routers read them to learn membership (address, role, state), the model
facts they validate and hash with, and load. One typed definition (a msgspec Struct over
the engine's `EngineLoad`): msgpack on the wire, never pickle, decoded and type-checked in
one step; unknown fields are ignored, so a newer worker can talk to an older router.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from engine.core.kv_cache_manager import window_tokens
from engine.types import EngineLoad

Role = Literal["prefill", "decode"]
WorkerState = Literal["starting", "serving", "draining"]
"""A worker moves starting -> serving -> draining -> gone (its key expires or is deleted)."""


def hb_key(ns: str, worker_id: str) -> str:
    return f"{ns}:hb:{worker_id}"


def kv_key(ns: str, worker_id: str) -> str:
    return f"{ns}:kv:{worker_id}"


def router_key(ns: str, router_id: str) -> str:
    return f"{ns}:router:{router_id}"


def target_key(ns: str, role: str) -> str:
    """A pool's requested size (`splitserve scale`), taken by the controller."""
    return f"{ns}:target:{role}"


def store_key(ns: str, host_id: str) -> str:
    """A host's KV store's entry (kvstore/host.py): its address, store id and counters, as JSON."""
    return f"{ns}:kvstore:{host_id}"


class StoreEntry(msgspec.Struct, frozen=True):
    """Where a host's KV store is, as its registry entry says (kvstore/host.py writes the entry
    as JSON, with its counters beside these for `status`): read by routers and by the workers
    of its host, through `store_entry` alone."""

    address: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    store_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


_decode_store_entry = msgspec.json.Decoder(StoreEntry).decode


def store_entry(data: bytes | str) -> StoreEntry:
    """A store's registry entry read; ValueError saying what is wrong with it."""
    try:
        return _decode_store_entry(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"a KV store's entry is JSON with its address and store_id: {e}") from None


def controller_key(ns: str) -> str:
    """The controller's status: targets, workers' states, last actions and autoscaler decision."""
    return f"{ns}:controller"


FACT_LIMITS = {"block_size": 1 << 12, "vocab_size": 1 << 24, "max_model_len": 1 << 24, "num_total_blocks": 1 << 32,
               "kv_window": 1 << 24}
"""A model fact's largest believable value (heartbeats outside are skipped as malformed)."""


class ModelFacts(msgspec.Struct, frozen=True):
    """What a worker's engine owns and a router must agree with."""

    model_id: str = ""
    """Keys the block hashes (with the cluster secret): same id, same hashes."""
    block_size: int = 0
    """Tokens per KV block."""
    vocab_size: int = 0
    max_model_len: int = 0
    """Longest sequence (prompt + output) the engine serves."""
    num_total_blocks: int = 0
    """KV pool size in blocks."""
    kv_window: int = 0
    """The sliding window of a model whose every layer has one (ModelConfig.kv_window): a
    sequence holds only that window's blocks; 0: its whole context."""

    def __post_init__(self) -> None:
        """Sizes in range (0 only while unknown: a worker that serves reports them all; a block
        size of 0 or a negative pool would break every request's arithmetic)."""
        for name, high in FACT_LIMITS.items():
            value = getattr(self, name)
            if not 0 <= value <= high:
                raise ValueError(f"model fact {name}={value} is outside [0, {high}]")
        if len(self.model_id) > 256:
            raise ValueError("model fact model_id is longer than 256 characters")

    @property
    def complete(self) -> bool:
        """Every size known (what a serving worker must report)."""
        return all(getattr(self, name) > 0 for name in FACT_LIMITS if name != "kv_window")

    @property
    def max_held_tokens(self) -> int | None:
        """The most KV tokens one sequence holds, however long (None: no window, its length)."""
        return window_tokens(self.block_size, self.kv_window) if self.kv_window else None


class TierSpeed(msgspec.Struct, frozen=True):
    """What a worker with a KV tier measured of fetching blocks against computing them: routers
    price a store's hit with it (`fetch_share`). Unmeasured: 0 or empty."""

    token_s: float = 0.0
    """Seconds its engine takes per prompt token it computes (engine/core/step_model.py PrefillCost)."""
    fetch: list[float] = msgspec.field(default_factory=list)
    """[a, b]: a fetch of n blocks from its host's store took a + b·n seconds (kvstore/tier_meters.py)."""
    far_fetch: list[float] = msgspec.field(default_factory=list)
    """The same from other hosts' stores (over tcp)."""

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) and x >= 0 for x in (self.token_s, *self.fetch, *self.far_fetch)):
            raise ValueError("heartbeat field tier_speed holds a negative or infinite time")
        if len(self.fetch) not in (0, 2) or len(self.far_fetch) not in (0, 2):
            raise ValueError("heartbeat field tier_speed's fetch lines are not [a, b] seconds")


FETCH_PROBE_S = 10.0
"""A worker priced out of fetching (its measured fetch no faster than computing) is still let
fetch once this often (routers tell it to, and its tier lets it): its measurement then follows
a store, or a load, that changed, and one slow first fetch (a new connection) cannot price it
out for good."""


def fetch_share(fetch_s: float, compute_s: float, prior: float) -> float:
    """What fetching a store's blocks costs as a share of computing their tokens, from the two
    times (seconds); `prior` where either is unknown (<= 0). At most 1: a fetch slower than
    computing saves nothing."""
    if fetch_s <= 0 or compute_s <= 0:
        return prior
    return min(fetch_s / compute_s, 1.0)


def hit_share(num_blocks: int, fetch_line: Sequence[float], token_s: float, block_size: int, prior: float) -> float:
    """`fetch_share` of a store's hit of `num_blocks` for one worker: its measured fetch line (a +
    b·blocks seconds; empty: none yet) against its seconds per computed token (0: not measured).
    Routers price hits by it (router/policy.py `store_hit`), and a worker's tier its hinted
    fetches, with its newest measurements (kvstore/tier_meters.py `FetchGate`)."""
    fetch_s = fetch_line[0] + fetch_line[1] * num_blocks if len(fetch_line) == 2 and num_blocks else 0.0
    return fetch_share(fetch_s, num_blocks * block_size * token_s, prior)


class Probes:
    """Per key (a worker, a store), when a fetch priced out is let through again: once every
    `FETCH_PROBE_S` (`due`)."""

    def __init__(self) -> None:
        self._at: dict[object, float] = {}

    def due(self, key: object, now: float) -> bool:
        if now < self._at.get(key, 0.0):
            return False
        self._at = {k: t for k, t in self._at.items() if t > now}  # only the pending ones kept
        self._at[key] = now + FETCH_PROBE_S
        return True


def _idle() -> EngineLoad:
    return EngineLoad(0, 0, 0, 0, 0, 0, 0, 0)


class Heartbeat(msgspec.Struct, frozen=True):
    worker_id: str
    role: Role
    address: str = ""
    """host:port of the worker's gRPC service (PrefillWorker or DecodeWorker)."""
    state: WorkerState = "serving"
    incarnation: str = ""
    """Random per process start: a restarted worker with the same id is a new one."""
    facts: ModelFacts = msgspec.field(default_factory=ModelFacts)
    load: EngineLoad = msgspec.field(default_factory=_idle)
    """What its engine holds now (`LLMEngine.load()`)."""
    metrics_address: str = ""
    """host:port of the worker's Prometheus `/metrics` (HTTP); empty when it serves none."""
    sent_at: float = 0.0
    """Wall-clock time of the report (s since the epoch)."""
    step_model: list[float] = msgspec.field(default_factory=list)
    """A decode worker's decode step time, [a, b, c]: a + b·requests + c·KV tokens seconds
    (engine/core/step_model.py); routers forecast admission waits with it. Empty until measured."""
    step_profile: list[float] = msgspec.field(default_factory=list)
    """A decode worker's start-up profile of its decode steps (engine/step_profile.py), flat
    (requests, KV tokens, seconds) triples; routers prefer it to `step_model`. Empty: none run."""
    kv_store: str = ""
    """The id of the KV store this worker fetches from (its host's, kvstore/host.py), whose
    event stream routers index; empty: none."""
    tier_speed: TierSpeed = msgspec.field(default_factory=TierSpeed)

    def __post_init__(self) -> None:
        """What the types cannot say (msgspec checks the types as it decodes)."""
        if any(v < 0 for v in dataclasses.astuple(self.load) if isinstance(v, int)) or \
                any(v < 0 for v in self.load.spec_accepted_per_pos):
            raise ValueError("heartbeat field load holds a negative count")
        if not all(math.isfinite(x) for x in (*self.step_model, *self.step_profile, self.sent_at)):
            raise ValueError("heartbeat holds a number that is not finite")
        if len(self.kv_store) > 64:
            raise ValueError("heartbeat field kv_store is longer than 64 characters")
        if len(self.step_model) not in (0, 3):
            raise ValueError("heartbeat field step_model is not [a, b, c] seconds")
        p = self.step_profile
        if len(p) % 3 or any(x < 0 for x in p) or any(p[i] < 1 for i in range(0, len(p), 3)):
            raise ValueError("heartbeat field step_profile is not (requests >= 1, KV tokens, seconds) triples")

    def to_wire(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_wire(cls, data: object) -> Heartbeat:
        """Raises BadEntry for anything but a heartbeat map with fields of the right types."""
        if not isinstance(data, bytes):
            raise BadEntry(f"a heartbeat is msgpack bytes, not {type(data).__name__}")
        try:
            return _DECODER.decode(data)
        except msgspec.DecodeError as e:  # ValidationError too: a wrong type, a missing field, __post_init__
            raise BadEntry(f"heartbeat: {e}") from None


class BadEntry(ValueError):
    """A registry entry (heartbeat or KV event) not in the format: it is skipped, never fatal."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Heartbeat)
