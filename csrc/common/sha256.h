// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for authenticating connections between
// ranks without linking a crypto library. Not constant-time beyond what HMAC needs: the
// only secret is the key, and MACs are compared with digestEqual.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace ddlcomm {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  Digest finish();

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t totalBytes_ = 0;
};

// HMAC-SHA256 of the concatenation of `parts` under `key`.
Digest hmacSha256(std::string_view key, std::initializer_list<std::string_view> parts);

// Compares two digests in time independent of where they differ.
bool digestEqual(const Digest& a, const Digest& b);

}  // namespace ddlcomm
