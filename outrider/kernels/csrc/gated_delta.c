/* The gated delta rule's state arithmetic for a verify's nodes (TreeWY) and the fold at commit,
 * in float64: the native form of models/gated_delta.py's tree_step and fold (the reference).
 *
 * Per value head the state S is [dk, dv]; node i (topological order: its ancestors come first)
 * brings q_i, k_i (l2-normed, q scaled), v_i, a log-decay g_i and a step beta_i. With Gamma_i the
 * log-decay summed along i's path from the committed state (a held ancestor's gamma already sums
 * the path up to it):
 *
 *     u_i = beta_i (v_i - e^{Gamma_i} S^T k_i - sum_{j strict ancestor} e^{Gamma_i - Gamma_j} (k_i . k_j) u_j)
 *     o_i = e^{Gamma_i} S^T q_i + sum_{j ancestor or i} e^{Gamma_i - Gamma_j} (q_i . k_j) u_j
 *
 * which is the unit lower-triangular solve of gated_delta.tree_step done by forward substitution,
 * node by node. Node i's outputs are computed from its own ancestors only, in one fixed order
 * (the held ancestors ascending, then the new ones ascending): they are the same bits whatever
 * the number of nodes beside it (a 1-node decode step and a k-node verify give a node the same
 * values when its ancestors are the same rows). Heads run in parallel (OpenMP); a head's sums
 * never split, so the thread count changes nothing.
 *
 * The fold: S <- e^{Gamma_L} S + sum_l e^{Gamma_L - Gamma_l} k_l u_l^T over a path's L rows, in place.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static double dot_fd(const float *a, const float *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}

enum { LANE = 32 };  /* columns of S^T k and S^T q kept in registers (AVX-512: 4 vectors each) */

/* sk = S^T k, sq = S^T q for one head's S [dk, dv]; each sum over a ascending (the same bits
 * whatever else is computed beside it) */
static void state_products(const double *restrict S, const float *restrict k, const float *restrict q, int64_t dk,
                           int64_t dv, double *restrict sk, double *restrict sq) {
    int64_t b0 = 0;
    for (; b0 + LANE <= dv; b0 += LANE) {
        double ak[LANE] = {0}, aq[LANE] = {0};
        for (int64_t a = 0; a < dk; a++) {
            const double *restrict r = S + a * dv + b0;
            const double ka = (double)k[a], qa = (double)q[a];
#pragma omp simd
            for (int64_t c = 0; c < LANE; c++) {
                ak[c] += r[c] * ka;
                aq[c] += r[c] * qa;
            }
        }
        for (int64_t c = 0; c < LANE; c++) {
            sk[b0 + c] = ak[c];
            sq[b0 + c] = aq[c];
        }
    }
    for (int64_t b = b0; b < dv; b++) {  /* the columns past the last whole LANE */
        double ak = 0.0, aq = 0.0;
        for (int64_t a = 0; a < dk; a++) {
            ak += S[a * dv + b] * (double)k[a];
            aq += S[a * dv + b] * (double)q[a];
        }
        sk[b] = ak;
        sq[b] = aq;
    }
}

/* S: double [HV, dk, dv]; q, k: float [N, HV, dk]; v: float [N, HV, dv]; g, beta: float [N, HV];
 * anc: uint8 [N, N] (anc[i, j]: j a strict ancestor of i among the new nodes, j < i);
 * P held rows: held_anc uint8 [N, P], hk float [P, HV, dk], hu double [P, HV, dv], hgamma double [P, HV].
 * Out: o double [N, HV, dv], u double [N, HV, dv], gamma double [N, HV]. Returns 0, or -1 where a
 * work buffer could not be had. */
int outrider_delta_tree(int64_t HV, int64_t dk, int64_t dv, int64_t N, int64_t P, const double *S,
                        const float *q, const float *k, const float *v, const float *g, const float *beta,
                        const uint8_t *anc, const uint8_t *held_anc, const float *hk, const double *hu,
                        const double *hgamma, double *o, double *u, double *gamma, int threads) {
    /* each node's gamma: its deepest held ancestor's (the largest index it sees), then its new
     * ancestors' g ascending, then its own */
    for (int64_t i = 0; i < N; i++) {
        int64_t deepest = -1;
        for (int64_t j = 0; j < P; j++)
            if (held_anc[i * P + j]) deepest = j;
        for (int64_t h = 0; h < HV; h++) {
            double s = deepest >= 0 ? hgamma[deepest * HV + h] : 0.0;
            for (int64_t j = 0; j < i; j++)
                if (anc[i * N + j]) s += (double)g[j * HV + h];
            gamma[i * HV + h] = s + (double)g[i * HV + h];
        }
    }
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < HV; h++) {
        /* S^T k_i and S^T q_i of every node: sk, sq [N, dv], LANE columns at a time in registers */
        double *sk = malloc(sizeof(double) * (size_t)(2 * N * dv));
        if (sk == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        double *sq = sk + N * dv;
        const double *Sh = S + h * dk * dv;
        for (int64_t i = 0; i < N; i++)
            state_products(Sh, k + (i * HV + h) * dk, q + (i * HV + h) * dk, dk, dv, sk + i * dv, sq + i * dv);
        for (int64_t i = 0; i < N; i++) {
            const float *qi = q + (i * HV + h) * dk, *ki = k + (i * HV + h) * dk, *vi = v + (i * HV + h) * dv;
            double *restrict ui = u + (i * HV + h) * dv, *restrict oi = o + (i * HV + h) * dv;
            const double gi = gamma[i * HV + h], e = exp(gi);
            for (int64_t b = 0; b < dv; b++) {
                ui[b] = (double)vi[b] - e * sk[i * dv + b];
                oi[b] = e * sq[i * dv + b];
            }
            for (int64_t j = 0; j < P; j++) {  /* the held ancestors */
                if (!held_anc[i * P + j]) continue;
                const float *kj = hk + (j * HV + h) * dk;
                const double *restrict uj = hu + (j * HV + h) * dv;
                const double w = exp(gi - hgamma[j * HV + h]);
                const double wk = w * dot_fd(ki, kj, dk), wq = w * dot_fd(qi, kj, dk);
                for (int64_t b = 0; b < dv; b++) {
                    ui[b] -= wk * uj[b];
                    oi[b] += wq * uj[b];
                }
            }
            for (int64_t j = 0; j < i; j++) {  /* the new ancestors, solved before i */
                if (!anc[i * N + j]) continue;
                const float *kj = k + (j * HV + h) * dk;
                const double *restrict uj = u + (j * HV + h) * dv;
                const double w = exp(gi - gamma[j * HV + h]);
                const double wk = w * dot_fd(ki, kj, dk), wq = w * dot_fd(qi, kj, dk);
                for (int64_t b = 0; b < dv; b++) {
                    ui[b] -= wk * uj[b];
                    oi[b] += wq * uj[b];
                }
            }
            const double bi = (double)beta[i * HV + h], self = dot_fd(qi, ki, dk);
            for (int64_t b = 0; b < dv; b++) {
                ui[b] *= bi;
                oi[b] += self * ui[b];
            }
        }
        free(sk);
    }
    return failed ? -1 : 0;
}

/* S: double [HV, dk, dv], folded in place over a path of L rows: k float [L, HV, dk],
 * u double [L, HV, dv], gamma double [L, HV] (from the committed state along the path). */
void outrider_delta_fold(int64_t HV, int64_t dk, int64_t dv, int64_t L, double *S, const float *k,
                         const double *u, const double *gamma, int threads) {
    if (L == 0) return;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < HV; h++) {
        const double last = gamma[(L - 1) * HV + h], e = exp(last);
        for (int64_t a = 0; a < dk; a++) {
            double *restrict row = S + (h * dk + a) * dv;
            for (int64_t b = 0; b < dv; b++) row[b] *= e;
            for (int64_t l = 0; l < L; l++) {
                const double c = exp(last - gamma[l * HV + h]) * (double)k[(l * HV + h) * dk + a];
                const double *restrict ul = u + (l * HV + h) * dv;
#pragma omp simd
                for (int64_t b = 0; b < dv; b++) row[b] += c * ul[b];
            }
        }
    }
}
