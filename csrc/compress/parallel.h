// Per-call threading for the kernels: large inputs are split into contiguous parts, one per
// thread, and the threads are joined before the call returns. No pool, no global state;
// results never depend on the number of parts (each kernel's contract).
#pragma once

#include <cstddef>
#include <functional>

namespace ddlcomm::compress {

// Each extra thread gets at least this many elements: below it, spawning costs more than it saves.
constexpr size_t kMinElementsPerThread = size_t(1) << 20;

// At most this many threads per pass, whatever DDLCOMM_NUM_THREADS or the core count say.
constexpr size_t kMaxThreads = 256;

// DDLCOMM_NUM_THREADS (1 to kMaxThreads), or 0 when unset; throws InvalidArgument when invalid.
size_t configuredThreads();

// Threads for a pass over `elements` elements: DDLCOMM_NUM_THREADS (read on every call) or
// this process's cores divided by LOCAL_WORLD_SIZE, and no more than the input justifies.
size_t threadsFor(size_t elements);

// Splits [0, items) into `parts` contiguous ranges whose inner boundaries are multiples of
// `align`, and runs fn(part, begin, end) for each: part 0 on the calling thread, the others on
// new threads. Rethrows the first exception after all parts finished.
void runParts(size_t parts, size_t items, size_t align, const std::function<void(size_t, size_t, size_t)>& fn);

// runParts with threadsFor(items * elementsPerItem) parts, for passes that need no part index.
void parallelFor(size_t items, size_t elementsPerItem, size_t align, const std::function<void(size_t, size_t)>& fn);

}  // namespace ddlcomm::compress
