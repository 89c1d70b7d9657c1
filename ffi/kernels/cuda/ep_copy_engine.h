// Host orchestration of the CUDA dispatch (kernels/cuda/ep.h "copy-engine rows"): the copy-engine policy, the copies
// and flags the member's copy stream writes beside the kernel, and the host's count of the stream sequence's
// dispatch-type calls (ep_layout.h "dispatch sequences") that picks their inbox half and flag values.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/ep.h"
#include "runtime/cuda_member.h"

namespace jax_engram {

// How a dispatch moves x's rows (jax_engram.EPConfig.dispatch_copy_engine).
enum EpCopyMode : int32_t { kEpCopyAuto = 0, kEpCopyNever = 1, kEpCopyAlways = 2 };

// Whether the copy engine can move this dispatch's rows on this member: stream memory operations and a copy stream,
// 16-byte rows, at least 2 ranks, and room for the peers' layout counters (the receivers lay out each peer's tokens).
bool ep_ce_available(const CudaMemberState& st, int64_t R, int64_t K, int64_t E, int64_t x_bytes);

// Copy-engine pieces of a dispatch of this config (0: SM stores). A function of the config, the mode and the hardware
// only, not of the token count N (which may differ per rank), so every rank decides the same. kEpCopyAuto takes the
// copy engine only when a peer is expected to receive nearly all of a rank's tokens (the whole x goes to every peer):
// 1 - P(none of a token's K distinct uniform experts is on that peer) >= 95 %, and M x row >= 4 MiB (smaller calls
// are latency-bound: every copy and flag costs the copy engine a few microseconds).
int ep_ce_policy(const CudaMemberState& st, int64_t R, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                 int32_t mode, int32_t pieces);

// Taper of P pieces (ep_layout.h ep_ce_piece_begin): kEpCeTaper, capped so that every piece keeps a positive share.
int ep_ce_taper(int pieces);

using EpDispatchLauncher = cudaError_t (*)(EpDispatchParams, const EpLaunch&, cudaStream_t);

// Runs one dispatch-type call of the stream sequence (EpSequence::kStream: not a graph target; full or cached
// dispatch; p.ce_pieces > 0: with copy-engine rows): takes its sequence number from the member's count, forks the
// copy stream off XLA's stream and enqueues the rows there, launches the kernel, counts the call and joins the copy
// stream back (x stays alive until the copies are done). `sa`: the staging allocation. Returns "" or what failed.
std::string ep_run_dispatch_stream(Member& m, const Allocation& sa, EpDispatchParams& p, const EpLaunch& l,
                                   cudaStream_t stream, EpDispatchLauncher launch, const char* what);

}  // namespace jax_engram
