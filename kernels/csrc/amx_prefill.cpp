// Causal prefill attention of one prompt chunk over its sequence's paged keys, on Intel AMX (kernels/native.py
// builds and loads this file; prefill.h describes the flash attention both prefill kernels run). The two
// products (keys by queries, weights by values) are AMX tile products; the softmax between them runs on
// AVX-512.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "prefill.h"

using namespace batcher::prefill;

// query [n, H, D] (the chunk, at positions ctx_start...); caches [rows, Hkv, D]; block_table [W] (int64),
// covering ctx_start + n keys. Returns [n, H, D].
torch::Tensor amx_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                          int64_t ctx_start, int64_t block_size, double scale) {
  TORCH_CHECK(batcher::amx_permitted(), "the OS refused this process AMX's tile state");
  Chunk c = prepare_chunk("amx_prefill", query, k_cache, v_cache, block_table, ctx_start, block_size);
  const int64_t dim = c.dim, dim_blocks = dim / 32;  // dim_blocks <= 4: head_dim <= 128
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, c.heads * c.q_tiles, 1, [&](int64_t begin, int64_t end) {
    // Tiles 1, 2: scores (16 keys x 16 positions each, fp32), then with 0 and 5 the four 16-dimension
    // blocks of the weighted values; 0, 7: key tiles (16 keys x 32 dimensions) before that; 3: a query tile
    // (16 dimension pairs x 16 positions); 3, 6, 7: value tiles (16 key pairs x 16 dimensions), rotated so a
    // load need not wait for the product reading the last one; 4: the weights (16 positions x 32 keys, bf16).
    batcher::configure_tiles();
    alignas(64) uint32_t queries_t[4 * PAIRS][16];  // the tile's queries, transposed: dimension pairs x positions
    alignas(64) float scores[KEYS][ROWS];          // transposed: a row per key, a column per position
    alignas(64) uint16_t weights[ROWS][KEYS];
    alignas(64) float acc[ROWS][128];
    alignas(64) float alpha[ROWS];
    for (int64_t unit = begin; unit < end; unit++) {
      const int64_t head = unit / c.q_tiles, tile = unit % c.q_tiles;
      const uint16_t* keys = c.head_keys(head);
      const uint16_t* values = c.head_values(head);
      transpose_queries(c.q_tile(head, tile), dim, queries_t);
      OnlineSoftmax softmax;
      for (int r = 0; r < ROWS; r++) std::fill(acc[r], acc[r] + dim, 0.0f);
      for (int64_t step = 0; step <= c.last_step(tile); step++) {
        _tile_zero(1);
        _tile_zero(2);
        const uint16_t* step_keys = keys + step * KEYS * dim;
        for (int64_t b = 0; b < dim_blocks; b++) {
          _tile_loadd(3, queries_t[b * PAIRS], 64);
          _tile_loadd(0, step_keys + b * 32, dim * 2);
          _tile_loadd(7, step_keys + ROWS * dim + b * 32, dim * 2);
          _tile_dpbf16ps(1, 0, 3);
          _tile_dpbf16ps(2, 7, 3);
        }
        _tile_stored(1, scores[0], ROWS * 4);
        _tile_stored(2, scores[16], ROWS * 4);
        __m512i pairs[PAIRS], weight_rows[PAIRS];
        _mm512_store_ps(alpha, softmax.step(scores, step * KEYS - c.first_pos(tile), sc, pairs));
        batcher::transpose16(pairs, weight_rows);  // a row per position: its 16 pairs of keys
        for (int r = 0; r < ROWS; r++) _mm512_store_si512(weights[r], weight_rows[r]);
        _tile_loadd(4, weights[0], KEYS * 2);
        for (int64_t group_start = 0; group_start < dim; group_start += 64) {  // four blocks of 16 at a time
          const uint16_t* v = values + (step * (dim / 16) + group_start / 16) * KEY_TILE;
          add_weighted_values(v, ROWS, alpha, &acc[0][group_start], 128);
        }
      }
      alignas(64) float sums[ROWS];
      _mm512_store_ps(sums, softmax.l);
      for (int r = 0; r < ROWS && tile * ROWS + r < c.n; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
        uint16_t* o = c.out_row(tile * ROWS + r, head);
        for (int64_t d = 0; d < dim; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[r][d]), inv)));
      }
    }
    _tile_release();
  });
  return c.out;
}
