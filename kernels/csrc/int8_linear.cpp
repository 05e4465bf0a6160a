// The int8 CPU kernels (AVX2): a linear layer on 8-bit weights. This file binds the build's module.
//
// Why: a decode step reads every weight once per step, so its floor is the weights' bytes over the memory's pace.
// Weights of 1 byte (symmetric, per output channel) cut that floor ~4x against fp32. AVX2 and FMA only, so the
// build loads on every AVX2 CPU, AVX-512 ones included (the fp32 build is ruled out there; this one is not).
//
// The arithmetic (kernels/native.py's `int8_linear` and workers/model/int8_linear.py's torch reference share it):
// - qweight int8 [N, K], contiguous, symmetric per output channel: q[n, k] = W[n, k] / wscale[n] rounded, in
//   [-127, 127]; wscale fp32 [N] (workers/model/int8_linear.py chooses each row's clip); a zero row: scale 0, q 0.
// - x fp32 [..., K] (M rows; any M, any K >= 1), quantized per row in blocks of BLOCK = 32 along K (the last one
//   may be shorter): amax = max |x[r, block]|, sx = amax / 127, qx = round_half_even(x * (127.0f / amax)) in
//   [-127, 127] (amax 0: sx 0, q 0). _mm256_cvtps_epi32 rounds to nearest even under the default MXCSR mode, as
//   torch.round does.
// - y[r, n] = wscale[n] * sum_b(sx[r, b] * isum[r, n, b]) + bias[n] (fp32 [..., N]), isum the exact int32 dot of
//   block b's int8 values.
// Each block's dot: _mm256_sign_epi8 moves x's signs onto the weights, _mm256_maddubs_epi16 multiplies |qx| by
// them (exact: 2 * 127 * 127 fits in int16), _mm256_madd_epi16 with ones sums pairs into 8 int32 lanes (llama.cpp's
// Q8_0 dot). Its lanes, exact as floats, times sx, are summed into 8 fp32 lanes per output, block after block;
// the 8 lanes are summed at the end (batcher::hsum). So only the order of the float sums differs from the torch
// reference.
//
// Layout and order: x's rows are quantized once per call into a scratch (int8 rows padded to whole blocks with
// zeros, one scale per block). W is streamed once: W_ROWS of its rows side by side, each block read once and met
// by every row of x while it stays in the cache, X_ROWS rows of x at a time (ROW_CHUNK rows at most per pass over
// W, so a prefill's scratch stays in L2). Threads split the output channels (at::parallel_for).
//
// Batch invariance: each output is computed by the same instructions in the same order whatever the tile, the
// number of rows, the other rows and the threads (no FMA contraction: -ffp-contract=off), so a row's bits never
// depend on its batch (docs/batch-invariance.md).
//
// Speed: at one row it streams W near the memory's pace; from a few rows on, the multiplies bind it (maddubs and
// madd, ~2 cycles per row, output and block on an AMD EPYC Zen 4, whatever the tiles): about MKL's fp32 speed at
// 32 rows and more. Not written yet: an AVX-512 VNNI variant (vpdpbusd: the sign, maddubs and madd in one
// instruction, on 64 bytes) and an AMX-INT8 one (tile products of int8 for prefill's many rows).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2.h"

namespace {

using batcher::check_fp32;
using batcher::hsum;
using batcher::tail_mask;

constexpr int BLOCK = INT8_BLOCK;  // kernels/build.py's INT8_BLOCK: x's quantization block, one AVX2 vector of int8
static_assert(BLOCK == 32, "a block is one 256-bit vector of int8");
constexpr int X_ROWS = 2;           // rows of x per pass over W_ROWS of W's rows: 8 accumulators
constexpr int W_ROWS = 4;           // W's rows read side by side
constexpr int64_t ROW_CHUNK = 64;   // rows of x per pass over W (their scratch: 64 * K bytes)
constexpr int64_t PREFETCH = 8192;  // bytes of W ahead of a group's start that its first pass asks the cache for
constexpr int64_t GRAIN = 96;       // W's rows per task where torch runs several threads
constexpr int64_t QUANT_GRAIN = 16; // rows of x per quantizing task

// x's rows, quantized: `stride` (whole blocks) int8 values per row, zeros past K, and `blocks` scales per row.
struct Quantized {
  int64_t blocks, stride;
  std::vector<int8_t> q;
  std::vector<float> scale;
};

// One row's block of n <= 32 values into 32 int8 (zeros past n) and its scale.
inline float quantize_block(const float* x, int64_t n, int8_t* q) {
  __m256 v[4];
  for (int i = 0; i < 4; i++) {
    const int64_t left = n - 8 * i;
    v[i] = left >= 8 ? _mm256_loadu_ps(x + 8 * i)
           : left > 0 ? _mm256_maskload_ps(x + 8 * i, tail_mask(left)) : _mm256_setzero_ps();
  }
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 a[4], bad = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    a[i] = _mm256_andnot_ps(sign, v[i]);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a[i], inf, _CMP_NLT_UQ));  // NaN or infinite
  }
  const __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const bool nan = _mm256_movemask_ps(bad);  // then the scale is NaN: the row's outputs are NaN, as torch's are
  if (nan || amax == 0.0f) {  // a zero block: q 0, scale 0
    std::memset(q, 0, BLOCK);
    return nan ? NAN : 0.0f;
  }
  const __m256 inv = _mm256_set1_ps(127.0f / amax);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i i32[4];
  for (int i = 0; i < 4; i++)
    i32[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lo), hi);
  // packs work within 128-bit lanes: the 4-byte groups of i32[0..3] come out as a0 b0 c0 d0 a1 b1 c1 d1; reorder.
  const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
  return amax / 127.0f;
}

Quantized quantize_rows(const float* x, int64_t rows, int64_t K) {
  Quantized out;
  out.blocks = (K + BLOCK - 1) / BLOCK;
  out.stride = out.blocks * BLOCK;
  out.q.resize(rows * out.stride);
  out.scale.resize(rows * out.blocks);
  at::parallel_for(0, rows, QUANT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      for (int64_t b = 0; b < out.blocks; b++)
        out.scale[r * out.blocks + b] = quantize_block(x + r * K + b * BLOCK, std::min<int64_t>(BLOCK, K - b * BLOCK),
                                                       out.q.data() + r * out.stride + b * BLOCK);
  });
  return out;
}

// What one pass over W needs: the scratch, W and its scales, the bias, and the output.
struct Operands {
  const Quantized& x;
  const int8_t* w;
  int64_t K, N;
  const float* wscale;
  const float* bias;  // nullptr: none
  float* y;
};

// y[r][n + j] for R rows of x from `row` (r < R) and W's rows n + j (j < WN). With `prefetch` (a group's first
// pass), each block also asks for the WN * 32 bytes of W that lie PREFETCH ahead: W's rows are short streams
// (K bytes each) that the hardware prefetchers barely learn, so a weight that does not fit the caches streamed at
// a quarter of the memory's pace without it (7 GB/s against 30, one row, 576 x 98304 on an AMD EPYC Zen 4).
template <int R, int WN>
inline void dot_rows(const Operands& o, int64_t row, int64_t n, bool prefetch) {
  __m256 acc[R][WN];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) acc[r][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* qx = o.x.q.data() + row * o.x.stride;
  const float* sx = o.x.scale.data() + row * o.x.blocks;
  const int8_t* w_row = o.w + n * o.K;
  auto block = [&](int64_t b, const __m256i (&wv)[WN]) {
    for (int r = 0; r < R; r++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * o.x.stride + b * BLOCK));
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      const __m256 s = _mm256_set1_ps(sx[r * o.x.blocks + b]);
      for (int j = 0; j < WN; j++) {
        const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[r][j] = _mm256_fmadd_ps(dot, s, acc[r][j]);
      }
    }
  };
  const int64_t full = o.K / BLOCK;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w_row) + PREFETCH;  // (past W's end: a no-op)
  for (int64_t b = 0; b < full; b++) {
    if (prefetch)
      for (int line = 0; line < WN * BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * WN * BLOCK + line), _MM_HINT_T0);
    __m256i wv[WN];  // (declared here, so the compiler keeps them in registers)
    for (int j = 0; j < WN; j++)
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + j * o.K + b * BLOCK));
    block(b, wv);
  }
  if (full < o.x.blocks) {  // the last, shorter block: x's scratch holds zeros past K
    __m256i wv[WN];
    alignas(32) int8_t tail[WN][BLOCK] = {};
    for (int j = 0; j < WN; j++) {
      std::memcpy(tail[j], w_row + j * o.K + full * BLOCK, o.K - full * BLOCK);
      wv[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[j]));
    }
    block(full, wv);
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) {
      const float scaled = o.wscale[n + j] * hsum(acc[r][j]);
      o.y[(row + r) * o.N + n + j] = o.bias ? scaled + o.bias[n + j] : scaled;
    }
}

// Rows [begin, end) of x against W's rows n..n+WN-1, which stay in the cache between passes.
template <int WN>
void all_rows(const Operands& o, int64_t begin, int64_t end, int64_t n) {
  int64_t r = begin;
  for (; r + X_ROWS <= end; r += X_ROWS) dot_rows<X_ROWS, WN>(o, r, n, r == begin);
  static_assert(X_ROWS == 2, "one row is left at most");
  if (r < end) dot_rows<1, WN>(o, r, n, r == begin);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor wscale,
                          c10::optional<torch::Tensor> bias) {
  check_fp32(x, "x");
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == torch::kInt8,
              "qweight must be an int8 CPU tensor, not ", qweight.scalar_type());
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be a contiguous [N, K] matrix");
  const int64_t K = qweight.size(1), N = qweight.size(0);
  TORCH_CHECK(K >= 1, "qweight has no columns");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x has ", x.size(-1), " features, qweight ", K);
  check_fp32(wscale, "wscale");
  TORCH_CHECK(wscale.numel() == N && wscale.is_contiguous(), "wscale must be ", N, " contiguous values, not ",
              wscale.sizes());
  torch::Tensor bias_c;
  const float* b = nullptr;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    check_fp32(bias_c, "bias");
    TORCH_CHECK(bias_c.numel() == N, "bias has ", bias_c.numel(), " values, qweight ", N, " rows");
    b = bias_c.data_ptr<float>();
  }
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (rows == 0 || N == 0) return y;
  const Quantized quantized = quantize_rows(x2.data_ptr<float>(), rows, K);
  const Operands o{quantized, qweight.data_ptr<int8_t>(), K, N, wscale.data_ptr<float>(), b, y.data_ptr<float>()};
  at::parallel_for(0, (N + W_ROWS - 1) / W_ROWS, GRAIN / W_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      for (int64_t group = begin; group < end; group++) {
        const int64_t n = W_ROWS * group;
        if (n + W_ROWS <= N) {
          all_rows<W_ROWS>(o, first, last, n);
        } else {
          for (int64_t one = n; one < N; one++) all_rows<1>(o, first, last, one);
        }
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x @ W.T + b on int8 weights (per-channel scales) and x quantized per block of 32",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("wscale"), pybind11::arg("bias"));
  m.attr("block") = BLOCK;
}
