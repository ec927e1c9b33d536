/* What the kernels in engine/kernels/csrc share: paged attention's arguments, and the bfloat16
 * entry points that forward.c strings together (each documented where it is defined). */
#ifndef SPLITSERVE_KERNELS_H
#define SPLITSERVE_KERNELS_H

#include <stdint.h>

typedef struct {
    int64_t num_queries;      /* tokens to compute */
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int64_t q_token_stride;   /* elements between tokens of q (heads are head_dim apart) */
    int64_t out_token_stride; /* elements between tokens of out */
    int64_t block_stride;     /* elements between blocks of the pool */
    int64_t layer_offset;     /* elements from a block's start to this layer's K */
    int64_t v_offset;         /* elements from a layer's K to its V */
    int64_t table_stride;     /* block-table row length */
    int64_t table_rows;       /* block-table rows */
    int64_t num_blocks;       /* blocks in the pool */
    int64_t num_tokens;       /* tokens (first dimension) of q and of out */
    float scale;
    int32_t num_threads;
    int64_t window;           /* keys a query attends to, its own last (sliding window); 0: all */
    float softcap;            /* scores become softcap * tanh(score / softcap) (Gemma 2); 0: not */
    float v_scale;            /* an e4m3 pool's V scale, applied to the output (its K scale is in `scale`) */
} attn_args;

int paged_attention_bf16(const attn_args *a, const uint16_t *q, const uint16_t *pool, const int64_t *table,
                         const int64_t *token_index, const int64_t *rows, const int64_t *ctx_lens, uint16_t *out);
void add_rms_norm_bf16(uint16_t *h, const uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                       int64_t dim, float eps, int32_t num_threads);
int rotary_store_bf16(uint16_t *qkv, int64_t tokens, int64_t token_stride, int64_t heads, int64_t kv_heads,
                      int64_t d, const uint16_t *cos, const uint16_t *sin, int64_t table_stride, uint16_t *pool,
                      int64_t num_blocks, int64_t block_size, int64_t block_stride, int64_t layer_offset,
                      int64_t v_offset, const int64_t *slot_blocks, const int64_t *slot_offsets, int num_threads);
int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads, const uint16_t *after,
                int64_t after_n, int64_t after_k);
int linear_swiglu_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                       int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads, const uint16_t *after,
                       int64_t after_n, int64_t after_k);

#endif
