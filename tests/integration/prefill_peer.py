"""A prefill engine with a kvfabric pusher, in a child process driven over a Pipe (split
across `world` processes, this one and its child ranks, when `world` > 1)."""
from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.parallel.tp_ranks import TensorRanks
from kvfabric import SenderConfig, Ticket
from kvfabric.nixl_ranks import RankPool
from kvfabric.pools import rank_allocator
from prefill_worker.kv_push import KVPusher
from tests.integration.reference import engine_config


def prefill_main(pipe: Connection, model_dir: str, transport: str, budget: int, device: str = "cpu",
                 num_blocks: int = 512, world: int = 1, kv_cache_dtype: str = "auto",
                 rank_pools: str = "mapped") -> None:
    """`rank_pools`: "own agents": each further rank's pool private, held and written from by a
    NIXL agent of its own (`kvfabric.nixl_ranks.RankPool`), as a GPU rank's is."""
    torch.set_num_threads(1)
    if device.startswith("cuda"):  # the GPU tests compare bytes: no TF32 in either engine
        torch.backends.cuda.matmul.allow_tf32 = False
    config = engine_config(model_dir, role="prefill", budget=budget, device=device, num_blocks=num_blocks,
                           kv_cache_dtype=kv_cache_dtype)
    ranks = TensorRanks(world, RankPool if rank_pools == "own agents" else rank_allocator(device)) \
        if world > 1 else None
    if ranks is not None:
        config = ranks.start(config)
    engine = LLMEngine(config)
    pusher = KVPusher(engine, SenderConfig(transport=transport, checksum=True))
    engine.handoff = pusher
    pipe.send(("ok", "ready"))
    while True:
        cmd, *args = pipe.recv()
        if cmd == "exit":
            pusher.close()
            if ranks is not None:
                engine.release_followers()
                ranks.stop()
            pipe.send(("ok", None))
            return
        pipe.send(("ok", attach(pusher, args[0]) if cmd == "attach" else prefill(engine, pusher, args[0], device)))


def attach(pusher: KVPusher, wires: list) -> dict[str, str | None]:
    """"attach": [ticket wire] -> {request id: error or None}, once each transfer opened or failed."""
    handoffs = [pusher.attach(Ticket.from_wire(w)) for w in wires]
    deadline = time.monotonic() + 10
    failed: dict[str, str | None] = {}
    while any(h.transfer is None and h.request_id not in failed for h in handoffs):
        assert time.monotonic() < deadline, "a transfer neither opened nor failed in 10 s"
        time.sleep(0.001)
        for d in pusher.take_done():
            pusher.settle(d)
            failed[d.request_id] = d.error
    return {h.request_id: failed.get(h.request_id) for h in handoffs}


def prefill(engine: LLMEngine, pusher: KVPusher, requests: list, device: str) -> dict:
    """"prefill": [(prompt token ids, request id, max_tokens[, more SamplingParams fields])] -> the
    first tokens, the pushes (with the pushed blocks' bytes as the pool holds them), errors."""
    for prompt, rid, max_tokens, *more in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(more[0] if more else {})),
                           rid)
    firsts, done, pool_bytes, pushed = {}, [], {}, {}
    while engine.has_unfinished() or pusher.num_open:
        if engine.has_schedulable():
            firsts |= {o.request_id: o.new_token_ids[0] for o in engine.step()}
        else:
            time.sleep(0.001)  # the push lanes finish the hand-offs
        for d in pusher.take_done():
            if d.error is None:
                blocks = engine.kv.held(d.request_id)  # the pushed blocks as the pool holds them, the GPU done
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                pool_bytes[d.request_id] = engine.kv_pool.tensor[blocks].cpu().view(torch.uint8).numpy().tobytes()
            pusher.settle(d)
            pushed[d.request_id] = d.num_blocks
            done.append((d.request_id, firsts.get(d.request_id) if d.error is None else None, d.error, d.num_pushes))
    in_use = engine.check_invariants().num_in_use - (engine.kv.null_block is not None)  # a window's null block
    return {"done": done, "in_use": in_use, "pool_bytes": pool_bytes, "pushed_blocks": pushed,
            "rank_posts": pusher.sender.rank_posts}
