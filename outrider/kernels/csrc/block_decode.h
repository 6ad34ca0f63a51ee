/* How a weight block of qmatmul.c is read: prefetching ahead, and its 32 values decoded into
 * registers (AVX-512: two vectors of 16; AVX2: four of 8; portable: an array of 32 the compiler
 * vectorizes) with the reference's own operations, the scales taken as block_kinds.h says (float16
 * and factored ones a window of blocks at a time in AVX-512 builds). Included by qmatmul.c and
 * qmatmul_fill.c (and the int8 kernels': qmatmul_i8.c, qmatmul_i8_avx2.c, qmatmul_i8_avx2_dot.h) only. */
#ifndef OUTRIDER_BLOCK_DECODE_H
#define OUTRIDER_BLOCK_DECODE_H
#include "block_kinds.h"

#ifndef QK
#define QK 32  /* values per block */
#endif

/* Ask for the codes and scales PREFETCH_BYTES ahead of block b (past a row's end that is the
 * next row's, which this thread computes next): a row is only a few hundred bytes, too short for
 * the hardware prefetcher to get ahead on its own. Once per 64-byte line: codes every second block
 * (Q8_0 blocks are 32 bytes), scales and mins every sixteenth. 8 KB ahead, into L2 (other
 * distances and L1 were no better: docs/experiments.md, The float32 row kernel and the AMX tiles). */
#define PREFETCH_BYTES 8192
#if defined(OUTRIDER_AVX2)
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T2)
#else
#define PREFETCH_L2(p) __builtin_prefetch((const void *)(p), 0, 1)
#endif
static inline __attribute__((always_inline)) void prefetch_ahead(int kind, int64_t b, const uint8_t *q,
                                                                 const void *d, const void *m) {
    if (b & 1) return;
    PREFETCH_L2(q + PREFETCH_BYTES);
    if (b & 15) return;
    const int64_t ahead = PREFETCH_BYTES / 8 * ((kind & HALF) ? 2 : 4);  /* 512 scales ahead, in bytes */
    PREFETCH_L2((const char *)d + ahead);
    if (m) PREFETCH_L2((const char *)m + ahead);
}


#if defined(OUTRIDER_AVX512)
/* A block's 32 values from its codes at q, its scale dd (dd1: the second 16 values' scale, q8_16)
 * and min mm (q4_1), broadcast. */
static inline __attribute__((always_inline)) void decode_with(int kind, const uint8_t *q, __m512 dd, __m512 dd1,
                                                              __m512 mm, __m512 *w0, __m512 *w1) {
    if (BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
        *w0 = _mm512_mul_ps(dd, a);
        *w1 = _mm512_mul_ps(BASE(kind) == KIND_Q8_16 ? dd1 : dd, b);
        return;
    }
    /* the block's 16 possible values, each computed as the reference computes it, then looked up
     * by code (vpermps reads the low 4 bits of each index: no mask needed for the low nibbles) */
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = BASE(kind) == KIND_Q4_0 ? _mm512_mul_ps(dd, _mm512_sub_ps(codes, _mm512_set1_ps(8.0f)))
                                           : _mm512_add_ps(_mm512_mul_ps(dd, codes), mm);
    __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); /* bytes 0..15 */
    *w0 = _mm512_permutexvar_ps(all, table);                        /* values 0..15 */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(all, 4), table);  /* values 16..31 */
}

/* Block i of a weight row: its codes at q, its scales and min at index i (SCALES(kind) i for the
 * scales) of d and m. */
static inline __attribute__((always_inline)) void decode(int kind, const uint8_t *q, const void *d, const void *m,
                                                         int64_t i, __m512 *w0, __m512 *w1) {
    const __m512 dd = _mm512_set1_ps(scale_at(kind, d, i * SCALES(kind)));
    const __m512 dd1 = BASE(kind) == KIND_Q8_16 ? _mm512_set1_ps(scale_at(kind, d, 2 * i + 1)) : dd;
    const __m512 mm = BASE(kind) == KIND_Q4_1 ? _mm512_set1_ps(min_at(kind, m, i)) : _mm512_setzero_ps();
    decode_with(kind, q, dd, dd1, mm, w0, w1);
}

/* Float16 scales (and mins) of blocks b..b+15 of a row (fewer at its end), widened at once: at one
 * or two rows of x a block's own widening would cost about as much as its multiply-adds. */
static inline __attribute__((always_inline)) __m512 widen16(const void *p, int64_t b, int64_t blocks) {
    const int64_t n = blocks - b < 16 ? blocks - b : 16;
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), (const uint16_t *)p + b));
}

/* FACTORED (block_kinds.h) scales of a row from block b (a multiple of WINDOW(kind)) on, computed at once
 * with the kernel's own operations (D * code, -(Dmin * code): the same values scale_at gives):
 * q4_1, blocks b..b+15 (two super-blocks; one at the row's end) into dv, their mins into mv;
 * q8_16, the 16 groups of blocks b..b+7 (one super-block) into dv. */
#define WINDOW(kind) (((kind) & FACTORED) && BASE(kind) == KIND_Q8_16 ? 8 : 16)
static inline __attribute__((always_inline)) void widen_factored(int kind, const uint8_t *row, int64_t b,
                                                                 int64_t blocks, __m512 *dv, __m512 *mv) {
    const uint8_t *s = row + b / 8 * SUPER_BYTES(kind);
    if (BASE(kind) == KIND_Q8_16) {
        const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 2))));
        *dv = _mm512_mul_ps(_mm512_set1_ps(half_at(s)), codes);
        return;
    }
    const int two = b + 8 < blocks;
    uint64_t sc0, mn0, sc1 = 0, mn1 = 0;
    memcpy(&sc0, s + 4, 8);
    memcpy(&mn0, s + 12, 8);
    if (two) memcpy(&sc1, s + 24, 8), memcpy(&mn1, s + 32, 8);
    const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(s)), _mm512_set1_ps(two ? half_at(s + 20) : 0.0f));
    const __m512 dm = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(s + 2)),
                                           _mm512_set1_ps(two ? half_at(s + 22) : 0.0f));
    *dv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)sc1, (long long)sc0))));
    const __m512 low = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)mn1, (long long)mn0))));
    *mv = _mm512_xor_ps(low, _mm512_set1_ps(-0.0f));  /* -(Dmin * code), as min_at */
}

#elif defined(OUTRIDER_AVX2)
static inline __attribute__((always_inline)) void decode(int kind, const uint8_t *q, const void *d, const void *m,
                                                         int64_t block, __m256 w[4]) {
    __m256 dd = _mm256_set1_ps(scale_at(kind, d, block * SCALES(kind)));
    if (BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16) {
        __m256 d1 = BASE(kind) == KIND_Q8_16 ? _mm256_set1_ps(scale_at(kind, d, 2 * block + 1)) : dd;
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
            w[i] = _mm256_mul_ps(i >= 2 ? d1 : dd, _mm256_cvtepi32_ps(v));
        }
        return;
    }
    __m128i raw = _mm_loadu_si128((const __m128i *)q);
    __m256i a = _mm256_cvtepu8_epi32(raw);                     /* bytes 0..7 */
    __m256i b = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));  /* bytes 8..15 */
    __m256i low = _mm256_set1_epi32(15);
    __m256 v[4] = {
        _mm256_cvtepi32_ps(_mm256_and_si256(a, low)),  /* values 0..7 */
        _mm256_cvtepi32_ps(_mm256_and_si256(b, low)),  /* values 8..15 */
        _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)),   /* values 16..23 */
        _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)),   /* values 24..31 */
    };
    __m256 mm = _mm256_set1_ps(BASE(kind) == KIND_Q4_1 ? min_at(kind, m, block) : 0.0f), eight = _mm256_set1_ps(8.0f);
    for (int i = 0; i < 4; i++)
        w[i] = BASE(kind) == KIND_Q4_0 ? _mm256_mul_ps(dd, _mm256_sub_ps(v[i], eight))
                                       : _mm256_add_ps(_mm256_mul_ps(dd, v[i]), mm);
}

#else
/* Portable: block `block` of a weight row, its 32 values into w (each as the reference computes
 * it: d * (q - 8), d * q + m, d * q; no contraction). */
static inline __attribute__((always_inline)) void decode(int kind, const uint8_t *q, const void *d, const void *m,
                                                         int64_t block, float w[32]) {
    const float dd = scale_at(kind, d, block * SCALES(kind));
    if (BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16) {
        const float d1 = BASE(kind) == KIND_Q8_16 ? scale_at(kind, d, 2 * block + 1) : dd;
        for (int i = 0; i < 16; i++) w[i] = dd * (float)(int8_t)q[i];
        for (int i = 16; i < 32; i++) w[i] = d1 * (float)(int8_t)q[i];
        return;
    }
    if (BASE(kind) == KIND_Q4_0) {
        for (int j = 0; j < 16; j++) w[j] = dd * ((float)(q[j] & 15) - 8.0f);
        for (int j = 0; j < 16; j++) w[j + 16] = dd * ((float)(q[j] >> 4) - 8.0f);
        return;
    }
    const float mm = min_at(kind, m, block);
    for (int j = 0; j < 16; j++) w[j] = dd * (float)(q[j] & 15) + mm;
    for (int j = 0; j < 16; j++) w[j + 16] = dd * (float)(q[j] >> 4) + mm;
}
#endif
#if defined(OUTRIDER_AVX2)
/* An AVX2 row kernel's reduction of 8 lanes (qmatmul.c, qmatmul_fill.c: the same order in both). */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* A weight row's K values into out (what decode gives, stored): for qmatmul.c's dequantize (a
 * caller's float GEMM, native.py `dequantize_rows`) and qmatmul_fill.c's decoded tile. QK values a block. */
static inline __attribute__((always_inline)) void decode_row(int kind, int64_t K, const uint8_t *q, int64_t qstride,
                                                             const void *d, const void *m, float *out) {
    for (int64_t b = 0; b < K / QK; b++) {
#if defined(OUTRIDER_AVX512)
        __m512 w0, w1;
        decode(kind, q + b * qstride, d, m, b, &w0, &w1);
        _mm512_storeu_ps(out + b * QK, w0);
        _mm512_storeu_ps(out + b * QK + 16, w1);
#elif defined(OUTRIDER_AVX2)
        __m256 w[4];
        decode(kind, q + b * qstride, d, m, b, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * QK + 8 * i, w[i]);
#else
        decode(kind, q + b * qstride, d, m, b, out + b * QK);
#endif
    }
}

#endif
