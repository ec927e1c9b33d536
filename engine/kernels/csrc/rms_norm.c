/* Residual add and RMSNorm in one pass (see engine/kernels/native.py for how this is built).
 *
 * For each row: h += residual (when given, rounded to the tensor's dtype, as torch's add
 * is), then out = weight * round(h * rsqrt(mean(h^2) + eps)), the variance in float32 and
 * the normalised value rounded to the dtype before the weight multiplies it, in the order
 * Hugging Face's LlamaRMSNorm rounds. The sum of squares may add in another order than
 * torch's, so results can differ from it in the last bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define bf16_in bf16_to_f32
#define bf16_out f32_to_bf16

static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }
static inline float bf16_round(float x) { return bf16_in(bf16_out(x)); }
static inline float f32_round(float x) { return x; }

#define DEFINE_NORM(NAME, T)                                                                  \
void add_rms_norm_##NAME(T *h, const T *residual, const T *weight, T *out, int64_t rows,     \
                         int64_t dim, float eps, int32_t num_threads) {                       \
    _Pragma("omp parallel for num_threads(num_threads) if (rows * dim >= 262144) schedule(static)") \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        T *hr = h + r * dim;                                                                  \
        T *o = out + r * dim;                                                                 \
        float ss = 0.f;                                                                       \
        if (residual != NULL) {                                                               \
            const T *a = residual + r * dim;                                                  \
            _Pragma("omp simd reduction(+ : ss)")                                             \
            for (int64_t i = 0; i < dim; i++) {                                               \
                const float v = NAME##_round(NAME##_in(hr[i]) + NAME##_in(a[i]));             \
                hr[i] = NAME##_out(v);                                                        \
                ss += v * v;                                                                  \
            }                                                                                 \
        } else {                                                                              \
            _Pragma("omp simd reduction(+ : ss)")                                             \
            for (int64_t i = 0; i < dim; i++) {                                               \
                const float v = NAME##_in(hr[i]);                                             \
                ss += v * v;                                                                  \
            }                                                                                 \
        }                                                                                     \
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);                                 \
        _Pragma("omp simd")                                                                   \
        for (int64_t i = 0; i < dim; i++)                                                     \
            o[i] = NAME##_out(NAME##_in(weight[i]) * NAME##_round(NAME##_in(hr[i]) * inv));   \
    }                                                                                         \
}

DEFINE_NORM(f32, float)
#if HAVE_BF16X16 /* explicit vectors: the compiler's own bfloat16 packing was several times slower */
void add_rms_norm_bf16(uint16_t *h, const uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                       int64_t dim, float eps, int32_t num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * dim >= 262144) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim, *o = out + r * dim;
        const uint16_t *a = residual != NULL ? residual + r * dim : NULL;
        __m512 acc = _mm512_setzero_ps();
        float ss = 0.f;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            __m512 v = bf16x16_load(hr + i);
            if (a != NULL) {
                v = bf16x16_round(_mm512_add_ps(v, bf16x16_load(a + i)));
                bf16x16_store(hr + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        for (; i < dim; i++) {
            const float v = a != NULL ? bf16_round(bf16_in(hr[i]) + bf16_in(a[i])) : bf16_in(hr[i]);
            if (a != NULL) hr[i] = bf16_out(v);
            ss += v * v;
        }
        ss += _mm512_reduce_add_ps(acc);
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        const __m512 invv = _mm512_set1_ps(inv);
        for (i = 0; i + 16 <= dim; i += 16)
            bf16x16_store(o + i, _mm512_mul_ps(bf16x16_load(weight + i),
                                               bf16x16_round(_mm512_mul_ps(bf16x16_load(hr + i), invv))));
        for (; i < dim; i++) o[i] = bf16_out(bf16_in(weight[i]) * bf16_round(bf16_in(hr[i]) * inv));
    }
}
#else
DEFINE_NORM(bf16, uint16_t)
#endif
