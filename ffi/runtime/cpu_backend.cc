// CPU backend: every segment of an allocation lives in one memfd mapped MAP_SHARED. Devices of one
// process share the mapping; other processes of the host import the descriptor and map it too, so the
// same load/store protocol as on GPUs runs between CPU "devices" (this is what CI exercises).
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "runtime/cpu_backend.h"
#include "runtime/shm.h"

namespace jax_engram {
namespace {

struct CpuMember {
  ErrorRecord record{};
};

struct CpuAlloc {
  int fd = -1;                          // exported memfd (closed by close_exports)
  std::vector<std::pair<void*, size_t>> mappings;  // own + imported mappings to unmap
};

class CpuBackend final : public Backend {
 public:
  const char* platform() const override { return "cpu"; }

  Status init_member(Member& m) override {
    auto st = std::make_shared<CpuMember>();
    m.error_host = &st->record;
    m.error_device = &st->record;
    m.backend_state = st;
    return {};
  }
  void destroy_member(Member& m) override { m.backend_state.reset(); }

  Status create_alloc(Member& m, Allocation& a) override {
    std::string err;
    std::string name = "jax_engram.c" + std::to_string(m.ctx_id) + ".r" + std::to_string(m.rank) + ".a" +
                       std::to_string(a.id);
    int fd = memfd_create_sized(name.c_str(), a.total_bytes, &err);
    if (fd < 0) return err;
    void* p = mmap(nullptr, a.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      return std::string("mapping ") + std::to_string(a.total_bytes) + " bytes of shared memory for allocation " +
             std::to_string(a.id) + " of " + m.label + " failed: " + strerror(errno) +
             (a.id == 0 ? " (the window: lower device_bytes / host_bytes in jax_engram.init())" : "");
    }
    auto st = std::make_shared<CpuAlloc>();
    st->fd = fd;
    st->mappings.push_back({p, a.total_bytes});
    a.backend_state = st;
    a.local = static_cast<uint8_t*>(p);
    a.exported.pid = getpid();
    a.exported.host_id = host_id();
    a.exported.fds = {fd};
    a.exported.sizes = {a.total_bytes};
    return {};
  }

  Status connect_alloc(Registry& reg, Member& m, Allocation& a, const std::vector<Export>& peers) override {
    auto st = std::static_pointer_cast<CpuAlloc>(a.backend_state);
    const std::string me = host_id();
    a.peers.assign(peers.size(), nullptr);
    for (size_t r = 0; r < peers.size(); ++r) {
      const Export& e = peers[r];
      if (static_cast<int>(r) == m.rank) {
        a.peers[r] = a.local;
        continue;
      }
      if (e.host_id != me)
        return "CPU contexts cannot span hosts (rank " + std::to_string(r) + " is on another host)";
      if (e.sizes.empty() || e.sizes[0] != a.total_bytes)
        return "rank " + std::to_string(r) + " created allocation " + std::to_string(a.id) + " with another size";
      if (e.pid == getpid()) {
        Member* peer = reg.find_rank(m.ctx_id, m.group, static_cast<int32_t>(r));
        Allocation* pa = peer ? peer->alloc(a.id) : nullptr;
        if (!pa) return "same-process rank " + std::to_string(r) + " has no allocation " + std::to_string(a.id);
        a.peers[r] = pa->local;
        continue;
      }
      std::string err;
      int fd = import_fd(e.pid, e.fds[0], &err);
      if (fd < 0) return "importing rank " + std::to_string(r) + "'s memory: " + err;
      void* p = mmap(nullptr, a.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);  // the mapping keeps the memory alive
      if (p == MAP_FAILED) return std::string("mmap of a peer's memory failed: ") + strerror(errno);
      st->mappings.push_back({p, a.total_bytes});
      a.peers[r] = static_cast<uint8_t*>(p);
    }
    a.peers_device = a.peers.data();
    return {};
  }

  void close_exports(Member&, Allocation& a) override {
    auto st = std::static_pointer_cast<CpuAlloc>(a.backend_state);
    if (st && st->fd >= 0) {
      close(st->fd);
      st->fd = -1;
    }
  }

  void free_alloc(Member&, Allocation& a) override {
    auto st = std::static_pointer_cast<CpuAlloc>(a.backend_state);
    if (!st) return;
    for (auto& [p, n] : st->mappings) munmap(p, n);
    st->mappings.clear();
    a.local = nullptr;
    a.peers.clear();
    a.backend_state.reset();
  }

  // CPU handlers run synchronously inside XLA's executor threads; Registry waits for `inflight`.
  Status quiesce(Member&) override { return {}; }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace jax_engram
