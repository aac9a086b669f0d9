#pragma once
/// @file
/// @brief Fused (grouped-query) attention, forward and backward, through cuDNN's SDPA graphs
/// (cuDNN 9 with its header-only frontend): the fast path for 16-bit operands. The own tiled
/// kernels (runtime/cuda/kernels.cuh, fp32) remain the fallback and what the host emulation tests.
///
/// Same semantics as cpu::causal_attention / cpu::causal_attention_grad: q and out
/// `[batch, seq, heads·head_dim]`, k and v `[batch, seq, kv_heads·head_dim]`, softmax scale
/// 1/√head_dim, causal mask top-left aligned (query i sees keys 0..i), lse `[batch, heads, seq]`
/// f32 in natural log. cuDNN names the dims [batch, heads, seq, head_dim] and reads our layout
/// through strides, so nothing is transposed.
///
/// Every function returns false (and writes nothing) where cuDNN cannot run the case: operands
/// not bf16/f16 (cuDNN's SDPA takes 16-bit inputs), a head mapping cuDNN does not express (it
/// maps q head h to kv head h / (heads / kv_heads); a rank holding every kv head but some q heads
/// does not fit), head_dim not a multiple of 8 or above 256, an operand not 16-byte aligned, the
/// graph's support check failing on this device, a workspace too small, or a build without the
/// frontend (CONCERTO_HAS_CUDNN_FRONTEND undefined, or the host emulation). The caller then runs
/// the own kernels.
///
/// Building a graph and choosing its plan takes milliseconds; a training step runs it thousands
/// of times. So each graph is built once per (shape, type, causal, pass) and kept in a
/// `cudnn_attention_cache`, one per cuDNN handle, used by one thread at a time (as the handle),
/// refusals included: an unsupported shape is not retried every step.
///
/// The backward is deterministic by default (`cudnn_attention_options::deterministic`), as the rest
/// of the backend: a step repeats bit for bit, which replays and the CPU-equality tests rely on.
/// The price, on Hopper with this cuDNN: dP goes through the workspace instead of atomics into dQ,
/// batch·heads·seq²·2 bytes (seq rounded up to 64; 512 MiB at batch 4, 16 heads, seq 2048), which
/// cudnn_attention_workspace_bytes reports. A cache made with `deterministic = false` lets cuDNN
/// pick (dP in workspace up to 256 MiB, else atomics: not repeatable).
/// Host code; the fast path needs nvcc (the frontend's headers use CUDA's 16-bit types).

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cuda/convolution.hpp>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#if defined(CONCERTO_HAS_CUDNN_FRONTEND) && !defined(CONCERTO_CUDA_EMULATION)
#define CONCERTO_CUDNN_ATTENTION 1
// The frontend's JSON (de)serialization of graphs is not used; skipping it keeps its bundled
// nlohmann::json out of translation units that also include the system's.
#ifndef CUDNN_FRONTEND_SKIP_JSON_LIB
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#endif
#include <cstring> // the frontend calls std::strlen without including it
#include <cudnn_frontend.h>

#include <memory>
#include <unordered_map>
#endif

namespace concerto::runtime::cuda {

/// @brief Whether this build has cuDNN's fused attention (else every call below returns false).
inline constexpr bool cudnn_attention_available =
#ifdef CONCERTO_CUDNN_ATTENTION
    true;
#else
    false;
#endif

/// @brief Which graph of the fused attention: the forward (with or without lse) or the backward.
enum class cudnn_attention_pass : std::uint8_t { forward, forward_with_lse, backward };

/// @brief How a cache's graphs are built (one policy per cache, as per backend).
struct cudnn_attention_options {
  bool deterministic = true; ///< backward bit for bit repeatable (see the file comment for its workspace)
};

/// @brief The device operands of one fused attention call (16-bit values of `type`; lse f32).
struct cudnn_attention_operands {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;        ///< forward: written; backward: the forward's output, read (or null: recomputed)
  float* lse = nullptr;       ///< forward: written when not null; backward: read (or null: recomputed)
  const void* dout = nullptr; ///< backward only
  void* dq = nullptr;         ///< backward only, like q
  void* dk = nullptr;         ///< backward only, like k (summed over each kv head's group)
  void* dv = nullptr;         ///< backward only, like v
};

namespace detail {

// Whether cuDNN's head mapping (q head h reads kv head h / (heads / kv_heads)) is the shape's own
// (kv_of(h) = (first_head + h) / group - kv_first_head) for every h.
[[nodiscard]] constexpr bool cudnn_maps_heads_alike(const cpu::attention_shape& s) noexcept {
  const std::size_t kv = s.kv();
  return s.group > 0 && kv > 0 && s.heads == kv * s.group && s.first_head == s.kv_first_head * s.group;
}

// The cases checked before any graph is built: 16-bit operands, cuDNN's head mapping, head_dim.
[[nodiscard]] constexpr bool cudnn_attention_shape_fits(const cpu::attention_shape& s, ir::dtype type) noexcept {
  return ir::is_16bit_float(type) && cudnn_maps_heads_alike(s) && s.head_dim % 8 == 0 && s.head_dim <= 256 &&
         s.batch > 0 && s.seq > 0 && s.heads > 0;
}

// Pieces of a backward that recomputes the forward: its output and lse ahead of cuDNN's own workspace.
inline constexpr std::size_t cudnn_workspace_align = 256;
constexpr std::size_t cudnn_aligned(std::size_t bytes) noexcept {
  return (bytes + cudnn_workspace_align - 1) / cudnn_workspace_align * cudnn_workspace_align;
}
constexpr std::size_t recomputed_out_bytes(const cpu::attention_shape& s) noexcept { return cudnn_aligned(s.q_floats() * 2); }
constexpr std::size_t recomputed_lse_bytes(const cpu::attention_shape& s) noexcept {
  return cudnn_aligned(s.lse_floats() * sizeof(float));
}

[[nodiscard]] inline bool aligned16(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

} // namespace detail

#ifdef CONCERTO_CUDNN_ATTENTION

namespace detail {

namespace fe = cudnn_frontend;

// The tensors' unique ids in every graph (the variant pack maps them to device pointers).
enum sdpa_uid : std::int64_t { uid_q = 1, uid_k, uid_v, uid_out, uid_lse, uid_dout, uid_dq, uid_dk, uid_dv };

// What a cached graph is built for.
struct sdpa_key {
  std::size_t batch, seq, heads, kv_heads, head_dim;
  bool causal;
  ir::dtype type;
  cudnn_attention_pass pass;
  bool operator==(const sdpa_key&) const = default;
};
struct sdpa_key_hash {
  std::size_t operator()(const sdpa_key& k) const noexcept {
    std::size_t h = 0;
    for (const std::size_t x : {k.batch, k.seq, k.heads, k.kv_heads, k.head_dim, static_cast<std::size_t>(k.causal),
                                static_cast<std::size_t>(k.type), static_cast<std::size_t>(k.pass)})
      h = h * 1000003u ^ x;
    return h;
  }
};

// A built graph and the workspace it runs with; no graph where cuDNN refused the case (why: `refusal`).
struct sdpa_graph {
  std::shared_ptr<fe::graph::Graph> graph;
  std::size_t workspace_bytes = 0;
  std::string refusal;
};

inline fe::DataType_t fe_type(ir::dtype t) { return t == ir::dtype::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF; }

// Our [batch, seq, heads, head_dim] rows, as cuDNN's dims [batch, heads, seq, head_dim].
inline std::shared_ptr<fe::graph::Tensor_attributes> sdpa_input(fe::graph::Graph& g, const char* name, std::int64_t uid,
                                                                const sdpa_key& k, std::size_t heads) {
  const auto b = static_cast<std::int64_t>(k.batch), s = static_cast<std::int64_t>(k.seq),
             h = static_cast<std::int64_t>(heads), d = static_cast<std::int64_t>(k.head_dim);
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({b, h, s, d}).set_stride(
      {s * h * d, d, h * d, 1}));
}
inline void mark_rows_output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, std::int64_t uid, const sdpa_key& k,
                             std::size_t heads) {
  const auto b = static_cast<std::int64_t>(k.batch), s = static_cast<std::int64_t>(k.seq),
             h = static_cast<std::int64_t>(heads), d = static_cast<std::int64_t>(k.head_dim);
  t->set_output(true).set_uid(uid).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
}
// lse [batch, heads, seq] f32, as cuDNN's stats [batch, heads, seq, 1].
inline std::shared_ptr<fe::graph::Tensor_attributes> lse_attributes(const sdpa_key& k) {
  const auto b = static_cast<std::int64_t>(k.batch), s = static_cast<std::int64_t>(k.seq), h = static_cast<std::int64_t>(k.heads);
  auto t = std::make_shared<fe::graph::Tensor_attributes>();
  t->set_name("lse").set_uid(uid_lse).set_dim({b, h, s, 1}).set_stride({h * s, s, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
  return t;
}

inline float softmax_scale(const sdpa_key& k) { return 1.0f / std::sqrt(static_cast<float>(k.head_dim)); }

// The tensors and the operation of one pass (no plan yet).
inline std::shared_ptr<fe::graph::Graph> describe_sdpa(const sdpa_key& k, const cudnn_attention_options& policy) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_type(k.type)).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  const auto q = sdpa_input(*g, "q", uid_q, k, k.heads);
  const auto kt = sdpa_input(*g, "k", uid_k, k, k.kv_heads);
  const auto v = sdpa_input(*g, "v", uid_v, k, k.kv_heads);
  if (k.pass != cudnn_attention_pass::backward) {
    const bool with_lse = k.pass == cudnn_attention_pass::forward_with_lse;
    auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(with_lse).set_attn_scale(softmax_scale(k));
    if (k.causal) options.set_causal_mask(true); // top-left: query i sees keys 0..i, as cpu::attention_shape
    auto [out, stats] = g->sdpa(q, kt, v, options);
    mark_rows_output(out, uid_out, k, k.heads);
    if (with_lse) {
      const auto want = lse_attributes(k);
      stats->set_output(true).set_uid(uid_lse).set_dim(want->get_dim()).set_stride(want->get_stride()).set_data_type(
          fe::DataType_t::FLOAT);
    }
    return g;
  }
  const auto out = sdpa_input(*g, "out", uid_out, k, k.heads);
  const auto dout = sdpa_input(*g, "dout", uid_dout, k, k.heads);
  const auto lse = g->tensor(*lse_attributes(k));
  auto options = fe::graph::SDPA_backward_attributes().set_name("attention_grad").set_attn_scale(softmax_scale(k));
  if (k.causal) options.set_causal_mask(true);
  options.set_deterministic_algorithm(policy.deterministic);
  auto [dq, dk, dv] = g->sdpa_backward(q, kt, v, out, dout, lse, options);
  mark_rows_output(dq, uid_dq, k, k.heads);
  mark_rows_output(dk, uid_dk, k, k.kv_heads);
  mark_rows_output(dv, uid_dv, k, k.kv_heads);
  return g;
}

// Describes, checks and plans one pass; a refusal (any step failing) is kept with its reason.
inline sdpa_graph build_sdpa(cudnnHandle_t handle, const sdpa_key& k, const cudnn_attention_options& options) {
  sdpa_graph built;
  try {
    auto g = describe_sdpa(k, options);
    const auto refused = [&](const char* step, fe::error_t e) {
      built.refusal = std::string(step) + ": " + e.get_message();
      return built;
    };
    if (auto e = g->validate(); e.is_bad()) return refused("validate", e);
    if (auto e = g->build_operation_graph(handle); e.is_bad()) return refused("build_operation_graph", e);
    if (auto e = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); e.is_bad())
      return refused("create_execution_plans", e);
    if (auto e = g->check_support(); e.is_bad()) return refused("check_support", e);
    if (auto e = g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); e.is_bad()) return refused("build_plans", e);
    std::int64_t bytes = 0;
    if (auto e = g->get_workspace_size(bytes); e.is_bad()) return refused("get_workspace_size", e);
    built.workspace_bytes = static_cast<std::size_t>(bytes);
    built.graph = std::move(g);
  } catch (const std::exception& e) { // the frontend's legacy descriptors throw on a backend refusal
    built.graph.reset();
    built.refusal = e.what();
  }
  return built;
}

} // namespace detail

/// @brief The fused attention's graphs, built once per shape, type, mask and pass, for one cuDNN
/// handle. Not synchronized: one thread (and one stream at a time) per cache, as the handle.
class cudnn_attention_cache {
public:
  /// `handle` must outlive the cache (the backend's dnn_handle::get()).
  explicit cudnn_attention_cache(cudnnHandle_t handle, cudnn_attention_options options = {})
      : handle_(handle), options_(options) {}

  [[nodiscard]] cudnnHandle_t handle() const noexcept { return handle_; }

  /// The graph of a case, built on first use; null graph where cuDNN refused it.
  const detail::sdpa_graph& graph(const cpu::attention_shape& s, ir::dtype type, cudnn_attention_pass pass) {
    const detail::sdpa_key key{s.batch, s.seq, s.heads, s.kv(), s.head_dim, s.causal, type, pass};
    auto it = graphs_.find(key);
    if (it == graphs_.end()) it = graphs_.emplace(key, detail::build_sdpa(handle_, key, options_)).first;
    if (!it->second.graph) last_refusal_ = it->second.refusal;
    return it->second;
  }

  /// Why cuDNN refused the last refused case (for messages and tests); empty if none was refused.
  [[nodiscard]] const std::string& last_refusal() const noexcept { return last_refusal_; }

private:
  cudnnHandle_t handle_;
  cudnn_attention_options options_;
  std::unordered_map<detail::sdpa_key, detail::sdpa_graph, detail::sdpa_key_hash> graphs_;
  std::string last_refusal_;
};

#else // no frontend: the same interface, refusing everything

class cudnn_attention_cache {
public:
  explicit cudnn_attention_cache(cudnnHandle_t handle, cudnn_attention_options = {}) : handle_(handle) {}
  [[nodiscard]] cudnnHandle_t handle() const noexcept { return handle_; }
  [[nodiscard]] const std::string& last_refusal() const noexcept { return why_; }

private:
  cudnnHandle_t handle_;
  std::string why_ = "built without cuDNN's frontend (CONCERTO_HAS_CUDNN_FRONTEND; scripts/deps.sh installs its headers)";
};

#endif

/// @brief Device workspace bytes a fused attention call needs, or nullopt where cuDNN cannot run
/// the case (the caller then sizes for and runs the own kernels). `pass` backward with
/// `recompute_forward` counts the forward's output and lse the backward then recomputes.
/// Builds (and caches) the graphs it asks about: call it before the first step, not in it.
/// @code
/// cuda::cudnn_attention_cache cache(dnn.get());
/// auto bytes = cuda::cudnn_attention_workspace_bytes(cache, c.att, ir::dtype::bf16, cuda::cudnn_attention_pass::backward, true);
/// @endcode
[[nodiscard]] inline std::optional<std::size_t> cudnn_attention_workspace_bytes(cudnn_attention_cache& cache,
                                                                                const cpu::attention_shape& shape,
                                                                                ir::dtype type, cudnn_attention_pass pass,
                                                                                bool recompute_forward = false) {
#ifdef CONCERTO_CUDNN_ATTENTION
  if (!detail::cudnn_attention_shape_fits(shape, type)) return std::nullopt;
  const auto& g = cache.graph(shape, type, pass);
  if (!g.graph) return std::nullopt;
  if (pass != cudnn_attention_pass::backward || !recompute_forward) return g.workspace_bytes;
  const auto& f = cache.graph(shape, type, cudnn_attention_pass::forward_with_lse);
  if (!f.graph) return std::nullopt;
  // The forward runs first, then the backward, each over the same scratch after out and lse.
  return detail::recomputed_out_bytes(shape) + detail::recomputed_lse_bytes(shape) +
         std::max(f.workspace_bytes, g.workspace_bytes);
#else
  (void)cache, (void)shape, (void)type, (void)pass, (void)recompute_forward;
  return std::nullopt;
#endif
}

#ifdef CONCERTO_CUDNN_ATTENTION
namespace detail {
// Runs a built graph on `stream`; an execution failure on a supported case is a real error.
inline void run_sdpa(cudnn_attention_cache& cache, const sdpa_graph& g, cudaStream_t stream,
                     std::unordered_map<std::int64_t, void*>& pack, void* workspace, const char* what) {
  CONCERTO_CUDNN_CHECK(cudnnSetStream(cache.handle(), stream));
  if (auto e = g.graph->execute(cache.handle(), pack, workspace); e.is_bad())
    fail(std::string(what) + ": cuDNN's fused attention failed to run a graph that passed its support check (" +
         e.get_message() + "); set CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=stderr to see the plan");
}
} // namespace detail
#endif

/// @brief `out = softmax(q·kᵀ/√head_dim [+ causal mask])·v` with cuDNN (and lse when `o.lse` is
/// not null), on `stream`. False, with nothing written, where cuDNN cannot run the case or
/// `workspace_bytes` is less than cudnn_attention_workspace_bytes(pass forward / forward_with_lse).
/// @code
/// if (!cuda::cudnn_attention_forward(cache, stream, ir::dtype::bf16, c.att, {.q = q, .k = k, .v = v, .out = out}, ws, ws_bytes))
///   /* the own kernels, on f32 copies */;
/// @endcode
[[nodiscard]] inline bool cudnn_attention_forward(cudnn_attention_cache& cache, cudaStream_t stream, ir::dtype type,
                                                  const cpu::attention_shape& shape, const cudnn_attention_operands& o,
                                                  void* workspace, std::size_t workspace_bytes) {
#ifdef CONCERTO_CUDNN_ATTENTION
  if (!detail::cudnn_attention_shape_fits(shape, type)) return false;
  for (const void* p : {o.q, o.k, o.v, static_cast<const void*>(o.out)})
    if (p == nullptr || !detail::aligned16(p)) return false;
  if (o.lse != nullptr && !detail::aligned16(o.lse)) return false;
  const auto pass = o.lse != nullptr ? cudnn_attention_pass::forward_with_lse : cudnn_attention_pass::forward;
  const auto& g = cache.graph(shape, type, pass);
  if (!g.graph || workspace_bytes < g.workspace_bytes || (g.workspace_bytes > 0 && workspace == nullptr)) return false;
  std::unordered_map<std::int64_t, void*> pack{{detail::uid_q, const_cast<void*>(o.q)},
                                               {detail::uid_k, const_cast<void*>(o.k)},
                                               {detail::uid_v, const_cast<void*>(o.v)},
                                               {detail::uid_out, o.out}};
  if (o.lse != nullptr) pack.emplace(detail::uid_lse, o.lse);
  detail::run_sdpa(cache, g, stream, pack, workspace, "cudnn_attention_forward");
  return true;
#else
  (void)cache, (void)stream, (void)type, (void)shape, (void)o, (void)workspace, (void)workspace_bytes;
  return false;
#endif
}

/// @brief dq, dk, dv (overwritten; dk and dv summed over each kv head's q heads) from q, k, v,
/// dout and the forward's `out` and `lse`, with cuDNN, on `stream`. Where `o.out` and `o.lse` are
/// both null (a pipeline that keeps neither between the passes, as the dispatch's attention_grad),
/// the forward graph first recomputes them into the workspace: one more forward (two fifths
/// of the backward's flops) and q-sized 16-bit plus lse-sized f32 scratch. False, with nothing
/// written, where cuDNN cannot run the case or the workspace is less than
/// cudnn_attention_workspace_bytes(pass backward, recompute_forward = o.lse == nullptr).
/// Given one of out and lse without the other is a caller's mistake: it throws.
/// @code
/// if (!cuda::cudnn_attention_backward(cache, stream, ir::dtype::bf16, c.att,
///                                     {.q = q, .k = k, .v = v, .dout = dy, .dq = dq, .dk = dk, .dv = dv}, ws, ws_bytes))
///   /* the own kernels */;
/// @endcode
[[nodiscard]] inline bool cudnn_attention_backward(cudnn_attention_cache& cache, cudaStream_t stream, ir::dtype type,
                                                   const cpu::attention_shape& shape, const cudnn_attention_operands& o,
                                                   void* workspace, std::size_t workspace_bytes) {
  if ((o.out == nullptr) != (o.lse == nullptr))
    fail("cudnn_attention_backward: `out` and `lse` are both the forward's (given) or both recomputed (null); "
         "pass both or neither");
#ifdef CONCERTO_CUDNN_ATTENTION
  if (!detail::cudnn_attention_shape_fits(shape, type)) return false;
  for (const void* p : {o.q, o.k, o.v, o.dout, static_cast<const void*>(o.dq), static_cast<const void*>(o.dk),
                        static_cast<const void*>(o.dv)})
    if (p == nullptr || !detail::aligned16(p)) return false;
  const bool recompute = o.lse == nullptr;
  if (!recompute && (!detail::aligned16(o.out) || !detail::aligned16(o.lse))) return false;
  const auto need = cudnn_attention_workspace_bytes(cache, shape, type, cudnn_attention_pass::backward, recompute);
  if (!need || workspace_bytes < *need || (*need > 0 && workspace == nullptr)) return false;
  void* out = o.out;
  float* lse = o.lse;
  auto* scratch = static_cast<std::byte*>(workspace);
  if (recompute) { // out and lse first in the workspace (256-byte aligned pieces, the workspace's own alignment)
    if (!detail::aligned16(workspace)) return false;
    out = scratch;
    lse = reinterpret_cast<float*>(scratch + detail::recomputed_out_bytes(shape));
    scratch += detail::recomputed_out_bytes(shape) + detail::recomputed_lse_bytes(shape);
    std::unordered_map<std::int64_t, void*> forward{{detail::uid_q, const_cast<void*>(o.q)},
                                                    {detail::uid_k, const_cast<void*>(o.k)},
                                                    {detail::uid_v, const_cast<void*>(o.v)},
                                                    {detail::uid_out, out},
                                                    {detail::uid_lse, lse}};
    detail::run_sdpa(cache, cache.graph(shape, type, cudnn_attention_pass::forward_with_lse), stream, forward, scratch,
                     "cudnn_attention_backward (recomputing the forward)");
  }
  std::unordered_map<std::int64_t, void*> pack{{detail::uid_q, const_cast<void*>(o.q)},
                                               {detail::uid_k, const_cast<void*>(o.k)},
                                               {detail::uid_v, const_cast<void*>(o.v)},
                                               {detail::uid_out, out},
                                               {detail::uid_lse, lse},
                                               {detail::uid_dout, const_cast<void*>(o.dout)},
                                               {detail::uid_dq, o.dq},
                                               {detail::uid_dk, o.dk},
                                               {detail::uid_dv, o.dv}};
  detail::run_sdpa(cache, cache.graph(shape, type, cudnn_attention_pass::backward), stream, pack, scratch,
                   "cudnn_attention_backward");
  return true;
#else
  (void)cache, (void)stream, (void)type, (void)shape, (void)workspace, (void)workspace_bytes;
  return false;
#endif
}

} // namespace concerto::runtime::cuda
