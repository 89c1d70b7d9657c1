// GIN support query (see cuda_gin.h).
#include "runtime/cuda_gin.h"

#include <nccl.h>

#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/engram_gin.h"
#include "runtime/cuda_member.h"

#if NCCL_VERSION_CODE >= 23004
#if __has_include(<nccl_device/host.h>)
#include <nccl_device/host.h>  // the host API moved here from core.h after 2.30
#else
#include <nccl_device/core.h>
#endif
#endif

namespace jax_engram {

GinSupport gin_support() {
  GinSupport s;
  s.compiled = engram_gin_compiled();
  s.build_version = NCCL_VERSION_CODE;
  int v = 0;
  s.runtime_version = ncclGetVersion(&v) == ncclSuccess ? v : 0;
  if (!s.compiled)
    s.reason = engram_gin_absent_reason();
  else if (s.runtime_version < kEngramGinMinNccl)
    s.reason = "the loaded libnccl (" + std::to_string(s.runtime_version) + ") is older than 2.30.4";
  return s;
}

Status gin_query(Registry& reg, int64_t ctx, int32_t ordinal, GinQuery* out) {
  Member* m = reg.find(ctx, ordinal);
  if (!m || !m->backend_state)
    return "no jax_engram member of context " + std::to_string(ctx) + " on GPU " + std::to_string(ordinal);
  const GinSupport s = gin_support();
  if (!s.reason.empty()) {
    out->reason = s.reason;
    return {};
  }
#if NCCL_VERSION_CODE >= 23004
  CudaMemberState& st = cuda_state(*m);
  if (!st.comm) {
    out->reason = "no NCCL communicator on this member yet";
    return {};
  }
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  const ncclResult_t r = ncclCommQueryProperties(st.comm, &props);
  if (r != ncclSuccess) {
    out->reason = std::string("ncclCommQueryProperties failed: ") + ncclGetErrorString(r);
    return {};
  }
  out->gin_type = static_cast<int>(props.ginType);
  out->railed_gin_type = static_cast<int>(props.railedGinType);
  if (out->gin_type <= 0 && out->railed_gin_type <= 0)
    out->reason = "NCCL reports no GIN backend (needs an RDMA NIC with GPUDirect: GDAKI or the proxy)";
#endif
  return {};
}

namespace {
std::mutex g_mu;
std::map<std::pair<int64_t, int32_t>, GinState>& states() {
  static auto* t = new std::map<std::pair<int64_t, int32_t>, GinState>();  // leaked: outlives XLA's threads
  return *t;
}
}  // namespace

GinState* gin_state(int64_t ctx, int32_t ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = states().find({ctx, ordinal});
  return it == states().end() || !it->second.devcomm ? nullptr : &it->second;
}

}  // namespace jax_engram
