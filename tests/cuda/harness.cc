#include "harness.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "compress/compress.h"

namespace ddlcomm::cuda_test {

using compress::Format;

int g_passed = 0, g_failed = 0;

void check(bool ok, const std::string& name, const std::string& detail) {
  if (ok) {
    ++g_passed;
    return;
  }
  ++g_failed;
  if (g_failed <= 60) std::printf("FAIL %s%s%s\n", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  if (g_failed == 60) std::printf("(further failures are counted, not printed)\n");
}

namespace {

bool sameF32(uint32_t a, uint32_t b) { return a == b || ((a & 0x7fffffffu) > 0x7f800000u && (b & 0x7fffffffu) > 0x7f800000u); }
bool sameHalf(uint16_t a, uint16_t b, DataType t) {
  const uint16_t inf = t == DataType::Float16 ? 0x7c00 : 0x7f80;
  return a == b || ((a & 0x7fff) > inf && (b & 0x7fff) > inf);
}

std::string describeElement(const void* got, const void* want, long long i, DataType type) {
  const size_t es = elementSize(type);
  uint64_t g = 0, w = 0;
  std::memcpy(&g, static_cast<const uint8_t*>(got) + i * es, es);
  std::memcpy(&w, static_cast<const uint8_t*>(want) + i * es, es);
  std::ostringstream out;
  out << "element " << i << ": got 0x" << std::hex << g << ", want 0x" << w << std::dec;
  if (type == DataType::Float32) {
    float gf, wf;
    std::memcpy(&gf, &g, 4);
    std::memcpy(&wf, &w, 4);
    out << " (" << gf << " vs " << wf << ")";
  }
  return out.str();
}

}  // namespace

long long firstDifference(const void* a, const void* b, size_t n, DataType type) {
  const size_t es = elementSize(type);
  for (size_t i = 0; i < n; ++i) {
    const auto* pa = static_cast<const uint8_t*>(a) + i * es;
    const auto* pb = static_cast<const uint8_t*>(b) + i * es;
    bool same;
    if (type == DataType::Float32) {
      uint32_t x, y;
      std::memcpy(&x, pa, 4);
      std::memcpy(&y, pb, 4);
      same = sameF32(x, y);
    } else if (type == DataType::Float16 || type == DataType::BFloat16) {
      uint16_t x, y;
      std::memcpy(&x, pa, 2);
      std::memcpy(&y, pb, 2);
      same = sameHalf(x, y, type);
    } else if (type == DataType::Float64) {
      double x, y;
      std::memcpy(&x, pa, 8);
      std::memcpy(&y, pb, 8);
      same = std::memcmp(pa, pb, 8) == 0 || (std::isnan(x) && std::isnan(y));
    } else {
      same = std::memcmp(pa, pb, es) == 0;
    }
    if (!same) return (long long)i;
  }
  return -1;
}

void checkArrays(const std::string& name, const void* got, const void* want, size_t n, DataType type) {
  const long long d = firstDifference(got, want, n, type);
  check(d < 0, name, d < 0 ? "" : describeElement(got, want, d, type));
}

std::string comparePayloads(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return str("size ", got.size(), " vs ", want.size());
  if (got.size() < 32) return "short payload";
  if (std::memcmp(got.data(), want.data(), 32) != 0) {
    for (int i = 0; i < 32; ++i)
      if (got[i] != want[i]) return str("header byte ", i, ": ", int(got[i]), " vs ", int(want[i]));
  }
  const auto f = Format(want[5]);
  uint64_t numel, k;
  uint32_t blockSize, valueBits;
  std::memcpy(&blockSize, &want[8], 4);
  std::memcpy(&valueBits, &want[12], 4);
  std::memcpy(&numel, &want[16], 8);
  std::memcpy(&k, &want[24], 8);
  size_t floatsAt = 0, floatsCount = 0, halfsAt = 0, halfsCount = 0;
  DataType halfType = DataType::Float16;
  switch (f) {
    case Format::OneBit:
    case Format::Ternary: {
      const uint64_t nb = blockSize ? (numel + blockSize - 1) / blockSize : 0;
      floatsAt = 32;
      floatsCount = nb * ((f == Format::OneBit && (want[6] & compress::kFlagTwoScales)) ? 2 : 1);
      break;
    }
    case Format::TopK:
    case Format::RandomK:
      floatsAt = 32 + 4 * k;
      floatsCount = valueBits == 0 ? k : size_t(1) << valueBits;  // float32 values, or the value table
      break;
    case Format::Float16:
    case Format::BFloat16:
      halfsAt = 32;
      halfsCount = numel;
      halfType = f == Format::Float16 ? DataType::Float16 : DataType::BFloat16;
      break;
  }
  for (size_t i = 32; i < got.size(); ++i) {
    if (i >= floatsAt && i < floatsAt + 4 * floatsCount) {
      const size_t e = (i - floatsAt) / 4;
      const long long d = firstDifference(&got[floatsAt + 4 * e], &want[floatsAt + 4 * e], 1, DataType::Float32);
      if (d >= 0) return str("float at byte ", floatsAt + 4 * e, ": ", describeElement(&got[floatsAt], &want[floatsAt], e, DataType::Float32));
      i = floatsAt + 4 * e + 3;
    } else if (i >= halfsAt && i < halfsAt + 2 * halfsCount) {
      const size_t e = (i - halfsAt) / 2;
      if (firstDifference(&got[halfsAt + 2 * e], &want[halfsAt + 2 * e], 1, halfType) >= 0)
        return str("16-bit value ", e, ": ", describeElement(&got[halfsAt], &want[halfsAt], e, halfType));
      i = halfsAt + 2 * e + 1;
    } else if (got[i] != want[i]) {
      return str("byte ", i, ": 0x", std::hex, int(got[i]), " vs 0x", int(want[i]));
    }
  }
  return "";
}

}  // namespace ddlcomm::cuda_test
