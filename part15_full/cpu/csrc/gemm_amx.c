/* y = x W^T (+ b) in bf16 on a CPU with AMX (Intel's tile unit, Sapphire Rapids and later): the
   linear layers' GEMM when the model runs in bf16, for a decode step's few rows and a prefill's
   many alike.

   Why not oneDNN (what shared/layers.py prepacks for, and what vLLM's CPU build calls). On a 2-core
   Sapphire Rapids VM its bf16 GEMM runs at 2.3 TFLOP/s on large products, but a decode step's
   projections (32 rows against a weight of 1-3.5 MB) read their weights at 13-18 GB/s, where the
   LM head's single large weight streams at 33-42: the time goes in per-call set-up and in kernels
   tuned for large products. Here a call configures the tiles once and streams each weight panel
   through them.

   The tiles. AMX has 8 tile registers of up to 16 rows x 64 bytes and one multiply,
   tdpbf16ps C, A, B: C [16 x 16 fp32] += A [16 x 32 bf16] . B, where B holds 32 k by 16 columns
   as 16 rows of 16 (k, k+1) pairs ("VNNI" layout). Each product of two bf16 is exact in fp32; the
   hardware adds them to C in a fixed order, flushing denormals. This kernel keeps a 32 x 32 block
   of y in four C tiles (tmm0-3), two 16-row tiles of x (tmm4-5) and two tiles of the weight
   (tmm6-7), and walks K 32 at a time: four multiplies per two loads of each.

   Layout. The weight [N, K] is packed once, at load time, into panels of 32 output columns: panel
   p, k-step s holds two tiles (columns p*32 .. +15, then +16 .. +31), each 16 rows of 16 pairs,
   so a panel is one contiguous run of K * 64 bytes, read in order. x is read in place (rows `ldx`
   elements apart), with no copy: when M is over 16 and not a multiple of it, the last tile is the
   last 16 rows, overlapping the tile before it (the rows they share are computed twice, to the
   same bits, and stored twice); under 16 rows, the tiles are configured that many rows high. N
   and K must be multiples of 32 (the Python side checks).

   Every output starts from a zeroed tile and adds its k-steps in order, whatever M is, which rows
   share its block and which thread takes its panel: a row's result does not depend on how many rows
   share the call (the engine needs that, as with the fp32 kernel). The fp32 sums, plus the bias,
   are rounded to bf16 once (to nearest even), as oneDNN does.

   Threads (OpenMP, torch's own) take a contiguous run of panels each, so a weight is read once for
   all of a step's rows and each thread streams one stretch of it; while a panel is multiplied, the
   panel after next is asked for into L2, a 64-byte line per line the tiles load (the hardware's
   own prefetch starts too late on a decode step's short runs). Large M is cut into chunks of rows
   whose x fits in L2, each chunk walking all panels. Linux lends a process the tile registers only
   when asked (amx_init). */
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_num_threads() 1
#define omp_get_thread_num() 0
#endif
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 32                /* output columns a panel */
#define KSTEP 32                /* k a tile multiply takes */
#ifndef PF_AHEAD
#define PF_AHEAD 2
#endif
#define CHUNK_BYTES (768 * 1024) /* x rows a chunk: what fits in L2 beside the panels */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

/* Ask Linux for the tile data state (once a process; arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA). 1 when the tiles may be used. */
int amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Every tile 64 bytes wide; y's and x's tiles (0-5) `rows` high (16, or M when M is under 16), the
   weight's (6, 7) 16 k pairs. */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)(t < 6 ? rows : 16);
    _tile_loadconfig(&cfg);
}

/* w [N, K] bf16 row-major -> [N / 32][K / 32][2 tiles][16 k pairs][16 columns][2]. */
void amx_pack_weight(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t s = 0; s < K / KSTEP; s++)
            for (int t = 0; t < 2; t++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int e = 0; e < 2; e++)
                            out[((((p * (K / KSTEP) + s) * 2 + t) * 16 + r) * 16 + c) * 2 + e] =
                                w[(p * PANEL + t * 16 + c) * K + s * KSTEP + 2 * r + e];
}

/* fp32 sums [rows][32] (+ bias) -> bf16 y rows, rounded to nearest even. */
static inline void store_rows(const float *acc, int rows, uint16_t *y, int64_t ldy, const uint16_t *bias) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + 16))), 16));
    }
    for (int i = 0; i < rows; i++) {
        __m512 v0 = _mm512_loadu_ps(acc + i * PANEL), v1 = _mm512_loadu_ps(acc + i * PANEL + 16);
        if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        _mm256_storeu_si256((void *)(y + i * ldy), (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_storeu_si256((void *)(y + i * ldy + 16), (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

/* One panel (`w`, K * 32 bf16) against one or two tiles of x rows (`two`), starting at x0 and x1
   (rows ldx elements apart): their sums into `acc`, 32 x 32 floats, rows 0-15 from x0's tile and
   16-31 from x1's. `pf`: the panel to ask for into L2 meanwhile, or NULL. */
static inline void panel_block(int64_t K, const uint16_t *x0, const uint16_t *x1, int64_t ldx, int two,
                               const uint16_t *w, float *acc, const char *pf) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += KSTEP, w += 2 * 16 * 32) {
        if (pf) {
            for (int l = 0; l < 2048; l += 64) _mm_prefetch(pf + l, _MM_HINT_T1);
            pf += 2048;
        }
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + 16 * 32, 64);
        _tile_loadd(4, x0 + k, ldx * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x1 + k, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, PANEL * 4);
    _tile_stored(1, acc + 16, PANEL * 4);
    if (two) {
        _tile_stored(2, acc + 16 * PANEL, PANEL * 4);
        _tile_stored(3, acc + 16 * PANEL + 16, PANEL * 4);
    }
}

/* y[M, N] = x[M, K] . W^T (+ bias[N]), all bf16; wp: W packed by amx_pack_weight. Returns 0. */
int amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
             int64_t ldy, const uint16_t *bias, int num_threads) {
    if (M <= 0) return 0;
    const int64_t panels = N / PANEL, tiles = (M + 15) / 16; /* 16-row tiles of x */
    const int rows = M < 16 ? (int)M : 16;                     /* each tile's rows */
    /* Tile t's first row: 16 t, except a last tile that would run past M, which ends at M. */
#define TILE_ROW(t) ((t) * 16 + 16 <= M ? (t) * 16 : M - rows)
    int64_t chunk = CHUNK_BYTES / (K * 2) / 32 * 2;  /* tiles of rows a chunk, an even number */
    if (chunk < 2) chunk = 2;
    if (num_threads < 1) num_threads = 1;
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
        const int64_t t1 = t0 + chunk < tiles ? t0 + chunk : tiles;
#pragma omp parallel num_threads(num_threads)
        {
            float acc[32 * PANEL] __attribute__((aligned(64)));
            /* This thread's panels: a contiguous run, so it streams one stretch of the weight. */
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t p0 = panels * id / nt, p1 = panels * (id + 1) / nt;
            configure(rows);
            for (int64_t p = p0; p < p1; p++) {
                const uint16_t *w = wp + p * K * PANEL;
                const uint16_t *b = bias ? bias + p * PANEL : 0;
                for (int64_t t = t0; t < t1; t += 2) {
                    const int two = t + 1 < t1;
                    const int64_t ra = TILE_ROW(t), rb = two ? TILE_ROW(t + 1) : ra;
                    /* The panel PF_AHEAD on is asked for into L2 while this one is multiplied. */
                    const char *pf = t == t0 && p + PF_AHEAD < p1 ? (const char *)(w + PF_AHEAD * K * PANEL) : 0;
                    panel_block(K, x + ra * ldx, x + rb * ldx, ldx, two, w, acc, pf);
                    store_rows(acc, rows, y + ra * ldy + p * PANEL, ldy, b);
                    if (two) store_rows(acc + 16 * PANEL, rows, y + rb * ldy + p * PANEL, ldy, b);
                }
            }
            _tile_release();
        }
    }
#undef TILE_ROW
    return 0;
}

#else /* no AMX in this build: amx_init says so, and nothing else is called */
int amx_init(void) { return 0; }
void amx_pack_weight(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {}
int amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y,
             int64_t ldy, const uint16_t *bias, int num_threads) { return -1; }
#endif
