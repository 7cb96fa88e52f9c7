/* Byte-level helpers of the GGUF block kernels (cpu_blockmm.c, cpu_blockq8.c): fp16 scales, 16-byte loads,
 * nibbles, the 5th bits of Q5 codes and the 6-bit scales/mins of Q4_K/Q5_K. Not #included: cpu_blockmm.level_source
 * writes it between a level's prelude (which defines BMM_LEVEL or BQ8_LEVEL) and the kernel's source, so the
 * built .c (named by its content) changes when this file does. */
#if BMM_LEVEL || BQ8_LEVEL
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
static inline float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
static inline __m128i ld16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline __m128i lo4(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0F)); }
static inline __m128i hi4(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)); }
/* byte i = `value` where bit i of `bits` is set, else 0 */
static inline __m128i bits16(uint32_t bits, char value) {
    const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    __m128i v = _mm_shuffle_epi8(_mm_set1_epi16((short)bits),
                                 _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, sel), sel), _mm_set1_epi8(value));
}
/* byte i = 0x10 where bit j of byte i of b is set */
static inline __m128i bit_j(__m128i b, int j) {
    const __m128i m = _mm_set1_epi8((char)(1 << j));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, m), m), _mm_set1_epi8(0x10));
}
/* sub-block j's 6-bit scale and min from a Q4_K/Q5_K block's 12 scale bytes */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
#endif
