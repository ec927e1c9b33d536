/* decode_layers_bf16: every decoder layer of a decode step in one call, the same kernels
 * in the same order as the model's Python loop (engine/model/decoder.py), so the result is the
 * same bit for bit, without ~10 Python calls per layer (about 40 us a layer) and with
 * the GIL released for the whole stack (ctypes drops it: the worker's other threads run).
 *
 * Per layer: h += delta; x = RMSNorm(h) -> qkv = x Wqkv (+ b) -> q, k rotated, k and v
 * stored in the pool -> attention over the pool -> delta = attn Wo; h += delta;
 * x = RMSNorm(h) -> act = silu(x Wgate) * x Wup (one linear, linear.c's SwiGLU epilogue)
 * -> delta = act Wdown. The last delta is left for the caller's final add + norm. Each
 * linear prefetches the next one's first tiles (linear.c's `after`), the last one the
 * caller's (`after` in the arguments).
 */
#include <stdint.h>

#include "kernels.h"

typedef struct {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
} layer_weights;

typedef struct {
    int64_t num_layers, tokens, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int32_t num_threads;
    const uint16_t *cos, *sin; /* [tokens, head_dim] rows `rope_stride` apart */
    int64_t rope_stride;
    uint16_t *pool;
    int64_t layer_stride;      /* elements between layers of a block */
    const int64_t *slot_blocks, *slot_offsets, *table, *token_index, *rows, *ctx_lens;
    /* scratch, `tokens` rows each: x [hidden], qkv [(heads + 2 kv_heads) head_dim],
     * attn [heads head_dim], act [inter] */
    uint16_t *x, *qkv, *attn, *act;
    const uint16_t *after;     /* the linear the caller runs next (may be NULL) */
    int64_t after_n, after_k;
} forward_args;

/* h [tokens, hidden]: the residual stream, added to in place; delta [tokens, hidden]:
 * out, the last layer's MLP output. attn: paged attention's arguments for layer 0
 * (layer_offset is advanced per layer). Returns 0, or the first failing kernel's status. */
int decode_layers_bf16(const forward_args *a, const layer_weights *w, const attn_args *attn, uint16_t *h,
                       uint16_t *delta) {
    const int64_t d = a->head_dim, n = a->tokens, hid = a->hidden;
    const int64_t q_width = a->heads * d, qkv_width = (a->heads + 2 * a->kv_heads) * d;
    const int th = a->num_threads;
    attn_args at = *attn;
    int status = 0;
    for (int64_t i = 0; i < a->num_layers && status == 0; i++) {
        const layer_weights *l = w + i;
        add_rms_norm_bf16(h, i ? delta : 0, l->input_norm, a->x, n, hid, a->eps, th);
        status = linear_bf16(a->x, hid, l->qkv, l->qkv_bias, a->qkv, qkv_width, n, qkv_width, hid, th,
                             l->o, hid, q_width);
        if (status) break;
        status = rotary_store_bf16(a->qkv, n, qkv_width, a->heads, a->kv_heads, d, a->cos, a->sin,
                                   a->rope_stride, a->pool, at.num_blocks, at.block_size, at.block_stride,
                                   i * a->layer_stride, at.v_offset, a->slot_blocks, a->slot_offsets, th);
        if (status) break;
        at.layer_offset = i * a->layer_stride;
        status = paged_attention_bf16(&at, a->qkv, a->pool, a->table, a->token_index, a->rows, a->ctx_lens,
                                      a->attn);
        if (status) break;
        status = linear_bf16(a->attn, q_width, l->o, l->o_bias, delta, hid, n, hid, q_width, th,
                             l->gate_up, 2 * a->inter, hid);
        if (status) break;
        add_rms_norm_bf16(h, delta, l->post_norm, a->x, n, hid, a->eps, th);
        status = linear_swiglu_bf16(a->x, hid, l->gate_up, l->gate_up_bias, a->act, a->inter, n, 2 * a->inter,
                                    hid, th, l->down, hid, a->inter);
        if (status) break;
        const int last = i + 1 == a->num_layers;
        status = linear_bf16(a->act, a->inter, l->down, l->down_bias, delta, hid, n, hid, a->inter, th,
                             last ? a->after : w[i + 1].qkv, last ? a->after_n : qkv_width, last ? a->after_k : hid);
    }
    return status;
}
