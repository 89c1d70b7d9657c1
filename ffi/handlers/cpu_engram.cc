// CPU handlers of the Engram ops: write (barrier, copy the shard into the own window region, barrier), fetch
// (gather by global id from every peer's region on the member's host gather pool, waiting for it) and wait (identity; the buffers are aliased).
// Operands, results and attribute structs are the CUDA handlers' (engram_bindings.h); overlap and the gather
// configuration have no effect here (host_threads sizes the pool; host_gather and slot are only validated).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "handlers/common.h"
#include "handlers/engram_bindings.h"
#include "handlers/engram_validate.h"
#include "jax_engram/engram_layout.h"
#include "kernels/cpu/engram.h"
#include "kernels/cpu/sync.h"
#include "runtime/host_gather.h"

namespace jax_engram {
namespace {

using namespace engram_validate;

ffi::Error EngramWriteCpu(int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer row_offset, ffi::AnyBuffer storage,
                          ffi::AnyBuffer sf, ffi::Result<ffi::AnyBuffer> token_out, EngramWriteAttrs at) {
  (void)token;
  MemberScope s(at.ctx_id, ordinal, kOpEngramWrite);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  WriteRegions w;
  if (auto e = check_write(kOpEngramWrite, m, row_offset, storage, sf, at, &w); !e.success()) return e;
  const int64_t start =
      engram::write_start_row(*static_cast<const int32_t*>(row_offset.untyped_data()), at.num_entries, w.rows);
  cpu::EngramWrite cw;
  cw.shard = w.a->local + at.offset;
  cw.src = static_cast<const uint8_t*>(storage.untyped_data());
  cw.num_entries = at.num_entries;
  cw.rows = w.rows;
  cw.row_bytes = at.row_bytes;
  cw.start = start;
  cw.nranks = m.nranks;
  cw.sf_table = w.sf_bytes ? w.sf_dst : nullptr;
  cw.sf_src = static_cast<const uint8_t*>(sf.untyped_data());
  cw.sf_row_bytes = at.sf_row_bytes;
  // No peer may still read the old rows (fetches on CPU are synchronous, so a peer past this barrier is done).
  if (!cpu::barrier(m, kOpEngramWrite)) return s.check_recorded();
  cpu::engram_write(cw);
  if (!cpu::barrier(m, kOpEngramWrite)) return s.check_recorded();
  if (token_out->size_bytes()) std::memset(token_out->untyped_data(), 0, token_out->size_bytes());
  return s.check_recorded();
}

ffi::Error EngramFetchCpu(int32_t ordinal, ffi::AnyBuffer indices, ffi::AnyBuffer token,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> sf_out,
                          ffi::Result<ffi::AnyBuffer> status, EngramFetchAttrs at) {
  (void)token;
  // CPU: the gather runs here and now (at.overlap has no effect); the gather configuration is only validated.
  MemberScope s(at.ctx_id, ordinal, kOpEngramFetch);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  FetchShapes fs;
  if (auto e = check_fetch(kOpEngramFetch, m, indices, *data, *sf_out, *status, at, &fs); !e.success()) return e;
  const int64_t mode = at.mode;
  const int64_t T = fs.T, E = fs.E, P = fs.P, total = fs.total;
  Allocation* a = fs.a;
  uint8_t* sf_table = fs.sf_table;
  const auto* ids = static_cast<const int32_t*>(indices.untyped_data());
  int32_t* st = static_cast<int32_t*>(status->untyped_data());
  *st = mode == engram::kModeChecked ? engram::kNoBadPosition : 0;
  if (mode == engram::kModeChecked) {
    const int64_t bad = cpu::engram_first_out_of_range(ids, T * E, total);
    if (bad >= 0) {
      *st = static_cast<int32_t>(bad);
      // Synchronous on CPU: this op fails; the context stays usable (no error record).
      return refuse_out_of_range(kOpEngramFetch, m.rank, ids[bad], bad, E, total);
    }
  }
  // The member's host gather pool (the same workers and routine as the CUDA host-table path): rows and their scale
  // factors in work items (engram::host_gather_plan) pulled by the workers and by this thread, which then waits,
  // bounded by the context timeout. A worker failure fails this op (the context stays usable: nothing is recorded).
  auto job = std::make_shared<HostGatherJob>();
  cpu::EngramGather& g = job->g;
  g.ids = ids;
  g.T = T;
  g.E = E;
  g.num_entries = at.num_entries;
  g.nranks = m.nranks;
  g.offset = at.offset;
  g.row_bytes = at.row_bytes;
  g.mode = static_cast<int32_t>(mode);
  g.out = static_cast<uint8_t*>(data->untyped_data());
  g.sf_table = reinterpret_cast<const uint32_t*>(sf_table);
  g.P = P;
  g.sf_layout = static_cast<int32_t>(at.sf_layout);
  g.sf_out = static_cast<uint32_t*>(sf_out->untyped_data());
  job->peers = a->peers;
  job->n = T * E;
  job->sf = sf_table != nullptr && P > 0;
  job->fail = m.host_gather_fail_next.exchange(false);
  const int threads = at.host_threads > 0 ? static_cast<int>(at.host_threads) : host_gather_default_threads(false);
  const engram::HostGatherPlan plan = engram::host_gather_plan(job->n, at.row_bytes, threads);
  job->item_rows = plan.item_rows;
  job->chunk_items = plan.chunk_items;
  HostGatherPool* pool = HostGatherPool::of(m, threads);
  pool->submit(job);
  HostGatherPool::help(*job, job->num_items());
  if (!job->wait(m.timeout_s)) {
    job->abandon("timed out");  // items not yet started are skipped
    // Items a worker is already running still write into this op's result buffers, which XLA may reuse once the
    // op has failed: wait for them too (bounded again; once abandoned, the job finishes with its last running item).
    const bool drained = job->wait(m.timeout_s);
    return op_error(kOpEngramFetch,
                    "the host gather on rank " + num(m.rank) + " of " + m.label + " did not finish within the " +
                        "context timeout (" + num(static_cast<int64_t>(m.timeout_s)) + " s)" +
                        (drained ? "" : "; a worker is still inside a work item after twice that"),
                    ffi::ErrorCode::kDeadlineExceeded);
  }
  if (job->failed())
    return op_error(kOpEngramFetch, "on rank " + num(m.rank) + " of " + m.label + ": " + job->error() +
                                        ". The fetch's result is invalid; the context stays usable",
                    ffi::ErrorCode::kInternal);
  return ffi::Error::Success();
}

// data / sf results alias the data / sf operands (input_output_aliases): nothing to do unless XLA copied.
ffi::Error EngramWaitCpu(int32_t ordinal, ffi::AnyBuffer data, ffi::AnyBuffer sf, ffi::AnyBuffer status,
                         ffi::AnyBuffer indices, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> data_out,
                         ffi::Result<ffi::AnyBuffer> sf_out, EngramWaitAttrs at) {
  (void)token;
  MemberScope s(at.ctx_id, ordinal, kOpEngramWait);
  if (!s.ok()) return s.error();
  if (data_out->size_bytes() != data.size_bytes() || sf_out->size_bytes() != sf.size_bytes())
    return op_error(kOpEngramWait, "results must have the sizes of the pending data and sf");
  if (at.check_total > 0) {  // a checked ("node", "gpu") lookup: see EngramWaitAttrs
    if (auto e = check_wait_status(kOpEngramWait, status, indices); !e.success()) return e;
    const auto* word = static_cast<const int32_t*>(status.untyped_data());
    const int64_t pos = word[0];
    if (pos != engram::kNoBadPosition) {
      const auto* ids = static_cast<const int32_t*>(indices.untyped_data());
      const int64_t id = pos >= 0 && pos < static_cast<int64_t>(indices.element_count()) ? ids[pos] : pos;
      return refuse_out_of_range(kOpEngramFetch, status.element_count() == 2 ? word[1] : s.member().rank, id, pos,
                                 indices.dimensions()[1], at.check_total);
    }
  }
  if (data_out->untyped_data() != data.untyped_data() && data.size_bytes())
    std::memcpy(data_out->untyped_data(), data.untyped_data(), data.size_bytes());
  if (sf_out->untyped_data() != sf.untyped_data() && sf.size_bytes())
    std::memcpy(sf_out->untyped_data(), sf.untyped_data(), sf.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

// Context arguments of every handler here: the device ordinal.
inline auto cpu_context() { return ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWriteCpu, EngramWriteCpu, bind_engram_write(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramFetchCpu, EngramFetchCpu, bind_engram_fetch(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWaitCpu, EngramWaitCpu, bind_engram_wait(cpu_context()));

static HandlerRegistrar reg_write("jax_engram_engram_write", reinterpret_cast<void*>(JeEngramWriteCpu));
static HandlerRegistrar reg_fetch("jax_engram_engram_fetch", reinterpret_cast<void*>(JeEngramFetchCpu));
static HandlerRegistrar reg_wait("jax_engram_engram_wait", reinterpret_cast<void*>(JeEngramWaitCpu));

}  // namespace jax_engram
