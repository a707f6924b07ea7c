/* A shared prefix's keys scored for the query rows of every decode together (decode_attention.c,
 * and the deterministic decodes of tiled_decode.c, which go on from its state): 16 rows a tile
 * of attention_tile.h, each key read once per 16 rows instead of once per sequence. */
#ifndef KVCACHE_SHARED_PREFIX_H
#define KVCACHE_SHARED_PREFIX_H

#include <stdlib.h>

#include "attention_tile.h"

/* The softmax state of every (sequence, query head) over the shared prefix: max, sum, and
 * the unnormalised output [S, Hq, D]. */
struct prefix_state {
    float *max, *sum, *acc;
};

/* Every row against the first `keys` tokens, which all sequences share (read through
 * sequence 0's table); 16 rows a task, row i being sequence i / G, query head head * G + i % G. */
static inline void score_shared_prefix(const float *q, const float *k_cache, const float *v_cache,
                                const int *table, long keys, long num_seqs, long hq, long hkv,
                                long d, long block_size, float scale, float softcap,
                                const struct prefix_state *state)
{
    const long group = hq / hkv, rows = num_seqs * group;
    const long tiles = (rows + TILE - 1) / TILE;
    #pragma omp parallel for schedule(dynamic, 1)
    for (long task = 0; task < hkv * tiles; task++) {
        const long head = task / tiles, first_row = task % tiles * TILE;
        float qt[TILE_MAX_DIM][TILE] __attribute__((aligned(64)));
        int positions[TILE];
        long slot[TILE]; /* (sequence, query head) of each lane */
        for (long i = 0; i < TILE; i++) {
            long row = first_row + i < rows ? first_row + i : rows - 1; /* spare lanes repeat */
            slot[i] = row / group * hq + head * group + row % group;
            for (long j = 0; j < d; j++)
                qt[j][i] = q[slot[i] * d + j] * scale;
            positions[i] = (int)keys; /* past every shared key: all visible */
        }
        const struct paged_keys src = {k_cache, v_cache, table, block_size, hkv * d, head, d};
        struct tile_state tile;
        tile_start(&tile, d);
        tile_attend(qt, &src, 0, keys, NULL, positions, softcap, &tile);
        float max[TILE], sum[TILE];
        _mm512_storeu_ps(max, tile.running_max);
        _mm512_storeu_ps(sum, tile.running_sum);
        for (long i = 0; i < TILE && first_row + i < rows; i++) {
            state->max[slot[i]] = max[i];
            state->sum[slot[i]] = sum[i];
            for (long j = 0; j < d; j++)
                state->acc[slot[i] * d + j] = tile.acc[j][i];
        }
    }
}

/* score_shared_prefix over float16 caches: the shared blocks widened to float32 once
 * (attention_tile.h, widen_blocks), not once per tile of 16 rows. 0, or -1 without memory. */
static inline int score_half_prefix(const float *q, const void *k_cache, const void *v_cache,
                             const int *table, long shared_blocks, long num_seqs, long hq,
                             long hkv, long d, long block_size, float scale, float softcap,
                             const struct prefix_state *state)
{
    const long row = block_size * hkv * d;
    float *wide = malloc((size_t)(2 * shared_blocks * row) * sizeof(float));
    int *identity = malloc((size_t)shared_blocks * sizeof(int));
    if (!wide || !identity) {
        free(wide);
        free(identity);
        return -1;
    }
    widen_blocks(k_cache, v_cache, table, shared_blocks, row, wide, wide + shared_blocks * row);
    for (long b = 0; b < shared_blocks; b++)
        identity[b] = (int)b;
    score_shared_prefix(q, wide, wide + shared_blocks * row, identity,
                        shared_blocks * block_size, num_seqs, hq, hkv, d, block_size, scale,
                        softcap, state);
    free(wide);
    free(identity);
    return 0;
}

/* Whether a window of `window` tokens (0: none) reaches back to key 0 for every sequence, so
 * that no key of the shared blocks lies outside one. */
static inline int windows_cover_all(const int *context_lens, long num_seqs, long window)
{
    for (long s = 0; window && s < num_seqs; s++)
        if (context_lens[s] > window)
            return 0;
    return 1;
}

#endif
