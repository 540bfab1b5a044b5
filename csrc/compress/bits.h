// Byte-level access to payload sections: little-endian scalars at any alignment (payloads are
// plain byte buffers), and bit streams for the packed sign bits and 2-bit codes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ddlcomm::compress {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "payloads are little endian; add byte swaps here");

template <class T>
[[gnu::always_inline]] inline T loadLE(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
[[gnu::always_inline]] inline void storeLE(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// Bit j of m moves to bit 2j (2-bit fields from bit masks, for the ternary codes).
inline uint64_t spreadBits(uint32_t m) {
  uint64_t x = m;
  x = (x | x << 16) & 0x0000ffff0000ffffull;
  x = (x | x << 8) & 0x00ff00ff00ff00ffull;
  x = (x | x << 4) & 0x0f0f0f0f0f0f0f0full;
  x = (x | x << 2) & 0x3333333333333333ull;
  return (x | x << 1) & 0x5555555555555555ull;
}

// The inverse: bit 2j of x moves to bit j (odd bits are ignored).
inline uint32_t gatherEvenBits(uint64_t x) {
  x &= 0x5555555555555555ull;
  x = (x | x >> 1) & 0x3333333333333333ull;
  x = (x | x >> 2) & 0x0f0f0f0f0f0f0f0full;
  x = (x | x >> 4) & 0x00ff00ff00ff00ffull;
  x = (x | x >> 8) & 0x0000ffff0000ffffull;
  return uint32_t(x | x >> 16);
}

// Appends groups of up to 32 bits, least significant first. Starts at a byte boundary;
// flush() writes the last partial byte with its unused high bits zero.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}

  // `bits` must be zero above bit n.
  [[gnu::always_inline]] void put(uint32_t bits, size_t n) {
    acc_ |= uint64_t(bits) << fill_;
    fill_ += n;
    if (fill_ >= 32) {
      storeLE(out_, uint32_t(acc_));
      out_ += 4;
      acc_ >>= 32;
      fill_ -= 32;
    }
  }

  // n <= 64 bits, zero above bit n.
  [[gnu::always_inline]] void putWide(uint64_t bits, size_t n) {
    put(uint32_t(bits), n < 32 ? n : 32);
    if (n > 32) put(uint32_t(bits >> 32), n - 32);
  }

  void flush() {
    for (; fill_ > 0; fill_ = fill_ > 8 ? fill_ - 8 : 0) {
      *out_++ = uint8_t(acc_);
      acc_ >>= 8;
    }
  }

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  size_t fill_ = 0;
};

// Reads what BitWriter wrote; never touches a byte beyond the last bit it returns.
class BitReader {
 public:
  explicit BitReader(const uint8_t* in) : in_(in) {}

  [[gnu::always_inline]] uint32_t get(size_t n) {
    if (fill_ == 0 && n == 32) {  // byte-aligned full rows: the common case
      const uint32_t bits = loadLE<uint32_t>(in_);
      in_ += 4;
      return bits;
    }
    while (fill_ < n) {
      acc_ |= uint64_t(*in_++) << fill_;
      fill_ += 8;
    }
    const uint32_t bits = uint32_t(acc_ & ((uint64_t(1) << n) - 1));
    acc_ >>= n;
    fill_ -= n;
    return bits;
  }

  [[gnu::always_inline]] uint64_t getWide(size_t n) {
    const uint64_t low = get(n < 32 ? n : 32);
    return n > 32 ? low | uint64_t(get(n - 32)) << 32 : low;
  }

 private:
  const uint8_t* in_;
  uint64_t acc_ = 0;
  size_t fill_ = 0;
};

}  // namespace ddlcomm::compress
