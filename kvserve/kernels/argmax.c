/* Greedy decoding's pick: the index of each row's largest value, x [M, N] fp32 row-major.
 *
 * torch's CPU max(dim=-1) reads [64, 262144] logits at ~4 GB/s here (18 ms a step); this reads
 * them at memory speed. Same answer as torch: the first index of the maximum, and a NaN counts
 * as the maximum (its first index), as torch.max propagates NaN.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static int64_t scalar_argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t row_argmax(const float *x, int64_t n) {
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 vmax = _mm512_loadu_ps(x);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i cur = vidx;
        __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        int64_t i = 16;
        for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16) {
            cur = _mm512_add_epi32(cur, step);
            const __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ); /* strictly: keeps the first */
            vmax = _mm512_mask_blend_ps(gt, vmax, v);
            vidx = _mm512_mask_blend_epi32(gt, vidx, cur);
        }
        if (nan) return scalar_argmax(x, n); /* rare: find the first NaN */
        float m[16];
        int32_t id[16];
        _mm512_storeu_ps(m, vmax);
        _mm512_storeu_si512(id, vidx);
        int64_t best = id[0];
        for (int l = 1; l < 16; l++)
            if (m[l] > x[best] || (m[l] == x[best] && id[l] < best)) best = id[l];
        for (; i < n; i++) {
            if (isnan(x[i])) return scalar_argmax(x, n);
            if (x[i] > x[best]) best = i;
        }
        return best;
    }
#elif defined(__AVX2__)
    if (n >= 8) { /* the same with 8 lanes */
        __m256 vmax = _mm256_loadu_ps(x);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        __m256i cur = vidx;
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q));
        int64_t i = 8;
        for (; i + 8 <= n && i + 8 <= INT32_MAX; i += 8) {
            cur = _mm256_add_epi32(cur, step);
            const __m256 v = _mm256_loadu_ps(x + i);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ); /* strictly: keeps the first */
            vmax = _mm256_blendv_ps(vmax, v, gt);
            vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
        }
        if (nan) return scalar_argmax(x, n); /* rare: find the first NaN */
        float m[8];
        int32_t id[8];
        _mm256_storeu_ps(m, vmax);
        _mm256_storeu_si256((__m256i *)id, vidx);
        int64_t best = id[0];
        for (int l = 1; l < 8; l++)
            if (m[l] > x[best] || (m[l] == x[best] && id[l] < best)) best = id[l];
        for (; i < n; i++) {
            if (isnan(x[i])) return scalar_argmax(x, n);
            if (x[i] > x[best]) best = i;
        }
        return best;
    }
#endif
    return scalar_argmax(x, n);
}

void argmax_rows(const float *x, int64_t *out, int M, int64_t N, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int r = 0; r < M; r++) out[r] = row_argmax(x + (int64_t)r * N, N);
}
