/* y [M, N] = x [M, K] @ w [N, K]^T in fp32 for the few rows of a decode step, on a copy of w
 * packed once into panels of PW output columns: wp [ceil(N / PW), K, PW], the last panel
 * zero-padded.
 *
 * Why: a decode step multiplies 1..128 rows by every weight matrix. MKL's sgemm packs the weight
 * on every call and takes slow paths for a handful of rows (the 262144 x 640 LM head: 8 rows as
 * slow as 64); against pre-packed panels each step only streams them once. A tile of MR rows x PW
 * columns keeps 2 * MR accumulator registers; for each k it loads one panel row (two vectors) and
 * broadcasts x[i, k] of each row i. Every output is one fp32 FMA chain over k = 0 .. K-1, whatever
 * the tile and thread, so a row gets bitwise the same result alone or in any batch.
 * Measured on this project's 2-core Xeon (docs/BENCHMARKS.md): 1.2-4x MKL for 5-64 rows.
 *
 * AVX-512 (PW 32, MR 12) or AVX2 + FMA (PW 16, MR 6); panel_width() is 0 without either, and the
 * caller keeps PyTorch's matmul.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define VW 16
#define MR 12
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VBCAST _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VZERO _mm512_setzero_ps
#define NEXT_PANEL_PREFETCH 1 /* see panel_gemm */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VW 8
#define MR 6
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VBCAST _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VZERO _mm256_setzero_ps
#define NEXT_PANEL_PREFETCH 0
#endif

#ifdef VW
#define PW (2 * VW)
#define PREFETCH_BYTES 4096

int panel_width(void) { return PW; }

/* w[n, k] at w[n * sn + k * sk] (element strides): row-major weights and the column-major ones the
 * loader keeps for PyTorch's matmuls pack without a contiguous copy first (column-major gives each
 * panel row's PW columns as one contiguous run; row-major reads PW rows' cache lines in turn). */
void pack_panels(const float *w, float *wp, int N, int K, int64_t sn, int64_t sk, int threads) {
    const int P = (N + PW - 1) / PW;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < P; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < PW; j++) {
                const int n = p * PW + j;
                wp[((size_t)p * K + k) * PW + j] = n < N ? w[n * sn + k * sk] : 0.f;
            }
}

/* Rows [0, mr) of x against one panel; ncols (<= PW) of the outputs are real. Each k step also
 * prefetches: `own` (the thread's first panel on its first pass: PREFETCH_BYTES ahead of the row in
 * use) and `next`, pf_step bytes of the thread's next panel, so that panel is in cache when its
 * turn comes instead of its first pass waiting on memory. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *panel, float *y, int K, int ldy,
                                                      int ncols, int own, const char *next, int pf_step,
                                                      const int mr) {
    vec a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) a0[i] = a1[i] = VZERO();
    for (int k = 0; k < K; k++) {
        const float *row = panel + (size_t)k * PW;
        if (own) __builtin_prefetch((const char *)row + PREFETCH_BYTES);
        if (next) { /* pf_step is 64 or 128 (at most a panel row of PW floats) */
            __builtin_prefetch(next);
            if (pf_step > 64) __builtin_prefetch(next + 64);
            next += pf_step;
        }
        const vec w0 = VLOAD(row), w1 = VLOAD(row + VW);
        for (int i = 0; i < mr; i++) {
            const vec xb = VBCAST(x[(size_t)i * K + k]);
            a0[i] = VFMA(xb, w0, a0[i]);
            a1[i] = VFMA(xb, w1, a1[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float *dst = y + (size_t)i * ldy;
        if (ncols == PW) {
            VSTORE(dst, a0[i]);
            VSTORE(dst + VW, a1[i]);
        } else { /* the zero-padded last panel */
            float tmp[PW];
            VSTORE(tmp, a0[i]);
            VSTORE(tmp + VW, a1[i]);
            memcpy(dst, tmp, sizeof(float) * (size_t)ncols);
        }
    }
}

#define ROWS(r) case r: tile(xm, panel, ym, K, N, ncols, own, pf, pf_step, r); break;

/* Each thread takes a contiguous range of panels (as schedule(static) would) and runs every row tile
 * against one panel before the next. With AVX-512's 128-byte panel rows (80 KB panels at K = 640),
 * the first pass over a panel waited on memory: there each thread prefetches its next panel, spread
 * evenly over this panel's passes (1.1-1.25x for 4-256 rows with 18 layers' weights streamed from
 * memory, neutral at 512-2048, on a Zen 4). With AVX2's 64-byte rows the same cost ~5%, so there
 * the first pass of each panel prefetches that panel ahead instead. The arithmetic is unchanged. */
void panel_gemm(const float *x, const float *wp, float *y, int M, int N, int K, int threads) {
    const int P = (N + PW - 1) / PW, passes = (M + MR - 1) / MR;
    const size_t panel_bytes = (size_t)K * PW * sizeof(float);
    /* bytes of the next panel per k step of every pass, in whole cache lines: 64 or 128 */
    const int pf_step = (int)((panel_bytes + (size_t)passes * K - 1) / ((size_t)passes * K) + 63) / 64 * 64;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p0 = (int)((int64_t)P * t / nt), p1 = (int)((int64_t)P * (t + 1) / nt);
        for (int p = p0; p < p1; p++) {
            const float *panel = wp + (size_t)p * K * PW;
            const int ncols = N - p * PW < PW ? N - p * PW : PW;
            const char *next = NEXT_PANEL_PREFETCH && p + 1 < p1 ? (const char *)(panel + (size_t)K * PW) : NULL;
            for (int m = 0; m < M; m += MR) {
                const float *xm = x + (size_t)m * K;
                float *ym = y + (size_t)m * N + (size_t)p * PW;
                const int own = m == 0 && (p == p0 || !NEXT_PANEL_PREFETCH);
                const size_t done = (size_t)(m / MR) * K * pf_step; /* of the next panel, by earlier passes */
                const char *pf = next && done < panel_bytes ? next + done : NULL;
                switch (M - m < MR ? M - m : MR) {
                    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR > 6
                    ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
                }
            }
        }
    }
}
#else
int panel_width(void) { return 0; }
void pack_panels(const float *w, float *wp, int N, int K, int64_t sn, int64_t sk, int threads) {
    (void)w, (void)wp, (void)N, (void)K, (void)sn, (void)sk, (void)threads;
}
void panel_gemm(const float *x, const float *wp, float *y, int M, int N, int K, int threads) {
    (void)x, (void)wp, (void)y, (void)M, (void)N, (void)K, (void)threads;
}
#endif
