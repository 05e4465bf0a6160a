// Causal prefill attention of one prompt chunk over its sequence's paged keys, on AVX-512 BF16, for CPUs
// without AMX (kernels/native.py builds and loads this file; prefill.h describes the flash attention both
// prefill kernels run).
//
// Both products keep the 16 positions of a tile in the 16 lanes of a vector, so nothing is transposed
// between them: a key's scores are dimension pairs of the queries (a vector per pair, transposed once per
// tile) times that key's pair, broadcast; a dimension's weighted values are key pairs of the weights (a
// vector per pair, as the softmax writes them) times that dimension's value pair, broadcast. Each
// `vdpbf16ps` multiplies 16 pairs into 16 sums, with 16 independent sums in flight. The running output stays
// transposed, a vector per dimension over the positions, so the softmax's rescaling is one multiply per
// vector; it is transposed once, at the end.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "prefill.h"

using namespace batcher::prefill;

namespace {

inline __m512bh broadcast_pair(const uint32_t* pair) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(*pair)); }

// scores[k][r] = query r . key k for the step's 32 keys (rows of `keys`, D bf16 each).
template <int D>
void score_step(const uint32_t queries_t[][16], const uint16_t* keys, float scores[KEYS][ROWS]) {
  const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(keys);
  for (int k0 = 0; k0 < KEYS; k0 += 16) {
    __m512 s[16];
    for (int j = 0; j < 16; j++) s[j] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
      const __m512bh q = (__m512bh)_mm512_load_si512(queries_t[p]);
      for (int j = 0; j < 16; j++) s[j] = _mm512_dpbf16_ps(s[j], q, broadcast_pair(key_pairs + (k0 + j) * D / 2 + p));
    }
    for (int j = 0; j < 16; j++) _mm512_store_ps(scores[k0 + j], s[j]);
  }
}

// acc[d] = acc[d] * alpha + sum over the step's keys of weight x value, for each dimension d (a vector over the
// positions). `values` is the step's part of pack_head's layout: per 16-dimension block, 16 key pairs x 16
// dimensions, one dword each.
template <int D>
void accumulate_step(const __m512i pairs[PAIRS], const uint16_t* values, __m512 alpha, float acc[][ROWS]) {
  const uint32_t* value_pairs = reinterpret_cast<const uint32_t*>(values);
  for (int block = 0; block < D / 16; block++) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_mul_ps(_mm512_load_ps(acc[block * 16 + j]), alpha);
    const uint32_t* block_pairs = value_pairs + block * PAIRS * 16;
    for (int kp = 0; kp < PAIRS; kp++) {
      const __m512bh w = (__m512bh)pairs[kp];
      for (int j = 0; j < 16; j++) a[j] = _mm512_dpbf16_ps(a[j], w, broadcast_pair(block_pairs + kp * 16 + j));
    }
    for (int j = 0; j < 16; j++) _mm512_store_ps(acc[block * 16 + j], a[j]);
  }
}

template <int D>
void run(Chunk& c, float scale) {
  at::parallel_for(0, c.heads * c.q_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t queries_t[D / 2][16];  // dimension pairs x positions
    alignas(64) float scores[KEYS][ROWS];       // a row per key, a column per position
    alignas(64) float acc[D][ROWS];             // a row per dimension, a column per position
    for (int64_t unit = begin; unit < end; unit++) {
      const int64_t head = unit / c.q_tiles, tile = unit % c.q_tiles;
      const uint16_t* keys = c.head_keys(head);
      const uint16_t* values = c.head_values(head);
      transpose_queries(c.q_tile(head, tile), D, queries_t);
      OnlineSoftmax softmax;
      for (int d = 0; d < D; d++) _mm512_store_ps(acc[d], _mm512_setzero_ps());
      for (int64_t step = 0; step <= c.last_step(tile); step++) {
        score_step<D>(queries_t, keys + step * KEYS * D, scores);
        __m512i pairs[PAIRS];
        const __m512 alpha = softmax.step(scores, step * KEYS - c.first_pos(tile), scale, pairs);
        accumulate_step<D>(pairs, values + step * KEYS * D, alpha, acc);
      }
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), softmax.l);
      for (int block = 0; block < D / 16; block++) {
        __m512i dims[16], positions[16];
        for (int j = 0; j < 16; j++)
          dims[j] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(acc[block * 16 + j]), inv));
        batcher::transpose16(dims, positions);
        for (int r = 0; r < ROWS && tile * ROWS + r < c.n; r++)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.out_row(tile * ROWS + r, head) + block * 16),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(positions[r])));
      }
    }
  });
}

}  // namespace

// query [n, H, D] (the chunk, at positions ctx_start...); caches [rows, Hkv, D]; block_table [W] (int64),
// covering ctx_start + n keys. Returns [n, H, D].
torch::Tensor avx512_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, int64_t ctx_start, int64_t block_size, double scale) {
  Chunk c = prepare_chunk("avx512_prefill", query, k_cache, v_cache, block_table, ctx_start, block_size);
  if (c.dim == 64) {
    run<64>(c, static_cast<float>(scale));
  } else {
    run<128>(c, static_cast<float>(scale));
  }
  return c.out;
}
