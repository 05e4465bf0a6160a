// bf16 x @ W.T + b on AVX-512 BF16 (kernels/native.py builds and loads this file): a decode step's few rows on
// CPUs without AMX, and, for batch invariance, every row count on them (a prefill's hundreds too).
//
// It reads the weight in amx_pack's layout (amx_linear.cpp): per block of 16 output columns and 32 of K, a
// row per pair of K holding that pair of all 16 columns. One load of such a row is a vector of 16 column
// pairs, which `vdpbf16ps` multiplies by a pair of x broadcast, into 16 sums: no reduction across a vector at
// the end, and each load of the weight serves every row of x in registers. Two blocks (32 columns) go
// together, up to 12 rows of x at a time (24 sums in registers); more rows walk the two blocks again, from
// the CPU's cache.
//
// Each output's sum runs over K in increasing pairs, from zero, in one fp32 lane, then adds the bias and rounds
// once: the same order whatever the number of rows, or the pass a row falls in. So a row's result does not
// depend on the rows beside it (batch invariance, docs/batch-invariance.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace {

constexpr int TILE_K = 32;  // bf16 values of K per block (amx_pack's layout)
constexpr int TILE_N = 16;  // output columns per block
constexpr int PAIRS = TILE_K / 2;
constexpr int MAX_ROWS_AT_ONCE = 12;
// Of each weight stream, ahead of its loads. Asked of L2 one line a load, the weights streamed at 27 GB/s at one row
// (AMD EPYC Zen 4); a burst of a block's lines into L1 at 4 KB, as amx_linear asks, at 19; none at 25.
constexpr int PREFETCH_BYTES = 3072;
constexpr int64_t X_BLOCK_BYTES = 512 * 1024;  // of x, walked by each pair of column blocks: half an EPYC core's L2

// Sums of `M` rows of x (from `x`, rows `k_padded` apart) against two blocks of columns, over all of K.
template <int M>
void two_blocks(const uint16_t* w0, const uint16_t* w1, int64_t blocks_k, const uint16_t* x, int64_t k_padded,
                bool prefetch, __m512 sums[][2]) {
  __m512 acc[M][2];
  for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks_k; kb++) {
    const uint16_t* t0 = w0 + kb * TILE_K * TILE_N;
    const uint16_t* t1 = w1 + kb * TILE_K * TILE_N;
    const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x + kb * TILE_K);
    for (int i = 0; i < PAIRS; i++) {
      if (prefetch) {  // each stream's line PREFETCH_BYTES ahead, into L2: one a load, not a burst a block
        _mm_prefetch(reinterpret_cast<const char*>(t0 + i * TILE_N * 2) + PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(t1 + i * TILE_N * 2) + PREFETCH_BYTES, _MM_HINT_T1);
      }
      const __m512bh a = (__m512bh)_mm512_loadu_si512(t0 + i * TILE_N * 2);
      const __m512bh b = (__m512bh)_mm512_loadu_si512(t1 + i * TILE_N * 2);
      for (int m = 0; m < M; m++) {
        const __m512bh xm = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m * k_padded / 2 + i]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, xm);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b, xm);
      }
    }
  }
  for (int m = 0; m < M; m++) sums[m][0] = acc[m][0], sums[m][1] = acc[m][1];
}

using TwoBlocks = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, bool, __m512[][2]);

static_assert(MAX_ROWS_AT_ONCE == 12, "kTwoBlocks lists 1 to 12 rows");
constexpr TwoBlocks kTwoBlocks[MAX_ROWS_AT_ONCE] = {&two_blocks<1>, &two_blocks<2>, &two_blocks<3>, &two_blocks<4>,
                                                    &two_blocks<5>, &two_blocks<6>, &two_blocks<7>, &two_blocks<8>,
                                                    &two_blocks<9>, &two_blocks<10>, &two_blocks<11>,
                                                    &two_blocks<12>};

}  // namespace

// x [..., K] bf16, any number of rows; packed from amx_pack of a weight [N, K]; bias [N] or None.
torch::Tensor avx512_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  batcher::check_bf16(x, "x");
  batcher::check_bf16(packed, "packed");
  const int64_t K = x.size(-1), blocks_k = packed.size(1), k_padded = blocks_k * TILE_K;
  TORCH_CHECK((K + TILE_K - 1) / TILE_K == blocks_k && packed.size(0) * TILE_N >= N,
              "the packed weight does not fit x");
  const auto x2 = x.reshape({-1, K});
  const int64_t rows = x2.size(0);
  auto y = batcher::linear_output(x, N);
  if (rows == 0) return y;
  // K zero-padded to whole blocks (x itself where K is whole blocks already)
  auto x_padded = K == k_padded ? x2.contiguous() : torch::zeros({rows, k_padded}, x.options());
  if (K != k_padded) x_padded.narrow(1, 0, K).copy_(x2);
  const auto bias_c = batcher::contiguous_bias(bias);
  const uint16_t* b = batcher::bias_data(bias_c);
  uint16_t* yp = batcher::bf16_data(y);
  const uint16_t* wp = batcher::bf16_data(packed);
  const uint16_t* xp = batcher::bf16_data(x_padded);
  const int64_t blocks_n = packed.size(0), block_elems = blocks_k * TILE_K * TILE_N;
  // Rows in blocks that stay in the CPU's L2 while every pair of column blocks walks them, each block in passes of
  // at most 12, as even as they go (32 rows: 11, 11, 10).
  const int64_t block_rows = std::max<int64_t>(MAX_ROWS_AT_ONCE, X_BLOCK_BYTES / (k_padded * 2));
  at::parallel_for(0, (blocks_n + 1) / 2, 4, [&](int64_t begin, int64_t end) {
    __m512 sums[MAX_ROWS_AT_ONCE][2];
    for (int64_t r_begin = 0; r_begin < rows; r_begin += block_rows) {
      const int64_t r_end = std::min(rows, r_begin + block_rows);
      const int64_t passes = (r_end - r_begin + MAX_ROWS_AT_ONCE - 1) / MAX_ROWS_AT_ONCE;
      const int64_t per_pass = (r_end - r_begin + passes - 1) / passes;
      for (int64_t pair = begin; pair < end; pair++) {
        const int64_t nb = 2 * pair;
        // A lone last block runs as its own pair: its twin's sums are computed on it again, and dropped.
        const uint16_t* w0 = wp + nb * block_elems;
        const uint16_t* w1 = nb + 1 < blocks_n ? w0 + block_elems : w0;
        __m512 bias_n[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        __mmask16 valid[2] = {0, 0};
        for (int half = 0; half < 2 && nb + half < blocks_n; half++) {
          const int64_t first = (nb + half) * TILE_N;
          const int columns = static_cast<int>(std::min<int64_t>(TILE_N, N - first));
          if (columns <= 0) break;
          valid[half] = static_cast<__mmask16>((1u << columns) - 1);
          if (b) bias_n[half] = batcher::bf16_to_fp32(_mm256_maskz_loadu_epi16(valid[half], b + first));
        }
        for (int64_t m0 = r_begin; m0 < r_end; m0 += per_pass) {
          const int count = static_cast<int>(std::min<int64_t>(per_pass, r_end - m0));
          // a block's first pass streams the weights from memory; later ones find them in the cache
          kTwoBlocks[count - 1](w0, w1, blocks_k, xp + m0 * k_padded, k_padded, m0 == r_begin, sums);
          for (int half = 0; half < 2; half++) {
            if (!valid[half]) continue;
            for (int m = 0; m < count; m++) {
              const __m256bh result = _mm512_cvtneps_pbh(_mm512_add_ps(sums[m][half], bias_n[half]));
              _mm256_mask_storeu_epi16(yp + (m0 + m) * N + (nb + half) * TILE_N, valid[half], (__m256i)result);
            }
          }
        }
      }
    }
  });
  return y;
}
