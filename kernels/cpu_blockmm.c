/* Matmul on GGUF block-format weights, in place: y[M, N] = x[M, K] · Wᵀ with W [N, K] stored as the file
 * stores it (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; the layouts are
 * described in block_formats.py). Not a repack: every call reads the blocks themselves.
 *
 * Arithmetic (the same for every M and thread count, so each output row is batch invariant, issue 28):
 *   - x rows are widened to fp32 (bf16 is exact in fp32);
 *   - W rows are dequantized to fp32 exactly as gguf-py's `dequantize` does (same operations, same order,
 *     no fused multiply-add: `chatserve_bmm_dequant` is checked bit for bit against the torch twin);
 *   - AVX2 (level 2): y[m, n] is one FMA chain over k = 0, 1, …, K − 1 from +0, in one vector lane (the
 *     broadcast microkernel below: x[m][k] broadcast, 8 columns of W per vector);
 *   - AVX-512 (level 3): y[m, n] = one dot product over the whole of K: lane l of one vector accumulator takes
 *     k ≡ l mod VW in increasing k with FMA, then a fixed tree adds the lanes. Tiles of MR rows × NR columns
 *     only choose which accumulators live in registers together.
 *   Neither splits K in a way that depends on M, and threads split columns only.
 * Loop nests: AVX2, see chatserve_bmm's level-2 comment (each weight dequantized once per call). AVX-512:
 * rows in chunks of MC (their fp32 copy stays in L2); per chunk, threads take blocks of NR weight rows,
 * dequantize them once into a per-thread buffer and run every row of the chunk against them. For M <= MC
 * (decode) each weight is read once per call.
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
#if !(BMM_LEVEL == 3 && defined(__AMX_TILE__) && defined(__AMX_BF16__))
int chatserve_bmm_amx(int want) { return 0; }    /* no AMX-BF16 in this build: the dot-product path only */
#endif

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
/* 16 int8 codes → 16 floats: q·d, q·d + m (kind 1) or q·d − m (kind 2), each rounded as numpy rounds; stored
 * as fp32 at o, or where hb is given (the AMX path) rounded once more to bf16 at hb */
static inline __attribute__((always_inline)) void emit16(float *o, uint16_t *hb, __m128i q, float d, float m, int kind) {
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    if (kind == 1) v = _mm512_add_ps(v, _mm512_set1_ps(m));
    if (kind == 2) v = _mm512_sub_ps(v, _mm512_set1_ps(m));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (hb) { _mm256_storeu_si256((__m256i *)hb, (__m256i)_mm512_cvtneps_pbh(v)); return; }
#endif
    _mm512_storeu_ps(o, v);
}
#elif BMM_LEVEL == 2
static inline void emit8(float *o, __m128i q, float d, float m, int kind) {
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    if (kind == 1) v = _mm256_add_ps(v, _mm256_set1_ps(m));
    if (kind == 2) v = _mm256_sub_ps(v, _mm256_set1_ps(m));
    _mm256_storeu_ps(o, v);
}
static inline void emit16(float *o, uint16_t *hb, __m128i q, float d, float m, int kind) {
    (void)hb;           /* bf16 output is the AVX-512 level's (AMX path) */
    emit8(o, q, d, m, kind);
    emit8(o + 8, _mm_srli_si128(q, 8), d, m, kind);
}
#endif

#if BMM_LEVEL
/* h2f, ld16, lo4, hi4, bits16, bit_j, scale_min_k4: block_bytes.h, written before this source */

/* ---- one block → fp32, per format (o: block_size floats; or bf16 at hb where hb is given) ---- */
#define AT(e) (hb ? (e) : NULL)       /* hb + offset, where there is an hb */
static inline __attribute__((always_inline)) void dq_q4_0(const uint8_t *b, float *o, uint16_t *hb) {
    const float d = h2f(b);
    const __m128i q = ld16(b + 2), e = _mm_set1_epi8(8);
    emit16(o, hb, _mm_sub_epi8(lo4(q), e), d, 0.f, 0);
    emit16(o + 16, AT(hb + 16), _mm_sub_epi8(hi4(q), e), d, 0.f, 0);
}
static inline __attribute__((always_inline)) void dq_q4_1(const uint8_t *b, float *o, uint16_t *hb) {
    const float d = h2f(b), m = h2f(b + 2);
    const __m128i q = ld16(b + 4);
    emit16(o, hb, lo4(q), d, m, 1);
    emit16(o + 16, AT(hb + 16), hi4(q), d, m, 1);
}
static inline __attribute__((always_inline)) void dq_q5(const uint8_t *b, float *o, uint16_t *hb, int with_min) {
    const float d = h2f(b), m = with_min ? h2f(b + 2) : 0.f;
    const uint8_t *p = b + (with_min ? 4 : 2);
    uint32_t qh; memcpy(&qh, p, 4);
    const __m128i q = ld16(p + 4), e = _mm_set1_epi8(with_min ? 0 : 16);
    emit16(o, hb, _mm_sub_epi8(_mm_or_si128(lo4(q), bits16(qh & 0xFFFF, 0x10)), e), d, m, with_min);
    emit16(o + 16, AT(hb + 16), _mm_sub_epi8(_mm_or_si128(hi4(q), bits16(qh >> 16, 0x10)), e), d, m, with_min);
}
static inline __attribute__((always_inline)) void dq_q8_0(const uint8_t *b, float *o, uint16_t *hb) {
    const float d = h2f(b);
    emit16(o, hb, ld16(b + 2), d, 0.f, 0);
    emit16(o + 16, AT(hb + 16), ld16(b + 18), d, 0.f, 0);
}
/* Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 scale bytes */
static inline __attribute__((always_inline)) void dq_qk(const uint8_t *b, float *o, uint16_t *hb, int five) {
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
            emit16(o + 32 * j + 16 * h, AT(hb + 32 * j + 16 * h), q, ds, dm, 2);
        }
    }
}
static inline __attribute__((always_inline)) void dq_q6_k(const uint8_t *b, float *o, uint16_t *hb) {
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
            emit16(o + 128 * h + e, AT(hb + 128 * h + e), q, d * (float)sc[8 * h + c], 0.f, 0);
        }
}
static inline __attribute__((always_inline)) void dq_iq4_xs(const uint8_t *b, float *o, uint16_t *hb) {
    const __m128i kv = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const float d = h2f(b);
    uint16_t sh; memcpy(&sh, b + 2, 2);
    for (int j = 0; j < 8; j++) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const __m128i q = ld16(b + 8 + 16 * j);
        emit16(o + 32 * j, AT(hb + 32 * j), _mm_shuffle_epi8(kv, lo4(q)), dl, 0.f, 0);
        emit16(o + 32 * j + 16, AT(hb + 32 * j + 16), _mm_shuffle_epi8(kv, hi4(q)), dl, 0.f, 0);
    }
}

/* ---- a tiled source (cpu_blockq8's row-interleaved layout, chatserve_bq8_tile): prompt rows read the decode
 * rows' copy instead of the file. fmt | TILED; row_bytes is one tile's bytes (tiled_at(fmt, k / 32)), and
 * a row's address is its tile's + its lane (row_at: tile bases are 16-byte aligned, chatserve_bmm checks). Each
 * block of 32 gathers the row's codes (4 bytes from each 64-byte chunk) and scales and emits them as the file's
 * dq_* do, same operations in the same order, so a tiled source gives the file's values bit for bit:
 * Q4_K and Q6_K keep the file's d (and dmin) and their 6-bit sc (and min) / int8 sc, products formed as dq_qk
 * and dq_q6_k form them. ---- */
#define TILED 0x100
/* bytes of one (tile, block of 32) in cpu_blockq8's tiled layout: Q4_K's without its super-block's d and dmin */
static inline int64_t tiled_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 288; case Q4_1: return 320; case Q8_0: return 544; case Q4_K: return 288; case Q6_K: return 448;
    default: return 0;
    }
}
/* Q4_K: a tile's super-block (8 blocks, then the 16 rows' fp16 d and dmin at K4_DM) */
#define K4_SUPER 2368
#define K4_DM 2304
/* offset of block j in a tile */
static inline int64_t tiled_at(int fmt, int64_t j) { return j * tiled_bytes(fmt) + (fmt == Q4_K ? (j >> 3) * 64 : 0); }
static inline const uint8_t *row_at(int fmt, const uint8_t *w, int64_t row_bytes, int64_t r) {
    return fmt & TILED ? w + (r >> 4) * row_bytes + (r & 15) : w + r * row_bytes;
}
/* a tiled source's tile bases must be 16-byte aligned (row_at keeps the lane in the low bits) */
static inline int bad_source(int fmt, const uint8_t *w, int64_t row_bytes) {
    return (fmt & TILED) && (((uintptr_t)w & 15) || (row_bytes & 15));
}
/* 16 bytes from chunks c0 … c0 + 3 of a (tile, block): byte 4c + i = chunk c0 + c's byte 4·lane + i */
static inline __m128i gather4(const uint8_t *o, int lane, int c0) {
    int32_t v[4];
    for (int c = 0; c < 4; c++) memcpy(v + c, o + 64 * (c0 + c) + 4 * lane, 4);
    return _mm_loadu_si128((const __m128i *)v);
}
/* block j (32 elements) of lane `lane` of a tile at t → o (fp32, or bf16 at hb) */
static inline __attribute__((always_inline)) void dq_tiled(int fmt, const uint8_t *t, int lane, int64_t j, float *o,
                                                           uint16_t *hb) {
    const uint8_t *b = t + tiled_at(fmt, j);
    switch (fmt) {
    case Q4_0: case Q4_1: {
        const __m128i q = gather4(b, lane, 0);
        const float d = h2f(b + 256 + 2 * lane), m = fmt == Q4_1 ? h2f(b + 288 + 2 * lane) : 0.f;
        const __m128i e = _mm_set1_epi8(fmt == Q4_0 ? 8 : 0);
        emit16(o, hb, _mm_sub_epi8(lo4(q), e), d, m, fmt == Q4_1);
        emit16(o + 16, AT(hb + 16), _mm_sub_epi8(hi4(q), e), d, m, fmt == Q4_1);
        break;
    }
    case Q8_0: {
        const float d = h2f(b + 512 + 2 * lane);
        emit16(o, hb, gather4(b, lane, 0), d, 0.f, 0);
        emit16(o + 16, AT(hb + 16), gather4(b, lane, 4), d, 0.f, 0);
        break;
    }
    case Q4_K: {
        const __m128i q = gather4(b, lane, 0);
        const uint8_t *dm = t + (j >> 3) * K4_SUPER + K4_DM;
        const float ds = h2f(dm + 2 * lane) * (float)b[256 + lane];          /* d · sc, dmin · min as dq_qk */
        const float m = h2f(dm + 32 + 2 * lane) * (float)b[272 + lane];
        emit16(o, hb, lo4(q), ds, m, 2);
        emit16(o + 16, AT(hb + 16), hi4(q), ds, m, 2);
        break;
    }
    case Q6_K: {
        const __m128i q = gather4(b, lane, 0), three = _mm_set1_epi8(3), z = _mm_set1_epi8(32);
        const __m128i shift = _mm_setr_epi32(0, 2, 4, 6);
        int32_t h0, h1;
        memcpy(&h0, b + 256 + 4 * lane, 4);
        memcpy(&h1, b + 320 + 4 * lane, 4);
        /* element 4c + i's 2 high bits: bits 2c, 2c + 1 of byte i (dword lane c shifted by 2c, bytes masked) */
        const __m128i u0 = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h0), shift), three);
        const __m128i u1 = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h1), shift), three);
        const float d = h2f(b + 384 + 2 * lane);
        const int8_t *sc = (const int8_t *)(b + 416);
        emit16(o, hb, _mm_sub_epi8(_mm_or_si128(lo4(q), _mm_slli_epi16(u0, 4)), z), d * (float)sc[lane], 0.f, 0);
        emit16(o + 16, AT(hb + 16), _mm_sub_epi8(_mm_or_si128(hi4(q), _mm_slli_epi16(u1, 4)), z),
               d * (float)sc[16 + lane], 0.f, 0);
        break;
    }
    }
}

/* elements [k0, k1) of one row of W → fp32 out[k1 - k0]; k0 on a block boundary, k1 too unless it is the
 * row's end (a whole number of blocks either way: the row length is one). Prefetch: a line 1 KiB ahead of
 * each block, or with next_span every line of the block as far ahead as the span is long (where a
 * span-by-span caller reads this row next; the rows interleave, so no hardware stream covers them) */
static inline __attribute__((always_inline)) int dequant_span_to(int fmt, const uint8_t *row, int64_t k0, int64_t k1,
                                                                  float *out, uint16_t *hb, int next_span) {
#define BLOCKS(bs, bytes, call) { \
    const int64_t ahead = next_span ? (k1 - k0) / (bs) * (bytes) : 1024; \
    for (int64_t i = k0 / (bs); i < k1 / (bs); i++) { \
        const uint8_t *b = row + (bytes) * i; \
        __builtin_prefetch(b + ahead); \
        if (next_span) for (int o = 64; o < (bytes) + 63; o += 64) __builtin_prefetch(b + ahead + o); \
        call; } return 0; }
    if (fmt & TILED) {
        const int lane = (int)((uintptr_t)row & 15);
        const uint8_t *t = row - lane;
        switch (fmt & ~TILED) {
        case Q4_0: case Q4_1: case Q8_0: case Q4_K: case Q6_K: break;
        default: return 1;
        }
        for (int64_t i = k0 / 32; i < k1 / 32; i++) dq_tiled(fmt & ~TILED, t, lane, i, out + (32 * i - k0),
                                                             AT(hb + (32 * i - k0)));
        return 0;
    }
    switch (fmt) {
    case F32: memcpy(out, row + 4 * k0, 4 * (size_t)(k1 - k0)); return 0;
    case F16: for (int64_t i = k0; i < k1; i++) out[i - k0] = h2f(row + 2 * i); return 0;
    case BF16:
        for (int64_t i = k0; i < k1; i++) {
            uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
            memcpy(out + (i - k0), &u, 4);
        }
        return 0;
    case Q4_0: BLOCKS(32, 18, dq_q4_0(b, out + (32 * i - k0), AT(hb + (32 * i - k0))))
    case Q4_1: BLOCKS(32, 20, dq_q4_1(b, out + (32 * i - k0), AT(hb + (32 * i - k0))))
    case Q5_0: BLOCKS(32, 22, dq_q5(b, out + (32 * i - k0), AT(hb + (32 * i - k0)), 0))
    case Q5_1: BLOCKS(32, 24, dq_q5(b, out + (32 * i - k0), AT(hb + (32 * i - k0)), 1))
    case Q8_0: BLOCKS(32, 34, dq_q8_0(b, out + (32 * i - k0), AT(hb + (32 * i - k0))))
    case Q4_K: BLOCKS(256, 144, dq_qk(b, out + (256 * i - k0), AT(hb + (256 * i - k0)), 0))
    case Q5_K: BLOCKS(256, 176, dq_qk(b, out + (256 * i - k0), AT(hb + (256 * i - k0)), 1))
    case Q6_K: BLOCKS(256, 210, dq_q6_k(b, out + (256 * i - k0), AT(hb + (256 * i - k0))))
    case IQ4_XS: BLOCKS(256, 136, dq_iq4_xs(b, out + (256 * i - k0), AT(hb + (256 * i - k0))))
    default: return 1;
    }
#undef BLOCKS
}

static int dequant_span(int fmt, const uint8_t *row, int64_t k0, int64_t k1, float *out, int next_span) {
    return dequant_span_to(fmt, row, k0, k1, out, NULL, next_span);
}

#if BMM_LEVEL == 3
/* a block format's row → bf16 at hb (the fp32 value rounded to nearest even; k a whole number of blocks);
 * fb: scratch the F32/F16/BF16 cases would write, unused here */
static int dequant_row_bf16(int fmt, const uint8_t *row, int64_t k, float *fb, uint16_t *hb) {
    return dequant_span_to(fmt, row, 0, k, fb, hb, 0);
}
#endif

/* one row of W (k elements) → fp32 out[k] */
static int dequant_row(int fmt, const uint8_t *row, int64_t k, float *out) { return dequant_span(fmt, row, 0, k, out, 0); }

/* W [n, k] (rows of row_bytes) → out [n, k] fp32: the kernel's dequantization, for the bit-exact tests */
int chatserve_bmm_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *out) {
    if (bad_source(fmt, w, row_bytes)) return 1;
    for (int64_t r = 0; r < n; r++)
        if (dequant_row(fmt, row_at(fmt, w, row_bytes, r), k, out + r * k)) return 1;
    return 0;
}

static inline uint16_t f2bf(float f) {          /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if BMM_LEVEL == 2
/* ---- AVX2: broadcast microkernel on k-major panels ----
 * A panel is NP = 16 weight rows (two ymm of output columns) × a span of k, dequantized once per call and
 * stored k-major: panel[k][j] = W[n0 + j][k]. The microkernel holds an MB × 16 tile of y in 12 ymm
 * accumulators; per k it broadcasts x[i][k] of each of its MB rows and FMAs it against the panel's two
 * vectors at k. Output (i, n0 + j) lives in lane j % 8 of one accumulator and takes k = 0, 1, …, K − 1 in
 * that order, one FMA each, from +0: the value does not depend on M, on the tile or row block it falls in,
 * on the threads, or on KC (a span's partial sums go through memory in fp32 and come back exactly).
 * Loop nest: threads take groups of GP panels (columns only); per group and span of KC k's, the panels are
 * dequantized once (rows → a row buffer → transposed), then every row of x runs against them in blocks of
 * MC rows (their span of x stays in L2; bf16 rows are widened per block), the panel being swept stays in L1. */
#define NP 16
#define MB 6
#ifndef KC
#define KC 256            /* a multiple of every block size (32, 256) */
#endif
#ifndef MC
#define MC 120            /* a multiple of MB */
#endif
#ifndef GPMAX
#define GPMAX 8
#endif

/* rows [16][kc] (row stride kc) → panel [kc][16] */
static void transpose16(const float *rows, int kc, float *panel) {
    int k = 0;
    for (; k + 8 <= kc; k += 8)
        for (int h = 0; h < 2; h++) {
            const float *r = rows + 8 * h * kc + k;
            __m256 a0 = _mm256_loadu_ps(r), a1 = _mm256_loadu_ps(r + kc), a2 = _mm256_loadu_ps(r + 2 * kc),
                   a3 = _mm256_loadu_ps(r + 3 * kc), a4 = _mm256_loadu_ps(r + 4 * kc),
                   a5 = _mm256_loadu_ps(r + 5 * kc), a6 = _mm256_loadu_ps(r + 6 * kc),
                   a7 = _mm256_loadu_ps(r + 7 * kc);
            __m256 b0 = _mm256_unpacklo_ps(a0, a1), b1 = _mm256_unpackhi_ps(a0, a1);
            __m256 b2 = _mm256_unpacklo_ps(a2, a3), b3 = _mm256_unpackhi_ps(a2, a3);
            __m256 b4 = _mm256_unpacklo_ps(a4, a5), b5 = _mm256_unpackhi_ps(a4, a5);
            __m256 b6 = _mm256_unpacklo_ps(a6, a7), b7 = _mm256_unpackhi_ps(a6, a7);
            __m256 c0 = _mm256_shuffle_ps(b0, b2, 0x44), c1 = _mm256_shuffle_ps(b0, b2, 0xEE);
            __m256 c2 = _mm256_shuffle_ps(b1, b3, 0x44), c3 = _mm256_shuffle_ps(b1, b3, 0xEE);
            __m256 c4 = _mm256_shuffle_ps(b4, b6, 0x44), c5 = _mm256_shuffle_ps(b4, b6, 0xEE);
            __m256 c6 = _mm256_shuffle_ps(b5, b7, 0x44), c7 = _mm256_shuffle_ps(b5, b7, 0xEE);
            float *o = panel + NP * k + 8 * h;
            _mm256_storeu_ps(o + 0 * NP, _mm256_permute2f128_ps(c0, c4, 0x20));
            _mm256_storeu_ps(o + 1 * NP, _mm256_permute2f128_ps(c1, c5, 0x20));
            _mm256_storeu_ps(o + 2 * NP, _mm256_permute2f128_ps(c2, c6, 0x20));
            _mm256_storeu_ps(o + 3 * NP, _mm256_permute2f128_ps(c3, c7, 0x20));
            _mm256_storeu_ps(o + 4 * NP, _mm256_permute2f128_ps(c0, c4, 0x31));
            _mm256_storeu_ps(o + 5 * NP, _mm256_permute2f128_ps(c1, c5, 0x31));
            _mm256_storeu_ps(o + 6 * NP, _mm256_permute2f128_ps(c2, c6, 0x31));
            _mm256_storeu_ps(o + 7 * NP, _mm256_permute2f128_ps(c3, c7, 0x31));
        }
    for (; k < kc; k++)
        for (int j = 0; j < NP; j++) panel[NP * k + j] = rows[j * kc + k];
}

/* mr (<= MB) rows × 16 columns over kc k's: x rows at stride ldx, the panel k-major; the partial sums come
 * from c (row stride ldc) unless first, and go back to c. Named accumulators, not an array: gcc keeps an
 * array of vectors on the stack and stores it every k. */
#define ACC_IN(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = a##i##0; \
    if (mr > i && !first) { a##i##0 = _mm256_loadu_ps(c + i * ldc); a##i##1 = _mm256_loadu_ps(c + i * ldc + 8); }
#define ACC_FMA(i) if (mr > i) { const __m256 b = _mm256_broadcast_ss(x + i * ldx + k); \
    a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1); }
#define ACC_OUT(i) if (mr > i) { _mm256_storeu_ps(c + i * ldc, a##i##0); _mm256_storeu_ps(c + i * ldc + 8, a##i##1); }
static inline __attribute__((always_inline)) void micro(int mr, const float *x, int64_t ldx, const float *p,
                                                        int kc, float *c, int64_t ldc, int first) {
    ACC_IN(0) ACC_IN(1) ACC_IN(2) ACC_IN(3) ACC_IN(4) ACC_IN(5)
    for (int k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(p + NP * k), w1 = _mm256_load_ps(p + NP * k + 8);
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5)
    }
    ACC_OUT(0) ACC_OUT(1) ACC_OUT(2) ACC_OUT(3) ACC_OUT(4) ACC_OUT(5)
}

/* the same arithmetic for 1 or 2 rows against np (<= 4) panels at once (panel q at p + q * ps, its tile of
 * partial sums at c + q * NP): with one panel their 2 or 4 chains would wait on the FMA latency */
#define WIN(i, q) __m256 a##i##q##0 = _mm256_setzero_ps(), a##i##q##1 = a##i##q##0; \
    if (mr > i && np > q && !first) { a##i##q##0 = _mm256_loadu_ps(c + i * ldc + q * NP); \
                                      a##i##q##1 = _mm256_loadu_ps(c + i * ldc + q * NP + 8); }
#define WFMA(q) if (np > q) { const __m256 v0 = _mm256_load_ps(p + q * ps + NP * k), \
                                           v1 = _mm256_load_ps(p + q * ps + NP * k + 8); \
    a0##q##0 = _mm256_fmadd_ps(b0, v0, a0##q##0); a0##q##1 = _mm256_fmadd_ps(b0, v1, a0##q##1); \
    if (mr > 1) { a1##q##0 = _mm256_fmadd_ps(b1, v0, a1##q##0); a1##q##1 = _mm256_fmadd_ps(b1, v1, a1##q##1); } }
#define WOUT(i, q) if (mr > i && np > q) { _mm256_storeu_ps(c + i * ldc + q * NP, a##i##q##0); \
                                           _mm256_storeu_ps(c + i * ldc + q * NP + 8, a##i##q##1); }
static inline __attribute__((always_inline)) void micro_wide(int mr, int np, const float *x, int64_t ldx,
                                                             const float *p, int64_t ps, int kc, float *c,
                                                             int64_t ldc, int first) {
    WIN(0, 0) WIN(0, 1) WIN(0, 2) WIN(0, 3) WIN(1, 0) WIN(1, 1) WIN(1, 2) WIN(1, 3)
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_broadcast_ss(x + k), b1 = mr > 1 ? _mm256_broadcast_ss(x + ldx + k) : b0;
        WFMA(0) WFMA(1) WFMA(2) WFMA(3)
    }
    WOUT(0, 0) WOUT(0, 1) WOUT(0, 2) WOUT(0, 3) WOUT(1, 0) WOUT(1, 1) WOUT(1, 2) WOUT(1, 3)
}

/* mr rows against np panels: the 6-row kernel panel by panel, or the wide one for 1 or 2 rows */
#define MICRO_CASE(r) case r: for (int q = 0; q < np; q++) micro(r, x, ldx, p + q * ps, kc, c + q * NP, ldc, first); break;
#define WIDE_CASE(r, n) case 8 * (r) + (n): micro_wide(r, n, x, ldx, p, ps, kc, c, ldc, first); break;
static void micro_any(int mr, int np, const float *x, int64_t ldx, const float *p, int64_t ps, int kc, float *c,
                      int64_t ldc, int first) {
    if (mr <= 2) {
        switch (8 * mr + np) {
        WIDE_CASE(1, 1) WIDE_CASE(1, 2) WIDE_CASE(1, 3) WIDE_CASE(1, 4)
        WIDE_CASE(2, 1) WIDE_CASE(2, 2) WIDE_CASE(2, 3) WIDE_CASE(2, 4)
        }
        return;
    }
    switch (mr) { MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6) }
}

/* mr rows × nr columns of finished sums (row stride ldc) → y at (m0, n0) */
static void store_rows(const float *c, int64_t ldc, int mr, int64_t nr, void *y, int y_bf16, int64_t ldy,
                       int64_t m0, int64_t n0) {
    for (int r = 0; r < mr; r++) {
        const int64_t off = (m0 + r) * ldy + n0;
        if (y_bf16) for (int64_t j = 0; j < nr; j++) ((uint16_t *)y)[off + j] = f2bf(c[r * ldc + j]);
        else memcpy((float *)y + off, c + r * ldc, sizeof(float) * (size_t)nr);
    }
}

/* x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] at row stride ldy (bf16 when y_bf16, else fp32): y may be
 * a column slice of a wider output (fused q/k/v or gate/up kept as separate tensors). 0 on success. */
int chatserve_bmm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, void *y, int64_t ldy, int y_bf16, int nt) {
    if (bad_source(fmt, w, row_bytes)) return 1;
    if (nt < 1) nt = 1;
    const int64_t npanels = (n + NP - 1) / NP;
    /* groups of at most GPMAX panels, as many per thread (36 panels on 2 threads: 6 groups of 6, not 8,8,8,8,4) */
    int64_t ngroups = (npanels + GPMAX - 1) / GPMAX;
    ngroups = (ngroups + nt - 1) / nt * nt;
    const int64_t gp = (npanels + ngroups - 1) / ngroups, nc = gp * NP;
    ngroups = (npanels + gp - 1) / gp;
    const int kc_max = k < KC ? (int)k : KC;
    const int spans = (int)((k + KC - 1) / KC);
    const int64_t mc = m < MC ? m : MC;
    /* per thread: the group's panels, a row buffer, bf16 x widened, partial sums of every row (spans > 1) */
    const size_t per = (size_t)(gp * NP * kc_max) + (size_t)(NP * kc_max) + (size_t)(mc * kc_max)
                       + (size_t)((spans > 1 ? m : MB) * nc);
    const size_t per_al = (per + 15) / 16 * 16;
    float *buf = aligned_alloc(64, sizeof(float) * per_al * (size_t)nt);
    if (!buf) return 2;
    int bad = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|: bad)
    for (int64_t g = 0; g < ngroups; g++) {
#ifdef _OPENMP
        float *tb = buf + per_al * (size_t)omp_get_thread_num();
#else
        float *tb = buf;
#endif
        float *panels = tb, *rows = panels + gp * NP * kc_max, *xw = rows + NP * kc_max;
        float *part = xw + mc * kc_max;
        const int64_t p0 = g * gp, gpn = npanels - p0 < gp ? npanels - p0 : gp;
        for (int64_t k0 = 0; k0 < k && !bad; k0 += KC) {
            const int kc = k - k0 < KC ? (int)(k - k0) : KC;
            const int first = k0 == 0, last = k0 + kc == k;
            for (int64_t q = 0; q < gpn; q++) {                /* dequantize the group's span of W */
                const int64_t n0 = (p0 + q) * NP;
                if (first)      /* the next panel's rows start cold: fetch their first span (kc / k of a row) */
                    for (int64_t j = n0 + NP; j < n0 + 2 * NP && j < (p0 + gpn) * NP && j < n; j++)
                        for (int64_t o = 0; o < row_bytes * kc / k; o += 64) __builtin_prefetch(row_at(fmt, w, row_bytes, j) + o);
                for (int j = 0; j < NP; j++) {
                    if (n0 + j < n) bad |= dequant_span(fmt, row_at(fmt, w, row_bytes, n0 + j), k0, k0 + kc, rows + j * kc, 1);
                    else memset(rows + j * kc, 0, sizeof(float) * (size_t)kc);
                }
                transpose16(rows, kc, panels + q * NP * kc);
            }
            /* rows i.. (mr of them) of this block against panels q.. (np of them), stored to y on the last span;
             * partial sums: rows of this group's columns (several spans) or one row block's tile */
#define tile_rows(mr, np, i, q) do { \
    float *c_ = (spans > 1 ? part + (m0 + (i)) * nc : part) + (q) * NP; \
    micro_any(mr, np, xs + (i) * ldx, ldx, panels + (q) * NP * kc, NP * kc, kc, c_, nc, first); \
    if (last) store_rows(c_, nc, mr, n - (p0 + (q)) * NP < (np) * NP ? n - (p0 + (q)) * NP : (np) * NP, \
                         y, y_bf16, ldy, m0 + (i), (p0 + (q)) * NP); } while (0)
            for (int64_t m0 = 0; m0 < m; m0 += MC) {
                const int64_t mr_all = m - m0 < MC ? m - m0 : MC;
                /* this block's span of x, widened from bf16 or copied: rows K apart would share cache sets */
                for (int64_t i = 0; i < mr_all; i++) {
                    if (x_bf16) {
                        const uint16_t *src = (const uint16_t *)x + (m0 + i) * k + k0;
                        for (int c = 0; c < kc; c++) { uint32_t u = (uint32_t)src[c] << 16; memcpy(xw + i * kc + c, &u, 4); }
                    } else memcpy(xw + i * kc, (const float *)x + (m0 + i) * k + k0, sizeof(float) * (size_t)kc);
                }
                const float *xs = xw;
                const int64_t ldx = kc;
                /* full 6-row tiles panel by panel (the panel stays in L1), then the last 1-5 rows against
                 * 4 (1 row), 2 (2 rows) or 1 panel at a time */
                const int64_t full = mr_all / MB * MB;
                for (int64_t q = 0; q < gpn; q++)
                    for (int64_t i = 0; i < full; i += MB)
                        tile_rows(MB, 1, i, q);
                if (full < mr_all) {
                    const int rest = (int)(mr_all - full), np = rest == 1 ? 4 : rest == 2 ? 2 : 1;
                    for (int64_t q = 0; q < gpn; q += np)
                        tile_rows(rest, gpn - q < np ? (int)(gpn - q) : np, full, q);
                }
            }
#undef tile_rows
        }
    }
    free(buf);
    return bad ? 1 : 0;
}
#else
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

/* the fp32 dot-product path: x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] */
static int bmm_dots(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
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
            for (int j = 0; j < nr; j++) bad |= dequant_row(fmt, row_at(fmt, w, row_bytes, n0 + j), k, wt + j * kp);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- AMX-BF16 (bf16 x, where the CPU has AMX and Linux grants the tile state) ----
 * y[m, n] = Σ_k x[m][k]·W[n][k] with W rounded to bf16 (round to nearest even, as torch's .bfloat16()):
 * TDPBF16PS adds each pair's exact products into one fp32 accumulator per output in increasing k, with every
 * output's K order fixed (k = 0 … Kp − 1, Kp = K padded with zeros to 32), so its bits do not depend on M, on
 * the rows beside it (tile rows past M are zeros) or on the threads (they split W's rows = output columns).
 * W is the A operand (its rows need no transpose: 16 rows × 32 k per tile, dequantized and rounded once per
 * call into a per-thread buffer), x the B operand in the pair-interleaved layout (built once per call); a C
 * tile is 16 columns of y × 16 rows of x, stored once after the whole K and written to y transposed.
 * Tiles: 0-3 C (2 W tiles × 2 x tiles), 4-5 W, 6-7 x. */
#include <sys/syscall.h>
#include <unistd.h>
#define WT 32                 /* W rows per pair of A tiles */
#ifndef GTMAX
#define GTMAX 4               /* tile pairs per column group (the group's bf16 rows stay in L2) */
#endif
static int amx_perm = -1, amx_on = 0;

/* want 1: run bf16 x through AMX where Linux grants the tile state (asked once per process: without it the
 * first tile instruction is SIGILL); 0: the dot-product path only (A/B benchmarks, tests); -1: ask. Returns
 * the state. */
int chatserve_bmm_amx(int want) {
    if (amx_perm < 0) amx_perm = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    if (want >= 0) amx_on = want && amx_perm;
    return amx_on;
}

struct tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* 16 floats → 16 bf16, rounded to nearest even (VCVTNEPS2BF16: subnormals flush to zero, as TDPBF16PS reads
 * them anyway; a block format's dequantized values are never subnormal) */
static inline __m256i w2bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* 16 floats → 16 bf16, rounded to nearest even exactly as f2bf (y) */
static inline __m256i f2bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}

/* one C tile (16 W rows i × 16 x rows j, at c) → y[m0 + j][n0 + i] for the rows and columns that exist */
static void store_tile(const float *c, void *y, int y_bf16, int64_t ldy, int64_t m0, int64_t mrows, int64_t n0,
                       int64_t ncols) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    const __mmask16 mk = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    for (int64_t j = 0; j < mrows && j < 16; j++) {
        const __m512 v = _mm512_i32gather_ps(idx, c + j, 4);
        if (y_bf16) _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + j) * ldy + n0, mk, f2bf16x16(v));
        else _mm512_mask_storeu_ps((float *)y + (m0 + j) * ldy + n0, mk, v);
    }
}

/* the calling thread's scratch of at least `bytes` (kept between calls and grown as needed: a fresh buffer
 * every call costs page faults and cold stores that a 1-row call would spend longer on than on its tiles;
 * scratch_trim gives back one over SCRATCH_KEEP after the call, so a long prompt's x copy is not kept).
 * Thread-local, so concurrent callers never share one; NULL when out of memory. */
#define SCRATCH_KEEP (8u << 20)
static __thread uint8_t *scratch_buf;
static __thread size_t scratch_size;
static uint8_t *scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_buf);
        scratch_size = (bytes + 4095) / 4096 * 4096;
        scratch_buf = aligned_alloc(64, scratch_size);
        if (!scratch_buf) scratch_size = 0;
    }
    return scratch_buf;
}

static void scratch_trim(void) {
    if (scratch_size > SCRATCH_KEEP) { free(scratch_buf); scratch_buf = NULL; scratch_size = 0; }
}

/* W rows [r0, r0 + WT) → bf16 rows of kp at o (fb: one fp32 row of scratch), zeros past k and past n */
static int w_pair(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t kp, int64_t r0,
                  uint16_t *o, float *fb) {
    int bad = 0;
    for (int64_t i = 0; i < WT; i++, o += kp) {
        if (r0 + i >= n) { memset(o, 0, 2 * (size_t)kp); continue; }
        if (fmt != F32 && fmt != F16 && fmt != BF16) {  /* block formats (k == kp): emit16 writes bf16 to o */
            bad |= dequant_row_bf16(fmt, row_at(fmt, w, row_bytes, r0 + i), k, fb, o);
            continue;
        }
        bad |= dequant_span(fmt, row_at(fmt, w, row_bytes, r0 + i), 0, k, fb, 0);
        for (int64_t c = k; c < kp; c++) fb[c] = 0.f;
        for (int64_t c = 0; c < kp; c += 16) _mm256_storeu_si256((__m256i *)(o + c), w2bf16x16(_mm512_loadu_ps(fb + c)));
    }
    return bad;
}

/* x tiles b and b + 1 (rows 16b … 16b + 31; one tile when b is the last) against the pair of W tiles a0 (W
 * rows r0 …): C from zero over k = 0 … kp − 1, stored once, written to y (cb: 4 C tiles of scratch) */
static void pair_tiles(const uint16_t *a0, int64_t kp, const uint32_t *xv, int64_t kh, int64_t mb, int64_t b,
                       float *cb, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n, int64_t r0) {
    const uint16_t *a1 = a0 + 16 * kp;
    const uint32_t *x0 = xv + b * kh * 16, *x1 = x0 + kh * 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    if (b + 1 < mb)
        for (int64_t c = 0; c < kp; c += 32) {
            _tile_loadd(4, a0 + c, 2 * kp); _tile_loadd(5, a1 + c, 2 * kp);
            _tile_loadd(6, x0 + 8 * c, 64); _tile_loadd(7, x1 + 8 * c, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
    else
        for (int64_t c = 0; c < kp; c += 32) {
            _tile_loadd(4, a0 + c, 2 * kp); _tile_loadd(5, a1 + c, 2 * kp);
            _tile_loadd(6, x0 + 8 * c, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
        }
    _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64);
    _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64);
    for (int h = 0; h < 2; h++)
        for (int bb = 0; bb < 2 && b + bb < mb; bb++) {
            const int64_t n0 = r0 + 16 * h, m0 = 16 * (b + bb);
            if (n0 < n) store_tile(cb + 256 * (2 * h + bb), y, y_bf16, ldy, m0, m - m0, n0, n - n0);
        }
}

static int bmm_amx(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const uint16_t *x, int64_t m,
                   void *y, int64_t ldy, int y_bf16, int nt) {
    const int64_t kp = (k + 31) / 32 * 32, kh = kp / 2, mb = (m + 15) / 16;
    const int64_t npairs = (n + WT - 1) / WT;
    int64_t ngroups = (npairs + GTMAX - 1) / GTMAX;         /* as many groups per thread, as in the AVX2 level */
    ngroups = (ngroups + nt - 1) / nt * nt;
    const int64_t gt = (npairs + ngroups - 1) / ngroups;
    ngroups = (npairs + gt - 1) / gt;
    /* x [mb][kh][16] pairs: block b, pair r, row j = x[16b + j][2r] | x[16b + j][2r + 1] << 16 */
    const size_t xbytes = (4 * (size_t)(mb * kh * 16) + 63) / 64 * 64;
    /* per thread: the group's W rows in bf16 [gt·WT][kp], one fp32 row, 4 C tiles */
    const size_t per = (4 * 1024 + 4 * (size_t)kp + 2048 + 2 * (size_t)(gt * WT * kp) + 63) / 64 * 64;
    uint8_t *all = scratch(xbytes + per * (size_t)nt);
    if (!all) return 2;
    uint32_t *xv = (uint32_t *)all;
    uint8_t *buf = all + xbytes;
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    int bad = 0;
    #pragma omp parallel num_threads(nt) reduction(|: bad)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < mb; b++)
            for (int j = 0; j < 16; j++) {
                uint32_t *o = xv + b * kh * 16 + j;
                const int64_t row = 16 * b + j;
                if (row >= m) { for (int64_t r = 0; r < kh; r++) o[16 * r] = 0; continue; }
                const uint16_t *s = x + row * k;
                int64_t r = 0;
                for (; 2 * r + 1 < k; r++) o[16 * r] = (uint32_t)s[2 * r] | (uint32_t)s[2 * r + 1] << 16;
                for (; r < kh; r++) o[16 * r] = 2 * r < k ? s[2 * r] : 0;
            }
#ifdef _OPENMP
        uint8_t *tb = buf + per * (size_t)omp_get_thread_num();
#else
        uint8_t *tb = buf;
#endif
        /* 4 C tiles, the fp32 row, then the bf16 rows 2 KiB further on than a multiple of 4 KiB would put
         * them (a row's loads and its converted stores 4 KiB apart would alias in the store buffer) */
        float *cb = (float *)tb, *fb = cb + 1024;
        uint16_t *wb = (uint16_t *)(tb + (4 * 1024 + 4 * (size_t)kp + 2048 + 63) / 64 * 64);
        _tile_loadconfig(&cfg);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < ngroups; g++) {
            const int64_t r0 = g * gt * WT, gtn = npairs - g * gt < gt ? npairs - g * gt : gt;
            /* few rows (one or two x tiles): each pair of W tiles right after its dequantization, while it is
             * in L1; more: the whole group first, then each 32 rows of x against every pair (x read once per
             * group). The same tile operations per output either way. */
            if (mb <= 2)
                for (int64_t t = 0; t < gtn; t++) {
                    bad |= w_pair(fmt, w, row_bytes, n, k, kp, r0 + t * WT, wb + t * WT * kp, fb);
                    for (int64_t b = 0; b < mb; b += 2) pair_tiles(wb + t * WT * kp, kp, xv, kh, mb, b, cb, y, y_bf16, ldy, m, n, r0 + t * WT);
                }
            else {
                for (int64_t t = 0; t < gtn; t++) bad |= w_pair(fmt, w, row_bytes, n, k, kp, r0 + t * WT, wb + t * WT * kp, fb);
                for (int64_t b = 0; b < mb; b += 2)
                    for (int64_t t = 0; t < gtn; t++) pair_tiles(wb + t * WT * kp, kp, xv, kh, mb, b, cb, y, y_bf16, ldy, m, n, r0 + t * WT);
            }
        }
        _tile_release();
    }
    scratch_trim();
    return bad ? 1 : 0;
}
#endif

/* x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] at row stride ldy (bf16 when y_bf16, else fp32): y may be
 * a column slice of a wider output (fused q/k/v or gate/up kept as separate tensors). 0 on success.
 * bf16 x runs on AMX when chatserve_bmm_amx switched it on, fp32 x (and bf16 x elsewhere) on the dot products. */
int chatserve_bmm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, void *y, int64_t ldy, int y_bf16, int nt) {
    if (bad_source(fmt, w, row_bytes)) return 1;
    if (nt < 1) nt = 1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (x_bf16 && amx_on) return bmm_amx(fmt, w, row_bytes, n, k, (const uint16_t *)x, m, y, ldy, y_bf16, nt);
#endif
    return bmm_dots(fmt, w, row_bytes, n, k, x, m, x_bf16, y, ldy, y_bf16, nt);
}
#endif
#else
int chatserve_bmm_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *out) { return 3; }
int chatserve_bmm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, void *y, int64_t ldy, int y_bf16, int nt) { return 3; }
#endif
