#pragma once
/// @file
/// @brief From a decoded compute task (runtime/kernel_call.hpp) to a CPU kernel call: one
/// function per op, on fp32 host buffers.
///
/// A bf16 or f16 operand (a lower working precision, ir/precision.hpp) is widened into f32
/// workspace when the kernel first asks for it, the kernel computes in f32, and what it wrote is
/// rounded back (to nearest even) when it returns: 16-bit storage, f32 arithmetic, as the GPU's
/// kernels do. A written operand is widened first too, so accumulating and in-place kernels see
/// its values.
///
/// A backend decodes its plan's tasks once (`runtime::decode`, which checks every operand
/// against its op) and calls `run_kernel` per task and step: nothing here reads attrs or
/// re-derives extents. What a task does not store (layernorm's statistics, attention's lse,
/// cross-entropy's row log-sum-exp) lives in the scratch region for the duration of one kernel
/// and is recomputed by the backward kernel that needs it: a second pass over a layernorm or
/// attention forward, for graphs whose buffers are exactly what the DSL declared.
/// `workspace_floats` sizes that region per call, and every kernel takes its pieces through a
/// cursor that refuses to run past it.
///
/// @code
/// const auto call = runtime::decode(g, g.tasks[i], settings.coords);
/// runtime::run_kernel(call, arena, settings);
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/float16_values.hpp>
#include <concerto/runtime/grad_clip.hpp>
#include <concerto/runtime/kernel_call.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime {

/// @brief Workspace floats the CPU kernel of a call takes from the scratch region besides its
/// 16-bit float operands' f32 copies: i64 ids narrowed to i32, and the statistics and score blocks the
/// task does not store.
[[nodiscard]] inline std::size_t kernel_workspace_floats(const kernel_call& c) {
  using ir::op;
  const std::size_t ids = c.ids; // narrowed when i64; an i32 operand is read in place (an upper bound)
  switch (c.fn) {
  case op::layernorm:
  case op::layernorm_grad_gamma: return 2 * c.rows;
  case op::layernorm_grad: return 2 * c.rows;
  case op::rmsnorm:
  case op::rmsnorm_grad:
  case op::rmsnorm_grad_gain: return c.rows;
  case op::rope:
  case op::rope_grad: return ids;
  case op::attention: return c.att.lse_floats() + cpu::causal_attention_workspace_floats(c.att);
  case op::attention_grad:
    return c.att.lse_floats() + c.att.q_floats() +
           std::max(cpu::causal_attention_workspace_floats(c.att), cpu::causal_attention_grad_workspace_floats(c.att));
  case op::cross_entropy:
  case op::cross_entropy_grad: return ids + c.rows;
  case op::embedding:
  case op::embedding_grad:
  case op::vocab_ce_target:
  case op::vocab_ce_grad: return ids;
  case op::conv2d:
  case op::conv2d_grad_input:
  case op::conv2d_grad_weight: return cpu::conv2d_workspace_floats(c.conv);
  case op::moe_route: return cpu::moe_route_workspace_floats(c.moe);
  case op::moe_route_grad: return cpu::moe_route_grad_workspace_floats(c.moe);
  case op::moe_dispatch:
  case op::moe_dispatch_grad:
  case op::moe_combine:
  case op::moe_combine_grad: return cpu::moe_slots_workspace_floats(c.moe);
  default: return 0;
  }
}

/// @brief Workspace floats the CPU kernel of a call takes: its 16-bit float operands' f32 copies and
/// what the kernel itself takes (kernel_workspace_floats).
[[nodiscard]] inline std::size_t workspace_floats(const kernel_call& c) { return c.staged + kernel_workspace_floats(c); }

/// @brief Workspace bytes the graph's kernels need at most (workspace_floats over its compute
/// tasks); the executor's arena holds it after the buffers.
[[nodiscard]] inline std::int64_t workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind) && ir::info(t.fn).executable) floats = std::max(floats, workspace_floats(decode(g, t)));
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

/// One call's view of the arena: spans of its operands and the pieces of scratch it takes.
class cpu_frame {
public:
  cpu_frame(const kernel_call& c, host_arena& mem, const kernel_settings& s)
      : c(c), s(s), mem_(mem), scratch_(mem.scratch_f32()) {}

  std::span<const float> in(std::size_t i) { return values(c.in[i]); }
  std::span<float> out(std::size_t i) { return values(c.out[i]); }
  std::span<std::byte> in_bytes(std::size_t i) const { return mem_.bytes(c.in[i]); }
  std::span<std::byte> out_bytes(std::size_t i) const { return mem_.bytes(c.out[i]); }
  std::span<std::byte> bytes(ir::buffer_id b) const { return mem_.bytes(b); }
  std::span<const float> floats(ir::buffer_id b) { return values(b); }

  /// Buffer b as f32 values: itself, or (bf16, f16) its values widened into scratch, once per call.
  std::span<float> values(ir::buffer_id b) {
    if (!ir::is_16bit_float(mem_.type(b))) return mem_.f32(b);
    for (std::size_t k = 0; k < n_staged_; ++k)
      if (staged_[k].id == b) return staged_[k].values;
    if (n_staged_ == staged_.size()) fail(task_ref(*c.task) + ": more 16-bit float operands than a kernel call stages");
    const auto raw = bits_of(b);
    const auto wide = scratch(raw.size());
    widen_16bit(mem_.type(b), raw, wide);
    staged_[n_staged_++] = {b, wide};
    return wide;
  }
  /// Rounds the staged operands the kernel may have written back into their 16-bit buffers.
  void commit() {
    for (std::size_t k = 0; k < n_staged_; ++k)
      for (std::size_t i = 0; i < c.n_out; ++i)
        if (c.out[i] == staged_[k].id) {
          round_to_16bit(mem_.type(staged_[k].id), staged_[k].values, bits_of(staged_[k].id));
          break;
        }
  }

  /// `n` floats of scratch after the pieces taken so far; running past the region (sized by
  /// another graph's workspace_bytes) is an error naming the task, never a write past the arena.
  std::span<float> scratch(std::size_t n) {
    if (n > scratch_.size() - used_)
      fail(task_ref(*c.task) + " (fn '" + std::string(ir::to_string(c.fn)) + "'): needs " + std::to_string(used_ + n) +
           " floats of kernel workspace, the arena holds " + std::to_string(scratch_.size()) +
           " (size it with runtime::workspace_bytes(graph))");
    const auto piece = scratch_.subspan(used_, n);
    used_ += n;
    return piece;
  }
  /// Integer operand i as i32: itself, or (i64) narrowed into scratch.
  std::span<const std::int32_t> ints(std::size_t i) {
    const auto b = c.in[i];
    if (mem_.type(b) == ir::dtype::i32) return mem_.i32(b);
    const auto raw = mem_.bytes(b);
    const auto n = raw.size() / sizeof(std::int64_t);
    auto* out = reinterpret_cast<std::int32_t*>(scratch(n).data());
    for (std::size_t k = 0; k < n; ++k) {
      std::int64_t v;
      std::memcpy(&v, raw.data() + k * sizeof v, sizeof v);
      if (v < INT32_MIN || v > INT32_MAX)
        fail(task_ref(*c.task) + ": id " + std::to_string(v) + " at position " + std::to_string(k) + " of '" + mem_.name(b) +
             "' does not fit in 32 bits");
      out[k] = static_cast<std::int32_t>(v);
    }
    return {out, n};
  }

  /// A 16-bit float buffer's stored values.
  std::span<std::uint16_t> bits_of(ir::buffer_id b) {
    const auto raw = mem_.bytes(b);
    return {reinterpret_cast<std::uint16_t*>(raw.data()), raw.size() / sizeof(std::uint16_t)};
  }
  [[nodiscard]] ir::dtype type(ir::buffer_id b) const { return mem_.type(b); }

  const kernel_call& c;
  const kernel_settings& s;

private:
  struct staged {
    ir::buffer_id id = -1;
    std::span<float> values;
  };

  host_arena& mem_;
  std::span<float> scratch_;
  std::size_t used_ = 0;
  std::array<staged, 10> staged_{};
  std::size_t n_staged_ = 0;
};

// `outer` rows of `len` bytes from a row pitch of `src_row` to one of `dst_row`; decode checked the extents.
inline void copy_rows(std::span<const std::byte> src, std::span<std::byte> dst, std::size_t outer, std::size_t src_row,
                      std::size_t dst_row, std::size_t src_off, std::size_t dst_off, std::size_t len) {
  for (std::size_t o = 0; o < outer; ++o) std::memmove(dst.data() + o * dst_row + dst_off, src.data() + o * src_row + src_off, len);
}

inline void run_matmul(cpu_frame& f) {
  const auto& c = f.c;
  const cpu::matmul_options o{.trans_a = c.trans_a, .trans_b = c.trans_b, .accumulate = c.accumulate};
  const auto a = f.in(0), b = f.in(1);
  const auto out = f.out(0);
  switch (c.form) {
  case gemm_form::single: cpu::matmul(a, b, out, c.m, c.gemm_n, c.k, o); return;
  case gemm_form::shared_b: cpu::matmul(a, b, out, c.batch * c.m, c.gemm_n, c.k, o); return;
  case gemm_form::summed_batch: cpu::matmul(a, b, out, c.m, c.gemm_n, c.batch * c.k, o); return;
  case gemm_form::strided_batch: cpu::matmul_batched(a, b, out, c.batch, c.m, c.gemm_n, c.k, o); return;
  }
}

inline void run_layernorm(cpu_frame& f) {
  const auto& c = f.c;
  const auto mean = f.scratch(c.rows), rstd = f.scratch(c.rows);
  cpu::layernorm(f.in(0), f.in(1), f.in(2), f.out(0), mean, rstd, c.rows, c.cols, f.s.layernorm_eps);
}

// dx from x, gamma, dy; the statistics are recomputed, dgamma and dbeta are other tasks
// (layernorm_grad_gamma, bias_grad).
inline void run_layernorm_grad(cpu_frame& f) {
  const auto& c = f.c;
  const auto mean = f.scratch(c.rows), rstd = f.scratch(c.rows);
  cpu::layernorm_stats(f.in(0), mean, rstd, c.rows, c.cols, f.s.layernorm_eps);
  cpu::layernorm_grad(f.in(2), f.in(0), f.in(1), mean, rstd, f.out(0), {}, {}, c.rows, c.cols);
}

// dgamma[c] = Σ_r dy·x̂ from x and dy.
inline void run_layernorm_grad_gamma(cpu_frame& f) {
  const auto& c = f.c;
  const auto x = f.in(0), dy = f.in(1);
  const auto dgamma = f.out(0);
  const auto mean = f.scratch(c.rows), rstd = f.scratch(c.rows);
  cpu::layernorm_stats(x, mean, rstd, c.rows, c.cols, f.s.layernorm_eps);
  if (!c.accumulate) std::fill(dgamma.begin(), dgamma.end(), 0.0f);
  for (std::size_t r = 0; r < c.rows; ++r)
    for (std::size_t k = 0; k < c.cols; ++k) dgamma[k] += dy[r * c.cols + k] * (x[r * c.cols + k] - mean[r]) * rstd[r];
}

// RMSNorm keeps no statistics between tasks: each recomputes rstd, one sum of squares per row.
inline void run_rmsnorm(cpu_frame& f) {
  const auto& c = f.c;
  cpu::rmsnorm(f.in(0), f.in(1), f.out(0), f.scratch(c.rows), c.rows, c.cols, f.s.rmsnorm_eps);
}
inline std::span<float> rms_stats(cpu_frame& f) {
  const auto rstd = f.scratch(f.c.rows);
  cpu::rmsnorm_stats(f.in(0), rstd, f.c.rows, f.c.cols, f.s.rmsnorm_eps);
  return rstd;
}
inline void run_rmsnorm_grad(cpu_frame& f) {
  const auto& c = f.c;
  cpu::rmsnorm_grad(f.in(2), f.in(0), f.in(1), rms_stats(f), f.out(0), c.rows, c.cols);
}
inline void run_rmsnorm_grad_gain(cpu_frame& f) {
  const auto& c = f.c;
  cpu::rmsnorm_grad_gain(f.in(1), f.in(0), rms_stats(f), f.out(0), c.rows, c.cols, c.accumulate);
}

inline void run_attention(cpu_frame& f) {
  const auto& a = f.c.att;
  const auto lse = f.scratch(a.lse_floats());
  cpu::causal_attention(f.in(0), f.in(1), f.in(2), f.out(0), lse, f.scratch(cpu::causal_attention_workspace_floats(a)), a);
}

// q, k, v, dy -> one buffer holding dq, dk, dv one after the other; lse is recomputed.
inline void run_attention_grad(cpu_frame& f) {
  const auto& a = f.c.att;
  const auto packed = f.out(0);
  const auto lse = f.scratch(a.lse_floats()), out = f.scratch(a.q_floats());
  const auto blocks = f.scratch(std::max(cpu::causal_attention_workspace_floats(a), cpu::causal_attention_grad_workspace_floats(a)));
  cpu::causal_attention(f.in(0), f.in(1), f.in(2), out, lse, blocks, a);
  cpu::causal_attention_grad(f.in(0), f.in(1), f.in(2), f.in(3), lse, packed.first(a.q_floats()),
                             packed.subspan(a.q_floats(), a.kv_floats()), packed.subspan(a.q_floats() + a.kv_floats()), blocks,
                             a);
}

// A loss gradient's factor: its share of the mean (kernel_call::scale) times, under dynamic loss
// scaling, the step's loss scale (the balance loss's part for the routing's gradient).
inline float loss_gradient_scale(cpu_frame& f) {
  return loss_gradient_factor(f.c.scale, f.c.loss_scale < 0 ? nullptr : f.floats(f.c.loss_scale).data());
}

inline void run_cross_entropy(cpu_frame& f) {
  const auto& c = f.c;
  const auto targets = f.ints(1);
  const auto lse = f.scratch(c.rows);
  if (c.fn == ir::op::cross_entropy) {
    f.out(0)[0] = cpu::cross_entropy(f.in(0), targets, lse, c.rows, c.cols) * c.scale;
    return;
  }
  (void)cpu::cross_entropy(f.in(0), targets, lse, c.rows, c.cols); // the row log-sum-exp, recomputed
  cpu::cross_entropy_grad(f.in(0), targets, lse, f.out(0), c.rows, c.cols, loss_gradient_scale(f));
}

inline void run_embedding(cpu_frame& f) {
  const auto& c = f.c;
  const auto ids = f.ints(0);
  const auto policy = c.reject_outside ? cpu::id_outside_table::reject : cpu::id_outside_table::zero_row;
  if (c.fn == ir::op::embedding) cpu::embedding(ids, f.in(1), f.out(0), c.cols, c.first, policy);
  else cpu::embedding_grad(ids, f.in(1), f.out(0), c.cols, c.accumulate, c.first, policy);
}

// The optimizers at this step's scheduled rate, their gradient scaled by the clipping factor
// when the update reads the global norm, and by one over the loss scale under loss scaling;
// nothing to apply (nullopt) when the loss-scaled step overflowed.
inline std::optional<float> grad_scale(cpu_frame& f) {
  const auto at = [&](int operand) { return operand < 0 ? nullptr : f.floats(operand).data(); };
  float factor;
  if (!update_factor(at(f.c.grad_norm_sq), at(f.c.loss_scale), f.s.clip_norm, factor)) return std::nullopt;
  return factor;
}

// Under a 16-bit policy the update leaves the master, rounded, in the parameter's working copy,
// which the next step's forward reads. A skipped (overflowed) step writes it too, from the master
// it left alone: under ZeRO-1/2 the copy is the shard the gather then moves into the parameter,
// and nothing else fills it (not the first step's, nor after a load).
inline void write_working_copy(cpu_frame& f) {
  if (f.c.working >= 0) round_to_16bit(f.type(f.c.working), f.out(0), f.bits_of(f.c.working));
}

inline void run_adamw(cpu_frame& f) {
  const auto factor = grad_scale(f);
  if (!factor) return write_working_copy(f);
  auto cfg = f.s.adamw;
  cfg.lr = lr_at(f.s.schedule, cfg.lr, f.s.step);
  cpu::adamw_update(f.out(0), f.in(1), f.out(1), f.out(2), cfg, f.s.step, *factor);
  write_working_copy(f);
}

inline void run_sgd(cpu_frame& f) {
  const auto factor = grad_scale(f);
  if (!factor) return write_working_copy(f);
  auto cfg = f.s.sgd;
  cfg.lr = lr_at(f.s.schedule, cfg.lr, f.s.step);
  const bool momentum = f.c.n_out > (f.c.working >= 0 ? 2 : 1);
  cpu::sgd_update(f.out(0), f.in(1), momentum ? f.out(1) : std::span<float>{}, cfg, *factor);
  write_working_copy(f);
}

// slice copies its part out of the whole buffer's rows; concat places each part after the previous one.
inline void run_parts(cpu_frame& f) {
  const auto& c = f.c;
  const bool into_part = c.fn != ir::op::concat;
  const auto whole = into_part ? f.in_bytes(0) : f.out_bytes(0);
  for (const auto& p : c.parts) {
    if (into_part) copy_rows(whole, f.bytes(p.part), p.outer, p.whole_row, p.part_row, p.offset, 0, p.part_row);
    else copy_rows(f.bytes(p.part), whole, p.outer, p.part_row, p.whole_row, 0, p.offset, p.part_row);
  }
}

// Megatron-LM's vocabulary-parallel cross-entropy over this rank's columns of the logits
// [rows, cols] (columns [first, first + cols) of the vocabulary). After the max all-reduce,
// `target` holds logit[label] - max on the rank owning the label and 0 elsewhere, so that
// vocab_ce_loss needs only the two sums: loss_r = log(sumexp_r) - target_r.
inline void run_vocab_ce(cpu_frame& f) {
  const auto& c = f.c;
  const auto rows = c.rows, cols = c.cols;
  if (c.fn == ir::op::vocab_ce_loss) {
    const auto sumexp = f.in(0), target = f.in(1);
    double total = 0;
    for (std::size_t r = 0; r < rows; ++r) total += std::log(static_cast<double>(sumexp[r])) - static_cast<double>(target[r]);
    f.out(0)[0] = static_cast<float>(total * static_cast<double>(c.scale));
    return;
  }
  const auto logits = f.in(0);
  const auto out = f.out(0);
  if (c.fn == ir::op::vocab_ce_max) {
    for (std::size_t r = 0; r < rows; ++r)
      out[r] = *std::max_element(logits.begin() + static_cast<std::ptrdiff_t>(r * cols),
                                 logits.begin() + static_cast<std::ptrdiff_t>((r + 1) * cols));
    return;
  }
  if (c.fn == ir::op::vocab_ce_sumexp) {
    const auto mx = f.in(1);
    for (std::size_t r = 0; r < rows; ++r) {
      float sum = 0;
      for (std::size_t k = 0; k < cols; ++k) sum += std::exp(logits[r * cols + k] - mx[r]);
      out[r] = sum;
    }
    return;
  }
  const auto labels = f.ints(1);
  const auto mx = f.in(2);
  const auto column = [&](std::size_t r) -> std::int64_t {
    const auto k = static_cast<std::int64_t>(labels[r]) - c.first;
    return k >= 0 && k < static_cast<std::int64_t>(cols) ? k : -1;
  };
  if (c.fn == ir::op::vocab_ce_target) {
    for (std::size_t r = 0; r < rows; ++r) {
      const auto k = column(r);
      out[r] = k >= 0 ? logits[r * cols + static_cast<std::size_t>(k)] - mx[r] : 0.0f;
    }
    return;
  }
  const auto sumexp = f.in(3);
  const float scale = loss_gradient_scale(f);
  for (std::size_t r = 0; r < rows; ++r) {
    const float inv = scale / sumexp[r];
    for (std::size_t k = 0; k < cols; ++k) out[r * cols + k] = inv * std::exp(logits[r * cols + k] - mx[r]);
    if (const auto k = column(r); k >= 0) out[r * cols + static_cast<std::size_t>(k)] -= scale;
  }
}

// The MoE kernels; the ones that place tokens in slots derive the slots into scratch.
inline void run_moe(cpu_frame& f) {
  const auto& c = f.c;
  const auto& s = c.moe;
  const auto slots = [&] {
    return std::span<std::int32_t>(reinterpret_cast<std::int32_t*>(f.scratch(cpu::moe_slots_workspace_floats(s)).data()),
                                   cpu::moe_slots_workspace_floats(s));
  };
  switch (c.fn) {
  case ir::op::moe_route: cpu::moe_route(f.in(0), f.out(0), s, f.scratch(cpu::moe_route_workspace_floats(s))); return;
  case ir::op::moe_route_grad:
    cpu::moe_route_grad(f.in(0), f.in(1), f.in(2), f.out(0), s, loss_gradient_scale(f),
                        f.scratch(cpu::moe_route_grad_workspace_floats(s)));
    return;
  case ir::op::moe_dispatch: cpu::moe_dispatch(f.in(0), f.in(1), f.out(0), s, slots()); return;
  case ir::op::moe_dispatch_grad: cpu::moe_dispatch_grad(f.in(0), f.in(1), f.out(0), s, slots()); return;
  case ir::op::moe_combine: cpu::moe_combine(f.in(0), f.in(1), f.out(0), s, slots()); return;
  case ir::op::moe_combine_grad: {
    const auto packed = f.out(0);
    const auto dy_values = f.in(0).size();
    cpu::moe_combine_grad(f.in(2), f.in(0), f.in(1), packed.first(dy_values), packed.subspan(dy_values), s, slots());
    return;
  }
  default: return;
  }
}

// cast: f32 to bf16 or f16 rounds to nearest even, back to f32 is exact, one type to itself
// copies; between the two 16-bit types through f32, a block at a time.
inline void run_cast(cpu_frame& f) {
  const auto from = f.c.in[0], to = f.c.out[0];
  const auto from_type = f.type(from), to_type = f.type(to);
  if (from_type == to_type) {
    if (f.bytes(from).data() != f.bytes(to).data()) std::memmove(f.bytes(to).data(), f.bytes(from).data(), f.bytes(from).size());
  } else if (from_type == ir::dtype::f32) {
    const auto src = f.bytes(from);
    round_to_16bit(to_type, {reinterpret_cast<const float*>(src.data()), src.size() / sizeof(float)}, f.bits_of(to));
  } else if (to_type == ir::dtype::f32) {
    const auto dst = f.bytes(to);
    widen_16bit(from_type, f.bits_of(from), {reinterpret_cast<float*>(dst.data()), dst.size() / sizeof(float)});
  } else {
    const auto src = f.bits_of(from);
    const auto dst = f.bits_of(to);
    std::array<float, 1024> wide; // a block at a time, so both conversions run vectorised
    for (std::size_t i = 0; i < src.size(); i += wide.size()) {
      const std::size_t n = std::min(wide.size(), src.size() - i);
      const std::span block(wide.data(), n);
      widen_16bit(from_type, src.subspan(i, n), block);
      round_to_16bit(to_type, block, dst.subspan(i, n));
    }
  }
}

// The kernel of the call's op; 16-bit float operands are staged by the frame (see the file comment).
inline void run_call(cpu_frame& f) {
  namespace cpu = runtime::cpu;
  using ir::op;
  const auto& c = f.c;
  switch (c.fn) {
  case op::matmul: run_matmul(f); return;
  case op::add: cpu::add(f.in(0), f.in(1), f.out(0)); return;
  case op::add_inplace: cpu::add_inplace(f.out(0), f.in(1)); return;
  case op::scale: cpu::scale(f.in(0), c.scale, f.out(0)); return;
  case op::bias_add: cpu::bias_add(f.in(0), f.in(1), f.out(0), c.rows, c.cols); return;
  case op::bias_grad: cpu::bias_add_grad(f.in(0), f.out(0), c.rows, c.cols, c.accumulate); return;
  case op::scale_table: cpu::scale_table(f.in(0), f.in(1), f.out(0), c.rows, c.cols); return;
  case op::scale_table_grad: cpu::scale_table_grad(f.in(0), f.in(1), f.out(0), c.rows, c.cols, c.accumulate); return;
  case op::gelu: cpu::gelu(f.in(0), f.out(0)); return;
  case op::relu: cpu::relu(f.in(0), f.out(0)); return;
  case op::gelu_grad: cpu::gelu_grad(f.in(0), f.in(1), f.out(0)); return;
  case op::relu_grad: cpu::relu_grad(f.in(0), f.in(1), f.out(0)); return;
  case op::zero:
    for (const auto b : c.task->writes) std::memset(f.bytes(b).data(), 0, f.bytes(b).size());
    return;
  case op::layernorm: run_layernorm(f); return;
  case op::layernorm_grad: run_layernorm_grad(f); return;
  case op::layernorm_grad_gamma: run_layernorm_grad_gamma(f); return;
  case op::softmax: cpu::softmax(f.in(0), f.out(0), c.rows, c.cols); return;
  case op::softmax_grad: cpu::softmax_grad(f.in(0), f.in(1), f.out(0), c.rows, c.cols); return;
  case op::attention: run_attention(f); return;
  case op::attention_grad: run_attention_grad(f); return;
  case op::cross_entropy:
  case op::cross_entropy_grad: run_cross_entropy(f); return;
  case op::mse: f.out(0)[0] = cpu::mse(f.in(0), f.in(1)) * c.scale; return;
  case op::mse_grad: cpu::mse_grad(f.in(0), f.in(1), f.out(0), loss_gradient_scale(f)); return;
  case op::embedding:
  case op::embedding_grad: run_embedding(f); return;
  case op::sgd: run_sgd(f); return;
  case op::adamw: run_adamw(f); return;
  case op::grad_sq_norm: f.out(0)[0] = cpu::sum_of_squares(f.in(0), c.replicas); return;
  case op::copy:
    if (f.in_bytes(0).data() != f.out_bytes(0).data()) std::memmove(f.out_bytes(0).data(), f.in_bytes(0).data(), c.n);
    return;
  case op::slice:
  case op::concat:
  case op::shard_slice: run_parts(f); return;
  case op::cast: run_cast(f); return;
  case op::keep_one:
    // Coordinate 0 on `mesh_axis` keeps the value, the others hold zero: a pending sum of one term.
    if (!c.keep) std::memset(f.out_bytes(0).data(), 0, c.n);
    else if (f.in_bytes(0).data() != f.out_bytes(0).data()) std::memmove(f.out_bytes(0).data(), f.in_bytes(0).data(), c.n);
    return;
  case op::vocab_ce_max:
  case op::vocab_ce_target:
  case op::vocab_ce_sumexp:
  case op::vocab_ce_loss:
  case op::vocab_ce_grad: run_vocab_ce(f); return;
  case op::silu: cpu::silu(f.in(0), f.out(0)); return;
  case op::sigmoid: cpu::sigmoid(f.in(0), f.out(0)); return;
  case op::sigmoid_grad: cpu::sigmoid_grad(f.in(0), f.in(1), f.out(0)); return;
  case op::tanh: cpu::tanh(f.in(0), f.out(0)); return;
  case op::tanh_grad: cpu::tanh_grad(f.in(0), f.in(1), f.out(0)); return;
  case op::transpose: cpu::swap_dims(f.in(0), f.out(0), c.batch, c.rows, c.cols, c.k); return;
  case op::batchnorm_stats: cpu::batchnorm_stats(f.in(0), f.out(0), c.rows, c.cols); return;
  case op::batchnorm_scale:
    if (c.from_running) cpu::batchnorm_scale_running(f.in(0), f.in(1), f.out(0), c.cols, f.s.batchnorm_eps);
    else cpu::batchnorm_scale(f.in(0), f.in(1), f.out(0), c.cols, c.count, f.s.batchnorm_eps);
    return;
  case op::batchnorm_track: cpu::batchnorm_track(f.in(0), f.out(0), c.cols, c.count, c.scale); return;
  case op::batchnorm: cpu::batchnorm(f.in(0), f.in(1), f.in(2), f.out(0), c.rows, c.cols); return;
  case op::batchnorm_grad_stats: cpu::batchnorm_grad_stats(f.in(0), f.in(1), f.in(2), f.out(0), c.rows, c.cols); return;
  case op::batchnorm_grad: cpu::batchnorm_grad(f.in(0), f.in(1), f.in(2), f.in(3), f.out(0), c.rows, c.cols, c.count); return;
  case op::sum_dim:
  case op::mean_dim: cpu::sum_dim(f.in(0), f.out(0), c.rows, c.k, c.cols, c.scale); return;
  case op::sum_dim_grad:
  case op::mean_dim_grad: cpu::sum_dim_grad(f.in(0), f.out(0), c.rows, c.k, c.cols, c.scale); return;
  case op::dropout:
  case op::dropout_grad: cpu::dropout(f.in(0), f.out(0), c.drop, f.s.step); return;
  case op::concat_dim: cpu::concat_dim(f.in(0), f.in(1), f.out(0), c.part); return;
  case op::slice_dim: cpu::slice_dim(f.in(0), f.out(0), c.part); return;
  case op::concat_dim_grad: cpu::concat_dim_grad(f.in(0), f.out(0), c.part); return;
  case op::slice_dim_grad: cpu::slice_dim_grad(f.in(0), f.out(0), c.part); return;
  case op::max_pool: cpu::max_pool(f.in(0), f.out(0), c.conv); return;
  case op::max_pool_grad: cpu::max_pool_grad(f.in(0), f.in(1), f.out(0), c.conv); return;
  case op::avg_pool: cpu::avg_pool(f.in(0), f.out(0), c.conv); return;
  case op::avg_pool_grad: cpu::avg_pool_grad(f.in(0), f.out(0), c.conv); return;
  case op::conv2d: cpu::conv2d(f.in(0), f.in(1), f.out(0), c.conv, f.scratch(cpu::conv2d_workspace_floats(c.conv))); return;
  case op::conv2d_grad_input:
    cpu::conv2d_grad_input(f.in(0), f.in(1), f.out(0), c.conv, f.scratch(cpu::conv2d_workspace_floats(c.conv)));
    return;
  case op::conv2d_grad_weight:
    cpu::conv2d_grad_weight(f.in(0), f.in(1), f.out(0), c.conv, c.accumulate, f.scratch(cpu::conv2d_workspace_floats(c.conv)));
    return;
  case op::silu_grad: cpu::silu_grad(f.in(0), f.in(1), f.out(0)); return;
  case op::mul: cpu::mul(f.in(0), f.in(1), f.out(0)); return;
  case op::swiglu: cpu::swiglu(f.in(0), f.in(1), f.out(0)); return;
  case op::swiglu_grad: cpu::swiglu_grad(f.in(0), f.in(1), f.in(2), f.out(0).first(c.n), f.out(0).subspan(c.n)); return;
  case op::rmsnorm: run_rmsnorm(f); return;
  case op::rmsnorm_grad: run_rmsnorm_grad(f); return;
  case op::rmsnorm_grad_gain: run_rmsnorm_grad_gain(f); return;
  case op::rope: cpu::rope(f.in(0), f.ints(1), f.out(0), c.rows, c.cols, c.head_dim, c.theta); return;
  case op::rope_grad: cpu::rope_grad(f.in(0), f.ints(1), f.out(0), c.rows, c.cols, c.head_dim, c.theta); return;
  case op::moe_route: case op::moe_route_grad: case op::moe_dispatch: case op::moe_dispatch_grad: case op::moe_combine:
  case op::moe_combine_grad: run_moe(f); return;
  case op::none: case op::input: case op::data: case op::param: case op::state: case op::to: case op::repeat_in:
  case op::repeat_out: case op::select: case op::all_reduce: case op::all_gather: case op::reduce_scatter:
  case op::all_to_all: case op::send: case op::recv: case op::broadcast: case op::sum: case op::max: case op::min:
  case op::add_position: case op::position_embedding_grad: case op::transpose_blocks: case op::flatten: case op::unflatten: case op::flatten_grad: break;
  }
  fail(task_ref(*c.task) + ": the CPU has no kernel for fn '" + std::string(ir::to_string(c.fn)) + "'");
}

} // namespace detail

/// @brief Runs one decoded compute task on the arena's buffers (f32 kernels, 16-bit float operands
/// staged; ids in i32).
/// @code
/// runtime::run_kernel(calls[t.id], arena, settings);
/// @endcode
inline void run_kernel(const kernel_call& c, host_arena& mem, const kernel_settings& s) {
  detail::cpu_frame f(c, mem, s);
  detail::run_call(f);
  f.commit();
}

} // namespace concerto::runtime
