"""Builders for bookkeeping tests: a scheduler over a block pool, no model; heartbeats."""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any

from control.heartbeat import Heartbeat, ModelFacts
from engine.core.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.core.hashing import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.types import EngineLoad, RequestId

SECRET = b"test-secret"


def make_scheduler(
    clock, num_blocks: int = 16, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
    chunked: bool = True, caching: bool = True, max_model_len: int = 1024, aging_s: float = 10.0,
    burst: int = 8192, window: int = 0,
) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=caching)
    kv = KVCacheManager(pool, BlockHasher(SECRET, "m", block_size), window)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          enable_chunked_prefill=chunked, aging_interval_s=aging_s, fair_burst_tokens=burst)
    return Scheduler(cfg, kv, max_model_len, clock)


def make_request(rid: str, prompt: list[int] | int, clock, max_tokens: int = 8,
                 priority: int = 0, tenant: str = "", weight: float = 1.0) -> Request:
    """An int prompt is that many tokens, distinct per request id (no accidental prefix hits)."""
    base = 1000 * (zlib.crc32(rid.encode()) % 1000)
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=clock(), priority=priority, tenant=tenant, tenant_weight=weight)


def fake_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, pretend the model ran, and sample `token` for every finished prefill."""
    out = s.schedule()
    sampled = {
        x.request.request_id: (token, None)
        for x in out.scheduled
        if x.request.num_computed_tokens + x.num_new_tokens == x.request.num_tokens
    }
    s.update_after_step(out, sampled)
    s.check_invariants()
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def heartbeat(worker_id: str, role: str, **fields: Any) -> Heartbeat:
    """A heartbeat from flat fields, as tests write them: the model facts and the engine load
    fields go where the message holds them (num_total_blocks to both)."""
    load_names = {f.name for f in dataclasses.fields(EngineLoad)}
    facts = {k: fields.pop(k) for k in list(fields) if k in ModelFacts.__struct_fields__ and k != "num_total_blocks"}
    load = {k: fields.pop(k) for k in list(fields) if k in load_names}
    total = load.get("num_total_blocks", 0)
    load = {**dict.fromkeys(load_names - {"spec_accepted_per_pos"}, 0), **load}
    return Heartbeat(worker_id, role, facts=ModelFacts(**facts, num_total_blocks=total),  # type: ignore[arg-type]
                     load=EngineLoad(**load), **fields)
