#pragma once
/// @file
/// @brief Device memory: an owned allocation and the arena holding every buffer of a plan.
///
/// The arena uses the same `memory_layout` as the CPU backend's host arena (runtime/buffers.hpp),
/// with 256-byte alignment (what cuBLASLt and vectorised loads like), so a buffer's offset is
/// the same function of the graph on both backends. Host code only; compiles with g++ too.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cuda/check.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::runtime::cuda {

/// @brief An owned device allocation (cudaMalloc), zeroed on creation.
/// @code
/// cuda::device_buffer ws(32 << 20);
/// @endcode
class device_buffer {
public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    void* p = nullptr;
    const auto e = cudaMalloc(&p, bytes_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      fail("cudaMalloc of " + std::to_string(bytes_) + " bytes failed: " + cudaGetErrorString(e));
    }
    p_ = static_cast<std::byte*>(p);
    check(cudaMemset(p_, 0, bytes_), "cudaMemset");
    // cudaMemset on device memory returns before it has run, on the legacy default stream,
    // which non-blocking streams (cuda::stream) do not wait for: wait here so that "zeroed on
    // creation" holds for work on any stream. Allocations happen at setup, never in a step.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  [[nodiscard]] std::byte* data() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return reinterpret_cast<T*>(p_);
  }

private:
  void reset() noexcept {
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  std::byte* p_ = nullptr;
  std::size_t bytes_ = 0;
};

/// @brief Alignment of every root buffer in a device arena.
inline constexpr std::size_t device_alignment = 256;

/// @brief One zeroed device allocation holding every buffer of a graph, at the offsets of
/// `make_layout(g, scratch, device_alignment)`; the scratch region follows the buffers.
///
/// Host code reaches the values with `upload` / `download` (synchronous copies that wait for the
/// whole device; for setup and checks, never inside a step).
/// @code
/// cuda::device_arena mem(g, runtime::make_layout(g, 0, cuda::device_alignment));
/// mem.upload<float>(w_id, host_w);          // host -> device
/// auto loss = mem.download<float>(loss_id); // device -> host, std::vector<float>
/// @endcode
class device_arena {
public:
  device_arena() = default;
  device_arena(const ir::graph& g, memory_layout layout)
      : layout_(std::move(layout)), storage_(static_cast<std::size_t>(std::max<std::int64_t>(layout_.total_bytes, 1))) {
    CONCERTO_CHECK(layout_.offset.size() == g.buffers.size(),
                   "device arena of graph '" + g.name + "': the layout covers " + std::to_string(layout_.offset.size()) +
                       " buffers, the graph has " + std::to_string(g.buffers.size()));
    CONCERTO_CHECK(layout_.alignment % device_alignment == 0,
                   "device arena of graph '" + g.name + "': the layout's alignment " +
                       std::to_string(layout_.alignment) + " is not a multiple of " + std::to_string(device_alignment));
    for (const auto& b : g.buffers) {
      const auto off = layout_.offset[static_cast<std::size_t>(b.id)];
      if (off < 0 || off + b.bytes > layout_.total_bytes)
        fail("device arena of graph '" + g.name + "': buffer '" + b.name + "' lies outside the arena");
      infos_.push_back({b.name, b.bytes, b.type});
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return infos_.size(); }
  [[nodiscard]] const memory_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::byte* data() const noexcept { return storage_.data(); }
  [[nodiscard]] std::int64_t total_bytes() const noexcept { return layout_.total_bytes; }

  /// Device address of a buffer.
  [[nodiscard]] std::byte* ptr(ir::buffer_id b) const {
    (void)at(b);
    return storage_.data() + layout_.offset[static_cast<std::size_t>(b)];
  }
  [[nodiscard]] std::int64_t bytes(ir::buffer_id b) const { return at(b).bytes; }
  [[nodiscard]] ir::dtype type(ir::buffer_id b) const { return at(b).type; }
  [[nodiscard]] const std::string& name(ir::buffer_id b) const { return at(b).name; }
  /// A buffer's device address as fp32; throws naming the buffer if it holds another type.
  [[nodiscard]] float* f32(ir::buffer_id b) const { return typed<float>(b, ir::dtype::f32); }
  /// A buffer's device address as int32; throws naming the buffer if it holds another type.
  [[nodiscard]] std::int32_t* i32(ir::buffer_id b) const { return typed<std::int32_t>(b, ir::dtype::i32); }
  /// Elements of a buffer of its own type.
  [[nodiscard]] std::size_t count(ir::buffer_id b) const {
    const auto& i = at(b);
    return static_cast<std::size_t>(i.bytes) / ir::size_of(i.type);
  }
  [[nodiscard]] std::byte* scratch() const noexcept { return storage_.data() + layout_.scratch_offset; }
  [[nodiscard]] std::int64_t scratch_bytes() const noexcept { return layout_.scratch_bytes; }

  /// Copies `values` into buffer b (sizes must match exactly); synchronous: work enqueued
  /// afterwards on any stream sees the values.
  template <class T>
  void upload(ir::buffer_id b, std::span<const T> values) const {
    const auto& i = at(b);
    CONCERTO_CHECK(static_cast<std::int64_t>(values.size_bytes()) == i.bytes,
                   "upload into buffer '" + i.name + "': " + std::to_string(values.size_bytes()) +
                       " bytes given, the buffer holds " + std::to_string(i.bytes));
    if (i.bytes == 0) return;
    check(cudaMemcpy(ptr(b), values.data(), values.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
    // From pageable memory cudaMemcpy may return once the values are staged, before the DMA
    // into the buffer has finished, and it is ordered on the legacy default stream, which the
    // backend's non-blocking streams do not wait for: a step's first kernel could read the old
    // values. Waiting for the device closes that window.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  template <class T>
  void upload(ir::buffer_id b, const std::vector<T>& values) const {
    upload(b, std::span<const T>(values));
  }
  /// Copies buffer b to the host, as values of T; synchronous (waits for the device's work).
  template <class T>
  [[nodiscard]] std::vector<T> download(ir::buffer_id b) const {
    const auto& i = at(b);
    CONCERTO_CHECK(i.bytes % static_cast<std::int64_t>(sizeof(T)) == 0,
                   "download of buffer '" + i.name + "': its size is not a whole number of elements");
    std::vector<T> out(static_cast<std::size_t>(i.bytes) / sizeof(T));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (i.bytes > 0) check(cudaMemcpy(out.data(), ptr(b), static_cast<std::size_t>(i.bytes), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }

private:
  struct info {
    std::string name;
    std::int64_t bytes;
    ir::dtype type;
  };
  const info& at(ir::buffer_id b) const {
    if (b < 0 || static_cast<std::size_t>(b) >= infos_.size())
      fail("device arena: buffer " + std::to_string(b) + " does not exist (the arena holds " +
           std::to_string(infos_.size()) + ")");
    return infos_[static_cast<std::size_t>(b)];
  }
  template <class T>
  T* typed(ir::buffer_id b, ir::dtype want) const {
    const auto& i = at(b);
    if (i.type != want)
      fail("buffer '" + i.name + "' holds " + std::string(ir::to_string(i.type)) + ", not " +
           std::string(ir::to_string(want)));
    return reinterpret_cast<T*>(ptr(b));
  }

  memory_layout layout_;
  device_buffer storage_;
  std::vector<info> infos_;
};

} // namespace concerto::runtime::cuda
