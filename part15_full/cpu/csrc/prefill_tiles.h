/* Paged attention for a prefill's rows, a tile of them at a time: included by paged_attention_cpu.c
   (after its Job, next_block_at and prefetch_row), which sends a tile of rows here when its caller
   says so: attention.py tiles a sequence's rows when it has more than SHORT_QUERY (8) of them
   in a step. Read that file first.

   Why. The row kernel there walks a block's keys once per query row. A prefill of n tokens has n
   rows that read the same keys, and per key the row kernel spends more on its per-row work (a
   dot product's horizontal sum, the softmax bookkeeping, prefetches) than on the multiply-adds:
   on a 2-core Cascade Lake Xeon its prefills ran at ~18 GFLOP/s.

   Lanes. An item here is one KV head and a tile of up to 16 / G consecutive rows of one sequence
   (5 rows of 3 query heads for SmolLM2). Each of the tile's query vectors is a lane of a 16-float
   vector, and every step is one vector operation on all lanes: a key's 16 scores are D multiply-
   adds of the key's element d, broadcast, into the lanes' q[d] (`qt`: the tile's queries,
   transposed once per item); its 16 softmax weights are one vector exp; its value row is added
   into each lane's output with the lane's weight. Nothing is summed across lanes (no horizontal
   sums), and a key is read once for the whole tile: ~2x faster than the row kernel on prefills
   (cpu/README.md has the measurements). For a decode row, with 3 of 16 lanes live, the same maths
   spends 16 lanes' work on 3: slower there than the row kernel, which is why decode stays on it.

   A lane's arithmetic does not depend on the other lanes: a key past a lane's causal length gets
   weight exactly 0 and a block past it leaves the lane's sums exactly as they were, so a prefill
   row's output is the same bit for bit whichever tile it lands in. A sliding window likewise: the
   tile walks from the block holding its rows' earliest first key, and a key before a lane's own
   first key gets weight exactly 0 (a score of -inf, then an exp of 0). A block wholly before it
   leaves the lane as it started: its maximum stays at the finite -FLT_MAX it starts from (not
   -inf: -inf - -inf would be NaN), its rescale is exp(0) = 1 exactly, and it adds nothing.
   A row's output is not the row kernel's (other summation orders): a prompt's rows round the same
   whatever shares the step, unless the scheduler cuts a chunk of it to 8 tokens or fewer, which
   then takes the row kernel. */

#define LANES 16 /* query vectors a tile holds */
#define KEYS 8   /* keys whose scores are summed together, each in its own register */

/* 16 floats (or their bit patterns as ints) as one value: GCC and clang compile arithmetic on it
   to one AVX-512 instruction, or two AVX ones. Loads and stores go through a type that may sit at
   any float's address and alias the floats it reads. C has no ?: on vectors: selects are masks. */
typedef float lanes __attribute__((vector_size(4 * LANES)));
typedef int32_t ilanes __attribute__((vector_size(4 * LANES)));
typedef float lanes_unaligned __attribute__((vector_size(4 * LANES), aligned(4), may_alias));

static inline lanes load_lanes(const float *p) { return *(const lanes_unaligned *)p; }
static inline void store_lanes(float *p, lanes x) { *(lanes_unaligned *)p = x; }
static inline lanes splat(float x) { return (lanes){0} + x; }
static inline lanes select_lanes(ilanes mask, lanes a, lanes b) {
    return (lanes)((mask & (ilanes)a) | (~mask & (ilanes)b));
}
static inline lanes max_lanes(lanes a, lanes b) { return select_lanes(a > b, a, b); }

/* vec_math.h's exp_approx on 16 lanes: its steps (EXP_*), as vector operations. */
static inline lanes exp_lanes(lanes x) {
    x = max_lanes(x, splat(-87.f));
    x = select_lanes(x > 87.f, splat(87.f), x);
    const lanes n = EXP_ROUND(x);
    const lanes r = EXP_REDUCE(x, n);
    const lanes y = EXP_POLY(r);
    const ilanes bits = (__builtin_convertvector(n, ilanes) + 127) << 23;
    return y * (lanes)bits;
}

/* Scores of nk keys (k: the first one's row, `stride` floats apart) for every lane. nk is a
   constant where inlined, so its sums are registers; each key's sum runs over d in order. */
static inline __attribute__((always_inline)) void tile_scores(const int nk, const float *qt, const float *k,
                                                              int64_t stride, const int D, lanes *s) {
    lanes a[KEYS];
    for (int i = 0; i < nk; i++) a[i] = (lanes){0};
    for (int d = 0; d < D; d++) {
        const lanes qd = load_lanes(qt + d * LANES);
        for (int i = 0; i < nk; i++) a[i] += qd * k[i * stride + d];
    }
    for (int i = 0; i < nk; i++) s[i] = a[i];
}

/* acc[i][:] = acc[i][:] * shrink[i] + sum over the block's keys j of p[j][i] * v[j][:], for the
   first nl lanes (a constant where inlined: the accumulators of a 16-float slice are registers). */
static inline __attribute__((always_inline)) void tile_values(const int nl, int n, const lanes *p, const float *v,
                                                              int64_t stride, const int D, lanes shrink,
                                                              float *acc) {
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
        lanes o[LANES];
        for (int i = 0; i < nl; i++) o[i] = load_lanes(acc + i * D + d) * shrink[i];
        for (int j = 0; j < n; j++) {
            const lanes vj = load_lanes(v + j * stride + d);
            for (int i = 0; i < nl; i++) o[i] += p[j][i] * vj;
        }
        for (int i = 0; i < nl; i++) store_lanes(acc + i * D + d, o[i]);
    }
    for (; d < D; d++) /* head sizes off the vector width */
        for (int i = 0; i < nl; i++) {
            float o = acc[i * D + d] * shrink[i];
            for (int j = 0; j < n; j++) o += p[j][i] * v[j * stride + d];
            acc[i * D + d] = o;
        }
}

/* One KV head and one tile of rows, r0 .. r0 + rows - 1. Inlined with D and the element type
   constants for the common head sizes. */
static inline __attribute__((always_inline)) void attend_tile(const Job *job, int64_t item, int r0, int rows,
                                                              const int D, const int bf16) {
    const int KV = job->num_kv_heads, G = job->group, bs = job->block_size;
    const int h = (int)(item % KV), nl = rows * G; /* live lanes: lane t * G + g is row r0 + t, head h * G + g */
    const int32_t *table = job->block_tables + (int64_t)job->row_seq[r0] * job->table_stride;
    const int64_t row_stride = (int64_t)KV * D; /* from one token's K (or V) row to the next */
    /* Only a sequence's first tile asks for blocks ahead: the tiles after it read the same blocks
       again, from cache (and a prefill's new K/V were stored a moment ago). */
    const int first = r0 == 0 || job->row_seq[r0 - 1] != job->row_seq[r0];
    float qt[MAX_HEAD_DIM * LANES] __attribute__((aligned(64))); /* qt[d][lane] */
    float acc[LANES * MAX_HEAD_DIM] __attribute__((aligned(64)));
    lanes p[MAX_BLOCK];
    int32_t lens[LANES] = {0}, firsts[LANES] = {0}; /* each lane's keys: firsts[i] .. lens[i] - 1 */
    int len = 0, min_len = job->row_len[r0]; /* the tile's longest and shortest rows */
    int min_first = INT32_MAX, max_first = 0; /* the tile's earliest and latest first keys (a window's) */

    memset(qt, 0, sizeof(float) * D * LANES);
    for (int t = 0; t < rows; t++) {
        const int64_t q_at = (int64_t)job->row_idx[r0 + t] * job->q_row_stride + (int64_t)h * G * D;
        const int row_len = job->row_len[r0 + t], row_first = first_key(job->window, row_len);
        for (int g = 0; g < G; g++) {
            lens[t * G + g] = row_len;
            firsts[t * G + g] = row_first;
            for (int d = 0; d < D; d++) qt[d * LANES + t * G + g] = load_elem(job->q, q_at + g * D + d, bf16);
        }
        len = row_len > len ? row_len : len;
        min_len = row_len < min_len ? row_len : min_len;
        min_first = row_first < min_first ? row_first : min_first;
        max_first = row_first > max_first ? row_first : max_first;
    }
    ilanes lenv, firstv;
    memcpy(&lenv, lens, sizeof lenv);
    memcpy(&firstv, firsts, sizeof firstv);
    memset(acc, 0, sizeof(float) * nl * D);
    lanes m = splat(-FLT_MAX), l = {0}; /* finite: a lane that sees no key keeps exp(m - m) = 1 */
    for (int t0 = min_first / bs * bs; t0 < len; t0 += bs) {
        const int n = len - t0 < bs ? len - t0 : bs;
        const int64_t at = (int64_t)table[t0 / bs] * bs * row_stride + (int64_t)h * D; /* row 0, head h */
        const int64_t next = first ? next_block_at(job, item, t0, len, table, row_stride, D) : -1;
        const int ahead = next < 0 ? 0 : bs;
        const float *k, *v;
        int64_t stride;
        if (bf16) { /* widened once into the thread's buffer, as the row kernel does */
            const uint16_t *k16 = (const uint16_t *)job->k_cache + at, *v16 = (const uint16_t *)job->v_cache + at;
            float *kw = job->widened, *vw = kw + (int64_t)bs * D;
            for (int j = 0; j < n; j++) {
                if (j < ahead) prefetch_row(job, next, j, row_stride, D, 2);
                for (int d = 0; d < D; d++) {
                    kw[j * D + d] = bf16_to_f32(k16[j * row_stride + d]);
                    vw[j * D + d] = bf16_to_f32(v16[j * row_stride + d]);
                }
            }
            for (int j = n; j < ahead; j++) prefetch_row(job, next, j, row_stride, D, 2);
            k = kw, v = vw, stride = D;
        } else {
            k = (const float *)job->k_cache + at, v = (const float *)job->v_cache + at, stride = row_stride;
            for (int j = 0; j < ahead; j++) prefetch_row(job, next, j, row_stride, D, 4);
        }
        int j = 0;
        for (; j + KEYS <= n; j += KEYS) tile_scores(KEYS, qt, k + j * stride, stride, D, p + j);
        for (; j < n; j++) tile_scores(1, qt, k + j * stride, stride, D, p + j);
        /* Online softmax, all lanes at once. A key outside a lane's keys (past its length, or
           before its window) is -inf there, weight 0; the selects only where the block reaches
           past the tile's shortest row or before its latest first key. */
        const int ragged = t0 + n > min_len || t0 < max_first;
#define SEES(key) (((key) < lenv) & ((key) >= firstv)) /* the lanes that see key `key` */
        lanes block_max = m;
        for (j = 0; j < n; j++) {
            p[j] *= job->scale;
            if (ragged) p[j] = select_lanes(SEES(t0 + j), p[j], splat(-INFINITY));
            block_max = max_lanes(block_max, p[j]);
        }
        const lanes shrink = exp_lanes(m - block_max); /* what was summed so far, rescaled */
        m = block_max;
        l *= shrink;
        for (j = 0; j < n; j++) {
            p[j] = exp_lanes(p[j] - m);
            if (ragged) p[j] = select_lanes(SEES(t0 + j), p[j], (lanes){0});
            l += p[j];
        }
        switch (nl) {
#define LIVE(c) case c: tile_values(c, n, p, v, stride, D, shrink, acc); break;
        LIVE(1) LIVE(2) LIVE(3) LIVE(4) LIVE(5) LIVE(6) LIVE(7) LIVE(8)
        LIVE(9) LIVE(10) LIVE(11) LIVE(12) LIVE(13) LIVE(14) LIVE(15) LIVE(16)
#undef LIVE
        default: break;
        }
#undef SEES
    }
    for (int t = 0; t < rows; t++) {
        const int64_t out_at = (int64_t)job->row_idx[r0 + t] * job->out_row_stride + (int64_t)h * G * D;
        for (int g = 0; g < G; g++) {
            const int i = t * G + g;
            const float inv = lens[i] > 0 ? 1.f / l[i] : 0.f;
            for (int d = 0; d < D; d++) store_elem(job->out, out_at + g * D + d, acc[i * D + d] * inv, bf16);
        }
    }
}
