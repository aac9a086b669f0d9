#pragma once
/// @file
/// @brief Collectives outside the step's plan, each with a deadline: the plan broadcast, the
/// agreement checks before step 1, the loss of every step, the gathers of a checkpoint, and the
/// communicators the backends make.
///
/// A blocking MPI call waits forever for a rank that stopped; these start the non-blocking form
/// and poll it until the runtime's timeout (runtime/deadline.hpp), answering other ranks'
/// questions meanwhile (runtime/mpi/channel.hpp), then throw naming what was waited for and,
/// per rank that did not arrive, where it is: waiting elsewhere, failed, planning, or silent.
/// After a timeout the communicator holds a request that may never complete: the job is meant
/// to end (run_or_abort), not to go on.
///
/// MPI_Comm_split has no non-blocking form: a split follows a barrier with the deadline (a
/// rank that never comes is reported there), and the split itself runs under a watchdog that
/// ends this process, saying why, if a rank stalls inside it. A communicator that only needs
/// to be another copy of one that exists is made by MPI_Comm_idup, with the deadline.
///
/// @code
/// runtime::mpi::control c(MPI_COMM_WORLD, 300);
/// double loss = c.sum_all(local_loss, "the loss of step 12");
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/runtime/deadline.hpp>
#include <concerto/runtime/mpi/channel.hpp>
#include <concerto/runtime/mpi/communicator.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace concerto::runtime::mpi {

/// The world ranks of `comm`, in its rank order (a local call).
[[nodiscard]] inline std::vector<int> world_ranks_of(MPI_Comm comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  check(MPI_Comm_group(comm, &group), "MPI_Comm_group");
  check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
  int n = 0;
  MPI_Group_size(group, &n);
  std::vector<int> mine(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = i;
  MPI_Group_translate_ranks(group, n, mine.data(), world, out.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

/// Waits for `request` until `timeout_s` has passed, serving the job's channel; throws naming
/// `what` and, per rank of `ranks` (world ranks) that did not arrive, where it is. `rank` and
/// `size` say which rank of which group waited.
inline void wait_with_deadline(MPI_Request& request, std::string_view what, double timeout_s, std::span<const int> ranks,
                               int rank, int size) {
  auto& ch = channel::get();
  channel::waiting here(ch, std::string(what));
  std::uint64_t polls = 0;
  const bool done = detail::poll_until(detail::deadline_after(timeout_s), [&] {
    if ((++polls & 15) == 0) ch.serve();
    int complete = 0;
    check(MPI_Test(&request, &complete, MPI_STATUS_IGNORE), "MPI_Test");
    return complete != 0;
  });
  if (done) return;
  auto where = ch.whereabouts(ranks, std::min(1.0, timeout_s), what);
  if (where.empty()) where = "every other rank waits for it too";
  fail(detail::timed_out_after(timeout_s) + " on rank " + std::to_string(rank) + " of " + std::to_string(size) +
       " waiting for " + std::string(what) + ": " + where + " (set CONCERTO_TIMEOUT_S to wait longer)");
}

/// Runs `call`, a blocking MPI call that cannot be interrupted, under a watchdog: past
/// `timeout_s` the watchdog says why and ends this process (the launcher then ends the job),
/// since the ranks in the call would otherwise wait for ever for one that stalled. World rank 0
/// says it first; the others wait a moment, so that one message is printed.
template <class Call>
void within_deadline(double timeout_s, const std::string& what, Call&& call) {
  const auto deadline = detail::deadline_after(timeout_s);
  if (deadline == clock::time_point::max()) {
    call();
    return;
  }
  const int rank = channel::get().rank(), size = channel::get().size();
  std::mutex m;
  std::condition_variable cv;
  bool finished = false;
  std::thread watchdog([&, rank, size] {
    std::unique_lock lock(m);
    const auto returned = [&] { return finished; };
    if (cv.wait_until(lock, deadline, returned)) return;
    if (rank != 0 && cv.wait_for(lock, std::chrono::seconds(2), returned)) return;
    std::fprintf(stderr, "concerto: rank %d failed: %s on rank %d of %d inside %s: a rank of the group entered it late or "
                 "not at all, and the call cannot be interrupted (set CONCERTO_TIMEOUT_S to wait longer)\n",
                 rank, detail::timed_out_after(timeout_s).c_str(), rank, size, what.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  });
  const auto stop_watching = [&] {
    {
      std::lock_guard lock(m);
      finished = true;
    }
    cv.notify_all();
    watchdog.join();
  };
  try {
    call();
  } catch (...) {
    stop_watching();
    throw;
  }
  stop_watching();
}

class control {
public:
  /// `timeout_s` is the longest wait of each call (seconds; past the clock's range: never).
  control(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    world_ranks_ = world_ranks_of(comm_);
  }

  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] double timeout_s() const noexcept { return timeout_s_; }

  /// Waits for `request` until the deadline; `what` names the wait in the error.
  void wait(MPI_Request& request, std::string_view what) const {
    wait_with_deadline(request, what, timeout_s_, world_ranks_, rank_, size_);
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

  /// Rank 0's `bytes` on every rank, by point-to-point messages only: what the settings
  /// agreement uses, so that it works where the ranks' collective algorithms differ (the fault
  /// it reports).
  void broadcast_point_to_point(std::string& bytes, std::string_view what) const {
    if (rank_ == 0) {
      std::vector<MPI_Request> sent;
      const auto n = static_cast<long long>(bytes.size());
      if (n > INT_MAX) fail(std::string(what) + ": " + std::to_string(n) + " bytes exceed MPI's int count");
      for (int r = 1; r < size_; ++r) {
        sent.push_back(MPI_REQUEST_NULL);
        check(MPI_Isend(bytes.data(), static_cast<int>(n), MPI_CHAR, r, point_to_point_tag, comm_, &sent.back()), "MPI_Isend");
      }
      for (auto& r : sent) wait(r, what);
      return;
    }
    bytes = receive_from(0, what);
  }

  /// Every rank's `mine` on rank 0 (in rank order; the others get an empty list), by
  /// point-to-point messages only (see broadcast_point_to_point).
  [[nodiscard]] std::vector<std::string> gather_point_to_point(const std::string& mine, std::string_view what) const {
    if (rank_ != 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      check(MPI_Isend(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, 0, point_to_point_tag, comm_, &r), "MPI_Isend");
      wait(r, what);
      return {};
    }
    std::vector<std::string> all{mine};
    for (int r = 1; r < size_; ++r) all.push_back(receive_from(r, what));
    return all;
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

  /// The ranks with the same `colour`, ordered by `key`, as a new communicator: a barrier with
  /// the deadline, then MPI_Comm_split under the watchdog (see the file comment).
  [[nodiscard]] communicator split(int colour, int key, std::string_view what) const {
    barrier(what);
    MPI_Comm c = MPI_COMM_NULL;
    within_deadline(timeout_s_, "MPI_Comm_split for " + std::string(what),
                    [&] { check(MPI_Comm_split(comm_, colour, key, &c), "MPI_Comm_split"); });
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return communicator(c);
  }

  /// A copy of `of` (a communicator this rank is in), made without blocking (MPI_Comm_idup)
  /// and waited for with the deadline. Collective over `of`.
  [[nodiscard]] communicator duplicate(const communicator& of, std::string_view what) const {
    MPI_Comm c = MPI_COMM_NULL;
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Comm_idup(of.get(), &c, &r), "MPI_Comm_idup");
    wait_with_deadline(r, what, timeout_s_, world_ranks_of(of.get()), of.rank(), of.size());
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return communicator(c);
  }

  /// The ranks of this communicator that share this rank's node (MPI_COMM_TYPE_SHARED), ordered
  /// by `key`; as split.
  [[nodiscard]] communicator split_by_node(int key, std::string_view what) const {
    barrier(what);
    MPI_Comm node = MPI_COMM_NULL;
    within_deadline(timeout_s_, "MPI_Comm_split_type for " + std::string(what), [&] {
      check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    });
    MPI_Comm_set_errhandler(node, MPI_ERRORS_RETURN);
    return communicator(node);
  }

private:
  // The tag of broadcast_point_to_point and gather_point_to_point: control-path messages
  // follow one another in one order on every rank, so one tag serves them all.
  static constexpr int point_to_point_tag = 7001;

  [[nodiscard]] std::string receive_from(int source, std::string_view what) const {
    MPI_Status st;
    int flag = 0;
    auto& ch = channel::get();
    channel::waiting here(ch, std::string(what));
    std::uint64_t polls = 0;
    const bool arrived = detail::poll_until(detail::deadline_after(timeout_s_), [&] {
      if ((++polls & 15) == 0) ch.serve();
      check(MPI_Iprobe(source, point_to_point_tag, comm_, &flag, &st), "MPI_Iprobe");
      return flag != 0;
    });
    if (!arrived) {
      auto where = ch.whereabouts(std::span(&world_ranks_[static_cast<std::size_t>(source)], 1), std::min(1.0, timeout_s_), what);
      if (where.empty()) where = "rank " + std::to_string(world_ranks_[static_cast<std::size_t>(source)]) + " waits for it too";
      fail(detail::timed_out_after(timeout_s_) + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           " waiting for " + std::string(what) + ": " + where + " (set CONCERTO_TIMEOUT_S to wait longer)");
    }
    int count = 0;
    MPI_Get_count(&st, MPI_CHAR, &count);
    std::string bytes(static_cast<std::size_t>(count), '\0');
    check(MPI_Recv(bytes.data(), count, MPI_CHAR, source, point_to_point_tag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
    return bytes;
  }

  MPI_Comm comm_;
  double timeout_s_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
};

} // namespace concerto::runtime::mpi
