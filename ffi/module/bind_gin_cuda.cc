// nanobind surface of the GIN support query (runtime/cuda_gin.h), CUDA module only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

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
}

}  // namespace jax_engram
