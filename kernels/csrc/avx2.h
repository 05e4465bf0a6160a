// What the fp32 build's AVX2 kernels share (and the int8 build's: it includes this header too).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

namespace batcher {

// Lanes 0..n-1 set (all 8 for n >= 8), for the last columns of a row.
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// e^x for x <= 0 (Cephes' polynomial, to within 2 ulp); x below -88 gives ~0.
inline __m256 exp256_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));  // p * 2^n
}

// Whether this CPU is Intel's: the far-apart reads' shape differs by vendor (fp32_linear.cpp's `order`).
inline bool intel_cpu() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Whether this CPU's cores read a lone row's weights faster as several streams in different pages than as one:
// Intel's (an Intel Xeon, Ice Lake: 0.77-0.86x the time, kernels/csrc/int8_linear.cpp's VNNI variant and
// fp32_linear.cpp) and AMD's without AVX-512 (an AMD EPYC Zen 1: fp32_linear.cpp 0.80x). AMD's with AVX-512, measured
// on a Zen 4, read one stream at their memory's pace.
inline bool lone_row_as_streams() {
  static const bool streams = intel_cpu() || !__builtin_cpu_supports("avx512f");
  return streams;
}

inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

inline void check_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be an fp32 CPU tensor");
}

}  // namespace batcher
