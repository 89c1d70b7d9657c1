// What the CUDA handlers share: the context arguments of their bindings and the error of a failed CUDA call.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "handlers/common.h"
#include "runtime/cuda_member.h"

namespace jax_engram {

// Context arguments of every CUDA handler: XLA's stream and the device ordinal.
inline auto cuda_context() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

// "<what> failed: cudaErrorX (description)" as an internal error of op.
inline ffi::Error cuda_failure(int32_t op, const std::string& what, cudaError_t e) {
  return op_error(op, what + " failed: " + cuda_error_string(e), ffi::ErrorCode::kInternal);
}

}  // namespace jax_engram
