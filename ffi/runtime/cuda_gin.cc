// GIN support query and the cross-node GIN communicator, windows and staging of a member (see cuda_gin.h).
#include "runtime/cuda_gin.h"

#include <nccl.h>

#include <cstring>
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
#include <nccl_device/impl/comm__types.h>
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

#if NCCL_VERSION_CODE >= 23004
ncclComm_t comm_of(const GinState& g) { return static_cast<ncclComm_t>(g.comm); }

// Waits for the members' communicators after a grouped call (bounded); on expiry marks them stuck so teardown
// aborts at once.
Status settle_all(std::vector<GinState*>& gs, ncclResult_t group_result, const std::string& what) {
  if (group_result != ncclSuccess && group_result != ncclInProgress)
    return nccl_error_string(group_result, "ncclGroupEnd after " + what);
  std::vector<ncclComm_t> comms;
  for (GinState* g : gs) comms.push_back(comm_of(*g));
  std::vector<ncclResult_t> st;
  if (!nccl_settle(comms, gs[0]->timeout_s, &st)) {
    for (GinState* g : gs) g->timeout_s = 0;
    return what + " on the cross-node GIN communicator did not complete within the context timeout (a peer process "
                  "did not take part)";
  }
  for (ncclResult_t r : st)
    if (r != ncclSuccess) return nccl_error_string(r, what);
  return {};
}

// Local teardown of one member's GIN state (device communicator, windows, staging, communicator).
void release_state(GinState& g) {
  if (!g.comm) return;
  CudaDeviceGuard guard(g.device);
  ncclComm_t c = comm_of(g);
  if (g.devcomm) {
    auto* dc = const_cast<ncclDevComm*>(static_cast<const ncclDevComm*>(g.devcomm));
    ncclDevCommDestroy(c, dc);
    delete dc;
    g.devcomm = nullptr;
  }
  for (auto& [id, w] : g.windows)
    if (w.win) ncclCommWindowDeregister(c, static_cast<ncclWindow_t>(w.win));
  g.windows.clear();
  if (g.staging_window) ncclCommWindowDeregister(c, static_cast<ncclWindow_t>(g.staging_window));
  g.staging_window = nullptr;
  std::vector<ncclResult_t> st;
  const bool settled = nccl_settle({c}, g.timeout_s, &st);
  if (g.staging && settled) ncclMemFree(g.staging);  // never free memory a stuck deregistration may still touch
  g.staging = nullptr;
  ncclResult_t r = settled ? ncclCommFinalize(c) : ncclInternalError;
  if ((r == ncclSuccess || r == ncclInProgress) && nccl_settle({c}, g.timeout_s, &st) && st[0] == ncclSuccess)
    ncclCommDestroy(c);
  else
    ncclCommAbort(c);
  g.comm = nullptr;
}
#endif
}  // namespace

int gin_launch_state(int64_t ctx, int32_t ordinal, int64_t window_id, GinState* state, GinWindow* window) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = states().find({ctx, ordinal});
  if (it == states().end() || !it->second.devcomm) return 1;
  auto w = it->second.windows.find(window_id);
  if (w == it->second.windows.end()) return 2;
  *window = w->second;
  const GinState& g = it->second;
  state->comm = g.comm;
  state->devcomm = g.devcomm;
  state->staging_window = g.staging_window;
  state->staging = g.staging;
  state->staging_bytes = g.staging_bytes;
  state->node = g.node;
  state->rank = g.rank;
  state->nranks = g.nranks;
  state->device = g.device;
  state->timeout_s = g.timeout_s;
  state->timeout_cycles = g.timeout_cycles;
  return 0;
}

Status gin_init(Registry& reg, int64_t ctx, const std::vector<GinMember>& members, int32_t nranks,
                const std::string& uid, int64_t staging_bytes) {
  const GinSupport sup = gin_support();
  if (!sup.reason.empty()) return sup.reason;
#if NCCL_VERSION_CODE >= 23004
  if (uid.size() != sizeof(ncclUniqueId)) return "gin_init: the NCCL unique id must be 128 bytes";
  if (members.empty()) return {};
  if (staging_bytes < 16) return "gin_init: staging_bytes must be >= 16";
  // Built here and published at the end: the collective steps below wait up to the timeout, without the lock.
  std::vector<GinState> built(members.size());
  std::vector<GinState*> gs;
  for (size_t i = 0; i < members.size(); ++i) {
    const GinMember& gm = members[i];
    Member* m = reg.find(ctx, gm.ordinal);
    if (!m || !m->backend_state)
      return "no jax_engram member of context " + std::to_string(ctx) + " on GPU " + std::to_string(gm.ordinal);
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (states().count({ctx, gm.ordinal})) return "gin_init: context " + std::to_string(ctx) + " already has GIN";
    }
    GinState& g = built[i];
    g.node = gm.node;
    g.rank = gm.rank;
    g.nranks = nranks;
    g.device = cuda_state(*m).device;
    g.timeout_s = m->timeout_s;
    g.staging_bytes = staging_bytes;
    int khz = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, g.device) != cudaSuccess) cudaGetLastError();
    g.timeout_cycles = static_cast<uint64_t>(m->timeout_s * 1e3 * (khz > 0 ? khz : 2000000));
    gs.push_back(&g);
  }
  auto fail = [&](const std::string& why) -> Status {
    for (size_t i = 0; i < gs.size(); ++i) {
      if (gs[i]->comm && gs[i]->timeout_s == 0) ncclCommAbort(comm_of(*gs[i])), gs[i]->comm = nullptr;
      release_state(*gs[i]);
    }
    return "jax_engram: setting up the cross-node GIN communicator of context " + std::to_string(ctx) + " (" +
           std::to_string(nranks) + " ranks) failed: " + why;
  };
  CudaDeviceGuard guard(gs[0]->device);
  ncclUniqueId id;
  std::memcpy(&id, uid.data(), sizeof(id));
  const std::string name = "jax_engram ctx " + std::to_string(ctx) + " gin";
  // 1. The communicator over every rank of the group (non-blocking: bounded by the context timeout).
  std::vector<ncclConfig_t> cfgs(gs.size());
  std::vector<ncclComm_t> comms(gs.size(), nullptr);
  std::string err;
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return fail(nccl_error_string(r, "ncclGroupStart"));
  for (size_t i = 0; i < gs.size() && err.empty(); ++i) {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    cfgs[i] = c;
    cfgs[i].commName = name.c_str();
    cfgs[i].blocking = 0;
    cudaSetDevice(gs[i]->device);
    r = ncclCommInitRankConfig(&comms[i], nranks, id, gs[i]->rank, &cfgs[i]);
    if (r != ncclSuccess && r != ncclInProgress)
      err = nccl_error_string(r, "ncclCommInitRankConfig(rank " + std::to_string(gs[i]->rank) + ")");
  }
  r = ncclGroupEnd();
  for (size_t i = 0; i < gs.size(); ++i) gs[i]->comm = comms[i];
  if (!err.empty()) return fail(err);
  if (Status t = settle_all(gs, r, "ncclCommInitRankConfig"); !t.empty()) return fail(t);
  // 2. GIN on every rank (NCCL answers for the whole communicator).
  for (GinState* g : gs) {
    ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
    r = ncclCommQueryProperties(comm_of(*g), &props);
    if (r != ncclSuccess) return fail(nccl_error_string(r, "ncclCommQueryProperties"));
    if (!props.deviceApiSupport || static_cast<int>(props.ginType) <= 0)
      return fail("NCCL reports no GIN on the cross-node communicator (deviceApiSupport=" +
                  std::to_string(props.deviceApiSupport) + ", ginType=" + std::to_string(props.ginType) + ")");
  }
  // 3. Staging: NCCL-allocated device memory (cuMem), registered as a window (collective).
  for (GinState* g : gs) {
    cudaSetDevice(g->device);
    void* p = nullptr;
    r = ncclMemAlloc(&p, static_cast<size_t>(staging_bytes));
    if (r != ncclSuccess) return fail(nccl_error_string(r, "ncclMemAlloc(staging)"));
    g->staging = static_cast<uint8_t*>(p);
  }
  std::vector<ncclWindow_t> wins(gs.size(), nullptr);
  r = ncclGroupStart();
  if (r != ncclSuccess) return fail(nccl_error_string(r, "ncclGroupStart"));
  for (size_t i = 0; i < gs.size() && err.empty(); ++i) {
    cudaSetDevice(gs[i]->device);
    r = ncclCommWindowRegister(comm_of(*gs[i]), gs[i]->staging, static_cast<size_t>(staging_bytes), &wins[i],
                               NCCL_WIN_DEFAULT);
    if (r != ncclSuccess && r != ncclInProgress) err = nccl_error_string(r, "ncclCommWindowRegister(staging)");
  }
  r = ncclGroupEnd();
  if (!err.empty()) return fail(err);
  if (Status t = settle_all(gs, r, "ncclCommWindowRegister(staging)"); !t.empty()) return fail(t);
  for (size_t i = 0; i < gs.size(); ++i) {
    if (!wins[i]) return fail("ncclCommWindowRegister(staging) returned no window");
    gs[i]->staging_window = wins[i];
  }
  // 4. The device communicator with GIN: FULL connections (a rank reads from any rank of another node), no
  //    signals or barriers (completion is per peer: flushAsync + wait).
  ncclDevCommRequirements_t req0 = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
  req0.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#if NCCL_VERSION_CODE >= 23005
  req0.ginStrongSignalsRequired = false;
  req0.ginVaSignalsRequired = false;
#endif
  std::vector<ncclDevCommRequirements_t> reqs(gs.size(), req0);  // read at ncclGroupEnd: keep alive
  std::vector<ncclDevComm*> dcs(gs.size(), nullptr);
  r = ncclGroupStart();
  if (r != ncclSuccess) return fail(nccl_error_string(r, "ncclGroupStart"));
  for (size_t i = 0; i < gs.size() && err.empty(); ++i) {
    cudaSetDevice(gs[i]->device);
    dcs[i] = new ncclDevComm();
    r = ncclDevCommCreate(comm_of(*gs[i]), &reqs[i], dcs[i]);
    if (r != ncclSuccess && r != ncclInProgress) err = nccl_error_string(r, "ncclDevCommCreate(GIN)");
  }
  r = ncclGroupEnd();
  Status t = err.empty() ? settle_all(gs, r, "ncclDevCommCreate(GIN)") : err;
  if (!t.empty()) {
    // A timed-out create may still write the structs until the communicator is aborted (fail() aborts it first).
    if (gs[0]->timeout_s != 0)
      for (ncclDevComm* d : dcs) delete d;
    return fail(t);
  }
  for (size_t i = 0; i < gs.size(); ++i) gs[i]->devcomm = dcs[i];
  std::lock_guard<std::mutex> lock(g_mu);
  for (size_t i = 0; i < members.size(); ++i) states()[{ctx, members[i].ordinal}] = std::move(built[i]);
  return {};
#else
  (void)reg, (void)ctx, (void)members, (void)nranks, (void)uid, (void)staging_bytes;
  return engram_gin_absent_reason();
#endif
}

Status gin_register_window(Registry& reg, int64_t ctx, const std::vector<int32_t>& ordinals, int64_t window_id,
                           int64_t alloc_id, int64_t offset, int64_t bytes, int64_t* region_offset) {
#if NCCL_VERSION_CODE >= 23004
  std::unique_lock<std::mutex> lock(g_mu);
  std::vector<GinState*> gs;  // map nodes stay put; only this context's own calls (one thread) remove them
  std::vector<uint8_t*> bases;
  std::vector<uint64_t> sizes;
  bool host = false;
  for (int32_t o : ordinals) {
    Member* m = reg.find(ctx, o);
    auto it = states().find({ctx, o});
    if (!m || it == states().end() || !it->second.devcomm)
      return "gin_register_window: context " + std::to_string(ctx) + " has no GIN communicator on GPU " +
             std::to_string(o);
    if (it->second.windows.count(window_id)) return "gin_register_window: window id already registered";
    Allocation* a = m->alloc(alloc_id);
    if (!a || !a->local) return "gin_register_window: no allocation " + std::to_string(alloc_id);
    // The window is the whole segment (one cuMem allocation: NCCL wants its start), the region inside it.
    uint64_t base = 0;
    size_t s = 0;
    for (; s < a->segments.size() && base + a->segments[s].bytes <= static_cast<uint64_t>(offset); ++s)
      base += a->segments[s].bytes;
    if (s == a->segments.size() || static_cast<uint64_t>(offset + bytes) > base + a->segments[s].bytes)
      return "gin_register_window: region [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
             ") is not inside one segment of allocation " + std::to_string(alloc_id);
    host = a->segments[s].kind == SegmentKind::kHost;
    if (host && !JE_GIN_SEGMENT_TAGS)
      return "gin_register_window: a host-placed table needs NCCL headers with GIN segment tags; place the "
             "table on the device or build against a newer nvidia-nccl-cu13";
    *region_offset = offset - static_cast<int64_t>(base);
    gs.push_back(&it->second);
    bases.push_back(a->local + base);
    sizes.push_back(a->segments[s].bytes);
  }
  if (gs.empty()) return {};
  lock.unlock();  // the registration waits (bounded) for every rank
  CudaDeviceGuard guard(gs[0]->device);
  std::vector<ncclWindow_t> wins(gs.size(), nullptr);
  std::string err;
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_error_string(r, "ncclGroupStart");
  for (size_t i = 0; i < gs.size() && err.empty(); ++i) {
    cudaSetDevice(gs[i]->device);
    r = ncclCommWindowRegister(comm_of(*gs[i]), bases[i], sizes[i], &wins[i], NCCL_WIN_DEFAULT);
    if (r != ncclSuccess && r != ncclInProgress) err = nccl_error_string(r, "ncclCommWindowRegister(table)");
  }
  r = ncclGroupEnd();
  Status t = err.empty() ? settle_all(gs, r, "ncclCommWindowRegister(table)") : err;
  lock.lock();
  for (size_t i = 0; i < gs.size(); ++i)
    if (wins[i]) gs[i]->windows[window_id] = GinWindow{wins[i], alloc_id, host};
  if (t.empty())
    for (ncclWindow_t w : wins)
      if (!w) t = "ncclCommWindowRegister(table) returned no window";
  if (!t.empty()) {
    for (GinState* g : gs) {
      auto it = g->windows.find(window_id);
      if (it == g->windows.end()) continue;
      ncclCommWindowDeregister(comm_of(*g), static_cast<ncclWindow_t>(it->second.win));
      g->windows.erase(it);
    }
    return "jax_engram: registering an Engram table for GIN (context " + std::to_string(ctx) + ") failed: " + t;
  }
  return {};
#else
  (void)reg, (void)ctx, (void)ordinals, (void)window_id, (void)alloc_id, (void)offset, (void)bytes,
      (void)region_offset;
  return engram_gin_absent_reason();
#endif
}

void gin_release_window(int64_t ctx, int32_t ordinal, int64_t window_id) {
#if NCCL_VERSION_CODE >= 23004
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = states().find({ctx, ordinal});
  if (it == states().end()) return;
  GinState& g = it->second;
  auto w = g.windows.find(window_id);
  if (w == g.windows.end()) return;
  CudaDeviceGuard guard(g.device);
  ncclCommWindowDeregister(comm_of(g), static_cast<ncclWindow_t>(w->second.win));
  g.windows.erase(w);
  std::vector<ncclResult_t> st;
  if (!nccl_settle({comm_of(g)}, g.timeout_s, &st)) g.timeout_s = 0;
#else
  (void)ctx, (void)ordinal, (void)window_id;
#endif
}

void gin_release_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = states().find({ctx, ordinal});
    if (it == states().end()) return;
    for (auto& [id, w] : it->second.windows)
      if (w.alloc_id == alloc_id) ids.push_back(id);
  }
  for (int64_t id : ids) gin_release_window(ctx, ordinal, id);
}

void gin_release(int64_t ctx, int32_t ordinal) {
#if NCCL_VERSION_CODE >= 23004
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = states().find({ctx, ordinal});
  if (it == states().end()) return;
  release_state(it->second);
  states().erase(it);
#else
  (void)ctx, (void)ordinal;
#endif
}

}  // namespace jax_engram
