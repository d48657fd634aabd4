/* The layer stack of a small step in one call (Gemma 3's and Llama's decoder layers): M rows,
 * each a decode row (one token of a sequence) or a row of a short chunk of one sequence (the k + 1
 * rows of a speculative verification, a short prompt).
 *
 * Why: at a few rows per step each layer is ~10 kernel calls and ~25 small torch ops whose Python
 * and dispatch overhead (~0.6-0.8 ms a layer on this project's 2-core machines) cost as much as
 * the weights' stream. Here the same kernels run back to back from C: the other kernel libraries'
 * functions are passed in as pointers (kvserve/accel/decode_plan.py takes them from their ctypes
 * handles), so every number is what the Python path computes, bit for bit.
 *
 * Per layer, h [M, hidden] fp32 in place (Gemma's sandwich norms; Llama: without the two post norms):
 *   x = rms_norm(h) * g_in;  qkv = x W_qkv^T;  q, k normed (when g_q, g_k) + RoPE, k and v written
 *   a = attention(q) W_o^T;  h = h + rms_norm(a) * g_post_attn  (Llama: h + a);  x = rms_norm(h) * g_pre_ff
 *   gu = x W_gu^T;  m = (act(gate) * up) W_down^T;  h = h + rms_norm(m) * g_post_ff  (Llama: h + m)
 * act: gelu_tanh (Gemma) or silu (Llama).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
typedef int (*prefill_fn)(const float *, const void *, const void *, const int64_t *, float *, int, int, int, int, int,
                          int, int, int, float, int, int);

enum { LIN_PANELS = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_GGML = 3, LIN_GGML_Q8 = 4, LIN_HALF = 5 }; /* Q8: int8 activations */

typedef struct {
    int kind, n, k;
    const void *w; /* packed panels [ceil(n / PW), k, PW] / int8 [n, k] / int4 tiles [n, k / 2] / GGUF blocks / 16-bit [n, k] */
    const void *scale; /* int8: fp32 [n]; int4: (s, z) table [k / group, n, 2]; panels, GGUF: unused */
    int sz_bf16, group, block_n; /* GGUF: group = the ggml type; 16-bit: sz_bf16 1 for bf16, 0 for fp16 */
    int64_t row_bytes;           /* GGUF: bytes of one weight row */
    const int64_t *order;        /* GGUF: output i is the file's row order[i] (NULL: in order) */
} Lin;

typedef struct { /* one sequence's chunk of rows, as kvserve.kernels.prefill_attention takes it */
    int q_start, q_len;      /* rows [q_start, q_start + q_len) of the step */
    const int64_t *slots;    /* [n]: slots of positions first_kv .. first_kv + n - 1 */
    int n, first_kv, first_q;
} Chunk;

typedef struct { /* what a step's layers of one (KV group, window, rope table) share */
    const float *cos, *sin;  /* [M, D] */
    const int64_t *slot;     /* [M]: where each row's K/V go */
    /* decode rows: n_dec sequences of one query each, rows dec_rows (NULL: rows 0 .. M - 1 in order) */
    int n_dec, max_len, max_blocks;
    const int64_t *dec_rows;
    const int32_t *table;    /* [n_dec, max_blocks] */
    const int32_t *start, *len; /* [n_dec]: attend positions [start, len) */
    int n_chunks, window;    /* window 0: none */
    const Chunk *chunks;     /* [n_chunks] */
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
    prefill_fn prefill; /* NULL: steps of decode rows only */
    int H, KVH, D, hidden, inter, block_size, threads, kv_type;
    float eps, qk_eps, scale;
} Step;

static int linear_rows(const Step *s, const Lin *l, const float *x, float *y, int M) {
    switch (l->kind) {
    case LIN_PANELS: s->panel_gemm(x, (const float *)l->w, y, M, l->n, l->k, s->threads); return 0;
    case LIN_INT8: s->int8_gemv(x, (const int8_t *)l->w, (const float *)l->scale, y, M, l->n, l->k, s->threads); return 0;
    case LIN_INT4:
        return s->int4_gemv(x, (const uint8_t *)l->w, l->scale, l->sz_bf16, y, M, l->n, l->k, l->group, l->block_n,
                            s->threads);
    case LIN_GGML: return s->ggml_gemv(x, (const uint8_t *)l->w, l->group, y, M, l->n, l->k, l->row_bytes, s->threads);
    case LIN_GGML_Q8: return s->ggml_q8(x, (const uint8_t *)l->w, l->group, y, M, l->n, l->k, l->row_bytes, s->threads);
    case LIN_HALF: s->half_gemv(x, (const uint16_t *)l->w, l->sz_bf16, y, M, l->n, l->k, s->threads); return 0;
    default: return -1;
    }
}

/* y [M, n] = x W^T, the outputs gathered into the model's order when the file's differs
 * (`scratch`: room for M * n floats). */
static int linear(const Step *s, const Lin *l, const float *x, float *y, float *scratch, int M) {
    if (!l->order) return linear_rows(s, l, x, y, M);
    const int rc = linear_rows(s, l, x, scratch, M);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < l->n; j++) y[(size_t)i * l->n + j] = scratch[(size_t)i * l->n + l->order[j]];
    return rc;
}

/* Parts reading the same input: part j's [M, n_j] output at part_at(parts, j, M) of y (one fused
 * matrix: y [M, n]; separate parts: each its own [M, n_j] block, one after the other, as the
 * Python path's separate tensors). */
static int linear_parts(const Step *s, const Lin *parts, int n_parts, const float *x, float *y, float *scratch,
                        int M) {
    int rc = 0;
    for (int j = 0; j < n_parts; j++) {
        rc |= linear(s, parts + j, x, y, scratch, M);
        y += (size_t)M * parts[j].n;
    }
    return rc;
}

/* Where a fused output's columns [col, ...) (one part) or part j's block (separate parts) start,
 * and its row stride. */
typedef struct { float *p; int64_t stride; } View;
static View part_view(const Lin *parts, int n_parts, float *y, int M, int col, int j) {
    if (n_parts == 1) return (View){y + col, parts[0].n};
    size_t off = 0;
    for (int i = 0; i < j; i++) off += (size_t)M * parts[i].n;
    return (View){y + off, parts[j].n};
}

static void add(const float *a, const float *b, float *y, size_t n) {
#pragma omp simd
    for (size_t k = 0; k < n; k++) y[k] = a[k] + b[k];
}

/* Attention of q [M, H, D] (this step's K/V written) into att [M, H, D]: the decode rows through
 * the paged decode kernel (gathered into gq, out through gout when they are not rows 0 .. M - 1),
 * each chunk through the prefill kernel, as kvserve/model/attention.py calls them. */
static int attend(const Step *s, const Layer *ly, const Ctx *c, const float *q, float *att, float *gq, float *gout) {
    const int H = s->H, KVH = s->KVH, D = s->D, HD = H * D;
    int rc = 0;
    if (c->n_dec > 0) {
        /* the kernel's own split rule (kvserve.kernels.paged_decode_attention) */
        int splits = (4 * s->threads + c->n_dec * KVH - 1) / (c->n_dec * KVH), by_len = (c->max_len + 63) / 64;
        splits = splits < by_len ? splits : by_len;
        splits = splits < 1 ? 1 : splits;
        const float *qd = q;
        float *od = att;
        if (c->dec_rows) {
            for (int b = 0; b < c->n_dec; b++) memcpy(gq + (size_t)b * HD, q + c->dec_rows[b] * HD, sizeof(float) * HD);
            qd = gq, od = gout;
        }
        rc |= s->paged_decode(qd, ly->k_pool, ly->v_pool, c->table, c->start, c->len, od, c->n_dec, H, KVH, D,
                              s->block_size, c->max_blocks, splits, s->scale, s->threads, 0, s->kv_type);
        if (c->dec_rows)
            for (int b = 0; b < c->n_dec; b++) memcpy(att + c->dec_rows[b] * HD, gout + (size_t)b * HD, sizeof(float) * HD);
    }
    for (int j = 0; j < c->n_chunks; j++) {
        const Chunk *k = c->chunks + j;
        if (!s->prefill) return -1;
        rc |= s->prefill(q + (size_t)k->q_start * HD, ly->k_pool, ly->v_pool, k->slots, att + (size_t)k->q_start * HD,
                         k->q_len, H, KVH, D, k->n, k->first_kv, k->first_q, c->window, s->scale, s->threads,
                         s->kv_type);
    }
    return rc;
}

/* Runs layers [0, L) on h [M, hidden] in place; returns 0, or -1 (h then undefined: the caller
 * recomputes the step on the Python path) when a kernel fails or memory runs out. */
int decode_layers(const Step *s, const Layer *layers, const Ctx *ctxs, int L, int M, float *h) {
    const int H = s->H, KVH = s->KVH, D = s->D, hid = s->hidden, inter = s->inter;
    const int qkv_n = (H + 2 * KVH) * D;
    size_t widest = (size_t)(2 * inter > qkv_n ? 2 * inter : qkv_n); /* scratch: any one output */
    widest = widest > (size_t)hid ? widest : (size_t)hid;
    const size_t per_row = (size_t)3 * hid + qkv_n + 4 * (size_t)H * D + 3 * (size_t)inter + widest;
    float *buf = malloc(sizeof(float) * per_row * (size_t)M);
    if (!buf) return -1;
    float *x = buf, *h2 = x + (size_t)M * hid, *o = h2 + (size_t)M * hid, *qkv = o + (size_t)M * hid,
          *q = qkv + (size_t)M * qkv_n, *att = q + (size_t)M * H * D, *gq = att + (size_t)M * H * D,
          *gout = gq + (size_t)M * H * D, *gu = gout + (size_t)M * H * D, *act = gu + (size_t)M * 2 * inter,
          *scratch = act + (size_t)M * inter;
    const size_t mh = (size_t)M * hid;
    int rc = 0;
    for (int i = 0; i < L && rc == 0; i++) {
        const Layer *ly = layers + i;
        const Ctx *c = ctxs + ly->ctx;
        s->rms_norm(h, ly->g_in, x, M, hid, s->eps, s->threads);
        rc |= linear_parts(s, ly->qkv, ly->n_qkv, x, qkv, scratch, M);
        const View vq = part_view(ly->qkv, ly->n_qkv, qkv, M, 0, 0),
                   vk = part_view(ly->qkv, ly->n_qkv, qkv, M, H * D, 1),
                   vv = part_view(ly->qkv, ly->n_qkv, qkv, M, (H + KVH) * D, 2);
        s->norm_rope_write(vq.p, vq.stride, vk.p, vk.stride, vv.p, vv.stride, M, H, KVH, D, ly->g_q, ly->g_k,
                           s->qk_eps, c->cos, c->sin, c->slot, ly->k_pool, ly->v_pool, q, s->threads, s->kv_type);
        rc |= attend(s, ly, c, q, att, gq, gout);
        rc |= linear(s, &ly->o, att, o, scratch, M);
        if (ly->g_post_attn) {
            s->add_rms_norm(o, ly->g_post_attn, h, h2, ly->g_pre_ff, x, M, hid, s->eps, s->threads);
        } else {
            add(h, o, h2, mh); /* torch's h + a: one rounding per element, the same sum */
            s->rms_norm(h2, ly->g_pre_ff, x, M, hid, s->eps, s->threads);
        }
        rc |= linear_parts(s, ly->gate_up, ly->n_gate_up, x, gu, scratch, M);
        const View vg = part_view(ly->gate_up, ly->n_gate_up, gu, M, 0, 0),
                   vu = part_view(ly->gate_up, ly->n_gate_up, gu, M, inter, 1);
        s->gated_act(vg.p, vu.p, act, M, inter, vg.stride, s->threads);
        rc |= linear(s, &ly->down, act, o, scratch, M);
        if (ly->g_post_ff)
            s->add_rms_norm(o, ly->g_post_ff, h2, h, NULL, NULL, M, hid, s->eps, s->threads);
        else
            add(h2, o, h, mh);
    }
    free(buf);
    return rc ? -1 : 0;
}
