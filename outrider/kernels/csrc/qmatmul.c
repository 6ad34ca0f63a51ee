/* y[M, N] = x[M, K] . W[N, K]^T for a weight W kept in GGUF blocks (Q8_0, Q4_0, Q4_1), float32.
 *
 * Built at first use by kernels/native.py (cc -O3 -ffp-contract=off -fopenmp and one variant's
 * instruction-set flags), once per variant: an AVX-512 path, an AVX2 path (FMA, F16C), and a
 * portable one in plain C (any CPU: ARM, older x86) that the compiler vectorizes for its target's
 * baseline (isa.h says which a build compiles).
 *
 * Layout (as quant.QuantBlocks holds it): 32 values a block along K.
 *   q8_0: q int8 [N, K]                     w = d * q
 *   q4_0: q uint8 [N, K / 2]                w = d * (q - 8)
 *   q4_1: q uint8 [N, K / 2], m             w = d * q + m
 *   q8_16: q int8 [N, K]                    w = d * q, one d per 16 values (Q6_K kept exactly)
 *   d (and m): [N, K / 32] ([N, K / 16] for q8_16), float16 as GGUF keeps them (kind + HALF: widened
 *   once a block, exactly) or float32 (q8_16, and a K-quant's re-expressed scales, which are not
 *   float16 values). A Q4 block's 16 bytes hold value j in the low nibble of byte j and value j + 16
 *   in its high nibble.
 *
 * Exactness. Each weight value is computed with the reference's own operations (a multiply,
 * then an add; no contraction), so it is the value quant.dequantize gives. Each y[r, n] is one
 * fixed sequence of float32 operations over x[r] and W[n]: per block, fused multiply-adds into
 * the same accumulators in the same order, then one fixed reduction. Which other rows share the
 * call (M), how rows are grouped to share a decoded block, and how many threads split N change
 * nothing: a row's result is bit-identical whether it is decoded alone or verified among k
 * others. That is what makes greedy speculative output equal autoregressive output here by
 * construction, not only within rounding.
 *
 * Speed. Memory-bound at one row, bound by float32 multiply-adds at 8: each block is read once
 * and decoded in registers once for up to ROWS rows of x (a Q4 block as a lookup of its 16 possible
 * values), and each 16 values of x are loaded once for up to COLS weight rows (a register tile of
 * 16 accumulators); threads split N (OpenMP: torch's own libgomp, with torch's thread count).
 * The three paths sum a row's products in different orders (AVX-512: 16 lanes; AVX2: 32; portable:
 * 32, reduced by halves), so their results may differ in the last bits; within one library every row is the same bits.
 * From outrider_fill_rows(kind) rows of x on (a prefill), outrider_qmatmul hands the product to
 * qmatmul_fill.c, which decodes a tile of weight rows once for all rows and gives the same bits.
 * Measured (a k-token verify against a 1-token step): docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md,
 * Verify cost.
 */
#include <stdint.h>

#include "isa.h"
#include "block_kinds.h"

#define QK 32             /* values per block */
#define TILE_N 16         /* output columns a thread takes at a time */

#include "block_decode.h"

#if defined(OUTRIDER_AVX512)
/* ---- AVX-512: a block is two vectors of 16 values; two accumulators per row ---------------- */
#define ROWS 8
#define COLS 4  /* weight rows a register tile takes at most */

/* y[r * ystride + c] = x[r] . W[c] for r < rows, c < cols (constants after inlining): a register
 * tile of rows x cols accumulators. Each block of each weight row is decoded once for all `rows`
 * rows of x, and each 16 values of x are loaded once for all `cols` weight rows, so at 4-8 rows the
 * tile is bound neither by the loads of x (one per multiply-add when cols is 1) nor by decoding.
 * Every y element is one accumulator: per block a multiply-add of the block's first 16 values,
 * then of its last 16, then one reduction; the same sequence whatever the tile. */
static inline __attribute__((always_inline)) void dot_tile(int kind, int rows, int cols, const float *x, int64_t K,
                                                           const uint8_t *q, int64_t qrow, int64_t qstride,
                                                           const void *d, int64_t drow, const void *m,
                                                           int64_t mrow, float *y, int64_t ystride) {
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t blocks = K / QK;
    /* float16 or factored scales: a window of blocks' widened at once (the same values; at one or
     * two rows of x a block's own widening would cost about as much as its multiply-adds) */
    const int wide = (kind & (HALF | FACTORED)) != 0;
    /* the window's scales and mins, stored: a block's are broadcast from memory (a load, where
     * picking them out of a register would take the shuffle port the decoding needs) */
    float dw[COLS][16] __attribute__((aligned(64))), mw[COLS][16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < blocks; b++) {
        __m512 w0[COLS], w1[COLS];
        if (wide && (b & (WINDOW(kind) - 1)) == 0)
            for (int c = 0; c < cols; c++) {
                __m512 dv, mv = _mm512_setzero_ps();
                if (kind & FACTORED) {
                    widen_factored(kind, (const uint8_t *)d + c * drow, b, blocks, &dv, &mv);
                } else {
                    dv = widen16((const uint8_t *)d + c * drow, b, blocks);
                    if (BASE(kind) == KIND_Q4_1) mv = widen16((const uint8_t *)m + c * mrow, b, blocks);
                }
                _mm512_store_ps(dw[c], dv);
                _mm512_store_ps(mw[c], mv);
            }
        for (int c = 0; c < cols; c++) {  /* weight row c: codes, scales, mins */
            const uint8_t *qc = q + c * qrow, *dc = (const uint8_t *)d + c * drow;
            const uint8_t *mc = m ? (const uint8_t *)m + c * mrow : 0;
            prefetch_ahead(kind, b, qc + b * qstride, dc + scale_offset(kind, b), mc ? mc + min_offset(kind, b) : 0);
            if (wide && BASE(kind) == KIND_Q8_16) {  /* FACTORED q8_16: the block's two groups */
                const int j = (int)(b & 7) * 2;
                decode_with(kind, qc + b * qstride, _mm512_set1_ps(dw[c][j]), _mm512_set1_ps(dw[c][j + 1]),
                            _mm512_setzero_ps(), &w0[c], &w1[c]);
            } else if (wide) {
                const __m512 dd = _mm512_set1_ps(dw[c][b & 15]);
                decode_with(kind, qc + b * qstride, dd, dd,
                            BASE(kind) == KIND_Q4_1 ? _mm512_set1_ps(mw[c][b & 15]) : _mm512_setzero_ps(),
                            &w0[c], &w1[c]);
            } else {
                decode(kind, qc + b * qstride, dc, mc, b, &w0[c], &w1[c]);
            }
        }
        const float *xb = x + b * QK;
        for (int r = 0; r < rows; r++) {
            __m512 x0 = _mm512_loadu_ps(xb + r * K), x1 = _mm512_loadu_ps(xb + r * K + 16);
            for (int c = 0; c < cols; c++) {
                acc[r][c] = _mm512_fmadd_ps(w0[c], x0, acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(w1[c], x1, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) y[r * ystride + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(OUTRIDER_AVX2)
/* ---- AVX2: a block is four vectors of 8 values; four accumulators per row ------------------ */
/* Up to four rows share a decoded block (a verify of 3 or 4 tokens decodes each block once): each
 * vector of 8 values is decoded just before its multiply-adds (the values `decode` gives, with its
 * operations), so that one decoded vector and the block's bytes are all that is live beside the
 * 4 x rows accumulators, the constants read from memory. Three rows a group cost the least a row
 * (16 registers exactly; four spill a few accumulators), so NEXT_ROWS takes groups of 3, one of 4
 * where 3s would leave a single row, and 2 for the rest (measured: docs/kernels.md, The row kernel). */
#define ROWS 4
#define NEXT_ROWS(left) ((left) % 3 == 1 && (left) >= 4 ? 4 : (left) < 3 ? (int)(left) : 3)

/* acc[r][i] += w . x[r] (values 8i..8i+7 of the block at xb) for r < rows. */
#define FMA_ROWS(i, w)                                                                              \
    for (int r = 0; r < rows; r++) acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + r * K + 8 * (i)), acc[r][i])

static inline __attribute__((always_inline)) void dot_rows(int kind, int rows, const float *x, int64_t K,
                                                           const uint8_t *q, int64_t qstride,
                                                           const void *d, const void *m,
                                                           float *y, int64_t ystride) {
    __m256 acc[ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    const int64_t blocks = K / QK;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * qstride;
        prefetch_ahead(kind, b, qb, (const uint8_t *)d + scale_offset(kind, b),
                       m ? (const uint8_t *)m + min_offset(kind, b) : 0);
        const float *xb = x + b * QK;
        const __m256 dd = _mm256_set1_ps(scale_at(kind, d, b * SCALES(kind)));
        if (BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16) {
            const __m256 d1 = BASE(kind) == KIND_Q8_16 ? _mm256_set1_ps(scale_at(kind, d, 2 * b + 1)) : dd;
            for (int i = 0; i < 4; i++) {
                const __m256 w = _mm256_mul_ps(i >= 2 ? d1 : dd,
                                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * i)))));
                FMA_ROWS(i, w);
            }
            continue;
        }
        const __m256 mm = _mm256_set1_ps(BASE(kind) == KIND_Q4_1 ? min_at(kind, m, b) : 0.0f);
        for (int h = 0; h < 2; h++) {  /* bytes 8h..8h+7: values 8h.. (low nibbles), 16 + 8h.. (high) */
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * h)));
            for (int hi = 0; hi < 2; hi++) {
                const __m256 v = _mm256_cvtepi32_ps(hi ? _mm256_srli_epi32(a, 4) : _mm256_and_si256(a, _mm256_set1_epi32(15)));
                const __m256 w = BASE(kind) == KIND_Q4_0 ? _mm256_mul_ps(dd, _mm256_sub_ps(v, _mm256_set1_ps(8.0f)))
                                                         : _mm256_add_ps(_mm256_mul_ps(dd, v), mm);
                FMA_ROWS(2 * hi + h, w);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        y[r * ystride] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                               _mm256_add_ps(acc[r][2], acc[r][3])));
}
#undef FMA_ROWS
#else
/* ---- portable: a block is 32 floats; 32 lanes of accumulators per row ----------------------- */
#define ROWS 4

/* y[r * ystride] = x[r] . W for r < rows: lane i takes the products of value i of each block in
 * turn (a multiply, then an add), then the 32 lanes are added by a fixed tree (halves, then
 * halves of those). Plain loops over the lanes, which the compiler turns into its target's
 * vectors (SSE2, NEON). */
static inline __attribute__((always_inline)) void dot_rows(int kind, int rows, const float *x, int64_t K,
                                                           const uint8_t *q, int64_t qstride,
                                                           const void *d, const void *m,
                                                           float *y, int64_t ystride) {
    float acc[ROWS][QK];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < QK; i++) acc[r][i] = 0.0f;
    const int64_t blocks = K / QK;
    for (int64_t b = 0; b < blocks; b++) {
        float w[QK];
        prefetch_ahead(kind, b, q + b * qstride, (const uint8_t *)d + scale_offset(kind, b),
                       m ? (const uint8_t *)m + min_offset(kind, b) : 0);
        decode(kind, q + b * qstride, d, m, b, w);
        const float *xb = x + b * QK;
        for (int r = 0; r < rows; r++) {
            const float *xr = xb + r * K;
            float *a = acc[r];
            for (int i = 0; i < QK; i++) a[i] = a[i] + w[i] * xr[i];
        }
    }
    for (int r = 0; r < rows; r++) {
        float *a = acc[r];
        for (int n = QK / 2; n > 0; n /= 2)
            for (int i = 0; i < n; i++) a[i] = a[i] + a[i + n];
        y[r * ystride] = a[0];
    }
}
#endif

#define DEQUANTIZE(NAME, KIND)                                                                      \
    static void NAME(int64_t K, const uint8_t *q, const void *d, const void *m, int64_t n0,         \
                     int64_t n1, float *out, int threads) {                                         \
        const int64_t blocks = K / QK;                                                              \
        const int64_t qstride = BASE(KIND) == KIND_Q8_0 || BASE(KIND) == KIND_Q8_16 ? QK : QK / 2; \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int64_t n = n0; n < n1; n++)                                                           \
            decode_row(KIND, K, q + n * blocks * qstride, qstride,                                  \
                       (const uint8_t *)d + n * scale_row_bytes(KIND, blocks),                      \
                       BASE(KIND) == KIND_Q4_1 ? (const uint8_t *)m + n * min_row_bytes(KIND, blocks) : 0, \
                       out + (n - n0) * K);                                                         \
    }

/* The same values rounded to bfloat16 (to nearest, ties to even: torch's float -> bfloat16), two
 * bytes each, for a bfloat16 GEMM (a prefill on a CPU with AMX): half the bytes written, no
 * float32 copy. AVX-512 builds only (every CPU with AMX has it). */
#if defined(OUTRIDER_AVX512)
static inline __attribute__((always_inline)) __m256i bf16_of(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#define DEQUANTIZE_BF16(NAME, KIND)                                                                 \
    static void NAME(int64_t K, const uint8_t *q, const void *d, const void *m, int64_t n0,         \
                     int64_t n1, uint16_t *out, int threads) {                                      \
        const int64_t blocks = K / QK;                                                              \
        const int64_t qstride = BASE(KIND) == KIND_Q8_0 || BASE(KIND) == KIND_Q8_16 ? QK : QK / 2; \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int64_t n = n0; n < n1; n++) {                                                         \
            const uint8_t *qn = q + n * blocks * qstride;                                           \
            const uint8_t *dn = (const uint8_t *)d + n * scale_row_bytes(KIND, blocks);             \
            const uint8_t *mn = BASE(KIND) == KIND_Q4_1 ? (const uint8_t *)m + n * min_row_bytes(KIND, blocks) : 0; \
            uint16_t *o = out + (n - n0) * K;                                                       \
            for (int64_t b = 0; b < blocks; b++) {                                                  \
                __m512 w0, w1;                                                                      \
                decode(KIND, qn + b * qstride, dn, mn, b, &w0, &w1);                                \
                _mm256_storeu_si256((__m256i *)(o + b * QK), bf16_of(w0));                          \
                _mm256_storeu_si256((__m256i *)(o + b * QK + 16), bf16_of(w1));                     \
            }                                                                                       \
        }                                                                                           \
    }

#endif


#if defined(OUTRIDER_AVX512)
/* Rows r..r+rows of x against weight rows n..n+cols (rows <= ROWS, cols <= COLS): each pair its
 * own constant-size copy of dot_tile, so the accumulators stay in registers (16 at most). */
#define TILE(R, C) case R * 8 + C: dot_tile(kind, R, C, x, K, q, qrow, qstride, d, drow, m, mrow, y, N); break;
static inline __attribute__((always_inline)) void dot_group(int kind, int rows, int cols, const float *x, int64_t K,
                                                            const uint8_t *q, int64_t qrow, int64_t qstride,
                                                            const void *d, int64_t drow, const void *m,
                                                            int64_t mrow, float *y, int64_t N) {
    switch (rows * 8 + cols) {
        TILE(8, 2) TILE(7, 2) TILE(6, 2) TILE(5, 2) TILE(4, 4) TILE(3, 4) TILE(2, 4) TILE(1, 4)
        TILE(8, 1) TILE(7, 1) TILE(6, 1) TILE(5, 1) TILE(4, 1) TILE(3, 1) TILE(2, 1) TILE(1, 1)
        default: break;
    }
}
#undef TILE
/* weight rows a tile takes beside `rows` rows of x: 16 accumulators */
#define TILE_COLS(rows) ((rows) <= 4 ? 4 : 2)
#else
/* Rows r..r+rows of x against one weight row (rows <= ROWS, each count its own constant-size
 * copy of dot_rows, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void dot_group(int kind, int rows, int cols, const float *x, int64_t K,
                                                            const uint8_t *q, int64_t qrow, int64_t qstride,
                                                            const void *d, int64_t drow, const void *m,
                                                            int64_t mrow, float *y, int64_t N) {
    (void)cols; (void)qrow; (void)drow; (void)mrow;
    switch (rows) {
#if ROWS >= 4
        case 4: dot_rows(kind, 4, x, K, q, qstride, d, m, y, N); break;
#endif
#if ROWS >= 3
        case 3: dot_rows(kind, 3, x, K, q, qstride, d, m, y, N); break;
#endif
        case 2: dot_rows(kind, 2, x, K, q, qstride, d, m, y, N); break;
        case 1: dot_rows(kind, 1, x, K, q, qstride, d, m, y, N); break;
        default: break;
    }
}
#define TILE_COLS(rows) 1
#endif

#ifndef NEXT_ROWS  /* rows of x the next group takes, of `left` */
#define NEXT_ROWS(left) ((left) < ROWS ? (int)(left) : ROWS)
#endif

/* One function per kind (the kind a constant inside it, so each decode is specialized). */
#define MATMUL(NAME, KIND)                                                                          \
    static void NAME(const float *x, int64_t M, int64_t K, const uint8_t *q, const void *d,         \
                     const void *m, int64_t N, float *y, int threads) {                             \
        const int64_t blocks = K / QK;                                                              \
        const int64_t qstride = BASE(KIND) == KIND_Q8_0 || BASE(KIND) == KIND_Q8_16 ? QK : QK / 2; /* code bytes a block */ \
        const int64_t drow = scale_row_bytes(KIND, blocks), mrow = min_row_bytes(KIND, blocks); /* a weight row's */ \
        const int64_t tiles = (N + TILE_N - 1) / TILE_N;                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int64_t t = 0; t < tiles; t++) {                                                       \
            const int64_t n1 = (t + 1) * TILE_N < N ? (t + 1) * TILE_N : N;                         \
            /* a group of rows of x stays in L1 while the tile's weight rows (also in L1) pass */   \
            for (int64_t r = 0, rows; r < M; r += rows) {                                           \
                rows = NEXT_ROWS(M - r);                                                            \
                const int cols = TILE_COLS(rows);                                                   \
                for (int64_t n = t * TILE_N; n < n1;) {                                             \
                    const int c = n + cols <= n1 ? cols : 1;                                        \
                    dot_group(KIND, rows, c, x + r * K, K, q + n * blocks * qstride, blocks * qstride, qstride, \
                              (const uint8_t *)d + n * drow, drow,                                  \
                              BASE(KIND) == KIND_Q4_1 ? (const uint8_t *)m + n * mrow : 0, mrow,    \
                              y + r * N + n, N);                                                    \
                    n += c;                                                                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

#define DEFINE(NAME, KIND) MATMUL(matmul_##NAME, KIND) DEQUANTIZE(dequantize_##NAME, KIND) DEFINE_BF16(NAME, KIND)
#if defined(OUTRIDER_AVX512)
#define DEFINE_BF16(NAME, KIND) DEQUANTIZE_BF16(dequantize_bf16_##NAME, KIND)
#else
#define DEFINE_BF16(NAME, KIND)
#endif
KINDS(DEFINE)

static int known(int kind, const void *m, int64_t K) {  /* 0: arguments the kernel takes */
    return kind_known(kind, m, K) ? 0 : -1;
}

/* The entry point (ctypes). kind: 0 q8_0, 1 q4_0, 2 q4_1, 3 q8_16, plus HALF (4) for float16
 * scales and mins (not q8_16) or FACTORED (8, q4_1 and q8_16: block_kinds.h); plus LANES (16): q is a
 * weight packed by qmatmul_i8.c, multiplied with int8 activations there (d and m unused); K a multiple of 32 (256
 * FACTORED); m only for q4_1 (FACTORED: d again). x, y contiguous float32 [M, K] and [M, N]; d (and
 * m) float32 or float16 [N, K / 32] ([N, K / 16] for q8_16), or FACTORED's bytes; `threads`:
 * the OpenMP team (torch's count: a thread other than the one that set it would otherwise get
 * OpenMP's default, every core). Returns 0, or -1 for arguments it cannot take. */
int outrider_i8_matmul(int kind, const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y,
                          int threads);

int outrider_qmatmul_fill(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                          const void *m, int64_t N, float *y, int threads);
int outrider_fill_rows(int kind);

/* As outrider_qmatmul, by a given path: 0 the faster for M (the row kernel below
 * outrider_fill_rows(kind) rows, qmatmul_fill.c from there), 1 the row kernel, 2 qmatmul_fill.c. Every
 * path gives the same bits (qmatmul_fill.c); the tests compare them. */
int outrider_qmatmul_path(int path, int kind, const float *x, int64_t M, int64_t K, const void *q,
                          const void *d, const void *m, int64_t N, float *y, int threads) {
    if (kind >= 0 && (kind & LANES)) return outrider_i8_matmul(kind, x, M, K, q, N, y, threads);  /* qmatmul_i8.c */
    if (known(kind, m, K) || M < 0 || N < 0 || threads < 1 || path < 0 || path > 2) return -1;
    if (path == 2 || (path == 0 && M >= outrider_fill_rows(kind))) {
        const int status = outrider_qmatmul_fill(kind, x, M, K, q, d, m, N, y, threads);
        if (status != -2) return status;  /* -2: no memory for its tiles: the row kernel */
    }
#define CALL(NAME, KIND) case KIND: matmul_##NAME(x, M, K, q, d, m, N, y, threads); return 0;
    switch (kind) { KINDS(CALL) default: return -1; }  /* one specialized loop per kind */
#undef CALL
}

int outrider_qmatmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                     const void *m, int64_t N, float *y, int threads) {
    return outrider_qmatmul_path(0, kind, x, M, K, q, d, m, N, y, threads);
}

/* Weight rows n0..n1 as float32 values into out [n1 - n0, K]: 0, or -1 for arguments it cannot take. */
int outrider_dequantize(int kind, int64_t K, const void *q, const void *d, const void *m, int64_t n0,
                        int64_t n1, float *out, int threads) {
    if (known(kind, m, K) || n0 < 0 || n1 < n0 || threads < 1) return -1;
#define CALL(NAME, KIND) case KIND: dequantize_##NAME(K, q, d, m, n0, n1, out, threads); return 0;
    switch (kind) { KINDS(CALL) default: return -1; }
#undef CALL
}

/* As outrider_dequantize, into bfloat16 (uint16 bits) [n1 - n0, K]; -1 also where the build has no
 * AVX-512. */
int outrider_dequantize_bf16(int kind, int64_t K, const void *q, const void *d, const void *m, int64_t n0,
                             int64_t n1, uint16_t *out, int threads) {
#if defined(OUTRIDER_AVX512)
    if (known(kind, m, K) || n0 < 0 || n1 < n0 || threads < 1) return -1;
#define CALL(NAME, KIND) case KIND: dequantize_bf16_##NAME(K, q, d, m, n0, n1, out, threads); return 0;
    switch (kind) { KINDS(CALL) default: return -1; }
#undef CALL
#else
    (void)kind; (void)K; (void)q; (void)d; (void)m; (void)n0; (void)n1; (void)out; (void)threads;
    return -1;
#endif
}

/* The rows per decoded block this build uses (the Python side reports it). */
int outrider_qmatmul_rows(void) { return ROWS; }
