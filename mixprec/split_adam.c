/* One Adam/AdamW step over split fp32 masters: each master is its bf16 model weight (the high 16 bits,
 * rounded half away from zero) plus an int16 low half, so one pass reads 14 bytes per parameter (weight 2,
 * low half 2, bf16 gradient 2, moments 8) and writes 12, where torch's fused fp32 AdamW reads 16 and writes
 * 12. See split_adam.py for the contract; this file only computes.
 *
 * The arithmetic is torch's _single_tensor_adam on fp32 tensors on the CPU, operation by operation: the
 * same fp32 roundings, and a fused multiply-add exactly where torch's CPU kernels use one (lerp, addcmul,
 * add with alpha) and nowhere else. sqrtf is correctly rounded (torch's CPU sqrt is MKL's, one ulp off in
 * ~0.6% of elements): otherwise the result is torch.optim.AdamW's on the fp32 masters, bit for bit. Build
 * with -ffp-contract=off so the compiler adds no contraction of its own, and without -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Per-tensor coefficients, in this order (floats: torch hands its kernels fp32 scalars). */
enum { STEP_SIZE, BIAS_CORRECTION2_SQRT, DECAY, WEIGHT_DECAY, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, EPS,
       N_COEF };
/* Per-tensor flags (bits). */
enum { DECOUPLED = 1, L2 = 2, MAXIMIZE = 4, SCALED = 8 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16; /* exact: a bf16 value is an fp32 value with 16 zero low bits */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float join(uint16_t high, int16_t low) {
    /* high * 2**16 + low, low in [-2**15, 2**15): in uint32, which wraps where int32 would overflow (NaN
     * payloads next to the sign bit) */
    /* A split never pairs a zero high half with a negative low half (that would be a NaN); it appears when
     * a zero is written over a trained weight (re-initialised, pruned, loaded): the master is that zero.
     * split_adam.py's generic load (_load_split in low_precision.py) reads it the same way. */
    if ((high & 0x7FFFu) == 0 && low < 0) low = 0;
    uint32_t bits = ((uint32_t)high << 16) + (uint32_t)(int32_t)low;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* flags and weight_is_small are constants at each call site below, so each specialisation is a straight
 * loop the compiler vectorises. */
static inline __attribute__((always_inline)) void adam_loop(
    int64_t n, uint16_t *restrict high, int16_t *restrict low, const uint16_t *restrict grad,
    float *restrict exp_avg, float *restrict exp_avg_sq, const float *restrict c, float inv_scale,
    const int flags, const int weight_is_small) {
    const float step_size = -c[STEP_SIZE], bc2_sqrt = c[BIAS_CORRECTION2_SQRT], decay = c[DECAY];
    const float wd = c[WEIGHT_DECAY], w = c[ONE_MINUS_BETA1], beta2 = c[BETA2];
    const float one_minus_beta2 = c[ONE_MINUS_BETA2], eps = c[EPS];
    const float one_minus_w = 1.0f - w; /* torch's lerp computes it in fp32 */
#pragma omp for simd schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) {
        float g = bf16_to_f32(grad[i]);
        if (flags & SCALED) g = g * inv_scale;  /* GradScaler's unscale: a multiply by 1/scale */
        if (flags & MAXIMIZE) g = -g;
        float p = join(high[i], low[i]);
        if (flags & L2) g = fmaf(wd, p, g);      /* grad.add(param, alpha=wd) */
        if (flags & DECOUPLED) p = p * decay;   /* param.mul_(1 - lr * wd) */
        const float m0 = exp_avg[i];
        /* exp_avg.lerp_(grad, 1 - beta1): torch picks the form by the weight's size */
        const float m = weight_is_small ? fmaf(w, g - m0, m0) : fmaf(-(g - m0), one_minus_w, g);
        const float v = fmaf(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2); /* mul_, then addcmul_ */
        const float denom = sqrtf(v) / bc2_sqrt + eps;
        const float updated = p + (step_size * m) / denom;                    /* addcdiv_ */
        /* Split again: high = round-half-away(bits / 2**16), low = the rest, in [-2**15, 2**15). */
        uint32_t bits;
        memcpy(&bits, &updated, 4);
        const uint32_t upper = (bits + 0x8000u) & 0xFFFF0000u;
        high[i] = (uint16_t)(upper >> 16);
        low[i] = (int16_t)(uint16_t)(bits - upper); /* the rest, in [-2**15, 2**15) as two's complement */
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

#define CASE(F, S) \
    case (F) * 2 + (S): adam_loop(n, high, low, grad, exp_avg, exp_avg_sq, c, inv_scale, (F), (S)); break;
#define CASES(F) CASE(F, 0) CASE(F, 1)

static void adam_tensor(int64_t n, uint16_t *high, int16_t *low, const uint16_t *grad, float *exp_avg,
                        float *exp_avg_sq, const float *c, float inv_scale, int flags) {
    const int small = c[ONE_MINUS_BETA1] < 0.5f;
    switch ((flags & 15) * 2 + small) {
        CASES(0) CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6) CASES(7)
        CASES(8) CASES(9) CASES(10) CASES(11) CASES(12) CASES(13) CASES(14) CASES(15)
    }
}

/* Step n_tensors tensors; pointer arrays hold each tensor's data (all contiguous). */
void split_adam_step(int64_t n_tensors, void **high, void **low, void **grad, void **exp_avg,
                     void **exp_avg_sq, const int64_t *numel, const float *coef, const int32_t *flags,
                     float inv_scale, int32_t n_threads) {
    int64_t total = 0;
    for (int64_t t = 0; t < n_tensors; ++t) total += numel[t];
    /* Threads only for enough work, as torch's parallel_for (its grain is 32768 elements): waking a team
     * for a few small tensors costs more than it saves, and a lot when another process holds a core. */
#pragma omp parallel num_threads(n_threads) if (total >= 32768)
    for (int64_t t = 0; t < n_tensors; ++t) {
        adam_tensor(numel[t], (uint16_t *)high[t], (int16_t *)low[t], (const uint16_t *)grad[t],
                    (float *)exp_avg[t], (float *)exp_avg_sq[t], coef + t * N_COEF, inv_scale, flags[t]);
    }
}
