/* Paged attention for short queries (decodes), reading K and V straight from the pool.
 *
 * Built at first use by engine/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with tensor data pointers; nothing here knows Python or torch.
 *
 * Pool layout (elements): [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim].
 * One task is one (query token, KV head): its `grp` query heads are scored against every
 * key of the token's context (no gather, no padding), softmax in float32, then the
 * weighted sum of V. Everything accumulates in float32; only the output is rounded.
 * Tasks run on the caller's OpenMP pool (torch's libgomp, loaded first, is shared).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
} attn_args;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define LOAD_f32(p, i) ((p)[i])
#define LOAD_bf16(p, i) bf16_to_f32((p)[i])
#define STORE_f32(x) (x)
#define STORE_bf16(x) f32_to_bf16(x)

/* Splits of one query's context: enough tasks for the threads when the batch is small,
 * at least MIN_SPLIT_BLOCKS blocks each. */
#define MIN_SPLIT_BLOCKS 4

/* One task: query token `tok` (its q and block-table row) over context blocks [b0, b1),
 * the last holding keys up to ctx - 1. Leaves per head the running max m, the sum of
 * exp(score - m) l, and acc = sum of exp(score - m) * v, in part[h * (d + 2) ...]:
 * acc[0 .. d-1], m, l. scores: scratch of heads * (b1 - b0) * block_size floats; qf: heads * d. */
#define DEFINE_TASK(NAME, T)                                                                  \
static void task_##NAME(const attn_args *a, const T *q, const T *pool, const int64_t *blocks, \
                        int64_t b0, int64_t b1, int64_t ctx, float *part, float *scores, float *qf) { \
    const int64_t d = a->head_dim, bs = a->block_size, kvh = a->num_kv_heads;                 \
    const int64_t heads = a->num_heads, grp = heads / kvh, tok_stride = kvh * d;              \
    const int64_t n_keys = (b1 * bs < ctx ? b1 * bs : ctx) - b0 * bs;                         \
    for (int64_t h = 0; h < heads; h++)                                                       \
        for (int64_t i = 0; i < d; i++) qf[h * d + i] = LOAD_##NAME(q, h * d + i) * a->scale; \
    for (int64_t b = b0; b < b1; b++) {                                                       \
        const T *k = pool + blocks[b] * a->block_stride + a->layer_offset;                    \
        if (b + 1 < b1) { /* the next block's K: one contiguous run */                        \
            const char *next = (const char *)(pool + blocks[b + 1] * a->block_stride + a->layer_offset); \
            for (int64_t off = 0; off < (int64_t)(bs * tok_stride * sizeof(T)); off += 64)    \
                __builtin_prefetch(next + off);                                               \
        }                                                                                     \
        const int64_t t0 = (b - b0) * bs, n = n_keys - t0 < bs ? n_keys - t0 : bs;            \
        for (int64_t t = 0; t < n; t++)                                                       \
            for (int64_t h = 0; h < heads; h++) {                                             \
                const float *qh = qf + h * d;                                                 \
                const T *kr = k + t * tok_stride + (h / grp) * d;                             \
                float s = 0.f;                                                                \
                _Pragma("omp simd reduction(+ : s)")                                          \
                for (int64_t i = 0; i < d; i++) s += qh[i] * LOAD_##NAME(kr, i);              \
                scores[h * n_keys + t0 + t] = s;                                              \
            }                                                                                 \
    }                                                                                         \
    for (int64_t h = 0; h < heads; h++) {                                                     \
        float *s = scores + h * n_keys, m = -INFINITY, l = 0.f;                               \
        for (int64_t t = 0; t < n_keys; t++) m = s[t] > m ? s[t] : m;                         \
        for (int64_t t = 0; t < n_keys; t++) { s[t] = expf(s[t] - m); l += s[t]; }            \
        float *ph = part + h * (d + 2);                                                       \
        memset(ph, 0, sizeof(float) * d);                                                     \
        ph[d] = m;                                                                            \
        ph[d + 1] = l;                                                                        \
    }                                                                                         \
    for (int64_t b = b0; b < b1; b++) {                                                       \
        const T *v = pool + blocks[b] * a->block_stride + a->layer_offset + a->v_offset;      \
        if (b + 1 < b1) {                                                                     \
            const char *next = (const char *)(pool + blocks[b + 1] * a->block_stride + a->layer_offset + a->v_offset); \
            for (int64_t off = 0; off < (int64_t)(bs * tok_stride * sizeof(T)); off += 64)    \
                __builtin_prefetch(next + off);                                               \
        }                                                                                     \
        const int64_t t0 = (b - b0) * bs, n = n_keys - t0 < bs ? n_keys - t0 : bs;            \
        for (int64_t t = 0; t < n; t++)                                                       \
            for (int64_t h = 0; h < heads; h++) {                                             \
                const float w = scores[h * n_keys + t0 + t];                                  \
                const T *vr = v + t * tok_stride + (h / grp) * d;                             \
                float *acc = part + h * (d + 2);                                              \
                _Pragma("omp simd")                                                           \
                for (int64_t i = 0; i < d; i++) acc[i] += w * LOAD_##NAME(vr, i);             \
            }                                                                                 \
    }                                                                                         \
}                                                                                             \
                                                                                              \
/* out = the splits' partials combined: sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. */   \
static void combine_##NAME(const attn_args *a, const float *parts, int64_t splits, T *out) {  \
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
        const float inv = 1.f / l;                                                            \
        for (int64_t i = 0; i < d; i++) out[h * d + i] = STORE_##NAME(acc[i] * inv);          \
    }                                                                                         \
}

DEFINE_TASK(f32, float)
DEFINE_TASK(bf16, uint16_t)

/* q, out: token i's heads at q + token_index[i] * q_token_stride (same for out).
 * rows[i]: its block-table row; ctx_lens[i]: keys it attends to (positions 0 .. ctx-1),
 * at least 1. head_dim at most 512. Returns 0; -1 when scratch memory can't be had (out
 * is then incomplete); -2 for a head_dim over 512, -3 for an index out of range (a
 * context longer than its table row, a row, token or block id outside its tensor): nothing
 * is read or written then. */
#define DEFINE_ENTRY(NAME, T)                                                                 \
int paged_attention_##NAME(const attn_args *a, const T *q, const T *pool, const int64_t *table, \
                           const int64_t *token_index, const int64_t *rows,                  \
                           const int64_t *ctx_lens, T *out) {                                 \
    const int64_t nq = a->num_queries, bs = a->block_size, d = a->head_dim, heads = a->num_heads; \
    if (nq == 0) return 0;                                                                    \
    if (d > 512) return -2;                                                                   \
    int64_t max_blocks = 1;                                                                   \
    for (int64_t i = 0; i < nq; i++) {                                                        \
        if (ctx_lens[i] < 1 || ctx_lens[i] > a->table_stride * bs || rows[i] < 0             \
            || rows[i] >= a->table_rows || token_index[i] < 0 || token_index[i] >= a->num_tokens) \
            return -3;                                                                        \
        const int64_t nb = (ctx_lens[i] + bs - 1) / bs;                                       \
        max_blocks = nb > max_blocks ? nb : max_blocks;                                       \
        for (int64_t b = 0; b < nb; b++) {                                                    \
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
        float *scratch = malloc(sizeof(float) * heads * (per_split * bs + d));                \
        if (scratch == NULL) failed = 1;                                                      \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t task = 0; task < nq * splits; task++) {                                  \
            const int64_t i = task / splits, s = task % splits;                               \
            const int64_t nb = (ctx_lens[i] + bs - 1) / bs;                                   \
            const int64_t b0 = s * per_split, b1 = (s + 1) * per_split < nb ? (s + 1) * per_split : nb; \
            float *part = parts + task * part_w;                                              \
            if (scratch == NULL || b0 >= b1) { /* an empty split: weight 0 */                 \
                for (int64_t h = 0; h < heads; h++) part[h * (d + 2) + d + 1] = 0.f;          \
                continue;                                                                     \
            }                                                                                 \
            task_##NAME(a, q + token_index[i] * a->q_token_stride, pool, table + rows[i] * a->table_stride, \
                        b0, b1, ctx_lens[i], part, scratch + heads * d, scratch);             \
        }                                                                                     \
        _Pragma("omp for schedule(static)")                                                   \
        for (int64_t i = 0; i < nq; i++)                                                      \
            combine_##NAME(a, parts + i * splits * part_w, splits, out + token_index[i] * a->out_token_stride); \
        free(scratch);                                                                        \
    }                                                                                         \
    free(parts);                                                                              \
    return failed ? -1 : 0;                                                                   \
}

DEFINE_ENTRY(f32, float)
DEFINE_ENTRY(bf16, uint16_t)
