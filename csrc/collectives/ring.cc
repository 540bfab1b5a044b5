// Ring reduce-scatter and all-gather, pipelined in segments: a segment received in step s
// is reduced and forwarded in step s+1 while later segments are still arriving. Each rank
// sends and receives 2(n-1)/n of the buffer in total, the bandwidth optimum.
#include <algorithm>
#include <vector>

#include "collectives/collectives.h"
#include "reduce/reduce.h"

namespace ddlcomm::ring {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// The segments of one chunk, in element offsets.
struct Segment {
  size_t begin;
  size_t length;
};

std::vector<Segment> segmentsOf(const Chunks& chunks, int chunk, size_t segmentElems) {
  std::vector<Segment> out;
  size_t b = chunks.begin(chunk), e = chunks.begin(chunk + 1);
  for (size_t s = b; s < e; s += segmentElems) out.push_back({s, std::min(segmentElems, e - s)});
  return out;
}

size_t segmentElements(Call& call, DataType dtype) {
  return std::max<size_t>(1, call.comm().options().segmentBytes / elementSize(dtype));
}

// A segment received in ring step `step`.
struct Unit {
  int step;
  Segment segment;
};

// Every segment rank r receives, in order: in step s, those of chunk r - offset - s.
std::vector<Unit> received(const Chunks& chunks, int r, int offset, size_t segElems) {
  const int n = chunks.n;
  std::vector<Unit> units;
  for (int s = 0; s < n - 1; ++s) {
    for (const Segment& seg : segmentsOf(chunks, mod(r - offset - s, n), segElems)) units.push_back({s, seg});
  }
  return units;
}

}  // namespace

Members Members::all(const Communicator& comm) {
  std::vector<int> ranks(size_t(comm.size()));
  for (int i = 0; i < comm.size(); ++i) ranks[size_t(i)] = i;
  return Members{std::move(ranks), comm.rank()};
}

Members Members::of(std::vector<int> ranks, int rank) {
  const int self = int(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  return Members{std::move(ranks), self};
}

void reduceScatterInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, ReduceOp op) {
  reduceScatterInPlace(call, data, chunks, dtype, op, Members::all(call.comm()));
}

void allgatherInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype) {
  allgatherInPlace(call, data, chunks, dtype, Members::all(call.comm()));
}

void reduceScatterInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, ReduceOp op,
                          const Members& members) {
  const int n = members.n(), r = members.self;
  if (n == 1) return;
  const int right = members.ranks[size_t(mod(r + 1, n))], left = members.ranks[size_t(mod(r - 1, n))];
  const size_t es = elementSize(dtype);
  const size_t segElems = segmentElements(call, dtype);

  // Step s sends chunk r-1-s and receives chunk r-2-s, so rank r finishes owning chunk r.
  const std::vector<Unit> units = received(chunks, r, 2, segElems);
  const std::vector<Segment> first = segmentsOf(chunks, mod(r - 1, n), segElems);
  std::vector<Request> sends(first.size() + units.size());
  std::vector<Request> recvs(units.size());
  size_t nextSend = 0;
  for (const Segment& seg : first) call.send(sends[nextSend++], right, data + seg.begin * es, seg.length * es);

  // Receive into a few rotating slots, so memory stays small whatever the buffer size.
  const size_t window = std::min<size_t>(4, units.size());
  char* slots = call.comm().scratch(window * segElems * es, 0);
  auto slot = [&](size_t i) { return slots + (i % window) * segElems * es; };
  for (size_t i = 0; i < window; ++i) call.recv(recvs[i], left, slot(i), units[i].segment.length * es);

  for (size_t i = 0; i < units.size(); ++i) {
    call.wait(recvs[i]);
    const Segment& seg = units[i].segment;
    reduceInto(op, dtype, data + seg.begin * es, slot(i), seg.length);
    if (units[i].step < n - 2) call.send(sends[nextSend++], right, data + seg.begin * es, seg.length * es);
    if (i + window < units.size()) {
      call.recv(recvs[i + window], left, slot(i + window), units[i + window].segment.length * es);
    }
  }
  for (size_t i = 0; i < nextSend; ++i) call.wait(sends[i]);
}

void allgatherInPlace(Call& call, char* data, const Chunks& chunks, DataType dtype, const Members& members) {
  const int n = members.n(), r = members.self;
  if (n == 1) return;
  const int right = members.ranks[size_t(mod(r + 1, n))], left = members.ranks[size_t(mod(r - 1, n))];
  const size_t es = elementSize(dtype);
  const size_t segElems = segmentElements(call, dtype);

  // Step s sends chunk r-s and receives chunk r-1-s straight into place.
  const std::vector<Unit> units = received(chunks, r, 1, segElems);
  const std::vector<Segment> own = segmentsOf(chunks, r, segElems);
  std::vector<Request> sends(own.size() + units.size());
  std::vector<Request> recvs(units.size());
  size_t nextSend = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const Segment& seg = units[i].segment;
    call.recv(recvs[i], left, data + seg.begin * es, seg.length * es);
  }
  for (const Segment& seg : own) call.send(sends[nextSend++], right, data + seg.begin * es, seg.length * es);
  for (size_t i = 0; i < units.size(); ++i) {
    call.wait(recvs[i]);
    const Segment& seg = units[i].segment;
    if (units[i].step < n - 2) call.send(sends[nextSend++], right, data + seg.begin * es, seg.length * es);
  }
  for (size_t i = 0; i < nextSend; ++i) call.wait(sends[i]);
}

}  // namespace ddlcomm::ring
