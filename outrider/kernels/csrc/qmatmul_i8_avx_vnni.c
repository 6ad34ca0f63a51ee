/* The AVX2 int8 kernel's (qmatmul_i8_avx2.c) choice of its integer sums' instruction, AVX-VNNI's
 * 256-bit vpdpbusd or vpmaddubsw (qmatmul_i8_avx2_dot.h), made at run time; and the CPU's own bound
 * on the products as the kernel makes them (outrider_i8_peak: scripts/bench_verify_cost.py times it).
 * AVX2 builds without AVX-512 VNNI only (qmatmul_i8.c has the others' stubs).
 */
#include <stdint.h>

#include "isa.h"

#if defined(OUTRIDER_AVX2) && !defined(OUTRIDER_VNNI512)

/* Whether the integer sums take AVX-VNNI: -1 not yet asked, else 0 or 1. */
static int avx_vnni = -1;

/* mode 1: AVX-VNNI where the CPU has it (the default), 0: vpmaddubsw; -1: only asks. Returns
 * whether it is in use. Not to be changed while a product runs. */
int outrider_i8_avx_vnni(int mode) {
    if (mode >= 0 || avx_vnni < 0) avx_vnni = mode != 0 && __builtin_cpu_supports("avxvnni");
    return avx_vnni;
}

/* The CPU's own bound on the products as qmatmul_i8_avx2.c's kernel makes them: `rounds` x 48
 * vpmaddubsw (32 multiply-adds each: 24 x 64 a round, as qmatmul_i8.c's peak counts), each added by
 * vpaddw into one of 8 16-bit accumulators (the Q4 path's pair), on each of `threads` threads, nothing loaded;
 * written in assembly (as intrinsics the compiler hoists the products and spills the sums).
 * Returns a value of the sums so that none is dropped. */
#define PAIR(T, A) "vpmaddubsw %[c], %[b], %%ymm" #T "\n\tvpaddw %%ymm" #T ", %[" #A "], %[" #A "]\n\t"
#define EIGHT PAIR(14, a0) PAIR(15, a1) PAIR(14, a2) PAIR(15, a3) PAIR(14, a4) PAIR(15, a5) PAIR(14, a6) PAIR(15, a7)
#define DP(A) "%{vex%} vpdpbusd %[c], %[b], %[" #A "]\n\t"
#define EIGHT_DP DP(a0) DP(a1) DP(a2) DP(a3) DP(a4) DP(a5) DP(a6) DP(a7)
int outrider_i8_peak(int64_t rounds, int threads) {
    int sink = 0;
    if (outrider_i8_avx_vnni(-1)) {  /* AVX-VNNI: 48 vpdpbusd a round (32 multiply-adds each) into 8 sums */
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            __m256i a0 = _mm256_set1_epi32(0), a1 = _mm256_set1_epi32(1), a2 = _mm256_set1_epi32(2),
                    a3 = _mm256_set1_epi32(3), a4 = _mm256_set1_epi32(4), a5 = _mm256_set1_epi32(5),
                    a6 = _mm256_set1_epi32(6), a7 = _mm256_set1_epi32(7);
            const __m256i b = _mm256_set1_epi8(1), c = _mm256_set1_epi8(2);
            for (int64_t r = 0; r < rounds; r++)
                __asm__ volatile(EIGHT_DP EIGHT_DP EIGHT_DP EIGHT_DP EIGHT_DP EIGHT_DP
                                 : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
                                   [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
                                 : [b] "x"(b), [c] "x"(c));
            const __m256i all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int i = 0; i < 8; i++) {
                int32_t v[8];
                _mm256_storeu_si256((__m256i *)v, all[i]);
                for (int k = 0; k < 8; k++) sink += v[k];
            }
        }
        return sink;
    }
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m256i a0 = _mm256_set1_epi16(0), a1 = _mm256_set1_epi16(1), a2 = _mm256_set1_epi16(2),
                a3 = _mm256_set1_epi16(3), a4 = _mm256_set1_epi16(4), a5 = _mm256_set1_epi16(5),
                a6 = _mm256_set1_epi16(6), a7 = _mm256_set1_epi16(7);
        const __m256i b = _mm256_set1_epi8(1), c = _mm256_set1_epi8(2);
        for (int64_t r = 0; r < rounds; r++)
            __asm__ volatile(EIGHT EIGHT EIGHT EIGHT EIGHT EIGHT
                             : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
                               [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
                             : [b] "x"(b), [c] "x"(c)
                             : "xmm14", "xmm15");
        const __m256i all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int i = 0; i < 8; i++) {
            int32_t v[8];
            _mm256_storeu_si256((__m256i *)v, _mm256_madd_epi16(all[i], _mm256_set1_epi16(1)));
            for (int k = 0; k < 8; k++) sink += v[k];
        }
    }
    return sink;
}
#undef EIGHT
#undef PAIR
#undef EIGHT_DP
#undef DP
#endif
