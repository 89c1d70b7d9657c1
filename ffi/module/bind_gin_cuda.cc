// nanobind surface of the GIN support query (runtime/cuda_gin.h), CUDA module only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "handlers/common.h"
#include "runtime/cuda_gin.h"

namespace nb = nanobind;

namespace jax_engram {

void bind_gin_cuda(nb::module_& m) {
  m.def("gin_support", []() {
    const GinSupport s = gin_support();
    nb::dict d;
    d["compiled"] = s.compiled;
    d["build_version"] = s.build_version;
    d["runtime_version"] = s.runtime_version;
    d["reason"] = s.reason;
    return d;
  }, "Whether the GIN Engram fetch is compiled in and the loaded libnccl can run it ({compiled, versions, reason}).");
  m.def("gin_query", [](int64_t ctx, int32_t ordinal) {
    GinQuery q;
    const Status s = gin_query(registry(), ctx, ordinal, &q);
    if (!s.empty()) throw std::runtime_error(s);
    nb::dict d;
    d["gin_type"] = q.gin_type;
    d["railed_gin_type"] = q.railed_gin_type;
    d["reason"] = q.reason;
    return d;
  }, nb::arg("ctx_id"), nb::arg("ordinal"),
  "ncclCommQueryProperties of the member's side communicator: {gin_type, railed_gin_type (0 none, -1 not "
  "asked), reason}. Never raises for an absent GIN.");
  m.def("gin_init", [](int64_t ctx, const std::vector<std::tuple<int32_t, int32_t, int32_t>>& members, int32_t nranks,
                       nb::bytes uid, int64_t staging_bytes) {
    std::vector<GinMember> ms;
    for (auto& [o, r, n] : members) ms.push_back(GinMember{o, r, n});
    std::string id(uid.c_str(), uid.size());
    Status s;
    {
      nb::gil_scoped_release nogil;  // collective: waits (bounded) for every rank of the group
      s = gin_init(registry(), ctx, ms, nranks, id, staging_bytes);
    }
    if (!s.empty()) throw std::runtime_error(s);
  }, nb::arg("ctx_id"), nb::arg("members"), nb::arg("nranks"), nb::arg("uid"), nb::arg("staging_bytes"),
  "Collective: the cross-node GIN communicator, staging window and GIN device communicator of the local members "
  "[(ordinal, global rank, node)].");
  m.def("gin_register_window", [](int64_t ctx, const std::vector<int32_t>& ordinals, int64_t window_id,
                                  int64_t alloc_id, int64_t offset, int64_t nbytes) {
    int64_t region_offset = -1;
    Status s;
    {
      nb::gil_scoped_release nogil;
      s = gin_register_window(registry(), ctx, ordinals, window_id, alloc_id, offset, nbytes, &region_offset);
    }
    if (!s.empty()) throw std::runtime_error(s);
    return region_offset;
  }, nb::arg("ctx_id"), nb::arg("ordinals"), nb::arg("window_id"), nb::arg("alloc_id"), nb::arg("offset"),
  nb::arg("nbytes"), "Collective: a table region as GIN window `window_id`; returns its offset in the window.");
  m.def("gin_release_window", [](int64_t ctx, int32_t ordinal, int64_t window_id) {
    nb::gil_scoped_release nogil;
    gin_release_window(ctx, ordinal, window_id);
  }, nb::arg("ctx_id"), nb::arg("ordinal"), nb::arg("window_id"));
  m.def("gin_release", [](int64_t ctx, int32_t ordinal) {
    nb::gil_scoped_release nogil;
    gin_release(ctx, ordinal);
  }, nb::arg("ctx_id"), nb::arg("ordinal"));
}

}  // namespace jax_engram
