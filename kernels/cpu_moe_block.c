/* A mixture-of-experts layer's routed experts for few decode rows in ONE call, on experts kept in their GGUF
 * block format in place (--gguf-in-place, issue 32): for every row t and rank j < k, expert e = ids[t, j] runs
 * gate_up, SiLU·up, then down, and the row's k outputs are combined in rank order, out[t] = Σ_j w[t, j] ·
 * y[t, j]. The matmuls are cpu_blockq8.c's per-lane kernel (chatserve_bq8) over each expert's view of the
 * mapped file, called from here: this file is compiled with a cpu_blockq8 level source (prelude, block_bytes.h,
 * cpu_blockq8.c) written before it by cpu_moe_block.py. It replaces the layer loop's 3·k BlockLinear band calls,
 * k SiLU calls and 2·k - 1 combine ops, each paying Python, ctypes and torch allocation overhead.
 *
 * Arithmetic, step by step the loop's (models/moe.py over linear_backends.CpuBlockLinear and cpu_ops' SiLU·mul),
 * so both give the same bits:
 *   the slots (t, j) grouped by expert, stably (a group's slots in row order), x's row copied per slot;
 *   gu[:, band] = chatserve_bq8(x rows of the group, band) per gate_up band (the gate rows, then the up rows),
 *     stored in the activation dtype at row stride 2I, x quantized to x_bits per block of 32 inside the call
 *     exactly as BlockLinear's band_q8 call does (per row: the same codes whatever rows share the call);
 *   h = store(store(silu(g)) · u) by cpu_ops.c's own SiLU·mul (a pointer to it is an argument);
 *   y = chatserve_bq8(h rows of the group, down band(s)) in the activation dtype;
 *   out = store(y_0 · w_0), then out = store(out + store(y_j · w_j)) for j = 1 .. k-1 (torch's ops).
 * Each expert's blocks stream once a step over all the slots routed to it; a slot's output never depends on the
 * slots beside it (chatserve_bq8's rows are independent, its threads split columns). Threads: a few decode rows
 * make every band call smaller than a parallel region pays for (the loop then runs each on one thread), so
 * here the threads take whole (expert, band) calls instead; bigger calls split their columns as the loop's.
 *
 * Bands: int64 [E, B, 4] tables of (GGUF type id, data pointer, row bytes, rows) per expert and band, gate_up's
 * B1 bands covering 2I rows of H, down's B2 bands H rows of I. Row bytes 0: the band is in cpu_blockq8's
 * row-interleaved ("tiled") layout (chatserve_bq8_tile's copy, data pointer to it) and runs chatserve_bq8_tiled,
 * as the loop's CpuBlockLinear runs a tiled band (one float epilogue per block for 16 W rows: the per-row cost
 * stays low at 1-16 rows an expert, where the per-lane kernel is bound by its per-lane float work).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef BQ8_LEVEL         /* compiled alone (cpu_build's check of every source): the block kernel by include */
#include "cpu_blockq8.c"
#endif

#ifndef CHATSERVE_MOE_ROWS_H
#include "moe_rows.h"
#endif

int chatserve_moe_block_level(void) { return BQ8_LEVEL * 10 + BQ8_VNNI; }


#if BQ8_LEVEL
/* One band call: rows [r0, r0 + M) of the grouped input through band b of expert e. */
typedef struct { int64_t e, b, r0, M, col; } mb_job;

/* The jobs of one matmul stage (every expert with slots, each band of its table [E, B, 4]), expert by expert,
 * band by band; col: the band's first output column. Returns their count. */
static int64_t mb_jobs(mb_job *jobs, const int64_t *bands, int64_t B, const int64_t *cnt, int64_t E) {
    int64_t n = 0;
    for (int64_t e = 0, r0 = 0; e < E; r0 += cnt[e + 1], e++) {
        if (!cnt[e + 1]) continue;
        for (int64_t b = 0, col = 0; b < B; col += bands[(e * B + b) * 4 + 3], b++)
            jobs[n++] = (mb_job){e, b, r0, cnt[e + 1], col};
    }
    return n;
}

/* Every job of a stage: x rows (activation dtype, [S, K]) → y [S, ldy]. With one thread, or a job of at least
 * min_macs multiply-adds, chatserve_bq8 splits the band's columns over the threads itself; otherwise (a few
 * decode rows: each band below the size where a parallel region pays) the threads take whole jobs, each call
 * on one thread. Either way a column's arithmetic is the same (chatserve_bq8's threads split columns), so the
 * bits never depend on the split. Returns the first nonzero chatserve_bq8 code, else 0. */
static int mb_stage(const mb_job *jobs, int64_t n, const int64_t *bands, int64_t B, int64_t K, const char *x,
                    int bf16, int x_bits, char *y, int64_t ldy, int nt, int64_t min_macs) {
    const size_t ab = bf16 ? 2 : 4;
    int rc = 0, spread = nt > 1;
    for (int64_t j = 0; j < n; j++)
        if (jobs[j].M * bands[(jobs[j].e * B + jobs[j].b) * 4 + 3] * K >= min_macs) spread = 0;
    #pragma omp parallel for num_threads(spread ? nt : 1) schedule(dynamic, 1) reduction(|:rc)
    for (int64_t j = 0; j < n; j++) {
        const mb_job *o = jobs + j;
        const int64_t *d = bands + (o->e * B + o->b) * 4, nr = d[3];
        const int t = spread || o->M * nr * K < min_macs ? 1 : nt;
        const char *xr = x + (size_t)(o->r0 * K) * ab;
        char *yr = y + (size_t)(o->r0 * ldy + o->col) * ab;
        rc |= d[2] ? chatserve_bq8((int)d[0], (const uint8_t *)d[1], d[2], nr, K, xr, o->M, bf16, x_bits, yr, ldy,
                                   bf16, t)
                   : chatserve_bq8_tiled((int)d[0], (const uint8_t *)d[1], nr, K, xr, o->M, bf16, x_bits, yr, ldy,
                                         bf16, t);
    }
    return rc;
}
#endif

/* out[T, H] (x's dtype: fp32, or bf16 when bf16 != 0) = Σ_j wts[t, j] · expert_{ids[t, j]}(x[t]) for x [T, H],
 * ids [T, k] int64, wts [T, k] fp32 (the routing weights as the activation dtype holds them). gu / dn: band
 * tables [E, B1, 4] / [E, B2, 4] (see above). x_bits: chatserve_bq8's activation codes (8 or 15). silu_mul:
 * cpu_ops.c's chatserve_silu_mul. Returns 0; -1 without the level's kernel; -2 out of memory; -3 a bad expert
 * id; chatserve_bq8's positive code on a band it rejects. */
int chatserve_moe_block(const int64_t *gu, int64_t B1, const int64_t *dn, int64_t B2, int64_t H, int64_t I,
                        int64_t E, const void *x, int64_t T, int64_t k, const int64_t *ids, const float *wts,
                        void *out, int bf16, int x_bits, int nthreads, int64_t min_macs, silu_mul_fn silu_mul) {
#if BQ8_LEVEL
    const int64_t S = T * k, N1 = 2 * I;
    const size_t ab = bf16 ? 2 : 4;
    const int nt = nthreads > 1 ? nthreads : 1;
    int64_t *cnt = calloc((size_t)E + 1, sizeof(int64_t)), *pos = malloc(sizeof(int64_t) * (size_t)S);
    int64_t *next = malloc(sizeof(int64_t) * (size_t)E);
    char *gx = malloc((size_t)(S * H) * ab), *gup = malloc((size_t)(S * N1) * ab);
    char *hh = malloc((size_t)(S * I) * ab), *yd = malloc((size_t)(S * H) * ab);
    mb_job *jobs = malloc(sizeof(mb_job) * (size_t)((B1 + B2) * (S < E ? S : E)));
    int rc = 0;
    if (!cnt || !pos || !next || !gx || !gup || !hh || !yd || !jobs) { rc = -2; goto done; }
    for (int64_t s = 0; s < S; s++) {
        if (ids[s] < 0 || ids[s] >= E) { rc = -3; goto done; }
        cnt[ids[s] + 1]++;
    }
    for (int64_t e = 0, at = 0; e < E; e++) next[e] = at, at += cnt[e + 1];
    for (int64_t s = 0; s < S; s++) {              /* slot s → its grouped place, x's row copied there */
        pos[s] = next[ids[s]]++;
        memcpy(gx + (size_t)(pos[s] * H) * ab, (const char *)x + (size_t)((s / k) * H) * ab, (size_t)H * ab);
    }
    const int64_t n1 = mb_jobs(jobs, gu, B1, cnt, E), n2 = mb_jobs(jobs + n1, dn, B2, cnt, E);
    rc = mb_stage(jobs, n1, gu, B1, H, gx, bf16, x_bits, gup, N1, nt, min_macs);     /* gate_up: [S, 2I] */
    if (rc) goto done;
    silu_mul(bf16, gup, hh, S, I, nt);             /* h = store(store(silu(g)) · u): cpu_ops' own function */
    rc = mb_stage(jobs + n1, n2, dn, B2, I, hh, bf16, x_bits, yd, H, nt, min_macs);   /* down: [S, H] */
    if (rc) goto done;
    moe_combine(yd, pos, wts, T, k, H, out, bf16);
done:
    free(cnt); free(pos); free(next); free(gx); free(gup); free(hh); free(yd); free(jobs);
    return rc;
#else
    (void)gu; (void)B1; (void)dn; (void)B2; (void)H; (void)I; (void)E; (void)x; (void)T; (void)k; (void)ids;
    (void)wts; (void)out; (void)bf16; (void)x_bits; (void)nthreads; (void)min_macs; (void)silu_mul;
    return -1;
#endif
}
