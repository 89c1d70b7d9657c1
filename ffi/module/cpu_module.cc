// _engram_cpu: the CPU backend (shared-memory windows) and its FFI handlers.
#include <nanobind/nanobind.h>

#include "handlers/common.h"
#include "module/bind_runtime.h"
#include "runtime/cpu_backend.h"

namespace jax_engram {
Registry& registry() {
  static Registry* r = new Registry(make_cpu_backend());  // leaked on purpose: outlives XLA's threads
  return *r;
}
std::vector<HandlerEntry>& handler_table() {
  static std::vector<HandlerEntry> t;
  return t;
}
}  // namespace jax_engram

NB_MODULE(_engram_cpu, m) {
  m.doc() = "jax_engram CPU backend: shared-memory windows and FFI handlers";
  jax_engram::bind_runtime(m, "cpu");
}
