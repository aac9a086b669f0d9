// cuDNN's fused attention (runtime/cuda/cudnn_attention.hpp) against the CPU attention on the
// same bf16-rounded inputs, forward and backward, causal grouped-query and not; its refusals
// (f32 operands, a head mapping cuDNN does not express, a short workspace, a build without the
// frontend). nvcc only, on a real GPU: every case SKIPs where none is visible.
#include "gpu_testing.hpp"

#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cuda/convolution.hpp>
#include <concerto/runtime/cuda/cudnn_attention.hpp>
#include <concerto/runtime/cuda/stream.hpp>

#include <catch2/catch_test_macros.hpp>

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace cu = concerto::runtime::cuda;
namespace ir = concerto::ir;
using gpu_testing::dev;
using gpu_testing::random;

namespace {

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> out(x.size());
  std::transform(x.begin(), x.end(), out.begin(), [](float f) { return __float2bfloat16(f); });
  return out;
}
std::vector<float> to_f32(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> out(x.size());
  std::transform(x.begin(), x.end(), out.begin(), [](__nv_bfloat16 b) { return __bfloat162float(b); });
  return out;
}
// What the GPU sees: random values rounded to bf16, so both sides start from the same numbers.
std::vector<float> bf16_random(std::size_t n, std::uint32_t seed) { return to_f32(to_bf16(random(n, seed))); }

// |got - want| <= tol·(max|want| + |want|) everywhere. cuDNN rounds its 16-bit outputs (2^-9
// relative) and feeds the probabilities P and dS to its tensor-core products in bf16 (another
// 2^-9 each), accumulating in f32; over a row of `seq` terms those roundings add up like a random
// walk, far below 1% of the row's largest magnitude at these sizes. The max|want| term is there
// because gradients cancel: an entry near 0 has no relative accuracy, only one relative to its row's
// scale. 2e-2 leaves a factor of ~4 over the bf16 rounding of the output alone (2^-8 near 1).
void check_bf16_close(const std::vector<float>& got, const std::vector<float>& want, float tol = 2e-2f) {
  REQUIRE(got.size() == want.size());
  float scale = 0.0f;
  for (const float w : want) scale = std::max(scale, std::abs(w));
  REQUIRE(scale > 0.0f); // a zero reference would let a broken kernel pass
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= tol * (scale + std::abs(want[i])))) {
      INFO("first mismatch at " << i << ": cuDNN " << got[i] << ", CPU " << want[i] << " (largest |CPU| " << scale << ")");
      CHECK(false);
      return;
    }
}

struct reference {
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
};
reference cpu_attention(const cpu::attention_shape& sh) {
  reference r{.q = bf16_random(sh.q_floats(), 41), .k = bf16_random(sh.kv_floats(), 42), .v = bf16_random(sh.kv_floats(), 43),
              .dout = bf16_random(sh.q_floats(), 44)};
  r.out.resize(sh.q_floats());
  r.lse.resize(sh.lse_floats());
  r.dq.resize(sh.q_floats());
  r.dk.resize(sh.kv_floats());
  r.dv.resize(sh.kv_floats());
  std::vector<float> ws(cpu::causal_attention_grad_workspace_floats(sh));
  cpu::causal_attention(r.q, r.k, r.v, r.out, r.lse, ws, sh);
  cpu::causal_attention_grad(r.q, r.k, r.v, r.dout, r.lse, r.dq, r.dk, r.dv, ws, sh);
  return r;
}

} // namespace

TEST_CASE("cuDNN's fused attention matches the CPU attention in bf16", "[gpu][cudnn][attention]") {
  CONCERTO_REQUIRE_GPU();
  if constexpr (!cu::cudnn_attention_available) SKIP("built without cuDNN's frontend: nothing to compare");
  cu::stream s;
  cu::dnn_handle dnn;
  cu::cudnn_attention_cache cache(dnn.get());
  // Causal grouped-query (4 q heads per kv head) over several of cuDNN's tiles with a partial last
  // one; non-causal multi-head; head_dim 128 (the benchmark's); one q head per kv head, causal.
  for (const cpu::attention_shape& sh :
       {cpu::attention_shape{.batch = 2, .seq = 200, .heads = 8, .head_dim = 64, .kv_heads = 2, .group = 4},
        cpu::attention_shape{.batch = 2, .seq = 96, .heads = 4, .head_dim = 64, .causal = false},
        cpu::attention_shape{.batch = 1, .seq = 130, .heads = 2, .head_dim = 128}}) {
    CAPTURE(sh.batch, sh.seq, sh.heads, sh.kv(), sh.head_dim, sh.causal);
    const auto want = cpu_attention(sh);
    dev<__nv_bfloat16> q(to_bf16(want.q)), k(to_bf16(want.k)), v(to_bf16(want.v)), dout(to_bf16(want.dout)),
        out(sh.q_floats()), dq(sh.q_floats()), dk(sh.kv_floats()), dv(sh.kv_floats());
    dev<float> lse(sh.lse_floats());

    const auto fwd_bytes = cu::cudnn_attention_workspace_bytes(cache, sh, ir::dtype::bf16, cu::cudnn_attention_pass::forward_with_lse);
    INFO("cuDNN refused: " << cache.last_refusal());
    REQUIRE(fwd_bytes.has_value());
    cu::device_buffer fwd_ws(std::max<std::size_t>(*fwd_bytes, 1));
    REQUIRE(cu::cudnn_attention_forward(cache, s.get(), ir::dtype::bf16, sh,
                                        {.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p(), .lse = lse.p()}, fwd_ws.data(),
                                        *fwd_bytes));
    check_bf16_close(to_f32(out.get()), want.out);
    check_bf16_close(lse.get(), want.lse, 1e-3f); // f32, from exact products of bf16 values: only the sums' order differs

    // With the forward's out and lse, then recomputing them: the same gradients.
    for (const bool recompute : {false, true}) {
      CAPTURE(recompute);
      const auto bwd_bytes =
          cu::cudnn_attention_workspace_bytes(cache, sh, ir::dtype::bf16, cu::cudnn_attention_pass::backward, recompute);
      INFO("cuDNN refused: " << cache.last_refusal());
      REQUIRE(bwd_bytes.has_value());
      cu::device_buffer bwd_ws(std::max<std::size_t>(*bwd_bytes, 1));
      // Cleared, so that a pass writing nothing cannot pass on the previous pass's gradients.
      for (const auto* g : {&dq, &dk, &dv}) cu::check(cudaMemset(g->p(), 0, g->n * sizeof(__nv_bfloat16)), "cudaMemset");
      cu::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); // the memsets ran on the legacy stream, not on `s`
      cu::cudnn_attention_operands ops{.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p(), .lse = lse.p(), .dout = dout.p(),
                                       .dq = dq.p(), .dk = dk.p(), .dv = dv.p()};
      if (recompute) ops.out = nullptr, ops.lse = nullptr;
      REQUIRE(cu::cudnn_attention_backward(cache, s.get(), ir::dtype::bf16, sh, ops, bwd_ws.data(), *bwd_bytes));
      check_bf16_close(to_f32(dq.get()), want.dq);
      check_bf16_close(to_f32(dk.get()), want.dk);
      check_bf16_close(to_f32(dv.get()), want.dv);
    }
  }
}

TEST_CASE("cuDNN's fused attention refuses what it cannot run and writes nothing", "[gpu][cudnn][attention]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  cu::dnn_handle dnn;
  cu::cudnn_attention_cache cache(dnn.get());
  const cpu::attention_shape sh{.batch = 1, .seq = 64, .heads = 2, .head_dim = 64};
  const std::vector<float> sentinel(sh.q_floats(), 7.0f);
  dev<float> q(random(sh.q_floats(), 1)), k(random(sh.kv_floats(), 2)), v(random(sh.kv_floats(), 3)), out(sentinel);
  const std::size_t ws_bytes = std::size_t{1} << 20;
  cu::device_buffer ws(ws_bytes);

  // f32 operands: cuDNN's SDPA takes 16-bit inputs; the caller runs the own f32 kernels.
  CHECK_FALSE(cu::cudnn_attention_workspace_bytes(cache, sh, ir::dtype::f32, cu::cudnn_attention_pass::forward).has_value());
  CHECK_FALSE(cu::cudnn_attention_forward(cache, s.get(), ir::dtype::f32, sh, {.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p()},
                                          ws.data(), ws_bytes));
  // A rank holding q heads 2..3 of 6 and both kv heads: cuDNN would map them to kv head 0.
  const cpu::attention_shape split{.batch = 1, .seq = 64, .heads = 2, .head_dim = 64, .kv_heads = 2, .group = 3, .first_head = 2};
  CHECK_FALSE(cu::cudnn_attention_forward(cache, s.get(), ir::dtype::bf16, split,
                                          {.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p()}, ws.data(), ws_bytes));
  // head_dim 100: not a multiple of 8.
  const cpu::attention_shape odd{.batch = 1, .seq = 64, .heads = 1, .head_dim = 100};
  CHECK_FALSE(cu::cudnn_attention_forward(cache, s.get(), ir::dtype::bf16, odd, {.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p()},
                                          ws.data(), ws_bytes));
  if constexpr (cu::cudnn_attention_available) {
    // A workspace shorter than the graph's: refused, not overrun (only where the graph wants one).
    const auto need = cu::cudnn_attention_workspace_bytes(cache, sh, ir::dtype::bf16, cu::cudnn_attention_pass::backward, true);
    REQUIRE(need.has_value());
    CHECK(*need > 0); // the recomputed out and lse at least
    CHECK_FALSE(cu::cudnn_attention_backward(cache, s.get(), ir::dtype::bf16, sh,
                                             {.q = q.p(), .k = k.p(), .v = v.p(), .dout = q.p(), .dq = out.p(), .dk = k.p(), .dv = v.p()},
                                             ws.data(), *need - 1));
  } else {
    // Without the frontend even a case cuDNN would run is refused, and the caller falls back.
    CHECK_FALSE(cu::cudnn_attention_forward(cache, s.get(), ir::dtype::bf16, sh, {.q = q.p(), .k = k.p(), .v = v.p(), .out = out.p()},
                                            ws.data(), ws_bytes));
    CHECK_FALSE(cache.last_refusal().empty());
  }
  CHECK(out.get() == sentinel);
}

TEST_CASE("without the frontend every fused attention call is refused, no GPU needed", "[cudnn][attention]") {
  if constexpr (cu::cudnn_attention_available) {
    SKIP("built with cuDNN's frontend: its refusals are checked on a GPU above");
  } else {
    cu::cudnn_attention_cache cache(nullptr); // never touched: nothing is built without the frontend
    const cpu::attention_shape sh{.batch = 1, .seq = 64, .heads = 2, .head_dim = 64};
    CHECK_FALSE(cu::cudnn_attention_workspace_bytes(cache, sh, ir::dtype::bf16, cu::cudnn_attention_pass::forward).has_value());
    CHECK_FALSE(cu::cudnn_attention_forward(cache, nullptr, ir::dtype::bf16, sh, {}, nullptr, 0));
    CHECK_FALSE(cu::cudnn_attention_backward(cache, nullptr, ir::dtype::bf16, sh, {}, nullptr, 0));
  }
}
