// The CPU dispatch on bf16 operands (runtime/dispatch.hpp): the cast kernel's rounding, and a
// kernel that widens its bf16 operands, computes in f32 and rounds what it writes.
#include <concerto/core/bfloat16.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <bit>
#include <limits>
#include <span>
#include <vector>

using namespace concerto;

namespace {
// One compute task on a two-buffer graph, run by the CPU dispatch.
struct one_task {
  ir::graph g;
  runtime::host_arena mem;
  runtime::kernel_call call;
  one_task(ir::op fn, ir::dtype in, ir::dtype out, std::int64_t n) {
    ir::builder b("t");
    const auto x = b.buffer("x", {n}, ir::buffer_role::activation, in);
    const auto y = b.buffer("y", {n}, ir::buffer_role::activation, out);
    b.compute(fn, "k", {x}, {y}, {{"n", n}, {"rows", 1}, {"cols", n}});
    g = std::move(b).finish();
    call = runtime::decode(g, g.tasks[0]);
    mem = runtime::host_arena(g, runtime::make_layout(g, runtime::workspace_bytes(g)));
  }
  std::span<std::uint16_t> half(ir::buffer_id id) {
    const auto raw = mem.bytes(id);
    return {reinterpret_cast<std::uint16_t*>(raw.data()), raw.size() / 2};
  }
  void run() { runtime::run_kernel(call, mem, {}); }
};
} // namespace

TEST_CASE("the CPU's cast rounds to nearest even and widens exactly", "[precision][cpu]") {
  one_task down(ir::op::cast, ir::dtype::f32, ir::dtype::bf16, 4);
  const std::vector<float> values{1.0f, std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u),
                                  std::numeric_limits<float>::infinity()};
  std::copy(values.begin(), values.end(), down.mem.f32(0).begin());
  down.run();
  const auto h = down.half(1);
  CHECK(h[0] == 0x3f80);
  CHECK(h[1] == 0x3f80); // a tie: to the even
  CHECK(h[2] == 0x3f82); // a tie: to the even
  CHECK(h[3] == 0x7f80);
  one_task up(ir::op::cast, ir::dtype::bf16, ir::dtype::f32, 4);
  std::copy(h.begin(), h.end(), up.half(0).begin());
  up.run();
  CHECK(up.mem.f32(1)[2] == from_bf16(0x3f82));
}

TEST_CASE("a CPU kernel on bf16 operands computes in f32 and rounds what it writes", "[precision][cpu]") {
  constexpr std::int64_t n = 64;
  one_task k(ir::op::gelu, ir::dtype::bf16, ir::dtype::bf16, n);
  CHECK(k.call.staged == 2 * n);
  std::vector<float> wide(n);
  for (std::int64_t i = 0; i < n; ++i) k.half(0)[static_cast<std::size_t>(i)] = to_bf16(static_cast<float>(i - 32) / 9.0f);
  widen_bf16(k.half(0), wide);
  k.run();
  std::vector<float> want(n);
  runtime::cpu::gelu(wide, want);
  for (std::int64_t i = 0; i < n; ++i) CHECK(k.half(1)[static_cast<std::size_t>(i)] == to_bf16(want[static_cast<std::size_t>(i)]));
  // A mixed call: a bf16 input and an f32 output.
  one_task mixed(ir::op::gelu, ir::dtype::bf16, ir::dtype::f32, n);
  CHECK(mixed.call.staged == n);
  std::copy(k.half(0).begin(), k.half(0).end(), mixed.half(0).begin());
  mixed.run();
  for (std::int64_t i = 0; i < n; ++i) CHECK(mixed.mem.f32(1)[static_cast<std::size_t>(i)] == want[static_cast<std::size_t>(i)]);
}
