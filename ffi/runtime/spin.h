// The pause between two polls of a spin-wait: tells the core (and a hypervisor's pause-loop exiting) that this
// thread is waiting, which frees its sibling hyper-thread and lowers the cost of the loop.
#pragma once

namespace jax_engram {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace jax_engram
