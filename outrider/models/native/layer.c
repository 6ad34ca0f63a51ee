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
 * count. Rotary is torch's formula, x * cos + (-x2 or x1) * sin, operation for operation.
 *
 * h_in: the qkv product's input [R, w[0].in] when the caller normed it itself (an EAGLE-3 head's
 * [norm(embedding) ; norm(hidden)]); NULL: rmsnorm(x) with in_norm, as a decoder layer.
 * Shapes (floats, row-major): x [R, E]; cos, sin [R, D]; mask [R, L] bytes (NULL: row r sees the
 * cache rows 0..crow[r] of its slot); the cache [S, G, Lmax + 1, D] of one layer, addressed by
 * slot[r] and crow[r]; work >= R * (Q + H*D + E + 3*I) + R * H * L floats, Q = (H + 2G) * D.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

int outrider_qmatmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const float *d,
                     const float *m, int64_t N, float *y, int threads);

typedef struct {  /* one weight as the kernel reads it (native.NativeWeight) */
    int64_t kind, out, in;
    const void *q;
    const float *d, *m;
} QWeight;

static void rmsnorm_row(const float *x, const float *w, float eps, int64_t E, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < E; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)E + eps);
    for (int64_t i = 0; i < E; i++) out[i] = w[i] * (x[i] * inv);
}

static float dot(const float *a, const float *b, int64_t n) {  /* 8 lanes, then lanes in order */
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += lanes[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void rotate(float *x, const float *c, const float *s, int D) {  /* half-split, as torch */
    int half = D / 2;
    float tmp[512];
    for (int i = 0; i < half; i++) tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < D; i++) tmp[i] = x[i] * c[i] + x[i - half] * s[i];
    memcpy(x, tmp, sizeof(float) * D);
}

static int matmul(const QWeight *w, const float *x, int64_t R, float *y, int threads) {
    return outrider_qmatmul((int)w->kind, x, R, w->in, w->q, w->d, w->m, w->out, y, threads);
}

int outrider_layer(int64_t R, int64_t E, int64_t H, int64_t G, int64_t D, int64_t I, float *x,
                   const float *h_in, const float *in_norm, const float *post_norm, float eps, const QWeight *w,
                   const float *qkv_bias, const float *q_norm, const float *k_norm, const float *cos,
                   const float *sin, float *k_cache, float *v_cache, int64_t slot_stride, int64_t row_stride,
                   const int64_t *slot, const int64_t *crow, const uint8_t *mask, int64_t L, float *work,
                   int threads) {
    if (R < 1 || D > 512 || D % 2 || H % G || threads < 1) return -1;
    const int64_t Q = (H + 2 * G) * D, g_stride = slot_stride / G;  /* a slot's kv heads, one after another */
    float *qkv = work, *att = qkv + R * Q, *h = att + R * H * D, *gu = h + R * E, *act = gu + R * 2 * I;
    float *scores = act + R * I;
    if (!h_in) for (int64_t r = 0; r < R; r++) rmsnorm_row(x + r * E, in_norm, eps, E, h + r * E);
    if (matmul(&w[0], h_in ? h_in : h, R, qkv, threads)) return -1;
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
#pragma omp parallel for num_threads(threads) schedule(static) if (R * H * L > 16384)
    for (int64_t task = 0; task < R * H; task++) {  /* one (row, head): softmax over the seen rows */
        int64_t r = task / H, hh = task % H, g = hh / groups;
        const float *q = qkv + r * Q + hh * D;
        const float *keys = k_cache + slot[r] * slot_stride + g * g_stride;
        const float *values = v_cache + slot[r] * slot_stride + g * g_stride;
        const uint8_t *seen = mask ? mask + r * L : 0;
        int64_t last = mask ? L - 1 : crow[r];
        float *s = scores + task * L, top = -INFINITY;
        for (int64_t j = 0; j <= last; j++) {
            if (seen && !seen[j]) continue;
            s[j] = dot(q, keys + j * row_stride, D) * scale;
            if (s[j] > top) top = s[j];
        }
        float total = 0.0f;
        for (int64_t j = 0; j <= last; j++) {
            if (seen && !seen[j]) continue;
            s[j] = expf(s[j] - top);
            total += s[j];
        }
        float *out = att + r * H * D + hh * D;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int64_t j = 0; j <= last; j++) {
            if (seen && !seen[j]) continue;
            const float p = s[j] / total, *v = values + j * row_stride;
            for (int64_t i = 0; i < D; i++) out[i] = out[i] + p * v[i];
        }
    }
    if (matmul(&w[1], att, R, h, threads)) return -1;
    for (int64_t i = 0; i < R * E; i++) x[i] = x[i] + h[i];
    for (int64_t r = 0; r < R; r++) rmsnorm_row(x + r * E, post_norm, eps, E, h + r * E);
    if (matmul(&w[2], h, R, gu, threads)) return -1;
    for (int64_t r = 0; r < R; r++) {
        const float *gate = gu + r * 2 * I, *up = gate + I;
        for (int64_t i = 0; i < I; i++) act[r * I + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    if (matmul(&w[3], act, R, h, threads)) return -1;
    for (int64_t i = 0; i < R * E; i++) x[i] = x[i] + h[i];
    return 0;
}
