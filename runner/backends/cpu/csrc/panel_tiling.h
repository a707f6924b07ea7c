/* What panel_gemm.c, pair_gemm.c and quad_gemm.c share: the panel width, the tile's rows, the weight types
 * and the tuning of how panels are walked. */
#ifndef KVCACHE_PANEL_TILING_H
#define KVCACHE_PANEL_TILING_H

#include <math.h>
#include <omp.h>
#include <stdlib.h>

enum { LANES = 16, MAX_ROWS = 16 };
/* What a panel holds (runner/backends/cpu/panels.py WEIGHT_TYPES); int8 scales cover INT8_GROUP k. */
enum {
    WEIGHTS_F32 = 0, WEIGHTS_BF16 = 1, WEIGHTS_INT8 = 2, WEIGHTS_BF16_PAIRS = 3,
    WEIGHTS_INT8_QUADS = 4
};
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

/* A product's tile kernel: rows row0 .. row0 + rows - 1 (rows <= 16, row0 a multiple of 16)
 * against panel p, or against WIDE panels from p when `wide` (rows <= FEW_ROWS). */
typedef void (*tile_fn)(const void *args, long p, long row0, int rows, int wide);

/* How pair_gemm and quad_gemm walk y [M, panels * 16]: the whole 16-row tiles in passes of at
 * most CHUNK_BYTES of x's rows (row_bytes each), the panels shared between threads; then the
 * last M % 16 rows, WIDE panels a task where they are few rows and there are wide tasks enough
 * for every thread. */
static inline void walk_tiles(long M, long panels, long row_bytes, tile_fn tile, const void *args)
{
    const long full = M / MAX_ROWS * MAX_ROWS;
    long chunk = CHUNK_BYTES / row_bytes / MAX_ROWS * MAX_ROWS;
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk;
    for (long first = 0; first < full; first += chunk) {
        const long last = full - first < chunk ? full : first + chunk;
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            for (long row0 = first; row0 < last; row0 += MAX_ROWS)
                tile(args, p, row0, MAX_ROWS, 0);
    }
    const int rest = (int)(M - full);
    if (rest == 0)
        return;
    const long wide_tasks = panels / WIDE;
    if (rest <= FEW_ROWS && wide_tasks >= omp_get_max_threads()) {
#pragma omp parallel for schedule(static)
        for (long t = 0; t < wide_tasks; t++)
            tile(args, t * WIDE, full, rest, 1);
        for (long p = wide_tasks * WIDE; p < panels; p++)
            tile(args, p, full, rest, 0);
    } else {
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            tile(args, p, full, rest, 0);
    }
}

/* The switch of a tile kernel's block (pair_gemm.c, quad_gemm.c): CASE(R, W) for each row
 * count R a tile takes, against W = WIDE panels when `wide` (rows <= FEW_ROWS), else one, so
 * each call is compiled with both as constants. Needs `rows` and `wide` in scope; returns. */
#define TILE_SWITCH(CASE) \
    if (wide) { \
        switch (rows) { CASE(1, WIDE) CASE(2, WIDE) CASE(3, WIDE) } \
        return; \
    } \
    switch (rows) { \
        CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) CASE(5, 1) CASE(6, 1) CASE(7, 1) \
        CASE(8, 1) CASE(9, 1) CASE(10, 1) CASE(11, 1) CASE(12, 1) CASE(13, 1) CASE(14, 1) \
        CASE(15, 1) CASE(16, 1) \
    }

/* The calling thread's buffer of at least `need` 32-bit words (64-byte aligned) for x's rows
 * as a product reads them, kept and grown between calls: a fresh one would be page-faulted in
 * on every product of a prefill. NULL where there is no memory. Each file that includes this
 * keeps buffers of its own. */
static inline unsigned *thread_buffer(long need)
{
    static __thread unsigned *buffer;
    static __thread long capacity;
    if (need > capacity) {
        free(buffer);
        capacity = need;
        buffer = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
        if (buffer == NULL) {
            capacity = 0;
            return NULL;
        }
    }
    return buffer;
}

/* y [M, panels * 16] all NaN: what a product writes where it has no memory for x's rows,
 * never stale numbers. */
static inline void fill_nan(float *y, long M, long panels)
{
    for (long i = 0; i < M * panels * LANES; i++)
        y[i] = NAN;
}

/* What a file of dot products defines where the build lacks its instructions (pair_gemm.c
 * without AVX512-BF16, quad_gemm.c without AVX512-VNNI): `has` answers 0 and `gemm` leaves y
 * alone, since runner/backends/cpu/kernel.py refuses such panels before calling. */
#define PRODUCT_NOT_BUILT(gemm, has) \
    long has(void) { return 0; } \
    void gemm(const float *x, long ldx, const void *packed, float *y, long M, long K, \
              long panels) \
    { \
        (void)x, (void)ldx, (void)packed, (void)y, (void)M, (void)K, (void)panels; \
    }

/* pair_gemm.c: y [M, panels * 16] = x [M, K] @ bfloat16 pair panels (WEIGHTS_BF16_PAIRS), x
 * rounded to bfloat16 first; NaN where there is no memory to round x, nothing where the build
 * lacks AVX512-BF16 (runner/backends/cpu/kernel.py refuses such panels before calling). */
void pair_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
               long panels);

/* quad_gemm.c: y [M, panels * 16] = x [M, K] @ int8 quad panels (WEIGHTS_INT8_QUADS), x
 * quantized to int8 per row first; NaN where there is no memory to quantize x, nothing where the
 * build lacks AVX512-VNNI (runner/backends/cpu/kernel.py refuses such panels before calling). */
void quad_gemm(const float *x, long ldx, const void *packed, float *y, long M, long K,
               long panels);

#endif
