/* The decoder's elementwise work, fused: RMSNorm (with the residual add), the rotary embedding,
   SiLU(gate) x up. fp32 or bf16, on contiguous rows (rotary: views into the fused QKV output).

   In torch each of these is several ops (RMSNorm with a residual: add, pow, mean, add, rsqrt, mul,
   mul), each a pass over the rows and a launch that costs more than its arithmetic at decode,
   where a step has a few dozen rows. Here each is one pass: a row is read once, stays in L1, and
   is written once. Rows are split across torch's OpenMP threads only when there are enough of
   them to pay for waking the threads (prefill; SiLU's exp from a few rows up).

   Each kernel's work on one row is one body taking its element type as a constant (`bf16`, 0 or 1:
   vec_math.h's load_elem/store_elem), inlined into an fp32 function and a `_bf16` one. Those hold
   the parallel loops: OpenMP moves a loop's body into a function of its own, and a `bf16` passed
   through it would no longer be a constant there (the loops would not vectorize). bf16 is computed in fp32
   and rounded once per stored element, as vLLM's CPU kernels do; torch's bf16 layers round after
   every op, so the two agree to about one bf16 step, not bit for bit.
   Built by build.py with the system C compiler; declared in kernels.py, used by layers.py. */
#include "vec_math.h"

#include <math.h>
#include <stdint.h>

/* Below this many elements a kernel runs on the calling thread: waking the others costs more. */
#define PARALLEL_MIN 65536
#define PARALLEL_MIN_SILU 8192 /* an exp and a division per element: worth threads sooner */

#define INLINE static inline __attribute__((always_inline))

/* 1/sqrt(mean(r^2) + eps) of the H elements from element r of x, sixteen partial sums so the
   compiler keeps them in vector lanes. */
INLINE float inv_rms(const void *x, int64_t r, int64_t H, float eps, const int bf16) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; j++) {
            const float v = load_elem(x, r + i + j, bf16);
            acc[j] += v * v;
        }
    float ss = 0.f;
    for (; i < H; i++) ss += load_elem(x, r + i, bf16) * load_elem(x, r + i, bf16);
    for (int j = 0; j < 16; j++) ss += acc[j];
    return 1.f / sqrtf(ss / (float)H + eps);
}

/* Row t of out [T, H] = w * x / rms(x). */
INLINE void rms_norm_row(const void *x, void *out, const void *w, int64_t t, int64_t H, float eps,
                         const int bf16) {
    const float inv = inv_rms(x, t * H, H, eps, bf16);
    for (int64_t i = 0; i < H; i++)
        store_elem(out, t * H + i, load_elem(w, i, bf16) * (load_elem(x, t * H + i, bf16) * inv), bf16);
}

/* Row t, in place, as the decoder layer uses it: residual += x (the next residual, stored in its
   own type), then x = w * residual / rms(residual). */
INLINE void fused_add_rms_norm_row(void *x, void *residual, const void *w, int64_t t, int64_t H,
                                   float eps, const int bf16) {
    for (int64_t i = 0; i < H; i++)
        store_elem(residual, t * H + i, load_elem(residual, t * H + i, bf16) + load_elem(x, t * H + i, bf16),
                   bf16);
    const float inv = inv_rms(residual, t * H, H, eps, bf16);
    for (int64_t i = 0; i < H; i++)
        store_elem(x, t * H + i, load_elem(w, i, bf16) * (load_elem(residual, t * H + i, bf16) * inv), bf16);
}

/* n_heads heads of D elements from element `at` of x, rotated in place by the fp32 rows c, s. */
INLINE void rotate(void *x, int64_t at, int n_heads, int D, const float *c, const float *s, const int bf16) {
    const int half = D / 2;
    for (int h = 0; h < n_heads; h++, at += D)
        for (int i = 0; i < half; i++) {
            const float x1 = load_elem(x, at + i, bf16), x2 = load_elem(x, at + i + half, bf16);
            store_elem(x, at + i, x1 * c[i] - x2 * s[i], bf16);
            store_elem(x, at + i + half, x2 * c[i + half] + x1 * s[i + half], bf16);
        }
}

/* Token t's q and k heads (rows `*_stride` elements apart), rotated by its position's rows of the
   fp32 cos/sin tables [max_pos, D]. */
INLINE void rotate_token(const int64_t *positions, int64_t t, void *q, int64_t q_stride, int nq, void *k,
                         int64_t k_stride, int nk, int D, const float *cos_table, const float *sin_table,
                         const int bf16) {
    const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
    rotate(q, t * q_stride, nq, D, c, s, bf16);
    rotate(k, t * k_stride, nk, D, c, s, bf16);
}

/* Row t of out [T, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up; each row of x [T, 2I] is
   gate | up. */
INLINE void silu_and_mul_row(const void *x, void *out, int64_t t, int64_t I, const int bf16) {
    for (int64_t i = 0; i < I; i++) {
        const float g = load_elem(x, t * 2 * I + i, bf16), u = load_elem(x, t * 2 * I + I + i, bf16);
        store_elem(out, t * I + i, silu_mul(g, u), bf16);
    }
}

/* What layers.py calls: each kernel over its rows, once per element type (x, out, w: [T, H]). */
void rms_norm(const float *x, float *out, const float *w, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) rms_norm_row(x, out, w, t, H, eps, 0);
}
void rms_norm_bf16(const uint16_t *x, uint16_t *out, const uint16_t *w, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) rms_norm_row(x, out, w, t, H, eps, 1);
}

void fused_add_rms_norm(float *x, float *residual, const float *w, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) fused_add_rms_norm_row(x, residual, w, t, H, eps, 0);
}
void fused_add_rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *w, int64_t T, int64_t H,
                             float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) fused_add_rms_norm_row(x, residual, w, t, H, eps, 1);
}

/* Rotate q [T, nq, D] and k [T, nk, D] in place (heads contiguous within a row, rows `*_stride`
   elements apart: views into the fused QKV output) by the cos/sin rows of each token's position
   (fp32 tables, whatever q's type). Returns -1, having changed nothing, if a position is outside
   the table. */
static int positions_in_table(const int64_t *positions, int64_t T, int64_t max_pos) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return 0;
    return 1;
}
int rotary_embedding(const int64_t *positions, int64_t T, float *q, int64_t q_stride, int nq, float *k,
                     int64_t k_stride, int nk, int D, const float *cos_table, const float *sin_table,
                     int64_t max_pos) {
    if (!positions_in_table(positions, T, max_pos)) return -1;
#pragma omp parallel for schedule(static) if (T * (nq + nk) * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        rotate_token(positions, t, q, q_stride, nq, k, k_stride, nk, D, cos_table, sin_table, 0);
    return 0;
}
int rotary_embedding_bf16(const int64_t *positions, int64_t T, uint16_t *q, int64_t q_stride, int nq,
                          uint16_t *k, int64_t k_stride, int nk, int D, const float *cos_table,
                          const float *sin_table, int64_t max_pos) {
    if (!positions_in_table(positions, T, max_pos)) return -1;
#pragma omp parallel for schedule(static) if (T * (nq + nk) * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        rotate_token(positions, t, q, q_stride, nq, k, k_stride, nk, D, cos_table, sin_table, 1);
    return 0;
}

void silu_and_mul(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN_SILU)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_row(x, out, t, I, 0);
}
void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN_SILU)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_row(x, out, t, I, 1);
}
