/* The sum of an AVX2 vector's 8 lanes (pairwise: high half onto low, then within 128 bits), for
 * the kernels whose AVX2 path reduces one (half_gemv.c, lowbit_gemv.c). */
#ifndef KVSERVE_VEC_SUM_H
#define KVSERVE_VEC_SUM_H
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
