/* Decode attention straight from the paged KV pool (one query token per sequence).
 *
 * The torch path gathers every sequence's K/V into a padded tensor before SDPA: each step it
 * writes and re-reads the whole context. Here each (sequence, KV head, split) task walks the
 * sequence's block table and reads K and V in place, once. The G query heads that share a
 * KV head (GQA/MQA) are scored against each K row while it is in cache.
 *
 * Long contexts with few sequences are cut into `splits` ranges of positions (flash-decoding):
 * each range keeps its own max, sum and unnormalised output, merged at the end, so batch-1
 * decode still uses every core.
 *
 * Layouts (all contiguous):
 *   q        [B, H, D]            fp32 or bf16 (q_bf16)
 *   k, v     [slots, KVH, D]      kv_type (kv_row.h): fp32, bf16 or fp16; slot = block_table[p / bs] * bs + p % bs
 *   tables   [B, max_blocks]      int32
 *   starts   [B], lens [B]        int32: sequence b attends positions [starts[b], lens[b])
 *   out      [B, H, D]            same dtype as q
 * Arithmetic is fp32 throughout (bf16 products are exact in fp32); 16-bit K/V rows are widened in
 * registers (AVX-512 score tiles) or once into L1, then used for all G heads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_row.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#endif
#if defined(__AVX512F__)
__m512 _ZGVeN16v_expf(__m512); /* glibc's vector expf (libmvec) */
#elif defined(__AVX2__) && defined(__FMA__)
__m256 _ZGVdN8v_expf(__m256);
#endif

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* out[g] = q[g] . k for the G query heads sharing a K row: with AVX-512 (or AVX2) four heads at a time,
 * two accumulators each, so eight independent FMA chains hide the FMA latency that one
 * reduction per head serialised on (the score pass ran ~3x slower than its loads). */
static inline void dots(const float *restrict q, const float *restrict k, int G, int D, float *restrict out) {
#ifdef __AVX512F__
    if (D % 32 == 0) {
        int g = 0;
        for (; g + 4 <= G; g += 4) {
            const float *q0 = q + (int64_t)g * D;
            __m512 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 32) {
                const __m512 k0 = _mm512_loadu_ps(k + d), k1 = _mm512_loadu_ps(k + d + 16);
                for (int h = 0; h < 4; h++) {
                    a[2 * h] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + h * D + d), k0, a[2 * h]);
                    a[2 * h + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + h * D + d + 16), k1, a[2 * h + 1]);
                }
            }
            for (int h = 0; h < 4; h++) out[g + h] = _mm512_reduce_add_ps(_mm512_add_ps(a[2 * h], a[2 * h + 1]));
        }
        for (; g < G; g++) out[g] = dot(q + (int64_t)g * D, k, D);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 16 == 0) { /* the same with 8-wide vectors */
        int g = 0;
        for (; g + 4 <= G; g += 4) {
            const float *q0 = q + (int64_t)g * D;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 16) {
                const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
                for (int h = 0; h < 4; h++) {
                    a[2 * h] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + h * D + d), k0, a[2 * h]);
                    a[2 * h + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + h * D + d + 8), k1, a[2 * h + 1]);
                }
            }
            for (int h = 0; h < 4; h++) {
                const __m256 v = _mm256_add_ps(a[2 * h], a[2 * h + 1]);
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                r = _mm_add_ps(r, _mm_movehl_ps(r, r));
                out[g + h] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
            }
        }
        for (; g < G; g++) out[g] = dot(q + (int64_t)g * D, k, D);
        return;
    }
#endif
    for (int g = 0; g < G; g++) out[g] = dot(q + (int64_t)g * D, k, D);
}

#ifdef HAVE_DPBF16
/* bf16 . bf16 with the AVX512-BF16 pair dot product: exact products, fp32 sums, no widening.
 * D must be a multiple of 32. */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int D) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    return _mm512_reduce_add_ps(acc);
}
#endif

typedef struct {
    float *m, *l, *acc; /* per head: max score, sum of exp, unnormalised output [G, D] */
} Partial;

typedef struct {
    const void *q, *k, *v;
    const int32_t *tables, *starts, *lens;
    void *out;
    int B, H, KVH, D, bs, max_blocks, splits, q_bf16, kv;
    float scale;
} Args;

/* offs[i] = element offset of KV head kvh's row of position p0 + i, for i < p1 - p0: one walk of the
 * block table per task, so the passes index an array instead of dividing by the page size twice a
 * row (1.13x / 1.32x over fp32 / fp16 pages at 4K positions, 8 KV heads of 64; docs/ARCHITECTURE.md). */
static void row_offsets(const Args *a, const int32_t *table, int kvh, int p0, int p1, int64_t *offs) {
    const int64_t row = (int64_t)a->KVH * a->D, head = (int64_t)kvh * a->D;
    int p = p0;
    while (p < p1) {
        const int blk = p / a->bs, end = (blk + 1) * a->bs < p1 ? (blk + 1) * a->bs : p1;
        const int64_t first = (int64_t)table[blk] * a->bs - (int64_t)blk * a->bs; /* slot of p is first + p */
        for (; p < end; p++) offs[p - p0] = (first + p) * row + head;
    }
}

/* The K or V row of position p on its way into cache: a decode step streams the weights between
 * two reads of a layer's pages, so they come from DRAM. Asking PREFETCH_ROWS rows ahead gained
 * 1.02-1.05x per call (docs/ARCHITECTURE.md, "Measured decisions"; most of the win there is `dots`). */
#define PREFETCH_ROWS 4
static inline void prefetch_row(const Args *a, const void *base, int64_t off) {
    const int elem = kv_elem_size(a->kv);
    const char *row = (const char *)base + off * elem;
    for (int c = 0; c < a->D * elem; c += 64) __builtin_prefetch(row + c);
}

/* s[i] = exp(s[i] - m) for i < n -> their sum; in vector registers where the CPU has them (the
 * scalar loop was ~1/6 of a call). */
static inline float exp_sum(float *s, int n, float m) {
    int i = 0;
    float l = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    l = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float t[8];
    _mm256_storeu_ps(t, acc);
    for (int j = 0; j < 8; j++) l += t[j];
#endif
    for (; i < n; i++) l += (s[i] = expf(s[i] - m));
    return l;
}

#if defined(__AVX512F__)
#define PV_ROWS 16 /* V rows weighed per block (16 KB of fp32 at D = 256: in L1) */
/* acc[h] += sum_i w[h * ws + i] * rows[i] for NH (1 or 4) heads over m rows, D a multiple of 64:
 * each 64-float slice of the NH outputs stays in registers over the block, so the accumulators
 * go through memory once a block instead of once a row. */
static inline __attribute__((always_inline)) void weigh_rows(const float *const *rows, int m, const float *w,
                                                             int ws, float *acc, int D, const int NH) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 o[4][4];
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++) o[h][j] = _mm512_loadu_ps(acc + (int64_t)h * D + d0 + 16 * j);
        for (int i = 0; i < m; i++) {
            const float *r = rows[i] + d0;
            const __m512 v0 = _mm512_loadu_ps(r), v1 = _mm512_loadu_ps(r + 16);
            const __m512 v2 = _mm512_loadu_ps(r + 32), v3 = _mm512_loadu_ps(r + 48);
            for (int h = 0; h < NH; h++) {
                const __m512 x = _mm512_set1_ps(w[h * ws + i]);
                o[h][0] = _mm512_fmadd_ps(x, v0, o[h][0]);
                o[h][1] = _mm512_fmadd_ps(x, v1, o[h][1]);
                o[h][2] = _mm512_fmadd_ps(x, v2, o[h][2]);
                o[h][3] = _mm512_fmadd_ps(x, v3, o[h][3]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + (int64_t)h * D + d0 + 16 * j, o[h][j]);
    }
}

/* 16 K elements at element offset `off` of the pool as fp32 (a 16-bit pool widened in registers). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t off, const int type) {
    if (type == KV_F32) return _mm512_loadu_ps((const float *)base + off);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    if (type == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: the top half */
}

/* out[h * ws + r] = q[h] . k_r for NR rows (at element offsets off[r]) and NH heads (1 or 4),
 * D a multiple of 16: each q load serves NR rows and each K load NH heads (the one-row loop was
 * bound by its q loads). */
static inline __attribute__((always_inline)) void score_tile(const void *base, const int64_t *off, const float *q,
                                                             int D, const int type, float *out, int ws,
                                                             const int NR, const int NH) {
    __m512 acc[4][4];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < NR; r++) acc[h][r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 k[4];
        for (int r = 0; r < NR; r++) k[r] = load16(base, off[r] + d, type);
        for (int h = 0; h < NH; h++) {
            const __m512 qv = _mm512_loadu_ps(q + (int64_t)h * D + d);
            for (int r = 0; r < NR; r++) acc[h][r] = _mm512_fmadd_ps(qv, k[r], acc[h][r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < NR; r++) out[(int64_t)h * ws + r] = _mm512_reduce_add_ps(acc[h][r]);
}

/* Pass 1 in blocks of 4 positions: scores [G, n] (unscaled) of the n rows at offsets offs. */
static inline __attribute__((always_inline)) void score_range_t(const Args *a, const int64_t *offs, int n,
                                                                const float *qh, float *scores, const int type) {
    const int G = a->H / a->KVH, D = a->D;
    for (int pb = 0; pb < n; pb += 4) {
        const int m = n - pb < 4 ? n - pb : 4;
        const int64_t *off = offs + pb;
        for (int i = 0; i < m; i++)
            if (PREFETCH_ROWS && pb + i + PREFETCH_ROWS < n) prefetch_row(a, a->k, offs[pb + i + PREFETCH_ROWS]);
        float *out = scores + pb;
        int g = 0;
        for (; g + 4 <= G; g += 4) {
            const float *qg = qh + (int64_t)g * D;
            if (m == 4) score_tile(a->k, off, qg, D, type, out + (int64_t)g * n, n, 4, 4);
            else
                for (int i = 0; i < m; i++) score_tile(a->k, off + i, qg, D, type, out + (int64_t)g * n + i, n, 1, 4);
        }
        for (; g < G; g++) {
            const float *qg = qh + (int64_t)g * D;
            if (m == 4) score_tile(a->k, off, qg, D, type, out + (int64_t)g * n, n, 4, 1);
            else
                for (int i = 0; i < m; i++) score_tile(a->k, off + i, qg, D, type, out + (int64_t)g * n + i, n, 1, 1);
        }
    }
}

/* Pass 1 through the score tiles (D a multiple of 16) -> 1, or 0 where they do not apply. */
static int score_range(const Args *a, const int64_t *offs, int n, const float *qh, float *scores) {
    if (a->D % 16) return 0;
    if (a->kv == KV_F16) score_range_t(a, offs, n, qh, scores, KV_F16);
    else if (a->kv == KV_BF16) score_range_t(a, offs, n, qh, scores, KV_BF16);
    else score_range_t(a, offs, n, qh, scores, KV_F32);
    return 1;
}

/* Pass 2 in blocks of PV_ROWS positions: the block's V rows (16-bit ones widened into `buf`
 * [PV_ROWS, D]) weighed by every head's scores [G, n]. */
static void weigh_range(const Args *a, const int64_t *offs, int n, const float *scores, float *acc, float *buf) {
    const int G = a->H / a->KVH, D = a->D;
    const float *rows[PV_ROWS];
    for (int pb = 0; pb < n; pb += PV_ROWS) {
        const int m = n - pb < PV_ROWS ? n - pb : PV_ROWS;
        for (int i = 0; i < m; i++) {
            if (PREFETCH_ROWS && pb + i + PREFETCH_ROWS < n) prefetch_row(a, a->v, offs[pb + i + PREFETCH_ROWS]);
            rows[i] = kv_load_row(a->v, offs[pb + i], a->kv, D, buf + (int64_t)i * D);
        }
        const float *w = scores + pb;
        int g = 0;
        for (; g + 4 <= G; g += 4) weigh_rows(rows, m, w + (int64_t)g * n, n, acc + (int64_t)g * D, D, 4);
        for (; g < G; g++) weigh_rows(rows, m, w + (int64_t)g * n, n, acc + (int64_t)g * D, D, 1);
    }
}
#else
static int score_range(const Args *a, const int64_t *offs, int n, const float *qh, float *scores) {
    (void)a, (void)offs, (void)n, (void)qh, (void)scores;
    return 0;
}
#endif

/* Positions [p0, p1) of sequence b against KV head kvh: fills `part`. scores: [G, p1 - p0];
 * offs: [p1 - p0], scratch for the rows' offsets. */
static void attend_range(const Args *a, int b, int kvh, int p0, int p1, float *scores, int64_t *offs, Partial part) {
    const int G = a->H / a->KVH, D = a->D, n = p1 - p0;
    row_offsets(a, a->tables + (int64_t)b * a->max_blocks, kvh, p0, p1, offs);
    const int64_t q0 = ((int64_t)b * a->H + (int64_t)kvh * G) * D; /* this task's G query rows */
    float qh[G * D], row[D], sc[G];
    for (int i = 0; i < G * D; i++)
        qh[i] = a->q_bf16 ? kv_bf16_to_f32(((const uint16_t *)a->q)[q0 + i]) : ((const float *)a->q)[q0 + i];
#ifdef HAVE_DPBF16
    const int use_dp = a->q_bf16 && a->kv == KV_BF16 && D % 32 == 0;
#else
    const int use_dp = 0;
#endif
    /* pass 1: scores and the max per head */
    for (int g = 0; g < G; g++) part.m[g] = -INFINITY;
    if (!use_dp && score_range(a, offs, n, qh, scores)) {
        for (int g = 0; g < G; g++) {
            float *sg = scores + (int64_t)g * n, mx = -INFINITY;
            for (int i = 0; i < n; i++) {
                sg[i] *= a->scale;
                mx = sg[i] > mx ? sg[i] : mx;
            }
            part.m[g] = mx;
        }
    } else {
        for (int i = 0; i < n; i++) {
            const int64_t off = offs[i];
            if (PREFETCH_ROWS && i + PREFETCH_ROWS < n) prefetch_row(a, a->k, offs[i + PREFETCH_ROWS]);
            const float *kr = use_dp ? NULL : kv_load_row(a->k, off, a->kv, D, row);
            if (!use_dp) dots(qh, kr, G, D, sc);
            for (int g = 0; g < G; g++) {
                float s = sc[g];
#ifdef HAVE_DPBF16
                if (use_dp) s = dot_bf16((const uint16_t *)a->q + q0 + (int64_t)g * D, (const uint16_t *)a->k + off, D);
#endif
                s *= a->scale;
                scores[(int64_t)g * n + i] = s;
                if (s > part.m[g]) part.m[g] = s;
            }
        }
    }
    /* exp and sum per head */
    for (int g = 0; g < G; g++) part.l[g] = exp_sum(scores + (int64_t)g * n, n, part.m[g]);
    /* pass 2: the weighted sum of V rows */
    memset(part.acc, 0, sizeof(float) * G * D);
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        float buf[a->kv == KV_F32 ? 1 : PV_ROWS * D];
        weigh_range(a, offs, n, scores, part.acc, buf);
        return;
    }
#endif
    for (int i = 0; i < n; i++) {
        if (PREFETCH_ROWS && i + PREFETCH_ROWS < n) prefetch_row(a, a->v, offs[i + PREFETCH_ROWS]);
        const float *vr = kv_load_row(a->v, offs[i], a->kv, D, row);
        for (int g = 0; g < G; g++) {
            const float w = scores[(int64_t)g * n + i];
            float *restrict ag = part.acc + (int64_t)g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ag[d] += w * vr[d];
        }
    }
}

static inline void store(const Args *a, int64_t index, const float *o, float inv_l) {
    if (a->q_bf16) {
        uint16_t *dst = (uint16_t *)a->out + index;
        for (int d = 0; d < a->D; d++) dst[d] = kv_f32_to_bf16(o[d] * inv_l);
    } else {
        float *dst = (float *)a->out + index;
        for (int d = 0; d < a->D; d++) dst[d] = o[d] * inv_l;
    }
}

int paged_decode(const void *q, const void *k, const void *v, const int32_t *tables, const int32_t *starts,
                 const int32_t *lens, void *out, int B, int H, int KVH, int D, int bs, int max_blocks, int splits,
                 float scale, int num_threads, int q_bf16, int kv_type) {
    const Args a = {q, k, v, tables, starts, lens, out, B, H, KVH, D, bs, max_blocks, splits, q_bf16, kv_type, scale};
    const int G = H / KVH, ntasks = B * KVH * splits;
    const size_t part_floats = (size_t)G * (D + 2);
    float *parts = malloc(sizeof(float) * (size_t)ntasks * part_floats);
    if (!parts) return -1;
    int64_t work = 0; /* K/V elements read: a parallel region only pays for itself above ~2e4 */
    for (int b = 0; b < B; b++) work += (int64_t)(lens[b] - starts[b]) * KVH * D;
    if (work < 20000) num_threads = 1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int t = 0; t < ntasks; t++) {
        const int b = t / (KVH * splits), kvh = (t / splits) % KVH, s = t % splits;
        const int span = (lens[b] - starts[b] + splits - 1) / splits;
        const int p0 = starts[b] + s * span, p1 = p0 + span < lens[b] ? p0 + span : lens[b];
        float *base = parts + (size_t)t * part_floats;
        Partial part = {base, base + G, base + 2 * G};
        if (p0 >= p1) { /* an empty split contributes nothing */
            for (int g = 0; g < G; g++) part.m[g] = -INFINITY, part.l[g] = 0.f;
            continue;
        }
        /* the rows' offsets, then their scores [G, p1 - p0] */
        int64_t *offs = malloc((sizeof(int64_t) + sizeof(float) * G) * (size_t)(p1 - p0));
        if (!offs) {
            failed = 1;
            continue;
        }
        attend_range(&a, b, kvh, p0, p1, (float *)(offs + (p1 - p0)), offs, part);
        free(offs);
        if (splits == 1) /* the whole context in one task: normalise and store now */
            for (int g = 0; g < G; g++)
                store(&a, ((int64_t)b * H + kvh * G + g) * D, part.acc + (size_t)g * D, 1.f / part.l[g]);
    }
    if (!failed && splits > 1) {
        /* merge the splits of each (b, kvh, g): rescale each by exp(m_s - m) */
        float o[D];
        for (int bk = 0; bk < B * KVH; bk++) {
            const int b = bk / KVH, kvh = bk % KVH;
            for (int g = 0; g < G; g++) {
                float m = -INFINITY, l = 0.f;
                for (int s = 0; s < splits; s++) {
                    const float ms = parts[((size_t)bk * splits + s) * part_floats + g];
                    if (ms > m) m = ms;
                }
                memset(o, 0, sizeof o);
                for (int s = 0; s < splits; s++) {
                    const float *base = parts + ((size_t)bk * splits + s) * part_floats;
                    if (base[G + g] == 0.f) continue;
                    const float c = expf(base[g] - m);
                    l += c * base[G + g];
                    const float *acc = base + 2 * G + (size_t)g * D;
                    for (int d = 0; d < D; d++) o[d] += c * acc[d];
                }
                store(&a, ((int64_t)b * H + kvh * G + g) * D, o, 1.f / l);
            }
        }
    }
    free(parts);
    return failed ? -1 : 0;
}
