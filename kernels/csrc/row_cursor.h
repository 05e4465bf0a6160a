// The walk of a sequence's cache rows, which both builds' attention kernels share (no ISA-specific code).
#pragma once

#include <cstdint>

namespace batcher {

// Walks a sequence's positions in order, giving each one's cache row without a division per position.
struct RowCursor {
  const int64_t* table;
  int64_t block_size, block = 0, offset = 0;
  int64_t next() {
    const int64_t row = table[block] * block_size + offset;
    if (++offset == block_size) {
      offset = 0;
      block++;
    }
    return row;
  }
};

}  // namespace batcher
