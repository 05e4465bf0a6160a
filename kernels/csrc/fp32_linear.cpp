// The fp32 CPU kernels (AVX2 and FMA), for CPUs where `dtype auto` picks fp32 (their bf16 matmuls are slow). This
// file binds the build's module: with fp32_layer_ops.cpp, fp32_decode.cpp and kv_write.cpp.
//
// fp32_linear: x @ W.T + b for a few rows of x, streaming W once. A decode step's linears have a few rows and
// must read every weight once; MKL's fp32 kernels read them well below the memory's pace at those sizes (on an
// AMD EPYC whose memory streams 18 GB/s: 11 GB/s at one row, 6 at four). Here W's rows are read 6 at a time,
// once from memory, and meet the rows of x 2 at a time while they stay in the cache. The first pass over those rows
// asks L2 for the next 6, a line a step: the weights then streamed 1.3-1.45x as fast at 1-4 rows (AMD EPYC Zen 4;
// into L1, or 1-4 KB ahead along each row, 0.9-1.2x).
//
// Each output is one dot product along K in 8 lanes, summed at the end: torch's sums in another order.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "avx2.h"

namespace {

using batcher::check_fp32;
using batcher::hsum;
using batcher::tail_mask;

constexpr int X_ROWS = 2;       // rows of x per pass over W_ROWS of W's rows: 12 accumulators, 6 weight vectors, 1 of x
constexpr int W_ROWS = 6;       // W's rows read side by side (the best of 1 to 8, with 1 to 16 rows of x)
constexpr int64_t GRAIN = 96;   // W's rows per task where torch runs several threads

// How a call reads W, measured per class. Where a core reads several streams faster than one
// (`lone_row_as_streams`), W's rows are read far apart: WN at a time, N / WN rows apart (as that many streams).
// - Side by side (6 rows of 2.3 KB: the same few pages) one row read SmolLM2's weights at ~0.65x an Intel Xeon's
//   memory pace; 6 rows far apart, with or without the software prefetch, in 0.82-0.86x the time (12 streams:
//   0.81x, 4: 0.89x), 2 rows 0.86x, 4 0.73x, 8 0.90x, 16 0.82x (prefetched; 0.87-0.93x without), 32 1.1x (Ice Lake:
//   family 6 model 106): FAR_APART_MAX_ROWS.
// - On an AMD EPYC Zen 1 (no AVX-512), 6 rows far apart took 1 and 2 rows of x 0.80-0.81x the time, but a pass of 2
//   rows over them read W from memory while a second pass found it in the cache, the two paces never overlapping
//   (4 rows: 0.94x, 16: 0.99x). From 3 rows, 4 rows of x a pass over 3 of W's rows far apart (12 sums) read W once:
//   3 rows 0.73x, 4 0.69x, 8 0.76x, 16 0.80x, 24 0.83x, 32 0.88x the time of 2 rows over 6 side by side (4 rows over
//   3 side by side: 0.78-0.80x at 4-16; at one row 3 far apart took 1.06x the time of 6).
enum class Order { side_by_side, far_apart, four_rows_far_apart };
constexpr int64_t FAR_APART_MAX_ROWS = 16;
constexpr int FOUR_ROWS_W_ROWS = 3;  // four_rows_far_apart's W rows a pass: 12 sums, 3 weight vectors, 1 of x
inline Order order(int64_t rows) {
  if (!batcher::lone_row_as_streams()) return Order::side_by_side;
  if (batcher::intel_cpu()) return rows <= FAR_APART_MAX_ROWS ? Order::far_apart : Order::side_by_side;
  return rows < 3 ? Order::far_apart : Order::four_rows_far_apart;
}

// y[r][n + j apart] for R rows of x (r < R) and W's rows n + j apart (j < WN): W's rows side by side (apart 1), or
// far apart (`far_apart`).
template <int R, int WN>
inline void dot_rows(const float* x, const float* w, int64_t K, float* y, int64_t N, const float* bias, int64_t n,
                     bool prefetch, int64_t apart = 1) {
  __m256 acc[R][WN];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) acc[r][j] = _mm256_setzero_ps();
  const float* w_row = w + n * K;
  const int64_t next = apart == 1 ? WN : 1;  // the next pass's first row, from n
  auto step = [&](int64_t k, auto load) {
    __m256 wv[WN];
    if (prefetch && k % 16 == 0) {  // the next pass's rows' line at k (past W's end: a no-op)
      for (int j = 0; j < WN; j++)
        _mm_prefetch(reinterpret_cast<const char*>(w_row + (next + j * apart) * K + k), _MM_HINT_T1);
    }
    for (int j = 0; j < WN; j++) wv[j] = load(w_row + j * apart * K + k);
    for (int r = 0; r < R; r++) {
      const __m256 xv = load(x + r * K + k);
      for (int j = 0; j < WN; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  };
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) step(k, [](const float* p) { return _mm256_loadu_ps(p); });
  if (k < K) {
    const __m256i mask = tail_mask(K - k);
    step(k, [mask](const float* p) { return _mm256_maskload_ps(p, mask); });
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) y[r * N + n + j * apart] = hsum(acc[r][j]) + (bias ? bias[n + j * apart] : 0.0f);
}

// Every row of x against W's rows n + j apart (j < WN), which stay in the cache between passes: XR rows of x a pass,
// then the rest (fewer than XR) in one pass of 3, 2 or 1.
template <int WN, int XR = X_ROWS>
void all_rows(const float* x, int64_t rows, const float* w, int64_t K, float* y, int64_t N, const float* bias,
              int64_t n, int64_t apart = 1) {
  int64_t r = 0;
  for (; r + XR <= rows; r += XR) dot_rows<XR, WN>(x + r * K, w, K, y + r * N, N, bias, n, r == 0, apart);
  const int64_t left = rows - r;
  if constexpr (XR > 3)
    if (left == 3) dot_rows<3, WN>(x + r * K, w, K, y + r * N, N, bias, n, r == 0, apart);
  if constexpr (XR > 2)
    if (left == 2) dot_rows<2, WN>(x + r * K, w, K, y + r * N, N, bias, n, r == 0, apart);
  if (left == 1) dot_rows<1, WN>(x + r * K, w, K, y + r * N, N, bias, n, r == 0, apart);
}

// Every row of x against W's rows WN at a time, N / WN rows apart; W's rows left past them one at a time.
template <int WN, int XR>
void far_apart(const float* x, int64_t rows, const float* w, int64_t K, float* y, int64_t N, const float* bias) {
  const int64_t apart = N / WN;
  at::parallel_for(0, apart, GRAIN / WN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) all_rows<WN, XR>(x, rows, w, K, y, N, bias, n, apart);
  });
  for (int64_t last = WN * apart; last < N; last++) all_rows<1, XR>(x, rows, w, K, y, N, bias, last);
}

torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous matrix");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  TORCH_CHECK(rows >= 1 && rows <= FP32_LINEAR_MAX_ROWS, "fp32_linear takes 1 to ", FP32_LINEAR_MAX_ROWS, " rows");
  torch::Tensor bias_c;
  const float* b = nullptr;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    check_fp32(bias_c, "bias");
    TORCH_CHECK(bias_c.numel() == N, "bias has ", bias_c.numel(), " values, the weight ", N, " rows");
    b = bias_c.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (order(rows)) {
    case Order::far_apart:
      far_apart<W_ROWS, X_ROWS>(xp, rows, wp, K, yp, N, b);
      return y;
    case Order::four_rows_far_apart:
      far_apart<FOUR_ROWS_W_ROWS, 4>(xp, rows, wp, K, yp, N, b);
      return y;
    case Order::side_by_side:
      break;
  }
  at::parallel_for(0, (N + W_ROWS - 1) / W_ROWS, GRAIN / W_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; group++) {
      const int64_t n = W_ROWS * group;
      if (n + W_ROWS <= N) {
        all_rows<W_ROWS>(xp, rows, wp, K, yp, N, b, n);
      } else {
        for (int64_t last = n; last < N; last++) all_rows<1>(xp, rows, wp, K, yp, N, b, last);
      }
    }
  });
  return y;
}

}  // namespace

void bind_fp32_layer_ops(pybind11::module& m);
void bind_fp32_decode(pybind11::module& m);
void bind_kv_write(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp32_linear", &fp32_linear, "fp32 x @ W.T + b for a few rows of x");
  bind_fp32_layer_ops(m);
  bind_fp32_decode(m);
  bind_kv_write(m);
}
