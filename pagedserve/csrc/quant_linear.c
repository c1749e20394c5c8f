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
 * K-quants, whose scales are products). One k's codes for 16 columns: 16 int8 (8 bits); two
 * little-endian 32-bit words of eight nibbles, column c at bits 4(c % 8) of word c / 8 (4 bits);
 * those 8 bytes and a 16-bit word of each column's fifth bit (5 bits) or a 32-bit word of its two
 * high bits at bits 2c (6 bits).
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

static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch converts float32 to bfloat16 (a NaN stays a quiet NaN). */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Column c's code for one k (`p`: that k's codes). */
static inline int code_at(const uint8_t *p, int bits, int c) {
    if (bits == 8) return (int8_t)p[c];
    int q = (load_u32(p + 4 * (c / 8)) >> (4 * (c % 8))) & 15;
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

/* 8 columns' codes (columns 8h .. 8h+7) of one k as int32 lanes. */
static inline __m256i codes8(const uint8_t *p, const int bits, const int h) {
    if (bits == 8) return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
    const __m256i nibble = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(p + 4 * h)), nibble),
                                 _mm256_set1_epi32(15));
    if (bits == 5) {
        const __m256i bit = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(load_u16(p + 8) >> (8 * h)), bit);
        q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), 4));
    } else if (bits == 6) {
        const __m256i pair = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32((int)(load_u32(p + 8) >> (16 * h))), pair);
        q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    }
    return q;
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

/* w = q * scale (+ min) for 8 columns. */
static inline __m256 weights8(const uint8_t *p, const int bits, const int h, __m256 s, __m256 m, const int has_min) {
    __m256 q = _mm256_cvtepi32_ps(codes8(p, bits, h));
    return has_min ? _mm256_fmadd_ps(q, s, m) : _mm256_mul_ps(q, s);
}

/* y[r][panel's columns] = x[r] . W for R rows, the weights dequantized in registers. */
static inline __attribute__((always_inline)) void panel_in_registers(
    const float *x, int64_t ldx, const uint8_t *panel, int64_t groups, const int bits, const int group,
    const int scale_f16, const int has_min, const int R, float *sums) {
    const int64_t tile = tile_bytes(bits, group, scale_f16, has_min), header = header_bytes(scale_f16, has_min);
    const int cb = code_bytes(bits);
    __m256 acc[REG_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *t = panel + g * tile;
        __m256 s[2], m[2];
        load_scales(t, scale_f16, has_min, s, m);
        const float *xg = x + g * group;
        for (int i = 0; i < group; i++) {
            const uint8_t *p = t + header + i * cb;
            __m256 w0 = weights8(p, bits, 0, s[0], m[0], has_min), w1 = weights8(p, bits, 1, s[1], m[1], has_min);
            for (int r = 0; r < R; r++) {
                __m256 a = _mm256_broadcast_ss(xg + r * ldx + i);
                acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(sums + r * COLS, acc[r][0]);
        _mm256_storeu_ps(sums + r * COLS + 8, acc[r][1]);
    }
}

#define IN_REGISTERS(BITS, R)                                                                              \
    static void in_registers_##BITS##_##R(const float *x, int64_t ldx, const uint8_t *panel, int64_t groups,  \
                                          int group, int scale_f16, int has_min, float *sums) {           \
        if (has_min)                                                                                       \
            panel_in_registers(x, ldx, panel, groups, BITS, group, scale_f16, 1, R, sums);                 \
        else                                                                                               \
            panel_in_registers(x, ldx, panel, groups, BITS, group, scale_f16, 0, R, sums);                 \
    }
#define IN_REGISTERS_ROWS(BITS) IN_REGISTERS(BITS, 1) IN_REGISTERS(BITS, 2) IN_REGISTERS(BITS, 3) IN_REGISTERS(BITS, 4)
IN_REGISTERS_ROWS(4)
IN_REGISTERS_ROWS(5)
IN_REGISTERS_ROWS(6)
IN_REGISTERS_ROWS(8)

typedef void in_registers_fn(const float *, int64_t, const uint8_t *, int64_t, int, int, int, float *);
static in_registers_fn *in_registers(int bits, int rows) {
    static in_registers_fn *const table[4][REG_ROWS] = {
        {in_registers_4_1, in_registers_4_2, in_registers_4_3, in_registers_4_4},
        {in_registers_5_1, in_registers_5_2, in_registers_5_3, in_registers_5_4},
        {in_registers_6_1, in_registers_6_2, in_registers_6_3, in_registers_6_4},
        {in_registers_8_1, in_registers_8_2, in_registers_8_3, in_registers_8_4}};
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
            _mm256_storeu_ps(o, weights8(p, bits, 0, s[0], m[0], has_min));
            _mm256_storeu_ps(o + 8, weights8(p, bits, 1, s[1], m[1], has_min));
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

/* sums[r][16] = x[r] . panel for R <= 6 rows, from a dequantized panel [k][16]. */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t ldx, const float *w, int64_t k,
                                                             const int R, float *sums) {
    __m256 acc[6][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 w0 = _mm256_loadu_ps(w + i * COLS), w1 = _mm256_loadu_ps(w + i * COLS + 8);
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(sums + r * COLS, acc[r][0]);
        _mm256_storeu_ps(sums + r * COLS + 8, acc[r][1]);
    }
}

#define DENSE(R) \
    static void dense_##R(const float *x, int64_t ldx, const float *w, int64_t k, float *s) { dense_tile(x, ldx, w, k, R, s); }
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
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc += x[r * ldx + i] * w[i * COLS + c];
            sums[r * COLS + c] = acc;
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
                            in_registers(bits, tile_rows)(x + r * k, k, panel, groups, group, scale_f16, has_min, sums);
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
