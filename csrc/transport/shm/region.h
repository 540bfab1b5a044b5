// Shared memory between the ranks of one host: each rank's region (an anonymous memfd,
// owner-only, never in /dev/shm), its layout, and the futex doorbell its owner sleeps on.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/error.h"

namespace ddlcomm::shm {

// What two ranks must share to try mapping each other's memory: the boot, the user namespace
// (ownership of the region) and the pid namespace (peers are reached, and watched, by pid).
// Published through the store; the mapping is then verified by a nonce.
std::string hostFacts();

// The control block at the start of every region. Written by its owner, read by peers,
// except `doorbell`, which peers bump to wake the owner.
struct alignas(64) RegionHeader {
  uint64_t magic;
  uint8_t nonce[16];  // random, published through the store: proves a peer mapped this region
  int32_t pid;
  int32_t rings;  // one from each local peer
  uint64_t ringBytes;
  uint64_t windowBytes;

  alignas(64) std::atomic<uint32_t> doorbell;  // futex word: bumped when the owner can make progress
  std::atomic<uint32_t> sleeping;              // the owner is about to sleep on `doorbell`
  std::atomic<uint32_t> closed;                // the owner shut its transport down
  // What the owner is waiting in (tag << 16 | dtype << 8 | op), for naming mismatched calls
  // that never exchange a message; 0 when it is not waiting.
  std::atomic<uint64_t> waitingIn;

  // Window synchronisation: generation reached, and the call each generation belongs to.
  alignas(64) std::atomic<uint64_t> arrived;
  struct Call {
    uint64_t generation;
    uint64_t tag;
    uint64_t count;
    uint64_t bytes;
    uint8_t op;
    uint8_t dtype;
  } calls[2];  // by generation % 2: a peer is never more than one generation ahead
};

// A byte ring from one rank to another, in the receiver's region. Each index is written by
// one side only; both only grow.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;  // bytes written (sender)
  alignas(64) std::atomic<uint64_t> tail;  // bytes consumed (receiver)
};

// Where things are in a region: a ring of `ringBytes` from each local peer, and two windows.
struct Layout {
  int rings = 0;
  size_t ringBytes = 0;
  size_t windowBytes = 0;  // of each of the two halves; 0 without windows

  size_t ringControl(int i) const { return sizeof(RegionHeader) + size_t(i) * sizeof(RingControl); }
  size_t ringData(int i) const { return align(ringControl(rings)) + size_t(i) * ringBytes; }
  size_t window(int half) const { return align(ringData(rings)) + size_t(half) * windowBytes; }
  size_t total() const { return window(2); }
  static size_t align(size_t offset) { return (offset + 4095) & ~size_t(4095); }
};

constexpr uint64_t kRegionMagic = 0x4d48534d4f434444ull;  // "DDCOMSHM"

// A mapped region (RAII). The owner creates it and keeps the fd open so that peers can
// open it through /proc/<pid>/fd/<fd>; nothing is ever named in a filesystem.
class Region {
 public:
  Region() = default;
  // Creates and maps an owner-only region with all its pages reserved (so running out of
  // memory fails here, not later with SIGBUS), and fills in the header.
  static Region create(const Layout& layout);
  // Maps a peer's region; throws Error(System) if it cannot be opened or is not the one the
  // owner published (magic, nonce).
  static Region open(int pid, int fd, const std::string& nonceHex, const Layout& layout);
  ~Region();
  Region(Region&& other) noexcept { *this = std::move(other); }
  Region& operator=(Region&& other) noexcept;

  bool valid() const { return base_ != nullptr; }
  int fd() const { return fd_; }
  char* base() const { return static_cast<char*>(base_); }
  RegionHeader& header() const { return *reinterpret_cast<RegionHeader*>(base_); }
  std::string nonceHex() const;
  // Owner: stop offering the region to peers (they have all mapped it).
  void closeFd();

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

// Futex on a word in shared memory (not FUTEX_PRIVATE: other processes wake it).
void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout);
void futexWake(std::atomic<uint32_t>& word);

// Wakes `header`'s owner if it sleeps; called after anything that lets the owner progress.
// The owner sets `sleeping`, reads the doorbell, looks at its work once more, then waits on
// the doorbell. The fence orders this rank's change before the look at `sleeping`: either
// the owner's last look sees the change, or this rank sees it sleeping and rings. An awake
// owner's doorbell is left alone (no cache line pulled from its core).
inline void ring(RegionHeader& header) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (header.sleeping.load(std::memory_order_seq_cst)) {
    header.doorbell.fetch_add(1, std::memory_order_seq_cst);
    futexWake(header.doorbell);
  }
}

// Watches a local peer process: whether it has exited (pidfd where the kernel has it).
class ProcessWatch {
 public:
  ProcessWatch() = default;
  explicit ProcessWatch(int pid);
  ~ProcessWatch();
  ProcessWatch(ProcessWatch&& other) noexcept : pid_(other.pid_), fd_(other.fd_) { other.fd_ = -1; }
  ProcessWatch& operator=(ProcessWatch&& other) noexcept {
    std::swap(pid_, other.pid_);
    std::swap(fd_, other.fd_);
    return *this;
  }
  bool exited() const;
  int pid() const { return pid_; }

 private:
  int pid_ = 0;
  int fd_ = -1;
};

}  // namespace ddlcomm::shm
