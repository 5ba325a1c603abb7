/* Whether any of a list of floats (fp16, bf16 or fp32) is inf or NaN, reading each element once and
 * writing nothing. See non_finite.py for the contract; this file only computes.
 *
 * A float is inf or NaN exactly when all its exponent bits are set (IEEE 754: the top exponent encodes
 * inf with a zero fraction, NaN otherwise), so the test is an integer AND and compare per element, which
 * the compiler vectorises: no conversion to fp32 and no write, unlike torch's check-and-unscale.
 */
#include <stdint.h>

/* 1 if an element of any of n_tensors tensors (data[t]: numel[t] elements of type T) has every bit of
 * exp_mask set (0x7C00: fp16's exponent; 0x7F80: bf16's; 0x7F800000: fp32's), else 0; -1, having read
 * nothing else, unless *inv_scale (the fp32 factor torch's check-and-unscale would multiply by) is exactly
 * 1: then that op would change the gradients, and the caller must run it. One definition per width. */
#define NON_FINITE(NAME, T)                                                                            \
    int32_t NAME(int64_t n_tensors, void **data, const int64_t *numel, int32_t exp_mask,              \
                 int32_t n_threads, const float *inv_scale) {                                         \
        if (*inv_scale != 1.0f) return -1;                                                            \
        int64_t total = 0;                                                                            \
        for (int64_t t = 0; t < n_tensors; ++t) total += numel[t];                                   \
        const T mask = (T)exp_mask;                                                                   \
        int32_t found = 0;                                                                            \
        /* Threads only for enough work, as torch's parallel_for (its grain is 32768 elements). */    \
        _Pragma("omp parallel num_threads(n_threads) if (total >= 32768)")                            \
        {                                                                                             \
            int32_t mine = 0; /* this thread's share: an OR over its elements, no early exit */      \
            for (int64_t t = 0; t < n_tensors; ++t) {                                                 \
                const T *x = (const T *)data[t];                                                      \
                const int64_t n = numel[t];                                                           \
                _Pragma("omp for schedule(static) nowait")                                            \
                for (int64_t i = 0; i < n; ++i) mine |= (x[i] & mask) == mask;                        \
            }                                                                                         \
            _Pragma("omp atomic")                                                                     \
            found |= mine;                                                                            \
        }                                                                                             \
        return found;                                                                                 \
    }

NON_FINITE(half_non_finite, uint16_t)
NON_FINITE(float_non_finite, uint32_t)
