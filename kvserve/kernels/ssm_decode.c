/* One decode token of Mamba2's SSM for B sequences, updating each sequence's state in place in
 * the state pool (kvserve/model/mamba.py, Mamba2Mixer._decode_ssm is the torch form):
 *
 *   h = (has_state ? h : 0) * exp(dt A) + (dt x) B^T,   y = h C + D x
 *
 * per head h [P, N]. torch builds [B, H, P, N] temporaries for each of the four products (the
 * state is read once and written five times); here each state row is read and written once, the
 * readout summed while it is in registers. pool [slots, H, P, N], slots [B] int64, has_state [B]
 * uint8, x [B, H, P], dt [B, H] (after softplus), A [H], Bm and Cm [B, H, N] (a group's B and C
 * repeated for its heads), D [H], y [B, H, P]; all fp32, contiguous. One task per (sequence, head).
 * The readout's sum runs in 16 partial sums (vectorizable without reassociating the source's
 * order per lane), so it differs from torch's sum in the last bits only. */
#include <math.h>
#include <stdint.h>

#define LANES 16

void ssm_decode(float *pool, const int64_t *slots, const uint8_t *has_state, const float *x, const float *dt,
                const float *A, const float *Bm, const float *Cm, const float *D, float *y, int B, int H, int P,
                int N, int threads) {
    const int64_t tasks = (int64_t)B * H;
#pragma omp parallel for num_threads(threads) if (tasks * P * N >= 65536) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / H, h = t % H;
        const float d = dt[t];
        const float decay = expf(d * A[h]);
        const float keep = has_state[b] ? 1.0f : 0.0f;
        float *st = pool + (slots[b] * H + h) * (int64_t)P * N;
        const float *bv = Bm + t * (int64_t)N, *cv = Cm + t * (int64_t)N;
        const float *xs = x + t * (int64_t)P;
        float *ys = y + t * (int64_t)P;
        for (int p = 0; p < P; p++) {
            float *s = st + (int64_t)p * N;
            const float xd = d * xs[p];
            float part[LANES] = {0};
            int n = 0;
            for (; n + LANES <= N; n += LANES)
                for (int l = 0; l < LANES; l++) {
                    const float v = (keep ? s[n + l] * decay : 0.0f) + xd * bv[n + l];
                    s[n + l] = v;
                    part[l] += v * cv[n + l];
                }
            float acc = 0.0f;
            for (int l = 0; l < LANES; l++) acc += part[l];
            for (; n < N; n++) {
                const float v = (keep ? s[n] * decay : 0.0f) + xd * bv[n];
                s[n] = v;
                acc += v * cv[n];
            }
            ys[p] = acc + D[h] * xs[p];
        }
    }
}
