/* K/V rows of the paged pool in the pool's element type, for the fp32 kernels that read and write
 * them: fp32 (used in place), bf16 or fp16 (`--kv-cache-dtype bf16|fp16`: half the bytes a
 * decode step streams; arithmetic stays fp32).
 *
 * Conversions round as torch's `.to()` does: fp32 -> bf16 and fp32 -> fp16 to nearest even, NaN
 * kept NaN; widening is exact. */
#ifndef KVSERVE_KV_ROW_H
#define KVSERVE_KV_ROW_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline int kv_elem_size(int type) { return type == KV_F32 ? 4 : 2; }

static inline float kv_bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16}; /* bf16 is the top half of fp32 */
    return c.f;
}

static inline uint16_t kv_f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Row `offset` (in elements) of `base` as fp32: fp32 rows in place, 16-bit rows widened into
 * `row` [D]. */
static inline const float *kv_load_row(const void *base, int64_t offset, int type, int D, float *restrict row) {
    if (type == KV_F32) return (const float *)base + offset;
    int d = 0;
    if (type == KV_F16) {
        const _Float16 *src = (const _Float16 *)base + offset;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16) _mm512_storeu_ps(row + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
#elif defined(__F16C__)
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(row + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
        for (; d < D; d++) row[d] = (float)src[d];
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16) {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_storeu_ps(row + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
#endif
        for (; d < D; d++) row[d] = kv_bf16_to_f32(src[d]);
    }
    return row;
}

/* Store the fp32 row x [D] at element `offset` of `base` in the pool's type. */
static inline void kv_store_row(void *base, int64_t offset, int type, int D, const float *restrict x) {
    if (type == KV_F32) {
        float *dst = (float *)base + offset;
        for (int d = 0; d < D; d++) dst[d] = x[d];
    } else if (type == KV_F16) {
        _Float16 *dst = (_Float16 *)base + offset;
        int d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), _mm512_cvtps_ph(_mm512_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; d < D; d++) dst[d] = (_Float16)x[d];
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int d = 0; d < D; d++) dst[d] = kv_f32_to_bf16(x[d]);
    }
}

#endif
