// Causal prefill attention of one prompt chunk over its sequence's paged keys, on Intel AMX (kernels/native.py
// builds and loads this file).
//
// Flash attention: 16 query positions of one head at a time walk the keys 32 at a time, keeping a running
// maximum and sum per position. The two products (keys by queries, weights by values) are AMX tile products;
// the softmax between them runs on AVX-512, a vector per key over the 16 positions (the scores come out
// transposed), so no step reduces across a vector. The keys and values of each KV head are first copied
// once, from the paged cache, into the layouts the tile products read, so every query tile of the chunk
// reuses them. The chunk's own keys must already be in the cache (the caller writes them first).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using batcher::exp_ps;
using batcher::transpose16;

constexpr int ROWS = 16;   // query positions per tile
constexpr int KEYS = 32;   // keys per step: one tile row of bf16 pairs
constexpr int PAIRS = 16;  // dimension (or key) pairs per tile of 64-byte rows

// e^x for x <= 0, to about 4e-5 relative: the attention weights it gives go to the values product in bf16
// (8 bits of mantissa), so a degree-4 polynomial for 2^f on [-1/2, 1/2] serves where exp_ps needs degree 6 and a
// two-part reduction. x below -88 gives ~0.
inline __m512 weight_exp(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.618129e-3f);  // (ln 2)^k / k!, k = 4..0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One KV head's keys and values, copied out of the paged cache into the tile products' layouts: keys as
// rows [position][dimension], values [step][dimension block of 16][16 key pairs x 16 dimensions x 2]. Keys
// past `length` are zeros.
void pack_head(const uint16_t* k_cache, const uint16_t* v_cache, int64_t row_stride, const int64_t* table,
               int64_t block_size, int64_t length, int64_t dim, uint16_t* keys, uint16_t* values) {
  const int64_t steps = (length + KEYS - 1) / KEYS, key_tile = PAIRS * 32;
  const int64_t padded = steps * KEYS;
  std::vector<int64_t> rows(length);
  batcher::RowCursor cursor{table, block_size};
  for (int64_t pos = 0; pos < length; pos++) {
    rows[pos] = cursor.next();
    std::copy(k_cache + rows[pos] * row_stride, k_cache + rows[pos] * row_stride + dim, keys + pos * dim);
  }
  std::fill(keys + length * dim, keys + padded * dim, 0);
  // Two keys' value rows interleaved word by word: unpack gives, per 128-bit lane L of a 32-dimension half,
  // dimensions 8L..8L+3 (low) and 8L+4..8L+7 (high); the permutes put them back in order, 16 at a time.
  const __m512i first16 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i last16 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t pos = 0; pos < padded; pos += 2) {
    const uint16_t* even = pos < length ? v_cache + rows[pos] * row_stride : nullptr;
    const uint16_t* odd = pos + 1 < length ? v_cache + rows[pos + 1] * row_stride : nullptr;
    uint16_t* pair_row = values + (pos / KEYS) * KEYS * dim + ((pos % KEYS) / 2) * 32;
    for (int64_t half = 0; half < dim / 32; half++) {
      const __m512i a = even ? _mm512_loadu_si512(even + 32 * half) : zero;
      const __m512i b = odd ? _mm512_loadu_si512(odd + 32 * half) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(pair_row + (2 * half) * key_tile, _mm512_permutex2var_epi64(lo, first16, hi));
      _mm512_storeu_si512(pair_row + (2 * half + 1) * key_tile, _mm512_permutex2var_epi64(lo, last16, hi));
    }
  }
}

}  // namespace

// query [n, H, D] (the chunk, at positions ctx_start...); caches [rows, Hkv, D]; block_table [W] (int64),
// covering ctx_start + n keys. Returns [n, H, D].
torch::Tensor amx_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                          int64_t ctx_start, int64_t block_size, double scale) {
  TORCH_CHECK(amx_permitted(), "the OS refused this process AMX's tile state");
  batcher::check_bf16(query, "query");
  batcher::check_bf16(k_cache, "k_cache");
  batcher::check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong, "the block table must be int64");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(dim == 64 || dim == 128, "amx_prefill takes head_dim 64 or 128, not ", dim);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const int64_t length = ctx_start + n, steps = (length + KEYS - 1) / KEYS, group = heads / kv_heads;
  const auto table = block_table.contiguous();
  TORCH_CHECK(table.size(0) * block_size >= length, "the block table does not cover the chunk");
  // Queries per head, contiguous and zero-padded to whole tiles of positions: [H][n rounded up][D].
  const int64_t q_tiles = (n + ROWS - 1) / ROWS;
  auto q = torch::zeros({heads, q_tiles * ROWS, dim}, query.options());
  q.narrow(1, 0, n).copy_(query.transpose(0, 1));
  auto packed_k = torch::empty({kv_heads, steps * KEYS * dim}, query.options());
  auto packed_v = torch::empty({kv_heads, steps * KEYS * dim}, query.options());
  const uint16_t* kc = batcher::bf16_data(k_cache);
  const uint16_t* vc = batcher::bf16_data(v_cache);
  uint16_t* pk = batcher::bf16_data(packed_k);
  uint16_t* pv = batcher::bf16_data(packed_v);
  const int64_t* tp = table.data_ptr<int64_t>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; h++)
      pack_head(kc + h * dim, vc + h * dim, kv_heads * dim, tp, block_size, length, dim, pk + h * steps * KEYS * dim,
                pv + h * steps * KEYS * dim);
  });
  auto out = torch::empty({n, heads, dim}, query.options());
  uint16_t* op = batcher::bf16_data(out);
  const uint16_t* qp = batcher::bf16_data(q);
  const float sc = static_cast<float>(scale);
  const int64_t dim_blocks = dim / 32, key_tile = PAIRS * 32;  // dim_blocks <= 4: head_dim <= 128
  at::parallel_for(0, heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    // Tiles 1, 2: scores (16 keys x 16 positions each, fp32), then with 0 and 5 the four 16-dimension
    // blocks of the weighted values; 0, 7: key tiles (16 keys x 32 dimensions) before that; 3: a query tile
    // (16 dimension pairs x 16 positions); 3, 6, 7: value tiles (16 key pairs x 16 dimensions), rotated so a
    // load need not wait for the product reading the last one; 4: the weights (16 positions x 32 keys, bf16).
    batcher::configure_tiles();
    alignas(64) uint32_t queries_t[4][PAIRS][16];  // the tile's queries, transposed: dimension pairs x positions
    alignas(64) float scores[KEYS][ROWS];          // transposed: a row per key, a column per position
    alignas(64) uint16_t weights[ROWS][KEYS];
    alignas(64) float values_sum[ROWS][64];  // one group of four 16-dimension blocks of weights x values
    alignas(64) float acc[ROWS][128];
    alignas(64) float alpha[ROWS];
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                                 0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                                 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D, 0x001E000E,
                                                 0x001F000F);  // words (i, 16 + i) into dword i
    for (int64_t unit = begin; unit < end; unit++) {
      const int64_t head = unit / q_tiles, tile = unit % q_tiles, h = head / group;
      const uint16_t* q_tile = qp + (head * q_tiles + tile) * ROWS * dim;
      const uint16_t* keys = pk + h * steps * KEYS * dim;
      const uint16_t* values = pv + h * steps * KEYS * dim;
      const int64_t first_pos = ctx_start + tile * ROWS;  // of the tile's first query
      const int64_t last_step = std::min(steps - 1, (first_pos + ROWS - 1) / KEYS);
      for (int64_t b = 0; b < dim_blocks; b++) {
        __m512i rows[16], columns[16];
        for (int r = 0; r < ROWS; r++) rows[r] = _mm512_loadu_si512(q_tile + r * dim + b * 32);
        transpose16(rows, columns);
        for (int pair = 0; pair < PAIRS; pair++) _mm512_store_si512(queries_t[b][pair], columns[pair]);
      }
      __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
      for (int r = 0; r < ROWS; r++) std::fill(acc[r], acc[r] + dim, 0.0f);
      for (int64_t step = 0; step <= last_step; step++) {
        _tile_zero(1);
        _tile_zero(2);
        const uint16_t* step_keys = keys + step * KEYS * dim;
        for (int64_t b = 0; b < dim_blocks; b++) {
          _tile_loadd(3, queries_t[b], 64);
          _tile_loadd(0, step_keys + b * 32, dim * 2);
          _tile_loadd(7, step_keys + ROWS * dim + b * 32, dim * 2);
          _tile_dpbf16ps(1, 0, 3);
          _tile_dpbf16ps(2, 7, 3);
        }
        _tile_stored(1, scores[0], ROWS * 4);
        _tile_stored(2, scores[16], ROWS * 4);
        // Key k is seen by the positions at or after its own: lanes r >= k's position - first_pos. A step
        // whose every key precedes the tile's first position is seen whole, and skips the masks.
        const int64_t first_hidden = step * KEYS - first_pos;  // key 0 of the step, relative to lane 0
        const bool seen_whole = first_hidden + KEYS - 1 <= 0;
        __m512 s[KEYS];
        __m512 step_max = _mm512_set1_ps(-INFINITY);
        for (int k = 0; k < KEYS; k++) {
          if (seen_whole) {
            s[k] = _mm512_mul_ps(_mm512_load_ps(scores[k]), _mm512_set1_ps(sc));
          } else {
            const __mmask16 seen = _mm512_cmp_epi32_mask(
                lanes, _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(first_hidden + k, -1, ROWS))),
                _MM_CMPINT_NLT);
            s[k] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_load_ps(scores[k]), _mm512_set1_ps(sc));
          }
          step_max = _mm512_max_ps(step_max, s[k]);
        }
        const __m512 m_new = _mm512_max_ps(m, step_max);  // finite: every position saw key 0, in step 0
        const __m512 a = exp_ps(_mm512_sub_ps(m, m_new));  // 0 on the first step (m = -inf)
        __m512 sum = _mm512_setzero_ps();
        __m512i pairs[PAIRS], weight_rows[PAIRS];
        for (int k = 0; k < KEYS; k += 2) {
          __m512 p0 = weight_exp(_mm512_sub_ps(s[k], m_new)), p1 = weight_exp(_mm512_sub_ps(s[k + 1], m_new));
          if (!seen_whole) {
            p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[k], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p0);
            p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[k + 1], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p1);
          }
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          pairs[k / 2] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        l = _mm512_fmadd_ps(l, a, sum);
        m = m_new;
        _mm512_store_ps(alpha, a);
        transpose16(pairs, weight_rows);  // a row per position: its 16 pairs of keys
        for (int r = 0; r < ROWS; r++) _mm512_store_si512(weights[r], weight_rows[r]);
        _tile_loadd(4, weights[0], KEYS * 2);
        for (int64_t group_start = 0; group_start < dim; group_start += 64) {  // four blocks of 16 at a time
          const uint16_t* v = values + (step * (dim / 16) + group_start / 16) * key_tile;
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(0);
          _tile_zero(5);
          _tile_loadd(3, v, 64);
          _tile_dpbf16ps(1, 4, 3);
          _tile_loadd(6, v + key_tile, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, v + 2 * key_tile, 64);
          _tile_dpbf16ps(0, 4, 7);
          _tile_loadd(3, v + 3 * key_tile, 64);
          _tile_dpbf16ps(5, 4, 3);
          _tile_stored(1, &values_sum[0][0], 64 * 4);
          _tile_stored(2, &values_sum[0][16], 64 * 4);
          _tile_stored(0, &values_sum[0][32], 64 * 4);
          _tile_stored(5, &values_sum[0][48], 64 * 4);
          for (int r = 0; r < ROWS; r++) {
            const __m512 ar = _mm512_set1_ps(alpha[r]);
            for (int d = 0; d < 64; d += 16) {
              float* target = &acc[r][group_start + d];
              _mm512_store_ps(target, _mm512_fmadd_ps(_mm512_load_ps(target), ar, _mm512_load_ps(&values_sum[r][d])));
            }
          }
        }
      }
      alignas(64) float sums[ROWS];
      _mm512_store_ps(sums, l);
      for (int r = 0; r < ROWS && tile * ROWS + r < n; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
        uint16_t* o = op + ((tile * ROWS + r) * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[r][d]), inv)));
      }
    }
    _tile_release();
  });
  return out;
}
