"""FP8 weights on a GPU (for the next GPU machine): an FP8 projection runs `torch._scaled_mm`
on e4m3 tensor cores and gives the float64 reference of its formula, (x_q @ w_q.T) * x_scale
* w_scale, within bfloat16's rounding; an engine with `quantization="fp8"` captures its
decode steps into CUDA graphs and they give the eager steps' tokens and log-probabilities,
and tokens the CPU's upcast reference of the same FP8 checkpoint mostly agrees with; a
mixture's FP8 experts run the grouped GEMM on e4m3 and give the torch form."""
from __future__ import annotations

import pytest
import torch

from engine.model.fp8 import E4M3, Fp8Weight, quantize_weight
from engine.model.linear import Linear
from engine.core.request import SamplingParams
from tests.integration.reference import random_prompts
from tests.unit.test_fp8 import reference


@pytest.mark.parametrize("inputs", ["dynamic", "static"])
@pytest.mark.parametrize("rows", [1, 7, 128])
def test_an_fp8_projection_runs_scaled_mm_and_computes_its_formula(inputs: str, rows: int) -> None:
    g = torch.Generator().manual_seed(3)
    out, inp = 256, 512
    q = quantize_weight(torch.randn(out, inp, generator=g) * 0.05)
    q.input_scale = 0.02 if inputs == "static" else None
    bias = torch.randn(out, generator=g).to(torch.bfloat16)
    x = (torch.randn(rows, inp, generator=g) * 2).to(torch.bfloat16)
    lin = Linear(q.values.to(torch.bfloat16).cuda(), bias.cuda(), True, None, False,
                 Fp8Weight(q.values.cuda(), q.scale.cuda(), q.input_scale), inputs)
    assert lin.w8 is not None and lin.w8.dtype == E4M3 and lin.nbytes == out * inp + out * 2  # one byte a weight
    got = lin(x.cuda()).double().cpu()
    torch.testing.assert_close(got, reference(x, q, inputs, bias, False), rtol=2.0**-6, atol=2.0**-6)


def test_an_fp8_engine_captures_its_decode_steps_and_the_graphs_give_the_eager_tokens(tiny_llama_dir: str) -> None:
    import dataclasses

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    config = EngineConfig(model_dir=tiny_llama_dir, device="cuda", dtype="bfloat16", quantization="fp8",
                          cache=CacheConfig(block_size=16, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    graphs = LLMEngine(config)
    assert graphs.runner.decode is not None and graphs.runner.decode.graphs  # captured at start, FP8 inside
    assert graphs.model.layers[0].qkv.w8 is not None
    eager = LLMEngine(dataclasses.replace(config, decode_graphs=False))
    prompts = random_prompts([5, 17, 33, 40], 512, seed=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True)
    a, b = graphs.generate(prompts, params), eager.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) < 1e-3
    cpu = LLMEngine(dataclasses.replace(config, device="cpu", decode_graphs=True)).generate(prompts, params)
    first = [c.token_ids[0] for c in cpu]  # the upcast reference's first tokens (later ones may part at near-ties)
    assert sum(f == c.token_ids[0] for f, c in zip(first, a)) >= 3


def test_fp8_kv_on_the_gpu_graphs_gives_the_eager_tokens_and_the_cpus_log_probabilities(tiny_llama_dir: str) -> None:
    """An e4m3 pool on the GPU: K and V stored through the torch form, decode read by the
    Triton kernel inside the CUDA graphs; the same tokens eagerly, and log-probabilities
    within float32's noise of the CPU's torch forms over the same FP8 pool."""
    import dataclasses

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    config = EngineConfig(model_dir=tiny_llama_dir, device="cuda", dtype="float32",
                          cache=CacheConfig(block_size=16, num_blocks=256, kv_cache_dtype="fp8"),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    graphs = LLMEngine(config)
    assert graphs.kv_pool.tensor.dtype == torch.float8_e4m3fn and graphs.runner.decode.graphs
    prompts = random_prompts([5, 17, 33, 40], 512, seed=5)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True)
    a = graphs.generate(prompts, params)
    b = LLMEngine(dataclasses.replace(config, decode_graphs=False)).generate(prompts, params)
    cpu = LLMEngine(dataclasses.replace(config, device="cpu")).generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] == [c.token_ids for c in cpu]
    assert max(abs(x - y) for p, q in zip(a, cpu) for x, y in zip(p.logprobs, q.logprobs)) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", ["dynamic", "static", "weights_only"])
def test_fp8_experts_run_the_grouped_gemm_on_e4m3_and_give_the_torch_form(inputs: str, dtype: torch.dtype) -> None:
    """A mixture's FP8 experts stored as e4m3 on the GPU: the grouped GEMM (e4m3 x e4m3 on the
    tensor cores) against the torch form over the same values. They part where an input
    requantized to e4m3 rounds the other way after a last-bit difference upstream (a step of
    1/16), so the check is on the mean and the largest difference, not element by element."""
    from engine.kernels import triton_moe
    from engine.model import moe
    from engine.model.model_config import MoEConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    num, hidden, inter, tokens = 8, 512, 256, 48
    gate_up, down, parts = moe._quantized_stacked(torch.randn(num, 2 * inter, hidden, generator=g) * hidden**-0.5,
                                                 torch.randn(num, hidden, inter, generator=g) * inter**-0.5)
    q = moe.Fp8Experts(gate_up=torch.stack([torch.cat([a.scale, b.scale]) for a, b, _ in parts]).cuda(),
                       down=torch.stack([d.scale for _, _, d in parts]).cuda(), inputs=inputs)
    if inputs == "static":
        q.gate_up_input = torch.full((num,), 0.01, device="cuda")
        q.down_input = torch.full((num,), 0.001, device="cuda")
    w = moe.MoEWeights(router=(torch.randn(num, hidden, generator=g) * 0.1).to(dtype).cuda(),
                       gate_up=gate_up.cuda().to(torch.float8_e4m3fn), down=down.cuda().to(torch.float8_e4m3fn), fp8=q)
    config = MoEConfig(num, 2, inter, True, (0,), 0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).cuda()
    got, want = triton_moe.moe_forward(x, w, config).float(), moe.moe_forward(x, w, config).float()
    diff, size = (got - want).abs(), want.abs()
    mean_bound, max_bound = (1e-3, 0.02) if dtype == torch.float32 else (0.05, 0.1)
    assert (diff.mean() / size.mean()).item() < mean_bound and (diff.max() / size.max()).item() < max_bound
