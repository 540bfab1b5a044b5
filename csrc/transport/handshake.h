// What every network transport's handshake shares (tcp/handshake.h, ucx/ucx_connect.cc): the
// group key and fresh nonces. The key is 32 random bytes that rank 0 publishes in the Store
// (the job's trust root, as for torch itself), optionally bound to DDLCOMM_AUTH_KEY so that
// reading the Store alone is not enough; each transport proves it to its peers its own way.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "transport/store.h"

namespace ddlcomm::transport {

using Nonce = std::array<uint8_t, 32>;

// From getrandom(); throws Error(System) if the kernel has none to give.
Nonce randomNonce();

// The group key: rank 0 makes it, every rank reads it from `store`.
std::string groupKey(KeyValueStore& store, int rank);

// The bytes of a plain struct, for a MAC or the store.
template <typename T>
std::string_view bytesOf(const T& value) {
  return {reinterpret_cast<const char*>(&value), sizeof value};
}

}  // namespace ddlcomm::transport
