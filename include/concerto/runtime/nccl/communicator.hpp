#pragma once
/// @file
/// @brief RAII for NCCL communicators, made from MPI groups (the unique id travels over MPI),
/// and the per-communicator settings the cost model cares about (channels, CTA policy).
///
/// Host code only; compiles with g++ as well as with nvcc.

#include <concerto/core/error.hpp>
#include <concerto/runtime/mpi/control.hpp>

#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>

namespace concerto::runtime::nccl {

/// @brief Throws concerto::error naming the call and NCCL's message when `r` is an error.
inline void check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::string text = ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') text += std::string(": ") + last;
  fail(std::string(what) + " failed: " + text);
}

/// @brief Per-communicator settings, passed through ncclConfig_t (NCCL >= 2.14). A negative
/// value leaves NCCL's default (and the NCCL_* environment variables) in charge.
///
/// Channels are what a collective's kernel occupies on the GPU: one CTA, i.e. one SM, per
/// channel. Fewer channels leave more SMs to the compute stream while a collective overlaps
/// it, at the price of collective bandwidth; this is the knob that trades the two
/// (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS per communicator instead of per process).
struct comm_options {
  int min_channels = -1; ///< ncclConfig_t::minCTAs
  int max_channels = -1; ///< ncclConfig_t::maxCTAs
  int cta_policy = -1;   ///< ncclConfig_t::CTAPolicy (NCCL >= 2.27): 0 default, 1 efficiency, 2 zero
  std::string name;      ///< ncclConfig_t::commName, shown in NCCL's logs
};

/// @brief An owned NCCL communicator.
/// @code
/// runtime::nccl::communicator tp =
///     runtime::nccl::communicator::from_mpi(runtime::mpi::control(tp_group, 300), {.max_channels = 8});
/// ncclAllReduce(x, x, n, ncclFloat, ncclSum, tp.get(), stream);
/// @endcode
class communicator {
public:
  communicator() = default;
  communicator(communicator&& o) noexcept
      : c_(std::exchange(o.c_, nullptr)), rank_(o.rank_), size_(o.size_), name_(std::move(o.name_)) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      reset();
      c_ = std::exchange(o.c_, nullptr);
      rank_ = o.rank_;
      size_ = o.size_;
      name_ = std::move(o.name_);
    }
    return *this;
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Finalizes and destroys the communicator, which waits for its collectives and may wait for
  /// the peers; during stack unwinding (a failing rank on its way to MPI_Abort, its peers
  /// possibly stuck in a collective) it aborts instead, which waits for nothing.
  ~communicator() {
    if (std::uncaught_exceptions() > 0) abort();
    else reset();
  }

  /// @brief One NCCL communicator over the ranks of `group`, rank i of the group being NCCL rank i.
  /// Rank 0 makes the unique id and broadcasts it over `group` within the group's deadline, so a
  /// rank that never comes is reported there; ncclCommInitRank itself then waits only for ranks
  /// that have the id. Collective over `group`; the current CUDA device is the one it uses.
  [[nodiscard]] static communicator from_mpi(const mpi::control& group, const comm_options& options = {}) {
    communicator c;
    c.rank_ = group.rank();
    c.size_ = group.size();
    ncclUniqueId id{};
    if (c.rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::string id_bytes(reinterpret_cast<const char*>(&id), sizeof id);
    group.broadcast(id_bytes, 0, "the NCCL unique id" + (options.name.empty() ? std::string() : " of '" + options.name + "'"));
    if (id_bytes.size() != sizeof id) fail("the NCCL unique id from rank 0 has " + std::to_string(id_bytes.size()) + " bytes");
    std::memcpy(&id, id_bytes.data(), sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    if (options.min_channels >= 0) config.minCTAs = options.min_channels;
    if (options.max_channels >= 0) config.maxCTAs = options.max_channels;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    if (options.cta_policy >= 0) config.CTAPolicy = options.cta_policy;
#else
    CONCERTO_CHECK(options.cta_policy < 0, "nccl::comm_options::cta_policy needs NCCL 2.27 or later");
#endif
    // Kept on the heap by the communicator: NCCL may hold on to the pointer.
    c.name_ = std::make_shared<const std::string>(options.name);
    if (!c.name_->empty()) config.commName = c.name_->c_str();
    check(ncclCommInitRankConfig(&c.c_, c.size_, id, c.rank_, &config),
          ("ncclCommInitRankConfig" + (options.name.empty() ? std::string() : " of '" + options.name + "'")).c_str());
    return c;
  }

  [[nodiscard]] ncclComm_t get() const noexcept { return c_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// Throws if NCCL reported an asynchronous error on this communicator (a peer died, a network error).
  void check_async() const { check(async_error(), "an NCCL collective"); }
  /// The asynchronous error NCCL reports on this communicator (ncclSuccess when there is none,
  /// or once aborted); cheap enough to poll while a step runs.
  [[nodiscard]] ncclResult_t async_error() const {
    if (c_ == nullptr) return ncclSuccess;
    ncclResult_t r = ncclSuccess;
    check(ncclCommGetAsyncError(c_, &r), "ncclCommGetAsyncError");
    return r;
  }
  /// Aborts the communicator: its unfinished collectives stop (their kernels exit) and its
  /// resources are freed without waiting for the peers, which see an error or time out. What a
  /// rank does when a collective failed or hung, before it exits; the communicator is empty after.
  void abort() noexcept {
    if (c_ != nullptr) (void)ncclCommAbort(c_);
    c_ = nullptr;
  }

private:
  void reset() noexcept {
    if (c_ != nullptr) {
      (void)ncclCommFinalize(c_);
      (void)ncclCommDestroy(c_);
    }
    c_ = nullptr;
  }
  ncclComm_t c_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<const std::string> name_;
};

} // namespace concerto::runtime::nccl
