#pragma once
/// @file
/// @brief RAII for MPI: the environment (MPI_Init_thread / MPI_Finalize), and the failure
/// policy (a rank that throws ends the whole job, its message printed once).

#include <concerto/core/error.hpp>
#include <concerto/runtime/deadline.hpp>
#include <concerto/runtime/mpi/channel.hpp>
#include <concerto/runtime/mpi/communicator.hpp>
#include <concerto/runtime/mpi/control.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace concerto::runtime::mpi {

/// @brief What `environment` sets up.
struct environment_options {
  /// Sets OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 (ring) unless the launcher already chose:
  /// the non-blocking ring all-reduce is what reached full overlap on this machine.
  bool prefer_ring_allreduce = true;
};

/// @brief Ends the job because this rank failed with `message`: every distinct message of the
/// ranks that failed is printed once, as "concerto: rank R failed: <message>", then MPI_Abort
/// (exit status 1). See run_or_abort.
[[noreturn]] inline void end_job(std::string message);
/// @brief World rank 0: ends the job because another rank reported a failure (`e`).
[[noreturn]] inline void end_job(const remote_failure& e);

/// @brief Initialises MPI for the process's lifetime (funneled: only the main thread calls MPI)
/// and finalises it on destruction. If MPI is already initialised it does neither.
///
/// Before MPI_Finalize the ranks meet at a barrier with the runtime's deadline
/// (CONCERTO_TIMEOUT_S): a rank that stalls after its last collective would otherwise leave the
/// others spinning in MPI_Finalize for ever; past the deadline the job ends, naming the ranks
/// that did not come and where they are.
/// @code
/// int main(int argc, char** argv) {
///   concerto::runtime::mpi::environment env(argc, argv);
///   return concerto::runtime::mpi::run_or_abort([&] { /* plan, execute */ });
/// }
/// @endcode
class environment {
public:
  environment(int& argc, char**& argv, environment_options options = {}) { init(&argc, &argv, options); }
  /// Without the command line (MPI may then not see launcher arguments; mpirun passes none).
  explicit environment(environment_options options = {}) { init(nullptr, nullptr, options); }
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;
  ~environment() {
    if (!owner_) return;
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (finalised) return;
    try {
      const control world(MPI_COMM_WORLD, detail::env_timeout_s(default_timeout_s));
      world.barrier("the other ranks at the end of the job (MPI_Finalize)");
    } catch (const remote_failure& e) {
      end_job(e);
    } catch (const std::exception& e) {
      end_job(e.what());
    }
    channel::get().close();
    MPI_Finalize();
  }

  [[nodiscard]] static int world_rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
  [[nodiscard]] static int world_size() {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }

private:
  void init(int* argc, char*** argv, const environment_options& options) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (initialised) return;
    if (options.prefer_ring_allreduce) ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    owner_ = true;
    // Errors come back as codes so that they become exceptions with the library's message.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  bool owner_ = false;
};

} // namespace concerto::runtime::mpi

namespace concerto::runtime::detail {

inline std::string without_prefix(std::string text) {
  if (text.starts_with("concerto: ")) text.erase(0, 10);
  return text;
}

// Prints each distinct message once, naming the ranks that said it; then the launcher's turn.
[[noreturn]] inline void print_and_abort(const std::vector<mpi::failure_report>& reports) {
  std::vector<std::pair<std::string, std::vector<int>>> distinct;
  for (const auto& r : reports) {
    auto text = without_prefix(r.text);
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& d) { return d.first == text; });
    if (it == distinct.end()) distinct.push_back({std::move(text), {r.rank}});
    else it->second.push_back(r.rank);
  }
  for (const auto& [text, ranks] : distinct) {
    std::string who = std::to_string(ranks.front());
    // The first rank names the line (a message a rank computed names that rank); the others
    // that said the same are counted, not repeated.
    std::fprintf(stderr, "concerto: rank %s failed: %s", who.c_str(), text.c_str());
    if (ranks.size() > 1) std::fprintf(stderr, " (%zu ranks alike)", ranks.size());
    std::fprintf(stderr, "\n");
  }
  std::fflush(stderr);
  // A moment for the launcher to forward the line before its own MPI_ABORT banner.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// World rank 0 waits this long for the reports of ranks failing with it (a mistake every rank
// makes alike arrives within milliseconds); another rank waits this long for rank 0 to end the
// job before it says its own message (rank 0 may be computing, or have stopped).
inline constexpr double collect_failures_s = 0.5, wait_for_rank_0_s = 2.0;

} // namespace concerto::runtime::detail

namespace concerto::runtime::mpi {

[[noreturn]] inline void end_job(std::string message) {
  auto& ch = channel::get();
  message = detail::without_prefix(std::move(message));
  ch.report_failure(message);
  if (ch.rank() != 0) {
    ch.serve_for(detail::wait_for_rank_0_s);
    detail::print_and_abort({{ch.rank(), std::move(message)}});
  }
  auto reports = ch.collect_failures(detail::collect_failures_s);
  reports.insert(reports.begin(), {0, std::move(message)});
  detail::print_and_abort(reports);
}

[[noreturn]] inline void end_job(const remote_failure& e) {
  auto& ch = channel::get();
  ch.report_failure("ending the job: rank " + std::to_string(e.rank) + " failed");
  auto reports = ch.collect_failures(detail::collect_failures_s);
  reports.insert(reports.begin(), {e.rank, e.text});
  detail::print_and_abort(reports);
}

/// @brief Runs `body` and returns what it returns (0 for a body returning nothing). If it
/// throws, the job ends: every rank's failure goes to world rank 0, which prints each distinct
/// message once ("concerto: rank R failed: <what>", with "(N ranks alike)" when several ranks
/// raised it: a mistake in the settings or the program is found by every rank at once) and
/// calls MPI_Abort, so the other ranks stop instead of hanging in a collective; the launcher
/// then exits with status 1. Rank 0, while it waits in the library, takes another rank's report
/// as its own failure, so a failure of one rank is printed at once by rank 0; a rank whose
/// report rank 0 does not take within 2 s (it is computing, or stopped) prints its own.
template <class F>
int run_or_abort(F&& body) {
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
      std::forward<F>(body)();
      return 0;
    } else {
      return static_cast<int>(std::forward<F>(body)());
    }
  } catch (const remote_failure& e) {
    end_job(e);
  } catch (const std::exception& e) {
    end_job(e.what());
  } catch (...) {
    end_job("an exception that is not a std::exception");
  }
}

} // namespace concerto::runtime::mpi
