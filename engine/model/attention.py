"""Attention over the paged pool, batched: no Python loop over requests.

The model runner puts all decodes (one query token each) in one `PagedGroup` and each
prefill chunk in a group of its own, so queries are barely padded. Per paged group and
layer: gather the group's K and V blocks (one `index_select` each), then attend under
a causal-and-length mask. A first chunk with no earlier context is a
`CausalGroup`: no gather, causal SDPA over its own new K and V. A GPU backend can
replace `paged_attention` (FlashAttention / FlexAttention) behind the same metadata.

On CPU, short-query groups (decodes) normally take the native kernel
(engine/kernels/csrc/paged_attention.c): it reads each request's blocks where they lie, with
no gather, splits long contexts across threads and accumulates in float32. The torch
forms below are its fallback (no C compiler) and the path of longer queries.

Over gathered K and V, the form is chosen by dtype and query length (`_paged_form`),
as measured on CPU. Long queries (prefill chunks), in every dtype, and every group in
float32: SDPA's CPU flash kernel, which reads K and V through their strides (against
two batched matmuls with a materialised float32 score matrix it was 3-4x faster in
bfloat16 and 10-25x in float16 for 512-1024-token chunks, and more accurate). Short
queries (decodes) in 16-bit dtypes, where that kernel is slow: grouped KV heads leave K
and V in [ctx, kv_heads, head_dim] order, which no batched matmul takes without a
strided copy of the whole context, so every query head is scored against every KV head
(`_all_pairs_attention`), kv_heads times the flops of a product that is memory-bound
anyway, and the matching heads are kept.

The torch forms materialise per group the gathered K and V (padded to the group's longest
context) and float32 scores: a decode batch of 128 with one 128k-token context, or a
second chunk of 2,048 queries over 16k keys, would need GiBs per layer. Given
`workspace_bytes` (the model passes `ATTENTION_WORKSPACE_BYTES` on GPUs, which KV sizing
keeps free), a group whose estimate is over it attends in pieces: runs of requests, or a
single request's queries in runs, each under the bound. Rows attend independently, so the
pieces give what the whole group would.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.kv_pool import KVPool
from engine.config import SHORT_QUERY_MAX_LEN
from engine.kernels.native import NativeKernels


ATTENTION_WORKSPACE_BYTES = 1 << 30
"""What the torch attention forms may materialise for one group on a GPU (see above)."""


@dataclass
class CausalGroup:
    """One request's first chunk: attends only to its own new tokens."""

    token_index: torch.Tensor
    """[num_group_tokens] positions of this group's tokens in the packed batch."""


@dataclass
class PagedGroup:
    token_index: torch.Tensor
    """[num_group_tokens] positions of this group's tokens in the packed batch."""
    padded_index: torch.Tensor
    """[num_group_tokens] flat positions of the same tokens in [batch, max_query_len]."""
    batch: int
    max_query_len: int
    block_table: torch.Tensor
    """[batch, max_blocks] int64, padded with block 0 (masked out)."""
    num_keys: int
    """max_blocks * block_size: the gathered context length the torch forms attend over."""
    rows: torch.Tensor
    """[num_group_tokens] int64, each token's row of the block table."""
    ctx_lens: torch.Tensor
    """[num_group_tokens] int64, keys each token attends to (its position + 1)."""
    in_order: bool = False
    """The group is the whole batch, one token per request in batch order: no index maps."""
    max_context_len: int = 0
    """The longest context in the group, in keys (0: not known; the torch forms attend over
    `num_keys` under the mask)."""
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def mask(self) -> torch.Tensor:
        return self.mask_for(0)

    def mask_for(self, window: int) -> torch.Tensor:
        """[batch, 1, max_query_len, num_keys] bool, True = attend: each token its first
        ctx_lens keys (causal within the request), of those the last `window` (0: all);
        padded query rows key 0 only (never an empty row). Built on first use, per window:
        the native kernel reads ctx_lens instead."""
        made = self._masks.get(window)
        if made is None:
            limit = torch.ones(self.batch * self.max_query_len, dtype=torch.long, device=self.ctx_lens.device)
            limit[self.padded_index] = self.ctx_lens
            keys = torch.arange(self.num_keys, device=limit.device)
            attend = keys[None, :] < limit[:, None]
            if window:
                attend &= keys[None, :] >= limit[:, None] - window
            made = self._masks[window] = attend.view(self.batch, 1, self.max_query_len, self.num_keys)
        return made


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor
    """[num_tokens] block id of each new token's slot."""
    slot_offsets: torch.Tensor
    """[num_tokens] offset inside that block."""
    groups: list[CausalGroup | PagedGroup]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: KVPool,
    meta: AttentionMetadata,
    scale: float,
    kernels: NativeKernels | None = None,
    workspace_bytes: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

    Attends over each request's whole context, or with a `window` (a layer's sliding
    window) over the last `window` keys of it, a token's own included; the caller has written
    k, v into the pool (`KVPool.write`, or the native `rotary_store`). Returns [num_tokens,
    num_heads, head_dim]. With `kernels`, short-query groups run the native kernel straight
    over the pool (no gather). With `workspace_bytes`, the torch forms attend in pieces under it.
    A `softcap` (Gemma 2) caps each score s at softcap * tanh(s / softcap): the torch forms
    then score explicitly (`_capped_attention`), as SDPA cannot. Over an FP8 pool every form
    reads K and V as the pool gives them back (a first chunk's own too: `KVPool.rounded`): the
    torch forms, the native decode kernel and the Triton one.
    """
    out = torch.empty_like(q)
    if pool.fp8 and not getattr(kernels, "reads_fp8_kv", False):
        kernels = None
    fp8_scales = pool.host_scales[layer] if pool.fp8 else ()
    for g in meta.groups:
        if isinstance(g, CausalGroup):
            kg, vg = pool.rounded(layer, k[g.token_index], v[g.token_index])
            out[g.token_index] = _causal_self_attention(q[g.token_index], kg, vg, scale, window, softcap)
            continue
        if kernels is not None and g.max_query_len <= SHORT_QUERY_MAX_LEN:
            kernels.paged_attention(q, pool.tensor, layer, g.block_table, g.token_index, g.rows, g.ctx_lens, scale, out,
                                    window, softcap, *fp8_scales)
            continue
        if q.is_cuda and g.batch == 1 and g.max_context_len and g.max_query_len > SHORT_QUERY_MAX_LEN and not (
                window or softcap):
            out[g.token_index] = _chunk_over_context(q[g.token_index], pool, layer, g, scale)
            continue
        o = _gathered_attention(q, pool, layer, g, scale, workspace_bytes, window, softcap)
        if g.in_order:  # the only group: its output is the whole output
            return o
        out[g.token_index] = o if g.max_query_len == 1 else o[g.padded_index]
    return out


def _gathered_attention(q: torch.Tensor, pool: KVPool, layer: int, g: PagedGroup, scale: float,
                        workspace_bytes: int | None, window: int, softcap: float) -> torch.Tensor:
    """A paged group through the torch forms: its queries padded to [batch, max_query_len],
    K and V gathered (in pieces under `workspace_bytes`), attended under the group's mask.
    Returns [batch * max_query_len, heads, head_dim]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if g.in_order:
        qp = q
    elif g.max_query_len == 1:  # one token per request: nothing to pad
        qp = q[g.token_index]
    else:
        qp = q.new_zeros(g.batch * g.max_query_len, num_heads, head_dim)
        qp[g.padded_index] = q[g.token_index]
    attend = _paged_form(q.dtype, g.max_query_len, softcap)
    qv = qp.view(g.batch, g.max_query_len, num_heads, head_dim)
    pieces = _pieces(g, num_heads, pool, q.element_size(), workspace_bytes)
    mask = g.mask_for(window)
    if len(pieces) == 1:
        kc, vc = pool.gather(layer, g.block_table, q.dtype)  # [batch, ctx, kv_heads, head_dim]
        o = attend(qv, kc, vc, mask, scale)
    else:
        o = qv.new_empty(qv.shape)
        gathered = pool.gather(layer, g.block_table, q.dtype) if g.batch == 1 else None  # query runs share it
        for rows, queries in pieces:
            kc, vc = gathered or pool.gather(layer, g.block_table[rows], q.dtype)
            o[rows, queries] = attend(qv[rows, queries], kc, vc, mask[rows, :, queries], scale)
    return o.reshape(g.batch * g.max_query_len, num_heads, head_dim)


def _chunk_over_context(q: torch.Tensor, pool: KVPool, layer: int, g: PagedGroup, scale: float) -> torch.Tensor:
    """One request's later prefill chunk, q: [n, heads, head_dim], over its whole context (the
    chunk's own keys last), as two fused attentions merged by their log-sum-exp: over the
    earlier context with no mask, and over the chunk's own keys, square causal. Both are
    shapes the fastest backend takes (cuDNN's on an H100); one call with the causal mask
    aligned to the lower right ran FlashAttention-2 only (the second GPU run: an 8,192-token
    prompt in 2,048-token chunks at 1.45x the GEMM floor, 62 ms of it in that kernel)."""
    n = q.shape[0]
    ctx = g.max_context_len
    kc, vc = pool.gather(layer, g.block_table, q.dtype)  # [1, keys, kv_heads, head_dim]
    qh = q.transpose(0, 1)[None]  # [1, heads, n, head_dim]
    kh, vh = kc[:, :ctx].transpose(1, 2), vc[:, :ctx].transpose(1, 2)  # [1, kv_heads, ctx, head_dim]
    past, past_lse = attention_with_lse(qh, kh[:, :, :ctx - n], vh[:, :, :ctx - n], False, scale)
    own, own_lse = attention_with_lse(qh, kh[:, :, ctx - n:], vh[:, :, ctx - n:], True, scale)
    w = torch.sigmoid(past_lse - own_lse)[..., None]  # past's share: e^a / (e^a + e^b)
    o = torch.lerp(own.float(), past.float(), w).to(q.dtype)
    return o[0].transpose(0, 1)  # [n, heads, head_dim]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, heads, n, d]; k, v: [1, kv_heads, keys, d] (causal: keys == n). Returns the
    output [1, heads, n, d] and each query's log-sum-exp of its scaled scores [1, heads, n]
    (float32), through the fused kernel this device runs: on CUDA cuDNN's, else
    FlashAttention's, else the memory-efficient one, else scores made in float32; SDPA's
    flash kernel on CPU."""
    if q.is_cuda:
        return _cuda_fused_with_lse(q, k, v, causal, scale) or _scores_with_lse(q, k, v, causal, scale)
    kk, vv = _expand_heads(k, v, q.shape[1])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, vv, 0.0, causal, scale=scale)
    return o, lse.reshape(q.shape[:3]).float()


def _cuda_fused_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """attention_with_lse through the first fused CUDA kernel that takes the inputs, the KV
    heads grouped as they are where a kernel takes them so, else repeated per query head;
    None where none takes them."""
    heads, n = q.shape[1], q.shape[2]
    cuda = torch.backends.cuda
    forms = [(k, v, k.shape[1] != heads)]
    if k.shape[1] != heads:
        forms.append((*_expand_heads(k, v, heads), False))
    for kk, vv, grouped in forms:
        params = cuda.SDPAParams(q, kk, vv, None, 0.0, causal, grouped)
        if cuda.cudnn_sdp_enabled() and cuda.can_use_cudnn_attention(params):
            got = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kk, vv, None, True, 0.0, causal, False,
                                                                     scale=scale)
            return got[0], got[1].reshape(1, heads, n).float()
        if cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(params):
            got = torch.ops.aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, causal, False, scale=scale)
            return got[0], got[1].reshape(1, heads, n).float()
        if not grouped and cuda.mem_efficient_sdp_enabled() and cuda.can_use_efficient_attention(params):
            got = torch.ops.aten._scaled_dot_product_efficient_attention(q, kk, vv, None, True, 0.0, causal,
                                                                         scale=scale)
            return got[0], got[1][:, :, :n].float()  # its log-sum-exp is padded to 32 queries
    return None


def _scores_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse with the scores made in float32, for inputs no fused kernel takes."""
    n = q.shape[2]
    kk, vv = _expand_heads(k, v, q.shape[1])
    scores = q.float() @ kk.float().transpose(-1, -2) * scale
    if causal:
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ vv.float()).to(q.dtype), lse


def _expand_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, kv_heads, keys, d] -> [1, heads, keys, d], each KV head repeated for its query heads."""
    if k.shape[1] == heads:
        return k, v
    return k.repeat_interleave(heads // k.shape[1], dim=1), v.repeat_interleave(heads // k.shape[1], dim=1)


def _pieces(g: PagedGroup, num_heads: int, pool: KVPool, elem: int, workspace_bytes: int | None
            ) -> list[tuple[slice, slice]]:
    """(requests, queries) runs of a group whose torch form stays under `workspace_bytes`:
    per key, a request's gathered K and V, and per key and query float32 scores and
    probabilities plus the all-pairs form's products in the input dtype."""
    whole = [(slice(None), slice(None))]
    if workspace_bytes is None:
        return whole
    lay = pool.layout
    per_key_query = num_heads * (8 + lay.num_kv_heads * elem)
    gathered = g.num_keys * 2 * lay.num_kv_heads * lay.head_dim * elem
    per_request = gathered + g.num_keys * g.max_query_len * per_key_query
    if per_request * g.batch <= workspace_bytes:
        return whole
    if g.batch > 1 or g.max_query_len == 1:
        n = max(1, workspace_bytes // per_request)
        return [(slice(i, i + n), slice(None)) for i in range(0, g.batch, n)]
    n = max(1, (workspace_bytes - gathered) // (g.num_keys * per_key_query))  # one request: runs of its queries
    return [(slice(None), slice(i, i + n)) for i in range(0, g.max_query_len, n)]


def _paged_form(dtype: torch.dtype, max_query_len: int, softcap: float = 0.0) -> Callable[..., torch.Tensor]:
    if softcap:  # SDPA cannot cap scores
        return functools.partial(_capped_attention, softcap=softcap)
    if dtype == torch.float32 or max_query_len > SHORT_QUERY_MAX_LEN:
        return _sdpa_attention
    return _all_pairs_attention


def _causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim] -> [n, num_heads, head_dim].

    The inputs get a batch dimension of 1: given 3-D tensors, torch's CPU SDPA takes its
    math path, not the flash kernel (8x slower for a 2048-token prompt, 2x at 512;
    `benchmarks/engine/engine_throughput.py` has the prefill numbers). A `window` shorter than the
    chunk bands the causal mask (token j sees keys j - window + 1 .. j)."""
    n = q.shape[0]
    band = None
    if (window and n > window) or softcap:
        keys = torch.arange(n, device=q.device)
        band = keys[None, :] <= keys[:, None]
        if window:
            band &= keys[None, :] > keys[:, None] - window
    if softcap:
        return _capped_attention(q[None], k[None], v[None], band[None, None], scale, softcap)[0]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=band,
        is_causal=band is None, scale=scale, enable_gqa=True,
    )  # [1, num_heads, n, head_dim]
    return o[0].transpose(0, 1)


def _sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [batch, q_len, heads, head_dim]; k, v: [batch, ctx, kv_heads, head_dim]; mask:
    [batch, 1, q_len, ctx], True = attend, never hiding a whole row (see the runner).
    Returns [batch, q_len, heads, head_dim]."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True,
    )  # [batch, heads, q_len, head_dim]
    return o.transpose(1, 2)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float) -> torch.Tensor:
    """`_sdpa_attention`'s contract, each score s capped at softcap * tanh(s / softcap) before
    the mask and the softmax (Gemma 2, as transformers' eager attention does); scores and
    probabilities in float32."""
    grp = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).float()  # [batch, heads, q_len, d]
    kh = k.transpose(1, 2).float().repeat_interleave(grp, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(grp, dim=1)
    scores = torch.tanh(qh @ kh.transpose(-1, -2) * (scale / softcap)) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return (probs @ vh).transpose(1, 2)


def _all_pairs_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as `_sdpa_attention`; k and v must be contiguous.

    K viewed as [batch, ctx * kv_heads, head_dim] and V as [batch, ctx, kv_heads * head_dim]
    are plain matrices, so both products run on the gathered memory as it lies; the
    diagonal (query head's own KV head) of each result is what attention needs.
    """
    b, n, h, d = q.shape
    ctx, kvh = k.shape[1], k.shape[2]
    grp = h // kvh
    qh = q.transpose(1, 2).reshape(b, h * n, d)  # rows: head-major, then query position
    s_all = torch.bmm(qh, k.view(b, ctx * kvh, d).transpose(1, 2)).view(b, kvh, grp * n, ctx, kvh)
    scores = torch.diagonal(s_all, dim1=1, dim2=4).permute(0, 3, 1, 2)  # [batch, kv_heads, grp * q_len, ctx]
    scores = scores.float().reshape(b, kvh, grp, n, ctx) * scale
    scores = torch.where(mask[:, :, None], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, h * n, ctx)
    o_all = torch.bmm(probs, v.view(b, ctx, kvh * d)).view(b, kvh, grp * n, kvh, d)
    o = torch.diagonal(o_all, dim1=1, dim2=3)  # [batch, grp * q_len, head_dim, kv_heads]
    return o.permute(0, 3, 1, 2).reshape(b, kvh, grp, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, h, d)
