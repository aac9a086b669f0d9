#pragma once
/// @file
/// @brief Typed views of the task attributes the planner's rewrites read and write: a matmul's
/// shape, an MoE layer's layout, a collective's layout dimensions, and which chunk of a split task
/// a task is. The names are the op table's (ir/ops.hpp lists the attrs each op carries); code
/// outside the executors' decoding reads them here, not by key.
///
/// @code
/// const auto mm = ir::matmul_attrs::of(t);
/// if (mm.plain()) { ir::task part = t; ir::set_matmul_rows(part, mm.m / 2); ir::mark_chunk(part, 0, 2); }
/// @endcode

#include <concerto/ir/graph.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace concerto::ir {

/// @brief A matmul task's shape: C[m, n] = op(A)[m, k] · op(B)[k, n], `batch` of them, C summed
/// into when `accumulate`.
struct matmul_attrs {
  std::int64_t m = 0, n = 0, k = 0, batch = 1;
  bool trans_a = false, trans_b = false, accumulate = false;

  [[nodiscard]] static matmul_attrs of(const task& t) {
    return {t.attr("m"),           t.attr("n"),           t.attr("k"),           t.attr("batch", 1),
            t.attr("trans_a") != 0, t.attr("trans_b") != 0, t.attr("accumulate") != 0};
  }
  /// One product (not batched) that overwrites its output: what a row split can cut.
  [[nodiscard]] bool plain() const noexcept { return batch == 1 && !accumulate; }
};

/// @brief The geometry of a convolution task (conv2d and its two gradients): images x [batch,
/// height, width, in_channels] (NHWC), weights w [kernel_h, kernel_w, in_channels, out_channels]
/// (HWIO), outputs y [batch, out_h, out_w, out_channels], zero padding on every side.
struct conv_geometry {
  std::int64_t batch = 1, height = 1, width = 1, in_channels = 1, out_channels = 1;
  std::int64_t kernel_h = 1, kernel_w = 1, stride = 1, padding = 0;

  /// ⌊(in + 2·padding − kernel) / stride⌋ + 1 positions of the kernel along one dimension (0 where it does not fit).
  [[nodiscard]] static constexpr std::int64_t output_extent(std::int64_t in, std::int64_t kernel, std::int64_t stride,
                                                            std::int64_t padding) noexcept {
    const auto room = in + 2 * padding - kernel;
    return room < 0 || stride < 1 ? 0 : room / stride + 1;
  }
  [[nodiscard]] constexpr std::int64_t out_h() const noexcept { return output_extent(height, kernel_h, stride, padding); }
  [[nodiscard]] constexpr std::int64_t out_w() const noexcept { return output_extent(width, kernel_w, stride, padding); }
  /// Output positions: the rows of the product y[positions, out] = patches[positions, patch] · w[patch, out].
  [[nodiscard]] constexpr std::int64_t positions() const noexcept { return batch * out_h() * out_w(); }
  /// Values of one patch: the product's contracted extent.
  [[nodiscard]] constexpr std::int64_t patch() const noexcept { return kernel_h * kernel_w * in_channels; }
  [[nodiscard]] constexpr std::int64_t x_values() const noexcept { return batch * height * width * in_channels; }
  [[nodiscard]] constexpr std::int64_t w_values() const noexcept { return patch() * out_channels; }
  [[nodiscard]] constexpr std::int64_t y_values() const noexcept { return positions() * out_channels; }
  [[nodiscard]] constexpr double flops() const noexcept {
    return 2.0 * static_cast<double>(positions()) * static_cast<double>(out_channels) * static_cast<double>(patch());
  }
  /// Values the windows of a pooling cover (its kernel the window, in = out channels).
  [[nodiscard]] constexpr double window_values() const noexcept {
    return static_cast<double>(positions()) * static_cast<double>(out_channels) * static_cast<double>(kernel_h * kernel_w);
  }
  /// A 1×1 kernel at stride 1 without padding: the image's rows are the patches (no gather).
  [[nodiscard]] constexpr bool pointwise() const noexcept {
    return kernel_h == 1 && kernel_w == 1 && stride == 1 && padding == 0;
  }

  /// From attrs read by `attr(name, fallback)`: the op table's names for the convolution's tasks.
  template <class Lookup>
  [[nodiscard]] static conv_geometry read(Lookup attr) {
    return {attr("batch", 1),        attr("height", 1),   attr("width", 1),  attr("in_channels", 1), attr("out_channels", 1),
            attr("kernel_h", 1),     attr("kernel_w", 1), attr("stride", 1), attr("padding", 0)};
  }
  [[nodiscard]] static conv_geometry of(const task& t) {
    return read([&](const char* key, std::int64_t fallback) { return t.attr(key, fallback); });
  }
  /// The attrs a convolution task carries (what read() reads back).
  [[nodiscard]] std::map<std::string, std::int64_t> attrs() const {
    return {{"batch", batch},       {"height", height},     {"width", width},   {"in_channels", in_channels},
            {"out_channels", out_channels}, {"kernel_h", kernel_h}, {"kernel_w", kernel_w}, {"stride", stride},
            {"padding", padding}};
  }
};

/// @brief The parts of one dim of a tensor viewed as [lead, outer, extent, inner]: the task of
/// a concat_dim, a slice_dim or their gradients. A part is [offset, offset + length) of the dim;
/// bit k of `broadcast` marks part k as a table of the tensor's last dims, one copy for every
/// lead (concat_dim's lower-rank operand; its gradient is summed over lead). concat_dim's first
/// part has `length`, its second the rest; a gradient's or a slice's part is bit 0.
struct dim_part {
  std::int64_t lead = 1, outer = 1, extent = 1, inner = 1, offset = 0, length = 1, broadcast = 0;

  /// Values of the whole, and of part k (length `length`, or for concat's second the rest).
  [[nodiscard]] constexpr std::int64_t whole_values() const noexcept { return lead * outer * extent * inner; }
  [[nodiscard]] constexpr std::int64_t part_values(std::int64_t part_length, int k = 0) const noexcept {
    return (repeated(k) ? 1 : lead) * outer * part_length * inner;
  }
  [[nodiscard]] constexpr bool repeated(int k) const noexcept { return ((broadcast >> k) & 1) != 0; }

  template <class Lookup>
  [[nodiscard]] static dim_part read(Lookup attr) {
    return {attr("lead", 1), attr("outer", 1), attr("extent", 1), attr("inner", 1), attr("offset", 0), attr("length", 1),
            attr("broadcast", 0)};
  }
  [[nodiscard]] std::map<std::string, std::int64_t> attrs() const {
    return {{"lead", lead},     {"outer", outer},   {"extent", extent},      {"inner", inner},
            {"offset", offset}, {"length", length}, {"broadcast", broadcast}};
  }
};

/// @brief A fraction in [0, 1) in a task's integer attrs: num / den with den = 2²⁴ (a dropout's
/// rate, whose draw's top 24 bits fall below num for a dropped value, runtime::dropout_layout;
/// a batch norm's momentum).
inline constexpr std::int64_t fraction_den = std::int64_t{1} << 24;
/// @brief The attr `num` of fraction f (its `den` is fraction_den).
[[nodiscard]] inline std::int64_t fraction_num(double f) { return std::llround(f * static_cast<double>(fraction_den)); }

/// @brief Sets a matmul task's row count (a chunk of its rows).
inline void set_matmul_rows(task& t, std::int64_t m) { t.attrs["m"] = m; }

/// @brief The layout of an MoE task (moe_dispatch, moe_combine and their gradients): experts, a
/// group's tokens, slots per expert and group, and the chunks its slots are laid out in.
struct moe_attrs {
  std::int64_t experts = 0, group = 0, capacity = 0, slot_chunks = 1;
  [[nodiscard]] static moe_attrs of(const task& t) {
    return {t.attr("experts"), t.attr("group"), t.attr("capacity"), t.attr("slot_chunks", 1)};
  }
};

/// @brief Lays an MoE task's slots out chunk-major in k chunks (the exchange split's layout).
inline void set_slot_chunks(task& t, std::int64_t k) { t.attrs["slot_chunks"] = k; }

/// @brief The attrs that name a collective's layout dimension: which dimension it gathers or
/// scatters along, or exchanges from and to.
inline constexpr std::array<std::string_view, 3> layout_dim_attrs{"dim", "from_dim", "to_dim"};

/// @brief The dimension layout attr `which` of a collective names (0 when it has none).
[[nodiscard]] inline std::int64_t layout_dim(const task& t, std::string_view which) { return t.attr(which, 0); }

/// @brief A chunk's collective works along dimension 0 of its [rows, columns] buffers: the layout
/// attrs it has are set to 0.
inline void reset_layout_dims(task& t) {
  for (const auto key : layout_dim_attrs)
    if (const auto it = t.attrs.find(std::string(key)); it != t.attrs.end()) it->second = 0;
}

/// @brief Marks a task as chunk j of the k a task was split into.
inline void mark_chunk(task& t, std::int64_t j, std::int64_t k) {
  t.attrs["chunk"] = j;
  t.attrs["chunks"] = k;
}
/// @brief Whether a task is a chunk of a split one.
[[nodiscard]] inline bool is_chunk(const task& t) { return t.attrs.contains("chunks"); }

} // namespace concerto::ir
