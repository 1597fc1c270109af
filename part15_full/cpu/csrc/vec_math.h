/* Math for part 15's C kernels that the compiler can vectorize, and their element types (fp32 and
   bf16). Include it first: the pragma below holds for the whole file.

   libm's expf is a call per element, which no loop around it can turn into vector instructions
   (without -ffast-math, which the kernels do not use). exp_approx is Cephes' single-precision
   polynomial (about 1 ulp) written without calls or branches, so a loop of it vectorizes. */
#ifndef VEC_MATH_H
#define VEC_MATH_H
#include <stdint.h>
#include <string.h>

/* No FP traps are used here; without this GCC will not turn exp_approx's clamp into vector
   min/max, and its loops stay scalar (clang assumes it already). */
#pragma GCC optimize("no-trapping-math")

/* exp_approx's steps as expressions, which GCC's vector types take too (prefill_tiles.h's
   exp_lanes computes 16 lanes with them). EXP_ROUND: n = round(x / ln2), adding and taking away
   1.5 * 2^23 leaves no fraction bits; EXP_REDUCE: x - n ln2, ln2 in two parts; EXP_POLY: e^r on
   the reduced range, Horner's rule. */
#define EXP_ROUND(x) (((x) * 1.44269504088896341f + 12582912.f) - 12582912.f)
#define EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define EXP_POLY(r)                                                                                     \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * \
           (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.f)

/* e^x, for x clamped to [-87, 87]: 2^n stays a normal float, and 1 + e^x stays under 2^126 (see
   reciprocal). Below -87 it returns ~1.6e-38 instead of a smaller number or 0. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : x > 87.f ? 87.f : x;
    const float n = EXP_ROUND(x);
    const float r = EXP_REDUCE(x, n);
    const float y = EXP_POLY(r);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* 1/d for 1 <= d < 2^126 without a division (AVX2's vector divide is slow): a first guess from
   the float's bits (within ~4%), then three Newton steps, each squaring the error. */
static inline float reciprocal(float d) {
    int32_t bits;
    memcpy(&bits, &d, sizeof bits);
    bits = 0x7EF311C3 - bits;
    float r;
    memcpy(&r, &bits, sizeof r);
    r = r * (2.f - d * r);
    r = r * (2.f - d * r);
    return r * (2.f - d * r);
}

/* silu(g) * u = g / (1 + e^-g) * u, for the MLP's activation: fused_ops_cpu.c's silu_and_mul and
   the end of gemm_cpu.c's gate/up GEMM both call this, so the two give the same bits. */
static inline float silu_mul(float g, float u) { return g * reciprocal(1.f + exp_approx(-g)) * u; }

/* bf16 is the top half of an fp32 (same exponent, 7 fraction bits): widening is a shift, narrowing
   rounds to nearest even (a NaN stays a quiet NaN). Written without branches or calls, so loops of
   them vectorize. The kernels compute in fp32 and round once, where they store. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7FFFFFFFu) > 0x7F800000u ? (bits >> 16) | 0x40u : rounded);
}

/* Element i of an fp32 (bf16 = 0) or bf16 (bf16 = 1) array, as fp32; and its store. Every caller
   passes a constant: the kernels' bodies are inlined once per element type, and the test folds
   away. */
static inline float load_elem(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_elem(void *p, int64_t i, float x, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}
#endif
