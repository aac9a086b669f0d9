// The executor on hand-built graphs with an in-process fake backend: stream orders and
// dependencies are respected, cross-stream waits happen only where the plan has a dependency
// across streams, every valid plan computes the same numbers, hangs become errors naming the
// lane, and steady-state steps allocate nothing.

#include <concerto/ir/builder.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/kernel_profile.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/trace/chrome_trace.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

// ---- allocation counting ----------------------------------------------------------------
// The replaced operators pair malloc with free themselves; GCC cannot see that through the
// replacement and warns at every inlined new/delete pair.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<long> allocations{0};
}
void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  const auto al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (std::max<std::size_t>(n, 1) + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return ::operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using namespace concerto;
namespace rt = concerto::runtime;

// ---- the fake backend -------------------------------------------------------------------

struct event {
  char what;          // 'c' compute ran, 's' collective started, 'f' collective finished, 'w' stream wait, 'r' record
  ir::task_id task;
  ir::stream_id stream; // for 'w': the stream made to wait
};

// One process plays every rank of a mesh whose axes all have size 1, so a collective moves
// its input to its output. Without stream ordering the move happens when the collective is
// seen complete, so a consumer that ran too early reads stale data and the numbers differ.
template <bool Ordered>
struct fake_backend {
  struct handle {
    ir::task_id task = -1;
  };
  static constexpr bool stream_ordered = Ordered;

  const ir::graph* g = nullptr;
  rt::host_arena arena;
  std::vector<rt::kernel_call> kernels;
  rt::kernel_settings settings{};
  std::vector<int> delay; // polls before a collective completes; -1: never
  std::vector<int> polls;
  std::vector<event> log;
  bool logging = true;
  int prepared = 0;

  void prepare(const plan::plan& p) {
    g = &p.graph;
    arena = rt::host_arena(p.graph, rt::make_layout(p.graph, rt::workspace_bytes(p.graph)));
    kernels.assign(p.graph.tasks.size(), {});
    for (const auto& t : p.graph.tasks)
      if (!ir::is_collective(t.kind)) kernels[static_cast<std::size_t>(t.id)] = rt::decode(p.graph, t);
    if (delay.empty()) delay.assign(p.graph.tasks.size(), 0);
    polls.assign(p.graph.tasks.size(), 0);
    log.reserve(1 << 12);
    ++prepared;
  }
  void begin_step(std::int64_t step) { settings.step = step; }
  void end_step() {}
  void note(char what, ir::task_id t, ir::stream_id s) {
    if (logging) log.push_back({what, t, s});
  }
  void run_compute(const ir::task& t) {
    rt::run_kernel(kernels[static_cast<std::size_t>(t.id)], arena, settings);
    note('c', t.id, t.stream);
  }
  void move(ir::task_id id) {
    const auto& t = g->tasks[static_cast<std::size_t>(id)];
    const auto in = arena.bytes(t.reads.at(0)), out = arena.bytes(t.writes.at(0));
    REQUIRE(in.size() == out.size());
    std::memmove(out.data(), in.data(), in.size());
  }
  handle start_collective(const ir::task& t) {
    polls[static_cast<std::size_t>(t.id)] = 0;
    if (Ordered) move(t.id);
    note('s', t.id, t.stream);
    return {t.id};
  }
  bool poll(handle& h) {
    const auto i = static_cast<std::size_t>(h.task);
    if (delay[i] < 0 || ++polls[i] < delay[i]) return false;
    if (!Ordered) move(h.task);
    note('f', h.task, g->tasks[i].stream);
    return true;
  }
  bool test(handle& h) { return poll(h); }
  std::optional<std::size_t> wait_any(std::span<handle> in_flight, rt::clock::time_point deadline) {
    for (;;) {
      for (std::size_t i = 0; i < in_flight.size(); ++i)
        if (poll(in_flight[i])) return i;
      if (rt::clock::now() >= deadline) return std::nullopt;
    }
  }
  void record(const ir::task& t) { note('r', t.id, t.stream); }
  void stream_wait(ir::stream_id s, const ir::task& dep) { note('w', dep.id, s); }
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void broadcast(std::string&, int, std::string_view) {}
  std::int64_t min_all(std::int64_t v, std::string_view) { return v; }
  void barrier(std::string_view) {}
};

static_assert(rt::backend<fake_backend<false>>);
static_assert(rt::backend<fake_backend<true>>);

// ---- graphs and plans -------------------------------------------------------------------

struct mlp_ids {
  ir::buffer_id x, w1, w2, target, loss, dw1, dw2;
};

// A two-layer MLP step on one rank, with a tensor-parallel all-gather and data-parallel
// gradient all-reduces on lanes of size-1 axes, and SGD updates.
ir::graph mlp_graph(mlp_ids* ids = nullptr) {
  ir::builder b("mlp");
  const int dp = b.axis("dp", 1), tp = b.axis("tp", 1);
  const auto x = b.buffer("x", {8, 16}, ir::buffer_role::input);
  const auto w1 = b.buffer("w1", {16, 32}, ir::buffer_role::param);
  const auto w2 = b.buffer("w2", {32, 4}, ir::buffer_role::param);
  const auto target = b.buffer("target", {8, 4}, ir::buffer_role::input);
  const auto h = b.buffer("h", {8, 32}), a = b.buffer("a", {8, 32}), y = b.buffer("y", {8, 4});
  const auto yf = b.buffer("y.full", {8, 4}), loss = b.buffer("loss", {1}), dy = b.buffer("dy", {8, 4});
  const auto da = b.buffer("da", {8, 32}), dh = b.buffer("dh", {8, 32});
  const auto dw1 = b.buffer("w1.grad", {16, 32}, ir::buffer_role::gradient);
  const auto dw2 = b.buffer("w2.grad", {32, 4}, ir::buffer_role::gradient);
  b.matmul("fc1", x, w1, h, 8, 32, 16);
  b.compute(ir::op::gelu, "act", {h}, {a});
  b.matmul("fc2", a, w2, y, 8, 4, 32);
  b.collective(ir::op_kind::all_gather, "y.ag", tp, y, yf);
  b.at(ir::phase::backward);
  b.compute(ir::op::mse, "loss", {yf, target}, {loss});
  b.compute(ir::op::mse_grad, "loss.grad", {yf, target}, {dy});
  b.matmul("fc2.wgrad", a, dy, dw2, 32, 4, 8, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w2.grad.ar", dp, dw2, dw2);
  b.matmul("fc2.dgrad", dy, w2, da, 8, 32, 4, 1, false, true);
  b.compute(ir::op::gelu_grad, "act.grad", {h, da}, {dh});
  b.matmul("fc1.wgrad", x, dh, dw1, 16, 32, 8, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w1.grad.ar", dp, dw1, dw1);
  b.at(ir::phase::optimizer);
  b.compute(ir::op::sgd, "w2.sgd", {w2, dw2}, {w2});
  b.compute(ir::op::sgd, "w1.sgd", {w1, dw1}, {w1});
  if (ids) *ids = {x, w1, w2, target, loss, dw1, dw2};
  return std::move(b).finish();
}

plan::plan make_plan(const planner::ordering& s, const char* policy) {
  std::vector<double> d(s.graph.tasks.size(), 1.0);
  auto p = sim::to_plan(s.graph, s.order, d, 1.0, policy, "test");
  plan::verify(p);
  return p;
}

// A random topological order (random priorities among ready tasks), split by stream.
plan::plan random_plan(const ir::graph& g, std::mt19937& rng) {
  const auto succ = g.successors();
  std::vector<int> indeg(g.tasks.size());
  for (const auto& t : g.tasks) indeg[static_cast<std::size_t>(t.id)] = static_cast<int>(t.deps.size());
  std::vector<ir::task_id> ready, order;
  for (const auto& t : g.tasks)
    if (t.deps.empty()) ready.push_back(t.id);
  while (!ready.empty()) {
    const auto k = std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(rng);
    const auto id = ready[k];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(k));
    order.push_back(id);
    for (const auto s : succ[static_cast<std::size_t>(id)])
      if (--indeg[static_cast<std::size_t>(s)] == 0) ready.push_back(s);
  }
  planner::ordering s{g, std::vector<std::vector<ir::task_id>>(g.streams.size())};
  for (const auto id : order) s.order[static_cast<std::size_t>(g[id].stream)].push_back(id);
  return make_plan(s, "random");
}

template <bool Ordered>
void fill_inputs(fake_backend<Ordered>& be, const mlp_ids& ids) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const auto b : {ids.x, ids.w1, ids.w2, ids.target})
    for (auto& v : be.arena.f32(b)) v = u(rng);
}

// The index in the log of each event of a kind, per task.
std::vector<std::ptrdiff_t> index_of(const std::vector<event>& log, std::size_t n, auto&& pick) {
  std::vector<std::ptrdiff_t> at(n, -1);
  for (std::size_t i = 0; i < log.size(); ++i)
    if (pick(log[i])) at[static_cast<std::size_t>(log[i].task)] = static_cast<std::ptrdiff_t>(i);
  return at;
}

} // namespace

TEST_CASE("the executor issues each stream's tasks in the plan's order, after their dependencies", "[runtime][executor]") {
  const auto g = mlp_graph();
  std::mt19937 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    const auto p = random_plan(g, rng);
    fake_backend<false> be;
    be.delay.resize(g.tasks.size());
    for (auto& d : be.delay) d = std::uniform_int_distribution<int>(0, 5)(rng);
    rt::executor ex(p, be);
    ex.run_step();
    const auto n = g.tasks.size();
    const auto started = index_of(be.log, n, [](const event& e) { return e.what == 'c' || e.what == 's'; });
    const auto finished = index_of(be.log, n, [](const event& e) { return e.what == 'c' || e.what == 'f'; });
    SECTION("every task runs exactly once") {
      for (std::size_t i = 0; i < n; ++i) CHECK(finished[i] >= 0);
      CHECK(be.log.size() == n + static_cast<std::size_t>(std::count_if(g.tasks.begin(), g.tasks.end(),
                                                                        [](const auto& t) { return ir::is_collective(t.kind); })));
    }
    SECTION("each stream starts its tasks in the plan's order") {
      for (const auto& order : p.order)
        for (std::size_t k = 1; k < order.size(); ++k)
          CHECK(started[static_cast<std::size_t>(order[k - 1])] < started[static_cast<std::size_t>(order[k])]);
    }
    SECTION("no task starts before all its dependencies have finished") {
      for (const auto& t : g.tasks)
        for (const auto d : t.deps) CHECK(finished[static_cast<std::size_t>(d)] < started[static_cast<std::size_t>(t.id)]);
    }
    SECTION("a stream that runs to completion on the host never waits on events") {
      CHECK(std::none_of(be.log.begin(), be.log.end(), [](const event& e) { return e.what == 'w' || e.what == 'r'; }));
    }
  }
}

TEST_CASE("on a stream-ordered backend the executor waits across streams only where the plan has a dependency",
          "[runtime][executor]") {
  const auto g = mlp_graph();
  const auto p = make_plan(planner::program_order_schedule(g), "program_order");
  fake_backend<true> be;
  be.delay.assign(g.tasks.size(), -1); // nothing completes before the step ends: every cross dep needs a wait
  rt::executor ex(p, be);
  ex.run_step();
  std::vector<std::pair<ir::task_id, ir::stream_id>> expected, waits;
  std::vector<ir::task_id> recorded, needs_record;
  for (const auto& t : g.tasks)
    for (const auto d : t.deps)
      if (g[d].stream != t.stream) {
        expected.emplace_back(d, t.stream);
        needs_record.push_back(d);
      }
  for (const auto& e : be.log) {
    if (e.what == 'w') waits.emplace_back(e.task, e.stream);
    if (e.what == 'r') recorded.push_back(e.task);
  }
  std::sort(expected.begin(), expected.end());
  std::sort(waits.begin(), waits.end());
  std::sort(needs_record.begin(), needs_record.end());
  needs_record.erase(std::unique(needs_record.begin(), needs_record.end()), needs_record.end());
  std::sort(recorded.begin(), recorded.end());

  SECTION("one stream wait per cross-stream dependency, none for same-stream ones") {
    REQUIRE_FALSE(expected.empty());
    CHECK(waits == expected);
    CHECK(ex.cross_stream_dependencies() == expected.size());
  }
  SECTION("an event is recorded exactly for the tasks another stream waits on, before any wait on it") {
    CHECK(recorded == needs_record);
    const auto rec = index_of(be.log, g.tasks.size(), [](const event& e) { return e.what == 'r'; });
    for (std::size_t i = 0; i < be.log.size(); ++i)
      if (be.log[i].what == 'w') CHECK(rec[static_cast<std::size_t>(be.log[i].task)] < static_cast<std::ptrdiff_t>(i));
  }
  SECTION("tasks are issued without waiting for completions") {
    CHECK(std::none_of(be.log.begin(), be.log.end(), [](const event& e) { return e.what == 'f'; }));
  }
}

TEST_CASE("every valid plan of a graph computes the same buffers", "[runtime][executor][numerics]") {
  mlp_ids ids{};
  const auto g = mlp_graph(&ids);
  const auto run = [&](const plan::plan& p, int steps) {
    fake_backend<false> be;
    be.delay.assign(g.tasks.size(), 2);
    rt::executor ex(p, be);
    fill_inputs(be, ids);
    for (int s = 0; s < steps; ++s) ex.run_step();
    return std::vector<std::byte>(be.arena.data(), be.arena.data() + be.arena.total_bytes());
  };
  const auto sync = run(make_plan(planner::sync_schedule(g), "sync"), 3);
  const auto eager = run(make_plan(planner::program_order_schedule(g), "program_order"), 3);
  SECTION("sync and program_order plans give identical bytes") { CHECK(sync == eager); }
  SECTION("random topological plans give identical bytes") {
    std::mt19937 rng(3);
    for (int i = 0; i < 5; ++i) CHECK(run(random_plan(g, rng), 3) == sync);
  }
  SECTION("the steps train: the loss after three steps is below the first step's") {
    fake_backend<false> be;
    rt::executor ex(make_plan(planner::program_order_schedule(g), "program_order"), be);
    fill_inputs(be, ids);
    be.settings.sgd.lr = 0.05f;
    ex.run_step();
    const float first = be.arena.f32(ids.loss)[0];
    for (int s = 0; s < 5; ++s) ex.run_step();
    CHECK(first > 0.0f);
    CHECK(be.arena.f32(ids.loss)[0] < first);
  }
}

TEST_CASE("steady-state steps allocate nothing", "[runtime][executor][memory]") {
  mlp_ids ids{};
  const auto g = mlp_graph(&ids);
  fake_backend<false> be;
  be.logging = false;
  be.delay.assign(g.tasks.size(), 3);
  rt::executor ex(make_plan(planner::program_order_schedule(g), "program_order"), be);
  fill_inputs(be, ids);
  ex.run_step();
  const auto* arena = be.arena.data();
  const auto bytes = be.arena.total_bytes();
  const long before = allocations.load();
  for (int s = 0; s < 3; ++s) ex.run_step();
  const long during = allocations.load() - before;
  CHECK(during == 0);
  CHECK(be.arena.data() == arena);
  CHECK(be.arena.total_bytes() == bytes);
  CHECK(be.prepared == 1);
}

TEST_CASE("a collective that never completes fails the step with the lane and the collective named",
          "[runtime][executor][failure]") {
  const auto g = mlp_graph();
  fake_backend<false> be;
  be.delay.assign(g.tasks.size(), 0);
  const auto stuck = std::find_if(g.tasks.begin(), g.tasks.end(), [](const auto& t) { return t.name == "w2.grad.ar"; })->id;
  be.delay[static_cast<std::size_t>(stuck)] = -1;
  rt::executor ex(make_plan(planner::program_order_schedule(g), "program_order"), be,
                  {.timeout_s = 0.05, .timeout_from_env = false});
  using Catch::Matchers::ContainsSubstring;
  CHECK_THROWS_WITH(ex.run_step(), ContainsSubstring("timed out after 0.05 s") &&
                                       ContainsSubstring("all_reduce 'w2.grad.ar'") &&
                                       ContainsSubstring("lane 'comm:dp'") && ContainsSubstring("CONCERTO_TIMEOUT_S"));
}

TEST_CASE("the measured timeline describes the step", "[runtime][executor][trace]") {
  const auto g = mlp_graph();
  fake_backend<false> be;
  be.delay.assign(g.tasks.size(), 4);
  rt::executor ex(make_plan(planner::program_order_schedule(g), "program_order"), be);
  const auto& r = ex.run_step().measured;
  SECTION("one interval per task on its own stream, ending after it starts, within the step") {
    REQUIRE(r.timeline.size() == g.tasks.size());
    for (const auto& iv : r.timeline) {
      CHECK(iv.stream == g[iv.task].stream);
      CHECK(iv.start_us <= iv.end_us);
      CHECK(iv.end_us <= r.step_us);
    }
    CHECK(std::is_sorted(r.timeline.begin(), r.timeline.end(),
                         [](const auto& a, const auto& b) { return a.start_us < b.start_us; }));
  }
  SECTION("exposed communication is charged to lanes only and adds up") {
    CHECK(r.exposed_us[0] == 0.0);
    double sum = 0;
    for (const auto v : r.exposed_us) sum += v;
    CHECK(sum == r.exposed_comm_us);
    CHECK(r.exposed_comm_us <= r.step_us);
  }
  SECTION("it renders as a Chrome trace") {
    const auto text = trace::chrome_trace(g, r, "rank 0 (measured)");
    CHECK(text.find("\"w1.grad.ar\"") != std::string::npos);
  }
  SECTION("step numbers count from 1") { CHECK(ex.last().step == 1); }
}

TEST_CASE("a task no executor runs is refused before the first step, naming the task and fn", "[runtime][dispatch]") {
  using Catch::Matchers::ContainsSubstring;
  ir::builder b("priced");
  b.cost_only(); // the benchmark workloads' block transposes are such ops
  const auto x = b.buffer("x", {4, 2}), y = b.buffer("y", {4, 2});
  b.compute(ir::op_kind::copy, "group", {x}, {y}, {ir::op::transpose_blocks, 0});
  const auto g = std::move(b).finish();
  fake_backend<false> be;
  CHECK_THROWS_WITH((rt::executor(make_plan(planner::program_order_schedule(g), "program_order"), be)),
                    ContainsSubstring("'group'") && ContainsSubstring("fn 'transpose_blocks'") &&
                        ContainsSubstring("no executor runs"));
  SECTION("and a graph that is run may not hold one at all") {
    auto runnable = g;
    runnable.cost_only = false;
    CHECK_THROWS_WITH(runnable.validate(), ContainsSubstring("'group'") && ContainsSubstring("fn 'transpose_blocks'") &&
                                               ContainsSubstring("not marked cost_only"));
  }
}

TEST_CASE("dispatch maps layout kernels onto the buffers as documented", "[runtime][dispatch]") {
  ir::builder b("layout");
  const auto src = b.buffer("src", {2, 6});
  const auto part = b.buffer("part", {2, 3});
  const auto other = b.buffer("other", {2, 3});
  const auto joined = b.buffer("joined", {2, 6});
  const auto m = b.buffer("m", {2, 6}, ir::buffer_role::optimizer_state);
  const auto v = b.buffer("v", {2, 6}, ir::buffer_role::optimizer_state);
  const auto grad = b.buffer("grad", {2, 6}, ir::buffer_role::gradient);
  const auto padded = b.buffer("padded", {2, 8});
  b.slice("take", src, part, {2, 6}, 1, 3, 3);  // builder::slice converts a dimension to the explicit geometry
  b.slice("rest", src, other, {2, 6}, 1, 0, 3);
  b.concat("join", {part, other}, joined, {2, 6}, 1);
  b.compute(ir::op::adamw, "adam", {src, grad, m, v}, {src, m, v});
  b.place("pad", src, padded, {2, 8}, 1, 6); // concat of one part with attr extent
  auto g = std::move(b).finish();
  const auto layout = rt::make_layout(g);
  rt::host_arena mem(g, layout);
  for (int i = 0; i < 12; ++i) mem.f32(src)[static_cast<std::size_t>(i)] = static_cast<float>(i);
  rt::kernel_settings s;
  for (int i = 0; i < 3; ++i) rt::run_kernel(rt::decode(g, g.tasks[static_cast<std::size_t>(i)]), mem, s);
  SECTION("slice takes columns [offset, offset + length) of every row") {
    const std::vector<float> want{3, 4, 5, 9, 10, 11};
    CHECK(std::vector<float>(mem.f32(part).begin(), mem.f32(part).end()) == want);
  }
  SECTION("concat lays its parts side by side along the dimension") {
    const std::vector<float> want{3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 7, 8};
    CHECK(std::vector<float>(mem.f32(joined).begin(), mem.f32(joined).end()) == want);
  }
  SECTION("place copies its part into the start of every row of a wider buffer and leaves the rest") {
    for (auto& x : mem.f32(padded)) x = -1.0f;
    rt::run_kernel(rt::decode(g, g.tasks[4]), mem, s);
    const std::vector<float> want{0, 1, 2, 3, 4, 5, -1, -1, 6, 7, 8, 9, 10, 11, -1, -1};
    CHECK(std::vector<float>(mem.f32(padded).begin(), mem.f32(padded).end()) == want);
  }
  SECTION("adamw updates the parameter, m and v in place") {
    for (auto& x : mem.f32(grad)) x = 1.0f;
    s.adamw = {.lr = 0.1f, .weight_decay = 0.0f};
    rt::run_kernel(rt::decode(g, g.tasks[3]), mem, s);
    // First AdamW step with g = 1: m̂ = v̂ = 1, so p -= lr·1/(1 + eps).
    CHECK(std::abs(mem.f32(src)[5] - (5.0f - 0.1f)) < 1e-5f);
    CHECK(std::abs(mem.f32(m)[0] - 0.1f) < 1e-6f);   // m = (1-β1)·g
    CHECK(std::abs(mem.f32(v)[0] - 0.001f) < 1e-7f); // v = (1-β2)·g²
  }
  SECTION("an operand that does not fit the op is refused when the task is decoded") {
    auto bad = g;
    bad.tasks[3].reads = {grad, src, m, v}; // grad first: the update would write a buffer it does not read first
    using Catch::Matchers::ContainsSubstring;
    CHECK_THROWS_WITH(rt::decode(bad, bad.tasks[3]), ContainsSubstring("'adam'") && ContainsSubstring("fn 'adamw'") &&
                                                         ContainsSubstring("in place"));
  }
  SECTION("views alias their root in the layout") {
    ir::builder vb("views");
    const auto root = vb.buffer("root", {10});
    const auto v = vb.view("v", root, 16, 8, {2});
    vb.compute(ir::op::zero, "z", {}, {v});
    const auto vg = std::move(vb).finish();
    const auto l = rt::make_layout(vg, 100);
    CHECK(l.offset[static_cast<std::size_t>(v)] == l.offset[static_cast<std::size_t>(root)] + 16);
    CHECK(l.scratch_offset % 64 == 0);
    CHECK(l.total_bytes >= l.scratch_offset + 100);
  }
}

TEST_CASE("the DSL's loss and layernorm forms stay inside the workspace workspace_bytes sizes", "[runtime][dispatch]") {
  // Targets narrowed from i64 and the recomputed row lse share the scratch region: the loss with
  // i64 targets equals the loss with the same targets as i32 (the lse once overwrote half of them).
  const std::int64_t rows = 33, classes = 70, cols = 300;
  ir::builder b("scratch");
  const auto logits = b.buffer("logits", {rows, classes});
  const auto t64 = b.buffer("t64", {rows}, ir::buffer_role::input, ir::dtype::i64);
  const auto t32 = b.buffer("t32", {rows}, ir::buffer_role::input, ir::dtype::i32);
  const auto loss64 = b.buffer("loss64", {1}), loss32 = b.buffer("loss32", {1});
  const auto d64 = b.buffer("d64", {rows, classes}), d32 = b.buffer("d32", {rows, classes});
  // Layernorm without "rows"/"cols" attributes: its statistics' room comes from the operands.
  const auto x = b.buffer("x", {rows, cols}), gamma = b.buffer("gamma", {cols}, ir::buffer_role::param),
             beta = b.buffer("beta", {cols}, ir::buffer_role::param), y = b.buffer("y", {rows, cols});
  b.compute(ir::op::cross_entropy, "ce64", {logits, t64}, {loss64});
  b.compute(ir::op::cross_entropy, "ce32", {logits, t32}, {loss32});
  b.compute(ir::op::cross_entropy_grad, "ce64.grad", {logits, t64}, {d64});
  b.compute(ir::op::cross_entropy_grad, "ce32.grad", {logits, t32}, {d32});
  b.compute(ir::op::layernorm, "ln", {x, gamma, beta}, {y});
  auto g = std::move(b).finish();
  CHECK(rt::workspace_bytes(g) >= static_cast<std::int64_t>(2 * rows * sizeof(float))); // mean and rstd
  rt::host_arena mem(g, rt::make_layout(g, rt::workspace_bytes(g)));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> real(-2.0f, 2.0f);
  for (const auto f : {logits, x, gamma, beta})
    for (auto& v : mem.f32(f)) v = real(rng);
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto label = (r * 37 + 11) % classes;
    std::memcpy(mem.bytes(t64).data() + r * 8, &label, 8);
    mem.i32(t32)[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(label);
  }
  rt::kernel_settings s;
  for (const auto& t : g.tasks) rt::run_kernel(rt::decode(g, t), mem, s);
  CHECK(mem.f32(loss64)[0] == mem.f32(loss32)[0]);
  CHECK(std::equal(mem.f32(d64).begin(), mem.f32(d64).end(), mem.f32(d32).begin()));
  SECTION("a workspace smaller than a task takes is an error naming the task") {
    rt::host_arena small(g, rt::make_layout(g, 64));
    using Catch::Matchers::ContainsSubstring;
    CHECK_THROWS_WITH(rt::run_kernel(rt::decode(g, g.tasks[4]), small, s),
                      ContainsSubstring("'ln'") && ContainsSubstring("kernel workspace"));
  }
}

TEST_CASE("the graph's own kernels are timed and priced against the roofline", "[runtime][kernel_profile]") {
  const auto g = mlp_graph();
  const runtime::kernel_settings settings;
  const auto times = runtime::time_kernels(g, settings);
  std::set<std::string, std::less<>> kernels;
  for (const auto& t : g.tasks) {
    INFO(t.name);
    if (ir::is_collective(t.kind)) {
      CHECK(times.task_us[static_cast<std::size_t>(t.id)] == 0.0);
    } else {
      CHECK(times.task_us[static_cast<std::size_t>(t.id)] > 0.0);
      kernels.emplace(cost::model::kernel_name(t));
    }
  }
  SECTION("one factor per kernel, each the measured over the priced time") {
    // These kernels are tiny (8 × 32): with a launch cost they would all be launch-bound, and a
    // launch-bound kernel gets no factor.
    auto hw = cost::presets::cpu_defaults();
    hw.launch_us = 0;
    const cost::model m(hw);
    const auto scales = runtime::kernel_scales(times, g, m);
    std::set<std::string, std::less<>> named;
    for (const auto& [k, v] : scales) {
      named.insert(k);
      CHECK(v > 0);
    }
    CHECK(named == kernels);
    // A machine twice as fast on paper makes every kernel twice as far from its roofline.
    auto fast = m.hw();
    fast.peak_tflops *= 2;
    fast.vector_tflops *= 2;
    fast.mem_bandwidth_gbs *= 2;
    fast.kernel_scale = {{"gelu", 100.0}}; // ignored: factors are relative to the bare roofline
    const auto doubled = runtime::kernel_scales(times, g, cost::model(fast));
    for (const auto& [k, v] : scales) {
      INFO(k);
      CHECK(std::abs(doubled.at(k) / v - 2.0) < 1e-9);
    }
  }
  SECTION("only the kernels asked for are timed") {
    const auto some = runtime::time_kernels(g, settings, {"gelu"});
    for (const auto& t : g.tasks)
      CHECK((some.task_us[static_cast<std::size_t>(t.id)] > 0) == (t.fn == ir::op::gelu));
    CHECK_THROWS_WITH(runtime::kernel_scales(runtime::kernel_times{{1.0}}, g, cost::model(cost::presets::cpu_defaults())),
                      Catch::Matchers::ContainsSubstring("graph 'mlp'"));
  }
}

TEST_CASE("a backend refuses a plan made for another number of ranks, naming both", "[executor][mesh]") {
  ir::builder b("wide");
  b.axis("dp", 4);
  b.axis("tp", 2);
  const auto g = std::move(b).finish();
  CHECK(runtime::mesh_of_plan(g, 8).rank_count() == 8);
  CHECK_THROWS_WITH(runtime::mesh_of_plan(g, 2),
                    Catch::Matchers::ContainsSubstring("graph 'wide' is for a mesh of 8 ranks (dp=4xtp=2)") &&
                        Catch::Matchers::ContainsSubstring("the MPI world has 2"));
}
