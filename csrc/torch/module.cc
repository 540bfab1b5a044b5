// The Python extension module ddlcomm._C: the backend class and its constructor.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "collectives/communicator.h"
#include "collectives/compressed_plan.h"
#include "common/error.h"
#include "torch/backend.h"
#include "torch/collective_compressed.h"
#include "transport/host.h"
#include "transport/topology.h"

namespace py = pybind11;
using ddlcomm::torch_glue::ProcessGroupDdlcomm;
using Options = ProcessGroupDdlcomm::Options;
using SpinMicros = std::map<std::string, int64_t>;
// A set of ranks' backends: for the tensor's device, for the payloads (csrc/torch/collective_compressed.h).
using Level = std::pair<c10::intrusive_ptr<c10d::Backend>, c10::intrusive_ptr<c10d::Backend>>;

namespace {

// The plan functions index chunks by rank: out of range they would read past the split.
void checkRank(int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw py::value_error("rank " + std::to_string(rank) + " of a group of " + std::to_string(size));
  }
}

// (begin, end, the n + 1 chunk bounds relative to begin) of each piece.
std::vector<std::tuple<size_t, size_t, std::vector<size_t>>> pieces(size_t count, int size) {
  checkRank(0, size);
  std::vector<std::tuple<size_t, size_t, std::vector<size_t>>> out;
  for (const ddlcomm::PieceSpan& span : ddlcomm::piecesOf(count, size)) {
    std::vector<size_t> bounds;
    for (int i = 0; i <= size; ++i) bounds.push_back(span.chunks.begin(i));
    out.emplace_back(span.begin, span.begin + span.chunks.total, std::move(bounds));
  }
  return out;
}

// Options are checked where they are written, so a bad value fails there rather than at init.
ddlcomm::TransportRequest checkedRequest(std::optional<std::string> name, SpinMicros spin) {
  ddlcomm::TransportRequest request{std::move(name), std::move(spin)};
  try {
    ddlcomm::checkTransportRequest(request);
  } catch (const ddlcomm::Error& e) {
    throw py::value_error(e.what());
  }
  return request;
}

std::optional<std::string> checkedAlgorithm(std::optional<std::string> name) {
  try {
    if (name) ddlcomm::allreduceAlgorithmNamed(*name, "ddlcomm.Options.allreduce_algorithm");
  } catch (const ddlcomm::Error& e) {
    throw py::value_error(e.what());
  }
  return name;
}

// The two-level plan of a compressed all-reduce of `numel` elements over a group
// (ddlcomm.host_levels' subgroups, the statistics), from every rank's host identity, the
// algorithm (a ddlcomm group's own, else DDLCOMM_ALLREDUCE_ALGO) and whether the group's
// collectives inside a host are fast: None where the flat plan runs. The exact all-reduce's
// rule (layeredByHost) and the plan's layout (hostPlanOf).
py::object hostPlan(const std::vector<std::string>& identities, int rank, size_t numel,
                    const std::optional<std::string>& algorithmName, bool fastInside) {
  const int size = int(identities.size());
  checkRank(rank, size);
  const ddlcomm::Topology topology = ddlcomm::Topology::ofHosts(identities, rank);
  const ddlcomm::AllreduceAlgorithm algorithm =
      ddlcomm::CollectiveOptions::fromEnvironment(std::chrono::milliseconds(0), checkedAlgorithm(algorithmName))
          .allreduceAlgorithm;
  // Under auto, only where the exact collectives inside a host are fast (GPU collectives, or the
  // native backend's shared memory): over gloo's TCP on loopback they cost more than the traffic
  // the two levels save (docs/collectives.md, "Compressed all-reduce across hosts").
  const bool layered = algorithm == ddlcomm::AllreduceAlgorithm::Auto
                           ? fastInside && topology.suitsHierarchy()
                           : ddlcomm::layeredByHost(algorithm, topology);
  if (!layered) return py::none();
  if (!topology.uniform()) {
    throw py::value_error("the hierarchical all-reduce (DDLCOMM_ALLREDUCE_ALGO) needs the same number of ranks on "
                          "every host; this group has " + topology.describe());
  }
  py::dict out;
  out["topology"] = topology.describe();
  out["host_ranks"] = topology.hostRanks();
  out["across_ranks"] = topology.peersAcrossHosts();
  out["server_chunks"] = ddlcomm::serverChunks(topology, true, numel, rank, size);
  return out;
}

std::optional<ddlcomm::torch_glue::CollectiveLevel> optionalLevel(const std::optional<Level>& l) {
  if (!l) return std::nullopt;
  return ddlcomm::torch_glue::CollectiveLevel{l->first, l->second};
}

ddlcomm::torch_glue::CollectiveGroup collectiveGroup(const Level& group, const std::optional<Level>& host,
                                                     const std::optional<Level>& across,
                                                     std::vector<std::string> identities, bool staged) {
  return {{group.first, group.second}, optionalLevel(host), optionalLevel(across), std::move(identities), staged};
}

constexpr const char* kOptionsDoc = R"(pg_options of a ddlcomm group (also ddlcomm.Options)::

    dist.new_group(backend="ddlcomm", pg_options=ddlcomm.Options(transport="shm"))

transport: "auto", "tcp", "shm" or "ucx" (ddlcomm.transports() lists this build's), or None
    (the default) for DDLCOMM_TRANSPORT, else auto. It wins over DDLCOMM_TRANSPORT.
spin_us: {transport name: microseconds} a waiting rank polls before it sleeps, over
    DDLCOMM_<NAME>_SPIN_US (assign a whole dict: the attribute returns a copy).
allreduce_algorithm: "auto", "ring", "recursive_doubling", "halving_doubling" or "hierarchical", or None (the
    default) for DDLCOMM_ALLREDUCE_ALGO, else auto. It wins over DDLCOMM_ALLREDUCE_ALGO. Reduce-scatter,
    all-gather and the compressed collectives take two levels over hosts under "hierarchical", and
    under "auto" where the all-reduce would; any other value keeps them flat.

Bad values raise ValueError when set. The group's timeout is init_process_group's or
new_group's timeout=, as for NCCL: _timeout is not read. A group's options property returns a
copy of the options it was created with, with its timeout, group name and ranks.)";

void bindOptions(py::class_<ProcessGroupDdlcomm, c10d::Backend, c10::intrusive_ptr<ProcessGroupDdlcomm>>& pg) {
  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(pg, "Options", kOptionsDoc)
      .def(py::init([](std::optional<std::string> transport, SpinMicros spin, std::optional<std::string> algorithm) {
             auto options = c10::make_intrusive<Options>();
             options->transport = checkedRequest(std::move(transport), std::move(spin));
             options->allreduceAlgorithm = checkedAlgorithm(std::move(algorithm));
             return options;
           }),
           py::arg("transport") = py::none(), py::arg("spin_us") = py::dict(),
           py::arg("allreduce_algorithm") = py::none())
      .def_property(
          "transport", [](const Options& o) { return o.transport.name; },
          [](Options& o, std::optional<std::string> name) {
            o.transport = checkedRequest(std::move(name), o.transport.spinMicros);
          })
      .def_property(
          "spin_us", [](const Options& o) { return o.transport.spinMicros; },
          [](Options& o, SpinMicros spin) { o.transport = checkedRequest(o.transport.name, std::move(spin)); })
      .def_property(
          "allreduce_algorithm", [](const Options& o) { return o.allreduceAlgorithm; },
          [](Options& o, std::optional<std::string> name) { o.allreduceAlgorithm = checkedAlgorithm(std::move(name)); })
      // torch's split_group deep-copies the parent's options; c10d's own Options do not copy.
      .def("__copy__", [](const Options& o) { return c10::make_intrusive<Options>(o); })
      .def("__deepcopy__", [](const Options& o, const py::dict&) { return c10::make_intrusive<Options>(o); },
           py::arg("memo"))
      .def(py::pickle(
          [](const Options& o) {
            return py::make_tuple(o.transport.name, o.transport.spinMicros, o.timeout, o.allreduceAlgorithm);
          },
          [](const py::tuple& state) {
            if (state.size() != 4) throw py::value_error("ddlcomm.Options: not a pickled ddlcomm.Options");
            auto options = c10::make_intrusive<Options>(state[2].cast<std::chrono::milliseconds>());
            options->transport =
                checkedRequest(state[0].cast<std::optional<std::string>>(), state[1].cast<SpinMicros>());
            options->allreduceAlgorithm = checkedAlgorithm(state[3].cast<std::optional<std::string>>());
            return options;
          }))
      .def("__repr__", [](const Options& o) {
        return "ddlcomm.Options(transport=" + std::string(py::repr(py::cast(o.transport.name))) +
               ", spin_us=" + std::string(py::repr(py::cast(o.transport.spinMicros))) +
               ", allreduce_algorithm=" + std::string(py::repr(py::cast(o.allreduceAlgorithm))) + ")";
      });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddlcomm native extension: the torch.distributed backend";
  py::class_<ProcessGroupDdlcomm, c10d::Backend, c10::intrusive_ptr<ProcessGroupDdlcomm>> pg(m, "ProcessGroupDdlcomm");
  bindOptions(pg);  // first: the constructor's signature names the class
  pg.def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks, std::string groupName,
                     std::optional<c10::intrusive_ptr<Options>> options) {
           return c10::make_intrusive<ProcessGroupDdlcomm>(store, rank, size, timeout, std::move(globalRanks),
                                                           std::move(groupName),
                                                           options ? *options : c10::intrusive_ptr<Options>());
         }),
         py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
         py::arg("global_ranks") = std::vector<int64_t>{}, py::arg("group_name") = "",
         py::arg("options") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_static(
          "over",
          [](const c10::intrusive_ptr<c10d::Backend>& carrier, const c10::intrusive_ptr<c10d::Store>& store,
             std::chrono::milliseconds timeout, std::string groupName, std::optional<std::string> algorithm) {
            auto options = c10::make_intrusive<Options>(timeout);
            options->allreduceAlgorithm = std::move(algorithm);
            return c10::make_intrusive<ProcessGroupDdlcomm>(carrier, store, timeout, std::move(groupName), options);
          },
          py::arg("carrier"), py::arg("store"), py::arg("timeout"), py::arg("group_name") = "",
          py::arg("algorithm") = std::nullopt, py::call_guard<py::gil_scoped_release>(),
          "A ddlcomm backend whose messages travel as `carrier`'s send and recv (a gloo group's backend): "
          "the compressed collectives on a group of another backend. store: the group's store, through "
          "which its ranks connect (those of a group on one host by shared memory, unless "
          "DDLCOMM_TRANSPORT=tcp); algorithm: as Options.allreduce_algorithm (unset: DDLCOMM_ALLREDUCE_ALGO).")
      .def("__repr__", &ProcessGroupDdlcomm::describe)
      .def_property_readonly("options", &ProcessGroupDdlcomm::getBackendOptions,
                             "ddlcomm.Options the group was created with (a copy), with the timeout of the next "
                             "operations.")
      .def("all_reduce_", &ProcessGroupDdlcomm::allreduceNow, py::arg("tensor"), py::arg("op"),
           py::call_guard<py::gil_scoped_release>(),
           "dist.all_reduce(tensor, op) without c10d's dispatch: blocking, in place (ddlcomm.all_reduce_).")
      .def(
          "compressed_reduce_scatter",
          [](ProcessGroupDdlcomm& pg, at::Tensor output, at::Tensor input, const ddlcomm::compress::Config& config,
             std::optional<at::Tensor> workerResidual, bool average, uint64_t stream, std::optional<Level> host,
             std::optional<Level> across, std::vector<std::string> identities) {
            return ddlcomm::torch_glue::startCompressedReduceScatter(
                pg, {config, std::move(output), std::move(input), std::move(workerResidual), average, stream},
                optionalLevel(host), optionalLevel(across), std::move(identities));
          },
          py::arg("output"), py::arg("input"), py::arg("config"), py::arg("worker_residual") = py::none(),
          py::arg("average") = true, py::arg("stream") = 0, py::arg("host") = py::none(),
          py::arg("across") = py::none(), py::arg("identities") = std::vector<std::string>{},
          py::call_guard<py::gil_scoped_release>(),
          "Compressed reduce-scatter with error feedback of CPU tensors (ddlcomm.fsdp) over this group's own "
          "collectives, one operation on its executor; returns a Work whose future holds [output]. host and across "
          "(with identities, every rank's host_identity()): the two levels' (backend, backend).")
      .def(
          "stats",
          [](ProcessGroupDdlcomm& pg) {
            ddlcomm::GroupStats s;
            {
              py::gil_scoped_release noGil;
              s = pg.stats();
            }
            py::dict d;
            d["ring_allreduces"] = s.collectives.ringAllreduces;
            d["recursive_doubling_allreduces"] = s.collectives.recursiveDoublingAllreduces;
            d["halving_doubling_allreduces"] = s.collectives.halvingDoublingAllreduces;
            d["shared_memory_allreduces"] = s.collectives.sharedMemoryAllreduces;
            d["shared_memory_reduce_scatters"] = s.collectives.sharedMemoryReduceScatters;
            d["shared_memory_allgathers"] = s.collectives.sharedMemoryAllgathers;
            d["hierarchical_allreduces"] = s.collectives.hierarchicalAllreduces;
            d["hierarchical_reduce_scatters"] = s.collectives.hierarchicalReduceScatters;
            d["hierarchical_allgathers"] = s.collectives.hierarchicalAllgathers;
            d["hierarchical_compressed_allreduces"] = s.collectives.hierarchicalCompressedAllreduces;
            d["topology"] = s.topology;
            d["network"] = s.transport.network;
            d["connections_per_peer"] = s.transport.connectionsPerPeer;
            d["bytes_sent"] = s.transport.bytesSent;
            d["bytes_retransmitted"] = s.transport.bytesRetransmitted;
            d["shared_memory_peers"] = s.transport.sharedMemoryPeers;
            d["shared_memory_bytes_sent"] = s.transport.sharedMemoryBytesSent;
            d["spin_us"] = s.transport.spinMicros;
            d["shared_memory_spin_us"] = s.transport.sharedMemorySpinMicros;
            return d;
          },
          "This group's counters, taken after everything submitted before: all-reduces per algorithm "
          "(ring_allreduces, recursive_doubling_allreduces, halving_doubling_allreduces, shared_memory_allreduces, "
          "hierarchical_allreduces; hierarchical_reduce_scatters and hierarchical_allgathers, likewise in two levels; "
          "hierarchical_compressed_allreduces: exact inside hosts, compressed across), "
          "the hosts its ranks are on (topology: '2 hosts x 2 ranks'), the network transport (network: 'tcp' or "
          "'ucx', the same on every rank) and its connections to each rank (connections_per_peer) and bytes_sent on them (TCP: TCP_INFO "
          "tcpi_bytes_sent, frame headers, the handshake and retransmissions included, of which bytes_retransmitted; "
          "UCX: header and payload bytes of completed sends), the ranks reached through shared "
          "memory (shared_memory_peers) and the message bytes written to their rings (shared_memory_bytes_sent), "
          "and how long a wait polls before it sleeps in the network transport (spin_us) and in shared memory "
          "(shared_memory_spin_us).")
      .def_static("encode_stream", &ddlcomm::encodeStream, py::arg("call_stream"), py::arg("rank"), py::arg("phase"),
                  py::arg("chunk"), py::arg("size"), py::arg("piece") = 0)
      .def_property_readonly_static(
          "piece_elements", [](py::object) { return ddlcomm::kPieceElements; },
          "Elements per piece of a quantized or cast compressed all-reduce (the last one shorter).")
      .def_static("host_identity", &ddlcomm::hostIdentity,
                  "This process's host: DDLCOMM_HOST_ID, else the boot id and network namespace (ranks with "
                  "the same one share a host).")
      .def_static("compressed_allreduce_host_plan", &hostPlan, py::arg("identities"), py::arg("rank"),
                  py::arg("numel"), py::arg("algorithm") = std::nullopt, py::arg("fast_inside") = false,
                  "The two-level plan of a compressed all-reduce over a group of another backend, from every "
                  "rank's host_identity() and `algorithm` (a ddlcomm group's, winning over DDLCOMM_ALLREDUCE_ALGO; auto takes "
                  "two levels only where `fast_inside`: the group's collectives inside a host are fast), or None for the flat plan: a dict of the "
                  "topology's description, host_ranks, across_ranks (the subgroups' ranks) and server_chunks.")
      .def_static("compressed_allreduce_pieces", &pieces, py::arg("numel"), py::arg("size"),
                  "The pieces of a quantized or cast compressed all-reduce: (begin, end, chunk bounds relative "
                  "to begin) each; chunk i of a piece goes to rank i (the benchmarks' payload sizes).")
      .def_static(
          "compressed_allreduce_server_chunks",
          [](size_t numel, int rank, int size) {
            checkRank(rank, size);
            return ddlcomm::flatServerChunks(numel, rank, size);
          },
          py::arg("numel"), py::arg("rank"), py::arg("size"),
          "The [begin, end) ranges `rank` re-encodes in a compressed all-reduce of `numel` elements over "
          "`size` ranks in one level (its chunk of every piece), in its server residual's order.")
      .def_static(
          "server_residual_numel",
          [](size_t numel, int rank, int size) {
            checkRank(rank, size);
            return ddlcomm::serverResidualLength(numel, rank, size);
          },
          py::arg("numel"), py::arg("rank"), py::arg("size"),
          "Elements of the server residual of `rank`: its chunk of every piece.")
      .def_static(
          "compressed_allreduce_wire_bytes",
          [](const ddlcomm::compress::Config& config, size_t numel, int rank, int size) {
            checkRank(rank, size);
            return ddlcomm::compressedAllreduceWireBytes(config, numel, rank, size);
          },
          py::arg("config"), py::arg("numel"), py::arg("rank"), py::arg("size"),
          "Payload bytes `rank` sends in one compressed all-reduce of `numel` elements.")
      .def_static(
          "compressed_reduce_scatter_wire_bytes",
          [](const ddlcomm::compress::Config& config, size_t numel, int size) {
            checkRank(0, size);
            return ddlcomm::compressedReduceScatterWireBytes(config, numel, size);
          },
          py::arg("config"), py::arg("numel"), py::arg("size"),
          "Payload bytes each rank sends in one compressed reduce-scatter of `numel` output elements.");
  py::class_<ddlcomm::torch_glue::CompressedAllreduce, std::shared_ptr<ddlcomm::torch_glue::CompressedAllreduce>>(
      m, "CompressedAllreduce",
      "The compressed all-reduce with error feedback bound to a group and a compressor (made by "
      "ddlcomm.compressed.route_of): group, host and across are (backend of the tensor's device, backend of the "
      "payloads); host and across (with identities, every rank's host_identity()) for two levels over hosts; "
      "staged: the payloads cross to pinned host memory. With an engine (a ProcessGroupDdlcomm), each call is "
      "one operation on its executor over the engine's own collectives (group unused); without, it runs on the "
      "caller's thread, blocking on the host only where a backend is.")
      .def(py::init([](const ddlcomm::compress::Config& config, std::optional<Level> group, std::optional<Level> host,
                       std::optional<Level> across, std::vector<std::string> identities, bool staged,
                       std::optional<c10::intrusive_ptr<ProcessGroupDdlcomm>> engine) {
             TORCH_CHECK_VALUE(group || engine, "ddlcomm: a compressed all-reduce needs a group's backends or an "
                               "engine");
             ddlcomm::torch_glue::CollectiveGroup levels{
                 {}, optionalLevel(host), optionalLevel(across), std::move(identities), staged};
             if (group) levels.group = {group->first, group->second};
             return std::make_shared<ddlcomm::torch_glue::CompressedAllreduce>(
                 config, std::move(levels), engine ? *engine : c10::intrusive_ptr<ProcessGroupDdlcomm>());
           }),
           py::arg("config"), py::arg("group") = py::none(), py::arg("host") = py::none(),
           py::arg("across") = py::none(), py::arg("identities") = std::vector<std::string>{},
           py::arg("staged") = false, py::arg("engine") = py::none())
      .def("start", &ddlcomm::torch_glue::CompressedAllreduce::start, py::arg("tensor"),
           py::arg("worker_residual") = py::none(), py::arg("server_residual") = py::none(),
           py::arg("average") = true, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
           "All-reduces tensor (float32, float16 or bfloat16, CPU or CUDA) in place; returns at once with a Work "
           "whose future holds [tensor] (on the caller's thread, once its work is issued).");
  m.def(
      "compressed_reduce_scatter_over_collectives",
      [](at::Tensor output, at::Tensor input, const ddlcomm::compress::Config& config,
         std::optional<at::Tensor> workerResidual, bool average, uint64_t stream, Level group,
         std::optional<Level> host, std::optional<Level> across, std::vector<std::string> identities, bool staged) {
        ddlcomm::torch_glue::compressedReduceScatterOverCollectives(
            collectiveGroup(group, host, across, std::move(identities), staged), {config, std::move(output), std::move(input), std::move(workerResidual), average, stream});
      },
      py::arg("output"), py::arg("input"), py::arg("config"), py::arg("worker_residual"), py::arg("average"),
      py::arg("stream"), py::arg("group"), py::arg("host"), py::arg("across"), py::arg("identities"),
      py::arg("staged"), py::call_guard<py::gil_scoped_release>(),
      "The compressed reduce-scatter over c10d collectives (ddlcomm.fsdp's, for every group and device); the "
      "groups as compressed_allreduce_over_collectives.");
  ddlcomm::bindings::bindCompression(m);
  ddlcomm::bindings::bindCudaCompression(m);
  ddlcomm::bindings::bindTransport(m);
}
