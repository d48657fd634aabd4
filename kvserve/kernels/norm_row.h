/* The RMSNorm of one fp32 row, shared by rms_norm.c and rope_cache.c so that a vector normalized
 * by either kernel is bitwise the same (one definition, same flags, never inlined into loops that
 * could change its summation order). */
#ifndef KVSERVE_NORM_ROW_H
#define KVSERVE_NORM_ROW_H
#include <math.h>

/* y[k] = x[k] * (1 / sqrt(mean(x^2) + eps)) * gain[k]; y may alias x. */
__attribute__((noinline)) static void norm_row(const float *x, const float *gain, float *y, int d, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int k = 0; k < d; k++) ss += x[k] * x[k];
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
#pragma omp simd
    for (int k = 0; k < d; k++) y[k] = x[k] * inv * gain[k];
}
#endif
