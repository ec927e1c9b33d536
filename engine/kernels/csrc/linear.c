/* y = x @ W^T (+ bias) in bfloat16, float32 accumulation, for CPUs with AVX-512 BF16.
 *
 * W [N, K] is packed once, at load time, into 16-column tiles of bfloat16 pairs:
 * packed[t][p][c][i] = W[16 t + c][2 p + i], so one 64-byte line holds what one
 * vdpbf16ps needs for 16 outputs over 2 inputs and a tile is one contiguous stream.
 *
 * Work is split by groups of NR tiles (48 outputs) across threads. Within a group, rows
 * go by blocks of MR: 8 x 3 float32 accumulators stay in registers, each weight line is
 * loaded once per row block and each pair of x values is broadcast once per row block.
 * The group's weights (NR * K * 32 bytes) stay in L2 for the later row blocks, so with
 * more than one row block the first one is the only one reading DRAM; while they run,
 * the next group is prefetched, spread evenly over the row blocks, so the weight stream
 * overlaps compute instead of following it. Each thread's last group prefetches its first
 * group of the linear that runs next (`after`, the model's next projection), so a call
 * doesn't start by waiting on DRAM either. Decode batches of 16 to 64 rows (two to eight
 * row blocks) gain most from that: about 20 % over oneDNN on the `small` model's linears
 * on this project's 2-core machine, as fast or faster at every batch size measured.
 *
 * Rounding: products of bfloat16 pairs are exact in float32 and added in float32 with
 * round-to-nearest-even (the instruction flushes float32 denormals to zero); the
 * output is rounded once. The sum order differs from oneDNN's, so results equal
 * F.linear up to float32 summation order, then bfloat16 rounding.
 *
 * SwiGLU epilogue (`swiglu`): the weight is the MLP's gate and up projections with their
 * rows interleaved by 8 (`pack_linear(..., swiglu=True)`: each 16-output tile is 8 gate
 * rows, then the same 8 up rows), and the kernel stores silu(gate) * up, [rows, n / 2],
 * instead of [gate | up]: the activation pass, its fork and join, and the round trip of
 * the projection's output through memory are gone. Bit for bit what pointwise.c's
 * silu_mul makes of the plain layout's output (the same roundings, the same silu).
 */
#pragma GCC optimize("fp-contract=off") /* the epilogue's silu rounds as pointwise.c's does */

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#include "bf16.h"
#include "fastmath.h"
#include "kernels.h"

#define MR 8
#define NR 3

/* One row block of one tile group: y[0..mr) x [0..16 nr) over all of K. */
static inline __attribute__((always_inline)) void row_block(
    const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, int mr, int nr,
    const uint16_t *bias, uint16_t *y, int64_t ldy, int swiglu,
    const uint16_t *next, int num_next, int64_t next_tile, int64_t next_line, int64_t next_end, int every)
{
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t tile = pairs * 32; /* elements per tile */
    int count = 0;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * tile + p * 32);
        if (++count == every) { /* one line of each next tile every `every` pairs */
            count = 0;
            if (next_line < next_end) {
                for (int j = 0; j < num_next; j++)
                    _mm_prefetch((const char *)(next + j * next_tile + next_line * 32), _MM_HINT_T2);
                next_line++;
            }
        }
        for (int i = 0; i < mr; i++) {
            int32_t two;
            memcpy(&two, x + i * ldx + 2 * p, sizeof two);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int j = 0; j < nr; j++) {
        __m512 b = _mm512_setzero_ps();
        if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + j * 16))), 16));
        for (int i = 0; i < mr; i++) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
            if (!swiglu) {
                _mm256_storeu_si256((__m256i *)(y + i * ldy + j * 16), (__m256i)out);
                continue;
            }
            /* lanes 0-7: 8 outputs' gate, 8-15: their up, each rounded as the plain store rounds */
            const __m512 gu = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)out), 16));
            const __m512 up = _mm512_shuffle_f32x4(gu, gu, 0xee);
            const __m256i act = bf16x16_pack(_mm512_mul_ps(bf16x16_round(silu16(gu)), up));
            _mm_storeu_si128((__m128i *)(y + i * ldy + j * 8), _mm256_castsi256_si128(act));
        }
    }
}

/* mr and nr as constants, so each instance keeps its accumulators in registers. */
#define ROWS(m) case m: switch (nr) { \
    case 1: row_block(x, ldx, w, pairs, m, 1, bias, y, ldy, swiglu, next, num_next, tile, line, end, every); return; \
    case 2: row_block(x, ldx, w, pairs, m, 2, bias, y, ldy, swiglu, next, num_next, tile, line, end, every); return; \
    default: row_block(x, ldx, w, pairs, m, 3, bias, y, ldy, swiglu, next, num_next, tile, line, end, every); \
        return; }

static void dispatch(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, int mr, int nr,
                     const uint16_t *bias, uint16_t *y, int64_t ldy, int swiglu,
                     const uint16_t *next, int num_next, int64_t tile, int64_t line, int64_t end, int every) {
    switch (mr) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) default: ROWS(8) }
}

/* Thread `me` of `threads` takes groups [*g0, *g1): contiguous, sizes differing by at most one. */
static void split(int64_t groups, int threads, int me, int64_t *g0, int64_t *g1) {
    const int64_t q = groups / threads, r = groups % threads;
    *g0 = me * q + (me < r ? me : r);
    *g1 = *g0 + q + (me < r ? 1 : 0);
}

/* A tile group to prefetch while one is computed: its first tile, tiles, tile stride and
 * lines (pairs) per tile. */
typedef struct { const uint16_t *first; int tiles; int64_t tile, pairs; } upcoming;

static upcoming group_of(const uint16_t *packed, int64_t n, int64_t k, int64_t g) {
    const int64_t pairs = k / 2, tiles = n / 16, t0 = g * NR;
    const upcoming u = {packed + t0 * pairs * 32, (int)(tiles - t0 < NR ? tiles - t0 : NR), pairs * 32, pairs};
    return u;
}

/* after (may be NULL): the packed weights [after_n / 16, after_k / 2, 16, 2] of the linear
 * the caller runs next, with the same number of threads. swiglu: y is [rows, n / 2]. */
static int linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                  uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads,
                  const uint16_t *after, int64_t after_n, int64_t after_k, int swiglu) {
    if (rows < 0 || n % 16 || k % 2 || ldx < k || ldy < (swiglu ? n / 2 : n)) return -3;
    if (after && (after_n <= 0 || after_n % 16 || after_k <= 0 || after_k % 2)) return -3;
    const int64_t pairs = k / 2, tiles = n / 16, groups = (tiles + NR - 1) / NR;
    const int64_t blocks = (rows + MR - 1) / MR;
    #pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t g0, g1;
        split(groups, threads, me, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) {
            const int64_t t0 = g * NR;
            const int nr = (int)(tiles - t0 < NR ? tiles - t0 : NR);
            /* a single row block streams at memory speed already: prefetching only competes */
            upcoming next = {0, 0, 0, 0};
            if (blocks > 1 && g + 1 < g1) {
                next = group_of(packed, n, k, g + 1);
            } else if (blocks > 1 && after) { /* this thread's first group of the next call */
                int64_t a0, a1;
                split((after_n / 16 + NR - 1) / NR, threads, me, &a0, &a1);
                if (a0 < a1) next = group_of(after, after_n, after_k, a0);
            }
            const int64_t per_block = next.tiles ? (next.pairs + blocks - 1) / blocks : 0;
            const int every = (int)(per_block && pairs / per_block > 1 ? pairs / per_block : 1);
            const uint16_t *w = packed + t0 * pairs * 32;
            for (int64_t r = 0; r < blocks; r++) {
                const int64_t m0 = r * MR, line = r * per_block;
                const int64_t end = line + per_block < next.pairs ? line + per_block : next.pairs;
                dispatch(x + m0 * ldx, ldx, w, pairs, (int)(rows - m0 < MR ? rows - m0 : MR), nr,
                         bias ? bias + t0 * 16 : 0, y + m0 * ldy + t0 * (swiglu ? 8 : 16), ldy, swiglu,
                         next.first ? next.first : w, next.tiles, next.tile, line, end, every);
            }
        }
    }
    return 0;
}

int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads,
                const uint16_t *after, int64_t after_n, int64_t after_k) {
    return linear(x, ldx, packed, bias, y, ldy, rows, n, k, num_threads, after, after_n, after_k, 0);
}

/* The SwiGLU epilogue: packed and bias interleaved by 8 (see the top); y [rows, n / 2]. */
int linear_swiglu_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                       uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads,
                       const uint16_t *after, int64_t after_n, int64_t after_k) {
    return linear(x, ldx, packed, bias, y, ldy, rows, n, k, num_threads, after, after_n, after_k, 1);
}

int linear_bf16_available(void) { return 1; }

#else /* no AVX-512 BF16 on the CPU this was built for: callers keep oneDNN */

int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads,
                const uint16_t *after, int64_t after_n, int64_t after_k) {
    (void)x; (void)ldx; (void)packed; (void)bias; (void)y; (void)ldy; (void)rows; (void)n; (void)k;
    (void)num_threads; (void)after; (void)after_n; (void)after_k;
    return -1;
}

int linear_swiglu_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                       uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads,
                       const uint16_t *after, int64_t after_n, int64_t after_k) {
    return linear_bf16(x, ldx, packed, bias, y, ldy, rows, n, k, num_threads, after, after_n, after_k);
}

int linear_bf16_available(void) { return 0; }

#endif
