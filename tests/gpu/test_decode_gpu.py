"""Decode on a GPU: the Triton paged attention kernel against the reference, batched bfloat16
decode with the kernel against the torch forms, and seeded sampling on cuda."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_pool import KVLayout, KVPool
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from tests.integration.reference import random_prompts
from tests.unit.test_native_attention import reference


def engine(model_dir: str, dtype: str, native_kernels: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", dtype=dtype,  # type: ignore[arg-type]
                                  native_kernels=native_kernels, cache=CacheConfig(block_size=16, num_blocks=512),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (4, 2, 64, 16), (12, 4, 64, 32)])
def test_the_triton_kernel_matches_the_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                                  block_size: int) -> None:
    from engine import triton_attention

    kernels = triton_attention.load()
    if kernels is None:
        pytest.skip("Triton does not import here")
    pool = KVPool(KVLayout(3, block_size, kv_heads, head_dim, dtype), 64, "cuda")
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1)).to("cuda"))
    g = torch.Generator().manual_seed(heads)
    table = torch.randperm(64, generator=g)[:60].view(4, 15).contiguous().cuda()
    rows = torch.tensor([0, 1, 2, 2, 3]).cuda()
    ctx_lens = torch.tensor([1, 17, 200, 201, 15 * block_size]).cuda()
    q = torch.randn(5, heads, head_dim, generator=g).to(dtype).cuda()
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(q, pool.tensor, 1, table, torch.arange(5).cuda(), rows, ctx_lens, head_dim**-0.5, out)
    want = reference(q.cpu(), _cpu(pool), 1, table.cpu(), rows.cpu(), ctx_lens.cpu(), head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)


def _cpu(pool: KVPool) -> KVPool:
    copy = KVPool(pool.layout, pool.num_blocks, "cpu")
    copy.tensor.copy_(pool.tensor.cpu())
    return copy


def test_batched_bfloat16_decode_with_the_kernel_tracks_the_torch_forms(tiny_llama_dir: str) -> None:
    """32 requests decoding together: the kernel's logits stay within bfloat16's rounding of
    the torch forms', and greedy tokens agree for the first 4 (later near-ties may flip)."""
    prompts = random_prompts([5 + 9 * i for i in range(32)], 512, seed=7)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fast, plain = engine(tiny_llama_dir, "bfloat16"), engine(tiny_llama_dir, "bfloat16", native_kernels=False)
    assert fast.model.attention_kernels is not None and plain.model.attention_kernels is None
    a, b = fast.generate(prompts, params), plain.generate(prompts, params)
    agree = sum(x.token_ids[:4] == y.token_ids[:4] for x, y in zip(a, b, strict=True))
    assert agree >= 30, f"{agree} of 32 agree on the first 4 tokens"
    f32 = engine(tiny_llama_dir, "float32").generate(prompts, params)
    ref = engine(tiny_llama_dir, "float32", native_kernels=False).generate(prompts, params)
    assert [x.token_ids for x in f32] == [x.token_ids for x in ref]  # float32: the same tokens


def test_seeded_sampling_on_cuda_repeats_and_depends_on_the_seed(tiny_llama_dir: str) -> None:
    prompts = random_prompts([12, 40], 512, seed=3)
    e = engine(tiny_llama_dir, "bfloat16")
    run = lambda seed: [o.token_ids for o in e.generate(prompts, [SamplingParams(  # noqa: E731
        max_tokens=16, temperature=0.9, seed=seed + i, ignore_eos=True) for i in range(len(prompts))])]
    first = run(11)
    assert run(11) == first  # the same seeds, the same tokens
    alone = [o.token_ids for o in e.generate([prompts[1]], SamplingParams(max_tokens=16, temperature=0.9, seed=12,
                                                                           ignore_eos=True))]
    assert alone == [first[1]]  # whatever else is in the batch
    assert run(100) != first
