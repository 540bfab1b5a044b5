// Settings from environment variables, read in one place so that every variable rejects the
// same mistakes (a typo, a negative count, trailing units, overflow) with the same message.
// Header-only: the standalone builds (scripts/fuzz.sh, csrc/cuda) list their sources by hand.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "common/error.h"

namespace ddlcomm {

// The variable's value, or nullptr when it is unset or empty (both mean "use the default").
inline const char* envString(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// The variable's value as a decimal integer in [min, max], or `fallback` when it is unset or
// empty. Anything else (not a number, a sign or characters around it, overflow, outside the
// range) throws InvalidArgument naming the variable, its value and the allowed range.
inline int64_t envInteger(const char* name, int64_t fallback, int64_t min,
                          int64_t max = std::numeric_limits<int64_t>::max()) {
  const char* text = envString(name);
  if (text == nullptr) return fallback;
  const char* end = text + std::strlen(text);
  int64_t value = 0;
  // from_chars takes no whitespace or '+', and reports overflow instead of clamping.
  const auto [stop, error] = std::from_chars(text, end, value);
  if (error == std::errc() && stop == end && value >= min && value <= max) return value;
  const std::string allowed = max != std::numeric_limits<int64_t>::max()
                                  ? detail::concat("an integer from ", min, " to ", max)
                                  : detail::concat("an integer >= ", min);
  fail(ErrorKind::InvalidArgument, "environment variable ", name, "='", text, "' is invalid: expected ", allowed,
       " (or unset for the default)");
}

}  // namespace ddlcomm
