/* Causal attention of prefill chunks over a paged KV cache, for the CPU.
 *
 * q [T, Hq, D]: the new tokens of S sequences, sequence s owning query_lens[s] rows from
 * query_start[s] on, whose positions are the last ones of its context_lens[s] tokens;
 * caches [blocks, B, Hkv, D] already hold the new K/V (float32, or float16 with kv_half:
 * widened once per step, see attend_half_cache);
 * block_tables [S, max_blocks] int32;
 * out [T, Hq, D] contiguous; q may have wider token rows (q_token_stride floats: q is a view
 * of the fused q/k projection). Each query sees the keys up to its own position p, read in
 * place; with a sliding window W > 0, only keys max(0, p - W + 1) .. p, and a tile of queries
 * starts reading at the first key any of its rows sees. With a logit soft cap c > 0 (Gemma 2),
 * each score s = (q . k) * scale counts as c tanh(s / c), masked and softmaxed as before.
 *
 * One task takes 16 query rows of one sequence and KV head (positions x the G query heads of
 * that KV head), one per vector lane, through the tile of attention_tile.h: scores and values
 * as small matrix products, with the exp and the rescaling around them.
 */
#include <stdlib.h>

#include "attention_tile.h"

enum { LANES = TILE, MAX_DIM = TILE_MAX_DIM };

struct task_shape {
    long hq, hkv, d, block_size, max_blocks;
    long q_token_stride; /* floats between two tokens' rows of q (heads are d apart) */
    long window;         /* keys a query sees, itself included (0: its whole context) */
    float scale;
    float softcap;       /* the logit soft cap (0: none) */
};

/* The first key a query at `position` sees: where its window starts (0 without one). */
static long first_visible(long position, long window)
{
    return window && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Rows first_row .. first_row + rows - 1 of the (query, head-in-group) list of sequence
 * `seq` and KV head `head`; row i is query i / G of the sequence, head head * G + i % G. */
static void attend_tile(const float *q, const float *k_cache, const float *v_cache,
                        const int *table, long q_start, long q_len, long context,
                        float *out, long head, long first_row, long rows,
                        const struct task_shape *shape)
{
    const long group = shape->hq / shape->hkv, d = shape->d;
    float qt[MAX_DIM][LANES] __attribute__((aligned(64))); /* q^T, scaled */
    int positions[LANES], lows[LANES];
    struct tile_state state;
    long last_position = 0, first_key = context;
    for (long i = 0; i < LANES; i++) {
        /* Lanes past the last row repeat it: same work, result dropped, never an empty row. */
        long row = first_row + (i < rows ? i : rows - 1);
        long query = row / group, qhead = head * group + row % group;
        const float *src = q + (q_start + query) * shape->q_token_stride + qhead * d;
        for (long j = 0; j < d; j++)
            qt[j][i] = src[j] * shape->scale;
        positions[i] = (int)(context - q_len + query);
        lows[i] = (int)first_visible(positions[i], shape->window);
        last_position = positions[i] > last_position ? positions[i] : last_position;
        first_key = lows[i] < first_key ? lows[i] : first_key;
    }
    /* The tile's keys go 16 at a time from a multiple of 16: a row's chunks of keys, and so
     * its sums, are then the same whatever rows share its tile (a window's start need not be
     * aligned; keys before a row's own start are masked for it). */
    first_key -= first_key % LANES;
    const struct paged_keys keys = {k_cache, v_cache, table, shape->block_size,
                                    shape->hkv * d, head, d};
    tile_start(&state, d);
    tile_attend(qt, &keys, first_key, last_position + 1, shape->window ? lows : NULL, positions,
                shape->softcap, &state);
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), state.running_sum);
    for (long j = 0; j < d; j++)
        _mm512_store_ps(state.acc[j], _mm512_mul_ps(_mm512_load_ps(state.acc[j]), inv));
    for (long i = 0; i < rows; i++) {
        long row = first_row + i;
        long query = row / group, qhead = head * group + row % group;
        float *dst = out + ((q_start + query) * shape->hq + qhead) * d;
        for (long j = 0; j < d; j++)
            dst[j] = state.acc[j][i];
    }
}

static int attend_float_cache(const float *q, const float *k_cache, const float *v_cache,
                              const int *block_tables, const int *query_start,
                              const int *query_lens, const int *context_lens, float *out,
                              long num_seqs, const struct task_shape *shape);

/* A float16 cache: each sequence's context is widened once into float32 blocks of its own
 * (attention_tile.h, widen_blocks), and attended to there. With a window, from the block of the
 * first key its first query sees: the blocks before it are never read. */
static int attend_half_cache(const float *q, const void *k_cache, const void *v_cache,
                             const int *block_tables, const int *query_start,
                             const int *query_lens, const int *context_lens, float *out,
                             long num_seqs, const struct task_shape *shape)
{
    const long block_size = shape->block_size, max_blocks = shape->max_blocks;
    const long row = block_size * shape->hkv * shape->d; /* elements of one block */
    long first[num_seqs + 1], skip[num_seqs]; /* each sequence's first widened block; unread */
    first[0] = 0;
    for (long s = 0; s < num_seqs; s++) {
        skip[s] = first_visible(context_lens[s] - query_lens[s], shape->window) / block_size;
        first[s + 1] = first[s] + (context_lens[s] + block_size - 1) / block_size - skip[s];
    }
    const long blocks = first[num_seqs];
    float *wide = malloc((size_t)(2 * blocks * row) * sizeof(float));
    int *tables = malloc((size_t)(num_seqs * max_blocks + 1) * sizeof(int));
    if (!wide || !tables) {
        free(wide);
        free(tables);
        return -1;
    }
    for (long s = 0; s < num_seqs; s++) {
        const long n = first[s + 1] - first[s];
        widen_blocks(k_cache, v_cache, block_tables + s * max_blocks + skip[s], n, row,
                     wide + first[s] * row, wide + (blocks + first[s]) * row);
        for (long j = 0; j < skip[s]; j++) /* never read: any block in bounds */
            tables[s * max_blocks + j] = (int)first[s];
        for (long j = 0; j < n; j++)
            tables[s * max_blocks + skip[s] + j] = (int)(first[s] + j);
    }
    int status = attend_float_cache(q, wide, wide + blocks * row, tables, query_start,
                                    query_lens, context_lens, out, num_seqs, shape);
    free(wide);
    free(tables);
    return status;
}

/* Returns 0, or -1 when the shapes are outside what the kernel handles or memory runs out
 * (nothing written). window: keys a query sees (0: all up to its own). softcap: the logit soft
 * cap (0: none; never negative). */
int prefill_attention(const float *q, long q_token_stride, const void *k_cache,
                      const void *v_cache, const int *block_tables, const int *query_start,
                      const int *query_lens, const int *context_lens, float *out,
                      long num_seqs, long hq, long hkv, long d, long block_size,
                      long max_blocks, long window, float scale, float softcap, int kv_half)
{
    if (hkv < 1 || hq % hkv || d % LANES || d > MAX_DIM || block_size < 1 || window < 0
        || !(softcap >= 0.0f))
        return -1;
    const struct task_shape shape = {hq, hkv, d, block_size, max_blocks, q_token_stride, window,
                                     scale, softcap};
    if (kv_half)
        return attend_half_cache(q, k_cache, v_cache, block_tables, query_start, query_lens,
                                 context_lens, out, num_seqs, &shape);
    return attend_float_cache(q, (const float *)k_cache, (const float *)v_cache, block_tables,
                              query_start, query_lens, context_lens, out, num_seqs, &shape);
}

static int attend_float_cache(const float *q, const float *k_cache, const float *v_cache,
                              const int *block_tables, const int *query_start,
                              const int *query_lens, const int *context_lens, float *out,
                              long num_seqs, const struct task_shape *shape)
{
    const long hkv = shape->hkv, max_blocks = shape->max_blocks;
    const long group = shape->hq / hkv;
    long tiles_before[num_seqs + 1]; /* tasks are (sequence, KV head, tile of 16 rows) */
    tiles_before[0] = 0;
    for (long s = 0; s < num_seqs; s++) {
        long rows = (long)query_lens[s] * group;
        tiles_before[s + 1] = tiles_before[s] + hkv * ((rows + LANES - 1) / LANES);
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (long task = 0; task < tiles_before[num_seqs]; task++) {
        long s = 0;
        while (tiles_before[s + 1] <= task)
            s++;
        long q_len = query_lens[s];
        long tiles = (q_len * group + LANES - 1) / LANES;
        long local = task - tiles_before[s];
        long head = local / tiles, tile = local % tiles;
        long first_row = tile * LANES;
        long rows = q_len * group - first_row < LANES ? q_len * group - first_row : LANES;
        attend_tile(q, k_cache, v_cache, block_tables + s * max_blocks, query_start[s], q_len,
                    context_lens[s], out, head, first_row, rows, shape);
    }
    return 0;
}
