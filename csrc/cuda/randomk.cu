// Random-k with error feedback: the k indices of Floyd's algorithm as compress.h defines it
// (step j = numel-k .. numel-1 draws t_j = floydCandidate(seed, stream, j) and takes t_j, or j
// when t_j is already taken), computed in parallel instead of step by step:
//
//   dup(m)       = an earlier step drew the same t_m
//   selfTaken(m) = step m took m itself = t_m == m || dup(m) || (numel-k <= t_m < m && selfTaken(t_m))
//   chosen set   = { t_j for every step j } + { m : selfTaken(m) }
//
// (the first step to draw a value takes it; a later one takes its own index; a value in the
// step range is also taken by its own step when that step's draw collided). Checked against
// the sequential algorithm by tests/cuda (exhaustively small) and the reference model.
// dup needs the first step of each drawn value: a hash table (or a direct array when that is
// smaller). The chosen set becomes a bitmap, and one pass over x and the residual writes the
// kept entries in index order (offsets from per-tile bit counts) and every residual.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
constexpr uint64_t kTileWords = kThreads;              // bitmap words per tile of the write pass
constexpr uint64_t kTileElems = kTileWords * 32;       // 8192 elements
constexpr int kRoundsPerTile = int(kTileElems / kThreads);  // 32

// First step (j - (numel - k)) that drew each value.
struct StepTable {
  uint32_t* keys;   // hashed: value + 1 per slot, 0 = empty; null: direct (steps[value])
  uint32_t* steps;  // smallest step per slot / per value; 0xffffffff = none
  uint64_t mask;    // hashed: slots - 1
  int shift;        // hashed: 64 - log2(slots)

  __device__ __forceinline__ uint64_t slotOf(uint64_t t) const { return (t * 0x9e3779b97f4a7c15ull) >> shift; }

  __device__ __forceinline__ void insert(uint32_t t, uint32_t step) {
    if (!keys) {
      atomicMin(&steps[t], step);
      return;
    }
    for (uint64_t s = slotOf(t), probes = 0; probes <= mask; s = (s + 1) & mask, ++probes) {
      const uint32_t prev = atomicCAS(&keys[s], 0u, t + 1);
      if (prev == 0u || prev == t + 1) {
        atomicMin(&steps[s], step);
        return;
      }
    }
  }

  // Every value looked up was inserted (it is some step's draw).
  __device__ __forceinline__ uint32_t firstStep(uint32_t t) const {
    if (!keys) return steps[t];
    for (uint64_t s = slotOf(t), probes = 0; probes <= mask; s = (s + 1) & mask, ++probes)
      if (keys[s] == t + 1) return steps[s];
    return 0xffffffffu;
  }
};

struct FloydParams {
  uint64_t n, k, seed, stream;
};

__global__ __launch_bounds__(kThreads) void floydInsertKernel(FloydParams f, StepTable table) {
  const uint64_t base = f.n - f.k;
  for (uint64_t s = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < f.k; s += uint64_t(gridDim.x) * blockDim.x)
    table.insert(uint32_t(compress::floydCandidate(f.seed, f.stream, base + s)), uint32_t(s));
}

// Did step m take its own index m?
__device__ __forceinline__ bool selfTaken(uint64_t m, const FloydParams& f, const StepTable& table) {
  const uint64_t base = f.n - f.k;
  for (;;) {  // each iteration moves to a smaller step; almost always one iteration
    const uint64_t t = compress::floydCandidate(f.seed, f.stream, m);
    if (t == m || table.firstStep(uint32_t(t)) != uint32_t(m - base)) return true;
    if (t < base) return false;
    m = t;
  }
}

__global__ __launch_bounds__(kThreads) void floydMarkKernel(FloydParams f, StepTable table, uint32_t* bitmap) {
  const uint64_t base = f.n - f.k;
  for (uint64_t s = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < f.k; s += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t j = base + s;
    const uint64_t t = compress::floydCandidate(f.seed, f.stream, j);
    atomicOr(&bitmap[t / 32], 1u << (t % 32));
    if (selfTaken(j, f, table)) atomicOr(&bitmap[j / 32], 1u << (j % 32));
  }
}

// Kept entries per tile of the bitmap (one warp per tile).
__global__ __launch_bounds__(kThreads) void tileBitsKernel(const uint32_t* bitmap, uint64_t nwords, uint64_t numTiles,
                                                           uint32_t* counts) {
  const uint32_t lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * (kThreads / kWarpSize);
  for (uint64_t b = uint64_t(blockIdx.x) * (kThreads / kWarpSize) + threadIdx.x / kWarpSize; b < numTiles;
       b += warpStride) {
    uint32_t c = 0;
    for (uint64_t w = b * kTileWords + lane; w < minOf<uint64_t>((b + 1) * kTileWords, nwords); w += kWarpSize)
      c += __popc(bitmap[w]);
    c = warpSumU32(c);
    if (lane == 0) counts[b] = c;
  }
}

// In-place exclusive prefix sum of counts[n] (one CTA; 8 consecutive entries per thread).
__global__ __launch_bounds__(kScanThreads) void exclusiveScanKernel(uint32_t* counts, uint64_t n) {
  constexpr int kPer = 8;
  uint64_t carry = 0;
  for (uint64_t chunk = 0; chunk < n; chunk += uint64_t(kScanThreads) * kPer) {
    const uint64_t first = chunk + uint64_t(threadIdx.x) * kPer;
    uint32_t c[kPer];
    uint64_t sum = 0;
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      c[q] = first + q < n ? counts[first + q] : 0;
      sum += c[q];
    }
    uint64_t total;
    uint64_t run = carry + blockExclusiveScan<kScanThreads>(sum, total);
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      if (first + q < n) counts[first + q] = uint32_t(run);
      run += c[q];
    }
    carry += total;
  }
}

struct WriteParams {
  uint64_t n;
  uint64_t nwords;
  uint64_t numTiles;
  const uint32_t* bitmap;
  const uint32_t* offsets;  // kept entries before each tile
  float scale;              // values are y * scale when scaled
  bool scaled;
  uint32_t* outIdx;
  float* outVal;
  uint8_t* payload;
  HeaderWords header;
};

// One CTA per tile of 8192 elements: element base + 256 r + t belongs to thread t, so warp w
// of round r covers exactly bitmap word 8 r + w. Writes the kept entries in index order and
// the residual of every element (y - sent, sent = 0 for the others).
template <typename XT>
__global__ __launch_bounds__(kThreads) void randomKWriteKernel(const typename XT::Raw* __restrict__ x,
                                                               float* __restrict__ residual, WriteParams p) {
  __shared__ uint32_t words[kTileWords];
  __shared__ uint32_t before[kTileWords];  // kept entries in the tile's earlier words
  writeHeader(p.payload, p.header);
  const uint32_t lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int kUnroll = 4;
  for (uint64_t tile = blockIdx.x; tile < p.numTiles; tile += gridDim.x) {
    const uint64_t w = tile * kTileWords + threadIdx.x;
    const uint32_t word = w < p.nwords ? p.bitmap[w] : 0u;
    uint64_t total;
    const uint64_t pre = blockExclusiveScan<kThreads>(__popc(word), total);
    words[threadIdx.x] = word;
    before[threadIdx.x] = uint32_t(pre);
    __syncthreads();
    const uint64_t base = tile * kTileElems, offset = p.offsets[tile];
    for (int r0 = 0; r0 < kRoundsPerTile; r0 += kUnroll) {
      float y[kUnroll];
      bool kept[kUnroll];
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {  // loads first: several in flight
        const uint64_t i = base + uint64_t(r0 + q) * kThreads + threadIdx.x;
        kept[q] = (words[(r0 + q) * (kThreads / kWarpSize) + warp] >> lane) & 1u;
        y[q] = i < p.n && (kept[q] || residual) ? loadY<XT>(x, residual, i) : 0.f;
      }
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        const uint64_t i = base + uint64_t(r0 + q) * kThreads + threadIdx.x;
        if (i >= p.n) continue;
        const float sent = kept[q] ? (p.scaled ? __fmul_rn(y[q], p.scale) : y[q]) : 0.f;
        if (kept[q]) {
          const int wi = (r0 + q) * (kThreads / kWarpSize) + warp;
          const uint64_t pos = offset + before[wi] + __popc(words[wi] & laneMaskLt(lane));
          p.outIdx[pos] = uint32_t(i);
          p.outVal[pos] = sent;
        }
        if (residual) residual[i] = residualAfter(y[q], sent);
      }
    }
    __syncthreads();  // words and before are reused by the next tile
  }
}

constexpr size_t align256(size_t v) { return (v + 255) / 256 * 256; }

struct RandomKWorkspace {
  uint64_t nwords, numTiles, slots;  // slots == 0: direct table of n entries
  size_t bitmapOff, keysOff, stepsOff, countsOff, bytes;
};

RandomKWorkspace planWorkspace(uint64_t n, uint64_t k) {
  RandomKWorkspace w{};
  w.nwords = (n + 31) / 32;
  w.numTiles = (n + kTileElems - 1) / kTileElems;
  uint64_t slots = 1024;
  while (slots < 2 * k) slots *= 2;
  const bool direct = 4 * n <= 8 * slots;  // a direct array is smaller than the hash table
  w.slots = direct ? 0 : slots;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  w.bitmapOff = take(4 * w.nwords);
  w.keysOff = take(4 * w.slots);
  w.stepsOff = take(4 * (direct ? n : w.slots));
  w.countsOff = take(4 * w.numTiles);
  w.bytes = off;
  return w;
}

template <typename T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + off);
}

}  // namespace

size_t randomkWorkspaceBytes(uint64_t numel, uint64_t k) {
  if (numel == 0) return 0;
  return planWorkspace(numel, k).bytes;
}

void encodeRandomK(const EncodeArgs& a) {
  const uint64_t n = a.numel, k = a.k;
  cudaStream_t s = a.cudaStream;
  if (n == 0) return launch(writeHeaderKernel, 1, 32, s, a.payload, a.header);
  const RandomKWorkspace w = planWorkspace(n, k);
  auto* bitmap = at<uint32_t>(a.workspace, w.bitmapOff);
  auto* counts = at<uint32_t>(a.workspace, w.countsOff);
  DDLCOMM_CUDA_CHECK(cudaMemsetAsync(bitmap, 0, 4 * w.nwords, s));
  if (k > 0) {
    StepTable table{w.slots ? at<uint32_t>(a.workspace, w.keysOff) : nullptr, at<uint32_t>(a.workspace, w.stepsOff),
                    w.slots ? w.slots - 1 : 0, 0};
    int log2Slots = 0;
    while ((uint64_t(1) << log2Slots) < w.slots) ++log2Slots;
    table.shift = 64 - log2Slots;
    if (table.keys) DDLCOMM_CUDA_CHECK(cudaMemsetAsync(table.keys, 0, 4 * w.slots, s));
    DDLCOMM_CUDA_CHECK(cudaMemsetAsync(table.steps, 0xff, 4 * (w.slots ? w.slots : n), s));
    const FloydParams f{n, k, a.config.seed, a.stream};
    launch(floydInsertKernel, gridFor(k, kThreads), kThreads, s, f, table);
    launch(floydMarkKernel, gridFor(k, kThreads), kThreads, s, f, table, bitmap);
  }
  launch(tileBitsKernel, gridFor(w.numTiles, kThreads / kWarpSize), kThreads, s, bitmap, w.nwords, w.numTiles,
         counts);
  launch(exclusiveScanKernel, 1, kScanThreads, s, counts, w.numTiles);
  const bool scaled = a.config.scaled && k > 0;
  const WriteParams p{n,
                      w.nwords,
                      w.numTiles,
                      bitmap,
                      counts,
                      scaled ? float(double(n) / double(k)) : 1.f,
                      scaled,
                      reinterpret_cast<uint32_t*>(a.payload + a.layout.first),
                      reinterpret_cast<float*>(a.payload + a.layout.second),
                      a.payload,
                      a.header};
  withFloatType(a.xType, [&](auto xt) {
    using XT = decltype(xt);
    launch(randomKWriteKernel<XT>, gridFor(w.numTiles, 1), kThreads, s, static_cast<const typename XT::Raw*>(a.x),
           a.residual, p);
  });
}

}  // namespace ddlcomm::gpu::detail
