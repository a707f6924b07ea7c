/* Causal attention of prefill chunks over a paged KV cache, for the CPU.
 *
 * q [T, Hq, D]: the new tokens of S sequences, sequence s owning query_lens[s] rows from
 * query_start[s] on, whose positions are the last ones of its context_lens[s] tokens;
 * caches [blocks, B, Hkv, D] already hold the new K/V; block_tables [S, max_blocks] int32;
 * out like q. Each query sees the keys up to its own position, read in place.
 *
 * One task takes 16 query rows of one sequence and KV head (positions x the G query heads of
 * that KV head) and walks the keys 16 at a time with every vector lane a query row:
 * - scores: for each of the 16 keys, sum over d of key[d] (broadcast) * q^T[d] (a vector of
 *   16 rows), so 16 vectors hold a 16 x 16 score tile and no horizontal sum is ever needed;
 * - the streaming softmax (running max and sum per row) is then plain vector arithmetic across
 *   the 16 keys;
 * - values: out^T[d] += value[d] (broadcast) * p (a vector of 16 rows), out^T [D, 16] kept in a
 *   small buffer, 16 accumulators at a time.
 * Two multiply-adds per score and value element, as a matrix product, with the exp and the
 * rescaling around them; D a multiple of 16 up to 256 (the loader checks).
 */
#include <immintrin.h>
#include <math.h>

enum { LANES = 16, MAX_DIM = 256 };

/* e^x for x <= 0 to about 1 ulp (see decode_attention.c). */
static inline __m512 exp_nonpositive(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

struct task_shape {
    long hq, hkv, d, block_size, max_blocks;
    float scale;
};

/* Rows first_row .. first_row + rows - 1 of the (query, head-in-group) list of sequence
 * `seq` and KV head `head`; row i is query i / G of the sequence, head head * G + i % G. */
static void attend_tile(const float *q, const float *k_cache, const float *v_cache,
                        const int *table, long q_start, long q_len, long context,
                        float *out, long head, long first_row, long rows,
                        const struct task_shape *shape)
{
    const long group = shape->hq / shape->hkv, d = shape->d;
    const long row_stride = shape->hkv * d; /* floats between tokens in a block */
    float qt[MAX_DIM][LANES] __attribute__((aligned(64)));   /* q^T, scaled */
    float acc[MAX_DIM][LANES] __attribute__((aligned(64)));  /* out^T, unnormalised */
    float probs[LANES][LANES] __attribute__((aligned(64)));  /* p per key, lanes = rows */
    int positions[LANES] __attribute__((aligned(64)));
    /* Token rows a multiple of 4 KB apart (Hkv * D = 1024, 2048, ...) put the 16 keys of a
     * chunk in one L1 set, where they evict each other (96 against 135 GFLOP/s for a copy
     * first, at 8 KV heads of 128); 2 KB apart they fit the set's 8 ways, and copying costs. */
    const int aliasing = row_stride % 1024 == 0;
    float key_copy[LANES][MAX_DIM + LANES] __attribute__((aligned(64)));
    float value_copy[LANES][MAX_DIM + LANES] __attribute__((aligned(64)));
    long last_position = 0;
    for (long i = 0; i < LANES; i++) {
        /* Lanes past the last row repeat it: same work, result dropped, never an empty row. */
        long row = first_row + (i < rows ? i : rows - 1);
        long query = row / group, qhead = head * group + row % group;
        const float *src = q + ((q_start + query) * shape->hq + qhead) * d;
        for (long j = 0; j < d; j++)
            qt[j][i] = src[j] * shape->scale;
        positions[i] = (int)(context - q_len + query);
        last_position = positions[i] > last_position ? positions[i] : last_position;
    }
    for (long j = 0; j < d; j++)
        _mm512_store_ps(acc[j], _mm512_setzero_ps());
    const __m512i position = _mm512_load_si512(positions);
    __m512 running_max = _mm512_set1_ps(-INFINITY), running_sum = _mm512_setzero_ps();
    for (long first = 0; first <= last_position; first += LANES) {
        const float *keys[LANES], *values[LANES];
        for (long t = 0; t < LANES; t++) {
            long key = first + t <= last_position ? first + t : last_position;
            long offset = ((long)table[key / shape->block_size] * shape->block_size
                           + key % shape->block_size) * row_stride + head * d;
            keys[t] = k_cache + offset;
            values[t] = v_cache + offset;
            if (aliasing) { /* read from copies whose rows are not 2 KB apart */
                for (long j = 0; j < d; j++) {
                    key_copy[t][j] = keys[t][j];
                    value_copy[t][j] = values[t][j];
                }
                keys[t] = key_copy[t];
                values[t] = value_copy[t];
            }
        }
        __m512 s[LANES];
        for (int t = 0; t < LANES; t++)
            s[t] = _mm512_setzero_ps();
        for (long j = 0; j < d; j++) {
            __m512 qj = _mm512_load_ps(qt[j]);
            for (int t = 0; t < LANES; t++)
                s[t] = _mm512_fmadd_ps(_mm512_set1_ps(keys[t][j]), qj, s[t]);
        }
        /* causal: key first + t is visible to the rows at or after its position; the others
         * get no weight at all */
        __m512 chunk_max = running_max;
        __mmask16 visible[LANES];
        for (int t = 0; t < LANES; t++) {
            visible[t] = _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32((int)(first + t)));
            chunk_max = _mm512_max_ps(chunk_max, _mm512_mask_mov_ps(running_max, visible[t], s[t]));
        }
        /* every row sees key 0, so chunk_max is finite from the first chunk on */
        __m512 shrink = exp_nonpositive(_mm512_sub_ps(running_max, chunk_max));
        running_max = chunk_max;
        running_sum = _mm512_mul_ps(running_sum, shrink);
        for (int t = 0; t < LANES; t++) {
            __m512 p = _mm512_maskz_mov_ps(visible[t],
                                           exp_nonpositive(_mm512_sub_ps(s[t], chunk_max)));
            running_sum = _mm512_add_ps(running_sum, p);
            _mm512_store_ps(probs[t], p);
        }
        for (long j0 = 0; j0 < d; j0 += LANES) {
            __m512 part[LANES];
            for (int j = 0; j < LANES; j++)
                part[j] = _mm512_mul_ps(_mm512_load_ps(acc[j0 + j]), shrink);
            for (int t = 0; t < LANES; t++) {
                __m512 p = _mm512_load_ps(probs[t]);
                const float *value = values[t] + j0;
                for (int j = 0; j < LANES; j++)
                    part[j] = _mm512_fmadd_ps(_mm512_set1_ps(value[j]), p, part[j]);
            }
            for (int j = 0; j < LANES; j++)
                _mm512_store_ps(acc[j0 + j], part[j]);
        }
    }
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), running_sum);
    for (long j = 0; j < d; j++)
        _mm512_store_ps(acc[j], _mm512_mul_ps(_mm512_load_ps(acc[j]), inv));
    for (long i = 0; i < rows; i++) {
        long row = first_row + i;
        long query = row / group, qhead = head * group + row % group;
        float *dst = out + ((q_start + query) * shape->hq + qhead) * d;
        for (long j = 0; j < d; j++)
            dst[j] = acc[j][i];
    }
}

/* Returns 0, or -1 when the shapes are outside what the kernel handles (nothing written). */
int prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                      const int *block_tables, const int *query_start, const int *query_lens,
                      const int *context_lens, float *out, long num_seqs, long hq, long hkv,
                      long d, long block_size, long max_blocks, float scale)
{
    if (hkv < 1 || hq % hkv || d % LANES || d > MAX_DIM || block_size < 1)
        return -1;
    const struct task_shape shape = {hq, hkv, d, block_size, max_blocks, scale};
    const long group = hq / hkv;
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
                    context_lens[s], out, head, first_row, rows, &shape);
    }
    return 0;
}
