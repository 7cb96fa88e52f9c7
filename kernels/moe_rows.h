/* Shared by the MoE one-call kernels (cpu_moe.c over cpu_qmatmul's packed experts, cpu_moe_block.c over the
 * file's blocks): activation-dtype loads and stores with torch's rounding, and the rank-order combine of a
 * row's k expert outputs, out = store(y_0 · w_0), then out = store(out + store(y_j · w_j)) (torch's bf16 ops).
 * Written before each kernel's source by its loader (cpu_build.composed_source), included when a kernel is
 * compiled alone. */
#ifndef CHATSERVE_MOE_ROWS_H
#define CHATSERVE_MOE_ROWS_H
#include <stdint.h>
#include <string.h>

static inline uint16_t moe_f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } c = {f};
    const uint16_t rounded = (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    return (c.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((c.u >> 16) | 0x40) : rounded;
}
static inline float moe_bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* an fp32 value as a store of the activation dtype leaves it */
static inline float moe_round(float v, int bf16) { return bf16 ? moe_bf16_to_f32(moe_f32_to_bf16(v)) : v; }

static inline float moe_load(const void *p, int64_t i, int bf16) {
    return bf16 ? moe_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void moe_store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = moe_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* cpu_ops.c's chatserve_silu_mul(dtype, gu [T, 2I], out [T, I], T, I, nthreads), which both kernels call */
typedef void (*silu_mul_fn)(int, const void *, void *, int64_t, int64_t, int);

/* out [T, H] = the rank-order combine of yd's slots (slot t·k + j at row pos[t·k + j] of yd [S, H]) with the
 * routing weights wts [T, k]. The fp32 combine must not fuse y·w + out into one FMA: torch rounds the product
 * first. */
__attribute__((optimize("fp-contract=off"), unused))
static void moe_combine(const char *yd, const int64_t *pos, const float *wts, int64_t T, int64_t k, int64_t H,
                        void *out, int bf16) {
    const size_t ybytes = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < k; j++) {
            const void *y = yd + (size_t)(pos[t * k + j] * H) * ybytes;
            const float wj = wts[t * k + j];
            if (j == 0) {
                for (int64_t i = 0; i < H; i++) moe_store(out, t * H + i, moe_load(y, i, bf16) * wj, bf16);
            } else {
                for (int64_t i = 0; i < H; i++) {
                    const float p = moe_round(moe_load(y, i, bf16) * wj, bf16);
                    moe_store(out, t * H + i, moe_load(out, t * H + i, bf16) + p, bf16);
                }
            }
        }
    }
}
#endif
