/* RMSNorm of a few fp32 rows: y = x * (1 / sqrt(mean(x^2) + eps)) * gain, one call instead of the
 * ~8 ops of torch's CPU rms_norm (a decode step runs ~110 norms of one token each, where the
 * per-op overhead is the cost). gain [d] fp32 (Gemma: 1 + w). */
#include "norm_row.h"

void rms_norm(const float *x, const float *gain, float *y, int rows, int d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 8) schedule(static)
    for (int r = 0; r < rows; r++) norm_row(x + (long)r * d, gain, y + (long)r * d, d, eps);
}

/* The sandwich norm's residual add in the same call: y = residual + norm(x) * gain, the sum
 * rounded once as torch's `residual + norm(x)` rounds it. With gain2 (not NULL) also
 * y2 = norm(y) * gain2: the next norm of the layer (Gemma's pre-feedforward norm) in the same call. */
void add_rms_norm(const float *x, const float *gain, const float *residual, float *y, const float *gain2, float *y2,
                  int rows, int d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 8) schedule(static)
    for (int r = 0; r < rows; r++) {
        float *yr = y + (long)r * d;
        const float *res = residual + (long)r * d;
        norm_row(x + (long)r * d, gain, yr, d, eps);
#pragma omp simd
        for (int k = 0; k < d; k++) yr[k] = res[k] + yr[k];
        if (gain2) norm_row(yr, gain2, y2 + (long)r * d, d, eps);
    }
}
