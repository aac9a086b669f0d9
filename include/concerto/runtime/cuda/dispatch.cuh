#pragma once
/// @file
/// @brief From a compute task to a CUDA kernel or a cuBLASLt product: the GPU twin of
/// runtime/dispatch.hpp. Needs nvcc.
///
/// It accepts exactly the tasks the CPU dispatch accepts: the same `runtime::resolve` names
/// the kernel, the same operand conventions pick the buffers (docs/runtime.md), the same attrs
/// give the extents, and a size that does not fit throws concerto::error naming the task and
/// the operand. Products are described once per task (`describe_gemm`, before the first step);
/// the other kernels take their extents from the buffers' sizes on every call, which is host
/// arithmetic only. Integer operands are found by dtype as on the CPU (i32, or i64 narrowed
/// into the workspace by a kernel). Matmul takes fp32 or bf16 operands (fp32 accumulation, C in
/// fp32 or bf16); every other kernel is fp32.
///
/// What the DSL's tasks do not store (layernorm's statistics, attention's lse, cross-entropy's
/// lse) lives in a device workspace for the duration of one task and is recomputed by the
/// backward kernel that needs it, as on the CPU; `device_workspace_bytes(g)` sizes it.

#if !defined(__CUDACC__) && !defined(CONCERTO_CUDA_EMULATION)
#error "concerto/runtime/cuda/dispatch.cuh launches CUDA kernels: compile this source with nvcc (concerto_cuda_sources(target) in CMake)"
#endif

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/kernels.cuh>
#include <concerto/runtime/cuda/memory.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/task_operands.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

namespace concerto::runtime::cuda {

/// @brief What a kernel call needs besides its buffers: the stream, the cuBLASLt handle and the
/// device words the backend owns. All pointers are device pointers except `blas`.
struct device_context {
  cudaStream_t stream = nullptr;
  const blas_handle* blas = nullptr;
  void* blas_workspace = nullptr;
  std::size_t blas_workspace_bytes = 0;
  float* workspace = nullptr;             ///< device_workspace_bytes(graph) bytes
  int* status = nullptr;                  ///< 0, or task id + 1 of the first kernel that met a bad id
  const std::int64_t* step = nullptr;     ///< the optimizer step, counting from 1
  std::size_t workspace_floats = 0;       ///< size of `workspace`; a task needing more throws
};

namespace detail {

// Every piece a task takes from the workspace starts on a 256-byte boundary.
inline constexpr std::size_t workspace_pad = 64;
constexpr std::size_t padded(std::size_t floats) noexcept { return (floats + workspace_pad - 1) / workspace_pad * workspace_pad; }

} // namespace detail

/// @brief Device workspace floats one task needs: what the kernels keep between two launches
/// (attention's per-row delta), the statistics the DSL's tasks do not store (layernorm's mean
/// and rstd, attention's lse and recomputed output, cross-entropy's lse), and i64 ids narrowed
/// to i32. The same operand conventions as run_kernel; 0 for collectives.
[[nodiscard]] inline std::size_t device_workspace_floats(const ir::graph& g, const ir::task& t) {
  if (ir::is_collective(t.kind)) return 0;
  const auto count = [&](ir::buffer_id b) {
    const auto& buf = g.buffers.at(static_cast<std::size_t>(b));
    return static_cast<std::size_t>(buf.bytes) / std::max<std::size_t>(ir::size_of(buf.type), 1);
  };
  const auto is_int = [&](ir::buffer_id b) {
    const auto ty = g.buffers.at(static_cast<std::size_t>(b)).type;
    return ty == ir::dtype::i32 || ty == ir::dtype::i64;
  };
  std::size_t ids = 0, id_count = 0, float_reads = 0;
  bool found = false;
  for (const auto b : t.reads) {
    if (!is_int(b)) {
      ++float_reads;
    } else if (!found) {
      found = true;
      id_count = count(b);
      if (g.buffers.at(static_cast<std::size_t>(b)).type == ir::dtype::i64) ids = detail::padded(id_count);
    }
  }
  const auto rows_of = [&](ir::buffer_id whole, ir::buffer_id row) { return count(whole) / std::max<std::size_t>(count(row), 1); };
  const auto dim = [&](const char* key) { return static_cast<std::size_t>(std::max<std::int64_t>(t.attr(key, 1), 0)); };
  const std::size_t n_rows = dim("batch") * dim("heads") * dim("seq"), n_qkv = n_rows * dim("head_dim");
  switch (resolve(t)) {
  case kernel::layernorm:
    return t.writes.size() >= 3 || t.reads.size() < 2 ? 0 : 2 * detail::padded(rows_of(t.reads[0], t.reads[1]));
  case kernel::layernorm_grad:
    return t.reads.size() >= 5 || t.reads.size() < 2 ? 0 : 2 * detail::padded(rows_of(t.reads[0], t.reads[1]));
  case kernel::layernorm_grad_gamma:
    return t.reads.empty() || t.writes.empty() ? 0 : 2 * detail::padded(rows_of(t.reads[0], t.writes[0]));
  case kernel::attention: return t.writes.size() >= 2 ? 0 : detail::padded(n_rows);
  case kernel::attention_grad:
    return t.reads.size() >= 5 ? detail::padded(n_rows) : 2 * detail::padded(n_rows) + detail::padded(n_qkv);
  case kernel::cross_entropy: return ids + (t.writes.size() >= 2 ? 0 : detail::padded(id_count));
  case kernel::cross_entropy_grad: return ids + (float_reads >= 2 ? 0 : detail::padded(id_count));
  case kernel::embedding:
  case kernel::embedding_grad:
  case kernel::vocab_ce_target:
  case kernel::vocab_ce_grad: return ids;
  default: return 0;
  }
}

/// @brief Device workspace bytes the graph's kernels need at most (device_workspace_floats
/// over its compute tasks); the backend places it after the cuBLASLt workspace.
/// @code
/// arena = cuda::device_arena(g, runtime::make_layout(g, blas_bytes + cuda::device_workspace_bytes(g), cuda::device_alignment));
/// @endcode
[[nodiscard]] inline std::int64_t device_workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  for (const auto& t : g.tasks) floats = std::max(floats, device_workspace_floats(g, t));
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

inline std::string task_ref(const ir::task& t) { return runtime::detail::task_ref(t) + " (fn '" + t.fn + "')"; }

/// Operand access for one task on the device arena: task_operands' decoding (as the CPU
/// dispatch), plus device pointers and the size checks the kernels cannot make themselves.
class device_operands : public runtime::detail::task_operands<const device_arena> {
public:
  using task_operands::task_operands;

  float* f(ir::buffer_id b) const { return mem_.f32(b); }
  std::size_t n(ir::buffer_id b) const { return static_cast<std::size_t>(mem_.bytes(b)) / sizeof(float); }
  /// Throws unless buffer b holds `expected` floats.
  void need(ir::buffer_id b, std::size_t expected, const char* what) const {
    if (n(b) != expected)
      fail(ref() + ": `" + what + "` ('" + mem_.name(b) + "') holds " + std::to_string(n(b)) +
           " floats, the extents need " + std::to_string(expected));
  }
};

/// Hands out pieces of the device workspace for one task; running past it throws naming the
/// task (a workspace sized by another graph, or an operand layout device_workspace_floats missed).
class workspace_cursor {
public:
  workspace_cursor(const ir::task& t, const device_context& ctx) : t_(t), base_(ctx.workspace), size_(ctx.workspace_floats) {}
  float* take(std::size_t floats, const char* what) {
    const auto need = padded(floats);
    if (base_ == nullptr || used_ + need > size_)
      fail(task_ref(t_) + ": the device workspace holds " + std::to_string(size_) + " floats, too few for `" + what +
           "` (" + std::to_string(floats) + " more after " + std::to_string(used_) + "); size it with device_workspace_bytes");
    float* p = base_ + used_;
    used_ += need;
    return p;
  }

private:
  const ir::task& t_;
  float* base_;
  std::size_t size_, used_ = 0;
};

inline gemm_type gemm_type_of(const ir::task& t, const device_arena& mem, ir::buffer_id b) {
  switch (mem.type(b)) {
  case ir::dtype::f32: return gemm_type::f32;
  case ir::dtype::bf16: return gemm_type::bf16;
  default:
    fail(task_ref(t) + ": matmul operand '" + mem.name(b) + "' holds " + std::string(ir::to_string(mem.type(b))) +
         "; the GPU products take f32 or bf16");
  }
}

// `outer` rows of `len` bytes from a row pitch of `src_row` to one of `dst_row` (the CPU
// dispatch's copy_strided); contiguous runs become one copy.
inline void copy_rows(const ir::task& t, std::byte* src, std::size_t src_bytes, std::byte* dst, std::size_t dst_bytes,
                      std::size_t outer, std::size_t src_row, std::size_t dst_row, std::size_t src_off, std::size_t dst_off,
                      std::size_t len, cudaStream_t s) {
  if (outer == 0 || len == 0) return;
  if ((outer - 1) * src_row + src_off + len > src_bytes || (outer - 1) * dst_row + dst_off + len > dst_bytes)
    fail(task_ref(t) + ": slice/concat extents run past a buffer");
  if (outer == 1 || (src_row == len && dst_row == len)) {
    if (src + src_off != dst + dst_off)
      check(cudaMemcpyAsync(dst + dst_off, src + src_off, outer * len, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    return;
  }
  check(cudaMemcpy2DAsync(dst + dst_off, dst_row, src + src_off, src_row, len, outer, cudaMemcpyDeviceToDevice, s),
        "cudaMemcpy2DAsync");
}

} // namespace detail

/// @brief Whether the GPU has a kernel for `k`: every kernel of the CPU dispatch. The switch
/// names each enumerator, so a kernel added to runtime::kernel without a GPU case is a
/// compile-time warning (-Wswitch) here.
[[nodiscard]] constexpr bool gpu_supports(kernel k) noexcept {
  switch (k) {
  case kernel::gemm: case kernel::add: case kernel::add_inplace: case kernel::scale: case kernel::bias_add:
  case kernel::bias_add_grad: case kernel::gelu: case kernel::gelu_grad: case kernel::relu: case kernel::relu_grad:
  case kernel::zero: case kernel::layernorm: case kernel::layernorm_grad: case kernel::softmax: case kernel::softmax_grad:
  case kernel::attention: case kernel::attention_grad: case kernel::cross_entropy: case kernel::cross_entropy_grad:
  case kernel::mse: case kernel::mse_grad: case kernel::embedding: case kernel::embedding_grad: case kernel::sgd:
  case kernel::adamw: case kernel::copy: case kernel::slice: case kernel::concat: case kernel::layernorm_grad_gamma:
  case kernel::shard_slice: case kernel::keep_one: case kernel::vocab_ce_max: case kernel::vocab_ce_target:
  case kernel::vocab_ce_sumexp: case kernel::vocab_ce_loss: case kernel::vocab_ce_grad:
    return true;
  }
  return false;
}

/// @brief Describes the product of a matmul task for cuBLASLt, with the four cases of the CPU
/// dispatch (one product; a batch sharing B as one taller product; a weight gradient summed over
/// the batch as one product with a longer contraction; a strided batch), and each operand's
/// alignment in the arena (`operand_alignment`).
/// Throws naming the task when the buffers do not hold the extents the attrs give.
/// @code
/// products[t.id] = cuda::describe_gemm(g, t, arena, lt, cuda::gemm::default_workspace);
/// @endcode
[[nodiscard]] inline gemm describe_gemm(const ir::graph& g, const ir::task& t, const device_arena& mem,
                                        const blas_handle& h, std::size_t workspace_bytes, bool allow_tf32 = false) {
  (void)g;
  const detail::device_operands op(t, mem);
  const auto a = op.read(0, "a"), b = op.read(1, "b"), c = op.write(0, "c");
  gemm_shape s;
  s.m = op.at("m");
  s.n = op.at("n");
  s.k = op.at("k");
  s.batch = op.at("batch", 1);
  s.trans_a = t.attr("trans_a") != 0;
  s.trans_b = t.attr("trans_b") != 0;
  s.accumulate = t.attr("accumulate") != 0;
  s.ab = detail::gemm_type_of(t, mem, a);
  s.c = detail::gemm_type_of(t, mem, c);
  s.allow_tf32 = allow_tf32;
  if (detail::gemm_type_of(t, mem, b) != s.ab)
    fail(detail::task_ref(t) + ": matmul operands '" + mem.name(a) + "' and '" + mem.name(b) + "' differ in type");
  const auto count = [&](ir::buffer_id id) {
    return static_cast<std::size_t>(mem.bytes(id)) / ir::size_of(mem.type(id));
  };
  const auto need = [&](ir::buffer_id id, std::size_t expected, const char* what) {
    if (count(id) != expected)
      fail(detail::task_ref(t) + ": matmul operand `" + what + "` ('" + mem.name(id) + "') holds " +
           std::to_string(count(id)) + " values, m/n/k/batch need " + std::to_string(expected));
  };
  if (s.batch > 1 && count(b) == s.k * s.n && !s.trans_a) { // B shared by the batch
    s.m *= s.batch;
    s.batch = 1;
  } else if (s.batch > 1 && count(c) == s.m * s.n && s.trans_a && !s.trans_b) {
    // A weight gradient of a batched activation: one product with the batch stacked into the
    // contraction (Σᵢ Aᵢᵀ·Bᵢ), as the CPU dispatch.
    s.k *= s.batch;
    s.batch = 1;
  }
  need(a, s.batch * s.m * s.k, "a");
  need(b, s.batch * s.k * s.n, "b");
  need(c, s.batch * s.m * s.n, "c");
  // Arena views (bucket members, decomposition chunks) start wherever their root's bytes do,
  // so the heuristic is told each operand's real alignment (gemm folds in the batch stride's).
  s.align_a = operand_alignment(mem.ptr(a));
  s.align_b = operand_alignment(mem.ptr(b));
  s.align_c = operand_alignment(mem.ptr(c));
  return gemm(h, s, workspace_bytes);
}

/// @brief Enqueues one compute task on `ctx.stream`; `product` is the task's describe_gemm
/// result for a matmul (ignored otherwise). Every form the CPU dispatch takes is taken here
/// with the same operands and attrs (see runtime/dispatch.hpp and docs/runtime.md).
/// @code
/// cuda::run_kernel(g, t, runtime::resolve(t), arena, settings, ctx, &products[t.id]);
/// @endcode
inline void run_kernel(const ir::graph& g, const ir::task& t, kernel k, const device_arena& mem,
                       const kernel_settings& s, const device_context& ctx, const gemm* product) {
  const detail::device_operands op(t, mem);
  detail::workspace_cursor ws(t, ctx);
  const auto st = ctx.stream;
  const int code = t.id + 1;
  // An integer operand as i32: itself, or (i64) narrowed into the workspace.
  const auto ints = [&](ir::buffer_id b) -> const std::int32_t* {
    if (mem.type(b) == ir::dtype::i32) return mem.i32(b);
    const auto count = mem.count(b);
    auto* out = reinterpret_cast<std::int32_t*>(ws.take(count, "narrowed ids"));
    narrow_ids(reinterpret_cast<const std::int64_t*>(mem.ptr(b)), out, count, ctx.status, code, st);
    return out;
  };
  switch (k) {
  case kernel::gemm: {
    CONCERTO_CHECK(product != nullptr && ctx.blas != nullptr, detail::task_ref(t) + ": no product described for the matmul");
    product->run(*ctx.blas, mem.ptr(op.read(0, "a")), mem.ptr(op.read(1, "b")), mem.ptr(op.write(0, "c")),
                 ctx.blas_workspace, st);
    return;
  }
  case kernel::add: {
    const auto a = op.read(0, "a"), b = op.read(1, "b"), o = op.write(0, "out");
    op.need(b, op.n(a), "b");
    op.need(o, op.n(a), "out");
    add(op.f(a), op.f(b), op.f(o), op.n(a), st);
    return;
  }
  case kernel::add_inplace: {
    const auto acc = op.write(0, "acc"), x = op.addend(acc);
    op.need(x, op.n(acc), "x");
    add_inplace(op.f(acc), op.f(x), op.n(acc), st);
    return;
  }
  case kernel::scale: {
    const auto x = op.read(0, "x"), o = op.write(0, "out");
    op.need(o, op.n(x), "out");
    scale(op.f(x), runtime::detail::ratio(t, "num", "den"), op.f(o), op.n(x), st);
    return;
  }
  case kernel::bias_add: {
    const auto x = op.read(0, "x"), bias = op.read(1, "bias"), o = op.write(0, "out");
    const auto cols = op.n(bias), rows = op.divide(op.n(x), cols, "rows");
    op.need(o, op.n(x), "out");
    bias_add(op.f(x), op.f(bias), op.f(o), rows, cols, st);
    return;
  }
  case kernel::bias_add_grad: {
    const auto dout = op.read(0, "dout"), dbias = op.write(0, "dbias");
    const auto cols = op.n(dbias);
    bias_add_grad(op.f(dout), op.f(dbias), op.divide(op.n(dout), cols, "rows"), cols, t.attr("accumulate") != 0, st);
    return;
  }
  case kernel::gelu:
  case kernel::relu: {
    const auto x = op.read(0, "x"), o = op.write(0, "out");
    op.need(o, op.n(x), "out");
    (k == kernel::gelu ? gelu : relu)(op.f(x), op.f(o), op.n(x), st);
    return;
  }
  case kernel::gelu_grad:
  case kernel::relu_grad: {
    // ir::builder graphs list (dout, x), the DSL (x, dout): the CPU dispatch's rule decides.
    const bool swapped = runtime::detail::dout_first(g, t);
    const auto x = op.read(swapped ? 1 : 0, "x"), dout = op.read(swapped ? 0 : 1, "dout"), dx = op.write(0, "dx");
    op.need(dout, op.n(x), "dout");
    op.need(dx, op.n(x), "dx");
    (k == kernel::gelu_grad ? gelu_grad : relu_grad)(op.f(x), op.f(dout), op.f(dx), op.n(x), st);
    return;
  }
  case kernel::zero:
    for (const auto b : t.writes)
      if (mem.bytes(b) > 0) check(cudaMemsetAsync(mem.ptr(b), 0, static_cast<std::size_t>(mem.bytes(b)), st), "cudaMemsetAsync");
    return;
  case kernel::layernorm: {
    const auto x = op.read(0, "x"), gamma = op.read(1, "gamma"), beta = op.read(2, "beta"), out = op.write(0, "out");
    const auto cols = op.n(gamma), rows = op.divide(op.n(x), cols, "rows");
    op.need(beta, cols, "beta");
    op.need(out, op.n(x), "out");
    // The DSL's layernorm writes only its output: the statistics go to the workspace.
    float *mean = nullptr, *rstd = nullptr;
    if (t.writes.size() >= 3) {
      op.need(t.writes[1], rows, "mean");
      op.need(t.writes[2], rows, "rstd");
      mean = op.f(t.writes[1]);
      rstd = op.f(t.writes[2]);
    } else {
      mean = ws.take(rows, "mean");
      rstd = ws.take(rows, "rstd");
    }
    layernorm(op.f(x), op.f(gamma), op.f(beta), op.f(out), mean, rstd, rows, cols, s.layernorm_eps, st);
    return;
  }
  case kernel::layernorm_grad: {
    if (t.reads.size() >= 5) { // ir::builder form: dout, x, gamma, mean, rstd -> dx, dgamma, dbeta
      const auto dout = op.read(0, "dout"), x = op.read(1, "x"), gamma = op.read(2, "gamma"), mean = op.read(3, "mean"),
                 rstd = op.read(4, "rstd");
      const auto dx = op.write(0, "dx"), dgamma = op.write(1, "dgamma"), dbeta = op.write(2, "dbeta");
      const auto cols = op.n(gamma), rows = op.divide(op.n(x), cols, "rows");
      op.need(dout, op.n(x), "dout");
      op.need(mean, rows, "mean");
      op.need(rstd, rows, "rstd");
      op.need(dx, op.n(x), "dx");
      op.need(dgamma, cols, "dgamma");
      op.need(dbeta, cols, "dbeta");
      layernorm_grad(op.f(dout), op.f(x), op.f(gamma), op.f(mean), op.f(rstd), op.f(dx), op.f(dgamma), op.f(dbeta), rows,
                     cols, t.attr("accumulate") != 0, st);
      return;
    }
    // The DSL's form: x, gamma, dy -> dx; the statistics are recomputed, dgamma and dbeta are
    // other tasks (layernorm_grad_gamma, bias_grad).
    const auto x = op.read(0, "x"), gamma = op.read(1, "gamma"), dy = op.read(2, "dy"), dx = op.write(0, "dx");
    const auto cols = op.n(gamma), rows = op.divide(op.n(x), cols, "rows");
    op.need(dy, op.n(x), "dy");
    op.need(dx, op.n(x), "dx");
    float* mean = ws.take(rows, "mean");
    float* rstd = ws.take(rows, "rstd");
    layernorm_stats(op.f(x), mean, rstd, rows, cols, s.layernorm_eps, st);
    layernorm_grad_input(op.f(dy), op.f(x), op.f(gamma), mean, rstd, op.f(dx), rows, cols, st);
    return;
  }
  case kernel::layernorm_grad_gamma: {
    // dgamma[c] = Σ_r dy·x̂ (reads x, dy), the statistics recomputed.
    const auto x = op.read(0, "x"), dy = op.read(1, "dy"), dgamma = op.write(0, "dgamma");
    const auto cols = op.n(dgamma), rows = op.divide(op.n(x), cols, "rows");
    op.need(dy, op.n(x), "dy");
    float* mean = ws.take(rows, "mean");
    float* rstd = ws.take(rows, "rstd");
    layernorm_stats(op.f(x), mean, rstd, rows, cols, s.layernorm_eps, st);
    layernorm_grad_gamma(op.f(dy), op.f(x), mean, rstd, op.f(dgamma), rows, cols, t.attr("accumulate") != 0, st);
    return;
  }
  case kernel::softmax:
  case kernel::softmax_grad: {
    const auto first = op.read(0, k == kernel::softmax ? "x" : "y");
    const auto& shape = g.buffers.at(static_cast<std::size_t>(first)).shape;
    const auto cols = op.at("cols", shape.empty() ? -1 : shape.back());
    const auto rows = op.divide(op.n(first), cols, "rows");
    if (k == kernel::softmax) {
      const auto o = op.write(0, "out");
      op.need(o, op.n(first), "out");
      softmax(op.f(first), op.f(o), rows, cols, st);
    } else {
      const auto dy = op.read(1, "dy"), dx = op.write(0, "dx");
      op.need(dy, op.n(first), "dy");
      op.need(dx, op.n(first), "dx");
      softmax_grad(op.f(first), op.f(dy), op.f(dx), rows, cols, st);
    }
    return;
  }
  case kernel::attention:
  case kernel::attention_grad: {
    if (t.attr("causal", 1) == 0) fail(detail::task_ref(t) + ": the attention kernel is causal only (attr causal = 0)");
    const auto batch = op.at("batch", 1), seq = op.at("seq"), heads = op.at("heads"), hd = op.at("head_dim");
    const auto n = batch * seq * heads * hd, nl = batch * heads * seq;
    const auto q = op.read(0, "q"), kk = op.read(1, "k"), v = op.read(2, "v");
    op.need(q, n, "q");
    op.need(kk, n, "k");
    op.need(v, n, "v");
    if (k == kernel::attention) {
      const auto out = op.write(0, "out");
      op.need(out, n, "out");
      // The DSL's attention writes only its output: lse goes to the workspace.
      float* lse = nullptr;
      if (t.writes.size() >= 2) {
        op.need(t.writes[1], nl, "lse");
        lse = op.f(t.writes[1]);
      } else {
        lse = ws.take(nl, "lse");
      }
      causal_attention(op.f(q), op.f(kk), op.f(v), op.f(out), lse, batch, seq, heads, hd, st);
      return;
    }
    if (t.reads.size() >= 5) { // q, k, v, dout, lse -> dq, dk, dv
      const auto dout = op.read(3, "dout"), lse = op.read(4, "lse");
      const auto dq = op.write(0, "dq"), dk = op.write(1, "dk"), dv = op.write(2, "dv");
      op.need(dout, n, "dout");
      op.need(lse, nl, "lse");
      op.need(dq, n, "dq");
      op.need(dk, n, "dk");
      op.need(dv, n, "dv");
      causal_attention_grad(op.f(q), op.f(kk), op.f(v), op.f(dout), op.f(lse), op.f(dq), op.f(dk), op.f(dv),
                            ws.take(nl, "delta"), batch, seq, heads, hd, st);
      return;
    }
    // The DSL's form: q, k, v, dy -> one [3, ...] buffer (dq, dk, dv); lse is recomputed.
    const auto dy = op.read(3, "dy"), packed = op.write(0, "dqkv");
    op.need(dy, n, "dy");
    if (op.n(packed) != 3 * n)
      fail(detail::task_ref(t) + ": output '" + mem.name(packed) + "' holds " + std::to_string(op.n(packed)) +
           " floats, expected 3 x " + std::to_string(n) + " (dq, dk, dv)");
    float* lse = ws.take(nl, "lse");
    float* out = ws.take(n, "recomputed output");
    float* delta = ws.take(nl, "delta");
    causal_attention(op.f(q), op.f(kk), op.f(v), out, lse, batch, seq, heads, hd, st);
    float* d = op.f(packed);
    causal_attention_grad(op.f(q), op.f(kk), op.f(v), op.f(dy), lse, d, d + n, d + 2 * n, delta, batch, seq, heads, hd, st);
    return;
  }
  case kernel::cross_entropy:
  case kernel::cross_entropy_grad: {
    // Mean over `global_rows` (every rank's rows; default: this rank's), as on the CPU.
    const auto id = op.int_read("targets");
    const auto rows = mem.count(id);
    CONCERTO_CHECK(rows > 0, detail::task_ref(t) + ": the mean over rows needs at least one row");
    const auto logits = op.float_read(0, "logits");
    const auto classes = op.divide(op.n(logits), rows, "rows");
    const auto global_rows = static_cast<double>(t.attr("global_rows", static_cast<std::int64_t>(rows)));
    const auto share = static_cast<float>(static_cast<double>(rows) / global_rows);
    const auto* targets = ints(id);
    if (k == kernel::cross_entropy) {
      const auto loss = op.write(0, "loss");
      if (op.n(loss) == 0) fail(detail::task_ref(t) + ": the loss buffer holds no value");
      float* lse = nullptr;
      if (t.writes.size() >= 2) {
        op.need(t.writes[1], rows, "lse");
        lse = op.f(t.writes[1]);
      } else {
        lse = ws.take(rows, "lse");
      }
      cross_entropy(op.f(logits), targets, lse, op.f(loss), rows, classes, ctx.status, code, st, share);
      return;
    }
    const auto dlogits = op.write(0, "dlogits");
    op.need(dlogits, op.n(logits), "dlogits");
    const float* lse = nullptr;
    if (op.float_reads() >= 2) {
      const auto l = op.float_read(1, "lse");
      op.need(l, rows, "lse");
      lse = op.f(l);
    } else { // the DSL's form: recompute the row log-sum-exp
      float* tmp = ws.take(rows, "lse");
      cross_entropy_lse(op.f(logits), targets, tmp, rows, classes, ctx.status, code, st);
      lse = tmp;
    }
    cross_entropy_grad(op.f(logits), targets, lse, op.f(dlogits), rows, classes,
                       runtime::detail::ratio(t, "dloss_num", "dloss_den") * share, st);
    return;
  }
  case kernel::mse:
  case kernel::mse_grad: {
    // Mean over `global_n` values (every rank's; default: this rank's), as cross_entropy.
    const auto pred = op.read(0, "pred"), target = op.read(1, "target");
    op.need(target, op.n(pred), "target");
    const auto share = static_cast<float>(static_cast<double>(op.n(pred)) /
                                          static_cast<double>(t.attr("global_n", static_cast<std::int64_t>(op.n(pred)))));
    if (k == kernel::mse) {
      const auto loss = op.write(0, "loss");
      if (op.n(loss) == 0) fail(detail::task_ref(t) + ": the loss buffer holds no value");
      mse(op.f(pred), op.f(target), op.f(loss), op.n(pred), st, share);
    } else {
      const auto dpred = op.write(0, "dpred");
      op.need(dpred, op.n(pred), "dpred");
      mse_grad(op.f(pred), op.f(target), op.f(dpred), op.n(pred), runtime::detail::ratio(t, "dloss_num", "dloss_den") * share,
               st);
    }
    return;
  }
  case kernel::embedding:
  case kernel::embedding_grad: {
    const auto ids = op.int_read("ids");
    const auto n = mem.count(ids);
    // A table split over the vocabulary (`vocab_axis`, the DSL) holds rows [coord·vocab, ...);
    // ids outside give zero rows, and an all-reduce of the outputs completes the lookup.
    const bool vocab_split = t.attr("vocab_axis", -1) >= 0;
    const bool reject = !vocab_split && t.attr("sharded") == 0;
    const auto first_row = vocab_split ? op.coord(s.coords, "vocab_axis") * t.attr("vocab", 0) : t.attr("first_row", 0);
    const auto big = k == kernel::embedding ? op.write(0, "out") : op.float_read(0, "dout");
    const auto table = k == kernel::embedding ? op.float_read(0, "table") : op.write(0, "dtable");
    const auto dim = op.at("hidden", static_cast<std::int64_t>(n == 0 ? 0 : op.n(big) / n));
    if (dim == 0 || op.n(table) % dim != 0)
      fail(detail::task_ref(t) + ": table '" + mem.name(table) + "' holds " + std::to_string(op.n(table)) +
           " floats, not a whole number of rows of dim " + std::to_string(dim));
    op.need(big, n * dim, k == kernel::embedding ? "out" : "dout");
    const auto rows = op.n(table) / dim;
    const auto* narrow = ints(ids);
    if (k == kernel::embedding)
      embedding(narrow, op.f(table), op.f(big), n, dim, rows, first_row, reject, ctx.status, code, st);
    else
      embedding_grad(narrow, op.f(big), op.f(table), n, dim, rows, t.attr("accumulate") != 0, first_row, reject,
                     ctx.status, code, st);
    return;
  }
  case kernel::sgd: {
    const auto p = op.write(0, "param"), grad = op.read_not_written("grad");
    op.need(grad, op.n(p), "grad");
    float* buf = nullptr;
    if (s.sgd.momentum != 0.0f) {
      if (t.writes.size() < 2) fail(detail::task_ref(t) + ": SGD with momentum needs a momentum buffer as its second write");
      op.need(t.writes[1], op.n(p), "momentum");
      buf = op.f(t.writes[1]);
    }
    sgd_update(op.f(p), op.f(grad), buf, op.n(p), s.sgd, st);
    return;
  }
  case kernel::adamw: {
    const auto p = op.write(0, "param"), grad = op.read_not_written("grad");
    op.need(grad, op.n(p), "grad");
    float *m = nullptr, *v = nullptr;
    if (t.writes.size() >= 3) {
      op.need(t.writes[1], op.n(p), "m");
      op.need(t.writes[2], op.n(p), "v");
      m = op.f(t.writes[1]);
      v = op.f(t.writes[2]);
    } else {
      const auto state = op.write(1, "state");
      if (op.n(state) != 2 * op.n(p))
        fail(detail::task_ref(t) + " (adamw): state buffer '" + mem.name(state) + "' holds " + std::to_string(op.n(state)) +
             " floats, expected 2 x " + std::to_string(op.n(p)) + " (m then v)");
      m = op.f(state);
      v = m + op.n(p);
    }
    CONCERTO_CHECK(ctx.step != nullptr, detail::task_ref(t) + ": no device step counter for AdamW");
    adamw_update(op.f(p), op.f(grad), m, v, op.n(p), s.adamw, ctx.step, st);
    return;
  }
  case kernel::copy: {
    const auto src = op.read(0, "src"), dst = op.write(0, "dst");
    if (mem.bytes(src) != mem.bytes(dst))
      fail(detail::task_ref(t) + ": copies " + std::to_string(mem.bytes(src)) + " bytes into a buffer of " +
           std::to_string(mem.bytes(dst)));
    if (mem.ptr(src) != mem.ptr(dst) && mem.bytes(src) > 0)
      check(cudaMemcpyAsync(mem.ptr(dst), mem.ptr(src), static_cast<std::size_t>(mem.bytes(src)), cudaMemcpyDeviceToDevice, st),
            "cudaMemcpyAsync");
    return;
  }
  case kernel::slice:
  case kernel::concat: {
    const bool slicing = k == kernel::slice;
    const auto bytes_of = [&](ir::buffer_id b) { return static_cast<std::size_t>(mem.bytes(b)); };
    const auto copy = [&](ir::buffer_id whole, ir::buffer_id part, const runtime::detail::rows_in_whole& r) {
      if (slicing)
        detail::copy_rows(t, mem.ptr(whole), bytes_of(whole), mem.ptr(part), bytes_of(part), r.outer, r.whole_row, r.part_row,
                          r.offset, 0, r.part_row, st);
      else
        detail::copy_rows(t, mem.ptr(part), bytes_of(part), mem.ptr(whole), bytes_of(whole), r.outer, r.part_row, r.whole_row,
                          0, r.offset, r.part_row, st);
    };
    runtime::detail::for_each_part(g, op, slicing, copy);
    return;
  }
  case kernel::shard_slice: {
    const auto src = op.read(0, "src"), dst = op.write(0, "dst");
    const auto r = runtime::detail::shard_rows(g, op, src, s.coords);
    detail::copy_rows(t, mem.ptr(src), static_cast<std::size_t>(mem.bytes(src)), mem.ptr(dst),
                      static_cast<std::size_t>(mem.bytes(dst)), r.outer, r.whole_row, r.part_row, r.offset, 0, r.part_row, st);
    return;
  }
  case kernel::keep_one: {
    // Coordinate 0 on `mesh_axis` keeps the value, the others hold zero: a pending sum of one term.
    const auto src = op.read(0, "src"), dst = op.write(0, "dst");
    const auto bytes = static_cast<std::size_t>(mem.bytes(dst));
    if (mem.bytes(src) != mem.bytes(dst)) fail(detail::task_ref(t) + ": input and output sizes differ");
    if (bytes == 0) return;
    if (op.coord(s.coords, "mesh_axis") != 0)
      check(cudaMemsetAsync(mem.ptr(dst), 0, bytes, st), "cudaMemsetAsync");
    else if (mem.ptr(src) != mem.ptr(dst))
      check(cudaMemcpyAsync(mem.ptr(dst), mem.ptr(src), bytes, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    return;
  }
  case kernel::vocab_ce_max:
  case kernel::vocab_ce_target:
  case kernel::vocab_ce_sumexp:
  case kernel::vocab_ce_grad: {
    // Megatron-LM's vocabulary-parallel cross-entropy over this rank's columns of the logits
    // [rows, cols] (columns [coord·cols, ...) of the vocabulary); see runtime/dispatch.hpp.
    const auto logits = op.float_read(0, "logits"), out = op.write(0, "out");
    const auto cols = op.at("cols");
    const auto rows = op.divide(op.n(logits), cols, "rows");
    op.need(out, k == kernel::vocab_ce_grad ? rows * cols : rows, "out");
    if (k == kernel::vocab_ce_max) {
      vocab_ce_max(op.f(logits), op.f(out), rows, cols, st);
      return;
    }
    const auto mx = op.float_read(1, "max");
    op.need(mx, rows, "max");
    if (k == kernel::vocab_ce_sumexp) {
      vocab_ce_sumexp(op.f(logits), op.f(mx), op.f(out), rows, cols, st);
      return;
    }
    const auto label_id = op.int_read("labels");
    if (mem.count(label_id) != rows)
      fail(detail::task_ref(t) + ": " + std::to_string(mem.count(label_id)) + " labels for " + std::to_string(rows) + " rows");
    const auto first = op.coord(s.coords, "vocab_axis") * static_cast<std::int64_t>(cols);
    const auto* labels = ints(label_id);
    if (k == kernel::vocab_ce_target) {
      vocab_ce_target(op.f(logits), op.f(mx), labels, op.f(out), rows, cols, first, st);
      return;
    }
    const auto sumexp = op.float_read(2, "sumexp");
    op.need(sumexp, rows, "sumexp");
    const auto scale = runtime::detail::ratio(t, "dloss_num", "dloss_den") /
                       static_cast<float>(t.attr("global_rows", static_cast<std::int64_t>(rows)));
    vocab_ce_grad(op.f(logits), op.f(mx), op.f(sumexp), labels, op.f(out), rows, cols, first, scale, st);
    return;
  }
  case kernel::vocab_ce_loss: {
    const auto sumexp = op.read(0, "sumexp"), target = op.read(1, "target"), loss = op.write(0, "loss");
    if (op.n(loss) == 0 || op.n(target) != op.n(sumexp))
      fail(detail::task_ref(t) + ": expects sumexp and target of one size and a one-value loss");
    vocab_ce_loss(op.f(sumexp), op.f(target), op.f(loss), op.n(sumexp),
                  static_cast<double>(t.attr("global_rows", static_cast<std::int64_t>(op.n(sumexp)))), st);
    return;
  }
  }
  fail(detail::task_ref(t) + ": kernel id out of range");
}

} // namespace concerto::runtime::cuda
