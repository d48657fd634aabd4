/* Peak arithmetic rates of this CPU's vector units, for benchmarks/throughput_floor.py.
 *
 * Each loop keeps 12 independent accumulators in registers (enough to cover the latency of an FMA
 * or of vpmaddwd + vpaddd at two issues a cycle) and runs `iters` rounds per thread, all threads in
 * parallel. An empty asm statement makes an operand look changed (every round for the FMAs, whose
 * accumulators already differ; before every vpmaddwd, whose products would otherwise be one common
 * subexpression), so the compiler can neither hoist the multiply out of the loop nor fold it away. Built with AVX2 + FMA (x86-64);
 * elsewhere the functions return -1 and the caller reports no peak.
 */
#include <omp.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The number of threads each loop below runs on. */
int peak_threads(void) { return omp_get_max_threads(); }

/* fp32 FMAs: returns a checksum (so the work is observable); 12 x 8 lanes x 2 flops a round. */
double fp32_fma_peak(int64_t iters) {
#if defined(__AVX2__) && defined(__FMA__)
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        /* distinct starting values: identical accumulators would be merged into one */
        __m256 a0 = _mm256_set1_ps(0.0f), a1 = _mm256_set1_ps(0.1f), a2 = _mm256_set1_ps(0.2f);
        __m256 a3 = _mm256_set1_ps(0.3f), a4 = _mm256_set1_ps(0.4f), a5 = _mm256_set1_ps(0.5f);
        __m256 a6 = _mm256_set1_ps(0.6f), a7 = _mm256_set1_ps(0.7f), a8 = _mm256_set1_ps(0.8f);
        __m256 a9 = _mm256_set1_ps(0.9f), a10 = _mm256_set1_ps(1.0f), a11 = _mm256_set1_ps(1.1f);
        __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-7f);
        for (int64_t i = 0; i < iters; i++) {
            __asm__ volatile("" : "+x"(x));
            a0 = _mm256_fmadd_ps(a0, x, y); a1 = _mm256_fmadd_ps(a1, x, y);
            a2 = _mm256_fmadd_ps(a2, x, y); a3 = _mm256_fmadd_ps(a3, x, y);
            a4 = _mm256_fmadd_ps(a4, x, y); a5 = _mm256_fmadd_ps(a5, x, y);
            a6 = _mm256_fmadd_ps(a6, x, y); a7 = _mm256_fmadd_ps(a7, x, y);
            a8 = _mm256_fmadd_ps(a8, x, y); a9 = _mm256_fmadd_ps(a9, x, y);
            a10 = _mm256_fmadd_ps(a10, x, y); a11 = _mm256_fmadd_ps(a11, x, y);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
        s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
        float out[8];
        _mm256_storeu_ps(out, s);
        for (int j = 0; j < 8; j++) total += out[j];
    }
    return total;
#else
    (void)iters;
    return -1.0;
#endif
}

/* int16 multiply-adds as the greedy screen does them (vpmaddwd, then vpaddd into int32):
 * 12 x 16 multiply-adds a round. Returns a checksum. */
double int16_madd_peak(int64_t iters) {
#ifdef __AVX2__
    double total = 0.0;
#pragma omp parallel reduction(+ : total)
    {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        __m256i a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        __m256i x = _mm256_set1_epi16(3), y = _mm256_set1_epi16(-2);
        for (int64_t i = 0; i < iters; i++) {
            __asm__ volatile("" : "+x"(x));
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a4 = _mm256_add_epi32(a4, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a5 = _mm256_add_epi32(a5, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a6 = _mm256_add_epi32(a6, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a7 = _mm256_add_epi32(a7, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a8 = _mm256_add_epi32(a8, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a9 = _mm256_add_epi32(a9, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(x, y));
            __asm__ volatile("" : "+x"(x));
            a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(x, y));
        }
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                     _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(a8, a9), _mm256_add_epi32(a10, a11)));
        int32_t out[8];
        _mm256_storeu_si256((__m256i *)out, s);
        for (int j = 0; j < 8; j++) total += out[j];
    }
    return total;
#else
    (void)iters;
    return -1.0;
#endif
}
