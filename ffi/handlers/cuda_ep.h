// What the CUDA EP handlers (cuda_ep.cc) expose to the module besides their FFI symbols.
#pragma once
#include <cstdint>
#include <vector>

namespace jax_engram {

// Copy-engine pieces a dispatch of this config would use on member (ctx_id, ordinal) under mode (EpCopyMode:
// 0 auto, 1 never, 2 always) with `pieces` pieces: 0 = SM stores, -1 = no such member (kernels/cuda/ep_copy_engine.h
// ep_ce_policy). Python asks at trace time and passes the answer to the handler (attribute copy_pieces).
int ep_dispatch_copy_pieces(int64_t ctx_id, int32_t ordinal, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                            int32_t mode, int32_t pieces);

// EP graph-target calls XLA captured into a CUDA graph on member (ctx_id, ordinal): [dispatch, cached dispatch,
// combine]; empty = no such member.
std::vector<int64_t> ep_graph_captures(int64_t ctx_id, int32_t ordinal);

}  // namespace jax_engram
