/* Vectorisable float32 exponentials for the kernels in engine/kernels/csrc (glibc's expf is not
 * vectorised): Cephes' range reduction to r in [-ln2/2, ln2/2] and a degree-6
 * polynomial, within 2 ulp of e^x. */
#ifndef SPLITSERVE_FASTMATH_H
#define SPLITSERVE_FASTMATH_H

#include <stdint.h>
#include <string.h>

/* e^x for -87 <= x <= 89 (callers clamp); infinity from x = 88.73 on, as expf. */
static inline float exp_clamped(float x) {
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t n1 = (int32_t)n / 2, n2 = (int32_t)n - n1; /* 2^n as two factors: n reaches 128 */
    int32_t bits1 = (n1 + 127) << 23, bits2 = (n2 + 127) << 23;
    float scale1, scale2;
    memcpy(&scale1, &bits1, sizeof scale1);
    memcpy(&scale2, &bits2, sizeof scale2);
    return p * scale1 * scale2;
}

/* e^x for x <= 0 (scores minus their max); below -87 it returns 2^-126, which is 0 for
 * every use here (weights next to e^0 = 1). */
static inline float exp_nonpos(float x) { return exp_clamped(x < -87.f ? -87.f : x); }

/* x / (1 + e^-x), as torch's silu computes it (e^-x is infinite below x = -88.73 and the
 * result -0; above x = 87 e^-x is nothing next to 1). */
static inline float silu(float x) {
    const float y = -x;
    return x / (1.f + exp_clamped(y < -87.f ? -87.f : y > 89.f ? 89.f : y));
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_clamped on 16 lanes (the same reduction and polynomial, 2^n applied by scalef, so
 * it overflows to infinity by itself past x = 88.73). */
static inline __m512 exp16_clamped(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* silu on 16 lanes, as silu() */
static inline __m512 silu16(__m512 x) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-87.f)),
                                   _mm512_set1_ps(89.f));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16_clamped(y)));
}
#endif

#endif
