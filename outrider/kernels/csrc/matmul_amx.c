/* y[M, N] = x[M, K] . W[N, K]^T for a prompt's prefill (many rows), W in the blocks of qmatmul.c,
 * on the AMX tile unit, with every product exact and float32 sums.
 *
 * Why exact. A block's value is d * c (+ m), c an integer code: 0..15 (Q4_1), -8..7 (Q4_0) or
 * -128..127 (Q8_0), each exactly a bfloat16. x is split into three bfloat16 parts, x = x1 + x2 + x3
 * exactly (x1 = x rounded to bfloat16, x2 the rest rounded, x3 what is left: 8 + 8 + 8 bits of
 * float32's 24; for |x| >= 2^-110, below which the unit reads a part as zero). A bfloat16 times a
 * bfloat16 is exact in float32, so the tile unit's dot products P = sum c * (x1 + x2 + x3) over a
 * block are float32 sums of exact products, and the block adds d * P (+ m * sum x, Q4_1) to the
 * row's float32 sum: the dot product of the float32 values, summed in another order than a float32
 * GEMM's, not rounded through bfloat16 (that is the lossy bfloat16 prefill, quant_linear.py).
 * Each y[r, n] depends on x[r] and W[n] only (not on M, on the other rows, or on the threads).
 *
 * Why fast. A tile product (16 rows x 32 values x 16 columns) is one instruction; three of them
 * (the parts) per block still do ~5x the multiply-adds a cycle of two AVX-512 FMA ports. What binds
 * it here is the vector unit's share: scaling each group's 16 x 16 sums and building the weight
 * tiles. Measured: docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Prefill.
 *
 * Layout of one call: x's parts in tiles (split_row: each 16 rows x one group contiguous, rows
 * padded to 16 with zeros); threads take blocks of up to NC pairs of 16-row weight blocks (the same
 * pairs every chunk); K is walked in chunks of KC values: per chunk a block's weight pairs are
 * decoded once into tiles of the unit's pair-interleaved layout (16 x 16 byte transposes), then for
 * each 16 rows of x (their part tiles for the chunk stay in L1 while the pairs pass) and each
 * weight block: per group the three part products into one accumulator tile (tiles 0 and 1 taken
 * in turn, so one group's sums are stored and scaled while the unit computes the next), scaled by
 * the group's scales into 16 float32 row sums held in registers, added into y at the chunk's end.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int outrider_amx_ok(void);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "block_kinds.h"

#define KC 256          /* values of K a chunk: x's three part tiles of 16 rows for it (24 KB) stay in L1 */
#define NC 8            /* weight pairs (of 16-row blocks) a thread takes at a time */
#define MAX_ROWS 1024   /* rows a call takes (the caller splits larger prefills) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* A group is the qk values (32, or 16 for q8_16) that share a scale. Tiles 0-3: float32 sums
 * [16 rows][16 columns]; 4: an x part [16 rows][qk values]; 6-7: a weight block [qk / 2 value
 * pairs][16 columns x 2]. */
static void configure(int qk) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 6 ? qk / 2 : 16;
        c.colsb[t] = t == 4 ? qk * 2 : 64;
    }
    _tile_loadconfig(&c);
}

static int granted;  /* 0: not asked yet, 1: the kernel lets this process use the tiles, -1: not */

int outrider_amx_ok(void) {
    if (!granted) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return granted == 1;
}

static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  /* nearest, ties even */
static inline __m512 from_bf16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* 16 values of x as three bfloat16 parts, a + b + c = x exactly. */
static inline void split16(__m512 v, __m256i part[3]) {
    part[0] = to_bf16(v);
    const __m512 r = _mm512_sub_ps(v, from_bf16(part[0]));  /* exact: the bits part 0 does not hold */
    part[1] = to_bf16(r);
    part[2] = to_bf16(_mm512_sub_ps(r, from_bf16(part[1])));  /* exact, and exactly a bfloat16 */
}

/* Row r of x (zeros past M) into its three parts, each where its tiles are: part p of rows
 * 16b..16b+15, group g, is the tile at xs + p * Mp * K + b * 16 * K + g * 16 * qk (rows 2 qk bytes
 * apart: rows K * 2 bytes apart would share a few L1 sets); dst[p] points at row r's place in its
 * group-0 tile. Within a group the values are in PAIR ORDER, x[0], x[h], x[1], x[h + 1], ...,
 * x[h - 1], x[2h - 1] (h = qk / 2), the order decode_block16 pairs the codes in. And (Q4_1) the
 * row's group sums s[g]. `parts` 1: only x rounded to bfloat16 (a drafter's lossy prefill). */
static void split_row(const float *x, int64_t K, int qk, int parts, int have, uint16_t *const dst[3], float *s) {
    const __m512i order32 = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m256i order16 = _mm256_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    for (int64_t k = 0; k < K; k += qk) {
        const int64_t at = k / qk * 16 * qk;
        __m256i lo[3], hi[3];
        const __m512 a = have ? _mm512_loadu_ps(x + k) : _mm512_setzero_ps();
        const __m512 b = have && qk == 32 ? _mm512_loadu_ps(x + k + 16) : _mm512_setzero_ps();
        split16(a, lo);
        if (qk == 32) split16(b, hi);
        if (s)  /* Q4_1's group sum, of the values the products see (x, or x rounded: one part) */
            s[k / 32] = _mm512_reduce_add_ps(parts == 3 ? _mm512_add_ps(a, b)
                                                        : _mm512_add_ps(from_bf16(lo[0]), from_bf16(hi[0])));
        for (int p = 0; p < parts; p++) {
            if (qk == 32) {
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1);
                _mm512_storeu_si512((__m512i *)(dst[p] + at), _mm512_permutexvar_epi16(order32, both));
            } else {
                _mm256_storeu_si256((__m256i *)(dst[p] + at), _mm256_permutexvar_epi16(order16, lo[p]));
            }
        }
    }
}

/* Byte j of 16 rows (16 bytes from rows[r] each): out[j % 4] lane j / 4 holds byte j of rows 0..15,
 * in row order. */
static inline void transpose_bytes(const uint8_t *const rows[16], __m512i out[4]) {
    /* within 4 rows (64 bytes), bring byte j of the 4 rows together: output byte 4j + r <- 16r + j */
    const __m512i gather4 = _mm512_set_epi8(
        63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26, 10,
        57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
        51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    __m512i z[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)rows[4 * i]));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[4 * i + 1]), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[4 * i + 2]), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[4 * i + 3]), 3);
        z[i] = _mm512_permutexvar_epi8(gather4, v);  /* dword j: byte j of rows 4i..4i+3 */
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);  /* lane L: byte 4L of rows 0..15 */
    out[1] = _mm512_unpackhi_epi64(t0, t2);  /* 4L + 1 */
    out[2] = _mm512_unpacklo_epi64(t1, t3);  /* 4L + 2 */
    out[3] = _mm512_unpackhi_epi64(t1, t3);  /* 4L + 3 */
}

static inline __m128i byte_column(const __m512i t[4], int j) {  /* byte j of the 16 rows */
    switch (j >> 2) {  /* the lane index must be a constant */
        case 0: return _mm512_extracti32x4_epi32(t[j & 3], 0);
        case 1: return _mm512_extracti32x4_epi32(t[j & 3], 1);
        case 2: return _mm512_extracti32x4_epi32(t[j & 3], 2);
        default: return _mm512_extracti32x4_epi32(t[j & 3], 3);
    }
}

/* Two vectors of 16 small integers (dwords) as 16 pairs of bfloat16, lo in the low half (exact:
 * at most 8 significant bits, so a float's top 16 bits are its bfloat16). */
static inline __m512i bf16_pairs(__m512i lo, __m512i hi) {
    const __m512i a = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(lo)), 16);
    const __m512i b = _mm512_and_si512(_mm512_castps_si512(_mm512_cvtepi32_ps(hi)), _mm512_set1_epi32((int)0xFFFF0000));
    return _mm512_or_si512(a, b);
}

/* Weight rows n0..n0+15 (those < N; zeros past it), groups g0..g1, into tiles B[g - g0][qk / 2][16]
 * (uint32 pairs) and their scales (and mins) ds[g - g0][16], ms[g - g0][16]. Tile row j holds, for
 * each weight row, the pair (code j, code j + qk / 2): in a Q4 block both are byte j's nibbles, so
 * a tile is one 16 x 16 byte transpose (x's parts are in the same PAIR ORDER). */
static void decode_block16(int kind, int qk, const uint8_t *q, const void *d, const void *m, int64_t K, int64_t N,
                           int64_t n0, int64_t g0, int64_t g1, uint32_t *B, float *ds, float *ms) {
    const int64_t groups = K / qk, qstride = BASE(kind) == KIND_Q8_0 || BASE(kind) == KIND_Q8_16 ? qk : qk / 2;
    const int64_t drow = scale_row_bytes(kind, K / 32), mrow = min_row_bytes(kind, K / 32);
    static const uint8_t zeros[32];
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(BASE(kind) == KIND_Q4_0 ? 8 : 0);
    for (int64_t g = g0; g < g1; g++) {
        uint32_t *b = B + (g - g0) * 8 * qk;
        const uint8_t *rows[16], *highs[16];
        for (int r = 0; r < 16; r++) {
            const int64_t n = n0 + r;
            const int have = n < N;
            rows[r] = have ? q + (n * groups + g) * qstride : zeros;
            highs[r] = rows[r] + 16;  /* Q8_0: codes 16..31 */
            ds[(g - g0) * 16 + r] = have ? scale_at(kind, (const uint8_t *)d + n * drow, g) : 0.0f;
            if (ms) ms[(g - g0) * 16 + r] = have ? min_at(kind, (const uint8_t *)m + n * mrow, g) : 0.0f;
        }
        __m512i t[4], h[4];
        transpose_bytes(rows, t);
        if (BASE(kind) == KIND_Q8_0) transpose_bytes(highs, h);
        for (int j = 0; j < qk / 2; j++) {
            __m512i lo, hi;
            if (BASE(kind) == KIND_Q8_0) {
                lo = _mm512_cvtepi8_epi32(byte_column(t, j));
                hi = _mm512_cvtepi8_epi32(byte_column(h, j));
            } else if (BASE(kind) == KIND_Q8_16) {  /* a group's 16 codes are bytes 0..15 */
                lo = _mm512_cvtepi8_epi32(byte_column(t, j));
                hi = _mm512_cvtepi8_epi32(byte_column(t, j + 8));
            } else {
                const __m512i all = _mm512_cvtepu8_epi32(byte_column(t, j));
                lo = _mm512_sub_epi32(_mm512_and_si512(all, low), eight);
                hi = _mm512_sub_epi32(_mm512_srli_epi32(all, 4), eight);
            }
            _mm512_store_si512((__m512i *)(b + j * 16), bf16_pairs(lo, hi));
        }
    }
}

/* One group: x's 16-row block (parts tiles, `part` elements apart) against one weight block into
 * tile C, stored to c[256]. */
#define GROUP1(C, xt, bt, c)                                                   \
    do {                                                                       \
        _tile_zero(C);                                                         \
        _tile_loadd(6, bt, 64);                                                \
        for (int p = 0; p < parts; p++) {                                      \
            _tile_loadd(4, (xt) + p * part, qk * 2);                           \
            _tile_dpbf16ps(C, 4, 6);                                           \
        }                                                                      \
        _tile_stored(C, c, 64);                                                \
    } while (0)

/* acc[r] += d * c[r] (+ m * s[r], Q4_1): one group's stored sums [16][16] scaled into the
 * accumulators, which stay in registers. */
static inline __attribute__((always_inline)) void scale_rows(const float *c, __m512 acc[16], const float *ds,
                                                             const float *ms, const float *s, int64_t sstride) {
    const __m512 dv = _mm512_loadu_ps(ds);
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        acc[r] = _mm512_fmadd_ps(dv, _mm512_load_ps(c + r * 16), acc[r]);
        if (ms) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(ms), _mm512_set1_ps(s[r * sstride]), acc[r]);
    }
}

/* Sums for x rows m0..m0+15 against weight rows n0..n0+15 over groups g0..g1, into out [16][16].
 * Groups alternate between tiles 0 and 1 so the scaling of one group's stored sums runs while the
 * tile unit computes the next; the 16 row sums stay in registers. */
static void tile_row(int qk, int parts, const uint16_t *xs, int64_t Mp, int64_t K, const float *s, int64_t m0,
                     int64_t g0, int64_t g1, const uint32_t *B, const float *ds, const float *ms, float *out) {
    float c[2][256] __attribute__((aligned(64)));
    const int64_t part = Mp * K, tile = 16 * qk, btile = 8 * qk, sstride = K / 32;
    const uint16_t *x0 = xs + m0 * K;  /* part 0's tiles of these rows */
    const float *srow = s ? s + m0 * sstride : 0;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        const int64_t i = g - g0;
        if (i & 1) GROUP1(1, x0 + g * tile, B + i * btile, c[1]);
        else GROUP1(0, x0 + g * tile, B + i * btile, c[0]);
        if (i > 0)  /* the group before: its sums were stored while these were computed */
            scale_rows(c[(i - 1) & 1], acc, ds + (i - 1) * 16, ms ? ms + (i - 1) * 16 : 0, srow ? srow + g - 1 : 0,
                       sstride);
    }
    const int64_t i = g1 - 1 - g0;
    scale_rows(c[i & 1], acc, ds + i * 16, ms ? ms + i * 16 : 0, srow ? srow + g1 - 1 : 0, sstride);
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(out + r * 16, acc[r]);
}

int outrider_amx_matmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d, const void *m,
                         int64_t N, float *y, int threads, int parts) {
    if (parts != 1 && parts != 3) return -1;
    if (!outrider_amx_ok() || !kind_known(kind, m, K)) return -1;
    if (N % 16 || M < 1 || M > MAX_ROWS || threads < 1) return -1;
    const int qk = BASE(kind) == KIND_Q8_16 ? 16 : 32, q41 = BASE(kind) == KIND_Q4_1;
    const int64_t Mp = (M + 15) / 16 * 16, pairs = (N + 31) / 32, chunk = KC / qk;
    /* blocks of at most NC pairs, at least one a thread */
    const int64_t per = (pairs + threads - 1) / threads < NC ? (pairs + threads - 1) / threads : NC;
    const int64_t nblocks = (pairs + per - 1) / per;
    /* each thread's scratch, allocated here (a failure returns -1 before any work): weight tiles
     * B, their scales sc, the sums of a weight pair acc */
    const size_t b_bytes = (size_t)NC * 2 * chunk * 8 * qk * sizeof(uint32_t), sc_bytes = NC * 4 * chunk * 16 * sizeof(float);
    const size_t per_thread = b_bytes + sc_bytes + 2 * 256 * sizeof(float);  /* all multiples of 64 */
    uint16_t *xs = aligned_alloc(64, (size_t)(parts * Mp * K * 2));
    float *s = q41 ? malloc((size_t)(Mp * (K / 32)) * sizeof(float)) : 0;
    uint8_t *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (!xs || (q41 && !s) || !scratch) {
        free(xs);
        free(s);
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        configure(qk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < Mp; r++) {
            const int64_t at = r / 16 * 16 * K + r % 16 * qk;  /* row r's place in its group-0 tile */
            uint16_t *const dst[3] = {xs + at, xs + Mp * K + at, xs + 2 * Mp * K + at};
            split_row(x + r * K, K, qk, parts, r < M, dst, s ? s + r * (K / 32) : 0);
        }
        uint8_t *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        uint32_t *B = (uint32_t *)mine;
        float *sc = (float *)(mine + b_bytes), *acc = (float *)(mine + b_bytes + sc_bytes);
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; blk++) {
            const int64_t p0 = blk * per, p1 = p0 + per < pairs ? p0 + per : pairs;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t g0 = k0 / qk, g1 = (k0 + KC < K ? k0 + KC : K) / qk, nb = g1 - g0;
                for (int64_t pr = p0; pr < p1; pr++) {  /* the block's weight pairs for this chunk */
                    uint32_t *b = B + (pr - p0) * 2 * nb * 8 * qk;
                    float *ps = sc + (pr - p0) * 4 * nb * 16;
                    decode_block16(kind, qk, q, d, m, K, N, pr * 32, g0, g1, b, ps, q41 ? ps + 2 * nb * 16 : 0);
                    decode_block16(kind, qk, q, d, m, K, N, pr * 32 + 16, g0, g1, b + nb * 8 * qk, ps + nb * 16,
                                   q41 ? ps + 3 * nb * 16 : 0);
                }
                for (int64_t m0 = 0; m0 < Mp; m0 += 16)  /* x's tiles for these rows stay in L1 across the pairs */
                    for (int64_t pr = p0; pr < p1; pr++) {
                        const uint32_t *b = B + (pr - p0) * 2 * nb * 8 * qk;
                        const float *ps = sc + (pr - p0) * 4 * nb * 16;
                        for (int t = 0; t < 2; t++)  /* the pair's two weight blocks */
                            tile_row(qk, parts, xs, Mp, K, s, m0, g0, g1, b + t * nb * 8 * qk, ps + t * nb * 16,
                                     q41 ? ps + (2 + t) * nb * 16 : 0, acc + t * 256);
                        for (int t = 0; t < 2; t++) {
                            const int64_t n = pr * 32 + t * 16;
                            if (n >= N) continue;
                            for (int r = 0; r < 16 && m0 + r < M; r++) {
                                float *out = y + (m0 + r) * N + n;
                                const __m512 v = _mm512_load_ps(acc + t * 256 + r * 16);
                                _mm512_storeu_ps(out, k0 ? _mm512_add_ps(_mm512_loadu_ps(out), v) : v);
                            }
                        }
                    }
            }
        }
        _tile_release();
    }
    free(xs);
    free(s);
    free(scratch);
    return 0;
}

#else
int outrider_amx_ok(void) { return 0; }

int outrider_amx_matmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d, const void *m,
                         int64_t N, float *y, int threads, int parts) {
    (void)kind; (void)x; (void)M; (void)K; (void)q; (void)d; (void)m; (void)N; (void)y; (void)threads; (void)parts;
    return -1;  /* built without the tile unit */
}
#endif
