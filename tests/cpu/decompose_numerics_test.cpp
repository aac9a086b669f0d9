// Decomposed and bucketed graphs compute what the original computes: a tiny SPMD interpreter
// runs every rank of a graph in one process (matmuls with the CPU kernels, collectives over
// the ranks' copies, slice / concat by their attributes) on seeded random data.

#include <concerto/ir/builder.hpp>
#include <concerto/planner/bucket.hpp>
#include <concerto/planner/decompose.hpp>
#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace concerto;
namespace cpu = concerto::runtime::cpu;

namespace {

using memory = std::vector<std::vector<float>>; // per root buffer id, its floats (others empty)

// Every root buffer of every rank filled from a seed of (rank, buffer name), so two graphs
// that share buffer names start from the same data.
std::vector<memory> initial(const ir::graph& g, int ranks) {
  std::vector<memory> m(static_cast<std::size_t>(ranks), memory(g.buffers.size()));
  for (int r = 0; r < ranks; ++r)
    for (const auto& b : g.buffers) {
      if (b.view_of >= 0) continue;
      std::seed_seq seq(b.name.begin(), b.name.end());
      std::mt19937 rng(seq);
      rng.discard(static_cast<unsigned long long>(r) * 7919u);
      std::uniform_real_distribution<float> d(-1.0f, 1.0f);
      auto& v = m[static_cast<std::size_t>(r)][static_cast<std::size_t>(b.id)];
      v.resize(static_cast<std::size_t>(b.bytes / 4));
      for (auto& x : v) x = d(rng);
    }
  return m;
}

std::span<float> span_of(const ir::graph& g, memory& m, ir::buffer_id b) {
  auto& root = m[static_cast<std::size_t>(g.root_of(b))];
  return std::span<float>(root).subspan(static_cast<std::size_t>(g.root_offset(b) / 4),
                                        static_cast<std::size_t>(g.buffers[static_cast<std::size_t>(b)].bytes / 4));
}

// How a gathered (or scattered) buffer holds the p rank parts, as the MPI backend reads attr
// `dim` of the collective against the buffer's shape: [outer, p, len] floats, part s at
// [:, s, :]. Without a shape, or along dim 0, the parts are p contiguous blocks (outer = 1).
std::pair<std::size_t, std::size_t> parts_along(const ir::graph& g, const ir::task& t, ir::buffer_id b, std::size_t p) {
  const auto& buf = g.buffers[static_cast<std::size_t>(b)];
  const auto dim = static_cast<std::size_t>(t.attr("dim", 0));
  const auto elems = static_cast<std::size_t>(buf.bytes / 4);
  if (dim == 0 || buf.shape.empty()) return {1, elems / p};
  INFO("task " << t.name << " along dim " << dim << " of buffer " << buf.name);
  REQUIRE(dim < buf.shape.size());
  std::size_t outer = 1;
  for (std::size_t d = 0; d < dim; ++d) outer *= static_cast<std::size_t>(buf.shape[d]);
  REQUIRE(static_cast<std::size_t>(buf.shape[dim]) % p == 0);
  return {outer, elems / outer / p};
}

// Runs the tasks in id order (builder and rewrite graphs are in program order).
void run(const ir::graph& g, std::vector<memory>& ranks) {
  const auto p = ranks.size();
  for (const auto& t : g.tasks) {
    const auto at = [&](std::size_t r, ir::buffer_id b) { return span_of(g, ranks[r], b); };
    switch (t.kind) {
    case ir::op_kind::matmul:
      for (std::size_t r = 0; r < p; ++r) {
        std::vector<float> out(at(r, t.writes[0]).size());
        cpu::matmul(at(r, t.reads[0]), at(r, t.reads[1]), out, static_cast<std::size_t>(t.attr("m")),
                    static_cast<std::size_t>(t.attr("n")), static_cast<std::size_t>(t.attr("k")),
                    {.trans_a = t.attr("trans_a") != 0, .trans_b = t.attr("trans_b") != 0});
        std::copy(out.begin(), out.end(), at(r, t.writes[0]).begin());
      }
      break;
    case ir::op_kind::slice: {
      const auto outer = t.attr("outer"), extent = t.attr("extent"), inner = t.attr("inner");
      const auto offset = t.attr("offset"), length = t.attr("length");
      for (std::size_t r = 0; r < p; ++r) {
        auto in = at(r, t.reads[0]);
        auto out = at(r, t.writes[0]);
        REQUIRE(static_cast<std::int64_t>(out.size()) == outer * length * inner);
        for (std::int64_t o = 0; o < outer; ++o)
          std::memcpy(&out[static_cast<std::size_t>(o * length * inner)],
                      &in[static_cast<std::size_t>((o * extent + offset) * inner)],
                      static_cast<std::size_t>(length * inner) * sizeof(float));
      }
      break;
    }
    case ir::op_kind::concat: {
      const auto outer = t.attr("outer"), inner = t.attr("inner"), length = t.attr("length");
      const auto parts = static_cast<std::int64_t>(t.reads.size());
      for (std::size_t r = 0; r < p; ++r) {
        auto out = at(r, t.writes[0]);
        for (std::int64_t j = 0; j < parts; ++j) {
          auto in = at(r, t.reads[static_cast<std::size_t>(j)]);
          for (std::int64_t o = 0; o < outer; ++o)
            std::memcpy(&out[static_cast<std::size_t>((o * parts + j) * length * inner)],
                        &in[static_cast<std::size_t>(o * length * inner)],
                        static_cast<std::size_t>(length * inner) * sizeof(float));
        }
      }
      break;
    }
    case ir::op_kind::all_gather: {
      std::vector<std::vector<float>> in;
      for (std::size_t r = 0; r < p; ++r) in.emplace_back(at(r, t.reads[0]).begin(), at(r, t.reads[0]).end());
      const auto [outer, len] = parts_along(g, t, t.writes[0], p);
      for (std::size_t r = 0; r < p; ++r) {
        auto out = at(r, t.writes[0]);
        REQUIRE(out.size() == p * in[0].size());
        for (std::size_t s = 0; s < p; ++s)
          for (std::size_t o = 0; o < outer; ++o)
            std::copy_n(in[s].begin() + static_cast<std::ptrdiff_t>(o * len), len,
                        out.begin() + static_cast<std::ptrdiff_t>((o * p + s) * len));
      }
      break;
    }
    case ir::op_kind::all_to_all: { // block s of rank r's output is block r of rank s's input
      std::vector<std::vector<float>> in;
      for (std::size_t r = 0; r < p; ++r) in.emplace_back(at(r, t.reads[0]).begin(), at(r, t.reads[0]).end());
      const auto block = in[0].size() / p;
      REQUIRE(block * p == in[0].size());
      for (std::size_t r = 0; r < p; ++r) {
        auto out = at(r, t.writes[0]);
        REQUIRE(out.size() == in[0].size());
        for (std::size_t s = 0; s < p; ++s)
          std::copy_n(in[s].begin() + static_cast<std::ptrdiff_t>(r * block), block,
                      out.begin() + static_cast<std::ptrdiff_t>(s * block));
      }
      break;
    }
    case ir::op_kind::all_reduce:
    case ir::op_kind::reduce_scatter: {
      const auto size = at(0, t.reads[0]).size();
      std::vector<float> sum(size, 0.0f);
      for (std::size_t r = 0; r < p; ++r) {
        auto in = at(r, t.reads[0]);
        for (std::size_t i = 0; i < size; ++i) sum[i] += in[i]; // rank order: the same in every variant
      }
      if (t.kind == ir::op_kind::all_reduce) {
        for (std::size_t r = 0; r < p; ++r) std::copy(sum.begin(), sum.end(), at(r, t.writes[0]).begin());
        break;
      }
      const auto [outer, len] = parts_along(g, t, t.reads[0], p);
      for (std::size_t r = 0; r < p; ++r) {
        auto out = at(r, t.writes[0]);
        REQUIRE(out.size() * p == size);
        for (std::size_t o = 0; o < outer; ++o)
          std::copy_n(sum.begin() + static_cast<std::ptrdiff_t>((o * p + r) * len), len,
                      out.begin() + static_cast<std::ptrdiff_t>(o * len));
      }
      break;
    }
    case ir::op_kind::elementwise:
      for (std::size_t r = 0; r < p; ++r) { // "scale": out = 2·in, the stand-in for any kernel
        auto in = at(r, t.reads[0]);
        auto out = at(r, t.writes[0]);
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = 2.0f * in[i % in.size()];
      }
      break;
    default:
      FAIL("the test interpreter has no " << ir::to_string(t.kind));
    }
  }
}

// Norm-wise relative difference max|a - b| / max|a| of the named buffer over all ranks: the
// BLAS blocks a GEMM by its row count, so a chunk's sums may round differently in the last bit.
double difference(const ir::graph& ga, std::vector<memory>& ma, const ir::graph& gb, std::vector<memory>& mb,
                  const std::string& name) {
  ir::buffer_id ia = -1, ib = -1;
  for (const auto& b : ga.buffers) if (b.name == name) ia = b.id;
  for (const auto& b : gb.buffers) if (b.name == name) ib = b.id;
  REQUIRE(ia >= 0);
  REQUIRE(ib >= 0);
  double worst = 0, scale = 0;
  for (std::size_t r = 0; r < ma.size(); ++r) {
    auto a = span_of(ga, ma[r], ia);
    auto b = span_of(gb, mb[r], ib);
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
      scale = std::max(scale, std::abs(double(a[i])));
    }
  }
  REQUIRE(scale > 0); // the data went through: no vacuous comparison of zeros
  return worst / scale;
}

ir::task_id find(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t.id;
  FAIL("no task named " << name);
  return -1;
}

std::string named(std::string prefix, int i) {
  prefix += std::to_string(i);
  return prefix;
}

constexpr std::int64_t rows = 48, hid = 20, cols = 12;

// The three shapes decomposition knows, on a group of `p` ranks, f32. Sequence parallel: the
// activations are [1, rows, ·] (one sequence of `rows` tokens, as the DSL lowers them) and the
// all_gather / reduce_scatter run along dim 1, the sequence.
ir::graph model_graph(int p, bool sequence_parallel = false) {
  ir::builder b(sequence_parallel ? "numerics-sp" : "numerics");
  const auto act = [&](std::vector<std::int64_t> shape) {
    if (sequence_parallel) shape.insert(shape.begin(), 1);
    return shape;
  };
  const int tp = b.axis("tp", p);
  const auto x = b.buffer("x.sp", act({rows / p, hid}), ir::buffer_role::input);
  const auto w1 = b.buffer("w1", {hid, cols}, ir::buffer_role::param);
  const auto xf = b.buffer("x.full", act({rows, hid}));
  const auto ag = b.collective(ir::op_kind::all_gather, "x.ag", tp, x, xf);
  const auto y = b.buffer("y", act({rows, cols}));
  b.matmul("fc1", xf, w1, y, rows, cols, hid);
  const auto a = b.buffer("a", act({rows, cols}));
  b.compute(ir::op_kind::elementwise, "act", {y}, {a}, {ir::op::scale, 1, -1, {{"num", 2}, {"den", 1}}});
  const auto w2 = b.buffer("w2", {cols, hid}, ir::buffer_role::param);
  const auto z = b.buffer("z.partial", act({rows, hid}));
  b.matmul("fc2", a, w2, z, rows, hid, cols);
  const auto zs = b.buffer("z", act({rows / p, hid}));
  const auto rs = b.collective(ir::op_kind::reduce_scatter, "z.rs", tp, z, zs);
  b.at(ir::phase::backward);
  const auto dz = b.buffer("dz", act({rows, hid}), ir::buffer_role::input);
  const auto gw = b.buffer("w2.grad", {cols, hid}, ir::buffer_role::gradient);
  b.matmul("fc2.wgrad", a, dz, gw, cols, hid, rows, 1, /*trans_a=*/true);
  b.collective(ir::op_kind::all_reduce, "w2.grad.ar", tp, gw, gw);
  auto g = std::move(b).finish();
  if (sequence_parallel)
    for (auto id : {ag, rs}) g.tasks[static_cast<std::size_t>(id)].attrs["dim"] = 1;
  return g;
}

} // namespace

TEST_CASE("a decomposed graph computes what the unsplit graph computes", "[decompose][numerics]") {
  cpu::init_blas_threads(1);
  const int p = GENERATE(1, 2, 4);
  const int k = GENERATE(2, 4);
  if (rows / p % k != 0) return;
  const auto g = model_graph(p);
  const std::vector<planner::decomposition> d{{find(g, "x.ag"), find(g, "fc1"), k},
                                              {find(g, "z.rs"), find(g, "fc2"), k},
                                              {find(g, "w2.grad.ar"), find(g, "fc2.wgrad"), k}};
  const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
  REQUIRE(split.tasks.size() > g.tasks.size());
  auto want = initial(g, p);
  auto got = initial(split, p);
  run(g, want);
  run(split, got);
  INFO("p = " << p << ", k = " << k);
  for (const char* name : {"y", "a", "z", "w2.grad"}) {
    INFO("buffer " << name);
    CHECK(difference(g, want, split, got, name) <= 1e-6);
  }
  // The result is not trivially zero: the data went through every task.
  bool nonzero = false;
  for (float v : span_of(g, want[0], g[find(g, "z.rs")].writes[0])) nonzero = nonzero || v != 0.0f;
  CHECK(nonzero);
}

TEST_CASE("a decomposed sequence-parallel graph gathers and scatters its chunks along their rows",
          "[decompose][numerics][sp]") {
  // The interpreter places rank parts along attr dim of the buffers, as the MPI backend does. The
  // chunk buffers are [rows, columns]: a chunk collective that kept the original's dim = 1 would
  // interleave the chunk's columns instead of stacking its rank blocks.
  cpu::init_blas_threads(1);
  const int p = GENERATE(2, 4);
  const int k = GENERATE(2, 4);
  if (rows / p % k != 0) return;
  const auto g = model_graph(p, /*sequence_parallel=*/true);
  const std::vector<planner::decomposition> d{{find(g, "x.ag"), find(g, "fc1"), k},
                                              {find(g, "z.rs"), find(g, "fc2"), k}};
  const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
  INFO("p = " << p << ", k = " << k);
  std::size_t chunks = 0;
  for (const auto& t : split.tasks)
    if (t.name.starts_with("x.ag.chunk") || t.name.starts_with("z.rs.chunk")) {
      INFO("chunk collective " << t.name);
      CHECK(t.attr("dim", 0) == 0);
      ++chunks;
    }
  CHECK(chunks == 2 * static_cast<std::size_t>(k));
  auto want = initial(g, p);
  auto got = initial(split, p);
  run(g, want);
  run(split, got);
  for (const char* name : {"y", "a", "z"}) {
    INFO("buffer " << name);
    CHECK(difference(g, want, split, got, name) <= 1e-6);
  }
}

// Expert parallel: dispatch all_to_all -> up matmul -> act -> down matmul -> combine
// all_to_all; the backward's weight gradient reads the exchanged tokens again and is
// all-reduced, then read by a stand-in optimizer.
ir::graph moe_graph(int p) {
  ir::builder b("moe-numerics");
  const int ep = b.axis("ep", p);
  const auto send = b.buffer("send", {rows, hid}, ir::buffer_role::input);
  const auto recv = b.buffer("recv", {rows, hid});
  b.collective(ir::op_kind::all_to_all, "dispatch.a2a", ep, send, recv);
  const auto w1 = b.buffer("w1", {hid, cols}, ir::buffer_role::param);
  const auto u = b.buffer("u", {rows, cols});
  b.matmul("up", recv, w1, u, rows, cols, hid);
  const auto a = b.buffer("a", {rows, cols});
  b.compute(ir::op_kind::elementwise, "act", {u}, {a}, {ir::op::scale, 1, -1, {{"num", 2}, {"den", 1}}});
  const auto w2 = b.buffer("w2", {cols, hid}, ir::buffer_role::param);
  const auto y = b.buffer("y", {rows, hid});
  b.matmul("down", a, w2, y, rows, hid, cols);
  const auto back = b.buffer("back", {rows, hid});
  b.collective(ir::op_kind::all_to_all, "combine.a2a", ep, y, back);
  b.at(ir::phase::backward);
  const auto du = b.buffer("du", {rows, cols}, ir::buffer_role::input);
  const auto gw = b.buffer("w1.grad", {hid, cols}, ir::buffer_role::gradient);
  b.matmul("up.wgrad", recv, du, gw, hid, cols, rows, 1, /*trans_a=*/true);
  b.collective(ir::op_kind::all_reduce, "w1.grad.ar", ep, gw, gw);
  const auto step = b.buffer("step", {hid, cols});
  b.at(ir::phase::optimizer);
  b.compute(ir::op_kind::elementwise, "update", {gw}, {step}, {ir::op::scale, 1, -1, {{"num", 2}, {"den", 1}}});
  return std::move(b).finish();
}

TEST_CASE("split all-to-alls and a split all-reduce compute what the unsplit graph computes",
          "[decompose][numerics][moe]") {
  cpu::init_blas_threads(1);
  const int p = GENERATE(1, 2, 4);
  const int k = GENERATE(2, 4);
  if (rows / p % k != 0) return;
  const auto g = moe_graph(p);
  std::vector<planner::decomposition> d{{find(g, "dispatch.a2a"), find(g, "up"), k},
                                        {find(g, "combine.a2a"), find(g, "down"), k}};
  if (p > 1) // one rank has nothing to scatter
    d.push_back({find(g, "w1.grad.ar"), -1, 1, planner::split_kind::reduce_scatter_all_gather});
  const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
  REQUIRE(split.tasks.size() > g.tasks.size());
  auto want = initial(g, p);
  auto got = initial(split, p);
  run(g, want);
  run(split, got);
  INFO("p = " << p << ", k = " << k);
  // Not "y": split, the down matmul's chunks go straight to the exchange, as with reduce_scatter.
  for (const char* name : {"recv", "u", "a", "back", "w1.grad", "step"}) {
    INFO("buffer " << name);
    CHECK(difference(g, want, split, got, name) <= 1e-6);
  }
  // The exchange moved data between ranks: rank 0 received other ranks' rows.
  if (p > 1) {
    const auto sent = span_of(g, want[1], g[find(g, "dispatch.a2a")].reads[0]);
    const auto received = span_of(g, want[0], g[find(g, "dispatch.a2a")].writes[0]);
    CHECK(received[rows / static_cast<std::size_t>(p) * hid] == sent[0]);
  }
}

TEST_CASE("bucketed gradients sum to what separate all-reduces give", "[bucket][numerics]") {
  cpu::init_blas_threads(1);
  ir::builder b("grads");
  const int dp = b.axis("dp", 3);
  b.at(ir::phase::backward);
  const auto x = b.buffer("x", {8, 6}, ir::buffer_role::input);
  std::vector<ir::task_id> ars;
  for (int i = 0; i < 4; ++i) {
    const auto dy = b.buffer(named("dy", i), {8, 3 + i}, ir::buffer_role::input);
    const auto gi = b.buffer(named("g", i), {6, 3 + i}, ir::buffer_role::gradient);
    b.matmul(named("wgrad", i), x, dy, gi, 6, 3 + i, 8, 1, true);
    ars.push_back(b.collective(ir::op_kind::all_reduce, named("g.ar", i), dp, gi, gi));
  }
  const auto g = std::move(b).finish();
  const auto fused = planner::apply_buckets(g, {{{ars[0], ars[1], ars[2]}}});
  REQUIRE(fused.tasks.size() == g.tasks.size() - 2);
  auto want = initial(g, 3);
  auto got = initial(fused, 3);
  run(g, want);
  run(fused, got);
  for (int i = 0; i < 4; ++i) {
    INFO("gradient " << i);
    CHECK(difference(g, want, fused, got, named("g", i)) == 0.0);
  }
}
