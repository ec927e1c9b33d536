"""Paged attention's forms, the KV gather and prepacked linears against slow references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import _all_pairs_attention, _causal_self_attention, _paged_form, _sdpa_attention
from engine.model.kv_pool import KVLayout, KVPool
from engine.model.linear import Linear


def reference_attention(q, k, v, ctx_lens, query_starts, scale):
    """One request and one head at a time: q [b, n, h, d], k/v [b, ctx, kvh, d]."""
    b, n, h, d = q.shape
    grp = h // k.shape[2]
    out = torch.zeros_like(q)
    for i in range(b):
        for t in range(n):
            visible = min(query_starts[i] + t + 1, ctx_lens[i])
            for head in range(h):
                keys = k[i, :visible, head // grp]
                p = torch.softmax((keys @ q[i, t, head]) * scale, dim=0)
                out[i, t, head] = p @ v[i, :visible, head // grp]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("q_len", [1, 3, 5])
def test_both_forms_match_the_per_head_reference(heads, kv_heads, q_len):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + q_len)
    b, ctx, d = 3, 40, 8
    q = torch.randn(b, q_len, heads, d, generator=g)
    k = torch.randn(b, ctx, kv_heads, d, generator=g)
    v = torch.randn(b, ctx, kv_heads, d, generator=g)
    ctx_lens = [40, 17, q_len + 2]
    starts = [c - q_len for c in ctx_lens]  # queries are the last q_len tokens of each context
    query_pos = torch.tensor([[s + t for t in range(q_len)] for s in starts])
    mask = (torch.arange(ctx)[None, None, :] <= query_pos[:, :, None])[:, None]  # [b, 1, n, ctx]
    want = reference_attention(q, k, v, ctx_lens, starts, 0.3)
    for form in (_all_pairs_attention, _sdpa_attention):
        got = form(q, k, v, mask, 0.3)
        assert got.shape == (b, q_len, heads, d)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=form.__name__)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_prefill_chunk_takes_sdpa_within_half_precision_of_the_reference(dtype):
    """A 40-token chunk after 24 cached tokens, as the runner's mask shapes it."""
    assert _paged_form(dtype, 40) is _sdpa_attention and _paged_form(dtype, 1) is _all_pairs_attention
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, h, 16, generator=g) for n, h in ((40, 6), (64, 2), (64, 2)))
    mask = (torch.arange(64)[None, :] <= torch.arange(24, 64)[:, None])[None, None]
    want = reference_attention(q, k, v, [64], [24], 0.25)
    got = _sdpa_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.25)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=0)  # a 16-bit output's rounding


def test_causal_self_attention_matches_the_reference():
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(33, 6, 8, generator=g), torch.randn(33, 2, 8, generator=g), torch.randn(33, 2, 8, generator=g)
    want = reference_attention(q[None], k[None], v[None], [33], [0], 0.3)[0]
    torch.testing.assert_close(_causal_self_attention(q, k, v, 0.3), want, atol=1e-5, rtol=1e-5)


def test_gather_returns_each_blocks_layer_in_table_order():
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=5, dtype=torch.float32)
    pool = KVPool(layout, num_blocks=9, device="cpu")
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view(pool.tensor.shape))
    table = torch.tensor([[7, 2, 0], [3, 3, 8]])
    k, v = pool.gather(1, table)
    assert k.shape == v.shape == (2, 12, 2, 5) and k.is_contiguous() and v.is_contiguous()
    for i in range(2):
        for j, blk in enumerate(table[i].tolist()):
            assert torch.equal(k[i, 4 * j : 4 * j + 4], pool.tensor[blk, 1, 0])
            assert torch.equal(v[i, 4 * j : 4 * j + 4], pool.tensor[blk, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_prepacked_or_not(dtype, bias):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    packed, plain = Linear(w, b, prepack=True), Linear(w, b, prepack=False)
    assert plain.packed is None
    assert plain.nbytes == packed.nbytes == (48 * 32 + (48 if bias else 0)) * w.element_size()
    for rows in (1, 7, 64):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        want = F.linear(x, w, b)
        assert torch.equal(plain(x), want)
        tol = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(packed(x), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("start,n", [(13, 9), (4, 16), (1, 30)])
def test_a_later_chunk_over_its_context_matches_the_reference(heads, kv_heads, start, n):
    """The GPU's form for one request's later prefill chunk (the lower-right causal mask over
    the context cut to its length; on CPU with the KV heads expanded) against the per-head one."""
    from engine.model.attention import PagedGroup, _chunk_over_context

    pool = KVPool(KVLayout(2, 4, kv_heads, 16, torch.float32), 20, "cpu")
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(start)))
    ctx = start + n
    width = -(-ctx // 4) + 1  # a padded table, as the runner builds for a group
    table = torch.randperm(20, generator=torch.Generator().manual_seed(n))[:width][None]
    q = torch.randn(n, heads, 16, generator=torch.Generator().manual_seed(heads))
    g = PagedGroup(token_index=torch.arange(n), padded_index=torch.arange(n), batch=1, max_query_len=n,
                   block_table=table, num_keys=width * 4, rows=torch.zeros(n, dtype=torch.long),
                   ctx_lens=torch.arange(start + 1, ctx + 1), max_context_len=ctx)
    k, v = pool.gather(1, table)
    want = reference_attention(q[None], k, v, [ctx], [start], 0.25)[0]
    torch.testing.assert_close(_chunk_over_context(q, pool, 1, g, 0.25), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_made_in_float32_give_the_fused_kernels_output_and_log_sum_exp(heads, kv_heads, causal):
    """The CUDA fallback of attention_with_lse (for inputs no fused kernel takes) against
    the CPU's fused flash kernel: the same output and log-sum-exp, grouped KV heads included."""
    from engine.model.attention import _scores_with_lse, attention_with_lse

    gen = torch.Generator().manual_seed(heads + kv_heads)
    q = torch.randn(1, heads, 7, 16, generator=gen)
    keys = 7 if causal else 11
    k, v = (torch.randn(1, kv_heads, keys, 16, generator=gen) for _ in range(2))
    want_o, want_lse = attention_with_lse(q, k, v, causal, 0.25)
    got_o, got_lse = _scores_with_lse(q, k, v, causal, 0.25)
    assert got_lse.shape == want_lse.shape == (1, heads, 7)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient", None])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_first_fused_cuda_kernel_that_takes_a_kv_form_runs_and_its_lse_is_per_query(
        monkeypatch: pytest.MonkeyPatch, kernel: str | None, kv_heads: int) -> None:
    """CUDA's answers injected: which kernel takes which inputs (torch.backends.cuda's
    can_use_*: here `kernel`, and only KV heads repeated per query head), run on the meta
    device, whose forms of the three kernels give CUDA's shapes (cuDNN's log-sum-exp has a
    trailing 1, the memory-efficient one pads to 32 queries)."""
    from engine.model.attention import _cuda_fused_with_lse

    cuda, tried = torch.backends.cuda, []

    def can_use(name: str):  # type: ignore[no-untyped-def]
        def answer(params) -> bool:  # type: ignore[no-untyped-def]
            tried.append((name, params.key.shape[1], params.enable_gqa))
            return name == kernel and not params.enable_gqa
        return answer

    for name in ("cudnn", "flash", "efficient"):
        monkeypatch.setattr(cuda, f"can_use_{name}_attention", can_use(name))
    for enabled in ("cudnn_sdp_enabled", "flash_sdp_enabled", "mem_efficient_sdp_enabled"):
        monkeypatch.setattr(cuda, enabled, lambda: True)
    q = torch.empty(1, 4, 5, 8, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(1, kv_heads, 7, 8, device="meta", dtype=torch.bfloat16)
    got = _cuda_fused_with_lse(q, k, v, False, 0.35)
    order = ["cudnn", "flash", "efficient"]
    upto = order[:order.index(kernel) + 1] if kernel else order
    if kv_heads == 4:  # one form, every kernel asked in turn
        assert tried == [(n, 4, False) for n in upto]
    else:  # grouped first (the memory-efficient kernel takes no groups), then repeated
        assert tried == [("cudnn", 2, True), ("flash", 2, True)] + [(n, 4, False) for n in upto]
    if kernel is None:
        assert got is None
    else:
        o, lse = got
        assert o.shape == (1, 4, 5, 8) and o.dtype == torch.bfloat16
        assert lse.shape == (1, 4, 5) and lse.dtype == torch.float32
