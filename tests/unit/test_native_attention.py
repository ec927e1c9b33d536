"""The native kernels (engine/kernels/csrc): paged attention against a per-request, per-head loop
reference, and the fused residual add + RMSNorm against the model's torch version.

Float32 within 1e-5; bfloat16 within the output's own rounding (the kernel accumulates
in float32 and rounds once, so it may differ from the reference by one bfloat16 step).
The build needs a C compiler: the `kernels` fixture (tests/unit/conftest.py) fails, not
skips, when one is on PATH and the kernel still does not load.
"""
from __future__ import annotations

import pytest
import torch

from engine.model.attention import AttentionMetadata, PagedGroup, paged_attention
from engine.model.kv_pool import KVLayout, KVPool


def make_pool(heads_kv: int, head_dim: int, dtype: torch.dtype, num_blocks: int = 40, block_size: int = 4) -> KVPool:
    pool = KVPool(KVLayout(3, block_size, heads_kv, head_dim, dtype), num_blocks, "cpu")
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1)))
    return pool


def reference(q, pool: KVPool, layer, table, rows, ctx_lens, scale, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor:
    """[n, heads, d] float32: each query token and head on its own, blocks read one at a time;
    with a window, over the last `window` keys; with a softcap, scores capped by tanh."""
    n, heads, d = q.shape
    kvh = pool.layout.num_kv_heads
    out = torch.zeros(n, heads, d)
    for i in range(n):
        blocks = [max(b, 0) for b in table[rows[i]].tolist()]
        first = max(int(ctx_lens[i]) - window, 0) if window else 0
        k = torch.cat([pool.tensor[b, layer, 0] for b in blocks])[first: ctx_lens[i]].float()  # [ctx, kvh, d]
        v = torch.cat([pool.tensor[b, layer, 1] for b in blocks])[first: ctx_lens[i]].float()
        for h in range(heads):
            g = h // (heads // kvh)
            scores = (k[:, g] @ q[i, h].float()) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            p = torch.softmax(scores, dim=0)
            out[i, h] = p @ v[:, g]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(4, 2, 8), (4, 4, 16), (8, 1, 32), (6, 2, 64), (8, 2, 128), (10, 2, 64)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_kernel_matches_the_reference(kernels, dtype, heads, kv_heads, head_dim, block_size):
    """Block sizes of 16 and more take the 16-keys-at-a-time paths, a block's last partial
    chunk included: bfloat16 K read straight from the pool where head_dim is a multiple of
    32, V summed in registers for up to 4 heads of a group at a time (10/2 heads: 4 + 1)
    where it is a multiple of 64; 4 takes the one-key-at-a-time path only."""
    pool = make_pool(kv_heads, head_dim, dtype, block_size=block_size)
    g = torch.Generator().manual_seed(heads + head_dim)
    per_row = 48 // block_size + 1
    table = torch.randperm(40, generator=g)[: 3 * per_row].view(3, per_row).contiguous()  # 3 requests
    rows = torch.tensor([0, 1, 1, 1, 2])  # request 1 has a 3-token query (a short chunk)
    ctx_lens = torch.tensor([1, 18, 19, 33, 48])  # one key; across block edges; whole blocks
    qkv = torch.randn(5, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :heads]  # tokens strided, as the model's fused qkv leaves them
    out = torch.full((5, heads, head_dim), float("nan"), dtype=dtype)
    kernels.paged_attention(q, pool.tensor, 2, table, torch.arange(5), rows, ctx_lens, 0.3, out)
    want = reference(q, pool, 2, table, rows, ctx_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (8, 1, 32), (10, 2, 64), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_an_fp8_pool_is_read_as_its_values_times_its_layers_scales(kernels, dtype, heads, kv_heads, head_dim,
                                                                   block_size):
    """e4m3 K and V widened through the kernel's table (16 at a time where head_dim allows, V
    summed in registers where it is a multiple of 64), the K scale folded into the score
    scale, the V scale on the output: the reference over the values multiplied back."""
    layout = KVLayout(3, block_size, kv_heads, head_dim, torch.float8_e4m3fn)
    pool = KVPool(layout, 40, "cpu", scales=torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.02, 0.05]]))
    g = torch.Generator().manual_seed(heads + head_dim + block_size)
    pool.tensor.copy_((torch.randn(pool.tensor.shape, generator=g) * 4).to(torch.float8_e4m3fn))
    pool.tensor[0, 2, 0, 0, 0, :4] = torch.tensor([0.0, 2.0**-9, -(2.0**-7), 448.0]).to(torch.float8_e4m3fn)
    wide = KVPool(KVLayout(3, block_size, kv_heads, head_dim, torch.float32), 40, "cpu")
    wide.tensor.copy_(pool.tensor.float() * pool.scales.view(1, 3, 2, 1, 1, 1))  # subnormals, zero, the largest
    per_row = 48 // block_size + 1
    table = torch.randperm(40, generator=g)[: 3 * per_row].view(3, per_row).contiguous()
    table[0, 0] = 0  # the block holding the edge values
    rows, ctx_lens = torch.tensor([0, 1, 2]), torch.tensor([5, 18, 48])
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype)
    out = torch.full((3, heads, head_dim), float("nan"), dtype=dtype)
    kernels.paged_attention(q, pool.tensor, 2, table, torch.arange(3), rows, ctx_lens, 0.3, out, k_scale=0.02,
                            v_scale=0.05)
    want = reference(q, wide, 2, table, rows, ctx_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 30])
def test_a_sliding_window_attends_to_the_last_keys_only(kernels, dtype, block_size, window):
    """Windows inside a block, on a block edge and over several; the blocks wholly before a
    window are not read (their table entries here are -1: freed blocks may be)."""
    pool = make_pool(2, 64, dtype, num_blocks=200, block_size=block_size)
    g = torch.Generator().manual_seed(window + block_size)
    ctx_lens = torch.tensor([1, 18, 19, 33, 120, 700])
    per_row = 700 // block_size + 1
    table = torch.randperm(200, generator=g).repeat(6)[: 6 * per_row].view(6, per_row).contiguous()
    for i, ctx in enumerate(ctx_lens.tolist()):
        table[i, : max(ctx - window, 0) // block_size] = -1
    q = torch.randn(6, 4, 64, generator=g).to(dtype)
    out = torch.full((6, 4, 64), float("nan"), dtype=dtype)
    kernels.paged_attention(q, pool.tensor, 1, table, torch.arange(6), torch.arange(6), ctx_lens, 0.2, out, window)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.float(), reference(q, pool, 1, table, range(6), ctx_lens, 0.2, window),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_the_reference_in_the_kernel_and_the_torch_forms(kernels, dtype):
    """Gemma 2's soft cap: the kernel (windowed and not) and the explicit torch form."""
    pool = make_pool(2, 64, dtype, num_blocks=60, block_size=16)
    g = torch.Generator().manual_seed(8)
    table = torch.randperm(60, generator=g)[:54].view(3, 18).contiguous()
    ctx_lens = torch.tensor([1, 40, 280])
    q = (torch.randn(3, 4, 64, generator=g) * 3).to(dtype)  # scores well past the cap
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for window in (0, 20):
        out = torch.empty(3, 4, 64, dtype=dtype)
        kernels.paged_attention(q, pool.tensor, 0, table, torch.arange(3), torch.arange(3), ctx_lens, 0.3, out,
                                window, 2.0)
        want = reference(q, pool, 0, table, range(3), ctx_lens, 0.3, window, 2.0)
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        assert (want - reference(q, pool, 0, table, range(3), ctx_lens, 0.3, window)).abs().max() > 0.01  # it bites
    group = PagedGroup(token_index=torch.arange(3), padded_index=torch.arange(3), batch=3, max_query_len=1,
                       block_table=table, num_keys=18 * 16, rows=torch.arange(3), ctx_lens=ctx_lens, in_order=True)
    meta = AttentionMetadata(slot_blocks=torch.zeros(3, dtype=torch.long), slot_offsets=torch.zeros(3, dtype=torch.long),
                             groups=[group])
    plain = paged_attention(q, q[:, :2], q[:, :2], 0, pool, meta, 0.3, window=20, softcap=2.0)
    torch.testing.assert_close(plain.float(), reference(q, pool, 0, table, range(3), ctx_lens, 0.3, 20, 2.0),
                               atol=tol, rtol=tol)


def test_the_torch_forms_band_a_windowed_group_as_the_kernel_does(kernels):
    """A decode group and a prefill chunk over earlier context, windowed, through
    `paged_attention`: the kernel and the masked torch form agree."""
    pool = make_pool(2, 16, torch.float32)
    table = torch.tensor([[3, 9, 1, 30, 31], [20, 21, 0, 4, 5]])
    group = PagedGroup(
        token_index=torch.arange(2), padded_index=torch.arange(2), batch=2, max_query_len=1, block_table=table,
        num_keys=20, rows=torch.arange(2), ctx_lens=torch.tensor([19, 6]), in_order=True)
    meta = AttentionMetadata(slot_blocks=torch.tensor([31, 21]), slot_offsets=torch.tensor([2, 1]), groups=[group])
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    pool.write(1, meta.slot_blocks, meta.slot_offsets, k, v)
    for window in (3, 7):
        plain = paged_attention(q, k, v, 1, pool, meta, 0.25, window=window)
        fast = paged_attention(q, k, v, 1, pool, meta, 0.25, kernels, window=window)
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain, reference(q, pool, 1, table, [0, 1], group.ctx_lens, 0.25, window),
                                   atol=1e-5, rtol=1e-5)


def test_long_contexts_split_across_threads_give_the_unsplit_result(kernels):
    """One request alone is cut into context splits (one per thread and more); each split's
    softmax is combined by its max and sum, equal to one pass within float rounding."""
    pool = make_pool(2, 16, torch.float32, num_blocks=300, block_size=16)
    table = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:256].view(1, 256).contiguous()
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(4))
    out = torch.empty_like(q)
    for ctx in (1, 15, 16, 17, 1000, 4096):
        lens = torch.tensor([ctx])
        kernels.paged_attention(q, pool.tensor, 0, table, torch.arange(1), torch.tensor([0]), lens, 0.25, out)
        torch.testing.assert_close(out, reference(q, pool, 0, table, [0], lens, 0.25), atol=1e-5, rtol=1e-5)


def test_only_the_indexed_tokens_are_written(kernels):
    pool = make_pool(2, 8, torch.float32)
    table = torch.arange(12).view(1, 12)
    q = torch.randn(6, 4, 8)
    out = torch.full((6, 4, 8), 7.0)
    kernels.paged_attention(q, pool.tensor, 1, table, torch.tensor([4, 1]), torch.tensor([0, 0]),
                            torch.tensor([5, 9]), 0.5, out)
    untouched = [0, 2, 3, 5]
    assert torch.equal(out[untouched], torch.full((4, 4, 8), 7.0))
    want = reference(q[[4, 1]], pool, 1, table, [0, 0], [5, 9], 0.5)
    torch.testing.assert_close(out[[4, 1]], want, atol=1e-5, rtol=1e-5)


def test_paged_attention_gives_the_same_with_and_without_the_kernel(kernels):
    """A decode group through `paged_attention`: native kernel against the torch form."""
    pool = make_pool(2, 16, torch.float32)
    table = torch.tensor([[3, 9, 1], [20, 21, 0]])
    group = PagedGroup(
        token_index=torch.arange(2), padded_index=torch.arange(2), batch=2, max_query_len=1, block_table=table,
        num_keys=12, rows=torch.arange(2),
        ctx_lens=torch.tensor([11, 6]), in_order=True,
    )
    meta = AttentionMetadata(slot_blocks=torch.tensor([1, 21]), slot_offsets=torch.tensor([2, 1]), groups=[group])
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    pool.write(1, meta.slot_blocks, meta.slot_offsets, k, v)
    plain = paged_attention(q, k, v, 1, pool, meta, 0.25)
    fast = paged_attention(q, k, v, 1, pool, meta, 0.25, kernels)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.tensor[21, 1, 0, 1], k[1])  # attention only reads the pool


def test_mismatched_inputs_are_refused(kernels):
    pool = make_pool(2, 8, torch.float32)
    table, rows, lens = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    q = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="does not match pool"):
        kernels.paged_attention(q.bfloat16(), pool.tensor, 0, table, rows, rows, lens, 1.0, q.bfloat16())
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_attention(q, pool.tensor, 0, table.int(), rows, rows, lens, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="dense heads"):
        kernels.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), pool.tensor, 0, table, rows, rows,
                                lens, 1.0, torch.empty_like(q))


@pytest.mark.parametrize("case", ["context past the table row", "block id past the pool", "row past the table",
                                  "token past q", "empty context"])
def test_out_of_range_indices_are_refused_before_any_write(kernels, case):
    pool = make_pool(2, 8, torch.float32, num_blocks=10)
    table, rows, lens, tokens = torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([12]), torch.tensor([0])
    if case == "context past the table row":
        lens = torch.tensor([13])
    elif case == "block id past the pool":
        table = torch.tensor([[1, 10, 3]])
    elif case == "row past the table":
        rows = torch.tensor([1])
    elif case == "token past q":
        tokens = torch.tensor([2])
    else:
        lens = torch.tensor([0])
    q, out = torch.randn(2, 4, 8), torch.full((2, 4, 8), 7.0)
    with pytest.raises(ValueError, match="out of range"):
        kernels.paged_attention(q, pool.tensor, 0, table, tokens, rows, lens, 1.0, out)
    assert torch.equal(out, torch.full((2, 4, 8), 7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 400])  # 400 x 768 runs on the OpenMP pool
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_the_model_reference(kernels, dtype, rows, with_delta):
    """h += delta exactly as torch adds. The norm: float32 within 2e-6; bfloat16 mostly
    bit-identical, and where the float32 sum of squares (added in another order than
    torch's) moves a normalised value across a rounding boundary, within two steps."""
    from engine.model.decoder import rms_norm

    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 768, generator=g).to(dtype)
    delta = torch.randn(rows, 768, generator=g).to(dtype) if with_delta else None
    weight = (torch.rand(768, generator=g) + 0.5).to(dtype)
    want_h = h + delta if with_delta else h.clone()
    want = rms_norm(want_h, weight, 1e-5)
    got = kernels.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, want_h)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:
        off = got != want
        assert off.float().mean() < 0.01
        step = want.float().abs() * 2**-6  # two bfloat16 steps: one in the normalised value, then the weight
        assert ((got.float() - want.float()).abs() <= step + 1e-30)[off].all()


def test_add_rms_norm_refuses_mismatched_tensors(kernels):
    h = torch.randn(4, 16)
    with pytest.raises(ValueError, match="residual"):
        kernels.add_rms_norm(h, torch.randn(3, 16), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        kernels.add_rms_norm(h, None, torch.ones(16, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="h must be contiguous"):
        kernels.add_rms_norm(h.t(), None, torch.ones(4), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_over_the_workspace_attends_in_pieces_and_gives_the_same(dtype):
    """A decode batch split into runs of requests, and one request's long chunk split into
    runs of its queries, against the whole group at once (the torch forms, no kernel)."""
    from engine.model import attention

    pool = make_pool(2, 16, dtype)
    decode = PagedGroup(token_index=torch.arange(3), padded_index=torch.arange(3), batch=3, max_query_len=1,
                        block_table=torch.tensor([[3, 9, 1], [20, 21, 0], [5, 0, 0]]), num_keys=12,
                        rows=torch.arange(3), ctx_lens=torch.tensor([11, 6, 2]))
    chunk = PagedGroup(token_index=torch.arange(3, 9), padded_index=torch.arange(6), batch=1, max_query_len=6,
                       block_table=torch.tensor([[7, 8, 10]]), num_keys=12, rows=torch.zeros(6, dtype=torch.long),
                       ctx_lens=torch.arange(7, 13))
    meta = AttentionMetadata(slot_blocks=torch.tensor([1, 21, 5, 8, 8, 10, 10, 10, 10]),
                             slot_offsets=torch.tensor([2, 1, 1, 2, 3, 0, 1, 2, 3]), groups=[decode, chunk])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 16, generator=g).to(dtype) for h in (4, 2, 2))
    pool.write(1, meta.slot_blocks, meta.slot_offsets, k, v)
    whole = paged_attention(q, k, v, 1, pool, meta, 0.25)
    one_request = attention._pieces(decode, 4, pool, q.element_size(), 1)
    assert one_request == [(slice(0, 1), slice(None)), (slice(1, 2), slice(None)), (slice(2, 3), slice(None))]
    per_query = 12 * 4 * (8 + 2 * q.element_size())
    gathered = 12 * 2 * 2 * 16 * q.element_size()
    assert attention._pieces(chunk, 4, pool, q.element_size(), gathered + 2 * per_query) == \
        [(slice(None), slice(0, 2)), (slice(None), slice(2, 4)), (slice(None), slice(4, 6))]
    pieces = paged_attention(q, k, v, 1, pool, meta, 0.25, workspace_bytes=gathered + 2 * per_query)
    assert attention._pieces(decode, 4, pool, q.element_size(), 10**9) == [(slice(None), slice(None))]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # SDPA's own blocking differs with the shapes
    torch.testing.assert_close(pieces, whole, atol=tolerance, rtol=tolerance)
