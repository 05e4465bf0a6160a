// The int8 kernel's pass over the packed W, included once per instruction set (kernels/csrc/int8_linear.cpp): each
// inclusion sits in a namespace of its own that first defines
// - X_ROWS (rows of x per pass), VECTORS (vectors per tile of 16 outputs: 2 of 256 bits, or 1 of 512), and the
//   integer (`Sums`) and float (`Floats`) vector types;
// - `block_start(offset)`: what a block's integer sums start from, given its offset (`Quantized`);
// - `load_w(w)`: the packed vector at w, ready for `dot`;
// - `dot(sum, w, four)`: `sum` plus, in lane j, the exact dot of x's 4 bytes `four` with output j's 4 bytes of w;
// - `add_block(acc, sum, sx)`: acc + (the sums as fp32) * sx, each operation rounded (no FMA);
// - `finish<R>(o, row, n, acc)`: y's R rows from `row`, outputs n.. of one vector: acc * wscale + bias, stored.
// - ONE_ROW_TILES: W's tiles that one row of x reads side by side (`one_row_tiles`), or 1: a tile at a time.
// Every variant computes the same integer block sums and float operations per output, so they give the same bits.

// y[r][16 t .. 16 t + 16) for R rows of x from `row` (r < R) and W's tile t. With PREFETCH (the tile's first
// pass), each step also asks L2 for the cache line `ahead` bytes ahead: the hardware prefetchers alone streamed a
// weight that does not fit the caches at ~0.6x the pace (the 49152 x 576 LM head at one row, AMD EPYC Zen 4). Asked
// of L1 instead, SmolLM2's weights streamed at 0.8-0.85x the pace at 4-8 rows, the same at one.
static_assert(GROUP % X_ROWS == 0 && ROW_CHUNK % GROUP == 0, "each pass's rows lie in one group of `Quantized`");
template <int R, bool PREFETCH>
inline void dot_rows(const Operands& o, int64_t row, int64_t t) {
  Floats acc[R][VECTORS];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < VECTORS; v++) acc[r][v] = Floats{};
  const int8_t* qx = o.x.q.data() + row * o.x.stride;
  const float* sx = o.x.scale.data() + o.x.at(row, 0);  // block b of row + r: sx[GROUP * b + r]
  const int32_t* offset = o.x.offset.data() + o.x.at(row, 0);
  const uint8_t* w = o.w + t * o.tile_bytes;  // read front to back: 64 bytes (one cache line) a step
  constexpr int64_t ahead = R == 1 ? PREFETCH_ONE_ROW : PREFETCH;
  for (int64_t b = 0; b < o.x.blocks; b++) {
    Sums sum[R][VECTORS];
    for (int r = 0; r < R; r++)
      for (int v = 0; v < VECTORS; v++) sum[r][v] = block_start(offset + GROUP * b + r);
    for (int step = 0; step < BLOCK / 4; step++, w += 64) {  // 4 bytes of K for 16 outputs
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T1);  // (past W: a no-op)
      Sums wv[VECTORS];
      for (int v = 0; v < VECTORS; v++) wv[v] = load_w(w + 64 / VECTORS * v);
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, qx + r * o.x.stride + b * BLOCK + 4 * step, 4);
        for (int v = 0; v < VECTORS; v++) sum[r][v] = dot(sum[r][v], wv[v], four);
      }
    }
    for (int r = 0; r < R; r++)  // the reference's order: the block's scaled sum, then added
      for (int v = 0; v < VECTORS; v++) acc[r][v] = add_block(acc[r][v], sum[r][v], sx[GROUP * b + r]);
  }
  for (int v = 0; v < VECTORS; v++) {
    const int64_t n = TILE * t + TILE / VECTORS * v;
    if (n >= o.N) break;  // the tile's padding past N
    Floats out[R];
    for (int r = 0; r < R; r++) out[r] = acc[r][v];
    finish<R>(o, row, n, out);
  }
}

// `dot_rows` with its prefetch chosen once a pass: a test of it at every step cost 2-3% of the time at 32-512 rows
// (AMD EPYC Zen 4).
template <int R>
inline void dot_tile(const Operands& o, int64_t row, int64_t t, bool prefetch) {
  if (prefetch)
    dot_rows<R, true>(o, row, t);
  else
    dot_rows<R, false>(o, row, t);
}

// The rows from `r` to `end` (fewer than 2 R) in passes of R, R / 2, ... 1 rows.
template <int R>
inline void rest(const Operands& o, int64_t r, int64_t end, int64_t t, bool prefetch) {
  if (r + R <= end) {
    dot_tile<R>(o, r, t, prefetch);
    r += R;
    prefetch = false;
  }
  if constexpr (R > 1) rest<R / 2>(o, r, end, t, prefetch);
}

// Rows [begin, end) of x against W's tile t, which stays in the cache between passes.
inline void all_rows(const Operands& o, int64_t begin, int64_t end, int64_t t) {
  int64_t r = begin;
  for (; r + X_ROWS <= end; r += X_ROWS) dot_tile<X_ROWS>(o, r, t, r == begin);
  rest<X_ROWS / 2>(o, r, end, t, r == begin);
}

// y's one row (x has one row) for W's tiles t .. t + S, read side by side: S streams of memory, the block's dots of
// each tile summed and scaled as `dot_rows<1>` sums and scales them, so the same bits. One core of an AMD EPYC Zen 1
// read W at ~6-7 GB/s as one stream, with or without software prefetch, and at ~9-10 GB/s as 4-8 streams.
template <int S>
inline void one_row_tiles(const Operands& o, int64_t t) {
  Floats acc[S][VECTORS];
  for (int s = 0; s < S; s++)
    for (int v = 0; v < VECTORS; v++) acc[s][v] = Floats{};
  const int8_t* qx = o.x.q.data();
  const float* sx = o.x.scale.data() + o.x.at(0, 0);
  const int32_t* offset = o.x.offset.data() + o.x.at(0, 0);
  const uint8_t* w = o.w + t * o.tile_bytes;
  for (int64_t b = 0; b < o.x.blocks; b++) {
    Sums sum[S][VECTORS];
    for (int s = 0; s < S; s++)
      for (int v = 0; v < VECTORS; v++) sum[s][v] = block_start(offset + GROUP * b);
    for (int step = 0; step < BLOCK / 4; step++, w += 64) {
      int32_t four;
      std::memcpy(&four, qx + b * BLOCK + 4 * step, 4);
      for (int s = 0; s < S; s++)
        for (int v = 0; v < VECTORS; v++)
          sum[s][v] = dot(sum[s][v], load_w(w + s * o.tile_bytes + 64 / VECTORS * v), four);
    }
    for (int s = 0; s < S; s++)
      for (int v = 0; v < VECTORS; v++) acc[s][v] = add_block(acc[s][v], sum[s][v], sx[GROUP * b]);
  }
  for (int s = 0; s < S; s++)
    for (int v = 0; v < VECTORS; v++) {
      const int64_t n = TILE * (t + s) + TILE / VECTORS * v;
      if (n >= o.N) break;  // the tile's padding past N
      const Floats out = acc[s][v];  // a copy: acc's own address never escapes, so it stays in registers
      finish<1>(o, 0, n, &out);
    }
}

// y for every row of x: threads split W's tiles, each tile met by ROW_CHUNK rows at a time (one row: ONE_ROW_TILES
// tiles at a time).
inline void pass_over_w(const Operands& o, int64_t rows) {
  at::parallel_for(0, (o.N + TILE - 1) / TILE, std::max<int64_t>(1, GRAIN / TILE), [&](int64_t begin, int64_t end) {
    if constexpr (ONE_ROW_TILES > 1) {
      if (rows == 1) {
        int64_t t = begin;
        for (; t + ONE_ROW_TILES <= end; t += ONE_ROW_TILES) one_row_tiles<ONE_ROW_TILES>(o, t);
        for (; t < end; t++) all_rows(o, 0, 1, t);
        return;
      }
    }
    for (int64_t first = 0; first < rows; first += ROW_CHUNK) {
      const int64_t last = std::min(rows, first + ROW_CHUNK);
      for (int64_t t = begin; t < end; t++) all_rows(o, first, last, t);
    }
  });
}
