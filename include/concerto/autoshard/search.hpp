#pragma once
/// @file
/// @brief Automatic sharding: the specs of the leaves a program wrote `auto_` (and, if asked, the
/// ZeRO stage) chosen by the step they give, scheduled as they will run.
///
/// Every candidate sharding is compiled by the compiler itself (graph/respecify.hpp: the op
/// table's rules propagate it and insert the collectives it implies, so no op is run to learn
/// its rules), lowered for the real mesh, shapes and depths, and judged by the planner's own
/// list-schedule judge on the cost model (planner/detail/evaluate.hpp) with its peak memory per
/// rank (parameters, gradients, optimizer state and live activations) against the cap: a
/// candidate's price is the makespan of its schedule, with overlap and contention, not a sum of
/// independent terms. The search:
///
/// 1. seeds, the layouts a person would write: pure data parallelism over every axis (the batch
///    dimension of each input split over all of them), tensor parallelism over each axis with data
///    parallelism over the others (Megatron's pairing, found from the program's data flow: a weight
///    whose matmul reads a value that went through an even number of weight products is split on
///    its output dimension, an odd number on its input dimension, an embedding table on its rows),
///    each with ZeRO-3 over its data axis when ZeRO is decided, and the user's own (`options::seeds`,
///    e.g. the specs of a hand-written program);
/// 2. from the best seeds, coordinate descent over the whole N-D mesh at once: each leaf in turn
///    tries every spec its free dimensions can take (replicated, split over one axis or over two,
///    dividing its extent), and the ZeRO stage every stage over every axis, the others fixed, until
///    a sweep gains nothing. A `repeat` stack's layers share their leaves, so they share one
///    strategy by construction;
/// 3. the best `options::keep` distinct candidates that fit, and every seed that fits, are planned
///    by the planner (decomposition, buckets, the Z3 windows with `options::planning`) and the one
///    with the shortest planned step wins: the sharding is chosen by the step its schedule achieves.
///
/// Every rank running the same search on the same inputs finds the same sharding (no clock is read
/// unless `options::planning` has a time budget; ties go to the first candidate found).
///
/// @code
/// constexpr auto step = program(loss, adamw{}, on(dp, tp)); // leaves written with auto_
/// auto chosen = autoshard::choose(step, mesh, shapes, cost::model::preset("h100x64"), {.memory_cap_bytes = 40LL << 30});
/// std::puts(chosen.explain().c_str());
/// auto trainer = train::compile(*chosen.program, mesh, shapes, {.adamw = {}});
/// @endcode

#include <concerto/autoshard/formulation.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/graph/respecify.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/memory.hpp>
#include <concerto/planner/detail/evaluate.hpp>
#include <concerto/planner/detail/parallel.hpp>
#include <concerto/planner/make_plan.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace concerto::autoshard {

/// @brief A sharding with the name of where it came from ("pure DP", "TP over tp, DP over dp", a
/// user's seed such as "hand-written").
struct named_choice {
  std::string origin;
  graph::sharding_choice choice;
};

/// @brief How to choose.
struct options {
  std::optional<std::int64_t> memory_cap_bytes; ///< peak bytes per rank every candidate must respect
  lower_options lower{};   ///< depths, heads, precision: as the step will be lowered
  bool decide_zero = true; ///< also choose the ZeRO stage (0-3) and its axis
  int keep = 3;            ///< the best candidates the planner schedules before the final choice
  /// Seeds are planned too when their list-schedule step is within this factor of the best
  /// candidate's (a layout several times slower is not worth a plan; its list step is reported).
  /// (Planning shortened a candidate's list step by 1.5-3% on the benchmark models: a seed 10%
  /// behind does not overtake.)
  double plan_seeds_within = 1.10;
  int max_sweeps = 4;      ///< coordinate-descent sweeps from each start
  int starts = 2;          ///< the best seeds the descent starts from
  bool pair_moves = true;  ///< when no leaf alone gains, move the pairs of leaves that meet at an op together
  /// A move is taken when it shortens the step by at least this share: a split of a norm's gain
  /// that the cost model prices 0.03% faster is within its error, and the simpler layout stays.
  double min_gain = 0.002;
  /// How the kept candidates are planned; deterministic by default (Z3 work, not time, bounds
  /// each window) so that every rank choosing alone chooses alike.
  planner::plan_options planning{.policy = planner::policy::concerto,
                                 .solver = {.window = 20, .rounds = 1, .time_budget_s = 0, .window_work_limit = 200000}};
  std::vector<named_choice> seeds; ///< more starting points (a hand-written program's specs), priced and planned too
  /// The exact formulation (autoshard/formulation.hpp), formulated for each ZeRO stage the search
  /// may choose and solved by Z3: its best `solutions` leaf choices per stage are seeds, priced by
  /// the schedule like the others (the formulation's additive objective cannot see overlap).
  struct exact_settings {
    bool enabled = true;
    int solutions = 2;
    double time_limit_s = 10;          ///< per solve; a solve that runs out reports its bound
    formulation_limits limits{}; ///< a node over them (aligned too) is reported and that stage's seeds skipped
    mip_solver solver = mip_solver::cbc;
  } exact{};
};

/// @brief What the exact formulation gave for one ZeRO stage.
struct exact_summary {
  int zero_stage = 0;
  std::string zero_axis;
  std::size_t nodes = 0, strategies = 0;
  double formulate_seconds = 0, solve_seconds = 0;
  std::vector<solution> solutions;  ///< best first; their leaf choices were seeds
  std::vector<std::string> origins; ///< the seed each solution became
  std::vector<graph::sharding_choice> choices; ///< each solution's leaf specs and stage
  bool infeasible = false;          ///< nothing fits the cap in the formulation's memory model
  std::string refused;              ///< why it was not formulated (too many strategies), empty if it was
  std::vector<std::string> aligned; ///< nodes formulated with their operands aligned (problem::aligned): a restriction
};

/// @brief The collectives a candidate's step runs on one mesh axis, of one kind.
struct collective_total {
  std::string kind; ///< all_reduce, all_gather, ...
  std::string axis;
  int count = 0;
  double bytes = 0;       ///< per rank, summed
  double duration_us = 0; ///< summed, as the cost model prices them alone
};

/// @brief One priced sharding.
struct candidate {
  std::string origin;
  graph::sharding_choice choice;
  bool valid = false;          ///< the compiler and the lowering accepted it
  std::string why_invalid;     ///< what refused it
  double list_step_us = std::numeric_limits<double>::infinity(); ///< the list-schedule judge's step
  double planned_step_us = std::numeric_limits<double>::quiet_NaN(); ///< after planning (kept candidates and seeds)
  std::int64_t peak_bytes = 0;  ///< per rank, of the list schedule
  bool fits = false;            ///< valid and within the memory cap
  std::uint64_t graph_hash = 0; ///< of its lowered step (plan::hash): two shardings that lower alike are one
  std::vector<collective_total> collectives;
};

/// @brief What choose found.
template <std::size_t N>
struct result {
  std::unique_ptr<graph::program<graph::respecified_size<N>>> program; ///< the program compiled with the chosen sharding
  candidate chosen;
  std::vector<candidate> planned; ///< every candidate the planner scheduled (the chosen one included), best first
  std::vector<candidate> seeds;   ///< every seed as priced (pure DP, TP per axis, ZeRO-3, the user's), planned or not
  std::vector<std::string> free_leaves; ///< the leaves and redistributions (graph::redistribution_name) whose specs were decided
  std::vector<exact_summary> exact;     ///< the exact formulation, per ZeRO stage
  int evaluated = 0;            ///< distinct shardings priced
  double search_seconds = 0;    ///< seeds and descent
  double planning_seconds = 0;  ///< scheduling the kept candidates
  std::optional<std::int64_t> memory_cap_bytes;
  /// A readable account: the chosen spec of each decided leaf, the ZeRO stage, the collectives it
  /// implies with their cost, the memory per rank, and the planned alternatives with their steps.
  [[nodiscard]] std::string explain() const;
  /// Two lines: what was chosen, its predicted step and memory, and the next planned candidates.
  [[nodiscard]] std::string brief() const;
};

/// @brief A sharding as JSON, e.g. `{"leaves": {"w1": [[], ["tp"]]}, "zero_stage": 3, "zero_axis": "dp", "axes": ["dp", "tp"]}`
/// (per leaf, the axes splitting each dimension): what rank 0 sends the others, and a record of
/// the choice.
[[nodiscard]] inline nlohmann::json to_json(const graph::sharding_choice& c) {
  nlohmann::json leaves = nlohmann::json::object();
  for (const auto& l : c.leaves) {
    nlohmann::json dims = nlohmann::json::array();
    for (int d = 0; d < l.spec.rank; ++d) {
      nlohmann::json axes = nlohmann::json::array();
      for (const auto& a : l.spec.dims[d])
        if (!a.empty()) axes.push_back(std::string(a.view()));
      dims.push_back(std::move(axes));
    }
    leaves[l.leaf] = std::move(dims);
  }
  return {{"leaves", leaves}, {"zero_stage", c.zero_stage.value_or(-1)}, {"zero_axis", c.zero_axis}, {"axes", c.axes}};
}

/// @brief The sharding to_json wrote; throws concerto::error naming what is malformed.
[[nodiscard]] inline graph::sharding_choice sharding_from_json(const nlohmann::json& j) {
  graph::sharding_choice c;
  try {
    for (const auto& [leaf, dims] : j.at("leaves").items()) {
      spec_value s;
      s.rank = static_cast<int>(dims.size());
      if (s.rank > max_rank) fail("leaf '" + leaf + "' has more than " + std::to_string(max_rank) + " dimensions");
      for (int d = 0; d < s.rank; ++d) {
        const auto& axes = dims.at(static_cast<std::size_t>(d));
        if (axes.size() > max_dim_axes) fail("leaf '" + leaf + "' splits a dimension over more than two axes");
        for (std::size_t k = 0; k < axes.size(); ++k) s.dims[d][k] = axis_name(axes.at(k).get<std::string>());
      }
      c.leaves.push_back({leaf, s});
    }
    if (const int stage = j.at("zero_stage").get<int>(); stage >= 0) c.zero_stage = stage;
    c.zero_axis = j.at("zero_axis").get<std::string>();
    if (j.contains("axes")) c.axes = j.at("axes").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("a sharding's JSON is malformed: ") + e.what());
  }
  return c;
}

namespace detail {

inline std::vector<collective_total> collectives_of(const plan::plan& pl) {
  std::vector<collective_total> out;
  for (std::size_t i = 0; i < pl.graph.tasks.size(); ++i) {
    const auto& t = pl.graph.tasks[i];
    if (!ir::is_collective(t.kind) || t.axis < 0) continue;
    const std::string kind(ir::to_string(t.kind)), axis = pl.graph.axes[static_cast<std::size_t>(t.axis)].name;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& c) { return c.kind == kind && c.axis == axis; });
    if (it == out.end()) it = out.insert(out.end(), collective_total{kind, axis});
    ++it->count;
    it->bytes += t.bytes;
    it->duration_us += pl.duration_us[i];
  }
  return out;
}

} // namespace detail

/// @brief One sharding priced as the search prices it: compiled (graph::respecify), lowered with
/// `o.lower`, ordered by the list-schedule judge on `model`, its peak memory per rank against
/// `o.memory_cap_bytes`. A sharding the compiler or the lowering refuses is invalid, with the
/// reason; nothing is thrown for it.
template <std::size_t N>
[[nodiscard]] candidate price(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
                              const options& o, const named_choice& nc) {
  candidate c;
  c.origin = nc.origin;
  c.choice = nc.choice;
  try {
    auto compiled = graph::respecify(p, nc.choice);
    if (!compiled.program) {
      c.why_invalid = compiled.message();
      return c;
    }
    const auto g = lower(*compiled.program, shapes, m, o.lower);
    const auto pl = planner::list_plan(g, model);
    c.valid = true;
    c.list_step_us = pl.step_us();
    c.peak_bytes = plan::peak_memory(pl).peak_bytes;
    c.fits = !o.memory_cap_bytes || c.peak_bytes <= *o.memory_cap_bytes;
    c.collectives = detail::collectives_of(pl);
    c.graph_hash = plan::hash(g);
  } catch (const error& e) {
    c.why_invalid = e.what();
  }
  return c;
}

/// @brief What exhaustive enumeration found.
struct enumeration {
  candidate best;   ///< the fitting sharding with the shortest list-schedule step (invalid if none fits)
  long priced = 0;  ///< shardings priced
};

/// @brief Prices every combination of the decided leaves' specs (and, with `o.decide_zero`,
/// every ZeRO stage over every axis) on the search's judge: the true optimum the search is
/// measured against where the count is affordable (the product of the leaves' spec counts).
template <std::size_t N>
[[nodiscard]] enumeration enumerate_all(const graph::program<N>& p, const mesh& m, const shape_map& shapes,
                                        const cost::model& model, const options& o) {
  const auto leaves = detail::free_leaves(p, shapes, o.lower);
  const auto axes = detail::split_axes(m);
  std::vector<std::vector<spec_value>> specs;
  for (const auto& l : leaves) specs.push_back(detail::leaf_specs(l, axes));
  const auto stages = o.decide_zero ? detail::zero_choices(axes) : std::vector<graph::sharding_choice>{{.zero_stage = 0}};
  enumeration out;
  std::vector<std::size_t> at(leaves.size(), 0);
  for (bool more = true; more;) {
    for (const auto& stage : stages) {
      named_choice nc{"exhaustive", stage};
      for (const auto& a : axes) nc.choice.axes.push_back(a.name);
      for (std::size_t i = 0; i < leaves.size(); ++i) nc.choice.leaves.push_back({leaves[i].name, specs[i][at[i]]});
      auto c = price(p, m, shapes, model, o, nc);
      ++out.priced;
      if (c.fits && (!out.best.fits || c.list_step_us < out.best.list_step_us)) out.best = std::move(c);
    }
    std::size_t i = 0;
    while (i < at.size() && ++at[i] == specs[i].size()) at[i++] = 0;
    more = i < at.size();
  }
  return out;
}

} // namespace concerto::autoshard

#include <concerto/autoshard/detail/seeds.hpp>
#include <concerto/autoshard/detail/searcher.hpp>

namespace concerto::autoshard {

/// @brief Chooses the specs of `p`'s leaves written `auto_` (and the ZeRO stage when
/// `o.decide_zero`) for mesh `m` and `shapes` on `model`; see the file comment. Throws
/// concerto::error naming the problem when `p` has no leaf written auto_ and no seed was given,
/// or when no candidate fits the memory cap (with the smallest peak found).
template <std::size_t N>
[[nodiscard]] result<N> choose(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
                               const options& o = {}) {
  detail::searcher<N> s(p, m, shapes, model, o);
  return s.run();
}

template <std::size_t N>
std::string result<N>::brief() const {
  char line[256];
  std::snprintf(line, sizeof line, "automatic sharding: %s, predicted step %.1f us, %.1f MiB per rank (%d shardings priced, %.1f s)\n",
                chosen.origin.c_str(), chosen.planned_step_us, static_cast<double>(chosen.peak_bytes) / 1048576.0, evaluated,
                search_seconds + planning_seconds);
  std::string out = line;
  for (std::size_t i = 1; i < planned.size() && i < 4; ++i) {
    std::snprintf(line, sizeof line, "%s%s %.1f us", i == 1 ? "  next: " : "; ", planned[i].origin.c_str(), planned[i].planned_step_us);
    out += line;
  }
  return out + (planned.size() > 1 ? "\n" : "");
}

template <std::size_t N>
std::string result<N>::explain() const {
  const auto mib = [](double b) { return b / 1048576.0; };
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "automatic sharding: %d shardings priced in %.2f s, %zu planned in %.2f s\n", evaluated,
                search_seconds, planned.size(), planning_seconds);
  out += line;
  if (!exact.empty()) out += "exact formulation (additive: compute and collectives, no overlap), per ZeRO stage:\n";
  for (const auto& e : exact) {
    const std::string stage = e.zero_stage > 0 ? "ZeRO-" + std::to_string(e.zero_stage) + " over " + e.zero_axis : "no ZeRO";
    if (!e.refused.empty()) {
      out += "  " + stage + ": not formulated: " + e.refused + "\n";
      continue;
    }
    std::snprintf(line, sizeof line, "  %-16s %zu nodes, %zu strategies, formulated in %.2f s, solved in %.2f s:", stage.c_str(), e.nodes,
                  e.strategies, e.formulate_seconds, e.solve_seconds);
    out += line;
    if (!e.aligned.empty()) {
      out += " operands aligned at";
      for (const auto& a : e.aligned) out += " " + a;
      out += " (a restriction: an upper bound of the full optimum):";
    }
    if (e.infeasible) out += " nothing fits the cap";
    for (const auto& x : e.solutions) {
      std::snprintf(line, sizeof line, " %.1f us%s", x.cost_us,
                    x.proved ? " (proved)" : (" (gap " + std::to_string(100.0 * x.gap()).substr(0, 5) + "%)").c_str());
      out += line;
    }
    out += "\n";
  }
  out += "chosen (" + chosen.origin + "):\n";
  for (const auto& l : chosen.choice.leaves)
    if (std::find(free_leaves.begin(), free_leaves.end(), l.leaf) != free_leaves.end())
      out += "  " + l.leaf + std::string(l.leaf.size() < 14 ? 14 - l.leaf.size() : 1, ' ') + to_string(l.spec) + "\n";
  const int stage = chosen.choice.zero_stage.value_or(0);
  out += stage > 0 ? "  ZeRO-" + std::to_string(stage) + " over " + chosen.choice.zero_axis + "\n" : "  no ZeRO\n";
  for (const auto& c : chosen.collectives) {
    std::snprintf(line, sizeof line, "  %-15s over %-4s x%-4d %10.2f MiB %10.1f us\n", c.kind.c_str(), c.axis.c_str(), c.count,
                  mib(c.bytes), c.duration_us);
    out += line;
  }
  std::snprintf(line, sizeof line, "  peak memory per rank %.1f MiB%s\n", mib(static_cast<double>(chosen.peak_bytes)),
                memory_cap_bytes ? (" (cap " + std::to_string(static_cast<long long>(mib(static_cast<double>(*memory_cap_bytes)))) + " MiB)").c_str()
                                 : "");
  out += line;
  out += "planned candidates (planned step, list-schedule step, peak memory per rank):\n";
  for (const auto& c : planned) {
    std::snprintf(line, sizeof line, "  %-40s %12.1f us %12.1f us %10.1f MiB\n", c.origin.c_str(), c.planned_step_us,
                  c.list_step_us, mib(static_cast<double>(c.peak_bytes)));
    out += line;
    out += "      " + detail::key_of(c.choice) + "\n";
  }
  out += "seeds not planned (list-schedule step, peak memory per rank):\n";
  std::vector<std::uint64_t> listed; // a seed lowered alike another (a user's seed and a standard one) is listed once
  for (const auto& c : seeds) {
    if (std::any_of(planned.begin(), planned.end(), [&](const candidate& p) { return p.graph_hash == c.graph_hash && c.valid; }))
      continue;
    if (c.valid && std::find(listed.begin(), listed.end(), c.graph_hash) != listed.end()) continue;
    listed.push_back(c.graph_hash);
    if (!c.valid) std::snprintf(line, sizeof line, "  %-40s refused: %.300s\n", c.origin.c_str(), c.why_invalid.c_str());
    else
      std::snprintf(line, sizeof line, "  %-40s %12.1f us %10.1f MiB%s\n", c.origin.c_str(), c.list_step_us,
                    mib(static_cast<double>(c.peak_bytes)), c.fits ? "" : "  (over the cap)");
    out += line;
  }
  return out;
}

} // namespace concerto::autoshard
