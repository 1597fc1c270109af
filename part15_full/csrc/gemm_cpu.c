/* y = x W^T (+ b) in fp32 on a CPU: the linear layers' GEMM, for the few rows of a decode step as
   much as for a prefill.

   Why not oneDNN (what every part uses, shared/layers.py). At decode a step multiplies 1-32 rows
   by each weight, and the weight comes from DRAM: 425 MB a step for SmolLM2-135M's 30 layers. The
   time is then reading the weight while the FMA units work on it, and oneDNN's kernels, tuned
   for large products, leave the two apart (on a 2-core Cascade Lake Xeon: 32 rows x the 30 layers'
   four projections at 126 GFLOP/s, where this kernel runs 199; large products 235 against 214).

   Layout. The weight [N, K] is packed once, at load time, into panels of NR output columns:
   panel p holds W[p*NR : p*NR+NR, :] transposed, [K][NR], so a step of k reads NR consecutive
   floats (two vector registers); the last panel is padded with zeros. x [M, K] rows are `ldx`
   floats apart, y [M, N] rows `ldy` apart.

   The micro-kernel keeps an MR x NR block of y in MR x 2 vector registers and walks k from 0 to
   K-1: each step loads the panel's two vectors, broadcasts one x value per row and adds the
   products (FMA). MR rows and two vectors are what the registers hold: 12 x 2 of AVX-512's 32
   zmm, 6 x 2 of AVX2's 16 ymm, 4 x 2 of SSE's 16 xmm.

   Every output sums its K products in the same order, k = 0, 1, ..., K-1, starting from zero,
   whatever M is, how rows are cut into blocks and which thread takes a panel: a row's result does
   not depend on how many rows share the call. (The engine needs that: a seeded request must
   sample the same alone or in a batch.) The bias is added last.

   Rows are cut into blocks of at most MR, as evenly as possible (32 rows: 11, 11, 10, not 12, 12,
   8). A panel is read from DRAM by its first block and from L2 by the next ones, so while a panel
   is worked on, the next panel is asked for into L2, spread over all the blocks' steps (a burst
   at one block's start would stall on the core's miss buffers): 1.25x faster at 32 rows with
   30 layers' weights out of cache. Large M is cut into chunks of rows whose x fits in L2
   (~512 KiB) and each chunk walks all panels; threads (OpenMP, torch's own) take panels. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define MR 12
#elif defined(__AVX__)
#define VW 8
#define MR 6
#else
#define VW 4
#define MR 4
#endif
#define NR (2 * VW)
#define CHUNK_BYTES (512 * 1024)

typedef float vec __attribute__((vector_size(VW * 4)));

/* The panel width the packed layout uses: the caller sizes the packed buffer by it. */
int gemm_panel_width(void) { return NR; }

/* 1 when the kernel runs on several threads (built with OpenMP); a build without runs on one. */
int gemm_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] row-major -> out [ceil(N / NR)][K][NR], zero padded. */
void gemm_pack_weight(const float *w, int64_t N, int64_t K, float *out) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.f;
            }
}

/* y[0:mr, 0:nc] = x[0:mr, :] . panel (+ bias). `mr` is a constant where it is inlined (panel()),
   so the accumulators are registers. `pf`: bytes of the next panel to ask for, `pf_step` a step. */
static inline __attribute__((always_inline)) void micro(const int mr, int64_t K, const float *x, int64_t ldx,
                                                         const float *w, float *y, int64_t ldy, int nc,
                                                         const float *bias, const char *pf, int64_t pf_step) {
    vec a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) {
        a0[i] = (vec){0};
        a1[i] = (vec){0};
    }
    for (int64_t k = 0; k < K; k++) {
        vec w0, w1;
        memcpy(&w0, w + k * NR, sizeof w0);
        memcpy(&w1, w + k * NR + VW, sizeof w1);
        if (pf) __builtin_prefetch(pf + k * pf_step, 0, 2);
        for (int i = 0; i < mr; i++) {
            const float xv = x[i * ldx + k];
            a0[i] += xv * w0;
            a1[i] += xv * w1;
        }
    }
    for (int i = 0; i < mr; i++) {
        float t[NR];
        memcpy(t, &a0[i], sizeof a0[i]);
        memcpy(t + VW, &a1[i], sizeof a1[i]);
        float *row = y + i * ldy;
        if (bias)
            for (int j = 0; j < nc; j++) row[j] = t[j] + bias[j];
        else if (nc == NR)
            memcpy(row, t, sizeof t);
        else
            for (int j = 0; j < nc; j++) row[j] = t[j];
    }
}

/* One panel against M rows, in `blocks` blocks; `next`: the panel after it (NULL: none). */
static void panel(int64_t M, int64_t blocks, int64_t K, const float *x, int64_t ldx, const float *w, float *y,
                  int64_t ldy, int nc, const float *bias, const float *next) {
    const int64_t pf_step = NR * (int64_t)sizeof(float) / blocks;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t m = M * b / blocks;
        const int rows = (int)(M * (b + 1) / blocks - m);
        const char *pf = next ? (const char *)next + b * (K * NR * (int64_t)sizeof(float) / blocks) : 0;
        const float *xb = x + m * ldx;
        float *yb = y + m * ldy;
        switch (rows) {
#define ROWS(r) case r: micro(r, K, xb, ldx, w, yb, ldy, nc, bias, pf, pf_step); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MR > 4
        ROWS(5) ROWS(6)
#endif
#if MR > 6
        ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
        default: break;
        }
    }
}

/* y[M, N] = x[M, K] . W^T (+ bias[N]); wp: W packed by gemm_pack_weight. */
void gemm(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
          const float *bias, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    if (chunk < MR) chunk = MR;
    if (num_threads < 1) num_threads = 1;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        const int64_t blocks = (rows + MR - 1) / MR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int nc = (p + 1) * NR <= N ? NR : (int)(N - p * NR);
            panel(rows, blocks, K, x + m0 * ldx, ldx, wp + p * K * NR, y + m0 * ldy + p * NR, ldy, nc,
                  bias ? bias + p * NR : 0, p + 1 < panels ? wp + (p + 1) * K * NR : 0);
        }
    }
}
