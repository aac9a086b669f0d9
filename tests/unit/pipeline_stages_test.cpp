// pipeline/stages.hpp on the GPT example's model: where its tasks go, what each stage's graph
// holds, that neighbouring stages send and receive the same messages in the same order under
// every schedule (and not under two different ones), and the errors that name what cannot be
// pipelined. The numerics of the executed stages are tests/mpi/train_pipeline_test.cpp's.
#include "../../examples/gpt/model.hpp"

#include <concerto/pipeline/policies.hpp>
#include <concerto/pipeline/search.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/plan/verify.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr int depth = 4;

ir::graph gpt_graph(int pp, int dp, int tp, std::int64_t rows = 2) {
  const auto m = mesh::from_world(pp * dp * tp, {{"pp", pp}, {"dp", dp}, {"tp", tp}});
  return lower(gpt_model::gpt_tp, gpt_model::shapes(rows * dp, 8, 32, 16), m,
               {.heads = 2, .depth = {{"layers", depth}}});
}

const ir::task& named(const ir::graph& g, const std::string& name) {
  const auto it = std::find_if(g.tasks.begin(), g.tasks.end(), [&](const auto& t) { return t.name == name; });
  REQUIRE(it != g.tasks.end());
  return *it;
}

// The sends of `from` to `to`, and the receives of `to` from `from`, as (tag, bytes), in lane order.
std::pair<std::vector<pipeline::message_record>, std::vector<pipeline::message_record>>
link(const plan::plan& from, int from_stage, const plan::plan& to, int to_stage, int axis) {
  std::vector<pipeline::message_record> sent, received;
  for (auto r : pipeline::message_sequence(from, axis))
    if (r.send && r.peer == to_stage) sent.push_back({false, 0, r.tag, r.bytes});
  for (auto r : pipeline::message_sequence(to, axis))
    if (!r.send && r.peer == from_stage) received.push_back({false, 0, r.tag, r.bytes});
  return {sent, received};
}

// What the arena would hold: every root buffer once.
std::int64_t runtime_bytes(const ir::graph& g) {
  std::int64_t sum = 0;
  for (const auto& b : g.buffers)
    if (b.view_of < 0) sum += b.bytes;
  return sum;
}

} // namespace

TEST_CASE("the split puts the embedding first, the head last, and sums the gradients over micro-batches", "[pipeline][stages]") {
  const auto g = gpt_graph(2, 2, 1);
  const auto s = pipeline::split(g, {.microbatches = 4});
  CHECK(s.chunk_layers == std::vector<int>{2, 2});
  const auto chunk = [&](const std::string& name) { return s.task(named(g, name).id).chunk; };
  const auto role = [&](const std::string& name) { return s.task(named(g, name).id).role; };
  CHECK(chunk("embedding#2") == 0);
  CHECK(chunk("layers.1.matmul#9") == 0);
  CHECK(chunk("layers.2.matmul#9") == 1);
  CHECK(chunk("matmul#33") == 1);       // the LM head
  CHECK(chunk("embedding_grad#91") == 0);
  CHECK(role("layers.0.wq.update") == pipeline::task_role::epilogue);
  CHECK(role("layers.0.wq.grad") == pipeline::task_role::epilogue); // the data-parallel all-reduce
  CHECK(role("layers.0.matmul#9") == pipeline::task_role::microbatch);
  // The weight gradient's product is W; the input gradient's, which the previous chunk waits for, B.
  const auto kind = [&](const std::string& name) { return s.task(named(g, name).id).kind; };
  CHECK(kind("layers.2.matmul#82") == pipeline::pass::weight_grad);
  CHECK(kind("layers.2.matmul#80") == pipeline::pass::input_grad);
  CHECK(kind("layers.2.matmul#9") == pipeline::pass::forward);
  // One value forward and its gradient back cross the one boundary.
  CHECK(s.messages == 2);
  const auto local_grad = named(g, "layers.0.wq.grad").reads.at(0);
  CHECK(s.buffer(local_grad).accumulated);
  CHECK(s.stage_of_buffer(g, named(g, "layers.3.wq.update").writes.at(0)) == 1);
}

TEST_CASE("neighbouring stages send and receive the same messages in one order under every schedule", "[pipeline][stages]") {
  for (auto [pp, m] : std::vector<std::pair<int, int>>{{2, 4}, {4, 4}, {4, 8}}) {
    const auto g = gpt_graph(pp, 1, 2);
    const auto s = pipeline::split(g, {.microbatches = m});
    const auto model = cost::model::preset("h100x64");
    const auto problem = pipeline::problem_of(s, g, model);
    for (const auto& c : problem.chunks) {
      CHECK(c.forward_us > 0);
      CHECK(c.input_grad_us + c.weight_grad_us > 0);
      CHECK(c.activation_bytes > 0);
    }
    CHECK(problem.send_us.at(0) > 0);
    std::vector<pipeline::schedule> schedules;
    for (const char* name : {"gpipe", "1f1b", "zb_h1"}) schedules.push_back(pipeline::baseline(name, problem));
    schedules.push_back(pipeline::plan_concerto(std::span(&problem, 1), {.time_budget_s = 1}).best);
    for (const auto& sched : schedules) {
      CAPTURE(pp, m, sched.policy);
      pipeline::verify(problem, sched);
      std::vector<plan::plan> plans;
      for (int st = 0; st < pp; ++st) {
        plans.push_back(pipeline::stage_plan(pipeline::stage_graph(g, s, st, sched), model, sched.policy));
        plan::verify(plans.back());
      }
      for (int st = 0; st + 1 < pp; ++st) {
        const auto [down, down_received] = link(plans[static_cast<std::size_t>(st)], st, plans[static_cast<std::size_t>(st + 1)], st + 1, s.axis);
        const auto [up, up_received] = link(plans[static_cast<std::size_t>(st + 1)], st + 1, plans[static_cast<std::size_t>(st)], st, s.axis);
        CHECK(down.size() == static_cast<std::size_t>(m));
        CHECK(down == down_received);
        CHECK(up.size() == static_cast<std::size_t>(m));
        CHECK(up == up_received);
      }
      // The optimizer runs once per step, after the stage's last block.
      const auto& last = plans.back().graph;
      CHECK(std::count_if(last.tasks.begin(), last.tasks.end(), [](const auto& t) { return t.name == "head.update"; }) == 1);
      CHECK(last.tasks.back().step_phase == ir::phase::optimizer);
    }
  }
}

// The GPT on 2 stages of 2 chunks each, 4 micro-batches: two chunk boundaries share each link.
struct two_chunks_per_stage {
  static constexpr int pp = 2, m = 4;
  ir::graph g = gpt_graph(pp, 1, 1);
  pipeline::stage_split s = pipeline::split(g, {.microbatches = m, .virtual_stages = 2});
  cost::model model = cost::model::preset("h100x64");
  pipeline::problem problem = pipeline::problem_of(s, g, model);

  // Both stages' plans under `sched`, each verified; each way, the sender's and the receiver's
  // messages agree, three per micro-batch (stage 0 sends chunk 0's and chunk 2's values and
  // chunk 2's gradient, stage 1 chunk 1's values and chunk 1's and chunk 3's gradients).
  void check_links_agree(const pipeline::schedule& sched) const {
    std::vector<plan::plan> plans;
    for (int st = 0; st < pp; ++st) {
      plans.push_back(pipeline::stage_plan(pipeline::stage_graph(g, s, st, sched), model, sched.policy));
      plan::verify(plans.back());
    }
    for (const auto& [from, to] : {std::pair{0, 1}, std::pair{1, 0}}) {
      const auto [sent, received] = link(plans[static_cast<std::size_t>(from)], from, plans[static_cast<std::size_t>(to)], to, s.axis);
      CAPTURE(from, to);
      REQUIRE(sent.size() == static_cast<std::size_t>(3 * m));
      REQUIRE(sent == received);
    }
  }
};

TEST_CASE("with two chunks per stage, every schedule that takes them gives stages that agree on their messages",
          "[pipeline][stages]") {
  const two_chunks_per_stage p;
  REQUIRE(p.problem.chunks.size() == 4);
  std::vector<pipeline::schedule> schedules{pipeline::gpipe(p.problem), pipeline::interleaved_one_f_one_b(p.problem),
                                            pipeline::plan_concerto(std::span(&p.problem, 1), {.time_budget_s = 1}).best};
  for (const auto& sched : schedules) {
    CAPTURE(sched.policy);
    pipeline::verify(p.problem, sched);
    p.check_links_agree(sched);
  }
  // GPipe holds every micro-batch of both chunks of a stage.
  const auto stage0 = pipeline::stage_graph(p.g, p.s, 0, schedules[0]);
  for (const char* base : {"layers.0.matmul#9", "layers.2.matmul#9"})
    CHECK(std::count_if(stage0.buffers.begin(), stage0.buffers.end(),
                        [&](const auto& b) { return b.name.starts_with(std::string(base) + "@buf"); }) == p.m);
}

TEST_CASE("with two chunks per stage, any verified schedule gives stages that agree on each link's order",
          "[pipeline][stages]") {
  // Seeded mutations of the baselines, with the backward split into B and W and not, each
  // repaired (align_links) and kept if it verifies: the first chunk's backward is all W
  // (nothing waits for its input gradient), and its B block must still be where its gradient
  // arrives, else the two ends of the link 1 -> 0 take its two boundaries' gradients in
  // different orders (the step's stage check stopped runs whose search ended on such a schedule).
  const two_chunks_per_stage p;
  std::mt19937 rng(7);
  int checked = 0, split = 0;
  for (int iter = 0; iter < 400; ++iter) {
    auto sched = iter % 2 ? pipeline::gpipe(p.problem) : pipeline::interleaved_one_f_one_b(p.problem);
    if (iter % 4 >= 2) sched = pipeline::split_backward(sched);
    for (int k = 0; k < 30; ++k) {
      auto& o = sched.order[rng() % 2];
      const auto i = rng() % (o.size() - 1);
      if (o[i].chunk == o[i + 1].chunk && (o[i].kind == o[i + 1].kind || o[i].microbatch == o[i + 1].microbatch)) continue;
      std::swap(o[i], o[i + 1]);
    }
    pipeline::detail::align_links(p.problem, sched);
    try {
      pipeline::verify(p.problem, sched);
    } catch (const error&) {
      continue;
    }
    ++checked;
    split += sched.split_backward;
    CAPTURE(iter);
    p.check_links_agree(sched);
  }
  CHECK(checked >= 100);
  CHECK(split >= 40);
}

TEST_CASE("stages built from two different schedules disagree on their messages", "[pipeline][stages]") {
  const auto g = gpt_graph(2, 1, 1);
  const auto s = pipeline::split(g, {.microbatches = 4});
  const auto model = cost::model::preset("h100x64");
  const auto problem = pipeline::problem_of(s, g, model);
  // Stage 0 runs 1F1B; stage 1 a copy whose micro-batches 1 and 2 swap places (a seeded mutation).
  const auto good = pipeline::one_f_one_b(problem);
  auto mutated = good;
  auto& order = mutated.order[1];
  for (auto& b : order)
    if (b.microbatch == 1) b.microbatch = 2;
    else if (b.microbatch == 2) b.microbatch = 1;
  CHECK_THROWS_WITH(pipeline::verify(problem, mutated), ContainsSubstring("stage"));
  const auto first = pipeline::stage_plan(pipeline::stage_graph(g, s, 0, good), model, "1f1b");
  const auto second = pipeline::stage_plan(pipeline::stage_graph(g, s, 1, mutated), model, "mutated");
  const auto [sent, received] = link(first, 0, second, 1, s.axis);
  CHECK(sent.size() == received.size());
  CHECK(sent != received);
}

TEST_CASE("micro-batches scale the loss's row count and accumulate the weight gradients", "[pipeline][stages]") {
  const auto g = gpt_graph(1, 1, 1);
  const auto s = pipeline::split(g, {.microbatches = 3});
  const auto problem = pipeline::problem_of(s, g, cost::model::preset("h100x64"));
  const auto stage = pipeline::stage_graph(g, s, 0, pipeline::gpipe(problem));
  const auto rows = named(g, "vocab_ce_loss#41").attr("global_rows");
  int accumulating = 0, adds = 0;
  for (const auto& t : stage.tasks) {
    if (t.name.starts_with("vocab_ce_loss#41@mb") && !t.name.ends_with(".accumulate")) CHECK(t.attr("global_rows") == 3 * rows);
    accumulating += t.attr("accumulate") != 0;
    adds += t.name.ends_with(".accumulate");
  }
  // Each weight gradient is written by micro-batch 0 and added to by the other two.
  int sinks = 0;
  for (std::size_t b = 0; b < g.buffers.size(); ++b) sinks += s.buffers[b].accumulated && g.buffers[b].role == ir::buffer_role::gradient;
  CHECK(accumulating + adds == 2 * (sinks + 1)); // + the loss, summed with an add
  CHECK(adds >= 2);
  // The inputs are one buffer of all micro-batches' rows.
  const auto ids = std::find_if(stage.buffers.begin(), stage.buffers.end(), [](const auto& b) { return b.name == "ids"; });
  REQUIRE(ids != stage.buffers.end());
  CHECK(ids->shape.at(0) == 3 * g.buffers[static_cast<std::size_t>(named(g, "embedding#2").reads.at(0))].shape.at(0));
}

TEST_CASE("a stage holds as many copies of a micro-batch's buffers as its schedule has in flight", "[pipeline][stages]") {
  const auto g = gpt_graph(2, 1, 1);
  const auto s = pipeline::split(g, {.microbatches = 8});
  const auto model = cost::model::preset("h100x64");
  const auto problem = pipeline::problem_of(s, g, model);
  const auto copies = [&](const pipeline::schedule& sched, int stage, const std::string& base) {
    const auto sg = pipeline::stage_graph(g, s, stage, sched);
    return std::count_if(sg.buffers.begin(), sg.buffers.end(), [&](const auto& b) { return b.name.starts_with(base + "@buf"); });
  };
  const auto bytes = [&](const pipeline::schedule& sched, int stage) {
    const auto p = pipeline::stage_plan(pipeline::stage_graph(g, s, stage, sched), model, sched.policy);
    plan::verify(p); // the reuse keeps the plan free of data races
    return runtime_bytes(p.graph);
  };
  const auto gpipe = pipeline::gpipe(problem), one_f_one_b = pipeline::one_f_one_b(problem);
  // GPipe runs every forward first: all 8 micro-batches are held. 1F1B holds p - s of them.
  CHECK(copies(gpipe, 0, "layers.0.matmul#9") == 8);
  CHECK(copies(one_f_one_b, 0, "layers.0.matmul#9") == 2);
  CHECK(copies(one_f_one_b, 1, "layers.2.matmul#9") == 1);
  CHECK(copies(one_f_one_b, 1, "layers.1.add#28") == 2); // received from stage 0: two at least
  CHECK(bytes(one_f_one_b, 0) < bytes(gpipe, 0));
}

TEST_CASE("what cannot be pipelined is refused naming it", "[pipeline][stages]") {
  const auto g = gpt_graph(2, 1, 1);
  CHECK_THROWS_WITH(pipeline::split(g, {.axis = "stages"}), ContainsSubstring("the mesh has no axis 'stages'"));
  CHECK_THROWS_WITH(pipeline::split(g, {.microbatches = 0}), ContainsSubstring("0 micro-batches"));
  CHECK_THROWS_WITH(pipeline::split(gpt_graph(8, 1, 1), {}),
                    ContainsSubstring("4 layers cannot be split into 8 chunks"));
  CHECK_THROWS_WITH(pipeline::split(g, {.virtual_stages = 4}), ContainsSubstring("4 layers cannot be split into 8 chunks"));

  // A weight read before and after the stack (tied) cannot live on two stages.
  constexpr auto tied = [] {
    constexpr auto x = input<"x">(spec(replicate, replicate));
    constexpr auto w = param<"w">(spec(replicate, replicate));
    constexpr auto block = [](auto h) { return gelu(matmul(h, param<"u">(spec(replicate, replicate)))); };
    return program(mse(matmul(repeat<"layers">(block, matmul(x, w)), w), input<"y">(spec(replicate, replicate))), sgd{});
  }();
  const auto m = mesh::from_world(2, {{"pp", 2}});
  const shape_map shapes{{"x", {4, 8}}, {"y", {4, 8}}, {"w", {8, 8}}, {"u", {8, 8}}};
  const auto tg = lower(tied, shapes, m, {.depth = {{"layers", 2}}});
  CHECK_THROWS_WITH(pipeline::split(tg, {}), ContainsSubstring("parameter 'w' is read by chunks 0 and 1"));

  // No repeat: nothing to split.
  constexpr auto flat = [] {
    constexpr auto x = input<"x">(spec(replicate, replicate));
    return program(mse(matmul(x, param<"w">(spec(replicate, replicate))), input<"y">(spec(replicate, replicate))), sgd{});
  }();
  const auto fg = lower(flat, {{"x", {4, 8}}, {"y", {4, 8}}, {"w", {8, 8}}}, m);
  CHECK_THROWS_WITH(pipeline::split(fg, {}), ContainsSubstring("no repeat stack to split"));
}
