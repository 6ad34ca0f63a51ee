/* Which code paths a build of the kernels compiles (kernels/native.py builds one library per
 * variant, each with its own instruction-set flags, and loads the best the CPU runs):
 *
 *   OUTRIDER_AVX2     x86-64 with AVX2, FMA and F16C (x86-64-v3: the `avx2` variant, and under
 *                     the AVX-512 paths of every AVX-512 variant)
 *   OUTRIDER_AVX512   and AVX-512 F, BW and VL (x86-64-v4: `avx512`, `avx512-vnni`, `amx`)
 *   OUTRIDER_VNNI512  and AVX-512 VNNI (`avx512-vnni`, `amx`): qmatmul_i8.c's int8 kernel; the other
 *                     AVX2 builds (`avx2`, `avx512`) take qmatmul_i8_avx2.c's
 *   neither           the `portable` variant: plain C, no intrinsics (ARM, older x86): the
 *                     compiler vectorizes its lane loops for the baseline of its target
 *
 * and float16 <-> float32 conversions for builds without F16C. Each path computes every output
 * as one fixed sequence of float32 operations, whatever the number of rows or threads; two
 * variants may differ from each other in the last bits (the order of a dot product's sums).
 */
#ifndef OUTRIDER_ISA_H
#define OUTRIDER_ISA_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OUTRIDER_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define OUTRIDER_AVX512 1
#if defined(__AVX512VNNI__)
#define OUTRIDER_VNNI512 1   /* qmatmul_i8.c's vpdpbusd kernel; AVX2 builds without it: qmatmul_i8_avx2.c */
#endif
#endif
#endif

static inline __attribute__((always_inline)) float outrider_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline __attribute__((always_inline)) uint32_t outrider_float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A float16's value, exactly (every float16 is a float32). */
static inline __attribute__((always_inline)) float outrider_half_float(uint16_t h) {
#if defined(OUTRIDER_AVX2)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return outrider_bits_float(sign | 0x7F800000u | (man << 13));      /* inf, nan */
    if (exp) return outrider_bits_float(sign | ((exp + 112) << 23) | (man << 13));      /* normal */
    /* zero or subnormal: man * 2^-24, exact (a small integer times a power of two) */
    return outrider_bits_float(sign | outrider_float_bits((float)man * 0x1.0p-24f));
#endif
}

/* f rounded to float16, to nearest, ties to even (as torch's .half() and F16C's vcvtps2ph with
 * _MM_FROUND_TO_NEAREST_INT round it): Maratyszcza's FP16 library's fp16_ieee_from_fp32_value,
 * whose float32 additions do the rounding (overflow to inf, subnormals, ties) in the FPU's own
 * round-to-nearest-even mode. A nan becomes the quiet nan 0x7E00. */
static inline __attribute__((always_inline)) uint16_t outrider_float_half(float f) {
#if defined(OUTRIDER_AVX2)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const float to_inf = 0x1.0p+112f;
    const float to_zero = 0x1.0p-110f;
    const uint32_t w = outrider_float_bits(f), shl1 = w + w, sign = w & 0x80000000u;
    float base = (outrider_bits_float(w & 0x7FFFFFFFu) * to_inf) * to_zero;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = outrider_bits_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = outrider_float_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}
#endif
