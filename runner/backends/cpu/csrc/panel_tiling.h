/* What panel_gemm.c and pair_gemm.c share: the panel width, the tile's rows, the weight types
 * and the tuning of how panels are walked. */
#ifndef KVCACHE_PANEL_TILING_H
#define KVCACHE_PANEL_TILING_H

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
