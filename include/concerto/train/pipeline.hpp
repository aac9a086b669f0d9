#pragma once
/// @file
/// @brief What a training step adds for pipeline parallelism: its options, the micro-batch
/// shapes it lowers with, the schedule rank 0 chooses and sends, and the check that the stages'
/// plans agree on their messages before the first step.
///
/// A step is pipelined when its mesh has the pipeline axis (`pp` unless
/// `pipeline_options::axis` says otherwise): the program is lowered for one micro-batch (every
/// data leaf's first dimension divided by `microbatches`), `pipeline::split` places its tasks
/// on the stages, the schedule policy orders every stage's blocks, and each rank runs the plan
/// of its own stage (pipeline/stages.hpp). docs/pipeline.md, "Training with stages".

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/graph/program.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/pipeline/policies.hpp>
#include <concerto/pipeline/search.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/runtime/mpi/control.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace concerto::train {

/// @brief How a step is pipelined (used when the mesh has `axis`).
struct pipeline_options {
  int microbatches = 1;           ///< per step; must divide every data leaf's first dimension
  std::string schedule = "1f1b";  ///< a pipeline::policy_table name: gpipe, 1f1b, interleaved_1f1b, zb_h1, concerto
  int virtual_stages = 1;         ///< chunks per stage (2 or more: gpipe, interleaved_1f1b, concerto)
  std::string axis = "pp";        ///< the mesh axis the stages lie along
  double search_budget_s = 10;    ///< concerto: the schedule search's time
  /// concerto: when positive, the search is bounded by this much Z3 work per window instead of
  /// by search_budget_s (pipeline::search_options::window_work_limit): for one problem, the same
  /// schedule on any machine however loaded. (The problem itself follows the kernels' measured
  /// factors unless step_options::measure_kernels is false.) Either way rank 0 alone searches and
  /// sends the schedule, and the search only returns one whose stages agree on their messages.
  std::uint64_t search_work_limit = 0;
};

namespace detail {

/// The shapes of one micro-batch: every data leaf's first dimension divided by `microbatches`.
template <std::size_t N>
shape_map microbatch_shapes(const graph::program<N>& p, shape_map shapes, int microbatches) {
  if (microbatches < 1) fail("train step: " + std::to_string(microbatches) + " micro-batches; at least 1");
  if (microbatches == 1) return shapes;
  for (int i = 0; i < p.size; ++i) {
    if (p.nodes[i].op != op_code::data) continue;
    const auto name = p.name_of(i);
    const auto it = shapes.find(name);
    if (it == shapes.end() || it->second.empty()) continue; // the lowering names what is missing
    auto& rows = it->second.front();
    if (rows % microbatches != 0)
      fail("train step: input '" + name + "' has " + std::to_string(rows) + " rows (its first dimension), which " +
           std::to_string(microbatches) + " micro-batches do not divide");
    rows /= microbatches;
  }
  return shapes;
}

/// Refuses, naming the fix, a schedule that is not a policy or that does not take the layout
/// (`stages` along the pipeline axis, the options' chunks per stage and micro-batches): what
/// pipeline::policy_table says each policy accepts. On every rank, before the split.
inline void check_pipeline_options(const pipeline_options& o, int stages) {
  const auto* policy = pipeline::find_policy(o.schedule);
  if (!policy) fail("train step: pipeline schedule '" + o.schedule + "' is not one of " + pipeline::policy_list());
  if (const auto why = pipeline::refusal(*policy, stages, o.virtual_stages, o.microbatches); !why.empty())
    fail("train step: " + why);
}

/// Rank 0's choice: a baseline from its definition, or the search (at the memory of
/// pipeline::memory_reference: 1F1B's, or interleaved 1F1B's with several chunks per stage).
/// Whatever the search's budget leaves it time for, what it returns has passed pipeline::verify,
/// which refuses a schedule whose two ends of a link order its messages differently.
inline pipeline::schedule choose_schedule(const pipeline_options& o, const pipeline::problem& p) {
  if (const auto* policy = pipeline::find_policy(o.schedule); policy && policy->baseline) return policy->baseline(p);
  pipeline::search_options s;
  s.time_budget_s = o.search_budget_s;
  s.window_work_limit = o.search_work_limit;
  return pipeline::plan_concerto(std::span(&p, 1), s).best;
}

inline nlohmann::json to_json(const pipeline::schedule& s) {
  nlohmann::json order = nlohmann::json::array();
  for (const auto& stage : s.order) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : stage) blocks.push_back({b.chunk, b.microbatch, static_cast<int>(b.kind)});
    order.push_back(std::move(blocks));
  }
  return nlohmann::json{{"policy", s.policy}, {"split", s.split_backward}, {"order", std::move(order)}};
}

inline pipeline::schedule schedule_from_json(const nlohmann::json& j) {
  pipeline::schedule s;
  s.policy = j.at("policy").get<std::string>();
  s.split_backward = j.at("split").get<bool>();
  for (const auto& stage : j.at("order")) {
    auto& blocks = s.order.emplace_back();
    for (const auto& b : stage)
      blocks.push_back({b.at(0).get<int>(), b.at(1).get<int>(), static_cast<pipeline::pass>(b.at(2).get<int>())});
  }
  return s;
}

/// Before the first step: the ranks of a stage run one plan, and every pair of stages sends
/// and receives the same messages in the same order (tags and sizes). Collective; every rank
/// reaches the same verdict and throws the same error.
inline void check_stage_agreement(const plan::plan& mine, int axis, const mesh& m,
                                  const runtime::mpi::control& control) {
  // Per peer stage and lane (values, gradients): [send hash, sends, recv hash, recvs].
  const auto stages = m.axes()[static_cast<std::size_t>(axis)].size;
  constexpr std::size_t lanes = 2, per_lane = 4;
  const auto fields = 1 + static_cast<std::size_t>(stages) * lanes * per_lane;
  const auto at_peer = [&](int q, int lane) { return 1 + (static_cast<std::size_t>(q) * lanes + static_cast<std::size_t>(lane)) * per_lane; };
  std::vector<std::int64_t> record(fields, 0);
  record[0] = std::bit_cast<std::int64_t>(plan::hash(mine));
  std::vector<hasher> hashes(fields);
  for (const auto& msg : pipeline::message_sequence(mine, axis)) {
    const auto base = at_peer(msg.peer, std::min(msg.lane, 1)) + (msg.send ? 0 : 2);
    hashes[base].add(msg.tag).add(msg.bytes);
    ++record[base + 1];
  }
  for (int q = 0; q < stages; ++q)
    for (int lane = 0; lane < 2; ++lane)
      for (const std::size_t k : {std::size_t{0}, std::size_t{2}})
        record[at_peer(q, lane) + k] = std::bit_cast<std::int64_t>(hashes[at_peer(q, lane) + k].value());
  const auto size = m.rank_count();
  std::vector<std::int64_t> all(fields * static_cast<std::size_t>(size));
  control.all_gather(std::span<const std::int64_t>(record), std::span(all), "the pipeline stages' message check");
  const auto at = [&](int r, std::size_t i) { return all[static_cast<std::size_t>(r) * fields + i]; };
  for (int r = 0; r < size; ++r) {
    auto coords = m.coords(r);
    const int s = coords[static_cast<std::size_t>(axis)];
    for (int other = 0; other < r; ++other) {
      auto oc = m.coords(other);
      if (oc[static_cast<std::size_t>(axis)] == s && at(other, 0) != at(r, 0))
        fail_on_every_rank("train step: ranks " + std::to_string(other) + " and " + std::to_string(r) +
                           " of pipeline stage " + std::to_string(s) + " made different plans for it");
    }
    for (int q = 0; q < stages; ++q) {
      if (q == s) continue;
      coords[static_cast<std::size_t>(axis)] = q;
      const int peer = m.rank_of(coords);
      for (int lane = 0; lane < 2; ++lane) {
        const auto sq = at_peer(q, lane), ps = at_peer(s, lane);
        if (at(r, sq) == at(peer, ps + 2) && at(r, sq + 1) == at(peer, ps + 3)) continue;
        const auto what = std::string(lane == 0 ? "values" : "gradients");
        fail_on_every_rank("train step: pipeline stages " + std::to_string(s) + " and " + std::to_string(q) +
                           " disagree on their messages: rank " + std::to_string(r) + " (stage " + std::to_string(s) +
                           ") sends " + std::to_string(at(r, sq + 1)) + " " + what + " to stage " + std::to_string(q) +
                           ", rank " + std::to_string(peer) + " (stage " + std::to_string(q) + ") receives " +
                           std::to_string(at(peer, ps + 3)) + " from stage " + std::to_string(s) +
                           (at(r, sq + 1) == at(peer, ps + 3) ? ", in another order or with other sizes" : "") +
                           "; a stage would wait for ever or read another tensor");
      }
    }
  }
}

} // namespace detail
} // namespace concerto::train
