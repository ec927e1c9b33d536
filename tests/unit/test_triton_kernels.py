"""The Triton kernels (engine/kernels/triton_attention.py, engine/kernels/triton_pointwise.py) against their
torch forms, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, in a process of its
own: the interpreter is chosen when a kernel is built). Skips where Triton is not installed;
on a GPU, tests/gpu runs them for real."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


ATTENTION = r"""
import torch
from engine.kernels import triton_attention
from engine.model.kv_pool import KVLayout, KVPool
from tests.unit.test_native_attention import reference

# bfloat16 is left to tests/gpu: the interpreter's bfloat16 dot reads garbage (NumPy has no bfloat16)
SHAPES = ((4, 2, 8, 4), (8, 1, 32, 16), (6, 2, 64, 16), (10, 2, 24, 12), (8, 2, 128, 16))
# every shape in float32; float16 (its rounding, not other indexing) on two (each call is seconds interpreted)
for dtype, tol, shapes in ((torch.float32, 1e-5, SHAPES), (torch.float16, 2e-3, SHAPES[1::3])):
    for heads, kv_heads, head_dim, block_size in shapes:
        per_row = 200 // block_size + 1
        pool = KVPool(KVLayout(3, block_size, kv_heads, head_dim, dtype), 3 * per_row + 5, "cpu")
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1)))
        g = torch.Generator().manual_seed(heads + head_dim)
        table = torch.randperm(3 * per_row + 5, generator=g)[: 3 * per_row].view(3, per_row).contiguous()
        rows = torch.tensor([0, 1, 1, 1, 2, 2])  # request 1: a 3-token query
        ctx_lens = torch.tensor([1, 18, 19, 33, 64, 200])  # one key; across block and tile edges; several tiles
        qkv = torch.randn(7, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
        q = qkv[:, :heads]  # tokens strided, as the fused qkv leaves them; token 4 is another group's
        tokens = torch.tensor([0, 1, 2, 3, 5, 6])
        want = reference(q[tokens], pool, 2, table, rows, ctx_lens, 0.3)
        for splits in (1, 3, 8)[: 3 if dtype == torch.float32 else 2]:  # one program per (token, KV head); splits
            # of several tiles; of one tile or none (float32)
            out = torch.full((7, heads, head_dim), float("nan"), dtype=dtype)
            triton_attention.paged_decode(q, pool.tensor, 2, table, tokens, rows, ctx_lens, 0.3, out, splits)
            torch.testing.assert_close(out[tokens].float(), want, atol=tol, rtol=tol)
            assert out[4].isnan().all()  # a token not in token_index is not written
        # a CUDA graph bucket's padded row: no keys, zeros out, nothing else touched; with one
        # split the first kernel writes the output itself
        for splits in (1, 4):
            out = torch.full((7, heads, head_dim), float("nan"), dtype=dtype)
            triton_attention.paged_decode(q, pool.tensor, 2, table, torch.tensor([6, 4]), torch.tensor([2, 0]),
                                          torch.tensor([200, 0]), 0.3, out, splits)
            assert (out[4] == 0).all() and out[:4].isnan().all()
            torch.testing.assert_close(out[6].float(), want[5], atol=tol, rtol=tol)
# a sliding window: the last `window` keys only, the table's slid-past entries never read (-1 here)
pool = KVPool(KVLayout(2, 16, 2, 32, torch.float32), 80, "cpu")
pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(5)))
g = torch.Generator().manual_seed(6)
ctx_lens = torch.tensor([1, 17, 40, 300])
table = torch.randperm(80, generator=g).repeat(2)[: 4 * 19].view(4, 19).contiguous()
q = torch.randn(4, 4, 32, generator=g)
for window in (1, 16, 50):
    windowed = table.clone()
    for i, ctx in enumerate(ctx_lens.tolist()):
        windowed[i, : max(ctx - window, 0) // 16] = -1
    want = reference(q, pool, 1, windowed, range(4), ctx_lens, 0.3, window)
    for splits in (1, 3):
        out = torch.full((4, 4, 32), float("nan"))
        triton_attention.paged_decode(q, pool.tensor, 1, windowed, torch.arange(4), torch.arange(4), ctx_lens, 0.3,
                                      out, splits, window)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    capped = reference(q * 4, pool, 1, windowed, range(4), ctx_lens, 0.3, window, 2.0)  # Gemma 2's soft cap
    out = torch.full((4, 4, 32), float("nan"))
    triton_attention.paged_decode(q * 4, pool.tensor, 1, windowed, torch.arange(4), torch.arange(4), ctx_lens, 0.3,
                                  out, 3, window, 2.0)
    torch.testing.assert_close(out, capped, atol=1e-5, rtol=1e-5)
# an FP8 pool: e4m3 K / k_scale and V / v_scale, widened in the kernel; the reference reads the
# same values multiplied back, in float32
fp8 = KVPool(KVLayout(3, 16, 2, 32, torch.float8_e4m3fn), 40, "cpu", scales=torch.tensor([[1.0, 1.0], [0.02, 0.05],
                                                                                           [1.0, 1.0]]))
g = torch.Generator().manual_seed(8)
fp8.tensor.copy_((torch.randn(fp8.tensor.shape, generator=g) * 3).clamp(-448, 448).to(torch.float8_e4m3fn))
wide = KVPool(KVLayout(3, 16, 2, 32, torch.float32), 40, "cpu")
wide.tensor.copy_(fp8.tensor.float())
wide.tensor[:, 1, 0] *= 0.02
wide.tensor[:, 1, 1] *= 0.05
table = torch.randperm(40, generator=g)[:36].view(3, 12).contiguous()
ctx_lens = torch.tensor([1, 70, 190])
q = torch.randn(3, 4, 32, generator=g)
want = reference(q, wide, 1, table, range(3), ctx_lens, 0.3)
for splits in (1, 3):
    out = torch.full((3, 4, 32), float("nan"))
    triton_attention.paged_decode(q, fp8.tensor, 1, table, torch.arange(3), torch.arange(3), ctx_lens, 0.3, out,
                                  splits, k_scale=0.02, v_scale=0.05)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
assert triton_attention.num_splits(1, 8, 4096, 132) == 33 and triton_attention.num_splits(128, 8, 4096, 132) == 1
assert triton_attention.num_splits(1, 8, 100, 132) == 2  # no more splits than tiles
print("ok")
"""

POINTWISE = r"""
import torch
import torch.nn.functional as F
from engine.kernels import triton_pointwise
from engine.model.kv_pool import KVLayout, KVPool
from engine.model.decoder import rms_norm
from engine.model.model_config import RopeConfig
from engine.model.rope import RotaryTable, apply_rotary

g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    # add + RMSNorm: h updated in place, the norm returned; with and without a delta, odd widths
    for rows, dim in ((3, 64), (5, 200), (1, 4096)):
        h = torch.randn(rows, dim, generator=g).to(dtype)
        delta = torch.randn(rows, dim, generator=g).to(dtype)
        w = torch.randn(dim, generator=g).to(dtype)
        h_ref = h + delta
        want = rms_norm(h_ref, w, 1e-5)
        got = triton_pointwise.add_rms_norm(h, delta, w, 1e-5)
        # the residual add rounds as torch's (the interpreter's bfloat16 casts truncate: within a unit)
        torch.testing.assert_close(h.float(), h_ref.float(), atol=0 if dtype == torch.float32 else tol, rtol=tol)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(triton_pointwise.add_rms_norm(h, None, w, 1e-5).float(),
                                   rms_norm(h, w, 1e-5).float(), atol=tol, rtol=tol)
    # silu(gate) * up
    gu = torch.randn(4, 2 * 1500, generator=g).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(triton_pointwise.silu_mul(gu).float(), (F.silu(gate) * up).float(), atol=tol, rtol=tol)
    # rope in place and k, v into their slots; a negative block (a padded row) stores nothing
    heads, kvh, d = 4, 2, 16
    rope = RotaryTable(RopeConfig(theta=10000.0), d, 64, "cpu")
    positions = torch.tensor([0, 5, 17, 40])
    cos, sin = rope.lookup(positions, dtype)
    pool = KVPool(KVLayout(2, 8, kvh, d, dtype), 6, "cpu")
    qkv = torch.randn(4, (heads + 2 * kvh) * d, generator=g).to(dtype)
    qk = qkv[:, : (heads + kvh) * d].view(4, heads + kvh, d)
    want_qk = apply_rotary(qk, cos, sin)
    v = qkv[:, (heads + kvh) * d:].view(4, kvh, d).clone()
    blocks, offsets = torch.tensor([3, 0, 5, -1]), torch.tensor([1, 5, 0, 2])
    triton_pointwise.rotary_store(qkv, heads, kvh, cos, sin, pool.tensor, 1, blocks, offsets)
    torch.testing.assert_close(qk.float(), want_qk.float(), atol=tol, rtol=tol)
    expect = torch.zeros_like(pool.tensor)
    for t in range(3):
        expect[blocks[t], 1, 0, offsets[t]] = want_qk[t, heads:]
        expect[blocks[t], 1, 1, offsets[t]] = v[t]
    torch.testing.assert_close(pool.tensor.float(), expect.float(), atol=tol, rtol=tol)
    assert pool.tensor[:, 0].abs().sum() == 0  # another layer untouched
print("ok")
"""


def _interpret(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


MOE = r"""
import torch
from engine.model import moe
from engine.kernels import triton_moe
from engine.model.model_config import MoEConfig

# the alignment: each expert's pairs in a run of its own, padded to BLOCK_M; blocks past the last run -1
experts = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 -> experts 2 0 2 1 0 2
pairs, blocks = triton_moe.align(experts, 4, block_m=4)
assert blocks.tolist() == [0, 1, 2, -1, -1, -1]  # 6 pairs / 4 + 4 experts = 6 blocks at most
assert pairs.tolist()[:12] == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6], pairs.tolist()  # 6: padding

CASES = ((1, 64, 32, 4, 2, True, 0), (37, 64, 48, 8, 2, False, 96), (20, 96, 64, 6, 3, True, 0), (5, 32, 32, 16, 4, False, 0))
for dtype, tol, cases in ((torch.float32, 1e-5, CASES), (torch.float16, 3e-3, CASES[1::2])):  # float16: its rounding
    for tokens, hidden, inter, num, k, renorm, shared in cases:
        g = torch.Generator().manual_seed(tokens + num)
        randn = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).to(dtype)
        w = moe.MoEWeights(router=randn(num, hidden), gate_up=randn(num, 2 * inter, hidden, std=hidden**-0.5),
                           down=randn(num, hidden, inter, std=inter**-0.5))
        if shared:
            w.shared_gate_up, w.shared_down = randn(2 * shared, hidden, std=hidden**-0.5), randn(hidden, shared, std=shared**-0.5)
            w.shared_gate = randn(1, hidden, std=hidden**-0.5)
        config = MoEConfig(num, k, inter, renorm, (0,), shared)
        x = randn(tokens, hidden)
        want = moe.moe_forward(x.float(), moe.MoEWeights(*(None if t is None else t.float() for t in (
            w.router, w.gate_up, w.down, w.shared_gate_up, w.shared_down, w.shared_gate))), config)
        got = triton_moe.moe_forward(x, w, config)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol)
        if dtype == torch.float32:  # the torch form in the same dtype: the same routing, rounding apart
            torch.testing.assert_close(got, moe.moe_forward(x, w, config), atol=1e-5, rtol=1e-5)

# FP8 experts: per-row e4m3 weights, inputs per token (dynamic), by each expert's static scale, or
# left 16-bit (weights_only); the weights held in the model's dtype (as on CPU: the products of
# widened e4m3) or as e4m3 (as on GPUs: e4m3 x e4m3 in tl.dot) -> the torch form's output
from engine.model.fp8 import E4M3
for tokens, hidden, inter, num, k, shared in ((9, 64, 32, 4, 2, 32), (23, 96, 64, 6, 3, 0)):
    g = torch.Generator().manual_seed(tokens)
    randn = lambda *shape, std=1.0: torch.randn(*shape, generator=g) * std
    gate_up, down, parts = moe._quantized_stacked(randn(num, 2 * inter, hidden, std=hidden**-0.5),
                                                 randn(num, hidden, inter, std=inter**-0.5))
    config = MoEConfig(num, k, inter, True, (0,), shared)
    x = randn(tokens, hidden)
    for inputs in ("dynamic", "static", "weights_only"):
        q = moe.Fp8Experts(gate_up=torch.stack([torch.cat([a.scale, b.scale]) for a, b, _ in parts]),
                           down=torch.stack([d.scale for _, _, d in parts]), inputs=inputs)
        if inputs == "static":
            q.gate_up_input = torch.linspace(0.004, 0.01, num)
            q.down_input = torch.linspace(0.0005, 0.001, num)
        w = moe.MoEWeights(router=randn(num, hidden), gate_up=gate_up, down=down, fp8=q)
        if shared:
            w.shared_gate_up = randn(2 * shared, hidden, std=hidden**-0.5)
            w.shared_down, w.shared_gate = randn(hidden, shared, std=shared**-0.5), randn(1, hidden, std=hidden**-0.5)
        want = moe.moe_forward(x, w, config)
        for stored in (torch.float32, E4M3):
            w8 = moe.MoEWeights(w.router, gate_up.to(stored), down.to(stored), w.shared_gate_up, w.shared_down,
                                w.shared_gate, q)
            got = triton_moe.moe_forward(x, w8, config)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{inputs} {stored}: {m}")
            torch.testing.assert_close(moe.moe_forward(x, w8, config), want)  # the torch form widens e4m3 storage
    assert (moe.moe_forward(x, w, config) - moe.moe_forward(x, moe.MoEWeights(
        w.router, gate_up, down, w.shared_gate_up, w.shared_down, w.shared_gate), config)).abs().max() > 1e-3  # scaled

# a Qwen2-MoE engine (routed and shared experts, a dense layer) on the GPU kernels gives the torch forms' tokens,
# in FP8 too (--quantization fp8: its experts' grouped GEMMs take e4m3 inputs)
import tempfile
from pathlib import Path
from engine.config import CacheConfig, EngineConfig
from engine.kernels.gpu_kernels import GpuKernels
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.tiny_model import make_tiny_model

model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "moe", arch="qwen2_moe", seed=0))
for quantization in (None, "fp8"):
    engine = LLMEngine(EngineConfig(model_dir=model, quantization=quantization,
                                    cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False)))
    kernels = engine.model.kernels
    assert isinstance(kernels, GpuKernels)
    mixtures = [layer.moe for layer in engine.model.layers if layer.moe is not None]
    assert mixtures and all((m.fp8 is not None) == (quantization == "fp8") for m in mixtures)
    prompts = [[5 + 7 * i % 300 for i in range(n)] for n in (3, 11)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    fused = [c.token_ids for c in engine.generate(prompts, params)]
    engine.model.use_kernels(None)
    assert fused == [c.token_ids for c in engine.generate(prompts, params)], quantization
print("ok")
"""


def test_the_grouped_gemm_mixture_of_experts_matches_the_torch_form_under_the_interpreter() -> None:
    _interpret(MOE)


def test_split_decode_attention_matches_the_reference_under_the_interpreter() -> None:
    _interpret(ATTENTION)


def test_pointwise_kernels_match_their_torch_forms_under_the_interpreter() -> None:
    _interpret(POINTWISE)


GRAPHS = r"""
import tempfile
from pathlib import Path
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.model.decode_graphs import EagerGraph
from engine.kernels.gpu_kernels import GpuKernels
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.tiny_model import make_tiny_model

# llama; gemma2 (a window of 8 passed within a decode, soft-capped scores, Gemma's norms);
# qwen2_moe (the grouped-GEMM experts inside the buckets); llama over an FP8 pool (K and V
# stored through the torch form, read by the Triton kernel)
for arch, kv in (("llama", "auto"), ("gemma2", "auto"), ("qwen2_moe", "auto"), ("llama", "fp8")):
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch, seed=0))
    cache = CacheConfig(block_size=4, num_blocks=256, kv_cache_dtype=kv)
    sched = SchedulerConfig(max_num_seqs=6)
    graphed = LLMEngine(EngineConfig(model_dir=model, cache=cache, scheduler=sched, max_model_len=96, overlap=True),
                        graphs=EagerGraph)
    assert isinstance(graphed.model.kernels, GpuKernels)
    decode = graphed.runner.decode
    assert decode.buckets == [1, 2, 4, 6] and sorted(decode.graphs) == [1, 2, 4, 6]
    replayed = []
    for b, g in decode.graphs.items():
        g.replay = (lambda b=b, f=g.replay: (replayed.append(b), f())[1])
    reference = LLMEngine(EngineConfig(model_dir=model, cache=cache, scheduler=sched, native_kernels=False,
                                       decode_graphs=False, max_model_len=96))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21]]  # 3 decoding: bucket 4, one row of padding
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = [c.token_ids for c in graphed.generate(prompts, params)]
    want = [c.token_ids for c in reference.generate(prompts, params)]
    assert got == want, (got, want)
    assert set(replayed) == {4}, replayed  # every decode step replayed the padded bucket
    assert graphed.overlap.num_guessed_rows == 3 * 8, graphed.overlap.num_guessed_rows  # launched ahead, inputs from the device
    assert graphed.check_invariants().num_in_use == 0
print("ok")
"""


def test_decode_buckets_replay_padded_with_the_kernels_equal_to_the_torch_forms() -> None:
    """The GPU's decode path on CPU: buckets captured into `EagerGraph`, a batch of 3 replayed
    in the bucket of 4 (a padded row: no KV stored, no keys read), the Triton kernels under
    the interpreter, each step launched before the last one's tokens are read (overlap: the
    input tokens come from the device); tokens equal the torch forms' without buffers."""
    _interpret(GRAPHS)
