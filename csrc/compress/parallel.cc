#include "compress/parallel.h"

#include <algorithm>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "common/cores.h"
#include "common/env.h"

namespace ddlcomm::compress {

namespace {

// The cores this process may run on, shared with the other ranks on the node (torchrun's
// LOCAL_WORLD_SIZE): ranks that each spawn a thread per core oversubscribe the node and wait
// for each other's threads (measured in docs/results/README.md, "Compressed all-reduce
// choices").
size_t coresPerLocalRank() {
  return std::max<size_t>(1, size_t(usableCores()) / size_t(envInteger("LOCAL_WORLD_SIZE", 1, 1)));
}

}  // namespace

size_t configuredThreads() { return size_t(envInteger("DDLCOMM_NUM_THREADS", 0, 1, kMaxThreads)); }

size_t threadsFor(size_t elements) {
  const size_t threads = configuredThreads();
  const size_t useful = elements / kMinElementsPerThread;
  return std::max<size_t>(1, std::min({threads ? threads : coresPerLocalRank(), useful, kMaxThreads}));
}

void runParts(size_t parts, size_t items, size_t align, const std::function<void(size_t, size_t, size_t)>& fn) {
  parts = std::max<size_t>(parts, 1);
  const size_t units = (items + align - 1) / align;
  auto bound = [&](size_t part) { return std::min(items, units * part / parts * align); };
  std::vector<std::exception_ptr> errors(parts);
  auto runPart = [&](size_t part) {
    try {
      fn(part, bound(part), bound(part + 1));
    } catch (...) {
      errors[part] = std::current_exception();
    }
  };
  {
    std::vector<std::thread> threads;
    threads.reserve(parts - 1);
    // Joined in all cases: a failed spawn leaves the remaining parts to this thread.
    struct Joiner {
      std::vector<std::thread>& threads;
      ~Joiner() {
        for (auto& t : threads) t.join();
      }
    } joiner{threads};
    size_t part = 1;
    try {
      for (; part < parts; ++part) threads.emplace_back(runPart, part);
    } catch (const std::system_error&) {
      for (; part < parts; ++part) runPart(part);
    }
    runPart(0);
  }
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

void parallelFor(size_t items, size_t elementsPerItem, size_t align, const std::function<void(size_t, size_t)>& fn) {
  runParts(threadsFor(items * elementsPerItem), items, align,
           [&](size_t, size_t begin, size_t end) { fn(begin, end); });
}

}  // namespace ddlcomm::compress
