// Side NCCL communicator, window and LSA device communicator of the CUDA members (see cuda_nccl.h).
// Compiles against NCCL 2.28.x (unversioned device-API structs) and 2.29+ (versioned structs, properties
// query); the loaded libnccl must be exactly the version of the headers (the device API is version-locked).
#include "runtime/cuda_nccl.h"

#include <dlfcn.h>
#include <nccl.h>

#if NCCL_VERSION_CODE < 22800
#error "jax_engram needs NCCL >= 2.28 headers (device API); install nvidia-nccl-cu13>=2.28.9 or set NCCL_ROOT"
#endif
#if NCCL_VERSION_CODE >= 22900 && __has_include(<nccl_device/host.h>)
#include <nccl_device/host.h>
#elif NCCL_VERSION_CODE >= 22900
#include <nccl_device/core.h>  // 2.29 / 2.30: the host-side device-API declarations live here
#include <nccl_device/impl/comm__types.h>
#else
#include <nccl_device/core.h>
#include <nccl_device/impl/comm__types.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "runtime/cuda_member.h"

#if defined(JAX_ENGRAM_NCCL_BUILD_VERSION)
static_assert(JAX_ENGRAM_NCCL_BUILD_VERSION == NCCL_VERSION_CODE,
              "CMake found one NCCL version, the compiler includes another nccl.h");
#endif

namespace jax_engram {
namespace {

std::string version_string(int v) {
  // NCCL >= 2.9 encodes X*10000 + Y*100 + Z.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::string nccl_error(ncclResult_t r, const std::string& what) {
  std::string s = what + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) s += std::string(" [") + last + "]";
  return s;
}

std::string library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) && info.dli_fname) return info.dli_fname;
  return "libnccl.so.2";
}

Status check_version() {
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) return nccl_error(r, "ncclGetVersion");
  if (v != NCCL_VERSION_CODE)
    return "jax_engram: the NCCL library loaded at run time (" + library_path() + ") is NCCL " + version_string(v) +
           " but jax_engram was built against the NCCL " + version_string(NCCL_VERSION_CODE) +
           " headers. NCCL's device API is version-locked, so both must match: install the matching wheel "
           "(pip install nvidia-nccl-cu13==" + version_string(NCCL_VERSION_CODE) +
           ") or rebuild jax_engram against the installed NCCL (pip install -e . --no-build-isolation).";
  return {};
}

// Members of `ctx` on `ordinals`, with their CUDA state; fails if any is missing.
Status local_members(Registry& reg, int64_t ctx, const std::vector<int32_t>& ordinals, std::vector<Member*>* out) {
  for (int32_t o : ordinals) {
    Member* m = reg.find(ctx, o);
    if (!m || !m->backend_state)
      return "no jax_engram member of context " + std::to_string(ctx) + " on GPU " + std::to_string(o);
    out->push_back(m);
  }
  return {};
}

const char* kNoWindowReason =
    "ncclCommWindowRegister returned no window: the communicator has no symmetric-memory (device API) support. "
    "Causes: GPUs of the axis without CUDA P2P between them, NCCL_CUMEM_ENABLE=0 or NCCL_WIN_ENABLE=0, or ranks "
    "on several nodes without GIN (RDMA NIC) on all of them. jax_engram's own peer mappings are unaffected.";

// Every communicator is created non-blocking (ncclConfig_t::blocking = 0): an NCCL call on it returns
// ncclInProgress while the work goes on in NCCL's threads, and ncclCommGetAsyncError tells when it is done. This
// waits, polling, until no communicator of `comms` is in progress any more or `timeout_s` has passed; the state of
// each is left in (*states)[i] (ncclInProgress for the ones still busy at the deadline). True if none is busy.
bool settle(const std::vector<ncclComm_t>& comms, double timeout_s, std::vector<ncclResult_t>* states) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  states->assign(comms.size(), ncclSuccess);
  for (auto sleep = std::chrono::microseconds(20);; sleep = std::min(sleep * 2, std::chrono::microseconds(20000))) {
    bool busy = false;
    for (size_t i = 0; i < comms.size(); ++i) {
      if (!comms[i]) continue;
      ncclResult_t st = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comms[i], &st);
      (*states)[i] = r != ncclSuccess ? r : st;
      busy |= (*states)[i] == ncclInProgress;
    }
    if (!busy) return true;
    if (clock::now() >= deadline) return false;
    std::this_thread::sleep_for(sleep);
  }
}

std::string rank_list(const std::vector<int32_t>& ranks) {
  std::string s;
  for (int32_t r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return "[" + s + "]";
}

}  // namespace

bool nccl_settle(const std::vector<ncclComm_t>& comms, double timeout_s, std::vector<ncclResult_t>* states) {
  return settle(comms, timeout_s, states);
}

std::string nccl_error_string(ncclResult_t r, const std::string& what) { return nccl_error(r, what); }

int nccl_runtime_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

int nccl_build_version() { return NCCL_VERSION_CODE; }

Status nccl_unique_id(std::string* out) {
  Status s = check_version();
  if (!s.empty()) return s;
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return nccl_error(r, "ncclGetUniqueId");
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return {};
}

Status nccl_comm_init(Registry& reg, int64_t ctx, const std::vector<std::pair<int32_t, int32_t>>& members,
                      int32_t nranks, const std::string& uid) {
  Status s = check_version();
  if (!s.empty()) return s;
  if (uid.size() != sizeof(ncclUniqueId))
    return "comm_init: the NCCL unique id must be " + std::to_string(sizeof(ncclUniqueId)) + " bytes, got " +
           std::to_string(uid.size());
  std::vector<int32_t> ordinals;
  for (auto& [o, r] : members) ordinals.push_back(o);
  std::vector<Member*> ms;
  if (!(s = local_members(reg, ctx, ordinals, &ms)).empty()) return s;
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i]->rank != members[i].second || ms[i]->nranks != nranks)
      return "comm_init: GPU " + std::to_string(members[i].first) + " is rank " + std::to_string(ms[i]->rank) + " of " +
             std::to_string(ms[i]->nranks) + " in context " + std::to_string(ctx) + ", not rank " +
             std::to_string(members[i].second) + " of " + std::to_string(nranks);
    if (cuda_state(*ms[i]).comm) return "comm_init: context " + std::to_string(ctx) + " already has a communicator";
  }
  ncclUniqueId id;
  std::memcpy(&id, uid.data(), sizeof(id));
  const std::string name = "jax_engram ctx " + std::to_string(ctx);
  std::vector<ncclConfig_t> cfgs(ms.size());
  std::vector<ncclComm_t> comms(ms.size(), nullptr);
  std::string first_err;
  CudaDeviceGuard guard(cuda_state(*ms[0]).device);  // restores the caller's device
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_error(r, "ncclGroupStart");
  for (size_t i = 0; i < ms.size(); ++i) {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    cfgs[i] = c;
    cfgs[i].commName = name.c_str();
    cfgs[i].blocking = 0;  // bounded below by the context timeout instead of waiting for every rank forever
    cudaError_t ce = cudaSetDevice(cuda_state(*ms[i]).device);
    if (ce != cudaSuccess) {
      first_err = "cudaSetDevice: " + cuda_error_string(ce);
      break;
    }
    r = ncclCommInitRankConfig(&comms[i], nranks, id, ms[i]->rank, &cfgs[i]);
    if (r != ncclSuccess && r != ncclInProgress) {
      first_err = nccl_error(r, "ncclCommInitRankConfig(rank " + std::to_string(ms[i]->rank) + ")");
      break;
    }
  }
  r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress && first_err.empty())
    first_err = nccl_error(r, "ncclGroupEnd after ncclCommInitRankConfig");
  const double timeout_s = ms[0]->timeout_s;
  if (first_err.empty()) {
    std::vector<ncclResult_t> states;
    if (!settle(comms, timeout_s, &states)) {
      // The ranks of the group that live in other processes: one of them never joined (or joined another id).
      std::vector<int32_t> local, missing;
      for (Member* m : ms) local.push_back(m->rank);
      for (int32_t rk = 0; rk < nranks; ++rk)
        if (std::find(local.begin(), local.end(), rk) == local.end()) missing.push_back(rk);
      for (auto& c : comms)
        if (c) ncclCommAbort(c);
      char secs[32];
      snprintf(secs, sizeof(secs), "%.3g", timeout_s);
      return "jax_engram: creating the NCCL communicator of context " + std::to_string(ctx) + " (" +
             std::to_string(nranks) + " ranks) timed out after " + secs + " s: local ranks " + rank_list(local) +
             " were ready, ranks " + rank_list(missing) +
             " of the other processes did not all join (a process crashed, hangs, or did not reach the same "
             "jax_engram call). The communicator was aborted; raise timeout_s in jax_engram.init() if a peer is "
             "only slow, or run with NCCL_DEBUG=WARN for NCCL's own diagnosis.";
    }
    for (size_t i = 0; i < states.size() && first_err.empty(); ++i)
      if (states[i] != ncclSuccess)
        first_err = nccl_error(states[i], "ncclCommInitRankConfig(rank " + std::to_string(ms[i]->rank) + ")");
  }
  if (!first_err.empty()) {
    for (auto& c : comms)
      if (c) ncclCommAbort(c);
    return "jax_engram: creating the NCCL communicator of context " + std::to_string(ctx) + " (" +
           std::to_string(nranks) + " ranks) failed: " + first_err +
           ". Every process owning devices of the axis must call jax_engram.init() with the same mesh; run with "
           "NCCL_DEBUG=WARN (or INFO) for NCCL's own diagnosis.";
  }
  for (size_t i = 0; i < ms.size(); ++i) {
    CudaMemberState& st = cuda_state(*ms[i]);
    st.comm = comms[i];
    st.nccl_rank = ms[i]->rank;
    st.nccl_timeout_s = timeout_s;
  }
  return {};
}

namespace {
// After a collective group call on the members' (non-blocking) communicators: wait, bounded by the context
// timeout, until NCCL has finished it. A peer that never takes part is an error here (the caller's init fails
// and tears the communicators down); NCCL's own failure is left to the caller (it is recorded, not raised).
Status settle_group(const std::vector<Member*>& ms, ncclResult_t group_result, const char* what) {
  if (group_result != ncclInProgress && group_result != ncclSuccess) return {};
  std::vector<ncclComm_t> comms;
  for (Member* m : ms) comms.push_back(cuda_state(*m).comm);
  std::vector<ncclResult_t> states;
  if (settle(comms, ms[0]->timeout_s, &states)) return {};
  for (Member* m : ms) cuda_state(*m).nccl_timeout_s = 0;  // stuck: teardown aborts at once instead of waiting again
  char secs[32];
  snprintf(secs, sizeof(secs), "%.3g", ms[0]->timeout_s);
  return std::string("jax_engram: ") + what + " on the NCCL communicator of context " + std::to_string(ms[0]->ctx_id) +
         " did not complete within " + secs + " s: a peer process did not take part (it crashed, hangs, or ran "
         "another sequence of jax_engram calls). Close the context; raise timeout_s in jax_engram.init() if a peer "
         "is only slow.";
}
}  // namespace

Status nccl_window_register(Registry& reg, int64_t ctx, const std::vector<int32_t>& ordinals) {
  std::vector<Member*> ms;
  Status s = local_members(reg, ctx, ordinals, &ms);
  if (!s.empty()) return s;
  if (ms.empty()) return {};
  for (Member* m : ms) {
    CudaMemberState& st = cuda_state(*m);
    if (!st.comm) return "window_register: context " + std::to_string(ctx) + " has no NCCL communicator (comm_init first)";
    if (st.window || st.devcomm) return "window_register: context " + std::to_string(ctx) + " already has a window";
    Allocation* a = m->alloc(0);
    if (!a || !a->local || a->segments.empty() || a->segments[0].kind != SegmentKind::kDevice)
      return "window_register: context " + std::to_string(ctx) + " has no device window (allocation 0) on GPU " +
             std::to_string(m->ordinal);
  }
  CudaDeviceGuard guard(cuda_state(*ms[0]).device);

  // 1. The window: only segment 0 (workspace + device segment). NCCL 2.28.x faults on windows that span a
  //    HOST_NUMA segment (measured on H200), and kernels reach host memory through our own mappings anyway.
  std::vector<ncclWindow_t> wins(ms.size(), nullptr);
  std::vector<std::string> werr(ms.size());
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_error(r, "ncclGroupStart");
  for (size_t i = 0; i < ms.size(); ++i) {
    CudaMemberState& st = cuda_state(*ms[i]);
    Allocation* a = ms[i]->alloc(0);
    cudaSetDevice(st.device);
    r = ncclCommWindowRegister(st.comm, a->local, a->segments[0].bytes, &wins[i], NCCL_WIN_COLL_SYMMETRIC);
    if (r != ncclSuccess && r != ncclInProgress) werr[i] = nccl_error(r, "ncclCommWindowRegister");
  }
  r = ncclGroupEnd();
  if (Status t = settle_group(ms, r, "ncclCommWindowRegister"); !t.empty()) return t;
  if (r == ncclInProgress) r = ncclSuccess;
  for (size_t i = 0; i < ms.size(); ++i) {
    CudaMemberState& st = cuda_state(*ms[i]);
    st.window = wins[i];
    if (wins[i]) {
      st.window_reason.clear();
      continue;
    }
    st.window_reason = !werr[i].empty() ? werr[i]
                       : r != ncclSuccess ? nccl_error(r, "ncclGroupEnd after ncclCommWindowRegister")
                                          : std::string(kNoWindowReason);
#if NCCL_VERSION_CODE >= 22900
    ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
    if (ncclCommQueryProperties(st.comm, &props) == ncclSuccess)
      st.window_reason += " (ncclCommQueryProperties: deviceApiSupport=" + std::to_string(props.deviceApiSupport) + ")";
#endif
  }

  // 2. An LSA-only device communicator (no GIN): LSA team discovery now, the base for GIN later.
  std::vector<ncclDevComm*> dcs(ms.size(), nullptr);
#if NCCL_VERSION_CODE >= 22900
  ncclDevCommRequirements_t req0 = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements_t req0{};  // 2.28.x: unversioned; GIN stays off on one node without GIN resources
#endif
  req0.lsaBarrierCount = 1;
#if NCCL_VERSION_CODE >= 23100
  req0.ginStrongSignalsRequired = false;  // no GIN: do not ask the (absent) GIN backend for signal features
  req0.ginVaSignalsRequired = false;
#endif
  std::vector<ncclDevCommRequirements_t> reqs(ms.size(), req0);  // read at ncclGroupEnd: keep alive
  std::vector<std::string> derr(ms.size());
  r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_error(r, "ncclGroupStart");
  for (size_t i = 0; i < ms.size(); ++i) {
    CudaMemberState& st = cuda_state(*ms[i]);
    cudaSetDevice(st.device);
    dcs[i] = new ncclDevComm();
    ncclResult_t ri = ncclDevCommCreate(st.comm, &reqs[i], dcs[i]);
    if (ri != ncclSuccess && ri != ncclInProgress) derr[i] = nccl_error(ri, "ncclDevCommCreate");
  }
  r = ncclGroupEnd();
  // On a timeout the structs stay allocated: NCCL may still write them until the communicator is aborted.
  if (Status t = settle_group(ms, r, "ncclDevCommCreate"); !t.empty()) return t;
  if (r == ncclInProgress) r = ncclSuccess;
  for (size_t i = 0; i < ms.size(); ++i) {
    CudaMemberState& st = cuda_state(*ms[i]);
    if (derr[i].empty() && r == ncclSuccess) {
      st.devcomm = dcs[i];
      st.lsa_size = dcs[i]->lsaSize;
      st.lsa_rank = dcs[i]->lsaRank;
      st.devcomm_reason.clear();
    } else {
      delete dcs[i];
      st.devcomm_reason = !derr[i].empty() ? derr[i] : nccl_error(r, "ncclGroupEnd after ncclDevCommCreate");
      st.devcomm_reason += " (LSA-only requirements; this NCCL communicator has no device API here, see the window "
                           "reason; jax_engram's kernels do not need it)";
    }
  }
  return {};
}

Status nccl_topology(Registry& reg, int64_t ctx, int32_t ordinal, TopologyInfo* out) {
  Member* m = reg.find(ctx, ordinal);
  if (!m || !m->backend_state)
    return "no jax_engram member of context " + std::to_string(ctx) + " on GPU " + std::to_string(ordinal);
  CudaMemberState& st = cuda_state(*m);
  TopologyInfo& t = *out;
  t.nccl_runtime_version = nccl_runtime_version();
  t.nccl_build_version = NCCL_VERSION_CODE;
  t.nccl_rank = st.nccl_rank;
  t.nranks = m->nranks;
  t.lsa_size = st.lsa_size;
  t.lsa_rank = st.lsa_rank;
  t.window_registered = st.window != nullptr;
  t.window_reason = st.window ? "" : st.window_reason.empty() ? "not registered yet" : st.window_reason;
  t.devcomm = st.devcomm != nullptr;
  t.devcomm_reason = st.devcomm ? "" : st.devcomm_reason.empty() ? "not created yet" : st.devcomm_reason;
#if NCCL_VERSION_CODE >= 22900
  if (st.comm) {
    ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
    if (ncclCommQueryProperties(st.comm, &props) == ncclSuccess) t.device_api_support = props.deviceApiSupport ? 1 : 0;
  }
#endif
  t.device = st.device;
  t.device_name = st.name;
  t.sm_count = st.sm_count;
  t.cc_major = st.cc_major;
  t.cc_minor = st.cc_minor;
  for (Member* p : reg.members()) {
    if (p == m || p->ctx_id != ctx || !p->backend_state) continue;
    int can = 0;
    int pd = cuda_state(*p).device;
    if (pd == st.device) {
      can = 1;
    } else if (cudaDeviceCanAccessPeer(&can, st.device, pd) != cudaSuccess) {
      cudaGetLastError();
      can = 0;
    }
    t.p2p[pd] = can != 0;
  }
  t.host_numa_id = st.host_numa_id;
  t.host_numa_vmm = st.host_numa_vmm;
  t.gdr_vmm = st.gdr_vmm;
  return {};
}

void nccl_release_window(CudaMemberState& st) {
  if (!st.comm || (!st.devcomm && !st.window)) return;
  CudaDeviceGuard g(st.device);
  if (st.devcomm) {
    ncclDevCommDestroy(st.comm, st.devcomm);
    delete st.devcomm;
    st.devcomm = nullptr;
  }
  if (st.window) {
    ncclCommWindowDeregister(st.comm, st.window);
    st.window = nullptr;
  }
  // Non-blocking communicator: let both calls finish (bounded) before the memory or the communicator goes; if
  // they do not, nccl_release_comm aborts the communicator at once.
  std::vector<ncclResult_t> states;
  if (!settle({st.comm}, st.nccl_timeout_s, &states)) st.nccl_timeout_s = 0;
}

void nccl_release_comm(CudaMemberState& st) {
  if (!st.comm) return;
  CudaDeviceGuard g(st.device);
  // Not collective: NCCL frees process-shared resources when the last communicator of the process goes. The
  // communicator is non-blocking: finalize (flushes its work), wait for that, bounded by the context timeout so a
  // dead peer cannot hold close(), then destroy; abort instead if it does not settle.
  std::vector<ncclResult_t> states;
  ncclResult_t r = ncclCommFinalize(st.comm);
  if ((r == ncclSuccess || r == ncclInProgress) && settle({st.comm}, st.nccl_timeout_s, &states) &&
      states[0] == ncclSuccess)
    ncclCommDestroy(st.comm);
  else
    ncclCommAbort(st.comm);
  st.comm = nullptr;
}

}  // namespace jax_engram
