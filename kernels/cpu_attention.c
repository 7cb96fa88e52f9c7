/* Paged attention for the CPU: every new token (decode rows and prefill chunks alike) against its
 * sequence's K/V, read from the paged cache in place (the torch twin gathers a padded copy).
 *
 * Built at first use by cpu_attention.py (cc -O3 -march=native -fopenmp) and called through ctypes,
 * which releases the GIL (with CHATSERVE_AVX2_ONLY defined, the AVX2 body on an AVX-512 CPU too: the
 * tests' build). OpenMP resolves to the libgomp torch has already loaded, so this kernel and
 * torch's ops share one thread pool. fp32 arithmetic whatever the storage (fp32 or bf16), except bf16 caches
 * of head_dim 64 with 3 or 4 query heads per kv head on a build with AVX-512 BF16: their rows take the bf16
 * body (vdpbf16ps dot products over keys-in-lanes tiles, issue 33), every row of them alike.
 *
 * Batch invariance: a query row's result depends on its own query and keys only. Its visible keys
 * [lo, p] are cut into segments at absolute multiples of SEG keys; each segment is one online softmax
 * over its cache blocks, front to back, and the segments are merged in order (merge_rows). How rows
 * are spread over threads (a whole row per item, or one segment per item when there are few rows)
 * changes who computes a segment, never its arithmetic, and neither does a row group (up to GROUP rows of
 * one prompt chunk passing over each K/V block together, each doing what it does alone), so neither the
 * batch, the chunking of a prompt, a prefix hit nor the thread count changes a row's bits. The twin is
 * the test oracle.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define MAX_HQ 128
#define MAX_D 256
#define MAX_ROW 4096        /* kv_heads * head_dim */
#define MAX_BS 64

typedef struct {
    int dtype;                          /* 0: float32, 1: bfloat16 (q, cache and out alike) */
    const void *q, *k, *v;
    void *out;
    int64_t q_st, q_sh, o_st, o_sh;     /* element strides of q / out: token, head (dim stride 1) */
    int64_t c_sb;                       /* element stride of a cache block (a block is contiguous) */
    const int32_t *tables, *qsl, *lens;
    int64_t bt_stride;
    int hq, hkv, D, bs, window;
    float scale, softcap;               /* softcap 0: none, else scores s become softcap·tanh(s / softcap) */
    const float *sinks;                 /* NULL, or [hq] logits in every row's denominator (gpt-oss) */
} job_t;

typedef struct {                        /* one work item: query row `row` (position p) of sequence b */
    int b, row, p;
    int k0, k1;                         /* a segment's keys; k0 < 0: the whole row, segment by segment */
    int part;                           /* the segment's partial slot (k0 >= 0) */
    int n;                              /* k0 < 0: rows row.. (positions p..) of b done together (row group) */
} item_t;

typedef struct {                        /* segments' unnormalized results, merged by merge_rows */
    float *acc;                         /* [n, hq, D] */
    float *mx, *den;                    /* [n, hq] */
} parts_t;

typedef struct {                        /* per-thread workspace */
    float q[MAX_HQ * MAX_D], acc[MAX_HQ * MAX_D];
    float s[MAX_HQ * MAX_BS];
    float row[MAX_ROW];
    float kb[MAX_BS * MAX_D], vb[MAX_BS * MAX_D];   /* a block's K, V rows of one kv head as fp32 (row groups, bf16) */
    float *gq;                          /* a row group's scaled queries, gq_cap floats */
    int64_t gq_cap;
    float mx[MAX_HQ], den[MAX_HQ];
    float dv[16 * MAX_HQ * 16];          /* the bf16 body's lane denominators: up to 16 rows (GROUP) x hq x 16 */
    parts_t own;                        /* a whole row's segment partials */
    int64_t own_cap;                    /* floats each of own.acc, own.mx, own.den holds */
} work_t;

/* One query row's state in a segment: its scaled query, its partial (acc [hq, D], mx, den [hq]) and the
 * segment's end k1 (rows of one group share the segment's start). */
typedef struct {
    const float *q;
    float *acc, *mx, *den;
    int k1;
} rowseg_t;

static __thread work_t *tls_work;       /* this thread's workspace, kept across calls */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {(uint32_t)x << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0 (softmax arguments), relative error ~2e-7; inlined so loops over it vectorize. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_floorf(t);
    const float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180546e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } s = {((int32_t)n + 127) << 23};
    return p * s.f;
}

/* n elements at src + off as fp32: the cache itself for fp32 (no copy), else converted into buf */
static inline const float *as_f32(int dtype, const void *src, int64_t off, float *buf, int n) {
    if (dtype == 0) return (const float *)src + off;
    const uint16_t *p = (const uint16_t *)src + off;
    for (int i = 0; i < n; i++) buf[i] = bf16_to_f32(p[i]);
    return buf;
}

/* out row at element offset off = acc / den (0 for a row that saw no key) */
static inline void write_out(const job_t *j, int64_t off, const float *acc, float den) {
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    if (j->dtype == 0) {
        float *o = (float *)j->out + off;
        for (int d = 0; d < j->D; d++) o[d] = acc[d] * inv;
    } else {
        uint16_t *o = (uint16_t *)j->out + off;
        for (int d = 0; d < j->D; d++) o[d] = f32_to_bf16(acc[d] * inv);
    }
}

/* First key the query at position p sees (its sliding window). */
static inline int first_key(const job_t *j, int p) {
    const int lo = j->window > 0 ? p + 1 - j->window : 0;
    return lo < 0 ? 0 : lo;
}

static inline float capped(const job_t *j, float s) {
    return j->softcap > 0.0f ? j->softcap * tanhf(s / j->softcap) : s;
}

/* Start a segment [k0, k1) of a query row: scaled queries, empty accumulators. Returns k0. */
static int seg_begin(const job_t *j, work_t *w, const item_t *it, int k0, int hq, int D) {
    const int t_q = it->row;
    for (int h = 0; h < hq; h++) {
        const float *qh = as_f32(j->dtype, j->q, (int64_t)t_q * j->q_st + (int64_t)h * j->q_sh, w->row, D);
        for (int d = 0; d < D; d++) w->q[h * D + d] = qh[d] * j->scale;
        memset(w->acc + h * D, 0, (size_t)D * sizeof(float));
        w->mx[h] = -1e30f;
        w->den[h] = 0.0f;
    }
    return k0;
}

/* Finish a segment: its partial (acc, max, sum) into slot `slot` of pt */
static void seg_end(const work_t *w, const parts_t *pt, int slot, int hq, int D) {
    memcpy(pt->acc + (int64_t)slot * hq * D, w->acc, (size_t)hq * D * sizeof(float));
    memcpy(pt->mx + (int64_t)slot * hq, w->mx, (size_t)hq * sizeof(float));
    memcpy(pt->den + (int64_t)slot * hq, w->den, (size_t)hq * sizeof(float));
}

/* The block of a segment's keys [lo, sl) that starts at key blk0: its keys [*a, *z), and where it
 * starts in the cache (element offset). */
static inline int64_t block_span(const job_t *j, const item_t *it, int blk0, int lo, int sl, int *a, int *z) {
    *a = lo > blk0 ? lo - blk0 : 0;
    *z = (sl - blk0) < j->bs ? (sl - blk0) : j->bs;
    return (int64_t)j->tables[(int64_t)it->b * j->bt_stride + blk0 / j->bs] * j->c_sb;
}

/* Online softmax step of one head over a block's scores s[a, z): s becomes exp(s - max) in place, the
 * running max *mx and sum *den move on; returns alpha, the factor the head's accumulator is scaled by. */
static inline float softmax_block(float *s, int a, int z, float *mx, float *den) {
    float bmax = *mx;
    for (int t = a; t < z; t++) bmax = s[t] > bmax ? s[t] : bmax;
    const float alpha = bmax == *mx ? 1.0f : exp_neg(*mx - bmax);   /* exp_neg(0) is exactly 1 */
    *mx = bmax;
    float sum = 0.0f;
    for (int t = a; t < z; t++) {
        s[t] = exp_neg(s[t] - bmax);
        sum += s[t];
    }
    *den = *den * alpha + sum;
    return alpha;
}

/* The generic body: any head_dim and group size, one dot product per (head, key). One segment
 * [k0, sl) of a query row; the result stays in w (acc, mx, den). */
static void run_seg(const job_t *j, work_t *w, const item_t *it, int k0, int sl) {
    const int D = j->D, bs = j->bs, hq = j->hq, G = hq / j->hkv, row = j->hkv * D;
    const int lo = seg_begin(j, w, it, k0, j->hq, D);         /* this segment's keys [lo, sl) */
    for (int blk0 = (lo / bs) * bs; blk0 < sl; blk0 += bs) {
        int a, z;                                             /* keys [a, z) of this block */
        const int64_t base = block_span(j, it, blk0, lo, sl, &a, &z);
        for (int t = a; t < z; t++) {
            const float *kr = as_f32(j->dtype, j->k, base + (int64_t)t * row, w->row, row);
            for (int h = 0; h < hq; h++) {
                const float *qh = w->q + h * D, *kh = kr + (h / G) * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
                w->s[h * MAX_BS + t] = capped(j, dot);
            }
        }
        for (int h = 0; h < hq; h++) {
            const float alpha = softmax_block(w->s + h * MAX_BS, a, z, &w->mx[h], &w->den[h]);
            if (alpha != 1.0f)
                for (int d = 0; d < D; d++) w->acc[h * D + d] *= alpha;
        }
        for (int t = a; t < z; t++) {
            const float *vr = as_f32(j->dtype, j->v, base + (int64_t)t * row, w->row, row);
            for (int h = 0; h < hq; h++) {
                const float p = w->s[h * MAX_BS + t];
                const float *vh = vr + (h / G) * D;
                float *ah = w->acc + h * D;
                for (int d = 0; d < D; d++) ah[d] += p * vh[d];
            }
        }
    }
}

#if defined(__AVX512F__) && !defined(CHATSERVE_AVX2_ONLY)
#include <immintrin.h>

static inline __m512 load16(int dtype, const void *base, int64_t off) {    /* 16 values as fp32 */
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + off);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp_neg over 16 lanes: the same polynomial as exp_neg, lane by lane (every lane of every row goes
 * through these instructions, so a row's bits never depend on which other rows share the call). */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180546e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* Lanes of the 16-key tile starting at block offset c0 that hold keys [a, z) of the block */
static inline __mmask16 tile_mask(int c0, int a, int z) {
    const int lo = a > c0 ? a - c0 : 0, hi = z - c0 < 16 ? z - c0 : 16;
    return hi <= lo ? (__mmask16)0 : (__mmask16)((((uint32_t)1 << hi) - 1) & ~(((uint32_t)1 << lo) - 1));
}

/* softmax_block over 16-key tiles (tiles at fixed block offsets, so a row's sum order depends on its
 * keys only): the max over the block's keys, exp(s - max) in place, the block's sum as a fixed tree
 * per tile, tiles in order. Returns alpha, as softmax_block. */
static inline float softmax_block16(float *s, int a, int z, float *mx, float *den) {
    __m512 vmax = _mm512_set1_ps(*mx);
    for (int c0 = (a / 16) * 16; c0 < z; c0 += 16) {
        const __mmask16 m = tile_mask(c0, a, z);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + c0));
    }
    const float bmax = _mm512_reduce_max_ps(vmax);
    const float alpha = bmax == *mx ? 1.0f : exp_neg(*mx - bmax);   /* exp_neg(0) is exactly 1 */
    *mx = bmax;
    float sum = 0.0f;
    for (int c0 = (a / 16) * 16; c0 < z; c0 += 16) {
        const __mmask16 m = tile_mask(c0, a, z);
        const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + c0), _mm512_set1_ps(bmax)));
        _mm512_mask_storeu_ps(s + c0, m, e);
        sum += _mm512_reduce_add_ps(_mm512_maskz_mov_ps(m, e));
    }
    *den = *den * alpha + sum;
    return alpha;
}

/* Sum of each of 16 vectors p[0..15] into lane t of one vector: per vector the fixed tree
 * ((e0+e2)+(e1+e3)) within each 128-bit lane, then lanes (L0+L1)+(L2+L3). Four at a time (quad). */
static inline __m512 quad_sums(__m512 p0, __m512 p1, __m512 p2, __m512 p3) {
    const __m512 w01 = _mm512_add_ps(_mm512_unpacklo_ps(p0, p1), _mm512_unpackhi_ps(p0, p1));
    const __m512 w23 = _mm512_add_ps(_mm512_unpacklo_ps(p2, p3), _mm512_unpackhi_ps(p2, p3));
    return _mm512_add_ps(_mm512_shuffle_ps(w01, w23, 0x44), _mm512_shuffle_ps(w01, w23, 0xEE));
}

static inline __m512 tile_sums(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x88), _mm512_shuffle_f32x4(x2, x3, 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

/* The scores of G query heads (vectors qv) over the 16 keys of a tile, key t's row of head_dim values at
 * element offset off + t * st of k (dt 0: fp32, 1: bf16), into s[g * MAX_BS + c0 + t] for the lanes in m.
 * A key's score: its 16 lane partials (one product, then fmas over the NV chunks of head_dim), summed by
 * the fixed tree of quad_sums and tile_sums, whichever row asks and wherever the key's values are read
 * from: the bits depend on the query and the key only. */
static inline __attribute__((always_inline)) void tile_scores(int dt, const void *k, int64_t off, int64_t st,
                                                              __m512 qv[8][8], float *s, int c0,
                                                              __mmask16 m, const int G, const int NV) {
    __m512 x[8][4];
    for (int qd = 0; qd < 4; qd++) {
        __m512 p[4][8];
        for (int t = 0; t < 4; t++) {
            const int64_t o = off + (int64_t)(qd * 4 + t) * st;
            __m512 kv[8];
            for (int v = 0; v < NV; v++) kv[v] = load16(dt, k, o + v * 16);
            for (int g = 0; g < G; g++) {
                __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[g][v], kv[v], acc);
                p[t][g] = acc;
            }
        }
        for (int g = 0; g < G; g++) x[g][qd] = quad_sums(p[0][g], p[1][g], p[2][g], p[3][g]);
    }
    for (int g = 0; g < G; g++)
        _mm512_mask_storeu_ps(s + g * MAX_BS + c0, m, tile_sums(x[g][0], x[g][1], x[g][2], x[g][3]));
}

/* The next cache block, pulled into L1 while a row scores this one (the rows of a block are scattered
 * blocks apart, so the hardware prefetcher does not see them coming). */
typedef struct {
    const char *k, *v;                  /* its first bytes in the K and V caches */
    int lines;                          /* its 64-byte lines (one cache) */
    int part, parts;                    /* this pass over the block is part `part` of `parts`: pull its share */
} pull_t;

static inline void pull_share(const pull_t *pf, int part) {
    const int per = (pf->lines + pf->parts - 1) / pf->parts;
    for (int l = part * per; l < part * per + per && l < pf->lines; l++) {
        _mm_prefetch(pf->k + l * 64, _MM_HINT_T0);
        _mm_prefetch(pf->v + l * 64, _MM_HINT_T0);
    }
}

/* One query row's G query heads of one kv head against keys [a, z) of one block, head_dim = 16 * NV (G, NV
 * compile-time constants after inlining): key t's K and V values at element offset off + t * st of kc and vc
 * (dt 0: fp32, 1: bf16); q: the row's G scaled query vectors [G, D]; acc [G, D], mx, den [G]: its running
 * state; s: [G, MAX_BS] scratch. The G query vectors and the G x NV output accumulators stay in registers
 * while the block's keys stream through. pf: NULL, or the next block to pull in (part pf->part of it per
 * tile or key). The arithmetic is one and the same whoever calls (a row alone reading the cache, or a row
 * group reading a block's K/V converted once): a row's bits do not depend on where its keys were read. */
static inline __attribute__((always_inline)) void head_block(const job_t *j, int dt, const void *kc, const void *vc,
                                                             int64_t off, int64_t st, const float *q, float *acc,
                                                             float *mx, float *den, float *s, int a, int z,
                                                             const pull_t *pf, const int G, const int NV) {
    const int D = 16 * NV;
    __m512 qv[8][8], av[8][8];               /* G x NV used; fixed sizes keep them in registers (VLAs spill) */
    float alpha[8];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) qv[g][v] = _mm512_loadu_ps(q + g * D + v * 16);
    if (j->bs % 16) {                                          /* scores, key by key */
        for (int t = a; t < z; t++) {
            if (pf) pull_share(pf, pf->part * (z - a) + (t - a));
            const int64_t o = off + (int64_t)t * st;
            __m512 kv[8];
            for (int v = 0; v < NV; v++) kv[v] = load16(dt, kc, o + v * 16);
            for (int g = 0; g < G; g++) {
                __m512 sc = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int v = 1; v < NV; v++) sc = _mm512_fmadd_ps(qv[g][v], kv[v], sc);
                s[g * MAX_BS + t] = capped(j, _mm512_reduce_add_ps(sc));
            }
        }
    } else {                                                   /* scores, 16 keys a tile */
        for (int c0 = (a / 16) * 16; c0 < z; c0 += 16) {
            if (pf) pull_share(pf, pf->part * (j->bs / 16) + c0 / 16);
            tile_scores(dt, kc, off + (int64_t)c0 * st, st, qv, s, c0, tile_mask(c0, a, z), G, NV);
        }
        if (j->softcap > 0.0f)
            for (int g = 0; g < G; g++)
                for (int t = a; t < z; t++) s[g * MAX_BS + t] = capped(j, s[g * MAX_BS + t]);
    }
    for (int g = 0; g < G; g++) alpha[g] = softmax_block16(s + g * MAX_BS, a, z, &mx[g], &den[g]);
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++)
            av[g][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + v * 16), _mm512_set1_ps(alpha[g]));
    for (int t = a; t < z; t++) {                              /* values */
        const int64_t o = off + (int64_t)t * st;
        __m512 vv[8];
        for (int v = 0; v < NV; v++) vv[v] = load16(dt, vc, o + v * 16);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(s[g * MAX_BS + t]);
            for (int v = 0; v < NV; v++) av[g][v] = _mm512_fmadd_ps(p, vv[v], av[g][v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + g * D + v * 16, av[g][v]);
}

/* run_seg for head_dim = 16 * NV and G query heads per kv head: block after block, kv head after kv head,
 * head_block straight on the cache (a lone row reads each key once: nothing to convert ahead), pulling the
 * next block in a share per key or tile. */
static inline __attribute__((always_inline)) void run_seg_avx512(const job_t *j, work_t *w,
                                                                 const item_t *it, int k0, int sl,
                                                                 const int G, const int NV) {
    const int D = 16 * NV, bs = j->bs, hkv = j->hkv, row = hkv * D;
    const int32_t *table = j->tables + (int64_t)it->b * j->bt_stride;
    const int lo = seg_begin(j, w, it, k0, G * hkv, D);       /* this segment's keys [lo, sl) */
    const int esz = j->dtype == 0 ? 4 : 2, lines = (bs * row * esz + 63) / 64;
    for (int blk0 = (lo / bs) * bs; blk0 < sl; blk0 += bs) {
        int a, z;                                             /* keys [a, z) of this block */
        const int64_t base = block_span(j, it, blk0, lo, sl, &a, &z);
        const int64_t nbase = blk0 + bs < sl ? (int64_t)table[blk0 / bs + 1] * j->c_sb : -1;
        pull_t pf = {NULL, NULL, lines, 0, bs % 16 ? (z - a) * hkv : bs / 16 * hkv};
        if (nbase >= 0) pf.k = (const char *)j->k + nbase * esz, pf.v = (const char *)j->v + nbase * esz;
        for (int hk = 0; hk < hkv; hk++) {
            pf.part = hk;
            head_block(j, j->dtype, j->k, j->v, base + hk * D, row, w->q + hk * G * D, w->acc + hk * G * D,
                       w->mx + hk * G, w->den + hk * G, w->s + hk * G * MAX_BS, a, z, nbase >= 0 ? &pf : NULL,
                       G, NV);
        }
    }
}

/* Rows [t0, t1) of one kv head's head_dim = D values, rows `row` elements apart from bf16 src + off, as
 * fp32 rows D apart in buf (exact: a bf16 is the top half of its fp32). */
static inline void rows_to_f32(const uint16_t *src, int64_t off, int64_t row, int t0, int t1, int D, float *buf) {
    for (int t = t0; t < t1; t++)
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(buf + t * D + d, load16(1, src, off + (int64_t)t * row + d));
}

/* Segment [k0, rs[r].k1) of n query rows of sequence b (a row group, see run_group), head_dim = 16 * NV and
 * G query heads per kv head. Per block and kv head, the block's K and V are made fp32 once (bf16 caches
 * converted into w->kb / w->vb; fp32 read in place) and stay in L1 while the n rows pass over them one
 * after another, each through head_block exactly as alone (same tiles, same softmax steps, same P·V over
 * its own keys [a, z) of the block; only where its keys' values are read from differs, and they are the
 * same fp32 values). So a row's bits do not depend on n. Each row keeps its own G x NV accumulators in
 * registers while it passes (one row at a time: at most 2 x 8 x 8 vectors, as alone), so the group size is
 * not bounded by the 32 zmm registers but by L1: GROUP rows' q and acc of one kv head (16 x 2 x G x D
 * floats) beside the block's K and V. */
static inline __attribute__((always_inline)) void run_rows_avx512(const job_t *j, work_t *w, int b, int k0,
                                                                  const rowseg_t *rs, int n, const int G,
                                                                  const int NV) {
    const int D = 16 * NV, bs = j->bs, hkv = j->hkv, row = hkv * D, tiles = bs % 16 == 0;
    const int32_t *table = j->tables + (int64_t)b * j->bt_stride;
    const int esz = j->dtype == 0 ? 4 : 2, lines = (bs * row * esz + 63) / 64;
    int kmax = k0;
    for (int r = 0; r < n; r++) kmax = rs[r].k1 > kmax ? rs[r].k1 : kmax;
    for (int blk0 = (k0 / bs) * bs; blk0 < kmax; blk0 += bs) {
        const int64_t base = (int64_t)table[blk0 / bs] * j->c_sb;
        const int a = k0 > blk0 ? k0 - blk0 : 0, zmax = kmax - blk0 < bs ? kmax - blk0 : bs;
        const int64_t nbase = blk0 + bs < kmax ? (int64_t)table[blk0 / bs + 1] * j->c_sb : -1;
        pull_t pf = {NULL, NULL, lines, 0, hkv};
        if (nbase >= 0) pf.k = (const char *)j->k + nbase * esz, pf.v = (const char *)j->v + nbase * esz;
        for (int hk = 0; hk < hkv; hk++) {
            const void *kc = j->k, *vc = j->v;
            int64_t off = base + hk * D, st = row;
            if (j->dtype == 1) {                   /* the tiles' keys (whole tiles: lanes past z are masked) */
                const int t0 = tiles ? (a / 16) * 16 : a, t1 = tiles ? (zmax + 15) / 16 * 16 : zmax;
                rows_to_f32((const uint16_t *)j->k, off, row, t0, t1, D, w->kb);
                rows_to_f32((const uint16_t *)j->v, off, row, a, zmax, D, w->vb);
                kc = w->kb, vc = w->vb, off = 0, st = D;
            }
            if (nbase >= 0) pull_share(&pf, hk);
            for (int r = 0; r < n; r++) {
                if (rs[r].k1 <= blk0) continue;
                const int z = rs[r].k1 - blk0 < bs ? rs[r].k1 - blk0 : bs;     /* this row's keys [a, z) */
                head_block(j, 0, kc, vc, off, st, rs[r].q + hk * G * D, rs[r].acc + hk * G * D, rs[r].mx + hk * G,
                           rs[r].den + hk * G, w->s, a, z, NULL, G, NV);
            }
        }
    }
}

/* The (G, NV) shapes the AVX-512 body is compiled for; others run the generic body. */
#define AVX512_SHAPES(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(5, 4) X(6, 4) X(8, 4) X(1, 8) X(2, 8) X(4, 8)

static inline int avx512_shape(const job_t *j) {
    const int G = j->hq / j->hkv, NV = j->D / 16;
#define IS_SHAPE(g, nv) if (G == g && NV == nv) return 1;
    if (j->D % 16 == 0) { AVX512_SHAPES(IS_SHAPE) }
#undef IS_SHAPE
    return 0;
}

#if defined(__AVX512BF16__)
/* ---- bf16 caches on CPUs with AVX-512 BF16 (vdpbf16ps): their own arithmetic, for every row ----
 * Per block and kv head, a 16-key tile's K is laid out keys-in-lanes ([head_dim / 2][16 keys][2]: a 64-byte
 * load is one head_dim pair of 16 keys) and its V pairs-of-keys-interleaved ([8 key pairs][head_dim][2]).
 * A query row then scores the tile's 16 keys at once: lane t = its key's raw bf16 dot product with the raw
 * bf16 query, the head_dim pairs in four chains (pairs i ≡ c mod 4, each in order, vdpbf16ps), added as
 * (c0 + c2) + (c1 + c3), then
 * times scale; one online-softmax step per tile (exp_neg16; the max moves, with a horizontal max and a
 * rescale, only on a tile with a key above it); the tile's exp values rounded to bf16 (these are the weights:
 * the denominator sums the rounded ones, lane by lane over the segment, its 16 lanes added at the end) and P·V
 * as vdpbf16ps over key pairs in order. No horizontal sums per key or per tile, half the multiply
 * instructions of the fp32 body. Every row of a bf16 cache on such
 * a build goes through it (decode rows, rows alone, row groups): a row's bits depend on its query and its
 * keys only (a key outside a row's range gets weight 0 and a zero or finite V: it adds ±0). */
#define HAVE_BF16_DOT 1

static inline int bf16_dots(const job_t *j) {
    return j->dtype == 1 && j->D == 64 && (j->hq / j->hkv == 3 || j->hq / j->hkv == 4);
}

/* r[0..15] (16 x 16 32-bit elements) transposed in place */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {             /* u[4g + c]: lane L = column 4L + c of rows 4g .. 4g + 3 */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* The 16-key tile at block offset c0 of one kv head (key t's D bf16 values at element offset off + t * st of
 * the K and V caches), keys outside [a, z) as zeros: kt [D/2][16] pairs (keys in lanes), vp [8][D][2]. */
static void pack_tile(const uint16_t *kc, const uint16_t *vc, int64_t off, int64_t st, int c0, int a, int z,
                      uint32_t *kt, uint16_t *vp, const int NV) {
    const int D = 16 * NV;
    const __m512i zero = _mm512_setzero_si512();
    for (int c = 0; c < D / 32; c++) {                     /* head_dim pairs 16c .. 16c + 15 */
        __m512i r[16];
        for (int t = 0; t < 16; t++) {
            const int key = c0 + t;
            r[t] = key >= a && key < z ? _mm512_loadu_si512(kc + off + (int64_t)key * st + 32 * c) : zero;
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (16 * c + i) * 16, r[i]);
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < 8; p++) {                          /* keys c0 + 2p, c0 + 2p + 1 */
        const int k0 = c0 + 2 * p, k1 = k0 + 1;
        for (int c = 0; c < D / 32; c++) {
            const __m512i x0 = k0 >= a && k0 < z ? _mm512_loadu_si512(vc + off + (int64_t)k0 * st + 32 * c) : zero;
            const __m512i x1 = k1 >= a && k1 < z ? _mm512_loadu_si512(vc + off + (int64_t)k1 * st + 32 * c) : zero;
            _mm512_storeu_si512(vp + (p * D + 32 * c) * 2, _mm512_permutex2var_epi16(x0, lo, x1));
            _mm512_storeu_si512(vp + (p * D + 32 * c + 16) * 2, _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
}

/* Every tile of keys [a, z) of one block and kv head into kt / vp (tile i at kt + i * 8 * D, vp + i * 16 * D) */
static void pack_block(const job_t *j, int64_t off, int a, int z, uint32_t *kt, uint16_t *vp, const int NV) {
    const int D = 16 * NV;
    for (int c0 = (a / 16) * 16; c0 < z; c0 += 16)
        pack_tile((const uint16_t *)j->k, (const uint16_t *)j->v, off, (int64_t)j->hkv * D, c0, a, z,
                  kt + (c0 / 16) * 8 * D, vp + (c0 / 16) * 16 * D, NV);
}

/* R rows' (1 or 2: a pair shares the tile's loads; each row's instructions are its own, the same as alone)
 * G query heads (qp[r]: raw bf16 values as [G][D/2] pairs) over one packed tile, keys in m: scores, an
 * online-softmax step (mx[r] [G]; dv[r] [G][16]: each head's denominator as 16 lane sums, added up once at
 * the segment's end), acc[r] [G][D] += P·V. The max moves only when a key scores above it (a compare; the
 * horizontal max and the rescale run then only), so most tiles take no horizontal reduction at all. The
 * accumulators live in memory between the score and P·V phases (each phase has the registers to itself). */
static inline __attribute__((always_inline)) void tile_bf16(const job_t *j, const uint32_t *kt, const uint16_t *vp,
                                                            const uint32_t *const *qp, float *const *acc,
                                                            float *const *mx, float *const *dv, __mmask16 m,
                                                            const int R, const int G, const int NV) {
    const int D = 16 * NV, P = D / 2;
    __m512 sc[2][8][4];                                    /* row r, head g, chain c: pairs i ≡ c mod 4 */
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) sc[r][g][c] = _mm512_setzero_ps();
    for (int i = 0; i < P; i += 4)
        for (int c = 0; c < 4; c++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + (i + c) * 16);
            for (int r = 0; r < R; r++)
                for (int g = 0; g < G; g++)
                    sc[r][g][c] = _mm512_dpbf16_ps(sc[r][g][c], kv, (__m512bh)_mm512_set1_epi32((int)qp[r][g * P + i + c]));
        }
    uint32_t pb[2][8][8];                                  /* each head's 16 weights as 8 bf16 key pairs */
    float alpha[2][8];                                     /* each head's rescale of acc (1: none) */
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_add_ps(_mm512_add_ps(sc[r][g][0], sc[r][g][2]), _mm512_add_ps(sc[r][g][1], sc[r][g][3]));
            s = _mm512_mul_ps(s, _mm512_set1_ps(j->scale));
            if (j->softcap > 0.0f) {
                float t[16];
                _mm512_storeu_ps(t, s);
                for (int l = 0; l < 16; l++) t[l] = capped(j, t[l]);
                s = _mm512_loadu_ps(t);
            }
            __m512 d = _mm512_loadu_ps(dv[r] + g * 16);
            alpha[r][g] = 1.0f;
            if (_mm512_mask_cmp_ps_mask(m, s, _mm512_set1_ps(mx[r][g]), _CMP_GT_OQ)) {   /* a key above the max */
                const float bmax = _mm512_reduce_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), m, s));
                alpha[r][g] = exp_neg(mx[r][g] - bmax);
                mx[r][g] = bmax;
                d = _mm512_mul_ps(d, _mm512_set1_ps(alpha[r][g]));
            }
            const __m256i e = (__m256i)_mm512_cvtneps_pbh(
                _mm512_maskz_mov_ps(m, exp_neg16(_mm512_sub_ps(s, _mm512_set1_ps(mx[r][g])))));
            _mm256_storeu_si256((__m256i *)pb[r][g], e);
            d = _mm512_add_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e), 16)));
            _mm512_storeu_ps(dv[r] + g * 16, d);
        }
    __m512 av[2][8][8];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const __m512 va = _mm512_set1_ps(alpha[r][g]);
            for (int v = 0; v < NV; v++) {
                av[r][g][v] = _mm512_loadu_ps(acc[r] + g * D + v * 16);
                if (alpha[r][g] != 1.0f) av[r][g][v] = _mm512_mul_ps(av[r][g][v], va);
            }
        }
    for (int p = 0; p < 8; p++) {
        __m512bh vv[8];
        for (int v = 0; v < NV; v++) vv[v] = (__m512bh)_mm512_loadu_si512(vp + (p * D + 16 * v) * 2);
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[r][g][p]);
                for (int v = 0; v < NV; v++) av[r][g][v] = _mm512_dpbf16_ps(av[r][g][v], pp, vv[v]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc[r] + g * D + v * 16, av[r][g][v]);
}

/* R rows' (1 or 2, the same keys [a, z) of this block) kv head over the block's packed tiles: acc[r] [G, D],
 * mx[r] [G] and the lane denominators dv[r] [G, 16] in and out */
static inline __attribute__((always_inline)) void head_tiles(const job_t *j, const uint32_t *kt, const uint16_t *vp,
                                                             const uint32_t *const *qp, float *const *acc,
                                                             float *const *mx, float *const *dv, int a, int z,
                                                             const int R, const int G, const int NV) {
    const int D = 16 * NV;
    for (int c0 = (a / 16) * 16; c0 < z; c0 += 16)
        tile_bf16(j, kt + (c0 / 16) * 8 * D, vp + (c0 / 16) * 16 * D, qp, acc, mx, dv, tile_mask(c0, a, z), R, G, NV);
}

/* A segment's lane denominators (hq x 16, all zero) begun, or added up into den [hq] at its end */
static inline void lanes_begin(float *dv, int hq) { memset(dv, 0, (size_t)hq * 16 * sizeof(float)); }
static inline void lanes_end(const float *dv, float *den, int hq) {
    for (int h = 0; h < hq; h++) den[h] = _mm512_reduce_add_ps(_mm512_loadu_ps(dv + h * 16));
}

/* A row's raw bf16 query heads as pairs (hq x D/2 uint32) at dst */
static inline void raw_pairs(const job_t *j, int row, uint32_t *dst) {
    for (int h = 0; h < j->hq; h++)
        memcpy(dst + (int64_t)h * j->D / 2, (const uint16_t *)j->q + (int64_t)row * j->q_st + (int64_t)h * j->q_sh,
               (size_t)j->D * 2);
}

/* The next block's K and V (every kv head: bs rows of hkv * D bf16), pulled into L1/L2 before this block's
 * work (blocks are scattered, so the hardware prefetcher does not see them coming); nbase < 0: none */
static inline void pull_block(const job_t *j, int64_t nbase) {
    if (nbase < 0) return;
    const int lines = (j->bs * j->hkv * j->D * 2 + 63) / 64;
    const char *k = (const char *)j->k + nbase * 2, *v = (const char *)j->v + nbase * 2;
    for (int l = 0; l < lines; l++) {
        _mm_prefetch(k + l * 64, _MM_HINT_T0);
        _mm_prefetch(v + l * 64, _MM_HINT_T0);
    }
}

/* run_seg for a bf16 cache (a row alone): each block's tiles packed for its keys, then the row over them */
static inline __attribute__((always_inline)) void run_seg_bf16(const job_t *j, work_t *w, const item_t *it,
                                                               int k0, int sl, const int G, const int NV) {
    const int D = 16 * NV, bs = j->bs, hkv = j->hkv;
    uint32_t *qp = (uint32_t *)w->q, *kt = (uint32_t *)w->kb;
    uint16_t *vp = (uint16_t *)w->vb;
    raw_pairs(j, it->row, qp);
    memset(w->acc, 0, (size_t)G * hkv * D * sizeof(float));
    for (int h = 0; h < G * hkv; h++) w->mx[h] = -1e30f;
    lanes_begin(w->dv, G * hkv);
    for (int blk0 = (k0 / bs) * bs; blk0 < sl; blk0 += bs) {
        int a, z;
        const int64_t base = block_span(j, it, blk0, k0, sl, &a, &z);
        pull_block(j, blk0 + bs < sl ? (int64_t)j->tables[(int64_t)it->b * j->bt_stride + blk0 / bs + 1] * j->c_sb : -1);
        for (int hk = 0; hk < hkv; hk++) {
            const uint32_t *q1[1] = {qp + hk * G * D / 2};
            float *acc1[1] = {w->acc + hk * G * D}, *mx1[1] = {w->mx + hk * G}, *dv1[1] = {w->dv + hk * G * 16};
            pack_block(j, base + hk * D, a, z, kt, vp, NV);
            head_tiles(j, kt, vp, q1, acc1, mx1, dv1, a, z, 1, G, NV);
        }
    }
    lanes_end(w->dv, w->den, G * hkv);
}

/* run_rows for a bf16 cache: per block and kv head the tiles of the group's keys packed once, then each row
 * over its own keys of them (rs[r].q: the row's raw pairs, see run_group) */
static inline __attribute__((always_inline)) void run_rows_bf16(const job_t *j, work_t *w, int b, int k0,
                                                                const rowseg_t *rs, int n, const int G,
                                                                const int NV) {
    const int D = 16 * NV, bs = j->bs, hkv = j->hkv;
    const int32_t *table = j->tables + (int64_t)b * j->bt_stride;
    uint32_t *kt = (uint32_t *)w->kb;
    uint16_t *vp = (uint16_t *)w->vb;
    const int hq = G * hkv;
    int kmax = k0;
    for (int r = 0; r < n; r++) kmax = rs[r].k1 > kmax ? rs[r].k1 : kmax;
    lanes_begin(w->dv, n * hq);                /* row r's lane denominators: w->dv + r * hq * 16 */
    for (int blk0 = (k0 / bs) * bs; blk0 < kmax; blk0 += bs) {
        const int64_t base = (int64_t)table[blk0 / bs] * j->c_sb;
        const int a = k0 > blk0 ? k0 - blk0 : 0, zmax = kmax - blk0 < bs ? kmax - blk0 : bs;
        pull_block(j, blk0 + bs < kmax ? (int64_t)table[blk0 / bs + 1] * j->c_sb : -1);
        for (int hk = 0; hk < hkv; hk++) {
            pack_block(j, base + hk * D, a, zmax, kt, vp, NV);
            for (int r = 0; r < n; r++) {
                if (rs[r].k1 <= blk0) continue;
                const int z = rs[r].k1 - blk0 < bs ? rs[r].k1 - blk0 : bs;
                const int two = r + 1 < n && (rs[r + 1].k1 - blk0 < bs ? rs[r + 1].k1 - blk0 : bs) == z;
                const uint32_t *q2[2] = {(const uint32_t *)rs[r].q + hk * G * D / 2,
                                         two ? (const uint32_t *)rs[r + 1].q + hk * G * D / 2 : NULL};
                float *acc2[2] = {rs[r].acc + hk * G * D, two ? rs[r + 1].acc + hk * G * D : NULL};
                float *mx2[2] = {rs[r].mx + hk * G, two ? rs[r + 1].mx + hk * G : NULL};
                float *dv2[2] = {w->dv + ((int64_t)r * hq + hk * G) * 16,
                                 two ? w->dv + ((int64_t)(r + 1) * hq + hk * G) * 16 : NULL};
                if (two) {                             /* a pair over the same keys: one pass, each row as alone */
                    head_tiles(j, kt, vp, q2, acc2, mx2, dv2, a, z, 2, G, NV);
                    r++;
                } else {
                    head_tiles(j, kt, vp, q2, acc2, mx2, dv2, a, z, 1, G, NV);
                }
            }
        }
    }
    for (int r = 0; r < n; r++) lanes_end(w->dv + (int64_t)r * hq * 16, rs[r].den, hq);
}
/* the shapes the bf16 body is built for (build time: each is a register-blocked copy), head_dim 64 and 3 or 4
 * query heads per kv head (SmolLM2-135M/360M, Llama 3.2 1B/3B); the others keep the fp32 body */
#define BF16_SHAPE(g, nv) ((nv) == 4 && ((g) == 3 || (g) == 4))
#define BF16_G(g) ((g) == 3 ? 3 : 4)
#define RUN_SEG(g, nv) (BF16_SHAPE(g, nv) && bf16_dots(j) ? run_seg_bf16(j, w, it, k0, sl, BF16_G(g), 4) : run_seg_avx512(j, w, it, k0, sl, g, nv))
#define RUN_ROWS(g, nv) (BF16_SHAPE(g, nv) && bf16_dots(j) ? run_rows_bf16(j, w, b, k0, rs, n, BF16_G(g), 4) : run_rows_avx512(j, w, b, k0, rs, n, g, nv))
#else
static inline int bf16_dots(const job_t *j) { (void)j; return 0; }
#define RUN_SEG(g, nv) run_seg_avx512(j, w, it, k0, sl, g, nv)
#define RUN_ROWS(g, nv) run_rows_avx512(j, w, b, k0, rs, n, g, nv)
#endif

/* n rows' segment through the AVX-512 body; 0 when it does not take these shapes */
static int rows_body(const job_t *j, work_t *w, int b, int k0, const rowseg_t *rs, int n) {
    const int G = j->hq / j->hkv, NV = j->D / 16;
#define ROWS_SHAPE(g, nv) if (G == g && NV == nv) { RUN_ROWS(g, nv); return 1; }
    if (j->D % 16 == 0) { AVX512_SHAPES(ROWS_SHAPE) }
#undef ROWS_SHAPE
    return 0;
}

/* Whether rows can be grouped: the AVX-512 body takes these shapes */
static inline int groupable(const job_t *j) { return avx512_shape(j); }

#define HAVE_ROW_GROUP 1
#define SPECIAL(g, nv) if (G == g && NV == nv) { RUN_SEG(g, nv); return; }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_BODY 1

/* exp_neg over 8 lanes: the same polynomial as exp_neg, lane by lane */
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180546e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503406e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lanes of the 8-key tile starting at block offset c0 that hold keys [a, z): all-ones lanes */
static inline __m256 tile_mask8(int c0, int a, int z) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(c0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(a - 1));
    const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(z), idx);
    return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
}

/* Lane t of the result = the sum of x[t]'s 8 lanes, by one fixed tree: ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) */
static inline __m256 lane_sums8(const __m256 x[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The 8 lanes of x summed by the same tree as lane_sums8 */
static inline float sum8(__m256 x) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x, x), x);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* softmax_block over 8-key tiles at fixed block offsets: exp(s - max) in place, each tile's sum by
 * sum8, tiles in order, so a row's sum order depends on its keys only. Returns alpha. */
static inline float softmax_block8(float *s, int a, int z, float *mx, float *den) {
    __m256 vmax = _mm256_set1_ps(*mx);   /* exact in any order; a NaN score is skipped, as softmax_block does */
    for (int c0 = (a / 8) * 8; c0 < z; c0 += 8)
        vmax = _mm256_max_ps(_mm256_blendv_ps(vmax, _mm256_loadu_ps(s + c0), tile_mask8(c0, a, z)), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float bmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float alpha = bmax == *mx ? 1.0f : exp_neg(*mx - bmax);   /* exp_neg(0) is exactly 1 */
    *mx = bmax;
    float sum = 0.0f;
    for (int c0 = (a / 8) * 8; c0 < z; c0 += 8) {
        const __m256 m = tile_mask8(c0, a, z);
        const __m256 e = _mm256_and_ps(m, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + c0), _mm256_set1_ps(bmax))));
        _mm256_storeu_ps(s + c0, e);
        sum += sum8(e);
    }
    *den = *den * alpha + sum;
    return alpha;
}

/* Rows [t0, t1) of kv head data at element offset off (rows `row` elements apart) as fp32: the cache
 * itself for fp32, else converted into buf (rows D apart); *st: the returned rows' stride. Row t of
 * the result is at index t * *st. */
static inline const float *rows_f32(const job_t *j, const void *src, int64_t off, int row, int t0, int t1,
                                    int D, float *buf, int64_t *st) {
    if (j->dtype == 0) {
        *st = row;
        return (const float *)src + off;
    }
    const uint16_t *p = (const uint16_t *)src + off;
    for (int t = t0; t < t1; t++)
        for (int d = 0; d < D; d += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(p + (int64_t)t * row + d));
            _mm256_storeu_ps(buf + t * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
    *st = D;
    return buf;
}

/* The scores of query q (head_dim 8 * NV) against 8 keys k + t * st: each key's 8 lane partials (one
 * product, then fmas over the NV chunks), summed by lane_sums8's fixed tree (the bits depend on the
 * query and the key only). */
static inline __attribute__((always_inline)) __m256 tile_dots8(const float *q, const float *k, int64_t st,
                                                               const int NV) {
    __m256 acc[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int t = 0; t < 8; t++) acc[t] = _mm256_mul_ps(q0, _mm256_loadu_ps(k + t * st));
    for (int v = 1; v < NV; v++) {
        const __m256 qv = _mm256_loadu_ps(q + v * 8);
        for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * st + v * 8), acc[t]);
    }
    return lane_sums8(acc);
}

/* Segment [k0, rs[r].k1) of n query rows of sequence b, head_dim = 8 * NV (NV a compile-time constant after
 * inlining), block size a multiple of 8. Per block and kv head, the block's K and V rows stay in L1 while
 * the n rows pass over them (the rows of one prompt chunk read their keys once, not once each), and
 * each row does exactly what it does alone: scores 8 keys a tile (tile_dots8), the online softmax over
 * 8-key tiles (softmax_block8) and P·V per query head with at most 8 live accumulators (AVX2 has 16
 * registers), all over its own keys [a, z) of the block. So a row's bits do not depend on n. */
static inline __attribute__((always_inline)) void run_rows_avx2(const job_t *j, work_t *w, int b, int k0,
                                                                const rowseg_t *rs, int n, const int NV) {
    const int D = 8 * NV, bs = j->bs, hkv = j->hkv, G = j->hq / hkv, row = hkv * D;
    const int32_t *table = j->tables + (int64_t)b * j->bt_stride;
    int kmax = k0;
    for (int r = 0; r < n; r++) kmax = rs[r].k1 > kmax ? rs[r].k1 : kmax;
    for (int blk0 = (k0 / bs) * bs; blk0 < kmax; blk0 += bs) {
        const int64_t base = (int64_t)table[blk0 / bs] * j->c_sb;
        const int a = k0 > blk0 ? k0 - blk0 : 0, zmax = kmax - blk0 < bs ? kmax - blk0 : bs;
        const int t0 = (a / 8) * 8;                           /* the first tile holding key a */
        for (int hk = 0; hk < hkv; hk++) {
            int64_t kst, vst;
            const float *kr = rows_f32(j, j->k, base + hk * D, row, t0, ((zmax + 7) / 8) * 8, D, w->kb, &kst);
            const float *vr = rows_f32(j, j->v, base + hk * D, row, a, zmax, D, w->vb, &vst);
            for (int r = 0; r < n; r++) {
                if (rs[r].k1 <= blk0) continue;
                const int z = rs[r].k1 - blk0 < bs ? rs[r].k1 - blk0 : bs;    /* this row's keys [a, z) */
                for (int c0 = t0; c0 < z; c0 += 8)
                    for (int g = 0; g < G; g++) {
                        const int h = hk * G + g;
                        _mm256_storeu_ps(w->s + h * MAX_BS + c0, tile_dots8(rs[r].q + h * D, kr + c0 * kst, kst, NV));
                    }
                if (j->softcap > 0.0f)
                    for (int g = 0; g < G; g++)
                        for (int t = a; t < z; t++)
                            w->s[(hk * G + g) * MAX_BS + t] = capped(j, w->s[(hk * G + g) * MAX_BS + t]);
                for (int g = 0; g < G; g++) {
                    const int h = hk * G + g;
                    float *s = w->s + h * MAX_BS;
                    const float alpha = softmax_block8(s, a, z, &rs[r].mx[h], &rs[r].den[h]);
                    for (int c = 0; c < NV; c += 8) {            /* 8 output vectors at a time */
                        const int nc = NV - c < 8 ? NV - c : 8;
                        float *acc = rs[r].acc + h * D + c * 8;
                        __m256 av[8];
                        for (int i = 0; i < nc; i++)
                            av[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * 8), _mm256_set1_ps(alpha));
                        for (int t = a; t < z; t++) {
                            const __m256 p = _mm256_set1_ps(s[t]);
                            const float *vt = vr + t * vst + c * 8;
                            for (int i = 0; i < nc; i++) av[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + i * 8), av[i]);
                        }
                        for (int i = 0; i < nc; i++) _mm256_storeu_ps(acc + i * 8, av[i]);
                    }
                }
            }
        }
    }
}

/* n rows' segment through the AVX2 body for this head_dim; 0 when it does not take these shapes */
static int rows_avx2(const job_t *j, work_t *w, int b, int k0, const rowseg_t *rs, int n) {
    if (j->bs % 8) return 0;
    if (j->D == 64) run_rows_avx2(j, w, b, k0, rs, n, 8);
    else if (j->D == 128) run_rows_avx2(j, w, b, k0, rs, n, 16);
    else if (j->D == 32) run_rows_avx2(j, w, b, k0, rs, n, 4);
    else return 0;
    return 1;
}

/* n rows' segment through this build's row body (run_group's entry point, as at AVX-512) */
static int rows_body(const job_t *j, work_t *w, int b, int k0, const rowseg_t *rs, int n) {
    return rows_avx2(j, w, b, k0, rs, n);
}

/* Whether rows can be grouped: the AVX2 body takes these shapes */
static inline int groupable(const job_t *j) {
    return j->bs % 8 == 0 && (j->D == 64 || j->D == 128 || j->D == 32);
}

#define HAVE_ROW_GROUP 1
#endif

/* One segment [k0, sl) of a query row: the register-blocked AVX-512 body (or, on a CPU with AVX2 but
 * no AVX-512, the AVX2 body) for the common head shapes, else the generic one. The body chosen depends
 * on the model's shapes only, never on the batch. */
static void segment(const job_t *j, work_t *w, const item_t *it, int k0, int sl) {
#if defined(__AVX512F__) && !defined(CHATSERVE_AVX2_ONLY)
    const int G = j->hq / j->hkv, NV = j->D / 16;
    if (j->D % 16 == 0) { AVX512_SHAPES(SPECIAL) }
#elif defined(HAVE_AVX2_BODY)
    const rowseg_t one = {w->q, w->acc, w->mx, w->den, sl};
    if (j->bs % 8 == 0 && (j->D == 64 || j->D == 128 || j->D == 32)) {
        seg_begin(j, w, it, k0, j->hq, j->D);
        rows_avx2(j, w, it->b, k0, &one, 1);
        return;
    }
#endif
    run_seg(j, w, it, k0, sl);
}

/* out row = Σ_s e^(mx_s - M) acc_s / Σ_s e^(mx_s - M) den_s over a row's n segments (M = max mx_s),
 * segments in key order: the one merge every row goes through, whoever computed its segments. */
static void merge_row(const job_t *j, const parts_t *pt, int row, int first, int n) {
    const int hq = j->hq, D = j->D;
    float acc[MAX_D];
    for (int h = 0; h < hq; h++) {
        float M = j->sinks ? j->sinks[h] : -1e30f, den = 0.0f;
        for (int s = first; s < first + n; s++) M = pt->mx[s * hq + h] > M ? pt->mx[s * hq + h] : M;
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int s = first; s < first + n; s++) {
            const float c = exp_neg(pt->mx[s * hq + h] - M);
            const float *a = pt->acc + ((int64_t)s * hq + h) * D;
            den += c * pt->den[s * hq + h];
            for (int d = 0; d < D; d++) acc[d] += c * a[d];
        }
        if (j->sinks) den += exp_neg(j->sinks[h] - M);     /* a sink: weight in the denominator only */
        write_out(j, (int64_t)row * j->o_st + (int64_t)h * j->o_sh, acc, den);
    }
}

/* The body this build runs for the common shapes: 3 AVX-512, 2 AVX2, 0 the generic one only. */
int chatserve_attention_level(void) {
#if defined(__AVX512F__) && !defined(CHATSERVE_AVX2_ONLY)
    return 3;
#elif defined(HAVE_AVX2_BODY)
    return 2;
#else
    return 0;
#endif
}

/* Segment boundaries: absolute multiples of SEG keys (a multiple of the block size), so a row's
 * segments depend on its position only. */
#define SEG 256

static inline int seg_count(int lo, int hi) { return (hi - 1) / SEG - lo / SEG + 1; }   /* lo < hi */

/* Segment i of keys [lo, hi): [*k0, *k1) */
static inline void seg_bounds(int lo, int hi, int i, int *k0, int *k1) {
    const int s = lo / SEG + i;
    *k0 = s * SEG > lo ? s * SEG : lo;
    *k1 = (s + 1) * SEG < hi ? (s + 1) * SEG : hi;
}

/* The thread's own partial slots hold at least n segments of hq heads (grown, never shrunk). */
static int own_slots(work_t *w, int n, int hq, int D) {
    const int64_t need = (int64_t)n * hq * D;            /* D >= 1, so need >= n * hq for mx and den */
    if (w->own_cap >= need) return 1;
    free(w->own.acc), free(w->own.mx), free(w->own.den);
    w->own.acc = (float *)malloc((size_t)need * sizeof(float));
    w->own.mx = (float *)malloc((size_t)need * sizeof(float));
    w->own.den = (float *)malloc((size_t)need * sizeof(float));
    w->own_cap = (w->own.acc && w->own.mx && w->own.den) ? need : 0;
    return w->own_cap > 0;
}

#if defined(HAVE_ROW_GROUP)
#define GROUP 16                        /* most rows of one sequence that pass over its keys together */
_Static_assert(GROUP <= 16, "work_t.dv holds the lane denominators of 16 rows");

/* n = it->n consecutive rows of sequence it->b (rows it->row.., positions it->p..) that see the same first
 * key: segment after segment, the rows that reach it pass over its blocks together (rows_body), each
 * into its own slots, from the same start state as seg_begin's; then each row is merged as run_item
 * merges a row alone. A row's arithmetic is the same in a group as alone. */
static int run_group(const job_t *j, work_t *w, const item_t *it) {
    const int hq = j->hq, D = j->D, n = it->n, lo = first_key(j, it->p);
    const int nsm = seg_count(lo, it->p + n);            /* the last row's segment count: the most */
    const int64_t need = (int64_t)n * hq * D;
    if (!own_slots(w, n * nsm, hq, D)) return 0;
    if (w->gq_cap < need) {
        free(w->gq);
        w->gq = (float *)malloc((size_t)need * sizeof(float));
        w->gq_cap = w->gq ? need : 0;
        if (!w->gq) return 0;
    }
#if defined(HAVE_BF16_DOT)
    if (bf16_dots(j))                                    /* the bf16 body takes raw bf16 pairs (run_rows_bf16) */
        for (int r = 0; r < n; r++) raw_pairs(j, it->row + r, (uint32_t *)(w->gq + (int64_t)r * hq * D));
    else
#endif
    for (int r = 0; r < n; r++)
        for (int h = 0; h < hq; h++) {
            const int64_t off = (int64_t)(it->row + r) * j->q_st + (int64_t)h * j->q_sh;
            const float *qh = as_f32(j->dtype, j->q, off, w->row, D);
            for (int d = 0; d < D; d++) w->gq[((int64_t)r * hq + h) * D + d] = qh[d] * j->scale;
        }
    for (int i = 0; i < nsm; i++) {
        rowseg_t rs[GROUP];
        int m = 0, k0 = 0;
        for (int r = 0; r < n; r++) {
            const int hi = it->p + r + 1;
            if (seg_count(lo, hi) <= i) continue;              /* this row's keys end before segment i */
            int k1;
            seg_bounds(lo, hi, i, &k0, &k1);                   /* k0: the same for every row */
            const int64_t slot = (int64_t)r * nsm + i;
            float *acc = w->own.acc + slot * hq * D, *mx = w->own.mx + slot * hq, *den = w->own.den + slot * hq;
            memset(acc, 0, (size_t)hq * D * sizeof(float));
            for (int h = 0; h < hq; h++) mx[h] = -1e30f, den[h] = 0.0f;
            rs[m++] = (rowseg_t){w->gq + (int64_t)r * hq * D, acc, mx, den, k1};
        }
        rows_body(j, w, it->b, k0, rs, m);
    }
    for (int r = 0; r < n; r++) merge_row(j, &w->own, it->row + r, r * nsm, seg_count(lo, it->p + r + 1));
    return 1;
}
#else
static inline int groupable(const job_t *j) { (void)j; return 0; }
#define GROUP 1
#endif

/* One work item: one segment of a row into the shared slots, a group of rows (run_group), or a whole
 * row: its segments one after another into the thread's own slots, then merged into out. Returns 0
 * when memory ran out. */
static int run_item(const job_t *j, work_t *w, const item_t *it, const parts_t *pt) {
#if defined(HAVE_ROW_GROUP)
    if (it->n > 1) return run_group(j, w, it);
#endif
    if (it->k0 >= 0) {
        segment(j, w, it, it->k0, it->k1);
        seg_end(w, pt, it->part, j->hq, j->D);
        return 1;
    }
    const int lo = first_key(j, it->p), hi = it->p + 1, n = seg_count(lo, hi);
    if (!own_slots(w, n, j->hq, j->D)) return 0;
    for (int i = 0; i < n; i++) {
        int k0, k1;
        seg_bounds(lo, hi, i, &k0, &k1);
        segment(j, w, it, k0, k1);
        seg_end(w, &w->own, i, j->hq, j->D);
    }
    merge_row(j, &w->own, it->row, 0, n);
    return 1;
}

/* Work items for the R query rows: a whole row each (where the AVX-512 or AVX2 body runs, up to GROUP
 * consecutive rows of a sequence with the same first key as one item, at most a thread's share), or, when rows are
 * fewer than two per thread (a few decodes), one segment each so a long context still keeps every
 * thread busy. Returns the item count (items of a row are consecutive); *nparts: shared partial slots
 * used. How rows are grouped never changes a row's arithmetic. */
static int64_t plan_items(const job_t *j, int B, int64_t R, int threads, item_t *items, int64_t *nparts) {
    const int split = R < 2 * (int64_t)threads, group = groupable(j);
    int64_t m = 0;
    for (int b = 0; b < B; b++) {
        const int ql = j->qsl[b + 1] - j->qsl[b];
        const int share = (ql + threads - 1) / threads, most = share < GROUP ? share : GROUP;
        for (int r = 0; r < ql; r++) {
            const int row = j->qsl[b] + r, p = j->lens[b] - ql + r;
            if (!split) {
                int n = 1;
                while (group && n < most && r + n < ql && first_key(j, p + n) == first_key(j, p)) n++;
                items[m++] = (item_t){b, row, p, -1, -1, -1, n};
                r += n - 1;
                continue;
            }
            const int lo = first_key(j, p), n = seg_count(lo, p + 1);
            for (int i = 0; i < n; i++) {
                int k0, k1;
                seg_bounds(lo, p + 1, i, &k0, &k1);
                items[m] = (item_t){b, row, p, k0, k1, (int)m, 1};
                m++;
            }
        }
    }
    *nparts = split ? m : 0;
    return m;
}

/* Every query row of a varlen batch: sequence b's ql = qsl[b+1] - qsl[b] new tokens sit at rows
 * qsl[b].. of q and out, positions seq_lens[b] - ql .. seq_lens[b] - 1, and see the keys before them
 * and themselves (their K/V already stored); sinks (NULL or [hq] float32) add e^sink to every
 * row's denominator. Returns 0 on success, 1 for shapes this kernel does
 * not take (the caller uses the twin), 2 for inconsistent lengths, 3 when memory ran out. */
int chatserve_paged_attention(int dtype, const void *q, int64_t q_st, int64_t q_sh,
                              const void *k_cache, const void *v_cache, int64_t c_sb,
                              const int32_t *block_tables, int64_t bt_stride,
                              const int32_t *query_start_loc, const int32_t *seq_lens,
                              int B, int hq, int hkv, int D, int block_size, float scale, int window,
                              float softcap, const float *sinks, void *out, int64_t o_st, int64_t o_sh,
                              int nthreads) {
    if (dtype < 0 || dtype > 1 || hkv <= 0 || hq % hkv || hq > MAX_HQ || D > MAX_D ||
        hkv * D > MAX_ROW || block_size > MAX_BS || block_size <= 0 || SEG % block_size)
        return 1;
    int64_t R = 0, cap = 0;
    for (int b = 0; b < B; b++) {
        const int ql = query_start_loc[b + 1] - query_start_loc[b];
        if (ql < 0 || ql > seq_lens[b]) return 2;
        R += ql;
        cap += (int64_t)ql * (seq_lens[b] / SEG + 2);
    }
    if (R == 0) return 0;
    const job_t j = {dtype, q, k_cache, v_cache, out, q_st, q_sh, o_st, o_sh, c_sb, block_tables,
                     query_start_loc, seq_lens, bt_stride, hq, hkv, D, block_size, window, scale, softcap,
                     sinks};
    int threads = nthreads < 1 ? 1 : nthreads;
    item_t *items = (item_t *)malloc((size_t)cap * sizeof(item_t));
    if (!items) return 3;
    int64_t nparts = 0;
    const int64_t m = plan_items(&j, B, R, threads, items, &nparts);
    parts_t pt = {NULL, NULL, NULL};
    if (nparts) {
        pt.acc = (float *)malloc((size_t)nparts * hq * D * sizeof(float));
        pt.mx = (float *)malloc((size_t)nparts * hq * sizeof(float));
        pt.den = (float *)malloc((size_t)nparts * hq * sizeof(float));
        if (!pt.acc || !pt.mx || !pt.den) {
            free(items), free(pt.acc), free(pt.mx), free(pt.den);
            return 3;
        }
    }
    if (threads > m) threads = (int)m;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (!tls_work) tls_work = (work_t *)calloc(1, sizeof(work_t));   /* once per pool thread */
        work_t *w = tls_work;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < m; i++)
            if (!w || !run_item(&j, w, &items[i], &pt)) {
#pragma omp atomic write
                failed = 1;
            }
        if (nparts) {            /* the implicit barrier above: every segment is done; merge per row */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < m; i++)
                if (i == 0 || items[i - 1].row != items[i].row) {
                    int k = 1;
                    while (i + k < m && items[i + k].row == items[i].row) k++;
                    merge_row(&j, &pt, items[i].row, items[i].part, k);
                }
        }
    }
    free(items), free(pt.acc), free(pt.mx), free(pt.den);
    return failed ? 3 : 0;
}
