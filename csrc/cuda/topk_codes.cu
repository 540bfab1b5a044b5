// Top-k's value codes (compress.h's contract, SparseLoCo's quantized values): each kept entry's
// magnitude bin by its rank, each code's mean as the table, the packed codes, and the residual
// of the kept entries. Equal-count bins need ranks, not a sort: bin b starts at rank
// R_b = ceil(b * k / L), and the entry at that rank is found by two radix selects over the k
// kept values (topk_select.cu): its magnitude key T, then among the ties of T its position
// (keyed ~position, so the lower index ranks first). An entry's bin is then the number of bin
// starts it does not precede, which needs no order among the entries: integers throughout, so
// the codes equal the CPU's.
#include "cuda/topk.cuh"

namespace ddlcomm::gpu::detail::topk {
namespace {

constexpr Gate kAlways{0, 0, -1};

// A selection for the rank-th largest key (1 = largest); the histogram is already zero (each
// pick clears the bins it reads, and initSelect zeroed them).
__global__ void startSelectKernel(RadixSelect* sel, uint64_t rank) {
  sel->prefix = 0;
  sel->rank = rank;
  sel->above = 0;
}

// The ties' selection: the tie that `of`'s rank stopped at.
__global__ void startTieSelectKernel(RadixSelect* ties, const RadixSelect* of) {
  ties->prefix = 0;
  ties->rank = of->rank;
  ties->above = 0;
}

__global__ void recordBinStartKernel(const RadixSelect* byKey, const RadixSelect* ties, uint32_t bins,
                                     BinStart* start) {
  *start = BinStart{byKey->prefix, ~ties->prefix, bins};
}

// code = the bins whose start this entry does not precede (ordered by key descending, then
// position ascending), plus L when !(y >= 0).
__global__ __launch_bounds__(kThreads) void codeKernel(const float* __restrict__ val, uint64_t k,
                                                       const BinStart* __restrict__ starts, uint32_t count,
                                                       uint32_t levels, uint8_t* __restrict__ code) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const float v = val[j];
    const uint32_t key = magnitudeKey(v);
    uint32_t bin = 0;
    for (uint32_t s = 0; s < count; ++s) {
      const BinStart b = starts[s];
      if (key > b.key || (key == b.key && j < b.position)) break;  // ranks before this start
      bin += b.bins;
    }
    code[j] = uint8_t(bin + (v >= 0.f ? 0 : levels));
  }
}

// One warp per code: lane j sums in float64, in index order, the entries e = j, j + 32, ...
// that have the code; then the lanes' tree (lane[j] += lane[j + 16], +8, ... +1), as the CPU.
__global__ __launch_bounds__(kThreads) void tableKernel(const float* __restrict__ val,
                                                        const uint8_t* __restrict__ code, uint64_t k,
                                                        uint32_t codes, float* __restrict__ table) {
  const uint32_t c = blockIdx.x * kWarpsPerCta + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (c >= codes) return;  // the whole warp
  double sum = 0.0;
  uint32_t count = 0;
  for (uint64_t e = lane; e < k; e += kWarpSize) {
    if (code[e] == c) {
      sum += double(val[e]);
      ++count;
    }
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) sum += __shfl_down_sync(kFullMask, sum, d);
  const uint64_t total = warpSumU32(count);  // < 2^32: k entries
  if (lane == 0) table[c] = total == 0 ? 0.f : float(sum / double(total));
}

// One thread per payload byte of codes (8 / bits entries each; unused high bits stay 0), and
// the residual of those entries: y - table[code] (0 where that is not finite).
__global__ __launch_bounds__(kThreads) void packKernel(const float* __restrict__ val,
                                                       const uint8_t* __restrict__ code, const uint32_t* outIdx,
                                                       uint64_t k, uint32_t bits, const float* table,
                                                       uint8_t* __restrict__ packed, float* residual) {
  const uint32_t perByte = 8 / bits;
  const uint64_t bytes = (k + perByte - 1) / perByte;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t b = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    uint32_t byte = 0;
    for (uint32_t q = 0; q < perByte; ++q) {
      const uint64_t e = b * perByte + q;
      if (e >= k) break;
      byte |= uint32_t(code[e]) << (q * bits);
      if (residual) residual[outIdx[e]] = residualAfter(val[e], table[code[e]]);
    }
    packed[b] = uint8_t(byte);
  }
}

}  // namespace

void writeValueCodes(const EncodeArgs& a, TopkState* st, const float* val, uint8_t* code, BinStart* bins,
                     cudaStream_t s) {
  const uint64_t k = a.k;
  const unsigned bits = compress::headerValueBits(a.config);
  const uint32_t levels = 1u << (bits - 1);
  const uint64_t grid = gridFor(k, kTile, 1024);
  // R_b grows with b; bins that start at one rank share a selection (k < L: most of them).
  auto startRank = [&](uint32_t b) { return (uint64_t(b) * k + levels - 1) / levels; };  // R_b, 0 = largest
  uint32_t starts = 0;
  for (uint32_t b = 1; b < levels && startRank(b) < k;) {
    const uint64_t rank = startRank(b);
    uint32_t sharing = 0;
    for (; b < levels && startRank(b) == rank; ++b) ++sharing;
    launch(startSelectKernel, 1, 1, s, &st->sample, rank + 1);
    radixSelect(KeptSource{val, k}, st, &st->sample, grid, kAlways, s);
    launch(startTieSelectKernel, 1, 1, s, &st->final, &st->sample);
    radixSelect(TieSource{val, k, &st->sample}, st, &st->final, grid, kAlways, s);
    launch(recordBinStartKernel, 1, 1, s, &st->sample, &st->final, sharing, bins + starts);
    ++starts;
  }
  launch(codeKernel, gridFor(k, kThreads * 4), kThreads, s, val, k, bins, starts, levels, code);
  auto* table = reinterpret_cast<float*>(a.payload + a.layout.second);
  launch(tableKernel, gridFor(2 * levels, kWarpsPerCta), kThreads, s, val, code, k, 2 * levels, table);
  launch(packKernel, gridFor((k * bits + 7) / 8, kThreads * 4), kThreads, s, val, code,
         reinterpret_cast<const uint32_t*>(a.payload + a.layout.first), k, bits, table, a.payload + a.layout.codes,
         a.residual);
}

}  // namespace ddlcomm::gpu::detail::topk
