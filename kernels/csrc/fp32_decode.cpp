// paged_decode in fp32 (AVX2 and FMA): one query token per sequence attends to its keys straight from the paged
// cache, through its block table (no gather, no padding, no mask), the query heads of a KV head reading each key
// and value once, with an online softmax; one call per layer for every decode of a step. torch's paths gather
// each decode's blocks, or call the flash kernel once per sequence and run of blocks.
//
// A decode reads its keys and values once and does ~2 FLOPs per value read, so memory bounds it: the keys of a
// tile are scored one at a time (a dot product per query head), and the next tile's rows are prefetched, since a
// sequence's rows of one KV head are strided and its blocks scattered.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "avx2.h"
#include "decode_call.h"
#include "row_cursor.h"

namespace {

using batcher::check_fp32;
using batcher::exp256_ps;
using batcher::hsum;
using batcher::RowCursor;

constexpr int TILE = 8;  // keys of one softmax update: a vector of scores per query head
constexpr int MAX_GROUP = MAX_QUERY_HEADS_PER_KV_HEAD;  // kept as the bf16 kernel's, which the runner checks

// One sequence's query heads, `group` to each of `kv_heads` KV heads: queries q[kv_heads * group][D], keys and
// values of `length` positions in the cache rows `table` gives. All KV heads go together, so each position's
// row (every head's keys, or values) is read in one run: a KV head at a time would read a third of each row, and
// the rest again for the next head, and streams at a third of the pace from memory.
template <int D>
void decode_sequence(const float* q, int kv_heads, int group, const float* k_cache, const float* v_cache,
                     const int64_t* table, int64_t length, int64_t block_size, float scale, float* out) {
  constexpr int VC = D / 8;  // vectors of a head's row
  const int heads = kv_heads * group;
  const int64_t row_stride = static_cast<int64_t>(kv_heads) * D;
  std::vector<__m256> state(2 * static_cast<size_t>(heads) * VC);  // the scaled queries, then the accumulators
  __m256* query = state.data();
  __m256* acc = query + heads * VC;
  std::vector<float> m(heads, -INFINITY), l(heads, 0.0f);
  std::vector<float> scores(static_cast<size_t>(heads) * TILE);
  for (int h = 0; h < heads; h++)
    for (int c = 0; c < VC; c++) {
      query[h * VC + c] = _mm256_mul_ps(_mm256_loadu_ps(q + h * D + 8 * c), _mm256_set1_ps(scale));
      acc[h * VC + c] = _mm256_setzero_ps();
    }
  int64_t rows_now[TILE], rows_next[TILE];
  RowCursor cursor{table, block_size};
  auto next_tile = [&](int64_t t0, int64_t* rows) {
    const int64_t n = std::min<int64_t>(TILE, length - t0);
    for (int t = 0; t < n; t++) {
      rows[t] = cursor.next();
      for (int64_t line = 0; line < row_stride * 4; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_cache + rows[t] * row_stride) + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_cache + rows[t] * row_stride) + line, _MM_HINT_T0);
      }
    }
  };
  next_tile(0, rows_next);
  for (int64_t t0 = 0; t0 < length; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, length - t0));
    std::copy(rows_next, rows_next + n, rows_now);
    if (t0 + TILE < length) next_tile(t0 + TILE, rows_next);
    for (int t = 0; t < n; t++) {
      const float* key_row = k_cache + rows_now[t] * row_stride;
      for (int kh = 0; kh < kv_heads; kh++) {
        __m256 k[VC];
        for (int c = 0; c < VC; c++) k[c] = _mm256_loadu_ps(key_row + kh * D + 8 * c);
        for (int h = kh * group; h < (kh + 1) * group; h++) {
          __m256 dot = _mm256_mul_ps(query[h * VC], k[0]);
          for (int c = 1; c < VC; c++) dot = _mm256_fmadd_ps(query[h * VC + c], k[c], dot);
          scores[h * TILE + t] = hsum(dot);
        }
      }
    }
    for (int h = 0; h < heads; h++) {
      float* s_h = scores.data() + h * TILE;
      for (int t = n; t < TILE; t++) s_h[t] = -INFINITY;
      const __m256 s = _mm256_loadu_ps(s_h);
      __m128 top = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      top = _mm_max_ps(top, _mm_movehl_ps(top, top));
      top = _mm_max_ss(top, _mm_movehdup_ps(top));
      const float m_new = std::max(m[h], _mm_cvtss_f32(top));
      const float alpha = std::exp(m[h] - m_new);  // 0 on the first tile (m = -inf)
      const __m256 p = exp256_ps(_mm256_sub_ps(s, _mm256_set1_ps(m_new)));  // 0 past the end (-inf)
      l[h] = l[h] * alpha + hsum(p);
      _mm256_storeu_ps(s_h, p);
      const __m256 a = _mm256_set1_ps(alpha);
      for (int c = 0; c < VC; c++) acc[h * VC + c] = _mm256_mul_ps(acc[h * VC + c], a);
      m[h] = m_new;
    }
    for (int t = 0; t < n; t++) {
      const float* value_row = v_cache + rows_now[t] * row_stride;
      for (int kh = 0; kh < kv_heads; kh++) {
        __m256 v[VC];
        for (int c = 0; c < VC; c++) v[c] = _mm256_loadu_ps(value_row + kh * D + 8 * c);
        for (int h = kh * group; h < (kh + 1) * group; h++) {
          const __m256 p = _mm256_set1_ps(scores[h * TILE + t]);
          for (int c = 0; c < VC; c++) acc[h * VC + c] = _mm256_fmadd_ps(p, v[c], acc[h * VC + c]);
        }
      }
    }
  }
  for (int h = 0; h < heads; h++) {
    const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
    for (int c = 0; c < VC; c++) _mm256_storeu_ps(out + h * D + 8 * c, _mm256_mul_ps(acc[h * VC + c], inv));
  }
}

// query [B, H, D]; k_cache, v_cache [rows, Hkv, D]; block_tables [B, W] (int64); context_lens [B] (int64).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  check_fp32(query, "query");
  check_fp32(k_cache, "k_cache");
  check_fp32(v_cache, "v_cache");
  const batcher::DecodeCall c = batcher::decode_call("paged_decode", query, k_cache, v_cache, block_tables,
                                                      context_lens, block_size, MAX_GROUP);
  auto out = torch::empty_like(c.query);
  const float* q = c.query.data_ptr<float>();
  const float* k = k_cache.data_ptr<float>();
  const float* v = v_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  auto run = [&](auto head_dim) {
    constexpr int D = decltype(head_dim)::value;
    batcher::parallel_for_keys(c, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b++)
        decode_sequence<D>(q + b * c.heads * D, static_cast<int>(c.kv_heads), c.group, k, v, c.table(b), c.length(b),
                           block_size, s, o + b * c.heads * D);
    });
  };
  if (c.dim == 64) {
    run(std::integral_constant<int, 64>{});
  } else {
    run(std::integral_constant<int, 128>{});
  }
  return out;
}

}  // namespace

void bind_fp32_decode(pybind11::module& m) {
  m.def("paged_decode", &paged_decode, "fp32 decode attention over the paged KV cache");
}
