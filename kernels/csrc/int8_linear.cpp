// The int8 CPU kernels (AVX2; AVX-512 VNNI and AMX-INT8 where present): a linear layer on 8-bit weights. This file
// binds the build's module.
//
// Why: a decode step reads every weight once per step, so its floor is the weights' bytes over the memory's pace.
// Weights of 1 byte (symmetric, per output channel) cut that floor ~4x against fp32. Compiled for AVX2 and FMA (the
// VNNI and AMX variants alone for more, and called only where the CPU has them), so the build loads on every AVX2
// CPU.
//
// The arithmetic (kernels/native.py's `int8_linear` and workers/model/int8_linear.py's torch reference share it):
// - x and W rotated along K in blocks of ROTATION = 64 (zeros past K to whole blocks): SIGNS flips fixed values of
//   each block, then the Hadamard transform's butterflies of span 1, 2, 4 ... 32 (value i and i + h become their
//   sum and difference), in fp32. Rotated operands' dot products are 64 times the originals' (W is rotated and
//   divided by 64 at load); a few large activations spread over their block, so one scale per row of x serves.
// - W: q int8 [N, K'] (K' = K rounded up to whole rotation blocks), symmetric per output channel: q[n, k] =
//   W'[n, k] / wscale[n] rounded, in [-127, 127]; wscale fp32 [N] (workers/model/int8_linear.py chooses each row's
//   clip); a zero row: scale 0, q 0. The kernel reads q packed once at load (the layout below), u8
//   [ceil(N / 16), 16 * K'].
// - x fp32 or bf16 [..., K] (M rows; any M, any K >= 1; bf16 widened to fp32 exactly), each row rotated (x'), then
//   quantized with one scale: amax = max |x'[r]|, sx = amax / 127, qx = round_half_even(x' * (127.0f / amax)) in
//   [-127, 127] (amax below TINY, where 127 / amax overflows: sx 0, q 0; a NaN or an infinity: sx NaN).
//   _mm256_cvtps_epi32 rounds to nearest even under the default MXCSR mode, as torch.round does.
// - y[r, n] = ((float(isum[r, n]) * sx[r]) * wscale[n]) + bias[n] in fp32 [..., N], each operation rounded, isum
//   the exact int32 dot of the row's int8 values (at most 127 * 127 * K'); in x's dtype (bf16 rounded to nearest
//   even, as torch's `.to` rounds): a bf16 model's linears then cast nothing around the call.
// The layout (kernels/native.py's `int8_pack`): W's rows in tiles of 16 (zero rows past N), each tile's K' in steps
// of 4 bytes, each step the 4 bytes of every output of the tile side by side: bytes 4s..4s+3 of output 16t + j lie
// at t * tile_bytes + 64 s + 4 j, as u8 (q + 128). One 64-byte step holds 4 bytes of K for the tile's 16 outputs
// (two 256-bit vectors, or one of 512), and the kernel reads W front to back, one stream (prefetched PREFETCH bytes
// ahead, PREFETCH_ONE_ROW for one row of x); for one row of x the AVX2 variant, and the VNNI one on an Intel CPU,
// read ONE_ROW_TILES tiles side by side instead, as that many streams.
// A step's dot: x's 4 bytes are broadcast to every lane. On AVX-512 VNNI (512-bit vectors) one vpdpbusd adds
// (q + 128) * x for the 4 bytes of each output, and a row's sums start at -128 times the row's sum of x (exact,
// computed as x is quantized). On AVX2 the bytes are made signed again (xor 0x80), _mm256_sign_epi8 moves x's signs
// onto them, and |x| times them is summed by _mm256_maddubs_epi16 (exact: 2 * 127 * 127 fits in int16) then
// _mm256_madd_epi16 (llama.cpp's Q8_0 dot). Both keep each output's exact integer sum in one int32 lane over the
// whole row; at the end, as fp32 times sx, times wscale, plus bias. So every variant gives the torch reference's
// bits (workers/model/int8_linear.py's `int8_linear_reference`).
//
// Order of the work: x's rows are rotated and quantized once per call into a scratch (int8 rows of K', a scale and
// a sum per row: `Quantized`; on 512-bit vectors where the variant is an AVX-512 one: the same bits). W is streamed
// once, a tile at a time, each block met by every row of x while it stays in the cache, X_ROWS rows of x at a time
// (4 on AVX2; on AVX-512 up to 16, and a prompt chunk's rows 4 at a time against 3 tiles: PASS_TILES); ROW_CHUNK
// rows at most per pass over W, so a prefill's scratch stays in L2. Threads split the tiles (at::parallel_for).
// The pass over W is kernels/csrc/int8_tiles.h, included once per variant.
//
// Batch invariance: each output is computed by the same instructions in the same order whatever the tile, the
// number of rows, the other rows and the threads (no FMA contraction: -ffp-contract=off), so a row's bits never
// depend on its batch (docs/batch-invariance.md).
//
// Speed (one thread, AMD EPYC Zen 4, SmolLM2's weights): the VNNI variant, on 512-bit vectors 8 rows at a time,
// takes 0.82-0.93x the time of the same on 256-bit vectors 4 rows at a time from 8 rows on, and 0.36-0.79x that of
// torch's bf16 linear (oneDNN's AVX512-BF16) at 8-512 rows; the AVX2 variant 1.1-1.75x the unpacked layout's kernel.
// At one row every variant streams W near the memory's pace. One scale per row (not per block of 32) took a prompt
// chunk's linears 0.93-0.96x the time (docs/benchmark-log.md, 2026-12-07). On an Intel Xeon with AMX the AMX variant
// runs from AMX_MIN_ROWS rows, 0.83x the VNNI variant's time at 128 when x had a scale per block; each block costs
// it a tile product (of K = 32), a store of its sums and their addition to the rows' int32 sums.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "amx.h"
#include "avx2.h"

namespace {

using batcher::check_fp32;
using batcher::tail_mask;

constexpr int BLOCK = INT8_BLOCK;  // kernels/build.py's INT8_BLOCK: K a pass takes at a time, one AVX2 vector of int8
static_assert(BLOCK == 32, "a block is one 256-bit vector of int8");
constexpr int TILE = INT8_TILE;     // kernels/build.py's INT8_TILE: outputs per packed tile
static_assert(TILE == 16, "a tile is two 256-bit vectors of 4 bytes of K for 8 outputs each");
constexpr float TINY = INT8_TINY;  // kernels/build.py's INT8_TINY: the least amax a row of x keeps
constexpr int ROTATION = INT8_ROTATION;  // kernels/build.py's INT8_ROTATION: the block x and W are rotated in
static_assert(ROTATION == 64 && ROTATION % BLOCK == 0, "a rotation block is 8 AVX2 vectors, normalized by 1 / 8");
constexpr uint64_t SIGNS = INT8_SIGNS;  // kernels/build.py's INT8_SIGNS: bit i negates value i of a block
// Bytes of W ahead that a tile's first pass asks L2 for, from 2 rows of x (a pass of several tiles: the same line of
// the next tiles). Until 2026-12-06 a template parameter of the same name hid this constant in int8_tiles.h, so those
// passes asked for the line they were reading: asked 8 KB ahead, 8-32 rows of SmolLM2's weights took 0.69-0.86x the
// time and skew-small in int8 ran 1.35-1.40x faster (AMD EPYC Zen 5); 4 KB 1.1x the time of 8, 16 KB the same. The
// AMX pass asks as far ahead (`amx::dot_tile`).
constexpr int64_t PREFETCH = 8192;
// and for one (a lone stream's decode): its step 0.91x that at 8 KB (five alternated pairs, AMD EPYC Zen 4)
constexpr int64_t PREFETCH_ONE_ROW = 3072;
// Rows of x from which a pass reads PASS_TILES tiles side by side (a prompt chunk; a decode step's few rows are bound
// by the memory, where 3 tiles at 8-16 rows took 1.16-1.24x the time of one, AMD EPYC Zen 5).
constexpr int64_t PASS_TILES_MIN_ROWS = 32;
constexpr int64_t GRAIN = 96;       // outputs per task where torch runs several threads
constexpr int64_t QUANT_GRAIN = 16; // rows of x per quantizing task
constexpr int AMX_ROWS = 16;        // rows of x per AMX tile product
// Rows from which AMX runs by default (below, VNNI's dots). AMX pays per group of 16 rows, VNNI per row. On an Intel
// Xeon with AMX (family 6 model 207), once VNNI's passes prefetched (PREFETCH): in skew-small and summarise runs, each
// int8 call of 10-31 rows timed on both variants, VNNI took 0.90-0.96x AMX's time at 10-23 rows, 1.04-1.05x at 24-31
// (the threshold was 10).
constexpr int64_t AMX_MIN_ROWS = 24;

// x's rows, quantized: `stride` (K rounded up to whole ROTATION blocks) int8 values per row, and per row a scale and
// -128 times the sum of its values (what VNNI's sums start from).
struct Quantized {
  int64_t blocks, stride;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scale;
  std::unique_ptr<int32_t[]> offset;
};

// Up to 8 of x's values as fp32 (zeros past `left`); bf16 widens exactly.
inline __m256 load8(const float* x, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(x) : left > 0 ? _mm256_maskload_ps(x, tail_mask(left)) : _mm256_setzero_ps();
}

inline __m256 load8(const c10::BFloat16* x, int64_t left) {
  __m128i bits;
  if (left >= 8) {
    bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  } else {
    alignas(16) uint16_t part[8] = {};
    std::memcpy(part, x, 2 * std::max<int64_t>(left, 0));
    bits = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The sign bit of each value of a rotation block that SIGNS flips.
struct SignBits {
  alignas(32) uint32_t lanes[ROTATION];
};
constexpr SignBits sign_bits() {
  SignBits bits{};
  for (int i = 0; i < ROTATION; i++) bits.lanes[i] = (SIGNS >> i & 1) ? 0x80000000u : 0u;
  return bits;
}
constexpr SignBits SIGN_BITS = sign_bits();

// One butterfly stage of span H (1, 2 or 4) within a vector: lane i (bit H clear) becomes v[i + H] + v[i], lane
// i + H becomes v[i] + -v[i + H]: the same bits as v[i] + v[i + H] and v[i] - v[i + H].
template <int H>
inline __m256 butterfly_within(__m256 v) {
  __m256 partner;
  if constexpr (H == 1)
    partner = _mm256_permute_ps(v, 0xB1);
  else if constexpr (H == 2)
    partner = _mm256_permute_ps(v, 0x4E);
  else
    partner = _mm256_permute2f128_ps(v, v, 0x01);
  const __m256 sign = H == 1 ? _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1)
                      : H == 2 ? _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1)
                               : _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);  // -1 in the lanes with bit H set
  return _mm256_fmadd_ps(v, sign, partner);  // exact products: one rounding, as the add's
}

// A block of ROTATION values (8 vectors) rotated as workers/model/int8_linear.py's `rotate` does: the signs flipped,
// then the butterflies of span 1, 2, 4 ... 32 in that order. Each value's additions are the reference's, so the same
// bits.
inline void rotate_block(__m256 v[8]) {
  for (int i = 0; i < 8; i++)
    v[i] = _mm256_xor_ps(v[i], _mm256_load_ps(reinterpret_cast<const float*>(SIGN_BITS.lanes + 8 * i)));
  for (int i = 0; i < 8; i++) v[i] = butterfly_within<4>(butterfly_within<2>(butterfly_within<1>(v[i])));
  for (int span = 1; span < 8; span *= 2)
    for (int i = 0; i < 8; i++)
      if (!(i & span)) {
        const __m256 a = v[i], b = v[i + span];
        v[i] = _mm256_add_ps(a, b);
        v[i + span] = _mm256_sub_ps(a, b);
      }
}

// Row r of x (`x` its K values) into `out`, `rotated` a scratch of `out.stride` floats: the row rotated, then
// quantized with one scale (amax / 127; q = round_half_even(value * (127 / amax)), as torch.round rounds under the
// default MXCSR mode); a NaN or an infinity anywhere: scale NaN (the row's outputs are NaN, as torch's are), q 0; an
// amax below TINY (127 / amax would overflow): scale 0, q 0.
template <typename T>
void quantize_row(const T* x, int64_t K, Quantized& out, int64_t r, float* rotated) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t base = 0; base < out.stride; base += ROTATION) {
    __m256 v[8];
    for (int i = 0; i < 8; i++) v[i] = load8(x + base + 8 * i, K - base - 8 * i);
    rotate_block(v);
    for (int i = 0; i < 8; i++) {
      _mm256_storeu_ps(rotated + base + 8 * i, v[i]);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinite
      top = _mm256_max_ps(top, a);
    }
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  int8_t* q = out.q.get() + r * out.stride;
  out.offset[r] = 0;
  if (_mm256_movemask_ps(bad) || amax < TINY) {
    std::memset(q, 0, out.stride);
    out.scale[r] = _mm256_movemask_ps(bad) ? NAN : 0.0f;
    return;
  }
  // |value| <= amax, so value * inv is within +-127 (127.00002 at most): no clamp (the packs saturate besides)
  const __m256 inv = _mm256_set1_ps(127.0f / amax);
  __m256i total = _mm256_setzero_si256();
  for (int64_t k = 0; k < out.stride; k += 32) {
    __m256i i32[4];
    for (int i = 0; i < 4; i++)
      i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(rotated + k + 8 * i), inv));
    // packs work within 128-bit lanes: the 4-byte groups of i32[0..3] come out as a0 b0 c0 d0 a1 b1 c1 d1; reorder.
    const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), i8);
    total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                                     _mm256_add_epi32(i32[2], i32[3])));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  int32_t sum = 0;
  for (const int32_t lane : lanes) sum += lane;
  out.offset[r] = -128 * sum;
  out.scale[r] = amax / 127.0f;
}

// x's rows, quantized, each by `row` (`quantize_row`, or the AVX-512 one: the same bits).
template <typename T>
Quantized quantize_rows(const T* x, int64_t rows, int64_t K,
                        void (*row)(const T*, int64_t, Quantized&, int64_t, float*)) {
  Quantized out;
  out.stride = (K + ROTATION - 1) / ROTATION * ROTATION;
  out.blocks = out.stride / BLOCK;
  out.q.reset(new int8_t[rows * out.stride]);
  out.scale.reset(new float[rows]);
  out.offset.reset(new int32_t[rows]);
  at::parallel_for(0, rows, QUANT_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(out.stride);
    for (int64_t r = begin; r < end; r++) row(x + r * K, K, out, r, rotated.data());
  });
  return out;
}

// What one pass over W needs: the scratch, the packed W and its scales, the bias, and the output.
struct Operands {
  const Quantized& x;
  const uint8_t* w;
  int64_t tile_bytes;  // of one packed tile: TILE * x.stride
  int64_t N;
  const float* wscale;
  const float* bias;  // nullptr: none
  float* y;                // fp32 output, or
  c10::BFloat16* y_bf16;   // bf16 output (x's dtype), rounded to nearest even as torch rounds
};

namespace avx2 {
// Rows of x per pass: 8 sums in AVX2's 16 registers. When x had a scale per block (and 8 float accumulators beside
// the sums, some on the stack), at 4-512 rows 4 took 0.82-0.93x the time of 2 (AMD EPYC Zen 3, whose int8 dots are
// bound by its multipliers from 4 rows; each load of W, and its xor, feeds twice the dots).
constexpr int X_ROWS = 4;
constexpr bool EXACT_PASSES = false;  // passes of X_ROWS, the rest in halves
constexpr int VECTORS = 2;  // 8 outputs a vector
constexpr int ONE_ROW_TILES = 4;  // 1.1-1.2x the pace of one at a time (AMD EPYC Zen 1), 8 sums in 16 registers
inline bool one_row_side_by_side() { return true; }
// A tile a pass at every row count, as measured on its class: on a Zen 4 (AVX2 code), 3 tiles took 0.96x the time of
// one at 64-512 rows after x's scale per row, unmeasured on an AVX2-only CPU.
constexpr int PASS_TILES = 1;
constexpr int PASS_ROWS = X_ROWS;
constexpr int64_t ROW_CHUNK = 64;  // rows of x per pass over W (their scratch: 64 * K bytes, in L2)
using Sums = __m256i;
using Floats = __m256;
inline Sums block_start(const int32_t*) { return _mm256_setzero_si256(); }
inline Sums load_w(const uint8_t* w) {  // signed q again
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), _mm256_set1_epi8(-128));
}
// |x| times q carrying x's signs, pairs summed in int16 (exact), then pairs of those in int32.
inline Sums dot(Sums sum, Sums q, int32_t four) {
  const __m256i xb = _mm256_set1_epi32(four);
  const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(q, xb));
  return _mm256_add_epi32(sum, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
inline Floats scaled(Sums sum, float sx) { return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(sx)); }
template <int R>
inline void finish(const Operands& o, int64_t row, int64_t n, const Floats* acc) {
  const int64_t left = o.N - n;
  const __m256 scale = load8(o.wscale + n, left), bias = o.bias ? load8(o.bias + n, left) : _mm256_setzero_ps();
  for (int r = 0; r < R; r++) {
    __m256 out = _mm256_mul_ps(acc[r], scale);
    if (o.bias) out = _mm256_add_ps(out, bias);
    const int64_t at = (row + r) * o.N + n;
    if (o.y_bf16) {
      alignas(32) float values[8];
      _mm256_store_ps(values, out);
      for (int64_t i = 0; i < std::min<int64_t>(8, left); i++) o.y_bf16[at + i] = c10::BFloat16(values[i]);
    } else if (left >= 8) {
      _mm256_storeu_ps(o.y + at, out);
    } else {
      _mm256_maskstore_ps(o.y + at, tail_mask(left), out);
    }
  }
}
#include "int8_tiles.h"
}  // namespace avx2

// AVX-512 VNNI on 512-bit vectors: a tile's 16 outputs are one vector, so a step is one load of W and one
// vpdpbusd a row (0.82-0.93x the time of the same kernel on 256-bit vectors, AMD EPYC Zen 4).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#endif
namespace vnni {
// A tile's rows, where a pass takes one tile (a decode step's, fewer than PASS_TILES_MIN_ROWS; a prompt chunk's tiles
// left past PASS_TILES), in as few passes of up to 16 as hold them, each of its exact count (EXACT_PASSES): one sum a
// row, so a pass keeps as many vpdpbusd independent as it has rows. Passes of 8 and the rest in halves left 9-15 rows a
// pass over the cached tile of 1-4 rows, bound by its vpdpbusd's latency: in skew-small runs (every call on both
// builds, both orders) calls of 9-12 rows then took 0.88x the time, 13-16 rows 0.85x, 17-32 rows 0.93x (AMD EPYC Zen 5,
// two vpdpbusd a cycle). On a Zen 4 (one a cycle), when sums were copied around each vpdpbusd, passes of 16 and the
// rest exact ran skew-small at 0.97-1.05x the tokens/s.
constexpr int X_ROWS = 16;
constexpr bool EXACT_PASSES = true;
constexpr int VECTORS = 1;  // 16 outputs a vector
// One row of x: on an AMD core a tile at a time streams W at the memory's pace (~26 GB/s, AMD EPYC Zen 4), where 4
// tiles side by side (no software prefetch) took 1.33-1.71x the time. An Intel core read SmolLM2's weights as one
// stream at ~0.7x its memory's pace, prefetched 1.5 to 12 KB ahead into L2 or L1 alike (Intel Xeon, Ice Lake:
// family 6 model 106); as 12 streams, 12 tiles side by side, in 0.77-0.82x the time (8: 0.80-0.87x, 16: 0.79-0.84x,
// 24: 0.83-0.90x; 12 with the software prefetch too: 0.89x).
constexpr int ONE_ROW_TILES = 12;  // 12 sums and 12 loads of W in AVX-512's 32 registers
inline bool one_row_side_by_side() { return batcher::lone_row_as_streams(); }
// From PASS_TILES_MIN_ROWS rows, passes of 4 rows over 3 tiles (12 sums): each broadcast of x feeds
// 3 vpdpbusd, where the 8-row pass spent one broadcast a vpdpbusd. A prompt chunk's linears (512 rows) then took 0.83x
// the time (5.4 against 4.5 G vpdpbusd/s, AMD EPYC Zen 5, which issues two a cycle); 2 tiles 0.85x; 8 rows over 2
// tiles spilled the registers (1.2x). With x's scale per row, 8 rows over 3 tiles (24 sums) spilled too (1.7-1.8x),
// and 4 rows over 4 tiles took 0.96-1.03x the time (Zen 4).
constexpr int PASS_TILES = 3;
constexpr int PASS_ROWS = 4;
// Rows of x per pass over W (their scratch: 128 * K bytes, in L2): a weight larger than L2 is read from L3 once per
// chunk. Against 64, a prompt chunk's linears (512 rows) took 0.98x the time in summarise runs (every call on both,
// AMD EPYC Zen 5, 1 MB of L2); no change on a Zen 4 when x had a scale per block.
constexpr int64_t ROW_CHUNK = 128;
using Sums = __m512i;
using Floats = __m512;
inline Sums block_start(const int32_t* offset) {
  return _mm512_set1_epi32(*offset);  // takes back the 128 each packed byte carries
}
inline Sums load_w(const uint8_t* w) { return _mm512_loadu_si512(w); }  // u8: q + 128
// Written as the intrinsic (_mm512_dpbusd_epi32), GCC 12 copied each sum to another register and back around its
// vpdpbusd (~1 vmovdqa a vpdpbusd in the passes' loops); the asm adds in place. A prompt chunk's linears then took
// 0.96x the time in summarise runs (AMD EPYC Zen 5, which issues two vpdpbusd a cycle).
inline Sums dot(Sums sum, Sums packed, int32_t four) {
  const __m512i x = _mm512_set1_epi32(four);
  asm("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(packed), "v"(x));  // sum += packed (u8) . x (s8), 4 bytes a lane
  return sum;
}
inline Floats scaled(Sums sum, float sx) { return _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(sx)); }
// The first n of 16 lanes (none for n <= 0).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : n > 0 ? static_cast<__mmask16>((1u << n) - 1) : 0;
}

// bf16 rounded to nearest even, as c10::BFloat16 rounds (a NaN: 0x7FC0), for 16 lanes at once.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
}
template <int R>
inline void finish(const Operands& o, int64_t row, int64_t n, const Floats* acc) {
  const int64_t left = o.N - n;
  const __mmask16 keep = first_lanes(left);
  const __m512 scale = _mm512_maskz_loadu_ps(keep, o.wscale + n);
  const __m512 bias = o.bias ? _mm512_maskz_loadu_ps(keep, o.bias + n) : _mm512_setzero_ps();
  for (int r = 0; r < R; r++) {
    __m512 out = _mm512_mul_ps(acc[r], scale);
    if (o.bias) out = _mm512_add_ps(out, bias);
    const int64_t at = (row + r) * o.N + n;
    if (o.y_bf16)
      _mm256_mask_storeu_epi16(o.y_bf16 + at, keep, to_bf16(out));
    else
      _mm512_mask_storeu_ps(o.y + at, keep, out);
  }
}
#include "int8_tiles.h"

// 16 of x's values as fp32 (zeros past `left`); bf16 widens exactly. A whole vector loads without a mask, as `load8`
// does: the quantizer on bf16 x then took 0.89-0.93x the time (AMD EPYC Zen 5).
inline __m512 load16(const float* x, int64_t left) {
  return left >= 16 ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(first_lanes(left), x);
}
inline __m512 load16(const c10::BFloat16* x, int64_t left) {
  const __m256i bits = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))
                                  : _mm256_maskz_loadu_epi16(first_lanes(left), x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// `butterfly_within` on 16 lanes, span H of 1, 2, 4 or 8.
template <int H>
inline __m512 butterfly_within(__m512 v) {
  __m512 partner;
  if constexpr (H == 1)
    partner = _mm512_permute_ps(v, 0xB1);
  else if constexpr (H == 2)
    partner = _mm512_permute_ps(v, 0x4E);
  else if constexpr (H == 4)
    partner = _mm512_shuffle_f32x4(v, v, 0xB1);
  else
    partner = _mm512_shuffle_f32x4(v, v, 0x4E);
  constexpr __mmask16 upper = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;
  const __m512 sign = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), upper, _mm512_set1_ps(-1.0f));
  return _mm512_fmadd_ps(v, sign, partner);  // exact products: one rounding, as the add's
}

// `rotate_block` on 4 vectors of 16: the same operations on each value, so the same bits.
inline void rotate_block(__m512 v[4]) {
  for (int i = 0; i < 4; i++) {
    const __m512i flip = _mm512_load_si512(SIGN_BITS.lanes + 16 * i);
    v[i] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v[i]), flip));
    v[i] = butterfly_within<8>(butterfly_within<4>(butterfly_within<2>(butterfly_within<1>(v[i]))));
  }
  for (int span = 1; span < 4; span *= 2)
    for (int i = 0; i < 4; i++)
      if (!(i & span)) {
        const __m512 a = v[i], b = v[i + span];
        v[i] = _mm512_add_ps(a, b);
        v[i + span] = _mm512_sub_ps(a, b);
      }
}

// `quantize_row` on 16 lanes: the same operations on each value, so the same bits.
template <typename T>
void quantize_row(const T* x, int64_t K, Quantized& out, int64_t r, float* rotated) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i top = _mm512_setzero_si512();  // |value|'s bits: ordered as the values, a NaN's or infinity's the largest
  for (int64_t base = 0; base < out.stride; base += ROTATION) {
    __m512 v[4];
    for (int i = 0; i < 4; i++) v[i] = load16(x + base + 16 * i, K - base - 16 * i);
    rotate_block(v);
    for (int i = 0; i < 4; i++) {
      _mm512_storeu_ps(rotated + base + 16 * i, v[i]);
      top = _mm512_max_epi32(top, _mm512_and_si512(_mm512_castps_si512(v[i]), magnitude));
    }
  }
  const int32_t bits = _mm512_reduce_max_epi32(top);
  float amax;
  std::memcpy(&amax, &bits, 4);
  int8_t* q = out.q.get() + r * out.stride;
  out.offset[r] = 0;
  const bool bad = bits >= 0x7F800000;  // a NaN or an infinity
  if (bad || amax < TINY) {
    std::memset(q, 0, out.stride);
    out.scale[r] = bad ? NAN : 0.0f;
    return;
  }
  // |value| <= amax, so value * inv is within +-127 (127.00002 at most): no clamp (the packs saturate besides)
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  __m512i total = _mm512_setzero_si512();
  // packs work within 128-bit lanes: 4-value groups of i32[0..3] come out as a0 b0 c0 d0 a1 ...; reordered.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t k = 0; k < out.stride; k += 64) {
    __m512i i32[4];
    for (int i = 0; i < 4; i++) {
      i32[i] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(rotated + k + 16 * i), inv));
      total = _mm512_add_epi32(total, i32[i]);
    }
    const __m512i i16a = _mm512_packs_epi32(i32[0], i32[1]), i16b = _mm512_packs_epi32(i32[2], i32[3]);
    _mm512_storeu_si512(q + k, _mm512_permutexvar_epi32(order, _mm512_packs_epi16(i16a, i16b)));
  }
  out.offset[r] = -128 * _mm512_reduce_add_epi32(total);
  out.scale[r] = amax / 127.0f;
}
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// AMX-INT8: a block's dots for 16 rows of x and a tile's 16 outputs in one tile product, where VNNI's dots (one
// instruction per row per 4 bytes of K) bind a prompt chunk's many rows. The packed W is already in AMX's layout for
// the second operand (4 bytes of K for 16 outputs per 64-byte row), so a block of a tile is one 8-row tile. Each
// block's exact sums (tdpbssd on a signed copy of the tile, or tdpbsud on W as packed, q + 128, plus the offsets) leave
// the tile and join the rows' int32 sums, scaled as VNNI scales them: the same integers and float operations, so the
// same bits.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#endif
namespace amx {
constexpr int64_t W_BLOCK = TILE * BLOCK;  // bytes of one block of a packed tile
// rows of x per pass over W here (their scratch: 256 * K bytes, in L2; AVX2's take 64, VNNI's 128), each
// tile's signed copy made once per pass
constexpr int64_t ROW_CHUNK = 256;
// Groups of AMX_ROWS rows from which a call's tiles are signed first (`signed_tile`): on an Intel Xeon with AMX the
// copy cost 1.02-1.35x the time at 20-32 rows (one or two groups to pay for it) and took 0.86-1.02x from 128 rows.
constexpr int64_t SIGNED_MIN_GROUPS = 4;
static_assert(ROW_CHUNK % AMX_ROWS == 0, "a chunk of rows is whole tile products");

// Tiles 0, 1: a block's sums (`rows` rows of x, up to 16, x 16 outputs, int32); 2, 3: x's rows of that block (32
// bytes each); 4, 5: W's block (8 rows of 4 bytes x 16 outputs). Blocks alternate between the two sets, so the next
// block's product is asked for before a block's sums are added. A group of fewer rows runs on tiles of that many:
// a product's rows are computed apart, and its sums are exact, so a row's bits do not depend on the group.
inline void configure(int64_t rows) {
  struct {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, BLOCK, BLOCK, 64, 64};
    uint8_t rows[16] = {0, 0, 0, 0, BLOCK / 4, BLOCK / 4};
  } config;
  for (int tile = 0; tile < 4; tile++) config.rows[tile] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&config);
}

// A packed tile of `bytes` with its bytes signed again (q, not q + 128) into `out`: tdpbssd's second operand, whose
// sums need no offset. Made once per tile and chunk of rows, where enough groups of rows meet the tile to pay for it;
// the bytes PREFETCH ahead asked for as it reads.
inline void signed_tile(const uint8_t* tile, int64_t bytes, int8_t* out) {
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(tile + i + PREFETCH), _MM_HINT_T1);  // (past W: a no-op)
    _mm512_storeu_si512(out + i, _mm512_xor_si512(_mm512_loadu_si512(tile + i), _mm512_set1_epi8(-128)));
  }
}

// The product of one block: x's rows from `x` (`stride` apart), W's block at `w`: signed (SIGNED: tdpbssd), else as
// packed (tdpbsud, q + 128). (The tile intrinsics take their tiles' numbers as written: one branch per set.)
template <int SET, bool SIGNED>
inline void start_block(const int8_t* x, int64_t stride, const void* w) {
  if constexpr (SET == 0) {
    _tile_loadd(2, x, stride);
    _tile_loadd(4, w, 64);
    _tile_zero(0);
    if constexpr (SIGNED)
      _tile_dpbssd(0, 2, 4);
    else
      _tile_dpbsud(0, 2, 4);
  } else {
    _tile_loadd(3, x, stride);
    _tile_loadd(5, w, 64);
    _tile_zero(1);
    if constexpr (SIGNED)
      _tile_dpbssd(1, 3, 5);
    else
      _tile_dpbsud(1, 3, 5);
  }
}

// A block's sums (tile SET) into `sums`: a tile store, whose data vector loads read only once it has landed.
template <int SET>
inline void store_sums(int32_t (*sums)[TILE]) {
  if constexpr (SET == 0)
    _tile_stored(0, sums, 64);
  else
    _tile_stored(1, sums, 64);
}

// Block b's sums added to the rows' integer sums `acc` (exact, in any order). FULL: a group of AMX_ROWS rows, its
// loop unrolled so that acc stays in registers (else `count`).
template <bool FULL>
inline void add_block(const int32_t (*sums)[TILE], int64_t count, __m512i* acc) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < (FULL ? AMX_ROWS : count); r++)
    acc[r] = _mm512_add_epi32(acc[r], _mm512_load_si512(sums[r]));
}

// y for x's rows [row, row + count) (count <= 16: the tiles are configured for it) and W's
// tile t at `w` (signed: `signed_tile`, or as packed). A block's sums are added only once the next block's product
// is asked for and its sums stored, so the tiles work while the vector units add. `fetch` (a tile's first group
// of rows; else nullptr): the packed tile, whose bytes PREFETCH ahead each pair of blocks asks L2 for. Without, a
// decode step's 24-64 rows over SmolLM2's weights took 1.06-1.22x the time (Intel Xeon with AMX, model 167).
template <bool FULL, bool SIGNED>
inline void dot_tile(const Operands& o, int64_t row, int64_t count, int64_t t, const void* w, const uint8_t* fetch) {
  __m512i acc[AMX_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_si512();
  alignas(64) int32_t sums[2][AMX_ROWS][TILE];
  const int64_t blocks = o.x.blocks, stride = o.x.stride;
  const int8_t* x = o.x.q.get() + row * stride;
  const auto* wb = static_cast<const uint8_t*>(w);
  start_block<0, SIGNED>(x, stride, wb);
  for (int64_t b = 0; b < blocks; b += 2) {  // block b on tiles of set 0, b + 1 on set 1
    if (fetch)
      for (int64_t line = 0; line < 2 * W_BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(fetch + b * W_BLOCK + PREFETCH + line), _MM_HINT_T1);
    if (b + 1 < blocks) start_block<1, SIGNED>(x + (b + 1) * BLOCK, stride, wb + (b + 1) * W_BLOCK);
    store_sums<0>(sums[0]);
    if (b > 0) add_block<FULL>(sums[1], count, acc);
    if (b + 1 < blocks) {
      if (b + 2 < blocks) start_block<0, SIGNED>(x + (b + 2) * BLOCK, stride, wb + (b + 2) * W_BLOCK);
      store_sums<1>(sums[1]);
      add_block<FULL>(sums[0], count, acc);
    }
  }
  // the last block's sums: stored, not yet added
  add_block<FULL>(sums[(blocks - 1) % 2], count, acc);
#pragma GCC unroll 16
  for (int64_t r = 0; r < (FULL ? AMX_ROWS : count); r++) {  // the offsets take back the 128 each packed byte carries
    const __m512i exact = SIGNED ? acc[r] : _mm512_add_epi32(_mm512_set1_epi32(o.x.offset[row + r]), acc[r]);
    const __m512 out = vnni::scaled(exact, o.x.scale[row + r]);  // a copy, so acc stays in registers
    vnni::finish<1>(o, row + r, TILE * t, &out);
  }
}

// x's rows [first, last) against W's tile t at `w`, 16 per tile product (a last group of fewer on tiles of that many
// rows); `configured`: the rows the tiles are configured for.
template <bool SIGNED>
inline void all_rows(const Operands& o, int64_t first, int64_t last, int64_t t, const void* w, int64_t& configured) {
  for (int64_t row = first; row < last; row += AMX_ROWS) {
    const int64_t count = std::min<int64_t>(AMX_ROWS, last - row);
    if (count != configured) configure(configured = count);
    const uint8_t* fetch = !SIGNED && row == first ? o.w + t * o.tile_bytes : nullptr;
    if (count == AMX_ROWS)
      dot_tile<true, SIGNED>(o, row, count, t, w, fetch);
    else
      dot_tile<false, SIGNED>(o, row, count, t, w, fetch);
  }
}

// y for every row of x: threads split W's tiles, each tile met by ROW_CHUNK rows at a time; from SIGNED_MIN_GROUPS
// groups of rows, a signed copy of it.
inline void pass_over_w(const Operands& o, int64_t rows) {
  const bool signed_copy = (rows + AMX_ROWS - 1) / AMX_ROWS >= SIGNED_MIN_GROUPS;
  at::parallel_for(0, (o.N + TILE - 1) / TILE, std::max<int64_t>(1, GRAIN / TILE), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> copy(signed_copy ? o.tile_bytes : 0);
    int64_t configured = 0;
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      for (int64_t t = begin; t < end; t++) {
        const uint8_t* tile = o.w + t * o.tile_bytes;
        if (copy.empty()) {
          all_rows<false>(o, first, last, t, tile, configured);
        } else {
          signed_tile(tile, o.tile_bytes, copy.data());
          all_rows<true>(o, first, last, t, copy.data(), configured);
        }
      }
    }
    _tile_release();
  });
}
}  // namespace amx
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

bool vnni_present() {
  static const bool present = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                               __builtin_cpu_supports("avx512bw");
  return present;
}

// The CPU has AMX-INT8 (with VNNI, which every such CPU has) and the OS lends this process its tiles.
bool amx_present() {
  static const bool present = vnni_present() && __builtin_cpu_supports("amx-tile") &&
                               __builtin_cpu_supports("amx-int8") && batcher::amx_permitted();
  return present;
}

const char* const ISA_AVX2 = "avx2";
const char* const ISA_VNNI = "avx512-vnni";
const char* const ISA_AMX = "amx-int8";

// The best variant here: AMX from AMX_MIN_ROWS rows, VNNI below (and where AMX is absent), else AVX2.
const char* best_isa(int64_t rows) {
  if (amx_present() && rows >= AMX_MIN_ROWS) return ISA_AMX;
  return vnni_present() ? ISA_VNNI : ISA_AVX2;
}

// `isa`: the variant to run, this CPU's best for the rows where empty (the others are for tests and benchmarks).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale,
                          c10::optional<torch::Tensor> bias, const std::string& isa) {
  TORCH_CHECK(isa.empty() || isa == ISA_AVX2 || isa == ISA_VNNI || isa == ISA_AMX, "no int8 variant '", isa, "'");
  TORCH_CHECK(isa != ISA_VNNI || vnni_present(), "this CPU has no AVX-512 VNNI");
  TORCH_CHECK(isa != ISA_AMX || amx_present(), "this CPU has no AMX-INT8, or the OS refused this process its tiles");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == torch::kFloat32),
              "x must be an fp32 or bf16 CPU tensor, not ", x.scalar_type());
  check_fp32(wscale, "wscale");
  TORCH_CHECK(wscale.dim() == 1 && wscale.is_contiguous(), "wscale must be one contiguous row of scales");
  const int64_t N = wscale.numel(), K = x.size(-1);
  TORCH_CHECK(x.dim() >= 1 && K >= 1, "x has no features");
  const int64_t tiles = (N + TILE - 1) / TILE, stride = (K + ROTATION - 1) / ROTATION * ROTATION;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 &&
                  packed.is_contiguous(),
              "the weight must be packed (kernels/native.py's int8_pack): a contiguous uint8 matrix, not ",
              packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(0) == tiles && packed.size(1) == TILE * stride, "the packed weight is ", packed.sizes(),
              "; ", N, " scales and ", K, " features need [", tiles, ", ", TILE * stride, "]");
  torch::Tensor bias_c;
  const float* b = nullptr;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    check_fp32(bias_c, "bias");
    TORCH_CHECK(bias_c.numel() == N, "bias has ", bias_c.numel(), " values, wscale ", N);
    b = bias_c.data_ptr<float>();
  }
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t rows = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (rows == 0 || N == 0) return y;
  const std::string run = isa.empty() ? best_isa(rows) : isa;
  const bool wide = run != ISA_AVX2;  // an AVX-512 variant, which quantizes x on AVX-512 too
  const Quantized quantized =
      bf16 ? quantize_rows(x2.data_ptr<c10::BFloat16>(), rows, K,
                           wide ? vnni::quantize_row<c10::BFloat16> : quantize_row<c10::BFloat16>)
           : quantize_rows(x2.data_ptr<float>(), rows, K, wide ? vnni::quantize_row<float> : quantize_row<float>);
  const Operands o{quantized, packed.data_ptr<uint8_t>(), TILE * stride, N, wscale.data_ptr<float>(), b,
                   bf16 ? nullptr : y.data_ptr<float>(), bf16 ? y.data_ptr<c10::BFloat16>() : nullptr};
  if (run == ISA_AMX)
    amx::pass_over_w(o, rows);
  else if (run == ISA_VNNI)
    vnni::pass_over_w(o, rows);
  else
    avx2::pass_over_w(o, rows);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear,
        "x @ W.T + b on packed int8 weights (per-channel scales), x rotated and quantized per row",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("wscale"), pybind11::arg("bias"),
        pybind11::arg("isa") = "");
  m.attr("block") = BLOCK;
  m.attr("tile") = TILE;
  m.def("isa", &best_isa, "the variant that runs by default on this many rows of x", pybind11::arg("rows"));
}
