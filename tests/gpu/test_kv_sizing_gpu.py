"""KV sizing against the GPU's real free memory: an engine started at the default share (0.9)
beside memory another worker already holds takes what is free less a step's transient, and
serves (a pool sized from the share alone would ask for memory that is not there)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams


def test_a_worker_beside_another_sizes_its_pool_from_what_is_free(tiny_llama_dir: str) -> None:
    free, total = torch.cuda.mem_get_info()
    other = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")  # another worker's pool
    free_beside = torch.cuda.mem_get_info()[0]
    engine = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, device="cuda", dtype="bfloat16"))
    pool = engine.kv_pool.num_blocks * engine.layout.block_bytes
    assert engine.config.cache.gpu_memory_utilization == 0.9 and 0.3 * free_beside < pool < free_beside
    left = torch.cuda.mem_get_info()[0]
    assert left > 0
    out = engine.generate([[5 + i for i in range(300)]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out)
    assert engine.check_invariants().num_in_use == 0
    del engine, other
    torch.cuda.empty_cache()
