#include "transport/tcp/handshake.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string_view>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/sha256.h"

namespace ddlcomm::tcp {
using transport::bytesOf;
using transport::randomNonce;

namespace {

constexpr uint32_t kHelloMagic = 0x4f4c4548;      // "HELO"
constexpr uint32_t kChallengeMagic = 0x4c414843;  // "CHAL"
constexpr uint32_t kRejectMagic = 0x434a4552;     // "REJC"
constexpr uint32_t kHandshakeVersion = 2;
constexpr size_t kMaxPending = 128;  // half-open connections held at once; a flood evicts the oldest
constexpr size_t kAcceptBatch = 32;  // accepted per wake-up, so pending proofs are read in between
constexpr size_t kLoggedDrops = 4;  // drops logged one by one per reason; the rest only counted
constexpr std::string_view kConnectorLabel = "ddlcomm connector";
constexpr std::string_view kAcceptorLabel = "ddlcomm acceptor";

#pragma pack(push, 1)
struct Challenge {
  uint32_t magic;
  uint32_t version;
  Nonce nonce;
};
struct ConnectorProof {
  Hello hello;
  Nonce nonce;
  Digest mac;
};
struct AcceptorProof {
  Hello hello;
  Digest mac;
};
#pragma pack(pop)

Digest connectorMac(const std::string& key, const Nonce& challenge, const Nonce& nonce, const Hello& hello) {
  return hmacSha256(key, {kConnectorLabel, bytesOf(challenge), bytesOf(nonce), bytesOf(hello)});
}

Digest acceptorMac(const std::string& key, const Nonce& challenge, const Nonce& nonce, const Hello& hello) {
  return hmacSha256(key, {kAcceptorLabel, bytesOf(nonce), bytesOf(challenge), bytesOf(hello)});
}

void logWarning(const Hello& mine, const std::string& text) {
  std::fprintf(stderr, "[ddlcomm rank %d] %s\n", mine.rank, text.c_str());
}

// One handshake attempt on a connected socket.
Hello authenticate(int fd, const std::string& peerName, const std::string& key, const Hello& mine, Deadline deadline) {
  Challenge challenge{};
  readAll(fd, &challenge, sizeof challenge, deadline);
  DDLCOMM_CHECK(challenge.magic == kChallengeMagic && challenge.version == kHandshakeVersion, ErrorKind::Protocol,
                peerName, " is not a ddlcomm rank speaking handshake version ", kHandshakeVersion);
  ConnectorProof proof{mine, randomNonce(), {}};
  proof.mac = connectorMac(key, challenge.nonce, proof.nonce, mine);
  writeAll(fd, &proof, sizeof proof, deadline);

  AcceptorProof reply{};
  readAll(fd, &reply.hello.magic, sizeof reply.hello.magic, deadline);
  DDLCOMM_CHECK(reply.hello.magic != kRejectMagic, ErrorKind::Mismatch, peerName,
                " rejected this rank's proof of the group key: the ranks disagree on DDLCOMM_AUTH_KEY, or read "
                "different stores");
  readAll(fd, reinterpret_cast<char*>(&reply) + sizeof reply.hello.magic, sizeof reply - sizeof reply.hello.magic,
          deadline);
  DDLCOMM_CHECK(reply.hello.magic == kHelloMagic &&
                    digestEqual(reply.mac, acceptorMac(key, challenge.nonce, proof.nonce, reply.hello)),
                ErrorKind::Protocol, peerName, " failed to prove the group key: it is not a rank of this group");
  return reply.hello;
}

}  // namespace

Hello makeHello(int rank, int size, int connectionsPerPeer) {
  return Hello{kHelloMagic, kHandshakeVersion, rank, size, 0, connectionsPerPeer};
}

Fd connectAuthenticated(const Address& address, const std::string& peerName, const std::string& key,
                        const Hello& mine, Deadline deadline, Hello* theirs) {
  std::string lastError = "no answer";
  auto backoff = std::chrono::milliseconds(10);
  while (Clock::now() < deadline) {
    Fd fd = connectTo(address, deadline);
    try {
      *theirs = authenticate(fd.get(), peerName, key, mine, deadline);
      return fd;
    } catch (const Error& e) {
      // A closed or reset connection may be the acceptor shedding a flood: try again.
      if (e.kind() != ErrorKind::PeerFailure) {
        if (e.kind() == ErrorKind::Timeout) break;
        throw;
      }
      lastError = e.what();
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  fail(ErrorKind::Timeout, "Timed out authenticating with ", peerName, " (last attempt: ", lastError, ")");
}

Acceptor::Acceptor(Fd listener, std::string key, const Hello& mine, std::chrono::milliseconds handshakeTimeout)
    : listener_(std::move(listener)), key_(std::move(key)), mine_(mine), handshakeTimeout_(handshakeTimeout) {
  setNonBlocking(listener_.get(), true);
}

Acceptor::~Acceptor() {
  const size_t total = std::accumulate(dropped_.begin(), dropped_.end(), size_t(0));
  if (total == 0) return;
  logWarning(mine_, detail::concat("dropped ", total, " unauthenticated connections while connecting the group: ",
                                   dropped_[kBadProof], " failed the key proof, ", dropped_[kTooSlow], " too slow, ",
                                   dropped_[kClosed], " closed early, ", dropped_[kEvicted], " evicted by a flood, ",
                                   dropped_[kSocketError], " socket errors"));
}

Fd Acceptor::next(Deadline deadline, Hello* hello) {
  std::vector<pollfd> fds;
  while (true) {
    const auto now = Clock::now();
    while (!pending_.empty() && pending_.front().deadline <= now) {
      Pending& p = pending_.front();
      drop(p, kTooSlow,
           detail::concat("sent ", p.got, " of ", kProofBytes, " handshake bytes within ", handshakeTimeout_.count(),
                          " ms (DDLCOMM_HANDSHAKE_TIMEOUT_MS)"));
      pending_.pop_front();
    }
    DDLCOMM_CHECK(now < deadline, ErrorKind::Timeout, "Timed out waiting for peers to connect");
    Deadline wake = pending_.empty() ? deadline : std::min(deadline, pending_.front().deadline);
    auto waitMs = std::chrono::ceil<std::chrono::milliseconds>(wake - now).count();

    fds.assign(1, pollfd{listener_.get(), POLLIN, 0});
    for (const Pending& p : pending_) fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
    int ready = ::poll(fds.data(), fds.size(), int(std::min<long long>(waitMs, 1000)));
    if (ready < 0 && errno != EINTR) fail(ErrorKind::System, systemErrorText("poll", errno));
    if (ready <= 0) continue;

    // Pending connections first, so a flood on the listener cannot starve a real peer.
    for (size_t i = 1, slot = 0; i < fds.size(); ++i) {
      auto it = pending_.begin() + std::ptrdiff_t(slot);
      if (fds[i].revents == 0) {
        ++slot;
        continue;
      }
      Fd accepted;
      if (advance(*it, hello)) accepted = std::move(it->fd);
      if (!it->fd.valid()) {
        pending_.erase(it);  // finished or dropped
      } else {
        ++slot;
      }
      if (accepted.valid()) {
        setNonBlocking(accepted.get(), false);
        return accepted;
      }
    }
    if (fds[0].revents != 0) acceptSome();
  }
}

void Acceptor::acceptSome() {
  for (size_t i = 0; i < kAcceptBatch; ++i) {
    Address from;
    from.length = sizeof from.storage;
    int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&from.storage), &from.length,
                       SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return;
      // Out of descriptors (a flood), or similar: shed the oldest half-open connection.
      if (!pending_.empty()) {
        drop(pending_.front(), kEvicted, systemErrorText("accept", errno) + "; dropping the oldest one waiting");
        pending_.pop_front();
      }
      return;
    }
    if (pending_.size() >= kMaxPending) {
      drop(pending_.front(), kEvicted, detail::concat("more than ", kMaxPending, " connections waiting to authenticate"));
      pending_.pop_front();
    }
    Pending p;
    p.fd = Fd(fd);
    p.from = from.toString();
    p.deadline = Clock::now() + handshakeTimeout_;
    p.nonce = randomNonce();
    const Challenge challenge{kChallengeMagic, kHandshakeVersion, p.nonce};
    // A fresh socket's send buffer always has room for 40 bytes.
    if (::send(fd, &challenge, sizeof challenge, MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(sizeof challenge)) {
      drop(p, kSocketError, systemErrorText("send", errno));
      continue;
    }
    pending_.push_back(std::move(p));
  }
}

bool Acceptor::advance(Pending& p, Hello* hello) {
  ssize_t n = ::recv(p.fd.get(), p.proof.data() + p.got, p.proof.size() - p.got, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
  if (n <= 0) {
    if (n == 0) {
      drop(p, kClosed, detail::concat("closed the connection after ", p.got, " handshake bytes"));
    } else {
      drop(p, kSocketError, systemErrorText("recv", errno));
    }
    return false;
  }
  p.got += size_t(n);
  if (p.got < p.proof.size()) return false;

  static_assert(sizeof(ConnectorProof) == kProofBytes, "the acceptor reads exactly one proof");
  ConnectorProof proof;
  std::memcpy(&proof, p.proof.data(), sizeof proof);
  if (!digestEqual(proof.mac, connectorMac(key_, p.nonce, proof.nonce, proof.hello))) {
    // Telling the client leaks nothing it could not infer, and lets a misconfigured rank
    // fail at once instead of retrying until the timeout.
    ::send(p.fd.get(), &kRejectMagic, sizeof kRejectMagic, MSG_NOSIGNAL | MSG_DONTWAIT);
    drop(p, kBadProof, "failed to prove the group key (wrong secret, or not a ddlcomm rank)");
    return false;
  }
  Hello reply = mine_;
  reply.index = proof.hello.index;
  const AcceptorProof answer{reply, acceptorMac(key_, p.nonce, proof.nonce, reply)};
  if (::send(p.fd.get(), &answer, sizeof answer, MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(sizeof answer)) {
    drop(p, kSocketError, systemErrorText("send", errno));
    return false;
  }
  *hello = proof.hello;
  return true;
}

void Acceptor::drop(Pending& p, Reason reason, const std::string& why) {
  if (++dropped_[reason] <= kLoggedDrops) {
    logWarning(mine_, "dropped a connection from " + p.from + ": " + why);
  }
  p.fd.reset();
}

}  // namespace ddlcomm::tcp
