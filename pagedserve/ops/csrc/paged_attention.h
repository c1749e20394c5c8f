/* Attention over a paged KV cache, for CPUs, in float32, over a float32, bfloat16 or fp8 cache:
 * paged_decode_attention (paged_decode.c) for one-token requests, paged_prefill_attention
 * (paged_prefill.c) for the rest. This header holds what both share. They are two translation units
 * so that a cold start compiles them at once, one per core (pagedserve/ops/native.py links them into
 * one library); -O3 spends most of a cold start's compile on these kernels.
 *
 * Built by pagedserve/ops/native.py with the system C compiler on first use and called
 * through ctypes; tests/ops/test_cpu_attention.py holds both against the torch oracle.
 *
 * Layouts (C-contiguous):
 *   q, out           [num_tokens, num_heads, head_dim]   only rows token_indices[r] are used; float32,
 *                    or bfloat16 where bf16_io (q widened exactly, out rounded once)
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   token_indices, seq_lens [n]; block_tables [n, table_stride] (int64), ids in 0..num_blocks-1
 * Query head h reads KV head h / (num_heads / num_kv_heads). Request r, at position
 * p = seq_lens[r] - 1, sees key positions j with p - window < j <= p (window <= 0: every j <= p).
 * Scores are (q . k) * scale and the softmax runs in float32, as in transformers' eager attention.
 * With sinks (gpt-oss), query head h's softmax has one more logit, sinks[h], that takes probability
 * mass and adds no value: its exp(sinks[h] - max) joins the denominator, the max including it.
 * (One exception: bfloat16 queries over a bfloat16 cache multiply in bf16 pairs where the CPU has
 * AVX-512 BF16, decode and prompts alike; see attend_request_bf16 and prefill_tile_bf16.) A bfloat16
 * or fp8 cache (e4m3, one byte per element, pagedserve/attention/kv_quant.py) is widened to float32
 * as it is read (exactly: both are float32 with fewer bits); an fp8 cache's K scale multiplies the
 * scores, its V scale the output.
 */
#ifndef PAGED_ATTENTION_H
#define PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

struct paged_kv {
    const void *k_cache, *v_cache;
    int64_t block_size, token_stride; /* token_stride: elements between consecutive slots */
};

/* One vector register of floats: 16 with AVX-512, 8 with AVX2 (a 16-float vector there lives on
 * the stack, and a tile of them spills: kernels ran at a thirtieth of the speed). head_dim must
 * be a multiple of 16 (ops/cpu_attention.supports checks). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define VL 8
#else
#define VL 16
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t))));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* An e4m3 byte as a float, in integer ops the compiler vectorizes (a table lookup per byte does
 * not). A normal byte s eeee mmm is the float s (eeee + 120)
 * mmm 0...0; a subnormal (eeee = 0) is mmm x 2^-9. The NaN bytes (0x7f, 0xff) read as +-480:
 * kv_quant.quantize never writes them, as it clamps finite input to +-448. */
static inline float fp8_to_float(uint8_t byte)
{
    const uint32_t magnitude = byte & 0x7f, sign = (uint32_t)(byte & 0x80) << 24;
    const float subnormal = (float)magnitude * (1.0f / 512);
    uint32_t sub_bits;
    memcpy(&sub_bits, &subnormal, sizeof sub_bits);
    const uint32_t is_sub = -(uint32_t)(magnitude < 8); /* a mask, not a branch: the loop vectorizes */
    const uint32_t bits = (sub_bits & is_sub) | (((magnitude << 20) + (120u << 23)) & ~is_sub) | sign;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* The cache's element types (`format` below). */
enum { KV_F32 = 0, KV_FP8 = 1, KV_BF16 = 2 };

/* A bfloat16 is the top half of a float32. */
static inline float bf16_to_float(uint16_t half)
{
    const uint32_t bits = (uint32_t)half << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Sum of the lanes, as a tree (a running scalar sum would be a chain of 16 dependent adds). */
#if VL == 16
#define HALVES(v, op)                                                                              \
    v = op(v, __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));   \
    v = op(v, __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15}));   \
    v = op(v, __builtin_shuffle(v, (ivec){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));   \
    v = op(v, __builtin_shuffle(v, (ivec){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}))
#else
#define HALVES(v, op)                                                                              \
    v = op(v, __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3}));                               \
    v = op(v, __builtin_shuffle(v, (ivec){2, 3, 0, 1, 4, 5, 6, 7}));                               \
    v = op(v, __builtin_shuffle(v, (ivec){1, 0, 2, 3, 4, 5, 6, 7}))
#endif
static inline vec vadd(vec a, vec b) { return a + b; }

static inline float hsum(vec v)
{
    HALVES(v, vadd);
    return v[0];
}

/* AVX-512 BF16 (vdpbf16ps): bfloat16 pair dot products with float32 sums, two multiply-adds per lane
 * and instruction. A 32-bit word holds a bfloat16 pair, the low half first. */
#if defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
static inline __m512bh pair_broadcast(uint32_t word) { return (__m512bh)_mm512_set1_epi32((int)word); }
static inline __m512bh load_pairs(const void *p) { return (__m512bh)_mm512_loadu_si512(p); }
#else
#define HAVE_BF16_DOT 0
#endif

static inline int64_t kv_bytes(const int format) { return format == KV_FP8 ? 1 : format == KV_BF16 ? 2 : 4; }

/* A float rounded to bfloat16 (to nearest, ties to even), as torch's .to(torch.bfloat16) does. */
static inline uint16_t float_to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* The kernels' status codes, besides 0 (done): no memory for scratch space; in a checked build, a
 * block id outside the pool or a sequence longer than its block table. */
enum { PAGED_NO_MEMORY = -1, PAGED_BAD_BLOCK = -2, PAGED_SHORT_TABLE = -3 };

/* Whether a request's table can be read for keys first..len-1: in a build with PAGEDSERVE_CHECKS
 * (ops/native.py, a debug build), its blocks of those keys lie within the table and name blocks of
 * the pool, else the status to return; a block id out of range would otherwise be read out of bounds.
 * Without the checks, always 0: the engine's block tables come from the block pool. */
static inline int check_table(const int64_t *table, int64_t first, int64_t len, int64_t block_size,
                              int64_t table_stride, int64_t num_blocks)
{
#ifdef PAGEDSERVE_CHECKS
    const int64_t end = (len + block_size - 1) / block_size;
    if (end > table_stride)
        return PAGED_SHORT_TABLE;
    for (int64_t b = first / block_size; b < end; b++)
        if (table[b] < 0 || table[b] >= num_blocks)
            return PAGED_BAD_BLOCK;
#else
    (void)table, (void)first, (void)len, (void)block_size, (void)table_stride, (void)num_blocks;
#endif
    return 0;
}

#endif
