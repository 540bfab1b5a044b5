// Collectives with no reduction: all-to-all, gather, scatter. Every message is posted at
// once; the transport moves them as the sockets allow.
#include <cstring>
#include <vector>

#include "collectives/collectives.h"

namespace ddlcomm {

void allToAll(Communicator& comm, const void* input, const std::vector<size_t>& sendCounts, void* output,
              const std::vector<size_t>& recvCounts, DataType dtype) {
  const int n = comm.size(), r = comm.rank();
  DDLCOMM_CHECK(sendCounts.size() == size_t(n) && recvCounts.size() == size_t(n), ErrorKind::InvalidArgument,
                "all_to_all needs one split size per rank (", n, ")");
  const size_t es = elementSize(dtype);
  // With uneven splits each rank sends a different total, so the call's signature carries no
  // count (0 on every rank); the transport still checks every message's byte count.
  comm.run(OpCode::AllToAll, dtype, 0, [&](Call& call) {
    std::vector<size_t> sendOff(size_t(n), 0), recvOff(size_t(n), 0);
    for (int i = 1; i < n; ++i) {
      sendOff[size_t(i)] = sendOff[size_t(i - 1)] + sendCounts[size_t(i - 1)];
      recvOff[size_t(i)] = recvOff[size_t(i - 1)] + recvCounts[size_t(i - 1)];
    }
    const char* in = static_cast<const char*>(input);
    char* out = static_cast<char*>(output);
    DDLCOMM_CHECK(sendCounts[size_t(r)] == recvCounts[size_t(r)], ErrorKind::InvalidArgument,
                  "all_to_all: rank ", r, " sends ", sendCounts[size_t(r)], " elements to itself but expects ",
                  recvCounts[size_t(r)]);
    std::vector<Request> sends(static_cast<size_t>(n)), recvs(static_cast<size_t>(n));
    // Staggered order (r+s, r-s) spreads the load so no rank is everyone's first target.
    for (int s = 1; s < n; ++s) {
      int to = (r + s) % n, from = (r - s + n) % n;
      call.recv(recvs[size_t(from)], from, out + recvOff[size_t(from)] * es, recvCounts[size_t(from)] * es);
      call.send(sends[size_t(to)], to, in + sendOff[size_t(to)] * es, sendCounts[size_t(to)] * es);
    }
    if (sendCounts[size_t(r)]) std::memmove(out + recvOff[size_t(r)] * es, in + sendOff[size_t(r)] * es, sendCounts[size_t(r)] * es);
    for (int s = 1; s < n; ++s) {
      call.wait(recvs[size_t((r - s + n) % n)]);
      call.wait(sends[size_t((r + s) % n)]);
    }
  });
}

void gather(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, int root) {
  const size_t bytes = count * elementSize(dtype);
  comm.run(OpCode::Gather, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    if (r != root) {
      Request send;
      call.send(send, root, input, bytes);
      call.wait(send);
      return;
    }
    char* out = static_cast<char*>(output);
    std::vector<Request> recvs(static_cast<size_t>(n));
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) call.recv(recvs[size_t(peer)], peer, out + size_t(peer) * bytes, bytes);
    }
    if (bytes && out + size_t(r) * bytes != input) std::memmove(out + size_t(r) * bytes, input, bytes);
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) call.wait(recvs[size_t(peer)]);
    }
  });
}

void scatter(Communicator& comm, const void* input, void* output, size_t count, DataType dtype, int root) {
  const size_t bytes = count * elementSize(dtype);
  comm.run(OpCode::Scatter, dtype, count, [&](Call& call) {
    const int n = comm.size(), r = comm.rank();
    if (r != root) {
      Request recv;
      call.recv(recv, root, output, bytes);
      call.wait(recv);
      return;
    }
    const char* in = static_cast<const char*>(input);
    std::vector<Request> sends(static_cast<size_t>(n));
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) call.send(sends[size_t(peer)], peer, in + size_t(peer) * bytes, bytes);
    }
    if (bytes && output != in + size_t(r) * bytes) std::memmove(output, in + size_t(r) * bytes, bytes);
    for (int peer = 0; peer < n; ++peer) {
      if (peer != r) call.wait(sends[size_t(peer)]);
    }
  });
}

}  // namespace ddlcomm
