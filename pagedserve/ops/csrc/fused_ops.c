/* The decoder's elementwise steps, fused, for CPUs, in float32 or bfloat16: each is one pass over
 * memory where torch runs 5 to 14 separate operators (each a full read and write, and a dispatch).
 *
 * Built by pagedserve/ops/native.py with the system C compiler on first use and called through ctypes
 * from pagedserve/ops/fused_cpu.py; tests/ops/test_fused_cpu.py holds each against the torch
 * arithmetic of models/layers.py.
 *
 * Every function that computes takes `bf16`: 0 for float32 tensors, 1 for bfloat16 ones.
 * Arithmetic is float32; in bfloat16, every value that torch would round to bfloat16 between two
 * of its operators is rounded here at the same place, so that results match torch's up to the
 * order of a sum (and an ulp of exp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

/* A bfloat16 is the top half of a float32. */
static inline float bf16_load(const uint16_t *p, int64_t i)
{
    const uint32_t bits = (uint32_t)p[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Round to nearest even, as torch does (NaN stays NaN: its payload keeps a high mantissa bit). */
static inline uint16_t bf16_bits(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

static inline float round_bf16(float x)
{
    const uint32_t bits = (uint32_t)bf16_bits(x) << 16;
    float y;
    memcpy(&y, &bits, sizeof y);
    return y;
}

static inline float get(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_load((const uint16_t *)p, i) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float x, int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = bf16_bits(x);
    else
        ((float *)p)[i] = x;
}

/* The model dtype's rounding of a float32 value. */
static inline float rnd(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_MIN 32768

/* RMSNorm, optionally after a residual add, over n tokens of `heads` rows of dim each: row h of
 * token t starts at element t * stride + h * dim of x, of residual and of out alike (stride =
 * heads * dim for contiguous rows; more for heads viewed in the fused qkv output). For each row:
 *   if residual: residual = x + residual (rounded to the dtype), and the norm reads it;
 *   unit_offset 0 (Llama): out = weight * dtype(r * rsqrt(mean(r^2) + eps))
 *   unit_offset 1 (Gemma): out = dtype(r * rsqrt(mean(r^2) + eps) * (1 + weight)), all in float32
 * with r the row in float32. out may be x. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, int64_t at, int64_t dim, float eps,
                                                               const int unit_offset, const int bf16)
{
    float row[dim];
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        float v = get(x, at + i, bf16);
        if (residual) {
            v = rnd(v + get(residual, at + i, bf16), bf16);
            put(residual, at + i, v, bf16);
        }
        row[i] = v;
    }
    /* A loop of its own: the sum's order does not depend on whether there was a residual. */
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++)
        sum += row[i] * row[i];
    const float inv = 1.f / sqrtf(sum / (float)dim + eps);
    if (unit_offset) {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            put(out, at + i, row[i] * inv * (1.f + get(weight, i, bf16)), bf16);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            put(out, at + i, get(weight, i, bf16) * rnd(row[i] * inv, bf16), bf16);
    }
}

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t n, int64_t dim, float eps,
              int64_t heads, int64_t stride, int unit_offset, int bf16, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * stride + h * dim;
            /* a copy of the row's loops per variant (see act_and_mul) */
            if (bf16 && unit_offset)
                rms_norm_row(x, residual, weight, out, at, dim, eps, 1, 1);
            else if (bf16)
                rms_norm_row(x, residual, weight, out, at, dim, eps, 0, 1);
            else if (unit_offset)
                rms_norm_row(x, residual, weight, out, at, dim, eps, 1, 0);
            else
                rms_norm_row(x, residual, weight, out, at, dim, eps, 0, 0);
        }
    }
}

/* The gated activations. ACT_GELU_TANH is torch's gelu(approximate="tanh"),
 * 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), written as x / (1 + exp(-2u)),
 * the same value in arithmetic that vectorizes. */
enum { ACT_SILU, ACT_GELU_TANH };

static inline __attribute__((always_inline)) float activation(float g, const int act)
{
    if (act == ACT_GELU_TANH) {
        const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
        return g / (1.f + fast_exp(-2.f * u));
    }
    return g / (1.f + fast_exp(-g));
}

/* out[t] = dtype(act(gate)) * up, where gate_up[t] = [gate (inter) | up (inter)]. */
static inline __attribute__((always_inline)) void act_and_mul_row(const void *gate_up, void *out, int64_t t,
                                                                  int64_t inter, const int act, const int bf16)
{
    const int64_t in = t * 2 * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float g = get(gate_up, in + i, bf16), u = get(gate_up, in + inter + i, bf16);
        put(out, t * inter + i, rnd(activation(g, act), bf16) * u, bf16);
    }
}

void act_and_mul(const void *gate_up, void *out, int64_t n, int64_t inter, int act, int bf16, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        /* A copy of the row loop per dtype and activation: with the dtype a variable inside it, the
         * bfloat16 loop ran 30x slower than torch's. */
        if (act == ACT_GELU_TANH && bf16)
            act_and_mul_row(gate_up, out, t, inter, ACT_GELU_TANH, 1);
        else if (act == ACT_GELU_TANH)
            act_and_mul_row(gate_up, out, t, inter, ACT_GELU_TANH, 0);
        else if (bf16)
            act_and_mul_row(gate_up, out, t, inter, ACT_SILU, 1);
        else
            act_and_mul_row(gate_up, out, t, inter, ACT_SILU, 0);
    }
}

/* Rotary embedding in place, half-split (GPT-NeoX) convention, on `heads` heads of head_dim
 * starting at element 0 of each row of x (rows `row_stride` elements apart): for each head, its
 * first rotary_dim elements (all of them, or a partial rotary's share; the rest are left as they are)
 *   [x1, x2] -> [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
 * with each product rounded to the dtype before the sum, as torch computes it. cos, sin:
 * [n, rotary_dim / 2] in the dtype. */
static inline __attribute__((always_inline)) void rotary_row(void *x, const void *cos, const void *sin, int64_t t,
                                                             int64_t row_stride, int64_t heads, int64_t head_dim,
                                                             int64_t rotary_dim, const int bf16)
{
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = t * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float c = get(cos, t * half + i, bf16), s = get(sin, t * half + i, bf16);
            const float x1 = get(x, base + i, bf16), x2 = get(x, base + half + i, bf16);
            put(x, base + i, rnd(x1 * c, bf16) - rnd(x2 * s, bf16), bf16);
            put(x, base + half + i, rnd(x2 * c, bf16) + rnd(x1 * s, bf16), bf16);
        }
    }
}

void rotary(void *x, const void *cos, const void *sin, int64_t n, int64_t row_stride, int64_t heads,
            int64_t head_dim, int64_t rotary_dim, int bf16, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (n * heads * rotary_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        if (bf16) /* a copy of the row's loops per dtype (see act_and_mul) */
            rotary_row(x, cos, sin, t, row_stride, heads, head_dim, rotary_dim, 1);
        else
            rotary_row(x, cos, sin, t, row_stride, heads, head_dim, rotary_dim, 0);
    }
}

/* Row copies, byte for byte: out[i] = src[rows[i]] (an embedding lookup, the rotary table's rows
 * of the step's positions), and dst[rows[i]] = src[i] with src's rows `src_stride` bytes apart
 * (a step's K or V rows, views of the fused qkv output, into their cache slots). Each returns -1,
 * copying nothing, if a row index lies outside [0, src_rows) or [0, dst_rows); else 0. */
static int rows_outside(const int64_t *rows, int64_t n, int64_t limit)
{
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= limit)
            return 1;
    return 0;
}

int gather_rows(const void *src, int64_t src_rows, const int64_t *rows, void *out, int64_t n, int64_t row_bytes,
                int num_threads)
{
    if (rows_outside(rows, n, src_rows))
        return -1;
#pragma omp parallel for num_threads(num_threads) if (n * row_bytes >= 4 * PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)out + i * row_bytes, (const char *)src + rows[i] * row_bytes, row_bytes);
    return 0;
}

int scatter_rows(const void *src, int64_t src_stride, const int64_t *rows, void *dst, int64_t dst_rows, int64_t n,
                 int64_t row_bytes, int num_threads)
{
    if (rows_outside(rows, n, dst_rows))
        return -1;
#pragma omp parallel for num_threads(num_threads) if (n * row_bytes >= 4 * PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)dst + rows[i] * row_bytes, (const char *)src + i * src_stride, row_bytes);
    return 0;
}

/* An embedding lookup that scales: out[i] = dtype(src[rows[i]] * scale) for src [src_rows, dim] in
 * the dtype, scale already rounded to it (Gemma multiplies its embeddings by sqrt(hidden_size)
 * so rounded). -1, writing nothing, if a row index lies outside [0, src_rows); else 0. */
static inline __attribute__((always_inline)) void scaled_row(const void *src, int64_t row, void *out, int64_t i,
                                                             int64_t dim, float scale, const int bf16)
{
#pragma omp simd
    for (int64_t j = 0; j < dim; j++)
        put(out, i * dim + j, get(src, row * dim + j, bf16) * scale, bf16);
}

int gather_scaled_rows(const void *src, int64_t src_rows, const int64_t *rows, void *out, int64_t n, int64_t dim,
                       float scale, int bf16, int num_threads)
{
    if (rows_outside(rows, n, src_rows))
        return -1;
#pragma omp parallel for num_threads(num_threads) if (n * dim >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        if (bf16) /* a copy of the row's loop per dtype (see act_and_mul) */
            scaled_row(src, rows[i], out, i, dim, scale, 1);
        else
            scaled_row(src, rows[i], out, i, dim, scale, 0);
    }
    return 0;
}
