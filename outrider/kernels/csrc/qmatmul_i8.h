/* The lanes layout of qmatmul_i8.c (see its header): sizes of a weight row's records, shared by
 * qmatmul_i8_pack.c (which writes them once at load), qmatmul_i8.c (AVX-512 VNNI) and
 * qmatmul_i8_avx2.c (AVX2) (which multiply with them); and the records of a row of x both kernels
 * read. Included by those three only (and qmatmul_i8_avx2.c's qmatmul_i8_avx2_dot.h), in builds with
 * AVX2 (every variant but portable). */
#ifndef OUTRIDER_QMATMUL_I8_H
#define OUTRIDER_QMATMUL_I8_H
#include <stdint.h>

#include <string.h>

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

/* ---- a row of x, rounded to 8-bit blocks (qmatmul_i8.c's header) --------------------------------- */

#define XREC 768          /* bytes of one row's group of x: 8 units of 64, d[16], sum[16], first-half sum[16], d * sum[16] */
/* a tail of nb blocks: vectors of codes (Q4: lanes of 4 bytes, 4 blocks a vector; Q8: 2 blocks) */
#define TAIL_VECTORS(kind, nb) (q8(kind) ? ((nb) + 1) / 2 : ((nb) + 3) / 4)
/* x's tail record: per code vector, x's partners (Q4: low and high nibbles' values: 2 vectors),
 * then each lane's d, sum of its values' codes, and d * sum (a vector each) */
#define XTAIL(kind, nb) (TAIL_VECTORS(kind, nb) * 64 * (q8(kind) ? 4 : 5))

/* Bytes of a row of x's records for a weight of `kind` (the tail's layout follows the codes'). */
static inline int64_t x_row_bytes(int kind, int64_t K) {
    const int64_t B = K / QK, tail = B % GROUP;
    return B / GROUP * XREC + (tail ? (short_group(tail) ? XREC : XTAIL(kind, tail)) : 0);
}

/* Block b of a row of x (B blocks), rounded: codes c[32], scale d, s0 and s1 the sums of codes
 * 0..15 and 16..31; into the row's records rec (zeroed first): lane b % 16 of its group, or the
 * dense tail's lanes (TAIL_VECTORS). */
static inline void store_x_block(int kind, uint8_t *rec, int64_t B, int64_t b, const int8_t c[32], float d,
                                 int32_t s0, int32_t s1) {
    const int64_t full = B / GROUP, nb = B % GROUP, tv = TAIL_VECTORS(kind, nb);
    if (b >= full * GROUP && !short_group(nb)) {  /* a dense tail: lane e = dword e of its codes */
        uint8_t *t = rec + full * XREC;
        const int64_t i = b - full * GROUP;
        for (int j = 0; j < (q8(kind) ? 8 : 4); j++) {
            const int64_t e = (q8(kind) ? 8 : 4) * i + j, v = e / 16, lane = e % 16;
            /* each lane: its scale group's sum of codes (q8_16: the block's half; else the block) */
            const int32_t sum = BASE(kind) == KIND_Q8_16 ? (j < 4 ? s0 : s1) : s0 + s1;
            if (q8(kind)) {  /* values 4j..4j+3, in order */
                memcpy(t + v * 64 + 4 * lane, c + 4 * j, 4);
            } else {  /* low nibbles' partners 4j..4j+3, high nibbles' 16+4j..16+4j+3 */
                memcpy(t + v * 64 + 4 * lane, c + 4 * j, 4);
                memcpy(t + (tv + v) * 64 + 4 * lane, c + 16 + 4 * j, 4);
            }
            uint8_t *lanes = t + (q8(kind) ? tv : 2 * tv) * 64 + v * 64 + 4 * lane;  /* d, then sum, then d * sum */
            memcpy(lanes, &d, 4);
            memcpy(lanes + tv * 64, &sum, 4);
            const float ds = d * (float)sum;
            memcpy(lanes + 2 * tv * 64, &ds, 4);
        }
        return;
    }
    uint8_t *g = rec + (b / GROUP) * XREC;
    const int64_t l = b % GROUP;
    for (int p = 0; p < 4; p++) {  /* unit 2p: values 4p..4p+3, unit 2p+1: 16+4p..16+4p+3 */
        memcpy(g + (2 * p) * 64 + 4 * l, c + 4 * p, 4);
        memcpy(g + (2 * p + 1) * 64 + 4 * l, c + 16 + 4 * p, 4);
    }
    const int32_t sum = s0 + s1;
    const float ds = d * (float)sum;
    memcpy(g + 512 + 4 * l, &d, 4);
    memcpy(g + 576 + 4 * l, &sum, 4);
    memcpy(g + 640 + 4 * l, &s0, 4);
    memcpy(g + 704 + 4 * l, &ds, 4);
}

#if defined(OUTRIDER_AVX2)
/* The sum of 16 float lanes (lo: lanes 0..7, hi: 8..15) in one fixed order, both kernels' (the tree
 * of GCC's _mm512_reduce_add_ps, written out): lane i + lane i + 8, then the 8 likewise by halves,
 * 4 -> 2 -> 1. */
static inline __attribute__((always_inline)) float sum16(__m256 lo, __m256 hi) {
    const __m256 t = _mm256_add_ps(hi, lo);
    const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(w) + _mm_cvtss_f32(_mm_shuffle_ps(w, w, 1));
}
#endif

static inline int base_known(int kind, int64_t K) {  /* a kind this layout takes (without LANES) */
    const int base = BASE(kind), extra = kind & ~3;
    const int ok = (extra == 0) || (extra == HALF && base != KIND_Q8_16) ||
                   (extra == FACTORED && (base == KIND_Q4_1 || base == KIND_Q8_16));
    return ok && kind >= 0 && K > 0 && K % ((kind & FACTORED) ? 256 : QK) == 0;
}
#endif
