/* One decoder layer for a few rows (decode and verify forwards), in one call from Python.
 *
 * The torch path of a layer (models/decoder.py) is some two hundred small tensor operations; for
 * one to a few dozen rows their dispatch costs more than the layer's arithmetic (measured on
 * SmolLM2-135M q4: 11 ms of kernels in a 22 ms decode step). This does the same layer in C:
 *
 *   h = rmsnorm(x) ; qkv = h W_qkv^T (+ bias) ; per head: q/k norm (Qwen3), rotary ;
 *   K/V written to the cache rows ; attention of each row over the cache rows it may see ;
 *   x += attn W_o^T ; x += down(silu(gate) * up) of rmsnorm(x)
 *
 * The matrix products are outrider_qmatmul (qmatmul.c); everything else is a fixed sequence of
 * float32 operations per row, so each row's result is the same whatever the other rows of the
 * batch (a k-token verify gives each row what a 1-token step gives) and whatever the thread
 * count. A prefill (`fill` 3 or 1, decoder.py's _native_fill) multiplies on the AMX tiles instead
 * (fill.c), and splits the per-row steps between the threads. A weight may be a stack of parts of
 * different kinds (QWeight.parts), each multiplied on its own into its columns. Rotary is torch's
 * formula, x * cos + (-x2 or x1) * sin, operation for operation.
 *
 * h_in: the qkv product's input [R, w[0].in] when the caller normed it itself (an EAGLE-3 head's
 * [norm(embedding) ; norm(hidden)]); NULL: rmsnorm(x) with in_norm, as a decoder layer.
 * Shapes (floats, row-major): x [R, E]; cos, sin [R, D]; mask [R, L] bytes (NULL: row r sees the
 * cache rows 0..crow[r] of its slot); the cache [S, G, Lmax + 1, D] of one layer, addressed by
 * slot[r] and crow[r]; work >= R * (Q + H*D + E + 3*I) + R * H * (L + 8) floats, Q = (H + 2G) * D.
 * Attention runs one task per (row, kv head), kv head major (one per (row, query head) when a lone
 * row has few kv heads), the threads splitting the tasks when there is work enough; which thread
 * runs a task changes nothing in its result.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int outrider_qmatmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                     const void *m, int64_t N, float *y, int threads);
int outrider_fill_matmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                         const void *m, int64_t N, float *y, int threads, int parts);

#define ROWS_PARALLEL 32  /* rows from which the per-row steps are split between the threads */

typedef struct QWeight {  /* one weight as the kernel reads it (native.NativeWeight) */
    int64_t kind, out, in;
    const void *q;
    const void *d, *m;  /* float32, or float16 where kind has HALF (qmatmul.c) */
    int64_t nparts;     /* > 0: a stack of weights of different kinds (quant_load.RowStack, a GGUF's
                         * Q and K in one kind, V in another), their outputs joined: `parts` */
    const struct QWeight *parts;
} QWeight;

static void rmsnorm_row(const float *x, const float *w, float eps, int64_t E, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < E; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)E + eps);
    for (int64_t i = 0; i < E; i++) out[i] = w[i] * (x[i] * inv);
}

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

/* The scores of query q against the 8 keys j0..j0+7 (a key past `last` reads key `last`: computed,
 * then ignored by the caller). Each score is one fixed sequence of operations whatever its lane:
 * multiply-adds over 8-value chunks of the head in order, the 8 lanes added as ((0+1)+(2+3)) +
 * ((4+5)+(6+7)) (the hadd tree below), then the values past the last whole chunk one by one. */
static inline __m256 dot8(const float *q, const float *keys, int64_t row_stride, int64_t j0, int64_t last,
                          int64_t D) {
    const float *k[8];
    __m256 acc[8];
    for (int l = 0; l < 8; l++) {
        k[l] = keys + (j0 + l <= last ? j0 + l : last) * row_stride;
        acc[l] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        for (int l = 0; l < 8; l++) acc[l] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[l] + i), acc[l]);
    }
    __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* keys 0-3 | 4-7, lanes 0-3 | 4-7 */
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (i == D) return sum;
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int l = 0; l < 8; l++)
        for (int64_t t = i; t < D; t++) lanes[l] = lanes[l] + q[t] * k[l][t];
    return _mm256_loadu_ps(lanes);
}

/* out[0 .. 8 nv) = the sum over the seen keys j <= last, in order, of p[j] * value_j[0 .. 8 nv), each
 * element as o = fma(p, v, o), kept in registers across the keys. */
static inline __attribute__((always_inline)) void weigh_values(int nv, const float *values, int64_t row_stride,
                                                              const float *p, const uint8_t *seen, int64_t last,
                                                              float *out) {
    __m256 o[8];
    for (int i = 0; i < nv; i++) o[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j <= last; j++) {
        if (seen && !seen[j]) continue;
        const float *v = values + j * row_stride;
        __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < nv; i++) o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), o[i]);
    }
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, o[i]);
}

#if defined(__AVX512F__)
/* weigh_values for nh heads at once (AVX-512; nv vectors of 16 values a head, nh * nv <= 24):
 * each key's value row is loaded once for all nh heads instead of once a head. Head a's weights
 * are p[a * Lp + j], its output out[a * D ..]; each element's operations are weigh_values' own
 * (o = fma(p, v, o) over the seen keys in order), so the results are the same bits. */
static inline __attribute__((always_inline)) void weigh_heads(int nh, int nv, const float *values, int64_t row_stride,
                                                             const float *p, int64_t Lp, const uint8_t *seen,
                                                             int64_t last, float *out, int64_t D) {
    __m512 o[6][8];
    for (int a = 0; a < nh; a++)
        for (int i = 0; i < nv; i++) o[a][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j <= last; j++) {
        if (seen && !seen[j]) continue;
        const float *v = values + j * row_stride;
        __m512 vj[8];
        for (int i = 0; i < nv; i++) vj[i] = _mm512_loadu_ps(v + 16 * i);
        for (int a = 0; a < nh; a++) {
            __m512 pj = _mm512_set1_ps(p[a * Lp + j]);
            for (int i = 0; i < nv; i++) o[a][i] = _mm512_fmadd_ps(pj, vj[i], o[a][i]);
        }
    }
    for (int a = 0; a < nh; a++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(out + a * D + 16 * i, o[a][i]);
}

/* Heads a0.. of a task whose head dimension is 64 or 128, as many at a time as 24 registers hold:
 * returns the number of heads done (0 for other head sizes: the caller's per-head path). */
static int weigh_heads_all(int64_t per, const float *values, int64_t row_stride, const float *p, int64_t Lp,
                           const uint8_t *seen, int64_t last, float *out, int64_t D) {
    if (D != 64 && D != 128) return 0;
    const int nv = (int)(D / 16), most = 24 / nv;
    int64_t a = 0;
    for (; a < per; ) {
        int nh = per - a < most ? (int)(per - a) : most;
        const float *pa = p + a * Lp;
        float *oa = out + a * D;
#define HEADS(NH, NV) case NH * 16 + NV: weigh_heads(NH, NV, values, row_stride, pa, Lp, seen, last, oa, D); break;
        switch (nh * 16 + nv) {
            HEADS(6, 4) HEADS(5, 4) HEADS(4, 4) HEADS(3, 4) HEADS(2, 4) HEADS(1, 4)
            HEADS(3, 8) HEADS(2, 8) HEADS(1, 8)
            default: return (int)a;
        }
#undef HEADS
        a += nh;
    }
    return (int)a;
}
#endif

static void rotate(float *x, const float *c, const float *s, int D) {  /* half-split, as torch */
    int half = D / 2;
    float tmp[512];
    for (int i = 0; i < half; i++) tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < D; i++) tmp[i] = x[i] * c[i] + x[i - half] * s[i];
    memcpy(x, tmp, sizeof(float) * D);
}

/* fill: 0, the row kernel (bit-identical rows: decode and verify); 3 or 1, a prefill's products on
 * the tile unit (fill.c, x in 3 bfloat16 parts: exact products; or 1: a drafter's lossy prefill),
 * the row kernel for a weight fill.c does not take. */
static int matmul(const QWeight *w, const float *x, int64_t R, float *y, int threads, int fill) {
    if (w->nparts > 0) {  /* each part into a scratch [R, part's out], then into its columns of y [R, out] */
        int64_t widest = 0, at = 0;
        for (int64_t p = 0; p < w->nparts; p++) widest = w->parts[p].out > widest ? w->parts[p].out : widest;
        float *part = malloc(sizeof(float) * R * widest);
        if (!part) return -1;
        for (int64_t p = 0; p < w->nparts; p++) {
            const int64_t n = w->parts[p].out;
            if (w->parts[p].nparts || matmul(&w->parts[p], x, R, part, threads, fill)) {
                free(part);
                return -1;
            }
            for (int64_t r = 0; r < R; r++) memcpy(y + r * w->out + at, part + r * n, sizeof(float) * n);
            at += n;
        }
        free(part);
        return at == w->out ? 0 : -1;
    }
    if (fill && outrider_fill_matmul((int)w->kind, x, R, w->in, w->q, w->d, w->m, w->out, y, threads, fill) == 0)
        return 0;
    return outrider_qmatmul((int)w->kind, x, R, w->in, w->q, w->d, w->m, w->out, y, threads);
}

int outrider_layer(int64_t R, int64_t E, int64_t H, int64_t G, int64_t D, int64_t I, float *x,
                   const float *h_in, const float *in_norm, const float *post_norm, float eps, const QWeight *w,
                   const float *qkv_bias, const float *q_norm, const float *k_norm, const float *cos,
                   const float *sin, float *k_cache, float *v_cache, int64_t slot_stride, int64_t row_stride,
                   const int64_t *slot, const int64_t *crow, const uint8_t *mask, int64_t L, float *work,
                   int threads, int fill) {
    if (R < 1 || D > 512 || D % 2 || H % G || H / G > 64 || threads < 1) return -1;
    const int64_t Q = (H + 2 * G) * D, g_stride = slot_stride / G;  /* a slot's kv heads, one after another */
    float *qkv = work, *att = qkv + R * Q, *h = att + R * H * D, *gu = h + R * E, *act = gu + R * 2 * I;
    float *scores = act + R * I;
    /* The per-row steps below run on the threads where there are many rows (a prefill): each row's
     * result is the same whichever thread computes it. */
    const int many = R >= ROWS_PARALLEL;
#pragma omp parallel for num_threads(threads) schedule(static) if (many && !h_in)
    for (int64_t r = 0; r < (h_in ? 0 : R); r++) rmsnorm_row(x + r * E, in_norm, eps, E, h + r * E);
    if (matmul(&w[0], h_in ? h_in : h, R, qkv, threads, fill)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t r = 0; r < R; r++) {  /* bias, q/k norms, rotary; K/V into the cache */
        float *row = qkv + r * Q;
        if (qkv_bias) for (int64_t i = 0; i < Q; i++) row[i] = row[i] + qkv_bias[i];
        for (int64_t hh = 0; hh < H + G; hh++) {
            float *head = row + hh * D;
            if (q_norm && hh < H) rmsnorm_row(head, q_norm, eps, D, head);
            if (k_norm && hh >= H) rmsnorm_row(head, k_norm, eps, D, head);
            rotate(head, cos + r * D, sin + r * D, (int)D);
        }
        for (int64_t g = 0; g < G; g++) {
            int64_t at = slot[r] * slot_stride + g * g_stride + crow[r] * row_stride;
            memcpy(k_cache + at, row + (H + g) * D, sizeof(float) * D);
            memcpy(v_cache + at, row + (H + G + g) * D, sizeof(float) * D);
        }
    }
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t groups = H / G;
    /* One task per (row, kv head): each cached key and value row is read once for the `groups`
     * query heads that share it; with fewer such tasks than two per thread (one row, few kv heads),
     * one task per (row, query head), so that the threads share the work evenly. Each (row, head)
     * gets its own fixed sequence of operations either way. */
    const int64_t parts = R * G < 2 * threads ? groups : 1, per = groups / parts;  /* query heads a task takes */
#pragma omp parallel for num_threads(threads) schedule(static) if (R * H * L >= 2048)
    for (int64_t task = 0; task < R * G * parts; task++) {
        /* kv head major: the threads' consecutive tasks share a head's keys and values (L2) */
        int64_t g = task / (R * parts), r = task % (R * parts) / parts, first = g * groups + task % parts * per;
        const float *keys = k_cache + slot[r] * slot_stride + g * g_stride;
        const float *values = v_cache + slot[r] * slot_stride + g * g_stride;
        const uint8_t *seen = mask ? mask + r * L : 0;
        int64_t last = mask ? L - 1 : crow[r];
        const int64_t Lp = (L + 8) / 8 * 8;  /* a head's scores, padded to whole lanes */
        float *s = scores + task * per * Lp, top[64], total[64];  /* total: 1 / the sum of weights */
        const float *q = qkv + r * Q + first * D;  /* the task's query heads, one after another */
        for (int64_t a = 0; a < per; a++) top[a] = -INFINITY, total[a] = 0.0f;
        for (int64_t j0 = 0; j0 <= last; j0 += 8) {  /* 8 keys at a time: each read once per query head */
            for (int64_t a = 0; a < per; a++) {
                float *sa = s + a * Lp + j0;
                _mm256_storeu_ps(sa, _mm256_mul_ps(dot8(q + a * D, keys, row_stride, j0, last, D), _mm256_set1_ps(scale)));
                for (int l = 0; l < 8; l++) {
                    if (j0 + l > last || (seen && !seen[j0 + l])) sa[l] = -INFINITY;
                    else if (sa[l] > top[a]) top[a] = sa[l];
                }
            }
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
            __m256 sum = _mm256_setzero_ps(), zero = _mm256_setzero_ps(), none = _mm256_set1_ps(-INFINITY);
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
#if defined(__AVX512F__)
        done = weigh_heads_all(per, values, row_stride, s, Lp, seen, last, out, D);
#endif
        for (int64_t a = done; a < per; a++) {  /* the p-weighted values, a head at a time */
            float *p = s + a * Lp, *o = out + a * D;
            int64_t c = 0;
            for (; c + 64 <= D; c += 64) weigh_values(8, values + c, row_stride, p, seen, last, o + c);
            if (c + 32 <= D) weigh_values(4, values + c, row_stride, p, seen, last, o + c), c += 32;
            if (c + 16 <= D) weigh_values(2, values + c, row_stride, p, seen, last, o + c), c += 16;
            if (c + 8 <= D) weigh_values(1, values + c, row_stride, p, seen, last, o + c), c += 8;
            for (int64_t i = c; i < D; i++) o[i] = 0.0f;
            for (int64_t j = 0; j <= last && c < D; j++) {
                if (seen && !seen[j]) continue;
                for (int64_t i = c; i < D; i++) o[i] = fmaf(p[j], values[j * row_stride + i], o[i]);
            }
        }
    }
    if (matmul(&w[1], att, R, h, threads, fill)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t i = r * E; i < (r + 1) * E; i++) x[i] = x[i] + h[i];
        rmsnorm_row(x + r * E, post_norm, eps, E, h + r * E);
    }
    if (matmul(&w[2], h, R, gu, threads, fill)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t r = 0; r < R; r++) {  /* silu(gate) * up = gate / (1 + e^-gate) * up, 8 lanes at a time */
        const float *gate = gu + r * 2 * I, *up = gate + I;
        float *a = act + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                  _mm256_loadu_ps(up + i)));
        }
        for (; i < I; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    if (matmul(&w[3], act, R, h, threads, fill)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t i = 0; i < R * E; i++) x[i] = x[i] + h[i];
    return 0;
}

/* Layers first..last-1 of a decoder in one call (native/layer.py NativeLayers.run): layer i's own
 * weights and norms in spec[i], its cache in k_caches[i] / v_caches[i], everything else shared
 * (x is updated in place, as by outrider_layer). One ctypes call a forward instead of one a layer:
 * the ~27 arguments of a call cost Python ~30 us, a tenth of a SmolLM2 decode step in all. */
typedef struct {  /* what differs between layers */
    const float *in_norm, *post_norm, *qkv_bias, *q_norm, *k_norm;
    const QWeight *w;  /* [4]: qkv, o, gate_up, down */
} LayerSpec;

int outrider_layers(int64_t first, int64_t last, const LayerSpec *spec, float *const *k_caches,
                    float *const *v_caches, int64_t R, int64_t E, int64_t H, int64_t G, int64_t D, int64_t I,
                    float *x, float eps, const float *cos, const float *sin, int64_t slot_stride,
                    int64_t row_stride, const int64_t *slot, const int64_t *crow, const uint8_t *mask, int64_t L,
                    float *work, int threads, int fill) {
    for (int64_t i = first; i < last; i++) {
        const LayerSpec *s = &spec[i];
        int status = outrider_layer(R, E, H, G, D, I, x, NULL, s->in_norm, s->post_norm, eps, s->w, s->qkv_bias,
                                    s->q_norm, s->k_norm, cos, sin, k_caches[i], v_caches[i], slot_stride,
                                    row_stride, slot, crow, mask, L, work, threads, fill);
        if (status) return status;
    }
    return 0;
}
