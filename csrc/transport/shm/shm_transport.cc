#include "transport/shm/shm_transport.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "common/env.h"

namespace ddlcomm::shm {
namespace {

// How often a sleeping rank looks at its local peers' processes and published state.
constexpr std::chrono::milliseconds kLivenessPeriod{100};
// Sleep slices while network requests are pending too: the futex does not see sockets.
constexpr std::chrono::milliseconds kMixedSlice{1};
// Polls, each followed by a pause, before a waiting rank starts yielding.
constexpr unsigned kPauseSpins = 256;

void note(int rank, const std::string& text) { std::fprintf(stderr, "[ddlcomm rank %d] %s\n", rank, text.c_str()); }

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Bytes [pos, pos + n) of a ring of `capacity` (a power of two) as at most two spans.
void copyToRing(char* ring, size_t capacity, uint64_t pos, const char* src, size_t n) {
  const size_t offset = size_t(pos & (capacity - 1)), first = std::min(n, capacity - offset);
  std::memcpy(ring + offset, src, first);
  if (n > first) std::memcpy(ring, src + first, n - first);
}
void copyFromRing(const char* ring, size_t capacity, uint64_t pos, char* dst, size_t n) {
  const size_t offset = size_t(pos & (capacity - 1)), first = std::min(n, capacity - offset);
  std::memcpy(dst, ring + offset, first);
  if (n > first) std::memcpy(dst + first, ring, n - first);
}

uint64_t waitingWord(const Signature& s) { return s.tag << 16 | uint64_t(s.dtype) << 8 | uint64_t(s.op); }

std::string callName(uint64_t word) {
  return detail::concat(opCodeName(OpCode(word & 0xff)), " #", word >> 16);
}

}  // namespace

ShmOptions ShmOptions::fromEnvironment() {
  ShmOptions o;
  o.ringBytes = size_t(envInteger("DDLCOMM_SHM_RING_BYTES", int64_t(o.ringBytes), 4096, int64_t(1) << 30));
  DDLCOMM_CHECK((o.ringBytes & (o.ringBytes - 1)) == 0, ErrorKind::InvalidArgument,
                "environment variable DDLCOMM_SHM_RING_BYTES='", o.ringBytes, "' is invalid: expected a power of two");
  o.windowBytes = size_t(envInteger("DDLCOMM_SHM_WINDOW_BYTES", int64_t(o.windowBytes), 0, int64_t(1) << 32));
  o.windowBytes &= ~size_t(63);
  o.spin.duration = std::chrono::microseconds(envInteger("DDLCOMM_SHM_SPIN_US", -1, 0, 1000000));
  return o;
}

ShmTransport::ShmTransport(std::unique_ptr<Transport> network, const ShmOptions& options)
    : network_(std::move(network)), rank_(network_->rank()), size_(network_->size()), options_(options) {
  peerIndex_.assign(size_t(size_), -1);
}

ShmTransport::~ShmTransport() { abort(ErrorKind::Aborted, "transport destroyed"); }

std::unique_ptr<Transport> ShmTransport::layer(std::unique_ptr<Transport> network, KeyValueStore& store,
                                               const ShmOptions& options) {
  const int rank = network->rank(), size = network->size();
  if (size == 1) return network;
  const std::string prefix = "ddlcomm/shm/", me = std::to_string(rank);
  const std::string facts = hostFacts();
  store.set(prefix + "facts/" + me, facts);
  std::vector<int> local;  // ranks that may share memory with this one, itself included
  std::string elsewhere;
  for (int r = 0; r < size; ++r) {
    if (r == rank || store.get(prefix + "facts/" + std::to_string(r)) == facts) {
      local.push_back(r);
    } else if (elsewhere.empty()) {
      elsewhere = detail::concat("rank ", r, " is on another host or namespace");
    }
  }
  DDLCOMM_CHECK(!options.required || elsewhere.empty(), ErrorKind::InvalidArgument,
                "DDLCOMM_TRANSPORT=shm needs every rank on this host, but ", elsewhere,
                " (use DDLCOMM_TRANSPORT=auto to mix shared memory and the network)");
  if (local.size() == 1) return network;

  std::unique_ptr<ShmTransport> t(new ShmTransport(std::move(network), options));
  t->layout_.rings = int(local.size()) - 1;
  t->layout_.ringBytes = options.ringBytes;
  t->layout_.windowBytes = local.size() == size_t(size) ? options.windowBytes : 0;
  const auto localIndex = [&](int r) { return int(std::find(local.begin(), local.end(), r) - local.begin()); };
  // The ring from `sender` in `receiver`'s region, which has none from itself.
  const auto ring = [&](int sender, int receiver) {
    const int s = localIndex(sender);
    return s - int(s > localIndex(receiver));
  };

  std::string offer;
  try {
    t->own_ = Region::create(t->layout_);
    offer = detail::concat(t->own_.header().pid, " ", t->own_.fd(), " ", t->own_.nonceHex());
  } catch (const Error& e) {
    if (options.required) note(rank, e.what());
    offer = std::string("none ") + e.what();
  }
  store.set(prefix + "region/" + me, offer);

  std::string mapped(size_t(size), '0');  // which peers' regions this rank mapped
  std::vector<Region> regions(static_cast<size_t>(size));
  std::string problem;
  for (int r : local) {
    if (r == rank) continue;
    std::istringstream theirs(store.get(prefix + "region/" + std::to_string(r)));
    std::string pid, fd, nonce;
    theirs >> pid >> fd >> nonce;
    try {
      DDLCOMM_CHECK(pid != "none", ErrorKind::System, "rank ", r, " has no region: ", theirs.str().substr(5));
      DDLCOMM_CHECK(t->own_.valid(), ErrorKind::System, "this rank has no region: ", offer.substr(5));
      regions[size_t(r)] = Region::open(std::stoi(pid), std::stoi(fd), nonce, t->layout_);
      mapped[size_t(r)] = '1';
    } catch (const std::exception& e) {
      if (problem.empty()) problem = detail::concat("cannot share memory with rank ", r, ": ", e.what());
    }
  }
  store.set(prefix + "mapped/" + me, mapped);
  bool everyPair = true;  // every rank mapped every other: the windows are usable
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const bool candidate = localIndex(r) < int(local.size());
    const std::string theirs = candidate || t->layout_.windowBytes ? store.get(prefix + "mapped/" + std::to_string(r)) : "";
    for (int q = 0; q < size && !theirs.empty(); ++q) everyPair = everyPair && (q == r || theirs[size_t(q)] == '1');
    if (!candidate || mapped[size_t(r)] != '1' || theirs[size_t(rank)] != '1') {
      everyPair = false;
      continue;
    }
    Peer p;
    p.rank = r;
    p.region = std::move(regions[size_t(r)]);
    p.watch = ProcessWatch(p.region.header().pid);
    p.outControl = reinterpret_cast<RingControl*>(p.region.base() + t->layout_.ringControl(ring(rank, r)));
    p.outData = p.region.base() + t->layout_.ringData(ring(rank, r));
    p.inControl = reinterpret_cast<RingControl*>(t->own_.base() + t->layout_.ringControl(ring(r, rank)));
    p.inData = t->own_.base() + t->layout_.ringData(ring(r, rank));
    t->peerIndex_[size_t(r)] = int(t->peers_.size());
    t->peers_.push_back(std::move(p));
  }
  // Every peer that could map this rank's region has: nobody can open it any more.
  t->own_.closeFd();
  if (!problem.empty() || t->peers_.size() + 1 < local.size()) {
    DDLCOMM_CHECK(!options.required, ErrorKind::System, "DDLCOMM_TRANSPORT=shm: ",
                  problem.empty() ? "a peer could not map this rank's shared memory" : problem);
    note(rank, problem.empty() ? "a local peer could not map this rank's shared memory; using the network with it"
                               : problem + "; using the network with it");
  }
  if (t->peers_.empty()) return std::move(t->network_);
  t->windowed_ = everyPair && t->layout_.windowBytes > 0 && int(t->peers_.size()) + 1 == size;
  t->mixed_ = int(t->peers_.size()) + 1 < size;
  return t;
}

void ShmTransport::trackNetwork(Request& r) {
  if (!r.done()) netPending_.push_back(&r);
}

// Requests complete only inside this class's calls into the network, and the caller may
// free them once a call returns: every such call prunes before returning.
void ShmTransport::pruneNetwork() {
  netPending_.erase(std::remove_if(netPending_.begin(), netPending_.end(), [](Request* r) { return r->done(); }),
                    netPending_.end());
}

void ShmTransport::postSend(Request& r) {
  guarded([&] {
    throwIfBroken();
    if (viaNetwork(r)) {
      network_->postSend(r);
      trackNetwork(r);
      pruneNetwork();
      return;
    }
    Peer& p = *local(r.peer);
    DDLCOMM_CHECK(!p.region.header().closed.load(), ErrorKind::PeerFailure, "rank ", rank_, " cannot send ",
                  r.signature.describe(), " to rank ", r.peer, ": it shut its transport down");
    r.transfersLeft = 1;
    r.failed = false;
    p.sends.push_back(Out{&r, makeFrameHeader(r.signature, 0, r.bytes)});
    pumpSend(p);  // eager: usually the ring has room and the message leaves right away
  });
}

void ShmTransport::postRecv(Request& r) {
  guarded([&] {
    throwIfBroken();
    if (viaNetwork(r)) {
      network_->postRecv(r);
      trackNetwork(r);
      pruneNetwork();
      return;
    }
    r.transfersLeft = 1;
    r.failed = false;
    local(r.peer)->recvs.push_back(In{&r});
  });
}

// A ring is published in slices of an eighth of it: the reader drains one slice while the
// writer fills the next, instead of the two taking turns over the whole ring (point-to-point
// of 1 MiB and more moved at the speed of one copy at a time).
size_t ShmTransport::sliceBytes() const { return std::max<size_t>(layout_.ringBytes / 8, 1024); }

bool ShmTransport::pumpSend(Peer& p) {
  const uint64_t start = p.outControl->head.load(std::memory_order_relaxed);  // only this rank writes it
  uint64_t head = start, published = start;
  const uint64_t capacity = layout_.ringBytes;
  const size_t slice = sliceBytes();
  auto publish = [&] {
    p.outControl->head.store(head, std::memory_order_release);
    ring(p.region.header());
    published = head;
  };
  while (!p.sends.empty()) {
    Out& o = p.sends.front();
    size_t space = size_t(capacity - (head - p.outControl->tail.load(std::memory_order_acquire)));
    if (space == 0) break;
    if (o.headerDone < sizeof(FrameHeader)) {
      const size_t n = std::min(space, sizeof(FrameHeader) - o.headerDone);
      copyToRing(p.outData, capacity, head, reinterpret_cast<const char*>(&o.header) + o.headerDone, n);
      o.headerDone += n;
      head += n;
      space -= n;
    }
    const size_t n = std::min({space, o.request->bytes - o.done, slice});
    if (n > 0) copyToRing(p.outData, capacity, head, o.request->data + o.done, n);
    o.done += n;
    head += n;
    if (head - published >= slice) publish();
    if (o.headerDone < sizeof(FrameHeader)) break;  // the ring is full
    if (o.done < o.request->bytes) continue;        // its next slice, if there is room
    --o.request->transfersLeft;
    p.sends.pop_front();
  }
  if (head == start) return false;
  if (head != published) publish();
  bytesSent_ += head - start;
  return true;
}

bool ShmTransport::pumpRecv(Peer& p) {
  const uint64_t start = p.inControl->tail.load(std::memory_order_relaxed);  // only this rank writes it
  uint64_t tail = start, published = start;
  const uint64_t capacity = layout_.ringBytes;
  const size_t slice = sliceBytes();
  auto publish = [&] {
    p.inControl->tail.store(tail, std::memory_order_release);
    ring(p.region.header());  // its sender may be waiting for room
    published = tail;
  };
  while (!p.recvs.empty()) {
    size_t avail = size_t(p.inControl->head.load(std::memory_order_acquire) - tail);
    if (avail == 0) break;
    In& in = p.recvs.front();
    if (!p.haveHeader) {
      const size_t n = std::min(avail, sizeof(FrameHeader) - p.headerGot);
      copyFromRing(p.inData, capacity, tail, reinterpret_cast<char*>(&p.header) + p.headerGot, n);
      p.headerGot += n;
      tail += n;
      avail -= n;
      if (p.headerGot < sizeof(FrameHeader)) break;
      const Signature got = parseFrameHeader(p.header, p.rank);
      const Signature& expected = in.request->signature;
      if (expected != got || p.header.bytes != in.request->bytes) {
        fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", p.rank, ": rank ", rank_,
             " is in ", expected.describe(), " expecting ", in.request->bytes, " bytes, but rank ", p.rank, " sent ",
             got.describe(), " with ", p.header.bytes,
             " bytes. All ranks must call the same collectives in the same order with the same sizes and dtypes");
      }
      p.haveHeader = true;
    }
    const size_t n = std::min({avail, in.request->bytes - in.done, slice});
    if (n > 0) copyFromRing(p.inData, capacity, tail, in.request->data + in.done, n);
    in.done += n;
    tail += n;
    if (tail - published >= slice) publish();
    if (in.done < in.request->bytes) continue;  // its next slice, if it has arrived
    --in.request->transfersLeft;
    p.recvs.pop_front();
    p.haveHeader = false;
    p.headerGot = 0;
  }
  if (tail == start) return false;
  if (tail != published) publish();
  return true;
}

bool ShmTransport::pumpAll() {
  bool moved = false;
  for (Peer& p : peers_) {
    if (!p.sends.empty()) moved |= pumpSend(p);
    if (!p.recvs.empty()) moved |= pumpRecv(p);
  }
  return moved;
}

bool ShmTransport::shmBusy() const {
  if (syncing_) return true;
  for (const Peer& p : peers_) {
    if (!p.sends.empty() || !p.recvs.empty()) return true;
  }
  return false;
}

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
  Clock::time_point spinUntil = Clock::now() + options_.spin.duration;
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
      spinUntil = now + options_.spin.duration;
      nextProbe = now + std::chrono::seconds(1);
      continue;
    }
    if (now < spinUntil) {
      // With a core per rank the peer is running elsewhere: pause a while, as a yield is a
      // system call that delays seeing it. Then, or when ranks outnumber cores, yield: if the
      // scheduler put a peer on this core, it runs now.
      if (!options_.spin.yield && ++idle < kPauseSpins) {
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
    spinUntil = Clock::now() + options_.spin.duration / 4;  // woken: spin a little before sleeping again
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

char* ShmTransport::window(int rank, int half) {
  const Region& s = rank == rank_ ? own_ : local(rank)->region;
  return s.base() + layout_.window(half);
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

void ShmTransport::abort(ErrorKind kind, const std::string& reason) noexcept {
  if (broken_) return;
  broken_ = true;
  brokenKind_ = kind;
  brokenReason_ = failureMessage(kind, reason);
  for (Peer& p : peers_) {
    for (Out& o : p.sends) o.request->failed = true, o.request->transfersLeft = 0;
    for (In& i : p.recvs) i.request->failed = true, i.request->transfersLeft = 0;
    p.sends.clear();
    p.recvs.clear();
  }
  // Peers waiting on this rank see it gone at their next look, like a closed socket.
  if (own_.valid()) {
    own_.header().closed.store(1);
    for (Peer& p : peers_) ring(p.region.header());
  }
  if (network_) network_->abort(kind, brokenReason_);
  netPending_.clear();
}

void ShmTransport::throwIfBroken() const {
  if (broken_) throw Error(brokenKind_, brokenReason_);
}

TransportStats ShmTransport::stats() const {
  TransportStats s = network_->stats();
  s.sharedMemoryPeers = int(peers_.size());
  s.sharedMemoryBytesSent = bytesSent_;
  s.sharedMemorySpinMicros = options_.spin.duration.count();
  return s;
}

}  // namespace ddlcomm::shm
