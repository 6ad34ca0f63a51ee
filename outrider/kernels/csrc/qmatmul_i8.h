/* The lanes layout of qmatmul_i8.c (see its header): sizes of a weight row's records, shared by
 * qmatmul_i8_pack.c (which writes them once at load) and qmatmul_i8.c (which multiplies with them).
 * Included by those two only, in builds with AVX-512 VNNI. */
#ifndef OUTRIDER_QMATMUL_I8_H
#define OUTRIDER_QMATMUL_I8_H
#include <stdint.h>

#include "block_kinds.h"

#define QK 32
#define GROUP 16          /* blocks a group (one lane each) */

int64_t outrider_i8_row_bytes(int kind, int64_t K);

/* A row's last nb < 16 blocks (its tail): from SHORT_MIN blocks on a short group (a group's
 * layout with nb lanes, its masked-off lanes absent from memory), below it dense (qmatmul_i8.c). */
#define SHORT_MIN 8
static inline int short_group(int64_t nb) { return nb >= SHORT_MIN; }

static inline int q8(int kind) { return BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16; }

/* Bytes of codes and of scales of a group of nb blocks. */
static inline int64_t code_bytes(int kind, int64_t nb) { return (q8(kind) ? 32 : 16) * nb; }
static inline int64_t scale_bytes(int kind, int64_t nb) {
    if (kind & FACTORED) return nb / 8 * SUPER_BYTES(kind);
    const int64_t per = (kind & HALF) ? 2 : 4, n = BASE(kind) == KIND_Q8_16 ? 2 * nb : nb;
    return n * per * (BASE(kind) == KIND_Q4_1 ? 2 : 1);
}
static inline int64_t group_bytes(int kind, int64_t nb) { return code_bytes(kind, nb) + scale_bytes(kind, nb); }

static inline int base_known(int kind, int64_t K) {  /* a kind this layout takes (without LANES) */
    const int base = BASE(kind), extra = kind & ~3;
    const int ok = (extra == 0) || (extra == HALF && base != KIND_Q8_16) ||
                   (extra == FACTORED && (base == KIND_Q4_1 || base == KIND_Q8_16));
    return ok && kind >= 0 && K > 0 && K % ((kind & FACTORED) ? 256 : QK) == 0;
}
#endif
