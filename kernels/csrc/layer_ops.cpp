// The small per-token ops of a Llama-shaped decoder layer in bf16, each in one pass where transformers' modules
// run 3 to 27 torch ops (workers/fused_decoder.py calls them):
// - rms_norm, and add_rms_norm (the residual add before it, in place);
// - rotary_, the rotary embedding of a step's queries and keys, in place;
// - silu_mul, the MLP's SiLU(gate) * up.
// Each rounds to bf16 wherever the modules' torch ops do, and RMSNorm adds its squares in torch's order, so the
// results are theirs bit for bit; only SiLU's exp is computed another way (within 2 ulp of fp32, which changes a
// bf16 result only where it lies on a rounding edge).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "torch_sum.h"

namespace {

using batcher::bf16_data;
using batcher::bf16_to_fp32;
using batcher::check_bf16;
using batcher::exp_ps;

constexpr int64_t ROWS_PER_TASK = 8;  // rows (tokens) of a parallel task: a decode step's one row stays on its thread

inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// A width-long row in vectors of 16: f<V>(i, mask) for V vectors from value i, first V = N whole ones at a time (mask
// 0xFFFF, a constant that makes their loads and stores plain ones), then the rest one at a time, the last masked past
// the row's end. A pass does each step of its work for all V before the next, so V dependent chains are in flight.
// Masked moves at every step, one vector at a time, took 2-4x the time in summarise's prompt chunks (below).
template <int N, typename F>
inline void in_passes(int64_t width, F f) {
  int64_t i = 0;
  for (; i + 16 * N <= width; i += 16 * N) f.template operator()<N>(i, 0xFFFF);
  for (; i < width; i += 16) f.template operator()<1>(i, lanes(width - i));
}

inline __m512 load(const uint16_t* p, __mmask16 mask) { return bf16_to_fp32(_mm256_maskz_loadu_epi16(mask, p)); }

inline void store(uint16_t* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// What a bf16 tensor op hands the next one: the fp32 result rounded to bf16 (to nearest even).
inline __m512 round_bf16(__m512 v) { return bf16_to_fp32((__m256i)_mm512_cvtneps_pbh(v)); }

void check_rows(const torch::Tensor& t, const char* name, int64_t width) {
  check_bf16(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == width, name, " must end in ", width, " features, not ", t.sizes());
}

// The sum of one row's squares in the order of torch's CPU sum, so that the norm's variance, and with it every
// bf16 result, is the one `x.pow(2).mean(-1)` gives.
float sum_of_squares(const uint16_t* x, int64_t H) {
  return batcher::torch_order_sum(
      H,
      [x](int64_t v) {
        const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * v))), 16));
        return _mm256_mul_ps(a, a);
      },
      [x](int64_t k) {
        const float v = static_cast<float>(c10::BFloat16(x[k], c10::BFloat16::from_bits()));
        return v * v;
      });
}

// Vectors a pass of the norms' rows (`in_passes`): against one masked vector at a time, add_rms_norm took 0.81-0.89x
// the time on 16-512 rows of SmolLM2's 576 features, and 0.40-0.60x in summarise's prompt chunks (calls alternated;
// AMD EPYC Zen 5, one thread).
constexpr int ROW_VECTORS = 4;

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)), the formula of Llama's RMSNorm, for one row.
void norm_row(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t H, float eps) {
  const float variance = sum_of_squares(x, H) / static_cast<float>(H);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(variance + eps));
  in_passes<ROW_VECTORS>(H, [&]<int V>(int64_t i, __mmask16 mask) {
    __m512 normed[V];
    for (int v = 0; v < V; v++) normed[v] = round_bf16(_mm512_mul_ps(load(x + i + 16 * v, mask), scale));
    for (int v = 0; v < V; v++)
      store(out + i + 16 * v, _mm512_mul_ps(load(weight + i + 16 * v, mask), normed[v]), mask);
  });
}

// h += delta over one row, rounded to bf16 as `residual + delta` is.
void add_row(uint16_t* h, const uint16_t* delta, int64_t H) {
  in_passes<ROW_VECTORS>(H, [&]<int V>(int64_t i, __mmask16 mask) {
    __m512 sum[V];
    for (int v = 0; v < V; v++) sum[v] = _mm512_add_ps(load(h + i + 16 * v, mask), load(delta + i + 16 * v, mask));
    for (int v = 0; v < V; v++) store(h + i + 16 * v, sum[v], mask);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16(weight, "weight");
  const int64_t H = weight.numel();
  check_rows(x, "x", H);
  auto out = torch::empty_like(x);
  const uint16_t* xp = bf16_data(x);
  const uint16_t* wp = bf16_data(weight);
  uint16_t* op = bf16_data(out);
  at::parallel_for(0, x.numel() / H, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) norm_row(xp + r * H, wp, op + r * H, H, static_cast<float>(eps));
  });
  return out;
}

// residual += delta (rounded to bf16, as `residual + delta` is), then the RMSNorm of the new residual.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_bf16(weight, "weight");
  const int64_t H = weight.numel();
  check_rows(residual, "residual", H);
  check_rows(delta, "delta", H);
  TORCH_CHECK(delta.numel() == residual.numel(), "delta must have the residual's shape");
  auto out = torch::empty_like(residual);
  uint16_t* hp = bf16_data(residual);
  const uint16_t* dp = bf16_data(delta);
  const uint16_t* wp = bf16_data(weight);
  uint16_t* op = bf16_data(out);
  at::parallel_for(0, residual.numel() / H, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      add_row(hp + r * H, dp + r * H, H);
      norm_row(hp + r * H, wp, op + r * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

// x = x * cos + rotate_half(x) * sin over each head of one token, in place, rounding as the torch ops do. Each half
// a vector at a time (`in_passes`): masked moves at every step took 2.4-4.6x the time in summarise's prompt chunks
// (calls alternated; AMD EPYC Zen 5, one thread).
void rotate_heads(uint16_t* x, int64_t heads, int64_t D, const uint16_t* cos, const uint16_t* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; h++) {
    uint16_t* head = x + h * D;
    in_passes<1>(half, [&]<int>(int64_t i, __mmask16 mask) {
      const __m512 x1 = load(head + i, mask), x2 = load(head + half + i, mask);
      const __m512 first = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, load(cos + i, mask))),
                                         round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                                  load(sin + i, mask))));
      const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load(cos + half + i, mask))),
                                          round_bf16(_mm512_mul_ps(x1, load(sin + half + i, mask))));
      store(head + i, first, mask);
      store(head + half + i, second, mask);
    });
  }
}

// Each token's values of a [T, ..., width] tensor must be contiguous; its tokens may lie apart (a step's queries
// and keys, or gate and up, as views of one linear's output).
void check_tokens(const torch::Tensor& t, const char* name, int64_t dims, int64_t width) {
  check_bf16(t, name);
  TORCH_CHECK(t.dim() == dims && t.size(-1) == width, name, " must have ", dims, " dims ending in ", width,
              ", not ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 && (dims == 2 || t.stride(1) == width), name, "'s tokens must be contiguous");
}

// query [T, H, D] and key [T, Hkv, D] rotated in place by cos and sin [T, D] (the rotary module's output).
void rotary_(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  const int64_t D = query.size(-1), T = query.size(0);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  check_tokens(query, "query", 3, D);
  check_tokens(key, "key", 3, D);
  check_rows(cos, "cos", D);
  check_rows(sin, "sin", D);
  TORCH_CHECK(key.size(0) == T && cos.numel() == T * D && sin.numel() == T * D,
              "query, key, cos and sin must cover the same tokens");
  const int64_t H = query.size(1), Hkv = key.size(1), q_stride = query.stride(0), k_stride = key.stride(0);
  uint16_t* qp = bf16_data(query);
  uint16_t* kp = bf16_data(key);
  const uint16_t* cp = bf16_data(cos);
  const uint16_t* sp = bf16_data(sin);
  at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      rotate_heads(qp + t * q_stride, H, D, cp + t * D, sp + t * D);
      rotate_heads(kp + t * k_stride, Hkv, D, cp + t * D, sp + t * D);
    }
  });
}

// x / (1 + e^-x), with e^-|x| alone computed so that exp_ps never overflows.
inline __m512 silu(__m512 x) {
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // e^-|x|
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  // x >= 0: x / (1 + e^-x); x < 0: x * e^x / (1 + e^x)
  const __m512 numerator = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(numerator, _mm512_add_ps(one, e));
}

// Vectors a pass of silu_mul's rows (`in_passes`): one vector's SiLU is a chain of ~25 dependent operations (exp's
// polynomial, then a division). Against one masked vector at a time, 8 a pass took 0.74x the time on 512 rows of
// SmolLM2's 1,536 outputs, and 0.32-0.48x in summarise's prompt chunks, where the loads wait on L3 (calls alternated;
// AMD EPYC Zen 5, one thread); 4 a pass 0.78x and 0.41-0.55x (8 took 0.86x 4's time there).
constexpr int SILU_VECTORS = 8;

// bf16(SiLU(gate)) * up, rounded as `act_fn(gate) * up` is; gate and up [T, I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  const int64_t I = gate.size(-1), T = gate.size(0);
  check_tokens(gate, "gate", 2, I);
  check_tokens(up, "up", 2, I);
  TORCH_CHECK(up.size(0) == T, "gate and up must have one shape");
  auto out = torch::empty({T, I}, gate.options());
  const uint16_t* gp = bf16_data(gate);
  const uint16_t* upp = bf16_data(up);
  uint16_t* op = bf16_data(out);
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0);
  at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const uint16_t* g = gp + r * g_stride;
      const uint16_t* u = upp + r * u_stride;
      uint16_t* o = op + r * I;
      in_passes<SILU_VECTORS>(I, [&]<int V>(int64_t i, __mmask16 mask) {
        __m512 activated[V];
        for (int v = 0; v < V; v++) activated[v] = load(g + i + 16 * v, mask);
        for (int v = 0; v < V; v++) activated[v] = round_bf16(silu(activated[v]));
        for (int v = 0; v < V; v++)
          store(o + i + 16 * v, _mm512_mul_ps(activated[v], load(u + i + 16 * v, mask)), mask);
      });
    }
  });
  return out;
}

}  // namespace

void bind_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm of each row, as Llama's");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then the RMSNorm of the residual");
  m.def("rotary_", &rotary_, "the rotary embedding of queries and keys, in place");
  m.def("silu_mul", &silu_mul, "bf16 SiLU(gate) * up");
}
