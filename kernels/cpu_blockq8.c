/* Matmul on GGUF block-format weights in place with integer activations: y[M, N] = x[M, K] · Wᵀ, W [N, K] as the
 * file stores it (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; layouts in block_formats.py), x rows
 * quantized per block of 32 to int8 and every product an exact integer dot against the codes. The decode path
 * of --gguf-in-place (few rows, memory-bound); prompt rows keep cpu_blockmm's fp32 arithmetic.
 *
 * Arithmetic (the torch twin is block_q8.py; the same for every M and thread count, so batch invariant):
 *   - x row m, block b (32 elements, row-local): amax, d = amax / top, q = round_even(x · (top / amax)) with
 *     top = 127 (x_bits 8: one int8 plane) or 32512 (x_bits 15: q = 255 · qh + ql, two int8 planes with
 *     digits in [-127, 127], and every lane dot is 255 · Σ u·qh + Σ u·ql: the same exact integer).
 *   - W row n, block b: unsigned codes u (Q4_0 nibbles, Q8_0 q + 128, Q6_K q + 32, IQ4_XS kvalue + 128, ...), a
 *     format zero z (8, 16, 128, 32, 128; 0 where the format has a min), a weight scale per 16 elements ws
 *     (d, or d·sc for the K-quants) and a min mn per 32 (Q4_1/Q5_1 m, Q4_K/Q5_K −dmin·mn, else 0), so that
 *     w = ws · (u − z) + mn bit for bit as the twin dequantizes.
 *   - per lane of 4 elements: the exact integer Σ (u − z) · q (vpdpbusd on u8 × s8 started from −z · Σ q on VNNI;
 *     maddubs/madd on |u − z| × sign(q) without it); then per lane, in increasing k, acc += float(dot) ·
 *     (ws · d) and acc += mn · (d · Σ q); a fixed tree adds the lanes. K is never split; threads split columns.
 * Loop nest: x is quantized once per call into row-local scratch; each thread takes a contiguous range of W
 * rows in chunks of ~32 KiB of blocks and runs every tile of up to MR rows of x against each chunk, so the
 * blocks stream from memory once per call.
 *
 * One source, two levels: cpu_blockq8.py prepends `#define BQ8_LEVEL 2` (AVX2 + FMA + F16C; AVX-VNNI where
 * the compiler targets it, else maddubs; 8 lanes = one block per step) or `3` (AVX-512 F/BW/VL + VNNI; 16
 * lanes = two blocks per step).
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef BQ8_LEVEL
#define BQ8_LEVEL 0
#endif
#if BQ8_LEVEL == 3 || (BQ8_LEVEL == 2 && defined(__AVXVNNI__))
#define BQ8_VNNI 1
#else
#define BQ8_VNNI 0
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23 };

/* level · 10 + 1 where the integer dots are VNNI instructions */
int chatserve_bq8_level(void) { return BQ8_LEVEL * 10 + BQ8_VNNI; }

static int zero_of(int fmt) {
    switch (fmt) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q8_0: case IQ4_XS: return 128;
    case Q6_K: return 32;
    default: return 0;
    }
}
static int has_min(int fmt) { return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K; }
static int known(int fmt) { return fmt == Q4_0 || fmt == Q8_0 || zero_of(fmt) || has_min(fmt); }

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* x [m, k] (fp32, or bf16) → codes q [m, k] in [-top, top] and scales d [m, k / 32] (the twin's exact
 * arithmetic). top = 127: int8 codes; top = 32512 = 255 · 127 + 127: 15-bit codes, split per element into two
 * int8 planes q = 255 · qh + ql with qh, ql in [-127, 127] (balanced base-255 digits) */
int chatserve_bq8_quantize(const void *x, int x_bf16, int64_t m, int64_t k, float top, int16_t *q, float *d) {
    float v[32];
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            const int64_t base = r * k + 32 * b;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) {
                v[i] = x_bf16 ? bf2f(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;           /* inline, not fmaxf/lrintf calls: the same values */
            }
            const float inv = amax > 0.f ? top / amax : 0.f;
            for (int i = 0; i < 32; i++) q[base + i] = (int16_t)__builtin_rintf(v[i] * inv);
            d[r * (k / 32) + b] = amax / top;
        }
    return 0;
}

#if BQ8_LEVEL
/* h2f, ld16, lo4, hi4, bits16, bit_j, scale_min_k4: block_bytes.h, written before this source */

/* Block j (32 elements) of a W row → codes u of elements 0-15 (lo) and 16-31 (hi), the weight scales of the
 * two halves and the min. Constant fmt: each caller is specialised per format. */
typedef struct { __m128i lo, hi; float ws0, ws1, mn; } blk32;

static inline __attribute__((always_inline)) blk32 unpack(const int fmt, const uint8_t *row, int64_t j) {
    blk32 o;
    o.mn = 0.f;
    switch (fmt) {
    case Q4_0: case Q4_1: {
        const uint8_t *b = row + j * (fmt == Q4_0 ? 18 : 20);
        const __m128i q = ld16(b + (fmt == Q4_0 ? 2 : 4));
        o.ws0 = o.ws1 = h2f(b);
        if (fmt == Q4_1) o.mn = h2f(b + 2);
        o.lo = lo4(q); o.hi = hi4(q);
        break;
    }
    case Q5_0: case Q5_1: {
        const uint8_t *b = row + j * (fmt == Q5_0 ? 22 : 24), *p = b + (fmt == Q5_0 ? 2 : 4);
        uint32_t qh; memcpy(&qh, p, 4);
        const __m128i q = ld16(p + 4);
        o.ws0 = o.ws1 = h2f(b);
        if (fmt == Q5_1) o.mn = h2f(b + 2);
        o.lo = _mm_or_si128(lo4(q), bits16(qh & 0xFFFF, 0x10));
        o.hi = _mm_or_si128(hi4(q), bits16(qh >> 16, 0x10));
        break;
    }
    case Q8_0: {
        const uint8_t *b = row + j * 34;
        const __m128i s = _mm_set1_epi8((char)0x80);          /* q + 128 as u8 */
        o.ws0 = o.ws1 = h2f(b);
        o.lo = _mm_xor_si128(ld16(b + 2), s); o.hi = _mm_xor_si128(ld16(b + 18), s);
        break;
    }
    case Q4_K: case Q5_K: {
        const int five = fmt == Q5_K, jj = (int)(j & 7);
        const uint8_t *b = row + (j >> 3) * (five ? 176 : 144);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        int sc, mn;
        scale_min_k4(b + 4, jj, &sc, &mn);
        o.ws0 = o.ws1 = h2f(b) * (float)sc;
        o.mn = -(h2f(b + 2) * (float)mn);
        __m128i l = ld16(qs + 32 * (jj / 2)), h = ld16(qs + 32 * (jj / 2) + 16);
        l = (jj & 1) ? hi4(l) : lo4(l);
        h = (jj & 1) ? hi4(h) : lo4(h);
        if (five) { l = _mm_or_si128(l, bit_j(ld16(qh), jj)); h = _mm_or_si128(h, bit_j(ld16(qh + 16), jj)); }
        o.lo = l; o.hi = h;
        break;
    }
    case Q6_K: {
        const int jj = (int)(j & 7), h2 = jj / 4;
        const uint8_t *b = row + (j >> 3) * 210, *ql = b + 64 * h2, *qh = b + 128 + 32 * h2;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h2;
        const float d = h2f(b + 208);
        __m128i q[2];
        for (int c = 0; c < 2; c++) {
            const int e = 32 * (jj % 4) + 16 * c;             /* element offset within the half */
            __m128i l = ld16(ql + e % 64);
            l = e < 64 ? lo4(l) : hi4(l);
            __m128i u = _mm_srli_epi16(ld16(qh + e % 32), 2 * (e / 32));
            u = _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi8(3)), 4);
            q[c] = _mm_or_si128(l, u);
        }
        o.ws0 = d * (float)sc[2 * (jj % 4)];
        o.ws1 = d * (float)sc[2 * (jj % 4) + 1];
        o.lo = q[0]; o.hi = q[1];
        break;
    }
    case IQ4_XS: {
        const int jj = (int)(j & 7);
        const uint8_t *b = row + (j >> 3) * 136;
        const __m128i kv = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        const __m128i kvu = _mm_xor_si128(kv, _mm_set1_epi8((char)0x80));       /* kvalue + 128 */
        uint16_t sh; memcpy(&sh, b + 2, 2);
        const int ls = ((b[4 + jj / 2] >> (4 * (jj % 2))) & 0xF) | (((sh >> (2 * jj)) & 3) << 4);
        o.ws0 = o.ws1 = h2f(b) * (float)(ls - 32);
        const __m128i q = ld16(b + 8 + 16 * jj);
        o.lo = _mm_shuffle_epi8(kvu, lo4(q)); o.hi = _mm_shuffle_epi8(kvu, hi4(q));
        break;
    }
    default:
        o.lo = o.hi = _mm_setzero_si128(); o.ws0 = o.ws1 = 0.f;
    }
    return o;
}

static inline int64_t block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
    case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210; case IQ4_XS: return 136;
    default: return 0;
    }
}
static inline int64_t block_elems(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K || fmt == IQ4_XS ? 256 : 32; }

/* W [n, k] → u [n, k], ws [n, k / 16], mn [n, k / 32]: the kernel's unpacking, for the exact tests */
int chatserve_bq8_unpack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *u,
                         float *ws, float *mn) {
    if (!known(fmt)) return 1;
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < k / 32; j++) {
            const blk32 b = unpack(fmt, w + r * row_bytes, j);
            _mm_storeu_si128((__m128i *)(u + r * k + 32 * j), b.lo);
            _mm_storeu_si128((__m128i *)(u + r * k + 32 * j + 16), b.hi);
            ws[r * (k / 16) + 2 * j] = b.ws0;
            ws[r * (k / 16) + 2 * j + 1] = b.ws1;
            mn[r * (k / 32) + j] = b.mn;
        }
    return 0;
}

/* ---- the integer dot per lane of 4 elements: Σ (u − z) · q ---- */
#if BQ8_LEVEL == 3
#define MR 8
typedef __m512 vf;
typedef __m512i vi;
static inline float hsum(vf v) {          /* fixed tree: 16 → 8 → 4 → 2 → 1 */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#else
#define MR 4
typedef __m256 vf;
typedef __m256i vi;
static inline float hsum(vf v) {          /* fixed tree: 8 → 4 → 2 → 1 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

/* u: codes (u8), q: x codes (s8); nzq: −z · Σ q per lane (VNNI), z: the zero (maddubs) */
static inline __attribute__((always_inline)) vi dot(vi nzq, vi u, vi q, int z) {
#if BQ8_LEVEL == 3
    (void)z;
    return _mm512_dpbusd_epi32(nzq, u, q);
#elif BQ8_VNNI
    (void)z;
    return _mm256_dpbusd_avx_epi32(nzq, u, q);
#else
    (void)nzq;
    const __m256i s = _mm256_sub_epi8(u, _mm256_set1_epi8((char)z));             /* u − z as s8 */
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(q, s));   /* ≤ 2·128·127 */
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* One step of the K loop covers SB blocks: level 2 one block in natural order; level 3 a pair of blocks a, b
 * in the order [a 0-15, b 0-15, a 16-31, b 16-31] (what nibble and byte unpacking yields with the fewest
 * shuffles), so 16 lanes of 4 = a, b, a, b per quarter. x is laid out in that order once per call. */
#if BQ8_LEVEL == 3
#define SB 2
#else
#define SB 1
#endif

/* natural position of x element `pos` of the stepped layout, or -1 past the last block (padding) */
static inline int64_t natural_pos(int64_t pos, int64_t nb) {
#if SB == 2
    const int64_t s = pos / 64, o = pos % 64, quarter = o / 16, block = 2 * s + (quarter & 1);
    return block < nb ? 32 * block + (quarter >= 2 ? 16 : 0) + o % 16 : -1;
#else
    (void)nb;
    return pos;
#endif
}

/* Per row of x, the call's scratch in the stepped layout: codes q [P, kp] (P = 1 plane of int8 codes, or 2:
 * qh then ql), and per lane of 4: −z·Σq (int32), the block's d (float) and d·Σq (float) [kp / 4]; padding 0 */
typedef struct {
    const int8_t *q;
    const int32_t *nzq;
    const float *dl, *dsq;
    int64_t nb, kp;
} xrows;

static void prepare_x(const int16_t *q, const float *d, int64_t m, int64_t k, int z, int P, int8_t *xp,
                      int32_t *nzq, float *dl, float *dsq) {
    const int64_t nb = k / 32, kp = (nb + SB - 1) / SB * SB * 32;
    for (int64_t r = 0; r < m; r++)
        for (int64_t l = 0; l < kp / 4; l++) {
            int32_t s = 0;
            int64_t block = -1;
            for (int i = 0; i < 4; i++) {
                const int64_t src = natural_pos(4 * l + i, nb);
                const int32_t v = src < 0 ? 0 : q[r * k + src];
                const int32_t h = P == 2 ? (v + (v >= 0 ? 127 : -127)) / 255 : v;
                xp[r * P * kp + 4 * l + i] = (int8_t)h;
                if (P == 2) xp[r * P * kp + kp + 4 * l + i] = (int8_t)(v - 255 * h);
                s += v;
                block = src < 0 ? -1 : src / 32;
            }
            const float dd = block < 0 ? 0.f : d[r * nb + block];
            nzq[r * (kp / 4) + l] = -z * s;
            dl[r * (kp / 4) + l] = dd;
            dsq[r * (kp / 4) + l] = dd * (float)s;
        }
}

#if BQ8_LEVEL == 3
/* W blocks j, j + 1 (b absent when !two) → codes u in the pair order, weight scales and mins per lane */
typedef struct { __m512i u; __m512 ws, mn; } pair64;

static inline __m512 two_halves(float a, float b) {       /* lanes: a ×4, b ×4, a ×4, b ×4 */
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(a, b, 0.f, 0.f)));
}
static inline __m512 two_fp16(const uint8_t *pa, const uint8_t *pb) {   /* two fp16 → two_halves */
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    uint16_t ha, hb; memcpy(&ha, pa, 2); memcpy(&hb, pb, 2);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)ha | ((uint32_t)hb << 16))));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
}

/* A Q4_K super-block's 8 weight scales d·sc (lanes 0-7) and mins −(dmin·mn) (lanes 8-15): unpack()'s float
 * products (the same bits), once per super-block instead of once per block; the 6-bit fields by the byte-wise
 * word arithmetic of scale_min_k4 (sc 0-3 = s[0-3] & 63, mn 0-3 = s[4-7] & 63, sc 4-7 = s[8-11] & 15 |
 * (s[0-3] >> 6) << 4, mn 4-7 = s[8-11] >> 4 | (s[4-7] >> 6) << 4) */
static inline __attribute__((always_inline)) __m512 k4_scales(const uint8_t *sb) {
    uint32_t u[3]; memcpy(u, sb + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3F3F3F3Fu, mn_lo = u[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo,
                                                                            (int)mn_hi)));
    int32_t dm; memcpy(&dm, sb, 4);                                                  /* fp16 d, dmin */
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(dm))));
    const __m512 p = _mm512_mul_ps(dd, f);
    return _mm512_mask_xor_ps(p, (__mmask16)0xFF00, p, _mm512_set1_ps(-0.f));
}

/* k4: k4_scales() of row's super-block j / 8 (Q4_K; unused otherwise) */
static inline __attribute__((always_inline)) pair64 pair(const int fmt, const uint8_t *row, int64_t j, int two,
                                                         __m512 k4) {
    pair64 o;
    if (two && (fmt == Q4_0 || fmt == Q4_1)) {             /* [qa, qb, qa >> 4, qb >> 4] & 0x0F */
        const int64_t bb = fmt == Q4_0 ? 18 : 20, at = fmt == Q4_0 ? 2 : 4;
        const uint8_t *a = row + j * bb, *b = a + bb;
        const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(ld16(a + at)), ld16(b + at), 1);
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
        o.u = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
        o.ws = two_fp16(a, b);
        o.mn = fmt == Q4_1 ? two_fp16(a + 2, b + 2) : _mm512_setzero_ps();
        return o;
    }
    if (two && fmt == Q8_0) {                             /* [a, b] → 128-bit lanes 0, 2, 1, 3; q + 128 */
        const uint8_t *a = row + j * 34, *b = a + 34;
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b + 2)), 1);
        o.u = _mm512_xor_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8((char)0x80));
        o.ws = two_fp16(a, b);
        o.mn = _mm512_setzero_ps();
        return o;
    }
    if (two && !(j & 1) && fmt == Q4_K) {   /* blocks jj, jj + 1 of a super-block: the low, high nibbles of 32 qs */
        const int jj = (int)(j & 7);
        const uint8_t *sb = row + (j >> 3) * 144;
        const __m256i t = _mm256_loadu_si256((const __m256i *)(sb + 16 + 16 * jj));
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
        o.u = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(0x0F));
        const __m512i at = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
                                            _mm512_set1_epi32(jj));     /* lanes a ×4, b ×4, a ×4, b ×4 */
        o.ws = _mm512_permutexvar_ps(at, k4);
        o.mn = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(8)), k4);
        return o;
    }
    if (two && !(j & 1) && fmt == Q6_K) {
        /* blocks jj, jj + 1 (jj even) of a half h2: a = elements 32·q .. 32·q + 31 of the half, b = the next 32
         * (q = jj % 4 ∈ {0, 2}); low 4 bits from ql[0:32] (a) and ql[32:64] (b), low or high nibbles as q is
         * 0 or 2; high 2 bits from qh[0:32], bits 2q (a) and 2q + 2 (b). Lanes: a 0-15, b 0-15, a 16-31, b 16-31 */
        const int jj = (int)(j & 7), h2 = jj / 4, q = jj % 4;
        const uint8_t *sb = row + (j >> 3) * 210, *ql = sb + 64 * h2, *qh = sb + 128 + 32 * h2;
        const __m512i l = _mm512_loadu_si512(ql);                                   /* [a0, a1, b0, b1] */
        __m512i lo = _mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(3, 1, 2, 0));          /* [a0, b0, a1, b1] */
        if (q) lo = _mm512_srli_epi16(lo, 4);
        lo = _mm512_and_si512(lo, _mm512_set1_epi8(0x0F));
        const __m256i hy = _mm256_loadu_si256((const __m256i *)qh);
        const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hy), hy, 1);   /* [h0, h1, h0, h1] */
        const __m512i hh = _mm512_shuffle_i64x2(hz, hz, _MM_SHUFFLE(3, 1, 2, 0));  /* [h0, h0, h1, h1] */
        const short sa = (short)(2 * q), sbs = (short)(2 * q + 2);
        const __m512i cnt = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(sbs),
                                                                                    _mm_set1_epi16(sa))),
                                               _mm256_set_m128i(_mm_set1_epi16(sbs), _mm_set1_epi16(sa)), 1);
        const __m512i top = _mm512_and_si512(_mm512_srlv_epi16(hh, cnt), _mm512_set1_epi8(3));
        o.u = _mm512_or_si512(lo, _mm512_slli_epi16(top, 4));
        const int8_t *sc = (const int8_t *)(sb + 192) + 8 * h2 + 2 * q;         /* a: sc[0], sc[1]; b: sc[2], sc[3] */
        const __m128 s4 = _mm_cvtepi32_ps(_mm_setr_epi32(sc[0], sc[2], sc[1], sc[3]));
        const __m128 w4 = _mm_mul_ps(_mm_set1_ps(h2f(sb + 208)), s4);              /* a.ws0, b.ws0, a.ws1, b.ws1 */
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        o.ws = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(w4));
        o.mn = _mm512_setzero_ps();
        return o;
    }
    const blk32 a = unpack(fmt, row, j);
    blk32 b;
    if (two) b = unpack(fmt, row, j + 1);
    else { b.lo = b.hi = _mm_setzero_si128(); b.ws0 = b.ws1 = b.mn = 0.f; }
    const __m256i lo = _mm256_set_m128i(b.lo, a.lo), hi = _mm256_set_m128i(b.hi, a.hi);
    o.u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    o.ws = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(a.ws0, b.ws0, a.ws1, b.ws1)));
    o.mn = has_min(fmt) ? two_halves(a.mn, b.mn) : _mm512_setzero_ps();
    return o;
}

/* mr rows of x (from row m0) · one W row → res[mr] */
static inline __attribute__((always_inline)) void rows_dot(const int fmt, const int mr, const int P,
                                                           const uint8_t *wrow, const xrows *X, int64_t m0,
                                                           float *res) {
    const int64_t nb = X->nb, kp = X->kp, kl = X->kp / 4;
    const int z = zero_of(fmt), mins = has_min(fmt);
    vf acc[MR];
    __m512 k4 = _mm512_setzero_ps();                /* Q4_K: the current super-block's k4_scales() */
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j += 2) {
        __builtin_prefetch(wrow + (j / (block_elems(fmt) / 32)) * block_bytes(fmt) + 1024);
        if (fmt == Q4_K && !(j & 7)) k4 = k4_scales(wrow + (j >> 3) * 144);
        const pair64 p = pair(fmt, wrow, j, j + 1 < nb, k4);
        for (int i = 0; i < mr; i++) {
            const int64_t r = m0 + i;
            const int8_t *xq = X->q + r * P * kp + 32 * j;
            const __m512i nz = _mm512_loadu_si512(X->nzq + r * kl + 8 * j);
            const __m512 dl = _mm512_loadu_ps(X->dl + r * kl + 8 * j);
            __m512i s;
            if (P == 2) {                                       /* 255 · Σ u·qh + Σ u·ql − z·Σq */
                const __m512i h = dot(_mm512_setzero_si512(), p.u, _mm512_loadu_si512(xq), z);
                s = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h),
                                     dot(nz, p.u, _mm512_loadu_si512(xq + kp), z));
            } else {
                s = dot(nz, p.u, _mm512_loadu_si512(xq), z);
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(p.ws, dl), acc[i]);
            if (mins) acc[i] = _mm512_fmadd_ps(p.mn, _mm512_loadu_ps(X->dsq + r * kl + 8 * j), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) res[i] = hsum(acc[i]);
}

/* one step's exact lane dots, for the tests: lanes [16] of x row (stepped layout) against W blocks j, j + 1 */
static void step_lanes(int fmt, const uint8_t *wrow, int64_t j, int two, int P, const int8_t *xq, int64_t kp,
                       const int32_t *nz, int32_t *lanes) {
    const pair64 p = pair(fmt, wrow, j, two, fmt == Q4_K ? k4_scales(wrow + (j >> 3) * 144) : _mm512_setzero_ps());
    const int z = zero_of(fmt);
    __m512i s = dot(_mm512_loadu_si512(nz), p.u, _mm512_loadu_si512(xq + (P == 2 ? kp : 0)), z);
    if (P == 2) {
        const __m512i h = dot(_mm512_setzero_si512(), p.u, _mm512_loadu_si512(xq), z);
        s = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h), s);
    }
    _mm512_storeu_si512(lanes, s);
}
/* lane quarter → (block offset, half) */
#define LANE_BLOCK(l) (((l) / 4) & 1)
#define LANE_HALF(l) ((l) / 8)
#else
static inline __attribute__((always_inline)) void rows_dot(const int fmt, const int mr, const int P,
                                                           const uint8_t *wrow, const xrows *X, int64_t m0,
                                                           float *res) {
    const int64_t nb = X->nb, kp = X->kp, kl = X->kp / 4;
    const int z = zero_of(fmt), mins = has_min(fmt);
    vf acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        __builtin_prefetch(wrow + (j / (block_elems(fmt) / 32)) * block_bytes(fmt) + 1024);
        const blk32 a = unpack(fmt, wrow, j);
        const __m256i u = _mm256_set_m128i(a.hi, a.lo);
        const __m256 ws = _mm256_set_m128(_mm_set1_ps(a.ws1), _mm_set1_ps(a.ws0));
        const __m256 mn = _mm256_set1_ps(a.mn);
        for (int i = 0; i < mr; i++) {
            const int64_t r = m0 + i;
            const int8_t *xq = X->q + r * P * kp + 32 * j;
            const __m256i nz = BQ8_VNNI ? _mm256_loadu_si256((const __m256i *)(X->nzq + r * kl + 8 * j))
                                        : _mm256_setzero_si256();
            const __m256 dl = _mm256_loadu_ps(X->dl + r * kl + 8 * j);
            __m256i s;
            if (P == 2) {
                const __m256i h = dot(_mm256_setzero_si256(), u, _mm256_loadu_si256((const __m256i *)xq), z);
                s = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(h, 8), h),
                                     dot(nz, u, _mm256_loadu_si256((const __m256i *)(xq + kp)), z));
            } else {
                s = dot(nz, u, _mm256_loadu_si256((const __m256i *)xq), z);
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws, dl), acc[i]);
            if (mins) acc[i] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(X->dsq + r * kl + 8 * j), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) res[i] = hsum(acc[i]);
}

static void step_lanes(int fmt, const uint8_t *wrow, int64_t j, int two, int P, const int8_t *xq, int64_t kp,
                       const int32_t *nz, int32_t *lanes) {
    (void)two;
    const blk32 a = unpack(fmt, wrow, j);
    const int z = zero_of(fmt);
    const __m256i u = _mm256_set_m128i(a.hi, a.lo);
    const __m256i n = BQ8_VNNI ? _mm256_loadu_si256((const __m256i *)nz) : _mm256_setzero_si256();
    __m256i s = dot(n, u, _mm256_loadu_si256((const __m256i *)(xq + (P == 2 ? kp : 0))), z);
    if (P == 2) {
        const __m256i h = dot(_mm256_setzero_si256(), u, _mm256_loadu_si256((const __m256i *)xq), z);
        s = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(h, 8), h), s);
    }
    _mm256_storeu_si256((__m256i *)lanes, s);
}
#define LANE_BLOCK(l) 0
#define LANE_HALF(l) ((l) / 4)
#endif

/* the integer dots alone, per 16-element half: out [m, n, k / 16] (exact tests of the unpacking and dot()) */
int chatserve_bq8_dots(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const int16_t *q,
                       int64_t m, int planes, int32_t *out) {
    if (!known(fmt) || k % 32 || planes < 1 || planes > 2) return 1;
    const int64_t nb = k / 32, kp = (nb + SB - 1) / SB * SB * 32;
    int8_t *xp = malloc((size_t)(m * planes * kp));
    int32_t *nzq = malloc(sizeof(int32_t) * (size_t)(m * kp / 4));
    float *d = malloc(sizeof(float) * (size_t)(m * nb));
    float *dl = malloc(sizeof(float) * (size_t)(m * kp / 4)), *dsq = malloc(sizeof(float) * (size_t)(m * kp / 4));
    if (!xp || !nzq || !d || !dl || !dsq) { free(xp); free(nzq); free(d); free(dl); free(dsq); return 2; }
    for (int64_t i = 0; i < m * nb; i++) d[i] = 1.f;
    prepare_x(q, d, m, k, zero_of(fmt), planes, xp, nzq, dl, dsq);
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) {
            int32_t *o = out + (r * n + c) * (k / 16);
            for (int64_t h = 0; h < k / 16; h++) o[h] = 0;
            for (int64_t j = 0; j < nb; j += SB) {
                int32_t lanes[16];
                step_lanes(fmt, w + c * row_bytes, j, j + 1 < nb, planes, xp + r * planes * kp + 32 * j, kp,
                           nzq + r * (kp / 4) + 8 * j, lanes);
                for (int l = 0; l < 8 * SB; l++) {
                    const int64_t block = j + LANE_BLOCK(l);
                    if (block < nb) o[2 * block + LANE_HALF(l)] += lanes[l];
                }
            }
        }
    free(xp); free(nzq); free(d); free(dl); free(dsq);
    return 0;
}

static inline uint16_t f2bf(float f) {          /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* rows [m0, m0 + mr) of x against W rows [c0, c1) → y */
static inline __attribute__((always_inline)) void tile_rows(const int fmt, const int mr, const int P, const uint8_t *w,
                                                            int64_t row_bytes, int64_t c0, int64_t c1,
                                                            const xrows *X, int64_t m0, void *y, int64_t ldy,
                                                            int y_bf16) {
    float res[MR];
    for (int64_t c = c0; c < c1; c++) {
        rows_dot(fmt, mr, P, w + c * row_bytes, X, m0, res);
        for (int i = 0; i < mr; i++) {
            const int64_t off = (m0 + i) * ldy + c;
            if (y_bf16) ((uint16_t *)y)[off] = f2bf(res[i]);
            else ((float *)y)[off] = res[i];
        }
    }
}

#define MR_BIG (MR == 8 ? 8 : 4)      /* the 8-row tile (AVX-512 only) */
#define FMT_TILES_P(F, P)                                                                                  \
    static void tiles_##F##_##P(int64_t m, const uint8_t *w, int64_t rb, int64_t c0, int64_t c1,          \
                                const xrows *X, void *y, int64_t ldy, int yb) {                            \
        for (int64_t m0 = 0; m0 < m;) {                                                                    \
            const int64_t left = m - m0;                                                                   \
            if (MR == 8 && left >= 8) { tile_rows(F, MR_BIG, P, w, rb, c0, c1, X, m0, y, ldy, yb); m0 += 8; } \
            else if (left >= 4) { tile_rows(F, 4, P, w, rb, c0, c1, X, m0, y, ldy, yb); m0 += 4; }          \
            else if (left >= 2) { tile_rows(F, 2, P, w, rb, c0, c1, X, m0, y, ldy, yb); m0 += 2; }          \
            else { tile_rows(F, 1, P, w, rb, c0, c1, X, m0, y, ldy, yb); m0 += 1; }                         \
        }                                                                                                  \
    }
#define FMT_TILES(F) FMT_TILES_P(F, 1) FMT_TILES_P(F, 2)
FMT_TILES(Q4_0) FMT_TILES(Q4_1) FMT_TILES(Q5_0) FMT_TILES(Q5_1) FMT_TILES(Q8_0)
FMT_TILES(Q4_K) FMT_TILES(Q5_K) FMT_TILES(Q6_K) FMT_TILES(IQ4_XS)

#define CHUNK_BYTES (32 * 1024)          /* W rows per chunk: their blocks stay in L2 for every tile of x rows */

/* x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] at row stride ldy (bf16 when y_bf16, else fp32).
 * 0 on success, 1 unknown format, 2 out of memory. */
/* x [m, k] (fp32, or bf16 when x_bf16) → y [m, n] at row stride ldy (bf16 when y_bf16, else fp32), x as
 * x_bits = 8 (int8 codes) or 15 (two int8 planes) per block of 32. 0 on success, 1 bad argument, 2 no memory. */
int chatserve_bq8(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, int x_bits, void *y, int64_t ldy, int y_bf16, int nt) {
    if (!known(fmt) || k % 32 || (x_bits != 8 && x_bits != 15)) return 1;
    if (nt < 1) nt = 1;
    const int P = x_bits == 15 ? 2 : 1;
    const int64_t nb = k / 32, kp = (nb + SB - 1) / SB * SB * 32, kl = kp / 4;
    int16_t *q = malloc(sizeof(int16_t) * (size_t)(m * k));
    int8_t *xp = malloc((size_t)(m * P * kp));
    float *d = malloc(sizeof(float) * (size_t)(m * nb));
    int32_t *nzq = malloc(sizeof(int32_t) * (size_t)(m * kl));
    float *dl = malloc(sizeof(float) * (size_t)(m * kl)), *dsq = malloc(sizeof(float) * (size_t)(m * kl));
    if (!q || !xp || !d || !nzq || !dl || !dsq) {
        free(q); free(xp); free(d); free(nzq); free(dl); free(dsq);
        return 2;
    }
    chatserve_bq8_quantize(x, x_bf16, m, k, P == 2 ? 32512.f : 127.f, q, d);
    prepare_x(q, d, m, k, zero_of(fmt), P, xp, nzq, dl, dsq);
    const xrows X = {xp, nzq, dl, dsq, nb, kp};
    int64_t chunk = CHUNK_BYTES / row_bytes;
    if (chunk < 1) chunk = 1;
    if (n < 8 * nt) nt = 1;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int part = 0; part < nt; part++) {
        const int64_t p0 = n * part / nt, p1 = n * (part + 1) / nt;
        for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < p1 ? c0 + chunk : p1;
#define CASE(F) case F: (P == 2 ? tiles_##F##_2 : tiles_##F##_1)(m, w, row_bytes, c0, c1, &X, y, ldy, y_bf16); break;
            switch (fmt) {
            CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q5_1) CASE(Q8_0) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K) CASE(IQ4_XS)
            }
#undef CASE
        }
    }
    free(q); free(xp); free(d); free(nzq); free(dl); free(dsq);
    return 0;
}

/* ---- the row-interleaved ("tiled") layout: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K at both levels (one copy for both) ----
 * chatserve_bq8_tile() re-lays the file's blocks at load, same bytes (codes, fp16 scales and mins), only
 * their order changed: W rows in tiles of 16 (the last padded with zero blocks), and per (tile, block j):
 *   codes: Q4_x 4 chunks of 64 bytes, byte 4·r + i of chunk c = row r's qs[4c + i] (low nibble: element
 *          4c + i, high: 16 + 4c + i); Q8_0 8 chunks, byte 4·r + i of chunk c = row r's qs[4c + i];
 *   then the 16 rows' d (fp16), then (Q4_1) their m (fp16).
 * A (tile, block) is 16 · the block's bytes, so the tiled copy is exactly the file's size. The K-quants keep the
 * same codes and the file's scales (no second quantization), the kernel forming unpack()'s ws and mn from them
 * (the twin's exact w = ws · (u − z) + mn):
 *   Q4_K: per super-block of 256 (2368 bytes), its 8 blocks of 32 (288 bytes each: 4 chunks of nibbles as Q4_x,
 *         low: element 4c + i, high: 16 + 4c + i, then the 16 rows' 6-bit sc, then their 6-bit min, a byte
 *         each), then the 16 rows' fp16 d, then their fp16 dmin (64 bytes; the kernels convert them once per
 *         super-block and form ws = d · sc, mn = −(dmin · min) as unpack() does, both exact): 296 bytes a block
 *         on average, 1.03 times the file's 16 · 18 (block j of a tile at tiled_at());
 *   Q6_K: 4 chunks of the codes' low nibbles as Q4_x, then 2 chunks of their high 2 bits (chunk h, byte 4·r + i:
 *         bits 2c..2c+1 = element 16·h + 4c + i), then the rows' fp16 d (the super-block's), then their int8 sc
 *         of elements 0-15, then of 16-31 (the file's bytes; the kernel forms ws = float(d) · sc as unpack()
 *         does): 448 bytes, 1.07 times the file's 16 · 26.25.
 * Q6_K's scale changes every 16 elements: its two halves are two integer sums and two FMAs, in order. One zmm lane
 * is one output row (level 2: one ymm lane, a tile as two ymm halves of 8 rows): the 4 x codes of a lane are
 * broadcast, so no per-lane reduction is left, and the float epilogue runs once per block for 16 rows.
 * Arithmetic per x row m, W row n (the twin: block_q8.matmul_tiled):
 *   acc = 0; for each block j in increasing k: I = Σ (u − z) · q (exact int32; 255 · Σ u·qh + Σ u·ql − z·Σq at
 *   15 bits), acc = fma(float(I), ws · d, acc), then with a min acc = fma(mn, d · Σq, acc); y = acc. */
static int tiled_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 || fmt == Q4_K || fmt == Q6_K; }

/* bytes of one (tile, block of 32) in the tiled layout: Q4_K's without its super-block's d and dmin */
static inline int64_t tiled_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 288; case Q4_1: return 320; case Q8_0: return 544; case Q4_K: return 288; case Q6_K: return 448;
    default: return 0;
    }
}
/* Q4_K: a tile's super-block (8 blocks, then the 16 rows' fp16 d and dmin at K4_DM) */
#define K4_SUPER 2368
#define K4_DM 2304
/* offset of block j in a tile; tiled_at(fmt, k / 32): a tile's bytes */
static inline int64_t tiled_at(int fmt, int64_t j) { return j * tiled_bytes(fmt) + (fmt == Q4_K ? (j >> 3) * 64 : 0); }

/* W [n, k] (file layout, row stride row_bytes) → dst [ceil(n / 16), tiled_at(fmt, k / 32)] */
int chatserve_bq8_tile(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *dst) {
    if (!tiled_fmt(fmt) || k % 32 || k % block_elems(fmt)) return 1;
    if (fmt == Q4_K || fmt == Q6_K) {
        const int64_t nb = k / 32, tiles = (n + 15) / 16, tb = tiled_bytes(fmt), tile_bytes = tiled_at(fmt, nb);
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t j = 0; j < nb; j++) {
                uint8_t *o = dst + t * tile_bytes + tiled_at(fmt, j);
                uint8_t *dm = fmt == Q4_K ? dst + t * tile_bytes + (j >> 3) * K4_SUPER + K4_DM : NULL;  /* d, dmin */
                memset(o, 0, (size_t)tb);
                if (dm && !(j & 7)) memset(dm, 0, 64);
                for (int r = 0; r < 16 && t * 16 + r < n; r++) {
                    const blk32 b = unpack(fmt, w + (t * 16 + r) * row_bytes, j);
                    uint8_t lo[16], hi[16];
                    _mm_storeu_si128((__m128i *)lo, b.lo);
                    _mm_storeu_si128((__m128i *)hi, b.hi);
                    for (int c = 0; c < 4; c++)
                        for (int i = 0; i < 4; i++) {
                            const int e = 4 * c + i;
                            o[64 * c + 4 * r + i] = (uint8_t)((lo[e] & 15) | ((hi[e] & 15) << 4));
                            if (fmt == Q6_K) {
                                o[256 + 4 * r + i] |= (uint8_t)(((lo[e] >> 4) & 3) << (2 * c));
                                o[320 + 4 * r + i] |= (uint8_t)(((hi[e] >> 4) & 3) << (2 * c));
                            }
                        }
                    if (fmt == Q6_K) {                          /* the file's d and the two halves' sc */
                        const uint8_t *sb = w + (t * 16 + r) * row_bytes + (j >> 3) * 210;
                        memcpy(o + 384 + 2 * r, sb + 208, 2);
                        o[416 + r] = sb[192 + 2 * (j & 7)];
                        o[432 + r] = sb[192 + 2 * (j & 7) + 1];
                        continue;
                    }
                    const uint8_t *sb = w + (t * 16 + r) * row_bytes + (j >> 3) * 144;   /* the file's bytes */
                    int sc, mn;
                    scale_min_k4(sb + 4, (int)(j & 7), &sc, &mn);
                    o[256 + r] = (uint8_t)sc;
                    o[272 + r] = (uint8_t)mn;
                    if (!(j & 7)) { memcpy(dm + 2 * r, sb, 2); memcpy(dm + 32 + 2 * r, sb + 2, 2); }
                }
            }
        return 0;
    }
    const int64_t bb = fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34, nb = k / 32, tiles = (n + 15) / 16;
    const int hdr = fmt == Q4_1 ? 4 : 2, ncodes = fmt == Q8_0 ? 32 : 16;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *o = dst + (t * nb + j) * 16 * bb;
            memset(o, 0, (size_t)(16 * bb));
            for (int r = 0; r < 16 && t * 16 + r < n; r++) {
                const uint8_t *b = w + (t * 16 + r) * row_bytes + j * bb;
                for (int c = 0; c < ncodes / 4; c++) memcpy(o + 64 * c + 4 * r, b + hdr + 4 * c, 4);
                memcpy(o + 16 * ncodes + 2 * r, b, 2);                          /* d */
                if (fmt == Q4_1) memcpy(o + 16 * ncodes + 32 + 2 * r, b + 2, 2);  /* m */
            }
        }
    return 0;
}

/* x of one call, natural order: code planes xh (the codes at 8 bits; qh at 15) and xl (ql) [m, k]; per block
 * −z·Σq (int32), d and d·Σq [m, k / 32] */
typedef struct { const int8_t *xh, *xl; const int32_t *nzq, *nzh; const float *d, *dsq; int64_t k, nb; } xnat;

#if BQ8_LEVEL == 3
static inline __m512i bc4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

/* x rows [m0, m0 + MB) against one tile of 16 W rows → res [MB] (lane r = W row 16·t + r) */
static inline __attribute__((always_inline)) void tile16(const int fmt, const int MB, const int P,
                                                         const uint8_t *wt, const xnat *X, int64_t m0, __m512 *res) {
    const int64_t nb = X->nb, k = X->k;
    const int q8 = fmt == Q8_0, six = fmt == Q6_K, codes = q8 ? 512 : 256, NC = MB <= 2 ? 2 : 1;
    __m512 acc[8], kd = _mm512_setzero_ps(), kdm = kd;      /* Q4_K: the super-block's 16 rows' d and dmin */
    for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *wb = wt + tiled_at(fmt, j);
        if (fmt == Q4_K && !(j & 7)) {
            const uint8_t *dm = wt + (j >> 3) * K4_SUPER + K4_DM;
            kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dm));
            kdm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 32)));
        }
        const __m512 d6 = six ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 384))) : _mm512_setzero_ps();
        /* the K-quants: d · sc, unpack()'s float product (Q4_K's mn: −(dmin · min)) */
        const __m512 ws = fmt == Q4_K ? _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld16(wb + 256))))
                        : six ? _mm512_mul_ps(d6, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld16(wb + 416))))
                        : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + codes)));
        const __m512 mn = fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + codes + 32)))
                        : fmt == Q4_K ? _mm512_xor_ps(_mm512_mul_ps(kdm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                          ld16(wb + 272)))), _mm512_set1_ps(-0.f))
                        : six ? _mm512_mul_ps(d6, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld16(wb + 432))))  /* ws₁ */
                        : _mm512_setzero_ps();
        if (six) {          /* one half of 16 at a time (its own scale): 2 · MB integer accumulators live */
            for (int hf = 0; hf < 2; hf++) {
                const __m512i hb = _mm512_loadu_si512(wb + 256 + 64 * hf), nib = _mm512_set1_epi8(0x0F);
                __m512i sh[8], sl[8];
                for (int i = 0; i < MB; i++) sh[i] = sl[i] = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512(wb + 64 * c);
                    const __m512i top = _mm512_and_si512(_mm512_srli_epi16(hb, 2 * c), _mm512_set1_epi8(3));
                    const __m512i a = _mm512_or_si512(_mm512_and_si512(hf ? _mm512_srli_epi16(v, 4) : v, nib),
                                                      _mm512_slli_epi16(top, 4));   /* | the high 2 bits << 4 */
                    for (int i = 0; i < MB; i++) {
                        const int64_t e = (m0 + i) * k + 32 * j + 16 * hf + 4 * c;
                        sh[i] = _mm512_dpbusd_epi32(sh[i], a, bc4(X->xh + e));
                        if (P == 2) sl[i] = _mm512_dpbusd_epi32(sl[i], a, bc4(X->xl + e));
                    }
                }
                for (int i = 0; i < MB; i++) {
                    const int64_t r = (m0 + i) * nb + j;
                    __m512i s = sh[i];
                    if (P == 2) s = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(s, 8), s), sl[i]);
                    s = _mm512_add_epi32(s, _mm512_set1_epi32(X->nzh[2 * r + hf]));
                    const __m512 wd = _mm512_mul_ps(hf ? mn : ws, _mm512_set1_ps(X->d[r]));     /* mn: Q6_K's ws₁ */
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), wd, acc[i]);
                }
            }
            continue;
        }
        __m512i ih[8][2], il[8][2];
        for (int i = 0; i < MB; i++)
            for (int c = 0; c < NC; c++) ih[i][c] = il[i][c] = _mm512_setzero_si512();
        if (q8) {
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), _mm512_set1_epi8((char)0x80));
                for (int i = 0; i < MB; i++) {
                    const int64_t e = (m0 + i) * k + 32 * j + 4 * c;
                    ih[i][c % NC] = _mm512_dpbusd_epi32(ih[i][c % NC], v, bc4(X->xh + e));
                    if (P == 2) il[i][c % NC] = _mm512_dpbusd_epi32(il[i][c % NC], v, bc4(X->xl + e));
                }
            }
        } else {
            const __m512i nib = _mm512_set1_epi8(0x0F);
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wb + 64 * c);
                const __m512i a = _mm512_and_si512(v, nib), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                for (int i = 0; i < MB; i++) {
                    const int64_t e = (m0 + i) * k + 32 * j + 4 * c;
                    ih[i][0] = _mm512_dpbusd_epi32(ih[i][0], a, bc4(X->xh + e));
                    ih[i][NC - 1] = _mm512_dpbusd_epi32(ih[i][NC - 1], h, bc4(X->xh + e + 16));
                    if (P == 2) {
                        il[i][0] = _mm512_dpbusd_epi32(il[i][0], a, bc4(X->xl + e));
                        il[i][NC - 1] = _mm512_dpbusd_epi32(il[i][NC - 1], h, bc4(X->xl + e + 16));
                    }
                }
            }
        }
        for (int i = 0; i < MB; i++) {
            const int64_t r = (m0 + i) * nb + j;
            __m512i h = ih[i][0], l = il[i][0];
            if (NC == 2) { h = _mm512_add_epi32(h, ih[i][1]); l = _mm512_add_epi32(l, il[i][1]); }
            __m512i s = P == 2 ? _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h), l) : h;
            s = _mm512_add_epi32(s, _mm512_set1_epi32(X->nzq[r]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(X->d[r])), acc[i]);
            if (fmt == Q4_1 || fmt == Q4_K) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(X->dsq[r]), acc[i]);
        }
    }
    for (int i = 0; i < MB; i++) res[i] = acc[i];
}

static inline void store16(void *y, int y_bf16, int64_t off, __m512 v, __mmask16 keep) {
    if (!y_bf16) { _mm512_mask_storeu_ps((float *)y + off, keep, v); return; }
    const __m512i u = _mm512_castps_si512(v);                 /* round to nearest even, as torch does */
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)y + off, keep, _mm512_cvtepi32_epi16(r));
}

#define TILED_RUN(F, MB, P)                                                                               \
    static void tiled_##F##_##MB##_##P(const uint8_t *w, int64_t n, int64_t t0, int64_t t1, const xnat *X,  \
                                       int64_t m0, void *y, int64_t ldy, int yb) {                       \
        const int64_t tb = tiled_at(F, X->nb);                                                            \
        __m512 res[MB];                                                                                   \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            tile16(F, MB, P, w + t * tb, X, m0, res);                                                     \
            const int64_t left = n - 16 * t;                                                              \
            const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);       \
            for (int i = 0; i < MB; i++) store16(y, yb, (m0 + i) * ldy + 16 * t, res[i], keep);           \
        }                                                                                                 \
    }
#else
/* Level 2 (AVX2): the same tiled layout, a tile's 16 rows as two ymm halves: rows 0-7 are bytes 0-31 of every
 * 64-byte chunk and the first 8 entries of each scale array, rows 8-15 bytes 32-63 and the last 8; one ymm lane
 * per output row, the level-3 arithmetic per lane in the same order. Integer dots: vpdpbusd ymm (AVX-VNNI) into
 * int32 as at level 3, or (without it) pmaddubsw of u8 codes × s8 x summed in int16 and widened by pmaddwd, no
 * more products per int16 sum than stay exact: Q4_x / Q4_K u ≤ 15, 8 maddubs (8 · 2 · 15 · 127 = 30480); Q6_K
 * u ≤ 63, 2 (2 · 2 · 63 · 127 = 32004); Q8_0 the file's signed codes w as |w| × sign(x, w), 1 (2 · 128 · 127 =
 * 32512), and no −z·Σq (Σ w·q is the dot itself). */
static inline __m256i bc4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(ld16(p)); }
static inline __m256 s8x8(const uint8_t *p) {              /* 8 int8 → float */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 u8x8(const uint8_t *p) {              /* 8 uint8 → float */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* s += the products u · x of each lane of 4: int32 (VNNI), or int16 pairs (maddubs) until iwide() */
static inline __attribute__((always_inline)) __m256i isum(__m256i s, __m256i u, __m256i x) {
#if BQ8_VNNI
    return _mm256_dpbusd_avx_epi32(s, u, x);
#else
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x));
#endif
}
static inline __attribute__((always_inline)) __m256i iwide(__m256i s) {      /* isum's sums → int32 per lane */
#if BQ8_VNNI
    return s;
#else
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}
/* int16 sums widened after this many chunks (Q6_K, Q8_0); Q4_x / Q4_K: once per block */
#define FLUSH_Q6 (BQ8_VNNI ? 4 : 2)
#define FLUSH_Q8 (BQ8_VNNI ? 8 : 1)
#define Q8_SIGNED (!BQ8_VNNI)           /* Q8_0 as |w| × sign(x, w): no zero, no −z·Σq */

/* block j of half hf of a tile (W rows 8·hf .. 8·hf + 7 of it) for x rows [m0, m0 + MB) → acc[MB]; kd, kdm:
 * Q4_K's d and dmin of these rows (the super-block's) */
static inline __attribute__((always_inline)) void block8(const int fmt, const int MB, const int P, const uint8_t *wb,
                                                         const int hf, const xnat *X, int64_t m0, int64_t j,
                                                         __m256 kd, __m256 kdm, __m256 *acc) {
    const int64_t nb = X->nb, k = X->k;
    const int q8 = fmt == Q8_0, six = fmt == Q6_K, codes = q8 ? 512 : 256;
    const uint8_t *wc = wb + 32 * hf;                      /* this half's 32 bytes of every 64-byte chunk */
    const __m256 d6 = six ? f16x8(wb + 384 + 16 * hf) : _mm256_setzero_ps();
    /* the K-quants: d · sc, unpack()'s float product (Q4_K's mn: −(dmin · min)) */
    const __m256 ws = fmt == Q4_K ? _mm256_mul_ps(kd, u8x8(wb + 256 + 8 * hf))
                    : six ? _mm256_mul_ps(d6, s8x8(wb + 416 + 8 * hf))
                    : f16x8(wb + codes + 16 * hf);
    const __m256 mn = fmt == Q4_1 ? f16x8(wb + codes + 32 + 16 * hf)
                    : fmt == Q4_K ? _mm256_xor_ps(_mm256_mul_ps(kdm, u8x8(wb + 272 + 8 * hf)), _mm256_set1_ps(-0.f))
                    : six ? _mm256_mul_ps(d6, s8x8(wb + 432 + 8 * hf))        /* Q6_K's ws₁ */
                    : _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256i sh[8], sl[8], th[8], tl[8];                    /* int32 sums; isum's partials */
    if (six) {          /* one half of 16 elements at a time (its own scale), as at level 3 */
        for (int eh = 0; eh < 2; eh++) {
            const __m256i hb = ld32(wc + 256 + 64 * eh);
            for (int i = 0; i < MB; i++) sh[i] = sl[i] = th[i] = tl[i] = zero;
            for (int c = 0; c < 4; c++) {
                const __m256i v = ld32(wc + 64 * c);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), _mm256_set1_epi8(3));
                const __m256i a = _mm256_or_si256(_mm256_and_si256(eh ? _mm256_srli_epi16(v, 4) : v, nib),
                                                  _mm256_slli_epi16(top, 4));   /* | the high 2 bits << 4 */
                for (int i = 0; i < MB; i++) {
                    const int64_t e = (m0 + i) * k + 32 * j + 16 * eh + 4 * c;
                    th[i] = isum(th[i], a, bc4(X->xh + e));
                    if (P == 2) tl[i] = isum(tl[i], a, bc4(X->xl + e));
                }
                if ((c + 1) % FLUSH_Q6 == 0)
                    for (int i = 0; i < MB; i++) {
                        sh[i] = _mm256_add_epi32(sh[i], iwide(th[i])); th[i] = zero;
                        if (P == 2) { sl[i] = _mm256_add_epi32(sl[i], iwide(tl[i])); tl[i] = zero; }
                    }
            }
            for (int i = 0; i < MB; i++) {
                const int64_t r = (m0 + i) * nb + j;
                __m256i s = sh[i];
                if (P == 2) s = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(s, 8), s), sl[i]);
                s = _mm256_add_epi32(s, _mm256_set1_epi32(X->nzh[2 * r + eh]));
                const __m256 wd = _mm256_mul_ps(eh ? mn : ws, _mm256_set1_ps(X->d[r]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), wd, acc[i]);
            }
        }
        return;
    }
    for (int i = 0; i < MB; i++) sh[i] = sl[i] = th[i] = tl[i] = zero;
    if (q8) {
        for (int c = 0; c < 8; c++) {
            const __m256i v = ld32(wc + 64 * c);
            const __m256i u = Q8_SIGNED ? _mm256_abs_epi8(v) : _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
            for (int i = 0; i < MB; i++) {
                const int64_t e = (m0 + i) * k + 32 * j + 4 * c;
                const __m256i xh = bc4(X->xh + e);
                th[i] = isum(th[i], u, Q8_SIGNED ? _mm256_sign_epi8(xh, v) : xh);
                if (P == 2) {
                    const __m256i xl = bc4(X->xl + e);
                    tl[i] = isum(tl[i], u, Q8_SIGNED ? _mm256_sign_epi8(xl, v) : xl);
                }
            }
            if ((c + 1) % FLUSH_Q8 == 0)
                for (int i = 0; i < MB; i++) {
                    sh[i] = _mm256_add_epi32(sh[i], iwide(th[i])); th[i] = zero;
                    if (P == 2) { sl[i] = _mm256_add_epi32(sl[i], iwide(tl[i])); tl[i] = zero; }
                }
        }
    } else {
        for (int c = 0; c < 4; c++) {
            const __m256i v = ld32(wc + 64 * c);
            const __m256i a = _mm256_and_si256(v, nib), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            for (int i = 0; i < MB; i++) {
                const int64_t e = (m0 + i) * k + 32 * j + 4 * c;
                th[i] = isum(isum(th[i], a, bc4(X->xh + e)), h, bc4(X->xh + e + 16));
                if (P == 2) tl[i] = isum(isum(tl[i], a, bc4(X->xl + e)), h, bc4(X->xl + e + 16));
            }
        }
        for (int i = 0; i < MB; i++) { sh[i] = iwide(th[i]); sl[i] = iwide(tl[i]); }
    }
    for (int i = 0; i < MB; i++) {
        const int64_t r = (m0 + i) * nb + j;
        __m256i s = P == 2 ? _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(sh[i], 8), sh[i]), sl[i]) : sh[i];
        if (!(q8 && Q8_SIGNED)) s = _mm256_add_epi32(s, _mm256_set1_epi32(X->nzq[r]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws, _mm256_set1_ps(X->d[r])), acc[i]);
        if (fmt == Q4_1 || fmt == Q4_K) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(X->dsq[r]), acc[i]);
    }
}

/* x rows [m0, m0 + MB) against one tile of 16 W rows → res [MB][2] (half h, lane r = W row 16·t + 8·h + r):
 * per block both halves, so each 64-byte chunk is read once. Software prefetch: without it the tiled Q8_0
 * copy streamed from memory at 0.6-0.7x the per-lane kernel's speed on an AVX2 EPYC (8192x2048, one row),
 * with it 1.7x (docs/benchmarks.md, 2026-12-03) */
#define TILED_PF 4096
static inline __attribute__((always_inline)) void tile16(const int fmt, const int MB, const int P,
                                                         const uint8_t *wt, const xnat *X, int64_t m0,
                                                         __m256 (*res)[2]) {
    __m256 acc[2][8], kd[2], kdm[2];                       /* Q4_K: the super-block's d and dmin, per half */
    kd[0] = kd[1] = kdm[0] = kdm[1] = _mm256_setzero_ps();
    for (int i = 0; i < MB; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < X->nb; j++) {
        const uint8_t *wb = wt + tiled_at(fmt, j);
        const int64_t span = tiled_at(fmt, j + 1) - tiled_at(fmt, j);        /* Q4_K's 8th block: + d, dmin */
        if (m0 == 0)        /* the first x rows of a chunk stream it from memory: every line TILED_PF ahead */
            for (int64_t o = 0; o < span; o += 64) __builtin_prefetch(wb + o + TILED_PF);
        if (fmt == Q4_K && !(j & 7))
            for (int hf = 0; hf < 2; hf++) {
                const uint8_t *dm = wt + (j >> 3) * K4_SUPER + K4_DM + 16 * hf;
                kd[hf] = f16x8(dm);
                kdm[hf] = f16x8(dm + 32);
            }
        for (int hf = 0; hf < 2; hf++) block8(fmt, MB, P, wb, hf, X, m0, j, kd[hf], kdm[hf], acc[hf]);
    }
    for (int i = 0; i < MB; i++) { res[i][0] = acc[0][i]; res[i][1] = acc[1][i]; }
}

/* 8 lanes → y[off ..] (bf16: rounded to nearest even, as torch does), the first `left` of them when left < 8 */
static inline void store8(void *y, int y_bf16, int64_t off, __m256 v, int64_t left) {
    if (!y_bf16) {
        if (left >= 8) _mm256_storeu_ps((float *)y + off, v);
        else _mm256_maskstore_ps((float *)y + off, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));   /* ≤ 0xFFFF */
    if (left >= 8) { _mm_storeu_si128((__m128i *)((uint16_t *)y + off), h); return; }
    uint16_t t[8];
    _mm_storeu_si128((__m128i *)t, h);
    memcpy((uint16_t *)y + off, t, sizeof(uint16_t) * (size_t)left);
}

#define TILED_RUN(F, MB, P)                                                                               \
    static void tiled_##F##_##MB##_##P(const uint8_t *w, int64_t n, int64_t t0, int64_t t1, const xnat *X,  \
                                       int64_t m0, void *y, int64_t ldy, int yb) {                       \
        const int64_t tb = tiled_at(F, X->nb);                                                            \
        __m256 res[MB][2];                                                                                \
        for (int64_t t = t0; t < t1; t++) {                                                               \
            tile16(F, MB, P, w + t * tb, X, m0, res);                                                     \
            for (int h = 0; h < 2; h++) {                                                                 \
                const int64_t left = n - 16 * t - 8 * h;                                                  \
                if (left > 0)                                                                             \
                    for (int i = 0; i < MB; i++) store8(y, yb, (m0 + i) * ldy + 16 * t + 8 * h, res[i][h], left); \
            }                                                                                             \
        }                                                                                                 \
    }
#endif
#define TILED_P(F, P) TILED_RUN(F, 1, P) TILED_RUN(F, 2, P) TILED_RUN(F, 4, P) TILED_RUN(F, 8, P)
#define TILED(F) TILED_P(F, 1) TILED_P(F, 2)
TILED(Q4_0) TILED(Q4_1) TILED(Q8_0) TILED(Q4_K) TILED(Q6_K)

#ifndef TILED_MB
#define TILED_MB (BQ8_LEVEL == 3 ? 8 : 4)       /* x rows per pass over a tile: 8 zmm accumulators, or 2 · 4 ymm */
#endif
typedef void (*tiled_fn)(const uint8_t *, int64_t, int64_t, int64_t, const xnat *, int64_t, void *, int64_t, int);
#define TILED_ROW(F, P) {tiled_##F##_1_##P, tiled_##F##_2_##P, tiled_##F##_4_##P, tiled_##F##_8_##P}

#if BQ8_LEVEL == 3
/* x [m, k] → the tiled kernel's x: per block of 32, the codes of chatserve_bq8_quantize (the same float
 * arithmetic, vectorised: amax, top / amax, x · that rounded to nearest even) as planes xp [P, m, k] (P = 2:
 * qh then ql, q = 255 · qh + ql), −z·Σq [m, k / 32], −z·Σq per half [m, k / 16], d and d·Σq [m, k / 32] */
static void prep_x_tiled(const void *x, int x_bf16, int64_t m, int64_t k, int P, int z, int8_t *xp, int32_t *nzq,
                         int32_t *nzh, float *d, float *dsq) {
    const float top = P == 2 ? 32512.f : 127.f;
    const int64_t nb = k / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < nb; j++) {
            const int64_t base = r * k + 32 * j;
            __m512 v[2];
            for (int h = 0; h < 2; h++)
                v[h] = x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + 16 * h))), 16))
                              : _mm512_loadu_ps((const float *)x + base + 16 * h);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absmask),
                                                                  _mm512_and_ps(v[1], absmask)));
            const float inv = amax > 0.f ? top / amax : 0.f;
            int32_t s = 0;
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
                const int32_t sh = _mm512_reduce_add_epi32(q);
                s += sh;
                nzh[2 * (r * nb + j) + h] = -z * sh;
                if (P == 1) { _mm_storeu_si128((__m128i *)(xp + base + 16 * h), _mm512_cvtepi32_epi8(q)); continue; }
                /* qh = trunc((q ± 127) / 255) (exact in float: |q| + 127 < 2^15), ql = q − 255 · qh */
                const __mmask16 neg = _mm512_cmplt_epi32_mask(q, _mm512_setzero_si512());
                const __m512i t = _mm512_mask_sub_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), neg,
                                                        q, _mm512_set1_epi32(127));
                const __m512i qh = _mm512_cvttps_epi32(_mm512_div_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(255.f)));
                const __m512i ql = _mm512_sub_epi32(q, _mm512_mullo_epi32(qh, _mm512_set1_epi32(255)));
                _mm_storeu_si128((__m128i *)(xp + base + 16 * h), _mm512_cvtepi32_epi8(qh));
                _mm_storeu_si128((__m128i *)(xp + m * k + base + 16 * h), _mm512_cvtepi32_epi8(ql));
            }
            d[r * nb + j] = amax / top;
            nzq[r * nb + j] = -z * s;
            dsq[r * nb + j] = d[r * nb + j] * (float)s;
        }
}

#else
/* 32 int32 (4 ymm, in order) → 32 int8 at p (values in [-127, 127]) */
static inline void store_s8x32(int8_t *p, const __m256i *q) {
    const __m256i a = _mm256_packs_epi32(q[0], q[1]), b = _mm256_packs_epi32(q[2], q[3]);   /* per 128-bit lane */
    _mm256_storeu_si256((__m256i *)p, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b),
                                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* level 3's prep_x_tiled at level 2: the same codes, planes, sums and scales */
static void prep_x_tiled(const void *x, int x_bf16, int64_t m, int64_t k, int P, int z, int8_t *xp, int32_t *nzq,
                         int32_t *nzh, float *d, float *dsq) {
    const float top = P == 2 ? 32512.f : 127.f;
    const int64_t nb = k / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < nb; j++) {
            const int64_t base = r * k + 32 * j;
            __m256 v[4];
            for (int e = 0; e < 4; e++)
                v[e] = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                    _mm_loadu_si128((const __m128i *)((const uint16_t *)x + base + 8 * e))), 16))
                              : _mm256_loadu_ps((const float *)x + base + 8 * e);
            const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                            _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            const float inv = amax > 0.f ? top / amax : 0.f;
            __m256i q[4];
            for (int e = 0; e < 4; e++) q[e] = _mm256_cvtps_epi32(_mm256_mul_ps(v[e], _mm256_set1_ps(inv)));
            int32_t s = 0;
            for (int hh = 0; hh < 2; hh++) {
                const int32_t sh = hsum_i32(_mm256_add_epi32(q[2 * hh], q[2 * hh + 1]));
                s += sh;
                nzh[2 * (r * nb + j) + hh] = -z * sh;
            }
            if (P == 1) store_s8x32(xp + base, q);
            else {
                /* qh = trunc((q ± 127) / 255) (exact in float: |q| + 127 < 2^15), ql = q − 255 · qh */
                __m256i qh[4], ql[4];
                for (int e = 0; e < 4; e++) {
                    const __m256i t = _mm256_add_epi32(q[e], _mm256_sign_epi32(_mm256_set1_epi32(127), q[e]));
                    qh[e] = _mm256_cvttps_epi32(_mm256_div_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(255.f)));
                    ql[e] = _mm256_sub_epi32(q[e], _mm256_mullo_epi32(qh[e], _mm256_set1_epi32(255)));
                }
                store_s8x32(xp + base, qh);
                store_s8x32(xp + m * k + base, ql);
            }
            d[r * nb + j] = amax / top;
            nzq[r * nb + j] = -z * s;
            dsq[r * nb + j] = d[r * nb + j] * (float)s;
        }
}
#endif

/* x [m, k] (fp32, or bf16 when x_bf16) · W ᵀ for W tiled by chatserve_bq8_tile → y [m, n] at row stride ldy
 * (bf16 when y_bf16). Threads split tiles; above 8 rows (level 3; level 2 always) each thread runs its tiles in
 * chunks of ~CHUNK_BYTES against every block of x rows (8 at level 3, 4, 2, 1), so the weights stream once. A
 * row's arithmetic is the same for every m, chunking and thread count. 0 on success, 1 bad argument, 2 no
 * memory. */
int chatserve_bq8_tiled(int fmt, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t m, int x_bf16,
                        int x_bits, void *y, int64_t ldy, int y_bf16, int nt) {
    if (!tiled_fmt(fmt) || k % 32 || k % block_elems(fmt) || (x_bits != 8 && x_bits != 15)) return 1;
    if (nt < 1) nt = 1;
    const int P = x_bits == 15 ? 2 : 1;
    const int64_t nb = k / 32, tiles = (n + 15) / 16, tile_bytes = tiled_at(fmt, nb);
    /* the call's x scratch, kept per calling thread between calls (grown as needed): no allocation per call */
    static __thread int8_t *xp;
    static __thread float *d, *dsq;
    static __thread int32_t *nzq, *nzh;
    static __thread int64_t have_x, have_b;
    if (m * k * P > have_x) {
        free(xp);
        xp = malloc((size_t)(m * k * P));
        have_x = xp ? m * k * P : 0;
    }
    if (m * nb > have_b) {
        free(d); free(dsq); free(nzq); free(nzh);
        d = malloc(sizeof(float) * (size_t)(m * nb)); dsq = malloc(sizeof(float) * (size_t)(m * nb));
        nzq = malloc(sizeof(int32_t) * (size_t)(m * nb)); nzh = malloc(sizeof(int32_t) * (size_t)(2 * m * nb));
        have_b = d && dsq && nzq && nzh ? m * nb : 0;
    }
    if (!have_x || !have_b) return 2;
    prep_x_tiled(x, x_bf16, m, k, P, zero_of(fmt), xp, nzq, nzh, d, dsq);
    const xnat X = {xp, P == 2 ? xp + m * k : xp, nzq, nzh, d, dsq, k, nb};
    static const tiled_fn fns[5][2][4] = {{TILED_ROW(Q4_0, 1), TILED_ROW(Q4_0, 2)},
                                          {TILED_ROW(Q4_1, 1), TILED_ROW(Q4_1, 2)},
                                          {TILED_ROW(Q8_0, 1), TILED_ROW(Q8_0, 2)},
                                          {TILED_ROW(Q4_K, 1), TILED_ROW(Q4_K, 2)},
                                          {TILED_ROW(Q6_K, 1), TILED_ROW(Q6_K, 2)}};
    const tiled_fn *f = fns[fmt == Q4_0 ? 0 : fmt == Q4_1 ? 1 : fmt == Q8_0 ? 2 : fmt == Q4_K ? 3 : 4][P - 1];
    /* level 2 always chunks: in passes of ≤ 4 rows, m = 3 or 5-8 would stream the weights more than once */
    int64_t chunk = BQ8_LEVEL == 3 && m <= 8 ? tiles : CHUNK_BYTES / tile_bytes;
    if (chunk < 1) chunk = 1;
    if (tiles < 4 * nt) nt = 1;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int part = 0; part < nt; part++) {
        const int64_t p0 = tiles * part / nt, p1 = tiles * (part + 1) / nt;
        for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < p1 ? c0 + chunk : p1;
            for (int64_t m0 = 0; m0 < m;) {
                const int64_t left = m - m0, mb = left >= 8 && TILED_MB >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                f[mb == 8 ? 3 : mb == 4 ? 2 : mb == 2 ? 1 : 0](w, n, c0, c1, &X, m0, y, ldy, y_bf16);
                m0 += mb;
            }
        }
    }
    return 0;
}
#else
int chatserve_bq8_unpack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *u,
                         float *ws, float *mn) { return 3; }
int chatserve_bq8_dots(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const int16_t *q,
                       int64_t m, int planes, int32_t *out) { return 3; }
int chatserve_bq8(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int64_t m,
                  int x_bf16, int x_bits, void *y, int64_t ldy, int y_bf16, int nt) { return 3; }
int chatserve_bq8_tile(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *dst) { return 3; }
int chatserve_bq8_tiled(int fmt, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t m, int x_bf16,
                        int x_bits, void *y, int64_t ldy, int y_bf16, int nt) { return 3; }
#endif
