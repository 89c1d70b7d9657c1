#pragma once
#include <memory>

#include "runtime/runtime.h"

namespace jax_engram {
// CUDA backend: windows made of cuMem segments (DEVICE on the member's GPU, HOST_NUMA next to it) in one
// VA range, shared with same-process peers by address and with other processes of the host by POSIX FD.
std::unique_ptr<Backend> make_cuda_backend();
}  // namespace jax_engram
