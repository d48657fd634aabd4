/* RMSNorm of a few fp32 rows: y = x * (1 / sqrt(mean(x^2) + eps)) * gain, one call instead of the
 * ~8 ops of torch's CPU rms_norm (a decode step runs ~110 norms of one token each, where the
 * per-op overhead is the cost). gain [d] fp32 (Gemma: 1 + w). */
#include <math.h>

void rms_norm(const float *x, const float *gain, float *y, int rows, int d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 8) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * d;
        float *yr = y + (long)r * d;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int k = 0; k < d; k++) ss += xr[k] * xr[k];
        const float inv = 1.f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int k = 0; k < d; k++) yr[k] = xr[k] * inv * gain[k];
    }
}
