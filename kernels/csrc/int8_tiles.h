// The int8 kernel's pass over W, included once per instruction set (kernels/csrc/int8_linear.cpp): each
// inclusion sits in a namespace of its own that first defines `dot4(ax, sw)`, the 8 int32 lanes of one block's
// exact dot (lane i: bytes 4i..4i+3 of |qx| times the weights carrying x's signs). Every variant computes the same
// integers in the same lanes, so they give the same bits.

// y[r][n + j] for R rows of x from `row` (r < R) and W's rows n + j (j < WN). With `prefetch` (a group's first
// pass), each block also asks for the WN * 32 bytes of W that lie PREFETCH ahead: W's rows are short streams
// (K bytes each) that the hardware prefetchers barely learn, so a weight that does not fit the caches streamed at
// a quarter of the memory's pace without it (7 GB/s against 30, one row, 576 x 98304 on an AMD EPYC Zen 4).
template <int R, int WN>
inline void dot_rows(const Operands& o, int64_t row, int64_t n, bool prefetch) {
  __m256 acc[R][WN];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) acc[r][j] = _mm256_setzero_ps();
  const int8_t* qx = o.x.q.data() + row * o.x.stride;
  const float* sx = o.x.scale.data() + row * o.x.blocks;
  const int8_t* w_row = o.w + n * o.K;
  auto block = [&](int64_t b, const __m256i (&wv)[WN]) {
    for (int r = 0; r < R; r++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * o.x.stride + b * BLOCK));
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      const __m256 s = _mm256_set1_ps(sx[r * o.x.blocks + b]);
      for (int j = 0; j < WN; j++) {
        const __m256 dot = _mm256_cvtepi32_ps(dot4(ax, _mm256_sign_epi8(wv[j], xv)));
        acc[r][j] = _mm256_fmadd_ps(dot, s, acc[r][j]);
      }
    }
  };
  const int64_t full = o.K / BLOCK;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w_row) + PREFETCH;  // (past W's end: a no-op)
  for (int64_t b = 0; b < full; b++) {
    if (prefetch)
      for (int line = 0; line < WN * BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * WN * BLOCK + line), _MM_HINT_T0);
    __m256i wv[WN];  // (declared here, so the compiler keeps them in registers)
    for (int j = 0; j < WN; j++)
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + j * o.K + b * BLOCK));
    block(b, wv);
  }
  if (full < o.x.blocks) {  // the last, shorter block: x's scratch holds zeros past K
    __m256i wv[WN];
    alignas(32) int8_t tail[WN][BLOCK] = {};
    for (int j = 0; j < WN; j++) {
      std::memcpy(tail[j], w_row + j * o.K + full * BLOCK, o.K - full * BLOCK);
      wv[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[j]));
    }
    block(full, wv);
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < WN; j++) {
      const float scaled = o.wscale[n + j] * hsum(acc[r][j]);
      const float out = o.bias ? scaled + o.bias[n + j] : scaled;
      if (o.y_bf16)
        o.y_bf16[(row + r) * o.N + n + j] = c10::BFloat16(out);
      else
        o.y[(row + r) * o.N + n + j] = out;
    }
}

// Rows [begin, end) of x against W's rows n..n+WN-1, which stay in the cache between passes.
template <int WN>
void all_rows(const Operands& o, int64_t begin, int64_t end, int64_t n) {
  int64_t r = begin;
  for (; r + X_ROWS <= end; r += X_ROWS) dot_rows<X_ROWS, WN>(o, r, n, r == begin);
  static_assert(X_ROWS == 2 || X_ROWS == 4, "rows are left in a pair and one at most");
  if (X_ROWS == 4 && r + 2 <= end) {
    dot_rows<2, WN>(o, r, n, r == begin);
    r += 2;
  }
  if (r < end) dot_rows<1, WN>(o, r, n, r == begin);
}

// y for every row of x: threads split W's rows in groups of W_ROWS, each group met by ROW_CHUNK rows at a time.
inline void pass_over_w(const Operands& o, int64_t rows) {
  const int64_t N = o.N;
  at::parallel_for(0, (N + W_ROWS - 1) / W_ROWS, GRAIN / W_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      for (int64_t group = begin; group < end; group++) {
        const int64_t n = W_ROWS * group;
        if (n + W_ROWS <= N) {
          all_rows<W_ROWS>(o, first, last, n);
        } else {
          for (int64_t one = n; one < N; one++) all_rows<1>(o, first, last, one);
        }
      }
    }
  });
}
