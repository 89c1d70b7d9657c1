// CUDA handlers of the Engram ops (same names, operands and attribute structs as cpu_engram.cc:
// engram_bindings.h).
//
// write: make XLA's stream wait for this member's side stream, queued fetches included (none of ours still reads
//        the old table), barrier kernel, the write kernel (the rows into the own region at the start row it reads
//        from the row_offset operand, every rank's sf slice into the replicated sf table; ends with a system fence:
//        published), barrier kernel; all on XLA's stream.
// fetch: overlap=1 and a side stream: record an event on XLA's stream, make the side stream wait for it, launch
//        the gather on the side stream (fetch returns at once; XLA work placed before wait overlaps the reads),
//        then record the fetch's slot event there (engram_order.h). overlap=0 (lookup = fetch + wait back to back)
//        or no side stream: the gather runs on XLA's stream. A host-placed table with host_gather=1 (and CPU access
//        to its segments) takes the host path (engram_host.h: CPU workers + copy engine, no SMs for the rows); else
//        the GPU gather kernel. The overlapped host path records only the fork here and leaves the side stream's
//        work to the member's enqueue thread (engram_host.h), so XLA's launch thread goes on at once.
// wait:  overlap=1: once the enqueue thread has enqueued the fetch (bounded; its failure is reported here), make
//        XLA's stream wait for the fetch's slot event (only that fetch, not later ones; slot 0: for everything on the
//        side stream so far). The data / sf results alias the operands (input_output_aliases) and the ids are an
//        operand too, so the buffers the fetch reads and writes stay alive until here.
// checked mode: the range check runs on the device and leaves the first bad position in the status result; the
//        wait reads it back (a host sync) and fails the call naming the id (refuse_out_of_range). Nothing is
//        recorded in the context, which stays usable.
// Not command-buffer compatible: they read host state (peer tables, streams, error record) per call.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "handlers/common.h"
#include "handlers/cuda_common.h"
#include "handlers/engram_bindings.h"
#include "handlers/engram_validate.h"
#include "jax_engram/engram_layout.h"
#include "kernels/cuda/base.h"
#include "kernels/cuda/engram.cuh"
#include "kernels/cuda/engram_host.h"
#include "kernels/cuda/engram_order.h"
#include "runtime/cuda_member.h"
#include "runtime/env.h"

namespace jax_engram {
namespace {

using namespace engram_validate;

const char* gather_name(int32_t g) {
  return g == engram::kGatherTma ? "tma" : g == engram::kGatherSm ? "sm" : g == engram::kGatherSmFew ? "sm_few" : "none";
}

// Debug tracing only (never a tuning knob): JAX_ENGRAM_ENGRAM_TRACE=1 prints which gather every fetch ran.
bool engram_trace() {
  static const bool on = env_int("JAX_ENGRAM_ENGRAM_TRACE", 0, 0, 1) != 0;
  return on;
}

ffi::Error enter_device(Member& m, int32_t op, CudaDeviceGuard& g) {
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  if (!m.backend_state) return op_error(op, "member has no CUDA state", ffi::ErrorCode::kFailedPrecondition);
  Allocation* w = m.alloc(0);
  if (!w || !w->peers_device)
    return op_error(op, "the context window is not connected on this device", ffi::ErrorCode::kFailedPrecondition);
  return ffi::Error::Success();
}

// Stream ordering through the member's events (kernels/cuda/engram_order.h), as an FFI error.
ffi::Error order_after(CudaMemberState& st, int32_t op, cudaStream_t from, cudaStream_t to, bool fork) {
  std::string what;
  cudaError_t e = engram_order_after(st, from, to, fork, &what);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_failure(op, what, e);
}

ffi::Error slot_record(CudaMemberState& st, int32_t op, int64_t slot, cudaStream_t side) {
  std::string what;
  cudaError_t e = engram_slot_record(st, slot, side, &what);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_failure(op, what, e);
}

ffi::Error EngramWriteCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer row_offset,
                           ffi::AnyBuffer storage, ffi::AnyBuffer sf, ffi::Result<ffi::AnyBuffer> token_out,
                           EngramWriteAttrs at) {
  (void)token;
  constexpr int32_t op = kOpEngramWrite;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  WriteRegions w;
  if (auto e = check_write(op, m, row_offset, storage, sf, at, &w); !e.success()) return e;
  CudaDeviceGuard g(ordinal);
  if (auto e = enter_device(m, op, g); !e.success()) return e;
  CudaMemberState& st = cuda_state(m);
  // Our own fetches of the old table (side stream, the queued ones included) finish before we arrive at the barrier;
  // every peer does the same, so after the barrier nobody reads the old rows.
  if (st.side_stream) {
    if (std::string msg = engram_host_enqueued(m, st, 0, false); !msg.empty())
      return op_error(op, msg, ffi::ErrorCode::kDeadlineExceeded);
    if (auto e = order_after(st, op, st.side_stream, stream, false); !e.success()) return e;
  }
  EngramWriteArgs wa;
  wa.shard = w.a->local + at.offset;
  wa.src = static_cast<const uint8_t*>(storage.untyped_data());
  wa.row_offset = static_cast<const int32_t*>(row_offset.untyped_data());
  wa.num_entries = at.num_entries;
  wa.rows = w.rows;
  wa.row_bytes = at.row_bytes;
  wa.nranks = m.nranks;
  wa.sf_table = w.sf_bytes ? w.sf_dst : nullptr;
  wa.sf_src = static_cast<const uint8_t*>(sf.untyped_data());
  wa.sf_row_bytes = at.sf_row_bytes;
  const SyncArgs sync = make_sync_args(m, op);
  cudaError_t ce = launch_barrier(sync, stream);
  if (ce != cudaSuccess) return cuda_failure(op, "launching the barrier kernel", ce);
  ce = launch_engram_write(wa, stream);
  if (ce != cudaSuccess) return cuda_failure(op, "launching the copy into the table region", ce);
  ce = launch_barrier(sync, stream);
  if (ce != cudaSuccess) return cuda_failure(op, "launching the barrier kernel", ce);
  if (token_out->size_bytes()) {
    ce = cudaMemsetAsync(token_out->untyped_data(), 0, token_out->size_bytes(), stream);
    if (ce != cudaSuccess) return cuda_failure(op, "writing the token", ce);
  }
  return ffi::Error::Success();
}

ffi::Error EngramFetchCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer indices, ffi::AnyBuffer token,
                           ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> sf_out,
                           ffi::Result<ffi::AnyBuffer> status, EngramFetchAttrs at) {
  (void)token;
  constexpr int32_t op = kOpEngramFetch;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  FetchShapes fs;
  if (auto e = check_fetch(op, m, indices, *data, *sf_out, *status, at, &fs); !e.success()) return e;
  const int64_t T = fs.T, E = fs.E, P = fs.P;
  const int64_t num_entries = at.num_entries, row_bytes = at.row_bytes, offset = at.offset;
  Allocation* a = fs.a;
  uint8_t* sf_table = fs.sf_table;
  if (!a->peers_device)
    return op_error(op, "the table's allocation is not connected", ffi::ErrorCode::kFailedPrecondition);
  CudaDeviceGuard g(ordinal);
  if (auto e = enter_device(m, op, g); !e.success()) return e;
  CudaMemberState& st = cuda_state(m);
  const bool overlap = at.overlap && st.side_stream;
  cudaStream_t run_on = overlap ? st.side_stream : stream;
  const uint64_t table_bytes = static_cast<uint64_t>(num_entries) * row_bytes;
  const bool in_device = region_in_device_segments(*a, static_cast<uint64_t>(offset), table_bytes);
  if (at.host_gather == engram::kHostGatherCpu && a->cpu_readable &&
      region_in_host_segments(*a, static_cast<uint64_t>(offset), table_bytes)) {
    // The host path: CPU workers gather, the copy engine moves the rows (engram_host.h); no SMs for the rows.
    EngramHostFetchArgs h;
    h.member = &m;
    h.state = &st;
    h.ids = static_cast<const int32_t*>(indices.untyped_data());
    h.T = T;
    h.E = E;
    h.num_entries = num_entries;
    h.table = a;
    h.offset = offset;
    h.row_bytes = row_bytes;
    h.mode = static_cast<int32_t>(at.mode);
    h.out = static_cast<uint8_t*>(data->untyped_data());
    h.sf_table = reinterpret_cast<const uint32_t*>(sf_table);
    h.P = P;
    h.sf_layout = static_cast<int32_t>(at.sf_layout);
    h.sf_out = static_cast<uint32_t*>(sf_out->untyped_data());
    h.status = static_cast<int32_t*>(status->untyped_data());
    h.threads = static_cast<int>(at.host_threads);
    const auto t0 = std::chrono::steady_clock::now();
    if (overlap) {  // queued on the member's enqueue thread (engram_host.h): XLA's launch thread goes on at once
      std::string msg = enqueue_engram_host_fetch(h, stream, at.slot);
      if (!msg.empty()) return op_error(op, "rank " + std::to_string(m.rank) + ": " + msg, ffi::ErrorCode::kInternal);
    } else {
      std::string what;
      cudaError_t he = launch_engram_host_fetch(h, stream, &what);
      if (he != cudaSuccess) return cuda_failure(op, "the host path (" + what + ")", he);
    }
    if (engram_trace())
      std::fprintf(stderr, "jax_engram engram fetch: rank %d T %lld E %lld row_bytes %lld placement host overlap %d "
                   "ran cpu (host gather, sf %s), %s in %.1f us\n", m.rank, static_cast<long long>(T),
                   static_cast<long long>(E), static_cast<long long>(row_bytes), static_cast<int>(overlap),
                   !(sf_table && P > 0) ? "none" : "gpu", overlap ? "queued" : "enqueued",
                   std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    return ffi::Error::Success();
  }
  if (overlap)
    if (auto e = order_after(st, op, stream, st.side_stream, true); !e.success()) return e;
  EngramFetchArgs f;
  f.ids = static_cast<const int32_t*>(indices.untyped_data());
  f.T = T;
  f.E = E;
  f.num_entries = num_entries;
  f.nranks = m.nranks;
  f.peers = static_cast<uint8_t* const*>(a->peers_device);
  f.offset = offset;
  f.row_bytes = row_bytes;
  f.mode = static_cast<int32_t>(at.mode);
  f.out = static_cast<uint8_t*>(data->untyped_data());
  f.sf_table = reinterpret_cast<const uint32_t*>(sf_table);
  f.P = P;
  f.sf_layout = static_cast<int32_t>(at.sf_layout);
  f.sf_out = static_cast<uint32_t*>(sf_out->untyped_data());
  f.status = static_cast<int32_t*>(status->untyped_data());
  // Checked mode leaves the first bad position in `status` for wait's host check (engram.py); it records nothing in
  // the context, which stays usable.
  f.err = nullptr;
  f.rank = m.rank;
  f.sm_count = st.sm_count;
  f.device_memory = in_device;
  f.timeout_ns = m.timeout_ns();
  f.timeout_err = m.error_device;  // a stalled bulk copy is a device failure, reported like any other
  f.gather = static_cast<int32_t>(at.gather);
  f.gather_sms = static_cast<int32_t>(at.gather_sms);
  f.tma_smem_bytes = at.tma_smem_bytes;
  f.sm_loads = static_cast<int32_t>(at.sm_loads);
  f.sm_blocks_per_sm = static_cast<int32_t>(at.sm_blocks_per_sm);
  EngramLaunchInfo info;
  cudaError_t ce = launch_engram_fetch(f, run_on, &info);
  if (ce != cudaSuccess)
    return cuda_failure(op, std::string("launching the ") + gather_name(info.gather) +
                                " gather kernel (T " + num(T) + ", E " + num(E) + ", row_bytes " + num(row_bytes) +
                                ", smem " + num(info.smem_bytes) + ")",
                        ce);
  if (engram_trace()) {
    std::fprintf(stderr,
                 "jax_engram engram fetch: rank %d T %lld E %lld row_bytes %lld placement %s overlap %d asked %s "
                 "ran %s sms %d chunk_bytes %lld chunks %lld smem %lld\n",
                 m.rank, static_cast<long long>(T), static_cast<long long>(E), static_cast<long long>(row_bytes),
                 f.device_memory ? "device" : "host", static_cast<int>(overlap),
                 gather_name(f.gather), gather_name(info.gather),
                 info.sms, static_cast<long long>(info.chunk_bytes), static_cast<long long>(info.chunks),
                 static_cast<long long>(info.smem_bytes));
  }
  if (overlap && at.slot > 0) return slot_record(st, op, at.slot, run_on);
  return ffi::Error::Success();
}

ffi::Error EngramWaitCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer data, ffi::AnyBuffer sf,
                          ffi::AnyBuffer status, ffi::AnyBuffer indices, ffi::AnyBuffer token,
                          ffi::Result<ffi::AnyBuffer> data_out,
                          ffi::Result<ffi::AnyBuffer> sf_out, EngramWaitAttrs at) {
  (void)token;
  constexpr int32_t op = kOpEngramWait;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  if (data_out->size_bytes() != data.size_bytes() || sf_out->size_bytes() != sf.size_bytes())
    return op_error(op, "results must have the sizes of the pending data and sf");
  CudaDeviceGuard g(ordinal);
  if (auto e = enter_device(m, op, g); !e.success()) return e;
  CudaMemberState& st = cuda_state(m);
  if (at.overlap && st.side_stream) {
    // A fetch queued on the enqueue thread is on the side stream first; a failure to enqueue it fails the fetch here.
    if (std::string msg = engram_host_enqueued(m, st, at.slot, true); !msg.empty())
      return op_error(kOpEngramFetch, msg, ffi::ErrorCode::kInternal);
    // The fetch's own event (slot > 0); else everything on the side stream so far.
    std::string what;
    cudaError_t ce = at.slot > 0 ? engram_slot_wait(st, at.slot, stream, &what)
                                 : engram_order_after(st, st.side_stream, stream, false, &what);
    if (ce != cudaSuccess) return cuda_failure(op, what, ce);
  }
  if (at.check_total > 0) {
    // mode="checked": the fetch's device-side range check left the first bad flat position in `status`; read it
    // back (a host sync, after the fetch by the ordering above) and fail this call naming it. Nothing is recorded
    // in the context, which stays usable. Engram handlers are never captured into graphs by XLA (no trait).
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive)
      return op_error(kOpEngramFetch, "mode='checked' reads the fetch's status on the host, which a captured CUDA "
                                      "graph cannot do", ffi::ErrorCode::kFailedPrecondition);
    if (auto e = check_wait_status(op, status, indices); !e.success()) return e;
    int32_t word[2] = {engram::kNoBadPosition, m.rank};
    cudaError_t ce = cudaMemcpyAsync(word, status.untyped_data(), status.size_bytes(), cudaMemcpyDeviceToHost, stream);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
    if (ce != cudaSuccess) return cuda_failure(op, "reading the checked fetch's status", ce);
    const int32_t pos = word[0];
    if (pos != engram::kNoBadPosition) {
      const int64_t n = indices.element_count(), E = indices.dimensions()[1];
      int32_t id = pos;  // the position itself if it is not an index position (never, by the kernels)
      if (pos >= 0 && pos < n) {
        ce = cudaMemcpy(&id, static_cast<const int32_t*>(indices.untyped_data()) + pos, sizeof(id),
                        cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) return cuda_failure(op, "reading the checked fetch's bad id", ce);
      }
      return refuse_out_of_range(kOpEngramFetch, word[1], id, pos, E, at.check_total);
    }
  }
  // input_output_aliases makes these the same buffers; copy only if XLA gave us distinct ones.
  cudaError_t ce = cudaSuccess;
  if (data_out->untyped_data() != data.untyped_data() && data.size_bytes())
    ce = cudaMemcpyAsync(data_out->untyped_data(), data.untyped_data(), data.size_bytes(), cudaMemcpyDeviceToDevice,
                         stream);
  if (ce == cudaSuccess && sf_out->untyped_data() != sf.untyped_data() && sf.size_bytes())
    ce = cudaMemcpyAsync(sf_out->untyped_data(), sf.untyped_data(), sf.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  if (ce != cudaSuccess) return cuda_failure(op, "copying the pending buffers", ce);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWriteCuda, EngramWriteCuda, bind_engram_write(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramFetchCuda, EngramFetchCuda, bind_engram_fetch(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWaitCuda, EngramWaitCuda, bind_engram_wait(cuda_context()));

static HandlerRegistrar reg_write("jax_engram_engram_write", reinterpret_cast<void*>(JeEngramWriteCuda));
static HandlerRegistrar reg_fetch("jax_engram_engram_fetch", reinterpret_cast<void*>(JeEngramFetchCuda));
static HandlerRegistrar reg_wait("jax_engram_engram_wait", reinterpret_cast<void*>(JeEngramWaitCuda));

}  // namespace jax_engram
