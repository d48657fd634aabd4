/* A few activation rows times a low-bit weight matrix (decode steps), on the layouts that
 * kvserve.weights.linear.QuantLinear stores for PyTorch's kernels, so no second copy of the weights:
 *
 * int8_gemv: y[m, n] = scale[n] * sum_k x[m, k] w[n, k] with fp32 sums; w int8 [N, K] row-major
 *   (a symmetric grid, `_weight_int8pack_mm`'s layout), scale [N] fp32.
 * int4_gemv: y[m, n] = sum_k x[m, k] ((u[n, k] - 8) s[g, n] + z[g, n]), g = k / group, on the
 *   tiled layout of `_weight_int4pack_mm_for_cpu` (kvserve/weights/packing.py): in each block of B
 *   output rows (B = 64 where PyTorch runs AVX-512, 32 with AVX2: the caller says which) the
 *   bytes run k-major, B/2 per input column, byte j holding rows j (low nibble) and j + B/2
 *   (high); a last block of r < B rows holds rows 2j and 2j + 1 in byte j. sz is the
 *   [K / group, N, 2] table of (s, z), bf16 or fp32. Per group the sum is taken as
 *   s * sum_k u x + (z - 8 s) * sum_k x: one FMA per weight, the scales applied once per group.
 * int4_dequant: rows of that W in fp32, for the prefill path (many rows: fp32 GEMM).
 *
 * x is [M, K] fp32 (a few rows; each row's arithmetic is the same whatever M, so a sequence
 * decodes the same alone or in a batch; the weights stream once, later rows find them in cache),
 * y [M, N] fp32.
 * A software prefetch 4 KB ahead of the weights being read lifts the stream from ~13 to ~22 GB/s
 * on this project's 2-core machines (the hardware prefetcher alone leaves each core latency-bound).
 * AVX-512 or AVX2 where the compiler targets it (-march=native), plain loops otherwise.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LOWBIT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_sum.h"
#define LOWBIT_AVX2 1
#endif

#define PREFETCH_BYTES 4096

static inline float bf16_bits_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* ---------------------------------------------------------------- int8, row-major [N, K] */

#ifdef LOWBIT_AVX512
static inline __m512 cvt8(const int8_t *p) { /* 16 int8 -> 16 fp32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(LOWBIT_AVX2)
static inline __m256 cvt8(const int8_t *p) { /* 8 int8 -> 8 fp32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* sum_k x[k] w[k] of one int8 row; several accumulators: one would serialize on the FMA latency. */
static inline float dot_int8(const float *x, const int8_t *wr, int K) {
    float acc = 0.f;
    int k = 0;
#ifdef LOWBIT_AVX512
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 64 <= K; k += 64) {
        __builtin_prefetch(wr + k + PREFETCH_BYTES); /* a hint: past the end is harmless */
        a0 = _mm512_fmadd_ps(cvt8(wr + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(cvt8(wr + k + 16), _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(cvt8(wr + k + 32), _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(cvt8(wr + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(cvt8(wr + k), _mm512_loadu_ps(x + k), a0);
    acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(LOWBIT_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        if ((k & 63) == 0) __builtin_prefetch(wr + k + PREFETCH_BYTES);
        a0 = _mm256_fmadd_ps(cvt8(wr + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(cvt8(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(cvt8(wr + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(cvt8(wr + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(cvt8(wr + k), _mm256_loadu_ps(x + k), a0);
    acc = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) acc += x[k] * (float)wr[k];
    return acc;
}

void int8_gemv(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) y[(size_t)m * N + n] = dot_int8(x + (size_t)m * K, w + (size_t)n * K, K) * scale[n];
}

/* ---------------------------------------------------------------- int4, PyTorch's CPU tiles */

/* sz entry (group g, row n, which: 0 = s, 1 = z) as fp32 */
static inline float sz_at(const void *sz, int sz_bf16, int N, int g, int n, int which) {
    const size_t i = ((size_t)g * N + n) * 2 + which;
    return sz_bf16 ? bf16_bits_to_f32(((const uint16_t *)sz)[i]) : ((const float *)sz)[i];
}

/* acc[r] += sum over k in [k0, k1) of u[r, k] x[k] for the 2 * HALF rows of one tile ([K, HALF]
 * bytes: byte j holds rows j and HALF + j). k0, k1 even. Row r's sum over a k pair is
 * (u0 x0 + u1 x1): two accumulator sets, one per k of a pair, when the tile alone would give too
 * few independent FMA chains to hide the FMA latency. */
#if defined(LOWBIT_AVX512) || defined(LOWBIT_AVX2)
#ifdef LOWBIT_AVX512
typedef __m512 vf;
typedef __m512i vi;
#define VW 16
#define LOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define AND_I _mm512_and_si512
#define SRL_I _mm512_srli_epi32
#define SET1_I _mm512_set1_epi32
#define LOADU_I(p) _mm512_loadu_si512((const void *)(p))
#define SLL_I _mm512_slli_epi32
#define CAST_F _mm512_castsi512_ps
#define MUL_F _mm512_mul_ps
#define SUB_F _mm512_sub_ps
#define CVT_F _mm512_cvtepi32_ps
#define FMA_F _mm512_fmadd_ps
#define ADD_F _mm512_add_ps
#define SET1_F _mm512_set1_ps
#define ZERO_F _mm512_setzero_ps
#define LOAD_F _mm512_loadu_ps
#define STORE_F _mm512_storeu_ps
#else
typedef __m256 vf;
typedef __m256i vi;
#define VW 8
#define LOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define AND_I _mm256_and_si256
#define SRL_I _mm256_srli_epi32
#define SET1_I _mm256_set1_epi32
#define LOADU_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define SLL_I _mm256_slli_epi32
#define CAST_F _mm256_castsi256_ps
#define MUL_F _mm256_mul_ps
#define SUB_F _mm256_sub_ps
#define CVT_F _mm256_cvtepi32_ps
#define FMA_F _mm256_fmadd_ps
#define ADD_F _mm256_add_ps
#define SET1_F _mm256_set1_ps
#define ZERO_F _mm256_setzero_ps
#define LOAD_F _mm256_loadu_ps
#define STORE_F _mm256_storeu_ps
#endif
static inline __attribute__((always_inline)) void tile_group(const uint8_t *tile, const float *x, int k0, int k1,
                                                            float *acc, const int HALF) {
    enum { MAXV = 64 / VW }; /* accumulators of one k: 2 * HALF / VW <= MAXV */
    const int NV = HALF / VW, U = 2 * NV <= 4 ? 2 : 1; /* U: k's in flight */
    const vi nib = SET1_I(0x0F);
    vf a[2][MAXV];
    for (int u = 0; u < 2; u++)
        for (int i = 0; i < 2 * NV; i++) a[u][i] = ZERO_F();
    for (int k = k0; k < k1; k += U)
        for (int u = 0; u < U; u++) {
            const uint8_t *b = tile + (size_t)(k + u) * HALF;
            __builtin_prefetch(b + PREFETCH_BYTES);
            const vf xb = SET1_F(x[k + u]);
            for (int c = 0; c < NV; c++) {
                const vi v = LOAD_U8(b + c * VW);
                a[u][c] = FMA_F(CVT_F(AND_I(v, nib)), xb, a[u][c]);
                a[u][NV + c] = FMA_F(CVT_F(SRL_I(v, 4)), xb, a[u][NV + c]);
            }
        }
    for (int i = 0; i < 2 * NV; i++) { /* accumulator i covers rows i * VW .. (lows, then highs) */
        vf t = LOAD_F(acc + i * VW);
        t = ADD_F(t, U == 2 ? ADD_F(a[0][i], a[1][i]) : a[0][i]);
        STORE_F(acc + i * VW, t);
    }
}
#else
static inline void tile_group(const uint8_t *tile, const float *x, int k0, int k1, float *acc, const int HALF) {
    for (int k = k0; k < k1; k++) {
        const uint8_t *b = tile + (size_t)k * HALF;
        for (int j = 0; j < HALF; j++) {
            acc[j] += (float)(b[j] & 0x0F) * x[k];
            acc[HALF + j] += (float)(b[j] >> 4) * x[k];
        }
    }
}
#endif

/* out[r] += s * acc[r] + (z - 8 s) * xsum for rows n0 .. n0 + rows of group g: the scales once per
 * group. bf16 tables with whole vectors of rows take the vector path: a row's (s, z) pair is one
 * 32-bit word, s its low half (<< 16 makes the fp32), z its high half; the same operations in the
 * same order as the scalar loop, so either gives bitwise the same row. */
static inline void apply_scales(const void *sz, int sz_bf16, int N, int g, int n0, int rows, const float *acc,
                                float xsum, float *out) {
    int r = 0;
#if defined(LOWBIT_AVX512) || defined(LOWBIT_AVX2)
    if (sz_bf16) {
        const uint32_t *pairs = (const uint32_t *)sz + (size_t)g * N + n0;
        const vi high = SET1_I((int)0xFFFF0000u);
        const vf eight = SET1_F(8.f), xs = SET1_F(xsum);
        for (; r + VW <= rows; r += VW) {
            const vi v = LOADU_I(pairs + r);
            const vf sv = CAST_F(SLL_I(v, 16)), zv = CAST_F(AND_I(v, high));
            const vf t = ADD_F(MUL_F(sv, LOAD_F(acc + r)), MUL_F(SUB_F(zv, MUL_F(eight, sv)), xs));
            STORE_F(out + r, ADD_F(LOAD_F(out + r), t));
        }
    }
#endif
    for (; r < rows; r++) {
        const float s = sz_at(sz, sz_bf16, N, g, n0 + r, 0), z = sz_at(sz, sz_bf16, N, g, n0 + r, 1);
        out[r] += s * acc[r] + (z - 8.f * s) * xsum;
    }
}

/* One row's output for the rows [n0, n0 + rows) of one tile: sum over groups. */
static inline void tile_row(const uint8_t *tile, const float *x, const float *xsum, const void *sz, int sz_bf16,
                            int N, int G, int group, int n0, int block_n, float *out) {
    for (int r = 0; r < block_n; r++) out[r] = 0.f;
    for (int g = 0; g < G; g++) {
        float acc[64] = {0};
        if (block_n == 64)
            tile_group(tile, x, g * group, (g + 1) * group, acc, 32);
        else
            tile_group(tile, x, g * group, (g + 1) * group, acc, 16);
        apply_scales(sz, sz_bf16, N, g, n0, block_n, acc, xsum[g], out);
    }
}

/* Returns -1 (nothing written) for a tile height other than 32 or 64, an odd group or no memory. */
int int4_gemv(const float *x, const uint8_t *w, const void *sz, int sz_bf16, float *y, int M, int N, int K,
              int group, int block_n, int threads) {
    if ((block_n != 32 && block_n != 64) || group % 2 || K % group) return -1;
    const int G = K / group, full = N - N % block_n;
    float *xsum = malloc(sizeof(float) * (size_t)M * G); /* [M, G]: sum of x over each group, the zero points' term */
    if (!xsum) return -1;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int k = g * group; k < (g + 1) * group; k++) s += x[(size_t)m * K + k];
            xsum[(size_t)m * G + g] = s;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < full / block_n; t++) {
        const uint8_t *tile = w + (size_t)t * block_n / 2 * K;
        for (int m = 0; m < M; m++) {
            float out[64];
            tile_row(tile, x + (size_t)m * K, xsum + (size_t)m * G, sz, sz_bf16, N, G, group, t * block_n, block_n,
                     out);
            float *ym = y + (size_t)m * N + (size_t)t * block_n;
            for (int r = 0; r < block_n; r++) ym[r] = out[r];
        }
    }
    /* the short last tile (N % block_n rows, a multiple of 16): byte j of column k holds rows 2j, 2j + 1 */
    const int rest = N - full;
    const uint8_t *tail = w + (size_t)full * K / 2;
    for (int m = 0; m < M; m++)
        for (int r = 0; r < rest; r++) {
            const float *xm = x + (size_t)m * K;
            float out = 0.f;
            for (int g = 0; g < G; g++) {
                float acc = 0.f;
                for (int k = g * group; k < (g + 1) * group; k++) {
                    const uint8_t b = tail[(size_t)k * (rest / 2) + r / 2];
                    acc += (float)((r & 1) ? b >> 4 : b & 0x0F) * xm[k];
                }
                apply_scales(sz, sz_bf16, N, g, full + r, 1, &acc, xsum[(size_t)m * G + g], &out);
            }
            y[(size_t)m * N + full + r] = out;
        }
    free(xsum);
    return 0;
}

/* The dequantized rows [n0, n1) of an int4 weight, W = (u - 8) s + z in fp32 (two roundings, as
 * torch computes it), into out [n1 - n0, K]. n0 a multiple of block_n; n1 one too, or N. */
void int4_dequant(const uint8_t *w, const void *sz, int sz_bf16, float *out, int N, int K, int group, int block_n,
                  int n0, int n1, int threads) {
    const int full = N - N % block_n, rest = N - full, half = block_n / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = n0; n < n1; n++) {
        float *o = out + (size_t)(n - n0) * K;
        /* this row's code of column k: byte base + k * stride, nibble at `shift` */
        const uint8_t *base;
        size_t stride;
        int shift;
        if (n < full) {
            const int t = n / block_n, r = n % block_n;
            base = w + (size_t)t * half * K + (r % half), stride = (size_t)half, shift = r < half ? 0 : 4;
        } else {
            const int r = n - full;
            base = w + (size_t)full * K / 2 + r / 2, stride = (size_t)(rest / 2), shift = (r & 1) ? 4 : 0;
        }
        for (int g = 0; g < K / group; g++) {
            const float s = sz_at(sz, sz_bf16, N, g, n, 0), z = sz_at(sz, sz_bf16, N, g, n, 1);
            for (int k = g * group; k < (g + 1) * group; k++)
                o[k] = ((float)((base[(size_t)k * stride] >> shift) & 0x0F) - 8.f) * s + z;
        }
    }
}
