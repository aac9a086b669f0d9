#pragma once
/// @file
/// @brief Collectives outside the step's plan, each with a deadline: the plan broadcast, the
/// agreement checks before step 1, the loss of every step, the gathers of a checkpoint, and the
/// communicators the backends make (split after a bounded barrier).
///
/// A blocking MPI call waits forever for a rank that stopped; these start the non-blocking form
/// and poll it until the runtime's timeout (runtime/deadline.hpp), then throw naming what was
/// waited for, on the ranks that did arrive. After a timeout the communicator holds a request
/// that may never complete: the job is meant to end (run_or_abort), not to go on.
///
/// @code
/// runtime::mpi::control c(MPI_COMM_WORLD, 300);
/// double loss = c.sum_all(local_loss, "the loss of step 12");
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/runtime/deadline.hpp>
#include <concerto/runtime/mpi/environment.hpp>

#include <mpi.h>

#include <climits>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace concerto::runtime::mpi {

class control {
public:
  /// `timeout_s` is the longest wait of each call (seconds; past the clock's range: never).
  control(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] double timeout_s() const noexcept { return timeout_s_; }

  /// Waits for `request` until the deadline; `what` names the wait in the error.
  void wait(MPI_Request& request, std::string_view what) const {
    const bool done = detail::poll_until(detail::deadline_after(timeout_s_), [&] {
      int complete = 0;
      check(MPI_Test(&request, &complete, MPI_STATUS_IGNORE), "MPI_Test");
      return complete != 0;
    });
    if (!done)
      fail(detail::timed_out_after(timeout_s_) + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           " waiting for " + std::string(what) +
           ": another rank stopped or never reached it (set CONCERTO_TIMEOUT_S to wait longer)");
  }

  /// Rank `root`'s bytes on every rank.
  void broadcast(std::string& bytes, int root, std::string_view what) const {
    auto n = static_cast<long long>(bytes.size());
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Ibcast(&n, 1, MPI_LONG_LONG, root, comm_, &r), "MPI_Ibcast");
    wait(r, what);
    if (n > INT_MAX) fail(std::string(what) + ": " + std::to_string(n) + " bytes exceed MPI's int count");
    bytes.resize(static_cast<std::size_t>(n));
    if (n == 0) return;
    check(MPI_Ibcast(bytes.data(), static_cast<int>(n), MPI_CHAR, root, comm_, &r), "MPI_Ibcast");
    wait(r, what);
  }

  [[nodiscard]] std::int64_t min_all(std::int64_t v, std::string_view what) const {
    std::int64_t out = 0;
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(&v, &out, 1, MPI_INT64_T, MPI_MIN, comm_, &r), "MPI_Iallreduce");
    wait(r, what);
    return out;
  }

  /// Element-wise sums over the ranks, in place.
  void sum_all(std::span<double> values, std::string_view what) const {
    if (values.size() > INT_MAX) fail(std::string(what) + ": too many values for MPI's int count");
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM, comm_, &r),
          "MPI_Iallreduce");
    wait(r, what);
  }
  [[nodiscard]] double sum_all(double v, std::string_view what) const {
    sum_all(std::span(&v, 1), what);
    return v;
  }

  /// Every rank's `mine`, in rank order, in `all` (size: ranks × mine.size()).
  template <class T>
    requires std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int64_t>
  void all_gather(std::span<const T> mine, std::span<T> all, std::string_view what) const {
    if (all.size() != mine.size() * static_cast<std::size_t>(size_) || mine.size() > INT_MAX)
      fail(std::string(what) + ": all_gather of " + std::to_string(mine.size()) + " values into " +
           std::to_string(all.size()) + " on " + std::to_string(size_) + " ranks");
    const int n = static_cast<int>(mine.size());
    MPI_Request r = MPI_REQUEST_NULL;
    const MPI_Datatype type = std::same_as<T, float> ? MPI_FLOAT : std::same_as<T, double> ? MPI_DOUBLE : MPI_INT64_T;
    check(MPI_Iallgather(mine.data(), n, type, all.data(), n, type, comm_, &r), "MPI_Iallgather");
    wait(r, what);
  }

  void barrier(std::string_view what) const {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm_, &r), "MPI_Ibarrier");
    wait(r, what);
  }

  /// The ranks with the same `colour`, ordered by `key`, as a new communicator. MPI_Comm_split
  /// has no non-blocking form: a barrier with the deadline comes first, so that a rank that
  /// never arrives is reported by the ones that did instead of holding them in the split.
  [[nodiscard]] communicator split(int colour, int key, std::string_view what) const {
    barrier(what);
    return communicator::split(comm_, colour, key);
  }

  /// The ranks of this communicator that share this rank's node (MPI_COMM_TYPE_SHARED), ordered
  /// by `key`; the same barrier first.
  [[nodiscard]] communicator split_by_node(int key, std::string_view what) const {
    barrier(what);
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    MPI_Comm_set_errhandler(node, MPI_ERRORS_RETURN);
    return communicator(node);
  }

private:
  MPI_Comm comm_;
  double timeout_s_;
  int rank_ = 0;
  int size_ = 1;
};

} // namespace concerto::runtime::mpi
