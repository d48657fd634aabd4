/* A few fp32 activation rows times a 16-bit weight matrix (decode steps of a bf16 / fp16
 * checkpoint kept in 16 bits, kvserve.weights.half.HalfLinear):
 *
 * half_gemv: y[m, n] = sum_k x[m, k] w[n, k], w bf16 or fp16 [N, K] row-major (as the checkpoint
 *   stores it), x [M, K] fp32, y [M, N] fp32. Each weight is widened to fp32 in registers (bf16: a
 *   16-bit shift; fp16: the F16C / AVX-512 conversion, exact) and the products are summed in fp32,
 *   so a row equals the fp32 model holding the widened weights up to the order of the sum.
 *
 * The weights stream once: up to 4 activation rows share each widened vector. Every row has
 * the same accumulators in the same order whatever M and its place in the group, so a sequence
 * decodes the same alone or in a batch. Threads split the output columns (weight rows).
 * A software prefetch 4 KB ahead of the weight row being read, as in lowbit_gemv.c.
 * AVX-512 or AVX2 + F16C where the compiler targets it (-march=native), plain loops otherwise.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define HALF_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec_sum.h"
#define HALF_AVX2 1
#endif

#define PREFETCH_HALVES 2048 /* 4 KB of weights ahead */
#define ROW_GROUP 4          /* activation rows that share one widened weight vector */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16 -> binary32, exact (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: shift the mantissa up to an implicit 1 */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while ((m & 0x400) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float widen(uint16_t h, int bf16) { return bf16 ? bf16_to_f32(h) : f16_to_f32(h); }

#if defined(HALF_AVX512)
typedef __m512 vf;
#define VW 16
static inline vf load_w(const uint16_t *p, int bf16) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)) : _mm512_cvtph_ps(v);
}
#define FMA_F _mm512_fmadd_ps
#define LOAD_F _mm512_loadu_ps
#define ZERO_F _mm512_setzero_ps
#define ADD_F _mm512_add_ps
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(HALF_AVX2)
typedef __m256 vf;
#define VW 8
static inline vf load_w(const uint16_t *p, int bf16) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)) : _mm256_cvtph_ps(v);
}
#define FMA_F _mm256_fmadd_ps
#define LOAD_F _mm256_loadu_ps
#define ZERO_F _mm256_setzero_ps
#define ADD_F _mm256_add_ps
static inline float hsum(vf v) { return hsum256(v); }
#endif

/* out[r] = sum_k x[r * K + k] wr[k] for `rows` (1..ROW_GROUP, a constant once inlined) rows.
 * Per row: two vector accumulators over k strides of 2 VW, one more vector step, their sum
 * reduced, then the scalar tail: the same operations for every row. */
static inline __attribute__((always_inline)) void rows_dot(const float *x, size_t K, const uint16_t *wr, int bf16,
                                                           const int rows, float *out) {
    size_t k = 0;
    float tail[ROW_GROUP];
#if defined(HALF_AVX512) || defined(HALF_AVX2)
    vf a0[ROW_GROUP], a1[ROW_GROUP];
    for (int r = 0; r < rows; r++) a0[r] = a1[r] = ZERO_F();
    for (; k + 2 * VW <= K; k += 2 * VW) {
        __builtin_prefetch(wr + k + PREFETCH_HALVES); /* a hint: past the end is harmless */
        const vf w0 = load_w(wr + k, bf16), w1 = load_w(wr + k + VW, bf16);
        for (int r = 0; r < rows; r++) {
            a0[r] = FMA_F(w0, LOAD_F(x + r * K + k), a0[r]);
            a1[r] = FMA_F(w1, LOAD_F(x + r * K + k + VW), a1[r]);
        }
    }
    if (k + VW <= K) {
        const vf w0 = load_w(wr + k, bf16);
        for (int r = 0; r < rows; r++) a0[r] = FMA_F(w0, LOAD_F(x + r * K + k), a0[r]);
        k += VW;
    }
    for (int r = 0; r < rows; r++) tail[r] = hsum(ADD_F(a0[r], a1[r]));
#else
    for (int r = 0; r < rows; r++) tail[r] = 0.f;
#endif
    for (; k < K; k++) {
        const float w = widen(wr[k], bf16);
        for (int r = 0; r < rows; r++) tail[r] += x[r * K + k] * w;
    }
    for (int r = 0; r < rows; r++) out[r] = tail[r];
}

void half_gemv(const float *x, const uint16_t *w, int bf16, float *y, int M, int N, int K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint16_t *wr = w + (size_t)n * K;
        float out[ROW_GROUP];
        int m = 0;
        for (; m + ROW_GROUP <= M; m += ROW_GROUP) {
            rows_dot(x + (size_t)m * K, (size_t)K, wr, bf16, ROW_GROUP, out);
            for (int r = 0; r < ROW_GROUP; r++) y[(size_t)(m + r) * N + n] = out[r];
        }
        const int rest = M - m;
        if (rest == 3) rows_dot(x + (size_t)m * K, (size_t)K, wr, bf16, 3, out);
        else if (rest == 2) rows_dot(x + (size_t)m * K, (size_t)K, wr, bf16, 2, out);
        else if (rest == 1) rows_dot(x + (size_t)m * K, (size_t)K, wr, bf16, 1, out);
        for (int r = 0; r < rest; r++) y[(size_t)(m + r) * N + n] = out[r];
    }
}
