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
/// arithmetic only. Integer operands are found by dtype as on the CPU. Matmul takes fp32 or
/// bf16 operands (fp32 accumulation, C in fp32 or bf16); every other kernel is fp32.

#ifndef __CUDACC__
#error "concerto/runtime/cuda/dispatch.cuh launches CUDA kernels: compile this source with nvcc (concerto_cuda_sources(target) in CMake)"
#endif

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/kernels.cuh>
#include <concerto/runtime/cuda/memory.hpp>
#include <concerto/runtime/dispatch.hpp>

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
  float* attention_workspace = nullptr;   ///< attention_workspace_bytes(graph) bytes
  int* status = nullptr;                  ///< 0, or task id + 1 of the first kernel that met a bad id
  const std::int64_t* step = nullptr;     ///< the optimizer step, counting from 1
};

/// @brief Device workspace bytes the graph's attention backward kernels need at most.
[[nodiscard]] inline std::int64_t attention_workspace_bytes(const ir::graph& g) {
  std::size_t floats = 0;
  for (const auto& t : g.tasks) {
    if (ir::is_collective(t.kind) || (t.fn != "attention_grad" && t.fn != "causal_attention_grad")) continue;
    floats = std::max(floats, causal_attention_grad_workspace_floats(static_cast<std::size_t>(t.attr("batch", 1)),
                                                                     static_cast<std::size_t>(t.attr("seq", 1)),
                                                                     static_cast<std::size_t>(t.attr("heads", 1))));
  }
  return static_cast<std::int64_t>(floats * sizeof(float));
}

namespace detail {

inline std::string task_ref(const ir::task& t) { return runtime::detail::task_ref(t) + " (fn '" + t.fn + "')"; }

/// Operand access for one task on the device arena, with messages naming the task and operand.
class device_operands {
public:
  device_operands(const ir::task& t, const device_arena& mem) : t_(t), mem_(mem) {}
  ir::buffer_id read(std::size_t i, const char* what) const { return pick(t_.reads, i, what, "reads"); }
  ir::buffer_id write(std::size_t i, const char* what) const { return pick(t_.writes, i, what, "writes"); }
  float* f(ir::buffer_id b) const { return mem_.f32(b); }
  std::size_t n(ir::buffer_id b) const { return static_cast<std::size_t>(mem_.bytes(b)) / sizeof(float); }
  ir::buffer_id int_read(const char* what) const {
    for (const auto b : t_.reads)
      if (mem_.type(b) == ir::dtype::i32) return b;
    fail(task_ref(t_) + " needs an i32 buffer among its reads for `" + what + "`");
  }
  ir::buffer_id float_read(std::size_t i, const char* what) const {
    std::size_t seen = 0;
    for (const auto b : t_.reads)
      if (mem_.type(b) != ir::dtype::i32 && seen++ == i) return b;
    fail(task_ref(t_) + " has no fp32 read #" + std::to_string(i) + " for `" + what + "`");
  }
  ir::buffer_id read_not_written(const char* what) const {
    for (const auto b : t_.reads)
      if (std::find(t_.writes.begin(), t_.writes.end(), b) == t_.writes.end()) return b;
    fail(task_ref(t_) + " has no read besides the buffers it writes, for `" + what + "`");
  }
  std::size_t at(const char* key, std::int64_t fallback = -1) const {
    const auto v = t_.attr(key, fallback);
    if (v < 0) fail(task_ref(t_) + " needs a non-negative attr '" + key + "'");
    return static_cast<std::size_t>(v);
  }
  std::size_t divide(std::size_t total, std::size_t by, const char* what) const {
    if (by == 0 || total % by != 0)
      fail(task_ref(t_) + ": " + std::to_string(total) + " values are not a whole number of " + what + " of " +
           std::to_string(by));
    return total / by;
  }
  /// Throws unless buffer b holds `expected` floats.
  void need(ir::buffer_id b, std::size_t expected, const char* what) const {
    if (n(b) != expected)
      fail(task_ref(t_) + ": `" + what + "` ('" + mem_.name(b) + "') holds " + std::to_string(n(b)) +
           " floats, the extents need " + std::to_string(expected));
  }

private:
  ir::buffer_id pick(const std::vector<ir::buffer_id>& list, std::size_t i, const char* what, const char* field) const {
    if (i >= list.size())
      fail(task_ref(t_) + " lists " + std::to_string(list.size()) + " " + field + " but the kernel needs `" + what +
           "` at position " + std::to_string(i));
    return list[i];
  }
  const ir::task& t_;
  const device_arena& mem_;
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

inline void copy_rows(const ir::task& t, std::byte* src, std::size_t src_bytes, std::byte* dst, std::size_t dst_bytes,
                      std::size_t outer, std::size_t src_row, std::size_t dst_row, std::size_t src_off, std::size_t dst_off,
                      std::size_t len, cudaStream_t s) {
  if (outer == 0 || len == 0) return;
  if ((outer - 1) * src_row + src_off + len > src_bytes || (outer - 1) * dst_row + dst_off + len > dst_bytes)
    fail(task_ref(t) + ": slice/concat extents run past a buffer");
  check(cudaMemcpy2DAsync(dst + dst_off, dst_row, src + src_off, src_row, len, outer, cudaMemcpyDeviceToDevice, s),
        "cudaMemcpy2DAsync");
}

} // namespace detail

/// @brief Whether the GPU has a kernel for `k`: the kernels of the CPU dispatch as of issue 5.
/// Kernels the CPU dispatch gained since (the DSL's vocabulary-sharded cross-entropy pieces,
/// shard_slice, keep_one, layernorm_grad_gamma) are refused by the backend before the first step.
[[nodiscard]] constexpr bool gpu_supports(kernel k) noexcept {
  switch (k) {
  case kernel::gemm: case kernel::add: case kernel::add_inplace: case kernel::scale: case kernel::bias_add:
  case kernel::bias_add_grad: case kernel::gelu: case kernel::gelu_grad: case kernel::relu: case kernel::relu_grad:
  case kernel::zero: case kernel::layernorm: case kernel::layernorm_grad: case kernel::softmax: case kernel::softmax_grad:
  case kernel::attention: case kernel::attention_grad: case kernel::cross_entropy: case kernel::cross_entropy_grad:
  case kernel::mse: case kernel::mse_grad: case kernel::embedding: case kernel::embedding_grad: case kernel::sgd:
  case kernel::adamw: case kernel::copy: case kernel::slice: case kernel::concat:
    return true;
  default:
    return false;
  }
}

/// @brief Describes the product of a matmul task for cuBLASLt, with the three cases of the CPU
/// dispatch (one product; a batch sharing B as one taller product; a strided batch).
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
  }
  need(a, s.batch * s.m * s.k, "a");
  need(b, s.batch * s.k * s.n, "b");
  need(c, s.batch * s.m * s.n, "c");
  return gemm(h, s, workspace_bytes);
}

/// @brief Enqueues one compute task on `ctx.stream`; `product` is the task's describe_gemm
/// result for a matmul (ignored otherwise).
/// @code
/// cuda::run_kernel(g, t, runtime::resolve(t), arena, settings, ctx, &products[t.id]);
/// @endcode
inline void run_kernel(const ir::graph& g, const ir::task& t, kernel k, const device_arena& mem,
                       const kernel_settings& s, const device_context& ctx, const gemm* product) {
  const detail::device_operands op(t, mem);
  const auto st = ctx.stream;
  const int code = t.id + 1;
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
    const auto acc = op.write(0, "acc");
    ir::buffer_id x = -1;
    for (const auto b : t.reads)
      if (b != acc) x = b;
    if (x < 0) fail(detail::task_ref(t) + " reads nothing to add into its output");
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
    const auto dout = op.read(0, "dout"), x = op.read(1, "x"), dx = op.write(0, "dx");
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
    const auto x = op.read(0, "x"), gamma = op.read(1, "gamma"), beta = op.read(2, "beta");
    const auto out = op.write(0, "out"), mean = op.write(1, "mean"), rstd = op.write(2, "rstd");
    const auto cols = op.n(gamma), rows = op.divide(op.n(x), cols, "rows");
    op.need(beta, cols, "beta");
    op.need(out, op.n(x), "out");
    op.need(mean, rows, "mean");
    op.need(rstd, rows, "rstd");
    layernorm(op.f(x), op.f(gamma), op.f(beta), op.f(out), op.f(mean), op.f(rstd), rows, cols, s.layernorm_eps, st);
    return;
  }
  case kernel::layernorm_grad: {
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
      const auto out = op.write(0, "out"), lse = op.write(1, "lse");
      op.need(out, n, "out");
      op.need(lse, nl, "lse");
      causal_attention(op.f(q), op.f(kk), op.f(v), op.f(out), op.f(lse), batch, seq, heads, hd, st);
    } else {
      const auto dout = op.read(3, "dout"), lse = op.read(4, "lse");
      const auto dq = op.write(0, "dq"), dk = op.write(1, "dk"), dv = op.write(2, "dv");
      op.need(dout, n, "dout");
      op.need(lse, nl, "lse");
      op.need(dq, n, "dq");
      op.need(dk, n, "dk");
      op.need(dv, n, "dv");
      CONCERTO_CHECK(ctx.attention_workspace != nullptr, detail::task_ref(t) + ": no attention workspace");
      causal_attention_grad(op.f(q), op.f(kk), op.f(v), op.f(dout), op.f(lse), op.f(dq), op.f(dk), op.f(dv),
                            ctx.attention_workspace, batch, seq, heads, hd, st);
    }
    return;
  }
  case kernel::cross_entropy: {
    const auto targets = op.int_read("targets");
    const auto logits = op.float_read(0, "logits");
    const auto loss = op.write(0, "loss"), lse = op.write(1, "lse");
    const auto rows = static_cast<std::size_t>(mem.bytes(targets)) / sizeof(std::int32_t);
    CONCERTO_CHECK(rows > 0, detail::task_ref(t) + ": cross_entropy needs at least one row");
    const auto classes = op.divide(op.n(logits), rows, "rows");
    op.need(lse, rows, "lse");
    if (op.n(loss) == 0) fail(detail::task_ref(t) + ": the loss buffer holds no value");
    cross_entropy(op.f(logits), mem.i32(targets), op.f(lse), op.f(loss), rows, classes, ctx.status, code, st);
    return;
  }
  case kernel::cross_entropy_grad: {
    const auto targets = op.int_read("targets");
    const auto logits = op.float_read(0, "logits"), lse = op.float_read(1, "lse");
    const auto dlogits = op.write(0, "dlogits");
    const auto rows = static_cast<std::size_t>(mem.bytes(targets)) / sizeof(std::int32_t);
    CONCERTO_CHECK(rows > 0, detail::task_ref(t) + ": cross_entropy_grad needs at least one row");
    const auto classes = op.divide(op.n(logits), rows, "rows");
    op.need(lse, rows, "lse");
    op.need(dlogits, op.n(logits), "dlogits");
    cross_entropy_grad(op.f(logits), mem.i32(targets), op.f(lse), op.f(dlogits), rows, classes,
                       runtime::detail::ratio(t, "dloss_num", "dloss_den"), st);
    return;
  }
  case kernel::mse: {
    const auto loss = op.write(0, "loss"), pred = op.read(0, "pred"), target = op.read(1, "target");
    if (op.n(loss) == 0) fail(detail::task_ref(t) + ": the loss buffer holds no value");
    op.need(target, op.n(pred), "target");
    mse(op.f(pred), op.f(target), op.f(loss), op.n(pred), st);
    return;
  }
  case kernel::mse_grad: {
    const auto pred = op.read(0, "pred"), target = op.read(1, "target"), dpred = op.write(0, "dpred");
    op.need(target, op.n(pred), "target");
    op.need(dpred, op.n(pred), "dpred");
    mse_grad(op.f(pred), op.f(target), op.f(dpred), op.n(pred), runtime::detail::ratio(t, "dloss_num", "dloss_den"), st);
    return;
  }
  case kernel::embedding:
  case kernel::embedding_grad: {
    const auto ids = op.int_read("ids");
    const auto n = static_cast<std::size_t>(mem.bytes(ids)) / sizeof(std::int32_t);
    const bool reject = t.attr("sharded") == 0;
    const auto first_row = t.attr("first_row", 0);
    const auto big = k == kernel::embedding ? op.write(0, "out") : op.float_read(0, "dout");
    const auto table = k == kernel::embedding ? op.float_read(0, "table") : op.write(0, "dtable");
    const auto dim = op.at("hidden", static_cast<std::int64_t>(n == 0 ? 0 : op.n(big) / n));
    if (dim == 0 || op.n(table) % dim != 0)
      fail(detail::task_ref(t) + ": table '" + mem.name(table) + "' holds " + std::to_string(op.n(table)) +
           " floats, not a whole number of rows of dim " + std::to_string(dim));
    op.need(big, n * dim, k == kernel::embedding ? "out" : "dout");
    const auto rows = op.n(table) / dim;
    if (k == kernel::embedding)
      embedding(mem.i32(ids), op.f(table), op.f(big), n, dim, rows, first_row, reject, ctx.status, code, st);
    else
      embedding_grad(mem.i32(ids), op.f(big), op.f(table), n, dim, rows, t.attr("accumulate") != 0, first_row, reject,
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
    const auto whole = slicing ? op.read(0, "src") : op.write(0, "dst");
    const auto& wb = g.buffers.at(static_cast<std::size_t>(whole));
    const auto elem = ir::size_of(wb.type);
    const auto dim = op.at("dim", 0);
    const auto dims = std::max<std::size_t>(wb.shape.size(), 1);
    if (dim >= dims)
      fail(detail::task_ref(t) + ": attr dim = " + std::to_string(dim) + " but buffer '" + wb.name + "' has " +
           std::to_string(dims) + " dimension(s)");
    const auto extent_of = [&](std::size_t d) {
      return wb.shape.empty() ? static_cast<std::size_t>(wb.bytes) / elem : static_cast<std::size_t>(wb.shape[d]);
    };
    std::size_t outer = 1, inner = elem;
    for (std::size_t d = 0; d < dim; ++d) outer *= extent_of(d);
    for (std::size_t d = dim + 1; d < dims; ++d) inner *= extent_of(d);
    const auto whole_row = extent_of(dim) * inner;
    const auto whole_bytes = static_cast<std::size_t>(mem.bytes(whole));
    if (slicing) {
      const auto part = op.write(0, "dst");
      const auto part_bytes = static_cast<std::size_t>(mem.bytes(part));
      const auto len = op.divide(part_bytes, outer, "rows");
      detail::copy_rows(t, mem.ptr(whole), whole_bytes, mem.ptr(part), part_bytes, outer, whole_row, len,
                        op.at("offset", 0) * inner, 0, len, st);
    } else {
      std::size_t at = 0;
      for (const auto b : t.reads) {
        const auto part_bytes = static_cast<std::size_t>(mem.bytes(b));
        const auto len = op.divide(part_bytes, outer, "rows");
        detail::copy_rows(t, mem.ptr(b), part_bytes, mem.ptr(whole), whole_bytes, outer, len, whole_row, 0, at, len, st);
        at += len;
      }
    }
    return;
  }
  default: break;
  }
  fail(detail::task_ref(t) + ": no GPU kernel implements it yet (the CPU dispatch does; see docs/gpu.md)");
}

} // namespace concerto::runtime::cuda
