// write_kv: a step's keys and values into their rows of the paged cache, in one call for both (two index_copy_
// calls cost ~11 us each at a decode step's few rows). It copies bytes, so both builds bind it, for any dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t TOKENS_PER_TASK = 64;

// [T, kv_heads, head_dim] of the cache's dtype, each token's values one run of memory (its tokens may lie apart:
// a step's keys and values are views of one linear's output).
void check_step(const torch::Tensor& t, const char* name, const torch::Tensor& cache) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == cache.scalar_type(), name, " must be a CPU tensor of the ",
              "cache's dtype, ", cache.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.size(1) == cache.size(1) && t.size(2) == cache.size(2), name, " must be [tokens, ",
              cache.size(1), ", ", cache.size(2), "], not ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name, "'s tokens must be contiguous");
}

// key and value into the caches' rows slot_mapping[t]; a slot outside the cache is refused before any write.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be contiguous CPU tensors of one dtype, [rows, kv_heads, head_dim]");
  check_step(key, "key", k_cache);
  check_step(value, "value", k_cache);
  const int64_t T = key.size(0);
  TORCH_CHECK(value.size(0) == T && slot_mapping.numel() == T && slot_mapping.scalar_type() == torch::kLong,
              "slot_mapping must give one int64 slot per token");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rows = k_cache.size(0);
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < rows, "slot ", slot[t], " is outside the cache");
  const int64_t item = k_cache.element_size(), bytes = k_cache.size(1) * k_cache.size(2) * item;
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * item, v_stride = value.stride(0) * item;
  at::parallel_for(0, T, TOKENS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      std::memcpy(kc + slot[t] * bytes, kp + t * k_stride, bytes);
      std::memcpy(vc + slot[t] * bytes, vp + t * v_stride, bytes);
    }
  });
}

}  // namespace

void bind_kv_write(pybind11::module& m) {
  m.def("write_kv", &write_kv, "a step's keys and values into their cache rows");
}
