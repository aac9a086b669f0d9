#pragma once
/// @file
/// @brief MPI's error codes as exceptions, and an owned communicator (RAII).

#include <concerto/core/error.hpp>

#include <mpi.h>

#include <string>
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

/// @brief An owned communicator, freed on destruction (never MPI_COMM_WORLD or MPI_COMM_NULL).
/// Made by runtime::mpi::control (split, duplicate), whose waits have deadlines.
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

} // namespace concerto::runtime::mpi
