/* The layer stack of a batch-1 decode step in one call (Gemma 3's and Llama's decoder layers).
 *
 * Why: at one token per step each layer is ~10 kernel calls and ~25 small torch ops whose Python
 * and dispatch overhead (~0.6-0.8 ms a layer on this project's 2-core machines) cost as much as
 * the weights' stream. Here the same kernels run back to back from C: the other kernel libraries'
 * functions are passed in as pointers (kvserve/accel/decode_plan.py takes them from their ctypes
 * handles), so every number is what the Python path computes, bit for bit.
 *
 * Per layer, h [hidden] fp32 in place (Gemma's sandwich norms; Llama: without the two post norms):
 *   x = rms_norm(h) * g_in;  qkv = x W_qkv^T;  q, k normed (when g_q, g_k) + RoPE, k and v written
 *   a = attention(q) W_o^T;  h = h + rms_norm(a) * g_post_attn  (Llama: h + a);  x = rms_norm(h) * g_pre_ff
 *   gu = x W_gu^T;  m = (act(gate) * up) W_down^T;  h = h + rms_norm(m) * g_post_ff  (Llama: h + m)
 * act: gelu_tanh (Gemma) or silu (Llama).
 */
#include <stdint.h>
#include <stdlib.h>

typedef void (*panel_gemm_fn)(const float *, const float *, float *, int, int, int, int);
typedef void (*int8_gemv_fn)(const float *, const int8_t *, const float *, float *, int, int, int, int);
typedef int (*int4_gemv_fn)(const float *, const uint8_t *, const void *, int, float *, int, int, int, int, int, int);
typedef void (*rms_norm_fn)(const float *, const float *, float *, int, int, float, int);
typedef void (*add_rms_norm_fn)(const float *, const float *, const float *, float *, const float *, float *, int,
                                int, float, int);
typedef void (*norm_rope_write_fn)(const float *, int64_t, const float *, int64_t, const float *, int64_t, int, int,
                                   int, int, const float *, const float *, float, const float *, const float *,
                                   const int64_t *, void *, void *, float *, int, int);
typedef int (*paged_decode_fn)(const void *, const void *, const void *, const int32_t *, const int32_t *,
                               const int32_t *, void *, int, int, int, int, int, int, int, float, int, int, int);
typedef void (*gated_act_fn)(const float *, const float *, float *, int, int, int64_t, int);
typedef int (*ggml_gemv_fn)(const float *, const uint8_t *, int, float *, int, int, int, int64_t, int);
typedef void (*half_gemv_fn)(const float *, const uint16_t *, int, float *, int, int, int, int);

enum { LIN_PANELS = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_GGML = 3, LIN_GGML_Q8 = 4, LIN_HALF = 5 }; /* Q8: int8 activations */

typedef struct {
    int kind, n, k;
    const void *w; /* packed panels [ceil(n / PW), k, PW] / int8 [n, k] / int4 tiles [n, k / 2] / GGUF blocks / 16-bit [n, k] */
    const void *scale; /* int8: fp32 [n]; int4: (s, z) table [k / group, n, 2]; panels, GGUF: unused */
    int sz_bf16, group, block_n; /* GGUF: group = the ggml type; 16-bit: sz_bf16 1 for bf16, 0 for fp16 */
    int64_t row_bytes;           /* GGUF: bytes of one weight row */
    const int64_t *order;        /* GGUF: output i is the file's row order[i] (NULL: in order) */
} Lin;

typedef struct { /* what a step's layers of one (KV group, window, rope table) share */
    const float *cos, *sin;  /* [D] */
    const int64_t *slot;     /* [1]: where this token's K/V go */
    const int32_t *table;    /* [max_blocks] */
    const int32_t *start, *len; /* [1]: attend positions [start, len) */
    int max_blocks;
} Ctx;

typedef struct {
    Lin qkv[3], o, gate_up[2], down; /* q/k/v and gate/up: one fused matrix, or separate parts (GGUF) */
    int n_qkv, n_gate_up;
    /* g_q / g_k NULL: no q/k norm; g_post_attn / g_post_ff NULL: no post norms (Llama) */
    const float *g_in, *g_post_attn, *g_pre_ff, *g_post_ff, *g_q, *g_k;
    void *k_pool, *v_pool; /* Step.kv_type elements (kv_row.h) */
    int ctx;
} Layer;

typedef struct {
    panel_gemm_fn panel_gemm;
    int8_gemv_fn int8_gemv;
    int4_gemv_fn int4_gemv;
    rms_norm_fn rms_norm;
    add_rms_norm_fn add_rms_norm;
    norm_rope_write_fn norm_rope_write;
    paged_decode_fn paged_decode;
    gated_act_fn gated_act; /* gelu_tanh_mul or silu_mul */
    ggml_gemv_fn ggml_gemv, ggml_q8;
    half_gemv_fn half_gemv;
    int H, KVH, D, hidden, inter, block_size, threads, kv_type;
    float eps, qk_eps, scale;
} Step;

static int linear_rows(const Step *s, const Lin *l, const float *x, float *y) {
    switch (l->kind) {
    case LIN_PANELS: s->panel_gemm(x, (const float *)l->w, y, 1, l->n, l->k, s->threads); return 0;
    case LIN_INT8: s->int8_gemv(x, (const int8_t *)l->w, (const float *)l->scale, y, 1, l->n, l->k, s->threads); return 0;
    case LIN_INT4:
        return s->int4_gemv(x, (const uint8_t *)l->w, l->scale, l->sz_bf16, y, 1, l->n, l->k, l->group, l->block_n,
                            s->threads);
    case LIN_GGML: return s->ggml_gemv(x, (const uint8_t *)l->w, l->group, y, 1, l->n, l->k, l->row_bytes, s->threads);
    case LIN_GGML_Q8: return s->ggml_q8(x, (const uint8_t *)l->w, l->group, y, 1, l->n, l->k, l->row_bytes, s->threads);
    case LIN_HALF: s->half_gemv(x, (const uint16_t *)l->w, l->sz_bf16, y, 1, l->n, l->k, s->threads); return 0;
    default: return -1;
    }
}

/* y [n] = W x, the outputs gathered into the model's order when the file's differs (`scratch`:
 * room for n floats). */
static int linear(const Step *s, const Lin *l, const float *x, float *y, float *scratch) {
    if (!l->order) return linear_rows(s, l, x, y);
    const int rc = linear_rows(s, l, x, scratch);
    for (int j = 0; j < l->n; j++) y[j] = scratch[l->order[j]];
    return rc;
}

/* Parts reading the same input, their outputs side by side in y. */
static int linear_parts(const Step *s, const Lin *parts, int n_parts, const float *x, float *y, float *scratch) {
    int rc = 0;
    for (int j = 0; j < n_parts; j++) {
        rc |= linear(s, parts + j, x, y, scratch);
        y += parts[j].n;
    }
    return rc;
}

static void add(const float *a, const float *b, float *y, int n) {
#pragma omp simd
    for (int k = 0; k < n; k++) y[k] = a[k] + b[k];
}

/* Runs layers [0, L) on h [hidden] in place; returns 0, or -1 (h then undefined: the caller
 * recomputes the step on the Python path) when a kernel fails or memory runs out. */
int decode_layers(const Step *s, const Layer *layers, const Ctx *ctxs, int L, float *h) {
    const int H = s->H, KVH = s->KVH, D = s->D, hid = s->hidden, inter = s->inter;
    const int qkv_n = (H + 2 * KVH) * D;
    size_t widest = (size_t)(2 * inter > qkv_n ? 2 * inter : qkv_n); /* scratch: any one output */
    widest = widest > (size_t)hid ? widest : (size_t)hid;
    float *buf = malloc(sizeof(float) * ((size_t)3 * hid + qkv_n + 2 * (size_t)H * D + 3 * (size_t)inter + widest));
    if (!buf) return -1;
    float *x = buf, *h2 = x + hid, *o = h2 + hid, *qkv = o + hid, *q = qkv + qkv_n, *att = q + H * D,
          *gu = att + H * D, *act = gu + 2 * inter, *scratch = act + inter;
    int rc = 0;
    for (int i = 0; i < L && rc == 0; i++) {
        const Layer *ly = layers + i;
        const Ctx *c = ctxs + ly->ctx;
        s->rms_norm(h, ly->g_in, x, 1, hid, s->eps, s->threads);
        rc |= linear_parts(s, ly->qkv, ly->n_qkv, x, qkv, scratch);
        s->norm_rope_write(qkv, H * D, qkv + H * D, KVH * D, qkv + (H + KVH) * D, KVH * D, 1, H, KVH, D, ly->g_q,
                           ly->g_k, s->qk_eps, c->cos, c->sin, c->slot, ly->k_pool, ly->v_pool, q, s->threads, s->kv_type);
        /* the kernel's own split rule (kvserve.kernels.paged_decode_attention, max_len = len) */
        int splits = (4 * s->threads + KVH - 1) / KVH, by_len = (c->len[0] + 63) / 64;
        splits = splits < by_len ? splits : by_len;
        splits = splits < 1 ? 1 : splits;
        rc |= s->paged_decode(q, ly->k_pool, ly->v_pool, c->table, c->start, c->len, att, 1, H, KVH, D, s->block_size,
                              c->max_blocks, splits, s->scale, s->threads, 0, s->kv_type);
        rc |= linear(s, &ly->o, att, o, scratch);
        if (ly->g_post_attn) {
            s->add_rms_norm(o, ly->g_post_attn, h, h2, ly->g_pre_ff, x, 1, hid, s->eps, s->threads);
        } else {
            add(h, o, h2, hid); /* torch's h + a: one rounding per element, the same sum */
            s->rms_norm(h2, ly->g_pre_ff, x, 1, hid, s->eps, s->threads);
        }
        rc |= linear_parts(s, ly->gate_up, ly->n_gate_up, x, gu, scratch);
        s->gated_act(gu, gu + inter, act, 1, inter, 2 * inter, s->threads);
        rc |= linear(s, &ly->down, act, o, scratch);
        if (ly->g_post_ff)
            s->add_rms_norm(o, ly->g_post_ff, h2, h, NULL, NULL, 1, hid, s->eps, s->threads);
        else
            add(h2, o, h, hid);
    }
    free(buf);
    return rc ? -1 : 0;
}
