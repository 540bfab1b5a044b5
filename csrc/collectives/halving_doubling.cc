// Recursive halving and doubling (Rabenseifner's all-reduce): a reduce-scatter in log2 p
// steps, each exchanging half of what is left with the member at distance p/2, p/4, ..., 1,
// then an all-gather that retraces them. The same bytes as the ring, 2(p-1)/p of the buffer,
// in 2 log2 p steps instead of 2(p-1): over many hosts on links of milliseconds the ring's
// steps, not its bytes, set the time. Members beyond the largest power of two p fold their
// buffer into a partner first and take the result back at the end.
#include <algorithm>
#include <vector>

#include "collectives/collectives.h"
#include "reduce/reduce.h"

namespace ddlcomm::halving {
namespace {

// A range of elements [begin, end).
struct Range {
  size_t begin;
  size_t end;
};

Range range(const ring::Chunks& chunks, int first, int last) { return {chunks.begin(first), chunks.begin(last)}; }

// `give` goes to `peer` while `peer`'s copy of `take` arrives, in segments: reduced into
// `data` (with `reduce`, through a few rotating slots, so each is summed while the next are
// on the wire) or written in place. Both sides call it with each other's ranges swapped.
void exchange(Call& call, int peer, char* data, Range give, Range take, DataType dtype, ReduceOp op, bool reduce) {
  const size_t es = elementSize(dtype);
  const size_t seg = std::max<size_t>(1, call.comm().options().segmentBytes / es);
  auto segments = [seg](Range r) {
    std::vector<Range> out;
    for (size_t s = r.begin; s < r.end; s += seg) out.push_back({s, std::min(r.end, s + seg)});
    return out;
  };
  const std::vector<Range> out = segments(give), in = segments(take);
  std::vector<Request> sends(out.size()), recvs(in.size());
  for (size_t i = 0; i < out.size(); ++i) {
    call.send(sends[i], peer, data + out[i].begin * es, (out[i].end - out[i].begin) * es);
  }
  const size_t window = reduce ? std::min<size_t>(4, in.size()) : in.size();
  char* slots = reduce ? call.comm().scratch(window * seg * es, 0) : nullptr;
  auto target = [&](size_t i) { return reduce ? slots + (i % window) * seg * es : data + in[i].begin * es; };
  auto post = [&](size_t i) { call.recv(recvs[i], peer, target(i), (in[i].end - in[i].begin) * es); };
  for (size_t i = 0; i < window; ++i) post(i);
  for (size_t i = 0; i < in.size(); ++i) {
    call.wait(recvs[i]);
    if (reduce) reduceInto(op, dtype, data + in[i].begin * es, target(i), in[i].end - in[i].begin);
    if (i + window < in.size()) post(i + window);
  }
  for (Request& send : sends) call.wait(send);
}

}  // namespace

int owners(int members) {
  int p = 1;
  while (p * 2 <= members) p *= 2;
  return p;
}

bool reduceScatterInPlace(Call& call, char* data, const ring::Chunks& chunks, DataType dtype, ReduceOp op,
                          const ring::Members& members) {
  const int n = members.n(), s = members.self, p = chunks.n;
  const Range all{0, chunks.total}, none{0, 0};
  if (s >= p) {  // folded into member s - p
    exchange(call, members.ranks[size_t(s - p)], data, all, none, dtype, op, true);
    return false;
  }
  if (s + p < n) exchange(call, members.ranks[size_t(s + p)], data, none, all, dtype, op, true);
  // Member s keeps the half of [lo, hi) that its bit `mask` names: it ends on chunk s.
  int lo = 0, hi = p;
  for (int mask = p / 2; mask >= 1; mask /= 2) {
    const int mid = lo + mask;
    const bool upper = (s & mask) != 0;
    const Range lower = range(chunks, lo, mid), higher = range(chunks, mid, hi);
    exchange(call, members.ranks[size_t(s ^ mask)], data, upper ? lower : higher, upper ? higher : lower, dtype, op,
             true);
    (upper ? lo : hi) = mid;
  }
  return true;
}

void allgatherInPlace(Call& call, char* data, const ring::Chunks& chunks, DataType dtype,
                      const ring::Members& members) {
  const int n = members.n(), s = members.self, p = chunks.n;
  const Range all{0, chunks.total}, none{0, 0};
  if (s >= p) {
    exchange(call, members.ranks[size_t(s - p)], data, none, all, dtype, ReduceOp::Sum, false);
    return;
  }
  // Member s holds the `mask` chunks from `lo` (aligned to mask); its partner the next or
  // previous ones.
  for (int mask = 1; mask < p; mask *= 2) {
    const int lo = s & ~(mask - 1), theirs = lo ^ mask;
    exchange(call, members.ranks[size_t(s ^ mask)], data, range(chunks, lo, lo + mask),
             range(chunks, theirs, theirs + mask), dtype, ReduceOp::Sum, false);
  }
  if (s + p < n) exchange(call, members.ranks[size_t(s + p)], data, all, none, dtype, ReduceOp::Sum, false);
}

}  // namespace ddlcomm::halving
