// Decode attention on Intel AMX in amx_prefill's arithmetic (kernels/native.py builds and loads this file with
// cpu_kernels.cpp, which binds it): one query token per sequence attends to its keys straight from the paged
// cache, the query heads of a KV head in the lanes where amx_prefill keeps a tile's 16 positions.
//
// Why: a tile product's element depends on its own row and column alone, and the online softmax works lane by
// lane, so a query head run in lane g of this kernel gets the bits a prompt position gets in amx_prefill. Prompt
// chunks can then take amx_prefill (4.3-4.4x avx512_prefill's pace at 512-token chunks, Intel Xeon with AMX) with
// batch invariance kept, where they took avx512_prefill, whose arithmetic only paged_decode shares.
//
// A step of 32 keys is read in amx_prefill's layouts (pack_head's, a step at a time): 16 keys of one block are a
// tile as they lie in the cache (else copied out), and values are interleaved in key pairs. The next step's cache
// lines are asked for as a step begins (keys) and after its softmax (values), a sequence's rows of one KV head
// being strided and its blocks scattered: asked in one short loop, they held the step up (1.32x its time).

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_call.h"
#include "prefill.h"

using namespace batcher::prefill;

namespace {

// One sequence's `group` query heads of one KV head (rows of q, `D` apart), over `length` positions. The tile
// products are amx_prefill's (lane g: query head g); the softmax between them runs per head with its 32 keys in
// two vectors, in OnlineSoftmax's operations (the decode kernel's layout, cpu_kernels.cpp): a tile's 16 lanes
// would carry 13 idle ones for a model of 3 query heads per KV head.
template <int D>
void decode_head(const uint16_t* q, int group, const uint16_t* k_cache, const uint16_t* v_cache, int64_t row_stride,
                 const int64_t* table, int64_t length, int64_t block_size, float scale, uint16_t* out) {
  constexpr int DIM_BLOCKS = D / 32;
  constexpr int MAX_GROUP = batcher::kMaxGroup;
  alignas(64) uint32_t queries_t[D / 2][16] = {};  // dimension pairs x lanes (a query head each; zeros past group)
  for (int g = 0; g < group; g++)
    for (int p = 0; p < D / 2; p++) queries_t[p][g] = reinterpret_cast<const uint32_t*>(q + g * D)[p];
  alignas(64) uint16_t keys[KEYS][D];     // a step's keys as rows where they are not already (zeros past the end)
  alignas(64) uint16_t values[KEYS * D];  // the step's values in pack_head's layout
  alignas(64) float scores[KEYS][ROWS];
  alignas(64) uint16_t weights[ROWS][KEYS] = {};  // a row per head (zeros past group)
  alignas(64) float acc[MAX_GROUP][D] = {};
  float alpha[MAX_GROUP];
  KeyLanesSoftmax softmax[MAX_GROUP];
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __m512i first16 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i last16 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512i zero = _mm512_setzero_si512();
  int64_t rows_now[KEYS], rows_next[KEYS];
  batcher::RowCursor cursor{table, block_size};
  auto next_rows = [&](int64_t t0) {
    const int64_t n = std::clamp<int64_t>(length - t0, 0, KEYS);
    for (int t = 0; t < n; t++) rows_next[t] = cursor.next();
    return static_cast<int>(n);
  };
  auto fetch = [&](const uint16_t* cache, int64_t row) {
    for (int line = 0; line < D * 2; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + row * row_stride) + line, _MM_HINT_T1);
  };
  const bool whole_blocks = block_size % 16 == 0;
  int n_next = next_rows(0);
  for (int t = 0; t < n_next; t++) {
    fetch(k_cache, rows_next[t]);
    fetch(v_cache, rows_next[t]);
  }
  for (int64_t t0 = 0; t0 < length; t0 += KEYS) {
    const int n = n_next;
    std::copy(rows_next, rows_next + n, rows_now);
    n_next = next_rows(t0 + KEYS);
    for (int t = 0; t < n_next; t++) fetch(k_cache, rows_next[t]);
    // Keys: 16 whole rows of one block (blocks of a multiple of 16: a step's halves start at multiples of 16) are
    // a tile as they lie in the cache; else they are copied out, zeros past the end as in pack_head.
    const uint16_t* half_keys[2];
    int64_t half_stride[2];
    for (int h = 0; h < 2; h++) {
      const int first = 16 * h;
      if (whole_blocks && first + 16 <= n) {
        half_keys[h] = k_cache + rows_now[first] * row_stride;
        half_stride[h] = row_stride * 2;
        continue;
      }
      for (int t = first; t < first + 16; t++) {
        if (t < n)
          std::copy(k_cache + rows_now[t] * row_stride, k_cache + rows_now[t] * row_stride + D, keys[t]);
        else
          std::fill(keys[t], keys[t] + D, 0);
      }
      half_keys[h] = keys[first];
      half_stride[h] = D * 2;
    }
    _tile_zero(1);
    _tile_zero(2);
    for (int b = 0; b < DIM_BLOCKS; b++) {  // amx_prefill's products: scores[key][lane]
      _tile_loadd(3, queries_t[b * PAIRS], 64);
      _tile_loadd(0, half_keys[0] + b * 32, half_stride[0]);
      _tile_loadd(7, half_keys[1] + b * 32, half_stride[1]);
      _tile_dpbf16ps(1, 0, 3);
      _tile_dpbf16ps(2, 7, 3);
    }
    _tile_stored(1, scores[0], ROWS * 4);
    _tile_stored(2, scores[16], ROWS * 4);
    // Values, two keys interleaved as pack_head lays them; the next step's lines asked for meanwhile.
    for (int kp = 0; kp < PAIRS; kp++) {
      const uint16_t* even = 2 * kp < n ? v_cache + rows_now[2 * kp] * row_stride : nullptr;
      const uint16_t* odd = 2 * kp + 1 < n ? v_cache + rows_now[2 * kp + 1] * row_stride : nullptr;
      for (int half = 0; half < DIM_BLOCKS; half++) {
        const __m512i a = even ? _mm512_loadu_si512(even + 32 * half) : zero;
        const __m512i b = odd ? _mm512_loadu_si512(odd + 32 * half) : zero;
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        _mm512_store_si512(values + (2 * half) * KEY_TILE + kp * 32, _mm512_permutex2var_epi64(lo, first16, hi));
        _mm512_store_si512(values + (2 * half + 1) * KEY_TILE + kp * 32, _mm512_permutex2var_epi64(lo, last16, hi));
      }
    }
    // OnlineSoftmax's step for each head, its keys in lanes (keys 0-15, 16-31), as the decode kernel runs it.
    for (int g = 0; g < group; g++) {
      __m512 head_scores[2];  // column g of the score tiles
      for (int h = 0; h < 2; h++) {
        const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(256 * h + g));
        head_scores[h] = _mm512_i32gather_ps(at, &scores[0][0], 4);
      }
      alpha[g] = _mm512_cvtss_f32(softmax[g].step(head_scores, n, scale, reinterpret_cast<uint32_t*>(weights[g])));
    }
    for (int t = 0; t < n_next; t++) fetch(v_cache, rows_next[t]);
    _tile_loadd(4, weights[0], KEYS * 2);
    for (int group_start = 0; group_start < D; group_start += 64) {  // amx_prefill's products and sums
      const uint16_t* v = values + (group_start / 16) * KEY_TILE;
      add_weighted_values(v, group, alpha, &acc[0][group_start], D);
    }
  }
  for (int g = 0; g < group; g++) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_cvtss_f32(softmax[g].l));
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[g][d]), inv)));
  }
}

}  // namespace

// query [B, H, D]; k_cache, v_cache [rows, Hkv, D]; block_tables [B, W] (int64); context_lens [B] (int64).
torch::Tensor amx_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                         torch::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(batcher::amx_permitted(), "the OS refused this process AMX's tile state");
  batcher::check_bf16(query, "query");
  batcher::check_bf16(k_cache, "k_cache");
  batcher::check_bf16(v_cache, "v_cache");
  const batcher::DecodeCall c = batcher::decode_call("amx_decode", query, k_cache, v_cache, block_tables, context_lens,
                                                      block_size, batcher::kMaxGroup);
  auto out = torch::empty_like(c.query);
  const uint16_t* q = batcher::bf16_data(c.query);
  const uint16_t* k = batcher::bf16_data(k_cache);
  const uint16_t* v = batcher::bf16_data(v_cache);
  uint16_t* o = batcher::bf16_data(out);
  const int64_t row_stride = c.kv_heads * c.dim;
  const float s = static_cast<float>(scale);
  batcher::parallel_for_keys(c, c.kv_heads, [&](int64_t begin, int64_t end) {
    batcher::configure_tiles();
    for (int64_t i = begin; i < end; i++) {
      const int64_t b = i / c.kv_heads, h = i % c.kv_heads;
      const int64_t first = (b * c.heads + h * c.group) * c.dim;
      if (c.dim == 64)
        decode_head<64>(q + first, c.group, k + h * 64, v + h * 64, row_stride, c.table(b), c.length(b), block_size, s,
                        o + first);
      else
        decode_head<128>(q + first, c.group, k + h * 128, v + h * 128, row_stride, c.table(b), c.length(b), block_size,
                         s, o + first);
    }
    _tile_release();
  });
  return out;
}
