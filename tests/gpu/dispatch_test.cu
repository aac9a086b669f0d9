// The GPU dispatch against the CPU dispatch (the source of truth): small graphs of every op in
// its one operand order (ir/ops.hpp) -- statistics not stored, the packed (grouped-query)
// attention gradient, i64 ids and labels, global row counts, the vocabulary-parallel
// cross-entropy at a rank's mesh coordinate, slice/concat, shard_slice, keep_one, bf16 and f16
// operands, dynamic loss scaling -- decoded once and run task by task on both from the same
// random buffers; every buffer a task writes must agree. That both dispatches have a case for every op of the table is a compile-time check
// (their run_kernel switches). Skips (exit code 4) where no GPU is visible.
#include "gpu_testing.hpp"

#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/dispatch.cuh>
#include <concerto/runtime/cuda/stream.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/float16_values.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ir = concerto::ir;
namespace rt = concerto::runtime;
namespace cu = concerto::runtime::cuda;

namespace dispatch_testing {

constexpr std::size_t blas_bytes = std::size_t{4} << 20;

// Both dispatches over one graph: equal initial buffers (f32 uniform in [-1, 1], integers
// uniform in [0, id_bound)), then every task in order on each.
struct twin {
  const ir::graph& g;
  rt::kernel_settings settings;
  rt::host_arena host;
  cu::device_arena dev;
  // Not named `stream`: with a member of that name, cudafe++ (CUDA 13.0) never finishes
  // `cu::check(cudaStreamSynchronize(stream.get()), ...)` (a front-end hang, not an error).
  cu::stream lane;
  cu::blas_handle blas;
  cu::device_buffer blas_ws{blas_bytes}, words{2 * sizeof(std::int64_t)};
  std::vector<cu::gemm> products;
  cu::dnn_handle dnn;
  bool use_cudnn = true;  // convolutions through cuDNN plans (else the own kernels)
  bool allow_tf32 = false;
  std::vector<cu::conv_plan> convs;

  twin(const ir::graph& graph, std::vector<int> coords, std::int64_t id_bound, std::uint32_t seed)
      : g(graph), host(g, rt::make_layout(g, rt::workspace_bytes(g))),
        dev(g, rt::make_layout(g, static_cast<std::int64_t>(blas_bytes) + cu::device_workspace_bytes(g), cu::device_alignment)) {
    settings.coords = std::move(coords);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> real(-1.0f, 1.0f);
    std::uniform_int_distribution<std::int64_t> id(0, id_bound - 1);
    for (const auto& b : g.buffers) {
      if (b.view_of >= 0) continue;
      auto bytes = host.bytes(b.id);
      for (std::size_t i = 0; i < bytes.size() / ir::size_of(b.type); ++i) {
        if (b.type == ir::dtype::f32) {
          const float v = real(rng);
          std::memcpy(bytes.data() + i * 4, &v, 4);
        } else if (ir::is_16bit_float(b.type)) {
          const auto v = b.type == ir::dtype::f16 ? concerto::to_f16(real(rng)) : concerto::to_bf16(real(rng));
          std::memcpy(bytes.data() + i * 2, &v, 2);
        } else if (b.type == ir::dtype::i32) {
          const auto v = static_cast<std::int32_t>(id(rng));
          std::memcpy(bytes.data() + i * 4, &v, 4);
        } else if (b.type == ir::dtype::i64) {
          const auto v = id(rng);
          std::memcpy(bytes.data() + i * 8, &v, 8);
        }
      }
      if (!bytes.empty())
        cu::check(cudaMemcpy(dev.ptr(b.id), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }

  // Returns the status word: 0 unless a kernel met a bad id. (No Catch macro in a member
  // function here: cudafe++ of CUDA 13.0 does not always finish on one.)
  int run() {
    const auto ws = cu::device_workspace_bytes(g);
    // The device's step counter holds the CPU dispatch's step (a dropout draws its mask by it).
    cu::check(cudaMemcpy(words.data() + sizeof(std::int64_t), &settings.step, sizeof settings.step, cudaMemcpyHostToDevice),
              "cudaMemcpy");
    const cu::device_context ctx{lane.get(),
                                 &blas,
                                 &dnn,
                                 blas_ws.data(),
                                 blas_bytes,
                                 reinterpret_cast<float*>(dev.scratch() + blas_bytes),
                                 words.as<int>(),
                                 reinterpret_cast<const std::int64_t*>(words.data() + sizeof(std::int64_t)),
                                 static_cast<std::size_t>(ws) / sizeof(float)};
    products.reserve(g.tasks.size());
    convs.reserve(g.tasks.size());
    for (const auto& t : g.tasks) {
      const auto call = rt::decode(g, t, settings.coords);
      rt::run_kernel(call, host, settings);
      const cu::gemm* product = nullptr;
      const cu::conv_plan* conv = nullptr;
      if (t.fn == ir::op::matmul) {
        products.push_back(cu::describe_gemm(call, dev, blas, blas_bytes));
        product = &products.back();
      }
      if (use_cudnn && cu::conv_pass_of(t.fn)) {
        convs.push_back(cu::describe_conv(call, dev, dnn, blas_bytes, allow_tf32));
        conv = &convs.back();
      }
      cu::run_kernel(call, dev, settings, ctx, product, conv);
    }
    cu::check(cudaStreamSynchronize(lane.get()), "cudaStreamSynchronize");
    int status = -1;
    cu::check(cudaMemcpy(&status, words.data(), sizeof status, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return status;
  }

  // Sets a buffer to `values` on both sides before `run` (rounded to nearest even in a 16-bit one).
  void set(ir::buffer_id b, const std::vector<float>& values) {
    const auto type = host.type(b);
    if (!ir::is_16bit_float(type)) return set_stored(b, values);
    std::vector<std::uint16_t> stored(values.size());
    rt::round_to_16bit(type, values, stored);
    set_stored(b, stored);
  }
  // Sets a buffer's stored values (of its own type) on both sides before `run`.
  template <class T>
  void set_stored(ir::buffer_id b, const std::vector<T>& values) {
    auto bytes = host.bytes(b);
    CONCERTO_CHECK(values.size() * sizeof(T) == bytes.size(), "twin::set: buffer '" + g.buffers[static_cast<std::size_t>(b)].name +
                                                                   "' holds " + std::to_string(bytes.size()) + " bytes");
    std::memcpy(bytes.data(), values.data(), bytes.size());
    cu::check(cudaMemcpy(dev.ptr(b), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  }

  // A buffer's values as f32 (a 16-bit one widened).
  std::vector<float> cpu(ir::buffer_id b) {
    if (ir::is_16bit_float(host.type(b))) {
      const auto raw = host.bytes(b);
      std::vector<std::uint16_t> h(raw.size() / 2);
      std::memcpy(h.data(), raw.data(), raw.size());
      return widened(host.type(b), h);
    }
    const auto v = host.f32(b);
    return {v.begin(), v.end()};
  }
  std::vector<float> gpu(ir::buffer_id b) const {
    if (ir::is_16bit_float(dev.type(b))) return widened(dev.type(b), dev.download<std::uint16_t>(b));
    return dev.download<float>(b);
  }
  static std::vector<float> widened(ir::dtype type, const std::vector<std::uint16_t>& h) {
    std::vector<float> out(h.size());
    rt::widen_16bit(type, h, out);
    return out;
  }

};

// Every f32 (and bf16, f16) buffer some task writes agrees; returns how many were compared.
inline std::size_t compare_written(twin& tw, float rtol = 1e-4f, float atol = 1e-5f) {
  std::set<ir::buffer_id> seen;
  for (const auto& t : tw.g.tasks)
    for (const auto b : t.writes) {
      const auto& buf = tw.g.buffers[static_cast<std::size_t>(b)];
      if ((buf.type != ir::dtype::f32 && !ir::is_16bit_float(buf.type)) || !seen.insert(b).second) continue;
      INFO("buffer '" << buf.name << "' written by '" << t.name << "'");
      gpu_testing::check_close(tw.gpu(b), tw.cpu(b), rtol, atol);
    }
  return seen.size();
}

} // namespace dispatch_testing

using dispatch_testing::twin;
using ir::op;

TEST_CASE("the DSL's layernorm forms match the CPU dispatch", "[gpu][dispatch][layernorm]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 19, cols = 300;
  ir::builder b("layernorm-dsl");
  const auto x = b.buffer("x", {rows, cols}), gamma = b.buffer("gamma", {cols}, ir::buffer_role::param),
             beta = b.buffer("beta", {cols}, ir::buffer_role::param), y = b.buffer("y", {rows, cols});
  const auto dy = b.buffer("dy", {rows, cols}), dx = b.buffer("dx", {rows, cols}), dgamma = b.buffer("dgamma", {cols}),
             dgamma_acc = b.buffer("dgamma.acc", {cols}), dbeta = b.buffer("dbeta", {cols});
  b.compute(op::layernorm, "ln", {x, gamma, beta}, {y});
  b.at(ir::phase::backward);
  b.compute(op::layernorm_grad, "ln.grad", {x, gamma, dy}, {dx});
  b.compute(op::layernorm_grad_gamma, "ln.dgamma", {x, dy}, {dgamma});
  b.compute(op::layernorm_grad_gamma, "ln.dgamma.acc", {x, dy}, {dgamma_acc}, {{"accumulate", 1}});
  b.compute(op::bias_grad, "ln.dbeta", {dy}, {dbeta});
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 21);
  CHECK(cu::device_workspace_bytes(g) >= static_cast<std::int64_t>(2 * rows * sizeof(float)));
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-3f, 1e-4f) == 5);
}

TEST_CASE("attention and its packed gradient match the CPU dispatch, grouped-query included", "[gpu][dispatch][attention]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t B = 2, T = 17, D = 8;
  for (const std::int64_t kv : {4, 2}) { // multi-head, then 2 q heads per kv head
    const std::int64_t H = 4;
    CAPTURE(kv);
    const std::map<std::string, std::int64_t> dims{{"batch", B}, {"seq", T}, {"heads", H}, {"head_dim", D},
                                                   {"kv_heads", kv}, {"group", H / kv}};
    ir::builder b("attention");
    const auto q = b.buffer("q", {B, T, H * D}), k = b.buffer("k", {B, T, kv * D}), v = b.buffer("v", {B, T, kv * D});
    const auto o = b.buffer("o", {B, T, H * D}), dy = b.buffer("dy", {B, T, H * D}),
               dqkv = b.buffer("dqkv", {B * T * (H + 2 * kv) * D});
    b.compute(op::attention, "attn", {q, k, v}, {o}, dims);
    b.at(ir::phase::backward);
    b.compute(op::attention_grad, "attn.grad", {q, k, v, dy}, {dqkv}, dims);
    const auto g = std::move(b).finish();
    twin tw(g, {}, 1, 22);
    CHECK(tw.run() == 0); // no kernel met a bad id
    CHECK(dispatch_testing::compare_written(tw, 1e-3f, 1e-4f) == 2);
  }
}

TEST_CASE("the MoE routing, dispatch, combine and their gradients match the CPU dispatch", "[gpu][dispatch][moe]") {
  CONCERTO_REQUIRE_GPU();
  // 3 groups of 9 tokens, 5 experts, top-2, capacity 3 (some tokens dropped), 12 values per token.
  const std::int64_t G = 3, S = 9, E = 5, C = 3, H = 12, T = G * S;
  const std::map<std::string, std::int64_t> dims{{"experts", E}, {"group", S}, {"capacity", C}, {"top_k", 2}};
  auto grad_dims = dims;
  grad_dims.insert({{"weight_num", 1}, {"weight_den", 10}, {"global_groups", 2 * G}});
  ir::builder b("moe");
  const auto logits = b.buffer("logits", {T, E}), gates = b.buffer("gates", {T, E}), x = b.buffer("x", {T, H});
  const auto sent = b.buffer("sent", {E, G * C, H}), y = b.buffer("y", {E, G * C, H}), out = b.buffer("out", {T, H});
  const auto dout = b.buffer("dout", {T, H}), dy_dgates = b.buffer("dy_dgates", {E * G * C * H + T * E});
  const auto dgates = b.buffer("dgates", {T, E}), dlogits = b.buffer("dlogits", {T, E}), dsent = b.buffer("dsent", {E, G * C, H}),
             dx = b.buffer("dx", {T, H});
  b.compute(op::moe_route, "route", {logits}, {gates}, dims);
  b.compute(op::moe_dispatch, "dispatch", {x, gates}, {sent}, dims);
  b.compute(op::moe_combine, "combine", {y, gates}, {out}, dims);
  b.at(ir::phase::backward);
  b.compute(op::moe_combine_grad, "combine.grad", {y, gates, dout}, {dy_dgates}, dims);
  b.compute(op::moe_route_grad, "route.grad", {logits, gates, dgates}, {dlogits}, grad_dims);
  b.compute(op::moe_dispatch_grad, "dispatch.grad", {dsent, gates}, {dx}, dims);
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 24);
  CHECK(tw.run() == 0); // every expert within its capacity
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-6f) == 6);
  // The routing dropped tokens (at most C of a group's 2·S choices per expert) and kept C per busy expert.
  const auto kept = tw.cpu(gates);
  std::size_t routed = 0;
  for (auto v : kept) routed += v != 0.0f;
  CHECK(routed <= static_cast<std::size_t>(G * E * C));
  CHECK(routed < static_cast<std::size_t>(2 * T));
}

TEST_CASE("axial attention's pieces match the CPU dispatch: attention without the mask, sigmoid, transpose",
          "[gpu][dispatch][dap]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t B = 3, T = 7, H = 2, D = 4;
  const std::map<std::string, std::int64_t> dims{{"batch", B}, {"seq", T}, {"heads", H}, {"head_dim", D}, {"causal", 0}};
  ir::builder b("axial");
  const auto q = b.buffer("q", {B, T, H * D}), k = b.buffer("k", {B, T, H * D}), v = b.buffer("v", {B, T, H * D});
  const auto o = b.buffer("o", {B, T, H * D}), dy = b.buffer("dy", {B, T, H * D}), dqkv = b.buffer("dqkv", {3 * B * T * H * D});
  const auto g = b.buffer("g", {B, T, H * D}), s = b.buffer("s", {B, T, H * D}), ds = b.buffer("ds", {B, T, H * D});
  const auto t = b.buffer("t", {T, B, H * D}), inside = b.buffer("inside", {B, H, T, D});
  b.compute(op::attention, "attn", {q, k, v}, {o}, dims);
  b.compute(op::sigmoid, "gate", {g}, {s});
  b.compute(op::transpose, "transpose", {o}, {t}, {{"rows", B}, {"cols", T}, {"inner", H * D}});
  // o [B, T, H, D] -> [B, H, T, D]: a pair inside (transpose<1>).
  b.compute(op::transpose, "transpose.inside", {o}, {inside}, {{"outer", B}, {"rows", T}, {"cols", H}, {"inner", D}});
  b.at(ir::phase::backward);
  b.compute(op::attention_grad, "attn.grad", {q, k, v, dy}, {dqkv}, dims);
  b.compute(op::sigmoid_grad, "gate.grad", {s, dy}, {ds});
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 25);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-3f, 1e-4f) == 6);
}

TEST_CASE("bf16 operands: casts, staged kernels and mixed products match the CPU dispatch", "[gpu][dispatch][bf16]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 8, cols = 16;
  ir::builder b("bf16");
  using ir::buffer_role;
  const auto x = b.buffer("x", {rows, cols}), gain = b.buffer("gain", {cols}), shift = b.buffer("shift", {cols});
  const auto xb = b.buffer("x.bf16", {rows, cols}, buffer_role::activation, ir::dtype::bf16);
  const auto w = b.buffer("w", {cols, cols}, buffer_role::activation, ir::dtype::bf16);
  const auto h = b.buffer("h", {rows, cols}, buffer_role::activation, ir::dtype::bf16);
  const auto mixed = b.buffer("mixed", {rows, cols}, buffer_role::activation, ir::dtype::bf16);
  const auto wide = b.buffer("wide", {rows, cols});
  const auto normed = b.buffer("normed", {rows, cols}, buffer_role::activation, ir::dtype::bf16);
  const auto back = b.buffer("back", {rows, cols});
  const auto shape = [&](std::int64_t n) { return ir::attr_map{{"n", n}, {"rows", rows}, {"cols", cols}}; };
  b.compute(op::cast, "cast", {x}, {xb}, shape(rows * cols));
  b.compute(op::gelu, "gelu", {xb}, {h}, shape(rows * cols));
  b.matmul("mixed", x, w, mixed, rows, cols, cols);   // an f32 and a bf16 operand, bf16 out
  b.matmul("wide", h, w, wide, rows, cols, cols);     // bf16 operands, f32 out (cuBLASLt's bf16 path)
  b.compute(op::layernorm, "layernorm", {h, gain, shift}, {normed}, shape(rows * cols));
  b.compute(op::cast, "back", {normed}, {back}, shape(rows * cols));
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 31);
  CHECK(tw.run() == 0);
  // One bf16 rounding apart at most where the two f32 kernels round differently.
  CHECK(dispatch_testing::compare_written(tw, 1e-2f, 1e-3f) == 6);
}

TEST_CASE("f16 operands: staged kernels, casts and products in place or staged match the CPU dispatch",
          "[gpu][dispatch][f16]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 8, cols = 16;
  ir::builder b("f16");
  const auto typed = [&](const char* name, std::vector<std::int64_t> shape, ir::dtype type) {
    return b.buffer(name, std::move(shape), ir::buffer_role::activation, type);
  };
  const auto x = b.buffer("x", {rows, cols}), gain = b.buffer("gain", {cols}), shift = b.buffer("shift", {cols});
  const auto xh = typed("x.f16", {rows, cols}, ir::dtype::f16), h = typed("h", {rows, cols}, ir::dtype::f16);
  const auto w = typed("w", {cols, cols}, ir::dtype::f16), wb = typed("w.bf16", {cols, cols}, ir::dtype::bf16);
  const auto normed = typed("normed", {rows, cols}, ir::dtype::f16), hb = typed("h.bf16", {rows, cols}, ir::dtype::bf16);
  const auto prod = typed("prod", {rows, cols}, ir::dtype::f16), mixed = typed("mixed", {rows, cols}, ir::dtype::f16);
  const auto crossed = typed("crossed", {rows, cols}, ir::dtype::f16);
  const auto wide = b.buffer("wide", {rows, cols}), back = b.buffer("back", {rows, cols});
  const auto shape = [&](std::int64_t n) { return ir::attr_map{{"n", n}, {"rows", rows}, {"cols", cols}}; };
  b.compute(op::cast, "cast", {x}, {xh}, shape(rows * cols));
  b.compute(op::gelu, "gelu", {xh}, {h}, shape(rows * cols));                         // elementwise, staged
  b.compute(op::layernorm, "layernorm", {h, gain, shift}, {normed}, shape(rows * cols)); // a row op, staged
  b.matmul("wide", h, w, wide, rows, cols, cols);                   // f16 inputs in place, f32 out
  b.matmul("prod", h, w, prod, rows, cols, cols);                   // f16 inputs and C in place
  b.matmul("prod.acc", xh, w, prod, rows, cols, cols, 1, false, false, true); // C += in f16
  b.matmul("mixed", h, wb, mixed, rows, cols, cols);                // f16 beside bf16: both widened, C staged
  b.compute(op::cast, "to.bf16", {h}, {hb}, shape(rows * cols));    // between the 16-bit types
  b.matmul("crossed", hb, wb, crossed, rows, cols, cols);           // bf16 inputs in place, an f16 C staged
  b.compute(op::cast, "back", {normed}, {back}, shape(rows * cols));
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 32);
  CHECK(tw.run() == 0);
  // f16 keeps 11 bits: one rounding apart at most where the two f32 kernels round differently.
  CHECK(dispatch_testing::compare_written(tw, 2e-3f, 1e-4f) == 9);
  // The staged kernel's values are the f32 kernel's on the widened input, rounded to f16.
  const auto input = tw.gpu(xh);
  std::vector<float> want(input.size());
  rt::cpu::gelu(input, want);
  for (auto& v : want) v = concerto::from_f16(concerto::to_f16(v));
  gpu_testing::check_close(tw.gpu(h), want, 1e-3f, 1e-6f);
}

TEST_CASE("bf16 operands of the native ops are read in place: no staged workspace, the staged path's values",
          "[gpu][dispatch][bf16][native]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 8, cols = 16, B = 1, T = 9, H = 4, kv = 2, D = 8;
  ir::builder b("bf16-native");
  const auto bf16 = [&](const char* name, std::vector<std::int64_t> shape) {
    return b.buffer(name, std::move(shape), ir::buffer_role::activation, ir::dtype::bf16);
  };
  // The bf16 policy's mix: activations and their gradients in bf16, statistics, losses and
  // accumulating weight gradients in f32 (ir/precision.hpp).
  const auto x = bf16("x", {rows, cols}), y = bf16("y", {rows, cols}), dy = bf16("dy", {rows, cols}), bias = bf16("bias", {cols});
  const auto gain = b.buffer("gain", {cols}, ir::buffer_role::param), shift = b.buffer("shift", {cols}, ir::buffer_role::param);
  const auto shape = ir::attr_map{{"n", rows * cols}, {"rows", rows}, {"cols", cols}};
  const std::map<std::string, std::int64_t> heads{{"batch", B}, {"seq", T}, {"heads", H}, {"head_dim", D}, {"kv_heads", kv},
                                                  {"group", H / kv}};
  const auto q = bf16("q", {B, T, H * D}), k = bf16("k", {B, T, kv * D}), v = bf16("v", {B, T, kv * D});
  const auto o = bf16("o", {B, T, H * D}), dout = bf16("do", {B, T, H * D}), dqkv = bf16("dqkv", {B * T * (H + 2 * kv) * D});
  const auto targets = b.buffer("targets", {rows}, ir::buffer_role::input, ir::dtype::i32);
  const auto loss = b.buffer("loss", {1}), dgamma = b.buffer("dgamma", {cols}), dbias = b.buffer("dbias", {cols});
  const auto dgain = b.buffer("dgain", {cols}), dtable = b.buffer("dtable", {cols, cols});
  const auto table = bf16("table", {cols, cols});
  b.compute(op::gelu, "gelu", {x}, {bf16("h", {rows, cols})}, shape);
  b.compute(op::silu, "silu", {x}, {bf16("silu", {rows, cols})}, shape);
  b.compute(op::add, "add", {x, y}, {bf16("sum", {rows, cols})}, shape);
  b.compute(op::mul, "mul", {x, y}, {bf16("prod", {rows, cols})}, shape);
  b.compute(op::swiglu, "swiglu", {x, y}, {bf16("swiglu", {rows, cols})}, shape);
  b.compute(op::bias_add, "bias_add", {x, bias}, {bf16("biased", {rows, cols})}, shape);
  b.compute(op::softmax, "softmax", {x}, {bf16("softmax", {rows, cols})}, shape);
  b.compute(op::layernorm, "layernorm", {x, gain, shift}, {bf16("ln", {rows, cols})});
  b.compute(op::rmsnorm, "rmsnorm", {x, gain}, {bf16("rms", {rows, cols})});
  b.compute(op::attention, "attention", {q, k, v}, {o}, heads);
  b.compute(op::embedding, "embedding", {targets, table}, {bf16("emb", {rows, cols})}, {{"hidden", cols}});
  b.compute(op::tanh, "tanh", {x}, {bf16("tanh", {rows, cols})}, shape); // not native: staged
  b.at(ir::phase::backward);
  b.compute(op::gelu_grad, "gelu.grad", {x, dy}, {bf16("dx", {rows, cols})}, shape);
  b.compute(op::layernorm_grad, "layernorm.grad", {x, gain, dy}, {bf16("dln", {rows, cols})});
  b.compute(op::layernorm_grad_gamma, "layernorm.dgamma", {x, dy}, {dgamma}, {{"accumulate", 1}});
  b.compute(op::rmsnorm_grad, "rmsnorm.grad", {x, gain, dy}, {bf16("drms", {rows, cols})});
  b.compute(op::rmsnorm_grad_gain, "rmsnorm.dgain", {x, dy}, {dgain});
  b.compute(op::bias_grad, "bias.grad", {dy}, {dbias}, shape);
  b.compute(op::attention_grad, "attention.grad", {q, k, v, dout}, {dqkv}, heads);
  b.compute(op::cross_entropy, "ce", {x, targets}, {loss});
  b.compute(op::cross_entropy_grad, "ce.grad", {x, targets}, {bf16("dlogits", {rows, cols})});
  b.compute(op::embedding_grad, "embedding.grad", {targets, dy}, {dtable}, {{"hidden", cols}});
  const auto g = std::move(b).finish();
  for (const auto& t : g.tasks) {
    if (ir::is_collective(t.kind) || !ir::info(t.fn).executable) continue;
    const auto call = rt::decode(g, t, std::vector<int>{});
    INFO("task '" << t.name << "'");
    REQUIRE(call.staged > 0);
    const auto staged = cu::device_workspace_floats(call, false) - cu::device_kernel_workspace_floats(call, false);
    CHECK((staged == 0) == cu::reads_16bit_natively(t.fn));
  }
  twin tw(g, {}, cols, 33);
  CHECK(tw.run() == 0);
  // The CPU dispatch stages (widens, runs f32, rounds): one bf16 rounding apart at most.
  CHECK(dispatch_testing::compare_written(tw, 1e-2f, 1e-3f) == 22);
}

TEST_CASE("the cast between f32 and f16 rounds to nearest even, to infinity from 65520, and widens exactly",
          "[gpu][dispatch][f16][cast]") {
  CONCERTO_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  // value, its f16 bits: the largest finite value and the overflow threshold, ties to even in
  // the normal and subnormal ranges, the smallest subnormal and half of it, signs, NaN.
  const std::vector<std::pair<float, std::uint16_t>> edges{
      {65504.0f, 0x7bff},        {std::nextafter(65520.0f, 0.0f), 0x7bff}, {65520.0f, 0x7c00},   {-65520.0f, 0xfc00},
      {1e6f, 0x7c00},            {inf, 0x7c00},                            {-inf, 0xfc00},       {1.0f + 0x1p-11f, 0x3c00},
      {1.0f + 0x3p-11f, 0x3c02}, {0.1f, 0x2e66},                           {0x1p-14f, 0x0400},   {0x1p-24f, 0x0001},
      {0x1p-25f, 0x0000},        {0x1.8p-25f, 0x0001},                     {0x5p-25f, 0x0002},   {0x7p-25f, 0x0004},
      {0x7ffp-25f, 0x0400},      {-0.0f, 0x8000},                          {-2.5f, 0xc100}};
  const auto n = static_cast<std::int64_t>(edges.size() + 1), every = std::int64_t{1} << 16;
  ir::builder b("f16-cast");
  const auto x = b.buffer("x", {n}), back = b.buffer("back", {n}), wide = b.buffer("wide", {every});
  const auto xh = b.buffer("x.f16", {n}, ir::buffer_role::activation, ir::dtype::f16);
  const auto all = b.buffer("all", {every}, ir::buffer_role::activation, ir::dtype::f16);
  const auto again = b.buffer("again", {every}, ir::buffer_role::activation, ir::dtype::f16);
  b.compute(op::cast, "narrow", {x}, {xh});
  b.compute(op::cast, "widen", {xh}, {back});
  b.compute(op::cast, "widen.all", {all}, {wide});
  b.compute(op::cast, "narrow.all", {wide}, {again});
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 33);
  std::vector<float> values;
  for (const auto& [v, bits] : edges) values.push_back(v);
  values.push_back(std::numeric_limits<float>::quiet_NaN());
  tw.set(x, values);
  std::vector<std::uint16_t> patterns(static_cast<std::size_t>(every));
  for (std::size_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<std::uint16_t>(i);
  tw.set_stored(all, patterns);
  CHECK(tw.run() == 0);
  const auto got = tw.dev.download<std::uint16_t>(xh);
  const auto widened = tw.gpu(back);
  for (std::size_t i = 0; i < edges.size(); ++i) {
    INFO("f32 " << edges[i].first);
    CHECK(got[i] == edges[i].second);
    CHECK(std::bit_cast<std::uint32_t>(widened[i]) == std::bit_cast<std::uint32_t>(concerto::from_f16(edges[i].second)));
  }
  CHECK((got.back() & 0x7c00) == 0x7c00); // NaN stays NaN
  CHECK((got.back() & 0x03ff) != 0);
  CHECK(std::isnan(widened.back()));
  // Every f16 value widens exactly (as core/float16.hpp does) and rounds back to itself; a NaN
  // stays a NaN (a signalling one comes back quiet).
  const auto all_wide = tw.gpu(wide);
  const auto round_trip = tw.dev.download<std::uint16_t>(again);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    const auto h = patterns[i];
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
    wrong += std::bit_cast<std::uint32_t>(all_wide[i]) != std::bit_cast<std::uint32_t>(concerto::from_f16(h));
    wrong += nan ? !std::isnan(concerto::from_f16(round_trip[i])) : round_trip[i] != h;
  }
  CHECK(wrong == 0);
  for (const auto id : {xh, back, wide, again}) { // the CPU dispatch's bits, NaNs included
    INFO("buffer '" << graph.buffers[static_cast<std::size_t>(id)].name << "'");
    const auto cpu = tw.host.bytes(id);
    CHECK(tw.dev.download<std::uint8_t>(id) == std::vector<std::uint8_t>(reinterpret_cast<const std::uint8_t*>(cpu.data()),
                                                                         reinterpret_cast<const std::uint8_t*>(cpu.data() + cpu.size())));
  }
}

TEST_CASE("loss gradients under dynamic loss scaling are the scale times the unscaled ones, as on the CPU",
          "[gpu][dispatch][loss_scale]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 13, classes = 20, n = 300;
  const std::int64_t G = 2, S = 6, E = 4, T = G * S;
  const float scale = 1024.0f;
  ir::builder b("loss-scaled gradients");
  const int tp = b.axis("tp", 2);
  const auto loss_scale = b.buffer(std::string(ir::loss_scale_buffer), {1}, ir::buffer_role::input);
  const auto logits = b.buffer("logits", {rows, classes}), targets = b.buffer("targets", {rows}, ir::buffer_role::input, ir::dtype::i64);
  const auto dl = b.buffer("dlogits", {rows, classes}), dl_s = b.buffer("dlogits.scaled", {rows, classes});
  const auto pred = b.buffer("pred", {n}), target = b.buffer("target", {n}), dp = b.buffer("dpred", {n}),
             dp_s = b.buffer("dpred.scaled", {n});
  const auto mx = b.buffer("max", {rows}), sumexp = b.buffer("sumexp", {rows}), dv = b.buffer("dvocab", {rows, classes}),
             dv_s = b.buffer("dvocab.scaled", {rows, classes});
  const auto route_logits = b.buffer("route.logits", {T, E}), gates = b.buffer("gates", {T, E}), dgates = b.buffer("dgates", {T, E});
  const auto dgates_s = b.buffer("dgates.scaled", {T, E}), dr = b.buffer("droute", {T, E}), dr_s = b.buffer("droute.scaled", {T, E});
  const ir::attr_map ce{{"global_rows", 2 * rows}, {"dloss_num", 1}, {"dloss_den", 3}};
  const ir::attr_map mse{{"global_n", 2 * n}, {"dloss_num", 2}, {"dloss_den", 5}};
  const ir::attr_map vocab{{"cols", classes}, {"vocab_axis", tp}, {"global_rows", 2 * rows}, {"dloss_num", 1}, {"dloss_den", 2}};
  const ir::attr_map route{{"experts", E}, {"group", S}, {"capacity", 3}, {"top_k", 2}};
  auto route_grad = route;
  route_grad.insert({{"weight_num", 1}, {"weight_den", 10}, {"global_groups", 2 * G}});
  b.compute(op::vocab_ce_max, "vocab.max", {logits}, {mx}, {{"cols", classes}});
  b.compute(op::vocab_ce_sumexp, "vocab.sumexp", {logits, mx}, {sumexp}, {{"cols", classes}});
  b.compute(op::moe_route, "route", {route_logits}, {gates}, route);
  b.at(ir::phase::backward);
  b.compute(op::cross_entropy_grad, "ce.grad", {logits, targets}, {dl}, ce);
  b.compute(op::cross_entropy_grad, "ce.grad.scaled", {logits, targets, loss_scale}, {dl_s}, ce);
  b.compute(op::mse_grad, "mse.grad", {pred, target}, {dp}, mse);
  b.compute(op::mse_grad, "mse.grad.scaled", {pred, target, loss_scale}, {dp_s}, mse);
  b.compute(op::vocab_ce_grad, "vocab.grad", {logits, targets, mx, sumexp}, {dv}, vocab);
  b.compute(op::vocab_ce_grad, "vocab.grad.scaled", {logits, targets, mx, sumexp, loss_scale}, {dv_s}, vocab);
  // The routing's gradient reads gate gradients that are already scaled; it scales the balance
  // loss's part, so that the whole is the scale times the unscaled gradient.
  b.compute(op::scale, "dgates.scale", {dgates}, {dgates_s}, {{"num", static_cast<std::int64_t>(scale)}, {"den", 1}});
  b.compute(op::moe_route_grad, "route.grad", {route_logits, gates, dgates}, {dr}, route_grad);
  b.compute(op::moe_route_grad, "route.grad.scaled", {route_logits, gates, dgates_s, loss_scale}, {dr_s}, route_grad);
  const auto graph = std::move(b).finish();
  twin tw(graph, {0}, classes, 34);
  tw.set(loss_scale, {scale});
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-6f) == 12);
  for (const auto& [plain, scaled] : {std::pair{dl, dl_s}, std::pair{dp, dp_s}, std::pair{dv, dv_s}, std::pair{dr, dr_s}}) {
    INFO("buffer '" << graph.buffers[static_cast<std::size_t>(scaled)].name << "'");
    auto want = tw.gpu(plain);
    for (auto& v : want) v *= scale;
    gpu_testing::check_close(tw.gpu(scaled), want, 1e-6f, 0.0f);
  }
}

TEST_CASE("updates under dynamic loss scaling apply the unscaled gradient, and skip an overflowed step",
          "[gpu][dispatch][loss_scale]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t n = 257;
  const float scale = 1024.0f, norm_sq = 4.0f; // a gradient norm of 2: clipping to 1 halves it
  ir::builder b("loss-scaled updates");
  const auto loss_scale = b.buffer(std::string(ir::loss_scale_buffer), {1}, ir::buffer_role::input);
  struct update {
    std::string name;
    ir::buffer_id p, g, m, v, norm;
  };
  const auto make = [&](const std::string& name) {
    const auto state = ir::buffer_role::optimizer_state;
    return update{name, b.buffer(name + ".p", {n}, ir::buffer_role::param), b.buffer(name + ".g", {n}, ir::buffer_role::gradient),
                  b.buffer(name + ".m", {n}, state), b.buffer(name + ".v", {n}, state), b.buffer(name + ".norm_sq", {1})};
  };
  // AdamW and SGD with momentum: on unscaled gradients with clipping, on scaled ones with the
  // scale, and on scaled ones whose norm overflowed (inf for AdamW, NaN for SGD).
  const auto adam = make("adam"), adam_s = make("adam.scaled"), adam_o = make("adam.overflowed");
  const auto sgd = make("sgd"), sgd_s = make("sgd.scaled"), sgd_o = make("sgd.overflowed");
  b.at(ir::phase::optimizer);
  b.compute(op::adamw, "adamw", {adam.p, adam.g, adam.m, adam.v, adam.norm}, {adam.p, adam.m, adam.v});
  for (const auto& u : {adam_s, adam_o})
    b.compute(op::adamw, u.name, {u.p, u.g, u.m, u.v, u.norm, loss_scale}, {u.p, u.m, u.v});
  b.compute(op::sgd, "sgd", {sgd.p, sgd.g, sgd.norm}, {sgd.p, sgd.m});
  for (const auto& u : {sgd_s, sgd_o}) b.compute(op::sgd, u.name, {u.p, u.g, u.norm, loss_scale}, {u.p, u.m});
  const auto graph = std::move(b).finish();
  for (const float clip : {1.0f, 0.0f}) {
    DYNAMIC_SECTION("clip_norm " << clip) {
      twin tw(graph, {}, 1, 35);
      tw.settings.clip_norm = clip;
      tw.settings.sgd.momentum = 0.9f;
      tw.set(loss_scale, {scale});
      // Every update of a kind starts from the same parameter and state; v is non-negative.
      for (const auto& [first, others] : {std::pair{adam, std::vector{adam_s, adam_o}}, std::pair{sgd, std::vector{sgd_s, sgd_o}}}) {
        auto v = tw.cpu(first.v);
        for (auto& x : v) x = std::abs(x);
        tw.set(first.v, v);
        tw.set(first.norm, {norm_sq});
        auto scaled = tw.cpu(first.g);
        for (auto& x : scaled) x *= scale;
        for (const auto& u : others) {
          for (const auto& [to, from] : {std::pair{u.p, first.p}, std::pair{u.m, first.m}, std::pair{u.v, first.v}})
            tw.set(to, tw.cpu(from));
          tw.set(u.g, scaled);
          tw.set(u.norm, {norm_sq * scale * scale});
        }
      }
      tw.set(adam_o.norm, {std::numeric_limits<float>::infinity()});
      tw.set(sgd_o.norm, {std::numeric_limits<float>::quiet_NaN()});
      std::vector<std::vector<float>> before;
      for (const auto& u : {adam_o, sgd_o})
        for (const auto id : {u.p, u.m, u.v}) before.push_back(tw.gpu(id));
      CHECK(tw.run() == 0);
      CHECK(dispatch_testing::compare_written(tw, 1e-5f, 1e-7f) == 15);
      // With a power-of-two scale the unscaling is exact: the same update as the unscaled one.
      for (const auto& [plain, scaled] : {std::pair{adam, adam_s}, std::pair{sgd, sgd_s}})
        for (const auto& [a, s] : {std::pair{plain.p, scaled.p}, std::pair{plain.m, scaled.m}, std::pair{plain.v, scaled.v}}) {
          INFO("buffer '" << graph.buffers[static_cast<std::size_t>(s)].name << "'");
          if (a == sgd.v) continue; // SGD keeps no second moment
          gpu_testing::check_close(tw.gpu(s), tw.gpu(a), 1e-6f, 0.0f);
        }
      // An overflowed step writes nothing: parameter and state bit for bit as they were.
      std::size_t k = 0;
      for (const auto& u : {adam_o, sgd_o})
        for (const auto id : {u.p, u.m, u.v}) {
          INFO("buffer '" << graph.buffers[static_cast<std::size_t>(id)].name << "'");
          CHECK(tw.gpu(id) == before[k++]);
        }
    }
  }
}

TEST_CASE("tanh, a table broadcast over rows and their gradients match the CPU dispatch", "[gpu][dispatch][tanh]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t n = 1000;
  ir::builder b("tanh");
  const auto x = b.buffer("x", {n}), y = b.buffer("y", {n}), dy = b.buffer("dy", {n}), dx = b.buffer("dx", {n});
  b.compute(op::tanh, "tanh", {x}, {y});
  b.at(ir::phase::backward);
  b.compute(op::tanh_grad, "tanh.grad", {y, dy}, {dx});
  // A table of the last dim broadcast over the rows: the product and the table's gradient.
  const std::int64_t rows = 8, cols = n / rows;
  const auto table = b.buffer("table", {cols}), scaled = b.buffer("scaled", {rows, cols}), dtable = b.buffer("dtable", {cols});
  b.at(ir::phase::forward);
  b.compute(op::scale_table, "scale", {x, table}, {scaled});
  b.at(ir::phase::backward);
  b.compute(op::scale_table_grad, "scale.dtable", {x, dy}, {dtable});
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 29);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-5f, 1e-6f) == 4);
}

namespace dispatch_testing {
// Forward, both gradients and an accumulated kernel gradient of three convolutions: strides,
// padding, a pointwise kernel. Returns the graph and the number of buffers it writes.
inline std::pair<ir::graph, std::size_t> conv_graph() {
  struct shape {
    std::int64_t batch, height, width, in, out, kernel, stride, padding;
  };
  ir::builder b("conv");
  std::size_t written = 0;
  for (const auto& s : {shape{2, 7, 6, 3, 5, 3, 2, 1}, shape{1, 5, 5, 4, 2, 1, 1, 0}, shape{2, 6, 6, 2, 3, 5, 1, 2}}) {
    const ir::conv_geometry g{s.batch, s.height, s.width, s.in, s.out, s.kernel, s.kernel, s.stride, s.padding};
    const std::string at = std::to_string(written);
    const auto x = b.buffer("x" + at, {g.batch, g.height, g.width, g.in_channels});
    const auto w = b.buffer("w" + at, {g.kernel_h, g.kernel_w, g.in_channels, g.out_channels});
    const auto y = b.buffer("y" + at, {g.batch, g.out_h(), g.out_w(), g.out_channels});
    const auto dy = b.buffer("dy" + at, {g.batch, g.out_h(), g.out_w(), g.out_channels});
    const auto dx = b.buffer("dx" + at, {g.batch, g.height, g.width, g.in_channels});
    const auto dw = b.buffer("dw" + at, {g.kernel_h, g.kernel_w, g.in_channels, g.out_channels});
    const ir::attr_map attrs = g.attrs();
    auto accumulated = attrs;
    accumulated["accumulate"] = 1;
    b.at(ir::phase::forward);
    b.compute(op::conv2d, "conv" + at, {x, w}, {y}, attrs);
    b.at(ir::phase::backward);
    b.compute(op::conv2d_grad_input, "conv.dx" + at, {dy, w}, {dx}, attrs);
    b.compute(op::conv2d_grad_weight, "conv.dw" + at, {x, dy}, {dw}, attrs);
    b.compute(op::conv2d_grad_weight, "conv.dw+" + at, {x, y}, {dw}, accumulated); // a second micro-batch's sum
    written += 3;
  }
  return {std::move(b).finish(), written};
}
} // namespace dispatch_testing

TEST_CASE("conv2d and its gradients match the CPU dispatch: strides, padding, a pointwise kernel, accumulation",
          "[gpu][dispatch][conv2d]") {
  CONCERTO_REQUIRE_GPU();
  const auto [graph, written] = dispatch_testing::conv_graph();
  SECTION("the own kernels") {
    twin tw(graph, {}, 1, 37);
    tw.use_cudnn = false;
    CHECK(tw.run() == 0);
    CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == written);
  }
  SECTION("cuDNN plans, the kernel described as HWIO by strides") {
    twin tw(graph, {}, 1, 37);
    CHECK(tw.run() == 0);
    CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == written);
    for (const auto& plan : tw.convs) CHECK(static_cast<bool>(plan));
  }
#ifdef CONCERTO_CUDA_EMULATION
  // What only the emulated cuDNN can be made to do: engines that refuse a strided kernel (the
  // kernel then goes to cuDNN as KRSC, staged by a transpose), none at all, and TF32 allowed.
  auto& emulated = cudnn_emulation::settings;
  const auto before = emulated.executions;
  SECTION("engines that take only a packed KRSC kernel: staged, its gradient transposed back and accumulated") {
    emulated.packed_filters_only = true;
    twin tw(graph, {}, 1, 37);
    CHECK(tw.run() == 0);
    emulated.packed_filters_only = false;
    CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == written);
    for (const auto& plan : tw.convs) CHECK(plan.filter() == cu::filter_layout::krsc);
    CHECK(emulated.executions - before == static_cast<long long>(tw.convs.size()));
  }
  SECTION("without an engine the own kernels run, and the plan says why") {
    emulated.no_engines = true;
    twin tw(graph, {}, 1, 37);
    CHECK(tw.run() == 0);
    emulated.no_engines = false;
    CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == written);
    CHECK(emulated.executions == before);
    REQUIRE_FALSE(tw.convs.empty());
    CHECK_THAT(tw.convs.front().reason(), Catch::Matchers::ContainsSubstring("no engine for a HWIO filter") &&
                                              Catch::Matchers::ContainsSubstring("no TF32"));
  }
  SECTION("the heuristic's first engine is a TF32 one: taken only when allowed (its rounding shows at 1e-4)") {
    twin strict(graph, {}, 1, 37);
    CHECK(strict.run() == 0);
    twin fast(graph, {}, 1, 37);
    fast.allow_tf32 = true;
    CHECK(fast.run() == 0);
    CHECK(dispatch_testing::compare_written(fast, 5e-2f, 5e-3f) == written);
    double worst = 0;
    for (const auto& t : graph.tasks)
      for (const auto b : t.writes) {
        const auto a = strict.gpu(b), f = fast.gpu(b);
        for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - f[i]));
      }
    CHECK(worst > 1e-5); // the TF32 engine ran
  }
#endif
}

TEST_CASE("max and average pooling and their gradients match the CPU dispatch: overlapping, padded and disjoint windows",
          "[gpu][dispatch][pooling]") {
  CONCERTO_REQUIRE_GPU();
  ir::builder b("pool");
  int written = 0;
  // batch, height, width, channels, window, stride, padding
  for (const auto& g : {ir::conv_geometry{2, 7, 6, 3, 3, 3, 3, 2, 1}, ir::conv_geometry{1, 6, 6, 4, 4, 2, 2, 2, 0},
                        ir::conv_geometry{2, 5, 5, 2, 2, 3, 3, 1, 1}}) {
    const std::string at = std::to_string(written);
    const auto x = b.buffer("x" + at, {g.batch, g.height, g.width, g.in_channels});
    const auto dy = b.buffer("dy" + at, {g.batch, g.out_h(), g.out_w(), g.in_channels});
    const auto ym = b.buffer("ymax" + at, {g.batch, g.out_h(), g.out_w(), g.in_channels});
    const auto ya = b.buffer("yavg" + at, {g.batch, g.out_h(), g.out_w(), g.in_channels});
    const auto dxm = b.buffer("dxmax" + at, {g.batch, g.height, g.width, g.in_channels});
    const auto dxa = b.buffer("dxavg" + at, {g.batch, g.height, g.width, g.in_channels});
    b.at(ir::phase::forward);
    b.compute(op::max_pool, "max" + at, {x}, {ym}, g.attrs());
    b.compute(op::avg_pool, "avg" + at, {x}, {ya}, g.attrs());
    b.at(ir::phase::backward);
    b.compute(op::max_pool_grad, "max.dx" + at, {x, dy}, {dxm}, g.attrs());
    b.compute(op::avg_pool_grad, "avg.dx" + at, {dy}, {dxa}, g.attrs());
    written += 4;
  }
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 43);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-5f, 1e-6f) == static_cast<std::size_t>(written));
}

TEST_CASE("concat and slice along a dim and their gradients match the CPU dispatch, repeated tables included",
          "[gpu][dispatch][parts]") {
  CONCERTO_REQUIRE_GPU();
  ir::builder b("parts");
  int written = 0;
  // lead, outer, extent, inner, the first part's length, which parts are repeated
  for (const auto& g : {ir::dim_part{1, 3, 5, 4, 0, 2, 0}, ir::dim_part{4, 1, 9, 6, 0, 1, 1}, ir::dim_part{2, 3, 4, 2, 0, 3, 2}}) {
    const std::string at = std::to_string(written);
    const auto rest = g.extent - g.length;
    const auto a = b.buffer("a" + at, {g.part_values(g.length, 0)}), c = b.buffer("b" + at, {g.part_values(rest, 1)});
    const auto out = b.buffer("out" + at, {g.whole_values()}), dy = b.buffer("dy" + at, {g.whole_values()});
    const auto da = b.buffer("da" + at, {g.part_values(g.length, 0)}), db = b.buffer("db" + at, {g.part_values(rest, 1)});
    const auto part = b.buffer("part" + at, {g.lead * g.outer * rest * g.inner});
    const auto dx = b.buffer("dx" + at, {g.whole_values()});
    const ir::dim_part first{g.lead, g.outer, g.extent, g.inner, 0, g.length, g.broadcast & 1};
    const ir::dim_part second{g.lead, g.outer, g.extent, g.inner, g.length, rest, g.broadcast >> 1};
    const ir::dim_part tail{g.lead, g.outer, g.extent, g.inner, g.length, rest, 0};
    b.at(ir::phase::forward);
    b.compute(op::concat_dim, "concat" + at, {a, c}, {out}, g.attrs());
    b.compute(op::slice_dim, "slice" + at, {dy}, {part}, tail.attrs());
    b.at(ir::phase::backward);
    b.compute(op::concat_dim_grad, "concat.da" + at, {dy}, {da}, first.attrs());
    b.compute(op::concat_dim_grad, "concat.db" + at, {dy}, {db}, second.attrs());
    b.compute(op::slice_dim_grad, "slice.dx" + at, {part}, {dx}, tail.attrs());
    written += 5;
  }
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 47);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-6f, 1e-7f) == static_cast<std::size_t>(written));
}

TEST_CASE("dropout and its gradient match the CPU dispatch: the same mask from the step on the device", "[gpu][dispatch][dropout]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 37, cols = 29;
  ir::builder b("dropout");
  const auto x = b.buffer("x", {rows, cols}), y = b.buffer("y", {rows, cols});
  const auto dy = b.buffer("dy", {rows, cols}), dx = b.buffer("dx", {rows, cols});
  const ir::attr_map attrs{{"num", ir::fraction_den / 3}, {"den", ir::fraction_den}, {"seed", 12345}, {"rank", 2},
                           {"local0", rows},          {"global0", rows},          {"local1", cols}, {"global1", cols}};
  b.compute(op::dropout, "dropout", {x}, {y}, attrs);
  b.at(ir::phase::backward);
  b.compute(op::dropout_grad, "dropout.grad", {dy}, {dx}, attrs);
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 53);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-6f, 1e-7f) == 2);
}

TEST_CASE("sums and means over one dim and their gradients match the CPU dispatch", "[gpu][dispatch][sum_dim]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t outer = 3, extent = 7, inner = 5;
  ir::builder b("sum_dim");
  const auto x = b.buffer("x", {outer, extent, inner}), s = b.buffer("s", {outer, inner}), m = b.buffer("m", {outer, inner});
  const auto dy = b.buffer("dy", {outer, inner}), ds = b.buffer("ds", {outer, extent, inner}), dm = b.buffer("dm", {outer, extent, inner});
  const ir::attr_map sum{{"outer", outer}, {"extent", extent}, {"inner", inner}, {"num", 1}, {"den", 1}};
  const ir::attr_map mean{{"outer", outer}, {"extent", extent}, {"inner", inner}, {"num", 1}, {"den", 2 * extent}};
  b.compute(op::sum_dim, "sum", {x}, {s}, sum);
  b.compute(op::mean_dim, "mean", {x}, {m}, mean);
  b.at(ir::phase::backward);
  b.compute(op::sum_dim_grad, "sum.grad", {dy}, {ds}, sum);
  b.compute(op::mean_dim_grad, "mean.grad", {dy}, {dm}, mean);
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 41);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-5f, 1e-6f) == 4);
}

TEST_CASE("batch normalisation's tasks match the CPU dispatch", "[gpu][dispatch][batchnorm]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 37, cols = 6;
  ir::builder b("batchnorm");
  const auto x = b.buffer("x", {rows, cols}), gamma = b.buffer("gamma", {cols}), beta = b.buffer("beta", {cols});
  const auto sums = b.buffer("sums", {2, cols}), scale = b.buffer("scale", {3, cols}), y = b.buffer("y", {rows, cols});
  const auto dy = b.buffer("dy", {rows, cols}), grad_sums = b.buffer("grad_sums", {2, cols}), dx = b.buffer("dx", {rows, cols});
  const ir::attr_map attrs{{"rows", rows}, {"cols", cols}, {"count", rows}};
  b.compute(op::batchnorm_stats, "stats", {x}, {sums}, attrs);
  b.compute(op::batchnorm_scale, "scale", {sums, gamma}, {scale}, attrs);
  b.compute(op::batchnorm, "norm", {x, scale, beta}, {y}, attrs);
  b.at(ir::phase::backward);
  b.compute(op::batchnorm_grad_stats, "grad_stats", {x, scale, dy}, {grad_sums}, attrs);
  b.compute(op::batchnorm_grad, "grad", {x, scale, grad_sums, dy}, {dx}, attrs);
  // The running statistics (a random mean, a positive variance) moved by the batch's, and the
  // evaluation's scale from them.
  const auto running = b.buffer("running", {2, cols}), eval_scale = b.buffer("eval_scale", {3, cols});
  auto track = attrs;
  track["num"] = ir::fraction_den / 10;
  track["den"] = ir::fraction_den;
  b.compute(op::batchnorm_track, "track", {sums, running}, {running}, track);
  auto from_running = attrs;
  from_running["running"] = 1;
  b.compute(op::batchnorm_scale, "eval_scale", {running, gamma}, {eval_scale}, from_running);
  const auto graph = std::move(b).finish();
  twin tw(graph, {}, 1, 43);
  CHECK(tw.run() == 0);
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == 7);
}

TEST_CASE("losses over global counts with i64 targets match the CPU dispatch", "[gpu][dispatch][loss]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 33, classes = 70, n = 1000;
  ir::builder b("losses");
  const auto logits = b.buffer("logits", {rows, classes}), targets = b.buffer("targets", {rows}, ir::buffer_role::input, ir::dtype::i64);
  const auto loss = b.buffer("loss", {1}), dlogits = b.buffer("dlogits", {rows, classes}),
             dlogits2 = b.buffer("dlogits.saved", {rows, classes});
  const auto pred = b.buffer("pred", {n}), target = b.buffer("target", {n}), mse_loss = b.buffer("mse.loss", {1}),
             dpred = b.buffer("dpred", {n}), loss2 = b.buffer("loss.local", {1});
  b.at(ir::phase::backward);
  // No lse stored: the backward recomputes it.
  b.compute(op::cross_entropy, "ce", {logits, targets}, {loss}, {{"global_rows", 4 * rows}});
  b.compute(op::cross_entropy_grad, "ce.grad", {logits, targets}, {dlogits},
            {{"global_rows", 4 * rows}, {"dloss_num", 1}, {"dloss_den", 3}});
  b.compute(op::cross_entropy, "ce.local", {logits, targets}, {loss2}); // the mean over this rank's rows
  b.compute(op::cross_entropy_grad, "ce.local.grad", {logits, targets}, {dlogits2});
  b.compute(op::mse, "mse", {pred, target}, {mse_loss}, {{"global_n", 2 * n}});
  b.compute(op::mse_grad, "mse.grad", {pred, target}, {dpred}, {{"global_n", 2 * n}, {"dloss_num", 2}, {"dloss_den", 5}});
  const auto g = std::move(b).finish();
  twin tw(g, {}, classes, 23);
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-6f) == 6);
  // The share is applied: a quarter of the full mean on both.
  CHECK(std::abs(tw.gpu(loss)[0] - tw.gpu(loss2)[0] / 4.0f) <= 1e-5f * std::abs(tw.gpu(loss2)[0]));
}

TEST_CASE("the vocabulary-parallel cross-entropy and embedding match the CPU dispatch at each coordinate",
          "[gpu][dispatch][vocab]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 29, cols = 40, vocab = 40, hidden = 24, tokens = 37;
  ir::builder b("vocab-parallel");
  const int tp = b.axis("tp", 2);
  const auto logits = b.buffer("logits", {rows, cols}), labels = b.buffer("labels", {rows}, ir::buffer_role::input, ir::dtype::i64);
  const auto mx = b.buffer("max", {rows}), target = b.buffer("target", {rows}), sumexp = b.buffer("sumexp", {rows});
  const auto loss = b.buffer("loss", {1}), dlogits = b.buffer("dlogits", {rows, cols});
  const auto table = b.buffer("wte", {vocab, hidden}, ir::buffer_role::param),
             ids = b.buffer("ids", {tokens}, ir::buffer_role::input, ir::dtype::i64), emb = b.buffer("emb", {tokens, hidden});
  const auto demb = b.buffer("demb", {tokens, hidden}), dtable = b.buffer("wte.grad", {vocab, hidden}, ir::buffer_role::gradient);
  const std::map<std::string, std::int64_t> vocab_attrs{{"vocab_axis", tp}, {"vocab", vocab}, {"hidden", hidden}};
  b.compute(op::embedding, "embed", {ids, table}, {emb}, vocab_attrs);
  b.at(ir::phase::backward);
  b.compute(op::vocab_ce_max, "ce.max", {logits}, {mx}, {{"cols", cols}});
  b.compute(op::vocab_ce_sumexp, "ce.sumexp", {logits, mx}, {sumexp}, {{"cols", cols}});
  b.compute(op::vocab_ce_target, "ce.target", {logits, labels, mx}, {target}, {{"cols", cols}, {"vocab_axis", tp}});
  b.compute(op::vocab_ce_loss, "ce.loss", {sumexp, target}, {loss}, {{"global_rows", 2 * rows}});
  b.compute(op::vocab_ce_grad, "ce.grad", {logits, labels, mx, sumexp}, {dlogits},
            {{"cols", cols}, {"vocab_axis", tp}, {"global_rows", 2 * rows}, {"dloss_num", 1}, {"dloss_den", 2}});
  b.compute(op::embedding_grad, "embed.grad", {ids, demb}, {dtable}, vocab_attrs);
  const auto g = std::move(b).finish();
  // Labels and ids over the whole vocabulary of both ranks (2·cols = 2·vocab): some rows'
  // labels are this rank's, some the other's.
  for (const int coord : {0, 1}) {
    DYNAMIC_SECTION("at coordinate " << coord << " of 2") {
      twin tw(g, {coord}, 2 * vocab, 24);
      CHECK(tw.run() == 0); // no kernel met a bad id
      CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == 7);
      const auto t = tw.gpu(target);
      std::size_t mine = 0;
      for (const auto v : t) mine += v != 0.0f;
      CHECK(mine > 0);
      CHECK(mine < t.size());
    }
  }
}

TEST_CASE("slices, concats, shard_slice and keep_one match the CPU dispatch", "[gpu][dispatch][layout]") {
  CONCERTO_REQUIRE_GPU();
  ir::builder b("layout");
  const int ax = b.axis("sp", 2);
  const auto whole = b.buffer("whole", {4, 6, 5}), other = b.buffer("other", {4, 3, 5});
  const auto part = b.buffer("part", {4, 3, 5}), joined = b.buffer("joined", {4, 6, 5}), dim_part = b.buffer("dim.part", {4, 2, 5});
  const auto shard = b.buffer("shard", {4, 3, 5}), kept = b.buffer("kept", {4, 6, 5});
  const auto wide = b.buffer("wide", {3, 8}), wide_part = b.buffer("wide.part", {3, 4});
  b.compute(op::slice, "slice.explicit", {whole}, {part}, {{"outer", 4}, {"extent", 6}, {"inner", 5}, {"offset", 2}, {"length", 3}});
  b.compute(op::concat, "concat.explicit", {part, other}, {joined}, {{"outer", 4}, {"inner", 5}, {"length", 3}, {"parts", 2}});
  b.slice("slice.dim", whole, dim_part, {4, 6, 5}, 1, 4, 2);
  b.compute(op::shard_slice, "shard", {whole}, {shard}, {{"dim", 1}, {"parts", 2}, {"mesh_axis", ax}});
  b.compute(op::shard_slice, "shard.last", {wide}, {wide_part}, {{"dim", 1}, {"parts", 2}, {"mesh_axis", ax}});
  b.compute(op::keep_one, "keep", {whole}, {kept}, {{"mesh_axis", ax}});
  const auto g = std::move(b).finish();
  for (const int coord : {0, 1}) {
    DYNAMIC_SECTION("at coordinate " << coord << " of 2") {
      twin tw(g, {coord}, 1, 25);
      CHECK(tw.run() == 0); // no kernel met a bad id
      for (const auto id : {part, joined, dim_part, shard, wide_part}) {
        INFO("buffer " << g.buffers[static_cast<std::size_t>(id)].name);
        CHECK(tw.gpu(id) == tw.cpu(id)); // copies: bit for bit
      }
      const auto k = tw.gpu(kept);
      CHECK(k == tw.cpu(kept));
      CHECK((k == std::vector<float>(k.size(), 0.0f)) == (coord != 0));
      // The shard is the coordinate's half along dim 1: element [1][0][0] of the shard is
      // element [1][3·coord][0] of the whole.
      CHECK(tw.gpu(shard)[15] == tw.cpu(whole)[static_cast<std::size_t>(30 + 15 * coord)]);
    }
  }
}

TEST_CASE("activation gradients and the batched weight gradient match the CPU dispatch", "[gpu][dispatch][order]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t batch = 3, m = 7, n = 9, k = 11;
  ir::builder b("orders");
  const auto x = b.buffer("x", {16, 20}), g0 = b.buffer("g0", {16, 20}), dout = b.buffer("dout", {16, 20});
  const auto dgelu = b.buffer("dgelu", {16, 20}), drelu = b.buffer("drelu", {16, 20});
  const auto a = b.buffer("a", {batch, k, m}), bb = b.buffer("b", {batch, k, n}), c = b.buffer("c", {m, n});
  b.at(ir::phase::backward);
  b.compute(op::scale, "make.dout", {g0}, {dout}, {{"num", 1}, {"den", 2}});
  b.compute(op::gelu_grad, "gelu.grad", {x, dout}, {dgelu});
  b.compute(op::relu_grad, "relu.grad", {x, dout}, {drelu});
  b.matmul("wgrad", a, bb, c, m, n, k, batch, true, false); // Σᵢ Aᵢᵀ·Bᵢ into one matrix
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 26);
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == 4);
}
