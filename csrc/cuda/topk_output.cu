// Ordered output of a top-k selection: per tile, the count of keys above the threshold T and
// equal to it; one scan into output offsets and ties before each tile; then per tile the kept
// entries, written in index order (deterministic, and equal to the CPU's).
#include "cuda/topk.cuh"

namespace ddlcomm::gpu::detail::topk {
namespace {

// Calls fn(tile, start, count, lane) for each tile this warp owns: one warp per tile, the
// grid striding over them, as both per-tile passes below need the same tiles.
template <typename Src, typename Fn>
__device__ __forceinline__ void forEachWarpTile(const Src& src, uint64_t numTiles, Fn&& fn) {
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < numTiles; b += warpStride) {
    uint64_t start;
    uint32_t count;
    src.tile(b, start, count);
    fn(b, start, count, lane);
  }
}

// Per tile (one warp each): keys > T and keys == T.
template <typename Src>
__global__ __launch_bounds__(kThreads) void tileCountKernel(Src src, const TopkState* st, Gate gate,
                                                            uint64_t numTiles, uint32_t* greater, uint32_t* equal) {
  if (!gate.pass(st)) return;
  const uint32_t T = st->final.prefix;
  forEachWarpTile(src, numTiles, [&](uint64_t b, uint64_t start, uint32_t count, int lane) {
    uint32_t gt = 0, eq = 0;
    for (uint32_t off = lane; off < count; off += kWarpSize) {
      const uint32_t key = src.key(start + off);
      gt += key > T;
      eq += key == T;
    }
    gt = warpSumU32(gt);
    eq = warpSumU32(eq);
    if (lane == 0) {
      greater[b] = gt;
      equal[b] = eq;
    }
  });
}

// One CTA: turns per-tile (greater, equal) into (output offset, ties before the tile); the
// first `ties` keys equal to T in index order are kept. Each thread owns 8 consecutive tiles.
__global__ __launch_bounds__(kPickThreads) void scanTilesKernel(const TopkState* st, uint64_t numTiles,
                                                                uint32_t* greaterToOffset, uint32_t* equalToBefore) {
  constexpr int kPer = 8;
  const uint64_t ties = st->final.rank;
  uint64_t carryEq = 0, carrySel = 0;
  for (uint64_t chunk = 0; chunk < numTiles; chunk += uint64_t(kPickThreads) * kPer) {
    const uint64_t first = chunk + uint64_t(threadIdx.x) * kPer;
    uint32_t g[kPer], e[kPer];
    uint64_t eqSum = 0;
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const bool in = first + q < numTiles;
      g[q] = in ? greaterToOffset[first + q] : 0;
      e[q] = in ? equalToBefore[first + q] : 0;
      eqSum += e[q];
    }
    uint64_t eqTotal, selTotal;
    uint64_t eqBefore = carryEq + blockExclusiveScan<kPickThreads>(eqSum, eqTotal);
    uint64_t sel[kPer], selSum = 0;
    uint64_t eb[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      eb[q] = eqBefore;
      const uint64_t taken = ties > eqBefore ? minOf<uint64_t>(ties - eqBefore, e[q]) : 0;
      sel[q] = g[q] + taken;
      selSum += sel[q];
      eqBefore += e[q];
    }
    uint64_t out = carrySel + blockExclusiveScan<kPickThreads>(selSum, selTotal);
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      if (first + q < numTiles) {
        greaterToOffset[first + q] = uint32_t(out);
        equalToBefore[first + q] = uint32_t(eb[q]);
      }
      out += sel[q];
    }
    carryEq += eqTotal;
    carrySel += selTotal;
  }
}

// Per tile (one warp each): writes the kept entries in index order at the tile's offset and
// sets their residual to y - y = 0 (0 for a non-finite y as well); the residual of an
// unsent non-finite y is reset to 0 too.
template <typename Src>
__global__ __launch_bounds__(kThreads) void tileWriteKernel(Src src, const TopkState* st, Gate gate, uint64_t numTiles,
                                                            const uint32_t* offsets, const uint32_t* tiesBefore,
                                                            uint32_t* outIdx, float* outVal, float* residual) {
  if (!gate.pass(st)) return;
  const uint32_t T = st->final.prefix;
  const uint64_t ties = st->final.rank;
  forEachWarpTile(src, numTiles, [&](uint64_t b, uint64_t start, uint32_t count, int lane) {
    uint64_t eqSeen = tiesBefore[b], pos = offsets[b];
    for (uint32_t off0 = 0; off0 < count; off0 += kWarpSize) {
      const uint32_t off = off0 + lane;
      const bool in = off < count;
      const float v = in ? src.value(start + off) : 0.f;
      const uint32_t key = magnitudeKey(v);
      const bool eq = in && key == T;
      const uint32_t eqMask = __ballot_sync(kFullMask, eq);
      const bool sel = (in && key > T) || (eq && eqSeen + __popc(eqMask & laneMaskLt(lane)) < ties);
      const uint32_t selMask = __ballot_sync(kFullMask, sel);
      if (sel && pos + __popc(selMask & laneMaskLt(lane)) < gate.k) {
        const uint64_t at = pos + __popc(selMask & laneMaskLt(lane));
        const uint64_t i = src.index(start + off);
        outIdx[at] = uint32_t(i);
        outVal[at] = v;
        if (residual) residual[i] = 0.f;
      } else if (in && !sel && residual && !isFiniteF(v)) {
        residual[src.index(start + off)] = 0.f;
      }
      eqSeen += __popc(eqMask);
      pos += __popc(selMask);
    }
  });
}

}  // namespace

void writeSelected(bool approximate, const CandSource& cand, const FullSource& all, const TopkState* st,
                   const Gate& fast, const Gate& full, uint64_t numTiles, uint32_t* greater, uint32_t* equal,
                   uint32_t* outIdx, float* outVal, float* residual, cudaStream_t s) {
  const uint64_t tileGrid = gridFor(numTiles, kWarpsPerCta);
  if (approximate) launch(tileCountKernel<CandSource>, tileGrid, kThreads, s, cand, st, fast, numTiles, greater, equal);
  launch(tileCountKernel<FullSource>, tileGrid, kThreads, s, all, st, full, numTiles, greater, equal);
  launch(scanTilesKernel, 1, kPickThreads, s, st, numTiles, greater, equal);
  if (approximate)
    launch(tileWriteKernel<CandSource>, tileGrid, kThreads, s, cand, st, fast, numTiles, greater, equal, outIdx,
           outVal, residual);
  launch(tileWriteKernel<FullSource>, tileGrid, kThreads, s, all, st, full, numTiles, greater, equal, outIdx, outVal,
         residual);
}

}  // namespace ddlcomm::gpu::detail::topk
