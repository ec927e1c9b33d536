"""A worker's heartbeat: who it is, where to reach it, what model it serves, how loaded it is.

Workers write one every `heartbeat_interval_s` under a TTL key, so a missing key is a
gone worker; routers read them to learn membership (address, role, state), the model
facts they validate and hash with, and load. msgpack on the wire, never pickle; unknown
fields are ignored, so a newer worker can talk to an older router.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import msgpack

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


def controller_key(ns: str) -> str:
    """The controller's status: targets, workers' states, last actions and autoscaler decision."""
    return f"{ns}:controller"


@dataclass(frozen=True)
class ModelFacts:
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


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    role: Role
    address: str = ""
    """host:port of the worker's gRPC service (PrefillWorker or DecodeWorker)."""
    state: WorkerState = "serving"
    incarnation: str = ""
    """Random per process start: a restarted worker with the same id is a new one."""
    model_id: str = ""
    block_size: int = 0
    vocab_size: int = 0
    max_model_len: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    """Evictable: free for new requests, still a prefix-cache hit until reused."""
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_prompt_tokens: int = 0
    """Cumulative prompt tokens seen, and how many of them were prefix-cache hits."""
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    """Speculative decoding, cumulative (`EngineLoad`): verifications, proposed and accepted
    tokens, accepted per proposal position."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    metrics_address: str = ""
    """host:port of the worker's Prometheus `/metrics` (HTTP); empty when it serves none."""
    sent_at: float = 0.0
    """Wall-clock time of the report (s since the epoch)."""
    step_model: list[float] = field(default_factory=list)
    """A decode worker's decode step time, [a, b, c]: a + b·requests + c·KV tokens seconds
    (engine/step_model.py); routers forecast admission waits with it. Empty until measured."""
    step_profile: list[float] = field(default_factory=list)
    """A decode worker's start-up profile of its decode steps (engine/step_profile.py), flat
    (requests, KV tokens, seconds) triples; routers prefer it to `step_model`. Empty: none run."""

    @property
    def facts(self) -> ModelFacts:
        return ModelFacts(self.model_id, self.block_size, self.vocab_size, self.max_model_len, self.num_total_blocks)

    def to_wire(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def from_wire(cls, data: object) -> Heartbeat:
        """Raises BadEntry for anything but a heartbeat map with fields of the right types."""
        try:
            d = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else None
        except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
            raise BadEntry(f"undecodable heartbeat: {e}") from None
        if not isinstance(d, dict):
            raise BadEntry("a heartbeat is a msgpack map")
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for name, v in values.items():
            if not isinstance(v, _FIELD_TYPES[name]) or isinstance(v, bool):
                raise BadEntry(f"heartbeat field {name} has a {type(v).__name__}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in values.get("spec_accepted_per_pos", [])):
            raise BadEntry("heartbeat field spec_accepted_per_pos is not a list of counts")
        model = values.get("step_model", [])
        if len(model) not in (0, 3) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in model):
            raise BadEntry("heartbeat field step_model is not [a, b, c] seconds")
        profile = values.get("step_profile", [])
        if len(profile) % 3 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                                       for x in profile) or any(profile[i] < 1 for i in range(0, len(profile), 3)):
            raise BadEntry("heartbeat field step_profile is not (requests >= 1, KV tokens, seconds) triples")
        if "worker_id" not in values or values.get("role") not in ("prefill", "decode") or \
                values.get("state", "serving") not in ("starting", "serving", "draining"):
            raise BadEntry(f"heartbeat of {values.get('worker_id')!r:.40} lacks a worker id, a role or a known state")
        return cls(**values)


class BadEntry(ValueError):
    """A registry entry (heartbeat or KV event) not in the format: it is skipped, never fatal."""


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: {"int": int, "float": (int, float), "list[float]": list, "list[int]": list}.get(str(f.type), str) for f in fields(Heartbeat)}
