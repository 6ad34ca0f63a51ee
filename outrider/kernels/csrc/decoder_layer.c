/* One decoder layer for a few rows (decode and verify forwards), in one call from Python.
 *
 * The torch path of a layer (models/decoder.py) is some two hundred small tensor operations; for
 * one to a few dozen rows their dispatch costs more than the layer's arithmetic
 * (docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Decoding and quantized weights: "The
 * native layer"). This does the same layer in C:
 *
 *   h = rmsnorm(x) ; qkv = h W_qkv^T (+ bias) ; per head: q/k norm (Qwen3), rotary ;
 *   K/V written to the cache rows ; attention of each row over the cache rows it may see ;
 *   x += attn W_o^T ; x += down(silu(gate) * up) of rmsnorm(x)
 *
 * The matrix products are outrider_qmatmul (qmatmul.c); everything else is a fixed sequence of
 * float32 operations per row, so each row's result is the same whatever the other rows of the
 * batch (a k-token verify gives each row what a 1-token step gives) and whatever the thread
 * count. A prefill (`fill` 3 or 1, decoder.py's _native_fill) multiplies on the AMX tiles instead
 * (matmul_amx.c), and splits the per-row steps between the threads. A weight may be a stack of parts of
 * different kinds (QWeight.parts), each multiplied on its own into its columns. Rotary is torch's
 * formula, x * cos + (-x2 or x1) * sin, operation for operation.
 *
 * I == 0: attention only, x += attn W_o^T and no MLP (w[2], w[3] not read): the caller runs the MLP
 * (a mixture of experts: kernels/decoder_layer.py runs its router and experts in torch).
 * h_in: the qkv product's input [R, w[0].in] when the caller normed it itself (an EAGLE-3 head's
 * [norm(embedding) ; norm(hidden)]); NULL: rmsnorm(x) with in_norm, as a decoder layer.
 * Shapes (floats, row-major): x [R, E]; cos, sin [R, D]; mask [R, L] bytes (NULL: row r sees the
 * cache rows 0..crow[r] of its slot); the cache [S, G, Lmax + 1, D] of one layer (float32, or
 * float16 where kv_half: attention.c), addressed by slot[r] and crow[r];
 * work >= R * (Q + H*D + E + 3*I) + R * H * (L + 8) floats, Q = (H + 2G) * D.
 * mass: NULL, or the scores option (attention.h AttentionMass): the attention weights the rows gave
 * each key, summed per kv head into the caller's buffer; the layer's outputs are the same bits.
 * Attention runs one task per (row, kv head), kv head major (one per (row, query head) when a lone
 * row has few kv heads), the threads splitting the tasks when there is work enough; which thread
 * runs a task changes nothing in its result.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

int outrider_qmatmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
                     const void *m, int64_t N, float *y, int threads);
int outrider_amx_matmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const void *d,
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

/* The sum of squares in 8 lanes (lane e: the values e, 8 + e, ... in order, a multiply then an add;
 * the compiler vectorizes the lane loop without reordering it), the lanes added ((0+1)+(2+3)) +
 * ((4+5)+(6+7)), then the values past the last whole 8 one by one: one fixed sequence in every
 * variant, 8 sums in flight instead of one chain of E dependent adds (a 512-token SmolLM2 prefill
 * on one thread, as AVX2: 1,035 against 1,044 ms). */
static void rmsnorm_row(const float *x, const float *w, float eps, int64_t E, float *out) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= E; i += 8)
        for (int e = 0; e < 8; e++) lanes[e] = lanes[e] + x[i + e] * x[i + e];
    float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < E; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)E + eps);
    for (i = 0; i < E; i++) out[i] = w[i] * (x[i] * inv);
}

static void rotate(float *x, const float *c, const float *s, int D) {  /* half-split, as torch */
    int half = D / 2;
    float tmp[512];
    for (int i = 0; i < half; i++) tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < D; i++) tmp[i] = x[i] * c[i] + x[i - half] * s[i];
    memcpy(x, tmp, sizeof(float) * D);
}

/* fill: 0, the row kernel (bit-identical rows: decode and verify); 3 or 1, a prefill's products on
 * the tile unit (matmul_amx.c, x in 3 bfloat16 parts: exact products; or 1: a drafter's lossy prefill),
 * the row kernel for a weight matmul_amx.c does not take. */
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
    if (fill && outrider_amx_matmul((int)w->kind, x, R, w->in, w->q, w->d, w->m, w->out, y, threads, fill) == 0)
        return 0;
    return outrider_qmatmul((int)w->kind, x, R, w->in, w->q, w->d, w->m, w->out, y, threads);
}

int outrider_layer(int64_t R, int64_t E, int64_t H, int64_t G, int64_t D, int64_t I, float *x,
                   const float *h_in, const float *in_norm, const float *post_norm, float eps, const QWeight *w,
                   const float *qkv_bias, const float *q_norm, const float *k_norm, const float *cos,
                   const float *sin, void *k_cache, void *v_cache, int64_t slot_stride, int64_t row_stride,
                   const int64_t *slot, const int64_t *crow, const uint8_t *mask, int64_t L, float *work,
                   int threads, int fill, int kv_half, const AttentionMass *mass, const KVPages *pages) {
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
            int64_t at = pages ? pages->rows[slot[r] * pages->map_stride + crow[r]] + g * pages->head_stride
                               : slot[r] * slot_stride + g * g_stride + crow[r] * row_stride;
            outrider_kv_store(k_cache, at, row + (H + g) * D, D, kv_half);
            outrider_kv_store(v_cache, at, row + (H + G + g) * D, D, kv_half);
        }
    }
    const int64_t groups = H / G;
    /* One task per (row, kv head): each cached key and value row is read once for the `groups`
     * query heads that share it; with fewer such tasks than two per thread (one row, few kv heads),
     * one task per (row, query head), so that the threads share the work evenly. Each (row, head)
     * gets its own fixed sequence of operations either way (attention.c). */
    const Attention job = {R, H, G, D, L, R * G < 2 * threads ? groups : 1, qkv, k_cache, v_cache, slot_stride,
                           row_stride, slot, crow, mask, 1.0f / sqrtf((float)D), scores, att, kv_half, 0, 0, pages};
    outrider_attend(&job, threads);
    if (mass) outrider_attention_mass(&job, mass, threads);  /* the scores option: reads, never changes, att */
    if (matmul(&w[1], att, R, h, threads, fill)) return -1;
    if (I == 0) {  /* attention only: the caller runs the MLP (an MoE layer's, in torch: kernels/decoder_layer.py) */
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
        for (int64_t i = 0; i < R * E; i++) x[i] = x[i] + h[i];
        return 0;
    }
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
#if defined(OUTRIDER_AVX2)
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                  _mm256_loadu_ps(up + i)));
        }
        for (; i < I; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
#else  /* portable: exp8's steps one value at a time (attention.h) */
        for (; i < I; i++) a[i] = gate[i] / (1.0f + outrider_exp1(0.0f - gate[i])) * up[i];
#endif
    }
    if (matmul(&w[3], act, R, h, threads, fill)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (many)
    for (int64_t i = 0; i < R * E; i++) x[i] = x[i] + h[i];
    return 0;
}

/* Layers first..last-1 of a decoder in one call (kernels/decoder_layer.py NativeLayers.run): layer i's own
 * weights and norms in spec[i], its cache in k_caches[i] / v_caches[i], everything else shared
 * (x is updated in place, as by outrider_layer). One ctypes call a forward instead of one a layer:
 * the ~27 arguments of a call cost Python ~30 us, a tenth of a SmolLM2 decode step in all. */
typedef struct {  /* what differs between layers */
    const float *in_norm, *post_norm, *qkv_bias, *q_norm, *k_norm;
    const QWeight *w;  /* [4]: qkv, o, gate_up, down */
} LayerSpec;

int outrider_layers(int64_t first, int64_t last, const LayerSpec *spec, void *const *k_caches,
                    void *const *v_caches, int64_t R, int64_t E, int64_t H, int64_t G, int64_t D, int64_t I,
                    float *x, float eps, const float *cos, const float *sin, int64_t slot_stride,
                    int64_t row_stride, const int64_t *slot, const int64_t *crow, const uint8_t *mask, int64_t L,
                    float *work, int threads, int fill, int kv_half, const AttentionMass *mass,
                    const KVPages *pages) {
    for (int64_t i = first; i < last; i++) {
        const LayerSpec *s = &spec[i];
        AttentionMass here;  /* layer i's part of the scores, when asked */
        if (mass) here = *mass, here.layer = i;
        int status = outrider_layer(R, E, H, G, D, I, x, NULL, s->in_norm, s->post_norm, eps, s->w, s->qkv_bias,
                                    s->q_norm, s->k_norm, cos, sin, k_caches[i], v_caches[i], slot_stride,
                                    row_stride, slot, crow, mask, L, work, threads, fill, kv_half,
                                    mass ? &here : NULL, pages);
        if (status) return status;
    }
    return 0;
}
