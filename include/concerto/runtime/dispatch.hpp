#pragma once
/// @file
/// @brief From a compute task (kind, fn, attrs, buffers) to a CPU kernel call.
///
/// A task's function is resolved once, before the first step (`resolve`), so that an unknown
/// function is reported with the task's name before anything runs and a step does no string
/// work. The operand conventions (which read is which) are the contract between the graph's
/// producers (the DSL lowering, ir::builder users, the benchmark workloads) and the executors;
/// docs/runtime.md lists them. Integer operands (token ids, targets) are found by their dtype,
/// not their position; ids and targets may be i32 or i64 (the DSL lowers `data` leaves as i64).
/// Extents come from the attrs where the kernel needs them (matmul, attention) and otherwise from
/// the buffer sizes, which the kernels check.
///
/// Two producers name these functions: ir::builder users (tests, benchmark workloads), whose
/// tasks write every saved statistic (layernorm's mean and rstd, attention's lse), and the DSL
/// lowering (docs/dsl-reference.md), whose tasks write only their result. For the latter the
/// statistics live in the scratch region for the duration of one kernel and are recomputed by the
/// backward kernel that needs them: this costs a second pass over a layernorm or attention
/// forward, and keeps the graph's buffers exactly what the lowering declared.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/task_operands.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::runtime {

/// @brief Every CPU kernel a compute task can name.
enum class kernel : std::uint8_t {
  gemm, add, add_inplace, scale, bias_add, bias_add_grad, gelu, gelu_grad, relu, relu_grad, zero,
  layernorm, layernorm_grad, softmax, softmax_grad, attention, attention_grad,
  cross_entropy, cross_entropy_grad, mse, mse_grad, embedding, embedding_grad,
  sgd, adamw, copy, slice, concat,
  layernorm_grad_gamma, shard_slice, keep_one,
  vocab_ce_max, vocab_ce_target, vocab_ce_sumexp, vocab_ce_loss, vocab_ce_grad,
};

namespace detail {
struct kernel_name {
  std::string_view fn;
  kernel k;
};
// Aliases first-class: "bias" and "bias_grad" are the DSL's op names, "matmul" and "" the
// builder's defaults, "causal_attention" the kernel's own name.
inline constexpr kernel_name kernel_names[] = {
    {"gemm", kernel::gemm}, {"matmul", kernel::gemm}, {"add", kernel::add}, {"add_inplace", kernel::add_inplace},
    {"accumulate", kernel::add_inplace}, {"scale", kernel::scale}, {"bias_add", kernel::bias_add},
    {"bias", kernel::bias_add}, {"bias_add_grad", kernel::bias_add_grad}, {"bias_grad", kernel::bias_add_grad},
    {"gelu", kernel::gelu}, {"gelu_grad", kernel::gelu_grad}, {"relu", kernel::relu}, {"relu_grad", kernel::relu_grad},
    {"zero", kernel::zero}, {"layernorm", kernel::layernorm}, {"layernorm_grad", kernel::layernorm_grad},
    {"softmax", kernel::softmax}, {"softmax_grad", kernel::softmax_grad}, {"attention", kernel::attention},
    {"causal_attention", kernel::attention}, {"attention_grad", kernel::attention_grad},
    {"causal_attention_grad", kernel::attention_grad}, {"cross_entropy", kernel::cross_entropy},
    {"cross_entropy_grad", kernel::cross_entropy_grad}, {"mse", kernel::mse}, {"mse_grad", kernel::mse_grad},
    {"embedding", kernel::embedding}, {"embedding_grad", kernel::embedding_grad}, {"sgd", kernel::sgd},
    {"adamw", kernel::adamw}, {"copy", kernel::copy}, {"slice", kernel::slice}, {"concat", kernel::concat},
    {"memcpy", kernel::copy}, {"identity", kernel::copy}, {"layernorm_grad_gamma", kernel::layernorm_grad_gamma},
    {"shard_slice", kernel::shard_slice}, {"keep_one", kernel::keep_one}, {"vocab_ce_max", kernel::vocab_ce_max},
    {"vocab_ce_target", kernel::vocab_ce_target}, {"vocab_ce_sumexp", kernel::vocab_ce_sumexp},
    {"vocab_ce_loss", kernel::vocab_ce_loss}, {"vocab_ce_grad", kernel::vocab_ce_grad},
};
} // namespace detail

/// @brief Every function name `resolve` accepts, for documentation and diagnostics.
[[nodiscard]] inline std::vector<std::string_view> known_functions() {
  std::vector<std::string_view> out;
  for (const auto& n : detail::kernel_names) out.push_back(n.fn);
  return out;
}

/// @brief The kernel a compute task runs; throws concerto::error naming the task and its fn
/// when no CPU kernel implements it (and for collectives, which are not kernels).
/// @code
/// for (const auto& t : g.tasks) if (!ir::is_collective(t.kind)) kernels[t.id] = runtime::resolve(t);
/// @endcode
[[nodiscard]] inline kernel resolve(const ir::task& t) {
  if (ir::is_collective(t.kind))
    fail(detail::task_ref(t) + " is a " + std::string(ir::to_string(t.kind)) + ", not a compute kernel");
  std::string_view fn = t.fn;
  if (fn.empty()) { // kinds whose kernel needs no name
    if (t.kind == ir::op_kind::matmul) return kernel::gemm;
    if (t.kind == ir::op_kind::copy) return kernel::copy;
    if (t.kind == ir::op_kind::slice) return kernel::slice;
    if (t.kind == ir::op_kind::concat) return kernel::concat;
  }
  for (const auto& n : detail::kernel_names)
    if (n.fn == fn) return n.k;
  std::string known;
  for (const auto& n : detail::kernel_names) known += (known.empty() ? "" : ", ") + std::string(n.fn);
  fail(detail::task_ref(t) + " (" + std::string(ir::to_string(t.kind)) + ") has fn '" + std::string(fn) +
       "', which no CPU kernel implements (known: " + known + ")");
}

/// @brief Run-time parameters of the kernels that attrs (integers) cannot carry.
struct kernel_settings {
  runtime::cpu::sgd_config sgd{};
  runtime::cpu::adamw_config adamw{};
  float layernorm_eps = 1e-5f;
  std::int64_t step = 1; ///< optimizer step, counting from 1 (AdamW bias correction); the executor sets it
  /// This rank's coordinate on each mesh axis of the graph (the backend fills it in prepare):
  /// `shard_slice`, `keep_one` and the vocabulary-sharded kernels (embedding with `vocab_axis`,
  /// `vocab_ce_target`, `vocab_ce_grad`) pick their part with it. Empty means coordinate 0 everywhere.
  std::vector<int> coords{};
};

/// @brief Workspace bytes the graph's kernels need at most: attention's score blocks, and for
/// the DSL's tasks the statistics they do not store (see the file comment) and i64 ids narrowed
/// to i32 for the CPU kernels.
[[nodiscard]] inline std::int64_t workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  const auto count = [&](ir::buffer_id b) {
    const auto& buf = g.buffers.at(static_cast<std::size_t>(b));
    return static_cast<std::size_t>(buf.bytes) / std::max<std::size_t>(ir::size_of(buf.type), 1);
  };
  for (const auto& t : g.tasks) {
    if (ir::is_collective(t.kind)) continue;
    std::size_t need = 0;
    if (t.fn == "attention" || t.fn == "causal_attention" || t.fn == "attention_grad" || t.fn == "causal_attention_grad") {
      const runtime::cpu::attention_shape s{static_cast<std::size_t>(t.attr("batch", 1)),
                                            static_cast<std::size_t>(t.attr("seq", 1)),
                                            static_cast<std::size_t>(t.attr("heads", 1)),
                                            static_cast<std::size_t>(t.attr("head_dim", 1))};
      need = s.lse_floats() + s.qkv_floats() +
             (t.fn.ends_with("_grad") ? runtime::cpu::causal_attention_grad_workspace_floats(s)
                                      : runtime::cpu::causal_attention_workspace_floats(s));
    } else if ((t.fn == "layernorm" || t.fn == "layernorm_grad") && t.reads.size() >= 2) {
      // Rows and columns from the operands, as the dispatch reads them (x, gamma, ...).
      const auto cols = std::max<std::size_t>(count(t.reads[1]), 1);
      need = 2 * (count(t.reads[0]) / cols) + 2 * cols;
    } else if (t.fn == "layernorm_grad_gamma" && !t.reads.empty() && !t.writes.empty()) {
      const auto cols = std::max<std::size_t>(count(t.writes[0]), 1); // x, dy -> dgamma
      need = 2 * (count(t.reads[0]) / cols);
    } else if (t.fn == "cross_entropy" || t.fn == "cross_entropy_grad" || t.fn == "embedding" || t.fn == "embedding_grad" ||
               t.fn == "vocab_ce_target" || t.fn == "vocab_ce_grad") {
      for (const auto b : t.reads) need += 2 * count(b); // narrowed ids, lse rows (bounded by any read)
    }
    floats = std::max(floats, need);
  }
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

/// `n` floats of the kernels' workspace from `offset`; a workspace sized for less than the task
/// takes (see workspace_bytes) is an error naming the task, never a write past the arena.
inline std::span<float> scratch_part(host_arena& mem, const ir::task& t, std::size_t offset, std::size_t n) {
  const auto ws = mem.scratch_f32();
  if (offset > ws.size() || n > ws.size() - offset)
    fail(task_ref(t) + ": needs " + std::to_string(offset + n) + " floats of kernel workspace, the arena holds " +
         std::to_string(ws.size()) + " (size it with runtime::workspace_bytes(graph))");
  return ws.subspan(offset, n);
}

/// Operand access for one task on the host arena: task_operands' decoding, plus spans of the bytes.
class operands : public task_operands<host_arena> {
public:
  using task_operands::task_operands;

  std::span<float> f(ir::buffer_id b) const { return mem_.f32(b); }
  std::span<const float> cf(ir::buffer_id b) const { return mem_.f32(b); }
  /// An integer buffer as i32: itself, or (i64) narrowed into `room` (part of the scratch region).
  std::span<const std::int32_t> ints(ir::buffer_id b, std::span<float> room) const {
    if (mem_.type(b) == ir::dtype::i32) return mem_.i32(b);
    const auto bytes = mem_.bytes(b);
    const auto n = bytes.size() / sizeof(std::int64_t);
    if (room.size() < n) fail(task_ref(t_) + ": the scratch region is too small to narrow '" + mem_.name(b) + "'");
    auto* out = reinterpret_cast<std::int32_t*>(room.data());
    for (std::size_t i = 0; i < n; ++i) {
      std::int64_t v;
      std::memcpy(&v, bytes.data() + i * sizeof v, sizeof v);
      if (v < INT32_MIN || v > INT32_MAX)
        fail(task_ref(t_) + ": id " + std::to_string(v) + " at position " + std::to_string(i) + " of '" + mem_.name(b) +
             "' does not fit in 32 bits");
      out[i] = static_cast<std::int32_t>(v);
    }
    return {out, n};
  }
  std::size_t floats(ir::buffer_id b) const { return mem_.bytes(b).size() / sizeof(float); }
};

// Row statistics of layernorm (biased variance, as cpu::layernorm) into mean and rstd.
inline void row_stats(std::span<const float> x, std::size_t rows, std::size_t cols, float eps, std::span<float> mean,
                      std::span<float> rstd) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    float sum = 0;
    for (std::size_t c = 0; c < cols; ++c) sum += px[c];
    const float mu = sum / static_cast<float>(cols);
    float sq = 0;
    for (std::size_t c = 0; c < cols; ++c) sq += (px[c] - mu) * (px[c] - mu);
    mean[r] = mu;
    rstd[r] = 1.0f / std::sqrt(sq / static_cast<float>(cols) + eps);
  }
}

inline void copy_strided(const operands& op, std::span<std::byte> src, std::span<std::byte> dst, std::size_t outer,
                         std::size_t src_row, std::size_t dst_row, std::size_t src_off, std::size_t dst_off,
                         std::size_t len) {
  for (std::size_t o = 0; o < outer; ++o) {
    const auto s = o * src_row + src_off, d = o * dst_row + dst_off;
    if (s + len > src.size() || d + len > dst.size())
      fail(task_ref(op.task()) + " (fn '" + op.task().fn + "'): slice/concat extents run past a buffer");
    std::memmove(dst.data() + d, src.data() + s, len);
  }
}

} // namespace detail

/// @brief Runs one compute task's kernel on the arena's buffers (fp32 kernels; ids in i32).
/// @code
/// runtime::run_kernel(g, g.tasks[i], runtime::resolve(g.tasks[i]), arena, settings);
/// @endcode
inline void run_kernel(const ir::graph& g, const ir::task& t, kernel k, host_arena& mem, const kernel_settings& s) {
  namespace cpu = runtime::cpu;
  const detail::operands op(t, mem);
  switch (k) {
  case kernel::gemm: {
    const auto m = op.at("m"), n = op.at("n"), kk = op.at("k"), batch = op.at("batch", 1);
    const cpu::matmul_options o{.trans_a = t.attr("trans_a") != 0, .trans_b = t.attr("trans_b") != 0,
                                .accumulate = t.attr("accumulate") != 0};
    const auto a = op.cf(op.read(0, "a")), b = op.cf(op.read(1, "b"));
    const auto c = op.f(op.write(0, "c"));
    if (batch == 1) {
      cpu::matmul(a, b, c, m, n, kk, o);
    } else if (b.size() == kk * n && !o.trans_a) { // B shared by the batch: one taller product
      cpu::matmul(a, b, c, batch * m, n, kk, o);
    } else if (c.size() == m * n && o.trans_a && !o.trans_b) {
      // A weight gradient of a batched activation: the output is one matrix, the sum over the
      // batch of Aᵢᵀ·Bᵢ, which is one product with the batch stacked into the contraction.
      cpu::matmul(a, b, c, m, n, batch * kk, o);
    } else {
      cpu::matmul_batched(a, b, c, batch, m, n, kk, o);
    }
    return;
  }
  case kernel::add:
    cpu::add(op.cf(op.read(0, "a")), op.cf(op.read(1, "b")), op.f(op.write(0, "out")));
    return;
  case kernel::add_inplace: {
    const auto acc = op.write(0, "acc");
    cpu::add_inplace(op.f(acc), op.cf(op.addend(acc)));
    return;
  }
  case kernel::scale:
    cpu::scale(op.cf(op.read(0, "x")), detail::ratio(t, "num", "den"), op.f(op.write(0, "out")));
    return;
  case kernel::bias_add: {
    const auto x = op.cf(op.read(0, "x")), bias = op.cf(op.read(1, "bias"));
    cpu::bias_add(x, bias, op.f(op.write(0, "out")), op.divide(x.size(), bias.size(), "rows"), bias.size());
    return;
  }
  case kernel::bias_add_grad: {
    const auto dout = op.cf(op.read(0, "dout"));
    const auto dbias = op.f(op.write(0, "dbias"));
    cpu::bias_add_grad(dout, dbias, op.divide(dout.size(), dbias.size(), "rows"), dbias.size(),
                       t.attr("accumulate") != 0);
    return;
  }
  case kernel::gelu: cpu::gelu(op.cf(op.read(0, "x")), op.f(op.write(0, "out"))); return;
  case kernel::relu: cpu::relu(op.cf(op.read(0, "x")), op.f(op.write(0, "out"))); return;
  case kernel::gelu_grad:
  case kernel::relu_grad: {
    const bool swapped = detail::dout_first(g, t);
    const auto x = op.cf(op.read(swapped ? 1 : 0, "x")), dout = op.cf(op.read(swapped ? 0 : 1, "dout"));
    if (k == kernel::gelu_grad) cpu::gelu_grad(x, dout, op.f(op.write(0, "dx")));
    else cpu::relu_grad(x, dout, op.f(op.write(0, "dx")));
    return;
  }
  case kernel::zero:
    for (const auto b : t.writes) {
      const auto bytes = mem.bytes(b);
      std::memset(bytes.data(), 0, bytes.size());
    }
    return;
  case kernel::layernorm: {
    const auto x = op.cf(op.read(0, "x")), gamma = op.cf(op.read(1, "gamma")), beta = op.cf(op.read(2, "beta"));
    const auto cols = gamma.size();
    const auto rows = op.divide(x.size(), cols, "rows");
    // The DSL's layernorm writes only its output: the statistics go to scratch.
    const bool stored = t.writes.size() >= 3;
    const auto mean = stored ? op.f(op.write(1, "mean")) : detail::scratch_part(mem, t, 0, rows);
    const auto rstd = stored ? op.f(op.write(2, "rstd")) : detail::scratch_part(mem, t, rows, rows);
    cpu::layernorm(x, gamma, beta, op.f(op.write(0, "out")), mean, rstd, rows, cols, s.layernorm_eps);
    return;
  }
  case kernel::layernorm_grad: {
    if (t.reads.size() >= 5) { // ir::builder form: dout, x, gamma, mean, rstd -> dx, dgamma, dbeta
      const auto dout = op.cf(op.read(0, "dout")), x = op.cf(op.read(1, "x")), gamma = op.cf(op.read(2, "gamma"));
      const auto cols = gamma.size();
      cpu::layernorm_grad(dout, x, gamma, op.cf(op.read(3, "mean")), op.cf(op.read(4, "rstd")),
                          op.f(op.write(0, "dx")), op.f(op.write(1, "dgamma")), op.f(op.write(2, "dbeta")),
                          op.divide(x.size(), cols, "rows"), cols, t.attr("accumulate") != 0);
      return;
    }
    // The DSL's form: x, gamma, dy -> dx; the statistics are recomputed, dgamma and dbeta are
    // other tasks (layernorm_grad_gamma, bias_grad) and land in scratch here.
    const auto x = op.cf(op.read(0, "x")), gamma = op.cf(op.read(1, "gamma")), dout = op.cf(op.read(2, "dy"));
    const auto cols = gamma.size();
    const auto rows = op.divide(x.size(), cols, "rows");
    const auto mean = detail::scratch_part(mem, t, 0, rows), rstd = detail::scratch_part(mem, t, rows, rows);
    detail::row_stats(x, rows, cols, s.layernorm_eps, mean, rstd);
    cpu::layernorm_grad(dout, x, gamma, mean, rstd, op.f(op.write(0, "dx")), detail::scratch_part(mem, t, 2 * rows, cols),
                        detail::scratch_part(mem, t, 2 * rows + cols, cols), rows, cols);
    return;
  }
  case kernel::layernorm_grad_gamma: {
    // dgamma[c] = sum over rows of dy·x̂ (reads x, dy).
    const auto x = op.cf(op.read(0, "x")), dout = op.cf(op.read(1, "dy"));
    const auto dgamma = op.f(op.write(0, "dgamma"));
    const auto cols = dgamma.size();
    const auto rows = op.divide(x.size(), cols, "rows");
    const auto mean = detail::scratch_part(mem, t, 0, rows), rstd = detail::scratch_part(mem, t, rows, rows);
    detail::row_stats(x, rows, cols, s.layernorm_eps, mean, rstd);
    if (t.attr("accumulate") == 0) std::fill(dgamma.begin(), dgamma.end(), 0.0f);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) dgamma[c] += dout[r * cols + c] * (x[r * cols + c] - mean[r]) * rstd[r];
    return;
  }
  case kernel::softmax:
  case kernel::softmax_grad: {
    const auto first = op.read(0, k == kernel::softmax ? "x" : "y");
    const auto& shape = g.buffers.at(static_cast<std::size_t>(first)).shape;
    const auto cols = op.at("cols", shape.empty() ? -1 : shape.back());
    const auto x = op.cf(first);
    const auto rows = op.divide(x.size(), cols, "rows");
    if (k == kernel::softmax)
      cpu::softmax(x, op.f(op.write(0, "out")), rows, cols);
    else
      cpu::softmax_grad(x, op.cf(op.read(1, "dy")), op.f(op.write(0, "dx")), rows, cols);
    return;
  }
  case kernel::attention:
  case kernel::attention_grad: {
    if (t.attr("causal", 1) == 0)
      fail(detail::task_ref(t) + ": the CPU attention kernel is causal only (attr causal = 0)");
    const cpu::attention_shape shape{op.at("batch", 1), op.at("seq"), op.at("heads"), op.at("head_dim")};
    const auto q = op.cf(op.read(0, "q")), kk = op.cf(op.read(1, "k")), v = op.cf(op.read(2, "v"));
    const auto ws = mem.scratch_f32();
    const auto lse_n = shape.lse_floats(), qkv_n = shape.qkv_floats();
    if (k == kernel::attention) {
      // The DSL's attention writes only its output: lse goes to scratch.
      const auto lse = t.writes.size() >= 2 ? op.f(op.write(1, "lse")) : detail::scratch_part(mem, t, 0, lse_n);
      const auto rest = t.writes.size() >= 2 ? ws : ws.subspan(lse_n);
      cpu::causal_attention(q, kk, v, op.f(op.write(0, "out")), lse,
                            rest.first(std::min(rest.size(), cpu::causal_attention_workspace_floats(shape))), shape);
      return;
    }
    if (t.reads.size() >= 5) { // q, k, v, dout, lse -> dq, dk, dv
      cpu::causal_attention_grad(q, kk, v, op.cf(op.read(3, "dout")), op.cf(op.read(4, "lse")),
                                 op.f(op.write(0, "dq")), op.f(op.write(1, "dk")), op.f(op.write(2, "dv")),
                                 ws.first(std::min(ws.size(), cpu::causal_attention_grad_workspace_floats(shape))),
                                 shape);
      return;
    }
    // The DSL's form: q, k, v, dy -> one [3, ...] buffer (dq, dk, dv); lse is recomputed.
    const auto packed = op.f(op.write(0, "dqkv"));
    if (packed.size() != 3 * qkv_n)
      fail(detail::task_ref(t) + ": output '" + mem.name(t.writes[0]) + "' holds " + std::to_string(packed.size()) +
           " floats, expected 3 x " + std::to_string(qkv_n) + " (dq, dk, dv)");
    const auto lse = detail::scratch_part(mem, t, 0, lse_n), out = detail::scratch_part(mem, t, lse_n, qkv_n);
    cpu::causal_attention(q, kk, v, out, lse,
                          detail::scratch_part(mem, t, lse_n + qkv_n, cpu::causal_attention_workspace_floats(shape)), shape);
    cpu::causal_attention_grad(q, kk, v, op.cf(op.read(3, "dy")), lse, packed.first(qkv_n),
                               packed.subspan(qkv_n, qkv_n), packed.subspan(2 * qkv_n, qkv_n),
                               detail::scratch_part(mem, t, lse_n + qkv_n, cpu::causal_attention_grad_workspace_floats(shape)),
                               shape);
    return;
  }
  case kernel::cross_entropy:
  case kernel::cross_entropy_grad: {
    // Mean over `global_rows` (the rows of every rank; default: this rank's), so that a
    // data-parallel loss is a sum of the ranks' values and its gradient needs no rescaling.
    const auto ws = mem.scratch_f32();
    const auto id = op.int_read("targets");
    const auto n_ids = mem.bytes(id).size() / ir::size_of(mem.type(id));
    const auto targets = op.ints(id, ws);
    // i64 targets narrowed to i32 take one float of scratch each; the row lse goes after them.
    const std::size_t lse_at = mem.type(id) == ir::dtype::i64 ? n_ids : 0;
    const auto logits = op.cf(op.float_read(0, "logits"));
    const auto rows = targets.size();
    const auto classes = op.divide(logits.size(), rows, "rows");
    const auto global_rows = static_cast<double>(t.attr("global_rows", static_cast<std::int64_t>(rows)));
    const auto share = static_cast<float>(static_cast<double>(rows) / global_rows);
    if (k == kernel::cross_entropy) {
      const auto loss = op.f(op.write(0, "loss"));
      if (loss.empty()) fail(detail::task_ref(t) + ": the loss buffer holds no value");
      const auto lse = t.writes.size() >= 2 ? op.f(op.write(1, "lse")) : detail::scratch_part(mem, t, lse_at, rows);
      loss[0] = cpu::cross_entropy(logits, targets, lse, rows, classes) * share;
      return;
    }
    std::span<const float> lse;
    if (op.float_reads() >= 2) {
      lse = op.cf(op.float_read(1, "lse"));
    } else { // the DSL's form: recompute the row log-sum-exp
      const auto tmp = detail::scratch_part(mem, t, lse_at, rows);
      (void)cpu::cross_entropy(logits, targets, tmp, rows, classes);
      lse = tmp;
    }
    cpu::cross_entropy_grad(logits, targets, lse, op.f(op.write(0, "dlogits")), rows, classes,
                            detail::ratio(t, "dloss_num", "dloss_den") * share);
    return;
  }
  case kernel::mse:
  case kernel::mse_grad: {
    // Mean over `global_n` values (every rank's; default: this rank's), as cross_entropy.
    const auto pred = op.cf(op.read(0, "pred")), target = op.cf(op.read(1, "target"));
    const auto share = static_cast<float>(static_cast<double>(pred.size()) /
                                          static_cast<double>(t.attr("global_n", static_cast<std::int64_t>(pred.size()))));
    if (k == kernel::mse) {
      const auto loss = op.f(op.write(0, "loss"));
      if (loss.empty()) fail(detail::task_ref(t) + ": the loss buffer holds no value");
      loss[0] = cpu::mse(pred, target) * share;
    } else {
      cpu::mse_grad(pred, target, op.f(op.write(0, "dpred")), detail::ratio(t, "dloss_num", "dloss_den") * share);
    }
    return;
  }
  case kernel::embedding:
  case kernel::embedding_grad: {
    const auto ids = op.ints(op.int_read("ids"), mem.scratch_f32());
    // A table split over the vocabulary (`vocab_axis`, the DSL) holds rows [coord·vocab, ...);
    // the ids outside give zero rows, and an all-reduce of the outputs completes the lookup.
    const bool vocab_split = t.attr("vocab_axis", -1) >= 0;
    const auto policy = vocab_split || t.attr("sharded") != 0 ? cpu::id_outside_table::zero_row
                                                              : cpu::id_outside_table::reject;
    const auto first_row = vocab_split ? op.coord(s.coords, "vocab_axis") * t.attr("vocab", 0) : t.attr("first_row", 0);
    if (k == kernel::embedding) {
      const auto out = op.f(op.write(0, "out"));
      const auto dim = op.at("hidden", static_cast<std::int64_t>(ids.empty() ? 0 : out.size() / ids.size()));
      cpu::embedding(ids, op.cf(op.float_read(0, "table")), out, dim, first_row, policy);
    } else {
      const auto dout = op.cf(op.float_read(0, "dout"));
      const auto dim = op.at("hidden", static_cast<std::int64_t>(ids.empty() ? 0 : dout.size() / ids.size()));
      cpu::embedding_grad(ids, dout, op.f(op.write(0, "dtable")), dim, t.attr("accumulate") != 0, first_row, policy);
    }
    return;
  }
  case kernel::sgd: {
    const auto p = op.f(op.write(0, "param"));
    const auto grad = op.cf(op.read_not_written("grad"));
    cpu::sgd_update(p, grad, t.writes.size() > 1 ? op.f(t.writes[1]) : std::span<float>{}, s.sgd);
    return;
  }
  case kernel::adamw: {
    const auto p = op.f(op.write(0, "param"));
    const auto grad = op.cf(op.read_not_written("grad"));
    std::span<float> m, v;
    if (t.writes.size() >= 3) {
      m = op.f(t.writes[1]);
      v = op.f(t.writes[2]);
    } else { // one state buffer holding both moments, m then v
      const auto state = op.f(op.write(1, "state"));
      if (state.size() != 2 * p.size())
        fail(detail::task_ref(t) + " (adamw): state buffer '" + mem.name(t.writes[1]) + "' holds " +
             std::to_string(state.size()) + " floats, expected 2 x " + std::to_string(p.size()) + " (m then v)");
      m = state.first(p.size());
      v = state.subspan(p.size());
    }
    cpu::adamw_update(p, grad, m, v, s.adamw, s.step);
    return;
  }
  case kernel::copy: {
    const auto src = mem.bytes(op.read(0, "src")), dst = mem.bytes(op.write(0, "dst"));
    if (src.size() != dst.size())
      fail(detail::task_ref(t) + ": copies " + std::to_string(src.size()) + " bytes into a buffer of " +
           std::to_string(dst.size()));
    if (src.data() != dst.data()) std::memmove(dst.data(), src.data(), src.size());
    return;
  }
  case kernel::slice:
  case kernel::concat: {
    // slice copies its part out of the whole buffer's rows; concat places each part after the previous one.
    const bool slicing = k == kernel::slice;
    detail::for_each_part(g, op, slicing, [&](ir::buffer_id whole, ir::buffer_id part, const detail::rows_in_whole& r) {
      if (slicing)
        detail::copy_strided(op, mem.bytes(whole), mem.bytes(part), r.outer, r.whole_row, r.part_row, r.offset, 0, r.part_row);
      else
        detail::copy_strided(op, mem.bytes(part), mem.bytes(whole), r.outer, r.part_row, r.whole_row, 0, r.offset, r.part_row);
    });
    return;
  }
  case kernel::shard_slice: {
    const auto src = op.read(0, "src");
    const auto r = detail::shard_rows(g, op, src, s.coords);
    detail::copy_strided(op, mem.bytes(src), mem.bytes(op.write(0, "dst")), r.outer, r.whole_row, r.part_row, r.offset, 0,
                         r.part_row);
    return;
  }
  case kernel::keep_one: {
    // Coordinate 0 on `mesh_axis` keeps the value, the others hold zero: a pending sum of one term.
    const auto src = mem.bytes(op.read(0, "src")), dst = mem.bytes(op.write(0, "dst"));
    if (src.size() != dst.size()) fail(detail::task_ref(t) + ": input and output sizes differ");
    if (op.coord(s.coords, "mesh_axis") == 0) {
      if (src.data() != dst.data()) std::memmove(dst.data(), src.data(), src.size());
    } else {
      std::memset(dst.data(), 0, dst.size());
    }
    return;
  }
  case kernel::vocab_ce_max:
  case kernel::vocab_ce_target:
  case kernel::vocab_ce_sumexp:
  case kernel::vocab_ce_grad: {
    // Megatron-LM's vocabulary-parallel cross-entropy over this rank's columns of the logits
    // [rows, cols] (columns [coord·cols, ...) of the vocabulary). After the max all-reduce,
    // `target` holds logit[label] - max on the rank owning the label and 0 elsewhere, so that
    // vocab_ce_loss needs only the two sums: loss_r = log(sumexp_r) - target_r.
    const auto logits = op.cf(op.float_read(0, "logits"));
    const auto out = op.f(op.write(0, "out"));
    const auto cols = op.at("cols");
    const auto rows = op.divide(logits.size(), cols, "rows");
    if (k == kernel::vocab_ce_max) {
      for (std::size_t r = 0; r < rows; ++r)
        out[r] = *std::max_element(logits.begin() + static_cast<std::ptrdiff_t>(r * cols),
                                   logits.begin() + static_cast<std::ptrdiff_t>((r + 1) * cols));
      return;
    }
    const auto mx = op.cf(op.float_read(1, "max"));
    if (k == kernel::vocab_ce_sumexp) {
      for (std::size_t r = 0; r < rows; ++r) {
        float sum = 0;
        for (std::size_t c = 0; c < cols; ++c) sum += std::exp(logits[r * cols + c] - mx[r]);
        out[r] = sum;
      }
      return;
    }
    const auto labels = op.ints(op.int_read("labels"), mem.scratch_f32());
    if (labels.size() != rows)
      fail(detail::task_ref(t) + ": " + std::to_string(labels.size()) + " labels for " + std::to_string(rows) + " rows");
    const auto first = op.coord(s.coords, "vocab_axis") * static_cast<std::int64_t>(cols);
    const auto column = [&](std::size_t r) -> std::int64_t {
      const auto c = static_cast<std::int64_t>(labels[r]) - first;
      return c >= 0 && c < static_cast<std::int64_t>(cols) ? c : -1;
    };
    if (k == kernel::vocab_ce_target) {
      for (std::size_t r = 0; r < rows; ++r) {
        const auto c = column(r);
        out[r] = c >= 0 ? logits[r * cols + static_cast<std::size_t>(c)] - mx[r] : 0.0f;
      }
      return;
    }
    const auto sumexp = op.cf(op.float_read(2, "sumexp"));
    const auto scale = detail::ratio(t, "dloss_num", "dloss_den") /
                       static_cast<float>(t.attr("global_rows", static_cast<std::int64_t>(rows)));
    for (std::size_t r = 0; r < rows; ++r) {
      const float inv = scale / sumexp[r];
      for (std::size_t c = 0; c < cols; ++c) out[r * cols + c] = inv * std::exp(logits[r * cols + c] - mx[r]);
      if (const auto c = column(r); c >= 0) out[r * cols + static_cast<std::size_t>(c)] -= scale;
    }
    return;
  }
  case kernel::vocab_ce_loss: {
    const auto sumexp = op.cf(op.read(0, "sumexp")), target = op.cf(op.read(1, "target"));
    const auto loss = op.f(op.write(0, "loss"));
    if (loss.empty() || target.size() != sumexp.size())
      fail(detail::task_ref(t) + ": expects sumexp and target of one size and a one-value loss");
    double total = 0;
    for (std::size_t r = 0; r < sumexp.size(); ++r)
      total += std::log(static_cast<double>(sumexp[r])) - static_cast<double>(target[r]);
    loss[0] = static_cast<float>(total / static_cast<double>(t.attr("global_rows", static_cast<std::int64_t>(sumexp.size()))));
    return;
  }
  }
  fail(detail::task_ref(t) + ": kernel id out of range");
}

} // namespace concerto::runtime
