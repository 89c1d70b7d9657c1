#include "runtime/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace jax_engram {

int memfd_create_sized(const char* name, uint64_t bytes, std::string* err) {
  int fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC));
  if (fd < 0) {
    *err = std::string("memfd_create failed: ") + strerror(errno);
    return -1;
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *err = std::string("ftruncate(memfd) failed: ") + strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

int import_fd(int64_t pid, int64_t fd, std::string* err) {
  if (pid == getpid()) {
    int d = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
    if (d < 0) *err = std::string("dup failed: ") + strerror(errno);
    return d;
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd >= 0) {
    int d = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, static_cast<int>(fd), 0));
    int e = errno;
    close(pidfd);
    if (d >= 0) return d;
    *err = std::string("pidfd_getfd(pid ") + std::to_string(pid) + ", fd " + std::to_string(fd) + ") failed: " +
           strerror(e);
  } else {
    *err = std::string("pidfd_open(") + std::to_string(pid) + ") failed: " + strerror(errno);
  }
  // Same user on the same host: the /proc link works where ptrace-based pidfd_getfd is restricted.
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int d = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (d >= 0) {
    err->clear();
    return d;
  }
  *err += std::string("; open(") + path + ") failed: " + strerror(errno);
  return -1;
}

}  // namespace jax_engram
