#include "collectives/failure_report.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "transport/transport.h"  // Clock, Deadline

namespace ddlcomm {
namespace {

const char* kFailureKey = "ddlcomm/first_failure";
// A plain array, not a std::string: tasks on a detached courier thread may use it at exit.
constexpr char kWaitingKey[] = "ddlcomm/failed_while_waiting/";
constexpr char kWaitingInKey[] = "ddlcomm/waiting_in/";  // the collectives a waiting rank had entered
// A healthy store answers in milliseconds; one that takes this long is treated as gone.
constexpr std::chrono::milliseconds kStoreCallBound{2000};

}  // namespace

FailureReport::FailureReport(std::shared_ptr<KeyValueStore> store, int rank, int size)
    : haveStore_(store != nullptr), rank_(rank), size_(size), courier_(std::move(store)) {}

bool FailureReport::probe(uint64_t entered) {
  if (!haveStore_) return false;
  const bool publish = entered != publishedWaiting_;
  const std::string key = kWaitingInKey + std::to_string(rank_), value = std::to_string(entered);
  auto found = courier_.call(
      [publish, key, value](KeyValueStore& s) {
        if (publish) s.set(key, value);
        return std::string(s.check(kFailureKey) ? "1" : "");
      },
      kStoreCallBound);
  if (found) publishedWaiting_ = entered;
  return found && !found->empty();
}

std::string FailureReport::ranksNotWaiting(std::chrono::milliseconds timeout, uint64_t entered) {
  // Ranks waiting in the same collective time out within about the time they entered it
  // apart; a rank still silent after that grace period was never there.
  const auto grace = std::clamp(timeout / 10, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
  const Deadline deadline = Clock::now() + grace;
  std::vector<int> silent;  // ranks with no report yet; each sweep asks only about these
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) silent.push_back(r);
  }
  while (!silent.empty() && Clock::now() < deadline) {
    auto reported = courier_.call(
        [silent, entered](KeyValueStore& s) {
          std::string flags;  // '1' for each rank of `silent` that has reported, or waits here or later
          for (int r : silent) {
            const std::string waitingIn = kWaitingInKey + std::to_string(r);
            const bool waiting = s.check(kWaitingKey + std::to_string(r)) ||
                                 (s.check(waitingIn) && std::stoull(s.get(waitingIn)) >= entered);
            flags += waiting ? '1' : '0';
          }
          return flags;
        },
        kStoreCallBound);
    if (!reported) return "";  // the store is unreachable: no way to tell
    std::vector<int> still;
    for (size_t i = 0; i < silent.size(); ++i) {
      if ((*reported)[i] == '0') still.push_back(silent[i]);
    }
    silent.swap(still);
    if (!silent.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string list;
  for (int r : silent) list += (list.empty() ? "rank " : ", rank ") + std::to_string(r);
  return list;
}

std::string FailureReport::record(ErrorKind kind, const std::string& local, std::chrono::milliseconds timeout,
                                  uint64_t entered) {
  if (!haveStore_) return local;
  std::string message = local;
  const bool remoteSymptom = kind == ErrorKind::PeerFailure || kind == ErrorKind::Timeout;
  const std::string me = std::to_string(rank_);
  if (remoteSymptom) {
    // Either way this rank was waiting in a collective when the group failed.
    courier_.call([me](KeyValueStore& s) { s.set(kWaitingKey + me, "1"); return std::string(); }, kStoreCallBound);
    const std::string silent = kind == ErrorKind::Timeout ? ranksNotWaiting(timeout, entered) : "";
    // Lead with the cause: whoever this rank waited for may itself have been waiting.
    if (!silent.empty()) {
      message = "likely cause: " + silent + (silent.find(',') == std::string::npos ? " was" : " were") +
                " not waiting in any collective when this one timed out; " + message;
    }
  }
  // Publish this failure unless a peer's came first; either way learn the first one.
  const std::string mine = "rank " + me + ": " + message;
  auto first = courier_.call(
      [mine](KeyValueStore& s) {
        if (s.check(kFailureKey)) return s.get(kFailureKey);
        s.set(kFailureKey, mine);
        return mine;
      },
      kStoreCallBound);
  if (!first) {
    message += " (the store did not answer, so other ranks' reports are unknown)";
  } else if (remoteSymptom && *first != mine) {
    // Lead with the root cause: this rank's own symptom may just be a peer aborting.
    message = "the group failed first at " + *first + "; then here: " + message;
  }
  return message;
}

}  // namespace ddlcomm
