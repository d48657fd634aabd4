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
 *   q        [B, H, D]            fp32 or bf16
 *   k, v     [slots, KVH, D]      same dtype; slot = block_table[p / bs] * bs + p % bs
 *   tables   [B, max_blocks]      int32
 *   starts   [B], lens [B]        int32: sequence b attends positions [starts[b], lens[b])
 *   out      [B, H, D]            same dtype as q
 * Arithmetic is fp32 throughout.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16}; /* bf16 is the top half of fp32 */
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* One task's partial result for G heads: max score, sum of exp, unnormalised output [G, D]. */
typedef struct {
    float *m, *l, *acc;
} Partial;

/* Each K or V row is widened to fp32 once (into `row`, which stays in L1) and then used by all
 * G query heads, instead of being converted G times inside the dot products. */
#define DEFINE_RANGE(NAME, T, LOAD)                                                                  \
    static void NAME(const float *qh, const T *k, const T *v, const int32_t *table, int bs, int kvh,   \
                     int KVH, int D, int G, int p0, int p1, float *scores, Partial part) {             \
        float row[D];                                                                                  \
        const int n = p1 - p0;                                                                         \
        /* pass 1: scores[g, p] = q_g . k_p, and the max per head */                                   \
        for (int g = 0; g < G; g++) part.m[g] = -INFINITY;                                             \
        for (int p = p0; p < p1; p++) {                                                                \
            const T *kr = k + ((int64_t)table[p / bs] * bs + p % bs) * KVH * D + (int64_t)kvh * D;     \
            _Pragma("omp simd") for (int d = 0; d < D; d++) row[d] = LOAD(kr[d]);                      \
            for (int g = 0; g < G; g++) {                                                              \
                const float *qg = qh + (int64_t)g * D;                                                 \
                float s = 0.f;                                                                         \
                _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < D; d++) s += qg[d] * row[d];  \
                scores[(int64_t)g * n + (p - p0)] = s;                                                 \
                if (s > part.m[g]) part.m[g] = s;                                                      \
            }                                                                                          \
        }                                                                                              \
        /* exp and sum per head, then the weighted sum of V rows */                                    \
        for (int g = 0; g < G; g++) {                                                                  \
            float *sg = scores + (int64_t)g * n, l = 0.f;                                              \
            for (int i = 0; i < n; i++) { sg[i] = expf(sg[i] - part.m[g]); l += sg[i]; }               \
            part.l[g] = l;                                                                             \
        }                                                                                              \
        memset(part.acc, 0, sizeof(float) * G * D);                                                    \
        for (int p = p0; p < p1; p++) {                                                                \
            const T *vr = v + ((int64_t)table[p / bs] * bs + p % bs) * KVH * D + (int64_t)kvh * D;     \
            _Pragma("omp simd") for (int d = 0; d < D; d++) row[d] = LOAD(vr[d]);                      \
            for (int g = 0; g < G; g++) {                                                              \
                const float w = scores[(int64_t)g * n + (p - p0)];                                     \
                float *ag = part.acc + (int64_t)g * D;                                                 \
                _Pragma("omp simd") for (int d = 0; d < D; d++) ag[d] += w * row[d];                   \
            }                                                                                          \
        }                                                                                              \
    }

#define IDENT(x) (x)
DEFINE_RANGE(range_f32, float, IDENT)
DEFINE_RANGE(range_bf16, uint16_t, bf16_to_f32)

#define DEFINE_KERNEL(NAME, T, RANGE, LOAD, STORE)                                                     \
    int NAME(const T *q, const T *k, const T *v, const int32_t *tables, const int32_t *starts,          \
             const int32_t *lens, T *out, int B, int H, int KVH, int D, int bs, int max_blocks,         \
             int splits, float scale, int num_threads) {                                                \
        const int G = H / KVH;                                                                          \
        const int ntasks = B * KVH * splits;                                                            \
        /* per task: m[G], l[G], acc[G*D]; merged per (b, kvh) afterwards */                           \
        float *parts = malloc(sizeof(float) * (size_t)ntasks * G * (D + 2));                            \
        if (!parts) return -1;                                                                          \
        int failed = 0;                                                                                 \
        int64_t work = 0; /* K/V elements read: a parallel region only pays for itself above ~1e5 */   \
        for (int b = 0; b < B; b++) work += (int64_t)(lens[b] - starts[b]) * KVH * D;                   \
        if (work < 100000) num_threads = 1;                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                      \
        for (int t = 0; t < ntasks; t++) {                                                              \
            const int b = t / (KVH * splits), kvh = (t / splits) % KVH, s = t % splits;                 \
            const int start = starts[b], len = lens[b];                                                 \
            const int span = (len - start + splits - 1) / splits;                                       \
            const int p0 = start + s * span, p1 = p0 + span < len ? p0 + span : len;                    \
            float *base = parts + (size_t)t * G * (D + 2);                                              \
            Partial part = {base, base + G, base + 2 * G};                                              \
            if (p0 >= p1) { /* an empty split contributes nothing */                                   \
                for (int g = 0; g < G; g++) { part.m[g] = -INFINITY; part.l[g] = 0.f; }                 \
                memset(part.acc, 0, sizeof(float) * G * D);                                             \
                continue;                                                                               \
            }                                                                                           \
            float qh[G * D];                                                                            \
            for (int g = 0; g < G; g++)                                                                 \
                for (int d = 0; d < D; d++)                                                             \
                    qh[g * D + d] = LOAD(q[((int64_t)b * H + kvh * G + g) * D + d]) * scale;            \
            float *scores = malloc(sizeof(float) * (size_t)G * (p1 - p0));                              \
            if (!scores) { failed = 1; continue; }                                                      \
            RANGE(qh, k, v, tables + (int64_t)b * max_blocks, bs, kvh, KVH, D, G, p0, p1, scores, part); \
            free(scores);                                                                               \
            if (splits == 1) { /* the whole context in one task: normalise and store now */            \
                for (int g = 0; g < G; g++) {                                                           \
                    T *dst = out + ((int64_t)b * H + kvh * G + g) * D;                                  \
                    for (int d = 0; d < D; d++) dst[d] = STORE(part.acc[g * D + d] / part.l[g]);        \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        if (failed) { free(parts); return -1; }                                                         \
        if (splits == 1) { free(parts); return 0; }                                                     \
        /* merge the splits of each (b, kvh, g): rescale each by exp(m_s - m) */                       \
        for (int bk = 0; bk < B * KVH; bk++) {                                                          \
            const int b = bk / KVH, kvh = bk % KVH;                                                     \
            for (int g = 0; g < G; g++) {                                                               \
                float m = -INFINITY, l = 0.f;                                                           \
                for (int s = 0; s < splits; s++) {                                                      \
                    float ms = parts[((size_t)bk * splits + s) * G * (D + 2) + g];                      \
                    if (ms > m) m = ms;                                                                 \
                }                                                                                       \
                float o[D];                                                                             \
                memset(o, 0, sizeof o);                                                                 \
                for (int s = 0; s < splits; s++) {                                                      \
                    const float *base = parts + ((size_t)bk * splits + s) * G * (D + 2);                \
                    if (base[G + g] == 0.f) continue;                                                   \
                    float c = expf(base[g] - m);                                                        \
                    l += c * base[G + g];                                                               \
                    const float *a = base + 2 * G + (size_t)g * D;                                      \
                    for (int d = 0; d < D; d++) o[d] += c * a[d];                                       \
                }                                                                                       \
                T *dst = out + ((int64_t)b * H + kvh * G + g) * D;                                      \
                for (int d = 0; d < D; d++) dst[d] = STORE(o[d] / l);                                   \
            }                                                                                           \
        }                                                                                               \
        free(parts);                                                                                    \
        return 0;                                                                                       \
    }

DEFINE_KERNEL(paged_decode_f32, float, range_f32, IDENT, IDENT)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, range_bf16, bf16_to_f32, f32_to_bf16)
