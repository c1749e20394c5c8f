/* bfloat16 <-> float32 in plain C, for kernels that hold bfloat16 as uint16_t. */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

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
#endif
