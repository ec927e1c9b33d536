"""Tensor parallelism on CPU (gloo): a model split across 2 and 4 processes gives the greedy
tokens of the whole model in one process, and log-probabilities within 1e-4 (the sums of the
row-parallel projections run in another order). Each rank is a process of its own over its
share of the weights and a KV pool of its KV heads: rank 0's engine schedules and samples,
the others follow its steps (engine/parallel/tp_followers.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from tests.integration.fabric_peer import child_context
from tests.integration.reference import random_prompts

pytestmark = pytest.mark.timeout(600)

TOLERANCE = 1e-4
"""On a token's log-probability: the same sums in another order (float32)."""


def _rank(rank: int, world: int, rendezvous: str, model_dir: str, prompts: list[list[int]], out: str) -> None:
    """Rank 0 runs the engine (it alone has the requests); the others follow its steps."""
    import torch
    import torch.distributed as dist

    from engine.parallel.tensor_parallel import TensorParallel
    from engine.parallel.tp_followers import follow

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        config = replace(make_engine_config(model_dir), tensor_parallel=TensorParallel(rank, world))
        if rank:
            Path(out).write_text(json.dumps({"steps": follow(config)}))
            return
        engine = LLMEngine(config)
        got = engine.generate(prompts, PARAMS)
        forks = engine.generate([prompts[0]], FORKS)  # n choices: the prompt's last block copied on every rank
        engine.release_followers()
        Path(out).write_text(json.dumps({
            "tokens": [c.token_ids for c in got], "logprobs": [c.logprobs for c in got],
            "forks": [c.token_ids for c in forks], "kv_heads": engine.layout.num_kv_heads,
            "in_use": engine.check_invariants().num_in_use}))
    finally:
        dist.destroy_process_group()


PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
FORKS = SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=0.8, seed=11)


def make_engine_config(model_dir: str) -> EngineConfig:
    """Blocks of 4 tokens, a step budget of 16: the prompts prefill in chunks."""
    return EngineConfig(model_dir=model_dir, cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16))


def run_ranks(world: int, model_dir: str, prompts: list[list[int]], tmp_path: Path) -> list[dict]:
    rendezvous = tmp_path / f"rendezvous-{world}"  # a file, not a port picked, closed and hoped free
    ctx = child_context()  # forks of a server that has imported torch and the engine
    outs = [str(tmp_path / f"rank{r}-of-{world}.json") for r in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, str(rendezvous), model_dir, prompts, outs[r]))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, f"a rank ended with {p.exitcode}"
    return [json.loads(Path(o).read_text()) for o in outs]


@pytest.mark.parametrize("arch,world", [("llama", 2), ("llama", 4), ("qwen2", 2), ("gemma3", 2), ("phi3", 2),
                                        ("qwen2_moe", 2), ("mixtral", 2)])
def test_a_split_model_gives_the_whole_models_tokens(arch: str, world: int, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    """llama: KV heads split (2 ranks) and replicated (4 ranks, 2 KV heads); qwen2: q/k/v
    biases; gemma3: one KV head, sandwich norms, GeGLU, soft-capped logits; phi3: fused q/k/v
    and gate/up tensors; qwen2_moe: experts and a gated shared expert split, a dense layer;
    mixtral: its w1/w3/w2 experts."""
    if arch in ("llama", "qwen2"):
        model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    else:
        from engine.model.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(tmp_path / arch, arch=arch, seed=0))
    whole = LLMEngine(make_engine_config(model_dir))
    prompts = random_prompts([5, 23, 40], whole.model_config.vocab_size, seed=3)
    want = whole.generate(prompts, PARAMS)
    forks = whole.generate([prompts[0]], FORKS)
    leader, *followers = run_ranks(world, model_dir, prompts, tmp_path)
    assert leader["tokens"] == [c.token_ids for c in want]
    for got, ref in zip(leader["logprobs"], [c.logprobs for c in want], strict=True):
        assert got == pytest.approx(ref, abs=TOLERANCE)
    assert leader["forks"] == [c.token_ids for c in forks] and len(forks) == 3
    assert leader["kv_heads"] == max(whole.model_config.num_kv_heads // world, 1) and leader["in_use"] == 0
    assert all(f["steps"] > 10 for f in followers)  # every step followed
