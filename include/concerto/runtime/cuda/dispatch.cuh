#pragma once
/// @file
/// @brief From a decoded compute task (runtime/kernel_call.hpp) to a CUDA kernel or a cuBLASLt
/// product: the GPU twin of runtime/dispatch.hpp, one function per op. Needs nvcc.
///
/// It runs exactly the ops the CPU dispatch runs (both are checked against the op table at
/// compile time) from the same decoded calls: `runtime::decode` read and checked the operands
/// once, so nothing here reads attrs. Products are described once per task (`describe_gemm`,
/// before the first step). Matmul takes fp32 operands or 16-bit float ones, bf16 or f16 (fp32
/// accumulation, C in fp32 or the inputs' 16-bit type; a product whose inputs differ in type
/// widens its 16-bit ones, and a C of another 16-bit type is staged). The hot ops of a
/// transformer (reads_16bit_natively: attention, the norms, the pointwise ops, softmax, the
/// embedding and the cross-entropy) read and write each operand in its own type, f32, bf16 or
/// f16, computing in fp32 (kernels.cuh's float_in and float_out); every other kernel computes
/// on f32, and a 16-bit float operand is widened into the workspace before it and rounded back
/// after it (kernel_call::staged, as on the CPU). Integer operands are i32, or i64 narrowed into
/// the workspace by a kernel.
///
/// Under dynamic loss scaling (kernel_call::loss_scale) the loss gradients and the updates read
/// the step's loss scale from device memory when their kernels run, as they read the optimizer
/// step and the gradient norm: a captured CUDA graph replays with the value the host wrote
/// before the step.
///
/// What a task does not store (layernorm's statistics, attention's lse, cross-entropy's lse)
/// lives in a device workspace for the duration of one task and is recomputed by the backward
/// kernel that needs it, as on the CPU; `device_workspace_bytes(g)` sizes it.

#if !defined(__CUDACC__) && !defined(CONCERTO_CUDA_EMULATION)
#error "concerto/runtime/cuda/dispatch.cuh launches CUDA kernels: compile this source with nvcc (concerto_cuda_sources(target) in CMake)"
#endif

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/convolution.hpp>
#include <concerto/runtime/cuda/cudnn_attention.hpp>
#include <concerto/runtime/cuda/kernels.cuh>
#include <concerto/runtime/cuda/memory.hpp>
#include <concerto/runtime/cuda/moe.cuh>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/kernel_call.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace concerto::runtime::cuda {

/// @brief What a kernel call needs besides its buffers: the stream, the cuBLASLt and cuDNN handles
/// and the device words the backend owns. All pointers are device pointers except the handles.
/// cuBLASLt and cuDNN share one library workspace: both run on the compute stream, one at a time.
struct device_context {
  cudaStream_t stream = nullptr;
  const blas_handle* blas = nullptr;
  const dnn_handle* dnn = nullptr;
  void* blas_workspace = nullptr;
  std::size_t blas_workspace_bytes = 0;
  float* workspace = nullptr;             ///< device_workspace_bytes(graph) bytes
  int* status = nullptr;                  ///< 0, or task id + 1 of the first kernel that met a bad id
  const std::int64_t* step = nullptr;     ///< the optimizer step, counting from 1
  std::size_t workspace_floats = 0;       ///< size of `workspace`; a task needing more throws
  /// cuDNN's fused attention (runtime/cuda/cudnn_attention.hpp), where the backend made one: the
  /// fast path for 16-bit operands, in the library workspace; null: the own kernels.
  cudnn_attention_cache* attention = nullptr;
};

namespace detail {

// Every piece a task takes from the workspace starts on a 256-byte boundary.
inline constexpr std::size_t workspace_pad = 64;
constexpr std::size_t padded(std::size_t floats) noexcept { return (floats + workspace_pad - 1) / workspace_pad * workspace_pad; }

} // namespace detail

/// @brief Whether the GPU kernel of an op reads and writes its bf16 and f16 operands in place
/// (fp32 arithmetic inside), rather than on f32 copies staged in the workspace. The others are
/// rarer or run through libraries that take one type (matmul, cuDNN).
[[nodiscard]] constexpr bool reads_16bit_natively(ir::op fn) noexcept {
  using ir::op;
  switch (fn) {
  case op::attention: case op::attention_grad: case op::layernorm: case op::layernorm_grad: case op::layernorm_grad_gamma:
  case op::rmsnorm: case op::rmsnorm_grad: case op::rmsnorm_grad_gain: case op::bias_add: case op::bias_grad: case op::gelu:
  case op::gelu_grad: case op::silu: case op::silu_grad: case op::swiglu: case op::swiglu_grad: case op::add: case op::mul:
  case op::softmax: case op::softmax_grad: case op::embedding: case op::embedding_grad: case op::cross_entropy:
  case op::cross_entropy_grad: return true;
  default: return false;
  }
}

/// @brief Device workspace floats a call's kernel takes besides its staged 16-bit float operands' f32 copies:
/// what the kernels keep between two launches (attention's per-row delta), the statistics the
/// DSL's tasks do not store, the column sums' second level, the embedding gradient's token order,
/// and i64 ids narrowed to i32 (`i64_ids`: whether the call's integer operand is i64). 0 for the rest.
[[nodiscard]] inline std::size_t device_kernel_workspace_floats(const kernel_call& c, bool i64_ids) {
  using ir::op;
  const std::size_t ids = i64_ids ? detail::padded(c.ids) : 0;
  switch (c.fn) {
  case op::layernorm:
  case op::layernorm_grad: return 2 * detail::padded(c.rows);
  case op::layernorm_grad_gamma: return 2 * detail::padded(c.rows) + detail::padded(column_sum_workspace_floats(c.rows, c.cols, 2));
  case op::rmsnorm:
  case op::rmsnorm_grad: return detail::padded(c.rows);
  case op::rmsnorm_grad_gain: return detail::padded(c.rows) + detail::padded(column_sum_workspace_floats(c.rows, c.cols));
  case op::bias_grad:
  case op::scale_table_grad: return detail::padded(column_sum_workspace_floats(c.rows, c.cols));
  case op::rope:
  case op::rope_grad: return ids;
  case op::attention: return detail::padded(c.att.lse_floats());
  case op::attention_grad: return 2 * detail::padded(c.att.lse_floats()) + detail::padded(c.att.q_floats());
  case op::cross_entropy:
  case op::cross_entropy_grad: return ids + detail::padded(c.rows);
  case op::embedding_grad: return ids + detail::padded(embedding_grad_workspace_floats(c.ids, c.rows));
  case op::embedding:
  case op::vocab_ce_target:
  case op::vocab_ce_grad: return ids;
  case op::moe_route:
  case op::moe_route_grad:
  case op::moe_dispatch:
  case op::moe_dispatch_grad:
  case op::moe_combine:
  case op::moe_combine_grad: return detail::padded(moe_workspace_floats(c.fn, c.moe));
  case op::conv2d:
  case op::conv2d_grad_input:
  case op::conv2d_grad_weight: return 2 * detail::padded(static_cast<std::size_t>(c.conv.w_values())); // a KRSC kernel staged for cuDNN
  default: return 0;
  }
}

/// @brief Device workspace floats one call needs: its 16-bit float (bf16, f16) operands' f32
/// copies, each padded, unless its kernel reads them in place (reads_16bit_natively), and what
/// its kernel takes (device_kernel_workspace_floats).
[[nodiscard]] inline std::size_t device_workspace_floats(const kernel_call& c, bool i64_ids) {
  // 16-bit operands widened to f32, each piece padded (at most 10 operands).
  const std::size_t staged = c.staged == 0 || reads_16bit_natively(c.fn) ? 0 : c.staged + 10 * detail::workspace_pad;
  return staged + device_kernel_workspace_floats(c, i64_ids);
}

namespace detail {
// The integer operand of a call, if it has one (ids, targets, labels, positions).
inline bool reads_i64(const ir::graph& g, const kernel_call& c) {
  for (std::size_t i = 0; i < c.n_in; ++i)
    if (g.buffers.at(static_cast<std::size_t>(c.in[i])).type == ir::dtype::i64) return true;
  return false;
}
} // namespace detail

/// @brief Device workspace bytes the graph's kernels need at most; the backend places it after
/// the cuBLASLt workspace.
/// @code
/// arena = cuda::device_arena(g, runtime::make_layout(g, blas_bytes + cuda::device_workspace_bytes(g), cuda::device_alignment));
/// @endcode
[[nodiscard]] inline std::int64_t device_workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind) && ir::info(t.fn).executable) {
      const auto c = decode(g, t);
      floats = std::max(floats, device_workspace_floats(c, detail::reads_i64(g, c)));
    }
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

inline std::string call_ref(const kernel_call& c) {
  return runtime::detail::task_ref(*c.task) + " (fn '" + std::string(ir::to_string(c.fn)) + "')";
}

/// One call's view of the device arena: pointers to its operands and pieces of the workspace;
/// running past the workspace throws naming the task.
class device_frame {
public:
  device_frame(const kernel_call& c, const device_arena& mem, const kernel_settings& s, const device_context& ctx)
      : c(c), s(s), ctx(ctx), st(ctx.stream), code(c.task->id + 1), mem_(mem) {}

  float* in(std::size_t i) { return values(c.in[i]); }
  float* out(std::size_t i) { return values(c.out[i]); }
  /// Operand i in its own type, for the kernels that read 16-bit floats in place (nothing staged).
  float_in typed_in(std::size_t i) const { return {mem_.ptr(c.in[i]), mem_.type(c.in[i])}; }
  float_out typed_out(std::size_t i) const { return {mem_.ptr(c.out[i]), mem_.type(c.out[i])}; }
  /// Buffer b as f32 values: itself, or (bf16, f16) its values widened into the workspace, once per call.
  float* values(ir::buffer_id b) {
    const auto type = mem_.type(b);
    if (!ir::is_16bit_float(type)) return mem_.f32(b);
    for (std::size_t k = 0; k < n_staged_; ++k)
      if (staged_[k].id == b) return staged_[k].values;
    if (n_staged_ == staged_.size()) fail(call_ref(c) + ": more 16-bit float operands than a kernel call stages");
    const auto n = mem_.count(b);
    float* wide = take(n, "a 16-bit float operand widened to f32");
    convert(type, mem_.ptr(b), ir::dtype::f32, wide, n, st);
    staged_[n_staged_++] = {b, wide, n};
    return wide;
  }
  /// Rounds the staged operands the kernel may have written back into their 16-bit buffers.
  void commit() {
    for (std::size_t k = 0; k < n_staged_; ++k)
      for (std::size_t i = 0; i < c.n_out; ++i)
        if (c.out[i] == staged_[k].id) {
          const auto b = staged_[k].id;
          convert(ir::dtype::f32, staged_[k].values, mem_.type(b), mem_.ptr(b), staged_[k].count, st);
          break;
        }
  }
  std::byte* ptr(ir::buffer_id b) const { return mem_.ptr(b); }
  [[nodiscard]] ir::dtype type(ir::buffer_id b) const { return mem_.type(b); }
  std::size_t bytes(ir::buffer_id b) const { return static_cast<std::size_t>(mem_.bytes(b)); }
  float* take(std::size_t floats, const char* what) {
    const auto need = padded(floats);
    if (ctx.workspace == nullptr || used_ + need > ctx.workspace_floats)
      fail(call_ref(c) + ": the device workspace holds " + std::to_string(ctx.workspace_floats) + " floats, too few for `" +
           what + "` (" + std::to_string(floats) + " more after " + std::to_string(used_) + "); size it with device_workspace_bytes");
    float* p = ctx.workspace + used_;
    used_ += need;
    return p;
  }
  /// Integer operand i as i32: itself, or (i64) narrowed into the workspace.
  const std::int32_t* ints(std::size_t i) {
    const auto b = c.in[i];
    if (mem_.type(b) == ir::dtype::i32) return mem_.i32(b);
    const auto n = mem_.count(b);
    auto* narrowed = reinterpret_cast<std::int32_t*>(take(n, "narrowed ids"));
    narrow_ids(reinterpret_cast<const std::int64_t*>(mem_.ptr(b)), narrowed, n, ctx.status, code, st);
    return narrowed;
  }

  const kernel_call& c;
  const kernel_settings& s;
  const device_context& ctx;
  cudaStream_t st;
  int code;

private:
  struct staged {
    ir::buffer_id id = -1;
    float* values = nullptr;
    std::size_t count = 0;
  };
  const device_arena& mem_;
  std::size_t used_ = 0;
  std::array<staged, 10> staged_{};
  std::size_t n_staged_ = 0;
};

// `outer` rows of `len` bytes from a row pitch of `src_row` to one of `dst_row` (decode checked
// the extents); contiguous runs become one copy.
inline void copy_rows(std::byte* src, std::byte* dst, std::size_t outer, std::size_t src_row, std::size_t dst_row,
                      std::size_t src_off, std::size_t dst_off, std::size_t len, cudaStream_t s) {
  if (outer == 0 || len == 0) return;
  if (outer == 1 || (src_row == len && dst_row == len)) {
    if (src + src_off != dst + dst_off)
      check(cudaMemcpyAsync(dst + dst_off, src + src_off, outer * len, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    return;
  }
  check(cudaMemcpy2DAsync(dst + dst_off, dst_row, src + src_off, src_row, len, outer, cudaMemcpyDeviceToDevice, s),
        "cudaMemcpy2DAsync");
}

inline gemm_type gemm_type_of(const kernel_call& c, const device_arena& mem, ir::buffer_id b) {
  switch (mem.type(b)) {
  case ir::dtype::f32: return gemm_type::f32;
  case ir::dtype::bf16: return gemm_type::bf16;
  case ir::dtype::f16: return gemm_type::f16;
  case ir::dtype::i32:
  case ir::dtype::i64: break;
  }
  fail(call_ref(c) + ": matmul operand '" + mem.name(b) + "' holds " + std::string(ir::to_string(mem.type(b))) +
       "; the GPU products take f32, bf16 or f16");
}

// RMSNorm's rstd is recomputed by each task (rmsnorm_stats), as on the CPU.
inline void run_rmsnorm(device_frame& f) {
  const auto& c = f.c;
  rmsnorm(f.typed_in(0), f.typed_in(1), f.typed_out(0), f.take(c.rows, "rstd"), c.rows, c.cols, f.s.rmsnorm_eps, f.st);
}
inline void run_rmsnorm_grad(device_frame& f) {
  const auto& c = f.c;
  float* rstd = f.take(c.rows, "rstd");
  rmsnorm_stats(f.typed_in(0), rstd, c.rows, c.cols, f.s.rmsnorm_eps, f.st);
  rmsnorm_grad(f.typed_in(2), f.typed_in(0), f.typed_in(1), rstd, f.typed_out(0), c.rows, c.cols, f.st);
}
// The column sums' second level, where one split of the rows would leave the GPU idle.
inline float* column_sum_space(device_frame& f, std::size_t sums) {
  const auto floats = column_sum_workspace_floats(f.c.rows, f.c.cols, sums);
  return floats == 0 ? nullptr : f.take(floats, "the column sums' partial sums");
}
inline void run_rmsnorm_grad_gain(device_frame& f) {
  const auto& c = f.c;
  float* rstd = f.take(c.rows, "rstd");
  rmsnorm_stats(f.typed_in(0), rstd, c.rows, c.cols, f.s.rmsnorm_eps, f.st);
  rmsnorm_grad_gain(f.typed_in(1), f.typed_in(0), rstd, f.typed_out(0), c.rows, c.cols, c.accumulate, f.st, column_sum_space(f, 1));
}

inline void run_layernorm(device_frame& f) {
  const auto& c = f.c;
  float* mean = f.take(c.rows, "mean");
  float* rstd = f.take(c.rows, "rstd");
  layernorm(f.typed_in(0), f.typed_in(1), f.typed_in(2), f.typed_out(0), mean, rstd, c.rows, c.cols, f.s.layernorm_eps, f.st);
}

// dx from x, gamma, dy; the statistics are recomputed, dgamma and dbeta are other tasks.
inline void run_layernorm_grad(device_frame& f) {
  const auto& c = f.c;
  float* mean = f.take(c.rows, "mean");
  float* rstd = f.take(c.rows, "rstd");
  layernorm_stats(f.typed_in(0), mean, rstd, c.rows, c.cols, f.s.layernorm_eps, f.st);
  layernorm_grad_input(f.typed_in(2), f.typed_in(0), f.typed_in(1), mean, rstd, f.typed_out(0), c.rows, c.cols, f.st);
}

inline void run_layernorm_grad_gamma(device_frame& f) {
  const auto& c = f.c;
  float* mean = f.take(c.rows, "mean");
  float* rstd = f.take(c.rows, "rstd");
  layernorm_stats(f.typed_in(0), mean, rstd, c.rows, c.cols, f.s.layernorm_eps, f.st);
  layernorm_grad_gamma(f.typed_in(1), f.typed_in(0), mean, rstd, f.typed_out(0), c.rows, c.cols, c.accumulate, f.st,
                       column_sum_space(f, 2));
}

// q, k, v, dy -> one buffer holding dq, dk, dv one after the other; lse is recomputed.
// cuDNN's fused attention where the backend made its cache and q, k, v, out (and dout) are of one
// 16-bit type; false (nothing written) where cuDNN cannot run the case, and the own kernels run.
// The backward recomputes the forward's output and lse in the library workspace, as the own
// kernels recompute them in theirs.
inline bool fused_attention(device_frame& f) {
  const auto& c = f.c;
  if (f.ctx.attention == nullptr) return false;
  const auto type = f.type(c.in[0]);
  const std::size_t reads = c.fn == ir::op::attention ? 3 : 4;
  for (std::size_t i = 0; i < reads; ++i)
    if (f.type(c.in[i]) != type) return false;
  if (!ir::is_16bit_float(type) || f.type(c.out[0]) != type) return false;
  cudnn_attention_operands ops{.q = f.ptr(c.in[0]), .k = f.ptr(c.in[1]), .v = f.ptr(c.in[2])};
  if (c.fn == ir::op::attention) {
    ops.out = f.ptr(c.out[0]);
    return cudnn_attention_forward(*f.ctx.attention, f.st, type, c.att, ops, f.ctx.blas_workspace, f.ctx.blas_workspace_bytes);
  }
  std::byte* const d = f.ptr(c.out[0]);
  const auto width = ir::size_of(type);
  ops.dout = f.ptr(c.in[3]);
  ops.dq = d;
  ops.dk = d + c.att.q_floats() * width;
  ops.dv = d + (c.att.q_floats() + c.att.kv_floats()) * width;
  return cudnn_attention_backward(*f.ctx.attention, f.st, type, c.att, ops, f.ctx.blas_workspace, f.ctx.blas_workspace_bytes);
}

inline void run_attention(device_frame& f) {
  if (fused_attention(f)) return;
  causal_attention(f.typed_in(0), f.typed_in(1), f.typed_in(2), f.typed_out(0), f.take(f.c.att.lse_floats(), "lse"), f.c.att, f.st);
}

inline void run_attention_grad(device_frame& f) {
  if (fused_attention(f)) return;
  const auto& a = f.c.att;
  float* lse = f.take(a.lse_floats(), "lse");
  float* out = f.take(a.q_floats(), "recomputed output");
  float* delta = f.take(a.lse_floats(), "delta");
  const auto q = f.typed_in(0), k = f.typed_in(1), v = f.typed_in(2);
  causal_attention(q, k, v, out, lse, a, f.st);
  const auto d = f.typed_out(0);
  causal_attention_grad(q, k, v, out, f.typed_in(3), lse, d, d + a.q_floats(), d + a.q_floats() + a.kv_floats(), delta, a, f.st);
}

// The step's loss scale under dynamic loss scaling (in device memory, read when the kernel runs), or null.
inline const float* loss_scale(device_frame& f) {
  return f.c.loss_scale < 0 ? nullptr : reinterpret_cast<const float*>(f.ptr(f.c.loss_scale));
}

inline void run_cross_entropy(device_frame& f) {
  const auto& c = f.c;
  const auto* targets = f.ints(1);
  float* lse = f.take(c.rows, "lse");
  if (c.fn == ir::op::cross_entropy) {
    cross_entropy(f.typed_in(0), targets, lse, f.typed_out(0), c.rows, c.cols, f.ctx.status, f.code, f.st, c.scale);
    return;
  }
  cross_entropy_lse(f.typed_in(0), targets, lse, c.rows, c.cols, f.ctx.status, f.code, f.st);
  cross_entropy_grad(f.typed_in(0), targets, lse, f.typed_out(0), c.rows, c.cols, c.scale, f.st, loss_scale(f));
}

inline void run_embedding(device_frame& f) {
  const auto& c = f.c;
  const auto* ids = f.ints(0);
  if (c.fn == ir::op::embedding) {
    embedding(ids, f.typed_in(1), f.typed_out(0), c.ids, c.cols, c.rows, c.first, c.reject_outside, f.ctx.status, f.code, f.st);
    return;
  }
  float* order = f.take(embedding_grad_workspace_floats(c.ids, c.rows), "the embedding gradient's token order");
  embedding_grad(ids, f.typed_in(1), f.typed_out(0), c.ids, c.cols, c.rows, c.accumulate, c.first, c.reject_outside, f.ctx.status,
                 f.code, order, f.st);
}

// The squared global gradient norm an update with clipping reads (in device memory), or null.
inline const float* grad_norm_sq(device_frame& f) {
  return f.c.grad_norm_sq < 0 ? nullptr : reinterpret_cast<const float*>(f.ptr(f.c.grad_norm_sq));
}

// The optimizer step in device memory, which a kernel that depends on it reads (a captured graph
// replays with the current step); `what` names the kernel's need in the error.
inline const std::int64_t* device_step(const device_frame& f, const char* what) {
  CONCERTO_CHECK(f.ctx.step != nullptr, call_ref(f.c) + ": no device step counter for " + what);
  return f.ctx.step;
}

// Under a 16-bit policy the update writes the parameter's working copy from the new master in the
// same pass (no widening of it into the workspace).
inline working_copy working_of(const device_frame& f) {
  if (f.c.working < 0) return {};
  return {f.ptr(f.c.working), f.type(f.c.working)};
}

inline void run_sgd(device_frame& f) {
  float* momentum = nullptr;
  if (f.s.sgd.momentum != 0.0f) {
    if (f.c.n_out < (f.c.working >= 0 ? 3 : 2))
      fail(call_ref(f.c) + ": SGD with momentum needs a momentum buffer as its second write");
    momentum = f.out(1);
  }
  sgd_update(f.out(0), f.in(1), momentum, f.c.n, f.s.sgd, f.s.schedule, device_step(f, "SGD's scheduled rate"), grad_norm_sq(f),
             f.s.clip_norm, f.st, loss_scale(f), working_of(f));
}

inline void run_adamw(device_frame& f) {
  adamw_update(f.out(0), f.in(1), f.out(1), f.out(2), f.c.n, f.s.adamw, f.s.schedule, device_step(f, "AdamW"), grad_norm_sq(f),
               f.s.clip_norm, f.st, loss_scale(f), working_of(f));
}

inline void run_dropout(device_frame& f) {
  dropout(f.in(0), f.out(0), f.c.drop, device_step(f, "the dropout's mask"), f.c.n, f.st);
}

// slice and shard_slice copy their part out of the whole buffer's rows; concat places each part.
inline void run_parts(device_frame& f) {
  const auto& c = f.c;
  const bool into_part = c.fn != ir::op::concat;
  std::byte* whole = f.ptr(into_part ? c.in[0] : c.out[0]);
  for (const auto& p : c.parts) {
    if (into_part) copy_rows(whole, f.ptr(p.part), p.outer, p.whole_row, p.part_row, p.offset, 0, p.part_row, f.st);
    else copy_rows(f.ptr(p.part), whole, p.outer, p.part_row, p.whole_row, 0, p.offset, p.part_row, f.st);
  }
}

// Megatron-LM's vocabulary-parallel cross-entropy over this rank's columns; see runtime/dispatch.hpp.
inline void run_vocab_ce(device_frame& f) {
  const auto& c = f.c;
  switch (c.fn) {
  case ir::op::vocab_ce_max: vocab_ce_max(f.in(0), f.out(0), c.rows, c.cols, f.st); return;
  case ir::op::vocab_ce_sumexp: vocab_ce_sumexp(f.in(0), f.in(1), f.out(0), c.rows, c.cols, f.st); return;
  case ir::op::vocab_ce_target: vocab_ce_target(f.in(0), f.in(2), f.ints(1), f.out(0), c.rows, c.cols, c.first, f.st); return;
  case ir::op::vocab_ce_grad:
    vocab_ce_grad(f.in(0), f.in(2), f.in(3), f.ints(1), f.out(0), c.rows, c.cols, c.first, c.scale, f.st, loss_scale(f));
    return;
  default: // vocab_ce_loss: Σ (log sumexp - target) / global rows; scale is 1 / global rows
    vocab_ce_loss(f.in(0), f.in(1), f.out(0), c.rows, 1.0 / static_cast<double>(c.scale), f.st);
    return;
  }
}

// The MoE kernels (cuda/moe.cuh); the ones that place tokens in slots find the slots in the workspace.
inline void run_moe(device_frame& f) {
  const auto& c = f.c;
  const auto& s = c.moe;
  float* ws = f.take(moe_workspace_floats(c.fn, s), "moe workspace");
  auto* slots = reinterpret_cast<std::int32_t*>(ws);
  switch (c.fn) {
  case ir::op::moe_route: moe_route(f.in(0), f.out(0), s, ws, f.st); return;
  case ir::op::moe_route_grad: moe_route_grad(f.in(0), f.in(1), f.in(2), f.out(0), s, c.scale, ws, f.st, loss_scale(f)); return;
  case ir::op::moe_dispatch: moe_dispatch(f.in(0), f.in(1), f.out(0), s, slots, f.ctx.status, f.code, f.st); return;
  case ir::op::moe_dispatch_grad: moe_gather(f.in(0), f.in(1), f.out(0), s, slots, false, f.ctx.status, f.code, f.st); return;
  case ir::op::moe_combine: moe_gather(f.in(0), f.in(1), f.out(0), s, slots, true, f.ctx.status, f.code, f.st); return;
  case ir::op::moe_combine_grad: {
    float* dy = f.out(0);
    moe_combine_grad(f.in(2), f.in(0), f.in(1), dy, dy + s.experts * s.slots() * s.hidden, s, slots, f.ctx.status, f.code, f.st);
    return;
  }
  default: return;
  }
}

// cast: f32 to bf16 or f16 rounds to nearest even, back to f32 is exact, between the two 16-bit
// types through f32, one type to itself copies.
inline void run_cast(device_frame& f) {
  const auto from = f.c.in[0], to = f.c.out[0];
  if (f.type(from) != f.type(to)) {
    convert(f.type(from), f.ptr(from), f.type(to), f.ptr(to), f.c.n, f.st);
  } else if (f.ptr(from) != f.ptr(to) && f.c.n > 0) {
    check(cudaMemcpyAsync(f.ptr(to), f.ptr(from), f.bytes(from), cudaMemcpyDeviceToDevice, f.st), "cudaMemcpyAsync");
  }
}

// A convolution's pass through its cuDNN plan, or the own kernels where the backend described
// none. A plan that takes the kernel as KRSC gets it transposed into the workspace ([patch, out]
// to [out, patch]); its kernel gradient comes back the same way and is added when accumulating.
inline void run_conv(device_frame& f, const conv_plan* plan) {
  using ir::op;
  const auto& c = f.c;
  const auto st = f.st;
  if (plan == nullptr || !*plan) {
    if (c.fn == op::conv2d) cuda::conv2d(f.in(0), f.in(1), f.out(0), c.conv, st);
    else if (c.fn == op::conv2d_grad_input) cuda::conv2d_grad_input(f.in(0), f.in(1), f.out(0), c.conv, st);
    else cuda::conv2d_grad_weight(f.in(0), f.in(1), f.out(0), c.conv, c.accumulate, st);
    return;
  }
  const auto& dnn = *f.ctx.dnn;
  const auto patch = static_cast<std::size_t>(c.conv.patch()), out = static_cast<std::size_t>(c.conv.out_channels);
  const bool staged = plan->filter() == filter_layout::krsc;
  if (c.fn != op::conv2d_grad_weight) { // forward (x, w) and the image's gradient (dy, w)
    const float* w = f.in(1);
    if (staged) {
      float* krsc = f.take(patch * out, "a convolution kernel as KRSC");
      cuda::swap_dims(w, krsc, 1, patch, out, 1, st);
      w = krsc;
    }
    plan->run(dnn, f.in(0), w, f.out(0), f.ctx.blas_workspace, st);
    return;
  }
  if (!staged) {
    plan->run(dnn, f.in(0), f.in(1), f.out(0), f.ctx.blas_workspace, st);
    return;
  }
  float* krsc = f.take(patch * out, "a convolution kernel's gradient as KRSC");
  plan->run(dnn, f.in(0), f.in(1), krsc, f.ctx.blas_workspace, st);
  if (!c.accumulate) {
    cuda::swap_dims(krsc, f.out(0), 1, out, patch, 1, st);
    return;
  }
  float* hwio = f.take(patch * out, "a convolution kernel's gradient as HWIO");
  cuda::swap_dims(krsc, hwio, 1, out, patch, 1, st);
  cuda::add_inplace(f.out(0), hwio, patch * out, st);
}

// A product as describe_gemm described it: 16-bit inputs of one type read in place, else f32
// ones (a 16-bit one widened); C in place when described in its own type, else as f32 (an f32
// buffer itself, a 16-bit one staged).
inline void run_matmul(device_frame& f, const gemm* product) {
  const auto& c = f.c;
  CONCERTO_CHECK(product != nullptr && f.ctx.blas != nullptr, call_ref(c) + ": no product described for the matmul");
  const auto& shape = product->shape();
  const bool narrow = shape.ab != gemm_type::f32;
  const void* a = narrow ? static_cast<const void*>(f.ptr(c.in[0])) : f.in(0);
  const void* b = narrow ? static_cast<const void*>(f.ptr(c.in[1])) : f.in(1);
  void* out = shape.c != gemm_type::f32 ? static_cast<void*>(f.ptr(c.out[0])) : f.out(0);
  product->run(*f.ctx.blas, a, b, out, f.ctx.blas_workspace, f.st);
}

// The kernel of the call's op; 16-bit float operands are read in place by the ops reads_16bit_natively
// names and staged by the frame for the rest (see the file comment).
inline void run_call(device_frame& f, const gemm* product, const conv_plan* conv) {
  using ir::op;
  const auto& c = f.c;
  const auto& ctx = f.ctx;
  const auto st = ctx.stream;
  switch (c.fn) {
  case op::matmul: run_matmul(f, product); return;
  case op::add: cuda::add(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.n, st); return;
  case op::add_inplace: cuda::add_inplace(f.out(0), f.in(1), c.n, st); return;
  case op::scale: cuda::scale(f.in(0), c.scale, f.out(0), c.n, st); return;
  case op::bias_add: cuda::bias_add(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.rows, c.cols, st); return;
  case op::bias_grad:
    cuda::bias_add_grad(f.typed_in(0), f.typed_out(0), c.rows, c.cols, c.accumulate, st, column_sum_space(f, 1));
    return;
  case op::scale_table: cuda::scale_table(f.in(0), f.in(1), f.out(0), c.rows, c.cols, st); return;
  case op::scale_table_grad:
    cuda::scale_table_grad(f.in(0), f.in(1), f.out(0), c.rows, c.cols, c.accumulate, st, column_sum_space(f, 1));
    return;
  case op::gelu: cuda::gelu(f.typed_in(0), f.typed_out(0), c.n, st); return;
  case op::relu: cuda::relu(f.in(0), f.out(0), c.n, st); return;
  case op::gelu_grad: cuda::gelu_grad(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.n, st); return;
  case op::relu_grad: cuda::relu_grad(f.in(0), f.in(1), f.out(0), c.n, st); return;
  case op::zero:
    for (const auto b : c.task->writes)
      if (f.bytes(b) > 0) check(cudaMemsetAsync(f.ptr(b), 0, f.bytes(b), st), "cudaMemsetAsync");
    return;
  case op::layernorm: run_layernorm(f); return;
  case op::layernorm_grad: run_layernorm_grad(f); return;
  case op::layernorm_grad_gamma: run_layernorm_grad_gamma(f); return;
  case op::softmax: cuda::softmax(f.typed_in(0), f.typed_out(0), c.rows, c.cols, st); return;
  case op::softmax_grad: cuda::softmax_grad(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.rows, c.cols, st); return;
  case op::attention: run_attention(f); return;
  case op::attention_grad: run_attention_grad(f); return;
  case op::cross_entropy:
  case op::cross_entropy_grad: run_cross_entropy(f); return;
  case op::mse: cuda::mse(f.in(0), f.in(1), f.out(0), c.n, st, c.scale); return;
  case op::mse_grad: cuda::mse_grad(f.in(0), f.in(1), f.out(0), c.n, c.scale, st, loss_scale(f)); return;
  case op::embedding:
  case op::embedding_grad: run_embedding(f); return;
  case op::sgd: run_sgd(f); return;
  case op::adamw: run_adamw(f); return;
  case op::grad_sq_norm: cuda::grad_sq_norm(f.in(0), f.c.n, f.c.replicas, f.out(0), f.st); return;
  case op::copy:
    if (f.ptr(c.in[0]) != f.ptr(c.out[0]) && c.n > 0)
      check(cudaMemcpyAsync(f.ptr(c.out[0]), f.ptr(c.in[0]), c.n, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    return;
  case op::slice:
  case op::concat:
  case op::shard_slice: run_parts(f); return;
  case op::cast: run_cast(f); return;
  case op::keep_one:
    // Coordinate 0 on `mesh_axis` keeps the value, the others hold zero: a pending sum of one term.
    if (c.n == 0) return;
    if (!c.keep) check(cudaMemsetAsync(f.ptr(c.out[0]), 0, c.n, st), "cudaMemsetAsync");
    else if (f.ptr(c.in[0]) != f.ptr(c.out[0]))
      check(cudaMemcpyAsync(f.ptr(c.out[0]), f.ptr(c.in[0]), c.n, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    return;
  case op::vocab_ce_max:
  case op::vocab_ce_target:
  case op::vocab_ce_sumexp:
  case op::vocab_ce_loss:
  case op::vocab_ce_grad: run_vocab_ce(f); return;
  case op::silu: cuda::silu(f.typed_in(0), f.typed_out(0), c.n, st); return;
  case op::sigmoid: cuda::sigmoid(f.in(0), f.out(0), c.n, st); return;
  case op::sigmoid_grad: cuda::sigmoid_grad(f.in(0), f.in(1), f.out(0), c.n, st); return;
  case op::tanh: cuda::tanh(f.in(0), f.out(0), c.n, st); return;
  case op::tanh_grad: cuda::tanh_grad(f.in(0), f.in(1), f.out(0), c.n, st); return;
  case op::transpose: cuda::swap_dims(f.in(0), f.out(0), c.batch, c.rows, c.cols, c.k, st); return;
  case op::batchnorm_stats: cuda::batchnorm_stats(f.in(0), f.out(0), c.rows, c.cols, st); return;
  case op::batchnorm_scale:
    cuda::batchnorm_scale(f.in(0), f.in(1), f.out(0), c.cols, c.count, f.s.batchnorm_eps, c.from_running, st);
    return;
  case op::batchnorm_track: cuda::batchnorm_track(f.in(0), f.out(0), c.cols, c.count, c.scale, st); return;
  case op::batchnorm: cuda::batchnorm(f.in(0), f.in(1), f.in(2), f.out(0), c.rows, c.cols, st); return;
  case op::batchnorm_grad_stats: cuda::batchnorm_grad_stats(f.in(0), f.in(1), f.in(2), f.out(0), c.rows, c.cols, st); return;
  case op::batchnorm_grad:
    cuda::batchnorm_grad(f.in(0), f.in(1), f.in(2), f.in(3), f.out(0), c.rows, c.cols, c.count, st);
    return;
  case op::sum_dim:
  case op::mean_dim: cuda::sum_dim(f.in(0), f.out(0), c.rows, c.k, c.cols, c.scale, st); return;
  case op::sum_dim_grad:
  case op::mean_dim_grad: cuda::sum_dim_grad(f.in(0), f.out(0), c.rows, c.k, c.cols, c.scale, st); return;
  case op::dropout:
  case op::dropout_grad: run_dropout(f); return;
  case op::concat_dim: cuda::assemble_parts(f.in(0), f.in(1), f.out(0), c.part, st); return;
  case op::slice_dim_grad: cuda::assemble_parts(f.in(0), nullptr, f.out(0), c.part, st); return;
  case op::slice_dim: cuda::extract_part(f.in(0), f.out(0), c.part, false, st); return;
  case op::concat_dim_grad: cuda::extract_part(f.in(0), f.out(0), c.part, true, st); return;
  case op::max_pool: cuda::pool(f.in(0), f.out(0), c.conv, false, st); return;
  case op::avg_pool: cuda::pool(f.in(0), f.out(0), c.conv, true, st); return;
  case op::max_pool_grad: cuda::pool_grad(f.in(0), f.in(1), f.out(0), c.conv, false, st); return;
  case op::avg_pool_grad: cuda::pool_grad(nullptr, f.in(0), f.out(0), c.conv, true, st); return;
  case op::conv2d:
  case op::conv2d_grad_input:
  case op::conv2d_grad_weight: run_conv(f, conv); return;
  case op::silu_grad: cuda::silu_grad(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.n, st); return;
  case op::mul: cuda::mul(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.n, st); return;
  case op::swiglu: cuda::swiglu(f.typed_in(0), f.typed_in(1), f.typed_out(0), c.n, st); return;
  case op::swiglu_grad:
    cuda::swiglu_grad(f.typed_in(0), f.typed_in(1), f.typed_in(2), f.typed_out(0), f.typed_out(0) + c.n, c.n, st);
    return;
  case op::rmsnorm: run_rmsnorm(f); return;
  case op::rmsnorm_grad: run_rmsnorm_grad(f); return;
  case op::rmsnorm_grad_gain: run_rmsnorm_grad_gain(f); return;
  case op::rope:
  case op::rope_grad:
    cuda::rope(f.in(0), f.ints(1), f.out(0), c.rows, c.cols, c.head_dim, c.theta, c.fn == op::rope ? 1.0 : -1.0, st);
    return;
  case op::moe_route: case op::moe_route_grad: case op::moe_dispatch: case op::moe_dispatch_grad: case op::moe_combine:
  case op::moe_combine_grad: run_moe(f); return;
  case op::none: case op::input: case op::data: case op::param: case op::state: case op::to: case op::repeat_in:
  case op::repeat_out: case op::select: case op::all_reduce: case op::all_gather: case op::reduce_scatter:
  case op::all_to_all: case op::send: case op::recv: case op::broadcast: case op::sum: case op::max: case op::min:
  case op::add_position: case op::position_embedding_grad: case op::transpose_blocks: case op::flatten: case op::unflatten: case op::flatten_grad: break;
  }
  fail(call_ref(c) + ": the GPU has no kernel for this op");
}

} // namespace detail

/// @brief Describes the product of a decoded matmul for cuBLASLt in its gemm_form (as the CPU
/// runs it), with each operand's alignment in the arena (`operand_alignment`).
/// @code
/// products[t.id] = cuda::describe_gemm(calls[t.id], arena, lt, cuda::gemm::default_workspace);
/// @endcode
[[nodiscard]] inline gemm describe_gemm(const kernel_call& c, const device_arena& mem, const blas_handle& h,
                                        std::size_t workspace_bytes, bool allow_tf32 = false) {
  gemm_shape s;
  s.m = c.m;
  s.n = c.gemm_n;
  s.k = c.k;
  s.batch = c.batch;
  s.trans_a = c.trans_a;
  s.trans_b = c.trans_b;
  s.accumulate = c.accumulate;
  // cuBLASLt's 16-bit products take inputs of one type and C in f32 or that type: inputs that
  // differ are widened (run_kernel stages them) and the product is f32's; a C of another type
  // is staged as f32.
  const auto a = detail::gemm_type_of(c, mem, c.in[0]), b = detail::gemm_type_of(c, mem, c.in[1]),
             out = detail::gemm_type_of(c, mem, c.out[0]);
  s.ab = a == b ? a : gemm_type::f32;
  s.c = out == s.ab ? out : gemm_type::f32;
  s.allow_tf32 = allow_tf32;
  if (c.form == gemm_form::shared_b) {
    s.m *= s.batch;
    s.batch = 1;
  } else if (c.form == gemm_form::summed_batch) {
    s.k *= s.batch;
    s.batch = 1;
  }
  // Arena views (bucket members, decomposition chunks) start wherever their root's bytes do,
  // so the heuristic is told each operand's real alignment (gemm folds in the batch stride's);
  // a staged one starts a workspace piece, on 256 bytes.
  const auto align = [&](ir::buffer_id id, gemm_type as) {
    return detail::gemm_type_of(c, mem, id) != as ? 256u : operand_alignment(mem.ptr(id));
  };
  s.align_a = align(c.in[0], s.ab);
  s.align_b = align(c.in[1], s.ab);
  s.align_c = align(c.out[0], s.c);
  return gemm(h, s, workspace_bytes);
}

/// @brief The convolution pass an op runs (conv2d, conv2d_grad_input, conv2d_grad_weight), none for the rest.
[[nodiscard]] constexpr std::optional<conv_pass> conv_pass_of(ir::op fn) noexcept {
  switch (fn) {
  case ir::op::conv2d: return conv_pass::forward;
  case ir::op::conv2d_grad_input: return conv_pass::grad_input;
  case ir::op::conv2d_grad_weight: return conv_pass::grad_weight;
  default: return std::nullopt;
  }
}

/// @brief Describes a decoded convolution pass (conv2d, conv2d_grad_input, conv2d_grad_weight)
/// for cuDNN, with the alignment its operands have in the arena. The plan may be empty (no engine
/// suits: `reason()`), and run_kernel then runs the own kernels.
/// @code
/// convs[t.id] = cuda::describe_conv(calls[t.id], arena, dnn, cuda::gemm::default_workspace);
/// @endcode
[[nodiscard]] inline conv_plan describe_conv(const kernel_call& c, const device_arena& mem, const dnn_handle& h,
                                             std::size_t workspace_bytes, bool allow_tf32 = false) {
  const auto pass = conv_pass_of(c.fn);
  CONCERTO_CHECK(pass.has_value(), detail::call_ref(c) + ": describe_conv takes a convolution's pass");
  conv_request r;
  r.geometry = c.conv;
  r.pass = *pass;
  r.accumulate = c.accumulate;
  r.allow_tf32 = allow_tf32;
  r.workspace_limit = workspace_bytes;
  // 16-bit float operands are widened into the workspace, whose pieces start on 256 bytes.
  const auto align = [&](ir::buffer_id b) { return ir::is_16bit_float(mem.type(b)) ? 256u : operand_alignment(mem.ptr(b)); };
  r.align = std::min({align(c.in[0]), align(c.in[1]), align(c.out[0])});
  return conv_plan(h, r);
}

/// @brief Enqueues one decoded compute task on `ctx.stream`; `product` is the task's
/// describe_gemm result for a matmul, `conv` its describe_conv result for a convolution's pass
/// (each ignored otherwise; no plan runs the own convolution kernels).
/// @code
/// cuda::run_kernel(calls[t.id], arena, settings, ctx, &products[t.id], &convs[t.id]);
/// @endcode
inline void run_kernel(const kernel_call& c, const device_arena& mem, const kernel_settings& s, const device_context& ctx,
                       const gemm* product, const conv_plan* conv = nullptr) {
  detail::device_frame f(c, mem, s, ctx);
  detail::run_call(f, product, conv);
  f.commit();
}
} // namespace concerto::runtime::cuda
