// CUDA handler of the GIN leg of a hierarchical Engram lookup: rows owned by other nodes are read from their
// owners' windows with NCCL GIN gets (kernels/cuda/engram_gin.cu) into the rows the intra-node lookup produced
// (operand 1, aliased to result 0). Selected by jax_engram/_scaleout_gin.py only where NCCL reports GIN and the
// cross-node GIN communicator was created; anywhere else (no GIN backend, NCCL < 2.30.4 headers) it fails naming
// why, and the collective path is used instead. A peer whose completion times out is recorded in the member's
// error record (ctx.check() and the next op report it), like every other wait of the library.
#include <cuda_runtime_api.h>

#include <string>

#include "handlers/common.h"
#include "handlers/engram_bindings.h"
#include "jax_engram/engram_gin_plan.h"
#include "kernels/cuda/engram_gin.h"
#include "runtime/cuda_gin.h"
#include "runtime/cuda_member.h"

namespace jax_engram {
namespace {

ffi::Error EngramGinFetchCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer ids, ffi::AnyBuffer rows_in,
                              ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> status,
                              EngramGinFetchAttrs at) {
  constexpr int32_t op = kOpEngramFetch;
  if (!engram_gin_compiled()) return op_error(op, engram_gin_absent_reason(), ffi::ErrorCode::kUnimplemented);
  const int64_t ctx_id = at.ctx_id, window_id = at.window_id, row_bytes = at.row_bytes;
  MemberScope s(ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  GinState state;
  GinWindow win;
  const int found = gin_launch_state(ctx_id, ordinal, window_id, &state, &win);
  if (found == 1)
    return op_error(op, "context " + std::to_string(ctx_id) + " has no GIN communicator on GPU " +
                            std::to_string(ordinal) + " (ctx.info()['gin'] says why; the collective path serves it)",
                    ffi::ErrorCode::kFailedPrecondition);
  if (found == 2)
    return op_error(op, "the Engram table (GIN window " + std::to_string(window_id) + ") is not registered for GIN "
                        "on GPU " + std::to_string(ordinal) + " (freed?)", ffi::ErrorCode::kFailedPrecondition);
  const GinState* gs = &state;
  if (ids.element_type() != ffi::DataType::S32) return op_error(op, "ids must be int32");
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (at.num_entries < 1 || at.ranks_per_node < 1 || at.nodes < 1 || row_bytes < 1 || at.region_offset < 0 ||
      at.local_stride < 0 || at.mode < engram::kModeFill || at.mode > engram::kModeChecked ||
      at.ranks_per_node * at.nodes != gs->nranks)
    return op_error(op, "invalid GIN geometry attributes");
  if (static_cast<int64_t>(rows->size_bytes()) != n * row_bytes || rows_in.size_bytes() != rows->size_bytes())
    return op_error(op, "rows must be [n, row_bytes] for the n ids, in and out alike");
  const int64_t staging_rows = engram::gin_staging_rows(gs->staging_bytes, gs->nranks, row_bytes);
  if (staging_rows < 1)
    return op_error(op, "a row of " + std::to_string(row_bytes) + " bytes does not fit the GIN staging slice of a "
                        "peer (" + std::to_string(gs->staging_bytes / gs->nranks) + " bytes)");
  if (status->size_bytes() != sizeof(int32_t)) return op_error(op, "status must be one int32");
  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return op_error(op, "cudaSetDevice failed", ffi::ErrorCode::kInternal);
  cudaError_t ce = cudaSuccess;
  if (rows->untyped_data() != rows_in.untyped_data() && rows->size_bytes())
    ce = cudaMemcpyAsync(rows->untyped_data(), rows_in.untyped_data(), rows->size_bytes(), cudaMemcpyDeviceToDevice,
                         stream);
  if (ce == cudaSuccess) ce = cudaMemsetAsync(status->untyped_data(), 0, sizeof(int32_t), stream);
  if (ce != cudaSuccess) return op_error(op, std::string("preparing the GIN fetch: ") + cudaGetErrorString(ce));
  EngramGinArgs a;
  a.ids = static_cast<const int32_t*>(ids.untyped_data());
  a.n = n;
  a.mode = static_cast<int32_t>(at.mode);
  a.geo = engram::GinGeometry{at.num_entries, static_cast<int32_t>(at.ranks_per_node), static_cast<int32_t>(at.nodes),
                              row_bytes, at.region_offset, at.local_stride};
  a.table_host = win.host;
  a.my_node = gs->node;
  a.rank = gs->rank;
  a.staging_rows = staging_rows;
  a.staging = gs->staging;
  a.out = static_cast<uint8_t*>(rows->untyped_data());
  a.err = s->error_device;
  a.timeout_cycles = gs->timeout_cycles;
  const std::string err = launch_engram_gin_fetch(*static_cast<const ncclDevComm*>(gs->devcomm),
                                                  static_cast<ncclWindow_t>(win.win),
                                                  static_cast<ncclWindow_t>(gs->staging_window), a, stream);
  if (!err.empty()) return op_error(op, err, ffi::ErrorCode::kInternal);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramGinFetchCuda, EngramGinFetchCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // ids int32 [T, E] (global)
                                  .Arg<ffi::AnyBuffer>()  // rows from the intra-node lookup [T, E*hidden]
                                  .Ret<ffi::AnyBuffer>()  // rows (aliases operand 1)
                                  .Ret<ffi::AnyBuffer>()  // status int32 (0; a timeout goes to the error record)
                                  .Attrs<EngramGinFetchAttrs>());

static HandlerRegistrar reg_gin_fetch("jax_engram_engram_gin_fetch", reinterpret_cast<void*>(JeEngramGinFetchCuda));

}  // namespace jax_engram
