/* y = x @ W^T (+ bias) in float32 for the CPU, with W stored once as column panels.
 *
 * Layout: W [N, K] is packed as panels [ceil(N / 16)][K][16]: panel p holds output columns
 * 16p .. 16p + 15, one 16-float row per k, zero-padded past N. A panel is read front to back,
 * so the weights stream sequentially from memory, which is what a decode step (a few rows
 * of x against every weight of the model) is bound by.
 *
 * Each task computes up to 16 rows of x against one panel with 16 vector accumulators (one
 * per row) that stay in registers for the whole K loop: every weight vector loaded feeds up to
 * 16 fused multiply-adds. Each output is one sequential sum over k, so a row's result does not
 * depend on how many other rows share the call (batch-invariant).
 *
 * Built at run time with -march=native (see runner/cpu_kernel.py); the vector type becomes
 * one AVX-512 register, and threads come from the OpenMP runtime torch already loaded.
 */
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

enum { LANES = 16, MAX_ROWS = 16 };
/* Prefetch this many floats ahead in the panel (4 KB), into the outer caches only (locality
 * 1): on the EPYC this was tuned on that beat no prefetch, nearer distances and L1 prefetches
 * by 5-10% at 16 rows. */
enum { PREFETCH_AHEAD = 1024, PREFETCH_LOCALITY = 1 };
/* Rows of x handled per pass over the weights: keeps a pass's x (rows * K floats) within
 * about 2 MB of cache when M is large. */
enum { CHUNK_BYTES = 2 << 20 };

static inline __attribute__((always_inline)) void panel_tile(
    const float *restrict x, const float *restrict panel, const float *restrict bias,
    float *restrict y, long K, long N, long col0, long row0, const int rows)
{
    vec16 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = (vec16){0};
    const float *xr = x + row0 * K;
    for (long k = 0; k < K; k++) {
        vec16 w;
        memcpy(&w, panel + k * LANES, sizeof w);
        __builtin_prefetch(panel + k * LANES + PREFETCH_AHEAD, 0, PREFETCH_LOCALITY);
        for (int r = 0; r < rows; r++)
            acc[r] += xr[r * K + k] * w;
    }
    long width = N - col0 < LANES ? N - col0 : LANES;
    if (bias) {
        vec16 b = {0};
        memcpy(&b, bias + col0, width * sizeof(float));
        for (int r = 0; r < rows; r++)
            acc[r] += b;
    }
    for (int r = 0; r < rows; r++)
        memcpy(y + (row0 + r) * N + col0, &acc[r], width * sizeof(float));
}

/* The switch turns the row count into a constant, so each case compiles to a loop whose
 * accumulators are all registers. */
#define TILE_CASE(R) \
    case R: panel_tile(x, panel, bias, y, K, N, col0, row0, R); break;

void panel_gemm(const float *x, const float *packed, const float *bias, float *y,
                long M, long K, long N)
{
    long panels = (N + LANES - 1) / LANES;
    long chunk = CHUNK_BYTES / (K * (long)sizeof(float));
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk / MAX_ROWS * MAX_ROWS;
    for (long first = 0; first < M; first += chunk) {
        long last = first + chunk < M ? first + chunk : M;
        #pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++) {
            const float *panel = packed + p * K * LANES;
            long col0 = p * LANES;
            for (long row0 = first; row0 < last; row0 += MAX_ROWS) {
                switch (last - row0 < MAX_ROWS ? last - row0 : MAX_ROWS) {
                    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
                    TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
                    TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
                    TILE_CASE(13) TILE_CASE(14) TILE_CASE(15) TILE_CASE(16)
                }
            }
        }
    }
}

/* Lets the loader check that the library matches the layout it packs for. */
long panel_gemm_lanes(void) { return LANES; }
