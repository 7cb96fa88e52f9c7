/* Fused elementwise ops of a decoder layer for the CPU: residual add + RMSNorm and RoPE (and, for the
 * decode chain of cpu_decode.py, SiLU·mul and the K/V row store), each one
 * ctypes call instead of 4-8 small torch ops (and their dispatch and temporaries). Rounding follows the torch code they replace step by
 * step (bf16 results rounded where torch rounds them), so both paths agree to the last bit or so.
 *
 * Built at first use by cpu_build.py; rows are split across OpenMP threads when there are enough.
 * Every op is written once as a macro over the storage type (float32, bfloat16) so that each loop
 * has one load/store form and vectorizes. dtype 0: float32, 1: bfloat16, for every tensor of a call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {(uint32_t)x << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } c = {f};
    const uint16_t rounded = (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    return (c.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((c.u >> 16) | 0x40) : rounded;
}

/* per storage type: load as fp32, store from fp32, round an fp32 value as a store would */
#define LD_f32(p, i) ((p)[i])
#define ST_f32(p, i, v) ((p)[i] = (v))
#define RND_f32(v) (v)
#define LD_bf16(p, i) bf16_to_f32((p)[i])
#define ST_bf16(p, i, v) ((p)[i] = f32_to_bf16(v))
#define RND_bf16(v) bf16_to_f32(f32_to_bf16(v))

static inline int threads_for(int64_t elems, int nthreads) {
    return elems >= 32768 && nthreads > 1 ? nthreads : 1;
}

/* h[T, H] += add[T, H] (when add is given; rounded to the storage type), then
 * out = w * store(h * rsqrt(mean(h^2) + eps)) with the statistics in fp32 (as transformers' RMSNorm). */
#define ADD_RMS_NORM(TY, S)                                                                         \
    static void add_rms_norm_##S(TY *h, const TY *add, const TY *w, TY *out, int64_t T, int64_t H,  \
                                 float eps, int nthreads) {                                         \
        _Pragma("omp parallel for num_threads(threads_for(T * H, nthreads)) schedule(static)")     \
        for (int64_t t = 0; t < T; t++) {                                                          \
            TY *hr = h + t * H;                                                                     \
            TY *orow = out + t * H;                                                                 \
            float ss = 0.0f;                                                                        \
            if (add) {                                                                              \
                const TY *ar = add + t * H;                                                         \
                _Pragma("omp simd reduction(+ : ss)")                                               \
                for (int64_t i = 0; i < H; i++) {                                                   \
                    const float x = RND_##S(LD_##S(hr, i) + LD_##S(ar, i));                         \
                    ST_##S(hr, i, x);                                                               \
                    ss += x * x;                                                                    \
                }                                                                                   \
            } else {                                                                                \
                _Pragma("omp simd reduction(+ : ss)")                                               \
                for (int64_t i = 0; i < H; i++) ss += LD_##S(hr, i) * LD_##S(hr, i);                \
            }                                                                                       \
            const float r = 1.0f / sqrtf(ss / (float)H + eps);                                      \
            _Pragma("omp simd")                                                                     \
            for (int64_t i = 0; i < H; i++)                                                         \
                ST_##S(orow, i, LD_##S(w, i) * RND_##S(LD_##S(hr, i) * r));                         \
        }                                                                                           \
    }
ADD_RMS_NORM(float, f32)
ADD_RMS_NORM(uint16_t, bf16)

/* In place on x[T, heads, D] (row stride x_st, heads contiguous): rotate-half RoPE with the sign
 * folded into sin: x = store(store(x * cos) + roll(x, D/2) * sin), cos/sin rows [L, D] at pos[T]. */
#define ROPE(TY, S)                                                                                 \
    static void rope_##S(TY *x, int64_t x_st, const TY *cos_t, const TY *sin_t, const int64_t *pos, \
                         int64_t T, int64_t heads, int64_t D, int nthreads) {                       \
        const int64_t half = D / 2;                                                                 \
        _Pragma("omp parallel for num_threads(threads_for(T * heads * D, nthreads)) schedule(static)") \
        for (int64_t t = 0; t < T; t++) {                                                          \
            const TY *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;                              \
            for (int64_t hh = 0; hh < heads; hh++) {                                                \
                TY *r = x + t * x_st + hh * D;                                                      \
                float v[512], y[512];                                                               \
                for (int64_t i = 0; i < D; i++) v[i] = LD_##S(r, i);                                \
                for (int64_t i = 0; i < half; i++) {                                                \
                    y[i] = RND_##S(v[i] * LD_##S(c, i)) + v[i + half] * LD_##S(s, i);               \
                    y[i + half] = RND_##S(v[i + half] * LD_##S(c, i + half)) + v[i] * LD_##S(s, i + half); \
                }                                                                                   \
                for (int64_t i = 0; i < D; i++) ST_##S(r, i, y[i]);                                 \
            }                                                                                       \
        }                                                                                           \
    }
ROPE(float, f32)
ROPE(uint16_t, bf16)

void chatserve_add_rms_norm(int dtype, void *h, const void *add, const void *w, void *out,
                            int64_t T, int64_t H, float eps, int nthreads) {
    if (dtype == 0) add_rms_norm_f32(h, add, w, out, T, H, eps, nthreads);
    else add_rms_norm_bf16(h, add, w, out, T, H, eps, nthreads);
}

void chatserve_rope(int dtype, void *x, int64_t x_st, const void *cos_t, const void *sin_t,
                    const int64_t *pos, int64_t T, int64_t heads, int64_t D, int nthreads) {
    if (dtype == 0) rope_f32(x, x_st, cos_t, sin_t, pos, T, heads, D, nthreads);
    else rope_bf16(x, x_st, cos_t, sin_t, pos, T, heads, D, nthreads);
}

/* out[T, I] = store(store(silu(g)) * u) for gu[T, 2I] = [gate | up], as torch's F.silu then a multiply:
 * silu(x) = x / (1 + e^-x) in fp32. With AVX-512, 16 columns at a time through exp16 (a vector e^x
 * within ~1 ulp of expf, as torch's own vectorized exp) and exact-rounding stores; a tail is the same
 * instructions under a mask, so every element, whatever its row or column, goes through one arithmetic
 * and a row's bits never depend on the row count (batch invariance). With AVX2 + FMA (no AVX-512): the
 * same arithmetic 8 columns at a time (exp8), so both levels give an element the same bits. Else scalar expf. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(CHATSERVE_AVX2_ONLY)
#define OPS_LEVEL 3
#include <immintrin.h>

/* e^x over 16 lanes: n = round(x / ln 2), r = x - n ln 2 (two-part ln 2, Cody-Waite), e^r by a
 * degree-7 Taylor-like minimax polynomial on |r| <= ln 2 / 2, then 2^n applied as two factors so
 * large |n| overflows to inf and underflows gradually as expf does; NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));   /* 1 + r + r²p */
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i h = _mm512_srai_epi32(ni, 1);                                         /* n = h + (n - h) */
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, _mm512_set1_epi32(127)), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(ni, h), _mm512_set1_epi32(127)), 23));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.8f), _CMP_GT_OQ);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512 out = _mm512_mask_mov_ps(y, big, _mm512_set1_ps(__builtin_inff()));
    out = _mm512_mask_mov_ps(out, tiny, _mm512_setzero_ps());
    return _mm512_mask_mov_ps(out, nan, x);
}

/* fp32 → bf16 bits, round to nearest even, NaN kept quiet: f32_to_bf16 lane by lane */
static inline __m256i bf16_round16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 bf16_load16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* silu(g)·u for 16 columns (mask m) of one row */
static inline __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

static void silu_mul_row_f32(const float *g, const float *u, float *o, int64_t I) {
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
        const __m512 s = silu16(_mm512_maskz_loadu_ps(m, g + i));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t I) {
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1);
        const __m256i sb = bf16_round16(silu16(bf16_load16(g + i, m)));                  /* store(silu(g)) */
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sb), 16));
        _mm256_mask_storeu_epi16(o + i, m, bf16_round16(_mm512_mul_ps(s, bf16_load16(u + i, m))));
    }
}

#define SILU_MUL(TY, S)                                                                             \
    static void silu_mul_##S(const TY *gu, TY *out, int64_t T, int64_t I, int nthreads) {          \
        _Pragma("omp parallel for num_threads(threads_for(T * I, nthreads)) schedule(static)")     \
        for (int64_t t = 0; t < T; t++)                                                             \
            silu_mul_row_##S(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);                   \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OPS_LEVEL 2

/* exp16 over 8 lanes: the same instructions lane by lane (the same constants, reduction, polynomial and
 * two-factor 2^n), so an element's bits are those of the AVX-512 level. */
static inline __m256 exp8(__m256 x) {
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));   /* 1 + r + r²p */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i h = _mm256_srai_epi32(ni, 1);                                         /* n = h + (n - h) */
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    __m256 out = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()),
                                  _mm256_cmp_ps(x, _mm256_set1_ps(88.8f), _CMP_GT_OQ));
    out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* fp32 → bf16 bits, round to nearest even, NaN kept quiet: f32_to_bf16 lane by lane */
static inline __m128i bf16_round8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q),
                                             _mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));   /* all <= 0xffff */
}

static inline __m256 bf16_load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* 8 columns of one row; the row's last < 8 columns go through the same instructions on a zero-padded copy */
static inline void silu_mul8_f32(const float *g, const float *u, float *o) {
    _mm256_storeu_ps(o, _mm256_mul_ps(silu8(_mm256_loadu_ps(g)), _mm256_loadu_ps(u)));
}

static inline void silu_mul8_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    const __m128i sb = bf16_round8(silu8(bf16_load8(g)));                              /* store(silu(g)) */
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(sb), 16));
    _mm_storeu_si128((__m128i *)o, bf16_round8(_mm256_mul_ps(s, bf16_load8(u))));
}

#define SILU_MUL(TY, S)                                                                             \
    static void silu_mul_##S(const TY *gu, TY *out, int64_t T, int64_t I, int nthreads) {          \
        _Pragma("omp parallel for num_threads(threads_for(T * I, nthreads)) schedule(static)")     \
        for (int64_t t = 0; t < T; t++) {                                                          \
            const TY *g = gu + t * 2 * I, *u = g + I;                                               \
            TY *o = out + t * I;                                                                    \
            int64_t i = 0;                                                                          \
            for (; i + 8 <= I; i += 8) silu_mul8_##S(g + i, u + i, o + i);                          \
            if (i < I) {                                                                            \
                TY gt[8] = {0}, ut[8] = {0}, ot[8];                                                 \
                memcpy(gt, g + i, (size_t)(I - i) * sizeof(TY));                                    \
                memcpy(ut, u + i, (size_t)(I - i) * sizeof(TY));                                    \
                silu_mul8_##S(gt, ut, ot);                                                          \
                memcpy(o + i, ot, (size_t)(I - i) * sizeof(TY));                                    \
            }                                                                                       \
        }                                                                                           \
    }
#else
#define SILU_MUL(TY, S)                                                                             \
    static void silu_mul_##S(const TY *gu, TY *out, int64_t T, int64_t I, int nthreads) {          \
        _Pragma("omp parallel for num_threads(threads_for(T * I, nthreads)) schedule(static)")     \
        for (int64_t t = 0; t < T; t++) {                                                          \
            const TY *g = gu + t * 2 * I, *u = g + I;                                               \
            TY *o = out + t * I;                                                                    \
            for (int64_t i = 0; i < I; i++) {                                                       \
                const float x = LD_##S(g, i);                                                       \
                ST_##S(o, i, RND_##S(x / (1.0f + expf(-x))) * LD_##S(u, i));                        \
            }                                                                                       \
        }                                                                                           \
    }
#endif
SILU_MUL(float, f32)
SILU_MUL(uint16_t, bf16)

#ifndef OPS_LEVEL
#define OPS_LEVEL 0
#endif

/* SiLU·up's level in this build: 3 AVX-512, 2 AVX2, 0 scalar (CHATSERVE_AVX2_ONLY: AVX2 on AVX-512 too) */
int chatserve_ops_level(void) { return OPS_LEVEL; }

void chatserve_silu_mul(int dtype, const void *gu, void *out, int64_t T, int64_t I, int nthreads) {
    if (dtype == 0) silu_mul_f32(gu, out, T, I, nthreads);
    else silu_mul_bf16(gu, out, T, I, nthreads);
}

/* K and V rows of T tokens (row_bytes each, src row stride src_st bytes) into the paged caches at
 * slots[T] (a slot = block * block_size + offset; the cache rows are row_bytes apart). */
void chatserve_store_rows(const char *k, const char *v, int64_t src_st, char *k_cache, char *v_cache,
                          const int64_t *slots, int64_t T, int64_t row_bytes) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, k + t * src_st, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, v + t * src_st, (size_t)row_bytes);
    }
}
