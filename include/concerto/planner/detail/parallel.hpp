#pragma once
/// @file
/// @brief Judging independent candidates on every core: the rewrites (decomposition, bucketing)
/// judge each candidate by a whole-graph simulation, and the candidates of one decision do not
/// depend on each other. Not public API.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace concerto::planner::detail {

/// Calls `work(i)` for every i in [0, count), on up to one thread per core (the caller's
/// included); returns when all are done. The first exception thrown by a call is rethrown here
/// once the others have finished; calls not yet started when it was thrown are skipped.
template <class Work> void for_each_index(std::size_t count, Work&& work) {
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t workers = std::min(count, cores);
  if (workers <= 1) {
    for (std::size_t i = 0; i < count; ++i) work(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_lock;
  const auto run = [&] {
    for (std::size_t i; !failed && (i = next++) < count;) {
      try {
        work(i);
      } catch (...) {
        const std::lock_guard<std::mutex> hold(error_lock);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(workers - 1);
  for (std::size_t t = 1; t < workers; ++t) helpers.emplace_back(run);
  run();
  for (auto& h : helpers) h.join();
  if (first_error) std::rethrow_exception(first_error);
}

} // namespace concerto::planner::detail
