"""The ends of KV tier tests: a worker's engine on its loop with a tier (`TierWorker`, in the
test process) and a KV store in a child process (`store_main`) that the test may kill."""
from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine, RequestOutput
from engine.core.request import SamplingParams
from engine.parallel.tp_ranks import TensorRanks
from kvfabric.pools import rank_allocator
from kvstore.tier import KVTier, start_tier
from tests.integration.reference import engine_config

SECRET = b"kv-tier-test-cluster-secret"


class TierWorker:
    """An engine on its own thread (EngineLoop) with a KV tier, as a worker runs them: the
    loop's hook hands each step's KV events to the tier, requests start after a fetch."""

    def __init__(self, model_dir: str, store_address: str, num_blocks: int = 40,
                 redis: tuple[str, str] | None = None, tp: int = 1, through_host: bool | None = None,
                 device: str = "cpu", kv_transport: str | None = None, kv_cache_dtype: str = "auto") -> None:
        """`redis`: (url, namespace) to find the host's store there as a worker configured
        with `kv_store="local"` does (`start_tier`), `store_address` unused; `tp`: the
        worker's tensor-parallel degree (its ranks children of this process: one split worker
        a process); `through_host`: the tier moves the pool's blocks through host rows of its
        own, as it does a GPU pool's (None: where the pool is on a GPU)."""
        config = engine_config(model_dir, num_blocks=num_blocks, budget=64, device=device,
                               kv_cache_dtype=kv_cache_dtype)
        config = replace(config, cache=replace(config.cache, cluster_secret=SECRET))  # the cluster's: hashes agree
        self.ranks = TensorRanks(tp, rank_allocator("cpu")) if tp > 1 else None
        # a private pool (each rank's in shared memory when split): fetched blocks land through the tier's staging
        self.engine = LLMEngine(self.ranks.start(config) if self.ranks else config)
        self._done: dict[str, threading.Event] = {}
        self._tokens: dict[str, list[int]] = {}
        self._cached: dict[str, int] = {}
        self.loop = EngineLoop(self.engine, self._on_outputs, self._hook, name="tier-test-engine")
        if redis is None:
            self.tier = KVTier(self.engine, self.loop.call, store_address, timeout_s=10, through_host=through_host,
                               kv_transport=kv_transport)
        else:
            tier = start_tier(self.engine, self.loop.call, "local", redis[0], redis[1], None, None, "127.0.0.1", None)
            assert tier is not None, "no store registered for this host"
            self.tier = tier
        self.loop.start()
        self._next = 0

    def _hook(self, wait_s: float) -> bool:
        self.tier.on_events(self.engine, self.engine.take_kv_events())
        return False

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._tokens[out.request_id] += out.new_token_ids
            self._cached[out.request_id] = max(self._cached[out.request_id], out.num_cached_tokens)
            if out.finished:
                self._done[out.request_id].set()

    async def generate(self, prompt: list[int], tenant: str = "", max_tokens: int = 6,
                       hint: Any = None) -> tuple[int, list[int], int]:
        """(blocks fetched from the store, greedy tokens, prompt tokens served from the pool's
        cache); `hint`: the router's StoreHint, where one routes the request."""
        self._next += 1
        rid = f"q{self._next}"
        self._done[rid], self._tokens[rid], self._cached[rid] = threading.Event(), [], 0
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        before = self.tier.counters.num_fetched_blocks
        await self.tier.admit(prompt, tenant, lambda e: e.add_request(prompt, params, rid, 0, tenant), hint)
        fetched = self.tier.counters.num_fetched_blocks - before
        assert await asyncio.to_thread(self._done[rid].wait, 60), f"{rid} did not finish"
        return fetched, self._tokens[rid], self._cached[rid]

    async def on_engine(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    async def settled(self, timeout_s: float = 20.0) -> None:
        """Waits until no offload or fetch holds a block (a fetch's held until its writer is
        fenced), then checks the pool's accounting: nothing in use, no reservation left."""
        deadline = time.monotonic() + timeout_s
        while True:
            usage = await self.on_engine(lambda e: e.check_invariants())
            if usage.num_in_use == 0 and not await self.on_engine(lambda e: self.tier.offloads.held) \
                    and self.tier.staging.num_free == self.tier.staging.capacity:
                break
            held = await self.on_engine(lambda e: {k: len(v) for k, v in e.kv._held.items()})
            assert time.monotonic() < deadline, f"still held: {usage} {held}"
            await asyncio.sleep(0.05)
        assert self.tier.receiver.num_reservations() == 0

    async def close(self) -> None:
        await self.tier.close()
        self.loop.stop()
        if self.ranks is not None:
            self.engine.release_followers()
            self.ranks.stop()


def cached_run(engine: LLMEngine, prompt: list[int], tenant: str = "") -> int:
    """Engine thread: the prompt's full blocks the pool's prefix cache holds, leading run."""
    return len(engine.block_pool.lookup_run(engine.hasher.hash_prompt(prompt, tenant)))


def store_main(pipe: Connection, model_dir: str, model_id: str, capacity_mib: int, copy_delay_s: float) -> None:
    """A KV store whose fetches copy after `copy_delay_s` (a test kills it meanwhile)."""
    from kvstore.service import open_store, serve, store_layout

    def slow_copy(dst: int, src: int, nbytes: int) -> None:
        time.sleep(copy_delay_s)
        ctypes.memmove(dst, src, nbytes)

    async def run() -> None:
        store = open_store(store_layout(model_dir, model_id, 4, "float32"), capacity_mib << 20, "127.0.0.1", None,
                           None, copy=slow_copy)
        _, port = await serve(store, "127.0.0.1", 0, None)
        pipe.send(("ok", port))
        await asyncio.Event().wait()

    asyncio.run(run())
