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
  int sm_count = 0;                   // SMs of the device: the "sm" gather's grid
  bool device_memory = false;         // the table lies in device (HBM) segments: picks the load kind
  uint64_t timeout_ns = 0;            // bound of the "tma" gather's waits (the context timeout)
  ErrorRecord* timeout_err = nullptr; // where a "tma" wait past timeout_ns is recorded (kErrTimeout)
  // gather configuration (jax_engram/config.py EngramConfig; engram_layout.h Gather / Loads)
  int32_t gather = 0;                 // engram::Gather
  int32_t gather_sms = 4;             // "tma": CTAs (one per SM); also the CTA cap of its "sm" fallback
  int64_t tma_smem_bytes = 0;         // "tma": shared memory per CTA (clamped to the device's opt-in limit)
  int32_t sm_loads = 0;               // engram::Loads
  int32_t sm_blocks_per_sm = 0;       // "sm": grid cap in 256-thread blocks per SM (0: occupancy)
};

// Which kernel a fetch ran (for diagnosis and the benchmark): engram::kGatherSm or kGatherTma, and the CTAs.
struct EngramLaunchInfo {
  int32_t gather = -1;       // -1: nothing launched (no rows and no sf padding)
  int32_t sms = 0;           // at most this many SMs run the gather ("tma": its CTAs, one per SM)
  int64_t chunk_bytes = 0;   // "tma": engram::TmaPlan
  int64_t chunks = 0;
  int64_t smem_bytes = 0;
};

// Enqueues the gather (and, in checked mode, the status reset and the range check) on `stream`. The "tma" gather
// runs when asked for and tma_eligible (16-byte rows and addresses); otherwise the "sm" gather, capped at
// gather_sms CTAs when "tma" was asked for (the caller wanted few SMs held). `info` (optional) says which ran.
cudaError_t launch_engram_fetch(const EngramFetchArgs& a, cudaStream_t stream, EngramLaunchInfo* info = nullptr);

// A write of `rows` rows of every rank's shard (EngramTable.write). The start row is read on the device from
// `row_offset` (a stream-ordered operand) and clamped by engram::write_start_row; every rank's scale-factor slice
// goes to the own replicated table. The stores are performed system-wide when the kernel completes (peers read the
// rows after the write's closing barrier).
struct EngramWriteArgs {
  uint8_t* shard = nullptr;              // own table region [num_entries, row_bytes]
  const uint8_t* src = nullptr;          // [rows, row_bytes]
  const int32_t* row_offset = nullptr;   // one int32 (device)
  int64_t num_entries = 0, rows = 0, row_bytes = 0;
  int32_t nranks = 0;
  uint8_t* sf_table = nullptr;           // own replicated sf table [nranks*num_entries, sf_row_bytes] (nullptr: none)
  const uint8_t* sf_src = nullptr;       // [nranks*rows, sf_row_bytes], rank-major
  int64_t sf_row_bytes = 0;
};
cudaError_t launch_engram_write(const EngramWriteArgs& a, cudaStream_t stream);

// cudaSuccess if this module has a kernel image for the current device.
cudaError_t engram_kernels_loadable();

}  // namespace jax_engram
