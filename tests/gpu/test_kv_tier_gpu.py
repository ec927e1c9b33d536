"""The shared KV tier with GPU workers' pools: blocks go out to the host's store through pinned
host rows (a copy stream of their own) and come back from staging into the device pool
(kvstore/pinned_rows.py). A prefix evicted from a pool comes back from the store with the tokens
the worker computed for it, on the worker that offloaded it and on another GPU worker, and
nothing stays held. The CPU suite runs the same copies on host tensors
(tests/integration/test_kv_tier.py, through_host)."""
from __future__ import annotations

import asyncio

import pytest

from tests.integration.reference import random_prompts
from tests.integration.test_kv_tier import cached_run, served_store, wait_for

pytestmark = pytest.mark.timeout(120)


def test_a_gpu_pools_evicted_prefix_comes_back_from_the_store(tiny_llama_dir: str) -> None:
    prompt, *others = random_prompts([41, 38, 38, 38, 38], 512, seed=3)

    async def run() -> None:
        async with served_store(tiny_llama_dir, 4096, 2, device="cuda") as (store, (a, b)):
            assert a.tier.host is not None and a.tier.host.stream is not None  # the device path, pinned rows
            assert a.tier.host.rows.is_pinned()
            fetched, want, cached = await a.generate(prompt)
            assert (fetched, cached) == (0, 0)
            hashes = a.engine.hasher.hash_prompt(prompt)[:10]
            await wait_for(lambda: asyncio.sleep(0, store.lookup(hashes) == 10))
            for other in others:  # 40 blocks of pool: these evict the prompt's blocks
                await a.generate(other)
            assert await a.on_engine(lambda e: cached_run(e, prompt)) == 0
            assert await a.generate(prompt) == (10, want, 40)  # back from the store: the tokens it computed
            assert await b.generate(prompt) == (10, want, 40)  # another GPU worker's pool
            for w in (a, b):
                await w.settled()
                assert w.tier.counters.num_fetch_failures == 0 and w.tier.counters.num_offload_failures == 0
            store.check()

    asyncio.run(run())
