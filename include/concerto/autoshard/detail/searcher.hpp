#pragma once
/// @file
/// @brief Internal: automatic sharding's search (autoshard/search.hpp): pricing candidates,
/// coordinate descent from the seeds, planning the best. Include <concerto/autoshard/search.hpp>.

#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <utility>
#include <string>
#include <vector>

namespace concerto::autoshard::detail {

template <std::size_t N>
class searcher {
public:
  searcher(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model, const options& o)
      : p_(p), mesh_(m), shapes_(shapes), model_(model), o_(o), leaves_(free_leaves(p, shapes, o.lower)), axes_(split_axes(m)) {}

  result<N> run() {
    const auto started = std::chrono::steady_clock::now();
    if (leaves_.empty() && o_.seeds.empty())
      fail("automatic sharding: the program has no leaf written auto_ and no seed was given; write auto_ in the specs "
           "to decide (spec(auto_, auto_)) or pass options::seeds");
    auto seeds = o_.seeds;
    for (auto& s : standard_seeds(p_, leaves_, axes_, o_.decide_zero)) seeds.push_back(std::move(s));
    // The formulation's solutions start the descent like the other seeds; of them only the one
    // with the best list step is planned as a seed (they are many, and their additive objective
    // is not the step), the others when they rank among the best `keep`.
    const std::size_t written_seeds = seeds.size();
    std::vector<exact_summary> exact;
    if (o_.exact.enabled && !leaves_.empty())
      for (auto& s : exact_seeds(exact)) seeds.push_back(std::move(s));
    for (auto& s : seeds) complete(s.choice);
    const auto priced = price(seeds);
    // The best seeds of different layouts (a seed and its ZeRO-3 form are one start: the
    // descent moves the stage itself).
    std::vector<candidate> ranked = priced;
    std::stable_sort(ranked.begin(), ranked.end(), [&](const candidate& a, const candidate& b) { return better(a, b); });
    std::vector<std::string> layouts;
    for (const auto& s : ranked) {
      auto layout = s.choice;
      layout.zero_stage.reset();
      if (!s.valid || std::find(layouts.begin(), layouts.end(), key_of(layout)) != layouts.end()) continue;
      if (layouts.size() == static_cast<std::size_t>(std::max(1, o_.starts))) break;
      layouts.push_back(key_of(layout));
      descend(s);
    }
    result<N> out;
    out.search_seconds = seconds_since(started);
    out.evaluated = static_cast<int>(seen_.size());
    out.memory_cap_bytes = o_.memory_cap_bytes;
    for (const auto& l : leaves_) out.free_leaves.push_back(l.name);
    out.exact = std::move(exact);
    const auto planning_started = std::chrono::steady_clock::now();
    std::vector<candidate> planned_seeds(priced.begin(), priced.begin() + static_cast<std::ptrdiff_t>(written_seeds));
    if (const auto exact_best = std::min_element(priced.begin() + static_cast<std::ptrdiff_t>(written_seeds), priced.end(),
                                                 [&](const candidate& a, const candidate& b) { return better(a, b); });
        exact_best != priced.end())
      planned_seeds.push_back(*exact_best);
    out.planned = plan_best(planned_seeds);
    out.seeds = priced;
    out.planning_seconds = seconds_since(planning_started);
    out.chosen = out.planned.front();
    auto compiled = graph::respecify(p_, out.chosen.choice);
    out.program = std::move(compiled.program);
    return out;
  }

private:
  const graph::program<N>& p_;
  const mesh& mesh_;
  const shape_map& shapes_;
  const cost::model& model_;
  const options& o_;
  std::vector<free_leaf> leaves_;
  std::vector<ir::mesh_axis> axes_;
  std::map<std::string, candidate> seen_; // every sharding priced, by key_of

  // Every decided leaf and the ZeRO stage named, so that one sharding has one key (a `.to`
  // written with auto_ that no move named yet stays open: it keeps the layout its value arrives
  // in, so that it follows the leaves until a move decides it).
  void complete(graph::sharding_choice& c) const {
    for (const auto& l : leaves_)
      if (l.kind != op_code::to && std::none_of(c.leaves.begin(), c.leaves.end(), [&](const auto& x) { return x.leaf == l.name; }))
        c.leaves.push_back({l.name, l.written});
    c.zero_stage = c.zero_stage.value_or(p_.zero_stage);
    c.axes.clear(); // the mesh's order, as the exact formulation lays splits out
    for (const auto& a : axes_) c.axes.push_back(a.name);
    if (*c.zero_stage == 0) c.zero_axis.clear();
    else if (c.zero_axis.empty() && p_.zero_axis >= 0) c.zero_axis = std::string(p_.axes.names[p_.zero_axis].view());
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  [[nodiscard]] std::int64_t overflow(const candidate& c) const {
    return o_.memory_cap_bytes ? std::max<std::int64_t>(0, c.peak_bytes - *o_.memory_cap_bytes) : 0;
  }
  // Valid before invalid, then less memory over the cap, then the shorter step.
  [[nodiscard]] bool better(const candidate& a, const candidate& b) const {
    if (a.valid != b.valid) return a.valid;
    if (overflow(a) != overflow(b)) return overflow(a) < overflow(b);
    return a.list_step_us < b.list_step_us;
  }
  // A move worth taking: better, and by at least options::min_gain of the step unless it
  // brings memory closer to the cap or makes the sharding valid.
  [[nodiscard]] bool gains(const candidate& a, const candidate& b) const {
    if (!better(a, b)) return false;
    if (a.valid != b.valid || overflow(a) != overflow(b)) return true;
    return a.list_step_us <= b.list_step_us * (1.0 - o_.min_gain);
  }

  [[nodiscard]] candidate price_one(const named_choice& nc) const { return autoshard::price(p_, mesh_, shapes_, model_, o_, nc); }

  // Prices every sharding not priced yet, on every core; returns them all in the given order.
  std::vector<candidate> price(const std::vector<named_choice>& choices) {
    std::vector<std::string> keys;
    std::vector<std::size_t> fresh;
    for (std::size_t i = 0; i < choices.size(); ++i) {
      keys.push_back(key_of(choices[i].choice));
      const bool repeated = std::find(keys.begin(), keys.end() - 1, keys.back()) != keys.end() - 1;
      if (!seen_.contains(keys.back()) && !repeated) fresh.push_back(i);
    }
    std::vector<candidate> priced(fresh.size());
    planner::detail::for_each_index(fresh.size(), [&](std::size_t k) { priced[k] = price_one(choices[fresh[k]]); });
    for (std::size_t k = 0; k < fresh.size(); ++k) seen_.emplace(keys[fresh[k]], std::move(priced[k]));
    std::vector<candidate> out;
    for (const auto& k : keys) out.push_back(seen_.at(k));
    return out;
  }

  // The exact formulation for each ZeRO stage the search may choose (the stage the program has
  // when it is not decided), solved on every core; its solutions as seeds.
  std::vector<named_choice> exact_seeds(std::vector<exact_summary>& summaries) const {
    const std::string written_axis = p_.zero_axis >= 0 ? std::string(p_.axes.names[p_.zero_axis].view()) : "";
    const auto stages = o_.decide_zero ? zero_choices(axes_)
                                       : std::vector<graph::sharding_choice>{{.zero_stage = p_.zero_stage, .zero_axis = written_axis}};
    summaries.assign(stages.size(), {});
    planner::detail::for_each_index(stages.size(), [&](std::size_t i) {
      auto& sum = summaries[i];
      sum.zero_stage = stages[i].zero_stage.value_or(0);
      sum.zero_axis = stages[i].zero_axis;
      try {
        const auto t0 = std::chrono::steady_clock::now();
        const auto f = formulate(p_, mesh_, shapes_, model_,
                                 {.memory_cap_bytes = o_.memory_cap_bytes, .lower = o_.lower, .zero_stage = sum.zero_stage,
                                  .zero_axis = sum.zero_axis, .limits = o_.exact.limits});
        sum.formulate_seconds = seconds_since(t0);
        sum.nodes = f.nodes.size();
        sum.strategies = f.strategy_count();
        sum.aligned = f.aligned;
        const auto t1 = std::chrono::steady_clock::now();
        auto solved = solve(f, {.solutions = o_.exact.solutions, .time_limit_s = o_.exact.time_limit_s, .solver = o_.exact.solver});
        sum.solve_seconds = seconds_since(t1);
        sum.infeasible = solved.infeasible;
        for (auto& x : solved.solutions) {
          sum.origins.push_back(exact_origin(sum, x, sum.solutions.size()));
          sum.solutions.push_back(std::move(x));
        }
        for (const auto& x : sum.solutions) sum.choices.push_back(f.choice(x.pick));
      } catch (const error& e) {
        sum.refused = e.what();
      }
    });
    std::vector<named_choice> out;
    for (const auto& sum : summaries)
      for (std::size_t k = 0; k < sum.choices.size(); ++k) out.push_back({sum.origins[k], sum.choices[k]});
    return out;
  }
  static std::string exact_origin(const exact_summary& s, const solution& x, std::size_t k) {
    char text[160];
    std::snprintf(text, sizeof text, "%s formulation%s%s #%zu (%.1f us%s)", s.aligned.empty() ? "exact" : "aligned",
                  s.zero_stage > 0 ? ", ZeRO-" : "",
                  s.zero_stage > 0 ? (std::to_string(s.zero_stage) + " over " + s.zero_axis).c_str() : "", k + 1, x.cost_us,
                  x.proved ? ", proved" : "");
    return text;
  }

  // The moves of one coordinate: every spec of one leaf, or every ZeRO stage and axis.
  [[nodiscard]] std::vector<named_choice> leaf_moves(const candidate& from, std::size_t leaf) const {
    std::vector<named_choice> out;
    for (const auto& s : leaf_specs(leaves_[leaf], axes_)) {
      named_choice nc{"search", from.choice};
      auto& chosen = nc.choice.leaves;
      const auto it = std::find_if(chosen.begin(), chosen.end(), [&](const auto& l) { return l.leaf == leaves_[leaf].name; });
      if (it == chosen.end()) chosen.push_back({leaves_[leaf].name, s});
      else it->spec = s;
      out.push_back(std::move(nc));
    }
    return out;
  }
  [[nodiscard]] std::vector<named_choice> zero_moves(const candidate& from) const {
    std::vector<named_choice> out;
    for (const auto& z : zero_choices(axes_)) {
      named_choice nc{"search", from.choice};
      nc.choice.zero_stage = z.zero_stage;
      nc.choice.zero_axis = z.zero_axis;
      out.push_back(std::move(nc));
    }
    return out;
  }

  // Both leaves of a pair to every combination of their specs: a contraction split on both
  // sides at once (x's and w's inner dimension over one axis) is no single leaf's move, since
  // either half alone is refused.
  [[nodiscard]] std::vector<named_choice> pair_moves(const candidate& from, std::size_t a, std::size_t b) const {
    std::vector<named_choice> out;
    for (auto& first : leaf_moves(from, a)) {
      candidate half;
      half.choice = std::move(first.choice);
      for (auto& both : leaf_moves(half, b)) out.push_back(std::move(both));
    }
    return out;
  }

  // Moves of every leaf at once: one axis taken out of every spec (its ranks then hold copies:
  // an axis whose collectives cost more than the work it splits saves), or two axes swapped
  // everywhere (the same layout with the slow and the fast link exchanged); each with every ZeRO
  // stage when the stage is decided.
  [[nodiscard]] std::vector<named_choice> axis_moves(const candidate& from) const {
    std::vector<named_choice> out;
    const auto rewrite = [&](auto&& axis_map) {
      named_choice nc{"search", from.choice};
      for (auto& l : nc.choice.leaves) {
        spec_value s = l.spec;
        for (int d = 0; d < s.rank; ++d) {
          axis_name kept[max_dim_axes]{};
          int k = 0;
          for (const auto& a : s.dims[d])
            if (!a.empty())
              if (const auto to = axis_map(std::string(a.view())); !to.empty()) kept[k++] = axis_name(to);
          for (int i = 0; i < max_dim_axes; ++i) s.dims[d][i] = kept[i];
        }
        l.spec = s;
      }
      // The stage moves with the layout: ZeRO over an axis the specs now split differently is
      // another trade.
      if (!o_.decide_zero) out.push_back(std::move(nc));
      else
        for (auto& with_stage : zero_moves(candidate{.choice = nc.choice})) out.push_back(std::move(with_stage));
    };
    for (const auto& a : axes_) {
      rewrite([&](const std::string& x) { return x == a.name ? std::string{} : x; });
      for (const auto& b : axes_)
        if (a.name < b.name) rewrite([&](const std::string& x) { return x == a.name ? b.name : x == b.name ? a.name : x; });
    }
    return out;
  }

  // The pairs of decided leaves that meet at one op: read by it directly or through at most
  // two ops before it (Megatron's pair w1, w2 meets at the second product through the
  // activation and the first product).
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> meeting_pairs() const {
    // Decided redistributions take no part: they change together (a stack's entry and its
    // block's), which the sequence-parallel seed and the exact formulation do, and their pairs
    // with the leaves they meet doubled the search's time for no better step (GPT-40).
    std::vector<int> index(static_cast<std::size_t>(p_.raw_size), -1); // raw leaf -> leaves_ index
    for (std::size_t l = 0; l < leaves_.size(); ++l)
      if (leaves_[l].kind != op_code::to) index[static_cast<std::size_t>(leaves_[l].raw)] = static_cast<int>(l);
    std::set<std::pair<std::size_t, std::size_t>> pairs;
    for (int r = 0; r < p_.raw_size; ++r) {
      std::vector<std::size_t> met;
      const auto visit = [&](auto&& self, int at, int hops) -> void {
        at = through_to(p_, at);
        if (const int l = index[static_cast<std::size_t>(at)]; l >= 0) met.push_back(static_cast<std::size_t>(l));
        if (hops > 0)
          for (int k = 0; k < p_.raw[at].n_in; ++k) self(self, p_.raw[at].in[k], hops - 1);
      };
      for (int k = 0; k < p_.raw[r].n_in; ++k) visit(visit, p_.raw[r].in[k], 2);
      for (std::size_t i = 0; i < met.size(); ++i)
        for (std::size_t j = i + 1; j < met.size(); ++j)
          if (met[i] != met[j]) pairs.insert({std::min(met[i], met[j]), std::max(met[i], met[j])});
    }
    return {pairs.begin(), pairs.end()};
  }

  // Coordinate descent: each leaf (then the ZeRO stage, then an axis across every leaf) moves to
  // its best with the others fixed; when no such move gains, each pair of leaves that meet at an
  // op; until nothing gains.
  void descend(candidate current) {
    const auto pairs = meeting_pairs();
    for (int sweep = 0; sweep < o_.max_sweeps; ++sweep) {
      bool moved = false;
      const auto step = [&](const std::vector<named_choice>& moves) {
        for (auto& c : price(moves))
          if (gains(c, current)) {
            current = std::move(c);
            moved = true;
          }
      };
      for (std::size_t l = 0; l < leaves_.size(); ++l) step(leaf_moves(current, l));
      if (o_.decide_zero) step(zero_moves(current));
      step(axis_moves(current));
      if (!moved && o_.pair_moves)
        for (const auto& [a, b] : pairs) step(pair_moves(current, a, b));
      if (!moved) return;
    }
  }

  // Plans the best `keep` distinct shardings that fit, the user's seeds that fit, and the other
  // seeds that fit within options::plan_seeds_within of the best list step; the shortest planned
  // step first.
  std::vector<candidate> plan_best(const std::vector<candidate>& seeds) {
    std::vector<candidate> all;
    for (const auto& [key, c] : seen_) all.push_back(c);
    std::stable_sort(all.begin(), all.end(), [&](const candidate& a, const candidate& b) { return better(a, b); });
    if (all.empty() || !all.front().valid) fail(nothing_valid());
    if (!all.front().fits) fail(nothing_fits(all.front()));
    std::vector<candidate> kept;
    const auto lowered_alike = [&](const candidate& c) {
      return std::find_if(kept.begin(), kept.end(), [&](const candidate& k) { return k.graph_hash == c.graph_hash; });
    };
    for (const auto& c : all)
      if (c.fits && kept.size() < static_cast<std::size_t>(std::max(1, o_.keep)) && lowered_alike(c) == kept.end())
        kept.push_back(c);
    const double best_step = kept.front().list_step_us;
    for (std::size_t i = 0; i < seeds.size(); ++i) {
      const auto& s = seeds[i];
      const bool users = i < o_.seeds.size(); // the user's seeds are planned whatever their step: they are the comparison
      if (!s.fits || (!users && s.list_step_us > best_step * o_.plan_seeds_within)) continue;
      if (const auto it = lowered_alike(s); it != kept.end()) it->origin = s.origin; // a seed's name says more
      else kept.push_back(s);
    }
    auto planning = o_.planning;
    planning.memory_cap_bytes = o_.memory_cap_bytes;
    planning.solver.progress = false;
    // On every core (each plan alone uses them only in part; planning is deterministic, so the
    // order the plans finish in changes nothing).
    planner::detail::for_each_index(kept.size(), [&](std::size_t i) {
      auto& c = kept[i];
      const auto compiled = graph::respecify(p_, c.choice);
      c.choice.leaves.insert(c.choice.leaves.end(), compiled.kept.begin(), compiled.kept.end()); // every .to as it was decided
      const auto pl = planner::make_plan(lower(*compiled.program, shapes_, mesh_, o_.lower), model_, planning);
      c.planned_step_us = pl.step_us();
    });
    std::stable_sort(kept.begin(), kept.end(), [](const candidate& a, const candidate& b) { return a.planned_step_us < b.planned_step_us; });
    return kept;
  }

  [[nodiscard]] std::string nothing_valid() const {
    std::string why;
    for (const auto& [key, c] : seen_)
      if (why.empty()) why = c.why_invalid;
    return "automatic sharding: no sharding of the program is valid for this mesh and these shapes (the first refusal: " + why +
           "); check the shapes and that each split dimension divides over some mesh axis";
  }
  [[nodiscard]] std::string nothing_fits(const candidate& best) const {
    return "automatic sharding: no sharding fits the memory cap of " + std::to_string(*o_.memory_cap_bytes >> 20) +
           " MiB per rank; the smallest peak found is " + std::to_string(best.peak_bytes >> 20) + " MiB (" + best.origin +
           "); raise the cap, use more ranks or a smaller batch";
  }
};

} // namespace concerto::autoshard::detail
