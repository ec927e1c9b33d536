"""A decode worker's start-up profile of its decode steps: how long a step takes at batch
sizes from 1 to the most it may run, at a short and a long context per request.

The online step model (engine/core/step_model.py) learns only the loads a worker has served, and
a router forecasting a burst asks about loads it has not: a line through small batches
overstates large ones, since a step's time is concave in its batch (the weights are read
once for all requests). So before it serves, a decode worker runs real engine steps over
the loads it may meet and reports them (heartbeat `step_profile`); routers read times off
the profile (`profile_seconds`) and learn only its scale from what they measure.

The steps are the engine's own (scheduler, model, sampler, outputs) over requests that
arrive as remote KV into a pool of their own bookkeeping, with prefix caching off: the KV
they read is whatever the blocks hold (the time does not depend on it), no prefill is
computed, and nothing of them is cached, published or counted once the profile is done.
"""
from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_model import Row

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

LONG_CONTEXT = 1024
"""Tokens per request at the long context (less where the pool or the model is smaller)."""
TIMED_STEPS = 8
"""Steps timed per point, after one untimed. The fastest counts: what else runs on the host
(a worker starting beside this one) only adds, and routers scale the profile by what they
measure, so it must give the shape of the step time, not its level."""


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... and the largest batch itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes + [max_num_seqs] if max_num_seqs > 1 else sizes


def profile_decode(engine: LLMEngine, budget_s: float, seed: int = 0) -> tuple[Row, ...]:
    """(requests, KV tokens, seconds) per point, in order of batch size; the larger batches
    are left out where the next point would run past `budget_s` or the pool cannot hold it."""
    from engine.core.forks import Forks  # torch: imported where an engine runs (this module's readers need none)
    from engine.model.overlap import Overlap

    bs = engine.config.cache.block_size
    num_blocks = engine.kv_pool.num_blocks
    steps = TIMED_STEPS + 1
    short = bs // 2
    real_overlap = engine.overlap
    saved = engine.block_pool, engine.kv, engine.scheduler, engine.speculator, engine.forks, real_overlap
    engine.block_pool = BlockPool(num_blocks, enable_caching=False)
    engine.kv = KVCacheManager(engine.block_pool, engine.hasher)
    engine.scheduler = Scheduler(engine.config.scheduler, engine.kv, engine.max_model_len, engine.clock)
    engine.speculator = None
    engine.forks = Forks(engine.scheduler, engine.kv, engine._copy_block, engine._start, shadows=False)
    # the scratch requests' overlapped steps (the GPU default) track them in the scratch books, not the real ones
    engine.overlap = Overlap(engine.runner, engine.sampler, engine.scheduler, engine.kv, real_overlap.enabled)
    engine.overlap.host_copy = real_overlap.host_copy
    rng = random.Random(seed)
    rows: list[Row] = []
    began, last_point_s = time.perf_counter(), 0.0
    try:
        for n in batch_sizes(engine.config.scheduler.max_num_seqs):
            blocks_each = num_blocks // n
            long = min(LONG_CONTEXT, engine.max_model_len - steps - 1, blocks_each * bs - steps - 1)
            contexts = [c for c in dict.fromkeys((short, long)) if c >= 1]
            if not contexts or short + steps + 1 > blocks_each * bs:
                break
            if time.perf_counter() - began + 2 * last_point_s > budget_s:
                break
            point_began = time.perf_counter()
            for ctx in contexts:
                rows.append(_point(engine, rng, n, ctx, steps))
            last_point_s = time.perf_counter() - point_began
    finally:
        engine.overlap.drain_if_idle()
        engine.block_pool, engine.kv, engine.scheduler, engine.speculator, engine.forks, engine.overlap = saved
        engine._reset_state()
    logger.info("decode steps profiled in %.2f s: %s", time.perf_counter() - began,
                ", ".join(f"{n:.0f}x{kv / n:.0f} {s * 1e3:.2f} ms" for n, kv, s in rows))
    return tuple(rows)


def _point(engine: LLMEngine, rng: random.Random, n: int, ctx: int, steps: int) -> Row:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    ids = []
    for _ in range(n):
        reservation = engine.connector.reserve([rng.randrange(vocab) for _ in range(ctx)], params)
        assert reservation is not None, "the profile sized its requests to the pool"
        engine.connector.landed(reservation.request_id, 0)
        ids.append(reservation.request_id)
    times = []
    for i in range(steps):  # step i reads ctx + 1 + i tokens per request
        started = time.perf_counter()
        engine.step()
        if i:
            times.append(time.perf_counter() - started)
    for rid in ids:
        engine.abort(rid)
    return float(n), float(n * (ctx + 1 + steps // 2)), min(times)
