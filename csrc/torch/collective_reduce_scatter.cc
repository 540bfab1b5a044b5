// The compressed reduce-scatter over c10d collectives (collective_compressed.h): ddlcomm.fsdp's,
// for every group and device.
#include <algorithm>
#include <limits>

#include "collectives/compressed_plan.h"
#include "common/error.h"
#include "torch/backend.h"
#include "torch/collective_compressed.h"
#include "torch/payload_codec.h"
#include "torch/tensor_args.h"
#include "transport/topology.h"

namespace ddlcomm::torch_glue {
namespace {

void checkReduceScatterArgs(const CollectiveGroup& g, const CollectiveReduceScatterArgs& args) {
  checkCompressible(args.output, "compressed reduce-scatter");
  checkReduceScatterShapes(args.output, args.input, g.group.values->getSize());
  checkResidual(args.workerResidual, args.input.numel(), "worker residual", args.input.device());
}

}  // namespace

void compressedReduceScatterOverCollectives(const CollectiveGroup& g, const CollectiveReduceScatterArgs& args) {
  checkReduceScatterArgs(g, args);
  const int rank = g.group.values->getRank(), n = g.group.values->getSize();
  const size_t m = size_t(args.output.numel());
  const c10::Device device = args.input.device();
  const Codec codec(args.config, device);
  const Wire wire(args.config, device, g.staged);
  at::Tensor flat = args.input.contiguous().view({-1});
  if (compress::findFormat(uint8_t(args.config.format))->samplesRandomly &&
      nonFiniteAnywhere(*g.group.payloads, g.staged, flat)) {
    args.output.fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  std::vector<int> owners;  // whose chunk each chunk of `flat` is
  c10d::Backend* among = g.group.payloads.get();
  if (g.host) {
    // The host's sums of the chunks of the ranks at each place on every host, place by place:
    // this rank receives those of the ranks at its own place, which it then reduces among.
    const Topology topology = Topology::ofHosts(g.identities, rank);
    const std::vector<int>& hostRanks = topology.hostRanks();
    const size_t local = size_t(std::find(hostRanks.begin(), hostRanks.end(), rank) - hostRanks.begin());
    std::vector<at::Tensor> byPlace;
    for (size_t place = 0; place < hostRanks.size(); ++place) {
      for (int h = 0; h < topology.hosts(); ++h) {
        const size_t o = size_t(topology.ranksOfHost(h)[place]);
        byPlace.push_back(slice(flat, o * m, (o + 1) * m));
        if (place == local) owners.push_back(int(o));
      }
    }
    at::Tensor input = at::cat(byPlace);
    flat = at::empty({int64_t(owners.size() * m)}, flat.options());
    c10d::ReduceScatterOptions sum;
    sum.reduceOp = c10d::ReduceOp::SUM;
    wait(*g.host->values, g.host->values->_reduce_scatter_base(flat, input, sum));
    among = g.across->payloads.get();
  } else {
    for (int o = 0; o < n; ++o) owners.push_back(o);
  }
  const int k = int(owners.size());
  const size_t bytes = codec.bytes(m), slot = payloadSlot(args.config, m);
  at::Tensor outgoing = at::empty({int64_t(size_t(k) * slot)}, flat.options().dtype(at::kByte));
  std::vector<at::Tensor> xs, residuals, payloads;
  std::vector<uint64_t> streams;
  for (int i = 0; i < k; ++i) {
    const size_t o = size_t(owners[size_t(i)]);
    xs.push_back(slice(flat, size_t(i) * m, size_t(i + 1) * m));
    if (args.workerResidual) residuals.push_back(slice(*args.workerResidual, o * m, (o + 1) * m));
    streams.push_back(encodeStream(args.stream, rank, 0, int(o), n, 0));
    payloads.push_back(slice(outgoing, size_t(i) * slot, size_t(i + 1) * slot));
  }
  codec.encodeChunks(xs, residuals, streams, payloads);
  at::Tensor incoming = wire.empty(size_t(k) * slot);
  at::Tensor sent = wire.send(outgoing);
  std::vector<int64_t> even;  // empty: equal splits
  wait(*among, among->alltoall_base(incoming, sent, even, even));
  const at::Tensor rows = wire.receive(incoming.view({k, int64_t(slot)}), std::vector<size_t>(size_t(k), bytes),
                                       std::vector<size_t>(size_t(k), m));
  codec.sum(rows, bytes, args.average ? 1.f / float(n) : 1.f, args.output);
}

c10::intrusive_ptr<c10d::Work> startCompressedReduceScatter(ProcessGroupDdlcomm& engine,
                                                            CollectiveReduceScatterArgs args,
                                                            std::optional<CollectiveLevel> host,
                                                            std::optional<CollectiveLevel> across,
                                                            std::vector<std::string> identities) {
  checkTensor(args.output, "compressed reduce-scatter");  // CPU tensors
  checkTensor(args.input, "compressed reduce-scatter");
  auto self = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(&engine);
  CollectiveGroup levels{{self, self}, std::move(host), std::move(across), std::move(identities), false};
  checkReduceScatterArgs(levels, args);
  std::vector<at::Tensor> outputs{args.output};
  return engine.enqueue(c10d::OpType::REDUCE_SCATTER, std::move(outputs),
                        [levels = std::move(levels), args = std::move(args)](Communicator&) {
                          compressedReduceScatterOverCollectives(levels, args);
                        });
}

}  // namespace ddlcomm::torch_glue
