// The GPU dispatch against the CPU dispatch (the source of truth): small graphs in the forms the
// DSL lowering and the planner emit -- statistics not stored, the packed attention gradient,
// i64 ids and labels, global row counts, the vocabulary-parallel cross-entropy at a rank's mesh
// coordinate, the planner's explicit slice/concat, shard_slice, keep_one -- run task by task on
// both from the same random buffers; every buffer a task writes must agree. Skips (exit code 4)
// where no GPU is visible, except the first case, which needs none.
#include "gpu_testing.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/dispatch.cuh>
#include <concerto/runtime/cuda/stream.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <catch2/catch_test_macros.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
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
    const cu::device_context ctx{lane.get(),
                                 &blas,
                                 blas_ws.data(),
                                 blas_bytes,
                                 reinterpret_cast<float*>(dev.scratch() + blas_bytes),
                                 words.as<int>(),
                                 reinterpret_cast<const std::int64_t*>(words.data() + sizeof(std::int64_t)),
                                 static_cast<std::size_t>(ws) / sizeof(float)};
    products.reserve(g.tasks.size());
    for (const auto& t : g.tasks) {
      const auto k = rt::resolve(t);
      rt::run_kernel(g, t, k, host, settings);
      const cu::gemm* product = nullptr;
      if (k == rt::kernel::gemm) {
        products.push_back(cu::describe_gemm(g, t, dev, blas, blas_bytes));
        product = &products.back();
      }
      cu::run_kernel(g, t, k, dev, settings, ctx, product);
    }
    cu::check(cudaStreamSynchronize(lane.get()), "cudaStreamSynchronize");
    int status = -1;
    cu::check(cudaMemcpy(&status, words.data(), sizeof status, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return status;
  }

  std::vector<float> cpu(ir::buffer_id b) {
    const auto v = host.f32(b);
    return {v.begin(), v.end()};
  }
  std::vector<float> gpu(ir::buffer_id b) const { return dev.download<float>(b); }

};

// Every f32 buffer some task writes agrees; returns how many were compared.
inline std::size_t compare_written(twin& tw, float rtol = 1e-4f, float atol = 1e-5f) {
  std::set<ir::buffer_id> seen;
  for (const auto& t : tw.g.tasks)
    for (const auto b : t.writes) {
      const auto& buf = tw.g.buffers[static_cast<std::size_t>(b)];
      if (buf.type != ir::dtype::f32 || !seen.insert(b).second) continue;
      INFO("buffer '" << buf.name << "' written by '" << t.name << "'");
      gpu_testing::check_close(tw.gpu(b), tw.cpu(b), rtol, atol);
    }
  return seen.size();
}

inline ir::compute_info fn(std::string name, std::map<std::string, std::int64_t> attrs = {}) {
  ir::compute_info i;
  i.fn = std::move(name);
  i.attrs = std::move(attrs);
  return i;
}

} // namespace dispatch_testing

using dispatch_testing::fn;
using dispatch_testing::twin;

TEST_CASE("every function the CPU dispatch resolves has a GPU kernel", "[gpu][dispatch]") {
  const auto names = rt::known_functions();
  REQUIRE(names.size() >= 44); // aliases included
  std::set<rt::kernel> kernels;
  for (const auto name : names) {
    ir::task t;
    t.name = "probe";
    t.kind = ir::op_kind::elementwise;
    t.fn = std::string(name);
    const auto k = rt::resolve(t);
    INFO("fn '" << name << "'");
    CHECK(cu::gpu_supports(k));
    kernels.insert(k);
  }
  CHECK(kernels.size() == static_cast<std::size_t>(rt::kernel::vocab_ce_grad) + 1); // every enumerator named
}

TEST_CASE("the DSL's layernorm forms match the CPU dispatch", "[gpu][dispatch][layernorm]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 19, cols = 300;
  ir::builder b("layernorm-dsl");
  const auto x = b.buffer("x", {rows, cols}), gamma = b.buffer("gamma", {cols}, ir::buffer_role::param),
             beta = b.buffer("beta", {cols}, ir::buffer_role::param), y = b.buffer("y", {rows, cols});
  const auto dy = b.buffer("dy", {rows, cols}), dx = b.buffer("dx", {rows, cols}), dgamma = b.buffer("dgamma", {cols}),
             dgamma_acc = b.buffer("dgamma.acc", {cols}), dbeta = b.buffer("dbeta", {cols});
  b.compute(ir::op_kind::elementwise, "ln", {x, gamma, beta}, {y}, fn("layernorm"));
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::elementwise, "ln.grad", {x, gamma, dy}, {dx}, fn("layernorm_grad"));
  b.compute(ir::op_kind::elementwise, "ln.dgamma", {x, dy}, {dgamma}, fn("layernorm_grad_gamma"));
  b.compute(ir::op_kind::elementwise, "ln.dgamma.acc", {x, dy}, {dgamma_acc}, fn("layernorm_grad_gamma", {{"accumulate", 1}}));
  b.compute(ir::op_kind::elementwise, "ln.dbeta", {dy}, {dbeta}, fn("bias_grad"));
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 21);
  CHECK(cu::device_workspace_bytes(g) >= static_cast<std::int64_t>(2 * rows * sizeof(float)));
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-3f, 1e-4f) == 5);
}

TEST_CASE("the DSL's attention and its packed gradient match the CPU dispatch", "[gpu][dispatch][attention]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t B = 2, T = 17, H = 2, D = 8;
  const std::map<std::string, std::int64_t> dims{{"batch", B}, {"seq", T}, {"heads", H}, {"head_dim", D}};
  ir::builder b("attention-dsl");
  const auto q = b.buffer("q", {B, T, H * D}), k = b.buffer("k", {B, T, H * D}), v = b.buffer("v", {B, T, H * D});
  const auto o = b.buffer("o", {B, T, H * D}), dy = b.buffer("dy", {B, T, H * D}), dqkv = b.buffer("dqkv", {3, B, T, H * D});
  b.compute(ir::op_kind::attention, "attn", {q, k, v}, {o}, fn("attention", dims));
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::attention, "attn.grad", {q, k, v, dy}, {dqkv}, fn("attention_grad", dims));
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 22);
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-3f, 1e-4f) == 2);
}

TEST_CASE("losses over global counts with i64 targets match the CPU dispatch", "[gpu][dispatch][loss]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t rows = 33, classes = 70, n = 1000;
  ir::builder b("losses");
  const auto logits = b.buffer("logits", {rows, classes}), targets = b.buffer("targets", {rows}, ir::buffer_role::input, ir::dtype::i64);
  const auto loss = b.buffer("loss", {1}), lse = b.buffer("lse", {rows}), dlogits = b.buffer("dlogits", {rows, classes}),
             dlogits2 = b.buffer("dlogits.saved", {rows, classes});
  const auto pred = b.buffer("pred", {n}), target = b.buffer("target", {n}), mse_loss = b.buffer("mse.loss", {1}),
             dpred = b.buffer("dpred", {n}), loss2 = b.buffer("loss.with.lse", {1});
  b.at(ir::phase::backward);
  // The DSL's forms (no lse stored; the backward recomputes it), targets listed first.
  b.compute(ir::op_kind::loss, "ce", {targets, logits}, {loss}, fn("cross_entropy", {{"global_rows", 4 * rows}}));
  b.compute(ir::op_kind::loss, "ce.grad", {targets, logits}, {dlogits},
            fn("cross_entropy_grad", {{"global_rows", 4 * rows}, {"dloss_num", 1}, {"dloss_den", 3}}));
  // The builder's forms: lse written, then read.
  b.compute(ir::op_kind::loss, "ce.lse", {logits, targets}, {loss2, lse}, fn("cross_entropy"));
  b.compute(ir::op_kind::loss, "ce.lse.grad", {logits, targets, lse}, {dlogits2}, fn("cross_entropy_grad"));
  b.compute(ir::op_kind::loss, "mse", {pred, target}, {mse_loss}, fn("mse", {{"global_n", 2 * n}}));
  b.compute(ir::op_kind::loss, "mse.grad", {pred, target}, {dpred},
            fn("mse_grad", {{"global_n", 2 * n}, {"dloss_num", 2}, {"dloss_den", 5}}));
  const auto g = std::move(b).finish();
  twin tw(g, {}, classes, 23);
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-6f) == 7);
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
  b.compute(ir::op_kind::elementwise, "embed", {table, ids}, {emb}, fn("embedding", vocab_attrs));
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::loss, "ce.max", {logits}, {mx}, fn("vocab_ce_max", {{"cols", cols}}));
  b.compute(ir::op_kind::loss, "ce.sumexp", {logits, mx}, {sumexp}, fn("vocab_ce_sumexp", {{"cols", cols}}));
  b.compute(ir::op_kind::loss, "ce.target", {logits, mx, labels}, {target},
            fn("vocab_ce_target", {{"cols", cols}, {"vocab_axis", tp}}));
  b.compute(ir::op_kind::loss, "ce.loss", {sumexp, target}, {loss}, fn("vocab_ce_loss", {{"global_rows", 2 * rows}}));
  b.compute(ir::op_kind::loss, "ce.grad", {logits, mx, labels, sumexp}, {dlogits},
            fn("vocab_ce_grad", {{"cols", cols}, {"vocab_axis", tp}, {"global_rows", 2 * rows}, {"dloss_num", 1}, {"dloss_den", 2}}));
  b.compute(ir::op_kind::elementwise, "embed.grad", {demb, ids}, {dtable}, fn("embedding_grad", vocab_attrs));
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
  b.compute(ir::op_kind::slice, "slice.explicit", {whole}, {part},
            fn("slice", {{"outer", 4}, {"extent", 6}, {"inner", 5}, {"offset", 2}, {"length", 3}}));
  b.compute(ir::op_kind::concat, "concat.explicit", {part, other}, {joined},
            fn("concat", {{"outer", 4}, {"extent", 6}, {"inner", 5}, {"length", 3}, {"parts", 2}}));
  b.compute(ir::op_kind::slice, "slice.dim", {whole}, {dim_part}, fn("slice", {{"dim", 1}, {"offset", 4}}));
  b.compute(ir::op_kind::elementwise, "shard", {whole}, {shard}, fn("shard_slice", {{"dim", 1}, {"parts", 2}, {"mesh_axis", ax}}));
  b.compute(ir::op_kind::elementwise, "shard.last", {wide}, {wide_part},
            fn("shard_slice", {{"dim", 1}, {"parts", 2}, {"mesh_axis", ax}}));
  b.compute(ir::op_kind::elementwise, "keep", {whole}, {kept}, fn("keep_one", {{"mesh_axis", ax}}));
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

TEST_CASE("activation gradients in both operand orders and the batched weight gradient match the CPU dispatch",
          "[gpu][dispatch][order]") {
  CONCERTO_REQUIRE_GPU();
  const std::int64_t batch = 3, m = 7, n = 9, k = 11;
  ir::builder b("orders");
  const auto x = b.buffer("x", {16, 20}), g0 = b.buffer("g0", {16, 20}), dout = b.buffer("dout", {16, 20});
  const auto dx_builder = b.buffer("dx.builder", {16, 20}), dx_dsl = b.buffer("dx.dsl", {16, 20}),
             drelu = b.buffer("drelu", {16, 20});
  const auto a = b.buffer("a", {batch, k, m}), bb = b.buffer("b", {batch, k, n}), c = b.buffer("c", {m, n});
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::elementwise, "make.dout", {g0}, {dout}, fn("scale", {{"num", 1}, {"den", 2}}));
  b.compute(ir::op_kind::elementwise, "gelu.grad.builder", {dout, x}, {dx_builder}, fn("gelu_grad"));
  b.compute(ir::op_kind::elementwise, "gelu.grad.dsl", {x, dout}, {dx_dsl}, fn("gelu_grad"));
  b.compute(ir::op_kind::elementwise, "relu.grad.dsl", {x, dout}, {drelu}, fn("relu_grad"));
  b.matmul("wgrad", a, bb, c, m, n, k, batch, true, false); // Σᵢ Aᵢᵀ·Bᵢ into one matrix
  const auto g = std::move(b).finish();
  twin tw(g, {}, 1, 26);
  CHECK(tw.run() == 0); // no kernel met a bad id
  CHECK(dispatch_testing::compare_written(tw, 1e-4f, 1e-5f) == 5);
  gpu_testing::check_close(tw.gpu(dx_dsl), tw.gpu(dx_builder), 0.0f, 0.0f);
}
