/* The attention prologue of a decode step in one call: per token row, the optional per-head
 * RMSNorm of q and k (Gemma 3's q_norm / k_norm), the half-rotation RoPE of q and k, and the
 * write of the rotated k and of v into the paged KV pool. In torch this is ~25 small ops per
 * layer, whose dispatch costs more than their arithmetic at a few rows.
 *
 * Bitwise the same as the torch path: the norm is norm_row.h (the rms_norm kernel's), and RoPE is
 * x * cos + rotate_half(x) * sin with each product rounded before the sum (C11 mode, no FMA
 * contraction), as torch's elementwise ops round them.
 *
 * Layouts (fp32): q [T, H, D] and k, v [T, KVH, D] with a row stride in floats (views into a
 * fused qkv output are fine); cos, sin [T, D]; slots [T] int64; k_pool, v_pool [slots, KVH, D];
 * q_out [T, H, D] contiguous. k == NULL: a layer without K/V of its own (only q is rotated).
 * q_gain / k_gain NULL: no norm. The pools hold kv_type elements (kv_row.h: fp32, bf16 or fp16);
 * 16-bit pools get each row rounded as torch's `.to()` rounds it. */
#include <stdint.h>
#include <string.h>
#include "kv_row.h"
#include "norm_row.h"

static void rotate(const float *x, const float *cos, const float *sin, float *out, int D) {
    const int half = D / 2;
#pragma omp simd
    for (int d = 0; d < half; d++) out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
#pragma omp simd
    for (int d = half; d < D; d++) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

void norm_rope_write(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                     int64_t v_stride, int T, int H, int KVH, int D, const float *q_gain, const float *k_gain,
                     float eps, const float *cos, const float *sin, const int64_t *slots, void *k_pool,
                     void *v_pool, float *q_out, int threads, int kv_type) {
#pragma omp parallel for num_threads(threads) if (T >= 8) schedule(static)
    for (int t = 0; t < T; t++) {
        float tmp[D], rot[D];
        const float *ct = cos + (int64_t)t * D, *st = sin + (int64_t)t * D;
        for (int h = 0; h < H; h++) {
            const float *x = q + t * q_stride + (int64_t)h * D;
            if (q_gain) {
                norm_row(x, q_gain, tmp, D, eps);
                x = tmp;
            }
            rotate(x, ct, st, q_out + ((int64_t)t * H + h) * D, D);
        }
        if (!k) continue;
        const int64_t base = slots[t] * KVH * D;
        for (int h = 0; h < KVH; h++) {
            const float *x = k + t * k_stride + (int64_t)h * D;
            if (k_gain) {
                norm_row(x, k_gain, tmp, D, eps);
                x = tmp;
            }
            if (kv_type == KV_F32) {
                rotate(x, ct, st, (float *)k_pool + base + (int64_t)h * D, D);
                memcpy((float *)v_pool + base + (int64_t)h * D, v + t * v_stride + (int64_t)h * D, sizeof(float) * D);
            } else {
                rotate(x, ct, st, rot, D);
                kv_store_row(k_pool, base + (int64_t)h * D, kv_type, D, rot);
                kv_store_row(v_pool, base + (int64_t)h * D, kv_type, D, v + t * v_stride + (int64_t)h * D);
            }
        }
    }
}
