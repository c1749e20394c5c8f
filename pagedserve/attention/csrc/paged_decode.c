/* Decode attention over a paged KV cache, for CPUs, in float32.
 *
 * Each request brings one query token and reads its K/V in place through its block table: no
 * gathered copy of the context is ever made, so every K/V row crosses the memory bus once per
 * step. Work is split over (request, KV head) pairs; the query heads that share a KV head are
 * scored against each K row while it is in L1.
 *
 * Built by pagedserve/attention/cpu_kernel.py with the system C compiler on first use and called
 * through ctypes; tests/attention/test_cpu_kernel.py holds it against the torch oracle.
 *
 * Layouts (C-contiguous):
 *   q, out           [num_tokens, num_heads, head_dim]   only rows token_indices[r] are used
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   token_indices, seq_lens [n]; block_tables [n, table_stride] (int64)
 * Query head h reads KV head h / (num_heads / num_kv_heads). Request r, at position
 * p = seq_lens[r] - 1, sees key positions j with p - window < j <= p (window <= 0: every j <= p).
 * Scores are (q . k) * scale and the softmax runs in float32, as in transformers' eager attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct paged_kv {
    const float *k_cache, *v_cache;
    int64_t block_size, token_stride; /* token_stride: floats between consecutive slots */
};

/* Attention of one request's query heads qh [num_heads, head_dim] over its keys first..len-1,
 * into oh. Query head h reads KV head h / group. All KV heads are handled together so that each
 * slot's K and V rows (num_kv_heads * head_dim floats, contiguous) are read whole, in order.
 * scores: scratch of num_heads * max_len floats; acc: num_heads * head_dim.
 * Always inlined, so a constant head_dim gives fully unrolled vector loops. */
static inline __attribute__((always_inline)) void attend_request(
    const struct paged_kv *kv, const int64_t *table, int64_t first, int64_t len, const float *qh, float *oh,
    int64_t num_heads, int64_t group, const int64_t head_dim, float scale, float *scores, int64_t max_len,
    float *acc)
{
    const int64_t bs = kv->block_size, stride = kv->token_stride;
    const int64_t first_block = first / bs, end_block = (len + bs - 1) / bs;
    float maxima[num_heads], sums[num_heads];
    for (int64_t h = 0; h < num_heads; h++)
        maxima[h] = -INFINITY;

    /* Scores, block by block, and each query head's maximum. */
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = b == first_block ? first - b * bs : 0, t1 = len - b * bs < bs ? len - b * bs : bs;
        const float *kb = kv->k_cache + table[b] * bs * stride;
        for (int64_t t = t0; t < t1; t++) {
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qv = qh + h * head_dim, *k = kb + t * stride + (h / group) * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qv[d] * k[d];
                const float s = dot * scale;
                scores[h * max_len + b * bs + t] = s;
                maxima[h] = s > maxima[h] ? s : maxima[h];
            }
        }
    }

    /* Softmax numerators and their sums. */
    for (int64_t h = 0; h < num_heads; h++) {
        float *sh = scores + h * max_len, sum = 0.0f;
        for (int64_t j = first; j < len; j++) {
            sh[j] = expf(sh[j] - maxima[h]);
            sum += sh[j];
        }
        sums[h] = sum;
    }

    /* Probability-weighted sum of V, normalised at the end. */
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t b = first_block; b < end_block; b++) {
        const int64_t t0 = b == first_block ? first - b * bs : 0, t1 = len - b * bs < bs ? len - b * bs : bs;
        const float *vb = kv->v_cache + table[b] * bs * stride;
        for (int64_t t = t0; t < t1; t++) {
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * max_len + b * bs + t], *v = vb + t * stride + (h / group) * head_dim;
                float *ah = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    ah[d] += p * v[d];
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sums[h];
        for (int64_t d = 0; d < head_dim; d++)
            oh[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

int paged_decode_attention(
    const float *q, const float *k_cache, const float *v_cache, float *out,
    const int64_t *token_indices, const int64_t *block_tables, const int64_t *seq_lens,
    int64_t n, int64_t table_stride, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int num_threads)
{
    const struct paged_kv kv = {k_cache, v_cache, block_size, num_kv_heads * head_dim};
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++)
        max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * num_heads * (max_len + head_dim)); /* + acc */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n; r++) {
            if (scores == NULL)
                continue;
            const int64_t len = seq_lens[r], first = window > 0 && len > window ? len - window : 0;
            const float *qh = q + token_indices[r] * num_heads * head_dim;
            float *oh = out + token_indices[r] * num_heads * head_dim, *acc = scores + num_heads * max_len;
            const int64_t *table = block_tables + r * table_stride;
            /* Common head sizes get their own unrolled copy. */
            if (head_dim == 64)
                attend_request(&kv, table, first, len, qh, oh, num_heads, group, 64, scale, scores, max_len, acc);
            else if (head_dim == 128)
                attend_request(&kv, table, first, len, qh, oh, num_heads, group, 128, scale, scores, max_len, acc);
            else
                attend_request(&kv, table, first, len, qh, oh, num_heads, group, head_dim, scale, scores, max_len,
                               acc);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
