// File-descriptor plumbing shared by the backends: anonymous shared memory (memfd) and fetching another
// process's descriptor (pidfd_getfd, falling back to /proc/<pid>/fd/<fd>).
#pragma once
#include <cstdint>
#include <string>

namespace jax_engram {

// memfd of `bytes`, mode 0600 (owner only) and, where the kernel supports it, sealed non-executable.
int memfd_create_sized(const char* name, uint64_t bytes, std::string* err);
// Duplicate descriptor `fd` of process `pid` (which must belong to this process's user) into this process.
// -1 and *err on failure; the message names the kernel setting (Yama ptrace_scope) when that is what refused it.
int import_fd(int64_t pid, int64_t fd, std::string* err);

}  // namespace jax_engram
