// Host-side interface of the Engram gather kernel (kernels/cuda/engram.cu). Plain C++ (no device code), so
// the handler (compiled by the host compiler) can include it. Layout and id semantics: jax_engram/engram_layout.h.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/runtime.h"

namespace jax_engram {

struct EngramFetchArgs {
  const int32_t* ids = nullptr;       // [T, E] global ids (device)
  int64_t T = 0, E = 0;
  int64_t num_entries = 0;            // rows per rank
  int32_t nranks = 0;
  uint8_t* const* peers = nullptr;    // device array: the table's allocation on every rank (this member's view)
  int64_t offset = 0;                 // region offset of the table
  int64_t row_bytes = 0;
  int32_t mode = 0;                   // engram::Mode
  uint8_t* out = nullptr;             // [T*E, row_bytes]
  const uint32_t* sf_table = nullptr; // own replicated sf table [nranks*num_entries, P] (nullptr: none)
  int64_t P = 0;
  int32_t sf_layout = 0;              // engram::SfLayout
  uint32_t* sf_out = nullptr;
  int32_t* status = nullptr;          // one int32 (engram_layout.h kNoBadPosition)
  ErrorRecord* err = nullptr;         // checked mode: where kErrIdOutOfRange goes
  int32_t rank = 0;
  int sm_count = 0;                   // grid size
  bool device_memory = false;         // the table lies in device (HBM) segments: picks the load kind
};

// Tuning knobs, read once from the environment (for benchmarking; defaults are the safe choice):
//   JAX_ENGRAM_ENGRAM_BLOCKS_PER_SM  grid cap = sm_count * this (default 0 = as many 256-thread blocks as
//                                    are resident at once, from the occupancy calculator)
//   JAX_ENGRAM_ENGRAM_LOADS          unset (default): "cg" for a table in HBM (L2-only loads: peer HBM is cached
//                                    only in its owner's L2), "volatile" for host memory (relaxed.sys loads: the
//                                    reading GPU's L2 may hold a stale line of host memory another GPU wrote) |
//                                    "volatile" | "cg" | "plain" (ordinary global loads) for every placement
struct EngramTuning {
  enum Loads { kAuto = 0, kVolatile = 1, kCg = 2, kPlain = 3 };
  int blocks_per_sm = 0;  // 0: occupancy
  int loads = kAuto;
};
const EngramTuning& engram_tuning();

// Enqueues the gather (and, in checked mode, the status reset and the range check) on `stream`.
cudaError_t launch_engram_fetch(const EngramFetchArgs& a, cudaStream_t stream);

// cudaSuccess if this module has a kernel image for the current device.
cudaError_t engram_kernels_loadable();

}  // namespace jax_engram
