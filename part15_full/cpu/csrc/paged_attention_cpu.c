/* Paged attention on a CPU that reads K/V blocks where they lie in the pool.

   The torch path (paged_attention.py) first gathers each sequence's blocks into one contiguous
   tensor, then SDPA reads that copy: every K/V byte a step needs is read twice and written once.
   Attending one query row costs a few FLOPs per byte, so on a CPU the time is memory traffic, and
   the copy is most of it. Here each (query row, KV head) walks its block table and reads each key
   and value row once, straight from the pool. That is the row kernel below, for decode and
   speculative decoding's few rows a sequence; a prefill's rows go a tile of rows at a time through
   prefill_tiles.h, which reads a key once for the whole tile (the caller says which rows make a
   tile, once a step for all layers).

   Layout (as paged_attention.py): q, out [rows, H, D], each row contiguous, `*_row_stride` floats
   apart; k_cache, v_cache [num_blocks, block_size, KV, D] contiguous; block_tables [seqs, width].
   Query head h reads KV head h / (H / KV) (GQA). Query row r is row row_idx[r] of q and out,
   belongs to sequence row_seq[r] and sees that sequence's first row_len[r] keys (causal); in a
   sliding-window layer (`window` W > 0, HF's semantics: position i sees keys i - W < j <= i) only
   keys max(0, row_len[r] - W) .. row_len[r] - 1. A row's walk starts at its first key (the row
   kernel; its AMX scores at the 16-key run holding it) or at the start of the block holding its
   tile's earliest (prefill_tiles.h), so a sliding layer reads at most W keys a row and a block more.

   Softmax is online (one pass over the keys, a block at a time): a running maximum m, a running
   sum l of exp(score - m), and an output accumulator rescaled whenever m grows. q, the pool and out
   are all fp32 or all bf16 (`bf16`); the sums are fp32 either way. A bf16 block's keys are widened
   once into the thread's fp32 buffer (a shift per element: vec_math.h) and the score loops read
   that; its values are widened in registers as they are summed. A bf16 pool is half the bytes to
   read, and each element is widened once, not once per query head.
   Built by build.py with the system C compiler; declared in kernels.py.

   Speed. Reading from memory is the floor, and the loops must not be slower than it. Each block's
   values are summed into accumulators held in vector registers across all its keys (a first
   version added each key into the accumulator in memory: a load and a store per 8 floats per key,
   which made the kernel 1.6-2.2x slower than this one); the head size is a compile-time constant
   for 64 and 128, so those loops unroll (the element type is a constant too). Scores are taken
   eight keys at a time and their eight partial-sum vectors folded into one vector of eight dot
   products (sum8x8), where a horizontal sum per key had cost as many shuffles for one key; and a
   block's softmax sum is added up in a vector, where one running float made a chain of 16
   dependent adds per head (the two: 1.1-1.2x faster in bf16, about the same in fp32, which reads
   twice the bytes). The dot products and the values' sums run on 16-float vectors, a key's 64
   floats in 4 multiply-adds where 8-float vectors took 8 (a 16-float partial sum is folded to 8
   lanes before sum8x8): on a 2-core Cascade Lake Xeon, 28 rows of ~190 keys, 30 layers, 1.08-1.11x
   faster with the pool in L3 and 1.01-1.05x from DRAM, where the reads, not the arithmetic, set
   the pace.
   In the engine K/V come from DRAM, not cache (30 layers' pools), and there memory latency is the
   limit: a 16-token block is too short a run for the hardware prefetchers to learn, and without
   help the kernel read 8-9 GB/s of the machine's 30, stalled on the first load of each row. So
   while a block is summed, the next one (or, after an item's last block, the first of the thread's
   next item) is asked for into L2, a row per key as the bf16 keys are widened, spread over the
   block's work: a burst of requests fills the core's miss buffers and stalls on them (fp32 and
   the AMX path have no per-key pass before the scores and ask at the block's start; on the
   Sapphire Rapids VM, AMX asking over the values loop instead was 1.1x slower). On a Zen 4 EPYC
   that made the kernel 1.4x faster with 30 pools, bf16 and fp32, and changed nothing with the
   pool in cache. An earlier prefetch into L1, all at once at each block's start, had been 6-8%
   faster on an AVX2 EPYC, and the kernel 1.26x faster without it on Zen 4.

   AMX. On a CPU with AMX tiles (Sapphire Rapids on), a bf16 decode row's scores are one tile
   multiply per 32 elements of the head: tdpbf16ps with 16 keys of the block as the left tile, read
   in place from the pool (rows KV x D elements apart), and the G query heads, laid out once a row
   as the right tile's (element pair, head) layout, into a 16 x G tile of fp32 scores. The keys are
   then never widened. The products of two bf16 are exact in fp32 either way; only the order of the
   sums differs. On a 2-core Sapphire Rapids VM the kernel's time in a held-out bf16 round fell from
   0.95-1.13 s to 0.90-0.94 s. attention_use_amx switches it (attention.py:
   VLLM_COURSE_CPU_ATTENTION_AMX=0).

   Values, all of a KV head's query heads at once. A block's softmax is taken for each query head
   first, then one pass over its value rows adds each row into all G heads' sums (values_heads):
   a row is loaded, and in bf16 widened, once instead of G times, and the bf16 values need no
   widening pass through memory. Each sum adds its keys in the same order, so the bits are the
   same. Decode attention alone on that VM (32 rows, 5,690 keys, 30 layers' pools, alternated
   builds): fp32 15.1-15.3 -> 13.8-14.5 ms a step, bf16 without AMX 13.5-14.0 -> 8.3-8.5, bf16 with
   AMX scores 8.7-9.3 -> 8.4-9.3. The AMX scores still pay, if less than before: alternated in one
   process, 8.34-9.39 ms (median 8.51) against 8.69-9.13 (8.84) without, and 6.44-6.70 against
   7.74-7.81 with the pools in L3. */
#include "vec_math.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256  /* tokens per KV block */
#define MAX_THREADS 64

typedef struct {
    const void *q, *k_cache, *v_cache; /* fp32 or bf16 elements, as `bf16` says */
    void *out;
    const int32_t *block_tables, *row_idx, *row_seq, *row_len;
    const int32_t *tiles; /* tile t: rows tiles[t] .. tiles[t + 1] - 1 (the row kernel's: one row) */
    const unsigned char *tiled; /* tiled[t]: tile t goes through prefill_tiles.h */
    int64_t q_row_stride, out_row_stride, table_stride;
    int num_kv_heads, group, head_dim, block_size, bf16;
    int window; /* the layer's sliding window in keys, 0: none (full causal attention) */
    float *widened; /* bf16: this thread's 2 x block_size x head_dim floats (a block's K and V, widened) */
    float scale;
    int64_t begin, end; /* this thread's work items: item = tile * num_kv_heads + kv_head */
} Job;

/* Eight floats as one value: GCC and clang compile arithmetic on it to one vector instruction
   (AVX) or two (SSE). Loads and stores go through a type that may sit at any float's address and
   may alias the floats it reads (may_alias: the pool and q are float arrays). */
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef float vec4 __attribute__((vector_size(16)));
/* Sixteen floats: the dot products' and the values' loops, one AVX-512 instruction (two AVX). */
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));

static inline vec16 load16(const float *p) { return *(const vec16_unaligned *)p; }
static inline void store16(float *p, vec16 x) { *(vec16_unaligned *)p = x; }
static inline vec16 splat16(float x) { return (vec16){0} + x; }
/* Lanes i and i + 8 added: a 16-lane partial sum as an 8-lane one. */
static inline vec8 fold16(vec16 x) {
    vec8 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    return lo + hi;
}

static inline vec8 load8(const float *p) { return *(const vec8_unaligned *)p; }
static inline void store8(float *p, vec8 x) { *(vec8_unaligned *)p = x; }

static inline vec8 splat8(float x) { return (vec8){x, x, x, x, x, x, x, x}; }
static inline float sum8(vec8 x) {
    vec4 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    lo += hi;
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

/* Two vectors' lanes picked into one (lanes 0-7: x's, 8-15: y's). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
typedef int ivec8 __attribute__((vector_size(32)));
#define SHUF(x, y, ...) __builtin_shuffle(x, y, (ivec8){__VA_ARGS__})
#endif

/* Eight dot products' partial sums (a[i]: key i's eight lanes) -> one vector of the eight sums:
   three rounds of adding neighbouring lanes, each round interleaving two vectors, in place of a
   horizontal sum per key (which takes as many shuffles for one key as this does for eight). */
static inline vec8 sum8x8(const vec8 *a) {
    vec8 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The largest of start and x[0 .. n-1], in four running maxima: one would be a chain of n
   dependent compares, which took an eighth of the row kernel's time. (A maximum is exact, so
   the order it is taken in does not change it.) */
static inline float max_from(const float *x, int n, float start) {
    float m0 = start, m1 = start, m2 = start, m3 = start;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        m0 = x[j] > m0 ? x[j] : m0;
        m1 = x[j + 1] > m1 ? x[j + 1] : m1;
        m2 = x[j + 2] > m2 ? x[j + 2] : m2;
        m3 = x[j + 3] > m3 ? x[j + 3] : m3;
    }
    for (; j < n; j++) m0 = x[j] > m0 ? x[j] : m0;
    m0 = m1 > m0 ? m1 : m0;
    m2 = m3 > m2 ? m3 : m2;
    return m2 > m0 ? m2 : m0;
}

#define CHUNKS (MAX_HEAD_DIM / 16)

/* The first key a row of `len` keys sees: 0, or in a sliding-window layer the window's first. */
static inline int first_key(int window, int len) { return window > 0 && len > window ? len - window : 0; }

/* Where the block after this one starts (head h's first row), for the prefetch: this item's next
   block, or after its last the first block the thread's next item reads; -1 if none. */
static inline int64_t next_block_at(const Job *job, int64_t item, int t0, int len, const int32_t *table,
                                    int64_t row_stride, const int D) {
    const int bs = job->block_size, KV = job->num_kv_heads;
    if (t0 + bs < len) return (int64_t)table[t0 / bs + 1] * bs * row_stride + (int64_t)(item % KV) * D;
    if (item + 1 >= job->end) return -1;
    const int r = job->tiles[(item + 1) / KV]; /* the next item's (first) row */
    if (job->row_len[r] <= 0) return -1;
    const int32_t first = job->block_tables[(int64_t)job->row_seq[r] * job->table_stride +
                                            first_key(job->window, job->row_len[r]) / bs];
    return first < 0 ? -1 : (int64_t)first * bs * row_stride + (int64_t)((item + 1) % KV) * D;
}

/* Row j of the block at `at`, K and V (`esz` bytes an element), on its way to L2. A hint: no load
   waits for it, and an address it gets wrong costs nothing but the hint. */
static inline void prefetch_row(const Job *job, int64_t at, int j, int64_t row_stride, const int D, const int esz) {
    const char *k = (const char *)job->k_cache + (at + j * row_stride) * esz;
    const char *v = (const char *)job->v_cache + (at + j * row_stride) * esz;
    for (int b = 0; b < D * esz; b += 64) {
        __builtin_prefetch(k + b, 0, 2);
        __builtin_prefetch(v + b, 0, 2);
    }
}

/* bf16 scores on AMX tiles (see "AMX" above): set by attention_use_amx, read by every call. */
static int use_amx = 0;

/* 1 when bf16 rows' scores go through the tiles from now on (on: asked, the build and CPU have
   AMX, and Linux lends the tile registers); 0 otherwise, and with on = 0. */
int attention_use_amx(int on) {
#if HAVE_AMX
    use_amx = on && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    use_amx = 0;
#endif
    return use_amx;
}

/* Whether this job's decode rows take the tiles: bf16, the switch on, 16-key sub-blocks and
   32-element k-steps that fit the shapes. */
static inline int amx_rows(const Job *job) {
    return HAVE_AMX && use_amx && job->bf16 && job->block_size % 16 == 0 && job->head_dim % 32 == 0;
}

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tile 0: scores, 16 keys x G fp32; tile 1: 16 keys x 32 elements of K (bf16); tile 2: the query
   heads' 32 elements as 16 pairs x G (bf16, pairs side by side: the tiles' B layout). */
static void amx_configure(int G) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(G * 4);
    cfg.rows[1] = 16, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(G * 4);
    _tile_loadconfig(&cfg);
}

/* s[g * bs + j - lo] = scale * q_g . k_j for this block's keys lo <= j < end (k16: its first K row,
   head h; rows row_stride elements apart). qv: the G query heads, [D / 32][16 pairs][G][2] bf16.
   Keys are taken 16 at a time from a multiple of 16, so every run of 16 rows lies inside the block
   (its size is a multiple of 16): a window's first key need not be one, and the scores outside
   lo .. end - 1 are not kept. */
static inline void amx_scores(const uint16_t *k16, int64_t row_stride, int lo, int end, const uint16_t *qv,
                              int G, const int D, float scale, float *s, int bs) {
    float sc[16 * MAX_GROUP];
    for (int j0 = lo & ~15; j0 < end; j0 += 16) {
        _tile_zero(0);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(1, k16 + j0 * row_stride + 32 * c, row_stride * 2);
            _tile_loadd(2, qv + c * 32 * G, G * 4);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc, G * 4);
        const int j1 = lo > j0 ? lo - j0 : 0, m = end - j0 < 16 ? end - j0 : 16;
        for (int g = 0; g < G; g++)
            for (int j = j1; j < m; j++) s[g * bs + j0 + j - lo] = sc[j * G + g] * scale;
    }
}
#endif

/* Sixteen bf16 as fp32 (a shift each: exact), from any address. */
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline vec16 widen16(const uint16_t *p) {
    return (vec16)(__builtin_convertvector(*(const u16x16 *)p, u32x16) << 16);
}

/* acc[g][0:16C] = acc[g] * shrink[g] + sum over the block's keys j of p[g][j] * v_j, for `gn` query
   heads at once (a constant where inlined, so their C x gn sums stay in registers): each value row
   is loaded (and, bf16, widened) once for all of them, where a pass per head loaded it gn times.
   Each sum still adds its keys in order, as a pass per head did. */
static inline __attribute__((always_inline)) void values_heads(const int gn, int n, const float *p, int bs,
                                                               const void *v, int64_t stride, const int C,
                                                               const int D, const float *shrink, float *acc,
                                                               const int bf16) {
    vec16 o[6][CHUNKS];
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < C; c++) o[g][c] = load16(acc + g * D + 16 * c) * splat16(shrink[g]);
    for (int j = 0; j < n; j++) {
        vec16 vj[CHUNKS];
        for (int c = 0; c < C; c++)
            vj[c] = bf16 ? widen16((const uint16_t *)v + j * stride + 16 * c)
                         : load16((const float *)v + j * stride + 16 * c);
        for (int g = 0; g < gn; g++) {
            const vec16 pj = splat16(p[g * bs + j]);
            for (int c = 0; c < C; c++) o[g][c] += pj * vj[c];
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < C; c++) store16(acc + g * D + 16 * c, o[g][c]);
}

/* The row kernel: one query row r and one KV head. Inlined with D and the element type constants for the common head
   sizes, so the loops over D unroll and the output accumulators stay in registers while the keys
   stream by. k points at this block's first K row, `stride` floats apart: in the pool (fp32), or
   in the thread's buffer, widened (bf16 without AMX); values_heads reads the V rows in the pool. */
static inline __attribute__((always_inline)) void attend_row(const Job *job, int64_t item, int r, const int D,
                                                             const int bf16) {
    const int KV = job->num_kv_heads, G = job->group, bs = job->block_size, C = D / 16;
    const int h = (int)(item % KV);
    const int len = job->row_len[r];
    const int32_t *table = job->block_tables + (int64_t)job->row_seq[r] * job->table_stride;
    const int64_t q_at = (int64_t)job->row_idx[r] * job->q_row_stride + (int64_t)h * G * D;
    const int64_t out_at = (int64_t)job->row_idx[r] * job->out_row_stride + (int64_t)h * G * D;
    const int64_t row_stride = (int64_t)KV * D; /* from one token's K (or V) row to the next */
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP * MAX_BLOCK], acc[MAX_GROUP * MAX_HEAD_DIM];
    float q[MAX_GROUP * MAX_HEAD_DIM]; /* this KV head's query heads, in fp32 */

    const int amx = bf16 && amx_rows(job);
#if HAVE_AMX
    uint16_t qv[MAX_GROUP * MAX_HEAD_DIM]; /* amx: the query heads in the tiles' layout */
    if (amx) {
        const uint16_t *q16 = (const uint16_t *)job->q + q_at;
        for (int c = 0; c < D / 32; c++)
            for (int r = 0; r < 16; r++)
                for (int g = 0; g < G; g++)
                    for (int e = 0; e < 2; e++) qv[((c * 16 + r) * G + g) * 2 + e] = q16[g * D + 32 * c + 2 * r + e];
    } else
#endif
        for (int i = 0; i < G * D; i++) q[i] = load_elem(job->q, q_at + i, bf16);
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
    memset(acc, 0, sizeof(float) * G * D);
    const int first = first_key(job->window, len); /* 0, or the window's first key */
    for (int t0 = first / bs * bs; t0 < len; t0 += bs) {
        /* The block's keys lo .. lo + n - 1 (lo > 0 only in a window's first block), from row `at`. */
        const int lo = first > t0 ? first - t0 : 0, n = (len - t0 < bs ? len - t0 : bs) - lo;
        const int64_t block = (int64_t)table[t0 / bs] * bs * row_stride + (int64_t)h * D; /* row 0, head h */
        const int64_t at = block + lo * row_stride;
        const float *k, *v;
        int64_t stride;
        /* The next block on its way while this one is summed (see "Speed" above). */
        const int64_t next = next_block_at(job, item, t0, len, table, row_stride, D);
        const int ahead = next < 0 ? 0 : bs; /* its rows to ask for (past its length: a few wasted hints) */
        if (bf16) {
            const uint16_t *k16 = (const uint16_t *)job->k_cache + at;
            float *kw = job->widened;
            if (amx) { /* keys stay bf16, read by the tiles where they lie */
                for (int j = 0; j < ahead; j++) prefetch_row(job, next, j, row_stride, D, 2);
            } else {
                for (int j = 0; j < n; j++) {
                    if (j < ahead) prefetch_row(job, next, j, row_stride, D, 2); /* a row per key: spread out */
                    for (int d = 0; d < D; d++) kw[j * D + d] = bf16_to_f32(k16[j * row_stride + d]);
                }
                for (int j = n; j < ahead; j++) prefetch_row(job, next, j, row_stride, D, 2); /* a short last block */
            }
            k = kw, v = NULL, stride = D; /* values: read from the pool, widened in registers */
        } else {
            k = (const float *)job->k_cache + at, v = (const float *)job->v_cache + at, stride = row_stride;
            for (int j = 0; j < ahead; j++) prefetch_row(job, next, j, row_stride, D, 4); /* no per-key loop here */
        }
#if HAVE_AMX
        if (amx)
            amx_scores((const uint16_t *)job->k_cache + block, row_stride, lo, lo + n, qv, G, D, job->scale, s, bs);
        else
#endif
        for (int g = 0; g < G; g++) { /* scores: eight keys at a time, eight sums in flight */
            const float *qg = q + g * D;
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                vec16 a[8] = {{0}};
                for (int c = 0; c < C; c++) {
                    const vec16 qc = load16(qg + 16 * c);
                    for (int i = 0; i < 8; i++) a[i] += qc * load16(k + (j + i) * stride + 16 * c);
                }
                vec8 h[8];
                for (int i = 0; i < 8; i++) h[i] = fold16(a[i]);
                vec8 dots = sum8x8(h);
                for (int d = 16 * C; d < D; d++)
                    for (int i = 0; i < 8; i++) dots[i] += qg[d] * k[(j + i) * stride + d];
                store8(s + g * bs + j, dots * splat8(job->scale));
            }
            for (; j < n; j++) {
                const float *kj = k + j * stride;
                vec16 a = {0};
                for (int c = 0; c < C; c++) a += load16(qg + 16 * c) * load16(kj + 16 * c);
                float dot = sum8(fold16(a));
                for (int d = 16 * C; d < D; d++) dot += qg[d] * kj[d];
                s[g * bs + j] = dot * job->scale;
            }
        }
        float shrink[MAX_GROUP];
        for (int g = 0; g < G; g++) { /* online softmax */
            const float block_max = max_from(s + g * bs, n, m[g]);
            float c_old = 1.f;
            if (block_max > m[g]) { /* a new maximum: what was summed so far shrinks */
                c_old = expf(m[g] - block_max);
                l[g] *= c_old;
                m[g] = block_max;
            }
            shrink[g] = c_old;
            float *p = s + g * bs;
            for (int j = 0; j < n; j++) p[j] = exp_approx(p[j] - m[g]); /* vectorized (vec_math.h) */
            vec8 sum = {0}; /* eight partial sums: one running sum would be a chain of dependent adds */
            int j = 0;
            for (; j + 8 <= n; j += 8) sum += load8(p + j);
            float block_sum = sum8(sum);
            for (; j < n; j++) block_sum += p[j];
            l[g] += block_sum;
        }
        /* This block's values, for the query heads a few at a time (what the registers hold). */
        const void *vb = bf16 ? (const void *)((const uint16_t *)job->v_cache + at) : (const void *)v;
        const int64_t vs = bf16 ? row_stride : stride;
        const int per = C <= 4 ? 6 : C <= 8 ? 3 : 1;
        for (int g0 = 0; g0 < G; g0 += per) {
            const int gn = G - g0 < per ? G - g0 : per;
            switch (gn) {
#define HEADS(h) case h: values_heads(h, n, s + g0 * bs, bs, vb, vs, C, D, shrink + g0, acc + g0 * D, bf16); break;
            HEADS(1) HEADS(2) HEADS(3) HEADS(4) HEADS(5) HEADS(6)
#undef HEADS
            default: break;
            }
        }
        for (int g = 0; g < G; g++) { /* head sizes off the vector width */
            float *a = acc + g * D;
            const float *p = s + g * bs;
            for (int d = 16 * C; d < D; d++) {
                a[d] *= shrink[g];
                for (int j = 0; j < n; j++) a[d] += p[j] * load_elem(vb, j * vs + d, bf16);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float inv = len > 0 ? 1.f / l[g] : 0.f;
        for (int d = 0; d < D; d++) store_elem(job->out, out_at + g * D + d, acc[g * D + d] * inv, bf16);
    }
}

#include "prefill_tiles.h"

static inline __attribute__((always_inline)) void attend(const Job *job, int64_t item, const int D,
                                                         const int bf16) {
    const int64_t t = item / job->num_kv_heads;
    if (job->tiled[t]) attend_tile(job, item, job->tiles[t], job->tiles[t + 1] - job->tiles[t], D, bf16);
    else attend_row(job, item, job->tiles[t], D, bf16);
}

static void attend_one(const Job *job, int64_t item) {
    switch (job->head_dim * 2 + job->bf16) { /* constants for the head sizes models use, by type */
    case 64 * 2: attend(job, item, 64, 0); break;
    case 64 * 2 + 1: attend(job, item, 64, 1); break;
    case 128 * 2: attend(job, item, 128, 0); break;
    case 128 * 2 + 1: attend(job, item, 128, 1); break;
    default:
        if (job->bf16) attend(job, item, job->head_dim, 1);
        else attend(job, item, job->head_dim, 0);
    }
}

static void run_job(const Job *job) {
#if HAVE_AMX
    const int amx = amx_rows(job) && job->begin < job->end;
    if (amx) amx_configure(job->group);
#endif
    for (int64_t item = job->begin; item < job->end; item++) attend_one(job, item);
#if HAVE_AMX
    if (amx) _tile_release();
#endif
}

#ifndef _OPENMP
static void *run_thread(void *job) {
    run_job((const Job *)job);
    return NULL;
}
#endif

/* The rows a tile of prefill_tiles.h holds: 16 / G of them (G query heads per KV head). */
int attention_tile_lanes(void) { return LANES; }

/* Returns 0; -1 when the shapes exceed the fixed buffers or a tile is not one the kernel takes (the
   caller then takes the torch path), -2 when the buffers cannot be allocated. The step's tiles
   come from the caller, worked out once for all layers (attention.py's plan): tile t is rows
   tiles[t] .. tiles[t + 1] - 1, one sequence's, through prefill_tiles.h where tiled[t] (at most
   LANES / G rows) and else one row through the row kernel. window: the layer's sliding window in
   keys, 0 for none (see the top of this file). */
/* q, k_cache, v_cache and out: fp32 arrays, or bf16 ones (uint16_t) where bf16 is 1. */
int paged_attention_rows(const void *q, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, const int32_t *block_tables, int64_t table_stride,
                         const int32_t *row_idx, const int32_t *row_seq, const int32_t *row_len,
                         const int32_t *tiles, const unsigned char *tiled, int num_tiles,
                         int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int window, void *out, int64_t out_row_stride,
                         int num_threads, int bf16) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM ||
        block_size > MAX_BLOCK)
        return -1;
    const int group = num_heads / num_kv_heads, per_tile = LANES / group;
    for (int t = 0; t < num_tiles; t++) {
        const int n = tiles[t + 1] - tiles[t];
        if (n < 1 || n > (tiled[t] ? per_tile : 1) || row_seq[tiles[t + 1] - 1] != row_seq[tiles[t]]) return -1;
    }
    if (window < 0) window = 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    Job jobs[MAX_THREADS];
    const int64_t per_thread = 2 * (int64_t)block_size * head_dim; /* a block's K and V, widened */
    float *widened = bf16 ? malloc(sizeof(float) * per_thread * num_threads) : NULL;
    if (bf16 && !widened) return -2;

    /* Split the items by the work they do, not by their count: rows differ in length, and a tile
       of 5 rows costs about what 2 rows cost the row kernel (measured on a Xeon); a window cuts
       the keys a row reads. */
#define COST(t) ((int64_t)(row_len[tiles[(t) + 1] - 1] - first_key(window, row_len[tiles[t]])) * (tiled[t] ? 5 : 2))
    const int64_t items = (int64_t)num_tiles * num_kv_heads;
    int64_t total = 0, done = 0, item = 0;
    for (int t = 0; t < num_tiles; t++) total += COST(t);
    total *= num_kv_heads;
    for (int t = 0; t < num_threads; t++) {
        Job *job = &jobs[t];
        *job = (Job){q, k_cache, v_cache, out, block_tables, row_idx, row_seq, row_len, tiles, tiled,
                     q_row_stride, out_row_stride, table_stride, num_kv_heads, group, head_dim, block_size,
                     bf16 != 0, window, widened ? widened + t * per_thread : NULL, scale, item, item};
        const int64_t target = total * (t + 1) / num_threads;
        while (item < items && (t == num_threads - 1 || done < target)) {
            done += COST(item / num_kv_heads);
            item++;
        }
        job->end = item;
    }
#undef COST
#ifdef _OPENMP
    /* torch's own OpenMP threads: this library links libgomp.so.1, which the process already has
       loaded for torch, so the kernel runs on the same pool (threads of a second pool would wait
       on cores that torch's idle threads keep spinning on). */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++) run_job(&jobs[t]);
#else
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < num_threads; t++)
        started[t] = jobs[t].begin < jobs[t].end && pthread_create(&threads[t], NULL, run_thread, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < num_threads; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else run_job(&jobs[t]); /* empty, or no thread could be started: run it here */
    }
#endif
    free(widened);
    return 0;
}

/* This step's new K and V into the pool before attending (vLLM's reshape_and_cache): token t's row
   of k and of v (row_elems = kv_heads x head_dim contiguous elements; rows `*_row_stride` elements
   apart: views into the fused QKV output) goes to slot slots[t] of k_cache and v_cache, pools of
   num_slots such rows. A slot of -1 (a padding token) is skipped. One call for both, where torch
   needs an index_copy_ each at ~25 us for a few KB. Returns -1, having written nothing, if a slot
   is past the pool. */
int store_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, void *k_cache,
             void *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row_elems, int64_t num_slots,
             int bf16) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return -1;
    const int64_t elem = bf16 ? 2 : 4, row = row_elems * elem;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * row, (const char *)k + t * k_row_stride * elem, row);
        memcpy((char *)v_cache + slots[t] * row, (const char *)v + t * v_row_stride * elem, row);
    }
    return 0;
}
