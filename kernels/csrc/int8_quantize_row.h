// One row of x quantized block by block into a `Quantized` (kernels/csrc/int8_linear.cpp), included once per
// instruction set after that set's `quantize_block`: the AVX2 one at the top, the AVX-512 one in namespace vnni.

// Row r of x (`x` its K values) into `out`.
template <typename T>
void quantize_row(const T* x, int64_t K, Quantized& out, int64_t r) {
  for (int64_t b = 0, at = out.at(r, 0); b < out.blocks; b++, at += GROUP)
    out.scale[at] = quantize_block(x + b * BLOCK, std::min<int64_t>(BLOCK, K - b * BLOCK),
                                   out.q.data() + r * out.stride + b * BLOCK, out.offset.data() + at);
}
