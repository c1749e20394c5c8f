/* Replays a recorded decode forward: the C kernel calls of one forward pass of the model, in order,
 * with the arguments they were recorded with, except the row count (the step's number of
 * requests), which each replay sets. One call from Python runs the whole forward, where the eager
 * forward makes ~400 calls through ctypes and torch (pagedserve/worker/cpu_graphs.py says why and
 * records the calls; its KINDS lists the kernels this file runs).
 *
 * A call's integer and pointer arguments are in `ints`, its float ones in `floats`, each in the
 * order of the kernel's parameters; `fn` is the kernel, from the library that defines it.
 */
#include <stdint.h>
#include <string.h>

enum { LINEAR, RMS_NORM, ACT_AND_MUL, ROTARY, DECODE_ATTENTION, GATHER_ROWS, SCATTER_ROWS, QUANT_LINEAR, QUANT_ROWS,
       LORA_ADD, GATHER_SCALED_ROWS };
#define MAX_INTS 20
#define MAX_FLOATS 3

typedef struct {
    int64_t kind, rows_at; /* which kernel; which of `ints` is the row count */
    void *fn;
    int64_t ints[MAX_INTS];
    float floats[MAX_FLOATS];
} call_t;

typedef void linear_fn(const void *, int64_t, int64_t, const void *, const void *, void *, int64_t, int, int);
typedef void rms_norm_fn(const void *, void *, const void *, void *, int64_t, int64_t, float, int64_t, int64_t, int, int,
                         int);
typedef void act_and_mul_fn(const void *, void *, int64_t, int64_t, int, int, int);
typedef void rotary_fn(void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t, int, int);
typedef int decode_attention_fn(const void *, const void *, const void *, void *, const int64_t *, const int64_t *,
                                const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                float, int64_t, int, int, float, float, int, const float *);
typedef int gather_rows_fn(const void *, int64_t, const int64_t *, void *, int64_t, int64_t, int);
typedef int scatter_rows_fn(const void *, int64_t, const int64_t *, void *, int64_t, int64_t, int64_t, int);
typedef int gather_scaled_rows_fn(const void *, int64_t, const int64_t *, void *, int64_t, int64_t, float, int, int);
typedef void quant_linear_fn(const void *, int64_t, int64_t, const void *, int64_t, void *, int64_t, int, int, int, int,
                             int, int);
typedef int quant_rows_fn(const void *, int64_t, int64_t, const int64_t *, int64_t, void *, int, int, int, int, int,
                          int);
typedef int lora_add_fn(const void *, int64_t, int64_t, void *, int64_t, const int64_t *, int64_t, const void *,
                        const void *, const int64_t *, const int64_t *, int64_t, int64_t, int, int);

#define P(i) ((void *)a[i])

/* Run calls[0 .. count) with `rows` rows; 0, or 1 + the index of a call that failed. */
int64_t replay(const call_t *calls, int64_t count, int64_t rows)
{
    for (int64_t c = 0; c < count; c++) {
        const call_t *call = &calls[c];
        int64_t a[MAX_INTS];
        memcpy(a, call->ints, sizeof a);
        a[call->rows_at] = rows;
        const float *f = call->floats;
        switch (call->kind) {
        case LINEAR:
            ((linear_fn *)call->fn)(P(0), a[1], a[2], P(3), P(4), P(5), a[6], (int)a[7], (int)a[8]);
            break;
        case RMS_NORM:
            ((rms_norm_fn *)call->fn)(P(0), P(1), P(2), P(3), a[4], a[5], f[0], a[6], a[7], (int)a[8], (int)a[9],
                                      (int)a[10]);
            break;
        case ACT_AND_MUL:
            ((act_and_mul_fn *)call->fn)(P(0), P(1), a[2], a[3], (int)a[4], (int)a[5], (int)a[6]);
            break;
        case ROTARY:
            ((rotary_fn *)call->fn)(P(0), P(1), P(2), a[3], a[4], a[5], a[6], a[7], (int)a[8], (int)a[9]);
            break;
        case DECODE_ATTENTION:
            if (((decode_attention_fn *)call->fn)(P(0), P(1), P(2), P(3), P(4), P(5), P(6), a[7], a[8], a[9], a[10],
                                                  a[11], a[12], a[13], a[14], f[0], a[15], (int)a[16], (int)a[17], f[1],
                                                  f[2], (int)a[18], P(19)) != 0)
                return c + 1;
            break;
        case GATHER_ROWS:
            if (((gather_rows_fn *)call->fn)(P(0), a[1], P(2), P(3), a[4], a[5], (int)a[6]) != 0)
                return c + 1;
            break;
        case GATHER_SCALED_ROWS:
            if (((gather_scaled_rows_fn *)call->fn)(P(0), a[1], P(2), P(3), a[4], a[5], f[0], (int)a[6], (int)a[7]) != 0)
                return c + 1;
            break;
        case SCATTER_ROWS:
            if (((scatter_rows_fn *)call->fn)(P(0), a[1], P(2), P(3), a[4], a[5], a[6], (int)a[7]) != 0)
                return c + 1;
            break;
        case QUANT_LINEAR:
            ((quant_linear_fn *)call->fn)(P(0), a[1], a[2], P(3), a[4], P(5), a[6], (int)a[7], (int)a[8], (int)a[9],
                                          (int)a[10], (int)a[11], (int)a[12]);
            break;
        case QUANT_ROWS:
            if (((quant_rows_fn *)call->fn)(P(0), a[1], a[2], P(3), a[4], P(5), (int)a[6], (int)a[7], (int)a[8],
                                            (int)a[9], (int)a[10], (int)a[11]) != 0)
                return c + 1;
            break;
        case LORA_ADD:
            if (((lora_add_fn *)call->fn)(P(0), a[1], a[2], P(3), a[4], P(5), a[6], P(7), P(8), P(9), P(10), a[11], a[12],
                                          (int)a[13], (int)a[14]) != 0)
                return c + 1;
            break;
        default:
            return c + 1;
        }
    }
    return 0;
}
