#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <stdexcept>

#include "common/half.h"
#include "compress/wire_format.h"

namespace ddlcomm::ref {
namespace {

using compress::Format;

bool finite(float v) { return std::isfinite(v); }

// ---- counter-based randomness, from its definition (not compress/counter_random.h) -----------
// The key (seed, stream, index) folds into one 64-bit word, seed ^ stream * G ^ index * M1, which
// goes through one step of SplitMix64 (Steele, Lea & Flood 2014; Vigna's splitmix64.c): add the
// golden-ratio increment G, then the variant-13 finalizer (shifts 30, 27, 31; multipliers M1, M2).
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;  // 2^64 / phi, odd
constexpr uint64_t kMix1 = 0xbf58476d1ce4e5b9ull;
constexpr uint64_t kMix2 = 0x94d049bb133111ebull;

constexpr uint64_t splitmix64(uint64_t state) {
  uint64_t z = state + kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

constexpr uint64_t randomBits(uint64_t seed, uint64_t stream, uint64_t index) {
  return splitmix64(seed ^ (stream * kGolden) ^ (index * kMix1));
}

// SplitMix64 from state 0 yields 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f
// (the published sequence; the state advances by G per output).
static_assert(randomBits(0, 0, 0) == 0xe220a8397b1dcdafull, "splitmix64 known answer");
static_assert(randomBits(kGolden, 0, 0) == 0x6e789e6aa1b965f4ull, "splitmix64 known answer");
static_assert(randomBits(0, 2, 0) == 0x06c45d188009454full, "splitmix64 known answer");

// Uniform in [0, 1): the top 24 bits over 2^24 (exact in float).
float randomUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return float(uint32_t(randomBits(seed, stream, index) >> 40)) / 16777216.0f;
}

// Uniform integer in [0, bound): floor(bits * bound / 2^64), the high word of the 128-bit product.
uint64_t randomBelow(uint64_t bits, uint64_t bound) { return uint64_t((unsigned __int128)bits * bound >> 64); }

// 32 interleaved lane sums combined as lane[j] += lane[j+16], +8, +4, +2, +1.
struct LaneSum {
  float lane[32] = {};
  void add(uint32_t offsetInBlock, float v) { lane[offsetInBlock % 32] += v; }
  float total() {
    for (int d = 16; d >= 1; d /= 2)
      for (int j = 0; j < d; ++j) lane[j] = lane[j] + lane[j + d];
    return lane[0];
  }
};

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
float fromBits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// |v| bits: orders like the magnitude, NaN above +inf.
uint32_t key(float v) { return bits(v) & 0x7fffffffu; }

// r = y - decoded, or 0 where that is not finite.
float residualAfter(float y, float decoded) {
  const float r = y - decoded;
  return finite(r) ? r : 0.f;
}

template <typename T>
void put(std::vector<uint8_t>& out, size_t offset, T v) {
  std::memcpy(out.data() + offset, &v, sizeof v);
}
template <typename T>
T get(const uint8_t* p, size_t offset) {
  T v;
  std::memcpy(&v, p + offset, sizeof v);
  return v;
}

void header(std::vector<uint8_t>& out, Format f, uint8_t flags, uint32_t blockSize, uint64_t numel, uint64_t k,
            uint32_t valueBits) {
  put<uint32_t>(out, 0, compress::kPayloadMagic);
  out[4] = compress::kPayloadVersion;
  out[5] = uint8_t(f);
  out[6] = flags;
  out[7] = 0;
  put<uint32_t>(out, 8, blockSize);
  put<uint32_t>(out, 12, valueBits);
  put<uint64_t>(out, 16, numel);
  put<uint64_t>(out, 24, k);
}

struct Layout {
  size_t scales = 32, data = 0, values = 0, codes = 0, bytes = 0;  // top-k value codes: values = the table
  uint64_t nblocks = 0;
};

Layout layout(Format f, bool two, uint32_t blockSize, uint64_t numel, uint64_t k, uint32_t valueBits) {
  Layout l;
  switch (f) {
    case Format::OneBit:
      l.nblocks = (numel + blockSize - 1) / blockSize;
      l.data = 32 + 4 * l.nblocks * (two ? 2 : 1);
      l.bytes = l.data + (numel + 7) / 8;
      break;
    case Format::Ternary:
      l.nblocks = (numel + blockSize - 1) / blockSize;
      l.data = 32 + 4 * l.nblocks;
      l.bytes = l.data + (numel + 3) / 4;
      break;
    case Format::TopK:
    case Format::RandomK:
      l.data = 32;
      l.values = 32 + 4 * k;
      l.bytes = 32 + 8 * k;
      if (valueBits != 0) {  // a table of 2^bits float32, then the codes packed from bit 0
        l.codes = l.values + (size_t(4) << valueBits);
        l.bytes = l.codes + (k * valueBits + 7) / 8;
      }
      break;
    case Format::Float16:
    case Format::BFloat16:
      l.data = 32;
      l.bytes = 32 + 2 * numel;
      break;
  }
  return l;
}

// Deterministic ternary: sent iff |y| > mean |y| * kTernaryThreshold, s = mean |y| of the sent.
void thresholdTernaryBlock(const float* y, uint32_t count, float& scale, uint8_t* codes, float* residualOut) {
  LaneSum abs;
  for (uint32_t e = 0; e < count; ++e) abs.add(e, std::fabs(y[e]));
  const float mean = abs.total() / float(count);
  const bool all = !finite(mean);
  const float at = mean * compress::kTernaryThreshold;
  LaneSum kept;
  uint32_t sent = 0;
  for (uint32_t e = 0; e < count; ++e) {
    const bool send = std::fabs(y[e]) > at;
    kept.add(e, send ? std::fabs(y[e]) : 0.f);
    sent += send;
  }
  const float s = all ? mean : sent ? kept.total() / float(sent) : 0.f;
  scale = s;
  for (uint32_t e = 0; e < count; ++e) {
    const bool send = all || std::fabs(y[e]) > at;
    const uint8_t code = send ? (y[e] >= 0.f ? 1 : 2) : 0;
    codes[e] = code;
    const float d = code == 1 ? s : (code == 2 ? -s : 0.f);
    if (residualOut) residualOut[e] = residualAfter(y[e], d);
  }
}

void ternaryBlock(const float* y, uint32_t count, float clip, uint64_t seed, uint64_t stream, uint64_t first,
                  float& scale, uint8_t* codes /* one per element */, float* residualOut) {
  uint32_t m = 0;
  for (uint32_t e = 0; e < count; ++e) m = std::max(m, key(y[e]));
  float s = fromBits(m);
  if (clip > 0.f) {
    LaneSum s1, s2;
    for (uint32_t e = 0; e < count; ++e) {
      s1.add(e, y[e]);
      s2.add(e, y[e] * y[e]);
    }
    const float mean = s1.total() / float(count);
    const float var = s2.total() / float(count) - mean * mean;
    const float bound = clip * std::sqrt(var < 0.f ? 0.f : var);
    if (bound < s) s = bound;
  }
  scale = s;
  for (uint32_t e = 0; e < count; ++e) {
    const bool send = !finite(s) || randomUniform(seed, stream, first + e) * s < std::fabs(y[e]);
    const uint8_t code = send ? (y[e] >= 0.f ? 1 : 2) : 0;
    codes[e] = code;
    const float d = code == 1 ? s : (code == 2 ? -s : 0.f);
    if (residualOut) residualOut[e] = residualAfter(y[e], d);
  }
}

}  // namespace

float loadAsFloat(DataType type, const void* data, size_t i) {
  switch (type) {
    case DataType::Float16: return fp16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DataType::BFloat16: return bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

void storeFromFloat(DataType type, void* data, size_t i, float v) {
  switch (type) {
    case DataType::Float16: static_cast<uint16_t*>(data)[i] = floatToFp16(v); break;
    case DataType::BFloat16: static_cast<uint16_t*>(data)[i] = floatToBf16(v); break;
    default: static_cast<float*>(data)[i] = v; break;
  }
}

uint64_t keptEntries(const compress::Config& config, size_t numel) {
  if (numel == 0 || (config.format != Format::TopK && config.format != Format::RandomK)) return 0;
  if (config.k > 0) return std::min<uint64_t>(config.k, numel);
  const double k = std::round(config.ratio * double(numel));
  return k < 1.0 ? 1 : std::min<uint64_t>(uint64_t(k), numel);
}

void onebitBlock(const float* y, uint32_t count, bool two, float* scales, std::vector<uint8_t>& signBits,
                 float* residualOut) {
  LaneSum pos, neg;
  uint32_t npos = 0;
  for (uint32_t e = 0; e < count; ++e) {
    if (!two) {
      pos.add(e, std::fabs(y[e]));
    } else if (y[e] >= 0.f) {
      pos.add(e, y[e]);
      ++npos;
    } else {
      neg.add(e, std::fabs(y[e]));
    }
  }
  float sp, sn;
  if (!two) {
    sp = sn = pos.total() / float(count);
    scales[0] = sp;
  } else {
    const uint32_t nneg = count - npos;
    sp = npos ? pos.total() / float(npos) : 0.f;
    sn = nneg ? neg.total() / float(nneg) : 0.f;
    scales[0] = sp;
    scales[1] = sn;
  }
  signBits.assign(count, 0);
  for (uint32_t e = 0; e < count; ++e) {
    const bool bit = y[e] >= 0.f;
    signBits[e] = bit;
    if (residualOut) residualOut[e] = residualAfter(y[e], bit ? sp : -sn);
  }
}

namespace {

// Top-k's value codes, from the contract's text: the kept entries (index order) fall into
// L = 2^(bits-1) magnitude bins of equal count by rank, bin = rank * L / k; code = bin, plus
// L when !(y >= 0). table[c] = float(sum / count) of its entries (0 for none), the sum in
// float64, lane j summing entries e with e % 32 == j in order, then the lanes' tree.
void valueCodes(const std::vector<float>& y, const std::vector<uint64_t>& chosen, const std::vector<uint64_t>& rankOf,
                uint32_t valueBits, std::vector<uint8_t>& out, const Layout& l, float* residual) {
  const uint64_t k = chosen.size(), levels = uint64_t(1) << (valueBits - 1);
  std::vector<uint32_t> code(k);
  std::vector<double> lanes(2 * levels * 32, 0.0);
  std::vector<uint64_t> count(2 * levels, 0);
  for (uint64_t e = 0; e < k; ++e) {
    const float v = y[chosen[e]];
    code[e] = uint32_t(rankOf[chosen[e]] * levels / k + (v >= 0.f ? 0 : levels));
    lanes[code[e] * 32 + e % 32] += double(v);
    ++count[code[e]];
  }
  std::vector<float> table(2 * levels);
  for (uint64_t cd = 0; cd < 2 * levels; ++cd) {
    double* lane = &lanes[cd * 32];
    for (int d = 16; d >= 1; d /= 2)
      for (int j = 0; j < d; ++j) lane[j] = lane[j] + lane[j + d];
    table[cd] = count[cd] == 0 ? 0.f : float(lane[0] / double(count[cd]));
    put<float>(out, l.values + 4 * cd, table[cd]);
  }
  std::vector<float> sent(y.size(), 0.f);
  for (uint64_t e = 0; e < k; ++e) {
    put<uint32_t>(out, l.data + 4 * e, uint32_t(chosen[e]));
    const uint64_t bit = e * valueBits;
    out[l.codes + bit / 8] |= uint8_t(code[e] << (bit % 8));
    sent[chosen[e]] = table[code[e]];
  }
  if (residual)
    for (size_t i = 0; i < y.size(); ++i) residual[i] = residualAfter(y[i], sent[i]);
}

}  // namespace

std::vector<uint8_t> encode(const compress::Config& c, DataType xType, const void* x, float* residual, size_t n,
                            uint64_t stream, bool scaled) {
  std::vector<float> y(n);
  for (size_t i = 0; i < n; ++i) {
    const float xv = loadAsFloat(xType, x, i);
    y[i] = residual ? xv + residual[i] : xv;
  }
  const bool sparse = c.format == Format::TopK || c.format == Format::RandomK;
  const uint64_t k = sparse ? ref::keptEntries(c, n) : 0;
  const bool two = c.format == Format::OneBit && c.twoScales;
  const bool blocked = c.format == Format::OneBit || c.format == Format::Ternary;
  const uint32_t valueBits = c.format == Format::TopK && c.valueBits != 32 ? c.valueBits : 0;
  const Layout l = layout(c.format, two, c.blockSize, n, k, valueBits);
  std::vector<uint8_t> out(l.bytes, 0);
  const uint8_t flags = two                                                 ? compress::kFlagTwoScales
                        : c.format == Format::Ternary && c.stochastic ? compress::kFlagStochastic
                                                                      : 0;
  header(out, c.format, flags, blocked ? c.blockSize : 0, n, k, valueBits);

  switch (c.format) {
    case Format::OneBit: {
      std::vector<uint8_t> signBits;
      for (uint64_t b = 0; b < l.nblocks; ++b) {
        const uint64_t base = b * c.blockSize;
        const uint32_t count = uint32_t(std::min<uint64_t>(c.blockSize, n - base));
        float scales[2];
        onebitBlock(&y[base], count, two, scales, signBits, residual ? residual + base : nullptr);
        put<float>(out, l.scales + 4 * (two ? 2 * b : b), scales[0]);
        if (two) put<float>(out, l.scales + 4 * (2 * b + 1), scales[1]);
        for (uint32_t e = 0; e < count; ++e) {
          const uint64_t i = base + e;
          if (signBits[e]) out[l.data + i / 8] |= uint8_t(1u << (i % 8));
        }
      }
      break;
    }
    case Format::Ternary: {
      std::vector<uint8_t> codes(c.blockSize);
      for (uint64_t b = 0; b < l.nblocks; ++b) {
        const uint64_t base = b * c.blockSize;
        const uint32_t count = uint32_t(std::min<uint64_t>(c.blockSize, n - base));
        float s;
        if (c.stochastic) {
          ternaryBlock(&y[base], count, c.clip, c.seed, stream, base, s, codes.data(),
                       residual ? residual + base : nullptr);
        } else {
          thresholdTernaryBlock(&y[base], count, s, codes.data(), residual ? residual + base : nullptr);
        }
        put<float>(out, l.scales + 4 * b, s);
        for (uint32_t e = 0; e < count; ++e) {
          const uint64_t i = base + e;
          out[l.data + i / 4] |= uint8_t(codes[e] << (2 * (i % 4)));
        }
      }
      break;
    }
    case Format::TopK:
    case Format::RandomK: {
      std::vector<uint64_t> chosen;
      std::vector<uint64_t> rankOf(n);  // top-k: rank by magnitude, 0 = largest, ties to the lower index
      if (c.format == Format::TopK) {
        std::vector<uint64_t> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return key(y[a]) > key(y[b]); });
        chosen.assign(order.begin(), order.begin() + k);
        for (uint64_t r = 0; r < n; ++r) rankOf[order[r]] = r;
      } else {  // Floyd's algorithm, step by step
        std::set<uint64_t> taken;
        for (uint64_t j = n - k; j < n; ++j) {
          uint64_t t = randomBelow(randomBits(c.seed, stream, j), j + 1);
          if (taken.count(t)) t = j;
          taken.insert(t);
        }
        chosen.assign(taken.begin(), taken.end());
      }
      std::sort(chosen.begin(), chosen.end());
      if (valueBits != 0) {
        valueCodes(y, chosen, rankOf, valueBits, out, l, residual);
        break;
      }
      const float scale = scaled && k > 0 ? float(double(n) / double(k)) : 1.f;
      std::vector<float> sent(n, 0.f);
      for (uint64_t j = 0; j < k; ++j) {
        const float v = y[chosen[j]] * scale;
        put<uint32_t>(out, l.data + 4 * j, uint32_t(chosen[j]));
        put<float>(out, l.values + 4 * j, v);
        sent[chosen[j]] = v;
      }
      if (residual)
        for (size_t i = 0; i < n; ++i) residual[i] = residualAfter(y[i], sent[i]);
      break;
    }
    case Format::Float16:
    case Format::BFloat16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = c.format == Format::Float16 ? floatToFp16(y[i]) : floatToBf16(y[i]);
        put<uint16_t>(out, l.data + 2 * i, h);
        const float d = c.format == Format::Float16 ? fp16ToFloat(h) : bf16ToFloat(h);
        if (residual) residual[i] = residualAfter(y[i], d);
      }
      break;
  }
  return out;
}

namespace {

// Decoded value of element i (sparse formats: 0 where nothing is carried).
std::vector<float> decodeAll(const uint8_t* p, size_t bytes, size_t n) {
  if (bytes < 32) throw std::runtime_error("reference decode: short payload");
  const auto f = Format(p[5]);
  const bool two = f == Format::OneBit && (p[6] & compress::kFlagTwoScales);
  const uint32_t blockSize = get<uint32_t>(p, 8);
  const uint32_t valueBits = get<uint32_t>(p, 12);
  const uint64_t k = get<uint64_t>(p, 24);
  const Layout l = layout(f, two, blockSize, n, k, valueBits);
  if (l.bytes != bytes) throw std::runtime_error("reference decode: size mismatch");
  std::vector<float> out(n, 0.f);
  for (size_t i = 0; i < n; ++i) {
    switch (f) {
      case Format::OneBit: {
        const uint64_t b = i / blockSize;
        const bool bit = (p[l.data + i / 8] >> (i % 8)) & 1;
        const float sp = get<float>(p, l.scales + 4 * (two ? 2 * b : b));
        const float sn = two ? get<float>(p, l.scales + 4 * (2 * b + 1)) : sp;
        out[i] = bit ? sp : -sn;
        break;
      }
      case Format::Ternary: {
        const float s = get<float>(p, l.scales + 4 * (i / blockSize));
        const int code = (p[l.data + i / 4] >> (2 * (i % 4))) & 3;
        out[i] = code == 1 ? s : (code == 2 ? -s : 0.f);
        break;
      }
      case Format::Float16: out[i] = fp16ToFloat(get<uint16_t>(p, l.data + 2 * i)); break;
      case Format::BFloat16: out[i] = bf16ToFloat(get<uint16_t>(p, l.data + 2 * i)); break;
      default: break;
    }
  }
  if (f == Format::TopK || f == Format::RandomK)
    for (uint64_t j = 0; j < k; ++j) {
      const uint64_t bit = j * valueBits;
      const size_t at = valueBits == 0 ? j : (p[l.codes + bit / 8] >> (bit % 8)) & ((1u << valueBits) - 1);
      out[get<uint32_t>(p, l.data + 4 * j)] = get<float>(p, l.values + 4 * at);
    }
  return out;
}

}  // namespace

void decode(const uint8_t* payload, size_t bytes, DataType outType, void* out, size_t n) {
  const std::vector<float> d = decodeAll(payload, bytes, n);
  for (size_t i = 0; i < n; ++i) storeFromFloat(outType, out, i, d[i]);
}

void decodeAccumulate(const uint8_t* payload, size_t bytes, float* out, size_t n) {
  const auto f = Format(payload[5]);
  const std::vector<float> d = decodeAll(payload, bytes, n);
  if (f == Format::TopK || f == Format::RandomK) {  // only the carried entries are touched
    const uint64_t k = get<uint64_t>(payload, 24);
    for (uint64_t j = 0; j < k; ++j) {
      const uint32_t i = get<uint32_t>(payload, 32 + 4 * j);
      out[i] = out[i] + d[i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = out[i] + d[i];
}

}  // namespace ddlcomm::ref
