/* Decode attention for deterministic mode (docs/DETERMINISM.md): one query token per sequence,
 * each of its query rows summed exactly as prefill_attention.c's tile sums a prompt's row at the
 * same position, so a token's attention is bitwise the same whether it is decoded, computed in a
 * prompt, recomputed after a preemption, or read after a cached prefix, whatever else the step
 * holds.
 *
 * decode_attention.c's own loop sums in another order (a dot product of 16-lane partial sums per
 * key, a block's keys at a time). Here each task takes one sequence and KV head and walks its
 * keys 16 at a time from key 0, or from the first multiple of 16 at or before its window's start,
 * as the prefill tile does, with every operation on a row's numbers the tile's, in the tile's
 * order (attend_sequence). Where every decode starts with the same blocks (a system prompt),
 * their first keys, down to a multiple of 16, are scored for all rows together first
 * (shared_prefix.h: the tile itself), and each task goes on from that state: the same chunks of
 * keys, so the same sums, with each shared key read once per 16 rows. Measured against the tile
 * run on the G query heads of a sequence (most of its lanes idle): 304 against 414 us for a
 * layer's 16 decodes of 300 keys, 9 query and 3 KV heads of 64, one thread; decode_attention's
 * own order takes 156.
 *
 * Arguments as decode_attention's. A float16 cache goes through prefill_attention (one query a
 * sequence), which widens the context first; its decodes are then scored one sequence at a time.
 */
#include <stdlib.h>

#include "attention_tile.h"
#include "kernels.h"
#include "shared_prefix.h"

enum { MAX_GROUP = 8, MAX_DIM = TILE_MAX_DIM };

/* out[j][t] = rows[t][j0 + j] for j, t < 16: a 16 x 16 block of floats transposed in registers. */
static inline void transpose16(const float *const rows[TILE], long j0, float out[][TILE])
{
    __m512 r[TILE], t[TILE];
    for (int i = 0; i < TILE; i++)
        r[i] = _mm512_loadu_ps(rows[i] + j0);
    for (int i = 0; i < TILE; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < TILE; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    for (int i = 0; i < TILE; i++)
        _mm512_store_ps(out[i], r[i]);
}

/* Rows (head * G .. head * G + G - 1) of sequence s's query q [Hq, D] over its keys from
 * first_key (a multiple of 16) to context - 1, going on from `start` (NULL: from nothing).
 *
 * The prefill tile's arithmetic for one row, with its lanes turned round: there a lane is a query
 * row and a score's sum over the head runs down the tile's keys; here, with only G rows, a lane
 * is one of 16 keys (read transposed) and each row takes its own pass. Every operation on a
 * row's numbers is the tile's, in the tile's order: the score as a sequential sum over the
 * head of key * (q * scale), the chunk's max, the shrink, the 16 probabilities added in key
 * order, each value row added with its probability in key order, keys a row does not see
 * skipped. */
static void attend_sequence(const float *q, const float *k_cache, const float *v_cache,
                            const int *table, long context, float *out, long hq, long hkv,
                            long d, long head, long block_size, long window, float scale,
                            float softcap, long first_key, const struct prefix_state *start,
                            long slot0)
{
    const long group = hq / hkv, vecs = d / TILE, row_stride = hkv * d;
    const long low = window && context - window > 0 ? context - window : 0;
    float qs[MAX_GROUP][MAX_DIM], run_max[MAX_GROUP], run_sum[MAX_GROUP];
    __m512 acc[MAX_GROUP][MAX_DIM / TILE];
    for (long g = 0; g < group; g++) {
        const long slot = slot0 + g;
        for (long j = 0; j < d; j++)
            qs[g][j] = q[(head * group + g) * d + j] * scale;
        for (long v = 0; v < vecs; v++)
            acc[g][v] = start ? _mm512_loadu_ps(start->acc + slot * d + v * TILE)
                              : _mm512_setzero_ps();
        run_max[g] = start ? start->max[slot] : -INFINITY;
        run_sum[g] = start ? start->sum[slot] : 0.0f;
    }
    const __m512 cap = _mm512_set1_ps(softcap);
    float kt[MAX_DIM][TILE] __attribute__((aligned(64))); /* the chunk's keys, transposed */
    float probs[TILE] __attribute__((aligned(64)));
    const float *keys[TILE], *values[TILE];
    for (long first = first_key; first < context; first += TILE) {
        __mmask16 visible = 0;
        for (long t = 0; t < TILE; t++) {
            const long key = first + t < context ? first + t : context - 1;
            const long offset = ((long)table[key / block_size] * block_size + key % block_size)
                * row_stride + head * d;
            keys[t] = k_cache + offset;
            values[t] = v_cache + offset;
            if (first + t < context && first + t >= low)
                visible |= (__mmask16)(1u << t);
        }
        __m512 scores[MAX_GROUP];
        for (long j0 = 0; j0 < d; j0 += TILE)
            transpose16(keys, j0, kt + j0);
        for (long g = 0; g < group; g++)
            scores[g] = _mm512_setzero_ps();
        for (long j = 0; j < d; j++) { /* the G rows' chains side by side, each in j order */
            const __m512 kj = _mm512_load_ps(kt[j]);
            for (long g = 0; g < group; g++)
                scores[g] = _mm512_fmadd_ps(kj, _mm512_set1_ps(qs[g][j]), scores[g]);
        }
        for (long g = 0; g < group; g++) {
            __m512 s = scores[g];
            if (softcap > 0.0f)
                s = soft_cap_ps(s, cap);
            /* the running max and the seen keys' scores (the tile's max starts at the first) */
            const float seen_max = _mm512_reduce_max_ps(
                _mm512_mask_mov_ps(_mm512_set1_ps(run_max[g]), visible, s));
            const float chunk_max = seen_max > run_max[g] ? seen_max : run_max[g];
            const float shrink = chunk_max == -INFINITY
                ? 0.0f
                : _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(run_max[g] - chunk_max)));
            run_max[g] = chunk_max;
            _mm512_store_ps(probs, _mm512_maskz_mov_ps(
                visible, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(chunk_max)))));
            /* the tile's unfused multiply, then its adds in key order */
            float sum = _mm512_cvtss_f32(
                mul_unfused(_mm512_set1_ps(run_sum[g]), _mm512_set1_ps(shrink)));
            for (long t = 0; t < TILE; t++)
                sum += probs[t];
            run_sum[g] = sum;
            for (long v = 0; v < vecs; v++)
                acc[g][v] = _mm512_mul_ps(acc[g][v], _mm512_set1_ps(shrink));
            for (long t = 0; t < TILE; t++) {
                if (!(visible >> t & 1))
                    continue;
                const __m512 p = _mm512_set1_ps(probs[t]);
                for (long v = 0; v < vecs; v++)
                    acc[g][v] = _mm512_fmadd_ps(_mm512_loadu_ps(values[t] + v * TILE), p,
                                                acc[g][v]);
            }
        }
    }
    for (long g = 0; g < group; g++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(run_sum[g]));
        for (long v = 0; v < vecs; v++)
            _mm512_storeu_ps(out + (head * group + g) * d + v * TILE,
                             _mm512_mul_ps(acc[g][v], inv));
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
