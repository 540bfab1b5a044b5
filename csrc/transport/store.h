// The key-value store used for bootstrap and for telling peers why a rank gave up. The
// torch glue adapts c10d::Store to it; ddlcomm runs no rendezvous server of its own.
#pragma once

#include <string>

namespace ddlcomm {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (bounded by the store's own timeout).
  virtual std::string get(const std::string& key) = 0;
  // Non-blocking existence check.
  virtual bool check(const std::string& key) = 0;
};

}  // namespace ddlcomm
