// Every CUDA kernel against the CPU kernel of the same name, on random data with fixed seeds.
// Skips (exit code 4) where no GPU is visible. The same file also builds against the host
// emulation of CUDA (emulation/kernels_test.cpp), which runs it in CI without a GPU.
#include "gpu_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/cuda/kernels.cuh>
#include <concerto/runtime/cuda/stream.hpp>
#include <concerto/runtime/float16_values.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace cu = concerto::runtime::cuda;
using gpu_testing::dev;
using gpu_testing::random;
using gpu_testing::check_close;

TEST_CASE("elementwise kernels match the CPU kernels", "[gpu][kernels]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 37, cols = 129, n = rows * cols; // odd sizes: partial blocks
  const auto a = random(n, 1, -3, 3), b = random(n, 2), bias = random(cols, 3);
  dev<float> da(a), db(b), dbias(bias), out(n), small(cols);
  std::vector<float> want(n), want_small(cols, 0.5f);

  SECTION("add, add_inplace and scale") {
    cu::add(da.p(), db.p(), out.p(), n, s.get());
    cpu::add(a, b, want);
    check_close(out.get(), want);
    cu::add_inplace(out.p(), da.p(), n, s.get());
    cpu::add_inplace(want, a);
    check_close(out.get(), want);
    cu::scale(da.p(), -0.25f, out.p(), n, s.get());
    cpu::scale(a, -0.25f, want);
    check_close(out.get(), want);
  }
  SECTION("bias_add and its gradient, overwriting and accumulating") {
    cu::bias_add(da.p(), dbias.p(), out.p(), rows, cols, s.get());
    cpu::bias_add(a, bias, want, rows, cols);
    check_close(out.get(), want);
    cu::bias_add_grad(da.p(), small.p(), rows, cols, false, s.get());
    cpu::bias_add_grad(a, want_small, rows, cols, false);
    check_close(small.get(), want_small, 1e-4f, 1e-4f);
    cu::bias_add_grad(db.p(), small.p(), rows, cols, true, s.get());
    cpu::bias_add_grad(b, want_small, rows, cols, true);
    check_close(small.get(), want_small, 1e-4f, 1e-4f);
  }
  SECTION("gelu, relu and their gradients") {
    cu::gelu(da.p(), out.p(), n, s.get());
    cpu::gelu(a, want);
    check_close(out.get(), want);
    cu::gelu_grad(da.p(), db.p(), out.p(), n, s.get());
    cpu::gelu_grad(a, b, want);
    check_close(out.get(), want);
    cu::relu(da.p(), out.p(), n, s.get());
    cpu::relu(a, want);
    check_close(out.get(), want);
    cu::relu_grad(da.p(), db.p(), out.p(), n, s.get());
    cpu::relu_grad(a, b, want);
    check_close(out.get(), want);
  }
}

TEST_CASE("row-wise kernels match the CPU kernels", "[gpu][kernels]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 19, cols = 300, n = rows * cols; // cols > block: several passes per thread
  const auto x = random(n, 11, -2, 2), g = random(n, 12), gamma = random(cols, 13, 0.5f, 1.5f), beta = random(cols, 14);
  dev<float> dx(x), dg(g), dgamma(gamma), dbeta(beta), out(n), mean(rows), rstd(rows), ddx(n), dgam(cols), dbet(cols);

  SECTION("layernorm forward and backward") {
    std::vector<float> w(n), wm(rows), wr(rows), wdx(n), wdg(cols, 1.0f), wdb(cols, 1.0f);
    cu::layernorm(dx.p(), dgamma.p(), dbeta.p(), out.p(), mean.p(), rstd.p(), rows, cols, 1e-5f, s.get());
    cpu::layernorm(x, gamma, beta, w, wm, wr, rows, cols, 1e-5f);
    check_close(out.get(), w);
    check_close(mean.get(), wm, 1e-4f, 1e-5f);
    check_close(rstd.get(), wr);
    for (const bool accumulate : {false, true}) {
      cu::layernorm_grad(dg.p(), dx.p(), dgamma.p(), mean.p(), rstd.p(), ddx.p(), dgam.p(), dbet.p(), rows, cols, accumulate,
                         s.get());
      cpu::layernorm_grad(g, x, gamma, wm, wr, wdx, wdg, wdb, rows, cols, accumulate);
      check_close(ddx.get(), wdx, 1e-3f, 1e-5f);
      check_close(dgam.get(), wdg, 1e-4f, 1e-4f);
      check_close(dbet.get(), wdb, 1e-4f, 1e-4f);
    }
  }
  SECTION("softmax forward and backward") {
    std::vector<float> y(n), d(n);
    cu::softmax(dx.p(), out.p(), rows, cols, s.get());
    cpu::softmax(x, y, rows, cols);
    check_close(out.get(), y, 1e-4f, 1e-7f);
    cu::softmax_grad(out.p(), dg.p(), ddx.p(), rows, cols, s.get());
    cpu::softmax_grad(y, g, d, rows, cols);
    check_close(ddx.get(), d, 1e-3f, 1e-7f);
  }
}

TEST_CASE("Llama's kernels (rmsnorm, silu, mul, swiglu, rope) match the CPU kernels", "[gpu][kernels][llama]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 19, cols = 300, n = rows * cols; // cols > block: several passes per thread
  const auto x = random(n, 21, -3, 3), g = random(n, 22), gain = random(cols, 23, 0.5f, 1.5f);
  dev<float> dx(x), dg(g), dgain(gain), out(n), rstd(rows), ddx(n), ddgain(cols), pair(2 * n);

  SECTION("rmsnorm forward and backward") {
    std::vector<float> w(n), wr(rows), wdx(n), wdg(cols, 1.0f);
    cu::rmsnorm(dx.p(), dgain.p(), out.p(), rstd.p(), rows, cols, 1e-6f, s.get());
    cpu::rmsnorm(x, gain, w, wr, rows, cols, 1e-6f);
    check_close(out.get(), w);
    check_close(rstd.get(), wr);
    cu::rmsnorm_stats(dx.p(), rstd.p(), rows, cols, 1e-6f, s.get());
    check_close(rstd.get(), wr);
    cu::rmsnorm_grad(dg.p(), dx.p(), dgain.p(), rstd.p(), ddx.p(), rows, cols, s.get());
    cpu::rmsnorm_grad(g, x, gain, wr, wdx, rows, cols);
    check_close(ddx.get(), wdx, 1e-3f, 1e-5f);
    for (const bool accumulate : {false, true}) {
      cu::rmsnorm_grad_gain(dg.p(), dx.p(), rstd.p(), ddgain.p(), rows, cols, accumulate, s.get());
      cpu::rmsnorm_grad_gain(g, x, wr, wdg, rows, cols, accumulate);
      check_close(ddgain.get(), wdg, 1e-4f, 1e-4f);
    }
  }
  SECTION("silu, mul, swiglu and their gradients") {
    std::vector<float> w(n), w2(2 * n);
    cu::silu(dx.p(), out.p(), n, s.get());
    cpu::silu(x, w);
    check_close(out.get(), w);
    cu::silu_grad(dx.p(), dg.p(), out.p(), n, s.get());
    cpu::silu_grad(x, g, w);
    check_close(out.get(), w);
    cu::mul(dx.p(), dg.p(), out.p(), n, s.get());
    cpu::mul(x, g, w);
    check_close(out.get(), w);
    cu::swiglu(dx.p(), dg.p(), out.p(), n, s.get());
    cpu::swiglu(x, g, w);
    check_close(out.get(), w);
    cu::swiglu_grad(dx.p(), dg.p(), dg.p(), pair.p(), pair.p() + n, n, s.get());
    cpu::swiglu_grad(x, g, g, std::span<float>(w2).first(n), std::span<float>(w2).subspan(n));
    check_close(pair.get(), w2);
  }
  SECTION("rope and its gradient, in place as the dispatch may run them") {
    const std::size_t head_dim = 20; // 15 heads of 20 lanes per row
    std::vector<std::int32_t> pos(rows);
    for (std::size_t r = 0; r < rows; ++r) pos[r] = static_cast<std::int32_t>(7 * r);
    dev<std::int32_t> dpos(pos);
    std::vector<float> w(n);
    cu::rope(dx.p(), dpos.p(), out.p(), rows, cols, head_dim, 10000.0, 1.0, s.get());
    cpu::rope(x, pos, w, rows, cols, head_dim, 10000.0);
    check_close(out.get(), w, 1e-4f, 1e-5f);
    cu::rope(out.p(), dpos.p(), out.p(), rows, cols, head_dim, 10000.0, -1.0, s.get());
    check_close(out.get(), x, 1e-4f, 1e-5f);
  }
}

TEST_CASE("causal attention matches the CPU kernel forward and backward", "[gpu][kernels][attention]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  // Multi-head; grouped-query (3 q heads per kv head); a rank holding q heads 2..3 of 6 with
  // both kv heads (kv replicated while q is split): its dk, dv are the partial sums of its heads;
  // then each tile shape of the tiled kernels (head_dim up to 64, 128, 256) over several tiles
  // of rows and a partial last one, causal and not.
  for (const cpu::attention_shape& sh : {cpu::attention_shape{.batch = 2, .seq = 33, .heads = 3, .head_dim = 16},
                                        cpu::attention_shape{.batch = 2, .seq = 17, .heads = 6, .head_dim = 8, .kv_heads = 2, .group = 3},
                                        cpu::attention_shape{.batch = 1, .seq = 9, .heads = 2, .head_dim = 4, .kv_heads = 2, .group = 3,
                                                             .first_head = 2},
                                        cpu::attention_shape{.batch = 1, .seq = 70, .heads = 2, .head_dim = 64, .causal = false},
                                        cpu::attention_shape{.batch = 1, .seq = 45, .heads = 2, .head_dim = 96, .kv_heads = 1, .group = 2},
                                        cpu::attention_shape{.batch = 1, .seq = 37, .heads = 1, .head_dim = 160},
                                        cpu::attention_shape{.batch = 1, .seq = 21, .heads = 1, .head_dim = 130, .causal = false}}) {
    CAPTURE(sh.seq, sh.heads, sh.kv(), sh.first_head, sh.head_dim, sh.causal);
    const auto n = sh.q_floats(), nkv = sh.kv_floats(), nl = sh.lse_floats();
    const auto q = random(n, 21), k = random(nkv, 22), v = random(nkv, 23), dout = random(n, 24);
    std::vector<float> out(n), lse(nl), dq(n), dk(nkv), dv(nkv), ws(cpu::causal_attention_grad_workspace_floats(sh));
    cpu::causal_attention(q, k, v, out, lse, ws, sh);
    cpu::causal_attention_grad(q, k, v, dout, lse, dq, dk, dv, ws, sh);
    dev<float> gq(q), gk(k), gv(v), gdout(dout), gout(n), glse(nl), gdq(n), gdk(nkv), gdv(nkv),
        gws(cu::causal_attention_grad_workspace_floats(sh));
    cu::causal_attention(gq.p(), gk.p(), gv.p(), gout.p(), glse.p(), sh, s.get());
    check_close(gout.get(), out, 1e-3f, 1e-5f);
    check_close(glse.get(), lse, 1e-4f, 1e-5f);
    cu::causal_attention_grad(gq.p(), gk.p(), gv.p(), gout.p(), gdout.p(), glse.p(), gdq.p(), gdk.p(), gdv.p(), gws.p(), sh,
                              s.get());
    check_close(gdq.get(), dq, 1e-3f, 1e-5f);
    check_close(gdk.get(), dk, 1e-3f, 1e-5f);
    check_close(gdv.get(), dv, 1e-3f, 1e-5f);
  }
}

TEST_CASE("losses match the CPU kernels and flag bad targets", "[gpu][kernels][loss]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 45, classes = 67;
  const auto logits = random(rows * classes, 31, -4, 4);
  auto targets = gpu_testing::random_ids(rows, static_cast<std::int32_t>(classes), 32);
  dev<float> dl(logits), lse(rows), loss(1), dlog(rows * classes);
  dev<std::int32_t> dt(targets), status(1);
  std::vector<float> wl(rows), wd(rows * classes);

  SECTION("cross-entropy, its lse and its gradient") {
    const float want = cpu::cross_entropy(logits, targets, wl, rows, classes);
    cu::cross_entropy(dl.p(), dt.p(), lse.p(), loss.p(), rows, classes, status.p(), 7, s.get());
    check_close(loss.get(), {want}, 1e-5f, 1e-6f);
    check_close(lse.get(), wl);
    cpu::cross_entropy_grad(logits, targets, wl, wd, rows, classes, 0.5f);
    cu::cross_entropy_grad(dl.p(), dt.p(), lse.p(), dlog.p(), rows, classes, 0.5f, s.get());
    check_close(dlog.get(), wd, 1e-4f, 1e-7f);
    CHECK(status.get()[0] == 0);
  }
  SECTION("a target outside the classes sets the status word to the caller's code") {
    targets[5] = static_cast<std::int32_t>(classes);
    dev<std::int32_t> bad(targets);
    cu::cross_entropy(dl.p(), bad.p(), lse.p(), loss.p(), rows, classes, status.p(), 7, s.get());
    CHECK(status.get()[0] == 7);
  }
  SECTION("mean squared error and its gradient") {
    const auto pred = random(1000, 33), target = random(1000, 34);
    dev<float> dp(pred), dtg(target), dd(1000);
    std::vector<float> want(1000);
    cu::mse(dp.p(), dtg.p(), loss.p(), 1000, s.get());
    check_close(loss.get(), {cpu::mse(pred, target)}, 1e-5f, 1e-7f);
    cu::mse_grad(dp.p(), dtg.p(), dd.p(), 1000, 2.0f, s.get());
    cpu::mse_grad(pred, target, want, 2.0f);
    check_close(dd.get(), want);
  }
}

TEST_CASE("embedding lookup and scatter-add match the CPU kernels", "[gpu][kernels][embedding]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t vocab = 50, dim = 24, n = 200; // n > vocab: repeated ids must add up
  const auto table = random(vocab * dim, 41);
  const auto ids = gpu_testing::random_ids(n, static_cast<std::int32_t>(vocab), 42);
  const auto dout = random(n * dim, 43);
  dev<float> dtab(table), out(n * dim), dgrad(vocab * dim), ddout(dout), ws(cu::embedding_grad_workspace_floats(n, vocab));
  dev<std::int32_t> did(ids), status(1);
  std::vector<float> want(n * dim), wgrad(vocab * dim, 0.25f);

  SECTION("a whole table") {
    cu::embedding(did.p(), dtab.p(), out.p(), n, dim, vocab, 0, true, status.p(), 3, s.get());
    cpu::embedding(ids, table, want, dim);
    check_close(out.get(), want, 0, 0);
    for (const bool accumulate : {false, true}) {
      cu::embedding_grad(did.p(), ddout.p(), dgrad.p(), n, dim, vocab, accumulate, 0, true, status.p(), 3, ws.p(), s.get());
      cpu::embedding_grad(ids, dout, wgrad, dim, accumulate);
      check_close(dgrad.get(), wgrad, 1e-5f, 1e-5f);
    }
    CHECK(status.get()[0] == 0);
  }
  SECTION("a vocabulary shard gives zero rows for ids another rank holds") {
    const std::size_t rows = 20;
    const std::vector<float> shard(table.begin() + 15 * dim, table.begin() + 35 * dim);
    dev<float> dshard(shard), sgrad(rows * dim);
    std::vector<float> wsg(rows * dim);
    cu::embedding(did.p(), dshard.p(), out.p(), n, dim, rows, 15, false, status.p(), 3, s.get());
    cpu::embedding(ids, shard, want, dim, 15, cpu::id_outside_table::zero_row);
    check_close(out.get(), want, 0, 0);
    cu::embedding_grad(did.p(), ddout.p(), sgrad.p(), n, dim, rows, false, 15, false, status.p(), 3, ws.p(), s.get());
    cpu::embedding_grad(ids, dout, wsg, dim, false, 15, cpu::id_outside_table::zero_row);
    check_close(sgrad.get(), wsg, 1e-5f, 1e-5f);
    CHECK(status.get()[0] == 0);
  }
}

TEST_CASE("optimizer updates match the CPU kernels over several steps", "[gpu][kernels][optimizer]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t n = 3000;
  auto p = random(n, 51), m = std::vector<float>(n, 0.0f), v = std::vector<float>(n, 0.0f);
  dev<float> dp(p), dm(m), dv(v);
  // The rate follows a schedule computed on the device from the device's step counter.
  const concerto::runtime::lr_schedule schedule{.decay = concerto::runtime::lr_decay::cosine, .warmup_steps = 1, .decay_steps = 4,
                                      .min_ratio = 0.1f};
  dev<std::int64_t> step(1);
  SECTION("AdamW reads the step from device memory") {
    const cpu::adamw_config cfg{.lr = 1e-2f, .weight_decay = 0.1f};
    for (std::int64_t t = 1; t <= 3; ++t) {
      const auto g = random(n, 52 + static_cast<std::uint32_t>(t));
      dev<float> dg(g);
      cu::check(cudaMemcpy(step.p(), &t, sizeof t, cudaMemcpyHostToDevice), "cudaMemcpy");
      cu::adamw_update(dp.p(), dg.p(), dm.p(), dv.p(), n, cfg, schedule, step.p(), nullptr, 0.0f, s.get());
      auto scheduled = cfg;
      scheduled.lr = concerto::runtime::lr_at(schedule, cfg.lr, t);
      cpu::adamw_update(p, g, m, v, scheduled, t);
      s.synchronize();
    }
    check_close(dp.get(), p, 1e-5f, 1e-6f);
    check_close(dm.get(), m, 1e-5f, 1e-7f);
    check_close(dv.get(), v, 1e-5f, 1e-8f);
  }
  SECTION("AdamW with global-norm clipping: the norm computed on the device, the factor in the kernel") {
    const cpu::adamw_config cfg{.lr = 1e-2f, .weight_decay = 0.1f};
    const float max_norm = 0.5f; // below the random gradient's norm: the factor is active
    for (std::int64_t t = 1; t <= 2; ++t) {
      const auto g = random(n, 70 + static_cast<std::uint32_t>(t));
      dev<float> dg(g), norm_sq(std::vector<float>(1, 0.0f));
      cu::check(cudaMemcpy(step.p(), &t, sizeof t, cudaMemcpyHostToDevice), "cudaMemcpy");
      cu::grad_sq_norm(dg.p(), n, 2, norm_sq.p(), s.get()); // two ranks would hold this shard: half each
      cu::adamw_update(dp.p(), dg.p(), dm.p(), dv.p(), n, cfg, schedule, step.p(), norm_sq.p(), max_norm, s.get());
      s.synchronize();
      const float host_sq = cpu::sum_of_squares(g, 2);
      CHECK(norm_sq.get()[0] == Catch::Approx(host_sq).epsilon(1e-6));
      auto scheduled = cfg;
      scheduled.lr = concerto::runtime::lr_at(schedule, cfg.lr, t);
      const float factor = concerto::runtime::clip_factor(max_norm, host_sq);
      CHECK(factor < 1.0f);
      cpu::adamw_update(p, g, m, v, scheduled, t, factor);
    }
    check_close(dp.get(), p, 1e-5f, 1e-6f);
    check_close(dm.get(), m, 1e-5f, 1e-7f);
  }
  SECTION("SGD with momentum and weight decay") {
    const cpu::sgd_config cfg{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f};
    for (std::int64_t t = 1; t <= 3; ++t) {
      const auto g = random(n, 60 + static_cast<std::uint32_t>(t));
      dev<float> dg(g);
      cu::check(cudaMemcpy(step.p(), &t, sizeof t, cudaMemcpyHostToDevice), "cudaMemcpy");
      cu::sgd_update(dp.p(), dg.p(), dm.p(), n, cfg, schedule, step.p(), nullptr, 0.0f, s.get());
      auto scheduled = cfg;
      scheduled.lr = concerto::runtime::lr_at(schedule, cfg.lr, t);
      cpu::sgd_update(p, g, m, scheduled);
      s.synchronize();
    }
    check_close(dp.get(), p, 1e-5f, 1e-6f);
    check_close(dm.get(), m, 1e-5f, 1e-6f);
  }
}

TEST_CASE("restride packs a split along an inner dimension into blocks and back", "[gpu][kernels][restride]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  // len in bytes: 3 (byte copies), 12 (words), 32 (16-byte vectors); odd outer and parts.
  for (const std::size_t len : {std::size_t{3}, std::size_t{12}, std::size_t{32}}) {
    DYNAMIC_SECTION("parts of " << len << " bytes") {
      const std::size_t outer = 7, parts = 3, n = outer * parts * len;
      std::vector<std::uint8_t> whole(n);
      for (std::size_t i = 0; i < n; ++i) whole[i] = static_cast<std::uint8_t>((i * 37 + 11) % 251);
      // Block k holds part k of every row, rows in order (what the MPI backend's staging holds).
      std::vector<std::uint8_t> blocks(n);
      for (std::size_t k = 0; k < parts; ++k)
        for (std::size_t o = 0; o < outer; ++o)
          for (std::size_t b = 0; b < len; ++b) blocks[(k * outer + o) * len + b] = whole[(o * parts + k) * len + b];
      REQUIRE(blocks != whole);
      dev<std::uint8_t> dwhole(whole), dblocks(n), dback(n);
      cu::restride(reinterpret_cast<const std::byte*>(dwhole.p()), reinterpret_cast<std::byte*>(dblocks.p()), outer, parts,
                   len, true, s.get());
      CHECK(dblocks.get() == blocks);
      cu::restride(reinterpret_cast<const std::byte*>(dblocks.p()), reinterpret_cast<std::byte*>(dback.p()), outer, parts,
                   len, false, s.get());
      CHECK(dback.get() == whole);
    }
  }
}

TEST_CASE("i64 ids narrow to i32 and a value outside 32 bits is flagged", "[gpu][kernels][ids]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::vector<std::int64_t> ids{0, 5, -3, 2147483647, 123456};
  dev<std::int64_t> din(ids);
  dev<std::int32_t> out(ids.size()), status(1);
  cu::narrow_ids(din.p(), out.p(), ids.size(), status.p(), 9, s.get());
  CHECK(out.get() == std::vector<std::int32_t>{0, 5, -3, 2147483647, 123456});
  CHECK(status.get()[0] == 0);
  const std::vector<std::int64_t> bad{1, std::int64_t{1} << 40};
  dev<std::int64_t> dbad(bad);
  cu::narrow_ids(dbad.p(), out.p(), bad.size(), status.p(), 9, s.get());
  CHECK(status.get()[0] == 9);
  CHECK(out.get()[0] == 1);
}

namespace native_testing {

namespace ir = concerto::ir;

// A device buffer of one float type holding host values rounded to it: `host` is what the
// kernels read (the rounded values, as f32), `get` reads the device's back as f32.
struct typed {
  ir::dtype type;
  std::vector<float> host;
  concerto::runtime::cuda::device_buffer buf;
  typed(ir::dtype t, const std::vector<float>& values) : type(t), host(rounded(t, values)), buf(values.size() * width(t)) {
    if (host.empty()) return;
    std::vector<std::uint16_t> narrow(host.size());
    if (t != ir::dtype::f32) concerto::runtime::round_to_16bit(t, host, narrow);
    const void* from = t == ir::dtype::f32 ? static_cast<const void*>(host.data()) : narrow.data();
    cu::check(cudaMemcpy(buf.data(), from, host.size() * width(t), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  typed(ir::dtype t, std::size_t n) : typed(t, std::vector<float>(n, 0.0f)) {}
  cu::float_in in() const { return {buf.data(), type}; }
  cu::float_out out() const { return {buf.data(), type}; }
  std::vector<float> get() const {
    std::vector<float> out(host.size());
    cu::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (type == ir::dtype::f32) {
      cu::check(cudaMemcpy(out.data(), buf.data(), out.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
      return out;
    }
    std::vector<std::uint16_t> narrow(out.size());
    cu::check(cudaMemcpy(narrow.data(), buf.data(), out.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    concerto::runtime::widen_16bit(type, narrow, out);
    return out;
  }
  static std::size_t width(ir::dtype t) { return t == ir::dtype::f32 ? 4 : 2; }
  static std::vector<float> rounded(ir::dtype t, std::vector<float> v) {
    if (t == ir::dtype::f32 || v.empty()) return v;
    std::vector<std::uint16_t> narrow(v.size());
    concerto::runtime::round_to_16bit(t, v, narrow);
    concerto::runtime::widen_16bit(t, narrow, v);
    return v;
  }
};

// A kernel's 16-bit output against the CPU kernel's f32 result on the same rounded inputs,
// rounded to the output's type: the two f32 results differ by f32 rounding (summation order),
// which moves the 16-bit result by one unit in the last place where they straddle a rounding
// boundary, so the tolerance is one ulp relative (2^-7 for bf16, 2^-10 for f16) plus `atol` for
// values near zero that come out of cancellations. An f32 output is held to f32 tolerances.
inline void check_typed(const typed& got, const std::vector<float>& cpu, float atol = 1e-5f) {
  const auto want = typed::rounded(got.type, cpu);
  const float ulp = got.type == ir::dtype::bf16 ? 1.0f / 128 : got.type == ir::dtype::f16 ? 1.0f / 1024 : 1e-4f;
  check_close(got.get(), want, ulp, atol);
}

} // namespace native_testing

using native_testing::check_typed;
using native_testing::typed;
namespace ir = concerto::ir;

TEST_CASE("16-bit-native pointwise and row-wise kernels match the CPU kernels on rounded inputs", "[gpu][kernels][bf16]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 13, cols = 300, n = rows * cols; // cols > block: several passes per thread
  for (const auto t : {ir::dtype::bf16, ir::dtype::f16}) {
    CAPTURE(ir::to_string(t));
    const typed x(t, random(n, 101, -2, 2)), y(t, random(n, 102)), dout(t, random(n, 103)), bias(t, random(cols, 104));
    const typed gain(t, random(cols, 105, 0.5f, 1.5f)), shift(t, random(cols, 106));
    typed out(t, n), pair(t, 2 * n), small(t, cols);
    std::vector<float> want(n), want2(2 * n), want_small(cols);
    cu::add(x.in(), y.in(), out.out(), n, s.get());
    cpu::add(x.host, y.host, want);
    check_typed(out, want);
    cu::mul(x.in(), y.in(), out.out(), n, s.get());
    cpu::mul(x.host, y.host, want);
    check_typed(out, want);
    cu::bias_add(x.in(), bias.in(), out.out(), rows, cols, s.get());
    cpu::bias_add(x.host, bias.host, want, rows, cols);
    check_typed(out, want);
    cu::bias_add_grad(dout.in(), small.out(), rows, cols, false, s.get());
    cpu::bias_add_grad(dout.host, want_small, rows, cols, false);
    check_typed(small, want_small, 1e-4f);
    cu::gelu(x.in(), out.out(), n, s.get());
    cpu::gelu(x.host, want);
    check_typed(out, want);
    cu::gelu_grad(x.in(), dout.in(), out.out(), n, s.get());
    cpu::gelu_grad(x.host, dout.host, want);
    check_typed(out, want);
    cu::silu(x.in(), out.out(), n, s.get());
    cpu::silu(x.host, want);
    check_typed(out, want);
    cu::silu_grad(x.in(), dout.in(), out.out(), n, s.get());
    cpu::silu_grad(x.host, dout.host, want);
    check_typed(out, want);
    cu::swiglu(x.in(), y.in(), out.out(), n, s.get());
    cpu::swiglu(x.host, y.host, want);
    check_typed(out, want);
    cu::swiglu_grad(x.in(), y.in(), dout.in(), pair.out(), pair.out() + n, n, s.get());
    cpu::swiglu_grad(x.host, y.host, dout.host, std::span<float>(want2).first(n), std::span<float>(want2).subspan(n));
    check_typed(pair, want2);
    cu::softmax(x.in(), out.out(), rows, cols, s.get());
    cpu::softmax(x.host, want, rows, cols);
    check_typed(out, want, 1e-6f);
    typed dx(t, n);
    cu::softmax_grad(out.in(), dout.in(), dx.out(), rows, cols, s.get()); // y as the forward stored it, in 16 bits
    cpu::softmax_grad(out.get(), dout.host, want, rows, cols);
    check_typed(dx, want, 1e-6f);

    // The norms: statistics in f32, the rest in the 16-bit type.
    dev<float> mean(rows), rstd(rows);
    std::vector<float> wm(rows), wr(rows), wdg(cols), wdb(cols);
    cu::layernorm(x.in(), gain.in(), shift.in(), out.out(), mean.p(), rstd.p(), rows, cols, 1e-5f, s.get());
    cpu::layernorm(x.host, gain.host, shift.host, want, wm, wr, rows, cols, 1e-5f);
    check_typed(out, want);
    check_close(rstd.get(), wr);
    cu::layernorm_stats(x.in(), mean.p(), rstd.p(), rows, cols, 1e-5f, s.get());
    check_close(rstd.get(), wr);
    cu::layernorm_grad_input(dout.in(), x.in(), gain.in(), mean.p(), rstd.p(), out.out(), rows, cols, s.get());
    cu::layernorm_grad_gamma(dout.in(), x.in(), mean.p(), rstd.p(), small.out(), rows, cols, false, s.get());
    cpu::layernorm_grad(dout.host, x.host, gain.host, wm, wr, want, wdg, wdb, rows, cols, false);
    check_typed(out, want, 1e-4f);
    check_typed(small, wdg, 1e-4f);
    cu::rmsnorm(x.in(), gain.in(), out.out(), rstd.p(), rows, cols, 1e-6f, s.get());
    cpu::rmsnorm(x.host, gain.host, want, wr, rows, cols, 1e-6f);
    check_typed(out, want);
    cu::rmsnorm_stats(x.in(), rstd.p(), rows, cols, 1e-6f, s.get());
    check_close(rstd.get(), wr);
    cu::rmsnorm_grad(dout.in(), x.in(), gain.in(), rstd.p(), out.out(), rows, cols, s.get());
    cpu::rmsnorm_grad(dout.host, x.host, gain.host, wr, want, rows, cols);
    check_typed(out, want, 1e-4f);
    cu::rmsnorm_grad_gain(dout.in(), x.in(), rstd.p(), small.out(), rows, cols, false, s.get());
    cpu::rmsnorm_grad_gain(dout.host, x.host, wr, want_small, rows, cols, false);
    check_typed(small, want_small, 1e-4f);
  }
}

TEST_CASE("16-bit-native kernels take each operand in its own type", "[gpu][kernels][bf16]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 9, cols = 70, n = rows * cols;
  const typed x(ir::dtype::bf16, random(n, 111, -2, 2)), dout(ir::dtype::f32, random(n, 112)), hdout(ir::dtype::f16, random(n, 113));
  const typed gain(ir::dtype::f32, random(cols, 114, 0.5f, 1.5f)), shift(ir::dtype::bf16, random(cols, 115));
  typed wide(ir::dtype::f32, n), narrow(ir::dtype::bf16, n), dgain(ir::dtype::f32, cols);
  std::vector<float> want(n), want_gain(cols, 0.5f), wm(rows), wr(rows), wdb(cols, 0.0f);
  // bf16 x with f32 dout into f32 dx: nothing is rounded but the input, so f32 tolerances hold.
  cu::gelu_grad(x.in(), dout.in(), wide.out(), n, s.get());
  cpu::gelu_grad(x.host, dout.host, want);
  check_typed(wide, want);
  // bf16 x, f16 dout, bf16 dx.
  cu::silu_grad(x.in(), hdout.in(), narrow.out(), n, s.get());
  cpu::silu_grad(x.host, hdout.host, want);
  check_typed(narrow, want);
  // f32 gain, bf16 shift and x, bf16 out; then the f32 weight gradient accumulated from bf16 x.
  dev<float> mean(rows), rstd(rows);
  cu::layernorm(x.in(), gain.in(), shift.in(), narrow.out(), mean.p(), rstd.p(), rows, cols, 1e-5f, s.get());
  cpu::layernorm(x.host, gain.host, shift.host, want, wm, wr, rows, cols, 1e-5f);
  check_typed(narrow, want);
  cu::check(cudaMemcpy(dgain.buf.data(), want_gain.data(), cols * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  cu::layernorm_grad_gamma(dout.in(), x.in(), mean.p(), rstd.p(), dgain.out(), rows, cols, true, s.get());
  cpu::layernorm_grad(dout.host, x.host, gain.host, wm, wr, want, want_gain, wdb, rows, cols, true);
  check_typed(dgain, want_gain, 1e-4f);
}

TEST_CASE("bf16 attention, causal and grouped-query, matches the CPU kernel on rounded inputs", "[gpu][kernels][attention][bf16]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  for (const cpu::attention_shape& sh : {cpu::attention_shape{.batch = 2, .seq = 17, .heads = 6, .head_dim = 8, .kv_heads = 2, .group = 3},
                                        cpu::attention_shape{.batch = 1, .seq = 40, .heads = 2, .head_dim = 64, .causal = false}}) {
    CAPTURE(sh.seq, sh.heads, sh.kv(), sh.head_dim, sh.causal);
    const auto n = sh.q_floats(), nkv = sh.kv_floats(), nl = sh.lse_floats();
    const auto t = ir::dtype::bf16;
    const typed q(t, random(n, 121)), k(t, random(nkv, 122)), v(t, random(nkv, 123)), dout(t, random(n, 124));
    std::vector<float> out(n), lse(nl), dq(n), dk(nkv), dv(nkv), ws(cpu::causal_attention_grad_workspace_floats(sh));
    cpu::causal_attention(q.host, k.host, v.host, out, lse, ws, sh);
    cpu::causal_attention_grad(q.host, k.host, v.host, dout.host, lse, dq, dk, dv, ws, sh);
    typed gout(t, n), wide_out(ir::dtype::f32, n), gdq(t, n), gdk(t, nkv), gdv(t, nkv);
    dev<float> glse(nl), gws(cu::causal_attention_grad_workspace_floats(sh));
    cu::causal_attention(q.in(), k.in(), v.in(), gout.out(), glse.p(), sh, s.get());
    check_typed(gout, out, 1e-4f);
    cu::causal_attention(q.in(), k.in(), v.in(), wide_out.out(), glse.p(), sh, s.get()); // f32 out, as the dispatch recomputes it
    check_close(wide_out.get(), out, 1e-3f, 1e-5f);
    check_close(glse.get(), lse, 1e-4f, 1e-5f);
    cu::causal_attention_grad(q.in(), k.in(), v.in(), wide_out.in(), dout.in(), glse.p(), gdq.out(), gdk.out(), gdv.out(), gws.p(),
                              sh, s.get());
    check_typed(gdq, dq, 1e-4f);
    check_typed(gdk, dk, 1e-4f);
    check_typed(gdv, dv, 1e-4f);
  }
}

TEST_CASE("bf16 logits, embedding table and output match the CPU kernels", "[gpu][kernels][loss][embedding][bf16]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const auto t = ir::dtype::bf16;
  const std::size_t rows = 21, classes = 67;
  const typed logits(t, random(rows * classes, 131, -4, 4));
  const auto targets = gpu_testing::random_ids(rows, static_cast<std::int32_t>(classes), 132);
  dev<std::int32_t> dt(targets), status(1);
  dev<float> lse(rows), loss(1);
  typed dlogits(t, rows * classes);
  std::vector<float> wl(rows), wd(rows * classes);
  const float want = cpu::cross_entropy(logits.host, targets, wl, rows, classes);
  cu::cross_entropy(logits.in(), dt.p(), lse.p(), loss.p(), rows, classes, status.p(), 7, s.get());
  check_close(loss.get(), {want}, 1e-5f, 1e-6f);
  cu::cross_entropy_grad(logits.in(), dt.p(), lse.p(), dlogits.out(), rows, classes, 0.5f, s.get());
  cpu::cross_entropy_grad(logits.host, targets, wl, wd, rows, classes, 0.5f);
  check_typed(dlogits, wd, 1e-7f);

  const std::size_t vocab = 30, dim = 24, n = 50;
  const typed table(t, random(vocab * dim, 133));
  const auto ids = gpu_testing::random_ids(n, static_cast<std::int32_t>(vocab), 134);
  dev<std::int32_t> did(ids);
  typed out(t, n * dim);
  std::vector<float> wo(n * dim);
  cu::embedding(did.p(), table.in(), out.out(), n, dim, vocab, 0, true, status.p(), 3, s.get());
  cpu::embedding(ids, table.host, wo, dim);
  check_close(out.get(), wo, 0, 0); // a lookup copies: bf16 in, bf16 out
  CHECK(status.get()[0] == 0);
}

TEST_CASE("two-level column sums equal the serial sums and repeat bit for bit", "[gpu][kernels][column_sums]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t rows = 1500, cols = 70, n = rows * cols;
  REQUIRE(cu::column_sum_workspace_floats(rows, cols) > 0); // several splits of the rows: two levels
  const auto x = random(n, 141), g = random(n, 142);
  dev<float> dx(x), dg(g), ws(cu::column_sum_workspace_floats(rows, cols, 2)), sums(cols), again(cols);
  std::vector<float> want(cols);
  std::vector<double> bound(cols);
  for (std::size_t c = 0; c < cols; ++c) {
    double exact = 0, magnitude = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      exact += x[r * cols + c];
      magnitude += std::abs(x[r * cols + c]);
    }
    want[c] = static_cast<float>(exact);
    bound[c] = 2.0 * static_cast<double>(rows) * std::ldexp(1.0, -24) * magnitude; // f32 summation's error bound
  }
  cu::bias_add_grad(dx.p(), sums.p(), rows, cols, false, s.get(), ws.p());
  const auto got = sums.get();
  for (std::size_t c = 0; c < cols; ++c) {
    INFO("column " << c << ": " << got[c] << " against " << want[c]);
    CHECK(std::abs(static_cast<double>(got[c]) - static_cast<double>(want[c])) <= bound[c]);
  }
  cu::bias_add_grad(dx.p(), again.p(), rows, cols, false, s.get(), ws.p());
  const auto repeated = again.get();
  CHECK(std::memcmp(got.data(), repeated.data(), cols * sizeof(float)) == 0);
  // Accumulating, and the two sums of the norms' gain gradients, against the CPU kernels.
  std::vector<float> acc(want);
  cu::bias_add_grad(dg.p(), sums.p(), rows, cols, true, s.get(), ws.p());
  cpu::bias_add_grad(g, acc, rows, cols, true);
  check_close(sums.get(), acc, 1e-4f, 1e-4f);
  std::vector<float> wm(rows), wr(rows), wdx(n), wdgam(cols), wdbet(cols), ln(n);
  const auto gamma = random(cols, 143, 0.5f, 1.5f);
  cpu::layernorm(x, gamma, std::vector<float>(cols, 0.0f), ln, wm, wr, rows, cols, 1e-5f);
  cpu::layernorm_grad(g, x, gamma, wm, wr, wdx, wdgam, wdbet, rows, cols, false);
  dev<float> mean(wm), rstd(wr), dgamma(cols);
  cu::layernorm_grad_gamma(dg.p(), dx.p(), mean.p(), rstd.p(), dgamma.p(), rows, cols, false, s.get(), ws.p());
  check_close(dgamma.get(), wdgam, 1e-4f, 1e-4f);
  std::vector<float> wrms(n), wrr(rows), wgain(cols);
  cpu::rmsnorm(x, gamma, wrms, wrr, rows, cols, 1e-6f);
  cpu::rmsnorm_grad_gain(g, x, wrr, wgain, rows, cols, false);
  dev<float> rrstd(wrr), dgain(cols);
  cu::rmsnorm_grad_gain(dg.p(), dx.p(), rrstd.p(), dgain.p(), rows, cols, false, s.get(), ws.p());
  check_close(dgain.get(), wgain, 1e-4f, 1e-4f);
}

TEST_CASE("the embedding gradient over heavily repeated ids is the CPU kernel's, bit for bit, every run",
          "[gpu][kernels][embedding]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  // 90% of the tokens share one id; more tokens than a placement chunk, more columns than a block.
  const std::size_t vocab = 40, dim = 300, n = 600;
  auto ids = gpu_testing::random_ids(n, static_cast<std::int32_t>(vocab), 151);
  for (std::size_t i = 0; i < n; ++i)
    if (i % 10 != 3) ids[i] = 7;
  const auto dout = random(n * dim, 152);
  dev<std::int32_t> did(ids), status(1);
  dev<float> ddout(dout), ws(cu::embedding_grad_workspace_floats(n, vocab)), first(vocab * dim), second(vocab * dim);
  std::vector<float> want(vocab * dim, 0.25f);
  cpu::embedding_grad(ids, dout, want, dim, false);
  cu::embedding_grad(did.p(), ddout.p(), first.p(), n, dim, vocab, false, 0, true, status.p(), 3, ws.p(), s.get());
  cu::embedding_grad(did.p(), ddout.p(), second.p(), n, dim, vocab, false, 0, true, status.p(), 3, ws.p(), s.get());
  const auto a = first.get(), b = second.get();
  CHECK(std::memcmp(a.data(), want.data(), want.size() * sizeof(float)) == 0); // the CPU's sums, in its order
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  // Accumulating onto the table, from bf16 gradients into an f32 table.
  const typed narrow_dout(ir::dtype::bf16, dout);
  cpu::embedding_grad(ids, narrow_dout.host, want, dim, true);
  cu::embedding_grad(did.p(), narrow_dout.in(), first.p(), n, dim, vocab, true, 0, true, status.p(), 3, ws.p(), s.get());
  const auto c = first.get();
  CHECK(std::memcmp(c.data(), want.data(), want.size() * sizeof(float)) == 0);
  CHECK(status.get()[0] == 0);
  // An id outside the table is skipped and flagged; the other rows' sums are unchanged.
  ids[5] = static_cast<std::int32_t>(vocab);
  dev<std::int32_t> bad(ids);
  cu::embedding_grad(bad.p(), ddout.p(), second.p(), n, dim, vocab, false, 0, true, status.p(), 3, ws.p(), s.get());
  CHECK(status.get()[0] == 3);
  cpu::embedding_grad(ids, dout, want, dim, false, 0, cpu::id_outside_table::zero_row);
  const auto skipped = second.get();
  CHECK(std::memcmp(skipped.data(), want.data(), want.size() * sizeof(float)) == 0);
}

TEST_CASE("an update under a 16-bit policy leaves its f32 master, rounded, in the working copy", "[gpu][kernels][optimizer][bf16]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  const std::size_t n = 1000;
  const auto p0 = random(n, 81), g = random(n, 82);
  dev<std::int64_t> step(std::vector<std::int64_t>{1}); // the first step: AdamW's bias corrections divide by 1 - beta^step
  for (const auto type : {ir::dtype::bf16, ir::dtype::f16}) {
    CAPTURE(ir::to_string(type));
    dev<float> dp(p0), dg(g), dm(std::vector<float>(n, 0.0f)), dv(std::vector<float>(n, 0.0f));
    typed working(type, n);
    cu::adamw_update(dp.p(), dg.p(), dm.p(), dv.p(), n, {.lr = 1e-2f}, {}, step.p(), nullptr, 0.0f, s.get(), nullptr,
                     {working.buf.data(), type});
    const auto master = dp.get();
    CHECK(working.get() == typed::rounded(type, master));
    CHECK(master != typed::rounded(type, master)); // the master keeps what the copy rounds off
    // SGD, without momentum: its one optional write is the working copy.
    dev<float> sp(p0);
    typed sgd_copy(type, n);
    cu::sgd_update(sp.p(), dg.p(), nullptr, n, {.lr = 0.1f}, {}, step.p(), nullptr, 0.0f, s.get(), nullptr,
                   {sgd_copy.buf.data(), type});
    CHECK(sgd_copy.get() == typed::rounded(type, sp.get()));
  }
  // An overflowed loss-scaled step leaves the master as it was and writes it, rounded, into the
  // working copy (under ZeRO-1/2 the shard the gather then moves, which nothing else fills).
  dev<float> dp(p0), dg(g), dm(std::vector<float>(n, 0.0f)), dv(std::vector<float>(n, 0.0f));
  dev<float> inf_norm(std::vector<float>(1, INFINITY)), scale(std::vector<float>(1, 1024.0f));
  typed working(ir::dtype::f16, n);
  cu::adamw_update(dp.p(), dg.p(), dm.p(), dv.p(), n, {.lr = 1e-2f}, {}, step.p(), inf_norm.p(), 0.0f, s.get(), scale.p(),
                   {working.buf.data(), ir::dtype::f16});
  CHECK(dp.get() == p0);
  CHECK(working.get() == typed::rounded(ir::dtype::f16, p0));
}
