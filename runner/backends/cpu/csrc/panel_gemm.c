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
 * the multiply-adds of a float32 FMA per instruction. See pair_gemm.c. A fifth, int8 quads,
 * quantizes x to int8 per row and weights per column, summed exactly in int32 by AVX512-VNNI:
 * see quad_gemm.c.
 *
 * Built at run time with -march=native, on AVX-512 machines only (see
 * runner/backends/cpu/loader.py); the vector type becomes one AVX-512 register, the widening of
 * bfloat16 and int8 weights uses AVX-512 intrinsics, and threads come from the OpenMP runtime
 * torch already loaded.
 */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

#include "panel_tiling.h"

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
void panel_gemm(const float *x, long ldx, const void *packed, int wtype, float *y, long M, long K,
                long panels)
{
    if (wtype == WEIGHTS_BF16_PAIRS) {
        pair_gemm(x, ldx, packed, y, M, K, panels);
        return;
    }
    if (wtype == WEIGHTS_INT8_QUADS) {
        quad_gemm(x, ldx, packed, y, M, K, panels);
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
