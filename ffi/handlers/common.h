// What every FFI handler needs: the module's registry, self-registration of handler symbols, and a scoped
// lookup of the calling device's member that turns every failure into an ffi::Error naming the op.
#pragma once
#include <string>
#include <vector>

#include "runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jax_engram {
namespace ffi = xla::ffi;

Registry& registry();  // defined once per native module

struct HandlerEntry {
  const char* name;
  void* symbol;
};
std::vector<HandlerEntry>& handler_table();  // defined once per native module

// `static HandlerRegistrar r("jax_engram_x", reinterpret_cast<void*>(JeXCpu));` registers a handler
// with the module it is linked into; Python registers the whole table for the module's platform.
struct HandlerRegistrar {
  HandlerRegistrar(const char* name, void* symbol) { handler_table().push_back({name, symbol}); }
};

inline ffi::Error op_error(int32_t op, const std::string& msg, ffi::ErrorCode code = ffi::ErrorCode::kInvalidArgument) {
  return ffi::Error(code, std::string("jax_engram ") + op_name(op) + ": " + msg);
}

// Looks up (ctx_id, device ordinal); fails if absent, closing, or poisoned by an earlier error.
class MemberScope {
 public:
  MemberScope(int64_t ctx_id, int32_t ordinal, int32_t op) : op_(op) {
    bool closing = false;
    m_ = registry().acquire(ctx_id, ordinal, &closing);
    if (!m_) {
      err_ = op_error(op, closing ? "context " + std::to_string(ctx_id) + " is closing"
                                  : "no jax_engram context " + std::to_string(ctx_id) + " on device ordinal " +
                                        std::to_string(ordinal) +
                                        " (closed, or the op runs on a device outside the context's mesh axis; "
                                        "call it inside jax.shard_map over the context's mesh)",
                      ffi::ErrorCode::kFailedPrecondition);
      return;
    }
    const ErrorRecord& e = *m_->error_host;
    if (e.code > 0) err_ = ffi::Error(ffi::ErrorCode::kAborted, describe_error(*m_, e));
  }
  ~MemberScope() { Registry::release(m_); }
  MemberScope(const MemberScope&) = delete;
  MemberScope& operator=(const MemberScope&) = delete;

  bool ok() const { return err_.success(); }
  ffi::Error error() const { return err_; }
  Member& member() { return *m_; }
  Member* operator->() { return m_; }

  // After a kernel recorded an error synchronously (CPU), report it as this op's failure.
  ffi::Error check_recorded() const {
    const ErrorRecord& e = *m_->error_host;
    if (e.code > 0) return ffi::Error(e.code == kErrTimeout ? ffi::ErrorCode::kDeadlineExceeded
                                                            : ffi::ErrorCode::kInvalidArgument,
                                      describe_error(*m_, e));
    return ffi::Error::Success();
  }

 private:
  int32_t op_;
  Member* m_ = nullptr;
  ffi::Error err_ = ffi::Error::Success();
};

// A flat context maps every peer's window; a peer outside this NVLink domain has no mapping.
inline constexpr const char* kPeerUnreachable =
    "a peer on this axis is not reachable by loads/stores (another NVLink domain): a flat context must stay "
    "inside one NVLink domain; span nodes with a hierarchical (node, local) EP group, "
    "jax_engram.init(mesh, (\"node\", axis))";

// Region of an allocation, checked against its size: (alloc id, offset, bytes).
inline ffi::Error check_region(Member& m, int64_t alloc_id, int64_t offset, uint64_t bytes, int32_t op,
                               Allocation** out) {
  Allocation* a = m.alloc(alloc_id);
  if (!a)
    return op_error(op, "allocation " + std::to_string(alloc_id) + " of " + m.label + " does not exist: its memory "
                            "was freed (EngramTable.free / a released region) before this call ran, or never made",
                    ffi::ErrorCode::kFailedPrecondition);
  if (offset < 0 || static_cast<uint64_t>(offset) + bytes > a->total_bytes)
    return op_error(op, "region [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                            ") exceeds allocation of " + std::to_string(a->total_bytes) + " bytes");
  for (auto* p : a->peers)
    if (!p) return op_error(op, kPeerUnreachable, ffi::ErrorCode::kUnimplemented);
  *out = a;
  return ffi::Error::Success();
}

}  // namespace jax_engram
