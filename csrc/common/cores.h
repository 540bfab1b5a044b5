// How many cores this process may run on (its affinity mask, which containers and taskset
// narrow), for the choices that depend on ranks outnumbering cores.
#pragma once

#include <sched.h>

#include <thread>

namespace ddlcomm {

inline int usableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  const unsigned reported = std::thread::hardware_concurrency();
  return reported > 0 ? int(reported) : 1;
}

}  // namespace ddlcomm
