/* The gated MLPs' activations over fp32 rows, one call instead of torch's two ops and their
 * [rows, intermediate] temporary: Gemma's out = gelu_tanh(gate) * up, Llama's out = silu(gate) * up. gelu_tanh(x) = 0.5 x (1 + tanh(b (x + 0.044715
 * x^3))), b = sqrt(2 / pi), in the order torch's scalar kernel writes it (the engine takes this
 * kernel on every fp32 CPU path, so batched, alone and the decode-step kernel agree bitwise).
 * tanh is glibc's vector tanhf (libmvec, linked in: kernels/__init__.py) 16 or 8 lanes at a time,
 * its scalar tanhf on a row's last n % lanes elements; a scalar tanhf alone was 6x slower than
 * torch. gate / up rows are `stride` floats apart (a fused [rows, 2n] gate_up output: up = gate + n). */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
__m512 _ZGVeN16v_tanhf(__m512);
__m512 _ZGVeN16v_expf(__m512);
#define VW 16
typedef __m512 vf;
#define TANH _ZGVeN16v_tanhf
#define EXP _ZGVeN16v_expf
#define DIV _mm512_div_ps
#define NEG(x) _mm512_sub_ps(_mm512_setzero_ps(), x)
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define SET1 _mm512_set1_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#elif defined(__AVX2__)
#include <immintrin.h>
__m256 _ZGVdN8v_tanhf(__m256);
__m256 _ZGVdN8v_expf(__m256);
#define VW 8
typedef __m256 vf;
#define TANH _ZGVdN8v_tanhf
#define EXP _ZGVdN8v_expf
#define DIV _mm256_div_ps
#define NEG(x) _mm256_sub_ps(_mm256_setzero_ps(), x)
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define SET1 _mm256_set1_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#endif

#define BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define KAPPA 0.044715f

static inline float gelu_mul_1(float x, float u) {
    const float inner = BETA * (x + KAPPA * (x * x * x));
    return 0.5f * x * (1.f + tanhf(inner)) * u;
}

/* elements [j0, j1) of one row */
static void row_part(const float *g, const float *u, float *o, int j0, int j1) {
    int j = j0;
#ifdef VW
    const vf beta = SET1(BETA), kappa = SET1(KAPPA), half = SET1(0.5f), one = SET1(1.f);
    for (; j + VW <= j1; j += VW) {
        const vf x = LOAD(g + j);
        const vf inner = MUL(beta, ADD(x, MUL(kappa, MUL(MUL(x, x), x))));
        STORE(o + j, MUL(MUL(MUL(half, x), ADD(one, TANH(inner))), LOAD(u + j)));
    }
#endif
    for (; j < j1; j++) o[j] = gelu_mul_1(g[j], u[j]);
}

/* silu(x) * u = x / (1 + exp(-x)) * u, torch's formula; exp is libmvec's expf on whole vectors,
 * the scalar expf on a row's tail. */
static inline float silu_mul_1(float x, float u) { return x / (1.f + expf(-x)) * u; }

static void silu_row_part(const float *g, const float *u, float *o, int j0, int j1) {
    int j = j0;
#ifdef VW
    const vf one = SET1(1.f);
    for (; j + VW <= j1; j += VW) {
        const vf x = LOAD(g + j);
        STORE(o + j, MUL(DIV(x, ADD(one, EXP(NEG(x)))), LOAD(u + j)));
    }
#endif
    for (; j < j1; j++) o[j] = silu_mul_1(g[j], u[j]);
}

#define CHUNK 512 /* elements per task: a multiple of every vector width */

typedef void (*row_part_fn)(const float *, const float *, float *, int, int);

static void gated(row_part_fn part, const float *gate, const float *up, float *out, int rows, int n, int64_t stride,
                  int threads) {
    const int chunks = (n + CHUNK - 1) / CHUNK;
    const int64_t tasks = (int64_t)rows * chunks;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * n >= 16384) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t r = t / chunks;
        const int j0 = (int)(t % chunks) * CHUNK, j1 = j0 + CHUNK < n ? j0 + CHUNK : n;
        part(gate + r * stride, up + r * stride, out + r * n, j0, j1);
    }
}

void gelu_tanh_mul(const float *gate, const float *up, float *out, int rows, int n, int64_t stride, int threads) {
    gated(row_part, gate, up, out, rows, n, stride, threads);
}

void silu_mul(const float *gate, const float *up, float *out, int rows, int n, int64_t stride, int threads) {
    gated(silu_row_part, gate, up, out, rows, n, stride, threads);
}
