/* Decode attention over a paged KV cache (layouts and number formats: paged_attention.h).
 *
 * Each request brings one query token and reads its K/V in place through its block table: no
 * gathered copy of the context is ever made, so every K/V row crosses the memory bus once per
 * step. Threads take whole requests; within one, each block's K/V rows (all KV heads, contiguous)
 * are read in order and reused from L1 by the query heads that share them.
 */
#include "paged_attention.h"

/* The rows t0..t1-1 of block b that hold visible keys, for keys first..len-1 (blocks of bs rows). */
static inline int64_t span_start(int64_t b, int64_t first, int64_t bs) { return first > b * bs ? first - b * bs : 0; }
static inline int64_t span_end(int64_t b, int64_t len, int64_t bs) { return len - b * bs < bs ? len - b * bs : bs; }

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

/* A sink (gpt-oss) is one more logit in a query head's softmax, with no value: the softmax's
 * maximum is at least head h's sink logit (with_sink), and the sum gains exp(sink - maximum)
 * (sink_term; 0 without sinks). */
static inline float with_sink(float m, const float *sinks, int64_t h)
{
    return sinks != NULL && sinks[h] > m ? sinks[h] : m;
}

static inline float sink_term(float m, const float *sinks, int64_t h)
{
    return sinks != NULL ? fast_exp(sinks[h] - m) : 0.0f;
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

#elif defined(__AVX2__) && defined(__FMA__)
/* The lane sums of 8 vectors at once: lane t of the result is the sum of v[t]'s lanes (pairs, then
 * fours within each 128-bit half, then the halves); 7 horizontal adds and permutes where 8 hsums
 * take 24 and leave 8 scalars. */
static inline __m256 hsum8(const __m256 v[8])
{
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* v0-3 | v4-7, per half */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

/* Attention of one request's query heads qh [num_heads, head_dim] over its keys first..len-1,
 * into oh. Query head h reads KV head h / group. Each block's K rows, then (in a second pass) its
 * V rows, all KV heads contiguous, are read once, in order, and reused from L1 by the heads that
 * share them.
 * scores: scratch of num_heads * max_len floats; acc: num_heads * head_dim; buf: one block of
 * floats (fp8 and bfloat16 only); sinks: the query heads' sink logits, or NULL. Always inlined, so
 * a constant head_dim gives fully unrolled vector loops and a constant format a copy for that cache
 * type alone. */
static inline __attribute__((always_inline)) void attend_request(
    const struct paged_kv *kv, const int64_t *table, int64_t first, int64_t len, const float *qh, float *oh,
    int64_t num_heads, int64_t group, const int64_t head_dim, float scale, float v_scale, float *scores,
    int64_t max_len, float *acc, const int format, float *buf, const float *sinks)
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
#elif defined(__AVX2__) && defined(__FMA__)
        /* 8 keys at a time, their dot products summed by hsum8 */
        struct prefetcher pf = prefetch_spread(AHEAD(b - first_block), block_bytes, num_heads * ((t1 - t0 + 7) / 8));
        for (int64_t c0 = t0; c0 < t1; c0 += 8) {
            const int nt = t1 - c0 < 8 ? (int)(t1 - c0) : 8;
            for (int64_t h = 0; h < num_heads; h++) {
                prefetch_step(&pf);
                const float *qv = qh + h * head_dim, *kh = kb + c0 * stride + (h / group) * head_dim;
                __m256 part[8];
                for (int t = 0; t < 8; t++) {
                    __m256 dot = _mm256_setzero_ps();
                    if (t < nt)
                        for (int64_t i = 0; i < head_dim; i += 8)
                            dot = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kh + t * stride + i), dot);
                    part[t] = dot;
                }
                float s8[8], *sh = scores + h * max_len + b * bs + c0, m = maxima[h];
                _mm256_storeu_ps(s8, _mm256_mul_ps(hsum8(part), _mm256_set1_ps(scale)));
                for (int t = 0; t < nt; t++) {
                    sh[t] = s8[t];
                    m = s8[t] > m ? s8[t] : m;
                }
                maxima[h] = m;
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

    /* Softmax numerators and their sums (a sink's term included). */
    for (int64_t h = 0; h < num_heads; h++) {
        const float m = with_sink(maxima[h], sinks, h);
        sums[h] = softmax_numerators(scores + h * max_len, first, len, m) + sink_term(m, sinks, h);
    }

    /* Probability-weighted sum of V, normalised at the end. */
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = span_start(b, first, bs), t1 = span_end(b, len, bs);
        const float *vb = block_at(kv->v_cache, table, b, t0, t1, bs, stride, format, buf);
        struct prefetcher pf =
            prefetch_spread(AHEAD(num_blocks + b - first_block), block_bytes, num_heads * (t1 - t0));
        for (int64_t h = 0; h < num_heads; h++) {
            const float *vh = vb + (h / group) * head_dim, *ph = scores + h * max_len + b * bs;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
            /* in 8-lane registers: gcc keeps a 16-float `vec` on the stack without AVX-512 */
            __m256 a[head_dim / 8];
            for (int64_t i = 0; i < head_dim / 8; i++)
                a[i] = _mm256_loadu_ps(acc + h * head_dim + i * 8);
            for (int64_t t = t0; t < t1; t++) {
                prefetch_step(&pf);
                const __m256 p = _mm256_set1_ps(ph[t]);
                for (int64_t i = 0; i < head_dim / 8; i++)
                    a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vh + t * stride + i * 8), a[i]);
            }
            for (int64_t i = 0; i < head_dim / 8; i++)
                _mm256_storeu_ps(acc + h * head_dim + i * 8, a[i]);
#else
            vec a[nv];
            for (int64_t i = 0; i < nv; i++)
                a[i] = load(acc + h * head_dim + i * VL);
            for (int64_t t = t0; t < t1; t++) {
                prefetch_step(&pf);
                for (int64_t i = 0; i < nv; i++)
                    a[i] += ph[t] * load(vh + t * stride + i * VL);
            }
            for (int64_t i = 0; i < nv; i++)
                store(acc + h * head_dim + i * VL, a[i]);
#endif
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
    float *acc, uint16_t *p16, const float *sinks)
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
        const float m = with_sink(maxima[h], sinks, h);
        sums[h] = softmax_numerators(sh, first, len, m) + sink_term(m, sinks, h);
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

/* num_blocks: the pool's blocks (block ids run 0..num_blocks-1; checked in a checked build).
 * format: KV_F32, KV_BF16, or KV_FP8 (e4m3 bytes, to be multiplied by k_scale and v_scale; else 1).
 * bf16_io: q and out are bfloat16 (q widened on entry, exactly; out rounded once), else float32.
 * sinks: [num_heads] float32 sink logits (gpt-oss: one more logit per query head's softmax, with
 * no value), or NULL for none.
 * Token t's query heads start at element t * q_stride of q (q_stride = heads * head_dim when q is
 * contiguous; larger for a view of the fused qkv output); its output at t * heads * head_dim. */
int paged_decode_attention(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *token_indices, const int64_t *block_tables, const int64_t *seq_lens,
    int64_t n, int64_t q_stride, int64_t table_stride, int64_t num_blocks, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int num_threads, int format, float k_scale, float v_scale, int bf16_io,
    const float *sinks)
{
    const struct paged_kv kv = {k_cache, v_cache, block_size, num_kv_heads * head_dim};
    const int64_t group = num_heads / num_kv_heads, q_size = num_heads * head_dim;
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t len = seq_lens[r], first = window > 0 && len > window ? len - window : 0;
        const int status = check_table(block_tables + r * table_stride, first, len, block_size, table_stride,
                                       num_blocks);
        if (status != 0)
            return status;
        max_len = len > max_len ? len : max_len;
    }
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
    attend_request_bf16(&kv, table, first, len, q16, out32, num_heads, group, dim, scale, scores, max_len, acc, p16, \
                        sinks)
                if (head_dim == 64)
                    ATTEND(64);
                else if (head_dim == 128)
                    ATTEND(128);
                else if (head_dim == 256)
                    ATTEND(256);
                else
                    ATTEND(head_dim);
#undef ATTEND
                uint16_t *o16 = (uint16_t *)out + token_indices[r] * q_size;
                for (int64_t i = 0; i < q_size; i++)
                    o16[i] = float_to_bf16(out32[i]);
                continue;
            }
#endif
            /* Common head sizes get their own unrolled copy, for each cache type (Gemma's 256 too: in
             * bfloat16 its generic copy, whose sums per head do not stay in registers, took 2.2 times
             * as long; float32 5% longer). */
#define ATTEND(dim, fmt) \
    attend_request(&kv, table, first, len, qh, oh, num_heads, group, dim, scale * k_scale, v_scale, scores, \
                   max_len, acc, fmt, buf, sinks)
#define ATTEND_FORMATS(dim) \
    (format == KV_FP8 ? ATTEND(dim, KV_FP8) : format == KV_BF16 ? ATTEND(dim, KV_BF16) : ATTEND(dim, KV_F32))
            if (head_dim == 64)
                ATTEND_FORMATS(64);
            else if (head_dim == 128)
                ATTEND_FORMATS(128);
            else if (head_dim == 256)
                ATTEND_FORMATS(256);
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
    return failed ? PAGED_NO_MEMORY : 0;
}

