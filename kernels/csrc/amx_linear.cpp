// bf16 x @ W.T + b on Intel AMX (kernels/native.py builds and loads this file): a decode step's few rows, and, for
// batch invariance, every row count.
//
// A decode step's linears multiply a few rows by every weight once: the work is reading the weights.
// oneDNN's AMX kernels read them at about 9 GB/s here at 1 to 32 rows; this kernel streams a copy of
// each weight laid out in AMX's tile order (`amx_pack`, once at load) from start to end, and runs one
// tile product per 1 KB of weights, which costs far less than reading them.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace {

constexpr int TILE_ROWS = 16;      // rows of x (and of the result) per tile
constexpr int TILE_K = 32;         // bf16 values of K per tile row
constexpr int TILE_N = 16;         // output columns per tile
constexpr int MAX_ROWS = 2 * TILE_ROWS;  // rows of x per pass over a pair of column blocks
constexpr int PREFETCH_BYTES = 4096;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace

// weight [N, K] bf16 -> [N/16, K/32, 16, 32] bf16 (both padded with zeros): for each block of 16 output
// columns and 32 of K, the tile AMX reads, K-pairs by rows (row i holds (W[n][2i], W[n][2i+1]) for 16 n).
torch::Tensor amx_pack(torch::Tensor weight) {
  batcher::check_bf16(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "amx_pack takes a 2-D weight");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t blocks_n = round_up(N, TILE_N) / TILE_N, blocks_k = round_up(K, TILE_K) / TILE_K;
  auto packed = torch::zeros({blocks_n, blocks_k, TILE_K / 2, TILE_N * 2}, w.options());
  const uint16_t* src = batcher::bf16_data(w);
  uint16_t* dst = batcher::bf16_data(packed);
  at::parallel_for(0, blocks_n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb++)
      for (int64_t kb = 0; kb < blocks_k; kb++) {
        uint16_t* tile = dst + (nb * blocks_k + kb) * TILE_K * TILE_N;
        for (int n = 0; n < TILE_N && nb * TILE_N + n < N; n++)
          for (int k = 0; k < TILE_K && kb * TILE_K + k < K; k++)
            tile[(k / 2) * TILE_N * 2 + n * 2 + k % 2] = src[(nb * TILE_N + n) * K + kb * TILE_K + k];
      }
  });
  return packed;
}

// x [..., K] bf16, any number of rows; packed from amx_pack of a weight [N, K]; bias [N] or None. Rows go 32 at a
// time (two tiles) through each pair of column blocks, which stays in the CPU's cache for the later ones; a last
// group of fewer rows runs on tiles of that many rows. x is read where it lies when K is whole tiles of K (32
// values), else from a copy padded with zeros to them: a lone decode row's call then neither allocates nor copies
// (3.8 us a call on a 16x32 weight against 0.9 for avx512_linear, on an Intel Xeon with AMX, before). A row's
// results come from the same tile products at every row count (a product's rows are computed apart), so they do
// not depend on the rows beside it (batch invariance, docs/batch-invariance.md).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(batcher::amx_permitted(), "the OS refused this process AMX's tile state");
  batcher::check_bf16(x, "x");
  batcher::check_bf16(packed, "packed");
  const int64_t K = x.size(-1), blocks_k = packed.size(1), k_padded = blocks_k * TILE_K;
  TORCH_CHECK(round_up(K, TILE_K) == k_padded && packed.size(0) * TILE_N >= N, "the packed weight does not fit x");
  const auto x2 = x.reshape({-1, K});
  const int64_t rows = x2.size(0);
  auto y = batcher::linear_output(x, N);
  if (rows == 0) return y;
  torch::Tensor x_tiles = x2.contiguous();
  if (K != k_padded) {
    x_tiles = torch::zeros({rows, k_padded}, x.options());
    x_tiles.narrow(1, 0, K).copy_(x2);
  }
  const auto bias_c = batcher::contiguous_bias(bias);
  const uint16_t* b = batcher::bias_data(bias_c);
  uint16_t* yp = batcher::bf16_data(y);
  const uint16_t* wp = batcher::bf16_data(packed);
  const uint16_t* xt = batcher::bf16_data(x_tiles);
  const int64_t blocks_n = packed.size(0), pairs = (blocks_n + 1) / 2;
  const int64_t tile_elems = TILE_K * TILE_N, block_elems = blocks_k * tile_elems;
  at::parallel_for(0, pairs, 4, [&](int64_t begin, int64_t end) {
    // Tiles 0-3: results (rows 0-15 and 16-31 of the 32 at hand, of two blocks of 16 columns); 4, 5: x (those
    // rows 0-15, 16-31); 6, 7: the two blocks' weight tiles. Two blocks at a time keep four independent tile
    // products (and two streams of weights) in flight.
    int64_t configured = 0;  // rows of the group the tiles are configured for
    alignas(64) float out[2][MAX_ROWS][TILE_N];
    for (int64_t pair = begin; pair < end; pair++) {
      const int64_t nb = 2 * pair;
      // A lone last block runs as its own pair: its twin's products are computed on it again, and dropped.
      const uint16_t* w0 = wp + nb * block_elems;
      const uint16_t* w1 = nb + 1 < blocks_n ? w0 + block_elems : w0;
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t count = std::min<int64_t>(MAX_ROWS, rows - r0);
        const bool two_tiles = count > TILE_ROWS;
        if (count != configured) {
          batcher::configure_tiles(static_cast<uint8_t>(std::min<int64_t>(count, TILE_ROWS)),
                                   static_cast<uint8_t>(two_tiles ? count - TILE_ROWS : TILE_ROWS));
          configured = count;
        }
        const uint16_t* xr = xt + r0 * k_padded;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks_k; kb++) {
          const uint16_t* t0 = w0 + kb * tile_elems;
          const uint16_t* t1 = w1 + kb * tile_elems;
          if (r0 == 0) {  // the first rows stream the weights from memory; later ones find them in the cache
            for (int line = 0; line < tile_elems * 2; line += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(t0) + PREFETCH_BYTES + line, _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(t1) + PREFETCH_BYTES + line, _MM_HINT_T0);
            }
          }
          _tile_loadd(6, t0, TILE_N * 4);
          _tile_loadd(7, t1, TILE_N * 4);
          _tile_loadd(4, xr + kb * TILE_K, k_padded * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two_tiles) {
            _tile_loadd(5, xr + TILE_ROWS * k_padded + kb * TILE_K, k_padded * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, out[0][0], TILE_N * 4);
        _tile_stored(1, out[1][0], TILE_N * 4);
        if (two_tiles) {
          _tile_stored(2, out[0][TILE_ROWS], TILE_N * 4);
          _tile_stored(3, out[1][TILE_ROWS], TILE_N * 4);
        }
        for (int half = 0; half < 2 && nb + half < blocks_n; half++) {
          const int64_t first = (nb + half) * TILE_N;
          const int columns = static_cast<int>(std::min<int64_t>(TILE_N, N - first));
          if (columns <= 0) break;
          const __mmask16 valid = static_cast<__mmask16>((1u << columns) - 1);
          __m512 bias_n = _mm512_setzero_ps();
          if (b) {
            const __m256i raw = _mm256_maskz_loadu_epi16(valid, b + first);
            bias_n = batcher::bf16_to_fp32(raw);
          }
          for (int64_t m = 0; m < count; m++) {
            const __m256bh result = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(out[half][m]), bias_n));
            _mm256_mask_storeu_epi16(yp + (r0 + m) * N + first, valid, (__m256i)result);
          }
        }
      }
    }
    _tile_release();  // oneDNN configures its own tiles again before it uses them
  });
  return y;
}
