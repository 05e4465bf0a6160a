// bf16 decode kernels for CPUs with AVX-512 BF16 (kernels/native.py builds and loads this file with
// amx_linear.cpp, avx512_linear.cpp, amx_prefill.cpp, avx512_prefill.cpp, layer_ops.cpp and kv_write.cpp, whose
// functions it binds too).
//
// - paged_decode: one query token per sequence attends to its keys straight from the paged cache
//   (through its block table: no gather, no padding, no mask), the query heads of a KV head reading
//   each key and value once, with an online softmax; one call per layer for every decode of a step.
// - small_linear: x @ W.T + b for a few rows, streaming W once at the memory's pace (oneDNN's bf16
//   kernels run at about two thirds of it at one row).
//
// Both accumulate in fp32 and round once to bf16, as torch's own bf16 kernels do.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

using batcher::bf16_data;
using batcher::check_bf16;
using batcher::exp_ps;
using batcher::RowCursor;
using batcher::transpose16;

constexpr int TILE = 16;            // keys scored together: one vector of scores per query head
constexpr int PREFETCH_BYTES = 8192;

inline __m512 load_bf16_as_fp32(const uint16_t* p) {
  return batcher::bf16_to_fp32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline uint16_t to_bf16(float x) { return c10::BFloat16(x).x; }  // round to nearest even

// One sequence's query heads of one KV head: queries q[G][D], keys and values of `length` positions,
// position i at cache row table[i / block_size] * block_size + i % block_size. Keys go 16 at a time: their
// rows transposed into pairs of dimensions, so that one instruction scores 16 keys against a query pair.
template <int D, int group>
void decode_head(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                 int64_t row_stride, const int64_t* table, int64_t length, int64_t block_size,
                 float scale, uint16_t* out, int64_t out_head_stride) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int PAIRS = D / 2;  // dwords of a query or key row: pairs of bf16 dimensions
  constexpr int VC = D / 16;    // fp32 vectors of an output row
  const int32_t* q_pairs[group];
  __m512 acc[group][VC];
  float m[group], l[group];
  for (int g = 0; g < group; g++) {
    q_pairs[g] = reinterpret_cast<const int32_t*>(q + g * q_head_stride);
    for (int c = 0; c < VC; c++) acc[g][c] = _mm512_setzero_ps();
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  alignas(64) float probs[group][TILE];
  // The rows of this tile and of the next, whose lines are fetched ahead: a sequence's rows of one KV head
  // are strided and its blocks scattered, which the hardware prefetchers do not follow.
  int64_t rows_now[TILE], rows_next[TILE];
  RowCursor cursor{table, block_size};
  auto next_tile = [&](int64_t t0, int64_t* rows) {
    const int64_t n = std::min<int64_t>(TILE, length - t0);
    for (int t = 0; t < n; t++) {
      rows[t] = cursor.next();
      for (int line = 0; line < D * 2; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_cache + rows[t] * row_stride) + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_cache + rows[t] * row_stride) + line, _MM_HINT_T0);
      }
    }
    for (int64_t t = n; t < TILE; t++) rows[t] = rows[0];  // past the end: scored, then masked
  };
  next_tile(0, rows_next);
  const uint16_t* k_rows[TILE];
  const uint16_t* v_rows[TILE];
  for (int64_t t0 = 0; t0 < length; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, length - t0));
    std::copy(rows_next, rows_next + TILE, rows_now);
    if (t0 + TILE < length) next_tile(t0 + TILE, rows_next);
    for (int t = 0; t < TILE; t++) {
      k_rows[t] = k_cache + rows_now[t] * row_stride;
      v_rows[t] = v_cache + rows_now[t] * row_stride;
    }
    __m512 s[group];
    for (int g = 0; g < group; g++) s[g] = _mm512_setzero_ps();
    for (int half = 0; half < PAIRS / 16; half++) {
      __m512i rows[16], cols[16];
      for (int t = 0; t < TILE; t++) rows[t] = _mm512_loadu_si512(k_rows[t] + 32 * half);
      transpose16(rows, cols);
      for (int j = 0; j < 16; j++)
        for (int g = 0; g < group; g++)
          s[g] = _mm512_dpbf16_ps(s[g], (__m512bh)_mm512_set1_epi32(q_pairs[g][16 * half + j]), (__m512bh)cols[j]);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < group; g++) {
      const __m512 scaled = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, s[g], _mm512_set1_ps(scale));
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(scaled));
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
      const __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(scaled, _mm512_set1_ps(m_new))));
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(p);
      _mm512_store_ps(probs[g], p);
      const __m512 a = _mm512_set1_ps(alpha);
      for (int c = 0; c < VC; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], a);
      m[g] = m_new;
    }
    for (int t = 0; t < n; t++) {
      __m512 v[VC];
      for (int c = 0; c < VC; c++) v[c] = load_bf16_as_fp32(v_rows[t] + 16 * c);
      for (int g = 0; g < group; g++) {
        const __m512 p = _mm512_set1_ps(probs[g][t]);
        for (int c = 0; c < VC; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < group; g++) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
    for (int c = 0; c < VC; c++) {
      const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * out_head_stride + 16 * c), (__m256i)packed);
    }
  }
}

// query [B, H, D]; k_cache, v_cache [rows, Hkv, D]; block_tables [B, W] (int64); context_lens [B] (int64).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  check_bf16(query, "query");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= batcher::kMaxGroup, "unsupported query heads per KV head");
  TORCH_CHECK(k_cache.size(2) == dim && block_tables.size(0) == batch && context_lens.size(0) == batch,
              "mismatched shapes");
  const int group = static_cast<int>(heads / kv_heads);
  auto out = torch::empty_like(query);
  const uint16_t* q = bf16_data(query);
  const uint16_t* k = bf16_data(k_cache);
  const uint16_t* v = bf16_data(v_cache);
  uint16_t* o = bf16_data(out);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), row_stride = kv_heads * dim;
  const float s = static_cast<float>(scale);
  auto run = [&](auto head_dim, auto group_size) {
    constexpr int Dc = decltype(head_dim)::value, Gc = decltype(group_size)::value;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {
        const int64_t b = i / kv_heads, h = i % kv_heads;
        const int64_t first = (b * heads + h * Gc) * Dc;
        decode_head<Dc, Gc>(q + first, Dc, k + h * Dc, v + h * Dc, row_stride, tables + b * width, lens[b],
                            block_size, s, o + first, Dc);
      }
    });
  };
  static_assert(batcher::kMaxGroup == 8, "paged_decode instantiates 1 to 8 query heads per KV head");
  auto for_group = [&](auto head_dim) {
    switch (group) {
      case 1: run(head_dim, std::integral_constant<int, 1>{}); break;
      case 2: run(head_dim, std::integral_constant<int, 2>{}); break;
      case 3: run(head_dim, std::integral_constant<int, 3>{}); break;
      case 4: run(head_dim, std::integral_constant<int, 4>{}); break;
      case 5: run(head_dim, std::integral_constant<int, 5>{}); break;
      case 6: run(head_dim, std::integral_constant<int, 6>{}); break;
      case 7: run(head_dim, std::integral_constant<int, 7>{}); break;
      case 8: run(head_dim, std::integral_constant<int, 8>{}); break;
      default: TORCH_CHECK(false, "paged_decode supports 1 to ", batcher::kMaxGroup, " query heads per KV head, not ", group);
    }
  };
  TORCH_CHECK(dim == 64 || dim == 128, "paged_decode supports head_dim 64 and 128, not ", dim);
  if (dim == 64) {
    for_group(std::integral_constant<int, 64>{});
  } else {
    for_group(std::integral_constant<int, 128>{});
  }
  return out;
}

// y[m, n] = x[m] . w[n] (+ bias[n]) for rows [n_begin, n_end), M rows of x, in one pass over those rows of w
// (two rows of w at a time: two independent chains of dot products in flight).
template <int M>
void linear_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t K, int64_t N,
                 int64_t n_begin, int64_t n_end) {
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  for (int64_t n = n_begin; n < n_end; n += 2) {
    const int rows = n + 1 < n_end ? 2 : 1;
    const uint16_t* w_rows[2] = {w + n * K, w + (n + rows - 1) * K};
    __m512 acc[2][M];
    for (int j = 0; j < 2; j++)
      for (int r = 0; r < M; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) {
      for (int j = 0; j < 2; j++) {
        _mm_prefetch(reinterpret_cast<const char*>(w_rows[j] + k) + PREFETCH_BYTES, _MM_HINT_T0);
        const __m512bh wv = load_bf16(w_rows[j] + k);
        for (int r = 0; r < M; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], load_bf16(x + r * K + k), wv);
      }
    }
    if (tail) {
      for (int j = 0; j < 2; j++) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w_rows[j] + full);
        for (int r = 0; r < M; r++)
          acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * K + full), wv);
      }
    }
    for (int j = 0; j < rows; j++) {
      const float b = bias ? static_cast<float>(c10::BFloat16(bias[n + j], c10::BFloat16::from_bits())) : 0.0f;
      for (int r = 0; r < M; r++) y[r * N + n + j] = to_bf16(_mm512_reduce_add_ps(acc[j][r]) + b);
    }
  }
}

// x [..., K] with at most kLinearMaxRows rows; weight [N, K]; bias [N] or None.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  TORCH_CHECK(rows >= 1 && rows <= batcher::kLinearMaxRows, "small_linear takes 1 to ", batcher::kLinearMaxRows, " rows");
  const auto bias_c = batcher::contiguous_bias(bias);
  const uint16_t* b = batcher::bias_data(bias_c);
  auto y = batcher::linear_output(x, N);
  const uint16_t* xp = bf16_data(x2);
  const uint16_t* wp = bf16_data(weight);
  uint16_t* yp = bf16_data(y);
  static_assert(batcher::kLinearMaxRows == 4, "small_linear instantiates 1 to 4 rows");
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: linear_rows<1>(xp, wp, b, yp, K, N, begin, end); break;
      case 2: linear_rows<2>(xp, wp, b, yp, K, N, begin, end); break;
      case 3: linear_rows<3>(xp, wp, b, yp, K, N, begin, end); break;
      case 4: linear_rows<4>(xp, wp, b, yp, K, N, begin, end); break;
    }
  });
  return y;
}

}  // namespace

// amx_linear.cpp, avx512_linear.cpp
torch::Tensor amx_pack(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor avx512_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);
// amx_prefill.cpp, avx512_prefill.cpp
torch::Tensor amx_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                          int64_t ctx_start, int64_t block_size, double scale);
torch::Tensor avx512_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, int64_t ctx_start, int64_t block_size, double scale);
// layer_ops.cpp
void bind_layer_ops(pybind11::module& m);
void bind_kv_write(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "bf16 decode attention over the paged KV cache");
  m.def("small_linear", &small_linear, "bf16 x @ W.T + b for a few rows of x");
  m.def("amx_permitted", &amx_permitted, "whether the OS lends this process AMX's tile state");
  m.def("amx_pack", &amx_pack, "a bf16 weight laid out in AMX tiles, for amx_linear");
  m.def("amx_linear", &amx_linear, "bf16 x @ W.T + b for up to 32 rows of x, on AMX");
  m.def("avx512_linear", &avx512_linear, "bf16 x @ W.T + b for up to 32 rows of x, on AVX-512 over amx_pack's layout");
  m.def("amx_prefill", &amx_prefill, "causal bf16 attention of a prompt chunk over its paged keys, on AMX");
  m.def("avx512_prefill", &avx512_prefill, "causal bf16 attention of a prompt chunk over its paged keys, on AVX-512");
  bind_layer_ops(m);
  bind_kv_write(m);
}
