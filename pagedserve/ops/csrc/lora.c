/* The batched LoRA delta on CPU: each row of a fused linear's output gets the low-rank update of the
 * adapter in its row's slot, out[r, cols_p] += (x[r] @ A_p^T) @ B_p^T for each part p of the fused
 * linear (q | k | v, gate | up, or one part), so that one step serves rows of many adapters and of
 * the base model (slot -1: nothing added) in one call per linear.
 *
 * Layout (made by pagedserve/lora/layers.py), R the stack's rank dimension (a multiple of LANES,
 * ranks past an adapter's own zero):
 *   at [slots, parts, in_features, R]: A_p transposed, so that t_p = x @ A_p^T is a sum over the
 *     input features of x[i] * at[i, :], a multiply-add of whole vectors of ranks;
 *   bt [slots, R, out_total]: each B_p transposed into its part's columns, so that the delta of a
 *     block of columns is a sum over the ranks of t_p[k] * bt[k, cols], vectors of columns;
 *   ranks [slots, parts]: the rank an adapter uses in each part, 0 for a part it does not touch
 *     (skipped), and only that many ranks are read.
 * Sums are float32, in registers, in a fixed order; a bfloat16 output is rounded once, from its old
 * value plus the whole delta, to nearest even as torch rounds.
 *
 * Rows are taken in the order of their slots, so that each thread's run of rows of one slot reads
 * that slot's weights from cache; threads split the rows.
 */
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { F32 = 0, BF16 = 1 };
#define LANES 16 /* R is a multiple of it, and so of every build's vector width */
#define AI __attribute__((always_inline))

/* Sums are vectors of VL floats, one register of the build's widest (gcc's vector extensions: a
 * vector type wider than a register went through memory, 20x slower). A tile: up to TILE rows of
 * one slot share each load of its weights. A row's sums over the input features run in SPLIT
 * independent chains (hiding a multiply-add's latency), combined in a fixed order; a pass over B
 * keeps PASS vectors of columns per row. Every row is summed in the same order whatever tile it is
 * in, so its delta does not depend on the other rows of the step. TILE x SPLIT and TILE x PASS sums
 * take 16 of AVX-512's 32 registers, 8 of AVX2's 16. */
#if defined(__AVX512F__)
#define VL 16
#define TILE 4
#elif defined(__AVX__)
#define VL 8
#define TILE 2
#else
#define VL 4
#define TILE 2
#endif
#define SPLIT 4
#define PASS 4

typedef float vf __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* VL consecutive values at p, widened to float32 (any alignment). */
static inline AI vf load_vec(const void *p, const int dtype) {
    if (dtype == F32) {
        vf v;
        memcpy(&v, p, sizeof v);
        return v;
    }
#if defined(__AVX512F__) /* one instruction widens; gcc's generic conversion took five */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

static inline AI float load_one(const void *p, int64_t i, const int dtype) {
    return dtype == F32 ? ((const float *)p)[i] : widen_bf16(((const uint16_t *)p)[i]);
}

/* t[r][0 .. chunks * VL) = xf[r] @ a for the tile's nr rows (xf [nr, in] float32, t [nr, R]),
 * a [in, R] (its first chunks * VL ranks read). */
static inline AI void shrink(const float *xf, int64_t in, const char *a, int64_t R, int64_t chunks, float *t,
                             const int nr, const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2, row = R * elem;
    for (int64_t c = 0; c < chunks; c++) {
        const char *ac = a + c * VL * elem;
        vf s[TILE][SPLIT];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < SPLIT; j++) s[r][j] = (vf){0};
        int64_t i = 0;
        for (; i + SPLIT <= in; i += SPLIT)
            for (int j = 0; j < SPLIT; j++) {
                const vf w = load_vec(ac + (i + j) * row, dtype);
                for (int r = 0; r < nr; r++) s[r][j] += xf[r * in + i + j] * w;
            }
        for (; i < in; i++) {
            const vf w = load_vec(ac + i * row, dtype);
            for (int r = 0; r < nr; r++) s[r][0] += xf[r * in + i] * w;
        }
        for (int r = 0; r < nr; r++) {
            for (int half = SPLIT / 2; half > 0; half /= 2)
                for (int j = 0; j < half; j++) s[r][j] += s[r][j + half];
            memcpy(t + r * R + c * VL, &s[r][0], sizeof(vf));
        }
    }
}

static inline AI void add_sum(char *out, int64_t c, float sum, const int dtype) {
    if (dtype == F32)
        ((float *)out)[c] += sum;
    else
        ((uint16_t *)out)[c] = round_bf16(widen_bf16(((uint16_t *)out)[c]) + sum);
}

/* outs[r][first .. end) += t[r][0 .. rank) @ b[0 .. rank, first .. end) for the tile's nr rows
 * (t [nr, R]), b [R, total]. */
static inline AI void expand(const float *t, int64_t R, int64_t rank, const char *b, int64_t total, int64_t first,
                             int64_t end, char *const *outs, const int nr, const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2;
    int64_t c0 = first;
    for (; c0 + PASS * VL <= end; c0 += PASS * VL) {
        vf acc[TILE][PASS];
        for (int r = 0; r < nr; r++)
            for (int v = 0; v < PASS; v++) acc[r][v] = (vf){0};
        for (int64_t k = 0; k < rank; k++) {
            vf w[PASS];
            for (int v = 0; v < PASS; v++) w[v] = load_vec(b + (k * total + c0 + v * VL) * elem, dtype);
            for (int r = 0; r < nr; r++) {
                const float tk = t[r * R + k];
                for (int v = 0; v < PASS; v++) acc[r][v] += tk * w[v];
            }
        }
        for (int r = 0; r < nr; r++) {
            float sums[PASS * VL];
            memcpy(sums, acc[r], sizeof sums);
            for (int j = 0; j < PASS * VL; j++) add_sum(outs[r], c0 + j, sums[j], dtype);
        }
    }
    for (int r = 0; r < nr; r++) /* the columns past the last whole pass, in the same order of sums */
        for (int64_t c = c0; c < end; c++) {
            float sum = 0.f;
            for (int64_t k = 0; k < rank; k++) sum += t[r * R + k] * load_one(b, k * total + c, dtype);
            add_sum(outs[r], c, sum, dtype);
        }
}

/* The deltas of slot s for a tile of nr rows: xs[r] (rows of x), added into outs[r]. */
static inline AI void add_tile(const char *const *xs, int64_t in, char *const *outs, int64_t s, const char *at,
                               const char *bt, const int64_t *ranks, const int64_t *part_ends, int64_t parts,
                               int64_t R, const int nr, const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2, total = part_ends[parts - 1];
    float xf[nr * in], t[nr * R];
    for (int r = 0; r < nr; r++)
        for (int64_t i = 0; i < in; i++) xf[r * in + i] = load_one(xs[r], i, dtype);
    for (int64_t p = 0; p < parts; p++) {
        const int64_t rank = ranks[s * parts + p];
        if (rank <= 0) continue;
        shrink(xf, in, at + (s * parts + p) * in * R * elem, R, (rank + VL - 1) / VL, t, nr, dtype);
        expand(t, R, rank, bt + s * R * total * elem, total, p ? part_ends[p - 1] : 0, part_ends[p], outs, nr, dtype);
    }
}

/* add_tile with nr and the dtype as constants: a copy of the loops for each. */
static void add_tile_any(const char *const *xs, int64_t in, char *const *outs, int64_t s, const char *at,
                         const char *bt, const int64_t *ranks, const int64_t *part_ends, int64_t parts, int64_t R,
                         int nr, int dtype) {
#define CASE(N)                                                                                                \
    case N:                                                                                                    \
        if (dtype == F32)                                                                                      \
            add_tile(xs, in, outs, s, at, bt, ranks, part_ends, parts, R, N, F32);                             \
        else                                                                                                   \
            add_tile(xs, in, outs, s, at, bt, ranks, part_ends, parts, R, N, BF16);                            \
        break;
    switch (nr) {
        CASE(1)
        CASE(2)
#if TILE > 2
        CASE(3)
        CASE(4)
#endif
    }
#undef CASE
}

/* out[r, :] += the delta of slot slots[r] for each of `rows` rows of x [rows, in] (rows contiguous;
 * out's rows out_stride elements apart), for slots[r] in [0, num_slots); -1: the row is left as it
 * is. at, bt, ranks: see the top; part_ends [parts]: where each part's columns end (they start where
 * the previous ends, the first at 0); R % LANES == 0. 0, or 1 for a slot outside [-1, num_slots),
 * 2 for no memory (then nothing is written). */
int lora_add(const void *x, int64_t rows, int64_t in, void *out, int64_t out_stride, const int64_t *slots,
             int64_t num_slots, const void *at, const void *bt, const int64_t *ranks, const int64_t *part_ends,
             int64_t parts, int64_t R, int dtype, int threads) {
    int64_t active = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < -1 || slots[r] >= num_slots) return 1;
        active += slots[r] >= 0;
    }
    if (active == 0) return 0;
    /* The active rows, ordered by slot (a counting sort, stable). */
    int64_t *order = malloc((active + num_slots + 1) * sizeof *order);
    if (!order) return 2;
    int64_t *start = order + active;
    memset(start, 0, (num_slots + 1) * sizeof *start);
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] >= 0) start[slots[r] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] >= 0) order[start[slots[r]]++] = r;
    const int64_t elem = dtype == F32 ? 4 : 2;
    const int nt = threads < active ? threads : (int)active;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* Each thread a contiguous run of the ordered rows (a slot's rows stay together), cut into
         * tiles of one slot. */
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t end = active * (t + 1) / n;
        for (int64_t j = active * t / n; j < end;) {
            const int64_t s = slots[order[j]];
            const char *xs[TILE];
            char *outs[TILE];
            int nr = 0;
            for (; nr < TILE && j < end && slots[order[j]] == s; nr++, j++) {
                xs[nr] = (const char *)x + order[j] * in * elem;
                outs[nr] = (char *)out + order[j] * out_stride * elem;
            }
            add_tile_any(xs, in, outs, s, (const char *)at, (const char *)bt, ranks, part_ends, parts, R, nr, dtype);
        }
    }
    free(order);
    return 0;
}
