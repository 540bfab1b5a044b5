// CPU emulator (tests/cuda/emu): runtime API on host memory and the per-block coroutine
// scheduler behind threadIdx, warp collectives and __syncthreads. See include/cuda_runtime.h.
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's context switch is written for x86-64"
#endif

// Switches stacks: saves the callee-saved registers on the current stack, stores the stack
// pointer in *save, loads `load` and pops the registers saved there (cooperative fibers,
// much cheaper than swapcontext, which makes a signal-mask system call per switch).
extern "C" void emu_switch(void** save, void* load);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
)");

namespace emu {

uint3 g_blockIdx{0, 0, 0};
dim3 g_blockDim, g_gridDim;

namespace {

enum class State { Ready, WaitWarp, WaitBlock, Done };

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  void* stack = nullptr;
  uint3 tid{0, 0, 0};
  State state = State::Done;
  unsigned seq = 0;  // warp collectives done so far (selects the exchange buffer)
};

struct Warp {
  int live = 0;
  int arrived = 0;
  uint64_t slots[2][32];
};

std::vector<Fiber> fibers;
std::vector<Warp> warps;
int blockLive = 0, blockArrived = 0;
Fiber* current = nullptr;
void* schedulerSp = nullptr;
const std::function<void()>* body = nullptr;
#if EMU_ASAN
const void* schedulerStackBottom = nullptr;
size_t schedulerStackSize = 0;
#endif

void switchToScheduler(bool finished) {
#if EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, schedulerStackBottom, schedulerStackSize);
  emu_switch(&current->sp, schedulerSp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)finished;
  emu_switch(&current->sp, schedulerSp);
#endif
}

void fiberEntry() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &schedulerStackBottom, &schedulerStackSize);
#endif
  (*body)();
  Fiber* f = current;
  f->state = State::Done;
  Warp& w = warps[f->tid.x / 32];
  --w.live;
  if (w.arrived > 0) fatal("a lane exited while its warp waits in a collective (undefined on a GPU)");
  --blockLive;
  if (blockArrived > 0 && blockArrived == blockLive) {
    blockArrived = 0;
    for (Fiber& g : fibers)
      if (g.state == State::WaitBlock) g.state = State::Ready;
  }
  switchToScheduler(true);
  fatal("finished fiber resumed");
}

void runFiber(Fiber& f) {
  current = &f;
#if EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  emu_switch(&schedulerSp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  emu_switch(&schedulerSp, f.sp);
#endif
  current = nullptr;
}

// A fresh fiber's stack: six callee-saved registers for emu_switch to pop, then the address
// it returns to, then a dummy return address so that fiberEntry starts with the stack
// alignment of a called function.
void* initialStack(void* stack) {
#if EMU_ASAN
  __asan_unpoison_memory_region(stack, kStackBytes);  // frames of the fiber's previous run
#endif
  auto top = reinterpret_cast<uintptr_t>(stack) + kStackBytes;
  top &= ~uintptr_t(15);
  auto* p = reinterpret_cast<void**>(top);
  *--p = nullptr;                                    // fiberEntry never returns
  *--p = reinterpret_cast<void*>(&fiberEntry);       // emu_switch's ret target
  for (int i = 0; i < 6; ++i) *--p = nullptr;        // rbp, rbx, r12..r15
  return p;
}

}  // namespace

void fatal(const char* what) {
  std::fprintf(stderr, "cuda emulator: %s (block %u, thread %u)\n", what, g_blockIdx.x,
               current ? current->tid.x : 0u);
  std::abort();
}

const uint3& currentThreadIdx() {
  if (!current) fatal("threadIdx outside a kernel");
  return current->tid;
}

void warpExchange(uint64_t mine, uint64_t* all) {
  Fiber* f = current;
  if (!f) fatal("warp collective outside a kernel");
  Warp& w = warps[f->tid.x / 32];
  if (w.live != 32) fatal("warp collective with exited or missing lanes (undefined on a GPU)");
  const unsigned buf = f->seq++ & 1;
  w.slots[buf][f->tid.x % 32] = mine;
  if (++w.arrived == 32) {
    w.arrived = 0;
    const unsigned first = f->tid.x / 32 * 32;
    for (unsigned l = 0; l < 32; ++l)
      if (fibers[first + l].state == State::WaitWarp) fibers[first + l].state = State::Ready;
  } else {
    f->state = State::WaitWarp;
    switchToScheduler(false);
  }
  std::memcpy(all, w.slots[buf], sizeof(w.slots[buf]));
}

void syncThreads() {
  Fiber* f = current;
  if (!f) fatal("__syncthreads outside a kernel");
  if (++blockArrived == blockLive) {
    blockArrived = 0;
    for (Fiber& g : fibers)
      if (g.state == State::WaitBlock) g.state = State::Ready;
  } else {
    f->state = State::WaitBlock;
    switchToScheduler(false);
  }
}

namespace {
uint64_t enqueued = 0;  // kernel launches and stream memsets and copies (tests/cuda/emu/launches.cc)
}  // namespace

uint64_t operations() { return enqueued; }

void runGrid(uint64_t grid, unsigned block, const std::function<void()>& kernelBody) {
  ++enqueued;
  if (grid == 0 || grid > 0x7fffffffull) fatal("invalid grid size");
  if (block == 0 || block > 1024) fatal("invalid block size");
  g_gridDim = dim3(unsigned(grid));
  g_blockDim = dim3(block);
  body = &kernelBody;
  if (fibers.size() < block) {
    const size_t old = fibers.size();
    fibers.resize(block);
    for (size_t i = old; i < block; ++i) {
      fibers[i].stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (fibers[i].stack == MAP_FAILED) fatal("mmap of a fiber stack failed");
    }
  }
  warps.assign((block + 31) / 32, Warp{});
  for (uint64_t b = 0; b < grid; ++b) {
    g_blockIdx = uint3{unsigned(b), 0, 0};
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[t];
      f.tid = uint3{t, 0, 0};
      f.state = State::Ready;
      f.seq = 0;
      f.sp = initialStack(f.stack);
    }
    for (Warp& w : warps) {
      w.live = 0;
      w.arrived = 0;
    }
    for (unsigned t = 0; t < block; ++t) ++warps[t / 32].live;
    blockLive = int(block);
    blockArrived = 0;
    for (;;) {
      bool ran = false, all = true;
      for (unsigned t = 0; t < block; ++t) {
        if (fibers[t].state == State::Ready) {
          runFiber(fibers[t]);
          ran = true;
        }
        if (fibers[t].state != State::Done) all = false;
      }
      if (all) break;
      if (!ran) fatal("deadlock: threads wait in __syncthreads or a warp collective that others never reach");
    }
  }
  body = nullptr;
}

}  // namespace emu

// ---- runtime API -------------------------------------------------------------------------
namespace {
cudaError_t lastError = cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = std::getenv("DDLCOMM_EMU_NO_DEVICE") ? 0 : 1;
  return *count ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "ddlcomm CPU emulator");
  prop->totalGlobalMem = size_t(4) << 30;
  prop->multiProcessorCount = 1;
  prop->major = 9;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaGetLastError() {
  const cudaError_t e = lastError;
  lastError = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return lastError; }
const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
  }
  return "unknown error";
}
const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
  }
  return "cudaErrorUnknown";
}

// Exact-size allocations, so AddressSanitizer (when the emulator is built with it) reports
// any access past the end of a "device" buffer.
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return lastError = cudaErrorMemoryAllocation;
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *free = size_t(2) << 30;
  *total = size_t(4) << 30;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  ++emu::enqueued;
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (bytes) std::memset(dst, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  ++emu::enqueued;
  return cudaMemset(dst, value, bytes);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete reinterpret_cast<char*>(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

struct CUevent_st {
  std::chrono::steady_clock::time_point t;
};
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  event->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->t - start->t).count();
  return cudaSuccess;
}
