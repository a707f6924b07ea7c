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
 * depend on how many other rows share the call (batch-invariant). Tried and slower here: x
 * transposed into row panels, 2-3 panels per task with 8-12 rows.
 *
 * The panels hold float32 weights, or bfloat16 ones (the top 16 bits of each float32, as
 * torch rounds them): a decode step streams every weight once, so half the bytes is close to
 * half the time where memory bandwidth bounds it. A bfloat16 weight widens to float32 exactly
 * (a shift), and x, the accumulators and y stay float32, so a product on bfloat16 panels equals
 * the float32 product of the rounded weights bit for bit.
 *
 * Built at run time with -march=native (see runner/cpu_kernel_loader.py); the vector type becomes
 * one AVX-512 register, and threads come from the OpenMP runtime torch already loaded.
 */
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float vec16 __attribute__((vector_size(64)));
typedef unsigned short half16 __attribute__((vector_size(32)));
typedef unsigned int word16 __attribute__((vector_size(64)));

enum { LANES = 16, MAX_ROWS = 16 };
/* Prefetch this many bytes ahead in the panel (4 KB), into the outer caches only (locality
 * 1): on the EPYC this was tuned on that beat no prefetch, nearer distances and L1 prefetches
 * by 5-10% at 16 rows. */
enum { PREFETCH_AHEAD = 4096, PREFETCH_LOCALITY = 1 };
/* Rows per pass over the weights, at most: a pass's rows of x (about 512 KB) stay within a
 * core's L2 however long the batch (no cost measured where they fit anyway). */
enum { CHUNK_BYTES = 1 << 19 };

/* The 16 weights at element `at` of a panel, as float32 (bf16: constant after inlining). */
static inline __attribute__((always_inline)) vec16 load_weights(const void *panel, long at,
                                                               const int bf16)
{
    vec16 w;
    if (bf16) {
        /* One zero-extending load and a shift: GCC's generic widening of a 32-byte vector
         * takes two half loads and an insert. */
        const unsigned short *src = (const unsigned short *)panel + at;
#ifdef __AVX512F__
        __m256i h = _mm256_loadu_si256((const void *)src);
        __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
        half16 h;
        memcpy(&h, src, sizeof(h));
        word16 bits = __builtin_convertvector(h, word16) << 16;
#endif
        memcpy(&w, &bits, sizeof(w));
    } else {
        memcpy(&w, (const float *)panel + at, sizeof(w));
    }
    return w;
}

/* rows x panels of y: y[row0 + r, col0 + 16j + c] = sum over k of x[row0 + r, k] *
 * panel_j[k, c]. Only ever called with panels = 1; written over j because GCC 12 then keeps
 * the 16 row pointers where the loop reaches them fastest (plainer one-panel forms, or x
 * passed pre-offset, cost 5-15% on prefill-sized batches: register allocation, not
 * arithmetic). */
static inline __attribute__((always_inline)) void panel_tile(
    const float *restrict x, const void *restrict panel, float *restrict y, long K, long ldx,
    long ldy, long col0, long row0, const int rows, const int panels, const int bf16)
{
    vec16 acc[MAX_ROWS][1];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++)
            acc[r][j] = (vec16){0};
    const float *xr = x + row0 * ldx;
    for (long k = 0; k < K; k++) {
        vec16 w[1];
        for (int j = 0; j < panels; j++) {
            const long at = j * K * LANES + k * LANES;
            w[j] = load_weights(panel, at, bf16);
            __builtin_prefetch((const char *)panel + at * (bf16 ? 2 : 4) + PREFETCH_AHEAD, 0,
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

/* Panel p of `packed` (bf16: 2-byte weights, else 4-byte). */
static inline const void *panel_at(const void *packed, long p, long K, int bf16)
{
    return (const char *)packed + p * K * LANES * (bf16 ? 2 : 4);
}

/* The first M / 16 * 16 rows against panel p, in tiles of 16. */
static inline __attribute__((always_inline)) void full_panel(
    const float *x, long ldx, const void *packed, float *y, long M, long K, long panels, long p,
    const int bf16)
{
    const void *panel = panel_at(packed, p, K, bf16);
    for (long row0 = 0; row0 + MAX_ROWS <= M; row0 += MAX_ROWS)
        panel_tile(x, panel, y, K, ldx, panels * LANES, p * LANES, row0, MAX_ROWS, 1, bf16);
}

#define TILE_CASE(R) \
    case R: panel_tile(x, panel, y, K, ldx, panels * LANES, p * LANES, 0, R, 1, bf16); break;

/* M < 16 rows against panel p, one tile; the switch makes its row count a constant, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void partial_panel(
    const float *x, long ldx, const void *packed, float *y, long M, long K, long panels, long p,
    const int bf16)
{
    const void *panel = panel_at(packed, p, K, bf16);
    switch (M) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
        TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10)
        TILE_CASE(11) TILE_CASE(12) TILE_CASE(13) TILE_CASE(14) TILE_CASE(15)
    }
}

/* Each weight type gets a parallel loop of its own: OpenMP outlines a loop's body before GCC
 * inlines, so a constant `bf16` must already be in the body for the tiles to be specialised
 * (a float32 tile then compiles exactly as it did before bfloat16 panels existed). */
static void full_tiles(const float *x, long ldx, const void *packed, int bf16, float *y, long M,
                       long K, long panels)
{
    if (bf16) {
        #pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            full_panel(x, ldx, packed, y, M, K, panels, p, 1);
    } else {
        #pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            full_panel(x, ldx, packed, y, M, K, panels, p, 0);
    }
}

static void partial_tile(const float *x, long ldx, const void *packed, int bf16, float *y,
                         long M, long K, long panels)
{
    if (bf16) {
        #pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            partial_panel(x, ldx, packed, y, M, K, panels, p, 1);
    } else {
        #pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++)
            partial_panel(x, ldx, packed, y, M, K, panels, p, 0);
    }
}

/* y [M, panels * 16] = x [M, K] @ W^T for W packed as above (bf16: 2-byte weights): every
 * panel is written whole (the caller trims columns past N, and adds any bias). Row r of x starts at x + r * ldx:
 * the caller pads rows whose size is a multiple of 2 KB, since 16 rows that far apart all
 * fall in one set of the L1 cache and evict each other (half speed at K = 1024 or 2048).
 * Rows past the last multiple of 16 take a pass of their own over the weights: handled inside
 * the full tiles' loop (one by one, or by a switch on their count) they cost those tiles
 * 5-10%, more than the extra pass. */
void panel_gemm(const float *x, long ldx, const void *packed, int bf16, float *y, long M, long K,
                long panels)
{
    const long full = M / MAX_ROWS * MAX_ROWS;
    const long ldy = panels * LANES;
    long chunk = CHUNK_BYTES / (ldx * (long)sizeof(float)) / MAX_ROWS * MAX_ROWS;
    chunk = chunk < MAX_ROWS ? MAX_ROWS : chunk;
    for (long first = 0; first < full; first += chunk) {
        long rows = full - first < chunk ? full - first : chunk;
        full_tiles(x + first * ldx, ldx, packed, bf16, y + first * ldy, rows, K, panels);
    }
    if (M > full)
        partial_tile(x + full * ldx, ldx, packed, bf16, y + full * panels * LANES, M - full, K,
                     panels);
}

/* Lets the loader check that the library matches the layout it packs for. */
long panel_gemm_lanes(void) { return LANES; }
