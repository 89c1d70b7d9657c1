#include "module/bind_runtime.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "handlers/common.h"
#include "jax_engram/engram_layout.h"
#include "jax_engram/ep_layout.h"
#include "kernels/cpu/engram.h"
#include "runtime/host_gather.h"
#include "runtime/ordered_worker.h"

namespace nb = nanobind;

namespace jax_engram {
namespace {

void check(const Status& s) {
  if (!s.empty()) throw std::runtime_error(s);
}

nb::dict export_to_dict(const Export& e) {
  nb::dict d;
  d["pid"] = e.pid;
  d["host_id"] = e.host_id;
  d["fds"] = e.fds;
  d["sizes"] = e.sizes;
  d["device"] = e.device;
  return d;
}

Export export_from_dict(const nb::dict& d) {
  Export e;
  e.pid = nb::cast<int64_t>(d["pid"]);
  e.host_id = nb::cast<std::string>(d["host_id"]);
  e.fds = nb::cast<std::vector<int64_t>>(d["fds"]);
  e.sizes = nb::cast<std::vector<uint64_t>>(d["sizes"]);
  e.device = nb::cast<int64_t>(d["device"]);
  return e;
}

// Sets a test hook flag (a Member field) on every local member of context `ctx`.
void arm_test_hook(int64_t ctx, std::atomic<bool> Member::* flag) {
  int n = 0;
  for (Member* mem : registry().members())
    if (mem->ctx_id == ctx) {
      (mem->*flag).store(true);
      ++n;
    }
  if (!n) throw std::runtime_error("no member of context " + std::to_string(ctx) + " in this process");
}

}  // namespace

void bind_runtime(nb::module_& m, const char* platform) {
  m.attr("platform") = platform;
  // Layout figures and limits straight from the layout headers (ep_layout.h, engram_layout.h): the Python layer
  // asks for them instead of keeping its own copy (jax_engram/ep.py, engram.py).
  m.def("ep_dispatch_bytes", [](int64_t R, int64_t M, int64_t K, int64_t E, int64_t hidden_bytes, int64_t scales,
                                bool push) {
    return EpDispatchLayout::make(R, M, K, E, hidden_bytes, scales, push).total_bytes();
  }, nb::arg("ranks"), nb::arg("max_tokens_per_rank"), nb::arg("topk"), nb::arg("num_experts"),
     nb::arg("hidden_bytes"), nb::arg("num_scales"), nb::arg("push"),
     "Bytes of a dispatch staging region (EpDispatchLayout::total_bytes; push: the CUDA protocol).");
  m.def("ep_combine_bytes", [](int64_t R, int64_t M, int64_t K, int64_t hidden_bytes, bool push) {
    return EpCombineLayout::make(R, M, K, hidden_bytes, push).total_bytes();
  }, nb::arg("ranks"), nb::arg("max_tokens_per_rank"), nb::arg("topk"), nb::arg("hidden_bytes"), nb::arg("push"),
     "Bytes of a combine staging region (EpCombineLayout::total_bytes; push: the CUDA protocol).");
  m.def("ep_rows", [](bool expand, int64_t R, int64_t M, int64_t K, int64_t E_loc, int64_t A) {
    return ep_rows(expand, R, M, K, E_loc, A);
  }, nb::arg("expand"), nb::arg("ranks"), nb::arg("max_tokens_per_rank"), nb::arg("topk"),
     nb::arg("num_local_experts"), nb::arg("alignment"), "Rows of a dispatch's receive layout (ep_rows).");
  m.def("ep_local_dispatch_scratch_words", [](int64_t N, int64_t K, int64_t E) {
    return ep_local_dispatch_scratch_words(N, K, E);
  }, nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"),
     "int32 words of the one-rank dispatch call's scratch (ep_local_dispatch_scratch_words; 0: none).");
  {
    nb::dict lim;
    lim["max_topk"] = kEpMaxTopk;
    lim["max_local_experts"] = kEpMaxLocalExperts;
    lim["max_experts"] = kEpMaxExperts;
    lim["max_copy_pieces"] = kEpCeMaxPieces;
    lim["max_stage_warps"] = kEpMaxStageWarps;
    lim["local_layout_max_entries"] = kEpLocalLayoutMaxEntries;
    m.attr("ep_limits") = lim;
    nb::dict bad;  // EpBadKind: the kinds of a routing record (the guard's records = 1)
    bad["duplicate_expert"] = static_cast<int>(kEpBadDuplicateExpert);
    bad["expert_range"] = static_cast<int>(kEpBadExpertRange);
    m.attr("ep_bad_kinds") = bad;
    nb::dict eg, modes, sf_layouts;
    modes["fill"] = static_cast<int>(engram::kModeFill);
    modes["clip"] = static_cast<int>(engram::kModeClip);
    modes["checked"] = static_cast<int>(engram::kModeChecked);
    sf_layouts["row"] = static_cast<int>(engram::kSfRow);
    sf_layouts["tma_col_major"] = static_cast<int>(engram::kSfTmaColMajor);
    eg["modes"] = modes;
    eg["sf_layouts"] = sf_layouts;
    eg["sf_token_align"] = engram::kSfTokenAlign;
    eg["no_bad_position"] = engram::kNoBadPosition;
    eg["host_gather_gpu_max_shard_bytes"] = engram::kHostGatherGpuMaxShardBytes;
    eg["max_host_threads"] = engram::kMaxHostThreads;
    m.attr("engram_layout") = eg;
  }
  // Test hooks: the CUDA push protocol's token ranges, push chunks and copy-engine pieces (ep_layout.h), which the
  // host (copy sizes) and the kernels (waits, chunk words) must agree on; whole tables per call.
  m.def("ep_cta_table", [](int M, int G) {  // ([t0 per CTA], [t1 per CTA], [CTA of token t], tokens per CTA)
    std::vector<int> t0(G), t1(G), of(M);
    for (int c = 0; c < G; ++c) ep_cta_tokens(M, G, c, &t0[c], &t1[c]);
    for (int t = 0; t < M; ++t) of[t] = ep_cta_of_token(t, M, G);
    return nb::make_tuple(t0, t1, of, ep_tokens_per_cta(M, G));
  });
  m.def("ep_chunk_table", [](int t0, int len, int nch) {  // ([begin of chunk li, li = 0..nch], [chunk of token])
    std::vector<int> b(nch + 1), of(len);
    for (int li = 0; li <= nch; ++li) b[li] = ep_chunk_begin(t0, len, nch, li);
    for (int t = 0; t < len; ++t) of[t] = ep_chunk_of(t0 + t, t0, len, nch);
    return nb::make_tuple(b, of);
  });
  m.def("ep_ce_piece_table", [](int per, int P, int tau) {  // ([begin of piece j, j = 0..P], [piece of offset])
    std::vector<int> b(P + 1), of(per);
    for (int j = 0; j <= P; ++j) b[j] = ep_ce_piece_begin(per, P, j, tau);
    for (int off = 0; off < per; ++off) of[off] = ep_ce_piece_of(off, per, P, tau);
    return nb::make_tuple(b, of);
  });
  // Engram bulk-copy gather plan (engram_layout.h TmaPlan), used by the CUDA launcher; here for tests and for the
  // benchmark's "SMs held" column. engram_tma_pieces lists chunk c's row pieces as (row, row_off, stage_off, len).
  m.def("engram_tma_plan", [](int64_t n_rows, int64_t row_bytes, int32_t sms, int64_t smem_budget) {
    const engram::TmaPlan p = engram::tma_plan(n_rows, row_bytes, sms, smem_budget);
    nb::dict d;
    d["chunk_bytes"] = p.chunk_bytes;
    d["chunks"] = p.chunks;
    d["stages"] = p.stages;
    d["grid"] = p.grid;
    d["smem_bytes"] = p.smem_bytes;
    d["warps"] = engram::kTmaWarps;
    return d;
  });
  m.def("engram_tma_eligible", [](int64_t row_bytes, uint64_t table_offset, uint64_t out_address) {
    return engram::tma_eligible(row_bytes, table_offset, out_address);
  });
  m.def("engram_tma_pieces", [](int64_t c, int64_t chunk_bytes, int64_t row_bytes, int64_t n_rows) {
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
    int64_t r0 = 0, r1 = -1;
    if (engram::tma_chunk_rows(c, chunk_bytes, row_bytes, n_rows, &r0, &r1))
      for (int64_t r = r0; r <= r1; ++r) {
        int64_t ro, so, len;
        engram::tma_piece(c, chunk_bytes, row_bytes, n_rows, r, &ro, &so, &len);
        out.emplace_back(r, ro, so, len);
      }
    return out;
  });
  m.def("member_create",
        [](int64_t ctx, int32_t ordinal, int32_t group, int32_t rank, int32_t nranks, double timeout_s,
           const std::string& label) {
          check(registry().create_member(ctx, ordinal, group, rank, nranks, timeout_s, label));
        },
        nb::call_guard<nb::gil_scoped_release>());
  m.def("member_destroy", [](int64_t ctx, int32_t ordinal) { check(registry().destroy_member(ctx, ordinal)); },
        nb::call_guard<nb::gil_scoped_release>());
  m.def("alloc_create", [](int64_t ctx, int32_t ordinal, int64_t alloc_id,
                           const std::vector<std::pair<uint64_t, int>>& segments) {
    std::vector<SegmentSpec> segs;
    for (auto& [bytes, kind] : segments) segs.push_back({bytes, static_cast<SegmentKind>(kind)});
    Export e;
    {
      nb::gil_scoped_release nogil;
      check(registry().create_alloc(ctx, ordinal, alloc_id, segs, &e));
    }
    return export_to_dict(e);
  });
  m.def("alloc_connect", [](int64_t ctx, int32_t ordinal, int64_t alloc_id, const std::vector<nb::dict>& exports) {
    std::vector<Export> ex;
    for (auto& d : exports) ex.push_back(export_from_dict(d));
    nb::gil_scoped_release nogil;
    check(registry().connect_alloc(ctx, ordinal, alloc_id, ex));
  });
  m.def("alloc_close_exports",
        [](int64_t ctx, int32_t ordinal, int64_t alloc_id) { check(registry().close_exports(ctx, ordinal, alloc_id)); });
  m.def("alloc_free", [](int64_t ctx, int32_t ordinal, int64_t alloc_id) {
    check(registry().free_alloc(ctx, ordinal, alloc_id));
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("alloc_info", [](int64_t ctx, int32_t ordinal, int64_t alloc_id) {
    Member* mem = registry().find(ctx, ordinal);
    if (!mem) throw std::runtime_error("no such member");
    Allocation* a = mem->alloc(alloc_id);
    if (!a) throw std::runtime_error("no such allocation");
    nb::dict d;
    d["local"] = reinterpret_cast<uintptr_t>(a->local);
    std::vector<uintptr_t> peers;
    for (auto* p : a->peers) peers.push_back(reinterpret_cast<uintptr_t>(p));
    d["peers"] = peers;
    d["total_bytes"] = a->total_bytes;
    return d;
  });
  m.def("error", [](int64_t ctx, int32_t ordinal) -> nb::object {
    Member* mem = registry().find(ctx, ordinal);
    if (!mem || !mem->error_host || mem->error_host->code <= 0) return nb::none();
    const ErrorRecord& e = *mem->error_host;
    nb::dict d;
    d["code"] = e.code;
    d["op"] = std::string(op_name(e.op));
    d["rank"] = e.rank;
    d["peer"] = e.peer;
    d["expected"] = e.expected;
    d["observed"] = e.observed;
    d["elapsed_ns"] = e.elapsed_ns;
    d["detail"] = e.detail;
    d["message"] = describe_error(*mem, e);
    return d;
  });
  m.def("registrations", []() {
    nb::dict d;
    for (auto& h : handler_table()) d[h.name] = nb::capsule(h.symbol);
    return d;
  });
  m.def("host_id", []() { return host_id(); });
  // Engram host gathers (runtime/host_gather.h): the test hook, the pool's size, and the host-side measurements
  // the benchmarks report beside the fetch rates (any machine, also CPU-only).
  m.def("_test_fail_next_host_gather", [](int64_t ctx) { arm_test_hook(ctx, &Member::host_gather_fail_next); },
        nb::arg("ctx_id"), "Test hook: the next host gather job of every local member of the context fails inside "
                        "its worker.");
  // The ordered worker thread (runtime/ordered_worker.h) that enqueues overlapped host-path fetches on a GPU, exposed
  // for its own test on any machine. Tasks are Python callables (run holding the GIL); waits release it. Bound in
  // the CPU module only: nanobind registers a C++ type once per process, and a second module binding the same type
  // makes its import warn.
  if (std::string(platform) == "cpu") {
    nb::class_<OrderedWorker>(m, "_OrderedWorker")
        .def(nb::init<const std::string&>(), nb::arg("name"))
        .def("submit", [](OrderedWorker& w, std::function<void()> f) { return w.submit(std::move(f)); },
             nb::arg("task"))
        .def("wait", &OrderedWorker::wait, nb::arg("ticket"), nb::arg("timeout_s"),
             nb::call_guard<nb::gil_scoped_release>())
        .def("submit_watch",
             [](OrderedWorker& w, std::function<bool()> ready, std::function<void(bool)> fire, double timeout_s) {
               OrderedWorker* pw = &w;
               return w.submit([pw, ready, fire, timeout_s] {
                 pw->watch(ready, fire, OrderedWorker::Clock::now() +
                                            std::chrono::duration_cast<OrderedWorker::Clock::duration>(
                                                std::chrono::duration<double>(timeout_s)));
               });
             },
             nb::arg("ready"), nb::arg("fire"), nb::arg("timeout_s"),
             "Queues a task that leaves a watch: ready() is polled between tasks; fire(timed_out) runs once.")
        .def("watches", &OrderedWorker::watches)
        .def("drain", &OrderedWorker::drain, nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>())
        .def("submitted", &OrderedWorker::submitted)
        .def("completed", &OrderedWorker::completed)
        .def("stop", &OrderedWorker::stop, nb::call_guard<nb::gil_scoped_release>());
    // A host gather pool of its own (runtime/host_gather.h), for the test of its waking on any machine: gather() runs
    // one job of fill-mode rows from a host table through the workers.
    nb::class_<HostGatherPool>(m, "_HostGatherPool")
        .def("__init__",
             [](HostGatherPool* p, const std::string& label, int threads) {
               new (p) HostGatherPool(label);
               p->grow(threads);
             },
             nb::arg("label"), nb::arg("threads"))
        .def("threads", &HostGatherPool::threads)
        .def("stop", &HostGatherPool::stop, nb::call_guard<nb::gil_scoped_release>())
        .def("gather",
             [](HostGatherPool& pool, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> table,
                nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids,
                nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> out, int64_t item_rows,
                double timeout_s) {
               const int64_t n = static_cast<int64_t>(ids.shape(0)), rb = static_cast<int64_t>(table.shape(1));
               if (static_cast<int64_t>(out.shape(0)) != n || static_cast<int64_t>(out.shape(1)) != rb)
                 throw std::invalid_argument("out must be [len(ids), table.shape[1]]");
               auto job = std::make_shared<HostGatherJob>();
               job->g.ids = ids.data();
               job->g.T = n;
               job->g.E = 1;
               job->g.num_entries = static_cast<int64_t>(table.shape(0));
               job->g.nranks = 1;
               job->g.row_bytes = rb;
               job->g.mode = engram::kModeFill;
               job->g.out = out.data();
               job->g.streaming = false;
               job->peers = {const_cast<uint8_t*>(table.data())};
               job->n = n;
               job->item_rows = std::clamp<int64_t>(item_rows, 1, std::max<int64_t>(n, 1));
               job->chunk_items = 1;
               bool done;
               {
                 nb::gil_scoped_release nogil;
                 pool.submit(job);
                 done = job->wait(timeout_s);
               }
               if (!done) {  // the workers may still use the arrays: end the job here before returning
                 job->abandon("timed out");
                 nb::gil_scoped_release nogil;
                 HostGatherPool::help(*job, job->num_items());  // claims what is left (skipped: the job failed)
                 while (!job->wait(60.0)) {  // the items a worker is running
                 }
                 throw std::runtime_error("the host gather job did not finish within the timeout");
               }
               if (job->failed()) throw std::runtime_error(job->error());
             },
             nb::arg("table"), nb::arg("ids"), nb::arg("out"), nb::arg("item_rows"), nb::arg("timeout_s"),
             "Gathers table[ids] into out (negative ids: zero rows) on the pool's workers; raises the job's error.");
  }
  m.def("_test_fail_next_host_enqueue", [](int64_t ctx) { arm_test_hook(ctx, &Member::host_enqueue_fail_next); },
        nb::arg("ctx_id"), "Test hook (CUDA): the next overlapped host-path fetch of every local member of the context "
                        "fails on the enqueue thread instead of being enqueued.");
  m.def("host_gather_threads", [](int64_t ctx, int32_t ordinal) {
    Member* mem = registry().find(ctx, ordinal);
    if (!mem) throw std::runtime_error("no such member");
    std::lock_guard<std::mutex> lk(mem->host_gather_mu);
    return mem->host_gather ? mem->host_gather->threads() : 0;
  }, nb::arg("ctx_id"), nb::arg("ordinal"), "Worker threads of the member's host gather pool (0: not started).");
  m.def("host_memory_bandwidth", [](int64_t nbytes, int threads) {
    cpu::HostBandwidth b;
    {
      nb::gil_scoped_release nogil;
      b = cpu::host_memory_bandwidth(nbytes, threads);
    }
    nb::dict d;
    d["read_gbps"] = b.read_gbps;
    d["memcpy_gbps"] = b.memcpy_gbps;  // bytes copied (each read and written once) per second
    d["nt_write_gbps"] = b.nt_write_gbps;
    d["nbytes"] = nbytes;
    d["threads"] = threads;
    return d;
  }, nb::arg("nbytes"), nb::arg("threads"),
     "Host memory bandwidth with `threads` threads over two `nbytes` buffers: sequential read, memcpy (bytes copied) "
     "and non-temporal writes, GB/s (best of 3).");
  m.def("host_gather_rate", [](int64_t table_bytes, int64_t row_bytes, int64_t num_rows, int threads, int repeats,
                                double start_at_s, double min_seconds) {
    HostGatherRate r;
    {
      nb::gil_scoped_release nogil;
      r = host_gather_rate(table_bytes, row_bytes, num_rows, threads, repeats, start_at_s, min_seconds);
    }
    if (!r.error.empty()) throw std::runtime_error("host_gather_rate: " + r.error);
    nb::dict d;
    d["gather_gbps"] = r.gather_gbps;
    d["seconds"] = r.seconds;
    d["mean_gbps"] = r.mean_gbps;
    d["window_start_s"] = r.window_start_s;
    d["window_end_s"] = r.window_end_s;
    d["gathers"] = r.gathers;
    d["table_bytes"] = table_bytes;
    d["row_bytes"] = row_bytes;
    d["num_rows"] = num_rows;
    d["threads"] = threads;
    return d;
  }, nb::arg("table_bytes"), nb::arg("row_bytes"), nb::arg("num_rows"), nb::arg("threads"), nb::arg("repeats"),
     nb::arg("start_at_s") = 0.0, nb::arg("min_seconds") = 0.0,
     "GB/s of the host gather pool's routine: num_rows random rows of a table_bytes host table into a buffer "
     "(gather_gbps: best of `repeats`). Several processes at once: the timed window starts at start_at_s (wall "
     "clock) and lasts at least min_seconds; mean_gbps is its bytes over its length, window_start_s / "
     "window_end_s its span.");
  nb::dict info;
  info["jaxlib"] = JAX_ENGRAM_BUILD_JAXLIB;
  info["ffi_api"] = nb::make_tuple(JAX_ENGRAM_FFI_MAJOR, JAX_ENGRAM_FFI_MINOR);
  m.attr("build_info") = info;
  bind_gin(m);
}

}  // namespace jax_engram
