/* A mixture-of-experts layer's routed experts for few decode rows in ONE call (issue 32): for every row t
 * and rank j < k, expert e = ids[t, j] runs gate_up (x · Wguᵀ), SiLU·up, then down, and the row's k
 * outputs are combined in rank order, out[t] = Σ_j w[t, j] · y[t, j]. All of it back to back over the
 * packed 4/8-bit weights of cpu_qmatmul.c (this file is compiled with cpu_qmatmul.c written before it by
 * cpu_moe.py, so it calls the same tile kernels), instead of 2·k matmul calls, k SiLU calls and 2·k - 1
 * combine ops each paying Python, ctypes and allocation overhead.
 *
 * Arithmetic, step by step the same as the layer loop it replaces (models/moe.py with layers.Linear on
 * cpu_qmatmul and cpu_ops' SiLU·mul), so both give the same bits:
 *   x quantized per row and group of 32 (quantize_rows), once for all the row's experts;
 *   gu = qmm(x, Wgu) stored in the activation dtype (bf16 rounded to nearest even, or fp32);
 *   h = store(store(silu(g)) · u) by cpu_ops.c's own SiLU·mul (a pointer to it is an argument), then quantized
 *   per row as the down matmul's input;
 *   y = qmm(h, Wdown) stored in the activation dtype;
 *   out = store(y_0 · w_0), then out = store(out + store(y_j · w_j)) for j = 1 .. k-1 (torch's bf16 ops).
 * Each expert runs once over all the (row, rank) slots routed to it (its weights stream once a step), and a
 * slot's output never depends on the slots beside it: the tile kernels sum exact integer dots per group and
 * scale them in a fixed order whatever the row block (1, 2, 4 or 8 rows) or the thread that runs them.
 *
 * cpu_moe.py loads the concatenation, not an #include, so that the cache key covers both files' bytes.
 * Weights: int64 arrays of per-expert pointers (codes, scales+lows) for gate_up [2I, H] and down [H, I].
 */
#include <string.h>

#ifndef QMM_TILE          /* compiled alone (cpu_build's check of every source): the tile kernels by include */
#include "cpu_qmatmul.c"
#endif

#ifndef CHATSERVE_MOE_ROWS_H
#include "moe_rows.h"
#endif

int chatserve_moe_tile(void) { return QMM_TILE; }


#if QMM_TILE
/* One job: tiles [t0, t1) of expert group g. */
typedef struct { int64_t g, t0, t1; } moe_job;

/* Jobs over every group's tiles in chunks of `chunk` tiles, group by group. Returns their count. */
static int64_t moe_jobs(moe_job *jobs, int64_t ngroups, int64_t tiles, int64_t chunk) {
    int64_t n = 0;
    for (int64_t g = 0; g < ngroups; g++)
        for (int64_t t = 0; t < tiles; t += chunk) {
            jobs[n].g = g, jobs[n].t0 = t, jobs[n].t1 = t + chunk < tiles ? t + chunk : tiles;
            n++;
        }
    return n;
}

#endif

/* out[T, H] (x's dtype: fp32, or bf16 when bf16 != 0) = Σ_j wts[t, j] · expert_{ids[t, j]}(x[t]) for
 * x [T, H], ids [T, k] int64, wts [T, k] fp32 (the routing weights as the activation dtype holds them).
 * gu_w / dn_w: [E, 2] int64 (codes, scales+lows) of each expert's packed gate_up [2I, H] and down [H, I],
 * all of `bits` (4 or 8). silu_mul: cpu_ops.c's chatserve_silu_mul, called on gu [S, 2I] = [gate | up] rows,
 * so that SiLU·up is the layer loop's arithmetic by construction. Returns 0, -1 without the tile kernels (no AVX2), -2 when scratch could not be allocated. */
int chatserve_moe(const int64_t *gu_w, const int64_t *dn_w, int bits, int64_t H, int64_t I, int64_t E,
                  const void *x, int64_t T, int64_t k, const int64_t *ids, const float *wts, void *out,
                  int bf16, int nthreads, silu_mul_fn silu_mul) {
#if QMM_TILE
    const int64_t S = T * k, GH = H / GROUP, GI = I / GROUP, N1 = 2 * I;
    const size_t ab = bf16 ? 2 : 4, planes = (size_t)qmm_planes(bits, bf16);
    const int64_t tiles1 = (N1 + 15) / 16, tiles2 = (H + 15) / 16;
    /* scratch: quantized x [T] and its gathered copy per slot [S]; gu [S, 2I], h [S, I], its codes; y [S, H] */
    int64_t *cnt = calloc((size_t)E + 1, sizeof(int64_t)), *pos = malloc(sizeof(int64_t) * (size_t)S);
    int64_t *gexp = malloc(sizeof(int64_t) * (size_t)S), *gstart = malloc(sizeof(int64_t) * (size_t)(S + 1));
    int8_t *xq = malloc((size_t)(T * H) * planes), *gq = malloc((size_t)(S * H) * planes);
    float *xsx = malloc(sizeof(float) * (size_t)(T * GH) * 2), *gsx = malloc(sizeof(float) * (size_t)(S * GH) * 2);
    char *gu = malloc((size_t)(S * N1) * ab), *hh = malloc((size_t)(S * I) * ab), *yd = malloc((size_t)(S * H) * ab);
    int8_t *hq = malloc((size_t)(S * I) * planes);
    float *hsx = malloc(sizeof(float) * (size_t)(S * GI) * 2);
    const int64_t chunk1 = tiles1 < 4 ? tiles1 : 4, chunk2 = tiles2 < 4 ? tiles2 : 4;
    moe_job *jobs = malloc(sizeof(moe_job) * (size_t)(S * ((tiles1 + chunk1 - 1) / chunk1 + (tiles2 + chunk2 - 1) / chunk2)));
    int rc = 0;
    if (!cnt || !pos || !gexp || !gstart || !xq || !gq || !xsx || !gsx || !gu || !hh || !yd || !hq || !hsx || !jobs) {
        rc = -2;
        goto done;
    }
    for (int64_t s = 0; s < S; s++) {
        if (ids[s] < 0 || ids[s] >= E) { rc = -3; goto done; }
        cnt[ids[s] + 1]++;
    }
    /* slots grouped by expert (stable: a group's slots in row order); pos[slot] = its place */
    int64_t ngroups = 0;
    {
        int64_t *next = malloc(sizeof(int64_t) * (size_t)E);
        if (!next) { rc = -2; goto done; }
        int64_t at = 0;
        for (int64_t e = 0; e < E; e++) {
            next[e] = at;
            if (cnt[e + 1]) {
                gexp[ngroups] = e, gstart[ngroups] = at;
                ngroups++;
            }
            at += cnt[e + 1];
        }
        gstart[ngroups] = S;
        for (int64_t s = 0; s < S; s++) pos[s] = next[ids[s]]++;
        free(next);
    }
    const float top = planes == 2 ? 32639.f : 127.f;
    quantize_rows(x, bf16, T, H, top, xq, planes == 2 ? xq + T * H : NULL, xsx, xsx + T * GH,
                  nthreads > 1 ? nthreads : 1);
    for (int64_t s = 0; s < S; s++) {                 /* the slot's row of quantized x, at its grouped place */
        const int64_t t = s / k, p = pos[s];
        memcpy(gq + p * H, xq + t * H, (size_t)H);
        if (planes == 2) memcpy(gq + S * H + p * H, xq + T * H + t * H, (size_t)H);
        memcpy(gsx + p * GH, xsx + t * GH, sizeof(float) * (size_t)GH);
        memcpy(gsx + S * GH + p * GH, xsx + T * GH + t * GH, sizeof(float) * (size_t)GH);
    }
    const int64_t n1 = moe_jobs(jobs, ngroups, tiles1, chunk1);
    moe_job *jobs2 = jobs + n1;
    const int64_t n2 = moe_jobs(jobs2, ngroups, tiles2, chunk2);
    const int nt = nthreads > 1 ? nthreads : 1;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j = 0; j < n1; j++) {              /* gate_up of every group: gu [S, 2I] */
        const int64_t g = jobs[j].g, r0 = gstart[g], M = gstart[g + 1] - r0, e = gexp[g];
        qmm_rows(bits, (const uint8_t *)gu_w[2 * e], (const uint16_t *)gu_w[2 * e + 1], N1, H,
                 gq + r0 * H, gq + S * H + r0 * H, gsx + r0 * GH, gsx + S * GH + r0 * GH, M,
                 jobs[j].t0, jobs[j].t1, gu + (size_t)(r0 * N1) * ab, bf16);
    }
    silu_mul(bf16, gu, hh, S, I, nt);               /* h = store(store(silu(g)) · u): cpu_ops' own function */
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < S; p++)             /* h quantized per slot as the down matmul's input */
            quantize_rows(hh + (size_t)(p * I) * ab, bf16, 1, I, top, hq + p * I,
                          planes == 2 ? hq + S * I + p * I : NULL, hsx + p * GI, hsx + S * GI + p * GI, 1);
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n2; j++) {          /* down of every group: yd [S, H] */
            const int64_t g = jobs2[j].g, r0 = gstart[g], M = gstart[g + 1] - r0, e = gexp[g];
            qmm_rows(bits, (const uint8_t *)dn_w[2 * e], (const uint16_t *)dn_w[2 * e + 1], H, I,
                     hq + r0 * I, hq + S * I + r0 * I, hsx + r0 * GI, hsx + S * GI + r0 * GI, M,
                     jobs2[j].t0, jobs2[j].t1, yd + (size_t)(r0 * H) * ab, bf16);
        }
    }
    moe_combine(yd, pos, wts, T, k, H, out, bf16);
done:
    free(cnt); free(pos); free(gexp); free(gstart); free(xq); free(gq); free(xsx); free(gsx);
    free(gu); free(hh); free(yd); free(hq); free(hsx); free(jobs);
    return rc;
#else
    (void)gu_w; (void)dn_w; (void)bits; (void)H; (void)I; (void)E; (void)x; (void)T; (void)k; (void)ids;
    (void)wts; (void)out; (void)bf16; (void)nthreads; (void)silu_mul;
    return -1;
#endif
}
