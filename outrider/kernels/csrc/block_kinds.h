/* The weight kinds qmatmul.c and matmul_amx.c read, and where a weight row's scales (and mins) are.
 *
 *   kind: KIND_* (the codes' form), plus HALF (float16 scales and mins, as GGUF keeps a Q8_0, Q4_0
 *   or Q4_1 block's) or FACTORED (a K-quant's scales as the file keeps them), else float32.
 *
 * FACTORED: per 256 values (a super-block), float16 D (and Dmin), then per 32 values (q4_1, from
 * Q4_K) a uint8 scale code and a uint8 min code, 20 bytes; or per 16 values (q8_16, from Q6_K) an
 * int8 scale code, 18 bytes. A scale is D * code and a min -(Dmin * code): products exact in float32
 * (11 + 8 bits at most), the very values weights/quant_convert.py computes and dequantize gives. Kept so, a
 * Q4_K weight streams 4.6 bits a value instead of 6 (float32 scale and min a block), a Q6_K one
 * 8.6 instead of 10.
 */
#ifndef OUTRIDER_BLOCK_KINDS_H
#define OUTRIDER_BLOCK_KINDS_H
#include <stdint.h>
#include <string.h>

#include "isa.h"

enum { KIND_Q8_0 = 0, KIND_Q4_0 = 1, KIND_Q4_1 = 2, KIND_Q8_16 = 3 };
#define HALF 4                      /* float16 scales and mins (Q8_0, Q4_0, Q4_1 as GGUF keeps them) */
#define FACTORED 8                  /* a K-quant's factored scales (q4_1, q8_16) */
#define LANES 16                    /* the weight packed for int8 activations (qmatmul_i8.c), its kind + 16 */
#define BASE(kind) ((kind) & 3)     /* the codes' form */
#define SCALES(kind) (BASE(kind) == KIND_Q8_16 ? 2 : 1) /* scales a 32-value block has */
#define SUPER_BYTES(kind) (BASE(kind) == KIND_Q4_1 ? 20 : 18)  /* FACTORED: a super-block's scale bytes */

/* Every kind the float32 kernels take (qmatmul.c, qmatmul_fill.c: one specialized function each):
 * the four, those with float16 scales, and the K-quants' factored ones. */
#define KINDS(X) X(q8_0, KIND_Q8_0) X(q4_0, KIND_Q4_0) X(q4_1, KIND_Q4_1) X(q8_16, KIND_Q8_16) \
                 X(q8_0h, (KIND_Q8_0 + HALF)) X(q4_0h, (KIND_Q4_0 + HALF)) X(q4_1h, (KIND_Q4_1 + HALF)) \
                 X(q4_1f, (KIND_Q4_1 + FACTORED)) X(q8_16f, (KIND_Q8_16 + FACTORED))

/* Whether a kernel takes `kind` (m: the mins, for q4_1), K values a row. */
static inline int kind_known(int kind, const void *m, int64_t K) {
    const int base = BASE(kind), extra = kind & ~3;
    const int ok = kind >= 0 && (extra == 0 || (extra == HALF && base != KIND_Q8_16) ||
                                 (extra == FACTORED && (base == KIND_Q4_1 || base == KIND_Q8_16)));
    return ok && K % ((kind & FACTORED) ? 256 : 32) == 0 && (base != KIND_Q4_1 || m);
}

/* Bytes of scales (and of mins) a weight row of `blocks` 32-value blocks has. */
static inline int64_t scale_row_bytes(int kind, int64_t blocks) {
    if (kind & FACTORED) return blocks / 8 * SUPER_BYTES(kind);
    return blocks * SCALES(kind) * ((kind & HALF) ? 2 : 4);
}
static inline int64_t min_row_bytes(int kind, int64_t blocks) {
    if (kind & FACTORED) return scale_row_bytes(kind, blocks);  /* the mins ride in the super-blocks */
    return blocks * ((kind & HALF) ? 2 : 4);
}

static inline __attribute__((always_inline)) float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return outrider_half_float(h);
}

/* Scale i (a block's; for q8_16 a 16-value group's) of a weight row whose scales start at p. */
static inline __attribute__((always_inline)) float scale_at(int kind, const void *p, int64_t i) {
    if (kind & FACTORED) {
        const int per = BASE(kind) == KIND_Q4_1 ? 8 : 16;
        const uint8_t *s = (const uint8_t *)p + i / per * SUPER_BYTES(kind);
        const float code = BASE(kind) == KIND_Q4_1 ? (float)s[4 + i % per] : (float)(int8_t)s[2 + i % per];
        return half_at(s) * code;
    }
    return (kind & HALF) ? outrider_half_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Min i (q4_1) of a weight row whose mins start at p. */
static inline __attribute__((always_inline)) float min_at(int kind, const void *p, int64_t i) {
    if (kind & FACTORED) {
        const uint8_t *s = (const uint8_t *)p + i / 8 * SUPER_BYTES(kind);
        return -(half_at(s + 2) * (float)s[12 + i % 8]);
    }
    return scale_at(kind, p, i);
}

/* Byte offsets of block b's scale and min in their rows (for prefetching). */
static inline int64_t scale_offset(int kind, int64_t b) {
    if (kind & FACTORED) return b / 8 * SUPER_BYTES(kind);
    return b * SCALES(kind) * ((kind & HALF) ? 2 : 4);
}
static inline int64_t min_offset(int kind, int64_t b) {
    return (kind & FACTORED) ? scale_offset(kind, b) : b * ((kind & HALF) ? 2 : 4);
}
#endif
