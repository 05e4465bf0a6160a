// The int8 CPU kernels (AVX2; AVX-512 VNNI and AMX-INT8 where present): a linear layer on 8-bit weights. This file
// binds the build's module.
//
// Why: a decode step reads every weight once per step, so its floor is the weights' bytes over the memory's pace.
// Weights of 1 byte (symmetric, per output channel) cut that floor ~4x against fp32. Compiled for AVX2 and FMA (the
// VNNI and AMX variants alone for more, and called only where the CPU has them), so the build loads on every AVX2
// CPU.
//
// The arithmetic (kernels/native.py's `int8_linear` and workers/model/int8_linear.py's torch reference share it):
// - W: q int8 [N, K], symmetric per output channel: q[n, k] = W[n, k] / wscale[n] rounded, in [-127, 127]; wscale
//   fp32 [N] (workers/model/int8_linear.py chooses each row's clip); a zero row: scale 0, q 0. The kernel reads q
//   packed once at load (the layout below), u8 [ceil(N / 16), 16 * BLOCK * ceil(K / BLOCK)].
// - x fp32 or bf16 [..., K] (M rows; any M, any K >= 1; bf16 widened to fp32 exactly), quantized per row in
//   blocks of BLOCK = 32 along K (the last one may be shorter): amax = max |x[r, block]|, sx = amax / 127,
//   qx = round_half_even(x * (127.0f / amax)) in [-127, 127] (amax below TINY, where 127 / amax overflows: sx 0,
//   q 0). _mm256_cvtps_epi32 rounds to nearest even under the default MXCSR mode, as torch.round does.
// - y[r, n] = (sum_b(sx[r, b] * isum[r, n, b]) * wscale[n]) + bias[n] in fp32 [..., N], each operation rounded,
//   the blocks in order, isum the exact int32 dot of block b's int8 values; in x's dtype (bf16 rounded to nearest
//   even, as torch's `.to` rounds): a bf16 model's linears then cast nothing around the call.
// The layout (kernels/native.py's `int8_pack`): W's rows in tiles of 16 (zero rows past N), each tile's K (zero
// past K to whole blocks) in steps of 4 bytes, each step the 4 bytes of every output of the tile side by side:
// bytes 4s..4s+3 of output 16t + j lie at t * tile_bytes + 64 s + 4 j, as u8 (q + 128). One 64-byte step holds 4
// bytes of K for the tile's 16 outputs (two 256-bit vectors, or one of 512), and the kernel reads W front to back,
// one stream (prefetched PREFETCH bytes ahead, PREFETCH_ONE_ROW for one row of x); for one row of x the AVX2 variant
// reads ONE_ROW_TILES tiles side by side instead, as that many streams.
// A block's dot: x's 4 bytes are broadcast to every lane. On AVX-512 VNNI (512-bit vectors) one vpdpbusd adds
// (q + 128) * x for the 4 bytes of each output, and the block's sums start at -128 times the block's sum of x
// (exact, computed as x is quantized). On AVX2 the bytes are made signed again (xor 0x80), _mm256_sign_epi8 moves
// x's signs onto them, and |x| times them is summed by _mm256_maddubs_epi16 (exact: 2 * 127 * 127 fits in int16)
// then _mm256_madd_epi16 (llama.cpp's Q8_0 dot). Both give each output's exact integer sum over the block in one
// int32 lane. Then, per block, in the torch reference's order: the sum as fp32 (exact: below 2**24), times sx,
// added to the output's fp32 sum (no FMA); at the end times wscale, plus bias. So every variant gives the torch
// reference's bits (workers/model/int8_linear.py's `int8_linear_reference`).
//
// Order of the work: x's rows are quantized once per call into a scratch (int8 rows padded to whole blocks with
// zeros, one scale and one sum per block, those of 8 rows side by side: `Quantized`; where the variant is an AVX-512
// one, 16 whole blocks of a row at once, a block a lane: the same bits in 0.46-0.74x the time). W is streamed once, a
// tile at a time, each block met by every row of x while it stays in the cache, X_ROWS rows of x at a time (4 on
// AVX2's 16 registers, 8 on AVX-512's 32; on AVX-512 a prompt chunk's rows 4 at a time against 3 tiles: PASS_TILES);
// ROW_CHUNK rows at most per pass over W, so a prefill's scratch stays in L2. Threads split the tiles
// (at::parallel_for).
// The pass over W is kernels/csrc/int8_tiles.h, included once per variant.
//
// Batch invariance: each output is computed by the same instructions in the same order whatever the tile, the
// number of rows, the other rows and the threads (no FMA contraction: -ffp-contract=off), so a row's bits never
// depend on its batch (docs/batch-invariance.md).
//
// Speed (one thread, AMD EPYC Zen 4, SmolLM2's weights): the VNNI variant, on 512-bit vectors 8 rows at a time,
// takes 0.82-0.93x the time of the same on 256-bit vectors 4 rows at a time from 8 rows on, and 0.36-0.79x that of
// torch's bf16 linear (oneDNN's AVX512-BF16) at 8-512 rows; the AVX2 variant 1.1-1.75x the unpacked layout's kernel.
// At one row every variant streams W near the memory's pace. On an Intel Xeon with AMX the AMX variant runs from
// AMX_MIN_ROWS rows, 0.83x the VNNI variant's time at 128. Each block costs it a tile product (of K = 32: what one
// of K = 64 costs), a store of its sums and their scaling in float (3-4 vector operations per row); on a host of
// family 6 model 207 a product took ~18 ns, a 1 KB tile store ~12 and a tile load ~10, one after another (an ad-hoc
// loop), so ~40 ns a block with or without the float work, where amx_linear's bf16 products keep their sums in the
// tile across K: it stays 1.45-1.7x faster at 64-512 rows. Four products in flight (two groups of rows by two tiles)
// and x's rows regrouped into whole cache lines did not change that.

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

constexpr int BLOCK = INT8_BLOCK;  // kernels/build.py's INT8_BLOCK: x's quantization block, one AVX2 vector of int8
static_assert(BLOCK == 32, "a block is one 256-bit vector of int8");
constexpr int TILE = INT8_TILE;     // kernels/build.py's INT8_TILE: outputs per packed tile
static_assert(TILE == 16, "a tile is two 256-bit vectors of 4 bytes of K for 8 outputs each");
constexpr float TINY = INT8_TINY;  // kernels/build.py's INT8_TINY: the least amax a block keeps
constexpr int64_t ROW_CHUNK = 64;   // rows of x per pass over W (their scratch: 64 * K bytes)
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

// Rows of x whose block scales and offsets lie side by side (`Quantized::at`): a pass over X_ROWS <= GROUP rows reads
// them through one pointer each, where 8 rows' own pointers spilled the registers (AMD EPYC Zen 4).
constexpr int64_t GROUP = 8;

// x's rows, quantized: `stride` (whole blocks) int8 values per row, zeros past K; per block a scale, and -128 times
// the block's sum of values (what VNNI's sums start from), for rows in groups of GROUP: block b of the group's rows
// at `at(row, b)`, one after another (a last group's rows past x's are never written nor read). Left unzeroed: a
// vector's zeroing took 8.5-25 us of a prompt chunk's call (Intel Xeon with AMX).
struct Quantized {
  int64_t blocks, stride;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scale;
  std::unique_ptr<int32_t[]> offset;
  int64_t at(int64_t row, int64_t b) const { return (row / GROUP * blocks + b) * GROUP + row % GROUP; }
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

// One row's block of n <= 32 values into 32 int8 (zeros past n); its scale, and -128 times the sum of the int8s.
template <typename T>
inline float quantize_block(const T* x, int64_t n, int8_t* q, int32_t* offset) {
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
  *offset = 0;
  if (nan || amax < TINY) {  // a zero (or subnormal) block: q 0, scale 0
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
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
  int32_t total = 0;
  for (const int32_t lane : lanes) total += lane;
  *offset = -128 * total;
  return amax / 127.0f;
}

// Row r of x (`x` its K values) into `out`.
template <typename T>
void quantize_row(const T* x, int64_t K, Quantized& out, int64_t r) {
  for (int64_t b = 0, at = out.at(r, 0); b < out.blocks; b++, at += GROUP)
    out.scale[at] = quantize_block(x + b * BLOCK, std::min<int64_t>(BLOCK, K - b * BLOCK),
                                   out.q.get() + r * out.stride + b * BLOCK, out.offset.get() + at);
}

// x's rows quantized, each by `row` (`quantize_row`, or the AVX-512 one: the same bits).
template <typename T>
Quantized quantize_rows(const T* x, int64_t rows, int64_t K, void (*row)(const T*, int64_t, Quantized&, int64_t)) {
  Quantized out;
  out.blocks = (K + BLOCK - 1) / BLOCK;
  out.stride = out.blocks * BLOCK;
  out.q.reset(new int8_t[rows * out.stride]);
  const int64_t scales = (rows + GROUP - 1) / GROUP * GROUP * out.blocks;
  out.scale.reset(new float[scales]);
  out.offset.reset(new int32_t[scales]);
  at::parallel_for(0, rows, QUANT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) row(x + r * K, K, out, r);
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
// Rows of x per pass: 8 sums (of 2 rows: 4, and 4 accumulators, in AVX2's 16 registers). The compiler keeps some of
// the 8 sums and every accumulator on the stack, yet at 4-512 rows 4 took 0.82-0.93x the time of 2 (AMD EPYC Zen 3,
// whose int8 dots are bound by its multipliers from 4 rows; each load of W, and its xor, feeds twice the dots).
constexpr int X_ROWS = 4;
constexpr int VECTORS = 2;  // 8 outputs a vector
constexpr int ONE_ROW_TILES = 4;  // 1.1-1.2x the pace of one at a time (AMD EPYC Zen 1), 8 sums in 16 registers
constexpr int PASS_TILES = 1;  // a tile a pass at every row count
constexpr int PASS_ROWS = X_ROWS;
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
inline Floats add_block(Floats acc, Sums sum, float sx) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(sx)));
}
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
constexpr int X_ROWS = 8;   // 16 sums and accumulators of AVX-512's 32 registers
constexpr int VECTORS = 1;  // 16 outputs a vector
// A tile at a time: one row streams W at the memory's pace (~26 GB/s, AMD EPYC Zen 4), where 4 tiles side by side
// (no software prefetch) took 1.33-1.71x the time.
constexpr int ONE_ROW_TILES = 1;
// From PASS_TILES_MIN_ROWS rows, passes of 4 rows over 3 tiles (12 sums and accumulators): each broadcast of x feeds
// 3 vpdpbusd, where the 8-row pass spent one broadcast a vpdpbusd. A prompt chunk's linears (512 rows) then took 0.83x
// the time (5.4 against 4.5 G vpdpbusd/s, AMD EPYC Zen 5, which issues two a cycle); 2 tiles 0.85x; 8 rows over 2
// tiles spilled the registers (1.2x).
constexpr int PASS_TILES = 3;
constexpr int PASS_ROWS = 4;
using Sums = __m512i;
using Floats = __m512;
inline Sums block_start(const int32_t* offset) {
  return _mm512_set1_epi32(*offset);  // takes back the 128 each packed byte carries
}
inline Sums load_w(const uint8_t* w) { return _mm512_loadu_si512(w); }  // u8: q + 128
inline Sums dot(Sums sum, Sums packed, int32_t four) {
  return _mm512_dpbusd_epi32(sum, packed, _mm512_set1_epi32(four));
}
inline Floats add_block(Floats acc, Sums sum, float sx) {
  return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(sx)));
}
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

// 16 of x's values as fp32; bf16 widens exactly.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The permutations that fold 16 vectors into one, lane b of which is a reduction of vector b's lanes (`fold`): at
// step s, each of two vectors holds 2^s blocks' partial results in runs of 16 >> s lanes, and the first (FOLD[s][0])
// and second (FOLD[s][1]) halves of those runs, side by side, make one vector of twice the blocks in half the lanes.
struct FoldIndex {
  alignas(64) int32_t lanes[4][2][16];
};
constexpr FoldIndex fold_index() {
  FoldIndex index{};
  for (int step = 0; step < 4; step++) {
    const int run = 16 >> step, half = run / 2, per_vector = 1 << step;
    for (int lane = 0; lane < 16; lane++) {
      const int block = lane / half, first = (block < per_vector ? 0 : 16) + block % per_vector * run + lane % half;
      index.lanes[step][0][lane] = first;
      index.lanes[step][1][lane] = first + half;
    }
  }
  return index;
}
constexpr FoldIndex FOLD = fold_index();

// Lane b: `op` (max or add, on int32 lanes) over the 16 lanes of v[b], for 16 vectors at once: 15 folds of two
// permutes and one op, where reducing each vector alone takes 8 dependent operations (v is overwritten).
template <typename Op>
inline __m512i fold(__m512i* v, Op op) {
#pragma GCC unroll 4
  for (int step = 0, count = 16; step < 4; step++, count /= 2) {
    const __m512i first = _mm512_load_si512(FOLD.lanes[step][0]), second = _mm512_load_si512(FOLD.lanes[step][1]);
#pragma GCC unroll 8
    for (int j = 0; j < count / 2; j++)
      v[j] = op(_mm512_permutex2var_epi32(v[2 * j], first, v[2 * j + 1]),
                _mm512_permutex2var_epi32(v[2 * j], second, v[2 * j + 1]));
  }
  return v[0];
}

// A whole block's |x| as fp32 bits, folded to 16 int32 lanes by max: for non-negative floats the order of their bits
// as integers is theirs, and an infinity or a NaN (bits from 0x7F800000 up) stays the max, where a float max drops
// NaNs. bf16 x is compared as its 16 bits, which are the fp32 value's upper half.
inline __m512i block_max_bits(const float* x) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  return _mm512_max_epi32(_mm512_and_si512(_mm512_loadu_si512(x), magnitude),
                          _mm512_and_si512(_mm512_loadu_si512(x + 16), magnitude));
}
inline __m512i block_max_bits(const c10::BFloat16* x) {
  const __m512i values = _mm512_and_si512(_mm512_loadu_si512(x), _mm512_set1_epi16(0x7FFF));  // 32 of them
  const __m512i low = _mm512_and_si512(values, _mm512_set1_epi32(0xFFFF)), high = _mm512_srli_epi32(values, 16);
  return _mm512_slli_epi32(_mm512_max_epi32(low, high), 16);
}

// `count` <= 16 whole blocks of one row (x their values, q their int8s) as `quantize_block` quantizes each, their
// scales and offsets at `scale[GROUP * b]` and `offset[GROUP * b]`: each block's max, scale and sum in a lane of its
// own, so the reductions, the checks and the divisions are shared by 16 blocks. The same operations on each value,
// so the same bits.
template <typename T>
inline void quantize_blocks(const T* x, int64_t count, int8_t* q, float* scale, int32_t* offset) {
  __m512i folded[16];
#pragma GCC unroll 16
  for (int b = 0; b < 16; b++) folded[b] = b < count ? block_max_bits(x + BLOCK * b) : _mm512_setzero_si512();
  const __m512i bits = fold(folded, [](__m512i a, __m512i b) { return _mm512_max_epi32(a, b); });
  const __mmask16 bad = _mm512_cmpge_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));  // a NaN or an infinity
  const __m512 amax = _mm512_castsi512_ps(bits);
  const __m512 factor = _mm512_div_ps(_mm512_set1_ps(127.0f), amax);
  const __mmask16 zeroed = bad | _mm512_cmp_ps_mask(amax, _mm512_set1_ps(TINY), _CMP_LT_OQ);  // q 0, offset 0
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
#pragma GCC unroll 16
  for (int b = 0; b < 16; b++) {
    folded[b] = _mm512_setzero_si512();  // now each block's integer sum
    if (b >= count) continue;
    if (zeroed >> b & 1) {
      std::memset(q + BLOCK * b, 0, BLOCK);
      continue;
    }
    const __m512 inv = _mm512_permutexvar_ps(_mm512_set1_epi32(b), factor);
    for (int h = 0; h < 2; h++) {
      const __m512i i32 = _mm512_min_epi32(
          _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + BLOCK * b + 16 * h), inv)), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + BLOCK * b + 16 * h), _mm512_cvtepi32_epi8(i32));
      folded[b] = _mm512_add_epi32(folded[b], i32);
    }
  }
  alignas(64) float scales[16];
  alignas(64) int32_t offsets[16];
  const __m512 kept = _mm512_maskz_div_ps(static_cast<__mmask16>(~zeroed), amax, _mm512_set1_ps(127.0f));
  _mm512_store_ps(scales, _mm512_mask_mov_ps(kept, bad, _mm512_set1_ps(NAN)));
  const __m512i sums = fold(folded, [](__m512i a, __m512i b) { return _mm512_add_epi32(a, b); });
  _mm512_store_si512(offsets, _mm512_mullo_epi32(_mm512_set1_epi32(-128), sums));
  for (int64_t b = 0; b < count; b++) {
    scale[GROUP * b] = scales[b];
    offset[GROUP * b] = offsets[b];
  }
}

// Row r of x into `out`: its whole blocks 16 at a time (`quantize_blocks`), a shorter last one alone (on AVX2: one
// block a row at most, and none where K is a multiple of 32).
template <typename T>
void quantize_row(const T* x, int64_t K, Quantized& out, int64_t r) {
  int8_t* q = out.q.get() + r * out.stride;
  const int64_t whole = K / BLOCK;
  for (int64_t b = 0; b < whole; b += 16) {
    const int64_t at = out.at(r, b);
    quantize_blocks(x + b * BLOCK, std::min<int64_t>(16, whole - b), q + b * BLOCK, out.scale.get() + at,
                    out.offset.get() + at);
  }
  if (whole < out.blocks) {
    const int64_t at = out.at(r, whole);
    out.scale[at] = quantize_block(x + whole * BLOCK, K - whole * BLOCK, q + whole * BLOCK, out.offset.get() + at);
  }
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
// the tile for the float accumulation in VNNI's order: the same integers and float operations, so the same bits.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#endif
namespace amx {
constexpr int64_t W_BLOCK = TILE * BLOCK;  // bytes of one block of a packed tile
// rows of x per pass over W here (their scratch: 256 * K bytes, in L2; the other variants' passes take 64), each
// tile's signed copy made once per pass
constexpr int64_t ROW_CHUNK = 256;
// Groups of AMX_ROWS rows from which a call's tiles are signed first (`signed_tile`): on an Intel Xeon with AMX the
// copy cost 1.02-1.35x the time at 20-32 rows (one or two groups to pay for it) and took 0.86-1.02x from 128 rows.
constexpr int64_t SIGNED_MIN_GROUPS = 4;
static_assert(AMX_ROWS == 2 * GROUP && ROW_CHUNK % AMX_ROWS == 0, "a product's rows are two groups of `Quantized`");

// Tiles 0, 1: a block's sums (`rows` rows of x, up to 16, x 16 outputs, int32); 2, 3: x's rows of that block (32
// bytes each); 4, 5: W's block (8 rows of 4 bytes x 16 outputs). Blocks alternate between the two sets, so the next
// block's product is asked for before a block's sums are scaled. A group of fewer rows runs on tiles of that many:
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

// Where dot_tile's rows' block scales and offsets lie: block b of row r < 8 at `first[GROUP * b + r]`, of row r >= 8
// at `second[GROUP * b + r - 8]` (`Quantized::at`), as pointers the compiler need not load again after a tile store.
template <typename T>
struct RowPair {
  const T* first;
  const T* second;
  T of(int64_t b, int64_t r) const { return r < GROUP ? first[GROUP * b + r] : second[GROUP * b + r - GROUP]; }
};

// Block b's sums (plus the offsets that take back the 128 each packed byte carries, unless SIGNED) added to acc as
// VNNI adds them. FULL: a group of AMX_ROWS rows, its loop unrolled so that acc stays in registers (else `count`).
template <bool FULL, bool SIGNED>
inline void add_block(const int32_t (*sums)[TILE], RowPair<float> scale, RowPair<int32_t> offset, int64_t b,
                      int64_t count, __m512* acc) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < (FULL ? AMX_ROWS : count); r++) {
    __m512i exact = _mm512_load_si512(sums[r]);
    if constexpr (!SIGNED) exact = _mm512_add_epi32(_mm512_set1_epi32(offset.of(b, r)), exact);
    acc[r] = vnni::add_block(acc[r], exact, scale.of(b, r));
  }
}

// y for x's rows [row, row + count) (count <= 16: the tiles are configured for it; row a multiple of GROUP) and W's
// tile t at `w` (signed: `signed_tile`, or as packed). A block's sums are scaled only once the next block's product
// is asked for and its sums stored, so the tiles work while the vector units scale. `fetch` (a tile's first group
// of rows; else nullptr): the packed tile, whose bytes PREFETCH ahead each pair of blocks asks L2 for. Without, a
// decode step's 24-64 rows over SmolLM2's weights took 1.06-1.22x the time (Intel Xeon with AMX, model 167).
template <bool FULL, bool SIGNED>
inline void dot_tile(const Operands& o, int64_t row, int64_t count, int64_t t, const void* w, const uint8_t* fetch) {
  __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t sums[2][AMX_ROWS][TILE];
  const int64_t blocks = o.x.blocks, stride = o.x.stride;
  const int8_t* x = o.x.q.get() + row * stride;
  const auto* wb = static_cast<const uint8_t*>(w);
  const int64_t at0 = o.x.at(row, 0), at1 = count > GROUP ? o.x.at(row + GROUP, 0) : at0;
  const RowPair<float> scale{o.x.scale.get() + at0, o.x.scale.get() + at1};
  const RowPair<int32_t> offset{o.x.offset.get() + at0, o.x.offset.get() + at1};
  start_block<0, SIGNED>(x, stride, wb);
  for (int64_t b = 0; b < blocks; b += 2) {  // block b on tiles of set 0, b + 1 on set 1
    if (fetch)
      for (int64_t line = 0; line < 2 * W_BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(fetch + b * W_BLOCK + PREFETCH + line), _MM_HINT_T1);
    if (b + 1 < blocks) start_block<1, SIGNED>(x + (b + 1) * BLOCK, stride, wb + (b + 1) * W_BLOCK);
    store_sums<0>(sums[0]);
    if (b > 0) add_block<FULL, SIGNED>(sums[1], scale, offset, b - 1, count, acc);
    if (b + 1 < blocks) {
      if (b + 2 < blocks) start_block<0, SIGNED>(x + (b + 2) * BLOCK, stride, wb + (b + 2) * W_BLOCK);
      store_sums<1>(sums[1]);
      add_block<FULL, SIGNED>(sums[0], scale, offset, b, count, acc);
    }
  }
  // the last block's sums: stored, not yet added
  add_block<FULL, SIGNED>(sums[(blocks - 1) % 2], scale, offset, blocks - 1, count, acc);
#pragma GCC unroll 16
  for (int64_t r = 0; r < (FULL ? AMX_ROWS : count); r++) {
    const __m512 out = acc[r];  // a copy: acc's own address never escapes, so it stays in registers
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
  const int64_t tiles = (N + TILE - 1) / TILE, stride = (K + BLOCK - 1) / BLOCK * BLOCK;
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
        "x @ W.T + b on packed int8 weights (per-channel scales) and x quantized per block of 32",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("wscale"), pybind11::arg("bias"),
        pybind11::arg("isa") = "");
  m.attr("block") = BLOCK;
  m.attr("tile") = TILE;
  m.def("isa", &best_isa, "the variant that runs by default on this many rows of x", pybind11::arg("rows"));
}
