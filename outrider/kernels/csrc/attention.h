/* What decoder_layer.c hands attention.c: one layer's attention (outrider_attend), the K/V rows' store,
 * and e^x (in 8 lanes, or one at a time in portable builds), which both use. */
#ifndef OUTRIDER_ATTENTION_H
#define OUTRIDER_ATTENTION_H
#include <stdint.h>

#include "isa.h"

/* Paged K/V (models/paged_cache.py) read in place: row j of slot s, kv head 0, is value
 * rows[s map_stride + j] of each layer's pool [G, pages + 1, P, D]; kv head g is g head_stride
 * further. The map is the block table spelt out a row at a time (table[s][j / P] P D + (j % P) D),
 * made once a forward for every layer; row L of each slot is the scratch page's first row (padding). */
typedef struct {
    const int64_t *rows;
    int64_t map_stride, head_stride;  /* in int64s, in values */
} KVPages;

/* Row j's first value from a head's first value: j row_stride in a slot cache, map[j] over pages.
 * attention.c's paths take `map` NULL in the copies made for slot caches (a constant after inlining). */
#define KV_ROW(map, j, row_stride) ((map) ? (map)[j] : (j) * (row_stride))

typedef struct {
    int64_t R, H, G, D, L;            /* rows, query heads, kv heads, head size, cache rows a row may see */
    int64_t parts;                    /* tasks a (row, kv head): 1, or H / G (one a query head) */
    const float *qkv;                 /* [R, (H + 2G) D]: the rows' rotated queries (then their K and V) */
    const void *k_cache, *v_cache;    /* [S, G, Lmax + 1, D], float32 or float16 (`half`) */
    int64_t slot_stride, row_stride;  /* in values */
    const int64_t *slot, *crow;       /* [R]: each row's slot, and its own cache row */
    const uint8_t *mask;              /* [R, L] the rows each row sees, or NULL: rows 0..crow[r] */
    float scale;                      /* 1 / sqrt(D) */
    float *scores;                    /* R H (L + 8) floats of workspace */
    float *att;                       /* [R, H D]: the output */
    int half;                         /* the cache holds float16 */
    const float *kt;                  /* outrider_attend's own: the keys along the lanes, or NULL */
    int64_t kt_stride;                /* floats a kv head of kt */
    const KVPages *pages;             /* NULL: the slot layout above; else the caches are page pools
                                       * (slot_stride and row_stride unused), rows found through it */
} Attention;

void outrider_attend(const Attention *a, int threads);

/* The scores option (SparseSpec-L's selection, drafters/sparsespec_select.py): what the rows of one
 * layer's attention gave each key, summed over the query heads of each kv head and over the rows of
 * an entry, added into out [N, layers, G, L] at [at[r], layer]; at[r] < 0: row r is not counted.
 * Read from the weights outrider_attend left in its workspace, after it: its outputs are untouched. */
typedef struct {
    float *out;         /* [N, layers, G, L] float32, accumulated into */
    const int64_t *at;  /* [R] each row's entry, or -1 */
    int64_t layers, layer;
} AttentionMass;

void outrider_attention_mass(const Attention *a, const AttentionMass *m, int threads);
/* D values of src into a cache at value `at`, rounded to float16 (nearest, even) where `half`. */
void outrider_kv_store(void *cache, int64_t at, const float *src, int64_t D, int half);

#if defined(OUTRIDER_AVX2)
static inline __m256 exp8(__m256 x) {
    /* e^x in 8 lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), a
     * fixed sequence of operations per lane: about 1 ulp, and no call into libm. x is clamped to
     * [-87.3, 88] (below: a denormal's neighbour instead of 0; above: 1.6e38 instead of inf). */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* exp8's steps for one value, in plain C (portable builds): each fused multiply-add a multiply then
 * an add, the floor from a conversion (|x log2 e| < 128 after the clamp), so no call into libm. */
static inline float outrider_exp1(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f + 0.5f;
    float n = (float)(int32_t)t;  /* toward zero, then down to the floor */
    if (n > t) n = n - 1.0f;
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + (x + 1.0f);
    return y * outrider_bits_float((uint32_t)((int32_t)n + 127) << 23);
}

#endif
