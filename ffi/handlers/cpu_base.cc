// CPU handlers of the foundation ops: barrier and ring_exchange.
#include <cstring>

#include "handlers/common.h"
#include "kernels/cpu/sync.h"

namespace jax_engram {
namespace {

ffi::Error BarrierCpu(int32_t ordinal, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out, int64_t ctx_id) {
  MemberScope s(ctx_id, ordinal, kOpBarrier);
  if (!s.ok()) return s.error();
  if (out->size_bytes() != token.size_bytes()) return op_error(kOpBarrier, "token result must match token input");
  cpu::barrier(s.member(), kOpBarrier);
  std::memcpy(out->untyped_data(), token.untyped_data(), token.size_bytes());
  return s.check_recorded();
}

// Each rank publishes x in its region, then reads its left neighbour's: exercises peer loads through the
// window and two barriers (the first keeps a slow reader of the previous call from seeing new data).
ffi::Error RingExchangeCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t ctx_id,
                           int64_t alloc_id, int64_t offset) {
  MemberScope s(ctx_id, ordinal, kOpRingExchange);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  const uint64_t n = x.size_bytes();
  Allocation* a;
  if (auto e = check_region(m, alloc_id, offset, n, kOpRingExchange, &a); !e.success()) return e;
  if (!cpu::barrier(m, kOpRingExchange)) return s.check_recorded();
  std::memcpy(a->local + offset, x.untyped_data(), n);
  if (!cpu::barrier(m, kOpRingExchange)) return s.check_recorded();
  const int left = (m.rank + m.nranks - 1) % m.nranks;
  std::memcpy(y->untyped_data(), a->peers[left] + offset, n);
  return s.check_recorded();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeBarrierCpu, BarrierCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ctx_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeRingExchangeCpu, RingExchangeCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ctx_id")
                                  .Attr<int64_t>("alloc_id")
                                  .Attr<int64_t>("offset"));

static HandlerRegistrar reg_barrier("jax_engram_barrier", reinterpret_cast<void*>(JeBarrierCpu));
static HandlerRegistrar reg_ring("jax_engram_ring_exchange", reinterpret_cast<void*>(JeRingExchangeCpu));

}  // namespace jax_engram
