#pragma once
/// @file
/// @brief From a compute task (kind, fn, attrs, buffers) to a CPU kernel call.
///
/// A task's function is resolved once, before the first step (`resolve`), so that an unknown
/// function is reported with the task's name before anything runs and a step does no string
/// work. The operand conventions (which read is which) are the contract between the graph's
/// producers (the DSL lowering, ir::builder users, the benchmark workloads) and the executors;
/// docs/runtime.md lists them. Integer operands (token ids, targets) are found by their dtype,
/// not their position. Extents come from the attrs where the kernel needs them (matmul,
/// attention) and otherwise from the buffer sizes, which the kernels check.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cpu/kernels.hpp>

#include <algorithm>
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
};

namespace detail {
struct kernel_name {
  std::string_view fn;
  kernel k;
};
// Aliases first-class: "bias" and "bias_grad" are the DSL's op names, "matmul" and "" the
// builder's defaults, "causal_attention" the kernel's own name.
inline constexpr std::array<kernel_name, 36> kernel_names{{
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
    {"memcpy", kernel::copy}, {"identity", kernel::copy},
}};

inline std::string task_ref(const ir::task& t) { return "task " + std::to_string(t.id) + " '" + t.name + "'"; }
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
};

/// @brief Workspace bytes the graph's kernels need at most (attention's score blocks).
[[nodiscard]] inline std::int64_t workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  for (const auto& t : g.tasks) {
    if (ir::is_collective(t.kind)) continue;
    if (t.fn != "attention" && t.fn != "causal_attention" && t.fn != "attention_grad" && t.fn != "causal_attention_grad")
      continue;
    const runtime::cpu::attention_shape s{static_cast<std::size_t>(t.attr("batch", 1)),
                                          static_cast<std::size_t>(t.attr("seq", 1)),
                                          static_cast<std::size_t>(t.attr("heads", 1)),
                                          static_cast<std::size_t>(t.attr("head_dim", 1))};
    floats = std::max(floats, t.fn.ends_with("_grad") ? runtime::cpu::causal_attention_grad_workspace_floats(s)
                                                      : runtime::cpu::causal_attention_workspace_floats(s));
  }
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

/// Operand access for one task, with messages that name the task and the operand.
class operands {
public:
  operands(const ir::task& t, host_arena& mem) : t_(t), mem_(mem) {}

  ir::buffer_id read(std::size_t i, const char* what) const { return pick(t_.reads, i, what, "reads"); }
  ir::buffer_id write(std::size_t i, const char* what) const { return pick(t_.writes, i, what, "writes"); }
  std::span<float> f(ir::buffer_id b) const { return mem_.f32(b); }
  std::span<const float> cf(ir::buffer_id b) const { return mem_.f32(b); }
  /// The one int32 operand among the reads (ids, targets), wherever it is listed.
  ir::buffer_id int_read(const char* what) const {
    for (const auto b : t_.reads)
      if (mem_.type(b) == ir::dtype::i32) return b;
    fail(task_ref(t_) + " (fn '" + t_.fn + "') needs an i32 buffer among its reads for `" + what + "`");
  }
  /// The i-th fp32 read, skipping integer operands.
  ir::buffer_id float_read(std::size_t i, const char* what) const {
    std::size_t seen = 0;
    for (const auto b : t_.reads)
      if (mem_.type(b) != ir::dtype::i32 && seen++ == i) return b;
    fail(task_ref(t_) + " (fn '" + t_.fn + "') has no fp32 read #" + std::to_string(i) + " for `" + what + "`");
  }
  /// The first read that is not also written (an update's gradient).
  ir::buffer_id read_not_written(const char* what) const {
    for (const auto b : t_.reads)
      if (std::find(t_.writes.begin(), t_.writes.end(), b) == t_.writes.end()) return b;
    fail(task_ref(t_) + " (fn '" + t_.fn + "') has no read besides the buffers it writes, for `" + what + "`");
  }
  std::size_t floats(ir::buffer_id b) const { return mem_.bytes(b).size() / sizeof(float); }
  std::size_t at(const char* key, std::int64_t fallback = -1) const {
    const auto v = t_.attr(key, fallback);
    if (v < 0) fail(task_ref(t_) + " (fn '" + t_.fn + "') needs a non-negative attr '" + key + "'");
    return static_cast<std::size_t>(v);
  }
  std::size_t divide(std::size_t total, std::size_t by, const char* what) const {
    if (by == 0 || total % by != 0)
      fail(task_ref(t_) + " (fn '" + t_.fn + "'): " + std::to_string(total) + " values are not a whole number of " +
           what + " of " + std::to_string(by));
    return total / by;
  }
  const ir::task& task() const noexcept { return t_; }
  host_arena& mem() const noexcept { return mem_; }

private:
  ir::buffer_id pick(const std::vector<ir::buffer_id>& list, std::size_t i, const char* what, const char* field) const {
    if (i >= list.size())
      fail(task_ref(t_) + " (fn '" + t_.fn + "') lists " + std::to_string(list.size()) + " " + field +
           " but the kernel needs `" + what + "` at position " + std::to_string(i));
    return list[i];
  }
  const ir::task& t_;
  host_arena& mem_;
};

inline float ratio(const ir::task& t, const char* num, const char* den) {
  const auto d = t.attr(den, 1);
  if (d == 0) fail(task_ref(t) + ": attr '" + den + "' is 0");
  return static_cast<float>(static_cast<double>(t.attr(num, 1)) / static_cast<double>(d));
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
    ir::buffer_id x = -1;
    for (const auto b : t.reads)
      if (b != acc) x = b;
    if (x < 0) fail(detail::task_ref(t) + " (fn '" + t.fn + "') reads nothing to add into its output");
    cpu::add_inplace(op.f(acc), op.cf(x));
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
    cpu::gelu_grad(op.cf(op.read(1, "x")), op.cf(op.read(0, "dout")), op.f(op.write(0, "dx")));
    return;
  case kernel::relu_grad:
    cpu::relu_grad(op.cf(op.read(1, "x")), op.cf(op.read(0, "dout")), op.f(op.write(0, "dx")));
    return;
  case kernel::zero:
    for (const auto b : t.writes) {
      const auto bytes = mem.bytes(b);
      std::memset(bytes.data(), 0, bytes.size());
    }
    return;
  case kernel::layernorm: {
    const auto x = op.cf(op.read(0, "x")), gamma = op.cf(op.read(1, "gamma")), beta = op.cf(op.read(2, "beta"));
    const auto cols = gamma.size();
    cpu::layernorm(x, gamma, beta, op.f(op.write(0, "out")), op.f(op.write(1, "mean")), op.f(op.write(2, "rstd")),
                   op.divide(x.size(), cols, "rows"), cols, s.layernorm_eps);
    return;
  }
  case kernel::layernorm_grad: {
    const auto dout = op.cf(op.read(0, "dout")), x = op.cf(op.read(1, "x")), gamma = op.cf(op.read(2, "gamma"));
    const auto cols = gamma.size();
    cpu::layernorm_grad(dout, x, gamma, op.cf(op.read(3, "mean")), op.cf(op.read(4, "rstd")),
                        op.f(op.write(0, "dx")), op.f(op.write(1, "dgamma")), op.f(op.write(2, "dbeta")),
                        op.divide(x.size(), cols, "rows"), cols, t.attr("accumulate") != 0);
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
    if (k == kernel::attention)
      cpu::causal_attention(q, kk, v, op.f(op.write(0, "out")), op.f(op.write(1, "lse")),
                            ws.first(std::min(ws.size(), cpu::causal_attention_workspace_floats(shape))), shape);
    else
      cpu::causal_attention_grad(q, kk, v, op.cf(op.read(3, "dout")), op.cf(op.read(4, "lse")),
                                 op.f(op.write(0, "dq")), op.f(op.write(1, "dk")), op.f(op.write(2, "dv")),
                                 ws.first(std::min(ws.size(), cpu::causal_attention_grad_workspace_floats(shape))),
                                 shape);
    return;
  }
  case kernel::cross_entropy: {
    const auto targets = mem.i32(op.int_read("targets"));
    const auto logits = op.cf(op.float_read(0, "logits"));
    const auto loss = op.f(op.write(0, "loss"));
    const auto rows = targets.size();
    const auto value = cpu::cross_entropy(logits, targets, op.f(op.write(1, "lse")), rows,
                                          op.divide(logits.size(), rows, "rows"));
    if (loss.empty()) fail(detail::task_ref(t) + ": the loss buffer holds no value");
    loss[0] = value;
    return;
  }
  case kernel::cross_entropy_grad: {
    const auto targets = mem.i32(op.int_read("targets"));
    const auto logits = op.cf(op.float_read(0, "logits"));
    const auto rows = targets.size();
    cpu::cross_entropy_grad(logits, targets, op.cf(op.float_read(1, "lse")), op.f(op.write(0, "dlogits")), rows,
                            op.divide(logits.size(), rows, "rows"), detail::ratio(t, "dloss_num", "dloss_den"));
    return;
  }
  case kernel::mse: {
    const auto loss = op.f(op.write(0, "loss"));
    if (loss.empty()) fail(detail::task_ref(t) + ": the loss buffer holds no value");
    loss[0] = cpu::mse(op.cf(op.read(0, "pred")), op.cf(op.read(1, "target")));
    return;
  }
  case kernel::mse_grad:
    cpu::mse_grad(op.cf(op.read(0, "pred")), op.cf(op.read(1, "target")), op.f(op.write(0, "dpred")),
                  detail::ratio(t, "dloss_num", "dloss_den"));
    return;
  case kernel::embedding:
  case kernel::embedding_grad: {
    const auto ids = mem.i32(op.int_read("ids"));
    const auto policy = t.attr("sharded") != 0 ? cpu::id_outside_table::zero_row : cpu::id_outside_table::reject;
    const auto first_row = t.attr("first_row", 0);
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
    // Both walk the whole buffer's shape around `dim`: slice copies [offset, offset+len) of the
    // source's extent; concat places each part after the previous one.
    const bool slicing = k == kernel::slice;
    const auto whole = slicing ? op.read(0, "src") : op.write(0, "dst");
    const auto& wb = g.buffers.at(static_cast<std::size_t>(whole));
    const auto elem = ir::size_of(wb.type);
    const auto dim = op.at("dim", 0);
    const auto dims = std::max<std::size_t>(wb.shape.size(), 1);
    if (dim >= dims)
      fail(detail::task_ref(t) + ": attr dim = " + std::to_string(dim) + " but buffer '" + wb.name + "' has " +
           std::to_string(dims) + " dimension(s)");
    // An opaque buffer (no shape) is one dimension of elements.
    const auto extent_of = [&](std::size_t d) {
      return wb.shape.empty() ? static_cast<std::size_t>(wb.bytes) / elem : static_cast<std::size_t>(wb.shape[d]);
    };
    std::size_t outer = 1, inner = elem;
    for (std::size_t d = 0; d < dim; ++d) outer *= extent_of(d);
    for (std::size_t d = dim + 1; d < dims; ++d) inner *= extent_of(d);
    const auto whole_row = extent_of(dim) * inner;
    const auto whole_bytes = mem.bytes(whole);
    if (slicing) {
      const auto part = mem.bytes(op.write(0, "dst"));
      const auto len = op.divide(part.size(), outer, "rows");
      detail::copy_strided(op, whole_bytes, part, outer, whole_row, len, op.at("offset", 0) * inner, 0, len);
    } else {
      std::size_t at = 0;
      for (const auto b : t.reads) {
        const auto part = mem.bytes(b);
        const auto len = op.divide(part.size(), outer, "rows");
        detail::copy_strided(op, part, whole_bytes, outer, len, whole_row, 0, at, len);
        at += len;
      }
    }
    return;
  }
  }
  fail(detail::task_ref(t) + ": kernel id out of range");
}

} // namespace concerto::runtime
