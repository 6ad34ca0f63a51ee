/* y[M, N] = x[M, K] . W[N, K]^T with x rounded to 8-bit blocks and integer dot products
 * (AVX-512 VNNI): the numerics of the `-i8` dtypes (weights/quant_load.py), llama.cpp's way of running a
 * GGUF's blocks, on a layout of our own ("lanes") with a quarter of the float32 kernel's
 * instructions a row, so that more rows share one pass over the weights before compute binds.
 *
 * Activations. Each 32-value block of a row of x is rounded as llama.cpp rounds it for its Q8
 * dot products: d = max|x| / 127, xq = round(x / d) (x * (1 / d), to nearest, ties to even), so
 * x ~ d * xq with xq in -127..127. Done once a call, per row: a row's codes depend on that row only.
 *
 * Products. A weight block is d_w * c (+ m_w), c its integer codes (Q4: 0..15; Q8_0 and q8_16:
 * -128..127, kept here as c + 128 in 0..255, the unsigned operand VNNI takes). Then exactly
 *     sum_i w_i xq_i = d_w * (sum_i c_i xq_i - 8 * sum_i xq_i)            Q4_0 (w = d (c - 8))
 *                    = d_w * (sum_i (c_i + 128) xq_i - 128 * sum_i xq_i)   Q8_0 (w = d c)
 *                    = d_w * sum_i c_i xq_i + m_w * sum_i xq_i             Q4_1 (w = d c + m)
 * and a q8_16 block (two scales) is the Q8_0 form over each half. The integer sums are exact
 * (vpdpbusd: u8 x s8, four products a 32-bit lane, no saturation), so each block gives one
 * integer, and the row's float32 sum over blocks is, per output, a fixed sequence:
 *     acc[lane] = fma(float(isum), d_w * d_x, acc[lane])   (+ fma(m_w, d_x * sum xq, acc[lane]))
 * for the blocks of each group of 16 in turn (block l of a group in lane l), then one reduction
 * of the 16 lanes (_mm512_reduce_add_ps). Nothing depends on M, on the other rows, on how rows
 * share a weight row's loads, or on the threads: a k-token verify gives each row what a 1-token
 * step gives, bit for bit, so greedy speculative output equals greedy autoregressive output here
 * by construction, as with qmatmul.c's float32 kernel.
 *
 * Layout (qmatmul_i8_pack.c, once at load; qmatmul_i8.h its sizes). A weight row is cut into groups of 16
 * blocks; a group is one record: its codes in "units" of 4 bytes a lane, lane l = block l, then
 * its scales. Q4 kinds: 4 units, unit p holding bytes 4p..4p+3 of each block (a Q4 byte j holds
 * value j and, high nibble, value j + 16, so unit p gives values 4p..4p+3 in its low nibbles and
 * 16+4p..16+4p+3 in its high ones). Q8 kinds: 8 units, unit 2p values 4p..4p+3, unit 2p+1 values
 * 16+4p..16+4p+3. Each unit is one 64-byte vector, and a row has exactly the bytes of its GGUF
 * blocks (no padding). x is laid out to match (unit 2p: values 4p..4p+3 of each block, 2p+1:
 * values 16+4p..), so one vpdpbusd takes 64 codes of 16 blocks at once and a block's sum stays in
 * its lane: no horizontal sums until the row's end. Scales follow the codes as the weight had
 * them: float16 (HALF) d[nb] (and m[nb]); float32 d[nb] (and m[nb]; q8_16: first halves' d[nb],
 * then second halves'); FACTORED: the group's nb / 8 super-blocks' bytes.
 *   The tail (a row's last nb < 16 blocks). From 8 blocks on (qmatmul_i8.h SHORT_MIN: 12 of the Qwen
 * 0.5B's 28 a row, 8 of a 1.5B's down projection) it is a short group: a group's layout with nb
 * lanes, each unit 4 nb bytes (no padding), loaded masked; x's record is a whole one, its lanes
 * past nb zero. Below 8 (2 of SmolLM2's 18 a row: as a group it would cost as much as a whole one)
 * it is dense instead: its codes in the GGUF's own order, 4 bytes a lane, so a vector holds 4 Q4
 * blocks (or 2 Q8 ones), and x's tail is laid out lane by lane to match. A block's lanes are
 * summed (integers) before its scale applies, and its term goes into the accumulator lane of its
 * first code lane: each block still adds one term, as in a group. (Short groups from 8 blocks,
 * dense below, as measured: docs/benchmarks/2026-12-01-amd-epyc-zen5-avx512.md, Decoding;
 * docs/experiments.md, The int8 kernel and attention.)
 *
 * Why it is cheaper than qmatmul.c at several rows: a group (512 values) costs a row 8 VNNI
 * instructions and four float operations, where float32 needs 32 multiply-adds; the codes'
 * unpacking (a mask and a shift a unit) is shared by the rows of a tile.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

int outrider_i8_ok(void);

#if defined(OUTRIDER_VNNI512)
#include <immintrin.h>

#include "qmatmul_i8.h"
#include "block_decode.h"

#define RMAX 8            /* rows of x a tile takes */
#define TILE_N 16         /* weight rows a thread takes at a time */

int outrider_i8_ok(void) { return 1; }
int outrider_i8_avx_vnni(int mode) { (void)mode; return 0; }  /* qmatmul_i8_avx_vnni.c's choice: none here */

/* The CPU's own bound on the products: `rounds` x 24 independent vpdpbusd (64 multiply-adds
 * each) on each of `threads` threads, nothing loaded (scripts/bench_verify_cost.py times it and
 * sets the kernel's in-cache rate beside it). Returns a value of the sums so that none is dropped. */
int outrider_i8_peak(int64_t rounds, int threads) {
    int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512i a[24], b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(2);
        for (int i = 0; i < 24; i++) a[i] = _mm512_set1_epi32(i);
        for (int64_t r = 0; r < rounds; r++) {
            for (int i = 0; i < 24; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
            __asm__ volatile("" : "+v"(b));  /* keeps the loop from being folded */
        }
        for (int i = 0; i < 24; i++) sink += _mm512_reduce_add_epi32(a[i]);
    }
    return sink;
}

/* ---- activations --------------------------------------------------------------------------------- */

/* Row x [K] into its records for a weight of `kind`: the groups' (XREC bytes each), then the
 * tail's (XTAIL: lanes past its blocks zero). */
static void quantize_row(int kind, const float *x, int64_t K, uint8_t *rec) {
    const int64_t B = K / QK;
    memset(rec, 0, x_row_bytes(kind, K));
    for (int64_t b = 0; b < B; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));  /* to nearest, even */
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        int8_t c[32];
        _mm_storeu_si128((__m128i *)c, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(c + 16), _mm512_cvtsepi32_epi8(q1));
        store_x_block(kind, rec, B, b, c, d, s0, s1);
    }
}

/* ---- products ------------------------------------------------------------------------------------ */

/* A group's scales (and mins) as 16 lanes; q8_16: da the first halves', db the second halves'. */
static inline __attribute__((always_inline)) void group_scales(int kind, const uint8_t *s, int64_t nb,
                                                               __m512 *da, __m512 *db, __m512 *mw) {
    const __mmask16 lanes = (__mmask16)((1u << nb) - 1);
    *mw = _mm512_setzero_ps();
    *db = _mm512_setzero_ps();
    if (kind & FACTORED) {
        if (BASE(kind) == KIND_Q4_1) {
            widen_factored(kind, s, 0, nb, da, mw);
            return;
        }
        /* q8_16 from Q6_K: super-block j (blocks 8j..8j+7) is D_j then 16 int8 codes, two a block */
        const uint8_t *s1 = nb > 8 ? s + SUPER_BYTES(kind) : s;
        const __m128i c0 = _mm_loadu_si128((const __m128i *)(s + 2)), c1 = _mm_loadu_si128((const __m128i *)(s1 + 2));
        const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m128i e0 = _mm_shuffle_epi8(c0, even), e1 = _mm_shuffle_epi8(c1, even);
        const __m512 D = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(s)), _mm512_set1_ps(half_at(s1)));
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(e0, e1)));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(e0, e1)));
        *da = _mm512_maskz_mul_ps(lanes, D, first);   /* D * code, as scale_at */
        *db = _mm512_maskz_mul_ps(lanes, D, second);
        return;
    }
    if (kind & HALF) {
        *da = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, s));
        if (BASE(kind) == KIND_Q4_1) *mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, s + 2 * nb));
        return;
    }
    *da = _mm512_maskz_loadu_ps(lanes, s);
    if (BASE(kind) == KIND_Q8_16) *db = _mm512_maskz_loadu_ps(lanes, s + 4 * nb);
    if (BASE(kind) == KIND_Q4_1) *mw = _mm512_maskz_loadu_ps(lanes, s + 4 * nb);
}

/* One tail code vector's lanes -> their blocks (within the tail), for looking up scales. */
static inline __m512i tail_blocks(int kind, int64_t v) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i e = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(16 * v)));  /* the tail's dword e */
    if (!q8(kind)) return _mm512_srli_epi32(e, 2);                               /* 4 dwords a Q4 block */
    const __m512i block = _mm512_srli_epi32(e, 3);                                 /* 8 a Q8 block */
    if (BASE(kind) != KIND_Q8_16) return block;
    /* q8_16: dwords 4..7 of a block are its second half: scale 16 + block of [first | second] */
    return _mm512_add_epi32(block, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 2), _mm512_set1_epi32(1)), 4));
}

/* acc[r] += group gi of x's row r (its record at xq + r * xrow + gi * XREC) against the weight's
 * group of nb blocks at w (nb = GROUP, or a row's short tail: unit u at w + 4 nb u, loaded masked
 * so that lanes nb..15 are zero, as they are in x's record): block l's term into lane l. */
static inline __attribute__((always_inline)) void group_dot(int kind, int R, const uint8_t *xq, int64_t xrow,
                                                            int64_t gi, const uint8_t *w, int64_t nb, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __mmask16 lanes = (__mmask16)((1u << nb) - 1);
    /* integer sums a lane: sa all 32 values (q8_16: the first 16), sb the second 16 */
    __m512i sa[RMAX], sb[RMAX];
    for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm512_setzero_si512();
    for (int u = 0; u < (q8(kind) ? 8 : 4); u++) {
        /* Q8: unit u; Q4: units 2u, 2u+1 in its nibbles */
        const __m512i v = nb == GROUP ? _mm512_loadu_si512(w + u * 64) : _mm512_maskz_loadu_epi32(lanes, w + u * 4 * nb);
        const __m512i lo = q8(kind) ? v : _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; r++) {
            const uint8_t *xg = xq + r * xrow + gi * XREC;
            if (q8(kind)) {
                const __m512i xv = _mm512_load_si512(xg + u * 64);
                if (BASE(kind) == KIND_Q8_16 && (u & 1)) sb[r] = _mm512_dpbusd_epi32(sb[r], lo, xv);
                else sa[r] = _mm512_dpbusd_epi32(sa[r], lo, xv);
            } else {
                sa[r] = _mm512_dpbusd_epi32(sa[r], lo, _mm512_load_si512(xg + 2 * u * 64));
                sa[r] = _mm512_dpbusd_epi32(sa[r], hi, _mm512_load_si512(xg + (2 * u + 1) * 64));
            }
        }
    }
    __m512 da, db, mw;
    group_scales(kind, w + code_bytes(kind, nb), nb, &da, &db, &mw);
    for (int r = 0; r < R; r++) {
        const uint8_t *xg = xq + r * xrow + gi * XREC;
        const __m512 dx = _mm512_load_ps(xg + 512);
        const __m512i sum = _mm512_load_si512(xg + 576);
        __m512i a = sa[r], b = sb[r];
        if (BASE(kind) == KIND_Q8_16) {
            const __m512i first = _mm512_load_si512(xg + 640), rest = _mm512_sub_epi32(sum, first);
            a = _mm512_sub_epi32(a, _mm512_slli_epi32(first, 7));
            b = _mm512_sub_epi32(b, _mm512_slli_epi32(rest, 7));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(da, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(db, dx), acc[r]);
            continue;
        }
        if (BASE(kind) == KIND_Q8_0) a = _mm512_sub_epi32(a, _mm512_slli_epi32(sum, 7));
        if (BASE(kind) == KIND_Q4_0) a = _mm512_sub_epi32(a, _mm512_slli_epi32(sum, 3));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(da, dx), acc[r]);
        if (BASE(kind) == KIND_Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_load_ps(xg + 704), acc[r]);
    }
}

/* y[r * ystride] = x[r] . W for r < R (a constant after inlining): one weight row against R rows
 * of x (their records xq, xrow bytes apart), each weight vector unpacked once for the R rows.
 * Each y is its own accumulator and the sequence of operations the header gives, whatever R.
 * (Two weight rows a tile, so that each x vector loaded serves both, measured no faster.) */
static inline __attribute__((always_inline)) void dot_rows(int kind, int R, const uint8_t *xq, int64_t xrow,
                                                           const uint8_t *w, int64_t B, float *y, int64_t ystride) {
    __m512 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t full = B / GROUP, nb = B % GROUP, bytes = group_bytes(kind, GROUP);
    for (int64_t gi = 0; gi < full; gi++) {
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)w + PREFETCH_BYTES + o, _MM_HINT_T2);
        group_dot(kind, R, xq, xrow, gi, w, GROUP, acc);
        w += bytes;
    }
    if (nb && short_group(nb)) group_dot(kind, R, xq, xrow, full, w, nb, acc);  /* a short group: lanes 0..nb-1 */
    else if (nb) {  /* the tail, dense: each lane's scale looked up by its block */
        const int64_t cb = code_bytes(kind, nb), tv = TAIL_VECTORS(kind, nb);
        __m512 da, db, mw;
        group_scales(kind, w + cb, nb, &da, &db, &mw);
        const uint8_t *xt = xq + full * XREC;
        const int64_t lanes_at = (q8(kind) ? tv : 2 * tv) * 64;  /* x's tail: each lane's d, sum, d * sum */
        for (int64_t v = 0; v < tv; v++) {
            const int64_t left = cb - 64 * v;
            const __m512i code = _mm512_maskz_loadu_epi8(left >= 64 ? ~0ull : ((1ull << left) - 1), w + 64 * v);
            const __m512i lo = q8(kind) ? code : _mm512_and_si512(code, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(code, 4), low4);
            const __m512i idx = tail_blocks(kind, v);
            const __m512 dl = BASE(kind) == KIND_Q8_16 ? _mm512_permutex2var_ps(da, idx, db) : _mm512_permutexvar_ps(idx, da);
            const __m512 ml = _mm512_permutexvar_ps(idx, mw);
            for (int r = 0; r < R; r++) {
                const uint8_t *xg = xt + r * xrow;
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(xg + v * 64));
                if (!q8(kind)) s = _mm512_dpbusd_epi32(s, hi, _mm512_load_si512(xg + (tv + v) * 64));
                /* each scale group's lanes summed (integers: exact), so that it adds one term as a
                 * group's block does: its first lane's, the others masked off */
                s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xB1));  /* lanes 2i, 2i+1 */
                s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4E));  /* 4i .. 4i+3 */
                if (BASE(kind) == KIND_Q8_0) s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, 0xB1));  /* 8i .. 8i+7 */
                const __mmask16 first = BASE(kind) == KIND_Q8_0 ? 0x0101 : 0x1111;
                const __m512 dx = _mm512_load_ps(xg + lanes_at + v * 64);
                const __m512i sum = _mm512_load_si512(xg + lanes_at + (tv + v) * 64);
                if (q8(kind)) s = _mm512_sub_epi32(s, _mm512_slli_epi32(sum, 7));
                if (BASE(kind) == KIND_Q4_0) s = _mm512_sub_epi32(s, _mm512_slli_epi32(sum, 3));
                acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dl, dx), acc[r], first);
                if (BASE(kind) == KIND_Q4_1)
                    acc[r] = _mm512_mask3_fmadd_ps(ml, _mm512_load_ps(xg + lanes_at + (2 * tv + v) * 64), acc[r], first);
            }
        }
    }
    for (int r = 0; r < R; r++)  /* qmatmul_i8.h sum16: the AVX2 kernel's order too */
        y[r * ystride] = sum16(_mm512_castps512_ps256(acc[r]),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
}

/* Threads split the weight rows in tiles of TILE_N; each weight row of a tile passes over up to
 * RMAX rows of x at a time (its codes unpacked once for them; the tile's rows stay in L1/L2). */
#define ROWS_CASE(KIND, R) case R: dot_rows(KIND, R, xr, xrow, wn, B, yr, N); break;
/* One parallel region a call: the threads round x's rows (a share each), wait for one another,
 * then split the weight rows. */
#define MATMUL(NAME, KIND)                                                                          \
    static void NAME(const float *x, uint8_t *xq, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, \
                     int threads) {                                                                 \
        const int64_t B = K / QK, xrow = x_row_bytes(KIND, K);                                      \
        const int64_t wrow = outrider_i8_row_bytes(KIND, K), tiles = (N + TILE_N - 1) / TILE_N;  \
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
                    switch (R) {                                                                    \
                        ROWS_CASE(KIND, 1) ROWS_CASE(KIND, 2) ROWS_CASE(KIND, 3) ROWS_CASE(KIND, 4) \
                        ROWS_CASE(KIND, 5) ROWS_CASE(KIND, 6) ROWS_CASE(KIND, 7) ROWS_CASE(KIND, 8) \
                        default: break;                                                             \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        }                                                                                           \
    }

#define LANE_KINDS(X) X(q8_0, KIND_Q8_0) X(q4_0, KIND_Q4_0) X(q4_1, KIND_Q4_1) X(q8_16, KIND_Q8_16) \
                      X(q8_0h, (KIND_Q8_0 + HALF)) X(q4_0h, (KIND_Q4_0 + HALF)) X(q4_1h, (KIND_Q4_1 + HALF)) \
                      X(q4_1f, (KIND_Q4_1 + FACTORED)) X(q8_16f, (KIND_Q8_16 + FACTORED))
#define DEFINE(NAME, KIND) MATMUL(lanes_##NAME, KIND)
LANE_KINDS(DEFINE)
#undef DEFINE

/* y [M, N] = x [M, K] . W^T for W packed by outrider_i8_pack (kind: its kind code + LANES);
 * called by outrider_qmatmul for a LANES kind. 0, or -1 for arguments it cannot take (or when
 * the activations' scratch cannot be allocated). */
int outrider_i8_matmul(int kind, const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y,
                          int threads) {
    kind &= ~LANES;
    if (!base_known(kind, K) || M < 0 || N < 0 || threads < 1) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t xrow = x_row_bytes(kind, K);
    uint8_t *xq = aligned_alloc(64, (size_t)(M * xrow));
    if (!xq) return -1;
#define CALL(NAME, KIND) case KIND: lanes_##NAME(x, xq, M, K, (const uint8_t *)w, N, y, threads); break;
    switch (kind) { LANE_KINDS(CALL) default: free(xq); return -1; }
#undef CALL
    free(xq);
    return 0;
}

#elif !defined(OUTRIDER_AVX2)  /* portable: no int8 kernel, the -i8 dtypes are refused (native.i8_available);
                                 AVX2 builds without AVX-512 VNNI: qmatmul_i8_avx2.c */
int outrider_i8_ok(void) { return 0; }
int outrider_i8_avx_vnni(int mode) { (void)mode; return 0; }
int outrider_i8_peak(int64_t rounds, int threads) {
    (void)rounds; (void)threads;
    return 0;
}
int outrider_i8_matmul(int kind, const float *x, int64_t M, int64_t K, const void *w, int64_t N, float *y,
                          int threads) {
    (void)kind; (void)x; (void)M; (void)K; (void)w; (void)N; (void)y; (void)threads;
    return -1;
}
#endif
