/* y[M, N] = x[M, K] . W[N, K]^T for many rows of x (a prompt's prefill, a wide batch), with the
 * very arithmetic of qmatmul.c's row kernel: every y element is bit-identical to what the row
 * kernel gives it, so which of the two a product takes is a matter of speed only (chunked or
 * whole prefill, a 1-token step or a 700-token prompt: the same bits).
 *
 * How. The row kernel decodes a weight block in registers for the few rows of x it holds (8 on
 * AVX-512, 2 on AVX2) and decodes it again for the next few: at a prefill's hundreds of rows the
 * decoding (AVX2: about 20 instructions a block beside 8 multiply-adds) binds it. This kernel
 * decodes a tile of weight rows once (block_decode.h's decode_row: the same values) into a buffer
 * that stays in the L2 cache, and sweeps every row of x over it with a register tile of FR rows of
 * x by FC weight rows, loading each vector of x once for FC weight rows and each vector of the
 * tile once for FR rows: no decoding in the inner loop, FR * FC multiply-adds for FR + FC loads.
 *
 * The same sums, by variant (qmatmul.c says each row kernel's order):
 *   AVX-512  one accumulator of 16 lanes an element: lane j takes the products of k = 16 t + j for
 *            t = 0, 1, ... in turn (a block's first 16 values, then its last 16), then
 *            _mm512_reduce_add_ps. Here the decoded rows are read in that same order.
 *   AVX2     four accumulators of 8 lanes (chain i of lane j: k = 32 b + 8 i + j, b = 0, 1, ...),
 *            then hsum256((c0 + c1) + (c2 + c3)). Here x and the tile are stored chain by chain
 *            (each chain's values contiguous), and each chain is one sweep with its own register
 *            tile; the four chains' vectors are then added in the row kernel's order.
 *   portable 32 lanes (lane i: k = 32 b + i; a multiply, then an add), added by halves: the same
 *            loops over a decoded tile.
 * Threads split the weight rows by tiles, as the row kernel does; a tile's sums do not depend on
 * which thread or which other rows share the call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "isa.h"
#include "block_kinds.h"

#define QK 32
#include "block_decode.h"

/* rows from which outrider_qmatmul takes this kernel: where it took less time than the row kernel
 * at one and two threads (docs/kernels.md, The fill kernel): over SmolLM2's 4-bit layers
 * (FILL_ROWS), and over its Q8_0 output head (FILL_ROWS_Q8: a Q8_0 block is cheap to decode, so
 * the row kernel's decoding costs it less and the crossover comes later) */
#if defined(OUTRIDER_AVX512)
#define FILL_ROWS 32
#define FILL_ROWS_Q8 64
#elif defined(OUTRIDER_AVX2)
#define FILL_ROWS 10     /* since the row kernel shares a decoded block among 3-4 rows (6 before) */
#define FILL_ROWS_Q8 32  /* (48 before) */
#else
#define FILL_ROWS (1 << 30)  /* never: plain C's fill was slower at every count (1.07x at 64 rows) */
#define FILL_ROWS_Q8 (1 << 30)
#endif
#ifndef TILE_FLOATS
#define TILE_FLOATS (16 * 1024)
#endif  /* a thread's decoded tile: at most 192 KB (L2 on every CPU measured) */

#if defined(OUTRIDER_AVX512)
#define FR 4  /* rows of x a register tile takes */
#define FC 6  /* weight rows a register tile takes: 24 accumulators, 6 + 1 vectors beside them */
#elif defined(OUTRIDER_AVX2)
#define FR 4
#define FC 3  /* 12 accumulators, 3 + 1 vectors beside them (16 registers) */
#else
#define FR 4  /* as the portable row kernel's ROWS */
#define FC 1
#endif

#if defined(OUTRIDER_AVX512)
/* y[r * N + c] = x[r] . w[c] for r < rows, c < cols (constants after inlining), x [rows, K] and the
 * decoded tile w [cols, K]: the row kernel's accumulator and reduction for each element. */
static inline __attribute__((always_inline)) void fill_tile(int rows, int cols, const float *x, const float *w,
                                                            int64_t K, float *y, int64_t N) {
    __m512 acc[FR][FC];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[FC];
        for (int c = 0; c < cols; c++) wv[c] = _mm512_loadu_ps(w + c * K + k);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * K + k);
            for (int c = 0; c < cols; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) y[r * N + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(OUTRIDER_AVX2)

/* One chain (a quarter of K: K / 4 values, stored contiguously) of x [rows] against w [cols]
 * (row strides K), its 8-lane sums into out[r][c]. */
static inline __attribute__((always_inline)) void fill_chain(int rows, int cols, const float *x, const float *w,
                                                             int64_t K, __m256 out[FR][FC]) {
    __m256 acc[FR][FC];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K / 4; k += 8) {
        __m256 wv[FC];
        for (int c = 0; c < cols; c++) wv[c] = _mm256_loadu_ps(w + c * K + k);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < cols; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) out[r][c] = acc[r][c];
}

/* x and w stored chain by chain (`chained`): chain i of a row at offset i * K / 4. */
static inline __attribute__((always_inline)) void fill_tile(int rows, int cols, const float *x, const float *w,
                                                            int64_t K, float *y, int64_t N) {
    __m256 c0[FR][FC], c1[FR][FC], c2[FR][FC], c3[FR][FC];
    fill_chain(rows, cols, x, w, K, c0);
    fill_chain(rows, cols, x + K / 4, w + K / 4, K, c1);
    fill_chain(rows, cols, x + K / 2, w + K / 2, K, c2);
    fill_chain(rows, cols, x + 3 * K / 4, w + 3 * K / 4, K, c3);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            y[r * N + c] = hsum256(_mm256_add_ps(_mm256_add_ps(c0[r][c], c1[r][c]), _mm256_add_ps(c2[r][c], c3[r][c])));
}

/* A row of K values, chain by chain: out[i * K / 4 + 8 b + j] = v[32 b + 8 i + j]. */
static void chained(const float *v, int64_t K, float *out) {
    const int64_t quarter = K / 4;
    for (int64_t b = 0; b < K / QK; b++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + i * quarter + 8 * b, _mm256_loadu_ps(v + b * QK + 8 * i));
}

#else
/* The portable row kernel's loop (qmatmul.c's dot_rows), for up to FR rows of x and one decoded
 * weight row. */
static inline __attribute__((always_inline)) void fill_tile(int rows, int cols, const float *x, const float *w,
                                                            int64_t K, float *y, int64_t N) {
    (void)cols;
    float acc[FR][QK];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < QK; i++) acc[r][i] = 0.0f;
    for (int64_t b = 0; b < K / QK; b++) {
        const float *wb = w + b * QK;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * K + b * QK;
            float *a = acc[r];
            for (int i = 0; i < QK; i++) a[i] = a[i] + wb[i] * xr[i];
        }
    }
    for (int r = 0; r < rows; r++) {
        float *a = acc[r];
        for (int n = QK / 2; n > 0; n /= 2)
            for (int i = 0; i < n; i++) a[i] = a[i] + a[i + n];
        y[r * N] = a[0];
    }
}
#endif

/* Each (rows, cols) pair its own constant-size copy of fill_tile, so the accumulators stay in
 * registers. */
#define T(R, C) case R * 8 + C: fill_tile(R, C, x, w, K, y, N); break;
static inline __attribute__((always_inline)) void fill_group(int rows, int cols, const float *x, const float *w,
                                                             int64_t K, float *y, int64_t N) {
    switch (rows * 8 + cols) {
#if FR == 4 && FC == 6
        T(4, 6) T(4, 5) T(4, 4) T(4, 3) T(4, 2) T(4, 1) T(3, 6) T(3, 5) T(3, 4) T(3, 3) T(3, 2) T(3, 1)
        T(2, 6) T(2, 5) T(2, 4) T(2, 3) T(2, 2) T(2, 1) T(1, 6) T(1, 5) T(1, 4) T(1, 3) T(1, 2) T(1, 1)
#elif FR == 4 && FC == 3
        T(4, 3) T(4, 2) T(4, 1) T(3, 3) T(3, 2) T(3, 1) T(2, 3) T(2, 2) T(2, 1) T(1, 3) T(1, 2) T(1, 1)
#else
        T(4, 1) T(3, 1) T(2, 1) T(1, 1)
#endif
        default: break;
    }
}
#undef T

/* Weight rows a thread decodes at a time for rows of K values: a multiple of FC, at most
 * TILE_FLOATS values (at least FC rows). */
static int64_t tile_rows(int64_t K) {
    int64_t rows = TILE_FLOATS / K / FC * FC;
    return rows < FC ? FC : rows;
}

/* One function per kind, as qmatmul.c's. `xs`: x as the sweep reads it (AVX2: chained), `tiles`:
 * each thread's tile buffer and a spare row ((tile_rows(K) + 1) * K floats a thread). */
#define FILL(NAME, KIND)                                                                            \
    static void NAME(const float *xs, int64_t M, int64_t K, const uint8_t *q, const void *d,        \
                     const void *m, int64_t N, float *y, float *tiles, int threads) {               \
        const int64_t blocks = K / QK;                                                              \
        const int64_t qstride = BASE(KIND) == KIND_Q8_0 || BASE(KIND) == KIND_Q8_16 ? QK : QK / 2; \
        const int64_t drow = scale_row_bytes(KIND, blocks), mrow = min_row_bytes(KIND, blocks);    \
        const int64_t per = tile_rows(K), count = (N + per - 1) / per;                             \
        _Pragma("omp parallel num_threads(threads)")                                                \
        {                                                                                           \
            float *w = tiles + (int64_t)omp_get_thread_num() * (per + 1) * K;                                     \
            _Pragma("omp for schedule(static)")                                                     \
            for (int64_t t = 0; t < count; t++) {                                                   \
                const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;                       \
                for (int64_t n = n0; n < n1; n++)                                                   \
                    decode_tile_row(KIND, K, q + n * blocks * qstride, qstride,                     \
                                    (const uint8_t *)d + n * drow,                                  \
                                    BASE(KIND) == KIND_Q4_1 ? (const uint8_t *)m + n * mrow : 0,    \
                                    w + (n - n0) * K, w + per * K);                                 \
                for (int64_t r = 0; r < M; r += FR) {                                               \
                    const int rows = M - r < FR ? (int)(M - r) : FR;                                \
                    for (int64_t n = n0; n < n1; n += FC) {                                         \
                        const int cols = n1 - n < FC ? (int)(n1 - n) : FC;                          \
                        fill_group(rows, cols, xs + r * K, w + (n - n0) * K, K, y + r * N + n, N); \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }
/* A weight row decoded into the tile, in the order the sweep reads it (`spare`: K floats of the
 * thread's own). */
static inline __attribute__((always_inline)) void decode_tile_row(int kind, int64_t K, const uint8_t *q,
                                                                  int64_t qstride, const void *d, const void *m,
                                                                  float *out, float *spare) {
#if defined(OUTRIDER_AVX2) && !defined(OUTRIDER_AVX512)
    decode_row(kind, K, q, qstride, d, m, spare);
    chained(spare, K, out);
#else
    (void)spare;
    decode_row(kind, K, q, qstride, d, m, out);
#endif
}

#define DEFINE(NAME, KIND) FILL(fill_##NAME, KIND)
KINDS(DEFINE)

/* The entry point (qmatmul.c's outrider_qmatmul calls it from FILL_ROWS rows; ctypes for the
 * tests): arguments as outrider_qmatmul's, no LANES kinds. 0; -1 for arguments it cannot take;
 * -2 where its buffers could not be allocated (the caller takes the row kernel). */
int outrider_qmatmul_fill(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                          const void *m, int64_t N, float *y, int threads) {
    if (!kind_known(kind, m, K) || (kind & LANES) || M < 0 || N < 0 || threads < 1) return -1;
    if (M == 0 || N == 0) return 0;
    float *tiles = malloc((size_t)threads * (size_t)(tile_rows(K) + 1) * (size_t)K * sizeof(float));
    if (!tiles) return -2;
    const float *xs = x;
    float *chain = 0;
#if defined(OUTRIDER_AVX2) && !defined(OUTRIDER_AVX512)
    chain = malloc((size_t)M * (size_t)K * sizeof(float));
    if (!chain) {
        free(tiles);
        return -2;
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t r = 0; r < M; r++) chained(x + r * K, K, chain + r * K);
    xs = chain;
#endif
#define CALL(NAME, KIND) case KIND: fill_##NAME(xs, M, K, q, d, m, N, y, tiles, threads); break;
    switch (kind) { KINDS(CALL) default: break; }
#undef CALL
    free(chain);
    free(tiles);
    return 0;
}

/* The row count from which outrider_qmatmul takes this kernel for a weight of `kind` (measured:
 * docs/kernels.md, The fill kernel); outrider_fill_rows_set(n) puts another for every kind (n < 1:
 * the build's again), for A/B timing: every path gives the same bits. */
static int fill_rows = 0;
void outrider_fill_rows_set(int n) { fill_rows = n; }
int outrider_fill_rows(int kind) {
    if (fill_rows > 0) return fill_rows;
    return BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16 ? FILL_ROWS_Q8 : FILL_ROWS;
}
