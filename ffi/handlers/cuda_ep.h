// What the CUDA EP handlers (cuda_ep.cc) expose to the module besides their FFI symbols.
#pragma once
#include <cstdint>
#include <vector>

namespace jax_engram {

// Copy-engine pieces a dispatch of this config uses on member (ctx_id, ordinal): 0 = SM stores, -1 = no such member
// (kernels/cuda/ep.h "copy-engine rows"; the policy is ce_pieces_for in cuda_ep.cc).
int ep_dispatch_copy_pieces(int64_t ctx_id, int32_t ordinal, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                            bool expand);

// EP graph-target calls XLA captured into a CUDA graph on member (ctx_id, ordinal): [dispatch, cached dispatch,
// combine]; empty = no such member.
std::vector<int64_t> ep_graph_captures(int64_t ctx_id, int32_t ordinal);

}  // namespace jax_engram
