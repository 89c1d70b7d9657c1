#include "runtime/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifdef MFD_NOEXEC_SEAL
constexpr unsigned kMfdNoexecSeal = MFD_NOEXEC_SEAL;
#else
constexpr unsigned kMfdNoexecSeal = 0x0008U;  // linux/memfd.h, kernels >= 6.3
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace jax_engram {

int memfd_create_sized(const char* name, uint64_t bytes, std::string* err) {
  // Not executable, sealed so (kernels >= 6.3; older ones reject the flag and never map memfds executable by
  // default anyway).
  int fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC | kMfdNoexecSeal));
  if (fd < 0 && errno == EINVAL) fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC));
  if (fd < 0) {
    *err = std::string("memfd_create failed: ") + strerror(errno);
    return -1;
  }
  // Owner only: another user's process that reaches the descriptor through /proc/<pid>/fd cannot open it.
  if (fchmod(fd, 0600) != 0) {
    *err = std::string("fchmod(memfd, 0600) failed: ") + strerror(errno);
    close(fd);
    return -1;
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *err = std::string("ftruncate(memfd) failed: ") + strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

namespace {

// "kernel.yama.ptrace_scope = N" (what decides whether pidfd_getfd may take a sibling's descriptor), or "" without
// Yama.
std::string ptrace_scope() {
  FILE* f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return {};
  int v = -1;
  const bool ok = fscanf(f, "%d", &v) == 1;
  fclose(f);
  return ok ? "kernel.yama.ptrace_scope = " + std::to_string(v) : std::string();
}

}  // namespace

int import_fd(int64_t pid, int64_t fd, std::string* err) {
  if (pid == getpid()) {
    int d = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
    if (d < 0) *err = std::string("dup failed: ") + strerror(errno);
    return d;
  }
  const std::string proc = "/proc/" + std::to_string(pid);
  // Descriptors pass only between processes of the same user (the export record names a pid: check whose it is).
  struct stat ps {};
  if (stat(proc.c_str(), &ps) != 0) {
    *err = "process " + std::to_string(pid) + " is not running on this host (" + strerror(errno) +
           "): the peer exited, or its export record came from another host";
    return -1;
  }
  if (ps.st_uid != geteuid()) {
    *err = "process " + std::to_string(pid) + " belongs to user id " + std::to_string(ps.st_uid) + ", not to this "
           "process's user id " + std::to_string(geteuid()) + ": jax_engram shares memory only between processes of "
           "the same user";
    return -1;
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd >= 0) {
    int d = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, static_cast<int>(fd), 0));
    int e = errno;
    close(pidfd);
    if (d >= 0) return d;
    *err = std::string("pidfd_getfd(pid ") + std::to_string(pid) + ", fd " + std::to_string(fd) + ") failed: " +
           strerror(e);
    if (e == EPERM) {
      const std::string scope = ptrace_scope();
      *err += " (the kernel lets a process take another's descriptor only where it may ptrace it" +
              (scope.empty() ? std::string(")") : ": " + scope + "; 2 and 3 forbid it between the processes of a job)");
    }
  } else {
    *err = std::string("pidfd_open(") + std::to_string(pid) + ") failed: " + strerror(errno) +
           " (pidfd_open needs Linux >= 5.6)";
  }
  // Same user on the same host: the /proc link works where ptrace-based pidfd_getfd is restricted.
  std::string path = proc + "/fd/" + std::to_string(fd);
  int d = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (d >= 0) {
    err->clear();
    return d;
  }
  *err += std::string("; open(") + path + ") failed too: " + strerror(errno) +
          ". Run the job's processes as one user in one PID namespace (containers: share it), with "
          "kernel.yama.ptrace_scope <= 1 (sysctl) or /proc mounted without hidepid";
  return -1;
}

}  // namespace jax_engram
