#include "transport/shm/shm_transport.h"

#include <cstdint>

#include "common/env.h"

namespace ddlcomm::shm {

ShmOptions ShmOptions::fromEnvironment() {
  ShmOptions o;
  o.ringBytes = size_t(envInteger("DDLCOMM_SHM_RING_BYTES", int64_t(o.ringBytes), 4096, int64_t(1) << 30));
  DDLCOMM_CHECK((o.ringBytes & (o.ringBytes - 1)) == 0, ErrorKind::InvalidArgument,
                "environment variable DDLCOMM_SHM_RING_BYTES='", o.ringBytes, "' is invalid: expected a power of two");
  o.windowBytes = size_t(envInteger("DDLCOMM_SHM_WINDOW_BYTES", int64_t(o.windowBytes), 0, int64_t(1) << 32));
  o.windowBytes &= ~size_t(63);
  return o;
}

}  // namespace ddlcomm::shm
