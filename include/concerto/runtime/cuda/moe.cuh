#pragma once
/// @file
/// @brief CUDA kernels of the mixture-of-experts ops, the same functions as runtime/cpu/moe.hpp
/// (whose file comment defines the gates, the slots and the priorities) to rounding: the GPU
/// dispatch test checks each against the CPU kernel.
///
/// Routing is one block per group: the threads compute their tokens' softmax and top-k, then
/// one thread hands out the slots in priority order (a sequential pass of group·top_k steps, as
/// the capacity rule is). The slots are found once per call by one thread per (group, expert)
/// scanning the group's tokens; dispatch, combine and their gradients are then one block per
/// token. Gates that give an expert more tokens than its capacity (not moe_route's) are
/// skipped and flagged in `*status`, as kernels.cuh does for bad ids.
///
/// @code
/// cu::moe_route(d_logits, d_gates, shape, d_workspace, stream);
/// cu::moe_dispatch(d_x, d_gates, d_out, shape, d_slots, status, code, stream);
/// @endcode

#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/cuda/kernels.cuh>

#include <cfloat>

namespace concerto::runtime::cuda {

/// @brief Device workspace floats of each MoE call (slots as i32, routing's choices).
[[nodiscard]] inline std::size_t moe_workspace_floats(ir::op fn, const cpu::moe_shape& s) {
  switch (fn) {
  case ir::op::moe_route: return 2 * s.tokens() * s.top_k + s.groups * s.experts;
  case ir::op::moe_route_grad: return s.groups * s.experts;
  case ir::op::moe_dispatch:
  case ir::op::moe_dispatch_grad:
  case ir::op::moe_combine:
  case ir::op::moe_combine_grad: return s.tokens() * s.experts;
  default: return 0;
  }
}

namespace detail {

struct moe_dims {
  std::size_t groups, group, experts, hidden, capacity, top_k, chunks;
  __host__ __device__ std::size_t tokens() const { return groups * group; }
  __host__ __device__ std::size_t slots() const { return groups * capacity; }
  __device__ std::size_t row(std::size_t t, std::int32_t slot, std::size_t e) const {
    // cpu::moe_shape::row's layout: expert-major, or chunk-major when chunks > 1.
    const std::size_t s = (t / group) * capacity + static_cast<std::size_t>(slot), per_chunk = slots() / chunks;
    return (s / per_chunk * experts + e) * per_chunk + s % per_chunk;
  }
};
inline moe_dims dims_of(const cpu::moe_shape& s) {
  return {s.groups, s.group, s.experts, s.hidden, s.capacity, s.top_k, s.chunks};
}

// A grid-stride loop's first index and step (kernels.cuh keeps its macro to itself).
__device__ inline std::size_t grid_first() { return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline std::size_t grid_step() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

// Softmax of one row into p (one thread).
__device__ inline void moe_softmax_row(const float* logits, float* p, std::size_t n) {
  float mx = logits[0];
  for (std::size_t e = 1; e < n; ++e) mx = fmaxf(mx, logits[e]);
  float sum = 0.0f;
  for (std::size_t e = 0; e < n; ++e) sum += p[e] = expf(logits[e] - mx);
  for (std::size_t e = 0; e < n; ++e) p[e] /= sum;
}
// The k largest of p (ties to the lower index), one thread, as cpu::detail::top_k.
__device__ inline void moe_top_k(const float* p, std::size_t n, std::size_t k, std::int32_t* chosen) {
  for (std::size_t j = 0; j < k; ++j) {
    std::int32_t best = -1;
    for (std::size_t e = 0; e < n; ++e) {
      bool taken = false;
      for (std::size_t i = 0; i < j; ++i) taken |= chosen[i] == static_cast<std::int32_t>(e);
      if (!taken && (best < 0 || p[e] > p[best])) best = static_cast<std::int32_t>(e);
    }
    chosen[j] = best;
  }
}

// Block g: the group's tokens' probabilities go to the gates rows (then cleared), their choices
// and chosen probabilities to the workspace; thread 0 keeps choices in priority order.
template <int = 0>
__global__ void moe_route_k(const float* logits, float* gates, std::int32_t* chosen, float* prob, std::int32_t* used,
                            moe_dims d) {
  const std::size_t E = d.experts, K = d.top_k, first = blockIdx.x * d.group;
  for (std::size_t t = first + threadIdx.x; t < first + d.group; t += blockDim.x) {
    float* row = gates + t * E;
    moe_softmax_row(logits + t * E, row, E);
    moe_top_k(row, E, K, chosen + t * K);
    for (std::size_t j = 0; j < K; ++j) prob[t * K + j] = row[chosen[t * K + j]];
    for (std::size_t e = 0; e < E; ++e) row[e] = 0.0f;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  std::int32_t* mine = used + blockIdx.x * E;
  for (std::size_t e = 0; e < E; ++e) mine[e] = 0;
  for (std::size_t j = 0; j < K; ++j)
    for (std::size_t t = first; t < first + d.group; ++t) {
      const auto e = static_cast<std::size_t>(chosen[t * K + j]);
      if (static_cast<std::size_t>(mine[e]) >= d.capacity) continue; // dropped: over capacity
      ++mine[e];
      gates[t * E + e] = fmaxf(prob[t * K + j], FLT_MIN);
    }
}

// Thread (g, e): the slot of each of the group's tokens at expert e.
template <int = 0>
__global__ void moe_slots_k(const float* gates, std::int32_t* slot, moe_dims d, int* status, int code) {
  for (std::size_t i = grid_first(); i < d.groups * d.experts; i += grid_step()) {
    const std::size_t g = i / d.experts, e = i % d.experts;
    std::int32_t next = 0;
    for (std::size_t t = g * d.group; t < (g + 1) * d.group; ++t) {
      const auto at = t * d.experts + e;
      if (gates[at] == 0.0f) {
        slot[at] = -1;
      } else if (static_cast<std::size_t>(next) >= d.capacity) {
        slot[at] = -1;
        flag(status, code);
      } else {
        slot[at] = next++;
      }
    }
  }
}

// Block t: token t's row to each kept slot (out zeroed before).
template <int = 0>
__global__ void moe_dispatch_k(const float* x, const std::int32_t* slot, float* out, moe_dims d) {
  const std::size_t t = blockIdx.x;
  for (std::size_t e = 0; e < d.experts; ++e) {
    const auto c = slot[t * d.experts + e];
    if (c < 0) continue;
    float* dst = out + d.row(t, c, e) * d.hidden;
    for (std::size_t h = threadIdx.x; h < d.hidden; h += blockDim.x) dst[h] = x[t * d.hidden + h];
  }
}
// Block t: the sum over token t's kept slots (dispatch_grad), or their gate-weighted sum (combine).
template <int = 0>
__global__ void moe_gather_k(const float* rows, const float* gates, const std::int32_t* slot, float* out, moe_dims d,
                             bool weighted) {
  const std::size_t t = blockIdx.x;
  for (std::size_t h = threadIdx.x; h < d.hidden; h += blockDim.x) {
    float acc = 0.0f;
    for (std::size_t e = 0; e < d.experts; ++e) {
      const auto c = slot[t * d.experts + e];
      if (c < 0) continue;
      const float w = weighted ? gates[t * d.experts + e] : 1.0f;
      acc += w * rows[d.row(t, c, e) * d.hidden + h];
    }
    out[t * d.hidden + h] = acc;
  }
}
// Block t: dy of token t's kept slots and dgates of its row (dy zeroed before).
template <int = 0>
__global__ void moe_combine_grad_k(const float* dout, const float* y, const float* gates, const std::int32_t* slot,
                                   float* dy, float* dgates, moe_dims d) {
  __shared__ float red[32];
  const std::size_t t = blockIdx.x;
  const float* g = dout + t * d.hidden;
  for (std::size_t e = 0; e < d.experts; ++e) {
    const auto at = t * d.experts + e;
    const auto c = slot[at];
    if (c < 0) {
      if (threadIdx.x == 0) dgates[at] = 0.0f;
      continue;
    }
    const std::size_t row = d.row(t, c, e) * d.hidden;
    float dot = 0.0f;
    for (std::size_t h = threadIdx.x; h < d.hidden; h += blockDim.x) {
      dy[row + h] = gates[at] * g[h];
      dot += g[h] * y[row + h];
    }
    dot = block_reduce(dot, sum_op{}, red);
    if (threadIdx.x == 0) dgates[at] = dot;
  }
}
// Thread g: the group's count of top-k choices per expert; each token's probabilities go to
// its row of `rows` (scratch: the gradient the next kernel writes).
template <int = 0>
__global__ void moe_group_counts_k(const float* logits, float* count, float* rows, moe_dims d) {
  for (std::size_t g = grid_first(); g < d.groups; g += grid_step()) {
    const std::size_t E = d.experts;
    float* c = count + g * E;
    for (std::size_t e = 0; e < E; ++e) c[e] = 0.0f;
    for (std::size_t t = g * d.group; t < (g + 1) * d.group; ++t) {
      float* p = rows + t * E;
      moe_softmax_row(logits + t * E, p, E);
      std::int32_t chosen[16];
      moe_top_k(p, E, d.top_k, chosen);
      for (std::size_t j = 0; j < d.top_k; ++j) c[chosen[j]] += 1.0f;
    }
  }
}
// Thread t: dlogits of token t, the softmax backward of its kept gates' gradient plus the
// balance loss's (cpu::moe_route_grad). Under dynamic loss scaling the balance loss's part is
// scaled too (dgates already are), by the scale read when the kernel runs.
template <int = 0>
__global__ void moe_route_grad_k(const float* logits, const float* gates, const float* dgates, const float* count,
                                 float* dlogits, moe_dims d, float weight, const float* loss_scale) {
  const float aux_scale = loss_gradient_factor(weight, loss_scale);
  for (std::size_t t = grid_first(); t < d.tokens(); t += grid_step()) {
    const std::size_t E = d.experts, g = t / d.group;
    const float per = aux_scale * static_cast<float>(E) / static_cast<float>(d.group * d.top_k * d.group);
    float* out = dlogits + t * E; // p, then the gradient
    moe_softmax_row(logits + t * E, out, E);
    const auto dp = [&](std::size_t e) {
      return (gates[t * E + e] != 0.0f ? dgates[t * E + e] : 0.0f) + per * count[g * E + e];
    };
    float dot = 0.0f;
    for (std::size_t e = 0; e < E; ++e) dot += out[e] * dp(e);
    for (std::size_t e = 0; e < E; ++e) out[e] = out[e] * (dp(e) - dot);
  }
}

inline void moe_check(const cpu::moe_shape& s, const char* kernel) {
  CONCERTO_CHECK(s.top_k >= 1 && s.top_k <= 16 && s.top_k <= s.experts,
                 std::string(kernel) + ": top_k " + std::to_string(s.top_k) +
                     " must be between 1 and the experts (at most 16 on the GPU)");
}

} // namespace detail

/// @brief cpu::moe_route on the device; `workspace` holds moe_workspace_floats(moe_route).
inline void moe_route(const float* logits, float* gates, const cpu::moe_shape& s, float* workspace, cudaStream_t st) {
  detail::moe_check(s, "moe_route");
  if (s.tokens() == 0) return;
  auto* chosen = reinterpret_cast<std::int32_t*>(workspace);
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(s.groups, "moe_route"), detail::block, 0, st, detail::moe_route_k<>)(
      logits, gates, chosen, workspace + s.tokens() * s.top_k,
      reinterpret_cast<std::int32_t*>(workspace + 2 * s.tokens() * s.top_k), detail::dims_of(s));
  detail::launched("moe_route");
}
/// @brief cpu::moe_route_grad on the device; `workspace` holds moe_workspace_floats(moe_route_grad).
/// Under dynamic loss scaling the balance loss's gradient is also times `*loss_scale` (device,
/// read when the kernel runs).
inline void moe_route_grad(const float* logits, const float* gates, const float* dgates, float* dlogits,
                           const cpu::moe_shape& s, float aux_scale, float* workspace, cudaStream_t st,
                           const float* loss_scale = nullptr) {
  detail::moe_check(s, "moe_route_grad");
  if (s.tokens() == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(s.groups), detail::block, 0, st, detail::moe_group_counts_k<>)(
      logits, workspace, dlogits, detail::dims_of(s));
  detail::launched("moe_route_grad");
  CONCERTO_CUDA_LAUNCH(detail::grid_for(s.tokens()), detail::block, 0, st, detail::moe_route_grad_k<>)(
      logits, gates, dgates, workspace, dlogits, detail::dims_of(s), aux_scale, loss_scale);
  detail::launched("moe_route_grad");
}
/// @brief Each (token, expert)'s slot into `slot` (tokens·experts i32 of workspace).
inline void moe_slots(const float* gates, std::int32_t* slot, const cpu::moe_shape& s, int* status, int code, cudaStream_t st) {
  CONCERTO_CUDA_LAUNCH(detail::grid_for(s.groups * s.experts), detail::block, 0, st, detail::moe_slots_k<>)(
      gates, slot, detail::dims_of(s), status, code);
  detail::launched("moe_slots");
}
/// @brief cpu::moe_dispatch on the device.
inline void moe_dispatch(const float* x, const float* gates, float* out, const cpu::moe_shape& s, std::int32_t* slot,
                         int* status, int code, cudaStream_t st) {
  check(cudaMemsetAsync(out, 0, s.experts * s.slots() * s.hidden * sizeof(float), st), "cudaMemsetAsync");
  if (s.tokens() == 0) return;
  moe_slots(gates, slot, s, status, code, st);
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(s.tokens(), "moe_dispatch"), detail::block, 0, st, detail::moe_dispatch_k<>)(
      x, slot, out, detail::dims_of(s));
  detail::launched("moe_dispatch");
}
/// @brief cpu::moe_dispatch_grad (weighted = false) or cpu::moe_combine (weighted = true) on the device.
inline void moe_gather(const float* rows, const float* gates, float* out, const cpu::moe_shape& s, std::int32_t* slot,
                       bool weighted, int* status, int code, cudaStream_t st) {
  if (s.tokens() == 0) return;
  moe_slots(gates, slot, s, status, code, st);
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(s.tokens(), "moe_gather"), detail::block, 0, st, detail::moe_gather_k<>)(
      rows, gates, slot, out, detail::dims_of(s), weighted);
  detail::launched(weighted ? "moe_combine" : "moe_dispatch_grad");
}
/// @brief cpu::moe_combine_grad on the device.
inline void moe_combine_grad(const float* dout, const float* y, const float* gates, float* dy, float* dgates,
                             const cpu::moe_shape& s, std::int32_t* slot, int* status, int code, cudaStream_t st) {
  check(cudaMemsetAsync(dy, 0, s.experts * s.slots() * s.hidden * sizeof(float), st), "cudaMemsetAsync");
  if (s.tokens() == 0) return;
  moe_slots(gates, slot, s, status, code, st);
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(s.tokens(), "moe_combine_grad"), detail::block, 0, st,
                       detail::moe_combine_grad_k<>)(dout, y, gates, slot, dy, dgates, detail::dims_of(s));
  detail::launched("moe_combine_grad");
}
} // namespace concerto::runtime::cuda
