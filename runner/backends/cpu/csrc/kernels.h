/* The kernels that layers.c chains together, defined in the other files of this
 * directory (one shared library; see runner/backends/cpu/loader.py). */
#ifndef KVCACHE_KERNELS_H
#define KVCACHE_KERNELS_H

/* panel_gemm.c: y [M, panels * 16] = x [M, K] (rows ldx apart) @ packed panels of float32
 * (wtype 0), bfloat16 (1) or int8 weights with group scales (2), bfloat16 pairs (3) or int8
 * quads (4), which round or quantize x too. */
void panel_gemm(const float *x, long ldx, const void *packed, int wtype, float *y, long M, long K,
                long panels);

/* decode_attention.c: one query token per sequence over the paged cache (float32, or float16
 * with kv_half), each over its last `window` keys (0: all of them), scores soft-capped at
 * softcap (0: not); 0 or -1. */
int decode_attention(const float *q, const void *k_cache, const void *v_cache,
                     const int *block_tables, const int *context_lens, float *out,
                     long num_seqs, long hq, long hkv, long d, long block_size,
                     long max_blocks, long shared_blocks, long window, float scale,
                     float softcap, int kv_half);

/* tiled_decode.c: decode_attention's arguments and result, each query row summed as
 * prefill_attention sums a prompt's row at its position (deterministic mode). */
int tiled_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int *block_tables, const int *context_lens, float *out,
                           long num_seqs, long hq, long hkv, long d, long block_size,
                           long max_blocks, long shared_blocks, long window, float scale,
                           float softcap, int kv_half);

/* prefill_attention.c: causal attention of longer queries over the paged cache, each query
 * over its last `window` keys up to its own (0: all of them), scores soft-capped at softcap
 * (0: not); 0 or -1. */
int prefill_attention(const float *q, long q_token_stride, const void *k_cache,
                      const void *v_cache, const int *block_tables, const int *query_start,
                      const int *query_lens, const int *context_lens, float *out,
                      long num_seqs, long hq, long hkv, long d, long block_size,
                      long max_blocks, long window, float scale, float softcap, int kv_half);

/* elementwise.c: RMSNorm and the gated SiLU and tanh GeLU over strided rows. */
void rms_norm_rows(const float *x, long ldx, const float *w, float *y, long ldy, long rows,
                   long dim, float eps);
void silu_and_mul_rows(const float *gate_up, float *out, long ldo, long rows, long width);
void gelu_tanh_and_mul_rows(const float *gate_up, float *out, long ldo, long rows, long width);

/* rope_store.c: one token's q and k normed (where q_norm is set) and rotated, into q and the
 * cache slot k (skipped where k is NULL), its v copied into the slot v. */
void rotate_and_store(const float *row, const float *q_norm, const float *k_norm,
                      const float *cos, const float *sin, float *q, void *k, void *v, long hq,
                      long hkv, long d, long rot, float eps, float *normed, int kv_half,
                      int qk_across);

#endif
