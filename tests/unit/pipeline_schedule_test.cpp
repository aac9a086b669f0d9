#include <concerto/pipeline/search.hpp>
#include <concerto/pipeline/workloads.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

using namespace concerto;
using Catch::Approx;
using Catch::Matchers::ContainsSubstring;

namespace {

pipeline::chunk_cost unit_cost(double f, double b, double w) {
  pipeline::chunk_cost k;
  k.forward_us = f;
  k.input_grad_us = b;
  k.weight_grad_us = w;
  k.activation_bytes = 1;
  k.weight_grad_share = 0.5;
  return k;
}

// A problem with uneven chunks, messages, reductions and optimizer steps, from a seed.
pipeline::problem random_problem(std::uint32_t seed, int stages, int microbatches) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  auto p = pipeline::uniform_problem(stages, microbatches, unit_cost(1, 1, 1));
  for (auto& k : p.chunks) {
    k = unit_cost(u(rng), u(rng), u(rng));
    k.activation_bytes = u(rng);
    k.weight_grad_share = u(rng) / 4;
    k.grad_sync_us = u(rng);
    k.optimizer_us = u(rng) / 2;
  }
  for (auto& s : p.send_us) s = u(rng) / 5;
  return p;
}

// The same with `virtual_stages` chunks per stage.
pipeline::problem random_chunked_problem(std::uint32_t seed, int stages, int virtual_stages, int microbatches) {
  auto p = random_problem(seed, stages * virtual_stages, microbatches);
  p.stages = stages;
  p.virtual_stages = virtual_stages;
  p.check();
  return p;
}

// Whether, on every link (an ordered pair of stages) and for each pass that sends (F:
// activations, B: input gradients), the receiver takes the messages in the order the sender
// sends them: what the stages' plans must agree on. Written apart from pipeline::verify.
bool links_agree(const pipeline::problem& p, const pipeline::schedule& s) {
  using pipeline::pass;
  for (int from = 0; from < p.stages; ++from)
    for (int to = 0; to < p.stages; ++to)
      for (const auto kind : {pass::forward, pass::input_grad}) {
        if (from == to) continue;
        const int step = kind == pass::forward ? 1 : -1; // where a chunk's message goes
        std::vector<std::pair<int, int>> sent, received;  // (sending chunk, micro-batch)
        for (const auto& b : s.order[static_cast<std::size_t>(from)])
          if (const int c = b.chunk + step; b.kind == kind && c >= 0 && c < p.chunk_count() && p.stage_of(c) == to)
            sent.emplace_back(b.chunk, b.microbatch);
        for (const auto& b : s.order[static_cast<std::size_t>(to)])
          if (const int c = b.chunk - step; b.kind == kind && c >= 0 && c < p.chunk_count() && p.stage_of(c) == from)
            received.emplace_back(c, b.microbatch);
        if (sent != received) return false;
      }
  return true;
}

std::string error_of(const auto& f) {
  try {
    f();
  } catch (const concerto::error& e) {
    return e.what();
  }
  return "";
}

} // namespace

TEST_CASE("the baselines' steps and memory match their papers' formulas", "[pipeline]") {
  for (const int p : {2, 4, 8})
    for (const int m : {8, 16}) {
      CAPTURE(p, m);
      const double F = 1, B = 1.5, W = 0.75;
      const auto prob = pipeline::uniform_problem(p, m, unit_cost(F, B, W));
      // 1F1B and GPipe: (m + p - 1) slots of a forward and a whole backward.
      const auto ofob = pipeline::verify(prob, pipeline::one_f_one_b(prob));
      CHECK(ofob.step_us == Approx((m + p - 1) * (F + B + W)));
      CHECK(pipeline::simulate(prob, pipeline::gpipe(prob)).step_us == Approx((m + p - 1) * (F + B + W)));
      // 1F1B: stage s holds p - s micro-batches; GPipe holds all of them.
      for (int s = 0; s < p; ++s) CHECK(ofob.peak_memory_bytes[static_cast<std::size_t>(s)] == Approx(p - s));
      CHECK(pipeline::peak_memory(pipeline::simulate(prob, pipeline::gpipe(prob))) == Approx(m));
      // ZB-H1: the bubble shrinks to (p - 1)(F + B - W), at 1F1B's peak.
      const auto zb = pipeline::verify(prob, pipeline::zb_h1(prob));
      CHECK(zb.step_us == Approx(m * (F + B + W) + (p - 1) * (F + B - W)));
      CHECK(pipeline::peak_memory(zb) <= Approx(pipeline::peak_memory(ofob)));
      // Every schedule respects the lower bound.
      CHECK(pipeline::lower_bound(prob) <= zb.step_us * (1 + 1e-12));
    }
  // With F = B = W the bound is met: ZB-H1's bubble is the first micro-batch's forward path.
  const auto equal = pipeline::uniform_problem(4, 8, unit_cost(1, 1, 1));
  CHECK(pipeline::simulate(equal, pipeline::zb_h1(equal)).step_us == Approx(27));
  CHECK(pipeline::lower_bound(equal) == Approx(27));
}

TEST_CASE("interleaved 1F1B divides the bubble by the chunks per stage", "[pipeline]") {
  const int p = 4, m = 8, v = 2;
  auto prob = pipeline::uniform_problem(p, m, unit_cost(1.0 / v, 1.0 / v, 1.0 / v));
  prob.virtual_stages = v;
  prob.chunks.assign(static_cast<std::size_t>(p * v), prob.chunks[0]);
  prob.send_us.assign(static_cast<std::size_t>(p * v - 1), 0);
  const auto t = pipeline::verify(prob, pipeline::interleaved_one_f_one_b(prob));
  CHECK(t.step_us == Approx(m * 3.0 + (p - 1) * 3.0 / v));
  prob.microbatches = 6;
  CHECK_THAT(error_of([&] { (void)pipeline::interleaved_one_f_one_b(prob); }),
             ContainsSubstring("micro-batches (6) to be a multiple of the stages (4)"));
  CHECK_THAT(error_of([&] { (void)pipeline::one_f_one_b(prob); }), ContainsSubstring("one chunk per stage"));
}

TEST_CASE("GPipe with chunks runs their forwards in model order, then their backwards in reverse", "[pipeline]") {
  const int p = 4, m = 8, v = 2;
  auto prob = pipeline::uniform_problem(p, m, unit_cost(1.0 / v, 1.0 / v, 1.0 / v));
  prob.virtual_stages = v;
  prob.chunks.assign(static_cast<std::size_t>(p * v), prob.chunks[0]);
  prob.send_us.assign(static_cast<std::size_t>(p * v - 1), 0);
  const auto s = pipeline::gpipe(prob);
  // Stage 1: chunk 1's forwards, chunk 5's, then chunk 5's backwards, chunk 1's.
  const auto& o = s.order[1];
  REQUIRE(o.size() == static_cast<std::size_t>(2 * v * m));
  CHECK(o[0] == pipeline::block{1, 0, pipeline::pass::forward});
  CHECK(o[m] == pipeline::block{5, 0, pipeline::pass::forward});
  CHECK(o[2 * m] == pipeline::block{5, 0, pipeline::pass::input_grad});
  CHECK(o[3 * m + 1] == pipeline::block{1, 1, pipeline::pass::input_grad});
  // (v·m + p − 1) slots of a chunk's forward and backward, as interleaved 1F1B (m >= p), every
  // micro-batch of every chunk held at once.
  const auto t = pipeline::verify(prob, s);
  CHECK(t.step_us == Approx((v * m + p - 1) * 3.0 / v));
  CHECK(t.step_us == Approx(pipeline::verify(prob, pipeline::interleaved_one_f_one_b(prob)).step_us));
  CHECK(pipeline::peak_memory(t) == Approx(v * m));
  // Any micro-batches, random costs: a valid schedule.
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    const auto r = random_chunked_problem(seed, 3, 2, 5);
    CAPTURE(seed);
    CHECK_NOTHROW(pipeline::verify(r, pipeline::gpipe(r)));
  }
}

TEST_CASE("each policy takes the layouts its table entry says, and refuses the others naming the fix", "[pipeline]") {
  for (const auto& info : pipeline::policy_table)
    for (const int v : {1, 2, 3})
      for (const int m : {3, 4, 6, 8}) {
        const int stages = 4;
        CAPTURE(info.name, v, m);
        const bool chunks = info.chunks == pipeline::chunks_per_stage::any ||
                            (info.chunks == pipeline::chunks_per_stage::one ? v == 1 : v >= 2);
        const bool takes = chunks && (!info.microbatches_multiple_of_stages || m % stages == 0);
        CHECK(pipeline::accepts(info, stages, v, m) == takes);
        CHECK(pipeline::refusal(info, stages, v, m).empty() == takes);
        if (!info.baseline) continue;
        // The baseline's definition refuses what the table refuses, with the same words.
        auto p = pipeline::uniform_problem(stages, m, unit_cost(1, 1, 1));
        p.virtual_stages = v;
        p.chunks.assign(static_cast<std::size_t>(stages * v), p.chunks[0]);
        p.send_us.assign(static_cast<std::size_t>(stages * v - 1), 0.1);
        if (takes) CHECK_NOTHROW(pipeline::verify(p, info.baseline(p)));
        else CHECK_THAT(error_of([&] { (void)info.baseline(p); }), ContainsSubstring(pipeline::refusal(info, stages, v, m)));
      }
  const auto why = [](std::string_view name, int stages, int v, int m) {
    return pipeline::refusal(*pipeline::find_policy(name), stages, v, m);
  };
  CHECK(why("1f1b", 2, 2, 4) == "pipeline schedule '1f1b' runs one chunk per stage (virtual_stages = 2): set virtual_stages "
                                "= 1, or use gpipe, interleaved_1f1b or concerto, which take 2 chunks per stage");
  CHECK(why("zb_h1", 2, 2, 3) == "pipeline schedule 'zb_h1' runs one chunk per stage (virtual_stages = 2): set virtual_stages "
                                 "= 1, or use gpipe or concerto, which take 2 chunks per stage");
  CHECK(why("interleaved_1f1b", 2, 1, 4) ==
        "pipeline schedule 'interleaved_1f1b' interleaves several chunks per stage (virtual_stages = 1): set virtual_stages "
        "= 2 or more, or use gpipe, 1f1b, zb_h1 or concerto, which run one chunk per stage");
  CHECK(why("interleaved_1f1b", 4, 2, 6) ==
        "pipeline schedule 'interleaved_1f1b' needs the micro-batches (6) to be a multiple of the stages (4): use 4 or 8 "
        "micro-batches, or gpipe or concerto, which take 6 micro-batches");
  CHECK(why("interleaved_1f1b", 4, 2, 3) ==
        "pipeline schedule 'interleaved_1f1b' needs the micro-batches (3) to be a multiple of the stages (4): use 4 "
        "micro-batches, or gpipe or concerto, which take 3 micro-batches");
  CHECK_THAT(why("gpipe", 2, 0, 4), ContainsSubstring("needs at least 1 stage, 1 chunk per stage and 1 micro-batch"));
  CHECK(pipeline::find_policy("zb_h2") == nullptr);
  CHECK(pipeline::baseline_names() == std::vector<std::string>{"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"});
  const auto prob = pipeline::uniform_problem(2, 4, unit_cost(1, 1, 1));
  CHECK_THAT(error_of([&] { (void)pipeline::baseline("concerto", prob); }), ContainsSubstring("the search, not a baseline"));
}

TEST_CASE("docs/pipeline.md's table of what each policy takes is the library's", "[pipeline][docs]") {
  const auto path = std::filesystem::path(__FILE__).parent_path() / "../../docs/pipeline.md";
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  // The rows of the table under its header, in order.
  const std::string header = "| policy | chunks per stage (`virtual_stages`) | micro-batches | backward |";
  const auto doc = text.str();
  const auto at = doc.find(header);
  REQUIRE(at != std::string::npos);
  std::istringstream lines(doc.substr(at));
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line) && line.starts_with("|");)
    if (line.starts_with("| `")) rows.push_back(line);
  std::vector<std::string> want;
  for (const auto& p : pipeline::policy_table) {
    const auto chunks = p.chunks == pipeline::chunks_per_stage::one ? "1" : p.chunks == pipeline::chunks_per_stage::several ? "2 or more" : "any";
    want.push_back("| `" + std::string(p.name) + "` | " + chunks + " | " +
                   (p.microbatches_multiple_of_stages ? "a multiple of the stages" : "any") + " | " +
                   (p.split_backward ? "split: B, then W" : "whole") + " |");
  }
  CHECK(rows == want);
}

TEST_CASE("the verifier names both stages of a send/recv order mismatch", "[pipeline]") {
  const auto prob = pipeline::uniform_problem(4, 6, unit_cost(1, 1, 1));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    auto s = pipeline::zb_h1(prob);
    // Seeded mutation: on one stage, swap two forwards (or two B passes) of different micro-batches.
    const int stage = static_cast<int>(rng() % 4);
    const auto kind = rng() % 2 ? pipeline::pass::forward : pipeline::pass::input_grad;
    auto& o = s.order[static_cast<std::size_t>(stage)];
    std::vector<std::size_t> at;
    for (std::size_t i = 0; i < o.size(); ++i)
      if (o[i].kind == kind) at.push_back(i);
    const auto a = at[rng() % at.size()], b = at[rng() % at.size()];
    if (a == b) continue;
    std::swap(o[a].microbatch, o[b].microbatch);
    const auto msg = error_of([&] { (void)pipeline::verify(prob, s); });
    CAPTURE(stage, msg);
    // Only the mutated stage's order changed, so every mismatch involves it and a neighbour.
    const bool fwd = kind == pipeline::pass::forward;
    CHECK_THAT(msg, ContainsSubstring("stage " + std::to_string(stage)));
    CHECK_THAT(msg, ContainsSubstring("receives them"));
    CHECK_THAT(msg, ContainsSubstring(fwd ? "activations" : "input gradients"));
  }
}

TEST_CASE("the verifier refuses interleaved chunks whose shared link's two ends order its messages differently",
          "[pipeline]") {
  // Two stages of two chunks: chunks 0 -> 1 and 2 -> 3 both send activations from stage 0 to
  // stage 1, on one lane of the stages' plans.
  auto prob = pipeline::uniform_problem(4, 4, unit_cost(1, 1, 1));
  prob.stages = 2;
  prob.virtual_stages = 2;
  const auto good = pipeline::interleaved_one_f_one_b(prob);
  REQUIRE(links_agree(prob, good));
  CHECK_NOTHROW(pipeline::verify(prob, good));
  // Stage 0 runs a forward of chunk 0 before the chunk-2 forward just ahead of it (a later
  // micro-batch: no deadlock, and each chunk keeps its micro-batch order), stage 1 does not follow.
  auto swapped = good;
  auto& o = swapped.order[0];
  std::size_t i = 0;
  while (i + 1 < o.size() && !(o[i].kind == pipeline::pass::forward && o[i].chunk == 2 &&
                               o[i + 1].kind == pipeline::pass::forward && o[i + 1].chunk == 0))
    ++i;
  REQUIRE(i + 1 < o.size());
  std::swap(o[i], o[i + 1]);
  CHECK_FALSE(links_agree(prob, swapped));
  CHECK_NOTHROW(pipeline::simulate(prob, swapped)); // the replay alone runs it
  const auto msg = error_of([&] { (void)pipeline::verify(prob, swapped); });
  CHECK_THAT(msg, ContainsSubstring("stage 0 sends its activations for stage 1 in another order than stage 1 receives them"));
  CHECK_THAT(msg, ContainsSubstring("the two stages' plans would disagree on their messages"));
}

TEST_CASE("concerto's interleaved schedules keep each link's messages in one order, however short its search",
          "[pipeline][z3]") {
  // The search's budget (or, under a time budget, the machine's load) decides how far it gets:
  // with none it returns its start, often a greedy seed. Whatever point it stops at must verify,
  // its link orders included; with a work limit instead of time it is also the same every run.
  for (std::uint32_t seed = 1; seed <= 6; ++seed)
    for (const int stages : {2, 4})
      for (const int m : {3, 4}) {
        const auto p = random_chunked_problem(seed, stages, 2, m);
        CAPTURE(seed, stages, m);
        for (const double budget : {0.0, 0.05}) {
          pipeline::search_options o;
          o.time_budget_s = budget;
          o.window_time_limit_s = o.whole_time_limit_s = 0.005; // windows cut short, as on a loaded machine
          const auto r = pipeline::plan_concerto(std::span(&p, 1), o);
          CAPTURE(budget, r.warm_start);
          CHECK(links_agree(r.layout, r.best));
          CHECK_NOTHROW(pipeline::verify(r.layout, r.best));
        }
        pipeline::search_options o;
        o.window_work_limit = 200'000;
        o.time_budget_s = 0; // not read
        o.whole_problem = 0;
        o.window = 24;
        const auto a = pipeline::plan_concerto(std::span(&p, 1), o), b = pipeline::plan_concerto(std::span(&p, 1), o);
        CHECK(links_agree(a.layout, a.best));
        CHECK(a.best.order == b.best.order);
      }
}

TEST_CASE("the verifier refuses incomplete, misplaced, deadlocked and oversized schedules", "[pipeline]") {
  auto prob = pipeline::uniform_problem(3, 4, unit_cost(1, 1, 1));
  auto s = pipeline::one_f_one_b(prob);
  auto missing = s;
  missing.order[1].pop_back();
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, missing); }), ContainsSubstring("stage 1 never runs B(chunk 1, micro-batch 3)"));
  auto twice = s;
  twice.order[2].push_back(twice.order[2].front());
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, twice); }), ContainsSubstring("runs F(chunk 2, micro-batch 0) twice"));
  auto elsewhere = s;
  elsewhere.order[0].push_back(elsewhere.order[1].back());
  elsewhere.order[1].pop_back();
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, elsewhere); }), ContainsSubstring("a block of stage 1"));
  auto fused_w = s;
  fused_w.order[0].push_back({0, 0, pipeline::pass::weight_grad});
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, fused_w); }), ContainsSubstring("does not split the backward"));
  // The last stage runs B(0) before F(0): it waits for ever.
  auto stuck = s;
  std::swap(stuck.order[2][0], stuck.order[2][1]);
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, stuck); }), ContainsSubstring("deadlocks: stage"));
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, stuck); }), ContainsSubstring("stage 2 waits for ever at B(chunk 2, micro-batch 0)"));
  // GPipe over 1F1B's memory.
  prob.memory_cap_bytes = pipeline::peak_memory(pipeline::simulate(prob, s));
  CHECK_NOTHROW(pipeline::verify(prob, s));
  CHECK_THAT(error_of([&] { (void)pipeline::verify(prob, pipeline::gpipe(prob)); }), ContainsSubstring("stage 0 holds"));
  // A problem that does not fit names the field.
  auto bad = prob;
  bad.send_us.pop_back();
  CHECK_THAT(error_of([&] { bad.check(); }), ContainsSubstring("message costs for 3 chunks"));
  bad = prob;
  bad.chunks[1].weight_grad_share = 2;
  CHECK_THAT(error_of([&] { bad.check(); }), ContainsSubstring("chunk 1 has weight_grad_share"));
  CHECK_THAT(error_of([&] { (void)pipeline::baseline("zb_h2", prob); }), ContainsSubstring("unknown pipeline policy 'zb_h2'"));
}

TEST_CASE("concerto is never slower than a baseline that fits, stays in the cap, and respects the bound",
          "[pipeline][z3]") {
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    const int stages = 2 + static_cast<int>(seed % 3);
    const auto p1 = random_problem(seed, stages, 2 * stages);
    std::vector<pipeline::problem> layouts{p1};
    pipeline::search_options o;
    o.window_work_limit = 2'000'000; // deterministic
    o.whole_problem = 0;             // windows only: the path large problems take
    o.window = 24;
    const auto r = pipeline::plan_concerto(layouts, o);
    CAPTURE(seed, r.warm_start);
    const double cap = r.layout.memory_cap_bytes;
    CHECK(cap == Approx(pipeline::peak_memory(pipeline::simulate(p1, pipeline::one_f_one_b(p1)))));
    for (const auto& c : r.candidates)
      if (c.fits) CHECK(r.time.step_us <= c.step_us * (1 + 1e-9));
    CHECK(pipeline::peak_memory(r.time) <= cap * (1 + 1e-9));
    CHECK(r.time.step_us >= r.lower_bound_us * (1 - 1e-9));
    CHECK_NOTHROW(pipeline::verify(r.layout, r.best));
  }
}

TEST_CASE("concerto with chunks per stage searches at interleaved 1F1B's memory and is never slower than it",
          "[pipeline][z3]") {
  pipeline::search_options o;
  o.window_work_limit = 2'000'000; // deterministic
  o.whole_problem = 0;
  o.window = 24;
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    const int stages = 2 + static_cast<int>(seed % 2);
    // The layout of a training step with 2 chunks per stage: concerto's only one.
    const auto p = random_chunked_problem(seed, stages, 2, 2 * stages);
    const auto r = pipeline::plan_concerto(std::span(&p, 1), o);
    CAPTURE(seed, r.warm_start);
    CHECK(r.layout.virtual_stages == 2);
    const auto interleaved = pipeline::simulate(p, pipeline::interleaved_one_f_one_b(p));
    CHECK(r.layout.memory_cap_bytes == Approx(pipeline::peak_memory(interleaved)));
    CHECK(pipeline::memory_reference(p).policy == "interleaved_1f1b");
    CHECK_NOTHROW(pipeline::verify(r.layout, r.best));
    CHECK(r.time.step_us <= interleaved.step_us * (1 + 1e-9));
    CHECK(r.time.step_us >= r.lower_bound_us * (1 - 1e-9));
  }
  // Micro-batches that are not a multiple of the stages, which interleaved 1F1B does not take:
  // the cap is its order for the next multiple without the micro-batches beyond.
  for (const int m : {1, 5, 6}) {
    const auto p = random_chunked_problem(7, 4, 2, m);
    CAPTURE(m);
    REQUIRE_THAT(error_of([&] { (void)pipeline::interleaved_one_f_one_b(p); }), ContainsSubstring("multiple of the stages"));
    const auto reference = pipeline::memory_reference(p);
    CHECK(reference.policy == "interleaved_1f1b_of_" + std::to_string((m + 3) / 4 * 4));
    const auto ref = pipeline::verify(p, reference);
    const auto r = pipeline::plan_concerto(std::span(&p, 1), o);
    CHECK(r.layout.memory_cap_bytes == Approx(pipeline::peak_memory(ref)));
    CHECK_NOTHROW(pipeline::verify(r.layout, r.best));
    CHECK(r.time.step_us <= ref.step_us * (1 + 1e-9));
  }
  // One chunk per stage keeps 1F1B's memory.
  const auto one = random_problem(3, 3, 6);
  CHECK(pipeline::memory_reference(one).policy == "1f1b");
}

TEST_CASE("concerto finds and proves the optimum of a small pipeline", "[pipeline][z3]") {
  // Equal passes: ZB-H1 meets the bound, and the whole problem is one window.
  const auto equal = pipeline::uniform_problem(3, 4, unit_cost(1, 1, 1));
  std::vector<pipeline::problem> layouts{equal};
  const auto r = pipeline::plan_concerto(layouts, {});
  CHECK(r.time.step_us == Approx(pipeline::lower_bound(r.layout)));
  // A last stage twice as slow: the search must move work to beat the best baseline.
  auto skewed = pipeline::uniform_problem(3, 6, unit_cost(1, 1, 1));
  skewed.chunks[2] = unit_cost(2, 2, 2);
  skewed.chunks[2].activation_bytes = 1;
  layouts = {skewed};
  const auto s = pipeline::plan_concerto(layouts, {});
  CHECK(s.time.step_us <= s.warm_start_us);
  CHECK(s.time.step_us >= s.lower_bound_us * (1 - 1e-9));
}

TEST_CASE("layers split over chunks as evenly as possible, the ends lighter", "[pipeline]") {
  CHECK(pipeline::split_layers(40, 4) == std::vector<int>{10, 10, 10, 10});
  const auto llama = pipeline::split_layers(126, 16);
  CHECK(llama.front() == 7);
  CHECK(llama.back() == 7);
  for (std::size_t i = 1; i + 1 < llama.size(); ++i) CHECK(llama[i] == 8);
  CHECK(pipeline::split_layers(7, 4) == std::vector<int>{1, 2, 2, 2});
  CHECK_THAT(error_of([] { (void)pipeline::split_layers(3, 4); }), ContainsSubstring("cannot split 3 layers over 4 pipeline chunks"));
}

TEST_CASE("pipelined workloads are priced from their task graphs", "[pipeline]") {
  const auto model = cost::model::preset("a800x32");
  pipeline::workload_layout l;
  l.stages = 4;
  l.microbatches = 8;
  l.layers = 8;
  const auto p = pipeline::make_problem("gpt-ptd", model, l);
  REQUIRE(p.chunks.size() == 4);
  for (const auto& k : p.chunks) {
    CHECK(k.layers == 2);
    CHECK(k.forward_us > 0);
    CHECK(k.input_grad_us > 0);
    CHECK(k.weight_grad_us > 0);
    CHECK(k.activation_bytes > 0);
    CHECK(k.weight_grad_share > 0);
    CHECK(k.weight_grad_share < 1);
  }
  // The head and loss make the last chunk heavier than a middle one, the embedding the first.
  CHECK(p.chunks[3].forward_us > p.chunks[1].forward_us);
  CHECK(p.chunks[0].optimizer_us > p.chunks[1].optimizer_us);
  CHECK(p.chunks[1].forward_us == Approx(p.chunks[2].forward_us));
  CHECK(p.send_us[0] > 0);
  // Data parallelism adds the gradient reduction.
  l.data_parallel = 2;
  CHECK(pipeline::make_problem("gpt-ptd", model, l).chunks[1].grad_sync_us > 0);
  CHECK_THAT(error_of([&] { (void)pipeline::make_problem("gpt-pp", model, l); }),
             ContainsSubstring("unknown pipeline workload 'gpt-pp' (known: gpt-ptd, llama-ptd)"));
  l.layers = 3;
  CHECK_THAT(error_of([&] { (void)pipeline::make_problem("gpt-ptd", model, l); }),
             ContainsSubstring("cannot split 3 layers over 4 pipeline chunks"));
}
