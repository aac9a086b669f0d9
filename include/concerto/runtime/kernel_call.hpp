#pragma once
/// @file
/// @brief A compute task decoded once into a typed kernel call: its op, its operands in the op
/// table's order, and the extents its kernel needs, checked against the buffers. The CPU
/// dispatch (runtime/dispatch.hpp), the GPU dispatch (runtime/cuda/dispatch.cuh) and both
/// workspace-size functions read calls, never tasks: how a task is read is written here once.
///
/// A backend decodes every compute task of its plan before the first step (`decode`), so that
/// a task whose operands do not fit its op is reported, naming the task, its fn and the operand,
/// before anything runs, and a step does no attribute lookups. Integer operands (ids, targets,
/// positions) may be i32 or i64; a dispatch narrows i64 ones into its workspace.
/// docs/runtime.md lists every op's operands.
///
/// @code
/// for (const auto& t : g.tasks)
///   if (!ir::is_collective(t.kind)) calls[t.id] = runtime::decode(g, t, coords);
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/cpu/optimizer.hpp>
#include <concerto/runtime/dropout_mask.hpp>
#include <concerto/runtime/lr_schedule.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime {

/// @brief Run-time parameters of the kernels that attrs (integers) cannot carry.
struct kernel_settings {
  runtime::cpu::sgd_config sgd{};
  runtime::cpu::adamw_config adamw{};
  lr_schedule schedule{}; ///< the rate of each step from sgd.lr or adamw.lr (lr_schedule.hpp)
  float clip_norm = 0.0f; ///< global-norm gradient clipping's max_norm (grad_clip.hpp), 0: none
  float layernorm_eps = 1e-5f;
  float batchnorm_eps = 1e-5f;
  float rmsnorm_eps = 1e-6f;
  std::int64_t step = 1; ///< optimizer step, counting from 1 (AdamW bias correction); the executor sets it
  /// This rank's coordinate on each mesh axis of the graph (the backend fills it in prepare):
  /// the ops that pick their part of a split tensor read it when they are decoded. Empty means
  /// coordinate 0 everywhere.
  std::vector<int> coords{};
};

/// @brief Where a part's rows lie in a whole buffer, in bytes: `outer` rows, a whole row of
/// `whole_row` bytes holding the part's `part_row` bytes at `offset`; `part` is its buffer.
struct rows_in_whole {
  std::size_t outer = 1, whole_row = 0, part_row = 0, offset = 0;
  ir::buffer_id part = -1;
};

/// @brief How a matmul's product is run (the same on the CPU and the GPU).
enum class gemm_form : std::uint8_t {
  single,          ///< one product (batch 1)
  shared_b,        ///< a batch sharing B: one taller product (m·batch rows)
  summed_batch,    ///< a weight gradient of a batched activation: Σᵢ Aᵢᵀ·Bᵢ, one product with k·batch
  strided_batch,   ///< batch products, each with its own A, B and C
};

/// @brief Extents of (grouped-query) causal attention, shared with the CPU kernels.
using attention_extents = cpu::attention_shape;

/// @brief One compute task, decoded.
struct kernel_call {
  ir::op fn = ir::op::none;
  const ir::task* task = nullptr;              ///< for messages
  std::array<ir::buffer_id, 6> in{-1, -1, -1, -1, -1, -1}; ///< reads, in the op's order
  std::array<ir::buffer_id, 4> out{-1, -1, -1, -1};        ///< writes, in the op's order
  std::uint8_t n_in = 0, n_out = 0;
  std::size_t n = 0;             ///< values per operand (elementwise), or of the output
  std::size_t rows = 0, cols = 0; ///< row-wise ops, losses, broadcasts: [rows, cols]
  bool accumulate = false;       ///< add to the output instead of overwriting it
  // matmul
  std::size_t m = 0, k = 0, gemm_n = 0, batch = 1; ///< batch: also a transpose's dims before its pair
  bool trans_a = false, trans_b = false;
  gemm_form form = gemm_form::single;
  // attention
  attention_extents att{};
  // rope: rows are tokens of `cols` values, each `cols / head_dim` heads
  std::size_t head_dim = 0;
  double theta = 10000.0;
  // embedding, vocab-parallel cross-entropy: the first row / column this rank holds
  std::int64_t first = 0;
  bool reject_outside = false;   ///< embedding: an id outside the table is an error (an unsplit table)
  std::size_t ids = 0;           ///< integer values read (ids, targets, labels, positions)
  std::int64_t replicas = 1;     ///< grad_sq_norm: ranks holding the same gradient values
  ir::buffer_id grad_norm_sq = -1; ///< an update with global-norm clipping: the step's squared gradient norm
  /// An update under a 16-bit policy: the parameter's working copy (bf16, f16), its last write,
  /// which it leaves holding the updated f32 master rounded (ir/precision.hpp).
  ir::buffer_id working = -1;
  /// Under dynamic loss scaling (ir::precision_policy::loss_scaling): the step's loss scale, one
  /// f32 the step writes before it runs (ir::loss_scale_buffer). A loss gradient (cross_entropy_grad,
  /// vocab_ce_grad, mse_grad, moe_route_grad) multiplies what it writes by it; an update (which
  /// then also reads grad_norm_sq) skips when runtime::overflowed(norm²), else scales its gradient
  /// by runtime::gradient_factor(clip_norm, norm², scale).
  ir::buffer_id loss_scale = -1;
  float scale = 1.0f;            ///< scale's factor; a loss's share of the global mean (times dloss for a gradient)
  bool keep = true;              ///< keep_one: this rank keeps the value (others hold zero)
  bool from_running = false;     ///< batchnorm_scale in evaluation: from the running statistics, not a batch's sums
  std::vector<rows_in_whole> parts; ///< slice / concat / shard_slice: the parts' geometry (bytes)
  cpu::moe_shape moe{};          ///< the MoE ops: groups, tokens per group, experts, hidden, capacity, top_k
  ir::conv_geometry conv{};      ///< conv2d, pooling and their gradients: the image, the kernel (or window), stride and padding
  ir::dim_part part{};           ///< concat_dim, slice_dim and their gradients: the parts of the dim
  dropout_layout drop{};         ///< dropout and its gradient: this rank's block of the whole tensor, how it draws
  std::size_t count = 0;         ///< batch normalisation: the rows its statistics are over (every rank's when synchronised)
  /// Values of its bf16 and f16 operands (each buffer once, an update's working copy aside): the
  /// CPU dispatch widens them into f32 workspace before the kernel and rounds the written ones back
  /// after it (runtime/dispatch.hpp); the GPU dispatch does so for the ops whose kernels do not read
  /// 16-bit values in place (cuda::reads_16bit_natively).
  std::size_t staged = 0;

  [[nodiscard]] ir::buffer_id read(std::size_t i) const noexcept { return in[i]; }
  [[nodiscard]] ir::buffer_id write(std::size_t i) const noexcept { return out[i]; }
};

namespace detail {

inline std::string task_ref(const ir::task& t) { return "task " + std::to_string(t.id) + " '" + t.name + "'"; }

/// Reads a task against the buffers of its graph, with messages naming the task, its fn and the operand.
class call_reader {
public:
  call_reader(const ir::graph& g, const ir::task& t, std::span<const int> coords) : g_(g), t_(t), coords_(coords) {}

  [[nodiscard]] std::string ref() const { return task_ref(t_) + " (fn '" + std::string(ir::to_string(t_.fn)) + "')"; }
  [[noreturn]] void bad(const std::string& why) const { fail(ref() + ": " + why); }

  [[nodiscard]] const ir::buffer& buffer(ir::buffer_id b) const { return g_.buffers.at(static_cast<std::size_t>(b)); }
  [[nodiscard]] std::size_t count(ir::buffer_id b) const {
    const auto& buf = buffer(b);
    return static_cast<std::size_t>(buf.bytes) / std::max<std::size_t>(ir::size_of(buf.type), 1);
  }
  [[nodiscard]] bool is_int(ir::buffer_id b) const {
    const auto ty = buffer(b).type;
    return ty == ir::dtype::i32 || ty == ir::dtype::i64;
  }
  [[nodiscard]] std::string operand(const ir::operand_list& l, std::size_t i, ir::buffer_id b) const {
    const auto k = std::min<std::size_t>(i, static_cast<std::size_t>(std::max<int>(l.count - 1, 0)));
    // Appended piece by piece: g++ 12 warns falsely (-Wrestrict) on a chain of + here.
    std::string out(1, '`');
    out += l.names[k];
    out += "` ('";
    out += buffer(b).name;
    out += "')";
    return out;
  }
  /// Operand kinds: floating point (f32, or a 16-bit float: bf16 or f16, which a dispatch widens
  /// to f32 for the kernel and rounds back: kernel_call::staged), integer.
  void need_float(const kernel_call& c, std::size_t i, bool write) const {
    const auto& l = write ? ir::info(t_.fn).writes : ir::info(t_.fn).reads;
    const auto b = write ? c.out[i] : c.in[i];
    const auto ty = buffer(b).type;
    if (ty == ir::dtype::f32 || ir::is_16bit_float(ty)) return;
    bad(operand(l, i, b) + " holds " + std::string(ir::to_string(ty)) + ", the op takes f32, bf16 or f16");
  }
  void need_int(const kernel_call& c, std::size_t i) const {
    if (!is_int(c.in[i]))
      bad(operand(ir::info(t_.fn).reads, i, c.in[i]) + " holds " + std::string(ir::to_string(buffer(c.in[i]).type)) +
          "; it must hold i32 or i64 ids");
  }
  /// Throws unless operand i (a read, or a write) holds `expected` values.
  void need_count(const kernel_call& c, std::size_t i, bool write, std::size_t expected, const char* because) const {
    const auto& l = write ? ir::info(t_.fn).writes : ir::info(t_.fn).reads;
    const auto b = write ? c.out[i] : c.in[i];
    if (count(b) != expected)
      bad(operand(l, i, b) + " holds " + std::to_string(count(b)) + " values, " + because + " need " +
          std::to_string(expected));
  }
  [[nodiscard]] std::size_t attr(const char* key, std::int64_t fallback = -1) const {
    const auto v = t_.attr(key, fallback);
    if (v < 0) bad("needs a non-negative attr '" + std::string(key) + "'");
    return static_cast<std::size_t>(v);
  }
  [[nodiscard]] std::size_t positive_attr(const char* key, std::int64_t fallback = -1) const {
    const auto v = attr(key, fallback);
    if (v == 0) bad("attr '" + std::string(key) + "' is 0");
    return v;
  }
  [[nodiscard]] std::size_t divide(std::size_t total, std::size_t by, const char* what) const {
    if (by == 0 || total % by != 0)
      bad(std::to_string(total) + " values are not a whole number of " + what + " of " + std::to_string(by));
    return total / by;
  }
  [[nodiscard]] float ratio(const char* num, const char* den) const {
    const auto d = t_.attr(den, 1);
    if (d == 0) bad("attr '" + std::string(den) + "' is 0");
    return static_cast<float>(static_cast<double>(t_.attr(num, 1)) / static_cast<double>(d));
  }
  /// This rank's coordinate on the mesh axis named by attr `key` (0 when absent, -1, or no coords).
  [[nodiscard]] std::int64_t coord(const char* key) const {
    const auto a = t_.attr(key, -1);
    if (a < 0 || coords_.empty()) return 0;
    if (static_cast<std::size_t>(a) >= coords_.size())
      bad("attr " + std::string(key) + " = " + std::to_string(a) + " but the mesh has " + std::to_string(coords_.size()) +
          " axes");
    return coords_[static_cast<std::size_t>(a)];
  }
  [[nodiscard]] const ir::task& task() const noexcept { return t_; }
  [[nodiscard]] const ir::graph& graph() const noexcept { return g_; }

private:
  const ir::graph& g_;
  const ir::task& t_;
  std::span<const int> coords_;
};

inline void decode_matmul(const call_reader& r, kernel_call& c) {
  const auto& t = r.task();
  c.m = r.attr("m");
  c.gemm_n = r.attr("n");
  c.k = r.attr("k");
  c.batch = r.attr("batch", 1);
  c.trans_a = t.attr("trans_a") != 0;
  c.trans_b = t.attr("trans_b") != 0;
  c.accumulate = t.attr("accumulate") != 0;
  for (std::size_t i = 0; i < 2; ++i) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  if (c.accumulate && (c.n_in < 3 || c.in[2] != c.out[0]))
    r.bad("accumulates into `c`, so `c` must also be its third read");
  if (c.batch > 1 && r.count(c.in[1]) == c.k * c.gemm_n && !c.trans_a) {
    c.form = gemm_form::shared_b; // one taller product
  } else if (c.batch > 1 && r.count(c.out[0]) == c.m * c.gemm_n && c.trans_a && !c.trans_b) {
    c.form = gemm_form::summed_batch;
  } else {
    c.form = c.batch > 1 ? gemm_form::strided_batch : gemm_form::single;
  }
  const auto b_batch = c.form == gemm_form::shared_b ? 1 : c.batch, c_batch = c.form == gemm_form::summed_batch ? 1 : c.batch;
  r.need_count(c, 0, false, c.batch * c.m * c.k, "m·k·batch");
  r.need_count(c, 1, false, b_batch * c.k * c.gemm_n, "k·n·batch");
  r.need_count(c, 0, true, c_batch * c.m * c.gemm_n, "m·n·batch");
}

// Every read and write holds n fp32 values (x, y, out; a gradient of any of them).
inline void decode_same_size(const call_reader& r, kernel_call& c) {
  c.n = r.count(c.out[0]);
  for (std::size_t i = 0; i < c.n_in; ++i) {
    r.need_float(c, i, false);
    r.need_count(c, i, false, c.n, "the output's values");
  }
  for (std::size_t i = 0; i < c.n_out; ++i) r.need_float(c, i, true);
}

// x [rows, cols] with `vectors` operands of cols values from index `vector` (bias, gain and
// shift) and [rows, cols] for the other operands.
inline void decode_rows(const call_reader& r, kernel_call& c, std::size_t x, std::size_t vector, bool vector_is_write,
                        std::size_t vectors = 1) {
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  for (std::size_t i = 0; i < c.n_out; ++i) r.need_float(c, i, true);
  c.cols = r.count(vector_is_write ? c.out[vector] : c.in[vector]);
  c.rows = r.divide(r.count(c.in[x]), c.cols, "rows");
  c.n = c.rows * c.cols;
  const auto is_vector = [&](std::size_t i, bool write) { return write == vector_is_write && i >= vector && i < vector + vectors; };
  for (std::size_t i = 0; i < c.n_in; ++i)
    r.need_count(c, i, false, is_vector(i, false) ? c.cols : c.n, is_vector(i, false) ? "one value per column" : "rows·cols");
  for (std::size_t i = 0; i < c.n_out; ++i)
    r.need_count(c, i, true, is_vector(i, true) ? c.cols : c.n, is_vector(i, true) ? "one value per column" : "rows·cols");
  c.accumulate = r.task().attr("accumulate") != 0;
}

// Softmax rows: cols from attr `cols`, else the last dimension of the first read.
inline void decode_softmax(const call_reader& r, kernel_call& c) {
  decode_same_size(r, c);
  const auto& shape = r.buffer(c.in[0]).shape;
  c.cols = r.positive_attr("cols", shape.empty() ? -1 : shape.back());
  c.rows = r.divide(c.n, c.cols, "rows");
}

// swiglu_grad: gate, up and dout of n values each; one write holding dgate then dup.
inline void decode_packed_pair(const call_reader& r, kernel_call& c) {
  c.n = r.count(c.in[0]);
  for (std::size_t i = 0; i < c.n_in; ++i) {
    r.need_float(c, i, false);
    r.need_count(c, i, false, c.n, "the gate's values");
  }
  r.need_float(c, 0, true);
  r.need_count(c, 0, true, 2 * c.n, "the two gradients one after the other");
}

// rope / rope_grad: x (or dout) [rows, cols] and one integer position per row.
inline void decode_rope(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_int(c, 1);
  r.need_float(c, 0, true);
  c.n = r.count(c.in[0]);
  c.ids = c.rows = r.count(c.in[1]);
  c.cols = r.divide(c.n, c.rows, "values per position");
  r.need_count(c, 0, true, c.n, "the input's values");
  c.head_dim = static_cast<std::size_t>(r.positive_attr("head_dim"));
  if (c.head_dim % 2 != 0 || c.cols % c.head_dim != 0)
    r.bad("head_dim " + std::to_string(c.head_dim) + " must be even and divide the " + std::to_string(c.cols) +
          " values of a position");
  c.theta = static_cast<double>(r.positive_attr("theta"));
}

inline void decode_attention(const call_reader& r, kernel_call& c) {
  const auto& t = r.task();
  auto& a = c.att;
  a.causal = t.attr("causal", 1) != 0;
  a.batch = r.positive_attr("batch", 1);
  a.seq = r.positive_attr("seq");
  a.heads = r.positive_attr("heads");
  a.head_dim = r.positive_attr("head_dim");
  a.kv_heads = r.positive_attr("kv_heads", static_cast<std::int64_t>(a.heads));
  a.group = r.positive_attr("group", 1);
  const auto coord = static_cast<std::size_t>(r.coord("head_axis"));
  a.first_head = coord * a.heads;
  a.kv_first_head = t.attr("kv_split", 1) != 0 ? coord * a.kv_heads : 0;
  if (a.first_head / a.group < a.kv_first_head || a.kv_of(a.heads - 1) >= a.kv())
    r.bad("q heads [" + std::to_string(a.first_head) + ", " + std::to_string(a.first_head + a.heads) + ") in groups of " +
          std::to_string(a.group) + " read kv heads this rank does not hold (" + std::to_string(a.kv_heads) +
          " from kv head " + std::to_string(a.kv_first_head) + ")");
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  r.need_count(c, 0, false, a.q_floats(), "batch·seq·heads·head_dim");
  r.need_count(c, 1, false, a.kv_floats(), "batch·seq·kv_heads·head_dim");
  r.need_count(c, 2, false, a.kv_floats(), "batch·seq·kv_heads·head_dim");
  if (c.fn == ir::op::attention) {
    r.need_count(c, 0, true, a.q_floats(), "batch·seq·heads·head_dim");
  } else {
    r.need_count(c, 3, false, a.q_floats(), "batch·seq·heads·head_dim");
    r.need_count(c, 0, true, a.q_floats() + 2 * a.kv_floats(), "dq, dk and dv one after the other");
  }
}

inline void decode_embedding(const call_reader& r, kernel_call& c) {
  const auto& t = r.task();
  r.need_int(c, 0);
  r.need_float(c, 1, false);
  r.need_float(c, 0, true);
  c.ids = r.count(c.in[0]);
  const auto big = c.fn == ir::op::embedding ? c.out[0] : c.in[1];
  const auto table = c.fn == ir::op::embedding ? c.in[1] : c.out[0];
  c.cols = r.positive_attr("hidden", c.ids == 0 ? 1 : static_cast<std::int64_t>(r.count(big) / c.ids));
  c.rows = r.divide(r.count(table), c.cols, "table rows");
  if (r.count(big) != c.ids * c.cols)
    r.bad("'" + r.buffer(big).name + "' holds " + std::to_string(r.count(big)) + " values, ids·hidden need " +
          std::to_string(c.ids * c.cols));
  // A table split over the vocabulary (`vocab_axis`, the DSL) holds rows [coord·vocab, ...);
  // ids outside give zero rows, and an all-reduce of the outputs completes the lookup.
  const bool vocab_split = t.attr("vocab_axis", -1) >= 0;
  c.reject_outside = !vocab_split && t.attr("sharded") == 0;
  c.first = vocab_split ? r.coord("vocab_axis") * t.attr("vocab", 0) : t.attr("first_row", 0);
  c.accumulate = t.attr("accumulate") != 0;
}

// Mean over `global` values (every rank's; default: this rank's), so that a data-parallel loss
// is a sum of the ranks' values and its gradient needs no rescaling.
inline float loss_share(const call_reader& r, std::size_t here, const char* global_key) {
  const auto global = r.task().attr(global_key, static_cast<std::int64_t>(here));
  if (global <= 0) r.bad("attr '" + std::string(global_key) + "' must be positive");
  return static_cast<float>(static_cast<double>(here) / static_cast<double>(global));
}

inline void decode_cross_entropy(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_int(c, 1);
  r.need_float(c, 0, true);
  c.ids = c.rows = r.count(c.in[1]);
  if (c.rows == 0) r.bad("the mean over rows needs at least one row");
  c.cols = r.divide(r.count(c.in[0]), c.rows, "rows");
  c.scale = loss_share(r, c.rows, "global_rows");
  if (c.fn == ir::op::cross_entropy) {
    if (r.count(c.out[0]) == 0) r.bad("the loss buffer holds no value");
  } else {
    c.scale *= r.ratio("dloss_num", "dloss_den");
    r.need_count(c, 0, true, r.count(c.in[0]), "the logits' values");
  }
}

inline void decode_mse(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_float(c, 1, false);
  r.need_float(c, 0, true);
  c.n = r.count(c.in[0]);
  r.need_count(c, 1, false, c.n, "the prediction's values");
  c.scale = loss_share(r, c.n, "global_n");
  if (c.fn == ir::op::mse) {
    if (r.count(c.out[0]) == 0) r.bad("the loss buffer holds no value");
  } else {
    c.scale *= r.ratio("dloss_num", "dloss_den");
    r.need_count(c, 0, true, c.n, "the prediction's values");
  }
}

// Megatron-LM's vocabulary-parallel cross-entropy over this rank's columns [coord·cols, ...).
inline void decode_vocab_ce(const call_reader& r, kernel_call& c) {
  const auto& t = r.task();
  for (std::size_t i = 0; i < c.n_in; ++i)
    if (c.fn == ir::op::vocab_ce_loss || i != 1 || c.fn == ir::op::vocab_ce_sumexp) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  if (c.fn == ir::op::vocab_ce_loss) {
    c.rows = r.count(c.in[0]);
    r.need_count(c, 1, false, c.rows, "the rows of sumexp");
    if (r.count(c.out[0]) == 0) r.bad("the loss buffer holds no value");
    c.scale = 1.0f / static_cast<float>(t.attr("global_rows", static_cast<std::int64_t>(c.rows)));
    return;
  }
  c.cols = r.positive_attr("cols");
  c.rows = r.divide(r.count(c.in[0]), c.cols, "rows");
  r.need_count(c, 0, true, c.fn == ir::op::vocab_ce_grad ? c.rows * c.cols : c.rows,
               c.fn == ir::op::vocab_ce_grad ? "the logits' values" : "one value per row");
  if (c.fn == ir::op::vocab_ce_max) return;
  if (c.fn != ir::op::vocab_ce_sumexp) {
    r.need_int(c, 1);
    c.ids = r.count(c.in[1]);
    if (c.ids != c.rows) r.bad(std::to_string(c.ids) + " labels for " + std::to_string(c.rows) + " rows");
    c.first = r.coord("vocab_axis") * static_cast<std::int64_t>(c.cols);
  }
  const std::size_t max_at = c.fn == ir::op::vocab_ce_sumexp ? 1 : 2;
  r.need_count(c, max_at, false, c.rows, "one value per row");
  if (c.fn == ir::op::vocab_ce_grad) {
    r.need_count(c, 3, false, c.rows, "one value per row");
    c.scale = r.ratio("dloss_num", "dloss_den") / static_cast<float>(t.attr("global_rows", static_cast<std::int64_t>(c.rows)));
  }
}

// The MoE ops (runtime/cpu/moe.hpp): tokens in groups of attr `group`, dense gates [tokens,
// experts], expert buffers [experts, groups·capacity, hidden]; hidden follows from the buffers.
inline void decode_moe(const call_reader& r, kernel_call& c) {
  using ir::op;
  auto& s = c.moe;
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  for (std::size_t i = 0; i < c.n_out; ++i) r.need_float(c, i, true);
  s.experts = r.positive_attr("experts");
  const bool routing = c.fn == op::moe_route || c.fn == op::moe_route_grad;
  // The gates (or logits) operand: [tokens, experts].
  const std::size_t gates_at = routing ? 0 : 1;
  const auto tokens = r.divide(r.count(c.in[gates_at]), s.experts, "rows of experts");
  s.group = r.positive_attr("group");
  s.groups = r.divide(tokens, s.group, "groups of tokens");
  if (routing) {
    s.top_k = r.positive_attr("top_k");
    if (s.top_k > s.experts)
      r.bad("top_k " + std::to_string(s.top_k) + " is more than the " + std::to_string(s.experts) + " experts");
  }
  if (c.fn == op::moe_route) {
    s.capacity = r.positive_attr("capacity");
    r.need_count(c, 0, true, tokens * s.experts, "tokens·experts");
    return;
  }
  if (c.fn == op::moe_route_grad) {
    for (std::size_t i = 1; i < c.n_in; ++i) r.need_count(c, i, false, tokens * s.experts, "tokens·experts");
    r.need_count(c, 0, true, tokens * s.experts, "tokens·experts");
    // The balance loss's weight over the step's groups (its mean), times dloss.
    const auto weight_den = r.task().attr("weight_den", 1);
    if (weight_den <= 0 || r.task().attr("weight_num", 0) < 0) r.bad("the balance loss weight must be a non-negative ratio");
    c.scale = r.ratio("weight_num", "weight_den") * r.ratio("dloss_num", "dloss_den") /
              static_cast<float>(r.positive_attr("global_groups", static_cast<std::int64_t>(s.groups)));
    return;
  }
  s.capacity = r.positive_attr("capacity");
  // The token-major operand gives hidden: x (dispatch), dx (dispatch_grad), out (combine), dout (combine_grad).
  const auto token_values = c.fn == op::moe_dispatch        ? r.count(c.in[0])
                            : c.fn == op::moe_combine_grad ? r.count(c.in[2])
                                                           : r.count(c.out[0]);
  s.hidden = r.divide(token_values, tokens, "tokens' values");
  // The slot rows' layout: chunk-major in `slot_chunks` chunks where the planner split the exchanges.
  s.chunks = r.positive_attr("slot_chunks", 1);
  if (s.slots() % s.chunks != 0)
    r.bad("the " + std::to_string(s.slots()) + " slots per expert do not divide into " + std::to_string(s.chunks) +
          " chunks (slot_chunks)");
  const auto expert_values = s.experts * s.slots() * s.hidden;
  switch (c.fn) {
  case op::moe_dispatch: r.need_count(c, 0, true, expert_values, "experts·groups·capacity·hidden"); break;
  case op::moe_dispatch_grad:
  case op::moe_combine: r.need_count(c, 0, false, expert_values, "experts·groups·capacity·hidden"); break;
  case op::moe_combine_grad:
    r.need_count(c, 0, false, expert_values, "experts·groups·capacity·hidden");
    r.need_count(c, 0, true, expert_values + tokens * s.experts, "dy and dgates one after the other");
    break;
  default: break;
  }
}

// transpose: x [rows, cols, inner] (attrs) to out [cols, rows, inner].
inline void decode_transpose(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_float(c, 0, true);
  c.batch = r.positive_attr("outer", 1); // the dims before the pair (1: the pair leads)
  c.rows = r.positive_attr("rows");
  c.cols = r.positive_attr("cols");
  c.k = r.positive_attr("inner");
  c.n = c.batch * c.rows * c.cols * c.k;
  r.need_count(c, 0, false, c.n, "outer·rows·cols·inner");
  r.need_count(c, 0, true, c.n, "outer·rows·cols·inner");
  if (c.in[0] == c.out[0]) r.bad("transposes into its own input");
}

// A window task's geometry (a convolution's or a pooling's: ir::conv_geometry's attrs, padding
// the one that may be 0), its operands f32.
inline ir::conv_geometry read_window_task(const call_reader& r, const kernel_call& c) {
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  return ir::conv_geometry::read([&](const char* key, std::int64_t fallback) {
    return static_cast<std::int64_t>(key == std::string_view("padding") ? r.attr(key, fallback) : r.positive_attr(key, fallback));
  });
}

// conv2d (x, w -> y), conv2d_grad_input (dy, w -> dx), conv2d_grad_weight (x, dy -> dw): each
// operand holds the values its geometry gives it.
inline void decode_convolution(const call_reader& r, kernel_call& c) {
  const auto& g = c.conv = read_window_task(r, c);
  if (g.out_h() < 1 || g.out_w() < 1)
    r.bad("a kernel of " + std::to_string(g.kernel_h) + "x" + std::to_string(g.kernel_w) + " at stride " +
          std::to_string(g.stride) + " with padding " + std::to_string(g.padding) + " does not fit an image of " +
          std::to_string(g.height) + "x" + std::to_string(g.width));
  const auto x = static_cast<std::size_t>(g.x_values()), w = static_cast<std::size_t>(g.w_values()),
             y = static_cast<std::size_t>(g.y_values());
  constexpr auto image = "batch·height·width·in_channels", kernel = "kernel_h·kernel_w·in_channels·out_channels",
                 output = "batch·out_h·out_w·out_channels";
  switch (c.fn) {
  case ir::op::conv2d:
    r.need_count(c, 0, false, x, image);
    r.need_count(c, 1, false, w, kernel);
    r.need_count(c, 0, true, y, output);
    break;
  case ir::op::conv2d_grad_input:
    r.need_count(c, 0, false, y, output);
    r.need_count(c, 1, false, w, kernel);
    r.need_count(c, 0, true, x, image);
    break;
  default:
    r.need_count(c, 0, false, x, image);
    r.need_count(c, 1, false, y, output);
    r.need_count(c, 0, true, w, kernel);
    c.accumulate = r.task().attr("accumulate") != 0;
    break;
  }
  c.n = r.count(c.out[0]);
}

// dropout and dropout_grad (x -> y): this rank's block of the whole tensor from the extents and
// the coordinates on the axes splitting each dim, the rate, and the key (the seed, and in a
// pipelined step the micro-batch, which draws its own mask).
inline void decode_dropout(const call_reader& r, kernel_call& c) {
  auto& l = c.drop;
  const auto rank = r.positive_attr("rank");
  if (rank > dropout_layout::max_dims)
    r.bad("has rank " + std::to_string(rank) + "; dropout takes up to " + std::to_string(dropout_layout::max_dims) + " dims");
  l.rank = static_cast<int>(rank);
  std::int64_t values = 1, stride = 1;
  for (int d = l.rank - 1; d >= 0; --d) {
    const auto k = std::to_string(d);
    const auto local = static_cast<std::int64_t>(r.positive_attr(("local" + k).c_str()));
    const auto global = static_cast<std::int64_t>(r.positive_attr(("global" + k).c_str()));
    const auto block = r.coord(("major" + k).c_str()) * static_cast<std::int64_t>(r.attr(("minor_size" + k).c_str(), 1)) +
                       r.coord(("minor" + k).c_str());
    l.local[d] = local;
    l.offset[d] = block * local;
    l.global_stride[d] = stride;
    if (l.offset[d] + local > global)
      r.bad("its block [" + std::to_string(l.offset[d]) + ", " + std::to_string(l.offset[d] + local) + ") of dim " + k +
            " runs past the whole tensor's " + std::to_string(global));
    stride *= global;
    values *= local;
  }
  const auto num = static_cast<std::int64_t>(r.attr("num")), den = static_cast<std::int64_t>(r.attr("den"));
  if (den != ir::fraction_den || num >= den)
    r.bad("rate num / den = " + std::to_string(num) + " / " + std::to_string(den) + " is not a fraction in [0, 1) over 2^24");
  l.threshold = static_cast<std::uint32_t>(num);
  l.scale = static_cast<float>(static_cast<double>(den) / static_cast<double>(den - num));
  l.key = mix64(static_cast<std::uint64_t>(r.attr("seed"))) ^ mix64(static_cast<std::uint64_t>(r.task().attr("microbatch", -1) + 1) << 32);
  r.need_float(c, 0, false);
  r.need_float(c, 0, true);
  r.need_count(c, 0, false, static_cast<std::size_t>(values), "the block's values (local0·local1·…)");
  r.need_count(c, 0, true, static_cast<std::size_t>(values), "the block's values (local0·local1·…)");
  c.n = static_cast<std::size_t>(values);
}

// max_pool, avg_pool (x -> y) and their gradients (max: x, dy -> dx; avg: dy -> dx): a
// convolution's geometry whose kernel is the window over the image's channels.
inline void decode_pooling(const call_reader& r, kernel_call& c) {
  const auto& g = c.conv = read_window_task(r, c);
  if (g.in_channels != g.out_channels || g.kernel_h != g.kernel_w)
    r.bad("pools a square window over the channels it keeps (kernel_h = kernel_w, in_channels = out_channels)");
  if (g.out_h() < 1 || g.out_w() < 1 || 2 * g.padding > g.kernel_h)
    r.bad("a window of " + std::to_string(g.kernel_h) + " at stride " + std::to_string(g.stride) + " with padding " +
          std::to_string(g.padding) + " does not fit an image of " + std::to_string(g.height) + "x" + std::to_string(g.width) +
          " (or is padding for more than half of it)");
  const auto x = static_cast<std::size_t>(g.x_values()), y = static_cast<std::size_t>(g.y_values());
  constexpr auto image = "batch·height·width·channels", output = "batch·out_h·out_w·channels";
  const bool forward = c.fn == ir::op::max_pool || c.fn == ir::op::avg_pool;
  if (forward) {
    r.need_count(c, 0, false, x, image);
  } else {
    if (c.fn == ir::op::max_pool_grad) r.need_count(c, 0, false, x, image);
    r.need_count(c, c.n_in - 1, false, y, output);
  }
  r.need_count(c, 0, true, forward ? y : x, forward ? output : image);
  c.n = forward ? y : x;
}

// concat_dim (a, b -> out), slice_dim (x -> part) and their gradients (dy -> a part; dpart -> dx):
// the whole holds lead·outer·extent·inner values, a part its length (a repeated one without lead).
inline void decode_dim_parts(const call_reader& r, kernel_call& c) {
  auto& g = c.part;
  g = ir::dim_part::read([&](const char* key, std::int64_t fallback) {
    return static_cast<std::int64_t>(std::string_view(key) == "offset" || std::string_view(key) == "broadcast"
                                         ? r.attr(key, fallback)
                                         : r.positive_attr(key, fallback));
  });
  const bool joins = c.fn == ir::op::concat_dim;
  if (g.offset + g.length > g.extent || (joins && g.length >= g.extent) || g.broadcast < 0 || g.broadcast > (joins ? 3 : 1))
    r.bad("its part [" + std::to_string(g.offset) + ", " + std::to_string(g.offset + g.length) + ") of an extent of " +
          std::to_string(g.extent) + " (broadcast " + std::to_string(g.broadcast) + ") is not a part of the dim");
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  const auto whole = static_cast<std::size_t>(g.whole_values()), part = static_cast<std::size_t>(g.part_values(g.length));
  constexpr auto whole_text = "lead·outer·extent·inner", part_text = "(lead·)outer·length·inner";
  switch (c.fn) {
  case ir::op::concat_dim:
    r.need_count(c, 0, false, part, part_text);
    r.need_count(c, 1, false, static_cast<std::size_t>(g.part_values(g.extent - g.length, 1)), "(lead·)outer·(extent − length)·inner");
    r.need_count(c, 0, true, whole, whole_text);
    break;
  case ir::op::slice_dim_grad:
    r.need_count(c, 0, false, part, part_text);
    r.need_count(c, 0, true, whole, whole_text);
    break;
  default: // slice_dim, concat_dim_grad
    r.need_count(c, 0, false, whole, whole_text);
    r.need_count(c, 0, true, part, part_text);
    break;
  }
  c.n = r.count(c.out[0]);
}

// sum_dim / mean_dim: x [outer, extent, inner] -> out [outer, inner]; their gradients the
// reverse. rows = outer, k = extent, cols = inner; scale = num / den.
inline void decode_reduce_dim(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_float(c, 0, true);
  c.rows = r.attr("outer");
  c.k = r.attr("extent");
  c.cols = r.attr("inner");
  c.scale = r.ratio("num", "den");
  const bool forward = c.fn == ir::op::sum_dim || c.fn == ir::op::mean_dim;
  const auto whole = c.rows * c.k * c.cols, reduced = c.rows * c.cols;
  r.need_count(c, 0, false, forward ? whole : reduced, forward ? "outer·extent·inner" : "outer·inner");
  r.need_count(c, 0, true, forward ? reduced : whole, forward ? "outer·inner" : "outer·extent·inner");
  c.n = forward ? reduced : whole;
}

// The batch normalisation's tasks over an image of rows × cols (channels): each operand holds the
// image's values, a value per channel, or the sums [2, cols] / the scale [3, cols].
inline void decode_batchnorm(const call_reader& r, kernel_call& c) {
  c.rows = r.attr("rows");
  c.cols = r.positive_attr("cols");
  c.count = r.positive_attr("count");
  c.n = c.rows * c.cols;
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  r.need_float(c, 0, true);
  // What each operand is, so that a message names it by its role, not by its count (which
  // coincide when rows is 1, 2 or 3).
  struct operand {
    std::size_t values;
    const char* what;
  };
  const operand image{c.n, "rows·cols"}, sums{2 * c.cols, "2·cols (the sums)"}, scale{3 * c.cols, "3·cols (the scale)"},
      channels{c.cols, "cols"};
  const auto check = [&](std::initializer_list<operand> reads, operand write) {
    std::size_t i = 0;
    for (const auto& o : reads) r.need_count(c, i++, false, o.values, o.what);
    r.need_count(c, 0, true, write.values, write.what);
  };
  switch (c.fn) {
  case ir::op::batchnorm_stats: check({image}, sums); break;
  case ir::op::batchnorm_scale:
    c.from_running = r.task().attr("running", 0) != 0;
    check({sums, channels}, scale);
    break;
  case ir::op::batchnorm_track:
    check({sums, sums}, sums);
    if (c.out[0] != c.in[1]) r.bad("moves the running statistics in place: its write must be its second read");
    c.scale = r.ratio("num", "den");
    break;
  case ir::op::batchnorm: check({image, scale, channels}, image); break;
  case ir::op::batchnorm_grad_stats: check({image, scale, image}, sums); break;
  default: check({image, scale, sums, image}, image); break;
  }
}

inline void decode_update(const call_reader& r, kernel_call& c) {
  for (std::size_t i = 0; i < c.n_in; ++i) r.need_float(c, i, false);
  for (std::size_t i = 0; i < c.n_out; ++i) r.need_float(c, i, true);
  c.n = r.count(c.in[0]);
  // The optional last read: the squared global gradient norm that clipping scales by.
  // The optional last reads: the squared global gradient norm that clipping (or loss scaling)
  // scales by; the loss scale was taken off by take_loss_scale, and needs the norm.
  std::size_t values = c.n_in;
  if (std::size_t{c.n_in} + 1 == static_cast<std::size_t>(ir::info(c.fn).reads.count)) {
    c.grad_norm_sq = c.in[--values];
    r.need_count(c, values, false, 1, "one value (the squared gradient norm)");
  }
  for (std::size_t i = 1; i < values; ++i) r.need_count(c, i, false, c.n, "the parameter's values");
  for (std::size_t i = 0; i < c.n_out; ++i) r.need_count(c, i, true, c.n, "the parameter's values");
  if (c.out[0] != c.in[0]) r.bad("updates `param` in place: it must be its first read and its first write");
  if (ir::is_16bit_float(r.buffer(c.in[0]).type))
    r.bad("updates `param` in its f32 master; a 16-bit parameter is the master's working copy, its last write");
  // The working copy is the one 16-bit write: SGD's momentum, the other optional one, is f32.
  if (c.n_out > 1 && ir::is_16bit_float(r.buffer(c.out[c.n_out - 1]).type)) c.working = c.out[c.n_out - 1];
  if (c.fn == ir::op::adamw && (c.out[1] != c.in[2] || c.out[2] != c.in[3]))
    r.bad("updates `m` and `v` in place: its writes are param, m, v and its reads param, grad, m, v");
}

inline std::size_t bytes_of(const call_reader& r, ir::buffer_id b) { return static_cast<std::size_t>(r.buffer(b).bytes); }

// slice / concat: the explicit geometry of docs/decomposition.md ([outer, extent, inner] elements).
inline void decode_parts(const call_reader& r, kernel_call& c) {
  const bool slicing = c.fn == ir::op::slice;
  const auto whole = slicing ? c.in[0] : c.out[0];
  const auto elem = ir::size_of(r.buffer(whole).type);
  const auto outer = r.attr("outer"), inner = r.attr("inner") * elem, length = r.attr("length") * inner;
  const auto check = [&](ir::buffer_id part, const rows_in_whole& p) {
    if (p.outer * p.part_row != bytes_of(r, part) || (p.outer - 1) * p.whole_row + p.offset + p.part_row > bytes_of(r, whole))
      r.bad("its parts' extents (attrs outer, extent, inner, length, offset) run past buffer '" + r.buffer(part).name +
            "' or '" + r.buffer(whole).name + "'");
  };
  if (slicing) {
    const rows_in_whole p{outer, r.attr("extent") * inner, length, r.attr("offset") * inner, c.out[0]};
    check(c.out[0], p);
    c.parts = {p};
    return;
  }
  const auto parts = r.attr("parts", static_cast<std::int64_t>(r.task().reads.size()));
  if (parts != r.task().reads.size())
    r.bad("attr parts = " + std::to_string(parts) + " but the task reads " + std::to_string(r.task().reads.size()) +
          " buffer(s)");
  // attr extent: the whole's extent when the parts fill only its start (a padded copy).
  const auto filled = parts * r.attr("length"), extent = r.attr("extent", static_cast<std::int64_t>(filled));
  if (extent < filled)
    r.bad("attr extent = " + std::to_string(extent) + " is less than its parts' " + std::to_string(filled));
  for (std::size_t j = 0; j < parts; ++j) {
    const rows_in_whole p{outer, extent * inner, length, j * length, r.task().reads[j]};
    check(r.task().reads[j], p);
    c.parts.push_back(p);
  }
}

// shard_slice: the part of `src` along attr `dim` that this rank's coordinate on `mesh_axis` selects.
inline void decode_shard_slice(const call_reader& r, kernel_call& c) {
  const auto& sb = r.buffer(c.in[0]);
  const auto dim = r.attr("dim"), parts = r.positive_attr("parts");
  if (dim >= std::max<std::size_t>(sb.shape.size(), 1))
    r.bad("attr dim = " + std::to_string(dim) + " but '" + sb.name + "' has rank " + std::to_string(sb.shape.size()));
  const auto elem = ir::size_of(sb.type);
  std::size_t outer = 1, inner = elem;
  for (std::size_t d = 0; d < dim; ++d) outer *= static_cast<std::size_t>(sb.shape[d]);
  for (std::size_t d = dim + 1; d < sb.shape.size(); ++d) inner *= static_cast<std::size_t>(sb.shape[d]);
  const auto extent = sb.shape.empty() ? bytes_of(r, c.in[0]) / elem : static_cast<std::size_t>(sb.shape[dim]);
  const auto len = r.divide(extent, parts, "parts") * inner;
  const auto part = static_cast<std::size_t>(r.coord("mesh_axis"));
  if (part >= parts) r.bad("this rank's coordinate " + std::to_string(part) + " is not one of " + std::to_string(parts) + " parts");
  c.parts = {rows_in_whole{outer, extent * inner, len, part * len, c.out[0]}};
  if (bytes_of(r, c.out[0]) != outer * len)
    r.bad("`dst` ('" + r.buffer(c.out[0]).name + "') holds " + std::to_string(bytes_of(r, c.out[0])) + " bytes, its part " +
          std::to_string(outer * len));
}

// cast: the values of one float type in another (a lower working precision: ir/precision.hpp).
inline void decode_cast(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_float(c, 0, true);
  c.n = r.count(c.in[0]);
  r.need_count(c, 0, true, c.n, "its input's");
}

// The 16-bit float operands a kernel works on in f32 (each buffer once); byte moves and casts take none.
inline std::size_t staged_values(const call_reader& r, const kernel_call& c) {
  switch (c.fn) {
  case ir::op::copy: case ir::op::keep_one: case ir::op::slice: case ir::op::concat: case ir::op::shard_slice:
  case ir::op::zero: case ir::op::cast: return 0;
  default: break;
  }
  std::array<ir::buffer_id, 10> seen{};
  std::size_t n_seen = 0, values = 0;
  const auto add = [&](ir::buffer_id b) {
    // An update's working copy is written rounded, straight from the master: never widened.
    if (b < 0 || b == c.working || !ir::is_16bit_float(r.buffer(b).type) ||
        std::find(seen.begin(), seen.begin() + n_seen, b) != seen.begin() + n_seen)
      return;
    seen[n_seen++] = b;
    values += r.count(b);
  };
  for (std::size_t i = 0; i < c.n_in; ++i) add(c.in[i]);
  for (std::size_t i = 0; i < c.n_out; ++i) add(c.out[i]);
  return values;
}

// Dynamic loss scaling: an op that reads the loss scale has it as its last read when the step
// scales (ir::reads_loss_scale); it is taken off the operands the op's own decoding sees.
inline void take_loss_scale(const call_reader& r, kernel_call& c) {
  if (!ir::reads_loss_scale(c.fn) || c.n_in != static_cast<std::size_t>(ir::info(c.fn).reads.count)) return;
  const std::size_t last = c.n_in - 1;
  if (r.buffer(c.in[last]).type != ir::dtype::f32) r.bad("its loss scale ('" + r.buffer(c.in[last]).name + "') must be f32");
  r.need_count(c, last, false, 1, "one value (the loss scale)");
  c.loss_scale = c.in[last];
  c.in[last] = -1;
  c.n_in = static_cast<std::uint8_t>(last);
  if (ir::info(c.fn).form == ir::task_form::update && std::size_t{c.n_in} + 1 != static_cast<std::size_t>(ir::info(c.fn).reads.count))
    r.bad("reads a loss scale without the gradient norm that says whether the step overflowed");
}

// A gradient shard's squared norm (one value), counted once over its replicas.
inline void decode_grad_sq_norm(const call_reader& r, kernel_call& c) {
  r.need_float(c, 0, false);
  r.need_float(c, 0, true);
  c.n = r.count(c.in[0]);
  r.need_count(c, 0, true, 1, "one value");
  c.replicas = static_cast<std::int64_t>(r.positive_attr("replicas"));
}

inline void decode_copy(const call_reader& r, kernel_call& c) {
  if (bytes_of(r, c.in[0]) != bytes_of(r, c.out[0]))
    r.bad("copies " + std::to_string(bytes_of(r, c.in[0])) + " bytes into a buffer of " + std::to_string(bytes_of(r, c.out[0])));
  c.n = bytes_of(r, c.in[0]);
  if (c.fn == ir::op::keep_one) c.keep = r.coord("mesh_axis") == 0;
}

// The sizes and attrs of the call's op, checked against its operands.
inline void decode_operands(const call_reader& r, kernel_call& c) {
  using ir::op;
  const auto& t = r.task();
  switch (t.fn) {
  case op::matmul: detail::decode_matmul(r, c); break;
  case op::add:
  case op::gelu:
  case op::relu:
  case op::gelu_grad:
  case op::relu_grad:
  case op::add_inplace:
  case op::scale:
    detail::decode_same_size(r, c);
    if (t.fn == op::scale) c.scale = r.ratio("num", "den");
    break;
  case op::bias_add: detail::decode_rows(r, c, 0, 1, false); break;
  case op::bias_grad: detail::decode_rows(r, c, 0, 0, true); break;
  case op::scale_table: detail::decode_rows(r, c, 0, 1, false); break;
  case op::scale_table_grad: detail::decode_rows(r, c, 0, 0, true); break;
  case op::layernorm: detail::decode_rows(r, c, 0, 1, false, 2); break;
  case op::layernorm_grad: detail::decode_rows(r, c, 0, 1, false); break;
  case op::layernorm_grad_gamma: detail::decode_rows(r, c, 0, 0, true); break;
  case op::softmax:
  case op::softmax_grad: detail::decode_softmax(r, c); break;
  case op::attention:
  case op::attention_grad: detail::decode_attention(r, c); break;
  case op::embedding:
  case op::embedding_grad: detail::decode_embedding(r, c); break;
  case op::cross_entropy:
  case op::cross_entropy_grad: detail::decode_cross_entropy(r, c); break;
  case op::mse:
  case op::mse_grad: detail::decode_mse(r, c); break;
  case op::vocab_ce_max:
  case op::vocab_ce_target:
  case op::vocab_ce_sumexp:
  case op::vocab_ce_loss:
  case op::vocab_ce_grad: detail::decode_vocab_ce(r, c); break;
  case op::sgd:
  case op::adamw: detail::decode_update(r, c); break;
  case op::grad_sq_norm: detail::decode_grad_sq_norm(r, c); break;
  case op::zero: break;
  case op::copy:
  case op::keep_one: detail::decode_copy(r, c); break;
  case op::slice:
  case op::concat: detail::decode_parts(r, c); break;
  case op::shard_slice: detail::decode_shard_slice(r, c); break;
  case op::cast: detail::decode_cast(r, c); break;
  case op::silu:
  case op::silu_grad:
  case op::sigmoid:
  case op::sigmoid_grad:
  case op::tanh:
  case op::tanh_grad:
  case op::mul:
  case op::swiglu: detail::decode_same_size(r, c); break;
  case op::swiglu_grad: detail::decode_packed_pair(r, c); break;
  case op::rmsnorm: detail::decode_rows(r, c, 0, 1, false); break;
  case op::rmsnorm_grad: detail::decode_rows(r, c, 0, 1, false); break;
  case op::rmsnorm_grad_gain: detail::decode_rows(r, c, 0, 0, true); break;
  case op::rope:
  case op::rope_grad: detail::decode_rope(r, c); break;
  case op::moe_route:
  case op::moe_route_grad:
  case op::moe_dispatch:
  case op::moe_dispatch_grad:
  case op::moe_combine:
  case op::moe_combine_grad: detail::decode_moe(r, c); break;
  case op::transpose: detail::decode_transpose(r, c); break;
  case op::conv2d:
  case op::conv2d_grad_input:
  case op::conv2d_grad_weight: detail::decode_convolution(r, c); break;
  case op::sum_dim:
  case op::mean_dim:
  case op::sum_dim_grad:
  case op::mean_dim_grad: detail::decode_reduce_dim(r, c); break;
  case op::max_pool:
  case op::avg_pool:
  case op::max_pool_grad:
  case op::avg_pool_grad: detail::decode_pooling(r, c); break;
  case op::concat_dim:
  case op::slice_dim:
  case op::concat_dim_grad:
  case op::slice_dim_grad: detail::decode_dim_parts(r, c); break;
  case op::dropout:
  case op::dropout_grad: detail::decode_dropout(r, c); break;
  case op::batchnorm:
  case op::batchnorm_stats:
  case op::batchnorm_scale:
  case op::batchnorm_track:
  case op::batchnorm_grad_stats:
  case op::batchnorm_grad: detail::decode_batchnorm(r, c); break;
  // not compute ops, or priced only
  case op::none:
  case op::input:
  case op::data:
  case op::param:
  case op::state:
  case op::to:
  case op::repeat_in:
  case op::repeat_out:
  case op::select:
  case op::all_reduce:
  case op::all_gather:
  case op::reduce_scatter:
  case op::all_to_all:
  case op::send:
  case op::recv:
  case op::broadcast:
  case op::sum:
  case op::max:
  case op::min:
  case op::add_position:
  case op::position_embedding_grad:
  case op::transpose_blocks:
  case op::flatten: // views the lowering makes without a task
  case op::unflatten:
  case op::flatten_grad: r.bad("has no kernel to decode");
  }
}

} // namespace detail

/// @brief Decodes a compute task of `g` (see the file comment); `coords` is this rank's
/// coordinate on each mesh axis (kernel_settings::coords). Throws concerto::error naming the
/// task, its fn and the operand when the task does not fit its op.
[[nodiscard]] inline kernel_call decode(const ir::graph& g, const ir::task& t, std::span<const int> coords = {}) {
  const detail::call_reader r(g, t, coords);
  if (ir::is_collective(t.kind)) r.bad("is a " + std::string(ir::to_string(t.kind)) + ", not a compute kernel");
  const auto& op = ir::info(t.fn);
  if (op.role != ir::op_role::compute) r.bad("names no compute op");
  if (!op.executable) r.bad("no executor runs this op (it is priced in cost-only graphs only)");
  kernel_call c;
  c.fn = t.fn;
  c.task = &t;
  const auto take = [&](const std::vector<ir::buffer_id>& list, auto& into, std::uint8_t& n, const ir::operand_list& l,
                        const char* what) {
    if (list.size() < static_cast<std::size_t>(l.min()) || (!l.variadic && list.size() > static_cast<std::size_t>(l.count)))
      r.bad(std::string(what) + " " + std::to_string(list.size()) + " buffer(s), which its op does not take");
    // A variadic list (concat's parts, zero's outputs) is read from the task beyond the first few.
    n = static_cast<std::uint8_t>(std::min(list.size(), into.size()));
    for (std::size_t i = 0; i < n; ++i) into[i] = list[i];
  };
  take(t.reads, c.in, c.n_in, op.reads, "reads");
  take(t.writes, c.out, c.n_out, op.writes, "writes");
  detail::take_loss_scale(r, c);
  detail::decode_operands(r, c);
  c.staged = detail::staged_values(r, c);
  return c;
}


} // namespace concerto::runtime
