/* Paged attention for short queries (decodes), reading K and V straight from the pool.
 *
 * Built at first use by engine/kernels/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with tensor data pointers; nothing here knows Python or torch.
 *
 * Pool layout (elements): [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim].
 * One task is one query token over one split of its context (one split unless the batch is
 * too small to keep the threads busy): all its heads are scored against the split's keys
 * (no gather, no padding), softmax in float32, then the weighted sum of V; the splits are
 * combined by their max and sum. Everything accumulates in float32; only the output is
 * rounded. With AVX-512, keys go 16 at a time: bfloat16 K rows straight from the pool
 * through vdpbf16ps where the CPU has it (the scale applied to the scores, not to q),
 * otherwise widened once into L1 for the group's heads; V rows widened in registers and
 * summed into 4 heads' accumulators at once where head_dim is a multiple of 64.
 * Tasks run on the caller's OpenMP pool (torch's libgomp, loaded first, is shared).
 *
 * An FP8 pool (e4m3 bytes, `paged_attention_e4m3_f32` / `_e4m3_bf16` for float32 or bfloat16
 * q and out) is widened through a 256-entry table as it is read; its layer's K scale comes
 * folded into `scale` and its V scale is applied to the output (`v_scale`).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fastmath.h"
#include "kernels.h"


#define LOAD_f32(p, i) ((p)[i])
#define LOAD_bf16(p, i) bf16_to_f32((p)[i])
#define STORE_f32(x) (x)
#define STORE_bf16(x) f32_to_bf16(x)
#define LOAD_e4m3_f32 LOAD_f32
#define LOAD_e4m3_bf16 LOAD_bf16
#define STORE_e4m3_f32 STORE_f32
#define STORE_e4m3_bf16 STORE_bf16

/* e4m3 (fn: no infinities, 0x7f / 0xff NaN) -> float32, every byte's value; filled when the
 * library loads, before any call can read it. */
static float E4M3_TO_F32[256];
__attribute__((constructor)) static void e4m3_table_fill(void) {
    for (int b = 0; b < 256; b++) {
        const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
        float v = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.f + man / 8.f, exp - 7);
        if (exp == 15 && man == 7) v = NAN;
        E4M3_TO_F32[b] = sign ? -v : v;
    }
}

/* float32 kernels of the inner loops: K and V rows are converted once per KV head into
 * `row`, then shared by that head's group of query heads. With AVX-512 and head_dim a
 * multiple of 16 they are written out (the compiler's own reduction adds lane by lane). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC_OK(d) ((d) % 16 == 0)
#else
#define VEC_OK(d) 0
#endif

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
#if defined(__AVX512F__)
    if (VEC_OK(d)) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int64_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    _Pragma("omp simd reduction(+ : s)")
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict acc, float w, const float *restrict x, int64_t d) {
#if defined(__AVX512F__)
    if (VEC_OK(d)) {
        const __m512 wv = _mm512_set1_ps(w);
        for (int64_t i = 0; i < d; i += 16)
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(acc + i)));
        return;
    }
#endif
    _Pragma("omp simd")
    for (int64_t i = 0; i < d; i++) acc[i] += w * x[i];
}

static inline void row_f32(float *restrict row, const float *restrict x, int64_t d) { memcpy(row, x, sizeof(float) * d); }

static inline void row_e4m3(float *restrict row, const uint8_t *restrict x, int64_t d) {
#if defined(__AVX512F__)
    if (VEC_OK(d)) {
        for (int64_t i = 0; i < d; i += 16) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
            _mm512_storeu_ps(row + i, _mm512_i32gather_ps(idx, E4M3_TO_F32, 4));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) row[i] = E4M3_TO_F32[x[i]];
}
#define row_e4m3_f32 row_e4m3
#define row_e4m3_bf16 row_e4m3

static inline void row_bf16(float *restrict row, const uint16_t *restrict x, int64_t d) {
#if defined(__AVX512F__)
    if (VEC_OK(d)) {
        for (int64_t i = 0; i < d; i += 16) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i)));
            _mm512_storeu_ps(row + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) row[i] = bf16_to_f32(x[i]);
}

/* m <= 16 rows `stride` elements apart converted into row[16][d], rows m .. 15 zero. */
#define DEFINE_ROWS16(NAME, T)                                                                \
static inline void rows16_##NAME(float *restrict row, const T *src, int64_t stride, int64_t m, int64_t d) { \
    for (int64_t r = 0; r < m; r++) row_##NAME(row + r * d, src + r * stride, d);             \
    memset(row + m * d, 0, sizeof(float) * (16 - m) * d);                                     \
}
DEFINE_ROWS16(f32, float)
DEFINE_ROWS16(bf16, uint16_t)
DEFINE_ROWS16(e4m3_f32, uint8_t)
DEFINE_ROWS16(e4m3_bf16, uint8_t)

#if defined(__AVX512F__)
/* r[i] = the sum of v[i]'s 16 lanes: a transposing add tree, 45 ops for 16 sums. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 u[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *w = v + 4 * g;
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        const __m512d a = _mm512_castps_pd(s01), b = _mm512_castps_pd(s23);
        /* each 128-bit lane k: the lane's partial sums of w[0], w[1], w[2], w[3] */
        u[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xdd));
}

/* out[t] = dot(qh, rows + t * d) for 16 rows; d a multiple of 16. */
static inline void qk16(const float *restrict qh, const float *restrict rows, int64_t d, float *restrict out) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
        const __m512 qv = _mm512_loadu_ps(qh + j);
        for (int t = 0; t < 16; t++) acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows + t * d + j), acc[t]);
    }
    _mm512_storeu_ps(out, sum16(acc));
}

/* acc += sum over 16 rows of w[t] * rows[t]; d a multiple of 16. */
static inline void pv16(float *restrict acc, const float *restrict w, const float *restrict rows, int64_t d) {
    for (int64_t j = 0; j < d; j += 16) {
        __m512 a = _mm512_loadu_ps(acc + j);
        for (int t = 0; t < 16; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(w[t]), _mm512_loadu_ps(rows + t * d + j), a);
        _mm512_storeu_ps(acc + j, a);
    }
}
#define CHUNK16(d) ((d) % 16 == 0)

static inline __m512 load16_f32(const float *x) { return _mm512_loadu_ps(x); }
static inline __m512 load16_e4m3(const uint8_t *x) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)x)), E4M3_TO_F32, 4);
}
#define load16_e4m3_f32 load16_e4m3
#define load16_e4m3_bf16 load16_e4m3
static inline __m512 load16_bf16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

/* acc[h] += sum over n keys of w[h][t] * v[t], for HN heads of one KV head's group and 64
 * of the head's dims: 4 x HN float32 accumulators stay in registers over the keys, each
 * V row is read (and widened) once for all the group's heads. */
#define DEFINE_PV64(NAME, T, HN)                                                              \
static inline void pv64_##NAME##_##HN(float *acc, int64_t acc_stride, const float *w, int64_t w_stride, \
                                     const T *v, int64_t v_stride, int64_t n) {              \
    __m512 a[HN][4];                                                                          \
    for (int h = 0; h < HN; h++)                                                              \
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_loadu_ps(acc + h * acc_stride + 16 * c); \
    for (int64_t t = 0; t < n; t++) {                                                         \
        __m512 x[4];                                                                          \
        for (int c = 0; c < 4; c++) x[c] = load16_##NAME(v + t * v_stride + 16 * c);          \
        for (int h = 0; h < HN; h++) {                                                        \
            const __m512 wb = _mm512_set1_ps(w[h * w_stride + t]);                           \
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_fmadd_ps(wb, x[c], a[h][c]);         \
        }                                                                                     \
    }                                                                                         \
    for (int h = 0; h < HN; h++)                                                              \
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + h * acc_stride + 16 * c, a[h][c]); \
}

/* The same over a group of `grp` heads and head_dim d, a multiple of 64: 4 heads at a time. */
#define DEFINE_PV_GROUP(NAME, T)                                                              \
DEFINE_PV64(NAME, T, 1) DEFINE_PV64(NAME, T, 2) DEFINE_PV64(NAME, T, 3) DEFINE_PV64(NAME, T, 4) \
static void pv_group_##NAME(float *acc, int64_t acc_stride, const float *w, int64_t w_stride, \
                            const T *v, int64_t v_stride, int64_t n, int64_t d, int64_t grp) { \
    for (int64_t j = 0; j < d; j += 64)                                                       \
        for (int64_t h = 0; h < grp; h += 4) {                                                \
            float *ah = acc + h * acc_stride + j;                                             \
            const float *wh = w + h * w_stride;                                               \
            switch (grp - h < 4 ? grp - h : 4) {                                              \
            case 1: pv64_##NAME##_1(ah, acc_stride, wh, w_stride, v + j, v_stride, n); break; \
            case 2: pv64_##NAME##_2(ah, acc_stride, wh, w_stride, v + j, v_stride, n); break; \
            case 3: pv64_##NAME##_3(ah, acc_stride, wh, w_stride, v + j, v_stride, n); break; \
            default: pv64_##NAME##_4(ah, acc_stride, wh, w_stride, v + j, v_stride, n); break; \
            }                                                                                 \
        }                                                                                     \
}
DEFINE_PV_GROUP(f32, float)
DEFINE_PV_GROUP(bf16, uint16_t)
DEFINE_PV_GROUP(e4m3_f32, uint8_t)
DEFINE_PV_GROUP(e4m3_bf16, uint8_t)
#define CHUNK64(d) ((d) % 64 == 0)

#if defined(__AVX512BF16__)
/* out[t] = scale * dot(qh, k_t) for 16 bfloat16 K rows `k_stride` apart, straight from the
 * pool: pairs multiplied exactly and summed in float32 (vdpbf16ps), no widening pass.
 * Only out[0 .. m-1] are written (1 <= m <= 16). */
static inline void qk16_dp(const uint16_t *qh, const uint16_t *k, int64_t k_stride, int64_t d, float scale,
                           float *out, int64_t m) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + j);
        for (int t = 0; t < 16; t++)
            acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_loadu_si512(k + t * k_stride + j));
    }
    _mm512_mask_storeu_ps(out, (__mmask16)(0xffffu >> (16 - m)), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}
/* Whole 16-row chunks inside every block (rows past the context are read, their scores
 * dropped) and head_dim in 32-element steps. */
#define QK_DP_bf16(d, bs) ((d) % 32 == 0 && (bs) % 16 == 0)
#else
#define QK_DP_bf16(d, bs) 0
#define qk16_dp(qh, k, ks, d, scale, out, m) ((void)0)
#endif
#define QK_DP_f32(d, bs) 0
#define QK_DP_e4m3_f32(d, bs) 0
#define QK_DP_e4m3_bf16(d, bs) 0
#else
#define CHUNK16(d) 0
#define CHUNK64(d) 0
#define QK_DP_bf16(d, bs) 0
#define QK_DP_f32(d, bs) 0
#define QK_DP_e4m3_f32(d, bs) 0
#define QK_DP_e4m3_bf16(d, bs) 0
#define qk16_dp(qh, k, ks, d, scale, out, m) ((void)0)
#define pv_group_f32(acc, as, w, ws, v, vs, n, d, grp) ((void)0)
#define pv_group_bf16(acc, as, w, ws, v, vs, n, d, grp) ((void)0)
#define pv_group_e4m3_f32(acc, as, w, ws, v, vs, n, d, grp) ((void)0)
#define pv_group_e4m3_bf16(acc, as, w, ws, v, vs, n, d, grp) ((void)0)
#define qk16(qh, rows, d, out) ((void)0)
#define pv16(acc, w, rows, d) ((void)0)
#endif

/* Asks for the next block's K (or V) run of one layer, block_size * kv_heads * head_dim
 * elements in a row, while this block is computed. */
static inline void prefetch_run(const void *start, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch((const char *)start + off);
}

/* s[t] = e^(s[t] - m) for m = max(s[0 .. n-1]); *max_out = m, *sum_out = the sum of the
 * new s[t]. n >= 1. */
static inline void softmax_row(float *s, int64_t n, float *max_out, float *sum_out) {
    float m = -INFINITY, l = 0.f;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY), vl = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, k, s + t));
    }
    m = _mm512_reduce_max_ps(vm);
    const __m512 vmax = _mm512_set1_ps(m), lowest = _mm512_set1_ps(-87.f);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), vmax), lowest); /* as exp_nonpos */
        const __m512 e = exp16_clamped(x);
        _mm512_mask_storeu_ps(s + t, k, e);
        vl = _mm512_add_ps(vl, _mm512_maskz_mov_ps(k, e));
    }
    l = _mm512_reduce_add_ps(vl);
#else
    _Pragma("omp simd reduction(max : m)")
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    _Pragma("omp simd reduction(+ : l)")
    for (int64_t t = 0; t < n; t++) { s[t] = exp_nonpos(s[t] - m); l += s[t]; }
#endif
    *max_out = m;
    *sum_out = l;
}

/* The first key a query over ctx keys attends to. */
#define FIRST_KEY(a, ctx) ((a)->window > 0 && (ctx) > (a)->window ? (ctx) - (a)->window : 0)

/* Splits of one query's context: enough tasks for the threads when the batch is small,
 * at least MIN_SPLIT_BLOCKS blocks each. */
#define MIN_SPLIT_BLOCKS 4

/* One task: query token `tok` (its q and block-table row) over context blocks [b0, b1),
 * the last holding keys up to ctx - 1, the first `skip` keys of b0 outside the window (their
 * scores computed, then weighted exactly 0). Leaves per head the running max m, the sum of
 * exp(score - m) l, and acc = sum of exp(score - m) * v, in part[h * (d + 2) ...]:
 * acc[0 .. d-1], m, l. scores: scratch of heads * (b1 - b0) * block_size floats; qf: heads * d;
 * row: 16 * d (K or V rows converted to float32). */
#define DEFINE_TASK(NAME, TQ, T)                                                              \
static void task_##NAME(const attn_args *a, const TQ *q, const T *pool, const int64_t *blocks, \
                        int64_t b0, int64_t b1, int64_t ctx, int64_t skip, float *part, float *scores, \
                        float *qf, float *row) {                                              \
    const int64_t d = a->head_dim, bs = a->block_size, kvh = a->num_kv_heads;                 \
    const int64_t heads = a->num_heads, grp = heads / kvh, tok_stride = kvh * d;              \
    const int64_t n_keys = (b1 * bs < ctx ? b1 * bs : ctx) - b0 * bs;                         \
    const int64_t run_bytes = bs * tok_stride * (int64_t)sizeof(T);                           \
    for (int64_t h = 0; !QK_DP_##NAME(d, bs) && h < heads; h++) /* qf: the other paths' q */ \
        for (int64_t i = 0; i < d; i++) qf[h * d + i] = LOAD_##NAME(q, h * d + i) * a->scale; \
    for (int64_t b = b0; b < b1; b++) {                                                       \
        const T *k = pool + blocks[b] * a->block_stride + a->layer_offset;                    \
        if (b + 1 < b1)                                                                       \
            prefetch_run(pool + blocks[b + 1] * a->block_stride + a->layer_offset, run_bytes); \
        const int64_t t0 = (b - b0) * bs, n = n_keys - t0 < bs ? n_keys - t0 : bs;            \
        int64_t t = 0;                                                                        \
        for (; QK_DP_##NAME(d, bs) && t < n; t += 16) { /* bfloat16 K as it is in the pool */ \
            const int64_t m = n - t < 16 ? n - t : 16;                                        \
            for (int64_t g = 0; g < kvh; g++)                                                 \
                for (int64_t h = g * grp; h < (g + 1) * grp; h++)                             \
                    qk16_dp((const uint16_t *)q + h * d, (const uint16_t *)k + t * tok_stride + g * d, \
                            tok_stride, d, a->scale, scores + h * n_keys + t0 + t, m);        \
        }                                                                                     \
        for (; CHUNK16(d) && t < n; t += 16) { /* 16 keys at a time, rows in L1; zero rows pad */ \
            const int64_t m = n - t < 16 ? n - t : 16;                                        \
            for (int64_t g = 0; g < kvh; g++) {                                               \
                rows16_##NAME(row, k + t * tok_stride + g * d, tok_stride, m, d);                \
                for (int64_t h = g * grp; h < (g + 1) * grp; h++) {                           \
                    float s16[16];                                                            \
                    qk16(qf + h * d, row, d, s16);                                            \
                    memcpy(scores + h * n_keys + t0 + t, s16, sizeof(float) * m);             \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; t < n; t++)                                                                    \
            for (int64_t g = 0; g < kvh; g++) {                                               \
                row_##NAME(row, k + t * tok_stride + g * d, d);                               \
                for (int64_t h = g * grp; h < (g + 1) * grp; h++)                             \
                    scores[h * n_keys + t0 + t] = dot(qf + h * d, row, d);                    \
            }                                                                                 \
    }                                                                                         \
    if (a->softcap > 0.f) /* soft-capped scores (Gemma 2), as transformers caps them */    \
        for (int64_t h = 0; h < heads; h++)                                                   \
            for (int64_t t = skip; t < n_keys; t++)                                           \
                scores[h * n_keys + t] = a->softcap * tanhf(scores[h * n_keys + t] / a->softcap); \
    for (int64_t h = 0; h < heads; h++) {                                                     \
        float *ph = part + h * (d + 2);                                                       \
        memset(ph, 0, sizeof(float) * d);                                                     \
        softmax_row(scores + h * n_keys + skip, n_keys - skip, ph + d, ph + d + 1);           \
        memset(scores + h * n_keys, 0, sizeof(float) * skip);                                 \
    }                                                                                         \
    for (int64_t b = b0; b < b1; b++) {                                                       \
        const T *v = pool + blocks[b] * a->block_stride + a->layer_offset + a->v_offset;      \
        if (b + 1 < b1)                                                                       \
            prefetch_run(pool + blocks[b + 1] * a->block_stride + a->layer_offset + a->v_offset, run_bytes); \
        const int64_t t0 = (b - b0) * bs, n = n_keys - t0 < bs ? n_keys - t0 : bs;            \
        int64_t t = 0;                                                                        \
        if (CHUNK64(d)) { /* V rows straight from the pool, accumulators in registers */     \
            for (int64_t g = 0; g < kvh; g++)                                                 \
                pv_group_##NAME(part + g * grp * (d + 2), d + 2, scores + g * grp * n_keys + t0, n_keys, \
                                v + g * d, tok_stride, n, d, grp);                            \
            t = n;                                                                            \
        }                                                                                     \
        for (; CHUNK16(d) && t < n; t += 16) {                                                \
            const int64_t m = n - t < 16 ? n - t : 16;                                        \
            for (int64_t g = 0; g < kvh; g++) {                                               \
                rows16_##NAME(row, v + t * tok_stride + g * d, tok_stride, m, d);                \
                for (int64_t h = g * grp; h < (g + 1) * grp; h++) {                           \
                    float w16[16] = {0};                                                      \
                    memcpy(w16, scores + h * n_keys + t0 + t, sizeof(float) * m);             \
                    pv16(part + h * (d + 2), w16, row, d);                                    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; t < n; t++)                                                                    \
            for (int64_t g = 0; g < kvh; g++) {                                               \
                row_##NAME(row, v + t * tok_stride + g * d, d);                               \
                for (int64_t h = g * grp; h < (g + 1) * grp; h++)                             \
                    axpy(part + h * (d + 2), scores[h * n_keys + t0 + t], row, d);            \
            }                                                                                 \
    }                                                                                         \
}                                                                                             \
                                                                                              \
/* out = the splits' partials combined: sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. */   \
static void combine_##NAME(const attn_args *a, const float *parts, int64_t splits, TQ *out) { \
    const int64_t d = a->head_dim, w = a->num_heads * (d + 2);                               \
    for (int64_t h = 0; h < a->num_heads; h++) {                                              \
        float big = -INFINITY, l = 0.f, acc[512];                                             \
        for (int64_t s = 0; s < splits; s++) {                                                \
            const float *p = parts + s * w + h * (d + 2);                                     \
            if (p[d + 1] > 0.f && p[d] > big) big = p[d];                                     \
        }                                                                                     \
        memset(acc, 0, sizeof(float) * d);                                                    \
        for (int64_t s = 0; s < splits; s++) {                                                \
            const float *p = parts + s * w + h * (d + 2);                                     \
            if (!(p[d + 1] > 0.f)) continue;                                                  \
            const float f = expf(p[d] - big);                                                 \
            l += f * p[d + 1];                                                                \
            for (int64_t i = 0; i < d; i++) acc[i] += f * p[i];                               \
        }                                                                                     \
        const float inv = a->v_scale / l;                                                     \
        for (int64_t i = 0; i < d; i++) out[h * d + i] = STORE_##NAME(acc[i] * inv);          \
    }                                                                                         \
}

DEFINE_TASK(f32, float, float)
DEFINE_TASK(bf16, uint16_t, uint16_t)
DEFINE_TASK(e4m3_f32, float, uint8_t)
DEFINE_TASK(e4m3_bf16, uint16_t, uint8_t)

/* q, out: token i's heads at q + token_index[i] * q_token_stride (same for out).
 * rows[i]: its block-table row; ctx_lens[i]: keys it attends to (positions 0 .. ctx-1),
 * at least 1; with a window w, only the last w of them (the blocks before those are not
 * read, nor their table entries checked: they may be gone). head_dim at most 512. Returns 0; -1 when scratch memory can't be had (out
 * is then incomplete); -2 for a head_dim over 512, -3 for an index out of range (a
 * context longer than its table row, a row, token or block id outside its tensor): nothing
 * is read or written then. */
#define DEFINE_ENTRY(NAME, TQ, T)                                                             \
int paged_attention_##NAME(const attn_args *a, const TQ *q, const T *pool, const int64_t *table, \
                           const int64_t *token_index, const int64_t *rows,                  \
                           const int64_t *ctx_lens, TQ *out) {                                \
    const int64_t nq = a->num_queries, bs = a->block_size, d = a->head_dim, heads = a->num_heads; \
    if (nq == 0) return 0;                                                                    \
    if (d > 512) return -2;                                                                   \
    int64_t max_blocks = 1;                                                                   \
    for (int64_t i = 0; i < nq; i++) {                                                        \
        if (ctx_lens[i] < 1 || ctx_lens[i] > a->table_stride * bs || rows[i] < 0             \
            || rows[i] >= a->table_rows || token_index[i] < 0 || token_index[i] >= a->num_tokens) \
            return -3;                                                                        \
        const int64_t nb = (ctx_lens[i] + bs - 1) / bs, fb = FIRST_KEY(a, ctx_lens[i]) / bs;  \
        max_blocks = nb - fb > max_blocks ? nb - fb : max_blocks;                             \
        for (int64_t b = fb; b < nb; b++) {                                                   \
            const int64_t blk = table[rows[i] * a->table_stride + b];                         \
            if (blk < 0 || blk >= a->num_blocks) return -3;                                   \
        }                                                                                     \
    }                                                                                         \
    const int64_t want = (4 * (int64_t)a->num_threads + nq - 1) / nq;                         \
    const int64_t most = (max_blocks + MIN_SPLIT_BLOCKS - 1) / MIN_SPLIT_BLOCKS;              \
    const int64_t splits = want < most ? want : most;                                         \
    const int64_t per_split = (max_blocks + splits - 1) / splits;                             \
    const int64_t part_w = heads * (d + 2);                                                   \
    float *parts = malloc(sizeof(float) * nq * splits * part_w);                              \
    if (parts == NULL) return -1;                                                             \
    int failed = 0;                                                                           \
    _Pragma("omp parallel num_threads(a->num_threads) reduction(| : failed)")                 \
    {                                                                                         \
        float *scratch = malloc(sizeof(float) * (heads * (per_split * bs + d) + 16 * d));     \
        if (scratch == NULL) failed = 1;                                                      \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t task = 0; task < nq * splits; task++) {                                  \
            const int64_t i = task / splits, s = task % splits;                               \
            const int64_t nb = (ctx_lens[i] + bs - 1) / bs, k0 = FIRST_KEY(a, ctx_lens[i]);   \
            const int64_t b0 = k0 / bs + s * per_split;                                       \
            const int64_t b1 = b0 + per_split < nb ? b0 + per_split : nb;                     \
            float *part = parts + task * part_w;                                              \
            if (scratch == NULL || b0 >= b1) { /* an empty split: weight 0 */                 \
                for (int64_t h = 0; h < heads; h++) part[h * (d + 2) + d + 1] = 0.f;          \
                continue;                                                                     \
            }                                                                                 \
            task_##NAME(a, q + token_index[i] * a->q_token_stride, pool, table + rows[i] * a->table_stride, \
                        b0, b1, ctx_lens[i], k0 > b0 * bs ? k0 - b0 * bs : 0, part,                \
                        scratch + heads * d + 16 * d, scratch, scratch + heads * d);          \
        }                                                                                     \
        _Pragma("omp for schedule(static)")                                                   \
        for (int64_t i = 0; i < nq; i++)                                                      \
            combine_##NAME(a, parts + i * splits * part_w, splits, out + token_index[i] * a->out_token_stride); \
        free(scratch);                                                                        \
    }                                                                                         \
    free(parts);                                                                              \
    return failed ? -1 : 0;                                                                   \
}

DEFINE_ENTRY(f32, float, float)
DEFINE_ENTRY(bf16, uint16_t, uint16_t)
DEFINE_ENTRY(e4m3_f32, float, uint8_t)
DEFINE_ENTRY(e4m3_bf16, uint16_t, uint8_t)
