/* Decode attention for deterministic mode (docs/DETERMINISM.md): one query token per sequence,
 * each of its query rows summed exactly as prefill_attention.c's tile sums a prompt's row at the
 * same position, so a token's attention is bitwise the same whether it is decoded, computed in a
 * prompt, recomputed after a preemption, or read after a cached prefix, whatever else the step
 * holds.
 *
 * decode_attention.c's own loop sums in another order (a dot product of 16-lane partial sums per
 * key, a block's keys at a time). Here each task takes one sequence and KV head, its G query
 * heads one a lane of attention_tile.h's tile (the spare lanes repeat the last), and walks its
 * keys 16 at a time from key 0, or from the first multiple of 16 at or before its window's start,
 * as the prefill tile does. Where every decode starts with the same blocks (a system prompt),
 * their first keys, down to a multiple of 16, are scored for all rows together first
 * (shared_prefix.h, the same tile and order), and each task goes on from that state: the same
 * chunks of keys, so the same sums, with each shared key read once per 16 rows.
 *
 * Arguments as decode_attention's. A float16 cache goes through prefill_attention (one query a
 * sequence), which widens the context first; its decodes are then scored one sequence at a time.
 */
#include <stdlib.h>

#include "attention_tile.h"
#include "kernels.h"
#include "shared_prefix.h"

enum { MAX_GROUP = 8, MAX_DIM = TILE_MAX_DIM };

/* Rows (head * G .. head * G + G - 1) of sequence s's query q [Hq, D] over its keys from
 * first_key to context - 1, going on from `start` (NULL: from nothing). */
static void attend_sequence(const float *q, const float *k_cache, const float *v_cache,
                            const int *table, long context, float *out, long hq, long hkv,
                            long d, long head, long block_size, long window, float scale,
                            float softcap, long first_key, const struct prefix_state *start,
                            long slot0)
{
    const long group = hq / hkv;
    float qt[MAX_DIM][TILE] __attribute__((aligned(64)));
    int positions[TILE], lows[TILE];
    struct tile_state state;
    const long low = window && context - window > 0 ? context - window : 0;
    tile_start(&state, d);
    float max[TILE], sum[TILE];
    for (long i = 0; i < TILE; i++) {
        const long g = i < group ? i : group - 1; /* spare lanes repeat the last row */
        for (long j = 0; j < d; j++) {
            qt[j][i] = q[(head * group + g) * d + j] * scale;
            if (start)
                state.acc[j][i] = start->acc[(slot0 + g) * d + j];
        }
        max[i] = start ? start->max[slot0 + g] : -INFINITY;
        sum[i] = start ? start->sum[slot0 + g] : 0.0f;
        positions[i] = (int)(context - 1);
        lows[i] = (int)low;
    }
    state.running_max = _mm512_loadu_ps(max);
    state.running_sum = _mm512_loadu_ps(sum);
    const struct paged_keys keys = {k_cache, v_cache, table, block_size, hkv * d, head, d};
    if (first_key < context)
        tile_attend(qt, &keys, first_key, context, window ? lows : NULL, positions, softcap,
                    &state);
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), state.running_sum);
    float lane[TILE] __attribute__((aligned(64)));
    for (long j = 0; j < d; j++) {
        _mm512_store_ps(lane, _mm512_mul_ps(_mm512_load_ps(state.acc[j]), inv));
        for (long g = 0; g < group; g++)
            out[(head * group + g) * d + j] = lane[g];
    }
}

/* A float16 cache: each decode as a one-token prefill (prefill_attention.c widens first). */
static int attend_half(const float *q, const void *k_cache, const void *v_cache,
                       const int *block_tables, const int *context_lens, float *out,
                       long num_seqs, long hq, long hkv, long d, long block_size,
                       long max_blocks, long window, float scale, float softcap)
{
    int *starts = malloc((size_t)(2 * num_seqs + 1) * sizeof(int));
    if (!starts)
        return -1;
    int *ones = starts + num_seqs;
    for (long s = 0; s < num_seqs; s++) {
        starts[s] = (int)s;
        ones[s] = 1;
    }
    int status = prefill_attention(q, hq * d, k_cache, v_cache, block_tables, starts, ones,
                                   context_lens, out, num_seqs, hq, hkv, d, block_size,
                                   max_blocks, window, scale, softcap, 1);
    free(starts);
    return status;
}

int tiled_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int *block_tables, const int *context_lens, float *out,
                           long num_seqs, long hq, long hkv, long d, long block_size,
                           long max_blocks, long shared_blocks, long window, float scale,
                           float softcap, int kv_half)
{
    const long group = hkv > 0 ? hq / hkv : 0;
    if (group < 1 || group > MAX_GROUP || group * hkv != hq || d % TILE || d > MAX_DIM
        || block_size < 1 || shared_blocks < 0 || window < 0 || !(softcap >= 0.0f))
        return -1;
    if (kv_half)
        return attend_half(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, hq,
                           hkv, d, block_size, max_blocks, window, scale, softcap);
    const float *keys = (const float *)k_cache, *values = (const float *)v_cache;
    if (!windows_cover_all(context_lens, num_seqs, window))
        shared_blocks = 0; /* some window starts past key 0: each task reads its own keys */
    long shared_keys = shared_blocks * block_size;
    shared_keys -= shared_keys % TILE; /* the tile's chunks of 16 keys, from key 0 */
    struct prefix_state shared = {NULL, NULL, NULL};
    if (shared_keys) {
        shared.max = malloc((size_t)(num_seqs * hq * (d + 2)) * sizeof(float));
        if (!shared.max)
            return -1;
        shared.sum = shared.max + num_seqs * hq;
        shared.acc = shared.sum + num_seqs * hq;
        score_shared_prefix(q, keys, values, block_tables, shared_keys, num_seqs, hq, hkv, d,
                            block_size, scale, softcap, &shared);
    }
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (long head = 0; head < hkv; head++) {
        for (long s = 0; s < num_seqs; s++) {
            const long context = context_lens[s];
            float *os = out + s * hq * d;
            if (context <= 0) { /* nothing to attend to: a zero row, never a division by 0 */
                for (long i = head * group * d; i < (head + 1) * group * d; i++)
                    os[i] = 0.0f;
                continue;
            }
            long first_key = shared_keys;
            if (!shared_keys && window && context - window > 0)
                first_key = (context - window) - (context - window) % TILE;
            attend_sequence(q + s * hq * d, keys, values, block_tables + s * max_blocks, context,
                            os, hq, hkv, d, head, block_size, window, scale, softcap, first_key,
                            shared_keys ? &shared : NULL, s * hq + head * group);
        }
    }
    free(shared.max);
    return 0;
}
