/* Structured outputs' token mask: x[r, v] = -inf wherever bit v of row r's bitmask is 0.
 *
 * x [M, V] fp32 row-major; mask [M, W] int32 (W = ceil(V / 32), bit v % 32 of word v / 32 set:
 * token v allowed), xgrammar's bitmask layout; only the `n` rows listed in `rows` are touched.
 * A grammar usually allows a few tokens (~1 MB of -inf per Gemma row) or nearly all of them (a
 * JSON string's characters): whole words of 0 are filled with a plain store loop, words of ones
 * skipped, so a row costs its writes (xgrammar's own CPU loop took ~1.6 ms a row here).
 */
#include <math.h>
#include <stdint.h>

static void mask_row(float *x, const int32_t *mask, int64_t V) {
    const int64_t words = (V + 31) / 32;
    for (int64_t w = 0; w < words; w++) {
        const uint32_t bits = (uint32_t)mask[w];
        if (bits == 0xFFFFFFFFu) continue;
        float *p = x + w * 32;
        const int64_t n = V - w * 32 < 32 ? V - w * 32 : 32;
        if (bits == 0) {
            for (int64_t i = 0; i < n; i++) p[i] = -INFINITY;
            continue;
        }
        for (int64_t i = 0; i < n; i++)
            if (!((bits >> i) & 1u)) p[i] = -INFINITY;
    }
}

void apply_token_bitmask(float *x, const int32_t *mask, const int64_t *rows, int n, int64_t V, int64_t W,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int i = 0; i < n; i++) mask_row(x + rows[i] * V, mask + rows[i] * W, V);
}
