// File-descriptor plumbing shared by the backends: anonymous shared memory (memfd) and fetching another
// process's descriptor (pidfd_getfd, falling back to /proc/<pid>/fd/<fd>).
#pragma once
#include <cstdint>
#include <string>

namespace jax_engram {

// memfd of `bytes` (mode 0600 by construction: memfd is private to the owner unless its fd is shared).
int memfd_create_sized(const char* name, uint64_t bytes, std::string* err);
// Duplicate descriptor `fd` of process `pid` into this process. -1 and *err on failure.
int import_fd(int64_t pid, int64_t fd, std::string* err);

}  // namespace jax_engram
