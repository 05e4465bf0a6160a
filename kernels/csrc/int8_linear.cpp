// The int8 CPU kernels (AVX2, and AVX-512 VNNI where present): a linear layer on 8-bit weights. This file binds the
// build's module.
//
// Why: a decode step reads every weight once per step, so its floor is the weights' bytes over the memory's pace.
// Weights of 1 byte (symmetric, per output channel) cut that floor ~4x against fp32. Compiled for AVX2 and FMA (the
// VNNI variant alone for more, and called only where the CPU has it), so the build loads on every AVX2 CPU, AVX-512
// ones included (the fp32 build is ruled out there; this one is not).
//
// The arithmetic (kernels/native.py's `int8_linear` and workers/model/int8_linear.py's torch reference share it):
// - qweight int8 [N, K], contiguous, symmetric per output channel: q[n, k] = W[n, k] / wscale[n] rounded, in
//   [-127, 127]; wscale fp32 [N] (workers/model/int8_linear.py chooses each row's clip); a zero row: scale 0, q 0.
// - x fp32 or bf16 [..., K] (M rows; any M, any K >= 1; bf16 widened to fp32 exactly), quantized per row in
//   blocks of BLOCK = 32 along K (the last one may be shorter): amax = max |x[r, block]|, sx = amax / 127,
//   qx = round_half_even(x * (127.0f / amax)) in [-127, 127] (amax 0: sx 0, q 0). _mm256_cvtps_epi32 rounds to
//   nearest even under the default MXCSR mode, as torch.round does.
// - y[r, n] = wscale[n] * sum_b(sx[r, b] * isum[r, n, b]) + bias[n] in fp32 [..., N], isum the exact int32 dot of
//   block b's int8 values; in x's dtype (bf16 rounded to nearest even, as torch's `.to` rounds): a bf16 model's
//   linears then cast nothing around the call (two casts a linear were ~6% of a lone bf16 step).
// Each block's dot: _mm256_sign_epi8 moves x's signs onto the weights, and |qx| times them gives 8 int32 lanes, lane i
// the exact sum of bytes 4i..4i+3's products: on AVX2 _mm256_maddubs_epi16 (exact: 2 * 127 * 127 fits in int16) then
// _mm256_madd_epi16 with ones (llama.cpp's Q8_0 dot); where the CPU has AVX-512 VNNI, one vpdpbusd on the same 256
// bits, chosen at run time (the `vnni` namespace, compiled for it by pragma; `isa` names the one that runs). The
// lanes, exact as floats, times sx, are summed into 8 fp32 lanes per output, block after block; the 8 lanes are
// summed at the end (batcher::hsum). So the variants give the same bits, and only the order of the float sums
// differs from the torch reference.
//
// Layout and order: x's rows are quantized once per call into a scratch (int8 rows padded to whole blocks with
// zeros, one scale per block). W is streamed once: W_ROWS of its rows side by side, each block read once and met
// by every row of x while it stays in the cache, X_ROWS rows of x at a time (2 on AVX2's 16 registers, 4 on
// AVX-512's 32; ROW_CHUNK rows at most per pass over W, so a prefill's scratch stays in L2). Threads split the
// output channels (at::parallel_for). The pass over W is kernels/csrc/int8_tiles.h, included once per variant.
//
// Batch invariance: each output is computed by the same instructions in the same order whatever the tile, the
// number of rows, the other rows and the threads (no FMA contraction: -ffp-contract=off), so a row's bits never
// depend on its batch (docs/batch-invariance.md).
//
// Speed (one thread, AMD EPYC Zen 4, SmolLM2's 1536 x 576 weight from the cache): at one row it streams W near the
// memory's pace; from a few rows on, the integer dots and the per-block float sums bind it. AVX2: about MKL's fp32
// speed at 32 rows and more. VNNI: 1.2-1.6x the AVX2 variant from 8 rows on, still ~1.6x torch's bf16 (oneDNN's
// AVX512-BF16) time at 32-512 rows. Not written yet: an AMX-INT8 variant (tile products for prefill's many rows).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "avx2.h"

namespace {

using batcher::check_fp32;
using batcher::hsum;
using batcher::tail_mask;

constexpr int BLOCK = INT8_BLOCK;  // kernels/build.py's INT8_BLOCK: x's quantization block, one AVX2 vector of int8
static_assert(BLOCK == 32, "a block is one 256-bit vector of int8");
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

// Up to 8 of x's values as fp32 (zeros past `left`); bf16 widens exactly.
inline __m256 load8(const float* x, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(x) : left > 0 ? _mm256_maskload_ps(x, tail_mask(left)) : _mm256_setzero_ps();
}

inline __m256 load8(const c10::BFloat16* x, int64_t left) {
  alignas(16) uint16_t part[8] = {};
  const void* from = x;
  if (left < 8) {
    std::memcpy(part, x, 2 * std::max<int64_t>(left, 0));
    from = part;
  }
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(from)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// One row's block of n <= 32 values into 32 int8 (zeros past n) and its scale.
template <typename T>
inline float quantize_block(const T* x, int64_t n, int8_t* q) {
  __m256 v[4];
  for (int i = 0; i < 4; i++) v[i] = load8(x + 8 * i, n - 8 * i);
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

template <typename T>
Quantized quantize_rows(const T* x, int64_t rows, int64_t K) {
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
  float* y;                // fp32 output, or
  c10::BFloat16* y_bf16;   // bf16 output (x's dtype), rounded to nearest even as torch rounds
};

namespace avx2 {
constexpr int X_ROWS = 2;  // rows of x per pass over W_ROWS of W's rows: 8 accumulators of AVX2's 16 registers
// maddubs pairs |qx| with the signed weights into int16 (exact: 2 * 127 * 127 fits), madd sums pairs of them.
inline __m256i dot4(__m256i ax, __m256i sw) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
}
#include "int8_tiles.h"
}  // namespace avx2

// AVX-512 VNNI (with VL, on 256-bit vectors): vpdpbusd sums the four products of each lane in one instruction.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
#endif
namespace vnni {
constexpr int X_ROWS = 4;  // 16 accumulators: AVX-512 has 32 registers
inline __m256i dot4(__m256i ax, __m256i sw) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw); }
#include "int8_tiles.h"
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

bool vnni_present() {
  static const bool present = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return present;
}

const char* const ISA_AVX2 = "avx2";
const char* const ISA_VNNI = "avx512-vnni";

// `isa`: the variant to run, this CPU's best where empty (the others are for tests and benchmarks).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor wscale,
                          c10::optional<torch::Tensor> bias, const std::string& isa) {
  const bool vnni = isa.empty() ? vnni_present() : isa == ISA_VNNI;
  TORCH_CHECK(isa.empty() || isa == ISA_AVX2 || isa == ISA_VNNI, "no int8 variant '", isa, "'");
  TORCH_CHECK(!vnni || vnni_present(), "this CPU has no AVX-512 VNNI");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == torch::kFloat32),
              "x must be an fp32 or bf16 CPU tensor, not ", x.scalar_type());
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
  const Quantized quantized = bf16 ? quantize_rows(x2.data_ptr<c10::BFloat16>(), rows, K)
                                   : quantize_rows(x2.data_ptr<float>(), rows, K);
  const Operands o{quantized, qweight.data_ptr<int8_t>(), K, N, wscale.data_ptr<float>(), b,
                   bf16 ? nullptr : y.data_ptr<float>(), bf16 ? y.data_ptr<c10::BFloat16>() : nullptr};
  if (vnni)
    vnni::pass_over_w(o, rows);
  else
    avx2::pass_over_w(o, rows);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x @ W.T + b on int8 weights (per-channel scales) and x quantized per block of 32",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("wscale"), pybind11::arg("bias"),
        pybind11::arg("isa") = "");
  m.attr("block") = BLOCK;
  m.attr("isa") = vnni_present() ? ISA_VNNI : ISA_AVX2;  // what runs by default
}
