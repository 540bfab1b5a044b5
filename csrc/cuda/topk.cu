// Top-k (exact, and sampled-threshold "approximate") with error feedback: the encode.
//
// Order: key(v) = |v| as float32 bits (NaN above +inf); the k largest keys win,
// equal keys are taken in index order; indices are written ascending. Selection is a radix
// select on the key (digits of 11, 11, 10 bits: histogram, pick the bin holding the k-th
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
//
// Here: the sample, the prepare pass (y, and the candidates), the workspace and the launch
// sequence. The radix select is in topk_select.cu, the ordered compaction in topk_output.cu,
// the value codes (valueBits < 32) in topk_codes.cu, what they share in topk.cuh; the sparse
// decoder (top-k's and random-k's) in sparse.cu.
#include "cuda/topk.cuh"

namespace ddlcomm::gpu::detail {
namespace topk {
namespace {

constexpr uint64_t kSampleMax = 65536;
constexpr uint64_t kSampleSalt = 0x5851f42d4c957f2dull;  // sample positions use a stream of their own

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

// ---- workspace ------------------------------------------------------------------------------
constexpr size_t align256(size_t v) { return (v + 255) / 256 * 256; }

struct TopkWorkspace {
  uint64_t numTiles, sampleSize, sampleRank, candCap;
  size_t stateOff, sampleOff, greaterOff, equalOff, tileOffOff, tileCntOff, candIdxOff, candValOff;
  size_t keptValOff, codeOff, binsOff, bytes;  // value codes: the kept values, their codes, the bin starts
};

TopkWorkspace planWorkspace(bool approximate, uint64_t n, uint64_t k, unsigned valueBits) {
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
  const uint64_t coded = valueBits ? k : 0;
  w.keptValOff = take(4 * coded);
  w.codeOff = take(coded);
  w.binsOff = take(valueBits ? sizeof(BinStart) << (valueBits - 1) : 0);
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
  const unsigned valueBits = compress::headerValueBits(a.config);
  const TopkWorkspace w = planWorkspace(approx, n, k, valueBits);
  auto* st = at<TopkState>(a.workspace, w.stateOff);
  auto* outIdx = reinterpret_cast<uint32_t*>(a.payload + a.layout.first);
  // Value codes: the kept values go to the workspace, to be coded once all are known.
  auto* outVal = valueBits ? at<float>(a.workspace, w.keptValOff) : reinterpret_cast<float*>(a.payload + a.layout.second);
  const auto* x = static_cast<const typename XT::Raw*>(a.x);

  PrepareParams p{n, w.numTiles, st, at<uint32_t>(a.workspace, w.tileOffOff), at<uint32_t>(a.workspace, w.tileCntOff),
                  at<uint32_t>(a.workspace, w.candIdxOff), at<float>(a.workspace, w.candValOff), w.candCap,
                  a.payload, a.header};
  initSelect(st, w.sampleRank, k, s);
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
  writeSelected(approx, cand, all, st, fast, full, w.numTiles, greater, equal, outIdx, outVal, a.residual, s);
  if (valueBits) writeValueCodes(a, st, outVal, at<uint8_t>(a.workspace, w.codeOff), at<BinStart>(a.workspace, w.binsOff), s);
}

}  // namespace
}  // namespace topk

size_t topkWorkspaceBytes(bool approximate, uint64_t numel, uint64_t k, unsigned valueBits) {
  if (k == 0 || numel == 0) return 0;
  return topk::planWorkspace(approximate, numel, k, valueBits).bytes;
}

void encodeTopK(const EncodeArgs& a) {
  if (a.k == 0) {  // nothing is sent; value codes still carry a table, all zeros
    if (a.layout.codes != 0)
      DDLCOMM_CUDA_CHECK(cudaMemsetAsync(a.payload + a.layout.second, 0, a.layout.codes - a.layout.second, a.cudaStream));
    return topk::storeYAndHeader<topk::kStoreUnsent>(a);
  }
  withFloatType(a.xType, [&](auto xt) { topk::encodeTopKTyped<decltype(xt)>(a); });
}

}  // namespace ddlcomm::gpu::detail
