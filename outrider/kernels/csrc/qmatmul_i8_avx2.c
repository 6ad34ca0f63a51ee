/* The int8-activation kernel of the `-i8` dtypes (qmatmul_i8.c's header gives the numerics and the
 * layout) with AVX2 alone: the `avx2` variant, and `avx512` (AVX-512 without VNNI). The same weight
 * records (qmatmul_i8_pack.c), the same records of x (qmatmul_i8.h), the same integer block sums and
 * the same float32 operations lane by lane as the AVX-512 VNNI kernel, its 16 lanes kept as two
 * vectors of 8, summed by the same tree (qmatmul_i8.h sum16): every output is the bits qmatmul_i8.c
 * gives (tests/test_quant_i8.py compares them), whatever the rows and threads.
 *
 * Its parts: this file rounds x's rows to their records (quantize_row), runs the products over the
 * threads, the tiles of weight rows and up to RMAX rows of x at a time (dot_rows, MATMUL), and is the
 * entry point (outrider_i8_matmul); qmatmul_i8_avx2_dot.h has a group's and a dense tail's products:
 * the integer sums (vpmaddubsw, or AVX-VNNI's vpdpbusd) and their float epilogue; qmatmul_i8_avx_vnni.c
 * chooses between vpmaddubsw and AVX-VNNI at run time (outrider_i8_avx_vnni) and measures the CPU's
 * bound on the products (outrider_i8_peak).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#if defined(OUTRIDER_AVX2) && !defined(OUTRIDER_VNNI512)
#include "qmatmul_i8.h"
#include "block_decode.h"
#include "qmatmul_i8_avx2_dot.h"

#define TILE_N 16         /* weight rows a thread takes at a time */

int outrider_i8_ok(void) { return 1; }
int outrider_i8_avx_vnni(int mode);  /* qmatmul_i8_avx_vnni.c */

/* ---- activations --------------------------------------------------------------------------------- */

/* Row x [K] into its records (qmatmul_i8.h), with qmatmul_i8.c's float32 operations: d = amax / 127,
 * id = 1 / d (0 for d = 0), codes round(x * id) to nearest even (vcvtps2dq), saturated to int8. */
static void quantize_row(int kind, const float *x, int64_t K, uint8_t *rec) {
    const int64_t B = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    memset(rec, 0, x_row_bytes(kind, K));
    for (int64_t b = 0; b < B; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
        m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h);  /* a maximum: exact in any order */
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        /* sums of codes 0..15 and 16..31 (integers: exact) */
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, _mm256_add_epi32(q[0], q[1]));
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 8; i++) s0 += t[i];
        _mm256_storeu_si256((__m256i *)t, _mm256_add_epi32(q[2], q[3]));
        for (int i = 0; i < 8; i++) s1 += t[i];
        /* to int8, saturating as vpmovsdb does: the packs interleave 128-bit lanes, the permute puts
         * codes 0..31 back in order */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        int8_t c[32];
        _mm256_storeu_si256((__m256i *)c, _mm256_permutevar8x32_epi32(w, order));
        store_x_block(kind, rec, B, b, c, d, s0, s1);
    }
}

/* y[r * ystride] = x[r] . W for r < R (a constant after inlining): one weight row against R rows
 * of x (their records xq, xrow bytes apart), each half of a group decoded once for the R rows. */
AI void dot_rows(int kind, int vnni, int R, const uint8_t *xq, int64_t xrow, const uint8_t *w, int64_t B, float *y,
                 int64_t ystride) {
    __m256 acc[RMAX][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t full = B / GROUP, nb = B % GROUP, bytes = group_bytes(kind, GROUP);
    for (int64_t gi = 0; gi < full; gi++) {
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)w + PREFETCH_BYTES + o, _MM_HINT_T2);
        group_dot(kind, vnni, R, xq, xrow, gi, w, GROUP, acc);
        w += bytes;
    }
    if (nb && short_group(nb)) group_dot(kind, vnni, R, xq, xrow, full, w, nb, acc);
    else if (nb) tail_dot(kind, vnni, R, xq + full * XREC, xrow, w, nb, acc);
    for (int r = 0; r < R; r++) y[r * ystride] = sum16(acc[r][0], acc[r][1]);
}

/* As qmatmul_i8.c: one parallel region a call, the threads round x's rows, then split the weight
 * rows in tiles of TILE_N, each weight row passing over up to RMAX rows of x at a time. Row counts
 * other than 1, 2, 4 and RMAX run with R a variable (the same operations: only the unrolling
 * differs): every count a constant compiled this file in 47 s of CPU instead of about 20. */
#define ROWS_CASE(KIND, VNNI, R) case R: dot_rows(KIND, VNNI, R, xr, xrow, wn, B, yr, N); break;
#define MATMUL(NAME, KIND, VNNI)                                                                    \
    static void NAME(const float *x, uint8_t *xq, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, \
                     int threads) {                                                                 \
        const int64_t B = K / QK, xrow = x_row_bytes(KIND, K);                                      \
        const int64_t wrow = outrider_i8_row_bytes(KIND, K), tiles = (N + TILE_N - 1) / TILE_N;     \
        _Pragma("omp parallel num_threads(threads)")                                               \
        {                                                                                           \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t r = 0; r < M; r++) quantize_row(KIND, x + r * K, K, xq + r * xrow);            \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t t = 0; t < tiles; t++) {                                                       \
            const int64_t n1 = (t + 1) * TILE_N < N ? (t + 1) * TILE_N : N;                         \
            for (int64_t r = 0; r < M; r += RMAX) {                                                 \
                const int R = M - r < RMAX ? (int)(M - r) : RMAX;                                   \
                for (int64_t n = t * TILE_N; n < n1; n++) {                                         \
                    const uint8_t *xr = xq + r * xrow, *wn = w + n * wrow;                          \
                    float *yr = y + r * N + n;                                                      \
                    switch (R) {  /* 1, 2, 4 and RMAX rows as constants; the others' loops at run time */ \
                        ROWS_CASE(KIND, VNNI, 1) ROWS_CASE(KIND, VNNI, 2) ROWS_CASE(KIND, VNNI, 4)    \
                        ROWS_CASE(KIND, VNNI, RMAX)                                                 \
                        default: dot_rows(KIND, VNNI, R, xr, xrow, wn, B, yr, N); break;             \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        }                                                                                           \
    }

#define LANE_KINDS(X) X(q8_0, KIND_Q8_0) X(q4_0, KIND_Q4_0) X(q4_1, KIND_Q4_1) X(q8_16, KIND_Q8_16) \
                      X(q8_0h, (KIND_Q8_0 + HALF)) X(q4_0h, (KIND_Q4_0 + HALF)) X(q4_1h, (KIND_Q4_1 + HALF)) \
                      X(q4_1f, (KIND_Q4_1 + FACTORED)) X(q8_16f, (KIND_Q8_16 + FACTORED))
#define DEFINE(NAME, KIND) MATMUL(lanes_##NAME, KIND, 0) MATMUL(vnni_##NAME, KIND, 1)
LANE_KINDS(DEFINE)
#undef DEFINE

/* As qmatmul_i8.c's: y [M, N] = x [M, K] . W^T for W packed by outrider_i8_pack (kind + LANES). */
int outrider_i8_matmul(int kind, const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y,
                       int threads) {
    kind &= ~LANES;
    if (!base_known(kind, K) || M < 0 || N < 0 || threads < 1) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t xrow = x_row_bytes(kind, K);
    uint8_t *xq = aligned_alloc(64, (size_t)(M * xrow));
    if (!xq) return -1;
#define CALL(NAME, KIND) case KIND: (vnni ? vnni_##NAME : lanes_##NAME)(x, xq, M, K, (const uint8_t *)w, N, y, threads); break;
    const int vnni = outrider_i8_avx_vnni(-1);
    switch (kind) { LANE_KINDS(CALL) default: free(xq); return -1; }
#undef CALL
    free(xq);
    return 0;
}
#endif
