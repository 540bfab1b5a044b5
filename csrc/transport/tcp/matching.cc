// Message matching: which posted receive an arriving message fills. Collective messages
// match the next posted receive of their connection, and any difference in signature, size
// or stripe means the ranks' calls diverged. Point-to-point messages travel whole on
// connection 0 and match by tag: a receive naming the sender first, then one from any
// rank; a message nobody has asked for yet is buffered as unexpected.
#include <algorithm>
#include <cstring>

#include "transport/tcp/tcp_transport.h"

namespace ddlcomm::tcp {
namespace {

std::string humanBytes(size_t bytes) { return detail::concat(bytes, " bytes"); }

}  // namespace

void TcpTransport::postP2pRecv(Request& r) {
  if (r.peer == kAnySource) {
    anyRecvs_.push_back(stripeOf(r, 0, 1));
    matchAnySource();
    return;
  }
  checkPeer(r.peer, "receive from");
  PeerState& state = peers_[size_t(r.peer)];
  state.p2pRecvs.push_back(stripeOf(r, 0, 1));
  auto it = std::find_if(state.unexpected.begin(), state.unexpected.end(),
                         [&](const Unexpected& u) { return u.signature.tag == r.signature.tag; });
  if (it != state.unexpected.end()) {
    if (it->done == it->data.size()) completeUnexpected(state, it);
    return;
  }
  if (connection(r.peer, 0).closed) connectionFailed(connection(r.peer, 0), "connection closed earlier");
}

bool TcpTransport::wantsHeader(const Connection& c) const {
  return !c.collectiveRecvs.empty() ||
         (c.index == 0 && (!peers_[size_t(c.peer)].p2pRecvs.empty() || !anyRecvs_.empty()));
}

// Pairs the header just read with what this rank posted. A collective message must be the
// one the next posted receive expects: anything else means the ranks' calls diverged.
bool TcpTransport::matchIncoming(Connection& c) {
  const Signature& got = c.signature;
  if (got.op == OpCode::PointToPoint) {
    // Senders put point-to-point messages whole on connection 0. One arriving elsewhere could
    // pair with the receive connection 0 is filling, which the first to finish frees.
    DDLCOMM_CHECK(c.index == 0 && c.header.stripe == 0, ErrorKind::Protocol, "rank ", c.peer,
                  " sent a point-to-point message as stripe ", int(c.header.stripe), " on connection ", c.index,
                  ": they travel whole on connection 0");
    PeerState& state = peers_[size_t(c.peer)];
    bool earlierUnexpected = std::any_of(state.unexpected.begin(), state.unexpected.end(),
                                         [&](const Unexpected& u) { return u.signature.tag == got.tag; });
    if (!earlierUnexpected) {
      for (Stripe& p : state.p2pRecvs) {
        if (p.request->signature.tag != got.tag) continue;
        if (p.request->signature != got || p.bytes != c.header.bytes) {
          fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p.request->signature.describe(), ", ",
               humanBytes(p.bytes), ", but rank ", c.peer, " sent ", got.describe(), ", ",
               humanBytes(c.header.bytes));
        }
        c.target = &p;
        return true;
      }
      // No receive names this rank: the first receive from any rank with this tag takes it.
      for (auto p = anyRecvs_.begin(); p != anyRecvs_.end(); ++p) {
        if (p->request->signature.tag != got.tag) continue;
        checkP2pMatch(*p, c.peer, got, c.header.bytes);
        p->request->peer = c.peer;
        state.p2pRecvs.splice(state.p2pRecvs.end(), anyRecvs_, p);  // the node, and c.target, stay put
        c.target = &state.p2pRecvs.back();
        return true;
      }
    }
    DDLCOMM_CHECK(c.header.bytes <= options_.maxUnexpectedBytes, ErrorKind::Protocol, "rank ", c.peer,
                  " sent an unmatched message of ", c.header.bytes, " bytes, over the limit of ",
                  options_.maxUnexpectedBytes);
    state.unexpected.push_back(Unexpected{got, std::vector<char>(c.header.bytes), 0});
    c.unexpected = &state.unexpected.back();
    return true;
  }
  if (c.collectiveRecvs.empty()) return false;
  Stripe& want = c.collectiveRecvs.front();
  const Signature& expected = want.request->signature;
  if (expected != got || want.bytes != c.header.bytes || want.header.stripe != c.header.stripe) {
    fail(ErrorKind::Mismatch, "collective mismatch between rank ", rank_, " and rank ", c.peer, ": rank ", rank_,
         " is in ", expected.describe(), " expecting ", humanBytes(want.bytes), ", but rank ", c.peer, " sent ",
         got.describe(), " with ", humanBytes(c.header.bytes),
         ". All ranks must call the same collectives in the same order with the same sizes and dtypes");
  }
  c.target = &want;
  return true;
}

void TcpTransport::finishIncoming(Connection& c) {
  PeerState& state = peers_[size_t(c.peer)];
  if (c.target) {
    Request* r = c.target->request;
    if (c.signature.op == OpCode::PointToPoint) {
      state.p2pRecvs.remove_if([&](const Stripe& p) { return &p == c.target; });
    } else {
      c.collectiveRecvs.pop_front();
    }
    completeStripe(r);
  } else {
    for (auto it = state.unexpected.begin(); it != state.unexpected.end(); ++it) {
      if (&*it == c.unexpected) {
        completeUnexpected(state, it);
        break;
      }
    }
  }
  c.target = nullptr;
  c.unexpected = nullptr;
  c.haveHeader = false;
  c.headerGot = 0;
}

// An unexpected message is complete: hand it to the first posted receive with its tag.
void TcpTransport::completeUnexpected(PeerState& state, std::list<Unexpected>::iterator it) {
  for (auto p = state.p2pRecvs.begin(); p != state.p2pRecvs.end(); ++p) {
    if (p->request->signature.tag != it->signature.tag) continue;
    // Only the oldest unexpected message with this tag may match.
    for (auto older = state.unexpected.begin(); older != it; ++older) {
      if (older->signature.tag == it->signature.tag) return;
    }
    if (p->request->signature != it->signature || p->bytes != it->data.size()) {
      fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p->request->signature.describe(), ", ",
           humanBytes(p->bytes), ", but rank ", p->request->peer, " sent ", it->signature.describe(), ", ",
           humanBytes(it->data.size()));
    }
    if (!it->data.empty()) std::memcpy(p->data, it->data.data(), it->data.size());
    Request* r = p->request;
    state.p2pRecvs.erase(p);
    state.unexpected.erase(it);
    completeStripe(r);
    return;
  }
  matchAnySource();
}

void TcpTransport::checkP2pMatch(const Stripe& p, int peer, const Signature& got, size_t bytes) {
  if (p.request->signature != got || p.bytes != bytes) {
    fail(ErrorKind::Mismatch, "rank ", rank_, " posted a receive for ", p.request->signature.describe(), ", ",
         humanBytes(p.bytes), " from any rank, but rank ", peer, " sent ", got.describe(), ", ", humanBytes(bytes));
  }
}

void TcpTransport::matchAnySource() {
  for (auto p = anyRecvs_.begin(); p != anyRecvs_.end();) {
    const uint64_t tag = p->request->signature.tag;
    bool matched = false;
    for (int peer = 0; peer < size_ && !matched; ++peer) {
      PeerState& state = peers_[size_t(peer)];
      // Only this rank's oldest message with the tag, complete, and wanted by no receive naming the rank.
      auto it = std::find_if(state.unexpected.begin(), state.unexpected.end(),
                             [&](const Unexpected& u) { return u.signature.tag == tag; });
      if (it == state.unexpected.end() || it->done != it->data.size()) continue;
      if (std::any_of(state.p2pRecvs.begin(), state.p2pRecvs.end(),
                      [&](const Stripe& q) { return q.request->signature.tag == tag; })) {
        continue;
      }
      checkP2pMatch(*p, peer, it->signature, it->data.size());
      if (!it->data.empty()) std::memcpy(p->data, it->data.data(), it->data.size());
      Request* r = p->request;
      r->peer = peer;
      state.unexpected.erase(it);
      p = anyRecvs_.erase(p);
      completeStripe(r);
      matched = true;
    }
    if (!matched) ++p;
  }
}

}  // namespace ddlcomm::tcp
