/* Peak arithmetic rates of this CPU's vector units, for benchmarks/throughput_floor.py.
 *
 * Each loop keeps 12 independent accumulators in registers (enough to cover the latency of an FMA
 * or of a multiply-add at two issues a cycle) and runs `iters` rounds per thread, all threads in
 * parallel. An empty asm statement makes an operand look changed (every round for the FMAs, whose
 * accumulators already differ; before every multiply-add, whose products would otherwise be one
 * common subexpression), so the compiler can neither hoist the multiply out of the loop nor fold it
 * away. The vectors are the ones the kernels use on this build: 512-bit where the compiler sees
 * AVX-512 (a Zen 5 runs them at twice a 256-bit vector's rate, a Zen 4 at the same), else 256-bit;
 * the int16 loop runs the greedy screen's instruction (vpdpwssd with VNNI, else vpmaddwd + vpaddd).
 * Built with AVX2 + FMA (x86-64); elsewhere the functions return -1 and the caller reports no peak.
 */
#include <omp.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef __m512 fvec;
#define F_LANES 16
#define F_SET1 _mm512_set1_ps
#define F_FMA _mm512_fmadd_ps
#define F_SUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 fvec;
#define F_LANES 8
#define F_SET1 _mm256_set1_ps
#define F_FMA _mm256_fmadd_ps
static inline float F_SUM(__m256 v) {
    float out[8], s = 0.f;
    _mm256_storeu_ps(out, v);
    for (int j = 0; j < 8; j++) s += out[j];
    return s;
}
#endif

#if defined(__AVX512BW__)
typedef __m512i ivec;
#define I_LANES 16
#define I_SET1_16 _mm512_set1_epi16
#define I_ZERO _mm512_setzero_si512
#define I_SUM _mm512_reduce_add_epi32
#if defined(__AVX512VNNI__)
#define I_MADD(acc, h, w) _mm512_dpwssd_epi32((acc), (h), (w))
#else
#define I_MADD(acc, h, w) _mm512_add_epi32((acc), _mm512_madd_epi16((h), (w)))
#endif
#elif defined(__AVX2__)
typedef __m256i ivec;
#define I_LANES 8
#define I_SET1_16 _mm256_set1_epi16
#define I_ZERO _mm256_setzero_si256
static inline int32_t I_SUM(__m256i v) {
    int32_t out[8], s = 0;
    _mm256_storeu_si256((__m256i *)out, v);
    for (int j = 0; j < 8; j++) s += out[j];
    return s;
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I_MADD(acc, h, w) _mm256_dpwssd_epi32((acc), (h), (w))
#elif defined(__AVXVNNI__)
#define I_MADD(acc, h, w) _mm256_dpwssd_avx_epi32((acc), (h), (w))
#else
#define I_MADD(acc, h, w) _mm256_add_epi32((acc), _mm256_madd_epi16((h), (w)))
#endif
#endif

/* The number of threads each loop below runs on. */
int peak_threads(void) { return omp_get_max_threads(); }

/* fp32 lanes of one vector FMA in fp32_fma_peak (0 without AVX2 + FMA). */
int fp32_lanes(void) {
#ifdef F_LANES
    return F_LANES;
#else
    return 0;
#endif
}

/* int32 lanes of one multiply-add in int16_madd_peak, each summing 2 int16 products (0 without AVX2). */
int int32_lanes(void) {
#ifdef I_LANES
    return I_LANES;
#else
    return 0;
#endif
}

/* fp32 FMAs: returns a checksum (so the work is observable); 12 x F_LANES x 2 flops a round. */
double fp32_fma_peak(int64_t iters) {
#ifdef F_LANES
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        /* distinct starting values: identical accumulators would be merged into one */
        fvec a0 = F_SET1(0.0f), a1 = F_SET1(0.1f), a2 = F_SET1(0.2f), a3 = F_SET1(0.3f);
        fvec a4 = F_SET1(0.4f), a5 = F_SET1(0.5f), a6 = F_SET1(0.6f), a7 = F_SET1(0.7f);
        fvec a8 = F_SET1(0.8f), a9 = F_SET1(0.9f), a10 = F_SET1(1.0f), a11 = F_SET1(1.1f);
        fvec x = F_SET1(0.999f), y = F_SET1(1e-7f);
        for (int64_t i = 0; i < iters; i++) {
            __asm__ volatile("" : "+v"(x));
            a0 = F_FMA(a0, x, y), a1 = F_FMA(a1, x, y), a2 = F_FMA(a2, x, y), a3 = F_FMA(a3, x, y);
            a4 = F_FMA(a4, x, y), a5 = F_FMA(a5, x, y), a6 = F_FMA(a6, x, y), a7 = F_FMA(a7, x, y);
            a8 = F_FMA(a8, x, y), a9 = F_FMA(a9, x, y), a10 = F_FMA(a10, x, y), a11 = F_FMA(a11, x, y);
        }
        total += F_SUM(a0) + F_SUM(a1) + F_SUM(a2) + F_SUM(a3) + F_SUM(a4) + F_SUM(a5);
        total += F_SUM(a6) + F_SUM(a7) + F_SUM(a8) + F_SUM(a9) + F_SUM(a10) + F_SUM(a11);
    }
    return total;
#else
    (void)iters;
    return -1.0;
#endif
}

/* int16 multiply-adds as the greedy screen does them, into int32: 12 x I_LANES x 2 multiply-adds a
 * round. Returns a checksum. */
double int16_madd_peak(int64_t iters) {
#ifdef I_LANES
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        ivec a0 = I_ZERO(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        ivec a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        ivec x = I_SET1_16(3), y = I_SET1_16(-2);
#define STEP(a)                           \
    __asm__ volatile("" : "+v"(x));       \
    a = I_MADD(a, x, y)
        for (int64_t i = 0; i < iters; i++) {
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
            STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
        }
#undef STEP
        total += (double)I_SUM(a0) + I_SUM(a1) + I_SUM(a2) + I_SUM(a3) + I_SUM(a4) + I_SUM(a5);
        total += (double)I_SUM(a6) + I_SUM(a7) + I_SUM(a8) + I_SUM(a9) + I_SUM(a10) + I_SUM(a11);
    }
    return total;
#else
    (void)iters;
    return -1.0;
#endif
}
