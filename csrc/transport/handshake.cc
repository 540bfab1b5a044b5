#include "transport/handshake.h"

#include <sys/random.h>

#include <cerrno>

#include "common/env.h"
#include "common/error.h"
#include "common/sha256.h"

namespace ddlcomm::transport {

Nonce randomNonce() {
  Nonce n;
  size_t got = 0;
  while (got < n.size()) {
    ssize_t r = getrandom(n.data() + got, n.size() - got, 0);
    if (r < 0 && errno == EINTR) continue;
    DDLCOMM_CHECK(r > 0, ErrorKind::System, systemErrorText("getrandom", errno));
    got += size_t(r);
  }
  return n;
}

std::string groupKey(KeyValueStore& store, int rank) {
  const std::string name = "ddlcomm/auth_secret";
  if (rank == 0) {
    Nonce secret = randomNonce();
    store.set(name, std::string(bytesOf(secret)));
  }
  std::string secret = store.get(name);
  const char* extra = envString("DDLCOMM_AUTH_KEY");
  if (!extra) return secret;
  Digest bound = hmacSha256(extra, {"ddlcomm group key", secret});
  return std::string(bytesOf(bound));
}

}  // namespace ddlcomm::transport
