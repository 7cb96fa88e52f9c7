/* Paged decode attention for the CPU: one new token per sequence against its K/V, read from the
 * paged cache in place (the torch twin gathers a padded copy of every sequence's K/V per layer).
 *
 * Built at first use by cpu_attention.py (cc -O3 -march=native -fopenmp) and called through ctypes,
 * which releases the GIL. OpenMP resolves to the libgomp torch has already loaded, so this kernel and
 * torch's ops share one thread pool. A work item is one sequence, all heads: each cache block
 * [block_size, kv_heads, head_dim] is read once, front to back. Online softmax over blocks, fp32
 * arithmetic whatever the storage (fp32 or bf16). Rows of the batch with more than one new token
 * (prefill chunks) are left alone: the caller computes them. The twin is the test oracle.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    float scale;
} job_t;

typedef struct {                        /* one work item: keys [k0, k1) of decode sequence b */
    int b, k0, k1;
    int part;                           /* -1: the whole sequence (write out), else its partial slot */
} item_t;

typedef struct {                        /* a split's unnormalized result, merged by merge_parts */
    float *acc;                         /* [nparts, hq, D] */
    float *mx, *den;                    /* [nparts, hq] */
} parts_t;

typedef struct {                        /* per-thread workspace */
    float q[MAX_HQ * MAX_D], acc[MAX_HQ * MAX_D];
    float s[MAX_HQ * MAX_BS];
    float row[MAX_ROW];
    float mx[MAX_HQ], den[MAX_HQ];
} work_t;

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

/* First key sequence b's decode row sees (its sliding window). */
static inline int first_key(const job_t *j, int b) {
    const int lo = j->window > 0 ? j->lens[b] - j->window : 0;
    return lo < 0 ? 0 : lo;
}

/* Start a work item: scaled queries, empty accumulators. Returns its first key. */
static int seq_begin(const job_t *j, work_t *w, const item_t *it, int hq, int D) {
    const int t_q = j->qsl[it->b];
    for (int h = 0; h < hq; h++) {
        const float *qh = as_f32(j->dtype, j->q, (int64_t)t_q * j->q_st + (int64_t)h * j->q_sh, w->row, D);
        for (int d = 0; d < D; d++) w->q[h * D + d] = qh[d] * j->scale;
        memset(w->acc + h * D, 0, (size_t)D * sizeof(float));
        w->mx[h] = -1e30f;
        w->den[h] = 0.0f;
    }
    return it->k0;
}

/* Finish a work item: the output row of a whole sequence, else its partial (acc, max, sum) */
static void seq_end(const job_t *j, const work_t *w, const item_t *it, const parts_t *pt, int hq, int D) {
    if (it->part < 0) {
        const int t_q = j->qsl[it->b];
        for (int h = 0; h < hq; h++)
            write_out(j, (int64_t)t_q * j->o_st + (int64_t)h * j->o_sh, w->acc + h * D, w->den[h]);
        return;
    }
    memcpy(pt->acc + (int64_t)it->part * hq * D, w->acc, (size_t)hq * D * sizeof(float));
    memcpy(pt->mx + (int64_t)it->part * hq, w->mx, (size_t)hq * sizeof(float));
    memcpy(pt->den + (int64_t)it->part * hq, w->den, (size_t)hq * sizeof(float));
}

/* The block of a work item's keys [lo, it->k1) that starts at key blk0: its keys [*a, *z), and where
 * it starts in the cache (element offset). */
static inline int64_t block_span(const job_t *j, const item_t *it, int blk0, int lo, int *a, int *z) {
    const int sl = it->k1;
    *a = lo > blk0 ? lo - blk0 : 0;
    *z = (sl - blk0) < j->bs ? (sl - blk0) : j->bs;
    return (int64_t)j->tables[(int64_t)it->b * j->bt_stride + blk0 / j->bs] * j->c_sb;
}

/* Online softmax step of one head over a block's scores s[a, z): s becomes exp(s - max) in place, the
 * running max *mx and sum *den move on; returns alpha, the factor the head's accumulator is scaled by. */
static inline float softmax_block(float *s, int a, int z, float *mx, float *den) {
    float bmax = *mx;
    for (int t = a; t < z; t++) bmax = s[t] > bmax ? s[t] : bmax;
    const float alpha = exp_neg(*mx - bmax);
    *mx = bmax;
    float sum = 0.0f;
    for (int t = a; t < z; t++) {
        s[t] = exp_neg(s[t] - bmax);
        sum += s[t];
    }
    *den = *den * alpha + sum;
    return alpha;
}

/* The generic body: any head_dim and group size, one dot product per (head, key). */
static void run_seq(const job_t *j, work_t *w, const item_t *it, const parts_t *pt) {
    const int D = j->D, bs = j->bs, hq = j->hq, G = hq / j->hkv, row = j->hkv * D;
    const int sl = it->k1;
    const int lo = seq_begin(j, w, it, hq, D);                /* this item's keys [lo, sl) */
    for (int blk0 = (lo / bs) * bs; blk0 < sl; blk0 += bs) {
        int a, z;                                             /* keys [a, z) of this block */
        const int64_t base = block_span(j, it, blk0, lo, &a, &z);
        for (int t = a; t < z; t++) {
            const float *kr = as_f32(j->dtype, j->k, base + (int64_t)t * row, w->row, row);
            for (int h = 0; h < hq; h++) {
                const float *qh = w->q + h * D, *kh = kr + (h / G) * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
                w->s[h * MAX_BS + t] = dot;
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
    seq_end(j, w, it, pt, hq, D);
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16(int dtype, const void *base, int64_t off) {    /* 16 values as fp32 */
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + off);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* run_seq for head_dim = 16 * NV and G query heads per kv head, both compile-time constants after
 * inlining: per block and kv head, the G query vectors and the G x NV output accumulators stay in
 * registers while the block's tokens stream through (no converted copies, no per-token stores). */
static inline __attribute__((always_inline)) void run_seq_avx512(const job_t *j, work_t *w,
                                                                 const item_t *it, const parts_t *pt,
                                                                 const int G, const int NV) {
    const int D = 16 * NV, bs = j->bs, hkv = j->hkv, hq = G * hkv, row = hkv * D;
    const int sl = it->k1;
    const int32_t *table = j->tables + (int64_t)it->b * j->bt_stride;
    const int lo = seq_begin(j, w, it, hq, D);                /* this item's keys [lo, sl) */
    for (int blk0 = (lo / bs) * bs; blk0 < sl; blk0 += bs) {
        int a, z;                                             /* keys [a, z) of this block */
        const int64_t base = block_span(j, it, blk0, lo, &a, &z);
        const int64_t nbase = blk0 + bs < sl ? (int64_t)table[blk0 / bs + 1] * j->c_sb : -1;
        const int esz = j->dtype == 0 ? 4 : 2, lines = (bs * row * esz + 63) / 64;
        for (int hk = 0; hk < hkv; hk++) {
            __m512 qv[G][NV], av[G][NV];
            float alpha[G];
            for (int g = 0; g < G; g++)
                for (int v = 0; v < NV; v++) qv[g][v] = _mm512_loadu_ps(w->q + (hk * G + g) * D + v * 16);
            for (int t = a; t < z; t++) {                      /* scores */
                const int64_t off = base + (int64_t)t * row + hk * D;
                if (nbase >= 0) {   /* blocks are scattered: pull the next one in, a few lines per key */
                    const int per = (lines + (z - a) * hkv - 1) / ((z - a) * hkv);
                    const int first = ((t - a) * hkv + hk) * per;
                    for (int l = first; l < first + per && l < lines; l++) {
                        _mm_prefetch((const char *)j->k + nbase * esz + l * 64, _MM_HINT_T0);
                        _mm_prefetch((const char *)j->v + nbase * esz + l * 64, _MM_HINT_T0);
                    }
                }
                __m512 kv[NV];
                for (int v = 0; v < NV; v++) kv[v] = load16(j->dtype, j->k, off + v * 16);
                for (int g = 0; g < G; g++) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[g][v], kv[v], acc);
                    w->s[(hk * G + g) * MAX_BS + t] = _mm512_reduce_add_ps(acc);
                }
            }
            for (int g = 0; g < G; g++) {                      /* online softmax */
                const int h = hk * G + g;
                alpha[g] = softmax_block(w->s + h * MAX_BS, a, z, &w->mx[h], &w->den[h]);
            }
            for (int g = 0; g < G; g++)
                for (int v = 0; v < NV; v++)
                    av[g][v] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (hk * G + g) * D + v * 16),
                                             _mm512_set1_ps(alpha[g]));
            for (int t = a; t < z; t++) {                      /* values */
                const int64_t off = base + (int64_t)t * row + hk * D;
                __m512 vv[NV];
                for (int v = 0; v < NV; v++) vv[v] = load16(j->dtype, j->v, off + v * 16);
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(w->s[(hk * G + g) * MAX_BS + t]);
                    for (int v = 0; v < NV; v++) av[g][v] = _mm512_fmadd_ps(p, vv[v], av[g][v]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int v = 0; v < NV; v++) _mm512_storeu_ps(w->acc + (hk * G + g) * D + v * 16, av[g][v]);
        }
    }
    seq_end(j, w, it, pt, hq, D);
}

#define SPECIAL(g, nv) if (G == g && NV == nv) { run_seq_avx512(j, w, it, pt, g, nv); return; }
#endif

/* One work item: the register-blocked AVX-512 body for the common head shapes, else the generic one. */
static void decode_item(const job_t *j, work_t *w, const item_t *it, const parts_t *pt) {
#if defined(__AVX512F__)
    const int G = j->hq / j->hkv, NV = j->D / 16;
    if (j->D % 16 == 0) {
        SPECIAL(1, 4) SPECIAL(2, 4) SPECIAL(3, 4) SPECIAL(4, 4) SPECIAL(5, 4) SPECIAL(6, 4) SPECIAL(8, 4)
        SPECIAL(1, 8) SPECIAL(2, 8) SPECIAL(4, 8)
    }
#endif
    run_seq(j, w, it, pt);
}

/* out row = Σ_s e^(mx_s - M) acc_s / Σ_s e^(mx_s - M) den_s over a sequence's n splits (M = max mx_s) */
static void merge_parts(const job_t *j, const parts_t *pt, int b, int first, int n) {
    const int hq = j->hq, D = j->D;
    float acc[MAX_D];
    for (int h = 0; h < hq; h++) {
        float M = -1e30f, den = 0.0f;
        for (int s = first; s < first + n; s++) M = pt->mx[s * hq + h] > M ? pt->mx[s * hq + h] : M;
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int s = first; s < first + n; s++) {
            const float c = exp_neg(pt->mx[s * hq + h] - M);
            const float *a = pt->acc + ((int64_t)s * hq + h) * D;
            den += c * pt->den[s * hq + h];
            for (int d = 0; d < D; d++) acc[d] += c * a[d];
        }
        write_out(j, (int64_t)j->qsl[b] * j->o_st + (int64_t)h * j->o_sh, acc, den);
    }
}

/* Work items: each decode sequence's visible keys cut into splits of whole blocks, at least
 * MIN_SPLIT keys each, so that there are about SPLITS_PER_THREAD items per thread (one long
 * sequence, or a few of unequal lengths, still keep every thread busy). Returns the item count;
 * *nparts: partial slots used (items that are one split of several). */
#define MIN_SPLIT 256
#define SPLITS_PER_THREAD 4
static int plan_items(const job_t *j, const int *seqs, int n, int threads, item_t *items, int *nparts) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += j->lens[seqs[i]] - first_key(j, seqs[i]);
    int64_t chunk = threads > 1 ? (total + (int64_t)threads * SPLITS_PER_THREAD - 1) /
                                      ((int64_t)threads * SPLITS_PER_THREAD)
                                : INT32_MAX;
    if (chunk < MIN_SPLIT) chunk = MIN_SPLIT;
    chunk = (chunk + j->bs - 1) / j->bs * j->bs;
    int m = 0, p = 0;
    for (int i = 0; i < n; i++) {
        const int b = seqs[i], lo = first_key(j, b), sl = j->lens[b];
        const int k = (int)((sl - lo + chunk - 1) / chunk);
        for (int s = 0; s < k; s++) {
            /* split boundaries on block boundaries: no block is read by two items */
            int k0 = s == 0 ? lo : (int)((lo / j->bs) * j->bs + s * chunk);
            int k1 = s == k - 1 ? sl : (int)((lo / j->bs) * j->bs + (s + 1) * chunk);
            items[m++] = (item_t){b, k0, k1, k > 1 ? p++ : -1};
        }
    }
    *nparts = p;
    return m;
}

/* Decode rows (sequences with exactly one new token) of a varlen batch. Returns 0 on success, a
 * positive code for shapes this kernel does not take (the caller falls back to the twin). */
int chatserve_decode_attention(int dtype, const void *q, int64_t q_st, int64_t q_sh,
                               const void *k_cache, const void *v_cache, int64_t c_sb,
                               const int32_t *block_tables, int64_t bt_stride,
                               const int32_t *query_start_loc, const int32_t *seq_lens,
                               int B, int hq, int hkv, int D, int block_size, float scale, int window,
                               void *out, int64_t o_st, int64_t o_sh, int nthreads) {
    if (dtype < 0 || dtype > 1 || hkv <= 0 || hq % hkv || hq > MAX_HQ || D > MAX_D ||
        hkv * D > MAX_ROW || block_size > MAX_BS)
        return 1;
    int *seqs = (int *)malloc((size_t)(B > 0 ? B : 1) * sizeof(int));
    if (!seqs) return 3;
    int n = 0;
    int64_t max_items = 0;
    for (int b = 0; b < B; b++)
        if (query_start_loc[b + 1] - query_start_loc[b] == 1 && seq_lens[b] >= 1) {
            seqs[n++] = b;
            max_items += seq_lens[b] / MIN_SPLIT + 1;
        }
    const job_t j = {dtype, q, k_cache, v_cache, out, q_st, q_sh, o_st, o_sh, c_sb, block_tables,
                     query_start_loc, seq_lens, bt_stride, hq, hkv, D, block_size, window, scale};
    int threads = nthreads < 1 ? 1 : nthreads;
    item_t *items = (item_t *)malloc((size_t)(max_items > 0 ? max_items : 1) * sizeof(item_t));
    int nparts = 0;
    const int m = items ? plan_items(&j, seqs, n, threads, items, &nparts) : 0;
    parts_t pt = {NULL, NULL, NULL};
    if (nparts) {
        pt.acc = (float *)malloc((size_t)nparts * hq * D * sizeof(float));
        pt.mx = (float *)malloc((size_t)nparts * hq * sizeof(float));
        pt.den = (float *)malloc((size_t)nparts * hq * sizeof(float));
    }
    if (!items || (nparts && (!pt.acc || !pt.mx || !pt.den))) {
        free(seqs), free(items), free(pt.acc), free(pt.mx), free(pt.den);
        return 3;
    }
    if (threads > m) threads = m > 0 ? m : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (!tls_work) tls_work = (work_t *)malloc(sizeof(work_t));   /* once per pool thread */
        work_t *w = tls_work;
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < m; i++)
            if (w) decode_item(&j, w, &items[i], &pt);
        if (nparts) {            /* the implicit barrier above: every split is done; merge per sequence */
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < m; i++)
                if (items[i].part >= 0 && (i == 0 || items[i - 1].b != items[i].b)) {
                    int k = 1;
                    while (i + k < m && items[i + k].b == items[i].b) k++;
                    merge_parts(&j, &pt, items[i].b, items[i].part, k);
                }
        }
    }
    free(seqs), free(items), free(pt.acc), free(pt.mx), free(pt.den);
    return failed ? 3 : 0;
}
