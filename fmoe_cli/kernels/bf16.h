/* bf16 <-> float32, shared by experts.c and decode.c (kernels/build.py compiles both into one library). torch's
   bf16 elementwise ops compute in float32 and round each result once to the nearest even bf16: round_bf16. */
#ifndef FMOE_BF16_H
#define FMOE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#endif
