// Progress and waiting: spin while peers make progress, then sleep on the futex doorbell
// (or in the network's poll); look at local peers' liveness and published calls while
// asleep; time out with what was moved; and the rendezvous of the shared windows (sync).
#include <sched.h>

#include <algorithm>

#include "transport/shm/shm_transport.h"

namespace ddlcomm::shm {
namespace {

// How often a sleeping rank looks at its local peers' processes and published state.
constexpr std::chrono::milliseconds kLivenessPeriod{100};
// Sleep slices while network requests are pending too: the futex does not see sockets.
constexpr std::chrono::milliseconds kMixedSlice{1};
// Polls, each followed by a pause, before a waiting rank starts yielding.
constexpr unsigned kPauseSpins = 256;

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

uint64_t waitingWord(const Signature& s) { return s.tag << 16 | uint64_t(s.dtype) << 8 | uint64_t(s.op); }

std::string callName(uint64_t word) {
  return detail::concat(opCodeName(OpCode(word & 0xff)), " #", word >> 16);
}

}  // namespace

template <typename Done>
void ShmTransport::sleep(Deadline deadline, Done& done) {
  const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
  if (!shmBusy()) {  // only the network can move: sleep in its epoll (wakeup() reaches it too)
    network_->poll(std::chrono::duration_cast<std::chrono::milliseconds>(
        std::clamp(left, std::chrono::nanoseconds(0), std::chrono::nanoseconds(kLivenessPeriod))));
    pruneNetwork();
    return;
  }
  const std::chrono::nanoseconds slice = netPending_.empty() ? kLivenessPeriod : kMixedSlice;
  RegionHeader& mine = own_.header();
  mine.sleeping.store(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with ring()'s
  const uint32_t seen = mine.doorbell.load(std::memory_order_seq_cst);
  // Looked at again after reading the doorbell: a peer that arrived since the last look rang
  // it before `seen` was read, and would not wake this rank.
  if (!pumpAll() && !done()) {
    futexWait(mine.doorbell, seen, std::max(std::chrono::nanoseconds(1000), std::min(slice, left)));
  }
  mine.sleeping.store(0, std::memory_order_relaxed);
  if (!netPending_.empty()) {
    network_->poll(std::chrono::milliseconds(0));
    pruneNetwork();
  }
}

template <typename Done>
void ShmTransport::progressUntil(Done&& done, Deadline deadline, int waitedPeer, const Signature& signature) {
  RegionHeader& mine = own_.header();
  Clock::time_point spinUntil = Clock::now() + spin_.duration;
  Clock::time_point nextCheck = Clock::now() + kLivenessPeriod, nextProbe = Clock::now() + std::chrono::seconds(1);
  bool published = false;
  unsigned spins = 0, idle = 0;
  while (!done()) {
    throwIfBroken();
    bool moved = pumpAll();
    if (!netPending_.empty() && (++spins % 16 == 0 || !shmBusy())) {
      network_->poll(std::chrono::milliseconds(0));
      pruneNetwork();
    }
    if (done()) break;
    Clock::time_point now = Clock::now();
    if (moved) {
      idle = 0;
      spinUntil = now + spin_.duration;
      nextProbe = now + std::chrono::seconds(1);
      continue;
    }
    if (now < spinUntil) {
      // With a core per rank the peer is running elsewhere: pause a while, as a yield is a
      // system call that delays seeing it. Then, or when ranks outnumber cores, yield: if the
      // scheduler put a peer on this core, it runs now.
      if (!spin_.yield && ++idle < kPauseSpins) {
        cpuRelax();
      } else {
        sched_yield();
      }
      continue;
    }
    if (now >= deadline) timedOut(waitedPeer, signature, "");
    if (!published && signature.op != OpCode::PointToPoint) {
      mine.waitingIn.store(waitingWord(signature), std::memory_order_relaxed);
      published = true;
    }
    sleep(deadline, done);
    now = Clock::now();
    if (now >= nextCheck) {
      checkPeers(waitedPeer, signature);
      nextCheck = now + kLivenessPeriod;
    }
    if (now >= nextProbe && failureProbe_) {
      nextProbe = now + std::chrono::seconds(1);
      if (failureProbe_()) {
        fail(ErrorKind::PeerFailure, "rank ", rank_, " gave up waiting in ", signature.describe(), " for rank ",
             waitedPeer, ": another rank failed");
      }
    }
    spinUntil = Clock::now() + spin_.duration / 4;  // woken: spin a little before sleeping again
  }
  if (published) mine.waitingIn.store(0, std::memory_order_relaxed);
}

// A local peer that exited, shut down, or waits in another call than this rank: fail now
// rather than at the deadline.
void ShmTransport::checkPeers(int waitedPeer, const Signature& signature) {
  const uint64_t mine = waitingWord(signature);
  for (Peer& p : peers_) {
    const RegionHeader& h = p.region.header();
    const bool involved = p.rank == waitedPeer || !p.sends.empty() || !p.recvs.empty() ||
                          (syncing_ && h.arrived.load() < generation_);
    if (!involved) continue;
    const char* gone = h.closed.load() ? "shut its transport down" : p.watch.exited() ? "exited" : nullptr;
    if (gone) {
      if (pumpAll()) return;  // what it wrote before leaving is still to be read
      fail(ErrorKind::PeerFailure, "rank ", rank_, " lost rank ", p.rank, " while in ", signature.describe(),
           ": its process (pid ", p.watch.pid(), ") ", gone, " (did rank ", p.rank, " exit or crash?)");
    }
    const uint64_t theirs = h.waitingIn.load(std::memory_order_relaxed);
    if (signature.op != OpCode::PointToPoint && theirs != 0 && theirs >> 16 == mine >> 16 &&
        (theirs & 0xff) != (mine & 0xff)) {
      fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", p.rank, ": rank ", rank_,
           " is in ", callName(mine), " but rank ", p.rank, " is in ", callName(theirs),
           ". All ranks must call the same collectives in the same order");
    }
  }
}

void ShmTransport::wait(Request& r, Deadline deadline) {
  guarded([&] {
    if (viaNetwork(r) && !shmBusy()) {  // nothing to move here: the network waits best
      network_->wait(r, deadline);
      pruneNetwork();
      return;
    }
    progressUntil([&] { return r.done(); }, deadline, r.peer, r.signature);
    pruneNetwork();
    if (r.failed) throwIfBroken();
  });
}

void ShmTransport::poll(std::chrono::milliseconds timeout) {
  guarded([&] {
    throwIfBroken();
    if (pumpAll()) return;
    if (peers_.empty() || !shmBusy()) {
      network_->poll(timeout);
    } else {
      RegionHeader& mine = own_.header();
      mine.sleeping.store(1, std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with ring()'s
      const uint32_t seen = mine.doorbell.load(std::memory_order_seq_cst);
      if (!wakeRequested_.exchange(false) && !pumpAll()) {
        futexWait(mine.doorbell, seen, std::min<std::chrono::nanoseconds>(timeout, kMixedSlice));
      }
      mine.sleeping.store(0, std::memory_order_relaxed);
      pumpAll();
      network_->poll(std::chrono::milliseconds(0));
    }
    pruneNetwork();
  });
}

void ShmTransport::wakeup() {
  wakeRequested_.store(true);  // before ring()'s fence and look at `sleeping`
  ring(own_.header());
  network_->wakeup();
}

void ShmTransport::timedOut(int waitedPeer, const Signature& signature, const std::string&) {
  std::string progress;
  if (Peer* p = waitedPeer >= 0 ? local(waitedPeer) : nullptr) {
    for (const Out& o : p->sends) progress += detail::concat(" sent ", o.done, " of ", o.request->bytes, " bytes;");
    for (const In& i : p->recvs) progress += detail::concat(" received ", i.done, " of ", i.request->bytes, " bytes;");
  }
  fail(ErrorKind::Timeout, "rank ", rank_, ": Timed out in ", signature.describe(), " waiting for ",
       waitedPeer >= 0 ? detail::concat("rank ", waitedPeer) : std::string("the other ranks"),
       " over shared memory:", progress, " the rank waited for may be stuck, slower than the timeout, or in a "
       "different collective");
}

void ShmTransport::sync(const Signature& signature, uint64_t bytes, Deadline deadline) {
  guarded([&] {
    throwIfBroken();
    const uint64_t g = ++generation_;
    RegionHeader& mine = own_.header();
    mine.calls[g % 2] = RegionHeader::Call{g, signature.tag, signature.count, bytes, uint8_t(signature.op),
                                            uint8_t(signature.dtype)};
    mine.arrived.store(g, std::memory_order_seq_cst);
    for (Peer& p : peers_) ring(p.region.header());
    syncing_ = true;
    int late = -1;
    progressUntil(
        [&] {
          for (const Peer& p : peers_) {
            if (p.region.header().arrived.load(std::memory_order_acquire) < g) {
              late = p.rank;
              return false;
            }
          }
          return true;
        },
        deadline, late, signature);
    syncing_ = false;
    for (const Peer& p : peers_) {
      const RegionHeader::Call& c = p.region.header().calls[g % 2];
      if (c.generation == g && c.tag == signature.tag && c.op == uint8_t(signature.op) &&
          c.dtype == uint8_t(signature.dtype) && c.count == signature.count && c.bytes == bytes) {
        continue;
      }
      Signature theirs{OpCode(c.op), DataType(c.dtype), c.tag, 0, c.count};
      fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", p.rank, ": rank ", rank_,
           " is in ", signature.describe(), " with ", bytes, " bytes in shared memory, but rank ", p.rank, " is in ",
           theirs.describe(), " with ", c.bytes,
           ". All ranks must call the same collectives in the same order with the same sizes and dtypes");
    }
  });
}

}  // namespace ddlcomm::shm
