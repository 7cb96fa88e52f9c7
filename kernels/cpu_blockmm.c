/* Matmul on GGUF block-format weights, in place: y[M, N] = x[M, K] · Wᵀ with W [N, K] stored as the file
 * stores it (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; the layouts are
 * described in block_formats.py). Not a repack: every call reads the blocks themselves.
 *
 * Arithmetic (the same for every M and thread count, so each output row is batch invariant, issue 28):
 *   - x rows are widened to fp32 (bf16 is exact in fp32);
 *   - W rows are dequantized to fp32 exactly as gguf-py's `dequantize` does (same operations, same order,
 *     no fused multiply-add: `chatserve_bmm_dequant` is checked bit for bit against the torch twin);
 *   - y[m, n] = one dot product over the whole of K: lane l of one vector accumulator takes k ≡ l mod VW in
 *     increasing k with FMA, then a fixed tree adds the lanes. Tiles of MR rows × NR columns only choose
 *     which accumulators live in registers together; no split of K, and threads split columns only.
 * Loop nest: rows in chunks of MC (their fp32 copy stays in L2); per chunk, threads take blocks of NR weight
 * rows, dequantize them once into a per-thread buffer and run every row of the chunk against them. For
 * M <= MC (decode) each weight is read once per call.
 *
 * One source, two ISA levels: cpu_blockmm.py prepends `#define BMM_LEVEL 2` (AVX2 + FMA + F16C, 8 lanes)
 * or `3` (AVX-512 F/BW/VL, 16 lanes) and builds each through cpu_build.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef BMM_LEVEL
#define BMM_LEVEL 0
#endif

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_XS = 23, BF16 = 30 };

int chatserve_bmm_level(void) { return BMM_LEVEL; }

#if BMM_LEVEL == 3
typedef __m512 vf;
#define VW 16
#define MR 4
#define NR 4
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float hsum(vf v) {          /* fixed tree: 16 → 8 → 4 → 2 → 1 */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
/* 16 int8 codes → 16 floats: q·d, q·d + m (kind 1) or q·d − m (kind 2), each rounded as numpy rounds */
static inline void emit16(float *o, __m128i q, float d, float m, int kind) {
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    if (kind == 1) v = _mm512_add_ps(v, _mm512_set1_ps(m));
    if (kind == 2) v = _mm512_sub_ps(v, _mm512_set1_ps(m));
    _mm512_storeu_ps(o, v);
}
#elif BMM_LEVEL == 2
typedef __m256 vf;
#define VW 8
#define MR 2
#define NR 4
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float hsum(vf v) {          /* fixed tree: 8 → 4 → 2 → 1 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
static inline void emit8(float *o, __m128i q, float d, float m, int kind) {
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    if (kind == 1) v = _mm256_add_ps(v, _mm256_set1_ps(m));
    if (kind == 2) v = _mm256_sub_ps(v, _mm256_set1_ps(m));
    _mm256_storeu_ps(o, v);
}
static inline void emit16(float *o, __m128i q, float d, float m, int kind) {
    emit8(o, q, d, m, kind);
    emit8(o + 8, _mm_srli_si128(q, 8), d, m, kind);
}
#endif

#if BMM_LEVEL
/* h2f, ld16, lo4, hi4, bits16, bit_j, scale_min_k4: block_bytes.h, written before this source */

/* ---- one block → fp32, per format (o: block_size floats) ---- */
static void dq_q4_0(const uint8_t *b, float *o) {
    const float d = h2f(b);
    const __m128i q = ld16(b + 2), e = _mm_set1_epi8(8);
    emit16(o, _mm_sub_epi8(lo4(q), e), d, 0.f, 0);
    emit16(o + 16, _mm_sub_epi8(hi4(q), e), d, 0.f, 0);
}
static void dq_q4_1(const uint8_t *b, float *o) {
    const float d = h2f(b), m = h2f(b + 2);
    const __m128i q = ld16(b + 4);
    emit16(o, lo4(q), d, m, 1);
    emit16(o + 16, hi4(q), d, m, 1);
}
static void dq_q5(const uint8_t *b, float *o, int with_min) {
    const float d = h2f(b), m = with_min ? h2f(b + 2) : 0.f;
    const uint8_t *p = b + (with_min ? 4 : 2);
    uint32_t qh; memcpy(&qh, p, 4);
    const __m128i q = ld16(p + 4), e = _mm_set1_epi8(with_min ? 0 : 16);
    emit16(o, _mm_sub_epi8(_mm_or_si128(lo4(q), bits16(qh & 0xFFFF, 0x10)), e), d, m, with_min);
    emit16(o + 16, _mm_sub_epi8(_mm_or_si128(hi4(q), bits16(qh >> 16, 0x10)), e), d, m, with_min);
}
static void dq_q8_0(const uint8_t *b, float *o) {
    const float d = h2f(b);
    emit16(o, ld16(b + 2), d, 0.f, 0);
    emit16(o + 16, ld16(b + 18), d, 0.f, 0);
}
/* Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 scale bytes */
static void dq_qk(const uint8_t *b, float *o, int five) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(s, j, &sc, &mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        for (int h = 0; h < 2; h++) {                /* the two 16-element halves of sub-block j */
            __m128i q = ld16(qs + 32 * (j / 2) + 16 * h);
            q = (j & 1) ? hi4(q) : lo4(q);
            if (five) q = _mm_or_si128(q, bit_j(ld16(qh + 16 * h), j));
            emit16(o + 32 * j + 16 * h, q, ds, dm, 2);
        }
    }
}
static void dq_q6_k(const uint8_t *b, float *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 8; c++) {
            const int e = 16 * c;
            __m128i l = ld16(ql + 64 * h + e % 64);
            l = e < 64 ? lo4(l) : hi4(l);
            __m128i u = _mm_srli_epi16(ld16(qh + 32 * h + e % 32), 2 * (e / 32));
            u = _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi8(3)), 4);
            const __m128i q = _mm_sub_epi8(_mm_or_si128(l, u), _mm_set1_epi8(32));
            emit16(o + 128 * h + e, q, d * (float)sc[8 * h + c], 0.f, 0);
        }
}
static void dq_iq4_xs(const uint8_t *b, float *o) {
    const __m128i kv = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const float d = h2f(b);
    uint16_t sh; memcpy(&sh, b + 2, 2);
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const __m128i q = ld16(b + 8 + 16 * j);
        emit16(o + 32 * j, _mm_shuffle_epi8(kv, lo4(q)), dl, 0.f, 0);
        emit16(o + 32 * j + 16, _mm_shuffle_epi8(kv, hi4(q)), dl, 0.f, 0);
    }
}

/* the blocks stream from memory: fetch ~1 KiB ahead of the one being decoded */
#define PF(p) __builtin_prefetch((p) + 1024)

/* one row of W (k elements) → fp32 out[k] */
static int dequant_row(int fmt, const uint8_t *row, int64_t k, float *out) {
    switch (fmt) {
    case F32: memcpy(out, row, 4 * (size_t)k); return 0;
    case F16: for (int64_t i = 0; i < k; i++) out[i] = h2f(row + 2 * i); return 0;
    case BF16:
        for (int64_t i = 0; i < k; i++) {
            uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
            memcpy(out + i, &u, 4);
        }
        return 0;
    case Q4_0: for (int64_t i = 0; i < k / 32; i++) { PF(row + 18 * i); dq_q4_0(row + 18 * i, out + 32 * i); } return 0;
    case Q4_1: for (int64_t i = 0; i < k / 32; i++) { PF(row + 20 * i); dq_q4_1(row + 20 * i, out + 32 * i); } return 0;
    case Q5_0: for (int64_t i = 0; i < k / 32; i++) { PF(row + 22 * i); dq_q5(row + 22 * i, out + 32 * i, 0); } return 0;
    case Q5_1: for (int64_t i = 0; i < k / 32; i++) { PF(row + 24 * i); dq_q5(row + 24 * i, out + 32 * i, 1); } return 0;
    case Q8_0: for (int64_t i = 0; i < k / 32; i++) { PF(row + 34 * i); dq_q8_0(row + 34 * i, out + 32 * i); } return 0;
    case Q4_K: for (int64_t i = 0; i < k / 256; i++) { PF(row + 144 * i); dq_qk(row + 144 * i, out + 256 * i, 0); } return 0;
    case Q5_K: for (int64_t i = 0; i < k / 256; i++) { PF(row + 176 * i); dq_qk(row + 176 * i, out + 256 * i, 1); } return 0;
    case Q6_K: for (int64_t i = 0; i < k / 256; i++) { PF(row + 210 * i); dq_q6_k(row + 210 * i, out + 256 * i); } return 0;
    case IQ4_XS: for (int64_t i = 0; i < k / 256; i++) { PF(row + 136 * i); dq_iq4_xs(row + 136 * i, out + 256 * i); } return 0;
    default: return 1;
    }
}

/* W [n, k] (rows of row_bytes) → out [n, k] fp32: the kernel's dequantization, for the bit-exact tests */
int chatserve_bmm_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *out) {
    for (int64_t r = 0; r < n; r++)
        if (dequant_row(fmt, w + r * row_bytes, k, out + r * k)) return 1;
    return 0;
}

static inline uint16_t f2bf(float f) {          /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* mr × nr dot products over kp (a multiple of VW): x rows at stride ldx, W rows at stride kp */
static inline __attribute__((always_inline)) void tile(int mr, int nr, const float *x, int64_t ldx,
                                                       const float *w, int64_t kp, float *res) {
    vf acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = vzero();
    for (int64_t k = 0; k < kp; k += VW) {
        vf wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = vload(w + j * kp + k);
        for (int i = 0; i < mr; i++) {
            const vf xv = vload(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) res[i * NR + j] = hsum(acc[i][j]);
}

#define TILE_CASE(a, b) case (a) * 8 + (b): tile(a, b, x, ldx, w, kp, res); break;
static void tile_any(int mr, int nr, const float *x, int64_t ldx, const float *w, int64_t kp, float *res) {
    switch (mr * 8 + nr) {
    TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
    TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
#if MR == 4
    TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
    TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
#endif
    }
}

static void store_res(const float *res, int mr, int nr, void *y, int y_bf16, int64_t ldy, int64_t m0, int64_t n0) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            const int64_t off = (m0 + i) * ldy + n0 + j;
            if (y_bf16) ((uint16_t *)y)[off] = f2bf(res[i * NR + j]);
            else ((float *)y)[off] = res[i * NR + j];
        }
}

/* x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] at row stride ldy (bf16 when y_bf16, else fp32): y may be
 * a column slice of a wider output (fused q/k/v or gate/up kept as separate tensors). 0 on success. */
int chatserve_bmm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, void *y, int64_t ldy, int y_bf16, int nt) {
    const int64_t kp = (k + VW - 1) / VW * VW;
    int64_t mc = (512 << 10) / (4 * kp) / MR * MR;          /* rows whose fp32 copy fits in ~512 KiB */
    mc = mc < MR ? MR : mc > 64 ? 64 : mc;
    if (nt < 1) nt = 1;
    float *xb = aligned_alloc(64, sizeof(float) * (size_t)(mc * kp));
    float *wb = aligned_alloc(64, sizeof(float) * (size_t)(nt * NR * kp));
    if (!xb || !wb) { free(xb); free(wb); return 2; }
    memset(wb, 0, sizeof(float) * (size_t)(nt * NR * kp));   /* zero tails past k stay zero */
    const int64_t nblocks = (n + NR - 1) / NR;
    int bad = 0;
    for (int64_t m0 = 0; m0 < m && !bad; m0 += mc) {
        const int64_t rows = m - m0 < mc ? m - m0 : mc;
        for (int64_t i = 0; i < rows; i++) {
            float *dst = xb + i * kp;
            if (x_bf16) {
                const uint16_t *src = (const uint16_t *)x + (m0 + i) * k;
                for (int64_t c = 0; c < k; c++) { uint32_t u = (uint32_t)src[c] << 16; memcpy(dst + c, &u, 4); }
            } else memcpy(dst, (const float *)x + (m0 + i) * k, sizeof(float) * (size_t)k);
            memset(dst + k, 0, sizeof(float) * (size_t)(kp - k));
        }
        #pragma omp parallel for num_threads(nt) schedule(static) reduction(|: bad)
        for (int64_t nb = 0; nb < nblocks; nb++) {
#ifdef _OPENMP
            float *wt = wb + omp_get_thread_num() * NR * kp;
#else
            float *wt = wb;
#endif
            const int64_t n0 = nb * NR;
            const int nr = n - n0 < NR ? (int)(n - n0) : NR;
            for (int j = 0; j < nr; j++) bad |= dequant_row(fmt, w + (n0 + j) * row_bytes, k, wt + j * kp);
            float res[MR * NR];
            for (int64_t i = 0; i < rows; i += MR) {
                const int mr = rows - i < MR ? (int)(rows - i) : MR;
                tile_any(mr, nr, xb + i * kp, kp, wt, kp, res);
                store_res(res, mr, nr, y, y_bf16, ldy, m0 + i, n0);
            }
        }
    }
    free(xb);
    free(wb);
    return bad ? 1 : 0;
}
#else
int chatserve_bmm_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *out) { return 3; }
int chatserve_bmm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, void *y, int64_t ldy, int y_bf16, int nt) { return 3; }
#endif
