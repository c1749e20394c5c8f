/* exp(x) in plain arithmetic the compiler vectorizes (a libm call per element cannot be), to about
 * 1 ulp like libm's expf. Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, the classic
 * degree-6 polynomial for e^r, then 2^n in the exponent bits. Below -87.3, where expf underflows,
 * it returns 0 like expf; above 88 it returns +inf (expf: 1.6e38 up to 3.4e38, then inf), which
 * its callers cannot tell apart: softmax passes x <= 0, silu divides by 1 + exp(x). */
#ifndef PAGEDSERVE_FAST_EXP_H
#define PAGEDSERVE_FAST_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fast_exp(float x)
{
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const float clamped = n < -126.0f ? -126.0f : n > 127.0f ? 127.0f : n;
    const int32_t e = ((int32_t)clamped + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return x < -87.3f ? 0.0f : x > 88.0f ? INFINITY : p * two_n;
}

#endif
