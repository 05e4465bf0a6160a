// What every AMX kernel asks first, in either build (bf16, int8): Linux lends a process AMX's tile state only
// once asked. oneDNN asks too, and asking again is harmless.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace batcher {

inline bool amx_permitted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

}  // namespace batcher
