// glibc symbols newer than glibc 2.28 that the statically linked libstdc++ (built against the
// build machine's glibc), or our own code, references, defined here so that libmoeblaze_capi.so
// loads on manylinux_2_28 systems (MOEBLAZE_CAPI_MANYLINUX in CMakeLists.txt; the rest of the
// scheme is in src/capi/glibc-compat/old-versions.txt; why: docs/notes/manylinux-wheel.md).
//
// Every definition is hidden: the static link binds libstdc++.a's (and our objects') references
// to these copies instead of libc.so.6's, and nothing here is exported, so the host process's
// own glibc functions stay what every other library in it sees. Linux x86_64 only.
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MOEBLAZE_COMPAT extern "C" __attribute__((visibility("hidden")))

// __libc_single_threaded (glibc 2.32): libstdc++ skips atomic instructions on reference counts
// (std::string, exceptions, locales, shared_ptr) and static-local guards while it reads non-zero.
// 0 means "maybe threaded": always atomic, which is correct in every process (glibc itself
// clears its copy when the first thread starts); it only gives up a small single-threaded saving.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}

// arc4random (glibc 2.36): std::random_device's "arc4random" source, and its default where the
// CPU offers neither RDSEED nor RDRAND. 32 random bits from the kernel: getrandom (glibc 2.25,
// Linux 3.17), blocking only until the kernel's pool is first initialised, as glibc's arc4random
// does; /dev/urandom on kernels without getrandom. Thread-safe: no state. Like glibc's, it
// cannot fail: no entropy source at all aborts.
namespace {
bool read_urandom(unsigned char* p, size_t n) {
  int fd;
  do fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) return false;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  close(fd);
  return n == 0;
}
}  // namespace

MOEBLAZE_COMPAT uint32_t arc4random(void) noexcept {
  const int saved_errno = errno;
  uint32_t value = 0;
  unsigned char* p = reinterpret_cast<unsigned char*>(&value);
  size_t left = sizeof value;
  while (left > 0) {
    ssize_t r = getrandom(p, left, 0);
    if (r > 0) {
      p += r;
      left -= static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else if (r < 0 && errno == ENOSYS && read_urandom(p, left)) {
      left = 0;
    } else {
      abort();
    }
  }
  errno = saved_errno;
  return value;
}

// fstat64, stat, lstat (glibc 2.33; before, <sys/stat.h> turned them into __fxstat64 & co.):
// std::filebuf (libstdc++'s basic_file.o) and std::filesystem (fs_ops.o) call them. On x86_64
// struct stat, struct stat64 and the kernel's struct stat are one layout, so each is its system
// call; syscall() sets errno and returns -1 on failure, as the glibc functions do.
MOEBLAZE_COMPAT int fstat64(int fd, struct stat64* buf) noexcept {
  return static_cast<int>(syscall(SYS_fstat, fd, buf));
}
MOEBLAZE_COMPAT int stat(const char* path, struct stat* buf) noexcept {
  return static_cast<int>(syscall(SYS_stat, path, buf));
}
MOEBLAZE_COMPAT int lstat(const char* path, struct stat* buf) noexcept {
  return static_cast<int>(syscall(SYS_lstat, path, buf));
}

// exp, exp2, log, pow (libm, glibc 2.29): 2.29 gave them new versions without the old SVID error
// handling; the GLIBC_2.2.5 versions stay in every glibc and differ only in that handling (errno
// on overflow and the like). Any double-precision call needs them, e.g. the float64 reference
// (src/reference), which the C ABI does not link in today. Each forwards to the old version,
// bound with .symver. This file is compiled with -fno-builtin (CMakeLists.txt): GCC's implicit
// declarations of these builtins have default visibility and would override the hidden one.
#define MOEBLAZE_OLD_LIBM(name, params, args)                                  \
  extern "C" double moeblaze_old_##name params;                                \
  __asm__(".symver moeblaze_old_" #name ", " #name "@GLIBC_2.2.5");            \
  MOEBLAZE_COMPAT double name params noexcept { return moeblaze_old_##name args; }
MOEBLAZE_OLD_LIBM(exp, (double x), (x))
MOEBLAZE_OLD_LIBM(exp2, (double x), (x))
MOEBLAZE_OLD_LIBM(log, (double x), (x))
MOEBLAZE_OLD_LIBM(pow, (double x, double y), (x, y))
#undef MOEBLAZE_OLD_LIBM

// __isoc23_strtol & co. (glibc 2.38): where the build machine's glibc is 2.38 or newer, its
// headers send C++'s strtol family (g++ defines _GNU_SOURCE) to these C23 versions, which differ
// only in also reading a "0b" prefix. Each forwards to the classic function, bound by .symver to
// its GLIBC_2.2.5 version (plain strtol here would itself be redirected to the C23 name).
#define MOEBLAZE_OLD_STRTO(type, name)                                                   \
  extern "C" type moeblaze_old_##name(const char*, char**, int);                         \
  __asm__(".symver moeblaze_old_" #name ", " #name "@GLIBC_2.2.5");                      \
  MOEBLAZE_COMPAT type __isoc23_##name(const char* s, char** end, int base) noexcept {   \
    return moeblaze_old_##name(s, end, base);                                            \
  }
MOEBLAZE_OLD_STRTO(long, strtol)
MOEBLAZE_OLD_STRTO(unsigned long, strtoul)
MOEBLAZE_OLD_STRTO(long long, strtoll)
MOEBLAZE_OLD_STRTO(unsigned long long, strtoull)
#undef MOEBLAZE_OLD_STRTO
