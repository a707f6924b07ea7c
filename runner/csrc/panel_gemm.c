/* y = x @ W^T (+ bias) in float32 for the CPU, with W stored once as column panels.
 *
 * Layout: W [N, K] is packed as panels [ceil(N / 16)][K][16]: panel p holds output columns
 * 16p .. 16p + 15, one 16-float row per k, zero-padded past N. A panel is read front to back,
 * so the weights stream sequentially from memory, which is what a decode step (a few rows
 * of x against every weight of the model) is bound by.
 *
 * Each task computes up to 16 rows of x against one panel with 16 vector accumulators (one
 * per row) that stay in registers for the whole K loop: every weight vector loaded feeds up to
 * 16 fused multiply-adds; 1-3 rows take 4 panels at once (few_rows_panels). Each output is one
 * sequential sum over k, so a row's result does not depend on how many other rows share the
 * call (batch-invariant). Tried and slower here: x transposed into row panels, 2-3 panels per
 * task with 8-12 rows, and bfloat16 or int8 panels widened once into float32 for all of a
 * prefill's tiles.
 *
 * The panels hold float32 weights, bfloat16 ones (the top 16 bits of each float32, as torch
 * rounds them) or int8 ones with a float32 scale per column and group of 32 k (a panel's
 * [K][16] bytes are then followed by its [ceil(K / 32)][16] scales). A decode step streams
 * every weight once, so a half or a quarter of the bytes is close to a half or a quarter of
 * the time where memory bandwidth bounds it. Each weight becomes float32 as it is read: a
 * bfloat16 one exactly (a shift), an int8 one as float(q) * scale, the same single rounding
 * that dequantizing it gives. x, the accumulators and y stay float32, so a product on bfloat16
 * or int8 panels equals bit for bit the float32 product of the rounded or dequantized weights.
 *
 * A fourth type, bfloat16 pairs, rounds x too: the products take both inputs rounded to
 * bfloat16 and sum in float32 (torch's float32 matmul precision "medium"; llama.cpp's bf16
 * products on the CPU), through AVX512-BF16's dot product of bfloat16 pairs, which does twice
 * the multiply-adds of a float32 FMA per instruction. See pair_gemm at the end.
 *
 * Built at run time with -march=native, on AVX-512 machines only (see
 * runner/cpu_kernel_loader.py); the vector type becomes one AVX-512 register, the widening of
 * bfloat16 and int8 weights uses AVX-512 intrinsics, and threads come from the OpenMP runtime
 * torch already loaded.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

enum { LANES = 16, MAX_ROWS = 16 };
/* What a panel holds (runner/cpu_panels.py WEIGHT_TYPES); int8 scales cover INT8_GROUP k. */
enum { WEIGHTS_F32 = 0, WEIGHTS_BF16 = 1, WEIGHTS_INT8 = 2, WEIGHTS_BF16_PAIRS = 3 };
enum { INT8_GROUP = 32 };
/* Up to FEW_ROWS rows of x are multiplied with WIDE panels at a time (see few_rows_panels). */
enum { FEW_ROWS = 3, WIDE = 4 };
/* Prefetch this many bytes ahead in the panel (4 KB), into the outer caches only (locality
 * 1): on the EPYC this was tuned on that beat no prefetch, nearer distances and L1 prefetches
 * by 5-10% at 16 rows. */
enum { PREFETCH_AHEAD = 4096, PREFETCH_LOCALITY = 1 };
/* Rows per pass over the weights, at most: a pass's rows of x (about 512 KB) stay within a
 * core's L2 however long the batch (no cost measured where they fit anyway). */
enum { CHUNK_BYTES = 1 << 19 };

/* Bytes of one weight of each type. */
static inline long weight_bytes(int wtype)
{
    return wtype == WEIGHTS_F32 ? 4 : wtype == WEIGHTS_BF16 ? 2 : 1;
}

/* The 16 weights at element `at` of a panel, as float32 (wtype: constant after inlining);
 * int8 weights are multiplied by `scale`, their group's scales. */
static inline __attribute__((always_inline)) vec16 load_weights(const void *panel, long at,
                                                               const int wtype, vec16 scale)
{
    vec16 w;
    if (wtype == WEIGHTS_INT8) {
        const signed char *src = (const signed char *)panel + at;
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)src)));
        memcpy(&w, &q, sizeof(w));
        w = w * scale;
    } else if (wtype == WEIGHTS_BF16) {
        /* One zero-extending load and a shift: GCC's generic widening of a 32-byte vector
         * takes two half loads and an insert. */
        const unsigned short *src = (const unsigned short *)panel + at;
        __m256i h = _mm256_loadu_si256((const void *)src);
        __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        memcpy(&w, &bits, sizeof(w));
    } else {
        memcpy(&w, (const float *)panel + at, sizeof(w));
    }
    return w;
}

/* rows x panels of y: y[row0 + r, col0 + 16j + c] = sum over k of x[row0 + r, k] *
 * panel_j[k, c], panel j `stride` bytes after panel 0. Called with panels = 1, except for a few
 * rows (FEW_ROWS): the 16 row pointers of a full tile stay where the loop reaches them fastest
 * in this form (plainer one-panel forms, or x passed pre-offset, cost 5-15% on prefill-sized
 * batches: register allocation, not arithmetic). */
static inline __attribute__((always_inline)) void panel_tile(
    const float *restrict x, const void *restrict panel, long stride, float *restrict y, long K,
    long ldx, long ldy, long col0, long row0, const int rows, const int panels, const int wtype)
{
    vec16 acc[MAX_ROWS][WIDE];
    vec16 scale[WIDE] = {{0}}; /* int8: the current group's scales of each panel */
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = (vec16){0};
    const float *xr = x + row0 * ldx;
    for (long k = 0; k < K; k++) {
        vec16 w[WIDE];
        for (int j = 0; j < panels; j++) {
            const char *pj = (const char *)panel + j * stride;
            /* int8: the panel's scales follow its K rows of 16 bytes, a row of 16 per group. */
            if (wtype == WEIGHTS_INT8 && k % INT8_GROUP == 0)
                memcpy(&scale[j], (const float *)(pj + K * LANES) + k / INT8_GROUP * LANES,
                       sizeof(vec16));
            const long at = k * LANES;
            w[j] = load_weights(pj, at, wtype, scale[j]);
            __builtin_prefetch(pj + at * weight_bytes(wtype) + PREFETCH_AHEAD, 0,
                               PREFETCH_LOCALITY);
        }
        for (int r = 0; r < rows; r++) {
            float s = xr[r * ldx + k];
            for (int j = 0; j < panels; j++)
                acc[r][j] += s * w[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            memcpy(y + (row0 + r) * ldy + col0 + j * LANES, &acc[r][j], sizeof(vec16));
}

/* Bytes of one panel: K rows of 16 weights, and for int8 a row of 16 scales per group. */
static inline long panel_bytes(long K, int wtype)
{
    long bytes = K * LANES * weight_bytes(wtype);
    if (wtype == WEIGHTS_INT8)
        bytes += (K + INT8_GROUP - 1) / INT8_GROUP * LANES * (long)sizeof(float);
    return bytes;
}

/* The first M / 16 * 16 rows against panel p, in tiles of 16. */
static inline __attribute__((always_inline)) void full_panel(
    const float *x, long ldx, const void *packed, float *y, long M, long K, long panels, long p,
    const int wtype)
{
    const long stride = panel_bytes(K, wtype);
    const char *panel = (const char *)packed + p * stride;
    for (long row0 = 0; row0 + MAX_ROWS <= M; row0 += MAX_ROWS)
        panel_tile(x, panel, stride, y, K, ldx, panels * LANES, p * LANES, row0, MAX_ROWS, 1,
                   wtype);
}

#define TILE_CASE(R, W) \
    case R: \
        panel_tile(x, panel, stride, y, K, ldx, panels * LANES, p * LANES, 0, R, W, wtype); \
        break;

/* M < 16 rows against panel p, one tile; the switch makes its row count a constant, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void partial_panel(
    const float *x, long ldx, const void *packed, float *y, long M, long K, long panels, long p,
    const int wtype)
{
    const long stride = panel_bytes(K, wtype);
    const char *panel = (const char *)packed + p * stride;
    switch (M) {
        TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1) TILE_CASE(5, 1)
        TILE_CASE(6, 1) TILE_CASE(7, 1) TILE_CASE(8, 1) TILE_CASE(9, 1) TILE_CASE(10, 1)
        TILE_CASE(11, 1) TILE_CASE(12, 1) TILE_CASE(13, 1) TILE_CASE(14, 1) TILE_CASE(15, 1)
    }
}

/* M <= FEW_ROWS rows against WIDE panels from panel WIDE * t (one by one past the last whole
 * group of WIDE). With so few rows a panel's time is its chain of K dependent multiply-adds
 * into each accumulator, not its bytes; WIDE panels side by side run WIDE chains at once.
 * Each output is still the same sequential sum over k. Measured against one panel at a time:
 * 0.6-0.9x the time at 1-3 rows (most for bfloat16 and int8, whose weights arrive fastest),
 * but up to 1.27x at 4 rows of a float32 product that fits in cache, so 4 rows and more keep
 * one panel at a time. */
static inline __attribute__((always_inline)) void few_rows_panels(
    const float *x, long ldx, const void *packed, float *y, long M, long K, long panels, long t,
    const int wtype)
{
    const long stride = panel_bytes(K, wtype);
    const long p = t * WIDE;
    const char *panel = (const char *)packed + p * stride;
    if (p + WIDE > panels) {
        for (long q = p; q < panels; q++)
            partial_panel(x, ldx, packed, y, M, K, panels, q, wtype);
        return;
    }
    switch (M) {
        TILE_CASE(1, WIDE) TILE_CASE(2, WIDE) TILE_CASE(3, WIDE)
    }
}

/* Each weight type gets a parallel loop of its own: OpenMP outlines a loop's body before GCC
 * inlines, so a constant weight type must already be in the body for the tiles to be
 * specialised (a float32 tile then compiles exactly as it did before other types existed). */
#define EACH_TASK(CALL, TASKS, WTYPE) \
    _Pragma("omp parallel for schedule(static)") \
    for (long t = 0; t < (TASKS); t++) \
        CALL(x, ldx, packed, y, M, K, panels, t, WTYPE);

#define FOR_WEIGHT_TYPE(CALL, TASKS) \
    if (wtype == WEIGHTS_INT8) { \
        EACH_TASK(CALL, TASKS, WEIGHTS_INT8) \
    } else if (wtype == WEIGHTS_BF16) { \
        EACH_TASK(CALL, TASKS, WEIGHTS_BF16) \
    } else { \
        EACH_TASK(CALL, TASKS, WEIGHTS_F32) \
    }

static void full_tiles(const float *x, long ldx, const void *packed, int wtype, float *y, long M,
                       long K, long panels)
{
    FOR_WEIGHT_TYPE(full_panel, panels)
}

static void partial_tile(const float *x, long ldx, const void *packed, int wtype, float *y,
                         long M, long K, long panels)
{
    /* Side by side only while there is a task for every thread: on a many-core machine a
     * quarter of the tasks would leave cores idle. */
    const long wide_tasks = (panels + WIDE - 1) / WIDE;
    if (M <= FEW_ROWS && wide_tasks >= omp_get_max_threads()) {
        FOR_WEIGHT_TYPE(few_rows_panels, wide_tasks)
    } else {
        FOR_WEIGHT_TYPE(partial_panel, panels)
    }
}

/* y [M, panels * 16] = x [M, K] @ W^T for W packed as above (wtype: WEIGHTS_*): every
 * panel is written whole (the caller trims columns past N, and adds any bias). Row r of x
 * starts at x + r * ldx: the caller pads rows whose size is a multiple of 2 KB, since 16 rows
 * that far apart all fall in one set of the L1 cache and evict each other (half speed at
 * K = 1024 or 2048).
 * Rows past the last multiple of 16 take a pass of their own over the weights: handled inside
 * the full tiles' loop (one by one, or by a switch on their count) they cost those tiles
 * 5-10%, more than the extra pass. */
static void pair_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
                      long panels);

void panel_gemm(const float *x, long ldx, const void *packed, int wtype, float *y, long M, long K,
                long panels)
{
    if (wtype == WEIGHTS_BF16_PAIRS) {
        pair_gemm(x, ldx, packed, y, M, K, panels);
        return;
    }
    const long full = M / MAX_ROWS * MAX_ROWS;
    const long ldy = panels * LANES;
    long chunk = CHUNK_BYTES / (ldx * (long)sizeof(float)) / MAX_ROWS * MAX_ROWS;
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk;
    for (long first = 0; first < full; first += chunk) {
        long rows = full - first < chunk ? full - first : chunk;
        full_tiles(x + first * ldx, ldx, packed, wtype, y + first * ldy, rows, K, panels);
    }
    if (M > full)
        partial_tile(x + full * ldx, ldx, packed, wtype, y + full * panels * LANES, M - full, K,
                     panels);
}

/* Lets the loader check that the library matches the layout it packs for. */
long panel_gemm_lanes(void) { return LANES; }

/* ---- bfloat16 pairs (WEIGHTS_BF16_PAIRS) ------------------------------------------------------
 *
 * Layout: panel p holds columns 16p .. 16p + 15 as [ceil(K / 2)][16][2] bfloat16: for each pair
 * of k (k, k + 1) and each column, its two weights side by side, K zero-padded to even. x is
 * first rounded to bfloat16 (to nearest even, as torch rounds; the instruction reads subnormals
 * as zero) into groups of 16 rows, [pairs][16] 32-bit pairs a group, so a tile's 16 rows of
 * one pair are one cache line and each multiply takes its row's pair as an embedded broadcast
 * (row pointers of their own spill registers: 1.2x slower). One 64-byte load of the panel then
 * feeds 16 instructions of 32 multiply-adds. A pair's two products are exact in float32 and
 * summed before they are added to the accumulator: a sequential sum over pairs, so a row's
 * result still does not depend on the other rows of the call. */

#ifdef __AVX512BF16__
enum { PARALLEL_ROUNDING = 1 << 15 }; /* elements of x: below, one thread rounds them all */

long panel_gemm_has_pairs(void) { return 1; }

/* rows x panels of y from group g of xg (x's pairs, as above), as panel_tile. */
static inline __attribute__((always_inline)) void pair_tile(
    const unsigned *restrict xg, const void *restrict panel, long stride, float *restrict y,
    long pairs, long ldy, long col0, long row0, const int rows, const int panels)
{
    __m512 acc[MAX_ROWS][WIDE];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = _mm512_setzero_ps();
    const unsigned *xk = xg + row0 / MAX_ROWS * pairs * MAX_ROWS;
    for (long k = 0; k < pairs; k++, xk += MAX_ROWS) {
        __m512bh w[WIDE];
        for (int j = 0; j < panels; j++) {
            const char *at = (const char *)panel + j * stride + k * 64;
            w[j] = (__m512bh)_mm512_loadu_si512((const void *)at);
            __builtin_prefetch(at + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);
        }
        for (int r = 0; r < rows; r++) {
            __m512bh s = (__m512bh)_mm512_set1_epi32((int)xk[r]);
            for (int j = 0; j < panels; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], s);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            _mm512_storeu_ps(y + (row0 + r) * ldy + col0 + j * LANES, acc[r][j]);
}

#define PAIR_CASE(R, W) \
    case R: \
        pair_tile(xg, panel, stride, y, pairs, ldy, p * LANES, row0, R, W); \
        break;

/* Rows row0 .. row0 + rows - 1 (rows <= 16, row0 a multiple of 16) against panel p, or
 * against WIDE panels from p when `wide` (rows <= FEW_ROWS, p + WIDE <= panels): the switch
 * makes both constants. */
static void pair_block(const unsigned *xg, const void *packed, float *y, long pairs, long panels,
                       long p, long row0, int rows, int wide)
{
    const long stride = pairs * 64, ldy = panels * LANES;
    const char *panel = (const char *)packed + p * stride;
    if (wide) {
        switch (rows) { PAIR_CASE(1, WIDE) PAIR_CASE(2, WIDE) PAIR_CASE(3, WIDE) }
        return;
    }
    switch (rows) {
        PAIR_CASE(1, 1) PAIR_CASE(2, 1) PAIR_CASE(3, 1) PAIR_CASE(4, 1) PAIR_CASE(5, 1)
        PAIR_CASE(6, 1) PAIR_CASE(7, 1) PAIR_CASE(8, 1) PAIR_CASE(9, 1) PAIR_CASE(10, 1)
        PAIR_CASE(11, 1) PAIR_CASE(12, 1) PAIR_CASE(13, 1) PAIR_CASE(14, 1) PAIR_CASE(15, 1)
        PAIR_CASE(16, 1)
    }
}

/* x [M, K] float32 rounded to bfloat16 pairs in groups of 16 rows (layout above), the odd
 * K's last pair padded with a zero. The buffer is the calling thread's, kept and grown
 * between calls (a fresh one would be page-faulted in on every product of a prefill). */
static const unsigned *pair_groups(const float *x, long ldx, long M, long K, long pairs)
{
    static __thread unsigned *buffer;
    static __thread long capacity;
    const long groups = (M + MAX_ROWS - 1) / MAX_ROWS;
    const long need = groups * pairs * MAX_ROWS;
    if (need > capacity) {
        free(buffer);
        capacity = need;
        buffer = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
        if (buffer == NULL) {
            capacity = 0;
            return NULL;
        }
    }
    unsigned *out = buffer;
    /* A decode step's few rows are not worth a parallel region of their own. */
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_ROUNDING)
    for (long r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        unsigned *dst = out + r / MAX_ROWS * pairs * MAX_ROWS + r % MAX_ROWS;
        for (long k = 0; k < K; k += 32) {
            const long left = K - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 hi = left >= 32 ? 0xFFFF
                                 : left > 16 ? (__mmask16)((1u << (left - 16)) - 1)
                                             : 0;
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + k + 16),
                                                        _mm512_maskz_loadu_ps(lo, row + k));
            unsigned lanes[16] __attribute__((aligned(64)));
            _mm512_store_si512((void *)lanes, both);
            const long n = left >= 32 ? 16 : (left + 1) / 2;
            for (long i = 0; i < n; i++)
                dst[(k / 2 + i) * MAX_ROWS] = lanes[i];
        }
    }
    return out;
}

static void pair_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
                      long panels)
{
    const long pairs = (K + 1) / 2;
    const unsigned *xg = pair_groups(x, ldx, M, K, pairs);
    if (xg == NULL)
        return;
    const long full = M / MAX_ROWS * MAX_ROWS;
    long chunk = CHUNK_BYTES / (pairs * 4) / MAX_ROWS * MAX_ROWS;
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk;
    for (long first = 0; first < full; first += chunk) {
        const long last = full - first < chunk ? full : first + chunk;
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            for (long row0 = first; row0 < last; row0 += MAX_ROWS)
                pair_block(xg, packed, y, pairs, panels, p, row0, MAX_ROWS, 0);
    }
    const int rest = (int)(M - full);
    if (rest == 0)
        return;
    const long wide_tasks = panels / WIDE;
    if (rest <= FEW_ROWS && wide_tasks >= omp_get_max_threads()) {
#pragma omp parallel for schedule(static)
        for (long t = 0; t < wide_tasks; t++)
            pair_block(xg, packed, y, pairs, panels, t * WIDE, full, rest, 1);
        for (long p = wide_tasks * WIDE; p < panels; p++)
            pair_block(xg, packed, y, pairs, panels, p, full, rest, 0);
    } else {
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            pair_block(xg, packed, y, pairs, panels, p, full, rest, 0);
    }
}
#else
long panel_gemm_has_pairs(void) { return 0; }

static void pair_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
                      long panels)
{
    (void)x, (void)ldx, (void)packed, (void)y, (void)M, (void)K, (void)panels;
}
#endif
