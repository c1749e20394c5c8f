/* y = x @ W.T on CPU with W kept quantized: the weight formats of GGUF files (Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and pagedserve's own int8 / int4, repacked once at load
 * (models/quantized.py) into one layout this file streams.
 *
 * Every format is "codes of `bits` bits in groups of `group` consecutive k, with a scale and
 * optionally a min per group and output column": w = q * scale + min. For every format above that
 * product and sum are exact in float32 but for the sum's one rounding, which a fused multiply-add
 * also makes: the weights used here are bit for bit the ones gguf-py's dequantizers return.
 * 8-bit codes are signed and have no min; 4-, 5- and 6-bit codes are unsigned.
 *
 * Layout: output columns in panels of 16; a panel is a run of tiles, one per group, each
 *   [16 scales][16 mins, if any][group x the 16 columns' codes of one k]
 * with scales and mins float16 (where the format's values are float16, as Q4_1's) or float32 (the
 * K-quants, whose scales are products). One k's codes for 16 columns: 16 int8 (8 bits); 8 bytes,
 * byte j holding column j in its low nibble and column j + 8 in its high one, so that one widening
 * load and a mask or a shift give each half (4 bits); those 8 bytes and a 16-bit word of each
 * column's fifth bit (5 bits) or a 32-bit word of its two high bits at bits 2c (6 bits).
 *
 * Few rows (decode): each weight is dequantized in registers once per tile of up to 4 rows of x,
 * so a step reads every weight byte once. More rows: a thread dequantizes a panel into a float32
 * buffer once per block of rows, then multiplies it in 6-row tiles as csrc/linear.c does. Both
 * accumulate every output in the same order (k ascending, one fused multiply-add each), so a row's
 * result does not depend on how many rows share the call: batch invariance.
 * Activations are float32 or bfloat16 (widened to float32 once per call); sums are float32.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define COLS 16        /* output columns per panel */
#define REG_ROWS 4     /* rows per call dequantized in registers; more go through a panel buffer */
#define BLOCK_ROWS 64  /* rows per pass over a dequantized panel */

enum { F32 = 0, BF16 = 1 };

static inline int code_bytes(int bits) { return bits == 8 ? 16 : bits == 4 ? 8 : bits == 5 ? 10 : 12; }
static inline int64_t header_bytes(int scale_f16, int has_min) { return COLS * (scale_f16 ? 2 : 4) * (1 + has_min); }
static inline int64_t tile_bytes(int bits, int group, int scale_f16, int has_min) {
    return header_bytes(scale_f16, has_min) + (int64_t)group * code_bytes(bits);
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FF) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Column c's code for one k (`p`: that k's codes). */
static inline int code_at(const uint8_t *p, int bits, int c) {
    if (bits == 8) return (int8_t)p[c];
    int q = (p[c % 8] >> (4 * (c / 8))) & 15;
    if (bits == 5) q |= ((load_u16(p + 8) >> c) & 1) << 4;
    if (bits == 6) q |= ((load_u32(p + 8) >> (2 * c)) & 3) << 4;
    return q;
}

/* Column c's scale and min in a tile. */
static inline void scale_at(const uint8_t *tile, int scale_f16, int has_min, int c, float *s, float *m) {
    if (scale_f16) {
        *s = half_to_float(load_u16(tile + 2 * c));
        *m = has_min ? half_to_float(load_u16(tile + 2 * COLS + 2 * c)) : 0.0f;
    } else {
        memcpy(s, tile + 4 * c, 4);
        if (has_min) memcpy(m, tile + 4 * COLS + 4 * c, 4);
        else *m = 0.0f;
    }
}

/* x's rows as float32: x itself, or a widened copy (`owned`, freed by the caller). */
static const float *float_rows(const void *x, int64_t count, int dtype, float **owned) {
    *owned = NULL;
    if (dtype == F32) return (const float *)x;
    float *wide = malloc((size_t)count * sizeof(float));
    if (!wide) return NULL;
    for (int64_t i = 0; i < count; i++) wide[i] = widen_bf16(((const uint16_t *)x)[i]);
    return *owned = wide;
}

/* One row's 16 sums written to y's columns [0, cols). */
static inline void store_row(const float *sums, void *y, int cols, int dtype) {
    if (dtype == F32) memcpy(y, sums, (size_t)cols * sizeof(float));
    else for (int c = 0; c < cols; c++) ((uint16_t *)y)[c] = round_bf16(sums[c]);
}

/* The dequantized weights of one panel, [k][16] floats. */
static void dequantize_panel(const uint8_t *panel, int64_t groups, int bits, int group, int scale_f16, int has_min,
                             float *out);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The 16 columns' codes of one k as int32 lanes: columns 0-7 in q[0], 8-15 in q[1]. */
static inline void codes16(const uint8_t *p, const int bits, __m256i q[2]) {
    if (bits == 8) {
        q[0] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
        q[1] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
        return;
    }
    const __m256i both = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), low = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(both, low);
    q[1] = _mm256_srli_epi32(both, 4);
    if (bits == 5) {
        const __m256i high = _mm256_set1_epi32(load_u16(p + 8)), one = _mm256_set1_epi32(1);
        const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at8 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
        q[0] = _mm256_or_si256(q[0], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, at), one), 4));
        q[1] = _mm256_or_si256(q[1], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, at8), one), 4));
    } else if (bits == 6) {
        const __m256i high = _mm256_set1_epi32((int)load_u32(p + 8)), three = _mm256_set1_epi32(3);
        const __m256i at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i at8 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
        q[0] = _mm256_or_si256(q[0], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, at), three), 4));
        q[1] = _mm256_or_si256(q[1], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(high, at8), three), 4));
    }
}

static inline void load_scales(const uint8_t *tile, const int scale_f16, const int has_min, __m256 s[2],
                               __m256 m[2]) {
    for (int h = 0; h < 2; h++) {
        if (scale_f16) {
            s[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * h)));
            m[h] = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 2 * COLS + 16 * h)))
                           : _mm256_setzero_ps();
        } else {
            s[h] = _mm256_loadu_ps((const float *)tile + 8 * h);
            m[h] = has_min ? _mm256_loadu_ps((const float *)tile + COLS + 8 * h) : _mm256_setzero_ps();
        }
    }
}

/* w = q * scale (+ min) for the 16 columns of one k: columns 0-7 in w[0], 8-15 in w[1]. */
static inline void weights16(const uint8_t *p, const int bits, const __m256 s[2], const __m256 m[2], const int has_min,
                             __m256 w[2]) {
    __m256i q[2];
    codes16(p, bits, q);
    for (int h = 0; h < 2; h++) {
        __m256 f = _mm256_cvtepi32_ps(q[h]);
        w[h] = has_min ? _mm256_fmadd_ps(f, s[h], m[h]) : _mm256_mul_ps(f, s[h]);
    }
}

/* Every output is summed in four chains, one per k mod 4 (each k ascending), added at the end as
 * (S0 + S1) + (S2 + S3): one chain would wait on the multiply-add's latency at a row or two. Every
 * path (the tiles below, the portable one) sums in exactly this order, so that a row's result does
 * not depend on how many rows share the call. A tile that cannot hold all four chains in
 * registers makes a pass per chain (or pair of chains) over its panel, which stays in cache. */
#define CHAINS 4

/* Register tiles of up to 6 rows x 16 columns: named sums (c<row>0, c<row>1, and d, e, f for more
 * chains of rows 0-1), since gcc keeps an array of sums on the stack through the loop. */
#define SUMS_DECLARE                                                                                       \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,   \
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, d00 = c00, d01 = c00, d10 = c00,         \
           d11 = c00, e00 = c00, e01 = c00, f00 = c00, f01 = c00;                                          \
    (void)c10, (void)c11, (void)c20, (void)c21, (void)c30, (void)c31, (void)c40, (void)c41, (void)c50, (void)c51; \
    (void)d00, (void)d01, (void)d10, (void)d11, (void)e00, (void)e01, (void)f00, (void)f01;
#define ROW_FMA(R, c, r, X)                                                                                \
    if (R > r) {                                                                                           \
        __m256 a = _mm256_broadcast_ss(X);                                                                 \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                                         \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                                         \
    }
#define ROWS_FMA(R, c, x, ldx, i)                                                                          \
    ROW_FMA(R, c, 0, x + (i)) ROW_FMA(R, c, 1, x + ldx + (i)) ROW_FMA(R, c, 2, x + 2 * ldx + (i))          \
    ROW_FMA(R, c, 3, x + 3 * ldx + (i)) ROW_FMA(R, c, 4, x + 4 * ldx + (i)) ROW_FMA(R, c, 5, x + 5 * ldx + (i))
#define ROW_STORE(R, c, r, sums)                                                                           \
    if (R > r) {                                                                                           \
        _mm256_storeu_ps((sums) + r * COLS, c##r##0);                                                      \
        _mm256_storeu_ps((sums) + r * COLS + 8, c##r##1);                                                  \
    }
#define SUMS_STORE(R, c, sums)                                                                             \
    ROW_STORE(R, c, 0, sums) ROW_STORE(R, c, 1, sums) ROW_STORE(R, c, 2, sums) ROW_STORE(R, c, 3, sums)   \
    ROW_STORE(R, c, 4, sums) ROW_STORE(R, c, 5, sums)

/* sums = (chain 0 + chain 1) + (chain 2 + chain 3), chain j at chains + j * stride. */
static inline void add_chains(const float *chains, int64_t stride, int count, float *sums) {
    for (int j = 0; j < count; j += 8) {
        __m256 a = _mm256_add_ps(_mm256_loadu_ps(chains + j), _mm256_loadu_ps(chains + stride + j));
        __m256 b = _mm256_add_ps(_mm256_loadu_ps(chains + 2 * stride + j), _mm256_loadu_ps(chains + 3 * stride + j));
        _mm256_storeu_ps(sums + j, _mm256_add_ps(a, b));
    }
}

/* The weights of k = i of the group's tile t into w0, w1. */
#define DEQUANTIZE_K(BITS, MIN, i)                                                                         \
    weights16(t + header + (i) * code_bytes(BITS), BITS, s, m, MIN, w);                                    \
    w0 = w[0], w1 = w[1];
#define PANEL_START(BITS, MIN)                                                                             \
    const int64_t tile = tile_bytes(BITS, group, scale_f16, MIN), header = header_bytes(scale_f16, MIN);    \
    (void)header;
#define GROUP_START(MIN)                                                                                   \
    const uint8_t *t = panel + g * tile;                                                                   \
    const float *xg = x + g * group;                                                                       \
    __m256 s[2], m[2], w[2], w0, w1;                                                                       \
    load_scales(t, scale_f16, MIN, s, m);

/* sums[r][16] = x[r] . W's panel for R rows, the weights dequantized in registers: one row holds
 * its four chains in registers in one pass, two rows two chains per pass, more rows one. */
#define IN_REGISTERS_1(BITS, MIN)                                                                           \
    static void in_registers_##BITS##_1_##MIN(const float *x, int64_t ldx, const uint8_t *panel,              \
                                             int64_t groups, int group, int scale_f16, float *sums) {        \
        (void)ldx;                                                                                          \
        PANEL_START(BITS, MIN)                                                                              \
        SUMS_DECLARE                                                                                        \
        for (int64_t g = 0; g < groups; g++) {                                                              \
            GROUP_START(MIN)                                                                                \
            for (int i = 0; i < group; i += CHAINS) {                                                       \
                DEQUANTIZE_K(BITS, MIN, i) ROW_FMA(1, c, 0, xg + i)                                         \
                DEQUANTIZE_K(BITS, MIN, i + 1) ROW_FMA(1, d, 0, xg + i + 1)                                 \
                DEQUANTIZE_K(BITS, MIN, i + 2) ROW_FMA(1, e, 0, xg + i + 2)                                 \
                DEQUANTIZE_K(BITS, MIN, i + 3) ROW_FMA(1, f, 0, xg + i + 3)                                 \
            }                                                                                               \
        }                                                                                                   \
        c00 = _mm256_add_ps(_mm256_add_ps(c00, d00), _mm256_add_ps(e00, f00));                              \
        c01 = _mm256_add_ps(_mm256_add_ps(c01, d01), _mm256_add_ps(e01, f01));                              \
        SUMS_STORE(1, c, sums)                                                                              \
    }
#define IN_REGISTERS_2(BITS, MIN)                                                                           \
    static void in_registers_##BITS##_2_##MIN(const float *x, int64_t ldx, const uint8_t *panel,              \
                                             int64_t groups, int group, int scale_f16, float *sums) {        \
        PANEL_START(BITS, MIN)                                                                              \
        float chains[CHAINS][2 * COLS];                                                                     \
        for (int chain = 0; chain < 2; chain++) { /* chains `chain` and `chain` + 2 */                      \
            SUMS_DECLARE                                                                                    \
            for (int64_t g = 0; g < groups; g++) {                                                          \
                GROUP_START(MIN)                                                                            \
                for (int i = chain; i < group; i += CHAINS) {                                               \
                    DEQUANTIZE_K(BITS, MIN, i) ROW_FMA(2, c, 0, xg + i) ROW_FMA(2, c, 1, xg + ldx + i)      \
                    DEQUANTIZE_K(BITS, MIN, i + 2) ROW_FMA(2, d, 0, xg + i + 2) ROW_FMA(2, d, 1, xg + ldx + i + 2) \
                }                                                                                           \
            }                                                                                               \
            ROW_STORE(2, c, 0, chains[chain]) ROW_STORE(2, c, 1, chains[chain])                             \
            ROW_STORE(2, d, 0, chains[chain + 2]) ROW_STORE(2, d, 1, chains[chain + 2])                     \
        }                                                                                                   \
        add_chains(chains[0], 2 * COLS, 2 * COLS, sums);                                                    \
    }
#define IN_REGISTERS_N(BITS, R, MIN)                                                                        \
    static void in_registers_##BITS##_##R##_##MIN(const float *x, int64_t ldx, const uint8_t *panel,          \
                                                 int64_t groups, int group, int scale_f16, float *sums) {    \
        PANEL_START(BITS, MIN)                                                                              \
        float chains[CHAINS][R * COLS];                                                                     \
        for (int chain = 0; chain < CHAINS; chain++) {                                                      \
            SUMS_DECLARE                                                                                    \
            for (int64_t g = 0; g < groups; g++) {                                                          \
                GROUP_START(MIN)                                                                            \
                for (int i = chain; i < group; i += CHAINS) {                                               \
                    DEQUANTIZE_K(BITS, MIN, i) ROWS_FMA(R, c, xg, ldx, i)                                   \
                }                                                                                           \
            }                                                                                               \
            SUMS_STORE(R, c, chains[chain])                                                                 \
        }                                                                                                   \
        add_chains(chains[0], R * COLS, R * COLS, sums);                                                    \
    }
#define IN_REGISTERS_ROWS(BITS, MIN) \
    IN_REGISTERS_1(BITS, MIN) IN_REGISTERS_2(BITS, MIN) IN_REGISTERS_N(BITS, 3, MIN) IN_REGISTERS_N(BITS, 4, MIN)
IN_REGISTERS_ROWS(4, 1)
IN_REGISTERS_ROWS(5, 1)
IN_REGISTERS_ROWS(6, 1)
IN_REGISTERS_ROWS(8, 0)

/* 4-, 5- and 6-bit codes have mins, 8-bit ones none (models/quantized.py makes no other kinds). */
typedef void in_registers_fn(const float *, int64_t, const uint8_t *, int64_t, int, int, float *);
static in_registers_fn *in_registers(int bits, int rows) {
    static in_registers_fn *const table[4][REG_ROWS] = {
        {in_registers_4_1_1, in_registers_4_2_1, in_registers_4_3_1, in_registers_4_4_1},
        {in_registers_5_1_1, in_registers_5_2_1, in_registers_5_3_1, in_registers_5_4_1},
        {in_registers_6_1_1, in_registers_6_2_1, in_registers_6_3_1, in_registers_6_4_1},
        {in_registers_8_1_0, in_registers_8_2_0, in_registers_8_3_0, in_registers_8_4_0}};
    return table[bits == 4 ? 0 : bits == 5 ? 1 : bits == 6 ? 2 : 3][rows - 1];
}

static inline __attribute__((always_inline)) void dequantize_panel_bits(
    const uint8_t *panel, int64_t groups, const int bits, int group, int scale_f16, const int has_min, float *out) {
    const int64_t tile = tile_bytes(bits, group, scale_f16, has_min), header = header_bytes(scale_f16, has_min);
    const int cb = code_bytes(bits);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *t = panel + g * tile;
        __m256 s[2], m[2];
        load_scales(t, scale_f16, has_min, s, m);
        for (int i = 0; i < group; i++) {
            const uint8_t *p = t + header + i * cb;
            float *o = out + (g * group + i) * COLS;
            __m256 w[2];
            weights16(p, bits, s, m, has_min, w);
            _mm256_storeu_ps(o, w[0]);
            _mm256_storeu_ps(o + 8, w[1]);
        }
    }
}

static void dequantize_panel(const uint8_t *panel, int64_t groups, int bits, int group, int scale_f16, int has_min,
                             float *out) {
#define DEQUANTIZE(B)                                                                                      \
    if (bits == B) {                                                                                       \
        if (has_min) dequantize_panel_bits(panel, groups, B, group, scale_f16, 1, out);                    \
        else dequantize_panel_bits(panel, groups, B, group, scale_f16, 0, out);                            \
        return;                                                                                            \
    }
    DEQUANTIZE(4) DEQUANTIZE(5) DEQUANTIZE(6) DEQUANTIZE(8)
#undef DEQUANTIZE
}

/* sums[r][16] = x[r] . panel for R <= 6 rows, from a dequantized panel [k][16]: a pass per chain. */
#define DENSE(R)                                                                                            \
    static void dense_##R(const float *x, int64_t ldx, const float *w, int64_t k, float *sums) {            \
        float chains[CHAINS][6 * COLS];                                                                     \
        for (int chain = 0; chain < CHAINS; chain++) {                                                      \
            SUMS_DECLARE                                                                                    \
            for (int64_t i = chain; i < k; i += CHAINS) {                                                   \
                __m256 w0 = _mm256_loadu_ps(w + i * COLS), w1 = _mm256_loadu_ps(w + i * COLS + 8);          \
                ROWS_FMA(R, c, x, ldx, i)                                                                   \
            }                                                                                               \
            SUMS_STORE(R, c, chains[chain])                                                                 \
        }                                                                                                   \
        add_chains(chains[0], 6 * COLS, R * COLS, sums);                                                    \
    }
DENSE(1) DENSE(2) DENSE(3) DENSE(4) DENSE(5) DENSE(6)
typedef void dense_fn(const float *, int64_t, const float *, int64_t, float *);
static dense_fn *const DENSE_TILES[7] = {0, dense_1, dense_2, dense_3, dense_4, dense_5, dense_6};
#define DENSE_ROWS 6

int quant_linear_simd(void) { return 1; }

#else /* portable C: the same arithmetic, one column at a time */

static void dequantize_panel(const uint8_t *panel, int64_t groups, int bits, int group, int scale_f16, int has_min,
                             float *out) {
    const int64_t tile = tile_bytes(bits, group, scale_f16, has_min), header = header_bytes(scale_f16, has_min);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *t = panel + g * tile;
        for (int c = 0; c < COLS; c++) {
            float s, m;
            scale_at(t, scale_f16, has_min, c, &s, &m);
            for (int i = 0; i < group; i++)
                out[(g * group + i) * COLS + c] = (float)code_at(t + header + i * code_bytes(bits), bits, c) * s + m;
        }
    }
}

static void dense_any(const float *x, int64_t ldx, const float *w, int64_t k, int rows, float *sums) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COLS; c++) {
            float chain[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* the SIMD paths' four chains, in their order */
            for (int64_t i = 0; i < k; i++) chain[i % 4] += x[r * ldx + i] * w[i * COLS + c];
            sums[r * COLS + c] = (chain[0] + chain[1]) + (chain[2] + chain[3]);
        }
}
#define DENSE_ROWS 6

int quant_linear_simd(void) { return 0; }
#endif

/* y [rows, n] (row stride ldy elements, y's dtype = x's) = x [rows, k] @ W.T, W given as its
 * panels of tiles (see the top of this file). Threads split the panels. */
void quant_linear(const void *x_in, int64_t rows, int64_t k, const void *tiles, int64_t n, void *y, int64_t ldy,
                  int bits, int group, int scale_f16, int has_min, int dtype, int threads) {
    float *owned;
    const float *x = float_rows(x_in, rows * k, dtype, &owned);
    if (!x) return;
    const int64_t groups = k / group, panels = (n + COLS - 1) / COLS;
    const int64_t panel_bytes = groups * tile_bytes(bits, group, scale_f16, has_min);
    const size_t out_size = dtype == F32 ? 4 : 2;
    const int buffered = rows > REG_ROWS;
    const int team = (int)(panels < threads ? panels : threads);
#pragma omp parallel num_threads(team > 0 ? team : 1)
    {
        const int t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = panels * t / count, last = panels * (t + 1) / count;
        float sums[DENSE_ROWS * COLS];
        float *w = buffered ? aligned_alloc(64, (size_t)k * COLS * sizeof(float)) : NULL;
        if (!buffered || w) {
            for (int64_t r0 = 0; r0 < rows; r0 += buffered ? BLOCK_ROWS : rows) {
                const int64_t block = buffered ? (rows - r0 < BLOCK_ROWS ? rows - r0 : BLOCK_ROWS) : rows;
                for (int64_t p = first; p < last; p++) {
                    const uint8_t *panel = (const uint8_t *)tiles + p * panel_bytes;
                    const int cols = (int)(n - p * COLS < COLS ? n - p * COLS : COLS);
                    if (buffered) dequantize_panel(panel, groups, bits, group, scale_f16, has_min, w);
                    for (int64_t r = r0; r < r0 + block;) {
                        int tile_rows;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
                        if (buffered) {
                            tile_rows = (int)(r0 + block - r < DENSE_ROWS ? r0 + block - r : DENSE_ROWS);
                            DENSE_TILES[tile_rows](x + r * k, k, w, k, sums);
                        } else {
                            tile_rows = (int)(rows - r < REG_ROWS ? rows - r : REG_ROWS);
                            in_registers(bits, tile_rows)(x + r * k, k, panel, groups, group, scale_f16, sums);
                        }
#else
                        if (!buffered) dequantize_panel(panel, groups, bits, group, scale_f16, has_min,
                                                        w ? w : (w = malloc((size_t)k * COLS * sizeof(float))));
                        if (!w) break;
                        tile_rows = (int)(r0 + block - r < DENSE_ROWS ? r0 + block - r : DENSE_ROWS);
                        dense_any(x + r * k, k, w, k, tile_rows, sums);
#endif
                        for (int i = 0; i < tile_rows; i++)
                            store_row(sums + i * COLS, (char *)y + ((r + i) * ldy + p * COLS) * out_size, cols, dtype);
                        r += tile_rows;
                    }
                }
            }
        }
        free(w);
    }
    free(owned);
}

/* out[i] = row ids[i] of W (its output column), dequantized to out's dtype: the rows of a quantized
 * embedding table. -1 if an id is outside [0, n). */
int quant_rows(const void *tiles, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out, int bits,
               int group, int scale_f16, int has_min, int dtype, int threads) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    const int64_t groups = k / group, tile = tile_bytes(bits, group, scale_f16, has_min);
    const int64_t header = header_bytes(scale_f16, has_min), panel_bytes = groups * tile;
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        const int c = (int)(ids[i] % COLS);
        const uint8_t *panel = (const uint8_t *)tiles + ids[i] / COLS * panel_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *t = panel + g * tile;
            float s, m;
            scale_at(t, scale_f16, has_min, c, &s, &m);
            for (int j = 0; j < group; j++) {
                int64_t at = i * k + g * group + j;
                float v = (float)code_at(t + header + j * code_bytes(bits), bits, c) * s + m;
                if (dtype == F32) ((float *)out)[at] = v;
                else ((uint16_t *)out)[at] = round_bf16(v);
            }
        }
    }
    return 0;
}
