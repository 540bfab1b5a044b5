// A group's failure record in the store, which every rank reads: the first failure any rank
// published (ddlcomm/first_failure) and the ranks that failed while waiting in a collective
// (ddlcomm/failed_while_waiting/<rank>). A rank that only sees a closed socket or a timeout
// thereby names the rank that really failed, or the ranks that were never in the collective.
// Every store call goes through a StoreCourier: an unreachable store costs a bounded wait.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "collectives/store_courier.h"
#include "common/error.h"
#include "transport/store.h"

namespace ddlcomm {

class FailureReport {
 public:
  // Without a store (null) nothing is published and record() returns the message as it is.
  FailureReport(std::shared_ptr<KeyValueStore> store, int rank, int size);

  // The transport's failure hook: publishes this rank's failure, or, if a peer published
  // first, leads with its message. `timeout` is the group's: a rank that timed out waits a
  // tenth of it (1 to 5 s) for the others' reports. `entered` is how many collectives this
  // rank has entered. Returns the message to fail with.
  std::string record(ErrorKind kind, const std::string& message, std::chrono::milliseconds timeout,
                     uint64_t entered);
  // The transport's failure probe, called every second or so of a long wait: whether a rank
  // has published a failure. The first probe of a collective also publishes that this rank
  // waits there (`entered` collectives entered), so that a rank that times out in an earlier
  // collective does not take it for a rank that never came.
  bool probe(uint64_t entered);

 private:
  // After a timeout in collective `entered`: the ranks that have neither reported failing
  // while waiting in a collective nor been seen waiting in this one or a later one, as "rank
  // 1, rank 3"; waits a short grace period for their reports.
  std::string ranksNotWaiting(std::chrono::milliseconds timeout, uint64_t entered);

  const bool haveStore_;
  const int rank_;
  const int size_;
  StoreCourier courier_;
  uint64_t publishedWaiting_ = 0;  // the `entered` this rank last published waiting in (0: none)
};

}  // namespace ddlcomm
