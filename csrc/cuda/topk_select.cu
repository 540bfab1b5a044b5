// Radix select of the k-th largest 32-bit key (magnitudeKey's order, common.cuh): digits of 11,
// 11 and 10 bits, each a histogram of the keys that match the prefix fixed so far and a pick of
// the bin holding the wanted rank. Runs on the sample (the approximate threshold), the
// candidates, all elements, or the kept entries (top-k's value codes, topk_codes.cu).
#include "cuda/topk.cuh"

namespace ddlcomm::gpu::detail::topk {
namespace {

struct Digit {
  int shift;       // first bit of this digit
  uint32_t bins;   // 2^width
  int matchShift;  // keys must equal the prefix above this bit; 32: no condition
};
// All 32 bits: magnitude keys leave bit 31 clear, the value codes' tie keys (~position) do not.
constexpr Digit kDigits[3] = {{21, 2048, 32}, {10, 2048, 21}, {0, 1024, 10}};

__device__ __forceinline__ bool matches(uint32_t key, uint32_t prefix, int matchShift) {
  return matchShift >= 32 || (key >> matchShift) == (prefix >> matchShift);
}

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

}  // namespace

void initSelect(TopkState* st, uint64_t sampleRank, uint64_t k, cudaStream_t s) {
  launch(initKernel, 1, kPickThreads, s, st, sampleRank, k);
}

template <typename Src>
void radixSelect(Src src, TopkState* st, RadixSelect* sel, uint64_t histGrid, Gate gate, cudaStream_t s) {
  for (const Digit& d : kDigits) {
    launch(histKernel<Src>, histGrid, kThreads, s, src, st, sel, d, gate);
    launch(pickKernel, 1, kPickThreads, s, st, sel, d, gate);
  }
}

template void radixSelect(KeySource, TopkState*, RadixSelect*, uint64_t, Gate, cudaStream_t);
template void radixSelect(CandSource, TopkState*, RadixSelect*, uint64_t, Gate, cudaStream_t);
template void radixSelect(FullSource, TopkState*, RadixSelect*, uint64_t, Gate, cudaStream_t);
template void radixSelect(KeptSource, TopkState*, RadixSelect*, uint64_t, Gate, cudaStream_t);
template void radixSelect(TieSource, TopkState*, RadixSelect*, uint64_t, Gate, cudaStream_t);

}  // namespace ddlcomm::gpu::detail::topk
