// The order in which torch's CPU sum adds a contiguous row of fp32 values, for kernels whose results must be
// the bits of transformers' torch ops (RMSNorm's `x.pow(2).mean(-1)`). Only AVX2 instructions: both builds
// include it, and ATen runs its AVX2 sum kernel on AVX-512 CPUs too.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace batcher {

// The sum of f(x[0]) ... f(x[H-1]) in the order of SumKernel.cpp's cascade over vectors of 8 floats: four
// accumulators over the row's vectors in turn, gathered in levels of 16 such steps; then the scalar tail, then
// the lanes. `vector(v)` gives f of values 8v..8v+7, `scalar(k)` f of value k.
template <typename Vector, typename Scalar>
float torch_order_sum(int64_t H, Vector vector, Scalar scalar) {
  constexpr int LANES = 8, LEVELS = 4, ILP = 4;
  const int64_t vectors = H / LANES, steps = vectors / ILP;
  const int64_t ceil_log2 = steps <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(steps - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / LEVELS), level_step = int64_t{1} << level_power;
  __m256 acc[LEVELS][ILP];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + level_step <= steps) {
    for (int64_t j = 0; j < level_step; j++, i++)
      for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], vector(ILP * i + k));
    for (int j = 1; j < LEVELS; j++) {
      for (int k = 0; k < ILP; k++) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & ((level_step - 1) << (j * level_power))) != 0) break;
    }
  }
  for (; i < steps; i++)
    for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], vector(ILP * i + k));
  for (int j = 1; j < LEVELS; j++)
    for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = steps * ILP; v < vectors; v++) acc[0][0] = _mm256_add_ps(acc[0][0], vector(v));
  __m256 lanes_sum = acc[0][0];
  for (int k = 1; k < ILP; k++) lanes_sum = _mm256_add_ps(lanes_sum, acc[0][k]);
  float total = 0.0f;
  for (int64_t k = vectors * LANES; k < H; k++) total += scalar(k);
  alignas(32) float lane[LANES];
  _mm256_store_ps(lane, lanes_sum);
  for (float v : lane) total += v;
  return total;
}

}  // namespace batcher
