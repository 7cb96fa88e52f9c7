/* Weight-only quantized matmul for the few-row (decode) steps on the CPU: y[M, N] = x[M, K] · Wᵀ, with W
 * stored as 4- or 8-bit codes in groups of 32 along K (value = lo + code · scale, per row and group), in one
 * pass over the packed weights.
 * x is quantized per group of 32 on the fly and every dot product is exact integer work:
 *   4-bit: x as 15-bit codes in two int8 planes (two dots per chunk), finer than the bf16 x torch's int4
 *          kernel takes; 8-bit x here moved the decoder's logits visibly away from float32's.
 *   8-bit: x as 15-bit codes (two planes) under fp32 activations, which include the LM head's rows (float_out),
 *          and as int8 codes under bf16 ones; int8 x on the head flipped a near-tie of the default model's
 *          greedy answer ("Paris") on an AVX2 box (qmm_planes).
 *
 * Layout (built by cpu_qmatmul.py): rows in tiles of 16 (a 32-bit lane per row), and per (tile, group):
 *   8-bit: 8 chunks of 64 bytes; byte 4·r + i of chunk j is row r's code at k = 4·j + i;
 *   4-bit: 4 chunks of 64 bytes; byte 4·r + i of chunk c holds row r's codes at k = 8·c + i (low nibble)
 *          and k = 8·c + 4 + i (high nibble).
 * Scales and lows: [tiles, G, 32] fp16, the 16 rows' scales then their lows (GGUF Q4_1 keeps both in fp16).
 *
 * Two levels, picked by what -march=native targets (cpu_build.py builds it at first use), same layout:
 *   3: AVX-512 F/BW + VNNI: a tile is one zmm of 16 lanes; the dots are vpdpbusd (u8 codes × s8 x).
 *   2: AVX2 + FMA + F16C: a tile is two halves of 8 lanes (rows 0-7, then 8-15: the halves of each 64-byte
 *      chunk); the dots are AVX-VNNI's vpdpbusd where the compiler targets it, else pmaddubsw on codes ≤ 15
 *      (a 4-bit nibble, or an 8-bit code split into its nibbles) with int16 sums over the group (at most
 *      8 · 2 · 15 · 128 = 30720, no saturation) widened once by pmaddwd.
 * The dots are exact integers at both, and the float epilogue per lane is the same operations in the same
 * order, so a row's output bits are the same at both levels, every row count and thread count. Without
 * AVX2 + FMA + F16C chatserve_qmm_tile() returns 0 and the caller keeps torch's kernels.
 * Define QMM_LEVEL (2 or 3) and QMM_MADDUBS before this file to force a level (the tests compare them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef QMM_LEVEL
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMM_LEVEL 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_LEVEL 2
#else
#define QMM_LEVEL 0
#endif
#endif

#if QMM_LEVEL
#include <immintrin.h>
#define QMM_TILE 16
#else
#define QMM_TILE 0
#endif

#if QMM_LEVEL == 3 || (QMM_LEVEL == 2 && defined(__AVXVNNI__) && !defined(QMM_MADDUBS))
#define QMM_VNNI 1
#else
#define QMM_VNNI 0
#endif

#define GROUP 32

int chatserve_qmm_tile(void) { return QMM_TILE; }

/* 10 · level + 1 where the dots are VNNI instructions: 31, 21 (AVX-VNNI), 20 (maddubs), or 0 */
int chatserve_qmm_level(void) { return QMM_LEVEL * 10 + QMM_VNNI; }

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {(uint32_t)x << 16};
    return c.f;
}

/* x [M, K] (fp32, or bf16 when bf16 != 0) → per group of 32: codes of `top` levels each side of zero
 * (rounded to nearest), their scale sx [M, G] and the exact sum of the group xs [M, G]. top = 127: int8
 * codes in xh; top = 32639: 15-bit codes split into two int8 planes, code = 256 · xh + xl with xl in
 * [-128, 127] (32639 = 127 · 256 + 127 keeps xh in int8). */
static void quantize_rows(const void *x, int bf16, int64_t M, int64_t K, float top, int8_t *xh, int8_t *xl,
                          float *sx, float *xs, int nthreads) {
    const int64_t G = K / GROUP;
    /* rows split over threads (each row's arithmetic is its own); the max and the rounding inline, not as
     * fmaxf/lrintf calls (the same values: NaN is skipped by both maxes, rintf rounds as lrintf does): 16 rows
     * of a 1,536-wide x took 137 µs through the calls, most of a decode step's matmul at that width */
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && M > 1 && M * K >= 8192)
    for (int64_t m = 0; m < M; m++) {
        float v[GROUP];
        for (int64_t g = 0; g < G; g++) {
            const int64_t base = m * K + g * GROUP;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < GROUP; i++) {
                v[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            const float inv = amax > 0.f ? top / amax : 0.f;
            for (int i = 0; i < GROUP; i++) {
                const int32_t q = (int32_t)__builtin_rintf(v[i] * inv);
                if (!xl) {
                    xh[base + i] = (int8_t)q;
                    continue;
                }
                const int32_t lo8 = ((q + 128) & 255) - 128;
                xl[base + i] = (int8_t)lo8;
                xh[base + i] = (int8_t)((q - lo8) / 256);
            }
            sx[m * G + g] = amax / top;
            xs[m * G + g] = sum;
        }
    }
}

#if QMM_TILE
/* The vector of one level: VL lanes (a row each) of fp32 (vf) or 32-bit integers (vi). */
#if QMM_LEVEL == 3
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_of_i32(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_load_ph(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1_8(char a) { return _mm512_set1_epi8(a); }
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_shl32(vi a, int n) { return _mm512_slli_epi32(a, n); }
static inline vi vi_nib_hi(vi a) { return _mm512_srli_epi16(a, 4); }
static inline vi vi_bcast4(const int32_t *p) { return _mm512_set1_epi32(*p); }

/* lanes [0, left) of v to out + off (fp32, or bf16 rounded to nearest even as torch does) */
static inline void store_row(void *out, int bf16, int64_t off, vf v, int64_t left) {
    const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)out + off, keep, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)out + off, keep, _mm512_cvtepi32_epi16(r));
}
#else
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_of_i32(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vf_load_ph(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set1_8(char a) { return _mm256_set1_epi8(a); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_shl32(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vi vi_nib_hi(vi a) { return _mm256_srli_epi16(a, 4); }
static inline vi vi_bcast4(const int32_t *p) { return _mm256_set1_epi32(*p); }

static inline void store_row(void *out, int bf16, int64_t off, vf v, int64_t left) {
    if (!bf16) {
        if (left >= 8) {
            _mm256_storeu_ps((float *)out + off, v);
        } else {
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_maskstore_ps((float *)out + off, keep, v);
        }
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    /* r ≤ 0xFFFF: packus keeps it; the two 128-bit halves' four words each to the low half */
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
    if (left >= 8) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + off), h);
    } else {
        uint16_t tmp[8];
        _mm_storeu_si128((__m128i *)tmp, h);
        memcpy((uint16_t *)out + off, tmp, sizeof(uint16_t) * (size_t)left);
    }
}
#endif

/* Exact dots of u8 codes × s8 x per 32-bit lane (4 bytes each), summed over a group in a `dacc`:
 *   VNNI: int32 sums, dacc_add = vpdpbusd on any u8 codes; dacc_sum is the sum itself.
 *   maddubs: int16 pair sums (codes ≤ 15 only: a pair ≤ 2 · 15 · 128 = 3840, eight adds ≤ 30720 < 2^15),
 *            widened to int32 once per group by pmaddwd with ones. An 8-bit code is split into its nibbles
 *            (QMM_SPLIT8), Σ c · q = 16 · Σ hi · q + Σ lo · q. */
#if QMM_VNNI
#define QMM_SPLIT8 0
static inline vi dacc_add(vi d, vi codes, vi q) {
#if QMM_LEVEL == 3
    return _mm512_dpbusd_epi32(d, codes, q);
#else
    return _mm256_dpbusd_avx_epi32(d, codes, q);
#endif
}
static inline vi dacc_sum(vi d) { return d; }
#else
#define QMM_SPLIT8 1
static inline vi dacc_add(vi d, vi codes, vi q) { return _mm256_add_epi16(d, _mm256_maddubs_epi16(codes, q)); }
static inline vi dacc_sum(vi d) { return _mm256_madd_epi16(d, _mm256_set1_epi16(1)); }
#endif

/* Tiles [t0, t1) for MB rows of x, VL rows of a tile at a time (the tile's 16 / VL parts: part h reads bytes
 * [4 · VL · h, 4 · VL · (h + 1)) of each 64-byte chunk and the scales and lows of its rows): the accumulators
 * stay in registers across the K loop, and each row's dot products run in NC independent chains (4/MB for
 * 8-bit; half that for 4-bit, whose two planes already double them) so that the dot instructions' latency is
 * hidden. 4-bit codes and their scales are prefetched QMM_PREFETCH bytes (the scales QMM_PREFETCH / 2) ahead
 * by a tile's first part: a one-row pass over weights streaming from memory was bound by the hardware
 * prefetcher (issue 32, EPYC Zen 4, 1 thread: a MoE layer's 8 experts -15 % time, a 5120 x 2048 matrix
 * -40 %; the results are unchanged). */
#define QMM_PREFETCH 4096
#define TILE_HEAD(MB, GB)                                                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                                \
          for (int h = 0; h < 16 / VL && N - t * 16 - h * VL > 0; h++) {                                   \
            const uint8_t *wt = w + t * G * (GB) + 4 * VL * h;                                             \
            vf acc[MB], accl[MB];                                                                          \
            for (int m = 0; m < MB; m++) acc[m] = accl[m] = vf_zero();                                     \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const uint8_t *wg = wt + g * (GB);                                                         \
                if ((GB) == 256 && h == 0) {    /* 4-bit codes (8-bit ones measured no faster with it) */  \
                    for (int pl = 0; pl < (GB); pl += 64) __builtin_prefetch(wg + QMM_PREFETCH + pl);      \
                    __builtin_prefetch(sl + (t * G + g) * 32 + QMM_PREFETCH / 4);                          \
                }
/* The group's exact int32 dots ia[MB][NC] → acc += Σ dots · scale · sx, accl += low · Σx; then the part's
 * rows. */
#define TILE_TAIL(MB, NC)                                                                                  \
                const vf s = vf_load_ph(sl + (t * G + g) * 32 + VL * h);                                   \
                const vf l = vf_load_ph(sl + (t * G + g) * 32 + 16 + VL * h);                              \
                for (int m = 0; m < MB; m++) {                                                             \
                    vi dots = ia[m][0];                                                                    \
                    for (int c = 1; c < NC; c++) dots = vi_add32(dots, ia[m][c]);                          \
                    const vf sm = vf_mul(s, vf_set1(sx[m * G + g]));                                       \
                    acc[m] = vf_fmadd(vf_of_i32(dots), sm, acc[m]);                                        \
                    accl[m] = vf_fmadd(l, vf_set1(xs[m * G + g]), accl[m]);                                \
                }                                                                                          \
            }                                                                                              \
            for (int m = 0; m < MB; m++)                                                                   \
                store_row(out, bf16, m * N + t * 16 + VL * h, vf_add(acc[m], accl[m]), N - t * 16 - VL * h); \
          }                                                                                                \
        }

/* 8-bit codes × int8 x (xq [MB, K], scales sx [MB, G]): exact integer dots, then scaled per group. */
#define QMM_TILES_I8(MB, NC)                                                                               \
    static void qmm_i8_##MB(const uint8_t *w, const uint16_t *sl, int64_t G, int64_t K,                    \
                            const int8_t *xq, const float *sx, const float *xs, int64_t t0, int64_t t1,    \
                            int64_t N, void *out, int bf16) {                                              \
        const vi nib = vi_set1_8(0x0F);                                                                    \
        TILE_HEAD(MB, 512)                                                                                 \
                vi ia[MB][NC], ib[MB][NC];                                                                 \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) ia[m][c] = ib[m][c] = vi_zero();                          \
                for (int j = 0; j < 8; j++) {                                                              \
                    const vi v = vi_load(wg + j * 64);                                                     \
                    const vi a = QMM_SPLIT8 ? vi_and(v, nib) : v, b = vi_and(vi_nib_hi(v), nib);           \
                    for (int m = 0; m < MB; m++) {                                                         \
                        const vi q = vi_bcast4((const int32_t *)(xq + m * K + g * GROUP) + j);             \
                        ia[m][j % NC] = dacc_add(ia[m][j % NC], a, q);                                     \
                        if (QMM_SPLIT8) ib[m][j % NC] = dacc_add(ib[m][j % NC], b, q);                     \
                    }                                                                                      \
                }                                                                                          \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++)                                                           \
                        ia[m][c] = QMM_SPLIT8 ? vi_add32(vi_shl32(dacc_sum(ib[m][c]), 4), dacc_sum(ia[m][c])) \
                                             : dacc_sum(ia[m][c]);                                         \
        TILE_TAIL(MB, NC)                                                                                  \
    }
QMM_TILES_I8(1, 4)
QMM_TILES_I8(2, 2)
QMM_TILES_I8(4, 1)
QMM_TILES_I8(8, 1)

/* 4-bit codes × 15-bit x in two int8 planes (xh, xl [MB, K]): two exact integer dots per chunk, joined as
 * 256 · Σ code·xh + Σ code·xl, then scaled per group. */
#define QMM_TILES_I16(MB, NC)                                                                              \
    static void qmm_i16_##MB(const uint8_t *w, const uint16_t *sl, int64_t G, int64_t K, const int8_t *xh, \
                             const int8_t *xl, const float *sx, const float *xs, int64_t t0, int64_t t1,   \
                             int64_t N, void *out, int bf16) {                                             \
        const vi nib = vi_set1_8(0x0F);                                                                    \
        TILE_HEAD(MB, 256)                                                                                 \
                vi ih[MB][NC], il[MB][NC], ia[MB][NC];                                                     \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) ih[m][c] = il[m][c] = vi_zero();                          \
                for (int c = 0; c < 4; c++) {                                                              \
                    const vi v = vi_load(wg + c * 64);                                                     \
                    const vi a = vi_and(v, nib);                                                           \
                    const vi b = vi_and(vi_nib_hi(v), nib);                                                \
                    for (int m = 0; m < MB; m++) {                                                         \
                        const int32_t *hp = (const int32_t *)(xh + m * K + g * GROUP) + 2 * c;             \
                        const int32_t *lp = (const int32_t *)(xl + m * K + g * GROUP) + 2 * c;             \
                        const int k0 = (2 * c) % NC, k1 = (2 * c + 1) % NC;                                \
                        ih[m][k0] = dacc_add(ih[m][k0], a, vi_bcast4(hp));                                 \
                        il[m][k0] = dacc_add(il[m][k0], a, vi_bcast4(lp));                                 \
                        ih[m][k1] = dacc_add(ih[m][k1], b, vi_bcast4(hp + 1));                             \
                        il[m][k1] = dacc_add(il[m][k1], b, vi_bcast4(lp + 1));                             \
                    }                                                                                      \
                }                                                                                          \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++)                                                           \
                        ia[m][c] = vi_add32(vi_shl32(dacc_sum(ih[m][c]), 8), dacc_sum(il[m][c]));          \
        TILE_TAIL(MB, NC)                                                                                  \
    }
QMM_TILES_I16(1, 2)
QMM_TILES_I16(2, 1)
QMM_TILES_I16(4, 1)
QMM_TILES_I16(8, 1)

/* 8-bit codes × 15-bit x in two int8 planes (fp32 activations, see qmm_planes): per chunk the dots of both
 * planes (of both nibbles under QMM_SPLIT8), joined as 256 · Σ code·xh + Σ code·xl, then scaled per group.
 * |Σ| over a group ≤ 32 · 255 · 32639 < 2^31. */
#define QMM_TILES_I8X16(MB, NC)                                                                            \
    static void qmm_i8x16_##MB(const uint8_t *w, const uint16_t *sl, int64_t G, int64_t K,                 \
                               const int8_t *xh, const int8_t *xl, const float *sx, const float *xs,       \
                               int64_t t0, int64_t t1, int64_t N, void *out, int bf16) {                   \
        const vi nib = vi_set1_8(0x0F);                                                                    \
        TILE_HEAD(MB, 512)                                                                                 \
                vi ha[MB][NC], la[MB][NC], hb[MB][NC], lb[MB][NC], ia[MB][NC];                             \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) ha[m][c] = la[m][c] = hb[m][c] = lb[m][c] = vi_zero();    \
                for (int j = 0; j < 8; j++) {                                                              \
                    const vi v = vi_load(wg + j * 64);                                                     \
                    const vi a = QMM_SPLIT8 ? vi_and(v, nib) : v, b = vi_and(vi_nib_hi(v), nib);           \
                    for (int m = 0; m < MB; m++) {                                                         \
                        const vi qh = vi_bcast4((const int32_t *)(xh + m * K + g * GROUP) + j);            \
                        const vi ql = vi_bcast4((const int32_t *)(xl + m * K + g * GROUP) + j);            \
                        ha[m][j % NC] = dacc_add(ha[m][j % NC], a, qh);                                    \
                        la[m][j % NC] = dacc_add(la[m][j % NC], a, ql);                                    \
                        if (QMM_SPLIT8) {                                                                  \
                            hb[m][j % NC] = dacc_add(hb[m][j % NC], b, qh);                                \
                            lb[m][j % NC] = dacc_add(lb[m][j % NC], b, ql);                                \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) {                                                         \
                        const vi dh = QMM_SPLIT8 ? vi_add32(vi_shl32(dacc_sum(hb[m][c]), 4), dacc_sum(ha[m][c])) \
                                                 : dacc_sum(ha[m][c]);                                     \
                        const vi dl = QMM_SPLIT8 ? vi_add32(vi_shl32(dacc_sum(lb[m][c]), 4), dacc_sum(la[m][c])) \
                                                 : dacc_sum(la[m][c]);                                     \
                        ia[m][c] = vi_add32(vi_shl32(dh, 8), dl);                                          \
                    }                                                                                      \
        TILE_TAIL(MB, NC)                                                                                  \
    }
QMM_TILES_I8X16(1, 2)
QMM_TILES_I8X16(2, 1)
QMM_TILES_I8X16(4, 1)
QMM_TILES_I8X16(8, 1)

/* One block of mb (8, 4, 2 or 1) rows of quantized x (codes h and, with two planes, l; sx s, Σx u [mb, G])
 * through tiles [t0, t1) into o (mb rows of N): the tile kernel for the codes' bits and x's planes. */
static void qmm_block(int bits, int planes, int64_t mb, const uint8_t *w, const uint16_t *sl, int64_t G,
                      int64_t K, const int8_t *h, const int8_t *l, const float *s, const float *u, int64_t t0,
                      int64_t t1, int64_t N, void *o, int bf16) {
    if (bits == 4) {
        if (mb == 8) qmm_i16_8(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else if (mb == 4) qmm_i16_4(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else if (mb == 2) qmm_i16_2(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else qmm_i16_1(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
    } else if (planes == 2) {
        if (mb == 8) qmm_i8x16_8(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else if (mb == 4) qmm_i8x16_4(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else if (mb == 2) qmm_i8x16_2(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
        else qmm_i8x16_1(w, sl, G, K, h, l, s, u, t0, t1, N, o, bf16);
    } else {
        if (mb == 8) qmm_i8_8(w, sl, G, K, h, s, u, t0, t1, N, o, bf16);
        else if (mb == 4) qmm_i8_4(w, sl, G, K, h, s, u, t0, t1, N, o, bf16);
        else if (mb == 2) qmm_i8_2(w, sl, G, K, h, s, u, t0, t1, N, o, bf16);
        else qmm_i8_1(w, sl, G, K, h, s, u, t0, t1, N, o, bf16);
    }
}
#endif



/* Planes of x codes: 2 (15-bit codes) for 4-bit weights, and for 8-bit ones under fp32 activations, whose
 * model computes everything else in fp32 (int8 x moved the default model's greedy answer on an AVX2 box:
 * an LM-head near-tie of 0.004 against fp32's 0.08 margin); 1 (int8 codes) for 8-bit weights under bf16
 * activations, already as coarse as int8 x. */
static inline int qmm_planes(int bits, int bf16) { return bits == 4 || !bf16 ? 2 : 1; }

#if QMM_TILE
/* Rows [0, M) of quantized x (codes xh [M, K] and, with two planes, xl; sx, xs [M, G]) through tiles [t0, t1)
 * of one packed matrix into y [M, N] (fp32, or bf16 when bf16 != 0), in row blocks of 8, 4, 2, 1: chatserve_qmm's
 * chunks and cpu_moe.c's expert groups. */
static void qmm_rows(int bits, const uint8_t *w, const uint16_t *sl, int64_t N, int64_t K, const int8_t *xh,
                     const int8_t *xl, const float *sx, const float *xs, int64_t M, int64_t t0, int64_t t1,
                     char *y, int bf16) {
    const int64_t G = K / GROUP;
    const size_t ybytes = bf16 ? 2 : 4;
    const int planes = qmm_planes(bits, bf16);
    for (int64_t m = 0; m < M;) {
        const int64_t mb = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
        qmm_block(bits, planes, mb, w, sl, G, K, xh + m * K, planes == 2 ? xl + m * K : NULL, sx + m * G,
                  xs + m * G, t0, t1, N, y + (size_t)(m * N) * ybytes, bf16);
        m += mb;
    }
}
#endif

#define CHUNK_BYTES (96 * 1024)      /* codes + scales a chunk of tiles holds: well inside L2 */

/* y[M, N] (fp32, or bf16 when bf16 != 0) = x[M, K] · Wᵀ for packed W (see the top). K % 32 == 0.
 * Returns 0, or -1 when this build has no tile kernels or the scratch could not be allocated. */
int chatserve_qmm(const uint8_t *w, const uint16_t *sl, int bits, int64_t N, int64_t K,
                  const void *x, int64_t M, void *y, int bf16, int nthreads) {
#if QMM_TILE
    const int64_t G = K / GROUP, tiles = (N + 15) / 16;
    const int planes = qmm_planes(bits, bf16);
    int8_t *xq = malloc((size_t)(M * K) * (size_t)planes);      /* int8 codes, or two int8 planes */
    float *sx = malloc(sizeof(float) * (size_t)(M * G)), *xs = malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !sx || !xs) {
        free(xq); free(sx); free(xs);
        return -1;
    }
    quantize_rows(x, bf16, M, K, planes == 2 ? 32639.f : 127.f, xq, planes == 2 ? xq + M * K : NULL, sx, xs,
                  nthreads);
    const int nt = nthreads > 1 && tiles >= 8 ? nthreads : 1;
    /* More than 8 rows: each thread's tiles in chunks of ~CHUNK_BYTES of codes and scales, every row block
     * over a chunk before the next, so the weights stream from memory once and the later blocks read them
     * from L2. Each output's arithmetic is the same at any chunking (a tile is summed alone). */
    const int64_t tile_bytes = G * (bits == 4 ? 256 : 512) + G * 64;
    const int64_t chunk = M <= 8 ? tiles : (CHUNK_BYTES / tile_bytes > 1 ? CHUNK_BYTES / tile_bytes : 1);
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t part = 0; part < nt; part++) {
        const int64_t t0 = tiles * part / nt, t1 = tiles * (part + 1) / nt;
        for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
          const int64_t c1 = c0 + chunk < t1 ? c0 + chunk : t1;
          qmm_rows(bits, w, sl, N, K, xq, planes == 2 ? xq + M * K : NULL, sx, xs, M, c0, c1, (char *)y, bf16);
        }
    }
    free(xq); free(sx); free(xs);
    return 0;
#else
    (void)w; (void)sl; (void)bits; (void)N; (void)K; (void)x; (void)M; (void)y; (void)bf16;
    (void)nthreads; (void)quantize_rows;
    return -1;
#endif
}
