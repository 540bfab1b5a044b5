// The compressed all-reduce over c10d collectives (collective_compressed.h), over the payload
// codec (payload_codec.h): flat, or over hosts, a piece at a time.
#include "torch/collective_compressed.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "collectives/compressed_plan.h"
#include "common/error.h"
#include "torch/backend.h"
#include "torch/payload_codec.h"
#include "torch/device_staging.h"
#include "torch/tensor_args.h"
#include "transport/topology.h"

namespace ddlcomm::torch_glue {
namespace {

// What every part of one call shares among the ranks it runs with (the group, or one rank
// per host): the encodes' randomness streams are numbered by the whole group's rank and size.
struct Among {
  const Codec& codec;
  const Wire& wire;
  c10d::Backend& payloads;
  float scale;
  uint64_t stream;
  int me, size;
};

void allGather(c10d::Backend& backend, at::Tensor out, at::Tensor in) {
  wait(backend, backend._allgather_base(out, in));
}

// A sparse format: every rank's payload all-gathered, decoded and summed in rank order.
void sparseAmong(const at::Tensor& flat, const at::Tensor* residual, const Among& a) {
  const int k = a.payloads.getSize();
  const size_t numel = size_t(flat.numel()), bytes = a.codec.bytes(numel), slot = payloadSlot(a.codec.config(), numel);
  at::Tensor payload = at::empty({int64_t(slot)}, flat.options().dtype(at::kByte));
  a.codec.encode(flat, residual, encodeStream(a.stream, a.me, 0, 0, a.size, 0), payload);
  at::Tensor everyone = a.wire.empty(size_t(k) * slot);
  allGather(a.payloads, everyone, a.wire.send(payload));
  const at::Tensor rows =
      a.wire.receive(everyone.view({k, int64_t(slot)}), std::vector<size_t>(size_t(k), bytes),
                     std::vector<size_t>(size_t(k), numel));
  a.codec.sumSparse(rows, bytes, a.scale, flat);
}

// One piece of a quantized or cast format, in place: chunk i (flat[bounds[i], bounds[i+1]))
// reduced by rank i among the ranks, its sum re-encoded with the server residual and
// all-gathered. Three steps, so that a piece's all-gather travels while the next piece is
// encoded: scatter (encode every chunk, start the all-to-all), reduce (sum this rank's chunk,
// re-encode it, start the all-gather), gather (decode every rank's chunk).
class Piece {
 public:
  Piece(const at::Tensor& flat, const ring::Chunks& chunks, uint64_t index, const Among& a)
      : flat_(flat), chunks_(chunks), index_(index), a_(a) {
    const int n = chunks.n;
    for (int i = 0; i < n; ++i) {
      lengths_.push_back(chunks.length(i));
      sizes_.push_back(a.codec.bytes(lengths_.back()));
      slots_.push_back(payloadSlot(a.codec.config(), lengths_.back()));
    }
  }

  void scatter(const at::Tensor* worker) {
    const int n = chunks_.n, r = a_.payloads.getRank();
    std::vector<size_t> offsets{0};
    for (size_t slot : slots_) offsets.push_back(offsets.back() + slot);
    at::Tensor outgoing = at::empty({int64_t(offsets.back())}, flat_.options().dtype(at::kByte));
    std::vector<at::Tensor> xs, residuals, payloads;
    std::vector<uint64_t> streams;
    for (int i = 0; i < n; ++i) {
      xs.push_back(chunk(flat_, i));
      if (worker) residuals.push_back(chunk(*worker, i));
      streams.push_back(encodeStream(a_.stream, a_.me, 0, i, a_.size, index_));
      payloads.push_back(slice(outgoing, offsets[size_t(i)], offsets[size_t(i) + 1]));
    }
    a_.codec.encodeChunks(xs, residuals, streams, payloads);
    incoming_ = a_.wire.empty(size_t(n) * slots_[size_t(r)]);
    std::vector<int64_t> received(static_cast<size_t>(n), static_cast<int64_t>(slots_[size_t(r)]));
    std::vector<int64_t> sending(slots_.begin(), slots_.end());
    sent_ = a_.wire.send(outgoing);
    exchange_ = a_.payloads.alltoall_base(incoming_, sent_, received, sending);
  }

  void reduce(const at::Tensor* server) {
    const int n = chunks_.n, r = a_.payloads.getRank();
    wait(a_.payloads, exchange_);
    const at::Tensor workers = a_.wire.receive(incoming_.view({n, int64_t(slots_[size_t(r)])}),
                                               std::vector<size_t>(size_t(n), sizes_[size_t(r)]),
                                               std::vector<size_t>(size_t(n), lengths_[size_t(r)]));
    // The all-gather needs equal sizes: chunk payloads differ by at most one element's worth.
    widest_ = *std::max_element(slots_.begin(), slots_.end());
    at::Tensor padded = at::empty({int64_t(widest_)}, flat_.options().dtype(at::kByte));
    a_.codec.reduceEncode(workers, sizes_[size_t(r)], chunk(flat_, r), a_.scale, server,
                          encodeStream(a_.stream, a_.me, 1, r, a_.size, index_), padded);
    gathered_ = a_.wire.empty(size_t(n) * widest_);
    sent_ = a_.wire.send(padded);
    exchange_ = a_.payloads._allgather_base(gathered_, sent_);
  }

  void gather() {
    wait(a_.payloads, exchange_);
    const at::Tensor rows = a_.wire.receive(gathered_.view({chunks_.n, int64_t(widest_)}), sizes_, lengths_);
    std::vector<at::Tensor> payloads, outs;
    for (int j = 0; j < chunks_.n; ++j) {
      payloads.push_back(rows[j]);
      outs.push_back(chunk(flat_, j));
    }
    a_.codec.decodeChunks(payloads, sizes_, outs);
  }

 private:
  at::Tensor chunk(const at::Tensor& t, int i) const { return slice(t, chunks_.begin(i), chunks_.begin(i + 1)); }

  at::Tensor flat_;
  ring::Chunks chunks_;
  uint64_t index_;
  const Among& a_;
  std::vector<size_t> lengths_, sizes_, slots_;
  size_t widest_ = 0;
  at::Tensor sent_, incoming_, gathered_;  // kept alive while their exchange is in flight
  c10::intrusive_ptr<c10d::Work> exchange_;
};

// Every piece of `spans` (offsets into flat, one chunk per rank among the ranks), each one's
// all-gather in flight while the next is encoded; the server residual holds this rank's chunk
// of each, in order. Every rank issues the collectives in the same order: scatter k, gather k-1.
void piecesAmong(const at::Tensor& flat, const std::vector<PieceSpan>& spans, const at::Tensor* worker,
                 const at::Tensor* server, const Among& a) {
  const int r = a.payloads.getRank();
  size_t residualAt = 0;
  std::optional<Piece> previous;
  for (size_t k = 0; k < spans.size(); ++k) {
    const PieceSpan& span = spans[k];
    const size_t mine = span.chunks.length(r), end = span.begin + span.chunks.total;
    Piece piece(slice(flat, span.begin, end), span.chunks, k, a);
    const at::Tensor w = worker ? slice(*worker, span.begin, end) : at::Tensor();
    piece.scatter(worker ? &w : nullptr);
    if (previous) previous->gather();
    const at::Tensor s = server ? slice(*server, residualAt, residualAt + mine) : at::Tensor();
    piece.reduce(server ? &s : nullptr);
    previous.emplace(std::move(piece));
    residualAt += mine;
  }
  if (previous) previous->gather();
}

// Copies every host rank's shard (flat[chunks.begin(l), chunks.begin(l+1))) to the others; the
// all-gather needs equal sizes, so the shards are padded to the widest. The shards go back in
// one concatenation (one kernel on a GPU, not one a shard), this rank's own with the values it has.
void gatherInHost(const at::Tensor& flat, const ring::Chunks& chunks, int local, c10d::Backend& host) {
  const int k = chunks.n;
  size_t widest = 0;
  for (int l = 0; l < k; ++l) widest = std::max(widest, chunks.length(l));
  at::Tensor padded = at::empty({int64_t(widest)}, flat.options());
  slice(padded, 0, chunks.length(local)).copy_(slice(flat, chunks.begin(local), chunks.begin(local + 1)));
  at::Tensor everyone = at::empty({int64_t(size_t(k) * widest)}, flat.options());
  allGather(host, everyone, padded);
  const at::Tensor rows = everyone.view({k, int64_t(widest)});
  std::vector<at::Tensor> shards;
  for (int l = 0; l < k; ++l) shards.push_back(slice(rows[l], 0, chunks.length(l)));
  at::Tensor out = slice(flat, chunks.begin(0), chunks.begin(k));
  at::cat_out(out, shards);
}

// Exact inside the host (the host's all-reduce in the tensor's dtype), each rank's shard of
// the host sum compressed among the ranks at its place on the other hosts, the shards
// all-gathered inside the host: the hierarchical plan (hostPlanOf). The in-host sums are the
// backend's own all-reduce's, whose rounding may differ between backends with more than two
// ranks a host.
void overHosts(const CollectiveGroup& g, const at::Tensor& flat, const at::Tensor* worker, const at::Tensor* server,
               const Among& across) {
  const int rank = g.group.values->getRank(), size = g.group.values->getSize();
  const Topology topology = Topology::ofHosts(g.identities, rank);
  const std::vector<int>& hostRanks = topology.hostRanks();
  const int local = int(std::find(hostRanks.begin(), hostRanks.end(), rank) - hostRanks.begin());
  const size_t numel = size_t(flat.numel());
  std::vector<at::Tensor> whole{flat};
  c10d::AllreduceOptions sum;
  sum.reduceOp = c10d::ReduceOp::SUM;
  wait(*g.host->values, g.host->values->allreduce(whole, sum));
  if (compress::isSparse(across.codec.config().format)) {
    const ring::Chunks shards{numel, int(hostRanks.size())};
    const size_t begin = shards.begin(local), end = shards.begin(local + 1);
    const at::Tensor w = worker ? slice(*worker, begin, end) : at::Tensor();
    sparseAmong(slice(flat, begin, end), worker ? &w : nullptr, across);
    gatherInHost(flat, shards, local, *g.host->values);
    return;
  }
  const HostPlan plan = hostPlanOf(topology, numel, rank, size);
  piecesAmong(flat, plan.across, worker, server, across);
  const std::vector<PieceSpan> pieces = piecesOf(numel, size);
  for (size_t k = 0; k < pieces.size(); ++k) {
    gatherInHost(slice(flat, pieces[k].begin, pieces[k].begin + pieces[k].chunks.total), plan.inHost[k], local,
                 *g.host->values);
  }
}

void checkAllreduceArgs(const CollectiveGroup& g, const CollectiveAllreduceArgs& args) {
  const at::Tensor& tensor = args.tensor;
  checkCompressible(tensor, "compressed allreduce");
  const int rank = g.group.values->getRank(), size = g.group.values->getSize();
  const size_t numel = size_t(tensor.numel());
  checkResidual(args.workerResidual, int64_t(numel), "worker residual", tensor.device());
  checkResidual(args.serverResidual, int64_t(serverResidualLength(numel, rank, size)), "server residual",
                tensor.device());
}

// The whole call on the calling thread (the executor's, or the caller's).
void compressedAllreduceOverCollectives(const CollectiveGroup& g, const CollectiveAllreduceArgs& args) {
  checkAllreduceArgs(g, args);
  const at::Tensor& tensor = args.tensor;
  const int rank = g.group.values->getRank(), size = g.group.values->getSize();
  const size_t numel = size_t(tensor.numel());
  if (numel == 0) return;
  at::Tensor flat = tensor.is_contiguous() ? tensor.view({-1}) : tensor.contiguous().view({-1});
  if (compress::findFormat(uint8_t(args.config.format))->samplesRandomly &&
      nonFiniteAnywhere(*g.group.payloads, g.staged, flat)) {
    tensor.fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const c10::Device device = tensor.device();
  const Codec codec(args.config, device);
  const Wire wire(args.config, device, g.staged);
  const float scale = args.average ? 1.f / float(size) : 1.f;
  const at::Tensor* worker = args.workerResidual ? &*args.workerResidual : nullptr;
  const at::Tensor* server = args.serverResidual ? &*args.serverResidual : nullptr;
  if (g.host) {
    overHosts(g, flat, worker, server, Among{codec, wire, *g.across->payloads, scale, args.stream, rank, size});
  } else {
    const Among among{codec, wire, *g.group.payloads, scale, args.stream, rank, size};
    if (compress::isSparse(args.config.format)) {
      sparseAmong(flat, worker, among);
    } else {
      piecesAmong(flat, piecesOf(numel, size), worker, server, among);
    }
  }
  if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
}

}  // namespace

CompressedAllreduce::CompressedAllreduce(compress::Config config, CollectiveGroup group,
                                         c10::intrusive_ptr<ProcessGroupDdlcomm> engine)
    : config_(config), group_(std::move(group)), engine_(std::move(engine)) {
  TORCH_CHECK_VALUE(group_.host.has_value() == group_.across.has_value(), "ddlcomm: two levels need both the "
                    "host's and the across-hosts' collectives");
}

c10::intrusive_ptr<c10d::Work> CompressedAllreduce::start(at::Tensor tensor, std::optional<at::Tensor> workerResidual,
                                                          std::optional<at::Tensor> serverResidual, bool average,
                                                          uint64_t stream) const {
  CollectiveAllreduceArgs args{config_, std::move(tensor), std::move(workerResidual), std::move(serverResidual),
                               average, stream};
  const c10::Device device = args.tensor.device();
  if (!engine_) {
    compressedAllreduceOverCollectives(group_, args);
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    done->markCompleted(c10::IValue(std::vector<at::Tensor>{args.tensor}));
    return c10d::Work::create_from_future(done);
  }
  if (device.is_cpu()) checkTensor(args.tensor, "compressed allreduce");
  auto self = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(engine_.get());
  // A CUDA tensor's payloads cross to pinned host memory for the engine's collectives.
  CollectiveGroup levels{{self, self}, group_.host, group_.across, group_.identities, !device.is_cpu()};
  checkAllreduceArgs(levels, args);
  const DeviceWork onDevice(device);
  std::vector<at::Tensor> outputs{args.tensor};
  return engine_->enqueue(c10d::OpType::ALLREDUCE, std::move(outputs),
                          [levels = std::move(levels), args = std::move(args), onDevice](Communicator& comm) {
                            if (levels.host) ++comm.counters().hierarchicalCompressedAllreduces;
                            onDevice.run([&] { compressedAllreduceOverCollectives(levels, args); });
                          });
}

}  // namespace ddlcomm::torch_glue
