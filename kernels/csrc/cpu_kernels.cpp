// bf16 decode kernels for CPUs with AVX-512 BF16 (kernels/native.py builds and loads this file with
// amx_linear.cpp, avx512_linear.cpp, amx_prefill.cpp, amx_decode.cpp, avx512_prefill.cpp, layer_ops.cpp and
// kv_write.cpp, whose functions it binds too).
//
// - paged_decode: one query token per sequence attends to its keys straight from the paged cache
//   (through its block table: no gather, no padding, no mask), the query heads of a KV head reading
//   each key and value once, in avx512_prefill's arithmetic (the same bits for a query in either);
//   one call per layer for every decode of a step. On AMX, amx_decode takes decodes instead, beside amx_prefill.
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
#include "decode_call.h"
#include "prefill.h"

namespace {

using batcher::bf16_data;
using batcher::check_bf16;
using batcher::RowCursor;
using batcher::transpose16;
using batcher::prefill::KEYS;

constexpr int PREFETCH_BYTES = 8192;

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline uint16_t to_bf16(float x) { return c10::BFloat16(x).x; }  // round to nearest even

// One sequence's query heads of one KV head: queries q[G][D], keys and values of `length` positions,
// position i at cache row table[i / block_size] * block_size + i % block_size.
//
// It runs the prefill kernels' arithmetic (prefill.h), so that a query's result is the same bits whether it
// comes as a decode or in a prompt chunk (batch invariance, docs/batch-invariance.md): keys in steps of 32 from
// position 0, each score a sum over dimension pairs in order, the step's weights by `weight_exp`, rounded to
// bf16 and multiplied by the values in key pairs (`vdpbf16ps`), the running sum and maximum as there. Only the
// layout differs: here a vector holds 16 keys of one query head (their rows transposed into pairs of dimensions,
// so one instruction scores 16 keys against a query pair), and an output row's 16 dimensions.
template <int D, int group>
void decode_head(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                 int64_t row_stride, const int64_t* table, int64_t length, int64_t block_size,
                 float scale, uint16_t* out, int64_t out_head_stride) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int PAIRS = D / 2;  // dwords of a query or key row: pairs of bf16 dimensions
  constexpr int VC = D / 16;    // fp32 vectors of an output row
  const int32_t* q_pairs[group];
  __m512 acc[group][VC];
  batcher::prefill::KeyLanesSoftmax softmax[group];
  for (int g = 0; g < group; g++) {
    q_pairs[g] = reinterpret_cast<const int32_t*>(q + g * q_head_stride);
    for (int c = 0; c < VC; c++) acc[g][c] = _mm512_setzero_ps();
  }
  alignas(64) uint32_t weight_pairs[group][KEYS / 2];  // a step's weights in bf16, key pairs (2j low, 2j + 1 high)
  // The rows of this step and of the next. The next step's lines are asked for ahead (into L2: summarise 1.05-1.12x
  // the tokens/s of asking L1, AMD EPYC Zen 4), since a sequence's rows of one KV head are strided and its blocks
  // scattered, which the hardware prefetchers do not follow. They are asked for while this step computes, a key's
  // lines as this step's keys are scored and its values' as they are summed: asked all at once as a step began,
  // they held it up (a step of 24 sequences of 1,000 positions, SmolLM2's heads, Intel Xeon with AMX: 1.43x the pace).
  int64_t rows_now[KEYS], rows_next[KEYS];
  int n_next = 0;  // positions in the next step
  RowCursor cursor{table, block_size};
  auto next_step = [&](int64_t t0) {
    n_next = static_cast<int>(std::clamp<int64_t>(length - t0, 0, KEYS));
    for (int t = 0; t < n_next; t++) rows_next[t] = cursor.next();
    if (n_next > 0)
      for (int t = n_next; t < KEYS; t++) rows_next[t] = rows_next[0];  // past the end: scored, then masked
  };
  auto fetch = [&](const uint16_t* cache, int64_t row) {
    for (int line = 0; line < D * 2; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + row * row_stride) + line, _MM_HINT_T1);
  };
  next_step(0);
  for (int t = 0; t < n_next; t++) {
    fetch(k_cache, rows_next[t]);
    fetch(v_cache, rows_next[t]);
  }
  // Two keys' value rows interleaved word by word, each dimension a pair (even key's value, odd key's) as prefill.h's
  // pack_head lays them out, but left in the order the unpacks give: of 32 dimensions, vector 2h holds 0-3, 8-11,
  // 16-19 and 24-27, vector 2h + 1 the rest. A lane's arithmetic is its dimension's either way, so the bits are the
  // same; the outputs are put in order once, at the end (in cache 1.05x the pace of permuting every key pair's
  // values, AMD EPYC Zen 4).
  const __m512i first16 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i last16 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t0 = 0; t0 < length; t0 += KEYS) {
    const int n = static_cast<int>(std::min<int64_t>(KEYS, length - t0));
    std::copy(rows_next, rows_next + KEYS, rows_now);
    next_step(t0 + KEYS);
    // The step's keys transposed (pair p of keys 16h..16h+15 at keys_t[h][p]), then scored: each lane sums its
    // pairs in order, the two halves' sums in flight together (in-cache 1.06x the pace of one half after the other).
    const int key_halves = n > 16 ? 2 : 1;
    __m512i keys_t[2][PAIRS];
    for (int h = 0; h < key_halves; h++)
      for (int half = 0; half < PAIRS / 16; half++) {
        __m512i rows[16];
        for (int t = 0; t < 16; t++)
          rows[t] = _mm512_loadu_si512(k_cache + rows_now[16 * h + t] * row_stride + 32 * half);
        transpose16(rows, keys_t[h] + 16 * half);
      }
    __m512 s[group][2];  // scores of keys 0-15 and 16-31 of the step
    for (int g = 0; g < group; g++) s[g][0] = s[g][1] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
      for (int t = p * KEYS / PAIRS; t < std::min(n_next, (p + 1) * KEYS / PAIRS); t++)  // the next keys, spread
        fetch(k_cache, rows_next[t]);
      for (int g = 0; g < group; g++) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(q_pairs[g][p]);
        s[g][0] = _mm512_dpbf16_ps(s[g][0], qp, (__m512bh)keys_t[0][p]);
        if (key_halves == 2) s[g][1] = _mm512_dpbf16_ps(s[g][1], qp, (__m512bh)keys_t[1][p]);
      }
    }
    for (int g = 0; g < group; g++) {
      const __m512 alpha = softmax[g].step(s[g], n, scale, weight_pairs[g]);
      for (int c = 0; c < VC; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
    }
    int fetched = 0;
    for (int kp = 0; kp < (n + 1) / 2; kp++) {  // pairs past the end weigh 0: the prefill kernels' products add 0
      for (; fetched < std::min(n_next, 2 * kp + 2); fetched++) fetch(v_cache, rows_next[fetched]);  // the next values
      const uint16_t* even = v_cache + rows_now[2 * kp] * row_stride;
      const uint16_t* odd = 2 * kp + 1 < n ? v_cache + rows_now[2 * kp + 1] * row_stride : nullptr;
      __m512i v[VC];
      for (int half = 0; half < D / 32; half++) {
        const __m512i a = _mm512_loadu_si512(even + 32 * half);
        const __m512i b = odd ? _mm512_loadu_si512(odd + 32 * half) : zero;
        v[2 * half] = _mm512_unpacklo_epi16(a, b);
        v[2 * half + 1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < group; g++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[g][kp]));
        for (int c = 0; c < VC; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, (__m512bh)v[c]);
      }
    }
    for (; fetched < n_next; fetched++) fetch(v_cache, rows_next[fetched]);
  }
  for (int g = 0; g < group; g++) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), softmax[g].l);
    for (int half = 0; half < D / 32; half++) {
      const __m512i lo = _mm512_castps_si512(acc[g][2 * half]), hi = _mm512_castps_si512(acc[g][2 * half + 1]);
      const __m512 ordered[2] = {_mm512_castsi512_ps(_mm512_permutex2var_epi64(lo, first16, hi)),
                                 _mm512_castsi512_ps(_mm512_permutex2var_epi64(lo, last16, hi))};
      for (int c = 0; c < 2; c++) {
        const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(ordered[c], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * out_head_stride + 32 * half + 16 * c),
                            (__m256i)packed);
      }
    }
  }
}

// query [B, H, D]; k_cache, v_cache [rows, Hkv, D]; block_tables [B, W] (int64); context_lens [B] (int64).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  check_bf16(query, "query");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  const batcher::DecodeCall c = batcher::decode_call("paged_decode", query, k_cache, v_cache, block_tables,
                                                      context_lens, block_size, batcher::kMaxGroup);
  auto out = torch::empty_like(c.query);
  const uint16_t* q = bf16_data(c.query);
  const uint16_t* k = bf16_data(k_cache);
  const uint16_t* v = bf16_data(v_cache);
  uint16_t* o = bf16_data(out);
  const int64_t row_stride = c.kv_heads * c.dim;
  const float s = static_cast<float>(scale);
  auto run = [&](auto head_dim, auto group_size) {
    constexpr int Dc = decltype(head_dim)::value, Gc = decltype(group_size)::value;
    batcher::parallel_for_keys(c, c.kv_heads, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {
        const int64_t b = i / c.kv_heads, h = i % c.kv_heads;
        const int64_t first = (b * c.heads + h * Gc) * Dc;
        decode_head<Dc, Gc>(q + first, Dc, k + h * Dc, v + h * Dc, row_stride, c.table(b), c.length(b), block_size, s,
                            o + first, Dc);
      }
    });
  };
  static_assert(batcher::kMaxGroup == 8, "paged_decode instantiates 1 to 8 query heads per KV head");
  auto for_group = [&](auto head_dim) {
    switch (c.group) {
      case 1: run(head_dim, std::integral_constant<int, 1>{}); break;
      case 2: run(head_dim, std::integral_constant<int, 2>{}); break;
      case 3: run(head_dim, std::integral_constant<int, 3>{}); break;
      case 4: run(head_dim, std::integral_constant<int, 4>{}); break;
      case 5: run(head_dim, std::integral_constant<int, 5>{}); break;
      case 6: run(head_dim, std::integral_constant<int, 6>{}); break;
      case 7: run(head_dim, std::integral_constant<int, 7>{}); break;
      case 8: run(head_dim, std::integral_constant<int, 8>{}); break;
    }
  };
  if (c.dim == 64) {
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
// amx_decode.cpp
torch::Tensor amx_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                         torch::Tensor context_lens, int64_t block_size, double scale);
// layer_ops.cpp
void bind_layer_ops(pybind11::module& m);
void bind_kv_write(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "bf16 decode attention over the paged KV cache");
  m.def("small_linear", &small_linear, "bf16 x @ W.T + b for a few rows of x");
  m.def("amx_permitted", &batcher::amx_permitted, "whether the OS lends this process AMX's tile state");
  m.def("amx_pack", &amx_pack, "a bf16 weight laid out in AMX tiles, for amx_linear");
  m.def("amx_linear", &amx_linear, "bf16 x @ W.T + b for up to 32 rows of x, on AMX");
  m.def("avx512_linear", &avx512_linear, "bf16 x @ W.T + b for up to 32 rows of x, on AVX-512 over amx_pack's layout");
  m.def("amx_prefill", &amx_prefill, "causal bf16 attention of a prompt chunk over its paged keys, on AMX");
  m.def("amx_decode", &amx_decode, "bf16 decode attention over the paged KV cache on AMX, in amx_prefill's arithmetic");
  m.def("avx512_prefill", &avx512_prefill, "causal bf16 attention of a prompt chunk over its paged keys, on AVX-512");
  bind_layer_ops(m);
  bind_kv_write(m);
}
