#include "compress/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

namespace ddlcomm::compress {

size_t threadsFor(size_t elements) {
  size_t threads = std::thread::hardware_concurrency();
  if (const char* env = std::getenv("DDLCOMM_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && value > 0) threads = size_t(value);
  }
  const size_t useful = elements / kMinElementsPerThread;
  return std::max<size_t>(1, std::min({threads, useful, size_t(256)}));
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
