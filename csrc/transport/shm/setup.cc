// Set-up: the ranks that can share memory with this one (same host facts), each rank's region
// created and its file descriptor offered through the store, the peers' regions mapped, and
// the rings between every pair of local ranks located in them.
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "transport/shm/shm_transport.h"

namespace ddlcomm::shm {
namespace {

void note(int rank, const std::string& text) { std::fprintf(stderr, "[ddlcomm rank %d] %s\n", rank, text.c_str()); }

}  // namespace

std::unique_ptr<Transport> ShmTransport::layer(std::unique_ptr<Transport> network, KeyValueStore& store,
                                               const ShmOptions& options, SpinPolicy spin) {
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
                "transport shm (DDLCOMM_TRANSPORT or ddlcomm.Options) needs every rank on this host, but ", elsewhere,
                " (use transport auto to mix shared memory and the network)");
  if (local.size() == 1 || (options.wholeGroupOnly && !elsewhere.empty())) return network;

  std::unique_ptr<ShmTransport> t(new ShmTransport(std::move(network), options));
  t->setSpin(spin);
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
    DDLCOMM_CHECK(!options.required, ErrorKind::System, "transport shm: ",
                  problem.empty() ? "a peer could not map this rank's shared memory" : problem);
    note(rank, problem.empty() ? "a local peer could not map this rank's shared memory; using the network with it"
                               : problem + "; using the network with it");
  }
  if (t->peers_.empty()) return std::move(t->network_);
  t->windowed_ = everyPair && t->layout_.windowBytes > 0 && int(t->peers_.size()) + 1 == size;
  t->mixed_ = int(t->peers_.size()) + 1 < size;
  return t;
}

}  // namespace ddlcomm::shm
