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

/* out[T, I] = store(store(silu(g)) * u) for gu[T, 2I] = [gate | up], as torch's F.silu then a multiply. */
#define SILU_MUL(TY, S)                                                                             \
    static void silu_mul_##S(const TY *gu, TY *out, int64_t T, int64_t I, int nthreads) {          \
        _Pragma("omp parallel for num_threads(threads_for(T * I, nthreads)) schedule(static)")     \
        for (int64_t t = 0; t < T; t++) {                                                          \
            const TY *g = gu + t * 2 * I, *u = g + I;                                               \
            TY *o = out + t * I;                                                                    \
            _Pragma("omp simd")                                                                     \
            for (int64_t i = 0; i < I; i++) {                                                       \
                const float x = LD_##S(g, i);                                                       \
                ST_##S(o, i, RND_##S(x / (1.0f + expf(-x))) * LD_##S(u, i));                        \
            }                                                                                       \
        }                                                                                           \
    }
SILU_MUL(float, f32)
SILU_MUL(uint16_t, bf16)

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
