#pragma once
/// @file
/// @brief How long the runtime waits: CONCERTO_TIMEOUT_S, deadlines that never overflow, and the
/// start of every timeout message. The executor, both backends and the control-path collectives
/// (runtime/mpi/control.hpp) share it, so that every wait of the library has the same limit.

#include <concerto/core/error.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace concerto::runtime {

using clock = std::chrono::steady_clock;

/// @brief The longest wait when nobody says otherwise (seconds).
inline constexpr double default_timeout_s = 300;

namespace detail {

/// `fallback`, or CONCERTO_TIMEOUT_S when it is set (a positive number; `inf` means never).
inline double env_timeout_s(double fallback) {
  const char* text = std::getenv("CONCERTO_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v > 0))
    fail(std::string("CONCERTO_TIMEOUT_S='") + text + "' is not a positive number of seconds");
  return v;
}

/// The timeout a component configured with (`timeout_s`, `from_env`) uses; checks it is positive.
inline double resolve_timeout_s(double timeout_s, bool from_env, const char* who) {
  const double t = from_env ? env_timeout_s(timeout_s) : timeout_s;
  if (!(t > 0)) fail(std::string(who) + ": timeout_s must be positive");
  return t;
}

// A timeout past the clock's range (CONCERTO_TIMEOUT_S=inf, or 1e10 s) means "never": converting
// it to clock ticks would overflow into the past and fail every wait at once.
inline clock::time_point deadline_after(double timeout_s) {
  const auto now = clock::now();
  const std::chrono::duration<double> left_in_range = clock::time_point::max() - now;
  if (!(timeout_s < left_in_range.count())) return clock::time_point::max();
  return now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
}

/// Calls `done()` until it returns true (then true) or `deadline` passes (then false). Between
/// calls it gives the core away: a yield for the first thousand calls, which a short wait ends
/// within, then 20 µs sleeps, so that a long wait does not burn a core that another rank (ranks
/// may outnumber cores) needs. The clock is read every 64 calls.
template <class Done>
bool poll_until(clock::time_point deadline, Done&& done) {
  for (std::uint64_t polls = 0;; ++polls) {
    if (done()) return true;
    if ((polls & 63) == 0 && clock::now() >= deadline) return false;
    if (polls < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

inline std::string timed_out_after(double timeout_s) {
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", timeout_s);
  return "timed out after " + std::string(secs) + " s";
}

} // namespace detail
} // namespace concerto::runtime
