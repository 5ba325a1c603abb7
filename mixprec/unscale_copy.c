/* Copy fp16 or bf16 gradients into fp32 master gradients, unscaling them and checking them for inf/NaN in
 * the same pass: one read of the half gradients and one write of the fp32 ones, where a copy followed by
 * torch's check-and-unscale reads and writes the fp32 gradients a second time. See unscale_copy.py for
 * the contract; this file only computes.
 */
#include <stdint.h>
#include <string.h>

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* bf16 is the top half of an fp32: the upcast is a shift, exact for every value, inf and NaN included
 * (torch's conversion, c10::BFloat16, does the same). */
static inline float bf16_to_float(uint16_t h) { return from_bits((uint32_t)h << 16); }

/* fp16 to fp32, exact for every value, without a conversion instruction (so that every variant of the
 * build, -march=native or not, computes the same). The exponent and fraction move to fp32's places
 * (13 bits up); the exponent is rebiased by 127 - 15 (normal numbers), or by 255 - 31 to fp32's
 * all-ones (inf, NaN: a NaN's payload kept, and its quiet bit set, as torch's conversion does). A subnormal fp16 (exponent 0, value
 * f * 2^-24) is made the normal fp32 2^-14 * (1 + f/1024) and 2^-14 subtracted: exact, as both are
 * multiples of 2^-24 below 2^-13, and normal fp32 values, which a flush-to-zero mode leaves alone; zero
 * gives +0. The sign is put back after. */
static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t moved = (uint32_t)(h & 0x7FFF) << 13;
    const uint32_t exponent = moved & 0x0F800000; /* fp16's five exponent bits, in their new place */
    const uint32_t normal = moved + ((127u - 15u) << 23);
    const uint32_t quiet = (moved & 0x007FFFFF) != 0 ? 0x00400000 : 0; /* a NaN: quieted, as x86's F16C does */
    const uint32_t special = (moved + ((255u - 31u) << 23)) | quiet;
    const float magic = from_bits(113u << 23); /* 2^-14 */
    const uint32_t subnormal = to_bits(from_bits(moved + (113u << 23)) - magic);
    const uint32_t magnitude = exponent == 0x0F800000 ? special : exponent == 0 ? subnormal : normal;
    return from_bits(magnitude | sign);
}

/* For each of n_tensors tensors (src[t]: numel[t] fp16 or bf16 elements; dst[t]: as many fp32 ones):
 * dst = float(src) * *inv_scale in fp32, or float(src) itself where *inv_scale is exactly 1 (torch's
 * check-and-unscale op: a multiply by 1 would still quiet a signalling NaN). An element is inf or NaN
 * exactly when every exponent bit (MASK: 0x7F80 for bf16, 0x7C00 for fp16) of its half value is set; an upcast keeps it so, and a finite
 * value times an inverse scale <= 1 stays finite. Returns bit 0: some element was inf or NaN; bit 1:
 * *inv_scale was exactly 1, so dst holds the exact upcasts of src. */
#define UNSCALE_COPY(NAME, TO_FLOAT, MASK)                                                             \
    int32_t NAME(int64_t n_tensors, void **src, void **dst, const int64_t *numel, int32_t n_threads,  \
                 const float *inv_scale) {                                                            \
        const float inv = *inv_scale;                                                                 \
        const int by_one = inv == 1.0f;                                                               \
        int64_t total = 0;                                                                            \
        for (int64_t t = 0; t < n_tensors; ++t) total += numel[t];                                   \
        int32_t found = 0;                                                                            \
        /* Threads only for enough work, as torch's parallel_for (its grain is 32768 elements). */    \
        _Pragma("omp parallel num_threads(n_threads) if (total >= 32768)")                            \
        {                                                                                             \
            int32_t mine = 0; /* this thread's share: an OR over its elements, no early exit */      \
            for (int64_t t = 0; t < n_tensors; ++t) {                                                 \
                const uint16_t *x = (const uint16_t *)src[t];                                         \
                float *y = (float *)dst[t];                                                           \
                const int64_t n = numel[t];                                                           \
                _Pragma("omp for schedule(static) nowait")                                            \
                for (int64_t i = 0; i < n; ++i) {                                                     \
                    const uint16_t h = x[i];                                                          \
                    const float f = TO_FLOAT(h);                                                      \
                    mine |= (h & MASK) == MASK;                                                       \
                    y[i] = by_one ? f : f * inv;                                                      \
                }                                                                                     \
            }                                                                                         \
            _Pragma("omp atomic")                                                                     \
            found |= mine;                                                                            \
        }                                                                                             \
        return found | by_one << 1;                                                                   \
    }

UNSCALE_COPY(bf16_unscale_copy, bf16_to_float, 0x7F80)
UNSCALE_COPY(fp16_unscale_copy, fp16_to_float, 0x7C00)
