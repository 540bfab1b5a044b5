#include "transport/shm/region.h"

#include "transport/host.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

namespace ddlcomm::shm {
namespace {

std::string toHex(const uint8_t* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[bytes[i] >> 4];
    out += digits[bytes[i] & 15];
  }
  return out;
}

}  // namespace

std::string hostFacts() { return hostIdentity() + " " + kernelFacts(); }

Region& Region::operator=(Region&& other) noexcept {
  if (this != &other) {
    this->~Region();
    base_ = other.base_;
    bytes_ = other.bytes_;
    fd_ = other.fd_;
    other.base_ = nullptr;
    other.fd_ = -1;
  }
  return *this;
}

Region::~Region() {
  if (base_) ::munmap(base_, bytes_);
  closeFd();
  base_ = nullptr;
}

void Region::closeFd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string Region::nonceHex() const { return toHex(header().nonce, sizeof header().nonce); }

Region Region::create(const Layout& layout) {
  Region s;
  s.fd_ = int(::syscall(SYS_memfd_create, "ddlcomm", unsigned(MFD_CLOEXEC)));
  DDLCOMM_CHECK(s.fd_ >= 0, ErrorKind::System, systemErrorText("memfd_create", errno));
  // memfd files start world-accessible through /proc; only this user's processes may map it.
  DDLCOMM_CHECK(::fchmod(s.fd_, 0600) == 0, ErrorKind::System, systemErrorText("fchmod", errno));
  s.bytes_ = layout.total();
  int err = ::posix_fallocate(s.fd_, 0, off_t(s.bytes_));
  DDLCOMM_CHECK(err == 0, ErrorKind::System, "cannot reserve ", s.bytes_, " bytes of shared memory: ",
                systemErrorText("fallocate", err));
  s.base_ = ::mmap(nullptr, s.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd_, 0);
  if (s.base_ == MAP_FAILED) {
    s.base_ = nullptr;
    fail(ErrorKind::System, systemErrorText("mmap", errno));
  }
  RegionHeader& h = *new (s.base_) RegionHeader();  // placement: the memory is the region's
  std::random_device random;
  for (auto& b : h.nonce) b = uint8_t(random());
  h.pid = ::getpid();
  h.rings = layout.rings;
  h.ringBytes = layout.ringBytes;
  h.windowBytes = layout.windowBytes;
  std::atomic_thread_fence(std::memory_order_release);
  h.magic = kRegionMagic;
  return s;
}

Region Region::open(int pid, int fd, const std::string& nonceHex, const Layout& layout) {
  Region s;
  const std::string path = detail::concat("/proc/", pid, "/fd/", fd);
  s.fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  DDLCOMM_CHECK(s.fd_ >= 0, ErrorKind::System, systemErrorText(("open " + path).c_str(), errno));
  struct stat st {};
  DDLCOMM_CHECK(::fstat(s.fd_, &st) == 0 && size_t(st.st_size) == layout.total(), ErrorKind::System, path,
                " is not a region of the expected size ", layout.total());
  s.bytes_ = layout.total();
  s.base_ = ::mmap(nullptr, s.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd_, 0);
  if (s.base_ == MAP_FAILED) {
    s.base_ = nullptr;
    fail(ErrorKind::System, systemErrorText(("mmap " + path).c_str(), errno));
  }
  s.closeFd();  // the mapping keeps the memory
  const RegionHeader& h = s.header();
  DDLCOMM_CHECK(h.magic == kRegionMagic && s.nonceHex() == nonceHex && h.ringBytes == layout.ringBytes &&
                    h.windowBytes == layout.windowBytes && h.rings == layout.rings,
                ErrorKind::System, path, " is not the region its owner published");
  return s;
}

void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto ns = timeout.count();
  timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

ProcessWatch::ProcessWatch(int pid) : pid_(pid), fd_(int(::syscall(SYS_pidfd_open, pid, 0))) {}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) ::close(fd_);
}

bool ProcessWatch::exited() const {
  if (fd_ < 0) return ::kill(pid_, 0) != 0 && errno == ESRCH;  // kernels before 5.3
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;  // a pidfd is readable once its process has exited
}

}  // namespace ddlcomm::shm
