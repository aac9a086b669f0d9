#pragma once
/// @file
/// @brief RAII for MPI: the environment (MPI_Init_thread / MPI_Finalize), communicators, and
/// the failure policy (a rank that throws aborts the whole job with its message).

#include <concerto/core/error.hpp>

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <utility>

namespace concerto::runtime::mpi {

/// @brief Throws concerto::error naming the MPI call and MPI's own message when `rc` is an error.
inline void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

/// @brief What `environment` sets up.
struct environment_options {
  /// Sets OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 (ring) unless the launcher already chose:
  /// the non-blocking ring all-reduce is what reached full overlap on this machine.
  bool prefer_ring_allreduce = true;
};

/// @brief Initialises MPI for the process's lifetime (funneled: only the main thread calls MPI)
/// and finalises it on destruction. If MPI is already initialised it does neither.
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
    if (!finalised) MPI_Finalize();
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

/// @brief An owned communicator, freed on destruction (never MPI_COMM_WORLD or MPI_COMM_NULL).
class communicator {
public:
  communicator() = default;
  explicit communicator(MPI_Comm c) noexcept : comm_(c) {}
  communicator(communicator&& o) noexcept : comm_(std::exchange(o.comm_, MPI_COMM_NULL)) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      reset();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
    }
    return *this;
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() { reset(); }

  /// The ranks of `parent` with the same colour, ordered by key, as a new communicator.
  [[nodiscard]] static communicator split(MPI_Comm parent, int colour, int key) {
    MPI_Comm c = MPI_COMM_NULL;
    check(MPI_Comm_split(parent, colour, key, &c), "MPI_Comm_split");
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return communicator(c);
  }

  [[nodiscard]] MPI_Comm get() const noexcept { return comm_; }
  [[nodiscard]] int rank() const {
    int r = 0;
    check(MPI_Comm_rank(comm_, &r), "MPI_Comm_rank");
    return r;
  }
  [[nodiscard]] int size() const {
    int n = 0;
    check(MPI_Comm_size(comm_, &n), "MPI_Comm_size");
    return n;
  }

private:
  void reset() noexcept {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && !finalised) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// @brief Runs `body`; if it throws, prints "concerto: rank R failed: <what>" to stderr and
/// MPI_Aborts the whole job, so the other ranks stop instead of hanging in a collective.
///
/// The cause comes first and once: a concerto::collective_error (every rank raises the same) is
/// printed by the comm's rank 0 alone (another rank prints it only if rank 0 has not ended the job
/// 2 s later), and the abort waits a moment so that the launcher forwards the line before its
/// own MPI_ABORT banner.
/// @return 0 when body returns normally (then every rank continues).
template <class F>
int run_or_abort(F&& body, MPI_Comm comm = MPI_COMM_WORLD) {
  const auto report = [](const char* what) {
    std::string text = what;
    if (text.starts_with("concerto: ")) text.erase(0, 10);
    std::fprintf(stderr, "concerto: rank %d failed: %s\n", environment::world_rank(), text.c_str());
  };
  try {
    std::forward<F>(body)();
    return 0;
  } catch (const collective_error& e) {
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    if (rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    report(e.what());
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("an exception that is not a std::exception");
  }
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(comm, 1);
  return 1;
}

} // namespace concerto::runtime::mpi
