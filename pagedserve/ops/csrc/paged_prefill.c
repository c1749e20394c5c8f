/* Prompt attention over a paged KV cache: several new tokens per request (a whole prompt, or a chunk
 * behind its cached tokens). Layouts and number formats: paged_attention.h.
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
#include "paged_attention.h"

#define KV_ 4         /* vectors of keys per tile */
#define KT (KV_ * VL) /* keys per tile */
#define QT 32         /* new tokens per work item */
#define RB (VL == 16 ? 6 : 4) /* rows per register block: RB x KV_ score vectors, RB x OV output vectors */
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
    HALVES(v, vmax);
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

/* Row r's running softmax before any key (m in log2 units, l its sum): empty, or, with a sink
 * (gpt-oss: one more logit per query head, with no value), the sink's logit alone: its term
 * 2^(m - m) = 1 is in l from the start and rescales with it as keys come (m the max including it). */
#define START_ROW(r)                                                                                          \
    do {                                                                                                      \
        const float sink = sinks != NULL ? sinks[kvh * group + (r) / tokens] : 0.0f;                         \
        m[r] = sinks != NULL ? sink * 1.44269504088896341f : -INFINITY;                                       \
        l[r] = sinks != NULL ? 1.0f : 0.0f;                                                                   \
    } while (0)

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
    const int64_t head_dim, float scale, float v_scale, int64_t window, float *scratch, int bf16_io,
    const float *sinks)
{
    const int64_t tokens = i1 - i0, rows = group * tokens;
    /* scratch: acc [rows * head_dim], m and l [rows] each, then the rows' q [rows + RB zero rows][head_dim]:
     * one base pointer for a register block's rows (six pointers did not stay in registers). */
    float *acc = scratch, *m = acc + rows * head_dim, *l = m + rows, *qs = l + rows;
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        START_ROW(r);
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
    const int64_t head_dim, float scale, float v_scale, int64_t window, float *scratch, const float *sinks)
{
    const int64_t tokens = i1 - i0, rows = group * tokens, half = head_dim / 2;
    /* scratch: acc [rows * head_dim], m and l [rows] each, then the rows' q as bf16 pairs [rows + RB zero
     * rows][half]. */
    float *acc = scratch, *m = acc + rows * head_dim, *l = m + rows;
    uint32_t *qw = (uint32_t *)(l + rows);
    memset(qw + rows * half, 0, sizeof(uint32_t) * RB * half);
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        START_ROW(r);
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
#undef START_ROW
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
 * already in the cache. Layouts, num_blocks, format, bf16_io and sinks as for paged_decode_attention;
 * bfloat16 q over a bfloat16 cache multiply in bfloat16 where the CPU can (prefill_tile_bf16). */
int paged_prefill_attention(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *q_starts, const int64_t *num_new, const int64_t *block_tables, const int64_t *seq_lens,
    int64_t n, int64_t table_stride, int64_t num_blocks, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int num_threads, int format, float k_scale, float v_scale, int bf16_io,
    const float *sinks)
{
    const struct paged_kv kv = {k_cache, v_cache, block_size, num_kv_heads * head_dim};
    const int64_t group = num_heads / num_kv_heads;
    for (int64_t r = 0; r < n; r++) {
        const int status = check_table(block_tables + r * table_stride, staged_from(seq_lens[r] - num_new[r], window),
                                       seq_lens[r], block_size, table_stride, num_blocks);
        if (status != 0)
            return status;
    }
    /* Per request: its first query tile, first staged key tile, and where its staged K/V start. */
    int64_t *tile_start = malloc(sizeof(int64_t) * 3 * (n + 1));
    if (tile_start == NULL)
        return PAGED_NO_MEMORY;
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
        return PAGED_NO_MEMORY;
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
                      i0, i1, kvh, num_heads, group, dim, scale * k_scale, v_scale, window, scratch, sinks)
                if (head_dim == 64)
                    TILE(64);
                else if (head_dim == 128)
                    TILE(128);
                else if (head_dim == 256)
                    TILE(256);
                else
                    TILE(head_dim);
#undef TILE
                continue;
            }
#endif
#define TILE(dim) \
    prefill_tile(kt, vt, staged_from(ctx, window), q, out, q_starts[r], ctx, i0, i1, kvh, num_heads, group, \
                 dim, scale * k_scale, v_scale, window, scratch, bf16_io, sinks)
            if (head_dim == 64)
                TILE(64);
            else if (head_dim == 128)
                TILE(128);
            else if (head_dim == 256)
                TILE(256);
            else
                TILE(head_dim);
#undef TILE
        }
        free(scratch);
    }
    free(staged);
    free(tile_start);
    return failed ? PAGED_NO_MEMORY : 0;
}

