/* Attention of decode and verify rows over their cache rows (outrider_layer in decoder_layer.c calls it),
 * the K/V cache in float32 or float16 (`half`: llama.cpp's default cache type, half the bytes a
 * step reads at long contexts; each value widened exactly to float32 as it is read, so the
 * arithmetic is the float32 cache's on the rounded values). K/V rows are written rounded to
 * nearest even, as torch's .half() rounds them, so the torch path (decoder.py) and this one keep
 * the same bits. Every (row, head) is one fixed sequence of operations, whatever the batch, the
 * thread count or the cache type. Two paths (isa.h): AVX2 (with AVX-512 parts), and portable C
 * (the same steps in plain loops, a score's sum in 8 lanes as AVX2's, multiply-adds as a multiply
 * then an add, so its bits may differ from AVX2's in the last place). In AVX2 builds, many rows of
 * one slot (a prefill, a long verify) take register tiles over keys turned along the lanes
 * (attention_lanes.h) with each score's and each output's operations unchanged: the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

/* Value `at` of a float32 or float16 cache: its address; 8 or 16 values from it, widened; one. */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t at, int half) {
    return half ? (const void *)((const uint16_t *)base + at) : (const void *)((const float *)base + at);
}
static inline __attribute__((always_inline)) float kv_load1(const void *base, int64_t at, int half) {
    return half ? outrider_half_float(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}
#if defined(OUTRIDER_AVX2)
static inline __attribute__((always_inline)) __m256 kv_load8(const void *base, int64_t at, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
    return _mm256_loadu_ps((const float *)base + at);
}
#endif
#if defined(OUTRIDER_AVX512)
static inline __attribute__((always_inline)) __m512 kv_load16(const void *base, int64_t at, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)));
    return _mm512_loadu_ps((const float *)base + at);
}
#endif
#include "attention_lanes.h"  /* after kv_load8, which it reads values with */

void outrider_kv_store(void *cache, int64_t at, const float *src, int64_t D, int half) {
    if (!half) {
        memcpy((float *)cache + at, src, sizeof(float) * D);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int64_t i = 0;
#if defined(OUTRIDER_AVX2)
    for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < D; i++) dst[i] = outrider_float_half(src[i]);
}

#if defined(OUTRIDER_AVX2)

/* The scores of query q against the 8 keys j0..j0+7 (a key past `last` reads key `last`: computed,
 * then ignored by the caller). Each score is one fixed sequence of operations whatever its lane:
 * multiply-adds over 8-value chunks of the head in order, the 8 lanes added as ((0+1)+(2+3)) +
 * ((4+5)+(6+7)) (the hadd tree below), then the values past the last whole chunk one by one. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *keys, int64_t row_stride,
                                                         const int64_t *map, int64_t j0, int64_t last, int64_t D,
                                                         int half) {
    int64_t k[8];  /* each key's first value */
    __m256 acc[8];
    for (int l = 0; l < 8; l++) {
        k[l] = KV_ROW(map, j0 + l <= last ? j0 + l : last, row_stride);
        acc[l] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        for (int l = 0; l < 8; l++) acc[l] = _mm256_fmadd_ps(qi, kv_load8(keys, k[l] + i, half), acc[l]);
    }
    __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* keys 0-3 | 4-7, lanes 0-3 | 4-7 */
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (i == D) return sum;
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int l = 0; l < 8; l++)
        for (int64_t t = i; t < D; t++) lanes[l] = lanes[l] + q[t] * kv_load1(keys, k[l] + t, half);
    return _mm256_loadu_ps(lanes);
}

/* out[0 .. 8 nv) = the sum over the seen keys j <= last, in order, of p[j] * value_j[0 .. 8 nv), each
 * element as o = fma(p, v, o), kept in registers across the keys. */
static inline __attribute__((always_inline)) void weigh_values(int nv, const void *values, int64_t row_stride,
                                                              const int64_t *map, const float *p, const uint8_t *seen,
                                                              int64_t last, float *out, int half) {
    __m256 o[8];
    for (int i = 0; i < nv; i++) o[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j <= last; j++) {
        if (seen && !seen[j]) continue;
        const int64_t v = KV_ROW(map, j, row_stride);
        __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < nv; i++) o[i] = _mm256_fmadd_ps(pj, kv_load8(values, v + 8 * i, half), o[i]);
    }
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, o[i]);
}

#include "attention_heads.h"  /* weigh_heads_all: several heads' weighted values at once */

/* One task: row r's query heads first..first+per-1 (of kv head g) over the cache rows it sees
 * (`paged`: through job->pages' row map, the same operations on the same values). */
static inline __attribute__((always_inline)) void attend_task(const Attention *job, int64_t task, int half,
                                                             int paged) {
    const int64_t R = job->R, G = job->G, H = job->H, D = job->D, L = job->L, Q = (H + 2 * G) * D;
    const int64_t parts = job->parts, groups = H / G, per = groups / parts;
    const int64_t slot_stride = job->slot_stride, row_stride = job->row_stride, g_stride = slot_stride / G;
    const int64_t *slot = job->slot, *crow = job->crow;
    const uint8_t *mask = job->mask;
    const float *qkv = job->qkv, scale = job->scale;
    float *scores = job->scores, *att = job->att;
    const void *k_cache = job->k_cache, *v_cache = job->v_cache;
    /* kv head major: the threads' consecutive tasks share a head's keys and values (L2) */
    int64_t g = task / (R * parts), r = task % (R * parts) / parts, first = g * groups + task % parts * per;
    const int64_t *map = paged ? job->pages->rows + slot[r] * job->pages->map_stride : 0;
    const int64_t base = paged ? g * job->pages->head_stride  /* the task's first key and value */
                               : slot[r] * slot_stride + g * g_stride;
    const void *keys = kv_at(k_cache, base, half), *values = kv_at(v_cache, base, half);
    const uint8_t *seen = mask ? mask + r * L : 0;
    int64_t last = mask ? L - 1 : crow[r];
    const int64_t Lp = (L + 8) / 8 * 8;  /* a head's scores, padded to whole lanes */
    float *s = scores + task * per * Lp, top[64], total[64];  /* total: 1 / the sum of weights */
    const float *q = qkv + r * Q + first * D;  /* the task's query heads, one after another */
    for (int64_t a = 0; a < per; a++) top[a] = -INFINITY, total[a] = 0.0f;
    if (job->kt)  /* the keys along the lanes (outrider_attend turned them): tiles of heads and keys */
        scores_from_lanes(per, q, D, job->kt + g * job->kt_stride, last, s, Lp, scale);
    else
        for (int64_t j0 = 0; j0 <= last; j0 += 8)  /* 8 keys at a time: each read once per query head */
            for (int64_t a = 0; a < per; a++)
                _mm256_storeu_ps(s + a * Lp + j0, _mm256_mul_ps(dot8(q + a * D, keys, row_stride, map, j0, last, D, half),
                                                                _mm256_set1_ps(scale)));
    /* Unseen and past-the-end scores to -inf, and each head's greatest score: a maximum rounds
     * nothing, so in 8 lanes it is the value a loop key by key finds (up to the sign of a zero,
     * which changes no e^(s - top): exp8 makes -0 and +0 alike). */
    const __m256 none = _mm256_set1_ps(-INFINITY), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t a = 0; a < per; a++) {
        float *sa = s + a * Lp;
        __m256 most = none;
        for (int64_t j = 0; j <= last; j += 8) {
            __m256 v = _mm256_loadu_ps(sa + j);
            if (seen) {
                uint64_t m8 = 0;
                memcpy(&m8, seen + j, L - j < 8 ? (size_t)(L - j) : 8);
                __m256 keep = _mm256_cmp_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))),
                                            _mm256_setzero_ps(), _CMP_NEQ_OQ);
                v = _mm256_blendv_ps(none, v, keep);
            }
            if (j + 8 > last + 1)
                v = _mm256_blendv_ps(none, v, _mm256_cmp_ps(lane, _mm256_set1_ps((float)(last - j)), _CMP_LE_OQ));
            _mm256_storeu_ps(sa + j, v);
            most = _mm256_max_ps(most, v);
        }
        __m128 four = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
        top[a] = _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
    }
    /* e^(s - top) in 8 lanes over j = 0..last rounded up to 8 (unseen and past-the-end scores
     * are -inf, their weights exactly 0), then their sum: the seen keys' weights in lane
     * (rank among the seen keys) % 8, then the lanes by a fixed tree. By rank, not by cache
     * row, so that a tree node, whose ancestors sit at rows with gaps between them, sums its
     * weights in the order the same path decoded one token a step sums them (its keys at
     * consecutive rows): the same bits, not only the same sum within rounding. */
    const int64_t span = (last + 8) / 8 * 8;
    for (int64_t a = 0; a < per; a++) {
        float *sa = s + a * Lp;
        for (int64_t j = last + 1; j < span; j++) sa[j] = -INFINITY;
        __m256 sum = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
        for (int64_t j = 0; j < span; j += 8) {
            __m256 v = _mm256_loadu_ps(sa + j);
            __m256 e = _mm256_blendv_ps(exp8(_mm256_sub_ps(v, _mm256_set1_ps(top[a]))), zero,
                                        _mm256_cmp_ps(v, none, _CMP_EQ_OQ));
            _mm256_storeu_ps(sa + j, e);
            if (!seen) sum = _mm256_add_ps(sum, e);  /* no gaps: rank = row */
        }
        if (seen) {
            float lanes[8] = {0};
            int64_t rank = 0;
            for (int64_t j = 0; j <= last; j++)
                if (seen[j]) {
                    const int l = (int)(rank++ % 8);
                    lanes[l] = lanes[l] + sa[j];
                }
            sum = _mm256_loadu_ps(lanes);
        }
        __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        total[a] = 1.0f / _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
    }
    float *out = att + r * H * D + first * D;
    for (int64_t a = 0; a < per; a++)  /* weights p = e * (1 / sum) */
        for (int64_t j = 0; j <= last; j++) s[a * Lp + j] = s[a * Lp + j] * total[a];
    int64_t done = 0;  /* heads whose p-weighted values are summed */
    done = weigh_heads_all(per, values, row_stride, map, s, Lp, seen, last, out, D, half);
    for (int64_t a = done; a < per; a++) {  /* the p-weighted values, a head at a time */
        float *p = s + a * Lp, *o = out + a * D;
        int64_t c = 0;
        for (; c + 64 <= D; c += 64) weigh_values(8, kv_at(values, c, half), row_stride, map, p, seen, last, o + c, half);
        if (c + 32 <= D) weigh_values(4, kv_at(values, c, half), row_stride, map, p, seen, last, o + c, half), c += 32;
        if (c + 16 <= D) weigh_values(2, kv_at(values, c, half), row_stride, map, p, seen, last, o + c, half), c += 16;
        if (c + 8 <= D) weigh_values(1, kv_at(values, c, half), row_stride, map, p, seen, last, o + c, half), c += 8;
        for (int64_t i = c; i < D; i++) o[i] = 0.0f;
        for (int64_t j = 0; j <= last && c < D; j++) {
            if (seen && !seen[j]) continue;
            for (int64_t i = c; i < D; i++) o[i] = fmaf(p[j], kv_load1(values, KV_ROW(map, j, row_stride) + i, half), o[i]);
        }
    }
}

#else  /* portable */
/* The score of query q against the key at k: lane e takes values e, 8 + e, ... of the head (a
 * multiply, then an add), the lanes added ((0+1)+(2+3)) + ((4+5)+(6+7)) as the AVX2 path's hadd
 * tree, then the values past the last whole 8 one by one. */
static inline __attribute__((always_inline)) float dot1(const float *q, const void *keys, int64_t k, int64_t D,
                                                        int half) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int e = 0; e < 8; e++) acc[e] = acc[e] + q[i + e] * kv_load1(keys, k + i + e, half);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < D; i++) s = s + q[i] * kv_load1(keys, k + i, half);
    return s;
}

/* One task (as the AVX2 path's attend_task): row r's query heads first..first+per-1 (of kv head g)
 * over the cache rows it sees; the softmax's sum by rank among the seen keys, in 8 lanes. */
static inline __attribute__((always_inline)) void attend_task(const Attention *job, int64_t task, int half,
                                                             int paged) {
    const int64_t R = job->R, G = job->G, H = job->H, D = job->D, L = job->L, Q = (H + 2 * G) * D;
    const int64_t parts = job->parts, groups = H / G, per = groups / parts;
    const int64_t slot_stride = job->slot_stride, row_stride = job->row_stride, g_stride = slot_stride / G;
    const uint8_t *mask = job->mask;
    int64_t g = task / (R * parts), r = task % (R * parts) / parts, first = g * groups + task % parts * per;
    const int64_t *map = paged ? job->pages->rows + job->slot[r] * job->pages->map_stride : 0;
    const int64_t base = paged ? g * job->pages->head_stride : job->slot[r] * slot_stride + g * g_stride;
    const void *keys = kv_at(job->k_cache, base, half), *values = kv_at(job->v_cache, base, half);
    const uint8_t *seen = mask ? mask + r * L : 0;
    const int64_t last = mask ? L - 1 : job->crow[r];
    const int64_t Lp = (L + 8) / 8 * 8;
    float *s = job->scores + task * per * Lp;
    const float *q = job->qkv + r * Q + first * D;
    float *out = job->att + r * H * D + first * D;
    for (int64_t a = 0; a < per; a++) {
        float *sa = s + a * Lp, top = -INFINITY, lanes[8] = {0};
        for (int64_t j = 0; j <= last; j++) {
            if (seen && !seen[j]) continue;
            sa[j] = dot1(q + a * D, keys, KV_ROW(map, j, row_stride), D, half) * job->scale;
            if (sa[j] > top) top = sa[j];
        }
        int64_t rank = 0;
        for (int64_t j = 0; j <= last; j++) {  /* e^(s - top), summed in lane (rank among the seen) % 8 */
            if (seen && !seen[j]) continue;
            sa[j] = outrider_exp1(sa[j] - top);
            const int l = (int)(rank++ % 8);
            lanes[l] = lanes[l] + sa[j];
        }
        const float total = 1.0f / (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                                    ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7])));
        float *o = out + a * D;
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t j = 0; j <= last; j++) {  /* the p-weighted values, p = e * (1 / sum) */
            if (seen && !seen[j]) continue;
            const float p = sa[j] * total;
            sa[j] = p;  /* kept for the scores option (outrider_attention_mass), as the AVX2 path keeps it */
            const int64_t v = KV_ROW(map, j, row_stride);
            for (int64_t i = 0; i < D; i++) o[i] = o[i] + p * kv_load1(values, v + i, half);
        }
    }
}
#endif

/* Where LANES_ROWS rows or more of one slot attend with one task a (row, kv head) (a prefill's, a
 * long verify's), their keys are first turned along the lanes (attention_lanes.h), once for all the
 * rows, into job->kt: the same scores' bits in register tiles at about twice the rate. */
static float *turn_keys(Attention *job, int threads) {
#if defined(OUTRIDER_AVX2)
    if (job->R < LANES_ROWS || job->parts != 1 || job->D % 8 != 0) return 0;
    int64_t last = 0;
    for (int64_t r = 0; r < job->R; r++) {
        if (job->slot[r] != job->slot[0]) return 0;
        const int64_t upto = job->mask ? job->L - 1 : job->crow[r];  /* the last key row r may see */
        last = upto > last ? upto : last;
    }
    const int64_t G = job->G, D = job->D, blocks = (last + 8) / 8;
    float *kt = malloc(sizeof(float) * G * blocks * 8 * D);
    if (!kt) return 0;  /* the one-row path: the same bits */
    const int64_t runs = (blocks + 15) / 16;  /* a task: a kv head's 16 blocks */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < G * runs; t++) {
        const int64_t g = t / runs, b0 = t % runs * 16, b1 = b0 + 16 < blocks ? b0 + 16 : blocks;
        const KVPages *pages = job->pages;
        const int64_t *map = pages ? pages->rows + job->slot[0] * pages->map_stride : 0;
        const void *keys = kv_at(job->k_cache, pages ? g * pages->head_stride
                                                     : job->slot[0] * job->slot_stride + g * (job->slot_stride / G),
                                 job->half);
        keys_along_lanes(keys, job->row_stride, map, last, D, job->half, kt + g * blocks * 8 * D, b0, b1);
    }
    job->kt = kt, job->kt_stride = blocks * 8 * D;
    return kt;
#else
    (void)job, (void)threads;
    return 0;
#endif
}

void outrider_attend(const Attention *in, int threads) {
    Attention here = *in, *job = &here;
    job->kt = 0;
    float *kt = turn_keys(job, threads);
    const int64_t tasks = job->R * job->G * job->parts;
#pragma omp parallel for num_threads(threads) schedule(static) if (job->R * job->H * job->L >= 2048)
    for (int64_t task = 0; task < tasks; task++) {
        /* four copies, each with its loads and its row addressing fixed */
        if (job->pages) {
            if (job->half) attend_task(job, task, 1, 1);
            else attend_task(job, task, 0, 1);
        } else if (job->half) attend_task(job, task, 1, 0);
        else attend_task(job, task, 0, 0);
    }
    free(kt);
}

/* The weights p each row gave each key it sees (outrider_attend's workspace after it: row r, query
 * head g * groups + i at ((g R + r) groups + i) Lp, whatever the task split), summed over the group's
 * query heads, then over the rows of an entry in row order, into the entry's [G, L] of this layer.
 * A task is a kv head and a run of keys, so no two threads add to one value and each sum's order is
 * fixed (the same bits whatever the thread count). */
void outrider_attention_mass(const Attention *job, const AttentionMass *m, int threads) {
    const int64_t R = job->R, H = job->H, G = job->G, L = job->L, groups = H / G, Lp = (L + 8) / 8 * 8;
    const int64_t run = 1024, runs = (L + run - 1) / run;
#pragma omp parallel for num_threads(threads) schedule(static) if (R * H * L >= 65536)
    for (int64_t task = 0; task < G * runs; task++) {
        const int64_t g = task / runs, j0 = task % runs * run, j1 = j0 + run < L ? j0 + run : L;
        for (int64_t r = 0; r < R; r++) {
            if (m->at[r] < 0) continue;
            float *dst = m->out + ((m->at[r] * m->layers + m->layer) * G + g) * L;
            const uint8_t *seen = job->mask ? job->mask + r * L : 0;
            const int64_t last = job->mask ? L - 1 : job->crow[r], end = last + 1 < j1 ? last + 1 : j1;
            const float *p = job->scores + (g * R + r) * groups * Lp;
            for (int64_t j = j0; j < end; j++) {
                if (seen && !seen[j]) continue;
                float sum = p[j];
                for (int64_t i = 1; i < groups; i++) sum = sum + p[i * Lp + j];
                dst[j] = dst[j] + sum;
            }
        }
    }
}
