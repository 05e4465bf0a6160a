// The int8 kernel's pass over the packed W, included once per instruction set (kernels/csrc/int8_linear.cpp): each
// inclusion sits in a namespace of its own that first defines
// - X_ROWS (rows of x per pass over one tile, at most), EXACT_PASSES (a tile's rows in as few passes as hold them,
//   each of its exact count; else passes of X_ROWS and the rest in halves), VECTORS (vectors per tile of 16
//   outputs: 2 of 256 bits, or 1 of 512), and the integer (`Sums`) and float (`Floats`) vector types;
// - `block_start(offset)`: what a row's integer sums start from, given its offset (`Quantized`);
// - `load_w(w)`: the packed vector at w, ready for `dot`;
// - `dot(sum, w, four)`: `sum` plus, in lane j, the exact dot of x's 4 bytes `four` with output j's 4 bytes of w;
// - `scaled(sum, sx)`: the sums as fp32, times x's row scale sx;
// - `finish<R>(o, row, n, acc)`: y's R rows from `row`, outputs n.. of one vector: acc * wscale + bias, stored.
// - ONE_ROW_TILES: W's tiles that one row of x reads side by side where `one_row_side_by_side()` (this CPU's cores
//   stream W faster so), else a tile at a time;
// - PASS_TILES, PASS_ROWS: the tiles and rows of x a pass takes from PASS_TILES_MIN_ROWS rows (else 1 and X_ROWS).
// - ROW_CHUNK: the rows of x at most that meet W in one pass over it.
// Every variant computes the same integer block sums and float operations per output, so they give the same bits.

// y[r][16 t .. 16 (t + T)) for R rows of x from `row` (r < R) and W's T tiles from t, read side by side: each of x's
// broadcasts feeds T dots. With FIRST_PASS (the tiles' first pass), each step also asks L2 for each tile's cache line
// `ahead` bytes ahead: the hardware prefetchers alone streamed a weight that does not fit the caches at ~0.6x the
// pace (the 49152 x 576 LM head at one row, AMD EPYC Zen 4). Asked of L1 instead, SmolLM2's weights streamed at
// 0.8-0.85x the pace at 4-8 rows, the same at one.
template <int R, int T, bool FIRST_PASS>
inline void dot_rows(const Operands& o, int64_t row, int64_t t) {
  Sums sum[R][T][VECTORS];  // exact over the whole row: at most 127 * 255 * K in magnitude
  for (int r = 0; r < R; r++)
    for (int j = 0; j < T; j++)
      for (int v = 0; v < VECTORS; v++) sum[r][j][v] = block_start(o.x.offset.get() + row + r);
  const int8_t* qx = o.x.q.get() + row * o.x.stride;
  const uint8_t* w = o.w + t * o.tile_bytes;  // each tile read front to back: 64 bytes (one cache line) a step
  const int64_t ahead = R == 1 ? PREFETCH_ONE_ROW : T == 1 ? PREFETCH : T * o.tile_bytes;  // T: the next T tiles'
  for (int64_t b = 0; b < o.x.blocks; b++) {
#pragma GCC unroll 4
    for (int step = 0; step < BLOCK / 4; step++, w += 64) {  // 4 bytes of K for 16 outputs a tile
      Sums wv[T][VECTORS];
      for (int j = 0; j < T; j++) {
        const uint8_t* tile = w + j * o.tile_bytes;
        if (FIRST_PASS) _mm_prefetch(reinterpret_cast<const char*>(tile + ahead), _MM_HINT_T1);  // (past W: a no-op)
        for (int v = 0; v < VECTORS; v++) wv[j][v] = load_w(tile + 64 / VECTORS * v);
      }
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, qx + r * o.x.stride + b * BLOCK + 4 * step, 4);
        for (int j = 0; j < T; j++)
          for (int v = 0; v < VECTORS; v++) sum[r][j][v] = dot(sum[r][j][v], wv[j][v], four);
      }
    }
  }
  for (int j = 0; j < T; j++)
    for (int v = 0; v < VECTORS; v++) {
      const int64_t n = TILE * (t + j) + TILE / VECTORS * v;
      if (n >= o.N) break;  // the tile's padding past N
      Floats out[R];
      for (int r = 0; r < R; r++) out[r] = scaled(sum[r][j][v], o.x.scale[row + r]);
      finish<R>(o, row, n, out);
    }
}

// `dot_rows` with its prefetch chosen once a pass: a test of it at every step cost 2-3% of the time at 32-512 rows
// (AMD EPYC Zen 4).
template <int R, int T>
inline void dot_tiles(const Operands& o, int64_t row, int64_t t, bool first_pass) {
  if (first_pass)
    dot_rows<R, T, true>(o, row, t);
  else
    dot_rows<R, T, false>(o, row, t);
}

// The rows from `r` to `end` (fewer than 2 R) in passes of R, R / 2, ... 1 rows.
template <int R, int T>
inline void rest(const Operands& o, int64_t r, int64_t end, int64_t t, bool first_pass) {
  if (r + R <= end) {
    dot_tiles<R, T>(o, r, t, first_pass);
    r += R;
    first_pass = false;
  }
  if constexpr (R > 1) rest<R / 2, T>(o, r, end, t, first_pass);
}

// The rows [row, row + rows) against tile t in one pass of exactly that many (at most R).
template <int R>
inline void exact_pass(const Operands& o, int64_t row, int64_t rows, int64_t t, bool first_pass) {
  if (rows == R) return dot_tiles<R, 1>(o, row, t, first_pass);
  if constexpr (R > 1) exact_pass<R - 1>(o, row, rows, t, first_pass);
}

// Rows [begin, end) of x against W's T tiles from t, which stay in the cache between passes.
template <int T>
inline void all_rows(const Operands& o, int64_t begin, int64_t end, int64_t t) {
  if constexpr (T == 1 && EXACT_PASSES) {
    const int64_t passes = (end - begin + X_ROWS - 1) / X_ROWS, each = (end - begin + passes - 1) / passes;
    for (int64_t r = begin; r < end; r += each) exact_pass<X_ROWS>(o, r, std::min(each, end - r), t, r == begin);
    return;
  }
  constexpr int R = T == 1 ? X_ROWS : PASS_ROWS;
  int64_t r = begin;
  for (; r + R <= end; r += R) dot_tiles<R, T>(o, r, t, r == begin);
  rest<R / 2, T>(o, r, end, t, r == begin);
}

// y for every row of x: threads split W's tiles, each tile met by ROW_CHUNK rows at a time. One row reads
// ONE_ROW_TILES tiles side by side where `one_row_side_by_side()`, with no software prefetch: one core of an AMD
// EPYC Zen 1 read W at ~6-7 GB/s as one stream, with or without it, and at ~9-10 GB/s as 4-8 streams.
inline void pass_over_w(const Operands& o, int64_t rows) {
  const bool side_by_side = rows == 1 && one_row_side_by_side();
  at::parallel_for(0, (o.N + TILE - 1) / TILE, std::max<int64_t>(1, GRAIN / TILE), [&](int64_t begin, int64_t end) {
    if (side_by_side) {
      int64_t t = begin;
      for (; t + ONE_ROW_TILES <= end; t += ONE_ROW_TILES) dot_rows<1, ONE_ROW_TILES, false>(o, 0, t);
      for (; t < end; t++) all_rows<1>(o, 0, 1, t);
      return;
    }
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      int64_t t = begin;
      if (last - first >= PASS_TILES_MIN_ROWS)
        for (; t + PASS_TILES <= end; t += PASS_TILES) all_rows<PASS_TILES>(o, first, last, t);
      for (; t < end; t++) all_rows<1>(o, first, last, t);
    }
  });
}
