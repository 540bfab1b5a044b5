// Top-k (exact, and sampled-threshold "approximate") with error feedback, plus the sparse
// decoders (top-k and random-k share the payload layout).
//
// Order: key(v) = |v| as float32 bits (NaN above +inf); the k largest keys win,
// equal keys are taken in index order; indices are written ascending. Selection is a radix
// select on the key (digits of 11, 10, 10 bits: histogram, pick the bin holding the k-th
// largest, refine) followed by an ordered compaction over tiles (per-tile counts, one scan,
// per-tile writes), so the result is deterministic and equal to the CPU's.
//
// Approximate mode (Deep Gradient Compression's sampling, made exact): the k-th largest key
// is estimated on a stratified sample of 65536 elements; the pass that forms y also compacts
// the candidates key >= threshold; the exact selection then runs over the candidates only.
// If the candidates cannot contain the top k (fewer than k of them, more than the workspace
// holds, or a NaN threshold that would leave an infinite y out) the kernels of the exact path
// run instead, decided on the device (every kernel of both paths is launched and checks the
// state first), so the host never waits. Either way the payload is the exact top-k:
// `approximate` only changes the speed.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr int kRounds = 16;
constexpr uint64_t kTile = uint64_t(kThreads) * kRounds;  // elements per tile (prepare CTA)
constexpr uint64_t kSampleMax = 65536;
constexpr int kPickThreads = 1024;
constexpr uint64_t kSampleSalt = 0x5851f42d4c957f2dull;  // sample positions use a stream of their own

struct Digit {
  int shift;       // first bit of this digit
  uint32_t bins;   // 2^width
  int matchShift;  // keys must equal the prefix above this bit; 32: no condition
};
constexpr Digit kDigits[3] = {{20, 2048, 32}, {10, 1024, 20}, {0, 1024, 10}};

struct RadixSelect {
  uint32_t hist[2048];
  uint32_t prefix;  // key bits fixed so far; after the last digit: the k-th largest key T
  uint32_t pad;
  uint64_t rank;    // wanted position among keys matching prefix (1 = largest); finally: ties of T to take
  uint64_t above;   // keys greater than all keys matching prefix; finally: count of keys > T
};

struct TopkState {
  RadixSelect sample;  // threshold estimated on the sample
  RadixSelect final;   // k-th largest among candidates (fast path) or all elements (exact path)
  unsigned long long candCount;
  uint32_t overflow;
  uint32_t pad;
};

// Which path a kernel belongs to; every kernel evaluates the same predicate on the state.
struct Gate {
  uint64_t k;
  uint32_t exact;  // 1: exact mode, the full path always runs
  int want;        // -1: always run; 0: fast path only; 1: full path only
  __device__ __forceinline__ bool pass(const TopkState* st) const {
    if (want < 0) return true;
    // The fast path needs every non-finite y among the candidates (their residual is reset
    // there): a threshold above the infinity key would leave infinities out.
    const bool full = exact || st->overflow || st->candCount < k || st->sample.prefix > kInfKey;
    return full == (want == 1);
  }
};

__device__ __forceinline__ bool matches(uint32_t key, uint32_t prefix, int matchShift) {
  return matchShift >= 32 || (key >> matchShift) == (prefix >> matchShift);
}

__device__ __forceinline__ float loadAny(const void* x, DataType type, uint64_t i) {
  return withFloatType(type, [&](auto xt) {
    using XT = decltype(xt);
    return XT::toFloat(static_cast<const typename XT::Raw*>(x)[i]);
  });
}

// ---- element sources --------------------------------------------------------------------
// All elements: y already stored in the residual by the prepare pass, or x itself (no EF).
struct FullSource {
  const void* x;
  DataType xType;
  const float* y;
  uint64_t n;
  __device__ __forceinline__ uint64_t size(const TopkState*) const { return n; }
  __device__ __forceinline__ float value(uint64_t j) const { return y ? y[j] : loadAny(x, xType, j); }
  __device__ __forceinline__ uint32_t key(uint64_t j) const { return magnitudeKey(value(j)); }
  __device__ __forceinline__ uint64_t index(uint64_t j) const { return j; }
  // Tile b: positions [b * kTile, ...).
  __device__ __forceinline__ void tile(uint64_t b, uint64_t& start, uint32_t& count) const {
    start = b * kTile;
    count = uint32_t(minOf<uint64_t>(kTile, n - start));
  }
};

// Candidates compacted by the prepare pass: tile b's candidates, in index order, at
// tileOff[b] .. tileOff[b] + tileCnt[b].
struct CandSource {
  const uint32_t* idx;
  const float* val;
  const uint32_t* tileOff;
  const uint32_t* tileCnt;
  __device__ __forceinline__ uint64_t size(const TopkState* st) const { return st->candCount; }
  __device__ __forceinline__ float value(uint64_t j) const { return val[j]; }
  __device__ __forceinline__ uint32_t key(uint64_t j) const { return magnitudeKey(val[j]); }
  __device__ __forceinline__ uint64_t index(uint64_t j) const { return idx[j]; }
  __device__ __forceinline__ void tile(uint64_t b, uint64_t& start, uint32_t& count) const {
    start = tileOff[b];
    count = tileCnt[b];
  }
};

// Sample keys.
struct KeySource {
  const uint32_t* keys;
  uint64_t n;
  __device__ __forceinline__ uint64_t size(const TopkState*) const { return n; }
  __device__ __forceinline__ uint32_t key(uint64_t j) const { return keys[j]; }
};

// ---- radix select ---------------------------------------------------------------------------
__global__ void initKernel(TopkState* st, uint64_t sampleRank, uint64_t k) {
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) {
    st->sample.hist[i] = 0;
    st->final.hist[i] = 0;
  }
  if (threadIdx.x == 0) {
    st->sample.prefix = 0;
    st->sample.rank = sampleRank;
    st->sample.above = 0;
    st->final.prefix = 0;
    st->final.rank = k;
    st->final.above = 0;
    st->candCount = 0;
    st->overflow = 0;
  }
}

// Histogram of one digit over the keys that match the prefix fixed so far.
template <typename Src>
__global__ __launch_bounds__(kThreads) void histKernel(Src src, TopkState* st, RadixSelect* sel, Digit d, Gate gate) {
  __shared__ uint32_t h[2048];
  if (!gate.pass(st)) return;
  for (uint32_t i = threadIdx.x; i < d.bins; i += blockDim.x) h[i] = 0;
  __syncthreads();
  const uint32_t prefix = sel->prefix;
  const uint64_t n = src.size(st);
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    const uint32_t key = src.key(j);
    if (matches(key, prefix, d.matchShift)) atomicAdd(&h[(key >> d.shift) & (d.bins - 1)], 1u);
  }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < d.bins; i += blockDim.x)
    if (h[i]) atomicAdd(&sel->hist[i], h[i]);
}

// One CTA: finds the bin that holds the rank-th largest key (scanning bins from the top),
// fixes it in the prefix, and clears the histogram for the next digit.
__global__ __launch_bounds__(kPickThreads) void pickKernel(TopkState* st, RadixSelect* sel, Digit d, Gate gate) {
  if (!gate.pass(st)) return;
  const uint64_t rank = sel->rank;
  const int b0 = int(d.bins) - 1 - 2 * int(threadIdx.x), b1 = b0 - 1;  // this thread's bins, descending
  uint64_t c0 = 0, c1 = 0;
  if (b0 >= 0) {
    c0 = sel->hist[b0];
    sel->hist[b0] = 0;
  }
  if (b1 >= 0) {
    c1 = sel->hist[b1];
    sel->hist[b1] = 0;
  }
  uint64_t total;
  const uint64_t above = blockExclusiveScan<kPickThreads>(c0 + c1, total);
  int bin = -1;
  uint64_t newAbove = 0;
  if (above < rank && rank <= above + c0) {
    bin = b0;
    newAbove = above;
  } else if (above + c0 < rank && rank <= above + c0 + c1) {
    bin = b1;
    newAbove = above + c0;
  }
  if (bin >= 0) {  // exactly one thread, since 1 <= rank <= total
    sel->prefix |= uint32_t(bin) << d.shift;
    sel->rank = rank - newAbove;
    sel->above += newAbove;
  }
}

template <typename Src>
void radixSelect(Src src, TopkState* st, RadixSelect* sel, uint64_t histGrid, Gate gate, cudaStream_t s) {
  for (const Digit& d : kDigits) {
    launch(histKernel<Src>, histGrid, kThreads, s, src, st, sel, d, gate);
    launch(pickKernel, 1, kPickThreads, s, st, sel, d, gate);
  }
}

// ---- prepare: y = x + residual into the residual, candidates for the fast path ----------------
__global__ void sampleKernel(const void* x, DataType xType, const float* residual, uint64_t n, uint64_t m,
                             uint64_t seed, uint64_t stream, uint32_t* keys) {
  const uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= m) return;
  // Stratified: one position in each of m equal strata (m <= n < 2^32, so no product overflows).
  const uint64_t lo = j * n / m, hi = (j + 1) * n / m;
  const uint64_t i = lo + compress::uniformBelow(compress::counterBits(seed, stream ^ kSampleSalt, j), hi - lo);
  const float xv = loadAny(x, xType, i);
  keys[j] = magnitudeKey(residual ? __fadd_rn(xv, residual[i]) : xv);
}

struct PrepareParams {
  uint64_t n;
  uint64_t numTiles;
  TopkState* st;
  uint32_t* tileOff;
  uint32_t* tileCnt;
  uint32_t* candIdx;
  float* candVal;
  uint64_t candCap;
  uint8_t* payload;
  HeaderWords header;
};

// Appends the tile's candidates (key >= threshold) in index order to a stretch of the
// candidate buffer reserved with one atomic; y holds element r * 256 + threadIdx.x of round r.
__device__ __forceinline__ void compactTile(const float (&y)[kRounds], uint64_t tile, uint32_t threshold,
                                            const PrepareParams& p) {
  __shared__ uint32_t counts[kRounds * kWarpsPerCta];  // per (round, warp), then their exclusive prefix
  __shared__ uint32_t tileBase;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint64_t base = tile * kTile;
  uint32_t masks[kRounds];
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t i = base + r * kThreads + threadIdx.x;
    masks[r] = __ballot_sync(kFullMask, i < p.n && magnitudeKey(y[r]) >= threshold);
    if (lane == 0) counts[r * kWarpsPerCta + warp] = __popc(masks[r]);
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the 128 counts in (round, warp) order = index order
    uint32_t c[4], sum = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      c[q] = counts[4 * lane + q];
      sum += c[q];
    }
    const uint32_t inc = warpInclusiveScan(sum, lane);
    uint32_t run = inc - sum;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      counts[4 * lane + q] = run;
      run += c[q];
    }
    if (lane == kWarpSize - 1) {
      const unsigned long long off = atomicAdd(&p.st->candCount, (unsigned long long)inc);
      if (off + inc > p.candCap) {
        p.st->overflow = 1;  // the exact path will run; these candidates are not needed
        tileBase = 0xffffffffu;
      } else {
        tileBase = uint32_t(off);
        p.tileOff[tile] = uint32_t(off);
        p.tileCnt[tile] = inc;
      }
    }
  }
  __syncthreads();
  if (tileBase != 0xffffffffu) {
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      if ((masks[r] >> lane) & 1u) {
        const uint32_t pos = tileBase + counts[r * kWarpsPerCta + warp] + __popc(masks[r] & laneMaskLt(lane));
        p.candIdx[pos] = uint32_t(base + r * kThreads + threadIdx.x);
        p.candVal[pos] = y[r];
      }
    }
  }
  __syncthreads();  // counts and tileBase are reused by the next tile
}

// What the prepare pass leaves in the residual: y, read back by the selection (which resets
// the residual of kept and of non-finite entries at the end); y and the candidates (fast path);
// or the final residual of an encode that sends nothing (k = 0).
enum PrepareMode { kStoreY, kStoreYAndCompact, kStoreUnsent };

// One CTA per tile of 4096 elements: thread t holds elements r * 256 + t of round r in
// registers (coalesced loads, 16 in flight per input).
template <typename XT, int kMode>
__global__ __launch_bounds__(kThreads) void prepareKernel(const typename XT::Raw* __restrict__ x,
                                                          float* __restrict__ residual, PrepareParams p) {
  constexpr bool kCompact = kMode == kStoreYAndCompact;
  writeHeader(p.payload, p.header);
  uint32_t threshold = 0;
  if constexpr (kCompact) threshold = p.st->sample.prefix;
  for (uint64_t tile = blockIdx.x; tile < p.numTiles; tile += gridDim.x) {
    const uint64_t base = tile * kTile;
    float y[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t i = base + r * kThreads + threadIdx.x;
      y[r] = i < p.n ? loadY<XT>(x, residual, i) : 0.f;
    }
    if (residual) {
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t i = base + r * kThreads + threadIdx.x;
        if (i < p.n) residual[i] = kMode == kStoreUnsent ? residualAfter(y[r], 0.f) : y[r];
      }
    }
    if constexpr (kCompact) compactTile(y, tile, threshold, p);
  }
}

// ---- ordered output ----------------------------------------------------------------------
// Per tile (one warp each): keys > T and keys == T.
template <typename Src>
__global__ __launch_bounds__(kThreads) void tileCountKernel(Src src, const TopkState* st, Gate gate,
                                                            uint64_t numTiles, uint32_t* greater, uint32_t* equal) {
  if (!gate.pass(st)) return;
  const uint32_t T = st->final.prefix;
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < numTiles; b += warpStride) {
    uint64_t start;
    uint32_t count;
    src.tile(b, start, count);
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
  }
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
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t warpStride = uint64_t(gridDim.x) * kWarpsPerCta;
  for (uint64_t b = uint64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarpSize; b < numTiles; b += warpStride) {
    uint64_t start;
    uint32_t count;
    src.tile(b, start, count);
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
  }
}

// ---- workspace ------------------------------------------------------------------------------
constexpr size_t align256(size_t v) { return (v + 255) / 256 * 256; }

struct TopkWorkspace {
  uint64_t numTiles, sampleSize, sampleRank, candCap;
  size_t stateOff, sampleOff, greaterOff, equalOff, tileOffOff, tileCntOff, candIdxOff, candValOff, bytes;
};

TopkWorkspace planWorkspace(bool approximate, uint64_t n, uint64_t k) {
  TopkWorkspace w{};
  w.numTiles = (n + kTile - 1) / kTile;
  if (approximate) {
    w.sampleSize = minOf<uint64_t>(n, kSampleMax);
    // Aim the threshold 25% (plus 8 sample elements) below the expected k-th largest so the
    // candidates hold the top k with overwhelming probability; room for twice that many.
    w.sampleRank = minOf<uint64_t>(w.sampleSize, 5 * k * w.sampleSize / (4 * n) + 8);
    const uint64_t perSample = (n + w.sampleSize - 1) / w.sampleSize;
    w.candCap = minOf<uint64_t>(n, 2 * w.sampleRank * perSample + k);
  }
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  w.stateOff = take(sizeof(TopkState));
  w.greaterOff = take(4 * w.numTiles);
  w.equalOff = take(4 * w.numTiles);
  w.sampleOff = take(4 * w.sampleSize);
  w.tileOffOff = take(approximate ? 4 * w.numTiles : 0);
  w.tileCntOff = take(approximate ? 4 * w.numTiles : 0);
  w.candIdxOff = take(4 * w.candCap);
  w.candValOff = take(4 * w.candCap);
  w.bytes = off;
  return w;
}

template <typename T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + off);
}

// The header, and with a residual a pass that stores y (kStoreY) or the residual of an
// encode that sends nothing (kStoreUnsent).
template <int kMode>
void storeYAndHeader(const EncodeArgs& a) {
  if (!a.residual || a.numel == 0) return launch(writeHeaderKernel, 1, 32, a.cudaStream, a.payload, a.header);
  const PrepareParams p{a.numel, (a.numel + kTile - 1) / kTile, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                        a.payload, a.header};
  withFloatType(a.xType, [&](auto xt) {
    using XT = decltype(xt);
    launch(prepareKernel<XT, kMode>, gridFor(p.numTiles, 1), kThreads, a.cudaStream,
           static_cast<const typename XT::Raw*>(a.x), a.residual, p);
  });
}

template <typename XT>
void encodeTopKTyped(const EncodeArgs& a) {
  const uint64_t n = a.numel, k = a.k;
  cudaStream_t s = a.cudaStream;
  const bool approx = a.config.approximate;
  const TopkWorkspace w = planWorkspace(approx, n, k);
  auto* st = at<TopkState>(a.workspace, w.stateOff);
  auto* outIdx = reinterpret_cast<uint32_t*>(a.payload + a.layout.first);
  auto* outVal = reinterpret_cast<float*>(a.payload + a.layout.second);
  const auto* x = static_cast<const typename XT::Raw*>(a.x);

  PrepareParams p{n, w.numTiles, st, at<uint32_t>(a.workspace, w.tileOffOff), at<uint32_t>(a.workspace, w.tileCntOff),
                  at<uint32_t>(a.workspace, w.candIdxOff), at<float>(a.workspace, w.candValOff), w.candCap,
                  a.payload, a.header};
  launch(initKernel, 1, kPickThreads, s, st, w.sampleRank, k);
  if (approx) {
    auto* keys = at<uint32_t>(a.workspace, w.sampleOff);
    launch(sampleKernel, gridFor(w.sampleSize, kThreads), kThreads, s, a.x, a.xType,
           static_cast<const float*>(a.residual), n, w.sampleSize, a.config.seed, a.stream, keys);
    radixSelect(KeySource{keys, w.sampleSize}, st, &st->sample, gridFor(w.sampleSize, kTile), Gate{k, 0, -1}, s);
    launch(prepareKernel<XT, kStoreYAndCompact>, gridFor(w.numTiles, 1), kThreads, s, x, a.residual, p);
  } else {
    storeYAndHeader<kStoreY>(a);
  }

  // Selection of the k-th largest key T: over the candidates (fast path) or over all elements.
  const uint32_t exact = approx ? 0 : 1;
  const Gate fast{k, exact, 0}, full{k, exact, 1};
  const FullSource all{a.x, a.xType, a.residual, n};
  const CandSource cand{p.candIdx, p.candVal, p.tileOff, p.tileCnt};
  if (approx) radixSelect(cand, st, &st->final, gridFor(w.candCap, kTile, 1024), fast, s);
  radixSelect(all, st, &st->final, gridFor(n, kTile, 1024), full, s);

  // Ordered compaction of the keys > T and the first ties of T.
  auto* greater = at<uint32_t>(a.workspace, w.greaterOff);
  auto* equal = at<uint32_t>(a.workspace, w.equalOff);
  const uint64_t tileGrid = gridFor(w.numTiles, kWarpsPerCta);
  if (approx) launch(tileCountKernel<CandSource>, tileGrid, kThreads, s, cand, st, fast, w.numTiles, greater, equal);
  launch(tileCountKernel<FullSource>, tileGrid, kThreads, s, all, st, full, w.numTiles, greater, equal);
  launch(scanTilesKernel, 1, kPickThreads, s, st, w.numTiles, greater, equal);
  if (approx)
    launch(tileWriteKernel<CandSource>, tileGrid, kThreads, s, cand, st, fast, w.numTiles, greater, equal, outIdx,
           outVal, a.residual);
  launch(tileWriteKernel<FullSource>, tileGrid, kThreads, s, all, st, full, w.numTiles, greater, equal, outIdx, outVal,
         a.residual);
}

// ---- sparse decode ------------------------------------------------------------------------
template <typename OutT, bool kAcc>
__global__ __launch_bounds__(kThreads) void scatterKernel(const uint32_t* __restrict__ idx,
                                                          const float* __restrict__ val, uint64_t k, uint64_t numel,
                                                          typename OutT::Raw* __restrict__ out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const uint32_t i = idx[j];
    if (i >= numel) continue;  // validated payloads never have this; never write out of bounds
    if (kAcc) {
      out[i] = __fadd_rn(out[i], val[j]);
    } else {
      out[i] = OutT::fromFloat(val[j]);
    }
  }
}


}  // namespace

size_t topkWorkspaceBytes(bool approximate, uint64_t numel, uint64_t k) {
  if (k == 0 || numel == 0) return 0;
  return planWorkspace(approximate, numel, k).bytes;
}

void encodeTopK(const EncodeArgs& a) {
  if (a.k == 0) return storeYAndHeader<kStoreUnsent>(a);  // nothing is sent
  withFloatType(a.xType, [&](auto xt) { encodeTopKTyped<decltype(xt)>(a); });
}

void decodeSparse(const DecodeArgs& a) {
  if (!a.accumulate && a.numel > 0) {
    DDLCOMM_CUDA_CHECK(cudaMemsetAsync(a.out, 0, a.numel * elementSize(a.outType), a.cudaStream));
  }
  withOutput(a.accumulate, a.outType, [&](auto outT, auto acc) {
    using OutT = decltype(outT);
    launch(scatterKernel<OutT, decltype(acc)::value>, gridFor(a.k, kThreads * 4), kThreads, a.cudaStream,
           reinterpret_cast<const uint32_t*>(a.payload + a.layout.first),
           reinterpret_cast<const float*>(a.payload + a.layout.second), a.k, a.numel,
           static_cast<typename OutT::Raw*>(a.out));
  });
}

}  // namespace ddlcomm::gpu::detail
