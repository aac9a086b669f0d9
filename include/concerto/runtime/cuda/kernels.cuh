#pragma once
/// @file
/// @brief CUDA kernels for every op the CPU kernels have, forward and backward (matmul is in
/// blas.hpp), the pieces the CPU dispatch computes inline (the vocabulary-parallel
/// cross-entropy, layernorm's statistics and dgamma alone, i64 ids narrowed to i32), and the
/// restride that packs a tensor split along an inner dimension for NCCL. Needs nvcc.
///
/// Each host function enqueues on a stream and returns; it takes device pointers and the
/// extents of the CPU kernel of the same name (runtime/cpu/), and computes the same function,
/// so the two backends agree to rounding: the tests check each pair on random data. The
/// kernels are simple and correct rather than fast: one block per row for row-wise ops
/// (deterministic block reductions, no atomics), grid-stride loops for elementwise ones, column
/// sums split over rows and columns and added in a fixed order, an embedding gradient that sorts
/// its tokens by row instead of adding atomically, and a tiled attention with an online softmax
/// (FlashAttention's recurrence; fp32 arithmetic, no tensor cores). The kernels of a
/// transformer's hot ops take each float operand as a float_in or float_out, f32, bf16 or f16
/// (see float_in); the rest take f32. Kernels are templates so that a header included by several
/// translation units links.
///
/// Where the CPU kernel throws on bad data (a target or id outside its range), a device kernel
/// cannot; it skips the value and writes `code` into `*status` (first error wins), which the
/// backend reads after the step and turns into an error naming the task.
///
/// @code
/// namespace cu = concerto::runtime::cuda;
/// cu::gelu(d_x, d_y, n, stream);
/// cu::layernorm(d_x, d_gamma, d_beta, d_out, d_mean, d_rstd, rows, cols, 1e-5f, stream);
/// @endcode

#if !defined(__CUDACC__) && !defined(CONCERTO_CUDA_EMULATION)
#error "concerto/runtime/cuda/kernels.cuh holds CUDA kernels: compile this source with nvcc (concerto_cuda_sources(target) in CMake)"
#endif

#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cpu/optimizer.hpp>
#include <concerto/runtime/dropout_mask.hpp>
#include <concerto/runtime/cuda/check.hpp>
#include <concerto/runtime/grad_clip.hpp>
#include <concerto/runtime/lr_schedule.hpp>

#include <cuda_runtime.h>

// Kernels are launched and take their dynamic shared memory through these two macros, so that
// the host emulation of the CUDA execution model (tests/gpu/emulation), which defines them
// before this header, runs the same kernel code on a machine without a GPU.
#ifndef CONCERTO_CUDA_LAUNCH
#define CONCERTO_CUDA_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif
#ifndef CONCERTO_CUDA_DYNAMIC_SHARED
#define CONCERTO_CUDA_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace concerto::runtime::cuda {

/// @brief The parameter's working copy an update also writes under a 16-bit policy (ir/precision.hpp):
/// bf16 or f16 device values, the new master rounded; none when `values` is null.
struct working_copy {
  void* values = nullptr;
  ir::dtype type = ir::dtype::bf16;
};

namespace detail {
// Value i of a buffer of float type T (f32, bf16, f16) as f32, exactly; and f32 stored in T,
// rounded to nearest even (core/bfloat16.hpp, core/float16.hpp).
template <ir::dtype T>
__device__ float load_f32(const void* p, std::size_t i) {
  if constexpr (T == ir::dtype::f32) return static_cast<const float*>(p)[i];
  else if constexpr (T == ir::dtype::f16) return from_f16(static_cast<const std::uint16_t*>(p)[i]);
  else return from_bf16(static_cast<const std::uint16_t*>(p)[i]);
}
template <ir::dtype T>
__device__ void store_f32(void* p, std::size_t i, float v) {
  if constexpr (T == ir::dtype::f32) static_cast<float*>(p)[i] = v;
  else if constexpr (T == ir::dtype::f16) static_cast<std::uint16_t*>(p)[i] = to_f16(v);
  else static_cast<std::uint16_t*>(p)[i] = to_bf16(v);
}
__device__ inline float load_as_f32(const void* p, ir::dtype type, std::size_t i) {
  switch (type) {
  case ir::dtype::bf16: return load_f32<ir::dtype::bf16>(p, i);
  case ir::dtype::f16: return load_f32<ir::dtype::f16>(p, i);
  default: return load_f32<ir::dtype::f32>(p, i);
  }
}
__device__ inline void store_from_f32(void* p, ir::dtype type, std::size_t i, float v) {
  switch (type) {
  case ir::dtype::bf16: store_f32<ir::dtype::bf16>(p, i, v); return;
  case ir::dtype::f16: store_f32<ir::dtype::f16>(p, i, v); return;
  default: store_f32<ir::dtype::f32>(p, i, v); return;
  }
}
__host__ __device__ constexpr std::size_t float_width(ir::dtype type) { return type == ir::dtype::f32 ? 4 : 2; }
} // namespace detail

// The 16-bit-native kernels take their float operands as a pointer and its element type, decided
// at run time, rather than as templates over the types: each operand of a call is f32, bf16 or
// f16 on its own (ir/precision.hpp keeps losses, statistics and accumulating weight gradients in
// f32 beside bf16 activations), so a kernel of four operands would need 81 instantiations, each
// compiled for every shape of the attention. The type is the same for every thread of a launch,
// so the switch in a load or store never diverges, and arithmetic is f32 throughout: with f32
// operands a kernel computes exactly what it did on `const float*`, which still converts
// implicitly, so f32 callers are unchanged.

/// @brief A device buffer of float values (f32, bf16 or f16) read as f32, exactly.
struct float_in {
  const void* data = nullptr;
  ir::dtype type = ir::dtype::f32;
  float_in() = default;
  __host__ __device__ float_in(const float* p) : data(p) {} // NOLINT(google-explicit-constructor): f32 callers
  __host__ __device__ float_in(const void* p, ir::dtype t) : data(p), type(t) {}
  __device__ float operator[](std::size_t i) const { return detail::load_as_f32(data, type, i); }
  __host__ __device__ float_in operator+(std::size_t i) const {
    return {static_cast<const unsigned char*>(data) + i * detail::float_width(type), type};
  }
};
/// @brief A device buffer of float values (f32, bf16 or f16) written from f32, rounded to
/// nearest even; `out[i] = v` stores, reading `out[i]` widens.
struct float_out {
  void* data = nullptr;
  ir::dtype type = ir::dtype::f32;
  struct element {
    void* data;
    ir::dtype type;
    std::size_t i;
    __device__ const element& operator=(float v) const {
      detail::store_from_f32(data, type, i, v);
      return *this;
    }
    __device__ operator float() const { return detail::load_as_f32(data, type, i); } // NOLINT: a value's read
  };
  float_out() = default;
  __host__ __device__ float_out(float* p) : data(p) {} // NOLINT(google-explicit-constructor): f32 callers
  __host__ __device__ float_out(void* p, ir::dtype t) : data(p), type(t) {}
  __device__ element operator[](std::size_t i) const { return {data, type, i}; }
  __host__ __device__ float_out operator+(std::size_t i) const {
    return {static_cast<unsigned char*>(data) + i * detail::float_width(type), type};
  }
  __host__ __device__ explicit operator bool() const { return data != nullptr; }
};

namespace detail {

inline constexpr int block = 256;       // threads of elementwise and row-wise kernels

inline unsigned grid_for(std::size_t n, int threads = block) {
  const std::size_t blocks = (n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > 65535 ? 65535 : blocks);
}
inline unsigned rows_grid(std::size_t rows, const char* kernel) {
  CONCERTO_CHECK(rows <= 0x7fffffffu, std::string(kernel) + ": " + std::to_string(rows) + " rows exceed the grid");
  return static_cast<unsigned>(rows);
}
inline void launched(const char* kernel) {
  const auto e = cudaGetLastError();
  if (e != cudaSuccess) fail(std::string(kernel) + ": kernel launch failed: " + cudaGetErrorString(e));
}

struct sum_op {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct max_op {
  template <class T>
  __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};

// Reduces one value per thread over the block; every thread gets the result. The order of the
// additions is fixed (warp tree, then warps in order), so results do not vary run to run.
// `shared` holds 32 values; the leading barrier lets a caller reuse it call after call.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = shared[0];
  const int warps = (static_cast<int>(blockDim.x) + 31) >> 5;
  for (int w = 1; w < warps; ++w) r = op(r, shared[w]);
  return r;
}

__device__ inline void flag(int* status, int code) {
  if (status != nullptr) atomicCAS(status, 0, code);
}

#define CONCERTO_GRID_STRIDE(i, n)                                                                 \
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);   \
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)

inline constexpr float gelu_k0 = 0.7978845608028654f; // sqrt(2/pi), as the CPU kernel
inline constexpr float gelu_k1 = 0.044715f;

// ---- elementwise ----------------------------------------------------------------------------
template <int = 0>
__global__ void add_k(float_in a, float_in b, float_out out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
template <int = 0>
__global__ void add_inplace_k(float* acc, const float* x, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) acc[i] += x[i];
}
template <int = 0>
__global__ void scale_k(const float* x, float alpha, float* out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = alpha * x[i];
}
template <int = 0>
__global__ void bias_add_k(float_in x, float_in bias, float_out out, std::size_t n, std::size_t cols) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = x[i] + bias[i % cols];
}
// Sums over the rows, per column, of N terms `term(r, c, t)` (t[0..N) set by the call) into
// job.out[k][c] (or adds to it with `accumulate`; a null out[k] is skipped). A block of
// column_sum_threads threads owns 32 columns and one split of the rows (blockIdx.y): its 32 row
// lanes each walk every 32nd row of the split, a warp reading 32 adjacent values of one row, then
// lane partials are added in lane order. One thread per column walking all rows left most of the
// GPU idle (on an H200, layernorm's gain and bias sums over 8192 x 1024 took 3.4 ms, 14% of a GPT
// step), and so did one block per 32 columns walking all rows once rows far outnumber columns
// (16k x 2048: 64 blocks). So the rows are split too (column_sum_splits): each split's sums go
// to the device workspace and column_partials_k adds them in split order. Every addition's order
// is fixed, so results do not vary run to run; with one split (or no workspace) the sums are the
// one-level ones, in the same order.
inline constexpr int column_tile = 32;
inline constexpr int column_sum_threads = 1024; // column_tile columns x 32 row lanes
inline constexpr std::size_t column_sum_blocks = 512;     // about two waves of these blocks on an H100 or H200
inline constexpr std::size_t column_sum_min_rows = 256;   // per split: 8 rows per lane, below which a split costs more than it gains
template <int N>
struct column_sum_job {
  float_out out[N];
  bool accumulate = false;
  std::size_t rows = 0, cols = 0;
  std::size_t split_rows = 0; // rows per split, a multiple of 32
  float* partials = nullptr;  // [splits][N][cols] when there are several splits, else null
};
template <int N, class Term>
__device__ void column_sums(const column_sum_job<N>& job, Term term) {
  constexpr int lanes = column_sum_threads / column_tile;
  __shared__ float partial[N][lanes][column_tile + 1];
  const std::size_t tx = threadIdx.x % column_tile, lane = threadIdx.x / column_tile, cols = job.cols;
  const std::size_t first = std::size_t{blockIdx.y} * job.split_rows;
  const std::size_t end = first + job.split_rows < job.rows ? first + job.split_rows : job.rows;
  for (std::size_t c0 = std::size_t{blockIdx.x} * column_tile; c0 < cols; c0 += std::size_t{gridDim.x} * column_tile) {
    const std::size_t c = c0 + tx;
    float acc[N] = {};
    if (c < cols)
      for (std::size_t r = first + lane; r < end; r += lanes) {
        float t[N];
        term(r, c, t);
        for (int k = 0; k < N; ++k) acc[k] += t[k];
      }
    for (int k = 0; k < N; ++k) partial[k][lane][tx] = acc[k];
    __syncthreads();
    if (lane == 0 && c < cols)
      for (int k = 0; k < N; ++k) {
        float sum = 0.0f;
        for (int l = 0; l < lanes; ++l) sum += partial[k][l][tx];
        if (job.partials != nullptr) job.partials[(std::size_t{blockIdx.y} * N + k) * cols + c] = sum;
        else if (job.out[k]) job.out[k][c] = job.accumulate ? job.out[k][c] + sum : sum;
      }
    __syncthreads(); // partial is rewritten by the next tile
  }
}
// The second level: each column's split sums added in split order, one thread per (k, column).
template <int N>
__global__ void column_partials_k(column_sum_job<N> job, std::size_t splits) {
  CONCERTO_GRID_STRIDE(e, N * job.cols) {
    const std::size_t k = e / job.cols, c = e % job.cols;
    if (!job.out[k]) continue;
    float sum = 0.0f;
    for (std::size_t y = 0; y < splits; ++y) sum += job.partials[(y * N + k) * job.cols + c];
    job.out[k][c] = job.accumulate ? job.out[k][c] + sum : sum;
  }
}
inline unsigned column_grid(std::size_t cols) {
  const std::size_t tiles = (cols + column_tile - 1) / column_tile;
  return static_cast<unsigned>(tiles < 1 ? 1 : tiles > 65535 ? 65535 : tiles);
}
// Row splits of a column sum: enough blocks to fill the GPU, none under column_sum_min_rows rows.
inline std::size_t column_sum_splits(std::size_t rows, std::size_t cols) {
  const std::size_t wanted = (column_sum_blocks + column_grid(cols) - 1) / column_grid(cols);
  const std::size_t most = rows / column_sum_min_rows;
  const std::size_t splits = wanted < most ? wanted : most;
  return splits < 1 ? 1 : splits > 65535 ? 65535 : splits;
}
// Launches a column-sum kernel (its leading arguments, then the job) and, with several splits,
// the second level; without a workspace the sums are one level.
template <int N, class... Params, class... Args>
void launch_column_sums(void (*kernel)(Params...), column_sum_job<N> job, float* workspace, cudaStream_t s,
                        const char* name, Args... args) {
  if (job.cols == 0) return;
  const std::size_t splits = workspace == nullptr ? 1 : column_sum_splits(job.rows, job.cols);
  const std::size_t per_split = (job.rows + splits - 1) / splits;
  job.split_rows = splits == 1 ? (job.rows > 0 ? job.rows : 1) : (per_split + 31) / 32 * 32;
  job.partials = splits == 1 ? nullptr : workspace;
  const dim3 grid(column_grid(job.cols), static_cast<unsigned>(splits));
  CONCERTO_CUDA_LAUNCH(grid, column_sum_threads, 0, s, kernel)(args..., job);
  launched(name);
  if (splits == 1) return;
  CONCERTO_CUDA_LAUNCH(grid_for(N * job.cols), block, 0, s, column_partials_k<N>)(job, splits);
  launched(name);
}
template <int = 0>
__global__ void column_sum_k(float_in x, column_sum_job<1> job) {
  const std::size_t cols = job.cols;
  column_sums(job, [&](std::size_t r, std::size_t c, float (&t)[1]) { t[0] = x[r * cols + c]; });
}
// dtable[c] (+)= Σ_r x[r, c]·dout[r, c], the column sums of a product.
template <int = 0>
__global__ void scale_table_grad_k(const float* x, const float* dout, column_sum_job<1> job) {
  const std::size_t cols = job.cols;
  column_sums(job, [&](std::size_t r, std::size_t c, float (&t)[1]) { t[0] = x[r * cols + c] * dout[r * cols + c]; });
}
template <int = 0>
__global__ void scale_table_k(const float* x, const float* table, float* out, std::size_t n, std::size_t cols) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = x[i] * table[i % cols];
}
template <ir::dtype From, ir::dtype To>
__global__ void convert_k(const void* x, void* out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) { store_f32<To>(out, i, load_f32<From>(x, i)); }
}
template <int = 0>
__global__ void gelu_k(float_in x, float_out out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) {
    const float v = x[i];
    out[i] = 0.5f * v * (1.0f + tanhf(gelu_k0 * (v + gelu_k1 * v * v * v)));
  }
}
template <int = 0>
__global__ void gelu_grad_k(float_in x, float_in dout, float_out dx, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) {
    const float v = x[i];
    const float t = tanhf(gelu_k0 * (v + gelu_k1 * v * v * v));
    const float dinner = gelu_k0 * (1.0f + 3.0f * gelu_k1 * v * v);
    dx[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dinner);
  }
}
template <int = 0>
__global__ void relu_k(const float* x, float* out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
template <int = 0>
__global__ void relu_grad_k(const float* x, const float* dout, float* dx, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) dx[i] = x[i] > 0.0f ? dout[i] : 0.0f;
}

// ---- row-wise -------------------------------------------------------------------------------
// One block's row: its mean and 1/sqrt(biased variance + eps), as cpu::layernorm computes them;
// every thread gets both.
struct moments {
  float mean, rstd;
};
__device__ inline moments row_moments(float_in px, std::size_t cols, float eps, float* red) {
  float s = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) s += px[c];
  const float mu = block_reduce(s, sum_op{}, red) / static_cast<float>(cols);
  float sq = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = px[c] - mu;
    sq += d * d;
  }
  return {mu, rsqrtf(block_reduce(sq, sum_op{}, red) / static_cast<float>(cols) + eps)};
}
template <int = 0>
__global__ void layernorm_k(float_in x, float_in gamma, float_in beta, float_out out, float* mean, float* rstd,
                            std::size_t cols, float eps) {
  __shared__ float red[32];
  const std::size_t r = blockIdx.x;
  const float_in px = x + r * cols;
  const float_out po = out + r * cols;
  const auto [mu, rs] = row_moments(px, cols, eps, red);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) po[c] = (px[c] - mu) * rs * gamma[c] + beta[c];
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}
template <int = 0>
__global__ void layernorm_dx_k(float_in dout, float_in x, float_in gamma, const float* mean, const float* rstd,
                               float_out dx, std::size_t cols) {
  __shared__ float red[32];
  const std::size_t r = blockIdx.x;
  const float_in pg = dout + r * cols;
  const float_in px = x + r * cols;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0.0f, sgx = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = pg[c] * gamma[c];
    sg += g;
    sgx += g * (px[c] - mu) * rs;
  }
  const float mg = block_reduce(sg, sum_op{}, red) / static_cast<float>(cols);
  const float mgx = block_reduce(sgx, sum_op{}, red) / static_cast<float>(cols);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (px[c] - mu) * rs;
    dx[r * cols + c] = rs * (pg[c] * gamma[c] - mg - xhat * mgx);
  }
}
template <int = 0>
__global__ void layernorm_dparams_k(float_in dout, float_in x, const float* mean, const float* rstd, column_sum_job<2> job) {
  const std::size_t cols = job.cols;
  column_sums(job, [&](std::size_t r, std::size_t c, float (&t)[2]) {
    const float d = dout[r * cols + c];
    t[0] = d * (x[r * cols + c] - mean[r]) * rstd[r];
    t[1] = d;
  });
}
template <int = 0>
__global__ void softmax_k(float_in x, float_out out, std::size_t cols) {
  __shared__ float red[32];
  const float_in px = x + blockIdx.x * cols;
  const float_out po = out + blockIdx.x * cols;
  float m = -INFINITY;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, px[c]);
  m = block_reduce(m, max_op{}, red);
  float s = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(px[c] - m);
  const float inv = 1.0f / block_reduce(s, sum_op{}, red);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) po[c] = expf(px[c] - m) * inv;
}
template <int = 0>
__global__ void softmax_grad_k(float_in y, float_in dy, float_out dx, std::size_t cols) {
  __shared__ float red[32];
  const std::size_t off = blockIdx.x * cols;
  float dot = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) dot += dy[off + c] * y[off + c];
  dot = block_reduce(dot, sum_op{}, red);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) dx[off + c] = y[off + c] * (dy[off + c] - dot);
}

// ---- attention, tiled: no row of scores is ever held whole ---------------------------------
// Layout as the CPU kernel: q, out [batch, seq, heads·head_dim]; k, v [batch, seq, kv_heads·head_dim]
// (grouped-query attention: q head h reads kv head kv_of(h)); lse [batch, heads, seq].
// A block owns `Rows` rows, 4 threads a row (a quad of one warp), and walks the other side in
// tiles of `Tile` rows that it stages in shared memory beside its own; the forward's softmax is
// online (a running maximum and sum, the earlier tiles' output rescaled when the maximum grows:
// FlashAttention's recurrence), so any sequence length fits and K and V are read once per block
// of query rows, not once per row. Staged rows have a pitch of head_dim + 1 floats, so the rows
// the quads of a warp read at once fall in different banks. Forward and dq: grid (query tiles,
// batch·heads); dk and dv: grid (key tiles, batch·kv_heads), each key row summing every q head of
// its group on this rank. The backward is FlashAttention-2's without atomics: dq over key tiles,
// dk and dv over query tiles, both from P = exp(S − lse) and dS = P ∘ (dP − delta), delta =
// rowsum(dout ∘ out): deterministic.
struct attention_dims {
  std::size_t seq, heads, kv_heads, head_dim, group, first_head, kv_first_head;
  float scale;
  bool causal;
  __device__ bool sees(std::size_t i, std::size_t j) const { return i < seq && j < seq && (!causal || j <= i); } // as cpu::attention_shape
  __device__ std::size_t ld() const { return heads * head_dim; }
  __device__ std::size_t ld_kv() const { return kv_heads * head_dim; }
  __device__ std::size_t kv_of(std::size_t h) const { return (first_head + h) / group - kv_first_head; }
  // Offsets of row 0 of q head h / kv head g of sequence b.
  __device__ std::size_t q_base(std::size_t b, std::size_t h) const { return b * seq * ld() + h * head_dim; }
  __device__ std::size_t kv_base(std::size_t b, std::size_t g) const { return b * seq * ld_kv() + g * head_dim; }
};

// The four lanes of a row's quad agree on a maximum or a sum.
__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Rows [first, first + n) of a head (row r at src + r·ld) into shared rows of pitch D + 1; rows
// past `limit` are zeros.
__device__ inline void stage_rows(float* dst, float_in src, std::size_t first, std::size_t n, std::size_t limit,
                                  std::size_t ld, std::size_t D) {
  for (std::size_t e = threadIdx.x; e < n * D; e += blockDim.x) {
    const std::size_t r = e / D, d = e % D;
    dst[r * (D + 1) + d] = first + r < limit ? src[(first + r) * ld + d] : 0.0f;
  }
}
template <class A, class B> // float* (staged rows) or float_in
__device__ float dot_rows(A a, B b, std::size_t n) {
  float s = 0.0f;
  for (std::size_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// A block of query rows (forward, dq): its sequence and q head, where the head's rows and its kv
// head's start, its first row, and this thread's row and lane in the row's quad.
struct query_block {
  std::size_t bh, base, kv_base, first, row, lane, i;
  __device__ query_block(const attention_dims& a, std::size_t rows)
      : bh(blockIdx.y), base(a.q_base(bh / a.heads, bh % a.heads)), kv_base(a.kv_base(bh / a.heads, a.kv_of(bh % a.heads))),
        first(std::size_t{blockIdx.x} * rows), row(threadIdx.x / 4), lane(threadIdx.x % 4), i(first + row) {}
};

template <int MaxD, int Rows, int Tile>
__global__ void attention_k(float_in q, float_in k, float_in v, float_out out, float* lse, attention_dims a) {
  static_assert(Tile % 4 == 0 && MaxD % 4 == 0);
  CONCERTO_CUDA_DYNAMIC_SHARED(float, sh);
  const std::size_t D = a.head_dim, pitch = D + 1, T = a.seq;
  float* qs = sh;
  float* ks = qs + Rows * pitch;
  float* vs = ks + Tile * pitch;
  float* ps = vs + Tile * pitch; // [Rows][Tile + 1]
  const query_block blk(a, Rows);
  const std::size_t bh = blk.bh, base = blk.base, kvb = blk.kv_base, i0 = blk.first, r = blk.row, lane = blk.lane, i = blk.i;
  stage_rows(qs, q + base, i0, Rows, T, a.ld(), D);
  float o[MaxD / 4] = {};
  float m = -INFINITY, l = 0.0f;
  const std::size_t key_end = a.causal && i0 + Rows < T ? i0 + Rows : T;
  for (std::size_t j0 = 0; j0 < key_end; j0 += Tile) {
    __syncthreads(); // the previous tile is read (and, the first time, q is staged)
    stage_rows(ks, k + kvb, j0, Tile, T, a.ld_kv(), D);
    stage_rows(vs, v + kvb, j0, Tile, T, a.ld_kv(), D);
    __syncthreads();
    float s[Tile / 4];
    float tile_max = -INFINITY;
    for (int t = 0; t < Tile / 4; ++t) {
      const std::size_t c = lane + 4 * static_cast<std::size_t>(t);
      s[t] = a.sees(i, j0 + c) ? a.scale * dot_rows(qs + r * pitch, ks + c * pitch, D) : -INFINITY;
      tile_max = fmaxf(tile_max, s[t]);
    }
    const float m_new = fmaxf(m, quad_max(tile_max));
    // A row that has seen no key yet keeps m = -inf: nothing to rescale, every p is 0.
    const float rescale = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int t = 0; t < Tile / 4; ++t) {
      const float p = s[t] == -INFINITY ? 0.0f : expf(s[t] - m_new);
      ps[r * (Tile + 1) + lane + 4 * static_cast<std::size_t>(t)] = p;
      sum += p;
    }
    l = l * rescale + quad_sum(sum);
    m = m_new;
    __syncthreads(); // the quad's p are published
    for (int t = 0; t < MaxD / 4; ++t) {
      const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
      if (d >= D) break;
      float acc = 0.0f;
      for (int c = 0; c < Tile; ++c) acc += ps[r * (Tile + 1) + c] * vs[c * pitch + d];
      o[t] = o[t] * rescale + acc;
    }
  }
  if (i >= T) return;
  const float inv = 1.0f / l; // l > 0: every row sees at least key 0
  for (int t = 0; t < MaxD / 4; ++t) {
    const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
    if (d >= D) break;
    out[base + i * a.ld() + d] = o[t] * inv;
  }
  if (lane == 0) lse[bh * T + i] = m + logf(l);
}

// delta_i = Σ_d dout[i, d]·out[i, d] for every (sequence, q head, row), one thread per row.
template <int = 0>
__global__ void attention_delta_k(float_in out, float_in dout, float* delta, attention_dims a, std::size_t rows) {
  for (std::size_t e = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; e < rows; e += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t i = e % a.seq, bh = e / a.seq, at = a.q_base(bh / a.heads, bh % a.heads) + i * a.ld();
    delta[e] = dot_rows(out + at, dout + at, a.head_dim);
  }
}

// dq for a block of query rows, over key tiles.
template <int MaxD, int Rows, int Tile>
__global__ void attention_dq_k(float_in q, float_in k, float_in v, float_in dout, const float* lse, const float* delta,
                               float_out dq, attention_dims a) {
  CONCERTO_CUDA_DYNAMIC_SHARED(float, sh);
  const std::size_t D = a.head_dim, pitch = D + 1, T = a.seq;
  float* qs = sh;
  float* gs = qs + Rows * pitch;
  float* ks = gs + Rows * pitch;
  float* vs = ks + Tile * pitch;
  float* ds = vs + Tile * pitch; // [Rows][Tile + 1]
  const query_block blk(a, Rows);
  const std::size_t bh = blk.bh, base = blk.base, kvb = blk.kv_base, i0 = blk.first, r = blk.row, lane = blk.lane, i = blk.i;
  stage_rows(qs, q + base, i0, Rows, T, a.ld(), D);
  stage_rows(gs, dout + base, i0, Rows, T, a.ld(), D);
  const float li = i < T ? lse[bh * T + i] : 0.0f, di = i < T ? delta[bh * T + i] : 0.0f;
  float acc[MaxD / 4] = {};
  const std::size_t key_end = a.causal && i0 + Rows < T ? i0 + Rows : T;
  for (std::size_t j0 = 0; j0 < key_end; j0 += Tile) {
    __syncthreads();
    stage_rows(ks, k + kvb, j0, Tile, T, a.ld_kv(), D);
    stage_rows(vs, v + kvb, j0, Tile, T, a.ld_kv(), D);
    __syncthreads();
    for (int t = 0; t < Tile / 4; ++t) {
      const std::size_t c = lane + 4 * static_cast<std::size_t>(t);
      float g = 0.0f;
      if (a.sees(i, j0 + c)) {
        const float p = expf(a.scale * dot_rows(qs + r * pitch, ks + c * pitch, D) - li);
        g = p * (dot_rows(gs + r * pitch, vs + c * pitch, D) - di);
      }
      ds[r * (Tile + 1) + c] = g;
    }
    __syncthreads();
    for (int t = 0; t < MaxD / 4; ++t) {
      const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
      if (d >= D) break;
      float sum = 0.0f;
      for (int c = 0; c < Tile; ++c) sum += ds[r * (Tile + 1) + c] * ks[c * pitch + d];
      acc[t] += sum;
    }
  }
  if (i >= T) return;
  for (int t = 0; t < MaxD / 4; ++t) {
    const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
    if (d >= D) break;
    dq[base + i * a.ld() + d] = a.scale * acc[t];
  }
}

// dk and dv for a block of key rows of one kv head, over the query tiles of every q head of its
// group on this rank (none: zeros, a partial sum another rank completes).
template <int MaxD, int Rows, int Tile>
__global__ void attention_dkv_k(float_in q, float_in k, float_in v, float_in dout, const float* lse, const float* delta,
                                float_out dk, float_out dv, attention_dims a) {
  CONCERTO_CUDA_DYNAMIC_SHARED(float, sh);
  const std::size_t D = a.head_dim, pitch = D + 1, T = a.seq;
  float* ks = sh;
  float* vs = ks + Rows * pitch;
  float* qs = vs + Rows * pitch;
  float* gs = qs + Tile * pitch;
  float* ps = gs + Tile * pitch;      // [Rows][Tile + 1]
  float* ds = ps + Rows * (Tile + 1); // [Rows][Tile + 1]
  const std::size_t bg = blockIdx.y, b = bg / a.kv_heads, g = bg % a.kv_heads, kvb = a.kv_base(b, g);
  const std::size_t j0 = std::size_t{blockIdx.x} * Rows, r = threadIdx.x / 4, lane = threadIdx.x % 4, j = j0 + r;
  stage_rows(ks, k + kvb, j0, Rows, T, a.ld_kv(), D);
  stage_rows(vs, v + kvb, j0, Rows, T, a.ld_kv(), D);
  float acc_k[MaxD / 4] = {}, acc_v[MaxD / 4] = {};
  // The q heads of this kv head: a contiguous range, kv_of being monotonic.
  const std::size_t global_first = (g + a.kv_first_head) * a.group;
  const std::size_t h_lo = global_first > a.first_head ? global_first - a.first_head : 0;
  const std::size_t h_end = global_first + a.group > a.first_head ? global_first + a.group - a.first_head : 0;
  const std::size_t h_hi = h_end < a.heads ? h_end : a.heads;
  const std::size_t query_start = a.causal ? j0 / Tile * Tile : 0; // causal: no query before j0 sees these keys
  for (std::size_t h = h_lo; h < h_hi; ++h) {
    const std::size_t base = a.q_base(b, h), row = (b * a.heads + h) * T;
    for (std::size_t i0 = query_start; i0 < T; i0 += Tile) {
      __syncthreads();
      stage_rows(qs, q + base, i0, Tile, T, a.ld(), D);
      stage_rows(gs, dout + base, i0, Tile, T, a.ld(), D);
      __syncthreads();
      for (int t = 0; t < Tile / 4; ++t) {
        const std::size_t c = lane + 4 * static_cast<std::size_t>(t), i = i0 + c;
        float p = 0.0f, gr = 0.0f;
        if (a.sees(i, j)) {
          p = expf(a.scale * dot_rows(qs + c * pitch, ks + r * pitch, D) - lse[row + i]);
          gr = p * (dot_rows(gs + c * pitch, vs + r * pitch, D) - delta[row + i]);
        }
        ps[r * (Tile + 1) + c] = p;
        ds[r * (Tile + 1) + c] = gr;
      }
      __syncthreads();
      for (int t = 0; t < MaxD / 4; ++t) {
        const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
        if (d >= D) break;
        float sv = 0.0f, sk = 0.0f;
        for (int c = 0; c < Tile; ++c) {
          sv += ps[r * (Tile + 1) + c] * gs[c * pitch + d];
          sk += ds[r * (Tile + 1) + c] * qs[c * pitch + d];
        }
        acc_v[t] += sv;
        acc_k[t] += sk;
      }
    }
  }
  if (j >= T) return;
  for (int t = 0; t < MaxD / 4; ++t) {
    const std::size_t d = lane + 4 * static_cast<std::size_t>(t);
    if (d >= D) break;
    dv[kvb + j * a.ld_kv() + d] = acc_v[t];
    dk[kvb + j * a.ld_kv() + d] = a.scale * acc_k[t];
  }
}

// ---- losses ---------------------------------------------------------------------------------
template <int = 0>
__global__ void cross_entropy_rows_k(float_in logits, const std::int32_t* targets, float* lse, std::size_t classes,
                                     int* status, int code) {
  __shared__ float red[32];
  const float_in pl = logits + blockIdx.x * classes;
  float m = -INFINITY;
  for (std::size_t c = threadIdx.x; c < classes; c += blockDim.x) m = fmaxf(m, pl[c]);
  m = block_reduce(m, max_op{}, red);
  float s = 0.0f;
  for (std::size_t c = threadIdx.x; c < classes; c += blockDim.x) s += expf(pl[c] - m);
  s = block_reduce(s, sum_op{}, red);
  if (threadIdx.x == 0) {
    lse[blockIdx.x] = m + logf(s);
    const auto t = targets[blockIdx.x];
    if (t < 0 || static_cast<std::size_t>(t) >= classes) flag(status, code);
  }
}
// One block: the mean over rows in double, as the CPU kernel sums.
template <int = 0>
__global__ void cross_entropy_mean_k(float_in logits, const std::int32_t* targets, const float* lse, float_out loss,
                                     std::size_t rows, std::size_t classes, float share) {
  __shared__ double red[32];
  double s = 0.0;
  for (std::size_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const auto t = targets[r];
    if (t < 0 || static_cast<std::size_t>(t) >= classes) continue;
    s += static_cast<double>(lse[r]) - static_cast<double>(logits[r * classes + static_cast<std::size_t>(t)]);
  }
  s = block_reduce(s, sum_op{}, red);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(s / static_cast<double>(rows)) * share;
}
template <int = 0>
__global__ void cross_entropy_grad_k(float_in logits, const std::int32_t* targets, const float* lse, float_out dlogits,
                                     std::size_t rows, std::size_t classes, float share, const float* loss_scale) {
  const float s = loss_gradient_factor(share, loss_scale);
  CONCERTO_GRID_STRIDE(i, rows * classes) {
    const std::size_t r = i / classes, c = i % classes;
    const float g = s * expf(logits[i] - lse[r]);
    dlogits[i] = static_cast<std::size_t>(targets[r]) == c ? g - s : g;
  }
}
template <int = 0>
__global__ void mse_k(const float* pred, const float* target, float* loss, std::size_t n, float share) {
  __shared__ double red[32];
  double s = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double d = static_cast<double>(pred[i]) - static_cast<double>(target[i]);
    s += d * d;
  }
  s = block_reduce(s, sum_op{}, red);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(s / static_cast<double>(n)) * share;
}
template <int = 0>
__global__ void mse_grad_k(const float* pred, const float* target, float* dpred, std::size_t n, float share,
                           const float* loss_scale) {
  const float s = loss_gradient_factor(share, loss_scale);
  CONCERTO_GRID_STRIDE(i, n) dpred[i] = s * (pred[i] - target[i]);
}

// ---- embedding ------------------------------------------------------------------------------
template <int = 0>
__global__ void embedding_k(const std::int32_t* ids, float_in table, float_out out, std::size_t n, std::size_t dim,
                            std::int64_t first_row, std::size_t rows, bool reject, int* status, int code) {
  CONCERTO_GRID_STRIDE(i, n * dim) {
    const std::int64_t r = static_cast<std::int64_t>(ids[i / dim]) - first_row;
    if (r < 0 || r >= static_cast<std::int64_t>(rows)) {
      out[i] = 0.0f;
      if (reject) flag(status, code);
    } else {
      out[i] = table[static_cast<std::size_t>(r) * dim + i % dim];
    }
  }
}
// The embedding's gradient without atomics on the table: a counting sort of the token positions
// by row (a histogram, its exclusive scan, a stable placement), then one thread per (row, column)
// adding its row's tokens in token order. Atomic adds per value serialised on a popular row (a
// frequent token, padding) and summed in whatever order they landed; in token order the sums are
// the CPU kernel's, bit for bit, run after run. The histogram's atomics count integers: any order
// gives the same counts. Workspace (as int32): offsets [rows + 1], cursors [rows], order [n].
__device__ inline std::int64_t table_row(std::int32_t id, std::int64_t first_row, std::size_t rows) {
  const std::int64_t r = static_cast<std::int64_t>(id) - first_row;
  return r >= 0 && r < static_cast<std::int64_t>(rows) ? r : -1;
}
template <int = 0>
__global__ void embedding_count_k(const std::int32_t* ids, std::int32_t* counts, std::size_t n, std::int64_t first_row,
                                  std::size_t rows, bool reject, int* status, int code) {
  CONCERTO_GRID_STRIDE(i, n) {
    const std::int64_t r = table_row(ids[i], first_row, rows);
    if (r >= 0) atomicAdd(counts + r, 1);
    else if (reject) flag(status, code);
  }
}
// One block: offsets[i] = Σ_{j<i} counts[j] (offsets[n] the total), and the cursors start there.
// Each thread scans a contiguous run; thread 0 scans the runs' totals.
template <int = 0>
__global__ void exclusive_scan_k(const std::int32_t* counts, std::int32_t* offsets, std::int32_t* cursors, std::size_t n) {
  __shared__ std::int32_t run_start[block];
  const std::size_t per = (n + blockDim.x - 1) / blockDim.x, begin = threadIdx.x * per;
  const std::size_t end = begin + per < n ? begin + per : n;
  std::int32_t total = 0;
  for (std::size_t i = begin; i < end; ++i) total += counts[i];
  run_start[threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int32_t sum = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const std::int32_t v = run_start[t];
      run_start[t] = sum;
      sum += v;
    }
    offsets[n] = sum;
  }
  __syncthreads();
  std::int32_t at = run_start[threadIdx.x];
  for (std::size_t i = begin; i < end; ++i) {
    const std::int32_t count = counts[i]; // counts may be the cursors: read before written
    offsets[i] = at;
    cursors[i] = at;
    at += count;
  }
}
// One block places the tokens chunk by chunk in token order: a token's slot is its row's cursor
// plus the earlier tokens of its row in the chunk, and the row's last token in the chunk moves
// the cursor on. Each thread compares its id with the chunk's: n steps in all, no atomics.
template <int = 0>
__global__ void embedding_place_k(const std::int32_t* ids, std::int32_t* cursors, std::int32_t* order, std::size_t n,
                                  std::int64_t first_row, std::size_t rows) {
  __shared__ std::int64_t chunk[block];
  for (std::size_t base = 0; base < n; base += blockDim.x) {
    const std::size_t i = base + threadIdx.x;
    const std::int64_t r = i < n ? table_row(ids[i], first_row, rows) : -1;
    chunk[threadIdx.x] = r;
    __syncthreads();
    std::int32_t earlier = 0;
    bool last = true;
    if (r >= 0) {
      for (unsigned t = 0; t < blockDim.x; ++t)
        if (chunk[t] == r) {
          if (t < threadIdx.x) ++earlier;
          else if (t > threadIdx.x) last = false;
        }
      order[cursors[r] + earlier] = static_cast<std::int32_t>(i);
    }
    __syncthreads(); // every token of the chunk has read its cursor
    if (r >= 0 && last) cursors[r] += earlier + 1;
    __syncthreads(); // the cursors and the chunk are the next chunk's
  }
}
// dtable[r, c] (+)= Σ dout[i, c] over row r's tokens i in token order; grid (rows, column blocks).
template <int = 0>
__global__ void embedding_rows_k(const std::int32_t* offsets, const std::int32_t* order, float_in dout, float_out dtable,
                                 std::size_t dim, bool accumulate) {
  const std::size_t r = blockIdx.x, c = std::size_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (c >= dim) return;
  const std::int32_t begin = offsets[r], end = offsets[r + 1];
  if (accumulate && begin == end) return;
  float acc = accumulate ? static_cast<float>(dtable[r * dim + c]) : 0.0f;
  for (std::int32_t k = begin; k < end; ++k) acc += dout[static_cast<std::size_t>(order[k]) * dim + c];
  dtable[r * dim + c] = acc;
}

// ---- optimizers -----------------------------------------------------------------------------
// The step (and with it the scheduled rate), the squared gradient norm and the loss scale are
// read from device memory, so that a captured CUDA graph replays with the current ones. The gradient's factor is runtime::update_factor.
// A skipped (overflowed) update still writes the working copy, from the master it left alone:
// under ZeRO-1/2 the copy is the shard the gather then moves into the parameter, and nothing
// else fills it (runtime/dispatch.hpp's write_working_copy, the CPU's).
template <ir::dtype W>
__device__ void store_working_copy(const float* p, void* working, std::size_t n) {
  if constexpr (W != ir::dtype::f32) CONCERTO_GRID_STRIDE(i, n) store_f32<W>(working, i, p[i]);
}
// W: the type of the parameter's working copy the update also writes (ir/precision.hpp), f32 for none.
template <ir::dtype W = ir::dtype::f32>
__global__ void sgd_k(float* p, const float* g, float* buf, std::size_t n, cpu::sgd_config cfg, lr_schedule schedule,
                      const std::int64_t* step, const float* norm_sq, float max_norm, const float* loss_scale, void* working) {
  float scale;
  if (!update_factor(norm_sq, loss_scale, max_norm, scale)) return store_working_copy<W>(p, working, n);
  const float lr = lr_at(schedule, cfg.lr, *step), momentum = cfg.momentum, wd = cfg.weight_decay;
  CONCERTO_GRID_STRIDE(i, n) {
    const float gi = g[i] * scale + wd * p[i];
    if (buf == nullptr) {
      p[i] -= lr * gi;
    } else {
      buf[i] = momentum * buf[i] + gi;
      p[i] -= lr * buf[i];
    }
    if constexpr (W != ir::dtype::f32) store_f32<W>(working, i, p[i]);
  }
}
template <ir::dtype W = ir::dtype::f32>
__global__ void adamw_k(float* p, const float* g, float* m, float* v, std::size_t n, cpu::adamw_config cfg,
                        lr_schedule schedule, const std::int64_t* step, const float* norm_sq, float max_norm,
                        const float* loss_scale, void* working) {
  float scale;
  if (!update_factor(norm_sq, loss_scale, max_norm, scale)) return store_working_copy<W>(p, working, n);
  cfg.lr = lr_at(schedule, cfg.lr, *step);
  const double t = static_cast<double>(*step);
  const double bc1 = 1.0 - pow(static_cast<double>(cfg.beta1), t);
  const double bc2 = 1.0 - pow(static_cast<double>(cfg.beta2), t);
  const float step_size = static_cast<float>(static_cast<double>(cfg.lr) / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / sqrt(bc2));
  const float decay = 1.0f - cfg.lr * cfg.weight_decay;
  CONCERTO_GRID_STRIDE(i, n) {
    const float gi = g[i] * scale;
    m[i] = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * gi;
    v[i] = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * gi * gi;
    p[i] = p[i] * decay - step_size * m[i] / (sqrtf(v[i]) * inv_sqrt_bc2 + cfg.eps);
    if constexpr (W != ir::dtype::f32) store_f32<W>(working, i, p[i]);
  }
}

// Calls launch.template operator()<W>() with the working copy's type as W (f32: no copy).
template <class Launch>
void with_working_type(const working_copy& w, const char* kernel, Launch&& launch) {
  if (w.values == nullptr) return launch.template operator()<ir::dtype::f32>();
  if (w.type == ir::dtype::bf16) return launch.template operator()<ir::dtype::bf16>();
  if (w.type == ir::dtype::f16) return launch.template operator()<ir::dtype::f16>();
  fail(std::string(kernel) + ": a working copy holds bf16 or f16, not " + std::string(ir::to_string(w.type)));
}

// One block: Σ x² in double (as cpu::sum_of_squares), over a fixed order of additions, so the
// norm does not vary run to run; divided by the ranks holding the same values.
template <int = 0>
__global__ void grad_sq_norm_k(const float* x, std::size_t n, double replicas, float* out) {
  __shared__ double red[32];
  double sum = 0;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  sum = block_reduce(sum, sum_op{}, red);
  if (threadIdx.x == 0) *out = static_cast<float>(sum / replicas);
}

// ---- the DSL's forms and the vocabulary-parallel cross-entropy -------------------------------
// i64 ids narrowed to i32 for the kernels above; a value outside 32 bits is skipped and flagged
// (the CPU dispatch throws), so it never aliases a valid id.
template <int = 0>
__global__ void narrow_ids_k(const std::int64_t* in, std::int32_t* out, std::size_t n, int* status, int code) {
  CONCERTO_GRID_STRIDE(i, n) {
    const std::int64_t v = in[i];
    if (v < INT32_MIN || v > INT32_MAX) {
      out[i] = INT32_MIN;
      flag(status, code);
    } else {
      out[i] = static_cast<std::int32_t>(v);
    }
  }
}
// Layernorm's row statistics alone (the DSL's backward recomputes them), as layernorm_k.
template <int = 0>
__global__ void row_stats_k(float_in x, float* mean, float* rstd, std::size_t cols, float eps) {
  __shared__ float red[32];
  const auto [mu, rs] = row_moments(x + blockIdx.x * cols, cols, eps, red);
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = rs;
  }
}
template <int = 0>
__global__ void row_max_k(const float* x, float* out, std::size_t cols) {
  __shared__ float red[32];
  const float* px = x + blockIdx.x * cols;
  float m = -INFINITY;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, px[c]);
  m = block_reduce(m, max_op{}, red);
  if (threadIdx.x == 0) out[blockIdx.x] = m;
}
template <int = 0>
__global__ void row_sumexp_k(const float* x, const float* mx, float* out, std::size_t cols) {
  __shared__ float red[32];
  const float* px = x + blockIdx.x * cols;
  const float m = mx[blockIdx.x];
  float s = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(px[c] - m);
  s = block_reduce(s, sum_op{}, red);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}
// The label's column in this rank's part [first, first + cols) of the vocabulary, or -1.
__device__ inline std::int64_t vocab_column(std::int32_t label, std::int64_t first, std::size_t cols) {
  const std::int64_t c = static_cast<std::int64_t>(label) - first;
  return c >= 0 && c < static_cast<std::int64_t>(cols) ? c : -1;
}
template <int = 0>
__global__ void vocab_target_k(const float* logits, const float* mx, const std::int32_t* labels, float* out,
                               std::size_t rows, std::size_t cols, std::int64_t first) {
  CONCERTO_GRID_STRIDE(r, rows) {
    const auto c = vocab_column(labels[r], first, cols);
    out[r] = c >= 0 ? logits[r * cols + static_cast<std::size_t>(c)] - mx[r] : 0.0f;
  }
}
template <int = 0>
__global__ void vocab_grad_k(const float* logits, const float* mx, const float* sumexp, const std::int32_t* labels,
                             float* out, std::size_t rows, std::size_t cols, std::int64_t first, float share,
                             const float* loss_scale) {
  const float scale = loss_gradient_factor(share, loss_scale);
  CONCERTO_GRID_STRIDE(i, rows * cols) {
    const std::size_t r = i / cols, c = i % cols;
    const float g = scale / sumexp[r] * expf(logits[i] - mx[r]);
    out[i] = vocab_column(labels[r], first, cols) == static_cast<std::int64_t>(c) ? g - scale : g;
  }
}
// One block: Σ_r log(sumexp_r) - target_r in double, over the global row count.
template <int = 0>
__global__ void vocab_loss_k(const float* sumexp, const float* target, float* loss, std::size_t rows, double global_rows) {
  __shared__ double red[32];
  double s = 0.0;
  for (std::size_t r = threadIdx.x; r < rows; r += blockDim.x)
    s += log(static_cast<double>(sumexp[r])) - static_cast<double>(target[r]);
  s = block_reduce(s, sum_op{}, red);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(s / global_rows);
}
// Between a tensor split along one dimension, [outer][parts][len] words, and the collectives'
// layout, [parts][outer][len] (part k contiguous). Word is the widest type the sizes allow.
template <class Word>
__global__ void restride_k(const Word* from, Word* to, std::size_t outer, std::size_t parts, std::size_t len,
                           bool to_blocks) {
  CONCERTO_GRID_STRIDE(i, outer * parts * len) {
    const std::size_t w = i % len, ko = i / len, o = ko % outer, k = ko / outer; // i indexes the blocks' layout
    const std::size_t whole = (o * parts + k) * len + w;
    if (to_blocks) to[i] = from[whole];
    else to[whole] = from[i];
  }
}

// ---- Llama's pointwise ops ---------------------------------------------------------------------
__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
template <int = 0>
__global__ void silu_k(float_in x, float_out out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = x[i] * sigmoid(x[i]);
}
template <int = 0>
__global__ void silu_grad_k(float_in x, float_in dout, float_out dx, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) {
    const float s = sigmoid(x[i]);
    dx[i] = dout[i] * s * (1.0f + x[i] * (1.0f - s));
  }
}
template <int = 0>
__global__ void sigmoid_k(const float* x, float* out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = sigmoid(x[i]);
}
template <int = 0>
__global__ void sigmoid_grad_k(const float* y, const float* dout, float* dx, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) dx[i] = dout[i] * y[i] * (1.0f - y[i]);
}
template <int = 0>
__global__ void tanh_k(const float* x, float* out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = tanhf(x[i]);
}
template <int = 0>
__global__ void tanh_grad_k(const float* y, const float* dout, float* dx, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) dx[i] = dout[i] * (1.0f - y[i] * y[i]);
}
// out[o, c, r, :] = x[o, r, c, :] over x [outer, rows, cols, inner], one thread per value.
template <int = 0>
__global__ void swap_dims_k(const float* x, float* out, std::size_t outer, std::size_t rows, std::size_t cols,
                            std::size_t inner) {
  const std::size_t block = rows * cols * inner;
  CONCERTO_GRID_STRIDE(i, outer * block) {
    const std::size_t o = i / block, e = i % inner, rc = i % block / inner, r = rc / cols, c = rc % cols;
    out[o * block + (c * rows + r) * inner + e] = x[i];
  }
}
template <int = 0>
__global__ void mul_k(float_in a, float_in b, float_out out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}
template <int = 0>
__global__ void swiglu_k(float_in gate, float_in up, float_out out, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}
template <int = 0>
__global__ void swiglu_grad_k(float_in gate, float_in up, float_in dout, float_out dgate, float_out dup, std::size_t n) {
  CONCERTO_GRID_STRIDE(i, n) {
    const float s = sigmoid(gate[i]);
    dgate[i] = dout[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
    dup[i] = dout[i] * gate[i] * s;
  }
}
// One thread per (row, pair); the angle in double, as cpu::rope.
template <int = 0>
__global__ void rope_k(const float* x, const std::int32_t* positions, float* out, std::size_t rows, std::size_t width,
                       std::size_t head_dim, double theta, double direction) {
  const std::size_t half = head_dim / 2, pairs = width / 2;
  CONCERTO_GRID_STRIDE(k, rows * pairs) {
    const std::size_t r = k / pairs, j = k % pairs, h = j / half, i = j % half;
    const double angle = static_cast<double>(positions[r]) *
                         pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(direction * sin(angle));
    const std::size_t lo = r * width + h * head_dim + i, hi = lo + half;
    const float a = x[lo], b = x[hi];
    out[lo] = a * c - b * s;
    out[hi] = b * c + a * s;
  }
}
// ---- RMSNorm ------------------------------------------------------------------------------------
__device__ inline float row_rstd(float_in px, std::size_t cols, float eps, float* red) {
  float sq = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) sq += px[c] * px[c];
  return rsqrtf(block_reduce(sq, sum_op{}, red) / static_cast<float>(cols) + eps);
}
template <int = 0>
__global__ void rmsnorm_k(float_in x, float_in gain, float_out out, float* rstd, std::size_t cols, float eps) {
  __shared__ float red[32];
  const std::size_t r = blockIdx.x;
  const float_in px = x + r * cols;
  const float rs = row_rstd(px, cols, eps, red);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] = px[c] * rs * gain[c];
  if (threadIdx.x == 0 && rstd != nullptr) rstd[r] = rs;
}
template <int = 0>
__global__ void rmsnorm_dx_k(float_in dout, float_in x, float_in gain, const float* rstd, float_out dx, std::size_t cols) {
  __shared__ float red[32];
  const std::size_t r = blockIdx.x;
  const float_in pg = dout + r * cols;
  const float_in px = x + r * cols;
  const float rs = rstd[r];
  float sgx = 0.0f;
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) sgx += pg[c] * gain[c] * px[c] * rs;
  const float mgx = block_reduce(sgx, sum_op{}, red) / static_cast<float>(cols);
  for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) dx[r * cols + c] = rs * (pg[c] * gain[c] - px[c] * rs * mgx);
}
template <int = 0>
__global__ void rmsnorm_dgain_k(float_in dout, float_in x, const float* rstd, column_sum_job<1> job) {
  const std::size_t cols = job.cols;
  column_sums(job, [&](std::size_t r, std::size_t c, float (&t)[1]) { t[0] = dout[r * cols + c] * x[r * cols + c] * rstd[r]; });
}
template <int = 0>
__global__ void rms_stats_k(float_in x, float* rstd, std::size_t cols, float eps) {
  __shared__ float red[32];
  const float rs = row_rstd(x + blockIdx.x * cols, cols, eps, red);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
}

// Batch normalisation (as the CPU kernels, runtime/cpu/normalization.hpp): the sums one thread
// per channel over the rows (neighbouring threads read neighbouring channels of a row), in double.
template <int = 0>
__global__ void batchnorm_stats_k(const float* x, float* sums, std::size_t rows, std::size_t cols) {
  CONCERTO_GRID_STRIDE(c, cols) {
    double s = 0.0, sq = 0.0;
    for (std::size_t r = 0; r < rows; ++r) {
      const double v = x[r * cols + c];
      s += v;
      sq += v * v;
    }
    sums[c] = static_cast<float>(s);
    sums[cols + c] = static_cast<float>(sq);
  }
}
template <int = 0>
__global__ void batchnorm_scale_k(const float* sums, const float* gamma, float* scale, std::size_t cols, std::size_t count,
                                  float eps, bool from_running) {
  CONCERTO_GRID_STRIDE(c, cols) {
    // From a batch's sums, or (evaluation) from the running mean and variance.
    const double n = from_running ? 1.0 : static_cast<double>(count);
    const double mean = static_cast<double>(sums[c]) / n;
    const double var = from_running ? fmax(static_cast<double>(sums[cols + c]), 0.0)
                                    : fmax(static_cast<double>(sums[cols + c]) / n - mean * mean, 0.0);
    const double rstd = 1.0 / sqrt(var + static_cast<double>(eps));
    scale[c] = static_cast<float>(mean);
    scale[cols + c] = static_cast<float>(rstd);
    scale[2 * cols + c] = static_cast<float>(rstd * gamma[c]);
  }
}
// The running statistics moved towards the batch's, as cpu::batchnorm_track; one thread per channel.
template <int = 0>
__global__ void batchnorm_track_k(const float* sums, float* running, std::size_t cols, std::size_t count, float momentum) {
  CONCERTO_GRID_STRIDE(c, cols) {
    const double n = static_cast<double>(count), m = static_cast<double>(momentum);
    const double mean = static_cast<double>(sums[c]) / n;
    const double var = fmax(static_cast<double>(sums[cols + c]) / n - mean * mean, 0.0) * (count > 1 ? n / (n - 1) : 1.0);
    running[c] = static_cast<float>((1 - m) * running[c] + m * mean);
    running[cols + c] = static_cast<float>((1 - m) * running[cols + c] + m * var);
  }
}
template <int = 0>
__global__ void batchnorm_k(const float* x, const float* scale, const float* beta, float* y, std::size_t rows, std::size_t cols) {
  CONCERTO_GRID_STRIDE(i, rows * cols) {
    const std::size_t c = i % cols;
    y[i] = (x[i] - scale[c]) * scale[2 * cols + c] + beta[c];
  }
}
template <int = 0>
__global__ void batchnorm_grad_stats_k(const float* x, const float* scale, const float* dy, float* sums, std::size_t rows,
                                       std::size_t cols) {
  CONCERTO_GRID_STRIDE(c, cols) {
    double s = 0.0, sx = 0.0;
    for (std::size_t r = 0; r < rows; ++r) {
      const float d = dy[r * cols + c];
      s += d;
      sx += static_cast<double>(d) * ((x[r * cols + c] - scale[c]) * scale[cols + c]);
    }
    sums[c] = static_cast<float>(s);
    sums[cols + c] = static_cast<float>(sx);
  }
}
template <int = 0>
__global__ void batchnorm_grad_k(const float* x, const float* scale, const float* sums, const float* dy, float* dx,
                                 std::size_t rows, std::size_t cols, float inv_count) {
  CONCERTO_GRID_STRIDE(i, rows * cols) {
    const std::size_t c = i % cols;
    const float xhat = (x[i] - scale[c]) * scale[cols + c];
    dx[i] = scale[2 * cols + c] * (dy[i] - sums[c] * inv_count - xhat * sums[cols + c] * inv_count);
  }
}

// out[o, i] = scale·Σ_e x[o, e, i], one thread per output value.
template <int = 0>
__global__ void sum_dim_k(const float* x, float* out, std::size_t outer, std::size_t extent, std::size_t inner, float scale) {
  CONCERTO_GRID_STRIDE(v, outer * inner) {
    const std::size_t o = v / inner, i = v % inner;
    float acc = 0.0f;
    for (std::size_t e = 0; e < extent; ++e) acc += x[(o * extent + e) * inner + i];
    out[v] = scale * acc;
  }
}
// dx[o, e, i] = scale·dout[o, i], one thread per value.
template <int = 0>
__global__ void sum_dim_grad_k(const float* dout, float* dx, std::size_t extent, std::size_t inner, std::size_t n, float scale) {
  CONCERTO_GRID_STRIDE(v, n) dx[v] = scale * dout[(v / (extent * inner)) * inner + v % inner];
}

// A convolution's geometry as the kernels read it (ir::conv_geometry is host code).
struct conv_dims {
  long long batch, height, width, in, out, kernel_h, kernel_w, stride, padding, out_h, out_w;
};
// Image value e's image, row, column and channel (NHWC).
struct pixel {
  long long n, h, col, c;
};
__device__ inline pixel pixel_at(std::size_t e, const conv_dims& d) {
  const long long pix = static_cast<long long>(e) / d.in;
  return {pix / (d.width * d.height), (pix / d.width) % d.height, pix % d.width, static_cast<long long>(e) % d.in};
}
// Whether pixel (h, col) is row i and column j of some output position's window, and which
// (oh, ow): a convolution's image gradient by tap, a pooling's gradient over every tap.
__device__ inline bool window_at_tap(const conv_dims& d, long long h, long long col, long long i, long long j, long long& oh,
                                     long long& ow) {
  const long long sh = h + d.padding - i, sw = col + d.padding - j;
  if (sh < 0 || sw < 0 || sh % d.stride != 0 || sw % d.stride != 0) return false;
  oh = sh / d.stride;
  ow = sw / d.stride;
  return oh < d.out_h && ow < d.out_w;
}
// Calls f(oh, ow) for each output position whose window holds pixel (h, col).
template <class F>
__device__ void windows_holding(const conv_dims& d, long long h, long long col, F&& f) {
  long long oh = 0, ow = 0;
  for (long long i = 0; i < d.kernel_h; ++i)
    for (long long j = 0; j < d.kernel_w; ++j)
      if (window_at_tap(d, h, col, i, j, oh, ow)) f(oh, ow);
}
// The convolutions as implicit GEMMs: C[m, n] (+)= Σ_k A(m, k) · B(k, n), C row-major [M, N], with
// A and B read through gathers so that no patch matrix is ever written. One block computes a
// 64 × 64 tile of C, 256 threads 4 × 4 values each, stepping through K 8 at a time with both
// operand tiles in shared memory; an element outside the image (padding) or the matrix is 0.
//   forward      y[(n, oh, ow), o]  = Σ_{(i, j, c)} x[n, oh·s − p + i, ow·s − p + j, c] · w[(i, j, c), o]
//   image grad   dx[(n, h, w), c]   = Σ_{(i, j, o)} dy[n, (h + p − i)/s, (w + p − j)/s, o] · w[i, j, c, o]
//   kernel grad  dw[(i, j, c), o]   = Σ_{(n, oh, ow)} x[n, oh·s − p + i, ow·s − p + j, c] · dy[(n, oh, ow), o]
inline constexpr int gemm_tile = 64, gemm_step = 8, gemm_threads = 256;

template <class A, class B>
__global__ void implicit_gemm_k(A a, B b, float* c, long long rows, long long cols, long long depth, bool accumulate) {
  __shared__ float as[gemm_step][gemm_tile];
  __shared__ float bs[gemm_step][gemm_tile];
  const int tx = static_cast<int>(threadIdx.x) % 16, ty = static_cast<int>(threadIdx.x) / 16;
  const long long m0 = static_cast<long long>(blockIdx.x) * gemm_tile, n0 = static_cast<long long>(blockIdx.y) * gemm_tile;
  float acc[4][4] = {};
  for (long long k0 = 0; k0 < depth; k0 += gemm_step) {
    for (int e = static_cast<int>(threadIdx.x); e < gemm_step * gemm_tile; e += gemm_threads) {
      // A along k (a pixel's channels are contiguous), B along n (a row of w or dy is).
      const int ak = e % gemm_step, am = e / gemm_step, bk = e / gemm_tile, bn = e % gemm_tile;
      as[ak][am] = m0 + am < rows && k0 + ak < depth ? a(m0 + am, k0 + ak) : 0.0f;
      bs[bk][bn] = k0 + bk < depth && n0 + bn < cols ? b(k0 + bk, n0 + bn) : 0.0f;
    }
    __syncthreads();
    for (int k = 0; k < gemm_step; ++k) {
      float ar[4], br[4];
      for (int i = 0; i < 4; ++i) ar[i] = as[k][ty + 16 * i];
      for (int j = 0; j < 4; ++j) br[j] = bs[k][tx + 16 * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] += ar[i] * br[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const long long m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m >= rows || n >= cols) continue;
      float& out = c[m * cols + n];
      out = accumulate ? out + acc[i][j] : acc[i][j];
    }
}

// x at output position m = (n, oh, ow) and patch entry k = (i, j, c): the forward's A.
struct patch_gather {
  const float* x;
  conv_dims d;
  __device__ float operator()(long long m, long long k) const {
    const long long ow = m % d.out_w, oh = (m / d.out_w) % d.out_h, n = m / (d.out_w * d.out_h);
    const long long c = k % d.in, j = (k / d.in) % d.kernel_w, i = k / (d.in * d.kernel_w);
    const long long h = oh * d.stride - d.padding + i, col = ow * d.stride - d.padding + j;
    return h < 0 || h >= d.height || col < 0 || col >= d.width ? 0.0f : x[((n * d.height + h) * d.width + col) * d.in + c];
  }
};
// The same values transposed: patch entry m = (i, j, c), output position k (the kernel gradient's A).
struct patch_gather_t {
  patch_gather g;
  __device__ float operator()(long long m, long long k) const { return g(k, m); }
};
// dy at pixel m = (n, h, w) for tap k = (i, j, o): the output position whose window holds the pixel at (i, j).
struct window_gather {
  const float* dy;
  conv_dims d;
  __device__ float operator()(long long m, long long k) const {
    const long long col = m % d.width, h = (m / d.width) % d.height, n = m / (d.width * d.height);
    const long long o = k % d.out, j = (k / d.out) % d.kernel_w, i = k / (d.out * d.kernel_w);
    long long oh = 0, ow = 0;
    return window_at_tap(d, h, col, i, j, oh, ow) ? dy[((n * d.out_h + oh) * d.out_w + ow) * d.out + o] : 0.0f;
  }
};
// A row-major [rows, cols] matrix (w as [patch, out], dy as [positions, out]).
struct matrix_read {
  const float* p;
  long long cols;
  __device__ float operator()(long long r, long long c) const { return p[r * cols + c]; }
};
// w[i, j, c, o] at k = (i, j, o), column c: the image gradient's B.
struct kernel_by_tap {
  const float* w;
  conv_dims d;
  __device__ float operator()(long long k, long long c) const {
    const long long o = k % d.out, tap = k / d.out;
    return w[(tap * d.in + c) * d.out + o];
  }
};
// Pooling over windows (conv_dims with kernel_h the window, in = out the channels). The first
// maximum in row-major window order wins, as in cpu::max_pool_grad; padding never does.
__device__ inline long long pool_first_max(const float* x, conv_dims d, long long n, long long oh, long long ow, long long c) {
  const long long top = oh * d.stride - d.padding, left = ow * d.stride - d.padding;
  float best = -INFINITY;
  long long where = -1;
  for (long long i = top < 0 ? 0 : top; i < top + d.kernel_h && i < d.height; ++i)
    for (long long j = left < 0 ? 0 : left; j < left + d.kernel_w && j < d.width; ++j) {
      const long long at = ((n * d.height + i) * d.width + j) * d.in + c;
      if (where < 0 || x[at] > best) best = x[at], where = at;
    }
  return where;
}
// y = the maximum (or the mean, by window²) of each window, one thread per output value.
template <int = 0>
__global__ void pool_k(const float* x, float* y, conv_dims d, bool average) {
  CONCERTO_GRID_STRIDE(e, static_cast<std::size_t>(d.batch * d.out_h * d.out_w * d.in)) {
    const long long c = static_cast<long long>(e) % d.in, pos = static_cast<long long>(e) / d.in;
    const long long ow = pos % d.out_w, oh = (pos / d.out_w) % d.out_h, n = pos / (d.out_w * d.out_h);
    if (!average) {
      y[e] = x[pool_first_max(x, d, n, oh, ow, c)];
      continue;
    }
    const long long top = oh * d.stride - d.padding, left = ow * d.stride - d.padding;
    float acc = 0.0f;
    for (long long i = top < 0 ? 0 : top; i < top + d.kernel_h && i < d.height; ++i)
      for (long long j = left < 0 ? 0 : left; j < left + d.kernel_w && j < d.width; ++j)
        acc += x[((n * d.height + i) * d.width + j) * d.in + c];
    y[e] = acc / static_cast<float>(d.kernel_h * d.kernel_w);
  }
}
// dx = the sum of dy over the windows holding the pixel (the mean's share of each, or the
// maximum's where the pixel is it), one thread per pixel value: no atomics.
template <int = 0>
__global__ void pool_grad_k(const float* x, const float* dy, float* dx, conv_dims d, bool average) {
  CONCERTO_GRID_STRIDE(e, static_cast<std::size_t>(d.batch * d.height * d.width * d.in)) {
    const auto [n, h, col, c] = pixel_at(e, d);
    float acc = 0.0f;
    windows_holding(d, h, col, [&](long long oh, long long ow) {
      if (average || pool_first_max(x, d, n, oh, ow, c) == static_cast<long long>(e))
        acc += dy[((n * d.out_h + oh) * d.out_w + ow) * d.in + c];
    });
    dx[e] = average ? acc / static_cast<float>(d.kernel_h * d.kernel_w) : acc;
  }
}
// The parts of one dim as the kernels read them (ir::dim_part is host code): the whole
// [lead, outer, extent, inner]; part k covers [offset[k], offset[k] + length[k]) (length 0: none),
// repeated[k] when it is a table of the whole's last dims (no lead).
struct part_dims {
  long long lead, outer, extent, inner, offset[2], length[2];
  bool repeated[2];
};
// The whole from its parts, zero where none lies (concat_dim, slice_dim_grad), one thread per value.
template <int = 0>
__global__ void assemble_k(const float* a, const float* b, float* whole, part_dims d) {
  CONCERTO_GRID_STRIDE(e, static_cast<std::size_t>(d.lead * d.outer * d.extent * d.inner)) {
    const long long i = static_cast<long long>(e) % d.inner, rest = static_cast<long long>(e) / d.inner;
    const long long pos = rest % d.extent, row = rest / d.extent, o = row % d.outer;
    float v = 0.0f;
    for (int k = 0; k < 2; ++k) {
      const long long at = pos - d.offset[k];
      if (at < 0 || at >= d.length[k]) continue;
      v = (k == 0 ? a : b)[((d.repeated[k] ? o : row) * d.length[k] + at) * d.inner + i];
    }
    whole[e] = v;
  }
}
// Part 0 out of the whole (slice_dim, concat_dim_grad), summed over lead when repeated, one thread per value.
template <int = 0>
__global__ void extract_k(const float* whole, float* part, part_dims d) {
  const long long rows = d.repeated[0] ? d.outer : d.lead * d.outer;
  CONCERTO_GRID_STRIDE(e, static_cast<std::size_t>(rows * d.length[0] * d.inner)) {
    const long long i = static_cast<long long>(e) % d.inner, rest = static_cast<long long>(e) / d.inner;
    const long long at = rest % d.length[0], row = rest / d.length[0];
    float v = 0.0f;
    for (long long l = 0; l < (d.repeated[0] ? d.lead : 1); ++l)
      v += whole[(((d.repeated[0] ? l * d.outer : 0) + row) * d.extent + d.offset[0] + at) * d.inner + i];
    part[e] = v;
  }
}
// y = x · the step's mask (runtime::dropout_layout), one thread per value; the step from device
// memory, so a captured graph replays with the current step's masks.
template <int = 0>
__global__ void dropout_k(const float* x, float* y, dropout_layout l, const std::int64_t* step, std::size_t n) {
  const std::int64_t s = *step;
  CONCERTO_GRID_STRIDE(e, n) y[e] = x[e] * l.factor(e, s);
}
inline conv_dims dims_of(const ir::conv_geometry& g) {
  return {g.batch, g.height, g.width, g.in_channels, g.out_channels, g.kernel_h, g.kernel_w, g.stride, g.padding, g.out_h(), g.out_w()};
}

#undef CONCERTO_GRID_STRIDE

inline attention_dims make_dims(const cpu::attention_shape& a) {
  return {a.seq, a.heads, a.kv(), a.head_dim, a.group, a.first_head, a.kv_first_head,
          1.0f / std::sqrt(static_cast<float>(a.head_dim)), a.causal};
}
inline dim3 attention_grid(std::size_t batch, std::size_t seq, std::size_t rows, std::size_t heads, const char* kernel) {
  CONCERTO_CHECK(batch * heads <= 65535, std::string(kernel) + ": batch·heads = " + std::to_string(batch * heads) + " exceeds the grid");
  return dim3(static_cast<unsigned>((seq + rows - 1) / rows), static_cast<unsigned>(batch * heads));
}
// Shared bytes of the tiled attention kernels for head_dim D: staged rows of pitch D + 1 (own
// rows and a tile of the other side; dq and dk/dv stage two of each) and the tile's p (dk/dv: p and dS).
template <int Rows, int Tile>
constexpr std::size_t attention_forward_smem(std::size_t D) {
  return ((Rows + 2 * Tile) * (D + 1) + Rows * (Tile + 1)) * sizeof(float);
}
template <int Rows, int Tile>
constexpr std::size_t attention_backward_smem(std::size_t D) {
  return ((2 * Rows + 2 * Tile) * (D + 1) + 2 * Rows * (Tile + 1)) * sizeof(float);
}
// The kernels' shapes by head_dim, each within 48 KiB of shared memory: <max head_dim, rows, tile>.
template <int MaxD, int Rows, int Tile>
void attention_forward(float_in q, float_in k, float_in v, float_out out, float* lse, const attention_dims& d,
                       std::size_t batch, cudaStream_t s) {
  static_assert(attention_forward_smem<Rows, Tile>(MaxD) <= 48 * 1024);
  const auto smem = attention_forward_smem<Rows, Tile>(d.head_dim); // not in the launch macro: its comma splits arguments
  CONCERTO_CUDA_LAUNCH(attention_grid(batch, d.seq, Rows, d.heads, "attention"), 4 * Rows, smem, s,
                       attention_k<MaxD, Rows, Tile>)(q, k, v, out, lse, d);
}
template <int MaxD, int Rows, int Tile>
void attention_backward(float_in q, float_in k, float_in v, float_in dout, const float* lse, const float* delta,
                        float_out dq, float_out dk, float_out dv, const attention_dims& d, std::size_t batch,
                        cudaStream_t s) {
  static_assert(attention_backward_smem<Rows, Tile>(MaxD) <= 48 * 1024);
  const auto smem = attention_backward_smem<Rows, Tile>(d.head_dim);
  CONCERTO_CUDA_LAUNCH(attention_grid(batch, d.seq, Rows, d.heads, "attention_grad"), 4 * Rows, smem, s,
                       attention_dq_k<MaxD, Rows, Tile>)(q, k, v, dout, lse, delta, dq, d);
  CONCERTO_CUDA_LAUNCH(attention_grid(batch, d.seq, Rows, d.kv_heads, "attention_grad"), 4 * Rows, smem, s,
                       attention_dkv_k<MaxD, Rows, Tile>)(q, k, v, dout, lse, delta, dk, dv, d);
}
inline void check_head_dim(std::size_t head_dim, const char* kernel) {
  CONCERTO_CHECK(head_dim <= 256, std::string(kernel) + ": head_dim = " + std::to_string(head_dim) +
                                      " is more than the 256 the GPU's tiled attention stages in shared memory");
}

} // namespace detail

// ---- host entry points (enqueue on `s`; sizes as in runtime/cpu/) ----------------------------

/// @brief `out = a + b` over n values. out may alias a or b.
inline void add(float_in a, float_in b, float_out out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::add_k<>)(a, b, out, n);
  detail::launched("add");
}
/// @brief `acc += x` over n floats.
inline void add_inplace(float* acc, const float* x, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::add_inplace_k<>)(acc, x, n);
  detail::launched("add_inplace");
}
/// @brief `out = alpha·x` over n floats.
inline void scale(const float* x, float alpha, float* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::scale_k<>)(x, alpha, out, n);
  detail::launched("scale");
}
/// @brief `out[r,c] = x[r,c] + bias[c]`.
inline void bias_add(float_in x, float_in bias, float_out out, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows * cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * cols), detail::block, 0, s, detail::bias_add_k<>)(x, bias, out, rows * cols, cols);
  detail::launched("bias_add");
}
/// @brief Floats of device workspace the column sums over [rows, cols] (bias_add_grad, the gain
/// and bias gradients of the norms, scale_table_grad) take for their second level: `sums` per
/// split of the rows, none when one split fills the GPU. Given less (a null workspace) they
/// run in one level.
[[nodiscard]] inline std::size_t column_sum_workspace_floats(std::size_t rows, std::size_t cols, std::size_t sums = 1) {
  const auto splits = detail::column_sum_splits(rows, cols);
  return splits == 1 ? 0 : splits * sums * cols;
}
/// @brief `dbias[c] (+)= Σ_r dout[r,c]`; `workspace` holds column_sum_workspace_floats(rows, cols), or is null.
inline void bias_add_grad(float_in dout, float_out dbias, std::size_t rows, std::size_t cols, bool accumulate, cudaStream_t s,
                          float* workspace = nullptr) {
  detail::launch_column_sums<1>(detail::column_sum_k<>, {{dbias}, accumulate, rows, cols}, workspace, s, "bias_add_grad", dout);
}
/// @brief x times a table of its last dims, as cpu::scale_table.
inline void scale_table(const float* x, const float* table, float* out, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows * cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * cols), detail::block, 0, s, detail::scale_table_k<>)(x, table, out, rows * cols, cols);
  detail::launched("scale_table");
}
/// @brief The table's gradient of scale_table, as cpu::scale_table_grad (column sums of x·dout);
/// `workspace` as for bias_add_grad.
inline void scale_table_grad(const float* x, const float* dout, float* dtable, std::size_t rows, std::size_t cols, bool accumulate,
                             cudaStream_t s, float* workspace = nullptr) {
  detail::launch_column_sums<1>(detail::scale_table_grad_k<>, {{dtable}, accumulate, rows, cols}, workspace, s, "scale_table_grad", x,
                                dout);
}
namespace detail {
template <ir::dtype From>
void launch_convert(const void* x, ir::dtype to, void* out, std::size_t n, cudaStream_t s) {
  switch (to) {
  case ir::dtype::f32: CONCERTO_CUDA_LAUNCH(grid_for(n), block, 0, s, convert_k<From, ir::dtype::f32>)(x, out, n); return;
  case ir::dtype::bf16: CONCERTO_CUDA_LAUNCH(grid_for(n), block, 0, s, convert_k<From, ir::dtype::bf16>)(x, out, n); return;
  case ir::dtype::f16: CONCERTO_CUDA_LAUNCH(grid_for(n), block, 0, s, convert_k<From, ir::dtype::f16>)(x, out, n); return;
  case ir::dtype::i32:
  case ir::dtype::i64: break;
  }
  fail("cuda::convert: " + std::string(ir::to_string(to)) + " is not a float type (f32, bf16, f16)");
}
} // namespace detail
/// @brief n values of float type `from` into float type `to` (f32, bf16, f16): widening to f32
/// is exact, narrowing rounds to nearest even, as core/bfloat16.hpp and core/float16.hpp do on
/// the host; between bf16 and f16 through f32. A dispatch stages a 16-bit operand with it
/// (widened into the workspace before an f32 kernel, rounded back after) and `cast` runs it.
/// @code
/// cuda::convert(ir::dtype::f16, d_half, ir::dtype::f32, d_wide, n, stream);
/// @endcode
inline void convert(ir::dtype from, const void* x, ir::dtype to, void* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  switch (from) {
  case ir::dtype::f32: detail::launch_convert<ir::dtype::f32>(x, to, out, n, s); break;
  case ir::dtype::bf16: detail::launch_convert<ir::dtype::bf16>(x, to, out, n, s); break;
  case ir::dtype::f16: detail::launch_convert<ir::dtype::f16>(x, to, out, n, s); break;
  case ir::dtype::i32:
  case ir::dtype::i64: fail("cuda::convert: " + std::string(ir::to_string(from)) + " is not a float type (f32, bf16, f16)");
  }
  detail::launched("convert");
}
/// @brief GELU (tanh approximation), as cpu::gelu.
inline void gelu(float_in x, float_out out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::gelu_k<>)(x, out, n);
  detail::launched("gelu");
}
/// @brief `dx = dout·gelu'(x)`.
inline void gelu_grad(float_in x, float_in dout, float_out dx, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::gelu_grad_k<>)(x, dout, dx, n);
  detail::launched("gelu_grad");
}
/// @brief `out = max(x, 0)`.
inline void relu(const float* x, float* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::relu_k<>)(x, out, n);
  detail::launched("relu");
}
/// @brief `dx = x > 0 ? dout : 0`.
inline void relu_grad(const float* x, const float* dout, float* dx, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::relu_grad_k<>)(x, dout, dx, n);
  detail::launched("relu_grad");
}
/// @brief Layer normalisation over rows, saving mean and rstd (as cpu::layernorm).
inline void layernorm(float_in x, float_in gamma, float_in beta, float_out out, float* mean, float* rstd, std::size_t rows,
                      std::size_t cols, float eps, cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CHECK(cols > 0, "layernorm: a row needs at least one column");
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "layernorm"), detail::block, 0, s, detail::layernorm_k<>)(x, gamma, beta, out, mean, rstd, cols, eps);
  detail::launched("layernorm");
}
/// @brief Backward of layernorm (as cpu::layernorm_grad); `workspace` holds
/// column_sum_workspace_floats(rows, cols, 2), or is null.
inline void layernorm_grad(float_in dout, float_in x, float_in gamma, const float* mean, const float* rstd, float_out dx,
                           float_out dgamma, float_out dbeta, std::size_t rows, std::size_t cols, bool accumulate, cudaStream_t s,
                           float* workspace = nullptr) {
  if (cols == 0) return;
  if (rows > 0) {
    CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "layernorm_grad"), detail::block, 0, s, detail::layernorm_dx_k<>)(dout, x, gamma, mean, rstd, dx, cols);
    detail::launched("layernorm_grad");
  }
  detail::launch_column_sums<2>(detail::layernorm_dparams_k<>, {{dgamma, dbeta}, accumulate, rows, cols}, workspace, s,
                                "layernorm_grad", dout, x, mean, rstd);
}
/// @brief SiLU, as cpu::silu.
inline void silu(float_in x, float_out out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::silu_k<>)(x, out, n);
  detail::launched("silu");
}
/// @brief The logistic function, as cpu::sigmoid.
inline void sigmoid(const float* x, float* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::sigmoid_k<>)(x, out, n);
  detail::launched("sigmoid");
}
/// @brief `dx = dout·y·(1 - y)`, as cpu::sigmoid_grad.
inline void sigmoid_grad(const float* y, const float* dout, float* dx, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::sigmoid_grad_k<>)(y, dout, dx, n);
  detail::launched("sigmoid_grad");
}
/// @brief The hyperbolic tangent, as cpu::tanh.
inline void tanh(const float* x, float* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::tanh_k<>)(x, out, n);
  detail::launched("tanh");
}
/// @brief `dx = dout·(1 - y²)`, as cpu::tanh_grad.
inline void tanh_grad(const float* y, const float* dout, float* dx, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::tanh_grad_k<>)(y, dout, dx, n);
  detail::launched("tanh_grad");
}
/// @brief Per-channel Σx and Σx² of x [rows, cols], as cpu::batchnorm_stats.
inline void batchnorm_stats(const float* x, float* sums, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(cols), detail::block, 0, s, detail::batchnorm_stats_k<>)(x, sums, rows, cols);
  detail::launched("batchnorm_stats");
}
/// @brief (mean, 1/σ, gamma/σ) per channel, as cpu::batchnorm_scale (from_running: as
/// cpu::batchnorm_scale_running, `sums` the running statistics).
inline void batchnorm_scale(const float* sums, const float* gamma, float* scale, std::size_t cols, std::size_t count, float eps,
                            bool from_running, cudaStream_t s) {
  if (cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(cols), detail::block, 0, s, detail::batchnorm_scale_k<>)(sums, gamma, scale, cols, count,
                                                                                                 eps, from_running);
  detail::launched("batchnorm_scale");
}
/// @brief The running statistics moved towards the batch's, as cpu::batchnorm_track.
inline void batchnorm_track(const float* sums, float* running, std::size_t cols, std::size_t count, float momentum, cudaStream_t s) {
  if (cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(cols), detail::block, 0, s, detail::batchnorm_track_k<>)(sums, running, cols, count,
                                                                                                 momentum);
  detail::launched("batchnorm_track");
}
/// @brief y = (x − mean)·gamma/σ + beta, as cpu::batchnorm.
inline void batchnorm(const float* x, const float* scale, const float* beta, float* y, std::size_t rows, std::size_t cols,
                      cudaStream_t s) {
  if (rows * cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * cols), detail::block, 0, s, detail::batchnorm_k<>)(x, scale, beta, y, rows, cols);
  detail::launched("batchnorm");
}
/// @brief Per-channel Σdy and Σdy·x̂, as cpu::batchnorm_grad_stats.
inline void batchnorm_grad_stats(const float* x, const float* scale, const float* dy, float* sums, std::size_t rows,
                                 std::size_t cols, cudaStream_t s) {
  if (cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(cols), detail::block, 0, s, detail::batchnorm_grad_stats_k<>)(x, scale, dy, sums, rows,
                                                                                                      cols);
  detail::launched("batchnorm_grad_stats");
}
/// @brief dx through the normalisation and the statistics, as cpu::batchnorm_grad.
inline void batchnorm_grad(const float* x, const float* scale, const float* sums, const float* dy, float* dx, std::size_t rows,
                           std::size_t cols, std::size_t count, cudaStream_t s) {
  if (rows * cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * cols), detail::block, 0, s, detail::batchnorm_grad_k<>)(
      x, scale, sums, dy, dx, rows, cols, 1.0f / static_cast<float>(count));
  detail::launched("batchnorm_grad");
}
/// @brief The sum over the middle of x [outer, extent, inner] times scale, as cpu::sum_dim.
inline void sum_dim(const float* x, float* out, std::size_t outer, std::size_t extent, std::size_t inner, float scale,
                    cudaStream_t s) {
  if (outer * inner == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(outer * inner), detail::block, 0, s, detail::sum_dim_k<>)(x, out, outer, extent, inner,
                                                                                                  scale);
  detail::launched("sum_dim");
}
/// @brief dout repeated along the middle dim times scale, as cpu::sum_dim_grad.
inline void sum_dim_grad(const float* dout, float* dx, std::size_t outer, std::size_t extent, std::size_t inner, float scale,
                         cudaStream_t s) {
  const auto n = outer * extent * inner;
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::sum_dim_grad_k<>)(dout, dx, extent, inner, n, scale);
  detail::launched("sum_dim_grad");
}
namespace detail {
template <class A, class B>
void implicit_gemm(A a, B b, float* c, long long rows, long long cols, long long depth, bool accumulate, cudaStream_t s,
                   const char* what) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((rows + gemm_tile - 1) / gemm_tile), static_cast<unsigned>((cols + gemm_tile - 1) / gemm_tile));
  CONCERTO_CUDA_LAUNCH(grid, gemm_threads, 0, s, implicit_gemm_k<A, B>)(a, b, c, rows, cols, depth, accumulate);
  launched(what);
}
} // namespace detail
/// @brief conv2d over NHWC images by an HWIO kernel, as cpu::conv2d: an implicit GEMM (the fallback
/// where no cuDNN engine suits, runtime/cuda/convolution.hpp).
inline void conv2d(const float* x, const float* w, float* y, const ir::conv_geometry& g, cudaStream_t s) {
  const auto d = detail::dims_of(g);
  detail::implicit_gemm(detail::patch_gather{x, d}, detail::matrix_read{w, d.out}, y, g.positions(), d.out, g.patch(), false,
                        s, "conv2d");
}
/// @brief The image's gradient of conv2d, as cpu::conv2d_grad_input: an implicit GEMM over the
/// taps (i, j, o) of each pixel.
inline void conv2d_grad_input(const float* dy, const float* w, float* dx, const ir::conv_geometry& g, cudaStream_t s) {
  const auto d = detail::dims_of(g);
  detail::implicit_gemm(detail::window_gather{dy, d}, detail::kernel_by_tap{w, d}, dx, g.batch * g.height * g.width, d.in,
                        g.kernel_h * g.kernel_w * d.out, false, s, "conv2d_grad_input");
}
/// @brief The kernel's gradient of conv2d, as cpu::conv2d_grad_weight: an implicit GEMM over the
/// output positions.
inline void conv2d_grad_weight(const float* x, const float* dy, float* dw, const ir::conv_geometry& g, bool accumulate,
                               cudaStream_t s) {
  const auto d = detail::dims_of(g);
  detail::implicit_gemm(detail::patch_gather_t{{x, d}}, detail::matrix_read{dy, d.out}, dw, g.patch(), d.out, g.positions(),
                        accumulate, s, "conv2d_grad_weight");
}
/// @brief Max (or, with `average`, mean) pooling of NHWC images, as cpu::max_pool and
/// cpu::avg_pool (one thread per output value).
inline void pool(const float* x, float* y, const ir::conv_geometry& g, bool average, cudaStream_t s) {
  const auto n = static_cast<std::size_t>(g.y_values());
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::pool_k<>)(x, y, detail::dims_of(g), average);
  detail::launched(average ? "avg_pool" : "max_pool");
}
/// @brief The image's gradient of pool(), as cpu::max_pool_grad and cpu::avg_pool_grad (x is
/// read by the maximum's only; one thread per pixel value).
inline void pool_grad(const float* x, const float* dy, float* dx, const ir::conv_geometry& g, bool average, cudaStream_t s) {
  const auto n = static_cast<std::size_t>(g.x_values());
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::pool_grad_k<>)(x, dy, dx, detail::dims_of(g), average);
  detail::launched(average ? "avg_pool_grad" : "max_pool_grad");
}
/// @brief Dropout (and its gradient), as cpu::dropout.
inline void dropout(const float* x, float* y, const dropout_layout& l, const std::int64_t* step, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::dropout_k<>)(x, y, l, step, n);
  detail::launched("dropout");
}
/// @brief concat_dim and slice_dim_grad, as cpu::concat_dim and cpu::slice_dim_grad (b null:
/// one part at g.offset, zero elsewhere).
inline void assemble_parts(const float* a, const float* b, float* whole, const ir::dim_part& g, cudaStream_t s) {
  const auto n = static_cast<std::size_t>(g.whole_values());
  if (n == 0) return;
  detail::part_dims d{g.lead, g.outer, g.extent, g.inner, {g.offset, 0}, {g.length, 0}, {false, false}};
  if (b) d = {g.lead, g.outer, g.extent, g.inner, {0, g.length}, {g.length, g.extent - g.length}, {g.repeated(0), g.repeated(1)}};
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::assemble_k<>)(a, b, whole, d);
  detail::launched(b ? "concat_dim" : "slice_dim_grad");
}
/// @brief slice_dim and concat_dim_grad, as cpu::slice_dim and cpu::concat_dim_grad.
inline void extract_part(const float* whole, float* part, const ir::dim_part& g, bool summed, cudaStream_t s) {
  const bool repeated = summed && g.repeated(0);
  const auto n = static_cast<std::size_t>((repeated ? 1 : g.lead) * g.outer * g.length * g.inner);
  if (n == 0) return;
  const detail::part_dims d{g.lead, g.outer, g.extent, g.inner, {g.offset, 0}, {g.length, 0}, {repeated, false}};
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::extract_k<>)(whole, part, d);
  detail::launched(summed ? "concat_dim_grad" : "slice_dim");
}
/// @brief Dims rows and cols of x [outer, rows, cols, inner] swapped, as cpu::swap_dims.
inline void swap_dims(const float* x, float* out, std::size_t outer, std::size_t rows, std::size_t cols, std::size_t inner,
                      cudaStream_t s) {
  if (outer * rows * cols * inner == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(outer * rows * cols * inner), detail::block, 0, s, detail::swap_dims_k<>)(
      x, out, outer, rows, cols, inner);
  detail::launched("transpose");
}
/// @brief `dx = dout·silu'(x)`.
inline void silu_grad(float_in x, float_in dout, float_out dx, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::silu_grad_k<>)(x, dout, dx, n);
  detail::launched("silu_grad");
}
/// @brief `out = a·b` element by element.
inline void mul(float_in a, float_in b, float_out out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::mul_k<>)(a, b, out, n);
  detail::launched("mul");
}
/// @brief `out = silu(gate)·up`, as cpu::swiglu.
inline void swiglu(float_in gate, float_in up, float_out out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::swiglu_k<>)(gate, up, out, n);
  detail::launched("swiglu");
}
/// @brief Backward of swiglu, as cpu::swiglu_grad.
inline void swiglu_grad(float_in gate, float_in up, float_in dout, float_out dgate, float_out dup, std::size_t n,
                        cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::swiglu_grad_k<>)(gate, up, dout, dgate, dup, n);
  detail::launched("swiglu_grad");
}
/// @brief RoPE (direction +1) or its gradient (-1), as cpu::rope / cpu::rope_grad; out may alias x.
inline void rope(const float* x, const std::int32_t* positions, float* out, std::size_t rows, std::size_t width,
                 std::size_t head_dim, double theta, double direction, cudaStream_t s) {
  CONCERTO_CHECK(head_dim > 0 && head_dim % 2 == 0 && width % head_dim == 0,
                 "rope: head_dim " + std::to_string(head_dim) + " must be even and divide the row width " +
                     std::to_string(width));
  if (rows * width == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * width / 2), detail::block, 0, s, detail::rope_k<>)(x, positions, out, rows, width,
                                                                                              head_dim, theta, direction);
  detail::launched(direction > 0 ? "rope" : "rope_grad");
}
/// @brief RMS normalisation over rows, saving rstd when given (as cpu::rmsnorm).
inline void rmsnorm(float_in x, float_in gain, float_out out, float* rstd, std::size_t rows, std::size_t cols, float eps,
                    cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CHECK(cols > 0, "rmsnorm: a row needs at least one column");
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "rmsnorm"), detail::block, 0, s, detail::rmsnorm_k<>)(x, gain, out, rstd, cols, eps);
  detail::launched("rmsnorm");
}
/// @brief 1/√(mean(x²) + eps) per row alone (the backward recomputes it), as rmsnorm.
inline void rmsnorm_stats(float_in x, float* rstd, std::size_t rows, std::size_t cols, float eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "rmsnorm_stats"), detail::block, 0, s, detail::rms_stats_k<>)(x, rstd, cols, eps);
  detail::launched("rmsnorm_stats");
}
/// @brief Backward of rmsnorm for its input, as cpu::rmsnorm_grad.
inline void rmsnorm_grad(float_in dout, float_in x, float_in gain, const float* rstd, float_out dx, std::size_t rows,
                         std::size_t cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "rmsnorm_grad"), detail::block, 0, s, detail::rmsnorm_dx_k<>)(dout, x, gain, rstd, dx, cols);
  detail::launched("rmsnorm_grad");
}
/// @brief Backward of rmsnorm for its gain, as cpu::rmsnorm_grad_gain; `workspace` as for bias_add_grad.
inline void rmsnorm_grad_gain(float_in dout, float_in x, const float* rstd, float_out dgain, std::size_t rows, std::size_t cols,
                              bool accumulate, cudaStream_t s, float* workspace = nullptr) {
  detail::launch_column_sums<1>(detail::rmsnorm_dgain_k<>, {{dgain}, accumulate, rows, cols}, workspace, s, "rmsnorm_grad_gain",
                                dout, x, rstd);
}
/// @brief Row-wise stable softmax.
inline void softmax(float_in x, float_out out, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "softmax"), detail::block, 0, s, detail::softmax_k<>)(x, out, cols);
  detail::launched("softmax");
}
/// @brief `dx = y·(dy - Σ dy·y)` per row.
inline void softmax_grad(float_in y, float_in dy, float_out dx, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "softmax_grad"), detail::block, 0, s, detail::softmax_grad_k<>)(y, dy, dx, cols);
  detail::launched("softmax_grad");
}
/// @brief Causal (grouped-query) attention forward (as cpu::causal_attention), tiled: any seq,
/// head_dim ≤ 256; `lse` gets each row's log-sum-exp.
inline void causal_attention(float_in q, float_in k, float_in v, float_out out, float* lse,
                             const cpu::attention_shape& a, cudaStream_t s) {
  if (a.batch * a.seq * a.heads == 0) return;
  detail::check_head_dim(a.head_dim, "causal_attention");
  const auto d = detail::make_dims(a);
  if (a.head_dim <= 64) detail::attention_forward<64, 32, 32>(q, k, v, out, lse, d, a.batch, s);
  else if (a.head_dim <= 128) detail::attention_forward<128, 32, 16>(q, k, v, out, lse, d, a.batch, s);
  else detail::attention_forward<256, 32, 4>(q, k, v, out, lse, d, a.batch, s);
  detail::launched("causal_attention");
}
/// @brief Floats of device workspace `causal_attention_grad` needs (one value per query row).
[[nodiscard]] constexpr std::size_t causal_attention_grad_workspace_floats(const cpu::attention_shape& a) noexcept {
  return a.lse_floats();
}
/// @brief Causal (grouped-query) attention backward (as cpu::causal_attention_grad) from the
/// forward's `out` and `lse`; `workspace` holds `causal_attention_grad_workspace_floats` floats.
inline void causal_attention_grad(float_in q, float_in k, float_in v, float_in out, float_in dout, const float* lse,
                                  float_out dq, float_out dk, float_out dv, float* workspace,
                                  const cpu::attention_shape& a, cudaStream_t s) {
  if (a.batch * a.seq * a.heads == 0) return;
  detail::check_head_dim(a.head_dim, "causal_attention_grad");
  const auto d = detail::make_dims(a);
  const auto rows = a.lse_floats();
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows), detail::block, 0, s, detail::attention_delta_k<>)(out, dout, workspace, d, rows);
  if (a.head_dim <= 64) detail::attention_backward<64, 32, 32>(q, k, v, dout, lse, workspace, dq, dk, dv, d, a.batch, s);
  else if (a.head_dim <= 128) detail::attention_backward<128, 32, 8>(q, k, v, dout, lse, workspace, dq, dk, dv, d, a.batch, s);
  else detail::attention_backward<256, 16, 4>(q, k, v, dout, lse, workspace, dq, dk, dv, d, a.batch, s);
  detail::launched("causal_attention_grad");
}
/// @brief Mean cross-entropy times `share` into `loss[0]` (device), saving lse per row. A target
/// outside [0, classes) is skipped and sets `*status = code`. `share` is rows / global rows for
/// a loss summed over data-parallel ranks (the dispatch's `global_rows`).
inline void cross_entropy(float_in logits, const std::int32_t* targets, float* lse, float_out loss, std::size_t rows,
                          std::size_t classes, int* status, int code, cudaStream_t s, float share = 1.0f) {
  CONCERTO_CHECK(rows > 0, "cross_entropy: the mean over rows needs at least one row");
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "cross_entropy"), detail::block, 0, s, detail::cross_entropy_rows_k<>)(logits, targets, lse,
                                                                                                 classes, status, code);
  detail::launched("cross_entropy");
  CONCERTO_CUDA_LAUNCH(1, 1024, 0, s, detail::cross_entropy_mean_k<>)(logits, targets, lse, loss, rows, classes, share);
  detail::launched("cross_entropy");
}
/// @brief `dlogits = dloss·(softmax(logits) - onehot)/rows`, times `*loss_scale` (device, read
/// when the kernel runs) under dynamic loss scaling.
inline void cross_entropy_grad(float_in logits, const std::int32_t* targets, const float* lse, float_out dlogits,
                               std::size_t rows, std::size_t classes, float dloss, cudaStream_t s,
                               const float* loss_scale = nullptr) {
  CONCERTO_CHECK(rows > 0, "cross_entropy_grad: the mean over rows needs at least one row");
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * classes), detail::block, 0, s, detail::cross_entropy_grad_k<>)(
      logits, targets, lse, dlogits, rows, classes, dloss / static_cast<float>(rows), loss_scale);
  detail::launched("cross_entropy_grad");
}
/// @brief Mean squared error times `share` into `loss[0]` (device), summed in double.
inline void mse(const float* pred, const float* target, float* loss, std::size_t n, cudaStream_t s, float share = 1.0f) {
  CONCERTO_CHECK(n > 0, "mse: the mean needs at least one value");
  CONCERTO_CUDA_LAUNCH(1, 1024, 0, s, detail::mse_k<>)(pred, target, loss, n, share);
  detail::launched("mse");
}
/// @brief `dpred = dloss·2·(pred - target)/n`, times `*loss_scale` (device, read when the kernel
/// runs) under dynamic loss scaling.
inline void mse_grad(const float* pred, const float* target, float* dpred, std::size_t n, float dloss, cudaStream_t s,
                     const float* loss_scale = nullptr) {
  CONCERTO_CHECK(n > 0, "mse_grad: the mean needs at least one value");
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::mse_grad_k<>)(pred, target, dpred, n,
                                                                   2.0f * dloss / static_cast<float>(n), loss_scale);
  detail::launched("mse_grad");
}
/// @brief `out[i,:] = table[ids[i] - first_row, :]`; ids outside the table give zero rows, and
/// with `reject` also set `*status = code`.
inline void embedding(const std::int32_t* ids, float_in table, float_out out, std::size_t n, std::size_t dim,
                      std::size_t table_rows, std::int64_t first_row, bool reject, int* status, int code, cudaStream_t s) {
  if (n * dim == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n * dim), detail::block, 0, s, detail::embedding_k<>)(ids, table, out, n, dim, first_row, table_rows,
                                                                          reject, status, code);
  detail::launched("embedding");
}
/// @brief Floats of device workspace embedding_grad takes (int32 offsets, cursors and token order).
[[nodiscard]] constexpr std::size_t embedding_grad_workspace_floats(std::size_t n, std::size_t table_rows) noexcept {
  return 2 * table_rows + 1 + n;
}
/// @brief `dtable[ids[i] - first_row, :] += dout[i, :]` (overwriting unless `accumulate`), each
/// row's tokens added in token order as the CPU kernel adds them: deterministic, no atomics on
/// the table. `workspace` holds embedding_grad_workspace_floats(n, table_rows) floats.
inline void embedding_grad(const std::int32_t* ids, float_in dout, float_out dtable, std::size_t n, std::size_t dim,
                           std::size_t table_rows, bool accumulate, std::int64_t first_row, bool reject, int* status,
                           int code, float* workspace, cudaStream_t s) {
  if (table_rows * dim == 0) return;
  CONCERTO_CHECK(n < 0x7fffffffu, "embedding_grad: " + std::to_string(n) + " ids exceed the int32 token order");
  CONCERTO_CHECK(dim / detail::block < 65535, "embedding_grad: " + std::to_string(dim) + " columns exceed the grid");
  auto* offsets = reinterpret_cast<std::int32_t*>(workspace);
  std::int32_t* cursors = offsets + table_rows + 1;
  std::int32_t* order = cursors + table_rows;
  check(cudaMemsetAsync(cursors, 0, table_rows * sizeof(std::int32_t), s), "cudaMemsetAsync");
  if (n > 0) {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::embedding_count_k<>)(ids, cursors, n, first_row,
                                                                                                table_rows, reject, status, code);
  }
  CONCERTO_CUDA_LAUNCH(1, detail::block, 0, s, detail::exclusive_scan_k<>)(cursors, offsets, cursors, table_rows);
  if (n > 0) CONCERTO_CUDA_LAUNCH(1, detail::block, 0, s, detail::embedding_place_k<>)(ids, cursors, order, n, first_row, table_rows);
  const dim3 grid(detail::rows_grid(table_rows, "embedding_grad"), static_cast<unsigned>((dim + detail::block - 1) / detail::block));
  CONCERTO_CUDA_LAUNCH(grid, detail::block, 0, s, detail::embedding_rows_k<>)(offsets, order, dout, dtable, dim, accumulate);
  detail::launched("embedding_grad");
}
/// @brief SGD update in place (as cpu::sgd_update) at the rate `schedule` gives the device's step
/// counter `step` (from 1, read when the kernel runs); `momentum_buf` may be null when momentum is 0.
/// `norm_sq` (device, or null) is the squared global gradient norm that clipping to `max_norm`
/// scales by; with `loss_scale` (device, or null: no loss scaling) the gradients are that many
/// times the true ones and nothing is written when `norm_sq` is not finite (runtime/grad_clip.hpp).
inline void sgd_update(float* params, const float* grads, float* momentum_buf, std::size_t n, const cpu::sgd_config& cfg,
                       const lr_schedule& schedule, const std::int64_t* step, const float* norm_sq, float max_norm,
                       cudaStream_t s, const float* loss_scale = nullptr, working_copy working = {}) {
  if (n == 0) return;
  CONCERTO_CHECK(cfg.momentum == 0.0f || momentum_buf != nullptr, "sgd_update: momentum needs a momentum buffer");
  float* const buf = cfg.momentum == 0.0f ? nullptr : momentum_buf;
  detail::with_working_type(working, "sgd_update", [&]<ir::dtype W>() {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::sgd_k<W>)(params, grads, buf, n, cfg, schedule, step,
                                                                                     norm_sq, max_norm, loss_scale, working.values);
  });
  detail::launched("sgd_update");
}
/// @brief AdamW update in place (as cpu::adamw_update) at the rate `schedule` gives; `step` points
/// to the device's step counter (from 1), read when the kernel runs. `norm_sq` and `loss_scale`
/// as for sgd_update: under loss scaling an overflowed step leaves params, m and v as they were
/// (and writes params, rounded, into the working copy).
inline void adamw_update(float* params, const float* grads, float* m, float* v, std::size_t n, const cpu::adamw_config& cfg,
                         const lr_schedule& schedule, const std::int64_t* step, const float* norm_sq, float max_norm,
                         cudaStream_t s, const float* loss_scale = nullptr, working_copy working = {}) {
  if (n == 0) return;
  detail::with_working_type(working, "adamw_update", [&]<ir::dtype W>() {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::adamw_k<W>)(params, grads, m, v, n, cfg, schedule, step,
                                                                                       norm_sq, max_norm, loss_scale, working.values);
  });
  detail::launched("adamw_update");
}
/// @brief `*out = Σ x² / replicas` over n values (cpu::sum_of_squares), one block.
inline void grad_sq_norm(const float* x, std::size_t n, std::int64_t replicas, float* out, cudaStream_t s) {
  CONCERTO_CUDA_LAUNCH(1, 1024, 0, s, detail::grad_sq_norm_k<>)(x, n, static_cast<double>(replicas), out);
  detail::launched("grad_sq_norm");
}

/// @brief i64 ids into i32 (`out` holds n values); a value outside 32 bits becomes INT32_MIN and
/// sets `*status = code`.
inline void narrow_ids(const std::int64_t* in, std::int32_t* out, std::size_t n, int* status, int code, cudaStream_t s) {
  if (n == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::narrow_ids_k<>)(in, out, n, status, code);
  detail::launched("narrow_ids");
}
/// @brief Layernorm's row statistics (mean and rstd, biased variance) without the output.
inline void layernorm_stats(float_in x, float* mean, float* rstd, std::size_t rows, std::size_t cols, float eps,
                            cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CHECK(cols > 0, "layernorm_stats: a row needs at least one column");
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "layernorm_stats"), detail::block, 0, s, detail::row_stats_k<>)(x, mean, rstd, cols, eps);
  detail::launched("layernorm_stats");
}
/// @brief dx of layernorm alone (the DSL's layernorm_grad; dgamma and dbeta are other tasks).
inline void layernorm_grad_input(float_in dout, float_in x, float_in gamma, const float* mean,
                                 const float* rstd, float_out dx, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "layernorm_grad"), detail::block, 0, s, detail::layernorm_dx_k<>)(dout, x, gamma, mean, rstd,
                                                                                             dx, cols);
  detail::launched("layernorm_grad");
}
/// @brief `dgamma[c] (+)= Σ_r dout[r,c]·(x[r,c] - mean[r])·rstd[r]` (the DSL's layernorm_grad_gamma);
/// `workspace` holds column_sum_workspace_floats(rows, cols, 2), or is null.
inline void layernorm_grad_gamma(float_in dout, float_in x, const float* mean, const float* rstd, float_out dgamma,
                                 std::size_t rows, std::size_t cols, bool accumulate, cudaStream_t s, float* workspace = nullptr) {
  detail::launch_column_sums<2>(detail::layernorm_dparams_k<>, {{dgamma, float_out{}}, accumulate, rows, cols}, workspace, s,
                                "layernorm_grad_gamma", dout, x, mean, rstd);
}
/// @brief The row log-sum-exp of cross_entropy alone (its backward recomputes it); a target
/// outside [0, classes) sets `*status = code`.
inline void cross_entropy_lse(float_in logits, const std::int32_t* targets, float* lse, std::size_t rows,
                              std::size_t classes, int* status, int code, cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "cross_entropy"), detail::block, 0, s, detail::cross_entropy_rows_k<>)(logits, targets, lse,
                                                                                                 classes, status, code);
  detail::launched("cross_entropy");
}
/// @brief `out[r] = max_c logits[r,c]` (vocab_ce_max: this rank's part of the vocabulary).
inline void vocab_ce_max(const float* logits, float* out, std::size_t rows, std::size_t cols, cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CHECK(cols > 0, "vocab_ce_max: a row needs at least one column");
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "vocab_ce_max"), detail::block, 0, s, detail::row_max_k<>)(logits, out, cols);
  detail::launched("vocab_ce_max");
}
/// @brief `out[r] = Σ_c exp(logits[r,c] - max[r])` (vocab_ce_sumexp, after the max all-reduce).
inline void vocab_ce_sumexp(const float* logits, const float* max, float* out, std::size_t rows, std::size_t cols,
                            cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::rows_grid(rows, "vocab_ce_sumexp"), detail::block, 0, s, detail::row_sumexp_k<>)(logits, max, out, cols);
  detail::launched("vocab_ce_sumexp");
}
/// @brief `out[r] = logits[r, label - first_col] - max[r]` where this rank holds the label's
/// column (first_col ≤ label < first_col + cols), else 0 (vocab_ce_target).
inline void vocab_ce_target(const float* logits, const float* max, const std::int32_t* labels, float* out,
                            std::size_t rows, std::size_t cols, std::int64_t first_col, cudaStream_t s) {
  if (rows == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows), detail::block, 0, s, detail::vocab_target_k<>)(logits, max, labels, out, rows, cols, first_col);
  detail::launched("vocab_ce_target");
}
/// @brief `out = scale·(exp(logits - max)/sumexp - onehot)` over this rank's columns (vocab_ce_grad),
/// times `*loss_scale` (device, read when the kernel runs) under dynamic loss scaling.
inline void vocab_ce_grad(const float* logits, const float* max, const float* sumexp, const std::int32_t* labels,
                          float* out, std::size_t rows, std::size_t cols, std::int64_t first_col, float scale,
                          cudaStream_t s, const float* loss_scale = nullptr) {
  if (rows * cols == 0) return;
  CONCERTO_CUDA_LAUNCH(detail::grid_for(rows * cols), detail::block, 0, s, detail::vocab_grad_k<>)(logits, max, sumexp, labels, out, rows,
                                                                              cols, first_col, scale, loss_scale);
  detail::launched("vocab_ce_grad");
}
/// @brief `loss[0] = Σ_r (log sumexp[r] - target[r]) / global_rows`, summed in double (vocab_ce_loss).
inline void vocab_ce_loss(const float* sumexp, const float* target, float* loss, std::size_t rows, double global_rows,
                          cudaStream_t s) {
  CONCERTO_CUDA_LAUNCH(1, 1024, 0, s, detail::vocab_loss_k<>)(sumexp, target, loss, rows, global_rows);
  detail::launched("vocab_ce_loss");
}
/// @brief Moves `parts` blocks of `len` bytes per row between a tensor split along a dimension
/// (`outer` rows, each holding the parts side by side) and the collectives' layout (part k's
/// rows contiguous): `to_blocks` packs before an NCCL call, `!to_blocks` unpacks after one.
/// `from` and `to` must not overlap.
/// @code
/// cuda::restride(d_whole, d_stage, outer, ranks, part_row_bytes, true, lane_stream);
/// @endcode
inline void restride(const std::byte* from, std::byte* to, std::size_t outer, std::size_t parts, std::size_t len,
                     bool to_blocks, cudaStream_t s) {
  const std::size_t n = outer * parts * len;
  if (n == 0) return;
  const auto fits = [&](std::size_t w) {
    return len % w == 0 && reinterpret_cast<std::uintptr_t>(from) % w == 0 && reinterpret_cast<std::uintptr_t>(to) % w == 0;
  };
  if (fits(16)) {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n / 16), detail::block, 0, s, detail::restride_k<uint4>)(
        reinterpret_cast<const uint4*>(from), reinterpret_cast<uint4*>(to), outer, parts, len / 16, to_blocks);
  } else if (fits(4)) {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n / 4), detail::block, 0, s, detail::restride_k<std::uint32_t>)(
        reinterpret_cast<const std::uint32_t*>(from), reinterpret_cast<std::uint32_t*>(to), outer, parts, len / 4, to_blocks);
  } else {
    CONCERTO_CUDA_LAUNCH(detail::grid_for(n), detail::block, 0, s, detail::restride_k<std::uint8_t>)(
        reinterpret_cast<const std::uint8_t*>(from), reinterpret_cast<std::uint8_t*>(to), outer, parts, len, to_blocks);
  }
  detail::launched("restride");
}

} // namespace concerto::runtime::cuda
