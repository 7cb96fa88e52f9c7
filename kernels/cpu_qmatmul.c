/* Weight-only quantized matmul for the few-row (decode) steps on the CPU: y[M, N] = x[M, K] · Wᵀ, with W
 * stored as 4- or 8-bit codes in groups of 32 along K (value = lo + code · scale, per row and group), in one
 * pass over the packed weights.
 * x is quantized per group of 32 on the fly and every dot product is exact integer work for AVX-512 VNNI
 * (vpdpbusd: 64 u8 × s8 products per instruction):
 *   4-bit: x as 15-bit codes in two int8 planes (two dots per chunk), finer than the bf16 x torch's int4
 *          kernel takes; 8-bit x here moved the decoder's logits visibly away from float32's.
 *   8-bit: x as int8 codes. Used for the LM head, whose logits track float32 as closely as with bf16 x.
 *
 * Layout (built by cpu_qmatmul.py): rows in tiles of 16 (a zmm lane per row), and per (tile, group):
 *   8-bit: 8 chunks of 64 bytes; byte 4·r + i of chunk j is row r's code at k = 4·j + i;
 *   4-bit: 4 chunks of 64 bytes; byte 4·r + i of chunk c holds row r's codes at k = 8·c + i (low nibble)
 *          and k = 8·c + 4 + i (high nibble).
 * Scales and lows: [tiles, G, 32] fp16, the 16 rows' scales then their lows (GGUF Q4_1 keeps both in fp16). Built at first use by cpu_build.py with -march=native; without
 * AVX-512 VNNI and BF16 chatserve_qmm_tile() returns 0 and the caller keeps torch's kernels.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QMM_TILE 16
#else
#define QMM_TILE 0
#endif

#define GROUP 32

int chatserve_qmm_tile(void) { return QMM_TILE; }

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {(uint32_t)x << 16};
    return c.f;
}

/* x [M, K] (fp32, or bf16 when bf16 != 0) → per group of 32: codes of `top` levels each side of zero
 * (rounded to nearest), their scale sx [M, G] and the exact sum of the group xs [M, G]. top = 127: int8
 * codes in xh; top = 32639: 15-bit codes split into two int8 planes, code = 256 · xh + xl with xl in
 * [-128, 127] (32639 = 127 · 256 + 127 keeps xh in int8). */
static void quantize_rows(const void *x, int bf16, int64_t M, int64_t K, float top, int8_t *xh, int8_t *xl,
                          float *sx, float *xs) {
    const int64_t G = K / GROUP;
    float v[GROUP];
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t base = m * K + g * GROUP;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < GROUP; i++) {
                v[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
                amax = fmaxf(amax, fabsf(v[i]));
                sum += v[i];
            }
            const float inv = amax > 0.f ? top / amax : 0.f;
            for (int i = 0; i < GROUP; i++) {
                const int32_t q = (int32_t)lrintf(v[i] * inv);
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
static inline void store_row(void *out, int bf16, int64_t off, __m512 v, __mmask16 keep) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)out + off, keep, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);                  /* round to nearest even, as torch does */
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)out + off, keep, _mm512_cvtepi32_epi16(r));
}

/* Tiles [t0, t1) for MB rows of x: the accumulators stay in registers across the K loop, and each row's
 * dot products run in NC independent chains (4/MB for 8-bit; half that for 4-bit, whose two planes already
 * double them) so that the dot instructions' latency is hidden. 4-bit codes and their scales are prefetched
 * QMM_PREFETCH bytes (the scales QMM_PREFETCH / 2) ahead: a one-row pass over weights streaming from memory was
 * bound by the hardware prefetcher (issue 32, EPYC Zen 4, 1 thread: a MoE layer's 8 experts -15 % time, a
 * 5120 x 2048 matrix -40 %; the results are unchanged). */
#define QMM_PREFETCH 4096
#define TILE_HEAD(MB, GB)                                                                                  \
        for (int64_t t = t0; t < t1; t++) {                                                                \
            const uint8_t *wt = w + t * G * (GB);                                                          \
            __m512 acc[MB], accl[MB];                                                                      \
            for (int m = 0; m < MB; m++) acc[m] = accl[m] = _mm512_setzero_ps();                           \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const uint8_t *wg = wt + g * (GB);                                                         \
                if ((GB) == 256) {              /* 4-bit codes (8-bit ones measured no faster with it) */  \
                    for (int pl = 0; pl < (GB); pl += 64) __builtin_prefetch(wg + QMM_PREFETCH + pl);      \
                    __builtin_prefetch(sl + (t * G + g) * 32 + QMM_PREFETCH / 4);                          \
                }
/* The group's exact int32 dots ia[MB][NC] → acc += Σ dots · scale · sx, accl += low · Σx; then the tile's rows. */
#define TILE_TAIL(MB, NC)                                                                                  \
                const __m512i slv = _mm512_loadu_si512(sl + (t * G + g) * 32);                             \
                const __m512 s = _mm512_cvtph_ps(_mm512_castsi512_si256(slv));                             \
                const __m512 l = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(slv, 1));                       \
                for (int m = 0; m < MB; m++) {                                                             \
                    __m512i dots = ia[m][0];                                                               \
                    for (int c = 1; c < NC; c++) dots = _mm512_add_epi32(dots, ia[m][c]);                  \
                    const __m512 sm = _mm512_mul_ps(s, _mm512_set1_ps(sx[m * G + g]));                     \
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), sm, acc[m]);                        \
                    accl[m] = _mm512_fmadd_ps(l, _mm512_set1_ps(xs[m * G + g]), accl[m]);                  \
                }                                                                                          \
            }                                                                                              \
            const int64_t left = N - t * 16;                                                               \
            const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);         \
            for (int m = 0; m < MB; m++)                                                                   \
                store_row(out, bf16, m * N + t * 16, _mm512_add_ps(acc[m], accl[m]), keep);                \
        }

/* 8-bit codes × int8 x (xq [MB, K], scales sx [MB, G]): exact integer dots, then scaled per group. */
#define QMM_TILES_I8(MB, NC)                                                                               \
    static void qmm_i8_##MB(const uint8_t *w, const uint16_t *sl, int64_t G, int64_t K,      \
                            const int8_t *xq, const float *sx, const float *xs, int64_t t0, int64_t t1,    \
                            int64_t N, void *out, int bf16) {                                              \
        TILE_HEAD(MB, 512)                                                                                 \
                __m512i ia[MB][NC];                                                                        \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) ia[m][c] = _mm512_setzero_si512();                        \
                for (int j = 0; j < 8; j++) {                                                              \
                    const __m512i v = _mm512_loadu_si512(wg + j * 64);                                     \
                    for (int m = 0; m < MB; m++) {                                                         \
                        const int32_t *q = (const int32_t *)(xq + m * K + g * GROUP) + j;                  \
                        ia[m][j % NC] = _mm512_dpbusd_epi32(ia[m][j % NC], v, _mm512_set1_epi32(q[0]));    \
                    }                                                                                      \
                }                                                                                          \
        TILE_TAIL(MB, NC)                                                                         \
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
        const __m512i nib = _mm512_set1_epi8(0x0F);                                                        \
        TILE_HEAD(MB, 256)                                                                                 \
                __m512i ih[MB][NC], il[MB][NC], ia[MB][NC];                                                \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++) ih[m][c] = il[m][c] = _mm512_setzero_si512();             \
                for (int c = 0; c < 4; c++) {                                                              \
                    const __m512i v = _mm512_loadu_si512(wg + c * 64);                                     \
                    const __m512i a = _mm512_and_si512(v, nib);                                            \
                    const __m512i b = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);                      \
                    for (int m = 0; m < MB; m++) {                                                         \
                        const int32_t *h = (const int32_t *)(xh + m * K + g * GROUP) + 2 * c;              \
                        const int32_t *l = (const int32_t *)(xl + m * K + g * GROUP) + 2 * c;              \
                        const int k0 = (2 * c) % NC, k1 = (2 * c + 1) % NC;                                \
                        ih[m][k0] = _mm512_dpbusd_epi32(ih[m][k0], a, _mm512_set1_epi32(h[0]));            \
                        il[m][k0] = _mm512_dpbusd_epi32(il[m][k0], a, _mm512_set1_epi32(l[0]));            \
                        ih[m][k1] = _mm512_dpbusd_epi32(ih[m][k1], b, _mm512_set1_epi32(h[1]));            \
                        il[m][k1] = _mm512_dpbusd_epi32(il[m][k1], b, _mm512_set1_epi32(l[1]));            \
                    }                                                                                      \
                }                                                                                          \
                for (int m = 0; m < MB; m++)                                                               \
                    for (int c = 0; c < NC; c++)                                                           \
                        ia[m][c] = _mm512_add_epi32(_mm512_slli_epi32(ih[m][c], 8), il[m][c]);             \
        TILE_TAIL(MB, NC)                                                                            \
    }
QMM_TILES_I16(1, 2)
QMM_TILES_I16(2, 1)
QMM_TILES_I16(4, 1)
QMM_TILES_I16(8, 1)
#endif



#define CHUNK_BYTES (96 * 1024)      /* codes + scales a chunk of tiles holds: well inside L2 */

/* y[M, N] (fp32, or bf16 when bf16 != 0) = x[M, K] · Wᵀ for packed W (see the top). K % 32 == 0.
 * Returns 0, or -1 when this build has no VNNI kernel or the scratch could not be allocated. */
int chatserve_qmm(const uint8_t *w, const uint16_t *sl, int bits, int64_t N, int64_t K,
                  const void *x, int64_t M, void *y, int bf16, int nthreads) {
#if QMM_TILE
    const int64_t G = K / GROUP, tiles = (N + 15) / 16;
    int8_t *xq = malloc((size_t)(M * K) * (bits == 4 ? 2 : 1));      /* int8 codes, or two int8 planes */
    float *sx = malloc(sizeof(float) * (size_t)(M * G)), *xs = malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !sx || !xs) {
        free(xq); free(sx); free(xs);
        return -1;
    }
    quantize_rows(x, bf16, M, K, bits == 4 ? 32639.f : 127.f, xq, bits == 4 ? xq + M * K : NULL, sx, xs);
    const int nt = nthreads > 1 && tiles >= 8 ? nthreads : 1;
    const size_t ybytes = bf16 ? 2 : 4;
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
          for (int64_t m = 0; m < M;) {      /* rows of x in blocks of 8, 4, 2, 1 */
            const int64_t mb = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
            const float *u = xs + m * G;
            char *o = (char *)y + (size_t)(m * N) * ybytes;
            if (bits == 4) {
                const int8_t *h = xq + m * K, *l = xq + M * K + m * K;
                const float *s = sx + m * G;
                if (mb == 8) qmm_i16_8(w, sl, G, K, h, l, s, u, c0, c1, N, o, bf16);
                else if (mb == 4) qmm_i16_4(w, sl, G, K, h, l, s, u, c0, c1, N, o, bf16);
                else if (mb == 2) qmm_i16_2(w, sl, G, K, h, l, s, u, c0, c1, N, o, bf16);
                else qmm_i16_1(w, sl, G, K, h, l, s, u, c0, c1, N, o, bf16);
            } else {
                const int8_t *q = xq + m * K;
                const float *s = sx + m * G;
                if (mb == 8) qmm_i8_8(w, sl, G, K, q, s, u, c0, c1, N, o, bf16);
                else if (mb == 4) qmm_i8_4(w, sl, G, K, q, s, u, c0, c1, N, o, bf16);
                else if (mb == 2) qmm_i8_2(w, sl, G, K, q, s, u, c0, c1, N, o, bf16);
                else qmm_i8_1(w, sl, G, K, q, s, u, c0, c1, N, o, bf16);
            }
            m += mb;
          }
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
