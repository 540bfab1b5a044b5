// The byte rings between local ranks: a sender copies frames (FrameHeader, then the payload)
// into its ring in the receiver's region and publishes them slice by slice; the receiver
// matches them in order against its posted receives, as over a connection.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "transport/shm/shm_transport.h"

namespace ddlcomm::shm {
namespace {

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

// This rank's end of one ring, which only this rank writes: a send ring's head or a receive
// ring's tail. The pump moves `at`; publishing stores it and rings the peer's doorbell (the
// peer may be waiting for data or for room), every slice and once more at the end.
struct Cursor {
  Cursor(std::atomic<uint64_t>& shared, RegionHeader& doorbell)
      : shared(shared), doorbell(doorbell), start(shared.load(std::memory_order_relaxed)), at(start),
        published(start) {}

  // `n` more bytes copied; published once a slice has gathered.
  void advance(size_t n, size_t slice) {
    at += n;
    if (at - published >= slice) publish();
  }

  // Publishes what is left; returns the bytes moved by this pump.
  uint64_t finish() {
    if (at != published) publish();
    return at - start;
  }

  void publish() {
    shared.store(at, std::memory_order_release);
    ring(doorbell);
    published = at;
  }

  std::atomic<uint64_t>& shared;
  RegionHeader& doorbell;
  const uint64_t start;
  uint64_t at;
  uint64_t published;
};

}  // namespace

// A ring is published in slices of an eighth of it: the reader drains one slice while the
// writer fills the next, instead of the two taking turns over the whole ring (point-to-point
// of 1 MiB and more moved at the speed of one copy at a time).
size_t ShmTransport::sliceBytes() const { return std::max<size_t>(layout_.ringBytes / 8, 1024); }

bool ShmTransport::pumpSend(Peer& p) {
  Cursor head(p.outControl->head, p.region.header());
  const uint64_t capacity = layout_.ringBytes;
  const size_t slice = sliceBytes();
  while (!p.sends.empty()) {
    Out& o = p.sends.front();
    size_t space = size_t(capacity - (head.at - p.outControl->tail.load(std::memory_order_acquire)));
    if (space == 0) break;
    if (o.headerDone < sizeof(FrameHeader)) {
      const size_t n = std::min(space, sizeof(FrameHeader) - o.headerDone);
      copyToRing(p.outData, capacity, head.at, reinterpret_cast<const char*>(&o.header) + o.headerDone, n);
      o.headerDone += n;
      head.at += n;
      space -= n;
    }
    const size_t n = std::min({space, o.request->bytes - o.done, slice});
    if (n > 0) copyToRing(p.outData, capacity, head.at, o.request->data + o.done, n);
    o.done += n;
    head.advance(n, slice);
    if (o.headerDone < sizeof(FrameHeader)) break;  // the ring is full
    if (o.done < o.request->bytes) continue;        // its next slice, if there is room
    --o.request->transfersLeft;
    p.sends.pop_front();
  }
  const uint64_t moved = head.finish();
  bytesSent_ += moved;
  return moved > 0;
}

bool ShmTransport::pumpRecv(Peer& p) {
  Cursor tail(p.inControl->tail, p.region.header());
  const uint64_t capacity = layout_.ringBytes;
  const size_t slice = sliceBytes();
  while (!p.recvs.empty()) {
    size_t avail = size_t(p.inControl->head.load(std::memory_order_acquire) - tail.at);
    if (avail == 0) break;
    In& in = p.recvs.front();
    if (!p.haveHeader) {
      const size_t n = std::min(avail, sizeof(FrameHeader) - p.headerGot);
      copyFromRing(p.inData, capacity, tail.at, reinterpret_cast<char*>(&p.header) + p.headerGot, n);
      p.headerGot += n;
      tail.at += n;
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
    if (n > 0) copyFromRing(p.inData, capacity, tail.at, in.request->data + in.done, n);
    in.done += n;
    tail.advance(n, slice);
    if (in.done < in.request->bytes) continue;  // its next slice, if it has arrived
    --in.request->transfersLeft;
    p.recvs.pop_front();
    p.haveHeader = false;
    p.headerGot = 0;
  }
  return tail.finish() > 0;
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

}  // namespace ddlcomm::shm
