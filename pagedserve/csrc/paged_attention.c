/* Attention over a paged KV cache, for CPUs, in float32, over a float32, bfloat16 or fp8 cache:
 * paged_decode_attention for one-token requests, paged_prefill_attention (at the end) for the rest.
 *
 * Decode: each request brings one query token and reads its K/V in place through its block table: no
 * gathered copy of the context is ever made, so every K/V row crosses the memory bus once per
 * step. Threads take whole requests; within one, each block's K/V rows (all KV heads, contiguous)
 * are read in order and reused from L1 by the query heads that share them.
 *
 * Built by pagedserve/native.py with the system C compiler on first use and called
 * through ctypes; tests/attention/test_cpu_kernel.py holds both against the torch oracle.
 *
 * Layouts (C-contiguous):
 *   q, out           [num_tokens, num_heads, head_dim]   only rows token_indices[r] are used; float32,
 *                    or bfloat16 where bf16_io (q widened exactly, out rounded once)
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   token_indices, seq_lens [n]; block_tables [n, table_stride] (int64)
 * Query head h reads KV head h / (num_heads / num_kv_heads). Request r, at position
 * p = seq_lens[r] - 1, sees key positions j with p - window < j <= p (window <= 0: every j <= p).
 * Scores are (q . k) * scale and the softmax runs in float32, as in transformers' eager attention.
 * (One exception: bfloat16 queries over a bfloat16 cache multiply in bf16 pairs where the CPU has
 * AVX-512 BF16, decode and prompts alike; see attend_request_bf16 and prefill_tile_bf16.) A bfloat16 or fp8 cache (e4m3, one byte per element, pagedserve/attention/kv_quant.py) is widened
 * to float32 as it is read (exactly: both are float32 with fewer bits); an fp8 cache's K scale
 * multiplies the scores, its V scale the output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

struct paged_kv {
    const void *k_cache, *v_cache;
    int64_t block_size, token_stride; /* token_stride: elements between consecutive slots */
};

/* 16 floats: one AVX-512 register, two AVX2 ones; the compiler picks what the machine has.
 * head_dim must be a multiple of VL (cpu_kernel.supports checks). */
#define VL 16
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
static inline float hsum(vec v)
{
    v += __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (ivec){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
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

/* The rows t0..t1-1 of block b that hold visible keys, for keys first..len-1 (blocks of bs rows). */
static inline int64_t span_start(int64_t b, int64_t first, int64_t bs) { return first > b * bs ? first - b * bs : 0; }
static inline int64_t span_end(int64_t b, int64_t len, int64_t bs) { return len - b * bs < bs ? len - b * bs : bs; }

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

/* Rows t0..t1-1 of the request's block b as floats: in place for a float32 cache; an fp8 or bfloat16
 * block is widened once into buf, so the query heads that share its rows do not each convert them. */
static inline const float *block_at(const void *cache, const int64_t *table, int64_t b, int64_t t0, int64_t t1,
                                   int64_t bs, int64_t stride, const int format, float *buf)
{
    const uint8_t *block = (const uint8_t *)cache + table[b] * bs * stride * kv_bytes(format);
    if (format == KV_F32)
        return (const float *)block;
    if (format == KV_BF16) {
        const uint16_t *halves = (const uint16_t *)block;
#pragma omp simd
        for (int64_t i = t0 * stride; i < t1 * stride; i++)
            buf[i] = bf16_to_float(halves[i]);
        return buf;
    }
#pragma omp simd
    for (int64_t i = t0 * stride; i < t1 * stride; i++)
        buf[i] = fp8_to_float(block[i]);
    return buf;
}

/* A block to be read later is asked for while the current one is read: blocks sit anywhere in the
 * pool, out of the hardware prefetcher's sight. A few lines at each step of the loop over the
 * current block, spread over all of it: asking for a whole block at once stalls the core on its
 * few outstanding misses before it computes anything. On the 2-core test machine, 64 contexts of
 * 193 tokens in blocks scattered over a 30-layer pool: float32 read at 22 GB/s asked for at once,
 * 32-33 GB/s spread. The block asked for is about PREFETCH_AHEAD bytes ahead: the next one of
 * float32 (12 KiB at 16 tokens of the embedded model), the one after it in bfloat16 (11.2-11.5
 * against 12.2-12.7 ms for the 64 contexts; 16 of 1,300 tokens: 16.9 against 21.9 ms). */
#define PREFETCH_AHEAD 12288
struct prefetcher {
    const char *next; /* the next line to ask for */
    int64_t left, per_step; /* bytes still to ask for; bytes per step */
};

static inline struct prefetcher prefetch_spread(const void *block, int64_t bytes, int64_t steps)
{
    const int64_t lines = (bytes + 63) / 64, per_step = (lines + steps - 1) / steps;
    return (struct prefetcher){block, block == NULL ? 0 : bytes, per_step * 64};
}

static inline void prefetch_step(struct prefetcher *p)
{
    for (int64_t i = 0; i < p->per_step && p->left > 0; i += 64, p->left -= 64, p->next += 64)
        __builtin_prefetch(p->next);
}

/* Blocks are read in the order K first_block..end_block-1, then V the same (num_blocks each); while
 * the i-th of that order is read, the block about PREFETCH_AHEAD bytes further on is asked for:
 * this one (NULL past the end). */
static inline const void *ahead_block(const struct paged_kv *kv, const int64_t *table, int64_t first_block,
                                      int64_t num_blocks, int64_t block_bytes, int64_t i)
{
    const int64_t j = i + (PREFETCH_AHEAD + block_bytes - 1) / block_bytes;
    if (j >= 2 * num_blocks)
        return NULL;
    const char *cache = j < num_blocks ? kv->k_cache : kv->v_cache;
    return cache + table[first_block + j % num_blocks] * block_bytes;
}

/* sh[j] = exp(sh[j] - m) for j in first..len-1; returns their sum. */
static inline __attribute__((always_inline)) float softmax_numerators(float *sh, int64_t first, int64_t len, float m)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = first; j < len; j++) {
        sh[j] = fast_exp(sh[j] - m);
        sum += sh[j];
    }
    return sum;
}

#if defined(__AVX512F__)
/* hsum of 16 vectors at once: lane t of the result is the sum of the lanes of the vector in slot
 * KEY_SLOT(t), added in exactly hsum's order (lane i + lane i+8, then +4, +2, +1), so each sum has
 * hsum's bits; a transposing tree of 45 shuffles and adds where 16 hsums take 112 and leave 16
 * scalars. Slot s feeds lane 4 (s % 4) + s / 4 (the tree leaves its sums 4 x 4 transposed). */
#define KEY_SLOT(t) (4 * ((t) % 4) + (t) / 4)
static inline __m512 hsum16(const __m512 v[16])
{
    __m512 c[8], d[4], e[2];
    for (int j = 0; j < 8; j++) /* 256-bit halves: [lanes 0-7 + 8-15 of v2j | of v2j+1] */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; k++) /* 128-bit lane L: lanes 0-3 + 4-7 of slot 4k + L */
        d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++) { /* per 128-bit lane: + 2 apart */
        const __m512d x = (__m512d)d[2 * m], y = (__m512d)d[2 * m + 1];
        e[m] = _mm512_add_ps((__m512)_mm512_unpacklo_pd(x, y), (__m512)_mm512_unpackhi_pd(x, y));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)), /* + 1 apart */
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The scores of up to 16 keys (the lanes in `valid`) from their dot products' vectors (slot
 * KEY_SLOT(t) for key t): summed, scaled, stored at sh, and folded into the running maximum *m. */
static inline void store_scores16(const __m512 part[16], float scale, __mmask16 valid, float *sh, float *m)
{
    const __m512 s = _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(sh, valid, s);
    const float top = _mm512_mask_reduce_max_ps(valid, s);
    *m = top > *m ? top : *m;
}

#endif

/* Attention of one request's query heads qh [num_heads, head_dim] over its keys first..len-1,
 * into oh. Query head h reads KV head h / group. Each block's K rows, then (in a second pass) its
 * V rows, all KV heads contiguous, are read once, in order, and reused from L1 by the heads that
 * share them.
 * scores: scratch of num_heads * max_len floats; acc: num_heads * head_dim; buf: one block of
 * floats (fp8 and bfloat16 only). Always inlined, so a constant head_dim gives fully unrolled
 * vector loops and a constant format a copy for that cache type alone. */
static inline __attribute__((always_inline)) void attend_request(
    const struct paged_kv *kv, const int64_t *table, int64_t first, int64_t len, const float *qh, float *oh,
    int64_t num_heads, int64_t group, const int64_t head_dim, float scale, float v_scale, float *scores,
    int64_t max_len, float *acc, const int format, float *buf)
{
    const int64_t bs = kv->block_size, stride = kv->token_stride, nv = head_dim / VL;
    const int64_t first_block = first / bs, end_block = (len + bs - 1) / bs;
    const int64_t block_bytes = bs * stride * kv_bytes(format);
    float maxima[num_heads], sums[num_heads];
    for (int64_t h = 0; h < num_heads; h++)
        maxima[h] = -INFINITY;
    const int64_t num_blocks = end_block - first_block;
#define AHEAD(i) ahead_block(kv, table, first_block, num_blocks, block_bytes, i)

    /* Scores, block by block, and each query head's maximum. */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = span_start(b, first, bs), t1 = span_end(b, len, bs);
        const float *kb = block_at(kv->k_cache, table, b, t0, t1, bs, stride, format, buf);
#if defined(__AVX512F__)
        /* 16 keys at a time, their dot products summed by hsum16 (the same bits as one hsum each) */
        struct prefetcher pf = prefetch_spread(AHEAD(b - first_block), block_bytes, num_heads * ((t1 - t0 + 15) / 16));
        for (int64_t c0 = t0; c0 < t1; c0 += 16) {
            const int nt = t1 - c0 < 16 ? (int)(t1 - c0) : 16;
            const __mmask16 valid = (__mmask16)((1u << nt) - 1);
            for (int64_t h = 0; h < num_heads; h++) {
                prefetch_step(&pf);
                vec q[nv];
                for (int64_t i = 0; i < nv; i++)
                    q[i] = load(qh + h * head_dim + i * VL);
                const float *kh = kb + c0 * stride + (h / group) * head_dim;
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    vec prod = (vec){0};
                    if (t < nt) {
                        prod = q[0] * load(kh + t * stride);
                        for (int64_t i = 1; i < nv; i++)
                            prod += q[i] * load(kh + t * stride + i * VL);
                    }
                    part[KEY_SLOT(t)] = (__m512)prod;
                }
                store_scores16(part, scale, valid, scores + h * max_len + b * bs + c0, &maxima[h]);
            }
        }
#else
        struct prefetcher pf = prefetch_spread(AHEAD(b - first_block), block_bytes, num_heads * (t1 - t0));
        for (int64_t h = 0; h < num_heads; h++) {
            vec q[nv];
            for (int64_t i = 0; i < nv; i++)
                q[i] = load(qh + h * head_dim + i * VL);
            const float *kh = kb + (h / group) * head_dim;
            float *sh = scores + h * max_len + b * bs, m = maxima[h];
            for (int64_t t = t0; t < t1; t++) {
                prefetch_step(&pf);
                vec prod = q[0] * load(kh + t * stride);
                for (int64_t i = 1; i < nv; i++)
                    prod += q[i] * load(kh + t * stride + i * VL);
                sh[t] = hsum(prod) * scale;
                m = sh[t] > m ? sh[t] : m;
            }
            maxima[h] = m;
        }
#endif
    }

    /* Softmax numerators and their sums. */
    for (int64_t h = 0; h < num_heads; h++)
        sums[h] = softmax_numerators(scores + h * max_len, first, len, maxima[h]);

    /* Probability-weighted sum of V, normalised at the end. */
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = span_start(b, first, bs), t1 = span_end(b, len, bs);
        const float *vb = block_at(kv->v_cache, table, b, t0, t1, bs, stride, format, buf);
        struct prefetcher pf =
            prefetch_spread(AHEAD(num_blocks + b - first_block), block_bytes, num_heads * (t1 - t0));
        for (int64_t h = 0; h < num_heads; h++) {
            vec a[nv];
            for (int64_t i = 0; i < nv; i++)
                a[i] = load(acc + h * head_dim + i * VL);
            const float *vh = vb + (h / group) * head_dim, *ph = scores + h * max_len + b * bs;
            for (int64_t t = t0; t < t1; t++) {
                prefetch_step(&pf);
                for (int64_t i = 0; i < nv; i++)
                    a[i] += ph[t] * load(vh + t * stride + i * VL);
            }
            for (int64_t i = 0; i < nv; i++)
                store(acc + h * head_dim + i * VL, a[i]);
        }
    }
#undef AHEAD
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = v_scale / sums[h];
        for (int64_t d = 0; d < head_dim; d++)
            oh[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

#if HAVE_BF16_DOT
/* Query heads of one KV group per pass over a block's V rows: their sums stay in registers. */
#define DECODE_HEADS(head_dim) ((head_dim) <= 64 ? 4 : 2)

/* attend_request for bfloat16 queries over a bfloat16 cache, in bf16 pair dot products (the rows are
 * read as they lie in the cache, never widened into a buffer):
 *  - q . k: head_dim / 32 vdpbf16ps per key and query head, then hsum16 over 16 keys at once;
 *  - the softmax in float32, as attend_request; its numerators are then rounded to bfloat16 (p16),
 *    as torch's fused CPU attention rounds them in bfloat16, and the sums stay float32;
 *  - p . V: two keys' rows interleaved into pairs (vpunpck{l,h}wd), so each vdpbf16ps adds two
 *    keys' terms. The interleave permutes the dims within each 128-bit lane; acc holds them in that
 *    order until the end.
 * q16: the request's bfloat16 query heads; p16: scratch of num_heads * (max_len + 2) bfloat16. */
static inline __attribute__((always_inline)) void attend_request_bf16(
    const struct paged_kv *kv, const int64_t *table, int64_t first, int64_t len, const uint16_t *q16, float *oh,
    int64_t num_heads, int64_t group, const int64_t head_dim, float scale, float *scores, int64_t max_len,
    float *acc, uint16_t *p16)
{
    const int64_t bs = kv->block_size, stride = kv->token_stride, nq = head_dim / 32;
    const int64_t first_block = first / bs, end_block = (len + bs - 1) / bs, p_stride = max_len + 2;
    const int64_t block_bytes = bs * stride * 2, num_blocks = end_block - first_block;
    const uint16_t *k_cache = kv->k_cache, *v_cache = kv->v_cache;
    float maxima[num_heads], sums[num_heads];
    __m512bh q[num_heads][nq];
    for (int64_t h = 0; h < num_heads; h++) {
        maxima[h] = -INFINITY;
        for (int64_t i = 0; i < nq; i++)
            q[h][i] = load_pairs(q16 + h * head_dim + i * 32);
    }
#define AHEAD(i) ahead_block(kv, table, first_block, num_blocks, block_bytes, i)

    /* Scores, 16 keys of a block at a time, and each query head's maximum. */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = span_start(b, first, bs), t1 = span_end(b, len, bs);
        const uint16_t *kb = k_cache + table[b] * bs * stride;
        struct prefetcher pf = prefetch_spread(AHEAD(b - first_block), block_bytes,
                                               num_heads * ((t1 - t0 + 15) / 16));
        for (int64_t c0 = t0; c0 < t1; c0 += 16) {
            const int nt = t1 - c0 < 16 ? (int)(t1 - c0) : 16;
            const __mmask16 valid = (__mmask16)((1u << nt) - 1);
            for (int64_t h = 0; h < num_heads; h++) {
                prefetch_step(&pf);
                const uint16_t *kh = kb + c0 * stride + (h / group) * head_dim;
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    __m512 dot = _mm512_setzero_ps();
                    if (t < nt)
                        for (int64_t i = 0; i < nq; i++)
                            dot = _mm512_dpbf16_ps(dot, load_pairs(kh + t * stride + i * 32), q[h][i]);
                    part[KEY_SLOT(t)] = dot;
                }
                store_scores16(part, scale, valid, scores + h * max_len + b * bs + c0, &maxima[h]);
            }
        }
    }

    /* Softmax numerators, their float32 sums, and the numerators in bfloat16. */
    for (int64_t h = 0; h < num_heads; h++) {
        float *sh = scores + h * max_len;
        sums[h] = softmax_numerators(sh, first, len, maxima[h]);
        for (int64_t j = first; j < len; j += 16) {
            const __mmask16 valid = (__mmask16)(len - j < 16 ? (1u << (len - j)) - 1 : 0xffff);
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, sh + j));
            _mm256_mask_storeu_epi16(p16 + h * p_stride + j, valid, (__m256i)rounded);
        }
    }

    /* Probability-weighted sum of V, two keys per multiply-add, in acc's permuted dim order. */
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    const int64_t nh = DECODE_HEADS(head_dim), num_kv_heads = num_heads / group;
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = span_start(b, first, bs), t1 = span_end(b, len, bs);
        const uint16_t *vb = v_cache + table[b] * bs * stride;
        struct prefetcher pf = prefetch_spread(AHEAD(num_blocks + b - first_block), block_bytes,
                                               num_kv_heads * ((group + nh - 1) / nh) * ((t1 - t0 + 1) / 2));
        for (int64_t g = 0; g < num_kv_heads; g++)
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += nh) {
                const int64_t heads = (g + 1) * group - h0 < nh ? (g + 1) * group - h0 : nh;
                __m512 o[DECODE_HEADS(head_dim)][head_dim / 16];
                for (int64_t k = 0; k < heads; k++)
                    for (int64_t i = 0; i < head_dim / 16; i++)
                        o[k][i] = _mm512_loadu_ps(acc + (h0 + k) * head_dim + i * 16);
                for (int64_t t = t0; t < t1; t += 2) {
                    prefetch_step(&pf);
                    const uint16_t *row = vb + t * stride + g * head_dim;
                    const int pair = t + 1 < t1; /* else the odd last key's partner is zero */
                    __m512bh lo[nq], hi[nq];
                    for (int64_t i = 0; i < nq; i++) {
                        const __m512i x = _mm512_loadu_si512(row + i * 32);
                        const __m512i y = pair ? _mm512_loadu_si512(row + stride + i * 32) : _mm512_setzero_si512();
                        lo[i] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                        hi[i] = (__m512bh)_mm512_unpackhi_epi16(x, y);
                    }
                    for (int64_t k = 0; k < heads; k++) {
                        uint32_t word;
                        memcpy(&word, p16 + (h0 + k) * p_stride + b * bs + t, sizeof word);
                        const __m512bh p = pair_broadcast(pair ? word : word & 0xffff);
                        for (int64_t i = 0; i < nq; i++) {
                            o[k][2 * i] = _mm512_dpbf16_ps(o[k][2 * i], lo[i], p);
                            o[k][2 * i + 1] = _mm512_dpbf16_ps(o[k][2 * i + 1], hi[i], p);
                        }
                    }
                }
                for (int64_t k = 0; k < heads; k++)
                    for (int64_t i = 0; i < head_dim / 16; i++)
                        _mm512_storeu_ps(acc + (h0 + k) * head_dim + i * 16, o[k][i]);
            }
    }
#undef AHEAD
    /* acc's vector 2i (2i + 1) holds dims 32i + 8L + 0..3 (+ 4..7) in lanes 4L + 0..3 of 128-bit lane L. */
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sums[h];
        for (int64_t i = 0; i < nq; i++)
            for (int64_t half = 0; half < 2; half++)
                for (int64_t lane = 0; lane < 16; lane++)
                    oh[h * head_dim + 32 * i + 8 * (lane / 4) + 4 * half + lane % 4] =
                        acc[h * head_dim + (2 * i + half) * 16 + lane] * inv;
    }
}
#endif

/* format: KV_F32, KV_BF16, or KV_FP8 (e4m3 bytes, to be multiplied by k_scale and v_scale; else 1).
 * bf16_io: q and out are bfloat16 (q widened on entry, exactly; out rounded once), else float32.
 * Token t's query heads start at element t * q_stride of q (q_stride = heads * head_dim when q is
 * contiguous; larger for a view of the fused qkv output); its output at t * heads * head_dim. */
int paged_decode_attention(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *token_indices, const int64_t *block_tables, const int64_t *seq_lens,
    int64_t n, int64_t q_stride, int64_t table_stride, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int num_threads, int format, float k_scale, float v_scale, int bf16_io)
{
    const struct paged_kv kv = {k_cache, v_cache, block_size, num_kv_heads * head_dim};
    const int64_t group = num_heads / num_kv_heads, q_size = num_heads * head_dim;
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++)
        max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    int failed = 0;
    /* bfloat16 queries over a bfloat16 cache: bf16 dot products where the CPU has them. */
    const int bf16_dot = HAVE_BF16_DOT && bf16_io && format == KV_BF16 && head_dim % (2 * VL) == 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scores, acc, the query and output rows in float32 (bf16_io), one block of
         * widened rows (fp8, bfloat16), or the bfloat16 numerators (bf16_dot). */
        float *scores = malloc(sizeof(float) * (num_heads * (max_len + head_dim) + 2 * q_size
                                                + (bf16_dot ? num_heads * (max_len + 2) / 2 + 1
                                                   : format != KV_F32 ? block_size * kv.token_stride : 0)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r++) {
            if (scores == NULL)
                continue;
            const int64_t len = seq_lens[r], first = window > 0 && len > window ? len - window : 0;
            float *acc = scores + num_heads * max_len, *q32 = acc + num_heads * head_dim, *out32 = q32 + q_size;
            float *buf = out32 + q_size;
            const float *qh = (const float *)q + token_indices[r] * q_stride;
            float *oh = (float *)out + token_indices[r] * q_size;
            if (bf16_io) {
                const uint16_t *q16 = (const uint16_t *)q + token_indices[r] * q_stride;
                for (int64_t i = 0; i < q_size; i++)
                    q32[i] = bf16_to_float(q16[i]);
                qh = q32, oh = out32;
            }
            const int64_t *table = block_tables + r * table_stride;
#if HAVE_BF16_DOT
            if (bf16_dot) {
                const uint16_t *q16 = (const uint16_t *)q + token_indices[r] * q_stride;
                uint16_t *p16 = (uint16_t *)buf; /* the numerators take the widened block's place */
#define ATTEND(dim) \
    attend_request_bf16(&kv, table, first, len, q16, out32, num_heads, group, dim, scale, scores, max_len, acc, p16)
                if (head_dim == 64)
                    ATTEND(64);
                else if (head_dim == 128)
                    ATTEND(128);
                else
                    ATTEND(head_dim);
#undef ATTEND
                uint16_t *o16 = (uint16_t *)out + token_indices[r] * q_size;
                for (int64_t i = 0; i < q_size; i++)
                    o16[i] = float_to_bf16(out32[i]);
                continue;
            }
#endif
            /* Common head sizes get their own unrolled copy, for each cache type. */
#define ATTEND(dim, fmt) \
    attend_request(&kv, table, first, len, qh, oh, num_heads, group, dim, scale * k_scale, v_scale, scores, \
                   max_len, acc, fmt, buf)
#define ATTEND_FORMATS(dim) \
    (format == KV_FP8 ? ATTEND(dim, KV_FP8) : format == KV_BF16 ? ATTEND(dim, KV_BF16) : ATTEND(dim, KV_F32))
            if (head_dim == 64)
                ATTEND_FORMATS(64);
            else if (head_dim == 128)
                ATTEND_FORMATS(128);
            else
                ATTEND_FORMATS(head_dim);
#undef ATTEND_FORMATS
#undef ATTEND
            if (bf16_io) {
                uint16_t *o16 = (uint16_t *)out + token_indices[r] * q_size;
                for (int64_t i = 0; i < q_size; i++)
                    o16[i] = float_to_bf16(out32[i]);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* ---- Prompt attention: several new tokens per request (a whole prompt, or a chunk behind its cached tokens).
 *
 * First each request's visible keys are staged once per KV head, widened to float32 (or kept in
 * bfloat16 pairs, for prefill_tile_bf16): K transposed
 * ([head_dim][keys]: a row's scores for KT keys are then head_dim broadcast multiply-adds into
 * KT / VL vectors) and V as rows. Then a work item is one request's KV head and a tile of up to QT
 * of its new tokens (the group's query heads for those tokens are its rows); it walks the keys
 * those tokens may see in tiles of KT and keeps a running softmax per row (flash attention): the
 * scores are never written out whole. Causality and the window hide keys by position, so a chunk
 * behind cached tokens and a whole prompt are the same case. In the tile that crosses the diagonal a
 * block of rows computes only the vectors of keys up to its last row's position (block_visible): the
 * rest would be masked to weight 0.
 */
#define KV_ 4         /* vectors of keys per tile */
#define KT (KV_ * VL) /* keys per tile */
#define QT 32         /* new tokens per work item */
#define RB 6          /* rows per register block: RB x KV_ score vectors, RB x OV output vectors */
#define OV 4          /* output vectors per pass over a tile's V rows */

/* Keys j0..j0+KT-1 of KV head kvh, read through the block table: K transposed into kt[d * KT + t],
 * V into vt[t * head_dim + d]; keys from len on are zero (never visible, but must be finite). */
static inline __attribute__((always_inline)) void stage_kv_tile(
    const struct paged_kv *kv, const int64_t *table, int64_t j0, int64_t len, int64_t kvh, const int64_t head_dim,
    const int format, float *kt, float *vt)
{
    const int64_t bs = kv->block_size, stride = kv->token_stride;
    for (int64_t t = 0; t < KT; t++) {
        const int64_t j = j0 + t;
        float *vrow = vt + t * head_dim;
        if (j >= len) {
            for (int64_t d = 0; d < head_dim; d++)
                kt[d * KT + t] = 0.0f, vrow[d] = 0.0f;
            continue;
        }
        const int64_t slot = table[j / bs] * bs + j % bs, offset = (slot * stride + kvh * head_dim) * kv_bytes(format);
        const uint8_t *krow = (const uint8_t *)kv->k_cache + offset, *vsrc = (const uint8_t *)kv->v_cache + offset;
        for (int64_t d = 0; d < head_dim; d++) {
            if (format == KV_F32) {
                kt[d * KT + t] = ((const float *)krow)[d];
                vrow[d] = ((const float *)vsrc)[d];
            } else if (format == KV_BF16) {
                kt[d * KT + t] = bf16_to_float(((const uint16_t *)krow)[d]);
                vrow[d] = bf16_to_float(((const uint16_t *)vsrc)[d]);
            } else {
                kt[d * KT + t] = fp8_to_float(krow[d]);
                vrow[d] = fp8_to_float(vsrc[d]);
            }
        }
    }
}

static inline vec vselect(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

#if defined(__AVX512F__)
static inline vec vmax(vec a, vec b) { return (vec)_mm512_max_ps((__m512)a, (__m512)b); }

/* 2^x for x <= 0 (-inf included), to about 1 ulp: x = n + f with n whole and |f| <= 1/2; 2^f is
 * fast_exp's polynomial for e^r rewritten in f = r / ln 2, and vscalefps multiplies by 2^n. Results
 * under 2^-125 are 0 (a softmax weight that small adds nothing), so no lane is ever subnormal. */
static inline vec exp2_nonpositive(vec x)
{
    const __m512 v = (__m512)x, n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, n);
    __m512 p = _mm512_set1_ps(1.5279195034e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5506795114e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333747868e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6179281027e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504104643e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651273e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return (vec)_mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-125.0f), _CMP_GE_OQ), p, n);
}
#else
static inline vec vmax(vec a, vec b) { return vselect(a > b, a, b); }

static inline vec exp2_nonpositive(vec x)
{
    vec e;
    for (int i = 0; i < VL; i++)
        e[i] = fast_exp(x[i] * 0.693147180559945309f);
    return e;
}
#endif

/* The largest lane, as a tree. */
static inline float hmax(vec v)
{
    v = vmax(v, __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15}));
    v = vmax(v, __builtin_shuffle(v, (ivec){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
    v = vmax(v, __builtin_shuffle(v, (ivec){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
    return v[0];
}

/* The running softmax of one register block (rows r0..r0+nr-1 of a work item) over the first nvec
 * vectors of keys of one key tile (any past them are past every row's position): hide what a row may
 * not see (only tiles that cross the causal diagonal or the window's edge, `masked`, have such keys),
 * then p = exp(score * scale - running max) and corr = the factor that
 * rescales what each row saw before; m (each row's running max, in log2 units: exp(x) = 2^(x log2 e))
 * and l (its running sum) are updated. Each step runs for all RB rows at once, so that the rows'
 * chains of dependent operations overlap (one row at a time, the softmax took a third of the time). */
static inline __attribute__((always_inline)) void tile_softmax(
    vec s[RB][KV_], float p[RB][KT], float corr[RB], float *m, float *l, int64_t r0, int64_t nr, int64_t tokens,
    int64_t first_pos, int64_t j0, int masked, int64_t window, float scale, const int nvec)
{
    const vec minus_inf = (vec){0} - INFINITY;
    if (masked) {
        ivec iota;
        for (int i = 0; i < VL; i++)
            iota[i] = i;
        for (int64_t b = 0; b < RB; b++) {
            const int64_t pos = first_pos + (r0 + b) % tokens;
            for (int c = 0; c < nvec; c++) {
                const ivec kp = (ivec){0} + (int32_t)(j0 + c * VL - pos) + iota; /* key - query position */
                ivec hide = kp > 0;
                if (window > 0)
                    hide |= kp <= -(int32_t)window;
                s[b][c] = vselect(hide, minus_inf, s[b][c]);
            }
        }
    }
    /* Lane b of these vectors is row b's: its max so far, this tile's, and the new one. */
    const float log2_scale = scale * 1.44269504088896341f;
    vec m_old = minus_inf, m_tile = minus_inf;
    for (int64_t b = 0; b < RB; b++) {
        vec row_max = s[b][0];
        for (int c = 1; c < nvec; c++)
            row_max = vmax(row_max, s[b][c]);
        m_tile[b] = hmax(row_max) * log2_scale; /* scale > 0: the max of the scaled scores */
        if (b < nr)
            m_old[b] = m[r0 + b];
    }
    const vec m_new = vmax(m_old, m_tile);
    /* A row that has seen nothing yet subtracts 0: its p and corr come out 0, not NaN. */
    const vec shift = vselect(m_new == minus_inf, (vec){0}, m_new);
    const vec factor = exp2_nonpositive(m_old - shift);
    for (int64_t b = 0; b < RB; b++)
        for (int c = 0; c < nvec; c++)
            store(p[b] + c * VL, s[b][c] * log2_scale - shift[b]);
    /* All the exponentials in one pass over p (taken on s in registers instead, they ran slower). */
    for (int64_t b = 0; b < RB; b++)
        for (int c = 0; c < nvec; c++)
            store(p[b] + c * VL, exp2_nonpositive(load(p[b] + c * VL)));
    for (int64_t b = 0; b < RB; b++) {
        vec sum = load(p[b]);
        for (int c = 1; c < nvec; c++)
            sum += load(p[b] + c * VL);
        corr[b] = factor[b];
        if (b < nr) {
            l[r0 + b] = l[r0 + b] * factor[b] + hsum(sum);
            m[r0 + b] = m_new[b];
        }
    }
}

/* Whether some row of a work item (its new tokens at positions first_pos..last) must not see some
 * key of the tile from j0: its last key lies past the first row's position, or its first key at
 * or before the last row's window start. */
static inline int tile_is_masked(int64_t j0, int64_t first_pos, int64_t last, int64_t window)
{
    return j0 + KT - 1 > first_pos || (window > 0 && j0 <= last - window);
}

/* The first key any of the tokens from position `from` on may see, rounded down to a tile. */
static inline int64_t staged_from(int64_t from, int64_t window)
{
    const int64_t first = window > 0 && from - window + 1 > 0 ? from - window + 1 : 0;
    return first - first % KT;
}

/* acc[r] = out row r's sum of p . V, divided by l[r] (and V's scale) into out (float32, or bfloat16
 * rounded once where bf16). */
#define ROW_OFFSET(r) (((q_start + i0 + (r) % tokens) * num_heads + kvh * group + (r) / tokens) * head_dim)
#define WRITE_ROWS(bf16)                                                                                      \
    for (int64_t r = 0; r < rows; r++) {                                                                      \
        const float inv = v_scale / l[r];                                                                     \
        for (int64_t d = 0; d < head_dim; d++) {                                                              \
            const float o = acc[r * head_dim + d] * inv;                                                      \
            if (bf16)                                                                                         \
                ((uint16_t *)out)[ROW_OFFSET(r) + d] = float_to_bf16(o);                                      \
            else                                                                                              \
                ((float *)out)[ROW_OFFSET(r) + d] = o;                                                        \
        }                                                                                                     \
    }

/* How many keys from j0 on the rows r0..r0+nr-1 of a work item may see at most: up to the position of
 * their last token (rows wrap from one query head's tokens to the next's, so a block that wraps holds
 * the item's last token). At or below 0 the block sees none of the tile. Fewer than KT only in a tile
 * that crosses the diagonal, which tile_softmax masks: keys past this count need no scores. */
static inline int64_t block_visible(int64_t r0, int64_t nr, int64_t tokens, int64_t first_pos, int64_t j0)
{
    const int64_t t0 = r0 % tokens, last_token = t0 + nr - 1 < tokens ? t0 + nr - 1 : tokens - 1;
    return first_pos + last_token + 1 - j0;
}

/* Vectors of keys that hold any of `visible` keys: a diagonal tile computes only those. */
static inline int key_vectors(int64_t visible) { return visible >= KT ? KV_ : (int)((visible + VL - 1) / VL); }

/* Scores of RB rows against the first nvec vectors of keys of a tile (the others are neither computed
 * nor read): head_dim broadcast multiply-adds each. nvec is a constant where this is inlined
 * (WITH_KEY_VECTORS). */
static inline __attribute__((always_inline)) void tile_scores(
    vec s[RB][KV_], const float *kj, const float *qb, const int64_t head_dim, const int nvec)
{
    for (int64_t b = 0; b < RB; b++)
        for (int c = 0; c < nvec; c++)
            s[b][c] = (vec){0};
    for (int64_t d = 0; d < head_dim; d++) {
        vec k[KV_];
        for (int c = 0; c < nvec; c++)
            k[c] = load(kj + d * KT + c * VL);
        for (int64_t b = 0; b < RB; b++)
            for (int c = 0; c < nvec; c++)
                s[b][c] += qb[b * head_dim + d] * k[c];
    }
}

/* The statements with nv = nvec as a compile-time constant, so that their loops over key vectors unroll. */
_Static_assert(KV_ == 4, "WITH_KEY_VECTORS spells out nvec = 1..KV_");
#define WITH_KEY_VECTORS(nvec, ...)                 \
    switch (nvec) {                                 \
    case 1: { const int nv = 1; __VA_ARGS__; } break; \
    case 2: { const int nv = 2; __VA_ARGS__; } break; \
    case 3: { const int nv = 3; __VA_ARGS__; } break; \
    default: { const int nv = 4; __VA_ARGS__; } break; \
    }

/* One work item: rows = group x (tokens i0..i1-1 of the request's new tokens, at positions ctx + i).
 * Row r is token i0 + r % tokens of query head kvh * group + r / tokens. kt, vt: this request's
 * staged K and V for this KV head, from key stage_start on, tile by tile: each tile's K transposed
 * ([head_dim][KT], contiguous), its V as KT rows. */
static inline __attribute__((always_inline)) void prefill_tile(
    const float *kt, const float *vt, int64_t stage_start, const void *q, void *out,
    int64_t q_start, int64_t ctx, int64_t i0, int64_t i1, int64_t kvh, int64_t num_heads, int64_t group,
    const int64_t head_dim, float scale, float v_scale, int64_t window, float *scratch, int bf16_io)
{
    const int64_t tokens = i1 - i0, rows = group * tokens;
    /* scratch: acc [rows * head_dim], m and l [rows] each, then the rows' q [rows + RB zero rows][head_dim]:
     * one base pointer for a register block's rows (six pointers did not stay in registers). */
    float *acc = scratch, *m = acc + rows * head_dim, *l = m + rows, *qs = l + rows;
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            qs[r * head_dim + d] = bf16_io ? bf16_to_float(((const uint16_t *)q)[ROW_OFFSET(r) + d])
                                           : ((const float *)q)[ROW_OFFSET(r) + d];
    }
    memset(qs + rows * head_dim, 0, sizeof(float) * RB * head_dim);
    const int64_t last = ctx + i1 - 1; /* the item's last position: no row sees past it */

    for (int64_t j0 = staged_from(ctx + i0, window); j0 <= last; j0 += KT) {
        const int64_t nk = last + 1 - j0 < KT ? last + 1 - j0 : KT;
        const float *kj = kt + (j0 - stage_start) * head_dim, *vj = vt + (j0 - stage_start) * head_dim;
        const int masked = tile_is_masked(j0, ctx + i0, last, window);
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            const int64_t visible = block_visible(r0, nr, tokens, ctx + i0, j0);
            if (visible <= 0)
                continue; /* past these rows' positions: the tile changes nothing of theirs */
            const int64_t nt = visible < nk ? visible : nk; /* p is 0 past them: p . V skips them */
            const float *qb = qs + r0 * head_dim;
            vec s[RB][KV_];
            float p[RB][KT] __attribute__((aligned(64))), corr[RB];
            WITH_KEY_VECTORS(key_vectors(visible), tile_scores(s, kj, qb, head_dim, nv);
                             tile_softmax(s, p, corr, m, l, r0, nr, tokens, ctx + i0, j0, masked, window, scale, nv))
            /* acc = acc * corr + p . V, OV output vectors at a time, all RB rows in registers. */
            for (int64_t v0 = 0; v0 < head_dim; v0 += OV * VL) {
                vec o[RB][OV];
                for (int64_t b = 0; b < RB; b++)
                    for (int i = 0; i < OV; i++)
                        o[b][i] = v0 + i * VL < head_dim
                                      ? load(acc + (r0 + (b < nr ? b : 0)) * head_dim + v0 + i * VL) * corr[b]
                                      : (vec){0};
                for (int64_t t = 0; t < nt; t++) {
                    vec v[OV];
                    for (int i = 0; i < OV; i++)
                        v[i] = v0 + i * VL < head_dim ? load(vj + t * head_dim + v0 + i * VL) : (vec){0};
                    for (int64_t b = 0; b < RB; b++)
                        for (int i = 0; i < OV; i++)
                            o[b][i] += p[b][t] * v[i];
                }
                for (int64_t b = 0; b < nr; b++)
                    for (int i = 0; i < OV; i++)
                        if (v0 + i * VL < head_dim)
                            store(acc + (r0 + b) * head_dim + v0 + i * VL, o[b][i]);
            }
        }
    }
    WRITE_ROWS(bf16_io);
}

#if HAVE_BF16_DOT
/* A bfloat16 cache on a CPU with AVX-512 BF16: K and V stay bfloat16 when staged, and both
 * products run as bf16 pair dot products with float32 sums (vdpbf16ps: two multiply-adds per
 * lane and instruction). The probabilities are rounded to bfloat16 before p . V, as torch's own
 * fused CPU attention does in bfloat16; the softmax and the sums stay float32.
 * Staged layouts, in 32-bit words that each hold a bfloat16 pair (low half first):
 *   K tile [head_dim / 2][KT]: word (d, t) = key t's dims 2d, 2d + 1 (a 32-bit slice of its cache row);
 *   V tile [KT / 2][head_dim]: word (t, d) = dim d of keys 2t, 2t + 1. */
static inline __attribute__((always_inline)) void stage_kv_tile_bf16(
    const struct paged_kv *kv, const int64_t *table, int64_t j0, int64_t len, int64_t kvh, const int64_t head_dim,
    uint32_t *kt, uint32_t *vt)
{
    uint16_t *v16 = (uint16_t *)vt;
    for (int64_t t = 0; t < KT; t++) {
        const int64_t j = j0 + t;
        uint16_t *vpair = v16 + (t / 2) * head_dim * 2 + t % 2;
        if (j >= len) {
            for (int64_t d = 0; d < head_dim / 2; d++)
                kt[d * KT + t] = 0;
            for (int64_t d = 0; d < head_dim; d++)
                vpair[2 * d] = 0;
            continue;
        }
        const int64_t slot = table[j / kv->block_size] * kv->block_size + j % kv->block_size;
        const int64_t offset = slot * kv->token_stride + kvh * head_dim;
        const uint16_t *krow = (const uint16_t *)kv->k_cache + offset, *vrow = (const uint16_t *)kv->v_cache + offset;
        for (int64_t d = 0; d < head_dim / 2; d++) {
            uint32_t word;
            memcpy(&word, krow + 2 * d, sizeof word);
            kt[d * KT + t] = word;
        }
        for (int64_t d = 0; d < head_dim; d++)
            vpair[2 * d] = vrow[d];
    }
}

/* The first nvec vectors of each row's p rounded to bfloat16 pairs (for nvec odd, with a vector of
 * zeros as the last one's partner). */
static inline __attribute__((always_inline)) void round_pairs(
    float p[RB][KT], uint32_t pw[RB][KT / 2], const int nvec)
{
    for (int64_t b = 0; b < RB; b++)
        for (int c = 0; c < nvec; c += 2) {
            const __m512 high = c + 1 < nvec ? _mm512_load_ps(p[b] + (c + 1) * VL) : _mm512_setzero_ps();
            _mm512_store_si512(pw[b] + c * VL / 2, (__m512i)_mm512_cvtne2ps_pbh(high, _mm512_load_ps(p[b] + c * VL)));
        }
}

/* tile_scores over the staged bfloat16 pairs: half = head_dim / 2 pair dot products per score. */
static inline __attribute__((always_inline)) void tile_scores_bf16(
    vec s[RB][KV_], const uint32_t *kj, const uint32_t *qb, const int64_t half, const int nvec)
{
    for (int64_t b = 0; b < RB; b++)
        for (int c = 0; c < nvec; c++)
            s[b][c] = (vec){0};
    for (int64_t d = 0; d < half; d++) {
        __m512bh k[KV_];
        for (int c = 0; c < nvec; c++)
            k[c] = load_pairs(kj + d * KT + c * VL);
        for (int64_t b = 0; b < RB; b++) {
            const __m512bh qbd = pair_broadcast(qb[b * half + d]);
            for (int c = 0; c < nvec; c++)
                s[b][c] = (vec)_mm512_dpbf16_ps((__m512)s[b][c], k[c], qbd);
        }
    }
}

/* prefill_tile for a staged bfloat16 tile (layouts above), bfloat16 q and out. */
static inline __attribute__((always_inline)) void prefill_tile_bf16(
    const uint32_t *kt, const uint32_t *vt, int64_t stage_start, const void *q, void *out,
    int64_t q_start, int64_t ctx, int64_t i0, int64_t i1, int64_t kvh, int64_t num_heads, int64_t group,
    const int64_t head_dim, float scale, float v_scale, int64_t window, float *scratch)
{
    const int64_t tokens = i1 - i0, rows = group * tokens, half = head_dim / 2;
    /* scratch: acc [rows * head_dim], m and l [rows] each, then the rows' q as bf16 pairs [rows + RB zero
     * rows][half]. */
    float *acc = scratch, *m = acc + rows * head_dim, *l = m + rows;
    uint32_t *qw = (uint32_t *)(l + rows);
    memset(qw + rows * half, 0, sizeof(uint32_t) * RB * half);
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        memcpy(qw + r * half, (const uint16_t *)q + ROW_OFFSET(r), sizeof(uint16_t) * head_dim);
    }
    const int64_t last = ctx + i1 - 1;

    for (int64_t j0 = staged_from(ctx + i0, window); j0 <= last; j0 += KT) {
        const int64_t nk = last + 1 - j0 < KT ? last + 1 - j0 : KT;
        const uint32_t *kj = kt + (j0 - stage_start) * half, *vj = vt + (j0 - stage_start) * half;
        const int masked = tile_is_masked(j0, ctx + i0, last, window);
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            const int64_t visible = block_visible(r0, nr, tokens, ctx + i0, j0);
            if (visible <= 0)
                continue;
            const int64_t nt = visible < nk ? visible : nk;
            const uint32_t *qb = qw + r0 * half;
            vec s[RB][KV_];
            float p[RB][KT] __attribute__((aligned(64))), corr[RB];
            uint32_t pw[RB][KT / 2] __attribute__((aligned(64))); /* p rounded to bfloat16, in key pairs */
            WITH_KEY_VECTORS(key_vectors(visible), tile_scores_bf16(s, kj, qb, half, nv);
                             tile_softmax(s, p, corr, m, l, r0, nr, tokens, ctx + i0, j0, masked, window, scale, nv);
                             round_pairs(p, pw, nv))
            for (int64_t v0 = 0; v0 < head_dim; v0 += OV * VL) {
                vec o[RB][OV];
                for (int64_t b = 0; b < RB; b++)
                    for (int i = 0; i < OV; i++)
                        o[b][i] = v0 + i * VL < head_dim
                                      ? load(acc + (r0 + (b < nr ? b : 0)) * head_dim + v0 + i * VL) * corr[b]
                                      : (vec){0};
                for (int64_t t = 0; t < (nt + 1) / 2; t++) {
                    __m512bh v[OV];
                    for (int i = 0; i < OV; i++)
                        v[i] = v0 + i * VL < head_dim ? load_pairs(vj + t * head_dim + v0 + i * VL) : (__m512bh)_mm512_setzero_si512();
                    for (int64_t b = 0; b < RB; b++) {
                        const __m512bh pb = pair_broadcast(pw[b][t]);
                        for (int i = 0; i < OV; i++)
                            o[b][i] = (vec)_mm512_dpbf16_ps((__m512)o[b][i], v[i], pb);
                    }
                }
                for (int64_t b = 0; b < nr; b++)
                    for (int i = 0; i < OV; i++)
                        if (v0 + i * VL < head_dim)
                            store(acc + (r0 + b) * head_dim + v0 + i * VL, o[b][i]);
            }
        }
    }
    WRITE_ROWS(1);
}
#endif
#undef WRITE_ROWS
#undef ROW_OFFSET

/* The request r whose range of items starts[r] .. starts[r + 1] - 1 holds item i. */
static inline int64_t owner(const int64_t *starts, int64_t i)
{
    int64_t r = 0;
    while (starts[r + 1] <= i)
        r++;
    return r;
}

/* Request r's staged keys for KV head kvh: K tiles, then as many V tiles (stage_offset, key_tile_start
 * as paged_prefill_attention lays them out). */
static inline float *staged_k(float *staged, const int64_t *stage_offset, const int64_t *key_tile_start, int64_t r,
                              int64_t kvh, int64_t head_dim)
{
    const int64_t width = (key_tile_start[r + 1] - key_tile_start[r]) * KT;
    return staged + stage_offset[r] + kvh * 2 * width * head_dim;
}

/* Whether the kernels were built with their bfloat16 dot-product paths. */
int has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Request r's new tokens are rows q_starts[r]..q_starts[r] + num_new[r] - 1 of q and out, at
 * positions seq_lens[r] - num_new[r] ... seq_lens[r] - 1; its K/V (the new tokens' included) are
 * already in the cache. Layouts, format and bf16_io as for paged_decode_attention; bfloat16 q over a
 * bfloat16 cache multiply in bfloat16 where the CPU can (prefill_tile_bf16). */
int paged_prefill_attention(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *q_starts, const int64_t *num_new, const int64_t *block_tables, const int64_t *seq_lens,
    int64_t n, int64_t table_stride, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int num_threads, int format, float k_scale, float v_scale, int bf16_io)
{
    const struct paged_kv kv = {k_cache, v_cache, block_size, num_kv_heads * head_dim};
    const int64_t group = num_heads / num_kv_heads;
    /* Per request: its first query tile, first staged key tile, and where its staged K/V start. */
    int64_t *tile_start = malloc(sizeof(int64_t) * 3 * (n + 1));
    if (tile_start == NULL)
        return -1;
    int64_t *key_tile_start = tile_start + n + 1, *stage_offset = key_tile_start + n + 1;
    tile_start[0] = key_tile_start[0] = stage_offset[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        const int64_t key_tiles = (seq_lens[r] - staged_from(seq_lens[r] - num_new[r], window) + KT - 1) / KT;
        tile_start[r + 1] = tile_start[r] + (num_new[r] + QT - 1) / QT;
        key_tile_start[r + 1] = key_tile_start[r] + key_tiles;
        stage_offset[r + 1] = stage_offset[r] + 2 * num_kv_heads * key_tiles * KT * head_dim;
    }
    /* bfloat16 queries over a bfloat16 cache: bf16 dot products where the CPU has them (the staged
     * K/V then use half the words allocated). */
    const int bf16_dot = HAVE_BF16_DOT && bf16_io && format == KV_BF16 && head_dim % (2 * VL) == 0;
    (void)bf16_dot; /* (read only where HAVE_BF16_DOT) */
    float *staged = malloc(sizeof(float) * stage_offset[n]);
    if (staged == NULL) {
        free(tile_start);
        return -1;
    }
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* Stage every request's keys, tile by tile and KV head by KV head. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < key_tile_start[n] * num_kv_heads; item++) {
            const int64_t key_tile = item / num_kv_heads, kvh = item % num_kv_heads, r = owner(key_tile_start, key_tile);
            const int64_t width = (key_tile_start[r + 1] - key_tile_start[r]) * KT, t = key_tile - key_tile_start[r];
            const int64_t from = staged_from(seq_lens[r] - num_new[r], window);
            float *kt = staged_k(staged, stage_offset, key_tile_start, r, kvh, head_dim), *vt = kt + width * head_dim;
#define STAGE(fmt) \
    stage_kv_tile(&kv, block_tables + r * table_stride, from + t * KT, seq_lens[r], kvh, head_dim, fmt, \
                  kt + t * KT * head_dim, vt + t * KT * head_dim)
#if HAVE_BF16_DOT
            if (bf16_dot) {
                stage_kv_tile_bf16(&kv, block_tables + r * table_stride, from + t * KT, seq_lens[r], kvh, head_dim,
                                   (uint32_t *)kt + t * KT * head_dim / 2, (uint32_t *)vt + t * KT * head_dim / 2);
                continue;
            }
#endif
            format == KV_FP8 ? STAGE(KV_FP8) : format == KV_BF16 ? STAGE(KV_BF16) : STAGE(KV_F32);
#undef STAGE
        }
        /* (the loop's implicit barrier: every key is staged before any tile reads it) */
        const int64_t rows = group * QT;
        float *scratch = malloc(sizeof(float) * (rows * head_dim + 2 * rows + (rows + RB) * head_dim));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tile_start[n] * num_kv_heads; item++) {
            if (scratch == NULL)
                continue;
            /* Later tiles see more keys: take them first, so that the short ones fill the gaps. */
            const int64_t tile = tile_start[n] - 1 - item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t r = owner(tile_start, tile), ctx = seq_lens[r] - num_new[r];
            const int64_t i0 = (tile - tile_start[r]) * QT, i1 = i0 + QT < num_new[r] ? i0 + QT : num_new[r];
            const int64_t width = (key_tile_start[r + 1] - key_tile_start[r]) * KT;
            const float *kt = staged_k(staged, stage_offset, key_tile_start, r, kvh, head_dim), *vt = kt + width * head_dim;
#if HAVE_BF16_DOT
            if (bf16_dot) {
#define TILE(dim) \
    prefill_tile_bf16((const uint32_t *)kt, (const uint32_t *)vt, staged_from(ctx, window), q, out, q_starts[r], ctx, \
                      i0, i1, kvh, num_heads, group, dim, scale * k_scale, v_scale, window, scratch)
                if (head_dim == 64)
                    TILE(64);
                else if (head_dim == 128)
                    TILE(128);
                else
                    TILE(head_dim);
#undef TILE
                continue;
            }
#endif
#define TILE(dim) \
    prefill_tile(kt, vt, staged_from(ctx, window), q, out, q_starts[r], ctx, i0, i1, kvh, num_heads, group, \
                 dim, scale * k_scale, v_scale, window, scratch, bf16_io)
            if (head_dim == 64)
                TILE(64);
            else if (head_dim == 128)
                TILE(128);
            else
                TILE(head_dim);
#undef TILE
        }
        free(scratch);
    }
    free(staged);
    free(tile_start);
    return failed ? -1 : 0;
}
