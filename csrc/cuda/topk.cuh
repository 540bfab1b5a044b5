// What the top-k encode's files share (topk.cu: the encode; topk_select.cu: the radix select
// of the k-th largest key; topk_output.cu: the ordered compaction of the kept entries): the
// launch shapes, the selection state on the device, the gate that runs one path of the two,
// and the element sources a selection reads. Included by those .cu files only.
#pragma once

#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace ddlcomm::gpu::detail::topk {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr int kRounds = 16;
constexpr uint64_t kTile = uint64_t(kThreads) * kRounds;  // elements per tile (prepare CTA)
constexpr int kPickThreads = 1024;

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

// The kept values, in index order (the payload's): the value codes' magnitude ranks.
struct KeptSource {
  const float* val;
  uint64_t k;
  __device__ __forceinline__ uint64_t size(const TopkState*) const { return k; }
  __device__ __forceinline__ uint32_t key(uint64_t j) const { return magnitudeKey(val[j]); }
};

// The ties of `of->prefix` among the kept values, keyed ~position so the lower position ranks
// first; every other entry has key 0, below all ties (positions are < 2^32 - 1).
struct TieSource {
  const float* val;
  uint64_t k;
  const RadixSelect* of;
  __device__ __forceinline__ uint64_t size(const TopkState*) const { return k; }
  __device__ __forceinline__ uint32_t key(uint64_t j) const {
    return magnitudeKey(val[j]) == of->prefix ? ~uint32_t(j) : 0u;
  }
};

// The first entry of one or more value-code bins (`bins` of them start at its rank): its
// magnitude key and its position among the kept.
struct BinStart {
  uint32_t key;
  uint32_t position;
  uint32_t bins;
};

// ---- the steps in topk_select.cu, topk_output.cu and topk_codes.cu (their kernels are private to them) ----
// Zeroes both selections' histograms and counts; `sampleRank` and `k` are the ranks they look
// for (topk_select.cu).
void initSelect(TopkState* st, uint64_t sampleRank, uint64_t k, cudaStream_t s);

// Fixes sel->prefix to the k-th largest key of `src`, digit by digit (topk_select.cu; for
// KeySource, CandSource and FullSource).
template <typename Src>
void radixSelect(Src src, TopkState* st, RadixSelect* sel, uint64_t histGrid, Gate gate, cudaStream_t s);

// Writes the keys > T and the first ties of T in index order, over the candidates (`fast`,
// when approximate) and over all elements (`full`): each gate lets one of them run
// (topk_output.cu).
void writeSelected(bool approximate, const CandSource& cand, const FullSource& all, const TopkState* st,
                   const Gate& fast, const Gate& full, uint64_t numTiles, uint32_t* greater, uint32_t* equal,
                   uint32_t* outIdx, float* outVal, float* residual, cudaStream_t s);

// Top-k's value codes from the k kept values val[] (index order) whose indices are in the
// payload already: the table and the codes into the payload, the kept entries' residual
// (topk_codes.cu). Scratch: code[k] and bins[2^(valueBits-1)]; st's selections are free.
void writeValueCodes(const EncodeArgs& a, TopkState* st, const float* val, uint8_t* code, BinStart* bins,
                     cudaStream_t s);

}  // namespace ddlcomm::gpu::detail::topk
