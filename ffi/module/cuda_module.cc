// _engram_cuda: the CUDA backend (cuMem windows over NVLink), its FFI handlers and the side NCCL communicator.
// Importing it touches no GPU (the driver is resolved on first use), so it imports on GPU-less machines.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "handlers/common.h"
#include "module/bind_runtime.h"
#include "handlers/cuda_ep.h"
#include "runtime/cuda_backend.h"
#include "runtime/cuda_nccl.h"

namespace nb = nanobind;

namespace jax_engram {
void bind_gin_cuda(nb::module_& m);  // module/bind_gin_cuda.cc
}

namespace jax_engram {
Registry& registry() {
  static Registry* r = new Registry(make_cuda_backend());  // leaked on purpose: outlives XLA's threads
  return *r;
}
std::vector<HandlerEntry>& handler_table() {
  static std::vector<HandlerEntry> t;
  return t;
}

namespace {
void check(const Status& s) {
  if (!s.empty()) throw std::runtime_error(s);
}

nb::dict topology_dict(const TopologyInfo& t) {
  nb::dict d;
  d["nccl_runtime_version"] = t.nccl_runtime_version;
  d["nccl_build_version"] = t.nccl_build_version;
  d["nccl_rank"] = t.nccl_rank;
  d["nranks"] = t.nranks;
  d["lsa_size"] = t.lsa_size;
  d["lsa_rank"] = t.lsa_rank;
  d["window_registered"] = t.window_registered;
  d["window_reason"] = t.window_reason;
  d["devcomm"] = t.devcomm;
  d["devcomm_reason"] = t.devcomm_reason;
  d["device_api_support"] = t.device_api_support < 0 ? nb::none() : nb::cast(t.device_api_support != 0);
  d["device"] = t.device;
  d["device_name"] = t.device_name;
  d["sm_count"] = t.sm_count;
  d["compute_capability"] = nb::make_tuple(t.cc_major, t.cc_minor);
  nb::dict p2p;
  for (auto& [dev, ok] : t.p2p) p2p[nb::int_(dev)] = ok;
  d["p2p_access"] = p2p;
  d["host_numa_id"] = t.host_numa_id;
  d["host_numa_vmm"] = t.host_numa_vmm;
  d["gpu_direct_rdma_vmm"] = t.gdr_vmm;
  return d;
}
}  // namespace
}  // namespace jax_engram

NB_MODULE(_engram_cuda, m) {
  using namespace jax_engram;
  m.doc() = "jax_engram CUDA backend: cuMem windows, FFI handlers and the side NCCL communicator";
  bind_runtime(m, "gpu");
  bind_gin_cuda(m);

  m.def("nccl_unique_id", []() {
    std::string id;
    {
      nb::gil_scoped_release nogil;
      check(nccl_unique_id(&id));
    }
    return nb::bytes(id.data(), id.size());
  }, "A fresh 128-byte ncclUniqueId (call on one process, broadcast the bytes).");

  m.def("comm_init",
        [](int64_t ctx, const std::vector<std::pair<int32_t, int32_t>>& members, int32_t nranks, nb::bytes uid) {
          std::string id(uid.c_str(), uid.size());
          nb::gil_scoped_release nogil;  // blocks until every rank of the group has joined
          check(nccl_comm_init(registry(), ctx, members, nranks, id));
        },
        nb::arg("ctx_id"), nb::arg("members"), nb::arg("nranks"), nb::arg("uid"),
        "Collective: NCCL communicator of the local members [(device ordinal, rank), ...] of one group.");

  m.def("window_register",
        [](int64_t ctx, const std::vector<int32_t>& ordinals) {
          nb::gil_scoped_release nogil;
          check(nccl_window_register(registry(), ctx, ordinals));
        },
        nb::arg("ctx_id"), nb::arg("ordinals"),
        "Collective: NCCL window over the device part of the context window, and an LSA device communicator.");

  m.def("topology",
        [](int64_t ctx, int32_t ordinal) {
          TopologyInfo t;
          check(nccl_topology(registry(), ctx, ordinal, &t));
          return topology_dict(t);
        },
        nb::arg("ctx_id"), nb::arg("ordinal"));

  m.def("ep_dispatch_copy_pieces", &ep_dispatch_copy_pieces, nb::arg("ctx_id"), nb::arg("ordinal"),
        nb::arg("max_tokens_per_rank"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("hidden_bytes"),
        nb::arg("mode"), nb::arg("pieces"),
        "Copy-engine pieces a dispatch of this config uses on this member under mode (0 auto, 1 never, 2 always) "
        "(0: SM stores; -1: no such member).");
  m.def("ep_graph_captures", &ep_graph_captures, nb::arg("ctx_id"), nb::arg("ordinal"),
        "EP calls captured into a CUDA graph on this member: [dispatch, cached dispatch, combine] (empty: no such "
        "member).");

  m.def("nccl_versions", []() {
    return nb::make_tuple(nccl_runtime_version(), nccl_build_version());
  }, "(version of the loaded libnccl, version of the headers built against); X*10000+Y*100+Z.");
}
