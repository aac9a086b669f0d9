// The CPU dispatch on 16-bit float operands (runtime/dispatch.hpp): the cast kernel's rounding, a
// kernel that widens its bf16 or f16 operands, computes in f32 and rounds what it writes; and the
// loss scale a loss gradient multiplies by and an update divides by, or skips on (fp16's dynamic
// loss scaling, runtime/grad_clip.hpp).
#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
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

TEST_CASE("f16 operands: the cast saturates past 65504, a kernel computes in f32 and rounds to f16", "[precision][cpu]") {
  one_task down(ir::op::cast, ir::dtype::f32, ir::dtype::f16, 4);
  const std::vector<float> values{1.0f, 1.0f + 0x1p-11f, 65519.0f, 70000.0f};
  std::copy(values.begin(), values.end(), down.mem.f32(0).begin());
  down.run();
  const auto h = down.half(1);
  CHECK(h[0] == 0x3c00);
  CHECK(h[1] == 0x3c00); // a tie: to the even
  CHECK(h[2] == 0x7bff); // 65504
  CHECK(h[3] == 0x7c00); // infinity: what loss scaling watches for
  one_task across(ir::op::cast, ir::dtype::f16, ir::dtype::bf16, 4);
  std::copy(h.begin(), h.end(), across.half(0).begin());
  across.run();
  CHECK(across.half(1)[0] == to_bf16(1.0f));
  CHECK(across.half(1)[3] == 0x7f80);
  constexpr std::int64_t n = 64;
  one_task k(ir::op::gelu, ir::dtype::f16, ir::dtype::f16, n);
  CHECK(k.call.staged == 2 * n);
  std::vector<float> wide(n), want(n);
  for (std::int64_t i = 0; i < n; ++i) k.half(0)[static_cast<std::size_t>(i)] = to_f16(static_cast<float>(i - 32) / 9.0f);
  widen_f16(k.half(0), wide);
  k.run();
  runtime::cpu::gelu(wide, want);
  for (std::int64_t i = 0; i < n; ++i) CHECK(k.half(1)[static_cast<std::size_t>(i)] == to_f16(want[static_cast<std::size_t>(i)]));
}

namespace {
// An mse gradient or an SGD update reading the step's loss scale (and, the update, the norm).
struct scaled_task {
  ir::graph g;
  runtime::host_arena mem;
  runtime::kernel_call call;
  runtime::kernel_settings settings;
  scaled_task(ir::op fn, std::int64_t n) {
    ir::builder b("t");
    const auto x = b.buffer("x", {n}, ir::buffer_role::param, ir::dtype::f32);
    const auto y = b.buffer("y", {n}, ir::buffer_role::activation, ir::dtype::f32);
    const auto norm = b.buffer("norm", {1}, ir::buffer_role::activation, ir::dtype::f32);
    const auto scale = b.buffer("scale", {1}, ir::buffer_role::optimizer_state, ir::dtype::f32);
    if (fn == ir::op::mse_grad) {
      const auto out = b.buffer("d", {n}, ir::buffer_role::activation, ir::dtype::f32);
      b.compute(fn, "k", {x, y, scale}, {out}, {{"global_n", n}});
    } else {
      b.compute(fn, "k", {x, y, norm, scale}, {x}, {{"n", n}});
    }
    g = std::move(b).finish();
    call = runtime::decode(g, g.tasks[0]);
    mem = runtime::host_arena(g, runtime::make_layout(g, runtime::workspace_bytes(g)));
    settings.sgd.lr = 0.5f;
  }
  void run() { runtime::run_kernel(call, mem, settings); }
};
} // namespace

TEST_CASE("the loss scale: a loss gradient multiplies by it, an update divides by it or skips on overflow",
          "[precision][cpu]") {
  constexpr std::int64_t n = 8;
  scaled_task grad(ir::op::mse_grad, n);
  CHECK(grad.call.loss_scale == 3);
  CHECK(grad.call.n_in == 2); // the kernel's own operands
  for (std::int64_t i = 0; i < n; ++i) {
    grad.mem.f32(0)[static_cast<std::size_t>(i)] = static_cast<float>(i);
    grad.mem.f32(1)[static_cast<std::size_t>(i)] = 1.0f;
  }
  grad.mem.f32(3)[0] = 1024.0f;
  grad.run();
  std::vector<float> unscaled(n);
  runtime::cpu::mse_grad(grad.mem.f32(0), grad.mem.f32(1), unscaled, grad.call.scale);
  for (std::int64_t i = 0; i < n; ++i) CHECK(grad.mem.f32(4)[static_cast<std::size_t>(i)] == 1024.0f * unscaled[static_cast<std::size_t>(i)]);

  scaled_task update(ir::op::sgd, n);
  CHECK(update.call.loss_scale == 3);
  CHECK(update.call.grad_norm_sq == 2);
  const float scale = 4096.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    update.mem.f32(0)[static_cast<std::size_t>(i)] = 1.0f;
    update.mem.f32(1)[static_cast<std::size_t>(i)] = scale * 0.25f; // the true gradient 0.25, scaled
  }
  update.mem.f32(3)[0] = scale;
  update.mem.f32(2)[0] = std::numeric_limits<float>::infinity(); // some gradient overflowed
  update.run();
  for (std::int64_t i = 0; i < n; ++i) CHECK(update.mem.f32(0)[static_cast<std::size_t>(i)] == 1.0f); // skipped
  update.mem.f32(2)[0] = std::numeric_limits<float>::quiet_NaN();
  update.run();
  CHECK(update.mem.f32(0)[0] == 1.0f);
  update.mem.f32(2)[0] = scale * scale * 0.25f * 0.25f * n; // the scaled norm², finite
  update.run();
  for (std::int64_t i = 0; i < n; ++i) CHECK(update.mem.f32(0)[static_cast<std::size_t>(i)] == 1.0f - 0.5f * 0.25f);
  // With clipping, the factor is the true norm's: ‖g‖ = 0.25·√8 ≈ 0.707, clipped to 0.5.
  update.settings.clip_norm = 0.5f;
  update.mem.f32(0)[0] = 1.0f;
  update.run();
  const double clip = 0.5 / (0.25 * std::sqrt(8.0) + 1e-6);
  CHECK(std::abs(update.mem.f32(0)[0] - (1.0 - 0.5 * 0.25 * clip)) < 1e-6);
}

TEST_CASE("the f16 span conversions (the CPU's converters where it has them) give the portable conversion's bits",
          "[precision][cpu]") {
  std::vector<std::uint16_t> every(0x10000);
  for (std::size_t i = 0; i < every.size(); ++i) every[i] = static_cast<std::uint16_t>(i);
  std::vector<float> wide(every.size());
  runtime::widen_16bit(ir::dtype::f16, every, wide);
  int widened = 0;
  for (std::size_t i = 0; i < every.size(); ++i) {
    const float want = from_f16(every[i]);
    widened += std::memcmp(&wide[i], &want, sizeof want) == 0;
  }
  CHECK(widened == 0x10000); // signalling NaNs too: both quiet them
  std::vector<float> values;
  for (std::uint32_t bits = 0; bits < 0xffffffffu - 0x10001u; bits += 0x10001u) values.push_back(std::bit_cast<float>(bits));
  for (float v : {65519.0f, 65520.0f, 0x1p-25f, 0x1.8p-25f, 1.0f + 0x1p-11f, -0.0f}) values.push_back(v);
  std::vector<std::uint16_t> rounded(values.size());
  runtime::round_to_16bit(ir::dtype::f16, values, rounded);
  int same = 0;
  for (std::size_t i = 0; i < values.size(); ++i) same += rounded[i] == to_f16(values[i]);
  CHECK(same == static_cast<int>(values.size()));
}
