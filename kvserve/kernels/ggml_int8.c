/* GGUF's quantized blocks against int8 activations: the integer dot products that make a CPU's
 * integer units pay for low-bit weights (llama.cpp's approach), for decode rows and prefill alike.
 *
 * Activations: each row of x [M, K] fp32 is quantized per 32 values, symmetric:
 *   dx = max|x| / 127,  qx = round_half_even(x * (1 / dx))  (int8),
 * with, per 32 values and per 16, dx * (sum of the codes) kept for the weights' offsets.
 *
 * Weights stay the file's blocks; every supported type is "unsigned codes u times a scale, minus
 * an offset", per group of 16 or 32 values:
 *   Q4_0 d (u - 8)   Q5_0 d (u - 16)   Q8_0 d (u - 128), u = q + 128
 *   Q4_K (d sc) u - dmin m   Q5_K the same with 5-bit u   Q6_K (d sc) (u - 32), 16-value groups
 * so a row's product is  sum_g (w_scale_g dx_g) <u_g, qx_g>  -  sum_g w_offset_g dx_g sum(qx_g),
 * the integer dots <u, qx> exact (vpdpbusd: u8 x s8 into int32 with AVX512-VNNI; plain C
 * elsewhere). Each output row depends only on its own x row, never on the rows beside it, so a
 * sequence decodes the same alone or batched, and prefill and decode use the same arithmetic.
 *
 * ggml_q8_matmul: y [M, N] = x [M, K] @ W^T for any M: rows of x are quantized once; threads split
 * W's rows; each weight block is unpacked once for up to TILE rows of x.
 */
#include <math.h>
#include <stdlib.h>

#include "ggml_blocks.h"

#if defined(GGML_AVX512) && defined(__AVX512VNNI__)
#define Q8_VNNI 1
#endif

#define TILE 4     /* rows of x per pass over a weight row */
#define MCHUNK 64  /* rows of x whose codes stay in cache while every weight row passes */
/* Up to this many rows of x (batch-1 and small decode batches): the per-row kernel; more (larger
 * decode batches, prefill): the GEMM, whose packing pays from about 12 rows on (measured on a
 * Zen 5: 1.2x slower at 8 rows, 1.3x faster at 16, 3x at 64). kvserve/weights/ggml.py mirrors it. */
#define ROW_KERNEL_MAX_ROWS 12

typedef struct {
    const int8_t *q;  /* [K] codes */
    const float *d32; /* [K / 32] dx of each 32 values */
    const float *d16; /* [K / 16] dx of the 32 values holding each 16 */
    const float *s16; /* [K / 16] dx * (sum of the 16 codes) */
    const float *s32; /* [K / 32] dx * (sum of the 32 codes) */
} XRow;

static int supported(int t) {
    return t == T_Q4_0 || t == T_Q5_0 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

/* ---------------------------------------------------------------- activations */

/* One 32-value block: codes q [32], dx, and the sums of the codes in each half. */
static inline float quantize_block(const float *xb, int8_t *q, int sum[2]) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    sum[0] = sum[1] = 0;
    for (int j = 0; j < 32; j++) {
        const int v = (int)nearbyintf(xb[j] * id); /* the current rounding: half to even */
        q[j] = (int8_t)v;
        sum[j / 16] += v;
    }
    return d;
}

#ifdef GGML_AVX512
/* The same block 16 lanes at a time, bitwise the loop's results for finite x: the same maximum
 * (NaN lanes dropped, as fmaxf drops them), product and rounding (vcvtps2dq rounds in the current
 * mode, as nearbyintf does). The plain loop cost ~10 us of a decode matmul call at K = 3072,
 * longer than a small matrix's stream at the memory's rate. */
static inline float quantize_block_vec(const float *xb, int8_t *q, int sum[2]) {
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const __m512 aa = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_abs_ps(a));
    const __m512 ab = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), _mm512_abs_ps(b));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid)), vb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(va));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(vb));
    sum[0] = _mm512_reduce_add_epi32(va);
    sum[1] = _mm512_reduce_add_epi32(vb);
    return d;
}
#endif

/* `vector`: the AVX-512 block where this build has it (the plain loop otherwise). */
static void quantize_row(const float *x, int K, int8_t *q, float *d32, float *d16, float *s16, float *s32, int vector) {
    for (int b = 0; b < K / 32; b++) {
        int sum[2];
#ifdef GGML_AVX512
        const float d = vector ? quantize_block_vec(x + 32 * b, q + 32 * b, sum) : quantize_block(x + 32 * b, q + 32 * b, sum);
#else
        const float d = quantize_block(x + 32 * b, q + 32 * b, sum);
        (void)vector;
#endif
        d32[b] = d;
        d16[2 * b] = d16[2 * b + 1] = d;
        s16[2 * b] = d * (float)sum[0];
        s16[2 * b + 1] = d * (float)sum[1];
        s32[b] = d * (float)(sum[0] + sum[1]);
    }
}

/* Row x [K] quantized into `codes` [K] and `f` [3 K / 16] floats (d32, s32, d16, s16 in turn). */
static XRow quantize_into(int8_t *codes, float *f, const float *x, int K, int vector) {
    float *d32 = f, *s32 = f + K / 32, *d16 = f + K / 16, *s16 = f + K / 8;
    quantize_row(x, K, codes, d32, d16, s16, s32, vector);
    return (XRow){codes, d32, d16, s16, s32};
}

/* ---------------------------------------------------------------- plain C: any CPU */

/* Per 16 values of a block: the weight scale ws and the offset scale wo. */
static void block_scales(int t, const uint8_t *b, float *ws, float *wo) {
    switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: {
        const float d = f16(b);
        ws[0] = ws[1] = d;
        wo[0] = wo[1] = d * (t == T_Q8_0 ? 128.f : t == T_Q5_0 ? 16.f : 8.f);
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *sc = b + 4;
        for (int j = 0; j < 8; j++) { /* the 32-value sub-blocks' 6-bit scales and mins */
            uint8_t s, m;
            scale_min_k4(j, sc, &s, &m);
            ws[2 * j] = ws[2 * j + 1] = d * (float)s;
            wo[2 * j] = wo[2 * j + 1] = dmin * (float)m;
        }
        return;
    }
    default: { /* Q6_K */
        const float d = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int g = 0; g < 16; g++) {
            ws[g] = d * (float)sc[g];
            wo[g] = ws[g] * 32.f;
        }
    }
    }
}

/* A block's unsigned codes u [qk]. */
static void block_codes(int t, const uint8_t *b, uint8_t *u) {
    switch (t) {
    case T_Q4_0: case T_Q5_0: {
        uint32_t qh = 0;
        if (t == T_Q5_0) memcpy(&qh, b + 2, 4);
        const uint8_t *qs = b + (t == T_Q5_0 ? 6 : 2);
        for (int j = 0; j < 16; j++) {
            u[j] = (uint8_t)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
            u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        return;
    }
    case T_Q8_0:
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)((int8_t)b[2 + j] + 128);
        return;
    case T_Q4_K: case T_Q5_K: {
        const uint8_t *qh = b + 16, *qs = b + (t == T_Q5_K ? 48 : 16);
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) {
                const int hi = t == T_Q5_K ? ((qh[l] >> j) & 1) << 4 : 0;
                u[32 * j + l] = (uint8_t)(((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f) | hi);
            }
        return;
    }
    default: /* Q6_K */
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            uint8_t *o = u + 128 * n;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
    }
}

static float dot_row_c(int t, const uint8_t *row, const XRow *x, int K) {
    const int qk = block_values(t), bb = block_bytes(t);
    uint8_t u[256];
    float ws[16], wo[16], acc = 0.f, off = 0.f;
    for (int i = 0; i < K / qk; i++) {
        block_codes(t, row + (size_t)i * bb, u);
        block_scales(t, row + (size_t)i * bb, ws, wo);
        for (int g = 0; g < qk / 16; g++) {
            const int k0 = i * qk + 16 * g;
            int dot = 0;
            for (int l = 0; l < 16; l++) dot += (int)u[16 * g + l] * (int)x->q[k0 + l];
            acc += ws[g] * x->d16[k0 / 16] * (float)dot;
            off += wo[g] * x->s16[k0 / 16];
        }
    }
    return acc - off;
}

/* ---------------------------------------------------------------- AVX512-VNNI */
#ifdef Q8_VNNI

/* Per-word shift counts for vpsrlvw: four 16-bit counts in a 64-bit element. */
#define SH2 0x0002000200020002LL
#define SH4 0x0004000400040004LL
#define SH6 0x0006000600060006LL

/* The weight bytes a row kernel reads next, asked for PREFETCH_AHEAD bytes early: one request per
 * 64 bytes a step consumes. The kernels do enough work per byte that the hardware prefetchers
 * alone left batch-1 decode below the memory's rate: every matrix of the 1B / 3B Q4_K_M files in
 * decode order streamed 1.05-1.09x faster with it, 2-4 KB ahead (docs/ARCHITECTURE.md, measured
 * decisions). A request past the weights' end is a hint that never faults. */
#define PREFETCH_AHEAD 3072
static inline void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o, 0, 3);
}

static inline __m512i vdot(__m512i u, const int8_t *q) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512((const void *)q));
}

/* lanes 0-7 <- v[0], lanes 8-15 <- v[1] */
static inline __m512 spread2(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(v));
}

static inline __m128 load2(const float *p) { return _mm_castpd_ps(_mm_load_sd((const double *)p)); }

/* Two 32-value blocks' unsigned codes, block i in bytes 0-31, block i + 1 in bytes 32-63. */
static inline __m512i nibbles2(const uint8_t *q0, const uint8_t *q1) {
    /* 128-bit lanes [q0, q0, q1, q1]; the low nibbles in lanes 0 and 2, the high in 1 and 3 */
    const __m512i t = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q0))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q1)), 1);
    const __m512i shift = _mm512_set_epi64(SH4, SH4, 0, 0, SH4, SH4, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi16(t, shift), _mm512_set1_epi8(0x0f));
}

static inline __m512i codes2(int t, const uint8_t *b0, const uint8_t *b1) {
    if (t == T_Q8_0) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); /* q + 128 */
    }
    if (t == T_Q4_0) return nibbles2(b0 + 2, b1 + 2);
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    const __m512i lo = nibbles2(b0 + 6, b1 + 6); /* value v of a block: bit v of its qh */
    return _mm512_mask_add_epi8(lo, (__mmask64)h0 | ((__mmask64)h1 << 32), lo, _mm512_set1_epi8(16));
}

/* One 32-value block in 256 bits (a row's last block when K / 32 is odd). */
static inline __m256i codes1(int t, const uint8_t *b) {
    if (t == T_Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + (t == T_Q5_0 ? 6 : 2))));
    __m256i u = _mm256_and_si256(_mm256_srlv_epi16(v, _mm256_set_epi64x(SH4, SH4, 0, 0)), _mm256_set1_epi8(0x0f));
    if (t == T_Q5_0) {
        uint32_t h;
        memcpy(&h, b + 2, 4);
        u = _mm256_mask_add_epi8(u, (__mmask32)h, u, _mm256_set1_epi8(16));
    }
    return u;
}

/* Blocks i0 .. nb - 1 of a row of a 32-value type into acc / off (per x row: the scaled integer
 * dots, and the weight scale times the codes' sum) two at a time, then the odd one. */
static inline __attribute__((always_inline)) void b32_blocks(int t, const uint8_t *row, const XRow *x, const int R,
                                                             int i0, int nb, __m512 *acc, __m128 *off) {
    const int bb = block_bytes(t);
    int i = i0;
    for (; i + 1 < nb; i += 2) {
        const uint8_t *b0 = row + (size_t)i * bb, *b1 = b0 + bb;
        prefetch_ahead(b0, 2 * bb);
        const __m512i u = codes2(t, b0, b1);
        const __m128 dw = _mm_set_ps(0.f, 0.f, f16(b1), f16(b0));
        for (int r = 0; r < R; r++) {
            const __m512 s = spread2(_mm_mul_ps(dw, load2(x[r].d32 + i)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vdot(u, x[r].q + 32 * i)), s, acc[r]);
            off[r] = _mm_fmadd_ps(dw, load2(x[r].s32 + i), off[r]);
        }
    }
    if (i < nb) {
        const uint8_t *b = row + (size_t)i * bb;
        const __m256i u = codes1(t, b);
        const float dw = f16(b);
        for (int r = 0; r < R; r++) {
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u,
                                                    _mm256_loadu_si256((const __m256i *)(x[r].q + 32 * i)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(dot)),
                                     _mm512_set1_ps(dw * x[r].d32[i]), acc[r]);
            off[r] = _mm_fmadd_ps(_mm_set_ss(dw), _mm_load_ss(x[r].s32 + i), off[r]);
        }
    }
}

static inline float b32_result(int t, __m512 acc, __m128 off) {
    const float offset = t == T_Q8_0 ? 128.f : t == T_Q5_0 ? 16.f : 8.f;
    const __m128 o2 = _mm_add_ps(off, _mm_movehl_ps(off, off));
    return _mm512_reduce_add_ps(acc) - offset * _mm_cvtss_f32(_mm_add_ss(o2, _mm_movehdup_ps(o2)));
}

/* Rows r < R of y[r] = x_r . row for Q8_0; R is a constant where inlined. */
static inline __attribute__((always_inline)) void rows_b32(int t, const uint8_t *row, const XRow *x, const int R,
                                                           int K, float *y) {
    __m512 acc[TILE];
    __m128 off[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), off[r] = _mm_setzero_ps();
    b32_blocks(t, row, x, R, 0, K / 32, acc, off);
    for (int r = 0; r < R; r++) y[r] = b32_result(t, acc[r], off[r]);
}

/* x codes reordered for rows_nib4: per 128 values (4 blocks), values 0-15 of each block, then
 * values 16-31 of each, the order in which the file's 16 bytes of nibbles per block hold them. */
static void reorder_nib4(int8_t *q, int K) {
    int8_t tmp[128];
    for (int g = 0; g + 128 <= K; g += 128) {
        for (int k = 0; k < 4; k++) {
            memcpy(tmp + 16 * k, q + g + 32 * k, 16);
            memcpy(tmp + 64 + 16 * k, q + g + 32 * k + 16, 16);
        }
        memcpy(q + g, tmp, 128);
    }
}

/* Q4_0 / Q5_0, four blocks per step against x codes in reorder_nib4's order: lane k of `lo` is
 * values 0-15 of block i + k and of `hi` values 16-31, straight from the nibbles (no shuffles),
 * and both multiply into one int32 vector whose lane k is block i + k's dot. Per byte of weights
 * about 2.5x fewer instructions than two blocks per step, which bounded Q4_0 decode per thread
 * below the memory's rate. The blocks past the last whole four stay in x's natural order. */
static inline __attribute__((always_inline)) void rows_nib4(int t, const uint8_t *row, const XRow *x, const int R,
                                                            int K, float *y) {
    const int bb = block_bytes(t), nb = K / 32, qoff = t == T_Q5_0 ? 6 : 2;
    const __m512i low4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[TILE];
    __m128 off[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), off[r] = _mm_setzero_ps();
    int i = 0;
    for (; i + 3 < nb; i += 4) {
        const uint8_t *b = row + (size_t)i * bb;
        prefetch_ahead(b, 4 * bb);
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + qoff)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + bb + qoff)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 2 * bb + qoff)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 3 * bb + qoff)), 3);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        uint64_t d4 = 0;
        __mmask64 hlo = 0, hhi = 0;
        for (int k = 0; k < 4; k++) {
            uint16_t d;
            memcpy(&d, b + k * bb, 2);
            d4 |= (uint64_t)d << (16 * k);
            if (t == T_Q5_0) { /* bit j of qh: the fifth bit of value j */
                uint32_t h;
                memcpy(&h, b + k * bb + 2, 4);
                hlo |= (__mmask64)(h & 0xffff) << (16 * k);
                hhi |= (__mmask64)(h >> 16) << (16 * k);
            }
        }
        if (t == T_Q5_0) lo = _mm512_mask_add_epi8(lo, hlo, lo, sixteen), hi = _mm512_mask_add_epi8(hi, hhi, hi, sixteen);
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)d4));
        for (int r = 0; r < R; r++) {
            const int8_t *q = x[r].q + 32 * i;
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)q));
            dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512((const void *)(q + 64)));
            const __m512 s = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(x[r].d32 + i))));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
            off[r] = _mm_fmadd_ps(dw, _mm_loadu_ps(x[r].s32 + i), off[r]);
        }
    }
    b32_blocks(t, row, x, R, i, nb, acc, off);
    for (int r = 0; r < R; r++) y[r] = b32_result(t, acc[r], off[r]);
}

/* A Q4_K / Q5_K block's 8 scales and 8 mins (6 bits each, packed in 12 bytes) as bytes. */
static inline void k4_scales(const uint8_t *p, uint64_t *sc, uint64_t *mn) {
    uint32_t w[3];
    memcpy(w, p, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    *sc = (uint64_t)(w[0] & m6) | (uint64_t)((w[2] & m4) | (((w[0] >> 6) & m2) << 4)) << 32;
    *mn = (uint64_t)(w[1] & m6) | (uint64_t)(((w[2] >> 4) & m4) | (((w[1] >> 6) & m2) << 4)) << 32;
}

static inline __m256 bytes8_ps(uint64_t v, float d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v))), _mm256_set1_ps(d));
}

/* A Q4_K / Q5_K block's codes: u[c] = sub-blocks 2c (bytes 0-31) and 2c + 1 (bytes 32-63). */
static inline __attribute__((always_inline)) void k45_codes(int t, const uint8_t *b, __m512i u[4]) {
    const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16);
    const __m512i shift = _mm512_set_epi64(SH4, SH4, SH4, SH4, 0, 0, 0, 0), low4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        u[c] = _mm512_and_si512(_mm512_srlv_epi16(v, shift), low4);
    }
    if (t == T_Q5_K) { /* bit j of qh[l]: the fifth bit of sub-block j's value l */
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        for (int c = 0; c < 4; c++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                   _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
            u[c] = _mm512_mask_add_epi8(u[c], _mm512_test_epi8_mask(h, bit), u[c], _mm512_set1_epi8(16));
        }
    }
}

/* A Q6_K block's codes in value order: u[2n] = values 0-63 of half n, u[2n + 1] = values 64-127. */
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *b, __m512i u[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    const __m512i sh02 = _mm512_set_epi64(SH2, SH2, SH2, SH2, 0, 0, 0, 0);
    const __m512i sh46 = _mm512_set_epi64(SH6, SH6, SH6, SH6, SH4, SH4, SH4, SH4);
    for (int n = 0; n < 2; n++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * n));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n)));
        const __m512i h0 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh02), three), 4);
        const __m512i h1 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh46), three), 4);
        u[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low4), h0);
        u[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), h1);
    }
}

/* x codes reordered for rows_k45: per 256 values (a block), for c = 0..3 the values 8c .. 8c + 7
 * of each of the 8 sub-blocks in turn. */
static void reorder_k45(int8_t *q, int K) {
    int8_t tmp[256];
    for (int g = 0; g + 256 <= K; g += 256) {
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 8; j++) memcpy(tmp + 64 * c + 8 * j, q + g + 32 * j + 8 * c, 8);
        memcpy(q + g, tmp, 256);
    }
}

/* Q4_K / Q5_K against x codes in reorder_k45's order: 64-bit word j of every code vector holds 8
 * values of sub-block j, so the four vectors' integer dots add up per sub-block in one int32
 * vector (lanes 2j, 2j + 1) and a block costs one conversion and one multiply-add per x row,
 * against four of each with the sub-blocks in chunks; about 1.3x the rate per thread. */
static inline __attribute__((always_inline)) void rows_k45(int t, const uint8_t *row, const XRow *x, const int R,
                                                           int K, float *y) {
    const int bb = block_bytes(t);
    const __m512i low4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const __m512i odd4 = _mm512_set_epi64(SH4, 0, SH4, 0, SH4, 0, SH4, 0);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i bit_j = _mm512_set_epi64((long long)0x8080808080808080ULL, 0x4040404040404040LL, 0x2020202020202020LL,
                                           0x1010101010101010LL, 0x0808080808080808LL, 0x0404040404040404LL,
                                           0x0202020202020202LL, 0x0101010101010101LL);
    __m512 acc[TILE];
    __m256 mins[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
    for (int i = 0; i < K / 256; i++) {
        const uint8_t *b = row + (size_t)i * bb, *qs = b + (t == T_Q5_K ? 48 : 16);
        prefetch_ahead(b, bb);
        uint64_t sc8, mn8;
        k4_scales(b + 4, &sc8, &mn8);
        const __m256 sc = bytes8_ps(sc8, f16(b)), mn = bytes8_ps(mn8, f16(b + 2));
        /* word 4p + c of the 128 code bytes: values 8c .. 8c + 7 of sub-blocks 2p (low nibbles)
         * and 2p + 1 (high) */
        const __m512i w0 = _mm512_loadu_si512((const void *)qs), w1 = _mm512_loadu_si512((const void *)(qs + 64));
        __m512i u[4];
        for (int c = 0; c < 4; c++) {
            const __m512i idx = _mm512_set_epi64(12 + c, 12 + c, 8 + c, 8 + c, 4 + c, 4 + c, c, c);
            u[c] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutex2var_epi64(w0, idx, w1), odd4), low4);
            if (t == T_Q5_K) { /* bit j of qh[l]: the fifth bit of sub-block j's value l */
                uint64_t h;
                memcpy(&h, b + 16 + 8 * c, 8);
                u[c] = _mm512_mask_add_epi8(u[c], _mm512_test_epi8_mask(_mm512_set1_epi64((long long)h), bit_j), u[c],
                                            sixteen);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *q = x[r].q + 256 * i;
            __m512i dot = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) dot = _mm512_dpbusd_epi32(dot, u[c], _mm512_loadu_si512((const void *)(q + 64 * c)));
            const __m512 s = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(x[r].d32 + 8 * i))));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
            mins[r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(x[r].s32 + 8 * i), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m128 m = _mm_add_ps(_mm256_castps256_ps128(mins[r]), _mm256_extractf128_ps(mins[r], 1));
        const __m128 m2 = _mm_add_ps(m, _mm_movehl_ps(m, m));
        y[r] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
    }
}

/* Q6_K: a 128-value half is two 64-value vectors, values 0-63 and 64-127, 16-value groups in order. */
static inline __attribute__((always_inline)) void rows_q6_k(const uint8_t *row, const XRow *x, const int R, int K,
                                                            float *y) {
    __m512 acc[TILE], offs[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), offs[r] = _mm512_setzero_ps();
    for (int i = 0; i < K / 256; i++) {
        const uint8_t *b = row + (size_t)i * 210;
        prefetch_ahead(b, 210);
        const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                                        _mm512_set1_ps(f16(b + 208)));
        __m512i u[4];
        q6k_codes(b, u);
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_mul_ps(sc, _mm512_loadu_ps(x[r].d16 + 16 * i));
            const int8_t *q = x[r].q + 256 * i;
            for (int g = 0; g < 4; g++) {
                const __m512i idx = _mm512_set_epi32(4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 2, 4 * g + 2,
                                                     4 * g + 2, 4 * g + 2, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 1,
                                                     4 * g, 4 * g, 4 * g, 4 * g);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vdot(u[g], q + 64 * g)), _mm512_permutexvar_ps(idx, s),
                                         acc[r]);
            }
            offs[r] = _mm512_fmadd_ps(sc, _mm512_loadu_ps(x[r].s16 + 16 * i), offs[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]) - 32.f * _mm512_reduce_add_ps(offs[r]);
}

#define FOR_R(CALL)                          \
    switch (R) {                             \
    case 1: { const int R_ = 1; CALL; } break; \
    case 2: { const int R_ = 2; CALL; } break; \
    case 3: { const int R_ = 3; CALL; } break; \
    default: { const int R_ = 4; CALL; } break; \
    }

static void dot_rows(int t, const uint8_t *row, const XRow *x, int R, int K, float *y) {
    if (t == T_Q4_K || t == T_Q5_K) {
        FOR_R(rows_k45(t, row, x, R_, K, y))
    } else if (t == T_Q6_K) {
        FOR_R(rows_q6_k(row, x, R_, K, y))
    } else if (t == T_Q8_0) {
        FOR_R(rows_b32(t, row, x, R_, K, y))
    } else {
        FOR_R(rows_nib4(t, row, x, R_, K, y))
    }
}

/* ---- many rows of x (prefill): a GEMM over weight rows unpacked 16 at a time
 *
 * The 16 rows' codes are interleaved 4 bytes at a time ([K / 4][16 rows][4 bytes]), so one
 * vpdpbusd multiplies 4 values of an x row (broadcast) into all 16 rows at once and each int32
 * lane ends a group (32 values; 16 for Q6_K) holding that row's exact integer dot. Per group and
 * x row the float work is then one conversion and two multiply-adds for 16 outputs, against the
 * per-row kernel's one per 64 values: about 3x fewer instructions per multiply-add. */
#define NT 16 /* weight rows per packed tile: the 16 int32 lanes */
#define MR 8  /* x rows per register tile */

static int group_of(int t) { return t == T_Q6_K ? 16 : 32; }

/* r[i] = word j of row i (j < 16) -> out + 64 j = word j of the 16 rows, for j < words: a 16 x 16
 * transpose of 32-bit words in registers. */
static inline void transpose_store(__m512i r[16], uint8_t *out, int words) {
    __m512i t[16], o[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane L: rows i, i + 1 at words 4L, 4L+1 | 4L+2, 4L+3 */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* r[4g + c], lane L: word 4L + c of rows 4g .. 4g + 3 */
        r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) { /* the 4 x 4 lanes of r[c], r[4 + c], r[8 + c], r[12 + c] */
        const __m512i a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i a2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44),
                      a3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        o[c] = _mm512_shuffle_i32x4(a0, a2, 0x88);
        o[4 + c] = _mm512_shuffle_i32x4(a0, a2, 0xDD);
        o[8 + c] = _mm512_shuffle_i32x4(a1, a3, 0x88);
        o[12 + c] = _mm512_shuffle_i32x4(a1, a3, 0xDD);
    }
    for (int j = 0; j < words; j++) _mm512_storeu_si512((void *)(out + 64 * j), o[j]);
}

/* Q4_0 / Q5_0 / Q8_0 rows straight into the tile: each pair of blocks' codes (64 values, 16
 * words) of the 16 rows is unpacked into registers and transposed there; the scale of block i
 * (its group) for the 16 rows is one 16-lane half-to-float conversion. Measured on the bundled
 * model's 262144 x 640 Q8_0 head, 1 thread: packing 21 ms -> ~5 ms per call, a third of the
 * GEMM's time at 64 rows of x (the unpacking, scale and transpose loops each cost ~8 ms). */
static void pack_tile_b32(int t, const uint8_t *w, int64_t row_bytes, int n0, int nr, int K, uint8_t *packed,
                          float *ws, float *wo) {
    const int bb = block_bytes(t), blocks = K / 32;
    const __m512 off = _mm512_set1_ps(t == T_Q8_0 ? 128.f : t == T_Q5_0 ? 16.f : 8.f);
    const uint8_t *row0 = w + (size_t)n0 * row_bytes;
    __m512i r[16];
    for (int i = 0; i < blocks; i += 2) {
        for (int q = 0; q < NT; q++) {
            const uint8_t *b = row0 + (size_t)q * row_bytes + (size_t)i * bb;
            r[q] = q >= nr ? _mm512_setzero_si512()
                 : i + 1 < blocks ? codes2(t, b, b + bb) : _mm512_zextsi256_si512(codes1(t, b));
        }
        transpose_store(r, packed + (size_t)NT * 32 * i, i + 1 < blocks ? 16 : 8);
    }
    for (int i = 0; i < blocks; i++) {
        uint16_t h[NT] = {0};
        for (int q = 0; q < nr; q++) memcpy(h + q, row0 + (size_t)q * row_bytes + (size_t)i * bb, 2);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        _mm512_storeu_ps(ws + NT * i, d);
        _mm512_storeu_ps(wo + NT * i, _mm512_mul_ps(d, off));
    }
}

/* Q4_K / Q5_K / Q6_K rows into the tile the same way, a 256-value block of the 16 rows at a time:
 * its four 64-value chunks transposed in registers, its scales (8 groups of 32 values, 16 of 16
 * for Q6_K) computed as vectors per row and transposed too. */
static void pack_tile_k(int t, const uint8_t *w, int64_t row_bytes, int n0, int nr, int K, uint8_t *packed,
                        float *ws, float *wo) {
    const int bb = block_bytes(t), groups = t == T_Q6_K ? 16 : 8;
    const uint8_t *row0 = w + (size_t)n0 * row_bytes;
    for (int i = 0; i < K / 256; i++) {
        __m512i v[NT][4], sc[NT], mn[NT];
        for (int q = 0; q < NT; q++) {
            const uint8_t *b = row0 + (size_t)q * row_bytes + (size_t)i * bb;
            if (q >= nr) {
                for (int c = 0; c < 4; c++) v[q][c] = _mm512_setzero_si512();
                sc[q] = mn[q] = _mm512_setzero_si512();
            } else if (t == T_Q6_K) {
                q6k_codes(b, v[q]);
                const __m512 s = _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(b + 192)))));
                sc[q] = _mm512_castps_si512(s);
                mn[q] = _mm512_castps_si512(_mm512_mul_ps(s, _mm512_set1_ps(32.f)));
            } else {
                k45_codes(t, b, v[q]);
                uint64_t s8, m8;
                k4_scales(b + 4, &s8, &m8);
                sc[q] = _mm512_zextsi256_si512(_mm256_castps_si256(bytes8_ps(s8, f16(b))));
                mn[q] = _mm512_zextsi256_si512(_mm256_castps_si256(bytes8_ps(m8, f16(b + 2))));
            }
        }
        for (int c = 0; c < 4; c++) {
            __m512i r[NT];
            for (int q = 0; q < NT; q++) r[q] = v[q][c];
            transpose_store(r, packed + (size_t)NT * (256 * i + 64 * c), 16);
        }
        transpose_store(sc, (uint8_t *)(ws + (size_t)NT * groups * i), groups);
        transpose_store(mn, (uint8_t *)(wo + (size_t)NT * groups * i), groups);
    }
}

/* Weight rows n0 .. n0 + nr - 1 (nr <= 16; missing rows zero) packed: codes [K / 4][16][4] into
 * `packed`, and per group the 16 rows' weight and offset scales, ws / wo [K / G][16]. */
static void pack_tile(int t, const uint8_t *w, int64_t row_bytes, int n0, int nr, int K, uint8_t *packed, float *ws,
                      float *wo) {
    if (block_values(t) == 32)
        pack_tile_b32(t, w, row_bytes, n0, nr, K, packed, ws, wo);
    else
        pack_tile_k(t, w, row_bytes, n0, nr, K, packed, ws, wo);
}

/* out [R][16] = x rows . the tile's 16 rows; G and R constants where inlined. */
static inline __attribute__((always_inline)) void gemm_tile(const uint8_t *packed, const float *ws, const float *wo,
                                                            int K, const int G, const XRow *x, const int R,
                                                            float *out) {
    __m512 acc[MR], off[MR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m512i dot[MR];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        const uint8_t *pg = packed + (size_t)g * G * NT;
        for (int s = 0; s < G / 4; s++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(pg + 64 * s));
            for (int r = 0; r < R; r++) {
                int32_t xv;
                memcpy(&xv, x[r].q + G * g + 4 * s, 4);
                dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(xv));
            }
        }
        const __m512 sw = _mm512_loadu_ps(ws + NT * g), so = _mm512_loadu_ps(wo + NT * g);
        for (int r = 0; r < R; r++) {
            const float dx = G == 32 ? x[r].d32[g] : x[r].d16[g], sx = G == 32 ? x[r].s32[g] : x[r].s16[g];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(sw, _mm512_set1_ps(dx)), acc[r]);
            off[r] = _mm512_fmadd_ps(so, _mm512_set1_ps(sx), off[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + NT * r, _mm512_sub_ps(acc[r], off[r]));
}

#define FOR_R8(CALL)                                  \
    switch (R) {                                      \
    case 1: { const int R_ = 1; CALL; } break;        \
    case 2: { const int R_ = 2; CALL; } break;        \
    case 3: { const int R_ = 3; CALL; } break;        \
    case 4: { const int R_ = 4; CALL; } break;        \
    case 5: { const int R_ = 5; CALL; } break;        \
    case 6: { const int R_ = 6; CALL; } break;        \
    case 7: { const int R_ = 7; CALL; } break;        \
    default: { const int R_ = 8; CALL; } break;       \
    }

/* y [M, N] for the quantized rows xr; returns -1 when a thread's buffers cannot be had. */
static int gemm(const XRow *xr, const uint8_t *w, int t, float *y, int M, int N, int K, int64_t row_bytes,
                int threads) {
    const int G = group_of(t), tiles = (N + NT - 1) / NT;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *packed = aligned_alloc(64, (size_t)NT * K);
        float *ws = malloc(sizeof(float) * NT * (K / G)), *wo = malloc(sizeof(float) * NT * (K / G));
        if (!packed || !ws || !wo) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int tile = 0; tile < tiles; tile++) {
            if (!packed || !ws || !wo) continue;
            const int n0 = NT * tile, nr = N - n0 < NT ? N - n0 : NT;
            pack_tile(t, w, row_bytes, n0, nr, K, packed, ws, wo);
            /* The next tile's weights on their way to L2 while this one multiplies: packing read
             * them at DRAM latency otherwise (the prefetchers lose a stream interrupted by the
             * multiplies), ~60% of a call's time on the bundled model's head at 16 rows of x. */
            if (tile + 1 < tiles) {
                const int nr1 = N - n0 - NT < NT ? N - n0 - NT : NT;
                const uint8_t *next = w + (size_t)(n0 + NT) * row_bytes, *end = next + (size_t)nr1 * row_bytes;
                for (const uint8_t *a = next; a < end; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T1);
            }
            float out[MR * NT];
            for (int m0 = 0; m0 < M; m0 += MR) {
                const int R = M - m0 < MR ? M - m0 : MR;
                if (G == 32) {
                    FOR_R8(gemm_tile(packed, ws, wo, K, 32, xr + m0, R_, out))
                } else {
                    FOR_R8(gemm_tile(packed, ws, wo, K, 16, xr + m0, R_, out))
                }
                for (int r = 0; r < R; r++) memcpy(y + (size_t)(m0 + r) * N + n0, out + NT * r, sizeof(float) * nr);
            }
        }
        free(packed);
        free(ws);
        free(wo);
    }
    return failed ? -1 : 0;
}
#else
static void dot_rows(int t, const uint8_t *row, const XRow *x, int R, int K, float *y) {
    for (int r = 0; r < R; r++) y[r] = dot_row_c(t, row, x + r, K);
}
#endif

/* ---------------------------------------------------------------- the matmul */

/* Returns 0, or -1 for a type without an int8 path, a K that is not whole blocks, or no memory. */
int ggml_q8_matmul(const float *x, const uint8_t *w, int t, float *y, int M, int N, int K, int64_t row_bytes,
                   int threads) {
    if (!supported(t) || K % block_values(t) || M < 1 || (int64_t)(K / block_values(t)) * block_bytes(t) != row_bytes) return -1;
    const size_t per_row = (size_t)K + sizeof(float) * (3 * (size_t)K / 16);
    uint8_t *buf = malloc(per_row * (size_t)M);
    XRow *xr = malloc(sizeof(XRow) * (size_t)M);
    if (!buf || !xr) {
        free(buf);
        free(xr);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int m = 0; m < M; m++) {
        xr[m] = quantize_into((int8_t *)buf + (size_t)m * K, (float *)(buf + (size_t)M * K) + (size_t)m * (3 * K / 16),
                              x + (size_t)m * K, K, 1);
    }
#ifdef Q8_VNNI
    if (M > ROW_KERNEL_MAX_ROWS) {
        const int rc = gemm(xr, w, t, y, M, N, K, row_bytes, threads);
        free(buf);
        free(xr);
        return rc;
    }
    for (int m = 0; m < M; m++) { /* the row kernels' orders of x's codes */
        if (t == T_Q4_0 || t == T_Q5_0) reorder_nib4((int8_t *)xr[m].q, K);
        if (t == T_Q4_K || t == T_Q5_K) reorder_k45((int8_t *)xr[m].q, K);
    }
#endif
    for (int m0 = 0; m0 < M; m0 += MCHUNK) {
        const int mc = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *row = w + (size_t)n * row_bytes;
            float out[TILE];
            for (int r0 = 0; r0 < mc; r0 += TILE) {
                const int R = mc - r0 < TILE ? mc - r0 : TILE;
                dot_rows(t, row, xr + m0 + r0, R, K, out);
                for (int r = 0; r < R; r++) y[(size_t)(m0 + r0 + r) * N + n] = out[r];
            }
        }
    }
    free(buf);
    free(xr);
    return 0;
}

/* The plain C path whatever this build has (the tests compare it with the vector path). */
int ggml_q8_matmul_reference(const float *x, const uint8_t *w, int t, float *y, int M, int N, int K,
                             int64_t row_bytes) {
    if (!supported(t) || K % block_values(t) || M < 1 || (int64_t)(K / block_values(t)) * block_bytes(t) != row_bytes) return -1;
    int8_t *q = malloc((size_t)K);
    float *f = malloc(sizeof(float) * (3 * (size_t)K / 16));
    if (!q || !f) {
        free(q);
        free(f);
        return -1;
    }
    for (int m = 0; m < M; m++) {
        const XRow xr = quantize_into(q, f, x + (size_t)m * K, K, 0);
        for (int n = 0; n < N; n++) y[(size_t)m * N + n] = dot_row_c(t, w + (size_t)n * row_bytes, &xr, K);
    }
    free(q);
    free(f);
    return 0;
}

/* Row x [K] quantized as the matmuls quantize it: codes q [K] and f [3 K / 16] floats (dx per 32,
 * dx * sum per 32, dx per 16, dx * sum per 16); `vector` 0: the plain loop (for the tests, which
 * hold the vector block to it). Returns -1 when K is not whole blocks of 32. */
int ggml_q8_quantize(const float *x, int K, int8_t *q, float *f, int vector) {
    if (K < 32 || K % 32) return -1;
    quantize_into(q, f, x, K, vector);
    return 0;
}
