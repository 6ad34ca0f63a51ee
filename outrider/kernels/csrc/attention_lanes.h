/* Attention's AVX2 register tiles for many rows of one slot (a prefill's, a long verify's): the
 * scores from keys turned along the lanes (the weighted values of several heads at once:
 * attention_heads.h). Each score gets the operations attention.c's one-row path (dot8) gives it,
 * in the same order, so the bits do not depend on which path ran:
 * a prefill whole, in chunks or a row at a time, and a k-token verify against k one-token steps,
 * stay bit-identical. Included by attention.c only (its AVX2 builds). */
#ifndef OUTRIDER_ATTENTION_LANES_H
#define OUTRIDER_ATTENTION_LANES_H
#include <stdint.h>

#include "attention.h"

#if defined(OUTRIDER_AVX2)

/* Rows of one slot from which outrider_attend turns the keys along the lanes: below it the pass
 * costs as much as the tiles save or more (Zen 5 as AVX2, against the one-row path: 4 rows of a
 * float16 cache 0.75x, 6-8 rows even, 12 and 16 rows of a float32 cache 1.05x and 1.12x, 24 rows
 * over 2,000 keys 1.17x; docs/benchmarks/2026-12-03-amd-epyc-zen5-avx512.md). */
#define LANES_ROWS 12

/* The keys 0..last of kv head g, along the lanes: kt [blocks][D][8] float32 (block b's value i of
 * key 8 b + l at (b D + i) 8 + l; a float16 cache widened exactly, as kv_load8 widens it), a key
 * past `last` repeating key `last` (its scores are computed, then dropped as dot8's are). */
static inline void keys_along_lanes(const void *keys, int64_t row_stride, const int64_t *map, int64_t last,
                                    int64_t D, int half, float *kt, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        float *dst = kt + b * D * 8;
        for (int l = 0; l < 8; l++) {
            const int64_t j = 8 * b + l <= last ? 8 * b + l : last, at = KV_ROW(map, j, row_stride);
            for (int64_t i = 0; i < D; i++)
                dst[i * 8 + l] = half ? outrider_half_float(((const uint16_t *)keys)[at + i])
                                      : ((const float *)keys)[at + i];
        }
    }
}

/* The scores of NH query heads (q: [NH, D]) against NB blocks of 8 keys along the lanes (kt: [NB, D,
 * 8]), times scale, into s[a Lp + 8 b ..] (D a multiple of 8). dot8's lane e of a key is the
 * multiply-adds of the head's values e, 8 + e, 16 + e, ... in order, and its hadd tree adds the lanes
 * ((0+1)+(2+3)) + ((4+5)+(6+7)); here chain e is that lane for 8 keys at once, each (head, block)
 * its own accumulator, and the tree adds whole chains: the same operations per score, so the same
 * bits. The tile reads each key vector once for NH heads (dot8 reads it once a head). */
static inline __attribute__((always_inline)) void scores_lanes(int NH, int NB, const float *q, int64_t D,
                                                              const float *kt, float *s, int64_t Lp, float scale) {
    __m256 c[8][3][3];  /* chain e's sums [head][block]: NH, NB <= 3 */
    for (int e = 0; e < 8; e++) {
        __m256 acc[3][3];
        for (int a = 0; a < NH; a++)
            for (int b = 0; b < NB; b++) acc[a][b] = _mm256_setzero_ps();
        for (int64_t i = e; i < D; i += 8) {
            __m256 k[3];
            for (int b = 0; b < NB; b++) k[b] = _mm256_loadu_ps(kt + (b * D + i) * 8);
            for (int a = 0; a < NH; a++) {
                __m256 qa = _mm256_broadcast_ss(q + a * D + i);
                for (int b = 0; b < NB; b++) acc[a][b] = _mm256_fmadd_ps(qa, k[b], acc[a][b]);
            }
        }
        for (int a = 0; a < NH; a++)
            for (int b = 0; b < NB; b++) c[e][a][b] = acc[a][b];
    }
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NB; b++) {
            __m256 lo = _mm256_add_ps(_mm256_add_ps(c[0][a][b], c[1][a][b]), _mm256_add_ps(c[2][a][b], c[3][a][b]));
            __m256 hi = _mm256_add_ps(_mm256_add_ps(c[4][a][b], c[5][a][b]), _mm256_add_ps(c[6][a][b], c[7][a][b]));
            _mm256_storeu_ps(s + a * Lp + 8 * b, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
        }
}

/* The scores of `per` query heads (q: [per, D]) against keys 0..last (kt as keys_along_lanes made
 * it), times scale, into s[a Lp + j]: tiles of 3 heads by 3 blocks, then what is left. */
static inline __attribute__((always_inline)) void scores_from_lanes(int64_t per, const float *q, int64_t D,
                                                                   const float *kt, int64_t last, float *s,
                                                                   int64_t Lp, float scale) {
    int64_t a = 0;
    for (; a + 3 <= per; a += 3) {
        int64_t j0 = 0;
        for (; j0 + 24 <= last + 1; j0 += 24) scores_lanes(3, 3, q + a * D, D, kt + j0 * D, s + a * Lp + j0, Lp, scale);
        for (; j0 <= last; j0 += 8) scores_lanes(3, 1, q + a * D, D, kt + j0 * D, s + a * Lp + j0, Lp, scale);
    }
    for (; a < per; a++) {
        int64_t j0 = 0;
        for (; j0 + 24 <= last + 1; j0 += 24) scores_lanes(1, 3, q + a * D, D, kt + j0 * D, s + a * Lp + j0, Lp, scale);
        for (; j0 <= last; j0 += 8) scores_lanes(1, 1, q + a * D, D, kt + j0 * D, s + a * Lp + j0, Lp, scale);
    }
}

#endif
#endif
