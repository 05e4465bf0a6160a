// What every paged decode kernel checks of its call (the bf16 build's paged_decode and amx_decode, the fp32 build's
// paged_decode; each checks its dtype first): the shapes, and that each sequence's blocks lie in the cache, so a bad
// table fails with its reason rather than reading outside the cache; and how they split a call's decodes over
// torch's threads (`parallel_for_keys`). No ISA-specific code: both builds include it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace batcher {

// query [B, H, D]; k_cache, v_cache [rows, Hkv, D]; block_tables [B, W] (int64); context_lens [B] (int64).
struct DecodeCall {
  torch::Tensor query, block_tables, context_lens;  // contiguous
  int64_t batch = 0, heads = 0, dim = 0, kv_heads = 0, width = 0;
  int group = 0;  // query heads per KV head

  const int64_t* table(int64_t b) const { return block_tables.data_ptr<int64_t>() + b * width; }
  int64_t length(int64_t b) const { return context_lens.data_ptr<int64_t>()[b]; }
};

inline DecodeCall decode_call(const char* kernel, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& context_lens, int64_t block_size, int max_group) {
  TORCH_CHECK(query.dim() == 3, "the query must be [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "the KV cache must be contiguous, [rows, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  DecodeCall c;
  c.query = query.contiguous();
  c.block_tables = block_tables.contiguous();
  c.context_lens = context_lens.contiguous();
  c.batch = query.size(0), c.heads = query.size(1), c.dim = query.size(2), c.kv_heads = k_cache.size(1);
  TORCH_CHECK(c.dim == 64 || c.dim == 128, kernel, " supports head_dim 64 and 128, not ", c.dim);
  TORCH_CHECK(c.heads % c.kv_heads == 0 && c.heads / c.kv_heads <= max_group, kernel, " supports 1 to ", max_group,
              " query heads per KV head, not ", c.heads, " over ", c.kv_heads);
  TORCH_CHECK(k_cache.size(2) == c.dim && c.block_tables.dim() == 2 && c.block_tables.size(0) == c.batch &&
              c.context_lens.numel() == c.batch, "mismatched shapes");
  c.width = c.block_tables.size(1);
  c.group = static_cast<int>(c.heads / c.kv_heads);
  const int64_t rows = k_cache.size(0);
  for (int64_t b = 0; b < c.batch; b++) {
    const int64_t length = c.length(b);
    TORCH_CHECK(length >= 1 && length <= c.width * block_size, "context length ", length, " of sequence ", b,
                " is not covered by its ", c.width, " blocks");
    for (int64_t i = 0; i < (length + block_size - 1) / block_size; i++)  // the blocks it reads
      TORCH_CHECK(c.table(b)[i] >= 0 && (c.table(b)[i] + 1) * block_size <= rows, "block ", c.table(b)[i],
                  " is outside the cache");
  }
  return c;
}

// A unit's work that does not grow with its keys (its queries' load, its output), counted as this many keys.
constexpr int64_t UNIT_KEYS = 32;

// body(begin, end) over units [0, batch * per_sequence) (unit u: sequence u / per_sequence), once per thread of
// torch's, each a run of consecutive units of about equal keys. A unit's time follows its sequence's keys, so
// at::parallel_for's equal counts of units left one thread waiting on the other: 2 threads ran 8 decodes of 100-3000
// keys 1.59-1.63x one thread's pace, 32 of 300-2000 1.81-1.91x; split by keys 1.80-2.01x and 1.85-2.08x (the three
// decode kernels, Intel Xeon with AMX). Consecutive units keep a sequence's KV heads on one thread, as each cache row
// holds them all side by side (units dealt out one at a time to whichever thread was free ran slower than the
// split by counts). Which thread runs a unit changes none of its bits.
template <typename Body>
void parallel_for_keys(const DecodeCall& c, int64_t per_sequence, const Body& body) {
  const int64_t units = c.batch * per_sequence;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), units);
  if (parts <= 1) {
    body(0, units);
    return;
  }
  std::vector<int64_t> middle(units);  // twice the keys before each unit's middle
  int64_t total = 0;
  for (int64_t u = 0; u < units; u++) {
    const int64_t keys = c.length(u / per_sequence) + UNIT_KEYS;
    middle[u] = 2 * total + keys;
    total += keys;
  }
  // Part p takes the units whose middle lies in [p, p + 1) parts of all keys.
  auto first = [&](int64_t p) {
    return std::partition_point(middle.begin(), middle.end(), [&](int64_t m) { return parts * m < 2 * p * total; }) -
           middle.begin();
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) body(first(p), first(p + 1));
  });
}

}  // namespace batcher
