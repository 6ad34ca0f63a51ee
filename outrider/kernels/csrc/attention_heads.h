/* Attention's last step for several query heads of one task at once (attention.c): the weighted
 * values. Each key's value row is loaded once for the heads instead of once a head. Head a's
 * weights are p[a Lp + j], its output out[a D ..]; each element's operations are attention.c's
 * weigh_values' own (o = fma(p, v, o) over the seen keys j <= last, in order), so the bits do not
 * depend on how many heads were summed together, nor on the width.
 *
 * One definition for both vector widths: AVX-512 builds sum 16 values a vector, up to 24 sums
 * (nh heads x nv vectors) in registers; AVX2 builds 8 values a vector, up to 12 (3 heads x 4).
 * Included by attention.c after kv_load8 / kv_load16, which read the values (float32 or float16).
 */
#ifndef OUTRIDER_ATTENTION_HEADS_H
#define OUTRIDER_ATTENTION_HEADS_H

#include <stdint.h>

#include "attention.h"

#if defined(OUTRIDER_AVX2)
#if defined(OUTRIDER_AVX512)
typedef __m512 HeadsVec;
#define HEADS_LANES 16
#define HEADS_MOST 6 /* heads */
#define HEADS_VECS 8 /* vectors a head */
#define HEADS_ZERO() _mm512_setzero_ps()
#define HEADS_LOAD(base, at, half) kv_load16(base, at, half)
#define HEADS_WEIGHT(p) _mm512_set1_ps(*(p))
#define HEADS_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define HEADS_STORE(to, v) _mm512_storeu_ps(to, v)
#else
typedef __m256 HeadsVec;
#define HEADS_LANES 8
#define HEADS_MOST 3
#define HEADS_VECS 4
#define HEADS_ZERO() _mm256_setzero_ps()
#define HEADS_LOAD(base, at, half) kv_load8(base, at, half)
#define HEADS_WEIGHT(p) _mm256_broadcast_ss(p)
#define HEADS_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define HEADS_STORE(to, v) _mm256_storeu_ps(to, v)
#endif

/* nh heads (<= HEADS_MOST), nv vectors of HEADS_LANES values of each (<= HEADS_VECS), from value
 * column 0 of `values` and of each head's output. */
static inline __attribute__((always_inline)) void weigh_heads(int nh, int nv, const void *values, int64_t row_stride,
                                                             const int64_t *map, const float *p, int64_t Lp, const uint8_t *seen,
                                                             int64_t last, float *out, int64_t D, int half) {
    HeadsVec o[HEADS_MOST][HEADS_VECS];
    for (int a = 0; a < nh; a++)
        for (int i = 0; i < nv; i++) o[a][i] = HEADS_ZERO();
    for (int64_t j = 0; j <= last; j++) {
        if (seen && !seen[j]) continue;
        const int64_t v = KV_ROW(map, j, row_stride);
        HeadsVec vj[HEADS_VECS];
        for (int i = 0; i < nv; i++) vj[i] = HEADS_LOAD(values, v + HEADS_LANES * i, half);
        for (int a = 0; a < nh; a++) {
            HeadsVec pj = HEADS_WEIGHT(p + a * Lp + j);
            for (int i = 0; i < nv; i++) o[a][i] = HEADS_FMA(pj, vj[i], o[a][i]);
        }
    }
    for (int a = 0; a < nh; a++)
        for (int i = 0; i < nv; i++) HEADS_STORE(out + a * D + HEADS_LANES * i, o[a][i]);
}

/* The task's `per` heads, as many at a time as the registers hold; returns the heads done (0 where
 * the head size does not fit: the caller's head-by-head path). AVX-512: head sizes 64 and 128, whole
 * heads (4 or 8 vectors), up to 6 or 3 heads a pass over the keys. AVX2: head sizes a multiple of
 * 32, 3 heads (or those left) a pass, 32 of their values at a time. */
static inline __attribute__((always_inline)) int weigh_heads_all(int64_t per, const void *values, int64_t row_stride,
                                                                const int64_t *map, const float *p, int64_t Lp, const uint8_t *seen,
                                                                int64_t last, float *out, int64_t D, int half) {
#if defined(OUTRIDER_AVX512)
    if (D != 64 && D != 128) return 0;
    const int nv = (int)(D / 16), most = 24 / nv;
    int64_t a = 0;
    for (; a < per; ) {
        int nh = per - a < most ? (int)(per - a) : most;
        const float *pa = p + a * Lp;
        float *oa = out + a * D;
#define HEADS(NH, NV) case NH * 16 + NV: weigh_heads(NH, NV, values, row_stride, map, pa, Lp, seen, last, oa, D, half); break;
        switch (nh * 16 + nv) {
            HEADS(6, 4) HEADS(5, 4) HEADS(4, 4) HEADS(3, 4) HEADS(2, 4) HEADS(1, 4)
            HEADS(3, 8) HEADS(2, 8) HEADS(1, 8)
            default: return (int)a;
        }
#undef HEADS
        a += nh;
    }
    return (int)a;
#else
    if (D % 32 != 0 || per < 2) return 0;
    for (int64_t a = 0; a < per; a += 3) {
        const int nh = per - a < 3 ? (int)(per - a) : 3;
        for (int64_t c = 0; c < D; c += 32) {
            const void *vc = half ? (const void *)((const uint16_t *)values + c) : (const void *)((const float *)values + c);
            if (nh == 3) weigh_heads(3, 4, vc, row_stride, map, p + a * Lp, Lp, seen, last, out + a * D + c, D, half);
            else if (nh == 2) weigh_heads(2, 4, vc, row_stride, map, p + a * Lp, Lp, seen, last, out + a * D + c, D, half);
            else weigh_heads(1, 4, vc, row_stride, map, p + a * Lp, Lp, seen, last, out + a * D + c, D, half);
        }
    }
    return (int)per;
#endif
}
#endif

#endif
