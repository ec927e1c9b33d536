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
 * overlaps compute instead of following it. Decode batches of 16 to 64 rows (two to eight
 * row blocks) gain most from that: about 20 % over oneDNN on the `small` model's linears
 * on this project's 2-core machine, as fast or faster at every batch size measured.
 *
 * Rounding: products of bfloat16 pairs are exact in float32 and added in float32 with
 * round-to-nearest-even (the instruction flushes float32 denormals to zero); the
 * output is rounded once. The sum order differs from oneDNN's, so results equal
 * F.linear up to float32 summation order, then bfloat16 rounding.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define MR 8
#define NR 3

/* One row block of one tile group: y[0..mr) x [0..16 nr) over all of K. */
static inline __attribute__((always_inline)) void row_block(
    const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, int mr, int nr,
    const uint16_t *bias, uint16_t *y, int64_t ldy,
    const uint16_t *next, int num_next, int64_t next_line, int64_t next_end, int every)
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
                    _mm_prefetch((const char *)(next + j * tile + next_line * 32), _MM_HINT_T2);
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
        for (int i = 0; i < mr; i++)
            _mm256_storeu_si256((__m256i *)(y + i * ldy + j * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
    }
}

/* mr and nr as constants, so each instance keeps its accumulators in registers. */
#define ROWS(m) case m: switch (nr) { \
    case 1: row_block(x, ldx, w, pairs, m, 1, bias, y, ldy, next, num_next, line, end, every); return; \
    case 2: row_block(x, ldx, w, pairs, m, 2, bias, y, ldy, next, num_next, line, end, every); return; \
    default: row_block(x, ldx, w, pairs, m, 3, bias, y, ldy, next, num_next, line, end, every); return; }

static void dispatch(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, int mr, int nr,
                     const uint16_t *bias, uint16_t *y, int64_t ldy,
                     const uint16_t *next, int num_next, int64_t line, int64_t end, int every) {
    switch (mr) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) default: ROWS(8) }
}

int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads) {
    if (rows < 0 || n % 16 || k % 2 || ldx < k || ldy < n) return -3;
    const int64_t pairs = k / 2, tiles = n / 16, groups = (tiles + NR - 1) / NR;
    const int64_t blocks = (rows + MR - 1) / MR;
    const int64_t lines_per_block = blocks > 0 ? (pairs + blocks - 1) / blocks : 0;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = g * NR, t1 = t0 + NR;
        const int nr = (int)(tiles - t0 < NR ? tiles - t0 : NR);
        /* a single row block streams at memory speed already: prefetching only competes */
        const int num_next = blocks > 1 && t1 < tiles ? (int)(tiles - t1 < NR ? tiles - t1 : NR) : 0;
        const uint16_t *w = packed + t0 * pairs * 32, *next = packed + (num_next ? t1 : t0) * pairs * 32;
        for (int64_t r = 0; r < blocks; r++) {
            const int64_t m0 = r * MR, line = r * lines_per_block;
            const int64_t end = line + lines_per_block < pairs ? line + lines_per_block : pairs;
            dispatch(x + m0 * ldx, ldx, w, pairs, (int)(rows - m0 < MR ? rows - m0 : MR), nr,
                     bias ? bias + t0 * 16 : 0, y + m0 * ldy + t0 * 16, ldy,
                     next, num_next, line, end, (int)blocks);
        }
    }
    return 0;
}

int linear_bf16_available(void) { return 1; }

#else /* no AVX-512 BF16 on the CPU this was built for: callers keep oneDNN */

int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int num_threads) {
    (void)x; (void)ldx; (void)packed; (void)bias; (void)y; (void)ldy; (void)rows; (void)n; (void)k;
    (void)num_threads;
    return -1;
}

int linear_bf16_available(void) { return 0; }

#endif
