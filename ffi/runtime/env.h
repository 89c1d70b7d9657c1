// Integer tuning knobs from the environment (host code of handlers and kernel launchers).
#pragma once
#include <climits>
#include <cstdlib>

namespace jax_engram {

// The variable as a base-10 integer clamped to [lo, hi]; `fallback` when it is unset, empty or not a number.
inline int env_int(const char* name, int fallback, int lo = INT_MIN, int hi = INT_MAX) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  if (!end || *end != 0) return fallback;
  return v < lo ? lo : (v > hi ? hi : static_cast<int>(v));
}

}  // namespace jax_engram
