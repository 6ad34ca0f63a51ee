/* A group's and a dense tail's products of qmatmul_i8_avx2.c (the AVX2 int8 kernel: its header),
 * one weight row against up to RMAX rows of x: the integer block sums and their float epilogue,
 * lane for lane qmatmul_i8.c's. Included by qmatmul_i8_avx2.c only (AVX2 builds without AVX-512 VNNI).
 *
 * The integer sums. AVX2 has no vpdpbusd; its multiply of unsigned by signed bytes, vpmaddubsw,
 * adds two products into a signed 16-bit lane (saturating), and vpmaddwd with ones adds the two
 * 16-bit halves of each 32-bit lane: a block's lane gets its 4 products, as vpdpbusd gives them.
 *   Q4 codes (0..15) times x's codes (-127..127): a 16-bit lane holds at most 2 * 15 * 127 = 3810,
 *   so a group's 8 vpmaddubsw for a half (4 units, low and high nibbles: 16 products a 16-bit
 *   lane, at most 30480) add as 16-bit integers and are widened once: per 256 values of a row, 8
 *   vpmaddubsw, 7 vpaddw and one vpmaddwd.
 *   Q8 codes (-128..127; the layout keeps c + 128 for vpdpbusd, xored back here) as the unsigned
 *   operand would overflow it, so, as llama.cpp does, |c| is the unsigned operand and c's sign
 *   moves onto x (vpsignb): |c| * (sign(c) xq) = c xq, a 16-bit lane at most 2 * 128 * 127 =
 *   32512, widened at once (vpmaddwd each): the sum of c xq itself, where qmatmul_i8.c sums
 *   (c + 128) xq and takes 128 * sum xq off: the same integer.
 * Weights decoded once per group of rows: a group's half (8 blocks) is loaded and unpacked (Q4:
 * a mask and a shift a unit; Q8: the xor and |c|) once for up to RMAX rows of x.
 *
 * AVX-VNNI. Where the CPU has it (`avx_vnni`: Intel since Alder Lake, AMD Zen 5; not Zen 3), the
 * integer sums take its 256-bit vpdpbusd instead (u8 x s8, four products into a 32-bit lane, no
 * saturation), on Q8's stored c + 128 with qmatmul_i8.c's correction: 8 instructions per 256 values
 * of a row in place of 16 (Q4) or 32 (Q8). Chosen at run time (qmatmul_i8_avx_vnni.c; the variant's
 * flags stay AVX2's: written in assembly, so no target attribute is needed), off with
 * outrider_i8_avx_vnni(0). The integers are the same, so are the outputs' bits.
 *
 * The float epilogue per block lane is qmatmul_i8.c's: fma(float(isum), d_w * d_x, acc) (and Q4_1's
 * fma(m_w, d_x * sum xq, acc)), lanes past a short group's blocks given the same zero terms, a
 * dense tail's terms into the same lanes; so the bits agree with the avx512-vnni variant's.
 */
#ifndef OUTRIDER_QMATMUL_I8_AVX2_DOT_H
#define OUTRIDER_QMATMUL_I8_AVX2_DOT_H
#include <stdint.h>
#include <string.h>

#include "isa.h"

#if defined(OUTRIDER_AVX2)
#include "qmatmul_i8.h"
#include "block_decode.h"

#define RMAX 8            /* rows of x a weight row's decoded half serves */
#define AI static inline __attribute__((always_inline))

/* AVX-VNNI's vpdpbusd on 256 bits, VEX-encoded (ymm0..15: the "x" registers): acc + u8(u) . s8(s)
 * by fours. In assembly, so that the AVX2 build needs no -mavxvnni; run only where the CPU has it. */
AI __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    __asm__("%{vex%} vpdpbusd %[s], %[u], %[acc]" : [acc] "+x"(acc) : [u] "x"(u), [s] "x"(s));
    return acc;
}

/* ---- products ------------------------------------------------------------------------------------ */

/* Dword lanes 0..n-1 of a half set (n <= 0: none, n >= 8: all), for vpmaskmov. */
AI __m256i lane_mask(int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), lane);
}

/* 8 float16 values at p, lanes past n (< 8) zero: read by dwords under a mask (and an odd last one
 * alone), not through a buffer on the stack, whose 16-byte load after narrow stores stalls (the
 * store cannot be forwarded: a dense tail's scales took a tenth of a 576-wide row's time so). */
AI __m256 halves(const uint8_t *p, int64_t n) {
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (n <= 0) return _mm256_setzero_ps();
    const __m128i dwords = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n / 2)), _mm_setr_epi32(0, 1, 2, 3));
    __m128i v = _mm_maskload_epi32((const int *)p, dwords);
    if (n & 1) {  /* the last value, alone in its dword: into 16-bit lane n - 1 */
        uint16_t last;
        memcpy(&last, p + 2 * (n - 1), 2);
        const __m128i lane = _mm_cmpeq_epi16(_mm_set1_epi16((short)(n - 1)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
        v = _mm_or_si128(v, _mm_and_si128(lane, _mm_set1_epi16((short)last)));
    }
    return _mm256_cvtph_ps(v);
}

/* 8 float32 values at p, lanes past n zero. */
AI __m256 floats(const uint8_t *p, int64_t n) {
    if (n >= 8) return _mm256_loadu_ps((const float *)p);
    return _mm256_maskload_ps((const float *)p, lane_mask(n));
}

/* A group's scales (and mins) of nb blocks at s as 16 lanes (two halves of 8), lanes past nb zero,
 * with qmatmul_i8.c's operations (group_scales there); q8_16: da the first halves', db the second's. */
AI void group_scales(int kind, const uint8_t *s, int64_t nb, __m256 da[2], __m256 db[2], __m256 mw[2]) {
    for (int h = 0; h < 2; h++) db[h] = mw[h] = _mm256_setzero_ps();
    if (kind & FACTORED) {
        if (BASE(kind) == KIND_Q4_1) {  /* block_decode.h widen_factored: D * code, -(Dmin * code) */
            for (int h = 0; h < 2; h++) {
                const int here = h == 0 || nb > 8;
                const uint8_t *p = s + h * SUPER_BYTES(kind);
                uint64_t sc = 0, mn = 0;
                if (here) memcpy(&sc, p + 4, 8), memcpy(&mn, p + 12, 8);
                const __m256 D = _mm256_set1_ps(here ? half_at(p) : 0.0f), Dm = _mm256_set1_ps(here ? half_at(p + 2) : 0.0f);
                da[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
                const __m256 low = _mm256_mul_ps(Dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
                mw[h] = _mm256_xor_ps(low, _mm256_set1_ps(-0.0f));
            }
            return;
        }
        /* q8_16 from Q6_K: super-block h (blocks 8h..8h+7) is D_h then 16 int8 codes, two a block */
        const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        for (int h = 0; h < 2; h++) {
            da[h] = db[h] = _mm256_setzero_ps();
            if (h && nb <= 8) continue;  /* qmatmul_i8.c's masked-off lanes: zero */
            const uint8_t *p = s + h * SUPER_BYTES(kind);
            const __m128i e = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 2)), even);
            const __m256 D = _mm256_set1_ps(half_at(p));
            da[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e)));
            db[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(e, e))));
        }
        return;
    }
    for (int h = 0; h < 2; h++) {
        const int64_t n = nb - 8 * h;
        if (kind & HALF) {
            da[h] = halves(s + 16 * h, n);
            if (BASE(kind) == KIND_Q4_1) mw[h] = halves(s + 2 * nb + 16 * h, n);
            continue;
        }
        da[h] = floats(s + 32 * h, n);
        if (BASE(kind) == KIND_Q8_16) db[h] = floats(s + 4 * nb + 32 * h, n);
        if (BASE(kind) == KIND_Q4_1) mw[h] = floats(s + 4 * nb + 32 * h, n);
    }
}

/* 32 bytes at p of which the first n (a multiple of 4; <= 0: none) are there, the rest zero. */
AI __m256i codes_at(const uint8_t *p, int64_t n) {
    if (n >= 32) return _mm256_loadu_si256((const __m256i *)p);
    if (n <= 0) return _mm256_setzero_si256();
    return _mm256_maskload_epi32((const int *)p, lane_mask(n / 4));
}

/* acc[r][h] += the row's block terms of one half (lanes 8h..8h+7) of a group, its integer sums
 * sa (sb: q8_16's second halves) in hand: qmatmul_i8.c group_dot's epilogue, lane for lane. */
AI void group_terms(int kind, int vnni, const uint8_t *xg, int h, __m256i a, __m256i b, const __m256 da[2],
                    const __m256 db[2], const __m256 mw[2], __m256 *acc) {
    const __m256 dx = _mm256_load_ps((const float *)(xg + 512) + 8 * h);
    if (vnni && q8(kind)) {  /* sums of (c + 128) xq: 128 times x's sums off, as qmatmul_i8.c */
        const __m256i sum = _mm256_load_si256((const __m256i *)(xg + 576) + h);
        if (BASE(kind) == KIND_Q8_16) {
            const __m256i first = _mm256_load_si256((const __m256i *)(xg + 640) + h);
            a = _mm256_sub_epi32(a, _mm256_slli_epi32(first, 7));
            b = _mm256_sub_epi32(b, _mm256_slli_epi32(_mm256_sub_epi32(sum, first), 7));
        } else {
            a = _mm256_sub_epi32(a, _mm256_slli_epi32(sum, 7));
        }
    }
    if (BASE(kind) == KIND_Q8_16) {  /* the sums of c xq now: nothing more to take off */
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(da[h], dx), *acc);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_mul_ps(db[h], dx), *acc);
        return;
    }
    if (BASE(kind) == KIND_Q4_0) {
        const __m256i sum = _mm256_load_si256((const __m256i *)(xg + 576) + h);
        a = _mm256_sub_epi32(a, _mm256_slli_epi32(sum, 3));
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(da[h], dx), *acc);
    if (BASE(kind) == KIND_Q4_1) *acc = _mm256_fmadd_ps(mw[h], _mm256_load_ps((const float *)(xg + 704) + 8 * h), *acc);
}

/* acc[r] += group gi of x's row r (its record at xq + r * xrow + gi * XREC) against the weight's
 * group of nb blocks at w (nb = GROUP, or a short tail: unit u at w + 4 nb u, lanes past nb absent
 * from memory and zero here, as in x's record): block l's term into lane l (acc[r][l / 8]). */
AI void group_dot(int kind, int vnni, int R, const uint8_t *xq, int64_t xrow, int64_t gi, const uint8_t *w,
                  int64_t nb, __m256 acc[][2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 da[2], db[2], mw[2];
    group_scales(kind, w + code_bytes(kind, nb), nb, da, db, mw);
    for (int h = 0; h < 2; h++) {
        const int64_t here = 4 * (nb - 8 * h);  /* bytes of this half a unit has */
        const int64_t unit = nb == GROUP ? 64 : 4 * nb;
        if (!q8(kind)) {
            __m256i lo[4], hi[4];
            for (int u = 0; u < 4; u++) {
                const __m256i v = codes_at(w + u * unit + 32 * h, here);
                lo[u] = _mm256_and_si256(v, low4);
                hi[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            for (int r = 0; r < R && vnni; r++) {  /* AVX-VNNI: straight into 32-bit sums, two chains */
                const uint8_t *xg = xq + r * xrow + gi * XREC;
                const __m256i *xv = (const __m256i *)xg + h;
                __m256i s0 = dpbusd(_mm256_setzero_si256(), lo[0], _mm256_load_si256(xv));
                __m256i s1 = dpbusd(_mm256_setzero_si256(), hi[0], _mm256_load_si256(xv + 2));
                for (int u = 1; u < 4; u++) {
                    s0 = dpbusd(s0, lo[u], _mm256_load_si256(xv + 4 * u));
                    s1 = dpbusd(s1, hi[u], _mm256_load_si256(xv + 4 * u + 2));
                }
                group_terms(kind, vnni, xg, h, _mm256_add_epi32(s0, s1), _mm256_setzero_si256(), da, db, mw, &acc[r][h]);
            }
            for (int r = 0; r < R && !vnni; r++) {
                const uint8_t *xg = xq + r * xrow + gi * XREC;
                const __m256i *xv = (const __m256i *)xg + h;  /* unit j of x at xv[2 j] */
                __m256i p = _mm256_maddubs_epi16(lo[0], _mm256_load_si256(xv));
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[0], _mm256_load_si256(xv + 2)));
                for (int u = 1; u < 4; u++) {
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[u], _mm256_load_si256(xv + 4 * u)));
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[u], _mm256_load_si256(xv + 4 * u + 2)));
                }
                group_terms(kind, vnni, xg, h, _mm256_madd_epi16(p, ones), _mm256_setzero_si256(), da, db, mw, &acc[r][h]);
            }
            continue;
        }
        __m256i sa[RMAX], sb[RMAX];
        for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm256_setzero_si256();
        for (int u0 = 0; u0 < 8 && vnni; u0 += 4) {  /* AVX-VNNI: the stored c + 128 as they are */
            __m256i c[4];
            for (int i = 0; i < 4; i++) c[i] = codes_at(w + (u0 + i) * unit + 32 * h, here);
            for (int r = 0; r < R; r++) {
                const __m256i *xv = (const __m256i *)(xq + r * xrow + gi * XREC) + h;
                for (int i = 0; i < 4; i++) {
                    const int u = u0 + i;
                    if (BASE(kind) == KIND_Q8_16 && (u & 1)) sb[r] = dpbusd(sb[r], c[i], _mm256_load_si256(xv + 2 * u));
                    else sa[r] = dpbusd(sa[r], c[i], _mm256_load_si256(xv + 2 * u));
                }
            }
        }
        for (int u0 = 0; u0 < 8 && !vnni; u0 += 4) {  /* 4 units at a time: c and |c| in 8 registers */
            __m256i c[4], a[4];
            for (int i = 0; i < 4; i++) {
                c[i] = _mm256_xor_si256(codes_at(w + (u0 + i) * unit + 32 * h, here), flip);
                a[i] = _mm256_abs_epi8(c[i]);
            }
            for (int r = 0; r < R; r++) {
                const __m256i *xv = (const __m256i *)(xq + r * xrow + gi * XREC) + h;
                for (int i = 0; i < 4; i++) {
                    const int u = u0 + i;
                    const __m256i t = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(a[i], _mm256_sign_epi8(_mm256_load_si256(xv + 2 * u), c[i])), ones);
                    if (BASE(kind) == KIND_Q8_16 && (u & 1)) sb[r] = _mm256_add_epi32(sb[r], t);
                    else sa[r] = _mm256_add_epi32(sa[r], t);
                }
            }
        }
        for (int r = 0; r < R; r++)
            group_terms(kind, vnni, xq + r * xrow + gi * XREC, h, sa[r], sb[r], da, db, mw, &acc[r][h]);
    }
}

/* A dense tail's code vector v, half h: each dword lane's block (within the tail; q8_16: + 8 for a
 * block's second half), qmatmul_i8.c tail_blocks' index (< 8 there: a dense tail has < 8 blocks). */
AI __m256i tail_blocks(int kind, int64_t v, int h) {
    const __m256i e = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(16 * v + 8 * h)));
    return _mm256_srli_epi32(e, q8(kind) ? 3 : 2);
}

/* acc[r] += the dense tail (nb < SHORT_MIN blocks at w: codes in the GGUF's order, 4 Q4 blocks or 2
 * Q8 blocks a 64-byte vector) against x's tail records: qmatmul_i8.c dot_rows' tail, lane for lane. */
AI void tail_dot(int kind, int vnni, int R, const uint8_t *xt, int64_t xrow, const uint8_t *w, int64_t nb,
                 __m256 acc[][2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const int64_t cb = code_bytes(kind, nb), tv = TAIL_VECTORS(kind, nb);
    __m256 da[2], db[2], mw[2];
    group_scales(kind, w + cb, nb, da, db, mw);
    const int64_t lanes_at = (q8(kind) ? tv : 2 * tv) * 64;  /* x's tail: each lane's d, sum, d * sum */
    const int first = BASE(kind) == KIND_Q8_0 ? 0x01 : 0x11;   /* a scale group's first lane in a half */
    for (int64_t v = 0; v < tv; v++)
        for (int h = 0; h < 2; h++) {
            if (cb - 64 * v - 32 * h <= 0) {
                /* no codes in this half (SmolLM2's 2-block Q4 tail: lanes 8..15): qmatmul_i8.c's terms
                 * here are fma(0, 0 * 0, acc) (and Q4_1's fma(+-0, 0, acc)), i.e. acc + 0: the same */
                for (int r = 0; r < R; r++)
                    acc[r][h] = _mm256_blend_ps(acc[r][h], _mm256_add_ps(acc[r][h], _mm256_setzero_ps()), first);
                continue;
            }
            const __m256i code = codes_at(w + 64 * v + 32 * h, cb - 64 * v - 32 * h);
            const __m256i blk = tail_blocks(kind, v, h);
            __m256 dl = _mm256_permutevar8x32_ps(da[0], blk);
            if (BASE(kind) == KIND_Q8_16) {  /* dwords 4..7 of a block (bit 2 of the dword): its second half's scale */
                const __m256i e = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                   _mm256_set1_epi32((int)(16 * v + 8 * h)));
                const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(e, 29));  /* bit 2 to the sign */
                dl = _mm256_blendv_ps(dl, _mm256_permutevar8x32_ps(db[0], blk), second);
            }
            const __m256 ml = _mm256_permutevar8x32_ps(mw[0], blk);
            /* Q8: lo c (AVX-VNNI: c + 128, as stored), hi |c|; Q4: the low and high nibbles */
            const __m256i lo = q8(kind) ? (vnni ? code : _mm256_xor_si256(code, flip)) : _mm256_and_si256(code, low4);
            const __m256i hi = q8(kind) ? _mm256_abs_epi8(lo) : _mm256_and_si256(_mm256_srli_epi16(code, 4), low4);
            for (int r = 0; r < R; r++) {
                const uint8_t *xg = xt + r * xrow;
                const __m256i *xv = (const __m256i *)xg + h;
                __m256i s;
                if (vnni) {
                    s = dpbusd(_mm256_setzero_si256(), lo, _mm256_load_si256(xv + 2 * v));
                    if (!q8(kind)) s = dpbusd(s, hi, _mm256_load_si256(xv + 2 * (tv + v)));
                } else if (q8(kind)) {  /* lo: c, hi: |c| */
                    s = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_sign_epi8(_mm256_load_si256(xv + 2 * v), lo)), ones);
                } else {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(xv + 2 * v)),
                                                       _mm256_maddubs_epi16(hi, _mm256_load_si256(xv + 2 * (tv + v))));
                    s = _mm256_madd_epi16(p, ones);
                }
                /* each scale group's lanes summed (integers: exact), its term into its first lane */
                s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));  /* lanes 2i, 2i+1 */
                s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4E));  /* 4i .. 4i+3 */
                if (BASE(kind) == KIND_Q8_0) s = _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));  /* 8 */
                const float *lanes = (const float *)(xg + lanes_at);
                const __m256 dx = _mm256_load_ps(lanes + 16 * v + 8 * h);
                if (BASE(kind) == KIND_Q4_0 || (vnni && q8(kind))) {  /* Q4_0's 8, AVX-VNNI Q8's 128, times x's sum */
                    const __m256i sum = _mm256_load_si256((const __m256i *)(xg + lanes_at + (tv + v) * 64) + h);
                    s = _mm256_sub_epi32(s, _mm256_slli_epi32(sum, q8(kind) ? 7 : 3));
                }
                __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dl, dx), acc[r][h]);
                t = _mm256_blend_ps(acc[r][h], t, first);
                if (BASE(kind) == KIND_Q4_1)
                    t = _mm256_blend_ps(t, _mm256_fmadd_ps(ml, _mm256_load_ps(lanes + 16 * (2 * tv + v) + 8 * h), t), first);
                acc[r][h] = t;
            }
        }
}

#endif
#endif
