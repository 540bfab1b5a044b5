// Broadcast: a binomial tree when latency dominates (log n hops), a pipelined chain when
// bandwidth does (each link carries the buffer once, segments overlap along the chain).
#include <algorithm>
#include <vector>

#include "collectives/collectives.h"

namespace ddlcomm {
namespace {

void binomialTree(Call& call, char* data, size_t bytes, int root) {
  const int n = call.comm().size(), r = call.comm().rank();
  const int vr = (r - root + n) % n;
  Request request;
  int mask = 1;
  while (mask < n) {
    if (vr & mask) {
      call.recv(request, (vr - mask + root) % n, data, bytes);
      call.wait(request);
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < n) {
      call.send(request, (vr + mask + root) % n, data, bytes);
      call.wait(request);
    }
  }
}

void pipelinedChain(Call& call, char* data, size_t bytes, int root) {
  const int n = call.comm().size(), r = call.comm().rank();
  const int vr = (r - root + n) % n;
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  const size_t seg = call.comm().options().segmentBytes;
  const size_t segments = (bytes + seg - 1) / seg;
  std::vector<Request> recvs(segments), sends(segments);
  auto span = [&](size_t i) { return std::min(seg, bytes - i * seg); };
  if (vr != 0) {
    for (size_t i = 0; i < segments; ++i) call.recv(recvs[i], prev, data + i * seg, span(i));
  }
  const bool forward = vr != n - 1;
  for (size_t i = 0; i < segments; ++i) {
    if (vr != 0) call.wait(recvs[i]);
    if (forward) call.send(sends[i], next, data + i * seg, span(i));
  }
  if (forward) {
    for (auto& s : sends) call.wait(s);
  }
}

}  // namespace

void broadcast(Communicator& comm, void* data, size_t count, DataType dtype, int root) {
  const size_t bytes = count * elementSize(dtype);
  comm.run(OpCode::Broadcast, dtype, count, [&](Call& call) {
    if (comm.size() == 1 || bytes == 0) return;
    if (bytes <= comm.options().smallMessageBytes || comm.size() == 2) {
      binomialTree(call, static_cast<char*>(data), bytes, root);
    } else {
      pipelinedChain(call, static_cast<char*>(data), bytes, root);
    }
  });
}

}  // namespace ddlcomm
