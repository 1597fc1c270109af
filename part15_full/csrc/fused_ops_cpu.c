/* The decoder's elementwise work, fused: RMSNorm (with the residual add), the rotary embedding,
   SiLU(gate) x up. fp32, on contiguous rows (rotary: views into the fused QKV output).

   In torch each of these is several ops (RMSNorm with a residual: add, pow, mean, add, rsqrt, mul,
   mul), each a pass over the rows and a launch that costs more than its arithmetic at decode,
   where a step has a few dozen rows. Here each is one pass: a row is read once, stays in L1, and
   is written once. Rows are split across torch's OpenMP threads only when there are enough of
   them to pay for waking the threads (prefill; SiLU's exp from a few rows up).
   Built by cpu_build.py with the system C compiler; bound by cpu_ops.py. */
#include "vec_math.h"

#include <math.h>
#include <stdint.h>

/* Below this many elements a kernel runs on the calling thread: waking the others costs more. */
#define PARALLEL_MIN 65536
#define PARALLEL_MIN_SILU 8192 /* an exp and a division per element: worth threads sooner */

/* 1/sqrt(mean(r^2) + eps), sixteen partial sums so the compiler keeps them in vector lanes. */
static float inv_rms(const float *r, int64_t H, float eps) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += r[i + j] * r[i + j];
    float ss = 0.f;
    for (; i < H; i++) ss += r[i] * r[i];
    for (int j = 0; j < 16; j++) ss += acc[j];
    return 1.f / sqrtf(ss / (float)H + eps);
}

/* out [T, H] = w * x / rms(x). */
void rms_norm(const float *x, float *out, const float *w, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * H;
        float *o = out + t * H;
        const float inv = inv_rms(r, H, eps);
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* In place, as the decoder layer uses it: residual += x (the next residual), then
   x = w * residual / rms(residual). */
void fused_add_rms_norm(float *x, float *residual, const float *w, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * H, *r = residual + t * H;
        for (int64_t i = 0; i < H; i++) r[i] += xr[i];
        const float inv = inv_rms(r, H, eps);
        for (int64_t i = 0; i < H; i++) xr[i] = w[i] * (r[i] * inv);
    }
}

static void rotate(float *x, int n_heads, int D, const float *c, const float *s) {
    const int half = D / 2;
    for (int h = 0; h < n_heads; h++, x += D)
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
}

/* Rotate q [T, nq, D] and k [T, nk, D] in place (heads contiguous within a row, rows `*_stride`
   floats apart: views into the fused QKV output) by the cos/sin rows [max_pos, D] of each token's
   position. Returns -1, having changed nothing, if a position is outside the table. */
int rotary_embedding(const int64_t *positions, int64_t T, float *q, int64_t q_stride, int nq,
                     float *k, int64_t k_stride, int nk, int D, const float *cos_table,
                     const float *sin_table, int64_t max_pos) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
#pragma omp parallel for schedule(static) if (T * (nq + nk) * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        rotate(q + t * q_stride, nq, D, c, s);
        rotate(k + t * k_stride, nk, D, c, s);
    }
    return 0;
}

/* out [T, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up; each row of x [T, 2I] is gate | up. */
void silu_and_mul(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN_SILU)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] * reciprocal(1.f + exp_approx(-g[i])) * u[i];
    }
}
