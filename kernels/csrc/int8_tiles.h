// The int8 kernel's pass over the packed W, included once per instruction set (kernels/csrc/int8_linear.cpp): each
// inclusion sits in a namespace of its own that first defines X_ROWS (rows of x per pass), `block_start(o, row, b)`
// (what a block's integer sums start from), `prepare(w)` and `dot8(sum, w, xb)`: `sum` plus, in lane j, the exact
// dot of x's 4 bytes (xb, broadcast to every lane) with output j's 4 bytes of the packed vector w. Every variant
// computes the same integer block sums, so they give the same bits.

// y[r][16 t .. 16 t + 16) for R rows of x from `row` (r < R) and W's tile t. With `prefetch` (the tile's first
// pass), each step also asks for the cache line PREFETCH bytes ahead: the hardware prefetchers alone streamed a
// weight that does not fit the caches at ~0.6x the pace (the 49152 x 576 LM head at one row, AMD EPYC Zen 4).
template <int R>
inline void dot_tile(const Operands& o, int64_t row, int64_t t, bool prefetch) {
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* qx = o.x.q.data() + row * o.x.stride;
  const float* sx = o.x.scale.data() + row * o.x.blocks;
  const uint8_t* w = o.w + t * o.tile_bytes;  // read front to back: 64 bytes (2 vectors) a step
  for (int64_t b = 0; b < o.x.blocks; b++) {
    __m256i sum[R][2];
    for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = block_start(o, row + r, b);
    for (int step = 0; step < BLOCK / 4; step++, w += 64) {  // 4 bytes of K for 16 outputs: one cache line
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH), _MM_HINT_T0);  // (past W: a no-op)
      const __m256i w0 = prepare(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      const __m256i w1 = prepare(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, qx + r * o.x.stride + b * BLOCK + 4 * step, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        sum[r][0] = dot8(sum[r][0], w0, xb);
        sum[r][1] = dot8(sum[r][1], w1, xb);
      }
    }
    for (int r = 0; r < R; r++) {  // the reference's order: the block's scaled sum, then added (no FMA)
      const __m256 s = _mm256_set1_ps(sx[r * o.x.blocks + b]);
      for (int v = 0; v < 2; v++)
        acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_mul_ps(_mm256_cvtepi32_ps(sum[r][v]), s));
    }
  }
  for (int v = 0; v < 2; v++) {
    const int64_t n = TILE * t + 8 * v, left = o.N - n;
    if (left <= 0) break;  // the tile's padding past N
    const __m256 scale = load8(o.wscale + n, left), bias = o.bias ? load8(o.bias + n, left) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
      __m256 out = _mm256_mul_ps(acc[r][v], scale);
      if (o.bias) out = _mm256_add_ps(out, bias);
      store8(o, (row + r) * o.N + n, left, out);
    }
  }
}

// Rows [begin, end) of x against W's tile t, which stays in the cache between passes.
inline void all_rows(const Operands& o, int64_t begin, int64_t end, int64_t t) {
  int64_t r = begin;
  for (; r + X_ROWS <= end; r += X_ROWS) dot_tile<X_ROWS>(o, r, t, r == begin);
  static_assert(X_ROWS == 2 || X_ROWS == 4, "rows are left in a pair and one at most");
  if (X_ROWS == 4 && r + 2 <= end) {
    dot_tile<2>(o, r, t, r == begin);
    r += 2;
  }
  if (r < end) dot_tile<1>(o, r, t, r == begin);
}

// y for every row of x: threads split W's tiles, each tile met by ROW_CHUNK rows at a time.
inline void pass_over_w(const Operands& o, int64_t rows) {
  at::parallel_for(0, (o.N + TILE - 1) / TILE, std::max<int64_t>(1, GRAIN / TILE), [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      for (int64_t t = begin; t < end; t++) all_rows(o, first, last, t);
    }
  });
}
