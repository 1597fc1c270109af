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
   floats apart, y [M, N] rows `ldy` apart. The MLP's gate/up weight may be packed gated instead
   (gemm_pack_weight_gated: a panel's two vectors are 16 gate columns and the same 16 up
   columns), so that its GEMM can end with the activation (gemm_gated).

   The micro-kernel keeps an MR x NR block of y in MR x 2 vector registers and walks k from 0 to
   K-1: each step loads the panel's two vectors, broadcasts one x value per row and adds the
   products (FMA). MR rows and two vectors are what the registers hold: 14 x 2 of AVX-512's 32 zmm
   (with the two panel vectors and the broadcast, 31), 6 x 2 of AVX2's 16 ymm, 4 x 2 of SSE's 16
   xmm. A block's rows of x are first copied k-major ([K][rows], "packed"), so the broadcasts of a
   step read consecutive floats through one pointer instead of MR rows `ldx` apart, and the loop
   body is unrolled twice: fewer instructions a step besides the FMAs, which is what kept the
   kernel at ~85% of oneDNN's rate on large products (12 x 2, x unpacked: 195-215 GFLOP/s against
   its 230-240; 14 x 2 packed: 210-235).

   Every output sums its K products in the same order, k = 0, 1, ..., K-1, starting from zero,
   whatever M is, how rows are cut into blocks and which thread takes a panel: a row's result does
   not depend on how many rows share the call. (The engine needs that: a seeded request must
   sample the same alone or in a batch.) The bias is added last.

   Rows are cut into blocks of at most MR, as evenly as possible (32 rows: 11, 11, 10, not 14, 14,
   4). A panel is read from DRAM by its first block and from L2 by the next ones, so while a panel
   is worked on, the next panel is asked for into L2, spread over all the blocks' steps (a burst
   at one block's start would stall on the core's miss buffers): 1.25x faster at 32 rows with
   30 layers' weights out of cache. A step of one block (up to MR rows) asks for both 64-byte
   lines of its 128: with one, half the next panel was left to the hardware, and 8-14 rows took
   longer than 16 (a Sapphire Rapids VM, 30 layers' four projections and the LM head: 31.1 -> 23.8
   ms a step at 14 rows). Large M is cut into chunks of rows whose x fits in L2 (~512 KiB) and
   each chunk walks all panels. Threads (OpenMP, torch's own) take panels at a
   decode step's few rows, and chunks of rows from SPLIT_ROWS rows a thread (a prefill's): each
   thread then packs its own rows and nothing waits between packing and multiplying (1.03-1.05x
   on 128-974 rows). */
#include "vec_math.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define MR 14
#elif defined(__AVX__)
#define VW 8
#define MR 6
#else
#define VW 4
#define MR 4
#endif
#define NR (2 * VW)
#define CHUNK_BYTES (512 * 1024)
#define SPLIT_ROWS 56 /* rows a thread needs before threads take rows instead of panels */

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

/* Panels of `cols` output columns (below N), each [K][NR]: column j of panel p is output column
   p * cols + j % cols, read from row `at` of w [rows, K]; zero past N. */
static void pack(const float *w, int64_t N, int64_t K, float *out, int gated) {
    const int cols = gated ? VW : NR;
    const int64_t panels = (N + cols - 1) / cols;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t n = p * cols + j % cols, at = n + (j < cols ? 0 : N); /* gated: up rows after N */
                out[(p * K + k) * NR + j] = n < N ? w[at * K + k] : 0.f;
            }
}

/* w [N, K] row-major -> out [ceil(N / NR)][K][NR], zero padded. */
void gemm_pack_weight(const float *w, int64_t N, int64_t K, float *out) { pack(w, N, K, out, 0); }

/* The MLP's gate/up weight [2I, K] (gate rows, then up rows) packed so that panel p holds gate
   columns p*VW .. p*VW+VW-1 in its first vector and the same up columns in its second: the two
   halves of silu(gate) * up meet in one micro-kernel's registers. Out: [ceil(I / VW)][K][NR]. */
void gemm_pack_weight_gated(const float *w, int64_t I, int64_t K, float *out) { pack(w, I, K, out, 1); }

/* What a panel's MR x NR block becomes. PLAIN: y's NR columns (+ bias). A gated panel (above):
   GATE_UP writes its gate vector to columns 0.. and its up vector `up` columns further on, the
   layout a plain packing gives (gate | up); SILU writes silu(gate) * up through vec_math.h's
   silu_mul, as fused_ops_cpu.c's silu_and_mul does (the same operations, so the same bits). */
enum { PLAIN, GATE_UP, SILU };

/* y[0:mr, 0:nc] = x . panel (+ bias), x packed [K][mr]. `mr` is a constant where it is inlined
   (panel()), so the accumulators are registers. `pf`: bytes of the next panel to ask for, `pf_step`
   a step. The unrolled pairs of steps keep each sum's order (k, then k + 1). */
static inline __attribute__((always_inline)) void micro(const int mr, int64_t K, const float *x, const float *w,
                                                         float *y, int64_t ldy, int nc, const float *bias,
                                                         const char *pf, int64_t pf_step, int mode, int64_t up) {
    vec a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) {
        a0[i] = (vec){0};
        a1[i] = (vec){0};
    }
#define STEP(k)                                          \
    {                                                    \
        vec w0, w1;                                      \
        memcpy(&w0, w + (k) * NR, sizeof w0);            \
        memcpy(&w1, w + (k) * NR + VW, sizeof w1);       \
        for (int i = 0; i < mr; i++) {                   \
            const float xv = x[(k) * mr + i];            \
            a0[i] += xv * w0;                            \
            a1[i] += xv * w1;                            \
        }                                                \
    }
    int64_t k = 0;
    if (pf && pf_step >= 128) {  /* one block: both lines of the step's 128 bytes of the next panel */
        for (; k + 2 <= K; k += 2) {
            __builtin_prefetch(pf + k * pf_step, 0, 2);
            __builtin_prefetch(pf + k * pf_step + 64, 0, 2);
            STEP(k)
            __builtin_prefetch(pf + (k + 1) * pf_step, 0, 2);
            __builtin_prefetch(pf + (k + 1) * pf_step + 64, 0, 2);
            STEP(k + 1)
        }
    } else if (pf) {  /* two loops, so the one without a prefetch has no test in it */
        for (; k + 2 <= K; k += 2) {
            __builtin_prefetch(pf + k * pf_step, 0, 2);
            STEP(k)
            __builtin_prefetch(pf + (k + 1) * pf_step, 0, 2);
            STEP(k + 1)
        }
    } else {
        for (; k + 2 <= K; k += 2) {
            STEP(k) STEP(k + 1)
        }
    }
    if (k < K) STEP(k)
#undef STEP
    for (int i = 0; i < mr; i++) {
        /* The row's two vectors as floats through a union, stored whole: copied as floats
           (memcpy into a float array), GCC spilled them in halves and read them back whole, a
           stalled store-to-load forward per row that made the gate/up GEMM with its SiLU take
           1.13-1.24x the plain GEMM's time at 256-975 rows (now 1.0x). */
        union { vec v[2]; float f[NR]; } acc_row = {{a0[i], a1[i]}};
        const float *t = acc_row.f;
        float *row = y + i * ldy;
        if (mode == GATE_UP) {
            if (nc == VW) {  /* a constant size: vector stores, not a call */
                memcpy(row, t, VW * sizeof(float));
                memcpy(row + up, t + VW, VW * sizeof(float));
            } else
                for (int j = 0; j < nc; j++) row[j] = t[j], row[up + j] = t[VW + j];
        } else if (mode == SILU) {
            float o[VW];
            for (int j = 0; j < VW; j++) o[j] = silu_mul(t[j], t[VW + j]);  /* vectorized */
            if (nc == VW)
                memcpy(row, o, sizeof o);
            else
                for (int j = 0; j < nc; j++) row[j] = o[j];
        } else if (bias)
            for (int j = 0; j < nc; j++) row[j] = t[j] + bias[j];
        else if (nc == NR)
            memcpy(row, t, NR * sizeof(float));
        else
            for (int j = 0; j < nc; j++) row[j] = t[j];
    }
}

/* Row block b of M rows cut into `blocks`: its first row and its row count. */
static inline int64_t block_start(int64_t M, int64_t blocks, int64_t b) { return M * b / blocks; }

/* One panel against M rows of packed x (block b at xp + block_start * K), in `blocks` blocks;
   `next`: the panel after it (NULL: none). Inlined with `mode` a constant (see run), so each
   mode's loops are compiled apart and the plain one is what it was before modes. */
static inline __attribute__((always_inline)) void panel(int64_t M, int64_t blocks, int64_t K, const float *xp,
                                                         const float *w, float *y, int64_t ldy, int nc,
                                                         const float *bias, const float *next, const int mode,
                                                         int64_t up) {
    const int64_t pf_step = NR * (int64_t)sizeof(float) / blocks;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t m = block_start(M, blocks, b);
        const int rows = (int)(block_start(M, blocks, b + 1) - m);
        const char *pf = next ? (const char *)next + b * (K * NR * (int64_t)sizeof(float) / blocks) : 0;
        const float *xb = xp + m * K;
        float *yb = y + m * ldy;
        switch (rows) {
#define ROWS(r) case r: micro(r, K, xb, w, yb, ldy, nc, bias, pf, pf_step, mode, up); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MR > 4
        ROWS(5) ROWS(6)
#endif
#if MR > 6
        ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
#endif
#undef ROWS
        default: break;
        }
    }
}

/* The calling thread's buffer for packed x (one chunk), kept for its next call and freed when the
   thread ends. */
static pthread_key_t xpack_key;
static pthread_once_t xpack_once = PTHREAD_ONCE_INIT;
static __thread float *xpack;
static __thread int64_t xpack_floats;
static void xpack_key_make(void) { pthread_key_create(&xpack_key, free); }

static float *xpack_buffer(int64_t floats) {
    if (floats > xpack_floats) {
        float *grown = malloc(floats * sizeof(float));
        if (!grown) return 0;
        free(xpack);
        xpack = grown;
        xpack_floats = floats;
        pthread_once(&xpack_once, xpack_key_make);
        pthread_setspecific(xpack_key, xpack);
    }
    return xpack;
}

/* Block b .. b1 - 1 of `rows` rows of x (rows `ldx` apart) into xp, each block k-major ([K][its rows]). */
static void pack_rows(int64_t rows, int64_t blocks, int64_t b, int64_t b1, int64_t K, const float *x, int64_t ldx,
                      float *xp) {
    for (; b < b1; b++) {
        const int64_t m = block_start(rows, blocks, b);
        const int r = (int)(block_start(rows, blocks, b + 1) - m);
        float *dst = xp + m * K;
        for (int64_t k = 0; k < K; k++)
            for (int i = 0; i < r; i++) dst[k * r + i] = x[(m + i) * ldx + k];
    }
}

/* Panel p of `panels` against `rows` rows of packed x, ending as `mode` says (run's arguments). */
static inline __attribute__((always_inline)) void one_panel(int64_t p, int64_t panels, int64_t rows, int64_t blocks,
                                                             int64_t N, int64_t K, const float *xp, const float *wp,
                                                             float *y, int64_t ldy, const float *bias, int cols,
                                                             int mode) {
    const int nc = (p + 1) * cols <= N ? cols : (int)(N - p * cols);
    const float *w = wp + p * K * NR, *next = p + 1 < panels ? w + K * NR : 0;
    float *yp = y + p * cols;
    if (mode == PLAIN) panel(rows, blocks, K, xp, w, yp, ldy, nc, bias ? bias + p * cols : 0, next, PLAIN, 0);
    else if (mode == GATE_UP) panel(rows, blocks, K, xp, w, yp, ldy, nc, 0, next, GATE_UP, N);
    else panel(rows, blocks, K, xp, w, yp, ldy, nc, 0, next, SILU, 0);
}

/* y = x[M, K] . W^T over `panels` panels of `cols` output columns each (the last: to N), each panel
   ending as `mode` says. 0, or -1 when the buffer for packed x could not be had (y untouched). */
static int run(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *wp, float *y,
               int64_t ldy, const float *bias, int num_threads, int cols, int mode) {
    const int64_t panels = (N + cols - 1) / cols;
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    if (chunk < MR) chunk = MR;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 1 && M >= num_threads * SPLIT_ROWS) {
        /* Threads take rows: the same number of chunks each, cut as evenly as possible (974 rows on
           2 threads: 6 of 162-163), each packed into the thread's own buffer and run against every
           panel. A thread's x stays in its own L2 and nothing waits between packing and multiplying. */
        const int64_t chunks = (M + num_threads * chunk - 1) / (num_threads * chunk) * num_threads;
        int failed = 0;
#pragma omp parallel num_threads(num_threads)
        {
            if (!xpack_buffer((M + chunks - 1) / chunks * K)) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            int skip; /* the same for every thread (read after the barrier): all of them or none meet the loop */
#pragma omp atomic read
            skip = failed;
            if (!skip) {
#pragma omp for schedule(static)
                for (int64_t c = 0; c < chunks; c++) {
                    const int64_t m0 = M * c / chunks, rows = M * (c + 1) / chunks - m0, blocks = (rows + MR - 1) / MR;
                    pack_rows(rows, blocks, 0, blocks, K, x + m0 * ldx, ldx, xpack);
                    for (int64_t p = 0; p < panels; p++)
                        one_panel(p, panels, rows, blocks, N, K, xpack, wp, y + m0 * ldy, ldy, bias, cols, mode);
                }
            }
        }
        return failed ? -1 : 0;
    }
    /* Fewer rows (a decode step's): threads take panels, so a weight is read once for all rows. */
    float *const xp = xpack_buffer((M < chunk ? M : chunk) * K);
    if (!xp) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        const int64_t blocks = (rows + MR - 1) / MR;
        const float *xs = x + m0 * ldx;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) pack_rows(rows, blocks, b, b + 1, K, xs, ldx, xp);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                one_panel(p, panels, rows, blocks, N, K, xp, wp, y + m0 * ldy, ldy, bias, cols, mode);
        }
    }
    return 0;
}

/* y[M, N] = x[M, K] . W^T (+ bias[N]); wp: W packed by gemm_pack_weight. 0, or -1 when the buffer
   for packed x could not be had (y untouched). */
int gemm(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy,
         const float *bias, int num_threads) {
    return run(M, N, K, x, ldx, wp, y, ldy, bias, num_threads, NR, PLAIN);
}

/* The gate/up GEMM on a weight packed by gemm_pack_weight_gated ([2I, K], I = `inter`): with `silu`,
   y[M, I] = silu(x G^T) * (x U^T); without, y[M, 2I] = x G^T | x U^T, what gemm gives on the plain
   packing, bit for bit (each output sums its K products in the same order either way). */
int gemm_gated(int64_t M, int64_t inter, int64_t K, const float *x, int64_t ldx, const float *wp, float *y,
               int64_t ldy, int silu, int num_threads) {
    return run(M, inter, K, x, ldx, wp, y, ldy, 0, num_threads, VW, silu ? SILU : GATE_UP);
}
