// What the bf16 build's kernels share: their limits (set by kernels/native.py), tensor checks, the walk of a
// sequence's cache rows (row_cursor.h), and AVX-512 and AMX helpers.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

#include "amx.h"
#include "row_cursor.h"

namespace batcher {

// Defined by kernels/native.py's compile flags, so Python and C++ cannot disagree.
constexpr int kLinearMaxRows = LINEAR_MAX_ROWS;               // small_linear
constexpr int kMaxGroup = MAX_QUERY_HEADS_PER_KV_HEAD;        // paged_decode

inline void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, name, " must be a bf16 CPU tensor");
}

inline const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

inline uint16_t* bf16_data(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// What the bf16 linear kernels share: a bias, checked and contiguous (None: an undefined tensor), its values
// (nullptr for None), and the output [..., N] of x [..., K].
inline torch::Tensor contiguous_bias(const c10::optional<torch::Tensor>& bias) {
  if (!bias.has_value()) return {};
  auto b = bias->contiguous();
  check_bf16(b, "bias");
  return b;
}

inline const uint16_t* bias_data(const torch::Tensor& bias) { return bias.defined() ? bf16_data(bias) : nullptr; }

inline torch::Tensor linear_output(const torch::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return torch::empty(sizes, x.options());
}

// e^x for x <= 0 (Cephes' polynomial, to within 2 ulp); x below -88 gives ~0.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values (their bits) as fp32.
inline __m512 bf16_to_fp32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// in[i] holds 16 dwords of row i; out[j] gets dword j of rows 0..15 (a 16x16 transpose of 32-bit words).
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int k = 0; k < 4; k++) {  // u[4k + c], 128-bit lane L: rows 4k..4k+3 of dword 4L + c
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i even = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i even2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_i32x4(even, even2, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(even, even2, 0xDD);
    out[4 + c] = _mm512_shuffle_i32x4(odd, odd2, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(odd, odd2, 0xDD);
  }
}

// Every AMX kernel here uses 8 tiles of 64 bytes a row (16 fp32, or 32 bf16 as 16 pairs), of 16 rows; or, for a
// caller with fewer rows of x, tiles 0, 1 and 4 of `rows_a` rows and 2, 3 and 5 of `rows_b` (amx_linear's results
// and rows of x).
inline void configure_tiles(uint8_t rows_a = 16, uint8_t rows_b = 16) {
  struct {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  config.rows[0] = config.rows[1] = config.rows[4] = rows_a;
  config.rows[2] = config.rows[3] = config.rows[5] = rows_b;
  _tile_loadconfig(&config);
}

}  // namespace batcher
