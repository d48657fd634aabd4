/* Matmuls on GGUF's quantized blocks as the file stores them (kvserve/weights/ggml.py), so a
 * quantized model never holds an fp32 copy of its weights.
 *
 * A weight W [N, K] is N rows of K / QK blocks each, a block of QK values (32, or 256 for the
 * K-quants) being a few fp16 scales and packed codes (ggml's block_q4_0 ... block_q6_K). Each
 * function takes the ggml type number and dequantizes a block at a time into fp32 exactly as
 * ggml (and the gguf package's dequantizer, the tests' oracle) compute it: same products in the
 * same order, no FMA contraction (-ffp-contract=off), so a dequantized row is bitwise the
 * reference model's row.
 *
 * ggml_gemv:    y[m, n] = sum_k x[m, k] W[n, k] for a few rows x [M, K] fp32 (decode steps): each
 *               block is dequantized once and used by the M rows; sums in 16 fp32 lanes per row,
 *               so a row's arithmetic does not depend on M (a sequence decodes the same alone or
 *               batched). Threads split the output rows.
 * ggml_dequant: rows `ids` of W in fp32 (the prefill path's chunks, embedding lookups).
 */
#include "ggml_blocks.h"

#define LANES 16
#define MAX_ROWS 64 /* rows of x per call (the caller splits more) */

static float bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---------------------------------------------------------------- one block -> fp32 */

static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0f) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0f) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void deq_q5_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int x0 = ((qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10)) - 16;
        const int x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
        y[j] = (float)x0 * d;
        y[j + 16] = (float)x1 * d;
    }
}

static void deq_q5_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int x0 = (qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10);
        const int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = (float)x0 * d + m;
        y[j + 16] = (float)x1 * d + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

static void deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *q = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    int is = 0;
    for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = scales[is++];
                const float dl = d * (float)(sc & 0x0f), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
            }
            shift += 2;
        }
        q += 32;
    }
}

static void deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *q = b + 32;
    const float d_all = f16(b + 108);
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    const uint32_t km1 = 0x03030303u, km2 = 0x0f0f0f0fu, tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & km2) | (((tmp >> 4) & km1) << 4);
    aux[3] = ((aux[1] >> 4) & km2) | (((tmp >> 6) & km1) << 4);
    aux[0] = (aux[0] & km2) | (((tmp >> 0) & km1) << 4);
    aux[1] = (aux[1] & km2) | (((tmp >> 2) & km1) << 4);
    const int8_t *scales = (const int8_t *)aux;
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        int shift = 0;
        for (int j = 0; j < 4; j++) {
            for (int half = 0; half < 2; half++) {
                const float dl = d_all * (float)(scales[is++] - 32);
                for (int l = 0; l < 16; l++) {
                    const int o = l + 16 * half;
                    *y++ = dl * (float)(((q[o] >> shift) & 3) - ((hm[o] & m) ? 0 : 4));
                }
            }
            shift += 2;
            m <<= 1;
        }
        q += 32;
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        uint8_t sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0x0f) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
}

static void deq_q5_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        uint8_t sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0x0f) + ((qh[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}


#ifdef GGML_AVX512
/* The same values as the scalar dequantizers above (each value one product, or a product and a
 * difference, rounded as there), 16 at a time. */
static inline __m512 cvt16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

static void deq_q8_0_simd(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b));
    _mm512_storeu_ps(y, _mm512_mul_ps(cvt16(_mm_loadu_si128((const __m128i *)(b + 2))), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(cvt16(_mm_loadu_si128((const __m128i *)(b + 18))), d));
}

static void deq_q5_0_simd(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(f16(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), low4 = _mm_set1_epi8(0x0f), s16 = _mm_set1_epi8(16);
    __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    lo = _mm_sub_epi8(_mm_mask_add_epi8(lo, (__mmask16)(qh & 0xffff), lo, s16), s16); /* value i: bit i of qh */
    hi = _mm_sub_epi8(_mm_mask_add_epi8(hi, (__mmask16)(qh >> 16), hi, s16), s16);
    _mm512_storeu_ps(y, _mm512_mul_ps(cvt16(lo), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(cvt16(hi), d));
}

static void deq_q4_k_simd(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int is = 0; is < 8; is += 2, q += 32, y += 64) {
        uint8_t sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)mn);
        scale_min_k4(is + 1, scales, &sc, &mn);
        const __m512 d2 = _mm512_set1_ps(d * (float)sc), m2 = _mm512_set1_ps(dmin * (float)mn);
        for (int h = 0; h < 32; h += 16) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(q + h));
            const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            _mm512_storeu_ps(y + h, _mm512_sub_ps(_mm512_mul_ps(d1, cvt16(lo)), m1));
            _mm512_storeu_ps(y + 32 + h, _mm512_sub_ps(_mm512_mul_ps(d2, cvt16(hi)), m2));
        }
    }
}

/* One 128-value half of a Q6_K block as 8 vectors, w[j] = values 16 j .. 16 j + 15 (d * sc) * q. */
static inline void q6_k_half(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, float d, __m512 w[8]) {
    const __m128i low4 = _mm_set1_epi8(0x0f), three = _mm_set1_epi8(3), s32 = _mm_set1_epi8(32);
    for (int is = 0; is < 2; is++) {
        const int l = 16 * is;
        const __m128i a = _mm_loadu_si128((const __m128i *)(ql + l)), c = _mm_loadu_si128((const __m128i *)(ql + l + 32));
        const __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
        const __m128i q1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(a, low4), _mm_slli_epi16(_mm_and_si128(h, three), 4)), s32);
        const __m128i q2 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(c, low4),
                                                     _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2), three), 4)), s32);
        const __m128i q3 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low4),
                                                     _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 4), three), 4)), s32);
        const __m128i q4 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), low4),
                                                     _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 6), three), 4)), s32);
        w[is] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[is]), cvt16(q1));
        w[2 + is] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[is + 2]), cvt16(q2));
        w[4 + is] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[is + 4]), cvt16(q3));
        w[6 + is] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[is + 6]), cvt16(q4));
    }
}

static void deq_q6_k_simd(const uint8_t *b, float *y) {
    const float d = f16(b + 208);
    for (int n = 0; n < 2; n++, y += 128) {
        __m512 w[8];
        q6_k_half(b + 64 * n, b + 128 + 32 * n, (const int8_t *)(b + 192) + 8 * n, d, w);
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(y + 16 * j, w[j]);
    }
}
#endif

/* Values [i0, i0 + n) of a row (n a multiple of the block's values; i0 too) into y. */
static void deq_span(int t, const uint8_t *row, int i0, int n, float *y) {
    const int qk = block_values(t), bb = block_bytes(t);
    if (t == T_F32) { memcpy(y, row + 4 * (size_t)i0, 4 * (size_t)n); return; }
    for (int i = 0; i < n; i += qk) {
        const uint8_t *b = row + (size_t)((i0 + i) / qk) * bb;
        float *o = y + i;
        switch (t) {
        case T_F16: *o = f16(b); break;
        case T_BF16: *o = bf16(b); break;
        case T_Q4_0: deq_q4_0(b, o); break;
        case T_Q4_1: deq_q4_1(b, o); break;
        case T_Q5_1: deq_q5_1(b, o); break;
        case T_Q2_K: deq_q2_k(b, o); break;
        case T_Q3_K: deq_q3_k(b, o); break;
        case T_Q5_K: deq_q5_k(b, o); break;
#ifdef GGML_AVX512
        case T_Q5_0: deq_q5_0_simd(b, o); break;
        case T_Q8_0: deq_q8_0_simd(b, o); break;
        case T_Q4_K: deq_q4_k_simd(b, o); break;
        case T_Q6_K: deq_q6_k_simd(b, o); break;
#else
        case T_Q5_0: deq_q5_0(b, o); break;
        case T_Q8_0: deq_q8_0(b, o); break;
        case T_Q4_K: deq_q4_k(b, o); break;
        case T_Q6_K: deq_q6_k(b, o); break;
#endif
        }
    }
}

/* Rows ids[0..n_ids) of W (row_bytes each) into out [n_ids, K]. Returns 0, or -1 for a type
 * this file does not read or a K that is not whole blocks. */
int ggml_dequant(const uint8_t *w, int t, int K, int64_t row_bytes, const int64_t *ids, int n_ids, float *out,
                 int threads) {
    const int qk = block_values(t);
    if (qk == 0 || K % qk) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < n_ids; i++) deq_span(t, w + ids[i] * row_bytes, 0, K, out + (size_t)i * K);
    return 0;
}

#ifdef GGML_AVX512
/* A 32-value block's weights in two registers: the same products as deq_q8_0 / deq_q5_0 /
 * deq_q4_0. */
static inline void w32_q8_0(const uint8_t *b, __m512 *w0, __m512 *w1) {
    const __m512 d = _mm512_set1_ps(f16(b));
    *w0 = _mm512_mul_ps(cvt16(_mm_loadu_si128((const __m128i *)(b + 2))), d);
    *w1 = _mm512_mul_ps(cvt16(_mm_loadu_si128((const __m128i *)(b + 18))), d);
}

static inline void w32_q5_0(const uint8_t *b, __m512 *w0, __m512 *w1) {
    const __m512 d = _mm512_set1_ps(f16(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), low4 = _mm_set1_epi8(0x0f), s16 = _mm_set1_epi8(16);
    __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    lo = _mm_sub_epi8(_mm_mask_add_epi8(lo, (__mmask16)(qh & 0xffff), lo, s16), s16);
    hi = _mm_sub_epi8(_mm_mask_add_epi8(hi, (__mmask16)(qh >> 16), hi, s16), s16);
    *w0 = _mm512_mul_ps(cvt16(lo), d);
    *w1 = _mm512_mul_ps(cvt16(hi), d);
}

static inline void w32_q4_0(const uint8_t *b, __m512 *w0, __m512 *w1) {
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), low4 = _mm_set1_epi8(0x0f), s8 = _mm_set1_epi8(8);
    *w0 = _mm512_mul_ps(cvt16(_mm_sub_epi8(_mm_and_si128(q, low4), s8)), d);
    *w1 = _mm512_mul_ps(cvt16(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), s8)), d);
}

/* Rows of 32-value blocks without the span buffer: each block's weights dequantized in registers
 * and multiplied into the rows' 16 lanes in the order the span path uses, so the sums are
 * bitwise those of the generic loop. */
#define GEMV_B32(NAME, W32, BYTES)                                                                       \
    static void NAME(const float *x, const uint8_t *row, int M, int K, float acc[][LANES]) {            \
        const int nb = K / 32;                                                                          \
        __m512 w0, w1;                                                                                  \
        if (M == 1) {                                                                                   \
            __m512 va = _mm512_loadu_ps(acc[0]);                                                        \
            for (int i = 0; i < nb; i++) {                                                              \
                W32(row + (size_t)i * BYTES, &w0, &w1);                                                 \
                va = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * i), w0, va);                              \
                va = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * i + 16), w1, va);                         \
            }                                                                                           \
            _mm512_storeu_ps(acc[0], va);                                                               \
            return;                                                                                     \
        }                                                                                               \
        for (int i = 0; i < nb; i++) {                                                                  \
            W32(row + (size_t)i * BYTES, &w0, &w1);                                                     \
            for (int m = 0; m < M; m++) {                                                               \
                const float *xr = x + (size_t)m * K + 32 * i;                                           \
                __m512 va = _mm512_loadu_ps(acc[m]);                                                    \
                va = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, va);                                      \
                va = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, va);                                 \
                _mm512_storeu_ps(acc[m], va);                                                           \
            }                                                                                           \
        }                                                                                               \
    }
/* The K-quants' batch-1 rows without the buffer: a super-block's 256 weights dequantized 16 at a
 * time in registers (the products of deq_q4_k_simd / deq_q6_k_simd) and multiplied into the 16
 * lanes in ascending order, as the buffer path does: the same sums. */
static void gemv1_q4_k(const float *x, const uint8_t *row, int K, float *acc) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m512 va = _mm512_loadu_ps(acc);
    for (int i = 0; i < K / 256; i++, x += 256) {
        const uint8_t *b = row + (size_t)i * 144, *scales = b + 4, *q = b + 16;
        const float d = f16(b), dmin = f16(b + 2);
        for (int is = 0; is < 8; is += 2, q += 32) {
            uint8_t sc, mn;
            scale_min_k4(is, scales, &sc, &mn);
            const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)mn);
            scale_min_k4(is + 1, scales, &sc, &mn);
            const __m512 d2 = _mm512_set1_ps(d * (float)sc), m2 = _mm512_set1_ps(dmin * (float)mn);
            const __m128i v0 = _mm_loadu_si128((const __m128i *)q), v1 = _mm_loadu_si128((const __m128i *)(q + 16));
            const float *xs = x + 32 * is;
            va = _mm512_fmadd_ps(_mm512_loadu_ps(xs), _mm512_sub_ps(_mm512_mul_ps(d1, cvt16(_mm_and_si128(v0, low4))), m1), va);
            va = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 16), _mm512_sub_ps(_mm512_mul_ps(d1, cvt16(_mm_and_si128(v1, low4))), m1), va);
            va = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 32),
                                 _mm512_sub_ps(_mm512_mul_ps(d2, cvt16(_mm_and_si128(_mm_srli_epi16(v0, 4), low4))), m2), va);
            va = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 48),
                                 _mm512_sub_ps(_mm512_mul_ps(d2, cvt16(_mm_and_si128(_mm_srli_epi16(v1, 4), low4))), m2), va);
        }
    }
    _mm512_storeu_ps(acc, va);
}

static void gemv1_q6_k(const float *x, const uint8_t *row, int K, float *acc) {
    __m512 va = _mm512_loadu_ps(acc);
    for (int i = 0; i < K / 256; i++) {
        const uint8_t *b = row + (size_t)i * 210;
        const float d = f16(b + 208);
        for (int n = 0; n < 2; n++) {
            __m512 w[8];
            q6_k_half(b + 64 * n, b + 128 + 32 * n, (const int8_t *)(b + 192) + 8 * n, d, w);
            const float *xs = x + 256 * i + 128 * n;
            for (int jj = 0; jj < 8; jj++) va = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 16 * jj), w[jj], va);
        }
    }
    _mm512_storeu_ps(acc, va);
}

GEMV_B32(gemv_q8_0, w32_q8_0, 34)
GEMV_B32(gemv_q5_0, w32_q5_0, 22)
GEMV_B32(gemv_q4_0, w32_q4_0, 18)
#endif

/* The 16 lanes of a row's sums added up, one order for every M: a tree with AVX-512 (a chain of
 * 16 dependent adds cost as much as a short row's blocks), in order otherwise. */
static inline float sum_lanes(const float *a) {
#ifdef GGML_AVX512
    return _mm512_reduce_add_ps(_mm512_loadu_ps(a));
#else
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += a[l];
    return s;
#endif
}

/* y [M, N] = x [M, K] @ W^T for M <= MAX_ROWS. The K axis is walked in spans of SPAN values
 * (whole blocks), each dequantized once into a buffer and used by every row of x. */
#define SPAN 256
int ggml_gemv(const float *x, const uint8_t *w, int t, float *y, int M, int N, int K, int64_t row_bytes,
              int threads) {
    const int qk = block_values(t);
    if (qk == 0 || K % qk || M < 1 || M > MAX_ROWS) return -1;
    const int span = qk > SPAN ? qk : (SPAN / qk) * qk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        float buf[SPAN > 256 ? SPAN : 256];
        float acc[MAX_ROWS][LANES];
        memset(acc, 0, sizeof(float) * LANES * M);
#ifdef GGML_AVX512
        if (t == T_Q8_0 || t == T_Q5_0 || t == T_Q4_0) {
            (t == T_Q8_0 ? gemv_q8_0 : t == T_Q5_0 ? gemv_q5_0 : gemv_q4_0)(x, row, M, K, acc);
            goto reduce;
        }
        if (M == 1 && (t == T_Q4_K || t == T_Q6_K)) {
            (t == T_Q4_K ? gemv1_q4_k : gemv1_q6_k)(x, row, K, acc[0]);
            goto reduce;
        }
#endif
        for (int k0 = 0; k0 < K; k0 += span) {
            const int len = K - k0 < span ? K - k0 : span;
            deq_span(t, row, k0, len, buf);
            for (int m = 0; m < M; m++) {
                const float *xr = x + (size_t)m * K + k0;
                float *a = acc[m];
                int k = 0;
#ifdef GGML_AVX512
                __m512 va = _mm512_loadu_ps(a);
                for (; k + LANES <= len; k += LANES)
                    va = _mm512_fmadd_ps(_mm512_loadu_ps(xr + k), _mm512_loadu_ps(buf + k), va);
                _mm512_storeu_ps(a, va);
#else
                for (; k + LANES <= len; k += LANES)
                    for (int l = 0; l < LANES; l++) a[l] += xr[k + l] * buf[k + l];
#endif
                for (; k < len; k++) a[k % LANES] += xr[k] * buf[k];
            }
        }
#ifdef GGML_AVX512
    reduce:
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * N + n] = sum_lanes(acc[m]);
    }
    return 0;
}
