/* Weights into the lanes layout of qmatmul_i8.c, once at load (native.NativeWeight.packed): the same
 * codes and scales, regrouped 16 blocks a record (qmatmul_i8.c's header gives the layout). */
#include <stdint.h>
#include <string.h>

#include "isa.h"

int64_t outrider_i8_row_bytes(int kind, int64_t K);
int outrider_i8_pack(int kind, int64_t K, const void *q, const void *d, const void *m, int64_t n0, int64_t n1,
                        void *out, int threads);

#if defined(OUTRIDER_AVX2)  /* the builds with an int8 kernel: qmatmul_i8.c (AVX-512 VNNI) or qmatmul_i8_avx2.c */
#include "qmatmul_i8.h"

int64_t outrider_i8_row_bytes(int kind, int64_t K) {
    if (!base_known(kind & ~LANES, K)) return -1;
    kind &= ~LANES;
    const int64_t B = K / QK, full = B / GROUP, tail = B % GROUP;
    return full * group_bytes(kind, GROUP) + (tail ? group_bytes(kind, tail) : 0);
}

/* One weight row from the blocks qmatmul.c reads (q, d, m of that row) into `out`. */
static void pack_row(int kind, int64_t K, const uint8_t *q, const uint8_t *d, const uint8_t *m, uint8_t *out) {
    const int64_t B = K / QK, qstride = q8(kind) ? QK : QK / 2;
    const int64_t per = (kind & HALF) ? 2 : 4;
    for (int64_t g0 = 0; g0 < B; g0 += GROUP) {
        const int64_t nb = B - g0 < GROUP ? B - g0 : GROUP;
        const int units = q8(kind) ? 8 : 4;
        const int grouped = nb == GROUP || short_group(nb);
        if (!grouped) {  /* a dense tail: codes in the blocks' own order */
            for (int64_t l = 0; l < nb; l++) memcpy(out + l * qstride, q + (g0 + l) * qstride, qstride);
            if (q8(kind))
                for (int64_t i = 0; i < nb * qstride; i++) out[i] ^= 0x80;
        }
        for (int u = 0; u < units && grouped; u++) {
            /* the source bytes of unit u: Q4 dword u; Q8 dword u / 2 (+ 4 for the odd units) */
            const int dword = q8(kind) ? (u / 2) + (u & 1) * 4 : u;
            for (int64_t l = 0; l < nb; l++) {
                uint8_t *o = out + u * 4 * nb + 4 * l;
                memcpy(o, q + (g0 + l) * qstride + 4 * dword, 4);
                if (q8(kind))
                    for (int i = 0; i < 4; i++) o[i] ^= 0x80;  /* c + 128 */
            }
        }
        uint8_t *s = out + code_bytes(kind, nb);
        if (kind & FACTORED) {
            memcpy(s, d + g0 / 8 * SUPER_BYTES(kind), scale_bytes(kind, nb));
        } else if (BASE(kind) == KIND_Q8_16) {  /* float32 [2 nb]: first halves, then second halves */
            for (int64_t l = 0; l < nb; l++) {
                memcpy(s + 4 * l, d + 4 * (2 * (g0 + l)), 4);
                memcpy(s + 4 * (nb + l), d + 4 * (2 * (g0 + l) + 1), 4);
            }
        } else {
            memcpy(s, d + g0 * per, nb * per);
            if (BASE(kind) == KIND_Q4_1) memcpy(s + nb * per, m + g0 * per, nb * per);
        }
        out += group_bytes(kind, nb);
    }
}

/* Weight rows n0..n1 (the blocks of qmatmul.c: q, d, m as outrider_qmatmul takes them) into
 * out [n1 - n0, outrider_i8_row_bytes(kind, K)]. 0, or -1 for arguments it cannot take. */
int outrider_i8_pack(int kind, int64_t K, const void *q, const void *d, const void *m, int64_t n0, int64_t n1,
                        void *out, int threads) {
    if (!base_known(kind, K) || (BASE(kind) == KIND_Q4_1 && !m) || n0 < 0 || n1 < n0 || threads < 1) return -1;
    const int64_t B = K / QK, qrow = B * (q8(kind) ? QK : QK / 2);
    const int64_t drow = scale_row_bytes(kind, B), mrow = min_row_bytes(kind, B);
    const int64_t orow = outrider_i8_row_bytes(kind, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = n0; n < n1; n++)
        pack_row(kind, K, (const uint8_t *)q + n * qrow, (const uint8_t *)d + n * drow,
                 m ? (const uint8_t *)m + n * mrow : 0, (uint8_t *)out + (n - n0) * orow);
    return 0;
}

#else  /* portable: no int8 kernel, nothing is packed (native.i8_available) */
int64_t outrider_i8_row_bytes(int kind, int64_t K) { (void)kind; (void)K; return -1; }
int outrider_i8_pack(int kind, int64_t K, const void *q, const void *d, const void *m, int64_t n0, int64_t n1,
                        void *out, int threads) {
    (void)kind; (void)K; (void)q; (void)d; (void)m; (void)n0; (void)n1; (void)out; (void)threads;
    return -1;
}
#endif
