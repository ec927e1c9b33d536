/* Per-token kernels around the matmuls, each one pass over memory instead of several
 * torch ops with their temporaries.
 *
 * silu_mul: the SwiGLU activation, out = silu(gate) * up, from the fused gate_up
 * projection [rows, 2 I]. bfloat16 rounds where torch rounds (the silu, then the product),
 * so only the float32 exponential (within 2 ulp of torch's) can move an output across a
 * rounding boundary.
 *
 * rotary_store: the rotary embedding of q and k, in place in the fused qkv projection
 * [tokens, (heads + 2 kv_heads) d], then the token's k and v copied into its pool slot.
 * It computes x * cos + swapped(x) * signed_sin with torch's roundings (each product,
 * then the sum; no fused multiply-add), so it equals engine/model/rope.py's apply_rotary bit
 * for bit. Slot indices are range-checked before anything is written (-3).
 */
#pragma GCC optimize("fp-contract=off") /* a*b + c*d rounded as torch rounds it */

#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fastmath.h"

#define SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                               \
void silu_mul_##NAME(const T *gate_up, int64_t rows, int64_t inter, T *out, int num_threads) { \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                  \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const T *g = gate_up + r * 2 * inter, *u = g + inter;                               \
        T *o = out + r * inter;                                                             \
        _Pragma("omp simd")                                                                 \
        for (int64_t i = 0; i < inter; i++) o[i] = STORE(ROUND(silu(LOAD(g[i]))) * LOAD(u[i])); \
    }                                                                                       \
}

#define IDENT(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))

SILU_MUL(f32, float, IDENT, IDENT, IDENT)
#if HAVE_BF16X16 /* explicit vectors: the compiler's own bfloat16 packing was 4x slower */
void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16)
            bf16x16_store(o + i, _mm512_mul_ps(bf16x16_round(silu16(bf16x16_load(g + i))), bf16x16_load(u + i)));
        for (; i < inter; i++) o[i] = f32_to_bf16(ROUND_BF16(silu(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
    }
}
#else
SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
#endif

#define ROTARY_STORE(NAME, T, LOAD, STORE, ROUND)                                           \
int rotary_store_##NAME(T *qkv, int64_t tokens, int64_t token_stride, int64_t heads,       \
                        int64_t kv_heads, int64_t d, const T *cos, const T *sin,           \
                        int64_t table_stride, T *pool, int64_t num_blocks, int64_t block_size, \
                        int64_t block_stride, int64_t layer_offset, int64_t v_offset,      \
                        const int64_t *slot_blocks, const int64_t *slot_offsets, int num_threads) { \
    for (int64_t t = 0; t < tokens; t++)                                                    \
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks                              \
            || slot_offsets[t] < 0 || slot_offsets[t] >= block_size) return -3;             \
    const int64_t half = d / 2, row = kv_heads * d; /* one token's k (or v) in a block */  \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                  \
    for (int64_t t = 0; t < tokens; t++) {                                                  \
        T *x = qkv + t * token_stride;                                                      \
        const T *c = cos + t * table_stride, *s = sin + t * table_stride;                   \
        for (int64_t h = 0; h < heads + kv_heads; h++) { /* q heads, then k heads */        \
            T *xh = x + h * d;                                                              \
            float lo[half], hi[half];                                                       \
            for (int64_t i = 0; i < half; i++) { lo[i] = LOAD(xh[i]); hi[i] = LOAD(xh[half + i]); } \
            _Pragma("omp simd")                                                             \
            for (int64_t i = 0; i < half; i++) {                                            \
                xh[i] = STORE(ROUND(lo[i] * LOAD(c[i])) + ROUND(hi[i] * LOAD(s[i])));       \
                xh[half + i] = STORE(ROUND(hi[i] * LOAD(c[half + i])) + ROUND(lo[i] * LOAD(s[half + i]))); \
            }                                                                               \
        }                                                                                   \
        T *slot = pool + slot_blocks[t] * block_stride + layer_offset + slot_offsets[t] * row; \
        memcpy(slot, x + heads * d, sizeof(T) * row);                                       \
        memcpy(slot + v_offset, x + (heads + kv_heads) * d, sizeof(T) * row);              \
    }                                                                                       \
    return 0;                                                                               \
}

ROTARY_STORE(f32, float, IDENT, IDENT, IDENT)
ROTARY_STORE(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
