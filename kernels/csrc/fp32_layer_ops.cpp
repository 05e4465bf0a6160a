// The small per-token ops of a Llama-shaped decoder layer in fp32, each in one pass where transformers' modules
// run several torch ops (workers/fused_decoder.py calls them):
// - rms_norm, and add_rms_norm (the residual add before it, in place);
// - rotary_, the rotary embedding of a step's queries and keys, in place.
// Each rounds wherever the modules' torch ops do (the build turns off FMA contraction), and RMSNorm adds its
// squares in torch's order, so the results are theirs bit for bit. The MLP's SiLU stays torch's: its exp is
// Sleef's, which this build cannot match bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "avx2.h"
#include "torch_sum.h"

namespace {

using batcher::check_fp32;
using batcher::tail_mask;

constexpr int64_t ROWS_PER_TASK = 8;  // rows (tokens) of a parallel task: a decode step's one row stays on its thread

void check_rows(const torch::Tensor& t, const char* name, int64_t width) {
  check_fp32(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == width, name, " must end in ", width, " features, not ", t.sizes());
}

// A width-long row in vectors of 8: f(i, load, store) for i = 0, 8, ..., where load(p) and store(p, v) move the
// vector at p, masked past the row's end for the last one alone. Against vmaskmovps at every step, add_rms_norm took
// 0.50-0.65x the time and rotary_ 0.29-0.41x in fp32 summarise's prompt chunks (calls alternated; AMD EPYC Zen 5,
// one thread).
template <typename F>
inline void each_vector(int64_t width, F f) {
  int64_t i = 0;
  for (; i + 8 <= width; i += 8)
    f(i, [](const float* p) { return _mm256_loadu_ps(p); }, [](float* p, __m256 v) { _mm256_storeu_ps(p, v); });
  if (i < width) {
    const __m256i mask = tail_mask(width - i);
    f(i, [mask](const float* p) { return _mm256_maskload_ps(p, mask); },
      [mask](float* p, __m256 v) { _mm256_maskstore_ps(p, mask, v); });
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), the formula of Llama's RMSNorm, for one row.
void norm_row(const float* x, const float* weight, float* out, int64_t H, float eps) {
  const float sum = batcher::torch_order_sum(
      H, [x](int64_t v) { const __m256 a = _mm256_loadu_ps(x + 8 * v); return _mm256_mul_ps(a, a); },
      [x](int64_t k) { return x[k] * x[k]; });
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(H) + eps));
  each_vector(H, [&](int64_t i, auto load, auto store) {
    store(out + i, _mm256_mul_ps(load(weight + i), _mm256_mul_ps(load(x + i), scale)));
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_fp32(weight, "weight");
  const int64_t H = weight.numel();
  check_rows(x, "x", H);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.numel() / H, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) norm_row(xp + r * H, wp, op + r * H, H, static_cast<float>(eps));
  });
  return out;
}

// residual += delta, then the RMSNorm of the new residual.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_fp32(weight, "weight");
  const int64_t H = weight.numel();
  check_rows(residual, "residual", H);
  check_rows(delta, "delta", H);
  TORCH_CHECK(delta.numel() == residual.numel(), "delta must have the residual's shape");
  auto out = torch::empty_like(residual);
  float* hp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, residual.numel() / H, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      float* h = hp + r * H;
      each_vector(H, [&](int64_t i, auto load, auto store) {
        store(h + i, _mm256_add_ps(load(h + i), load(dp + r * H + i)));
      });
      norm_row(h, wp, op + r * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

// x = x * cos + rotate_half(x) * sin over each head of one token, in place: each product rounded, then the sum.
void rotate_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; h++) {
    float* head = x + h * D;
    each_vector(half, [&](int64_t i, auto load, auto store) {
      const __m256 x1 = load(head + i), x2 = load(head + half + i);
      const __m256 minus_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
      const __m256 first = _mm256_add_ps(_mm256_mul_ps(x1, load(cos + i)), _mm256_mul_ps(minus_x2, load(sin + i)));
      const __m256 second =
          _mm256_add_ps(_mm256_mul_ps(x2, load(cos + half + i)), _mm256_mul_ps(x1, load(sin + half + i)));
      store(head + i, first);
      store(head + half + i, second);
    });
  }
}

// [T, heads, D] with each token's values contiguous; its tokens may lie apart (views of one linear's output).
void check_tokens(const torch::Tensor& t, const char* name, int64_t D) {
  check_fp32(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(-1) == D, name, " must be [tokens, heads, ", D, "], not ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 && t.stride(1) == D, name, "'s tokens must be contiguous");
}

// query [T, H, D] and key [T, Hkv, D] rotated in place by cos and sin [T, D] (the rotary module's output).
void rotary_(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  const int64_t D = query.size(-1), T = query.size(0);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  check_tokens(query, "query", D);
  check_tokens(key, "key", D);
  check_rows(cos, "cos", D);
  check_rows(sin, "sin", D);
  TORCH_CHECK(key.size(0) == T && cos.numel() == T * D && sin.numel() == T * D,
              "query, key, cos and sin must cover the same tokens");
  const int64_t H = query.size(1), Hkv = key.size(1), q_stride = query.stride(0), k_stride = key.stride(0);
  float* qp = query.data_ptr<float>();
  float* kp = key.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      rotate_heads(qp + t * q_stride, H, D, cp + t * D, sp + t * D);
      rotate_heads(kp + t * k_stride, Hkv, D, cp + t * D, sp + t * D);
    }
  });
}

}  // namespace

void bind_fp32_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "fp32 RMSNorm of each row, as Llama's");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then the RMSNorm of the residual");
  m.def("rotary_", &rotary_, "the rotary embedding of queries and keys, in place");
}
