// What the two bf16 prefill kernels share (amx_prefill.cpp on AMX tiles, avx512_prefill.cpp on AVX-512 BF16):
// the checks and the copies of a chunk's inputs, and the online softmax of a step. The decode kernel
// (cpu_kernels.cpp) runs avx512_prefill's arithmetic too, so a query gets the same bits from either.
//
// Both run flash attention the same way: 16 query positions of one head at a time walk the keys 32 at a time,
// keeping a running maximum and sum per position. The scores of a step come out transposed (a vector per key
// over the 16 positions), so the softmax never reduces across a vector. The keys and values of each KV head
// are first copied once, from the paged cache, into the layouts the products read, so every query tile of
// the chunk reuses them. The chunk's own keys must already be in the cache (the caller writes them first).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace batcher::prefill {

constexpr int ROWS = 16;   // query positions per tile
constexpr int KEYS = 32;   // keys per step
constexpr int PAIRS = 16;  // key pairs of a step (and dimension pairs of a 32-dimension block)
constexpr int KEY_TILE = PAIRS * 32;  // bf16 values of one step's 16-dimension block of values

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

// One KV head's keys and values, copied out of the paged cache: keys as rows [position][dimension], values
// [step][dimension block of 16][16 key pairs x 16 dimensions x 2] (the word pair of key pair j and dimension d
// is one dword). Keys past `length` are zeros.
inline void pack_head(const uint16_t* k_cache, const uint16_t* v_cache, int64_t row_stride, const int64_t* table,
                      int64_t block_size, int64_t length, int64_t dim, uint16_t* keys, uint16_t* values) {
  const int64_t steps = (length + KEYS - 1) / KEYS;
  const int64_t padded = steps * KEYS;
  std::vector<int64_t> rows(length);
  RowCursor cursor{table, block_size};
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
      _mm512_storeu_si512(pair_row + (2 * half) * KEY_TILE, _mm512_permutex2var_epi64(lo, first16, hi));
      _mm512_storeu_si512(pair_row + (2 * half + 1) * KEY_TILE, _mm512_permutex2var_epi64(lo, last16, hi));
    }
  }
}

// The sum of a vector's 16 lanes, in every lane, in one fixed tree: lane k with lane k + 8, then k + 4, k + 2 and
// k + 1. The decode kernel (cpu_kernels.cpp) sums a step's 32 weights so, lane k holding keys k and k + 16 added;
// OnlineSoftmax sums its 32 vectors (a key each) in the same tree, so a query's running sum is the same bits in
// either kernel.
inline __m512 sum_lanes(__m512 x) {
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));  // 256-bit halves swapped: lane k ^ 8
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));  // 128-bit quarters swapped in pairs: k ^ 4
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));        // within each quarter: k ^ 2
  return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));     // k ^ 1
}

// A chunk's inputs as both kernels read them: the queries per head, zero-padded to whole tiles of positions
// (`q [H][tiles * ROWS][D]`), each KV head's keys and values packed (`pack_head`), and the output to fill.
struct Chunk {
  int64_t n, heads, dim, kv_heads, group, steps, q_tiles, ctx_start;
  torch::Tensor q, keys, values, out;

  // The tile's first position's index in the sequence, and the last step of keys a tile sees.
  int64_t first_pos(int64_t tile) const { return ctx_start + tile * ROWS; }
  int64_t last_step(int64_t tile) const { return std::min(steps - 1, (first_pos(tile) + ROWS - 1) / KEYS); }
  const uint16_t* q_tile(int64_t head, int64_t tile) const {
    return bf16_data(q) + (head * q_tiles + tile) * ROWS * dim;
  }
  const uint16_t* head_keys(int64_t head) const { return bf16_data(keys) + head / group * steps * KEYS * dim; }
  const uint16_t* head_values(int64_t head) const { return bf16_data(values) + head / group * steps * KEYS * dim; }
  uint16_t* out_row(int64_t position, int64_t head) { return bf16_data(out) + (position * heads + head) * dim; }
};

// query [n, H, D] (the chunk, at positions ctx_start...); caches [rows, Hkv, D]; block_table [W] (int64),
// covering ctx_start + n keys.
inline Chunk prepare_chunk(const char* kernel, const torch::Tensor& query, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_table, int64_t ctx_start,
                           int64_t block_size) {
  check_bf16(query, "query");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong, "the block table must be int64");
  Chunk c;
  c.n = query.size(0), c.heads = query.size(1), c.dim = query.size(2), c.kv_heads = k_cache.size(1);
  c.ctx_start = ctx_start;
  TORCH_CHECK(c.dim == 64 || c.dim == 128, kernel, " takes head_dim 64 or 128, not ", c.dim);
  TORCH_CHECK(c.heads % c.kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(2) == c.dim, "the cache's head_dim is not the query's");
  const int64_t length = ctx_start + c.n;
  c.steps = (length + KEYS - 1) / KEYS, c.group = c.heads / c.kv_heads;
  const auto table = block_table.contiguous();
  TORCH_CHECK(table.size(0) * block_size >= length, "the block table does not cover the chunk");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t cache_rows = k_cache.size(0);
  for (int64_t b = 0; b < (length + block_size - 1) / block_size; b++)
    TORCH_CHECK(tp[b] >= 0 && (tp[b] + 1) * block_size <= cache_rows, "block ", tp[b], " is outside the cache");
  c.q_tiles = (c.n + ROWS - 1) / ROWS;
  c.q = torch::zeros({c.heads, c.q_tiles * ROWS, c.dim}, query.options());
  c.q.narrow(1, 0, c.n).copy_(query.transpose(0, 1));
  c.keys = torch::empty({c.kv_heads, c.steps * KEYS * c.dim}, query.options());
  c.values = torch::empty({c.kv_heads, c.steps * KEYS * c.dim}, query.options());
  const uint16_t* kc = bf16_data(k_cache);
  const uint16_t* vc = bf16_data(v_cache);
  uint16_t* pk = bf16_data(c.keys);
  uint16_t* pv = bf16_data(c.values);
  at::parallel_for(0, c.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; h++)
      pack_head(kc + h * c.dim, vc + h * c.dim, c.kv_heads * c.dim, tp, block_size, length, c.dim,
                pk + h * c.steps * KEYS * c.dim, pv + h * c.steps * KEYS * c.dim);
  });
  c.out = torch::empty({c.n, c.heads, c.dim}, query.options());
  return c;
}

// A tile's queries transposed, 32 dimensions at a time: dword row p holds dimension pair p (dimensions 2p and
// 2p + 1) of the 16 positions.
inline void transpose_queries(const uint16_t* q_tile, int64_t dim, uint32_t queries_t[][16]) {
  for (int64_t b = 0; b < dim / 32; b++) {
    __m512i rows[16], columns[16];
    for (int r = 0; r < ROWS; r++) rows[r] = _mm512_loadu_si512(q_tile + r * dim + b * 32);
    transpose16(rows, columns);
    for (int pair = 0; pair < PAIRS; pair++) _mm512_store_si512(queries_t[b * PAIRS + pair], columns[pair]);
  }
}

// The online softmax of one query, a step's 32 keys in two vectors (keys 0-15, 16-31): the decode kernels' layout
// (paged_decode, amx_decode). OnlineSoftmax's operations for one of its lanes (the weights' sum in sum_lanes' tree),
// so a query's running maximum, sum and weights are the same bits in either layout.
struct KeyLanesSoftmax {
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();  // every lane the same

  // One step of `n` keys (the rest hidden): writes their weights in bf16, in key order (key pairs 2j, 2j + 1 in
  // dword j, 64-byte aligned), and returns what the running sums scale by (every lane the same).
  __m512 step(const __m512 scores[2], int n, float scale, uint32_t weights[KEYS / 2]) {
    const __mmask16 valid[2] = {static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1),
                                static_cast<__mmask16>(n <= 16 ? 0 : n >= 32 ? 0xFFFF : (1u << (n - 16)) - 1)};
    __m512 scaled[2], p[2];
    for (int h = 0; h < 2; h++)
      scaled[h] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[h], scores[h], _mm512_set1_ps(scale));
    const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(scaled[0], scaled[1]));
    const __m512 m_new = _mm512_max_ps(m, _mm512_set1_ps(step_max));
    const __m512 alpha = exp_ps(_mm512_sub_ps(m, m_new));  // ~0 on the first step (m = -inf)
    for (int h = 0; h < 2; h++) p[h] = _mm512_maskz_mov_ps(valid[h], weight_exp(_mm512_sub_ps(scaled[h], m_new)));
    l = _mm512_fmadd_ps(l, alpha, sum_lanes(_mm512_add_ps(p[0], p[1])));
    _mm512_store_si512(weights, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    m = m_new;
    return alpha;
  }
};

// The AMX kernels' weighted values of a step (amx_prefill, amx_decode), added to their running outputs: the weights in
// tile 4 (16 rows x 32 keys, bf16) times the step's four 16-dimension blocks of values at `v` (pack_head's layout),
// on tiles 1, 2, 0 and 5 (zeroed first; the value tiles 3, 6 and 7 are rotated so a load need not wait for the
// product reading the last one); then for each of the first `rows` rows, its 64 dimensions at `acc + r * acc_stride`
// become acc * alpha[r] + its weighted values, one FMA a lane, so either kernel rounds a query's output alike.
inline void add_weighted_values(const uint16_t* v, int rows, const float* alpha, float* acc, int64_t acc_stride) {
  alignas(64) float values_sum[16][64];
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(0);
  _tile_zero(5);
  _tile_loadd(3, v, 64);
  _tile_dpbf16ps(1, 4, 3);
  _tile_loadd(6, v + KEY_TILE, 64);
  _tile_dpbf16ps(2, 4, 6);
  _tile_loadd(7, v + 2 * KEY_TILE, 64);
  _tile_dpbf16ps(0, 4, 7);
  _tile_loadd(3, v + 3 * KEY_TILE, 64);
  _tile_dpbf16ps(5, 4, 3);
  _tile_stored(1, &values_sum[0][0], 64 * 4);
  _tile_stored(2, &values_sum[0][16], 64 * 4);
  _tile_stored(0, &values_sum[0][32], 64 * 4);
  _tile_stored(5, &values_sum[0][48], 64 * 4);
  for (int r = 0; r < rows; r++) {
    const __m512 ar = _mm512_set1_ps(alpha[r]);
    for (int d = 0; d < 64; d += 16) {
      float* target = acc + r * acc_stride + d;
      _mm512_store_ps(target, _mm512_fmadd_ps(_mm512_load_ps(target), ar, _mm512_load_ps(&values_sum[r][d])));
    }
  }
}

// The online softmax of a tile's 16 positions (lane r: position first_pos + r).
struct OnlineSoftmax {
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();

  // One step: `scores[k]` holds key k's products with the 16 queries; `first_hidden` is the step's key 0
  // relative to lane 0's position (key k is seen by lanes r >= first_hidden + k). Writes the weights as key
  // pairs, `pairs[j]` lane r = (weight of key 2j, of key 2j + 1) in bf16, and returns what the running sums
  // scale by before this step's weighted values join them.
  __m512 step(const float scores[KEYS][ROWS], int64_t first_hidden, float scale, __m512i pairs[PAIRS]) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                                 0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                                 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D, 0x001E000E,
                                                 0x001F000F);  // words (i, 16 + i) into dword i
    // A step whose every key precedes lane 0's position is seen whole, and skips the masks.
    const bool seen_whole = first_hidden + KEYS - 1 <= 0;
    __m512 s[KEYS];
    __m512 step_max = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < KEYS; k++) {
      if (seen_whole) {
        s[k] = _mm512_mul_ps(_mm512_load_ps(scores[k]), _mm512_set1_ps(scale));
      } else {
        const __mmask16 seen = _mm512_cmp_epi32_mask(
            lanes, _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(first_hidden + k, -1, ROWS))),
            _MM_CMPINT_NLT);
        s[k] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_load_ps(scores[k]), _mm512_set1_ps(scale));
      }
      step_max = _mm512_max_ps(step_max, s[k]);
    }
    const __m512 m_new = _mm512_max_ps(m, step_max);  // finite: every position saw key 0, in step 0
    const __m512 alpha = exp_ps(_mm512_sub_ps(m, m_new));  // 0 on the first step (m = -inf)
    __m512 p[KEYS];
    for (int k = 0; k < KEYS; k++) {
      p[k] = weight_exp(_mm512_sub_ps(s[k], m_new));
      if (!seen_whole)
        p[k] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[k], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p[k]);
    }
    for (int k = 0; k < KEYS; k += 2)
      pairs[k / 2] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p[k + 1], p[k]));
    for (int width = KEYS / 2; width >= 1; width /= 2)  // sum_lanes' tree: key k with k + 16, then k + 8, ...
      for (int k = 0; k < width; k++) p[k] = _mm512_add_ps(p[k], p[k + width]);
    const __m512 sum = p[0];
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = m_new;
    return alpha;
  }
};

}  // namespace batcher::prefill
