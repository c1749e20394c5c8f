/* y = x @ W.T (+ bias) on CPU, made for a few rows of x: the matmuls of decode steps.
 *
 * Decode multiplies a handful of rows by every weight of the model, so it is bound by streaming
 * the weights from memory. oneDNN's GEMM, made for many rows, streams them at about the memory's
 * rate for one row but falls behind from 8 rows on (1.5x slower at 16 bfloat16 rows on the 2-core
 * test machine; docs/benchmarks.md). Here every weight is read from memory once per call and the
 * arithmetic on it overlaps the stream.
 *
 * Layout (made by ops/cpu_linear.py): W [n, k] is cut into panels of 64 output columns; a panel
 * is a sequence of steps of 256 bytes, each the 64 columns' weights for one k (float32) or for a
 * pair of consecutive k (bfloat16, interleaved [64][2], the operand of vdpbf16ps, which multiplies
 * the pairs and adds both products into float32). Either way a step consumes 4 bytes of each row
 * of x: a float, or a bfloat16 pair, broadcast to all 16 lanes. Sums are float32 in both.
 *
 * With AVX-512, a tile of up to 6 rows x 64 columns of sums lives in 24 of the 32 vector registers
 * through a chunk of 64 steps (16 KB of panel, resident in L1 while each group of 6 rows passes
 * over it), and every pass prefetches the chunk after (past a panel's end too: a prefetch never
 * faults). With AVX2 (and FMA) the same walk runs in tiles of 6 rows x 16 columns (see there).
 * Threads split the panels by halves. The same kernel serves prompts too where oneDNN has no fast
 * bfloat16 (cpu_linear.py): on AVX2 it reaches about 90% of the float32 multiply rate from 32 rows.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PANEL 64          /* output columns per panel: four 16-lane vectors */
#define STEP_BYTES 256    /* one step of a panel */
#define ROWS 6            /* rows of x per register tile */
#define CHUNK 64          /* steps per chunk */
#define ROWS_MAX 48       /* rows whose sums one thread holds per panel (48 x 64 floats, 12 KB) */

enum { F32 = 0, BF16 = 1 };

/* A tile function: sums (+)= a tile of rows of x times `steps` steps of a panel (or half panel),
 * defined per instruction set below as TILE(NAME, rows, width, how); TILES makes one for each
 * row count, by [whole panel or half][rows]. */
typedef void (*tile_fn)(const char *x, int64_t ldx, const char *panel, int64_t steps, float *sums, int first);
#define TILES(PREFIX, HOW)                                                                         \
    TILE(PREFIX##_1, 1, 4, HOW) TILE(PREFIX##_2, 2, 4, HOW) TILE(PREFIX##_3, 3, 4, HOW)            \
    TILE(PREFIX##_4, 4, 4, HOW) TILE(PREFIX##_5, 5, 4, HOW) TILE(PREFIX##_6, 6, 4, HOW)            \
    TILE(PREFIX##_h1, 1, 2, HOW) TILE(PREFIX##_h2, 2, 2, HOW) TILE(PREFIX##_h3, 3, 2, HOW)         \
    TILE(PREFIX##_h4, 4, 2, HOW) TILE(PREFIX##_h5, 5, 2, HOW) TILE(PREFIX##_h6, 6, 2, HOW)         \
    static const tile_fn PREFIX##_TILES[2][ROWS + 1] = {                                           \
        {0, PREFIX##_1, PREFIX##_2, PREFIX##_3, PREFIX##_4, PREFIX##_5, PREFIX##_6},               \
        {0, PREFIX##_h1, PREFIX##_h2, PREFIX##_h3, PREFIX##_h4, PREFIX##_h5, PREFIX##_h6}};

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512i broadcast_word(const char *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return _mm512_set1_epi32(word);
}

#define FMA_F32(acc, a, w) _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(w), acc)
#define DOT_BF16(acc, a, w) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(w))

/* sums[r][16j..16j+15] (+)= rows r < R of x times `steps` steps of NV vectors (NV x 16 columns,
 * one cache line each) of a panel: set on the first chunk, added to after. x rows are ldx bytes
 * apart. */
#define TILE(NAME, R, NV, MULADD)                                                                  \
    static void NAME(const char *x, int64_t ldx, const char *panel, int64_t steps, float *sums,     \
                     int first) {                                                                  \
        __m512 acc[R][NV];                                                                         \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < NV; j++)                                                           \
                acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * PANEL + 16 * j); \
        for (int64_t i = 0; i < steps; i++) {                                                      \
            const char *w = panel + i * STEP_BYTES;                                                \
            __m512i wv[NV];                                                                        \
            for (int j = 0; j < NV; j++) {                                                         \
                _mm_prefetch(w + CHUNK * STEP_BYTES + 64 * j, _MM_HINT_T0);                        \
                wv[j] = _mm512_loadu_si512(w + 64 * j);                                            \
            }                                                                                      \
            for (int r = 0; r < R; r++) {                                                          \
                __m512i a = broadcast_word(x + r * ldx + 4 * i);                                   \
                for (int j = 0; j < NV; j++)                                                       \
                    acc[r][j] = MULADD(acc[r][j], a, wv[j]);                                       \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < NV; j++)                                                           \
                _mm512_storeu_ps(sums + r * PANEL + 16 * j, acc[r][j]);                            \
    }

TILES(f32, FMA_F32)
#if defined(__AVX512BF16__)
TILES(bf16, DOT_BF16)
#else
static const tile_fn bf16_TILES[2][ROWS + 1] = {{0}};
#endif

static inline __mmask16 first_lanes(int cols) {
    return cols >= 16 ? (__mmask16)0xFFFF : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
}

/* One row's sums (+ bias) written to y's columns [0, cols), rounded to y's dtype. */
static void store_row(const float *sums, const void *bias, void *y, int cols, int dtype) {
    for (int j = 0; j < (cols + 15) / 16; j++) {
        __mmask16 m = first_lanes(cols - 16 * j);
        __m512 v = _mm512_loadu_ps(sums + 16 * j);
        if (dtype == F32) {
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, (const float *)bias + 16 * j));
            _mm512_mask_storeu_ps((float *)y + 16 * j, m, v);
        } else {
#if defined(__AVX512BF16__)
            if (bias) {
                __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)bias + 16 * j));
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
            }
            _mm256_mask_storeu_epi16((uint16_t *)y + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(v));
#endif
        }
    }
}

int linear_supports(int dtype) {
#if defined(__AVX512BF16__)
    return dtype == F32 || dtype == BF16;
#else
    return dtype == F32;
#endif
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* With 16 vector registers of 8 lanes, a register tile is 6 rows x 16 columns (12 sums, two
 * weight vectors and a broadcast), and a tile function walks its panel's (or half panel's) groups
 * of 16 columns one after another: 64 bytes of each 256-byte step in either dtype. There are no
 * bfloat16 dot products: a bfloat16 pair widens to two floats exactly (the even k by a shift, the
 * odd k by masking off the even half), and x's rows are widened to float32 a chunk at a time
 * (`columns`), so a step reads 8 bytes of each row. */
#define X_WIDENED_BF16 1

#define TILE(NAME, R, GROUPS, BF16)                                                                \
    static void NAME(const char *x, int64_t ldx, const char *panel, int64_t steps, float *sums,     \
                     int first) {                                                                  \
        const __m256i odd_half = _mm256_set1_epi32((int)0xFFFF0000u);                              \
        for (int g = 0; g < GROUPS; g++) {                                                         \
            __m256 acc[R][2];                                                                      \
            float *s = sums + 16 * g;                                                              \
            for (int r = 0; r < R; r++)                                                            \
                for (int j = 0; j < 2; j++)                                                        \
                    acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(s + r * PANEL + 8 * j); \
            for (int64_t i = 0; i < steps; i++) {                                                  \
                const char *w = panel + i * STEP_BYTES + 64 * g;                                   \
                _mm_prefetch(w + CHUNK * STEP_BYTES, _MM_HINT_T0);                                 \
                __m256i v0 = _mm256_loadu_si256((const __m256i *)w);                               \
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 32));                        \
                if (!BF16) {                                                                       \
                    __m256 w0 = _mm256_castsi256_ps(v0), w1 = _mm256_castsi256_ps(v1);             \
                    for (int r = 0; r < R; r++) {                                                  \
                        __m256 a = _mm256_broadcast_ss((const float *)(x + r * ldx + 4 * i));      \
                        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);                             \
                        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);                             \
                    }                                                                              \
                } else {                                                                           \
                    /* the even k of the step, then the odd: 15 live registers at a time */        \
                    __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));                    \
                    __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));                    \
                    for (int r = 0; r < R; r++) {                                                  \
                        __m256 a = _mm256_broadcast_ss((const float *)(x + r * ldx + 8 * i));      \
                        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);                             \
                        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);                             \
                    }                                                                              \
                    w0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd_half));                      \
                    w1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd_half));                      \
                    for (int r = 0; r < R; r++) {                                                  \
                        __m256 a = _mm256_broadcast_ss((const float *)(x + r * ldx + 8 * i + 4));  \
                        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);                             \
                        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);                             \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < R; r++)                                                            \
                for (int j = 0; j < 2; j++)                                                        \
                    _mm256_storeu_ps(s + r * PANEL + 8 * j, acc[r][j]);                            \
        }                                                                                          \
    }

TILES(f32, 0)
TILES(bf16, 1)

/* One row's sums (+ bias) written to y's columns [0, cols), rounded to y's dtype. */
static void store_row(const float *sums, const void *bias, void *y, int cols, int dtype) {
    if (dtype == F32) {
        for (int c = 0; c < cols; c++) ((float *)y)[c] = sums[c] + (bias ? ((const float *)bias)[c] : 0.0f);
    } else {
        for (int c = 0; c < cols; c++)
            ((uint16_t *)y)[c] = round_bf16(sums[c] + (bias ? widen_bf16(((const uint16_t *)bias)[c]) : 0.0f));
    }
}

int linear_supports(int dtype) { return dtype == F32 || dtype == BF16; }

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifndef X_WIDENED_BF16
#define X_WIDENED_BF16 0
#endif

/* Columns [first, first + cols) of y = x @ W.T (+ bias): one panel, or a half of one (vectors
 * 0-1 or 2-3 of each step, so the threads can split an odd number of panels evenly). */
static void columns(const char *x, int64_t m, int64_t k, int64_t steps, const char *panel, const tile_fn *tiles,
                    const char *bias, char *y, int64_t n, int64_t first, int cols, int dtype) {
    const int elem = dtype == F32 ? 4 : 2;
    float sums[ROWS_MAX * PANEL];
#if X_WIDENED_BF16
    float wide[ROWS_MAX * 2 * CHUNK]; /* a chunk's k of the rows, widened to float32 */
#endif
    for (int64_t r0 = 0; r0 < m; r0 += ROWS_MAX) {
        int64_t rows = m - r0 < ROWS_MAX ? m - r0 : ROWS_MAX;
        for (int64_t i0 = 0; i0 < steps; i0 += CHUNK) {
            int64_t chunk = steps - i0 < CHUNK ? steps - i0 : CHUNK, ldx = k * elem;
            const char *xs = x + r0 * ldx + 4 * i0;
#if X_WIDENED_BF16
            if (dtype == BF16) {
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t j = 0; j < 2 * chunk; j++)
                        wide[r * 2 * CHUNK + j] = widen_bf16(((const uint16_t *)(x + (r0 + r) * ldx))[2 * i0 + j]);
                xs = (const char *)wide, ldx = 8 * CHUNK;
            }
#endif
            for (int64_t r = 0; r < rows; r += ROWS)
                tiles[rows - r < ROWS ? rows - r : ROWS](xs + r * ldx, ldx, panel + i0 * STEP_BYTES, chunk,
                                                         sums + r * PANEL, i0 == 0);
        }
        for (int64_t r = 0; r < rows; r++)
            store_row(sums + r * PANEL, bias ? bias + first * elem : 0, y + ((r0 + r) * n + first) * elem, cols, dtype);
    }
}

/* x [m, k] (rows contiguous), packed W (see the top), bias [n] or NULL -> y [m, n]. */
void linear(const void *x, int64_t m, int64_t k, const void *packed, const void *bias, void *y, int64_t n,
            int dtype, int threads) {
    const int64_t steps = dtype == F32 ? k : k / 2, halves = 2 * ((n + PANEL - 1) / PANEL);
    const tile_fn(*tiles)[ROWS + 1] = dtype == F32 ? f32_TILES : bf16_TILES;
#pragma omp parallel num_threads(threads)
    {
        /* Each thread takes a run of half panels, whole panels where the run allows. */
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t h = halves * t / nt, end = halves * (t + 1) / nt;
        while (h < end) {
            int half = h % 2 || h + 1 == end;
            int64_t first = h / 2 * PANEL + (h % 2) * PANEL / 2;
            int64_t cols = n - first < (half ? PANEL / 2 : PANEL) ? n - first : (half ? PANEL / 2 : PANEL);
            const char *panel = (const char *)packed + h / 2 * steps * STEP_BYTES + (h % 2) * STEP_BYTES / 2;
            if (cols > 0)
                columns((const char *)x, m, k, steps, panel, tiles[half], (const char *)bias, (char *)y, n, first,
                        (int)cols, dtype);
            h += half ? 1 : 2;
        }
    }
}

#else
int linear_supports(int dtype) { (void)dtype; return 0; }
void linear(const void *x, int64_t m, int64_t k, const void *packed, const void *bias, void *y, int64_t n,
            int dtype, int threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)bias; (void)y; (void)n; (void)dtype; (void)threads;
}
#endif
