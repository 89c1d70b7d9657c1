// CUDA backend of the runtime (see cuda_backend.h). Every allocation is one VA reservation holding its
// segments back to back (cuMemCreate PINNED, POSIX-FD shareable): DEVICE segments on the member's GPU,
// HOST segments in host NUMA memory next to it. Peers in this process use the owner's VA (after granting
// this member's GPU access to it); peers in other processes of the host import the exported FDs and map
// them into a VA of their own; peers on other hosts are unreachable (nullptr; ops refuse them).
#include "runtime/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "kernels/cuda/base.h"
#include "runtime/cuda_driver.h"
#include "runtime/cuda_gin.h"
#include "runtime/cuda_member.h"
#include "runtime/shm.h"

namespace jax_engram {

std::string cuda_error_string(cudaError_t e) {
  cudaGetLastError();  // clear, so the next unrelated check does not see this error again
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

CudaDeviceGuard::CudaDeviceGuard(int device) {
  bool have_ctx = false;
  if (const CudaDriver* d = cuda_driver(nullptr)) {
    CUcontext c = nullptr;
    have_ctx = d->cuCtxGetCurrent(&c) == CUDA_SUCCESS && c != nullptr;
  }
  int cur = -1;
  if (have_ctx && cudaGetDevice(&cur) == cudaSuccess && cur == device) return;
  if (have_ctx && cur >= 0) prev_ = cur;
  status_ = cudaSetDevice(device);
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

namespace {

// One VA range with cuMem segments mapped back to back (own memory or a peer's imported memory).
struct Mapping {
  CUdeviceptr va = 0;
  size_t bytes = 0;                                  // reserved size
  std::vector<size_t> sizes;                         // per segment
  std::vector<CUmemGenericAllocationHandle> handles; // created or imported (released on free)
  size_t mapped = 0;                                 // segments [0, mapped) are mapped
  bool cpu_readable = true;                          // this process's CPU may read/write its host segments
};

struct CudaAlloc {
  int device = -1;
  size_t align = kSegmentAlignment;  // VA alignment: max of the segments' cuMem granularities
  Mapping own;
  std::vector<int> fds;            // exported shareable handles (closed by close_exports)
  std::vector<Mapping> imports;    // other processes' memory
  void* peers_device = nullptr;    // cudaMalloc'd copy of Allocation::peers
  std::mutex mu;
  std::vector<int> accessors;      // other GPUs of this process granted access to `own` (by their connect)
};

std::string seg_name(const SegmentSpec& s) { return s.kind == SegmentKind::kDevice ? "device" : "host"; }

void release_mapping(const CudaDriver* d, Mapping& mp) {
  size_t off = 0;
  for (size_t i = 0; i < mp.mapped; ++i) {
    d->cuMemUnmap(mp.va + off, mp.sizes[i]);
    off += mp.sizes[i];
  }
  mp.mapped = 0;
  for (auto h : mp.handles) d->cuMemRelease(h);
  mp.handles.clear();
  if (mp.va) d->cuMemAddressFree(mp.va, mp.bytes);
  mp.va = 0;
}

void close_fds(CudaAlloc& al) {
  for (int fd : al.fds)
    if (fd >= 0) close(fd);
  al.fds.clear();
}

void release_all(const CudaDriver* d, CudaAlloc& al) {
  close_fds(al);
  if (al.peers_device) cudaFree(al.peers_device);
  al.peers_device = nullptr;
  for (auto& mp : al.imports) release_mapping(d, mp);
  al.imports.clear();
  release_mapping(d, al.own);
}

// Maps mp.handles back to back into a fresh reservation and gives `device` read/write access; host segments
// (kinds from `segs`, the same layout on every rank) also to this process's CPU (host NUMA node `numa`), so that
// the Engram host path's worker threads gather from them. A driver that refuses the CPU grant leaves
// mp.cpu_readable false (fetches then use the GPU gather) instead of failing the allocation.
Status map_all(const CudaDriver* d, Mapping& mp, size_t align, int device, const std::string& what,
               const std::vector<SegmentSpec>& segs, int numa) {
  CUresult r = d->cuMemAddressReserve(&mp.va, mp.bytes, align, 0, 0);
  if (r != CUDA_SUCCESS) {
    mp.va = 0;
    return "cuMemAddressReserve(" + std::to_string(mp.bytes) + " bytes) for " + what + " failed: " + cu_error_string(r);
  }
  size_t off = 0;
  for (size_t i = 0; i < mp.handles.size(); ++i) {
    r = d->cuMemMap(mp.va + off, mp.sizes[i], 0, mp.handles[i], 0);
    if (r != CUDA_SUCCESS)
      return "cuMemMap of segment " + std::to_string(i) + " of " + what + " failed: " + cu_error_string(r);
    mp.mapped = i + 1;
    off += mp.sizes[i];
  }
  CUmemAccessDesc acc{};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d->cuMemSetAccess(mp.va, mp.bytes, &acc, 1);
  if (r != CUDA_SUCCESS)
    return "cuMemSetAccess(read/write for GPU " + std::to_string(device) + ") on " + what + " failed: " +
           cu_error_string(r);
  off = 0;
  for (size_t i = 0; i < mp.sizes.size(); ++i) {
    if (i < segs.size() && segs[i].kind == SegmentKind::kHost) {
      CUmemAccessDesc both[2] = {acc, {}};
      both[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      both[1].location.id = numa < 0 ? 0 : numa;
      both[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if (d->cuMemSetAccess(mp.va + off, mp.sizes[i], both, 2) != CUDA_SUCCESS) mp.cpu_readable = false;
    }
    off += mp.sizes[i];
  }
  return {};
}

class CudaBackend final : public Backend {
 public:
  const char* platform() const override { return "gpu"; }

  Status init_member(Member& m) override {
    std::string err;
    const CudaDriver* d = cuda_driver(&err);
    if (!d) return "jax_engram (CUDA): " + err;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return "jax_engram (CUDA): cudaGetDeviceCount failed: " + cuda_error_string(e);
    if (m.ordinal < 0 || m.ordinal >= n)
      return "jax_engram (CUDA): device ordinal " + std::to_string(m.ordinal) + " is not visible to the CUDA runtime (" +
             std::to_string(n) + " devices; check CUDA_VISIBLE_DEVICES)";
    auto st = std::make_shared<CudaMemberState>();
    st->device = m.ordinal;
    CudaDeviceGuard g(st->device);
    if (g.status() != cudaSuccess)
      return "cudaSetDevice(" + std::to_string(st->device) + ") failed: " + cuda_error_string(g.status());

    cudaDeviceProp prop{};
    if ((e = cudaGetDeviceProperties(&prop, st->device)) != cudaSuccess)
      return "cudaGetDeviceProperties failed: " + cuda_error_string(e);
    st->name = prop.name;
    st->sm_count = prop.multiProcessorCount;
    st->cc_major = prop.major;
    st->cc_minor = prop.minor;
    st->vmm = cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0) != 0;
    st->posix_fd = cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0) != 0;
    st->gdr_vmm = cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, 0) != 0;
    st->host_numa_vmm =
        cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0) != 0;
    st->host_numa_id = cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, -1);
    const std::string dev = "GPU " + std::to_string(st->device) + " (" + st->name + ")";
    if (!st->vmm || !st->posix_fd)
      return "jax_engram (CUDA): " + dev + " does not support cuMem virtual memory management with POSIX file "
             "descriptor handles (VMM " + std::to_string(st->vmm) + ", POSIX FD " + std::to_string(st->posix_fd) +
             "); symmetric windows need both";
    if ((e = kernels_loadable(st->device)) != cudaSuccess)
      return "jax_engram (CUDA): the module has no kernel image for " + dev + ", compute capability " +
             std::to_string(st->cc_major) + "." + std::to_string(st->cc_minor) + " (" + cuda_error_string(e) +
             "). Rebuild with -DCMAKE_CUDA_ARCHITECTURES=" + std::to_string(st->cc_major * 10 + st->cc_minor) + ".";

    auto fail = [&](const std::string& what, cudaError_t err2) {
      if (st->ep_fork) cudaEventDestroy(st->ep_fork);
      for (auto& ev : st->ep_joins)
        if (ev) cudaEventDestroy(ev);
      for (auto& cs : st->ep_copy_streams)
        if (cs) cudaStreamDestroy(cs);
      if (st->side_stream) cudaStreamDestroy(st->side_stream);
      if (st->error_alloc) cudaFreeHost(st->error_alloc);
      return "jax_engram (CUDA) on " + dev + ": " + what + " failed: " + cuda_error_string(err2);
    };
    // The error record: pinned, mapped host memory written by kernels and read by handlers without a sync.
    constexpr size_t kRecordBytes = 256;
    static_assert(sizeof(ErrorRecord) <= kRecordBytes, "ErrorRecord grew");
    if ((e = cudaHostAlloc(&st->error_alloc, kRecordBytes, cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess) {
      st->error_alloc = nullptr;
      return fail("cudaHostAlloc of the error record", e);
    }
    std::memset(st->error_alloc, 0, kRecordBytes);
    void* dev_ptr = nullptr;
    if ((e = cudaHostGetDevicePointer(&dev_ptr, st->error_alloc, 0)) != cudaSuccess)
      return fail("cudaHostGetDevicePointer of the error record", e);
    // Highest priority: the few CTAs of an overlapped Engram fetch are dispatched ahead of the model's pending CTAs
    // as soon as an SM frees up, instead of after every CTA of the kernel the fetch is meant to run beside.
    int least_priority = 0, greatest_priority = 0;
    if (cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority) != cudaSuccess) {
      cudaGetLastError();
      greatest_priority = 0;
    }
    if ((e = cudaStreamCreateWithPriority(&st->side_stream, cudaStreamNonBlocking, greatest_priority)) != cudaSuccess) {
      st->side_stream = nullptr;
      return fail("cudaStreamCreateWithPriority", e);
    }
    for (int i = 0; i < CudaMemberState::kEpCopyStreams; ++i) {
      if ((e = cudaStreamCreateWithFlags(&st->ep_copy_streams[i], cudaStreamNonBlocking)) != cudaSuccess) {
        st->ep_copy_streams[i] = nullptr;
        return fail("cudaStreamCreateWithFlags (EP copy stream)", e);
      }
      if ((e = cudaEventCreateWithFlags(&st->ep_joins[i], cudaEventDisableTiming)) != cudaSuccess) {
        st->ep_joins[i] = nullptr;
        return fail("cudaEventCreateWithFlags (EP join)", e);
      }
    }
    if ((e = cudaEventCreateWithFlags(&st->ep_fork, cudaEventDisableTiming)) != cudaSuccess) {
      st->ep_fork = nullptr;
      return fail("cudaEventCreateWithFlags (EP fork)", e);
    }
    {
      const CudaDriver* drv = cuda_driver(nullptr);
      st->stream_mem_ops = drv && drv->cuStreamWriteValue64 &&
                           cu_device_attribute(st->device, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 0) != 0;
      // 32-bit stream memory operations (v2 API) are supported on every device of the drivers that export the
      // entry point; without them the host path gathers synchronously in a host function (engram_host.h).
      st->stream_wait_value = drv && drv->cuStreamWaitValue32;
    }
    m.error_host = static_cast<ErrorRecord*>(st->error_alloc);
    m.error_device = static_cast<ErrorRecord*>(dev_ptr);
    m.backend_state = st;
    return {};
  }

  void destroy_member(Member& m) override {
    if (!m.backend_state) return;
    CudaMemberState& st = cuda_state(m);
    gin_release(m.ctx_id, m.ordinal);  // the cross-node GIN communicator and its windows over our allocations
    nccl_release_window(st);
    nccl_release_comm(st);
    CudaDeviceGuard g(st.device);
    if (st.ep_fork) cudaEventDestroy(st.ep_fork);
    st.ep_fork = nullptr;
    for (int i = 0; i < CudaMemberState::kEpCopyStreams; ++i) {
      if (st.ep_joins[i]) cudaEventDestroy(st.ep_joins[i]);
      if (st.ep_copy_streams[i]) cudaStreamDestroy(st.ep_copy_streams[i]);
      st.ep_joins[i] = nullptr;
      st.ep_copy_streams[i] = nullptr;
    }
    if (st.enqueuer) st.enqueuer->stop();  // idle since the quiesce; joined before the state its tasks use goes
    st.enqueuer.reset();
    st.host_fetch.reset();  // pinned staging (the registry already joined the host gather pool)
    for (cudaEvent_t ev : {st.engram_fork, st.engram_join})
      if (ev) cudaEventDestroy(ev);
    for (auto& kv : st.engram_slots)
      if (kv.second) cudaEventDestroy(kv.second);
    st.engram_fork = st.engram_join = nullptr;
    st.engram_slots.clear();
    if (st.side_stream) cudaStreamDestroy(st.side_stream);
    if (st.error_alloc) cudaFreeHost(st.error_alloc);
    st.side_stream = nullptr;
    st.error_alloc = nullptr;
    m.error_host = m.error_device = nullptr;
    m.backend_state.reset();
  }

  Status create_alloc(Member& m, Allocation& a) override {
    std::string err;
    const CudaDriver* d = cuda_driver(&err);
    if (!d) return err;
    CudaMemberState& st = cuda_state(m);
    CudaDeviceGuard g(st.device);
    if (g.status() != cudaSuccess) return "cudaSetDevice failed: " + cuda_error_string(g.status());
    auto al = std::make_shared<CudaAlloc>();
    al->device = st.device;
    Status s = create(d, st, a, *al);
    if (!s.empty()) {
      release_all(d, *al);
      return "jax_engram: creating allocation " + std::to_string(a.id) + " (" + std::to_string(a.total_bytes) +
             " bytes) on GPU " + std::to_string(st.device) + ": " + s;
    }
    a.backend_state = al;
    a.local = reinterpret_cast<uint8_t*>(al->own.va);
    a.exported.pid = getpid();
    a.exported.host_id = host_id();
    a.exported.fds.assign(al->fds.begin(), al->fds.end());
    a.exported.sizes.assign(al->own.sizes.begin(), al->own.sizes.end());
    a.exported.device = st.device;
    return {};
  }

  Status connect_alloc(Registry& reg, Member& m, Allocation& a, const std::vector<Export>& peers) override {
    std::string err;
    const CudaDriver* d = cuda_driver(&err);
    if (!d) return err;
    CudaMemberState& st = cuda_state(m);
    auto al = std::static_pointer_cast<CudaAlloc>(a.backend_state);
    CudaDeviceGuard g(st.device);
    if (g.status() != cudaSuccess) return "cudaSetDevice failed: " + cuda_error_string(g.status());
    const std::string me = host_id();
    const pid_t my_pid = getpid();
    a.peers.assign(peers.size(), nullptr);
    for (size_t r = 0; r < peers.size(); ++r) {
      const Export& e = peers[r];
      const std::string who = "rank " + std::to_string(r) + " (GPU " + std::to_string(e.device) + ", pid " +
                              std::to_string(e.pid) + ")";
      if (static_cast<int>(r) == m.rank) {
        a.peers[r] = a.local;
        continue;
      }
      if (e.host_id != me) continue;  // another host: not mappable (nullptr); ops refuse such contexts
      if (e.sizes != al->own.sizes || e.fds.size() != e.sizes.size())
        return who + " created allocation " + std::to_string(a.id) + " with another segment layout";
      if (e.pid == my_pid) {
        Status s = connect_local(d, reg, m, st, a, static_cast<int>(r), e, who);
        if (!s.empty()) return s;
        continue;
      }
      al->imports.emplace_back();
      Mapping& mp = al->imports.back();
      mp.sizes = e.sizes;
      for (auto sz : e.sizes) mp.bytes += sz;
      for (size_t i = 0; i < e.fds.size(); ++i) {
        int fd = import_fd(e.pid, e.fds[i], &err);
        if (fd < 0)
          return "importing segment " + std::to_string(i) + " of " + who + ": " + err +
                 " (processes of one host share GPU memory by file descriptor; they must run as the same user "
                 "and may not be sandboxed from each other)";
        CUmemGenericAllocationHandle h = 0;
        CUresult cr = d->cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd);  // the imported handle keeps the memory alive
        if (cr != CUDA_SUCCESS)
          return "cuMemImportFromShareableHandle of segment " + std::to_string(i) + " of " + who +
                 " failed: " + cu_error_string(cr);
        mp.handles.push_back(h);
      }
      Status s = map_all(d, mp, al->align, st.device, "the memory of " + who, a.segments, st.host_numa_id);
      if (!s.empty())
        return s + ". GPU " + std::to_string(st.device) + " may not reach GPU " + std::to_string(e.device) +
               " of the other process (no peer access between them?)";
      a.peers[r] = reinterpret_cast<uint8_t*>(mp.va);
    }
    const size_t bytes = sizeof(uint8_t*) * a.peers.size();
    cudaError_t ce = cudaMalloc(&al->peers_device, bytes);
    if (ce != cudaSuccess) {
      al->peers_device = nullptr;
      return "cudaMalloc of the peer table failed: " + cuda_error_string(ce);
    }
    ce = cudaMemcpy(al->peers_device, a.peers.data(), bytes, cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) return "copying the peer table to the GPU failed: " + cuda_error_string(ce);
    a.peers_device = al->peers_device;
    // Same-process peers' memory is their own mapping (CPU access granted by its creator).
    a.cpu_readable = al->own.cpu_readable;
    for (const Mapping& mp : al->imports) a.cpu_readable = a.cpu_readable && mp.cpu_readable;
    for (size_t r = 0; r < peers.size(); ++r) {
      if (peers[r].pid != my_pid || static_cast<int>(r) == m.rank || !a.peers[r]) continue;
      Member* peer = reg.find(m.ctx_id, static_cast<int32_t>(peers[r].device));
      Allocation* pa = peer ? peer->alloc(a.id) : nullptr;
      auto pal = pa ? std::static_pointer_cast<CudaAlloc>(pa->backend_state) : nullptr;
      if (!pal || !pal->own.cpu_readable) a.cpu_readable = false;
    }
    return {};
  }

  void close_exports(Member&, Allocation& a) override {
    auto al = std::static_pointer_cast<CudaAlloc>(a.backend_state);
    if (al) close_fds(*al);
  }

  void free_alloc(Member& m, Allocation& a) override {
    auto al = std::static_pointer_cast<CudaAlloc>(a.backend_state);
    if (!al) return;
    const CudaDriver* d = cuda_driver(nullptr);
    CudaMemberState& st = cuda_state(m);
    if (a.id == 0) nccl_release_window(st);  // the NCCL window lies in this allocation: deregister first
    gin_release_alloc(m.ctx_id, m.ordinal, a.id);  // so do GIN table windows over it
    {
      // Other GPUs of this process read our memory through our VA: let their queued work finish first.
      std::vector<int> acc;
      {
        std::lock_guard<std::mutex> lk(al->mu);
        acc = al->accessors;
      }
      for (int dev : acc) {
        CudaDeviceGuard g2(dev);
        cudaDeviceSynchronize();
        cudaGetLastError();
      }
    }
    CudaDeviceGuard g(st.device);
    if (d) release_all(d, *al);
    a.local = nullptr;
    a.peers.clear();
    a.peers_device = nullptr;
    a.backend_state.reset();
  }

  Status quiesce(Member& m) override {
    if (!m.backend_state) return {};
    CudaMemberState& st = cuda_state(m);
    // Host-path fetches still being enqueued, or waiting for their stream to start them, are part of the work
    // already asked for (the lock only reads the pointer: the worker's own tasks take it; it lives until destroy).
    OrderedWorker* enq = nullptr;
    {
      std::lock_guard<std::mutex> lk(st.enqueuer_mu);
      enq = st.enqueuer.get();
    }
    if (enq && !enq->drain(m.timeout_s))
      return "jax_engram: the Engram enqueue thread of " + m.label + " (rank " + std::to_string(m.rank) +
             ") did not finish its fetches within the context timeout (" + std::to_string(m.timeout_s) + " s)";
    CudaDeviceGuard g(st.device);
    if (g.status() != cudaSuccess) return "cudaSetDevice failed: " + cuda_error_string(g.status());
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
      return "jax_engram: waiting for the work of GPU " + std::to_string(st.device) + " of " + m.label +
             " failed: " + cuda_error_string(e);
    return {};
  }

 private:
  static Status create(const CudaDriver* d, CudaMemberState& st, Allocation& a, CudaAlloc& al) {
    Mapping& mp = al.own;
    size_t align = kSegmentAlignment;
    for (const SegmentSpec& s : a.segments) {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      if (s.kind == SegmentKind::kDevice) {
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = st.device;
        prop.allocFlags.gpuDirectRDMACapable = st.gdr_vmm ? 1 : 0;
      } else {
        if (!st.host_numa_vmm)
          return "this GPU cannot map host NUMA memory through cuMem (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_"
                 "MANAGEMENT_SUPPORTED = 0: driver older than 550, or no NUMA support); use placement='device' and "
                 "host_bytes=None";
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        prop.location.id = st.host_numa_id < 0 ? 0 : st.host_numa_id;
      }
      size_t gran = 0;
      CUresult r = d->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      if (r != CUDA_SUCCESS)
        return "cuMemGetAllocationGranularity(" + seg_name(s) + ") failed: " + cu_error_string(r);
      if (gran && s.bytes % gran)
        return seg_name(s) + " segment of " + std::to_string(s.bytes) + " bytes is not a multiple of the cuMem "
               "granularity " + std::to_string(gran);
      align = std::max(align, gran);
      CUmemGenericAllocationHandle h = 0;
      r = d->cuMemCreate(&h, s.bytes, &prop, 0);
      if (r != CUDA_SUCCESS) {
        std::string msg = "cuMemCreate of a " + std::to_string(s.bytes) + "-byte " + seg_name(s) + " segment (" +
                          (s.kind == SegmentKind::kDevice ? "GPU " + std::to_string(st.device)
                                                          : "host NUMA node " + std::to_string(prop.location.id)) +
                          ") failed: " + cu_error_string(r);
        if (r == CUDA_ERROR_OUT_OF_MEMORY && s.kind == SegmentKind::kDevice)
          msg += ". JAX preallocates most GPU memory by default: set XLA_PYTHON_CLIENT_PREALLOCATE=false or a "
                 "lower XLA_PYTHON_CLIENT_MEM_FRACTION, or pass a smaller device_bytes to jax_engram.init()";
        return msg;
      }
      mp.handles.push_back(h);
      mp.sizes.push_back(s.bytes);
      mp.bytes += s.bytes;
    }
    al.align = align;
    Status s = map_all(d, mp, align, st.device, "own memory", a.segments, st.host_numa_id);
    if (!s.empty()) return s;
    // Zero-fill on our side stream (does not wait for XLA's work on the device), one segment at a time: a
    // memset across a device and a host segment fails once the host segments also grant the CPU access.
    cudaError_t e = cudaSuccess;
    for (size_t i = 0, off = 0; i < mp.sizes.size() && e == cudaSuccess; off += mp.sizes[i++])
      e = cudaMemsetAsync(reinterpret_cast<void*>(mp.va + off), 0, mp.sizes[i], st.side_stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st.side_stream);
    if (e != cudaSuccess) return "zero-filling the allocation failed: " + cuda_error_string(e);
    for (size_t i = 0; i < mp.handles.size(); ++i) {
      int fd = -1;
      CUresult r = d->cuMemExportToShareableHandle(&fd, mp.handles[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS)
        return "cuMemExportToShareableHandle(POSIX FD) of segment " + std::to_string(i) + " failed: " +
               cu_error_string(r);
      al.fds.push_back(fd);
    }
    return {};
  }

  // A peer of this process: use its VA directly after granting our GPU access to it.
  static Status connect_local(const CudaDriver* d, Registry& reg, Member& m, CudaMemberState& st, Allocation& a,
                              int r, const Export& e, const std::string& who) {
    Member* peer = reg.find(m.ctx_id, static_cast<int32_t>(e.device));
    if (!peer || peer->rank != r)
      return who + " is in this process but has no member of context " + std::to_string(m.ctx_id) + " on its GPU";
    Allocation* pa = peer->alloc(a.id);
    if (!pa || !pa->local || !pa->backend_state)
      return who + " has no allocation " + std::to_string(a.id) + " yet";
    const int peer_dev = static_cast<int>(e.device);
    if (peer_dev != st.device) {
      int can = 0;
      cudaError_t ce = cudaDeviceCanAccessPeer(&can, st.device, peer_dev);
      if (ce != cudaSuccess || !can)
        return "GPU " + std::to_string(st.device) + " (rank " + std::to_string(m.rank) + ") cannot access the memory of GPU " +
               std::to_string(peer_dev) + " (" + who + "): cudaDeviceCanAccessPeer = 0" +
               (ce != cudaSuccess ? " (" + cuda_error_string(ce) + ")" : std::string()) +
               ". jax_engram needs CUDA peer access (NVLink, or PCIe P2P) between all GPUs of a context axis";
      CUmemAccessDesc acc{};
      acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      acc.location.id = st.device;
      acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      CUresult cr = d->cuMemSetAccess(reinterpret_cast<CUdeviceptr>(pa->local), pa->total_bytes, &acc, 1);
      if (cr != CUDA_SUCCESS)
        return "granting GPU " + std::to_string(st.device) + " access to the memory of GPU " +
               std::to_string(peer_dev) + " (" + who + ") failed: cuMemSetAccess: " + cu_error_string(cr);
      auto pal = std::static_pointer_cast<CudaAlloc>(pa->backend_state);
      std::lock_guard<std::mutex> lk(pal->mu);
      if (std::find(pal->accessors.begin(), pal->accessors.end(), st.device) == pal->accessors.end())
        pal->accessors.push_back(st.device);
    }
    a.peers[r] = pa->local;
    return {};
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace jax_engram
