#pragma once
/// @file
/// @brief The plan verifier: every plan is checked before it runs.
///
/// A plan is sound when its graph is valid, every task is scheduled exactly once on its own
/// stream, predicted times respect dependencies and stream exclusivity, the stream orders
/// cannot deadlock against the dependencies, the collectives of each communicator are
/// totally ordered (so every rank issues them in the same order), and it fits a memory cap.
/// `check` lists every problem; `verify` throws them as one concerto::error.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/plan/memory.hpp>
#include <concerto/plan/plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <queue>
#include <string>
#include <utility>
#include <vector>

namespace concerto::plan {

/// @brief What `check` and `verify` enforce beyond soundness.
struct verify_options {
  std::optional<std::int64_t> memory_cap_bytes; ///< reject a plan whose peak_memory exceeds it
};

/// @brief One collective as a rank issues it; ranks must issue identical sequences.
struct collective_signature {
  int axis = -1;
  ir::op_kind kind = ir::op_kind::all_reduce;
  double bytes = 0;
  std::string name;
  friend bool operator==(const collective_signature&, const collective_signature&) = default;
};

namespace detail {

inline std::string format_us(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  std::string s = buf;
  if (s.find_first_of(".eninf") == std::string::npos) s += ".0"; // "3" reads as a count, "3.0" as a time
  return s;
}

inline std::string task_ref(const ir::graph& g, ir::task_id t) {
  return "task " + std::to_string(t) + " '" + g.tasks[static_cast<std::size_t>(t)].name + "'";
}

inline std::string stream_ref(const ir::graph& g, std::size_t s) { return "stream '" + g.streams[s].name + "'"; }

/// Slack for predicted times computed in floating point.
inline double tolerance(double x) { return 1e-6 * std::max(1.0, std::abs(x)); }

inline std::string strip_prefix(std::string s) {
  constexpr std::string_view prefix = "concerto: ";
  if (s.starts_with(prefix)) s.erase(0, prefix.size());
  return s;
}

/// Predecessors in the happens-before relation an executor enforces: the dependencies, and
/// each task's predecessor in its stream's order. Out-of-range order entries are skipped.
inline std::vector<std::vector<ir::task_id>> happens_before(const plan& p) {
  const auto& g = p.graph;
  std::vector<std::vector<ir::task_id>> preds(g.tasks.size());
  for (const auto& t : g.tasks) preds[static_cast<std::size_t>(t.id)] = t.deps;
  for (const auto& order : p.order) {
    ir::task_id prev = -1;
    for (const auto t : order) {
      if (t < 0 || static_cast<std::size_t>(t) >= g.tasks.size()) continue;
      if (prev >= 0 && prev != t) preds[static_cast<std::size_t>(t)].push_back(prev);
      prev = t;
    }
  }
  return preds;
}

/// Topological order, ties to the smallest id so that every rank derives the same one.
/// Shorter than the task count when there is a cycle.
inline std::vector<ir::task_id> ordered(const std::vector<std::vector<ir::task_id>>& preds) {
  const auto n = preds.size();
  std::vector<int> indegree(n, 0);
  std::vector<std::vector<ir::task_id>> succ(n);
  for (std::size_t t = 0; t < n; ++t)
    for (const auto d : preds[t]) {
      succ[static_cast<std::size_t>(d)].push_back(static_cast<ir::task_id>(t));
      ++indegree[t];
    }
  std::priority_queue<ir::task_id, std::vector<ir::task_id>, std::greater<>> ready;
  for (std::size_t t = 0; t < n; ++t)
    if (indegree[t] == 0) ready.push(static_cast<ir::task_id>(t));
  std::vector<ir::task_id> out;
  out.reserve(n);
  while (!ready.empty()) {
    const auto t = ready.top();
    ready.pop();
    out.push_back(t);
    for (const auto s : succ[static_cast<std::size_t>(t)])
      if (--indegree[static_cast<std::size_t>(s)] == 0) ready.push(s);
  }
  return out;
}

/// A cycle among the tasks a topological sort left out, in execution direction.
inline std::vector<ir::task_id> find_cycle(const std::vector<std::vector<ir::task_id>>& preds,
                                           const std::vector<ir::task_id>& sorted) {
  std::vector<bool> left(preds.size(), true);
  for (const auto t : sorted) left[static_cast<std::size_t>(t)] = false;
  // Every left-out task has a left-out predecessor, so walking back must revisit a task.
  auto start = static_cast<ir::task_id>(std::find(left.begin(), left.end(), true) - left.begin());
  std::vector<int> seen_at(preds.size(), -1);
  std::vector<ir::task_id> walk;
  for (auto t = start; seen_at[static_cast<std::size_t>(t)] < 0;) {
    seen_at[static_cast<std::size_t>(t)] = static_cast<int>(walk.size());
    walk.push_back(t);
    const auto& ps = preds[static_cast<std::size_t>(t)];
    t = *std::find_if(ps.begin(), ps.end(), [&](ir::task_id d) { return left[static_cast<std::size_t>(d)]; });
    if (seen_at[static_cast<std::size_t>(t)] >= 0) {
      std::vector<ir::task_id> cycle(walk.begin() + seen_at[static_cast<std::size_t>(t)], walk.end());
      std::reverse(cycle.begin(), cycle.end());
      return cycle;
    }
  }
  return walk;
}

inline std::string describe(const collective_signature& c) {
  char bytes[40];
  if (c.bytes == std::floor(c.bytes) && std::abs(c.bytes) < 1e18)
    std::snprintf(bytes, sizeof bytes, "%.0f", c.bytes);
  else
    std::snprintf(bytes, sizeof bytes, "%g", c.bytes);
  return std::string(ir::to_string(c.kind)) + " '" + c.name + "' on mesh axis " + std::to_string(c.axis) + " (" +
         bytes + " bytes)";
}

class checker {
public:
  checker(const plan& p, const verify_options& opts) : p_(p), g_(p.graph), opts_(opts) {}

  std::vector<std::string> run() {
    try {
      g_.validate();
    } catch (const error& e) {
      problems_.push_back(strip_prefix(e.what()));
      return std::move(problems_); // the other checks index through the graph
    }
    const bool times_ok = check_times();
    const bool orders_ok = check_orders();
    if (times_ok) check_precedence();
    if (orders_ok) {
      if (times_ok) check_exclusivity();
      const bool deadlock_free = check_stream_orders();
      if (deadlock_free) {
        const auto preds = happens_before(p_);
        const auto sorted = ordered(preds);
        if (sorted.size() != g_.tasks.size()) {
          report_cycle(preds, sorted);
        } else {
          check_collective_order(preds, sorted);
          check_races(preds, sorted);
        }
      }
    }
    if (times_ok && opts_.memory_cap_bytes) check_memory(*opts_.memory_cap_bytes);
    return std::move(problems_);
  }

private:
  void add(std::string s) { problems_.push_back(std::move(s)); }
  [[nodiscard]] double end(std::size_t t) const { return p_.start_us[t] + p_.duration_us[t]; }

  bool check_times() {
    const auto n = g_.tasks.size();
    bool ok = true;
    if (p_.start_us.size() != n) {
      add("the plan has " + std::to_string(p_.start_us.size()) + " start times for " + std::to_string(n) + " tasks");
      ok = false;
    }
    if (p_.duration_us.size() != n) {
      add("the plan has " + std::to_string(p_.duration_us.size()) + " durations for " + std::to_string(n) + " tasks");
      ok = false;
    }
    if (!ok) return false;
    for (std::size_t t = 0; t < n; ++t) {
      const auto who = task_ref(g_, static_cast<ir::task_id>(t));
      if (!std::isfinite(p_.start_us[t])) {
        add(who + " has no finite start time");
        ok = false;
      }
      if (!std::isfinite(p_.duration_us[t]) || p_.duration_us[t] < 0) {
        add(who + " has duration " + format_us(p_.duration_us[t]) + " us");
        ok = false;
      }
    }
    return ok;
  }

  bool check_orders() {
    bool ok = true;
    if (p_.order.size() != g_.streams.size()) {
      add("the plan has " + std::to_string(p_.order.size()) + " stream orders for " +
          std::to_string(g_.streams.size()) + " streams");
      ok = false;
    }
    const auto n = g_.tasks.size();
    std::vector<int> count(n, 0);
    for (std::size_t s = 0; s < p_.order.size(); ++s) {
      const auto where = s < g_.streams.size() ? stream_ref(g_, s) : "stream " + std::to_string(s);
      for (const auto t : p_.order[s]) {
        if (t < 0 || static_cast<std::size_t>(t) >= n) {
          add("the order of " + where + " names task " + std::to_string(t) + ", which does not exist");
          ok = false;
          continue;
        }
        ++count[static_cast<std::size_t>(t)];
        const auto own = static_cast<std::size_t>(g_.tasks[static_cast<std::size_t>(t)].stream);
        if (own != s) {
          add(task_ref(g_, t) + " runs on " + stream_ref(g_, own) + " but is in the order of " + where);
          ok = false;
        }
      }
    }
    for (std::size_t t = 0; t < n; ++t) {
      const auto id = static_cast<ir::task_id>(t);
      if (count[t] == 0) {
        add(task_ref(g_, id) + " is never scheduled (missing from the order of " +
            stream_ref(g_, static_cast<std::size_t>(g_.tasks[t].stream)) + ")");
        ok = false;
      } else if (count[t] > 1) {
        add(task_ref(g_, id) + " is scheduled " + std::to_string(count[t]) + " times");
        ok = false;
      }
    }
    return ok;
  }

  void check_precedence() {
    for (const auto& t : g_.tasks)
      for (const auto d : t.deps) {
        const auto e = end(static_cast<std::size_t>(d));
        const auto s = p_.start_us[static_cast<std::size_t>(t.id)];
        if (s < e - tolerance(e))
          add(task_ref(g_, t.id) + " starts at " + format_us(s) + " us before its dependency " +
              task_ref(g_, d).substr(5) + " ends at " + format_us(e) + " us");
      }
  }

  void check_exclusivity() {
    for (std::size_t s = 0; s < p_.order.size(); ++s) {
      const auto& order = p_.order[s];
      for (std::size_t i = 1; i < order.size(); ++i) {
        const auto a = static_cast<std::size_t>(order[i - 1]), b = static_cast<std::size_t>(order[i]);
        const auto sa = p_.start_us[a], sb = p_.start_us[b], ea = end(a);
        if (sb < sa - tolerance(sa))
          add(task_ref(g_, order[i]) + " follows " + task_ref(g_, order[i - 1]) + " in the order of " +
              stream_ref(g_, s) + " but starts earlier, at " + format_us(sb) + " us against " + format_us(sa) + " us");
        else if (sb < ea - tolerance(ea))
          add(task_ref(g_, order[i - 1]) + " and " + task_ref(g_, order[i]) + " overlap on " + stream_ref(g_, s) +
              ": the first runs until " + format_us(ea) + " us, the second starts at " + format_us(sb) + " us");
      }
    }
  }

  /// A task placed before one of its own (transitive) predecessors on the same stream waits
  /// for a task its stream can only reach after it: a deadlock. Per stream, carry through
  /// the dependency DAG the latest order position of an ancestor on that stream.
  bool check_stream_orders() {
    const auto n = g_.tasks.size();
    std::vector<int> pos(n, -1);
    for (const auto& order : p_.order)
      for (std::size_t i = 0; i < order.size(); ++i) pos[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
    const auto topo = g_.topological_order();
    bool ok = true;
    for (std::size_t s = 0; s < g_.streams.size(); ++s) {
      std::vector<std::pair<int, ir::task_id>> latest(n, {-1, -1}); // (position, ancestor)
      for (const auto t : topo) {
        const auto ti = static_cast<std::size_t>(t);
        for (const auto d : g_.tasks[ti].deps) {
          const auto di = static_cast<std::size_t>(d);
          latest[ti] = std::max(latest[ti], latest[di]);
          if (static_cast<std::size_t>(g_.tasks[di].stream) == s) latest[ti] = std::max(latest[ti], std::pair{pos[di], d});
        }
        if (static_cast<std::size_t>(g_.tasks[ti].stream) == s && latest[ti].first > pos[ti]) {
          add(task_ref(g_, t) + " is at position " + std::to_string(pos[ti]) + " in the order of " + stream_ref(g_, s) +
              ", before its predecessor " + task_ref(g_, latest[ti].second) + " at position " +
              std::to_string(latest[ti].first) + ": the stream would wait for it forever (deadlock)");
          ok = false;
        }
      }
    }
    return ok;
  }

  void report_cycle(const std::vector<std::vector<ir::task_id>>& preds, const std::vector<ir::task_id>& sorted) {
    const auto cycle = find_cycle(preds, sorted);
    std::string text;
    for (const auto t : cycle)
      text += task_ref(g_, t) + " (" + stream_ref(g_, static_cast<std::size_t>(g_.tasks[static_cast<std::size_t>(t)].stream)) + ") -> ";
    text += task_ref(g_, cycle.front());
    add("the stream orders and the dependencies wait on each other in a cycle (deadlock): " + text);
  }

  /// Two tasks that touch the same bytes, one of them writing, must run in program order
  /// (ir/hazards.hpp): the happens-before relation must lead from the earlier to the later.
  /// A search back from the later task only visits tasks sorted after the earlier one.
  void check_races(const std::vector<std::vector<ir::task_id>>& preds, const std::vector<ir::task_id>& sorted) {
    const auto hazards = ir::derived_deps(g_, ir::program_order(g_));
    const auto pos = ir::positions(sorted);
    std::vector<std::size_t> seen(g_.tasks.size(), 0);
    std::size_t search = 0, reported = 0;
    std::vector<ir::task_id> stack;
    const auto reaches = [&](ir::task_id from, ir::task_id to) {
      ++search;
      stack.assign(1, to);
      while (!stack.empty()) {
        const auto t = stack.back();
        stack.pop_back();
        for (const auto d : preds[static_cast<std::size_t>(t)]) {
          if (d == from) return true;
          const auto du = static_cast<std::size_t>(d);
          if (pos[du] > pos[static_cast<std::size_t>(from)] && seen[du] != search) {
            seen[du] = search;
            stack.push_back(d);
          }
        }
      }
      return false;
    };
    for (std::size_t v = 0; v < g_.tasks.size() && reported < 20; ++v)
      for (const auto u : hazards[v]) {
        const auto later = static_cast<ir::task_id>(v);
        if (pos[static_cast<std::size_t>(u)] < pos[v] && reaches(u, later)) continue;
        add(task_ref(g_, u) + " and " + task_ref(g_, later) + " both access buffer '" + shared_buffer(u, later) +
            "', one writing, but no chain of dependencies and stream orders runs from the first to the second (a "
            "data race; declare the dependency)");
        if (++reported == 20) break;
      }
  }

  /// A buffer name two conflicting tasks share (for messages).
  std::string shared_buffer(ir::task_id a, ir::task_id b) const {
    const auto& ta = g_.tasks[static_cast<std::size_t>(a)];
    const auto& tb = g_.tasks[static_cast<std::size_t>(b)];
    for (const auto* la : {&ta.reads, &ta.writes})
      for (const auto x : *la)
        for (const auto* lb : {&tb.reads, &tb.writes})
          for (const auto y : *lb)
            if (g_.overlap(x, y)) return g_.buffers[static_cast<std::size_t>(x)].name;
    return "?";
  }

  /// Collectives of one mesh axis are safe only if the happens-before relation orders them
  /// totally (every rank of a group joins each, and NCCL's kernels on two communicators of the
  /// same ranks can wait on each other when issued in different orders). Walking them in a
  /// topological order, each must have the previous one as an ancestor; the latest ancestor
  /// among them is carried through the graph. Sends and receives are not in it: each joins two
  /// ranks, and a pipeline's lanes order them per link (train/pipeline.hpp checks both ends).
  void check_collective_order(const std::vector<std::vector<ir::task_id>>& preds,
                              const std::vector<ir::task_id>& sorted) {
    const auto n = g_.tasks.size();
    for (std::size_t a = 0; a < g_.axes.size(); ++a) {
      std::vector<int> index(n, -1);
      std::vector<ir::task_id> members;
      for (const auto t : sorted) {
        const auto& task = g_.tasks[static_cast<std::size_t>(t)];
        const bool point_to_point = task.kind == ir::op_kind::send || task.kind == ir::op_kind::recv;
        if (ir::is_collective(task.kind) && !point_to_point && task.axis == static_cast<int>(a)) {
          index[static_cast<std::size_t>(t)] = static_cast<int>(members.size());
          members.push_back(t);
        }
      }
      if (members.size() < 2) continue;
      std::vector<int> latest(n, -1);
      for (const auto t : sorted) {
        const auto ti = static_cast<std::size_t>(t);
        for (const auto d : preds[ti])
          latest[ti] = std::max({latest[ti], latest[static_cast<std::size_t>(d)], index[static_cast<std::size_t>(d)]});
      }
      for (std::size_t i = 1; i < members.size(); ++i) {
        const auto prev = members[i - 1], cur = members[i];
        if (latest[static_cast<std::size_t>(cur)] == static_cast<int>(i) - 1) continue;
        const auto lane = [&](ir::task_id t) {
          return stream_ref(g_, static_cast<std::size_t>(g_.tasks[static_cast<std::size_t>(t)].stream));
        };
        add("collectives " + task_ref(g_, prev) + " on " + lane(prev) + " and " + task_ref(g_, cur) + " on " +
            lane(cur) + " of mesh axis '" + g_.axes[a].name +
            "' are not ordered (no chain of dependencies and stream orders joins them), so ranks may issue them in "
            "different orders");
      }
    }
  }

  void check_memory(std::int64_t cap) {
    const auto mem = peak_memory(p_);
    if (mem.peak_bytes <= cap) return;
    auto live = mem.live_at_peak;
    std::sort(live.begin(), live.end(), [&](auto x, auto y) {
      return g_.buffers[static_cast<std::size_t>(x)].bytes > g_.buffers[static_cast<std::size_t>(y)].bytes;
    });
    std::string largest;
    for (std::size_t i = 0; i < live.size() && i < 3; ++i) {
      const auto& b = g_.buffers[static_cast<std::size_t>(live[i])];
      largest += (i ? ", '" : "'") + b.name + "' " + std::to_string(b.bytes);
    }
    add("peak memory " + std::to_string(mem.peak_bytes) + " bytes at " + format_us(mem.peak_at_us) +
        " us exceeds the cap of " + std::to_string(cap) + " bytes (persistent " + std::to_string(mem.persistent_bytes) +
        " bytes; largest live buffers: " + largest + ")");
  }

  const plan& p_;
  const ir::graph& g_;
  const verify_options& opts_;
  std::vector<std::string> problems_;
};

} // namespace detail

/// @brief Every problem of a plan, each naming the tasks involved; empty when the plan is sound.
/// @code
/// for (const auto& problem : plan::check(p, {.memory_cap_bytes = 80LL << 30})) std::cerr << problem << '\n';
/// @endcode
[[nodiscard]] inline std::vector<std::string> check(const plan& p, const verify_options& opts = {}) {
  try {
    return detail::checker(p, opts).run();
  } catch (const error& e) { // a check that could not finish is itself a problem
    return {detail::strip_prefix(e.what())};
  }
}

/// @brief Throws concerto::error listing the plan's problems (the first 20), if it has any.
inline void verify(const plan& p, const verify_options& opts = {}) {
  const auto problems = check(p, opts);
  if (problems.empty()) return;
  std::string message = "plan of graph '" + p.graph.name + "'" + (p.policy.empty() ? "" : " (policy " + p.policy + ")") +
                        " is invalid, " + std::to_string(problems.size()) + " problem" +
                        (problems.size() == 1 ? "" : "s") + ":";
  constexpr std::size_t shown = 20;
  for (std::size_t i = 0; i < problems.size() && i < shown; ++i) message += "\n  - " + problems[i];
  if (problems.size() > shown) message += "\n  ... and " + std::to_string(problems.size() - shown) + " more";
  fail(message);
}

/// @brief The collectives in the order every rank issues them: a topological order of the
/// dependencies and stream orders, ties broken by task id (so it is a function of the plan).
/// Throws concerto::error if the plan's orders deadlock.
[[nodiscard]] inline std::vector<collective_signature> collective_sequence(const plan& p) {
  const auto& g = p.graph;
  g.validate();
  const auto preds = detail::happens_before(p);
  const auto sorted = detail::ordered(preds);
  if (sorted.size() != g.tasks.size())
    fail("collective sequence of graph '" + g.name + "': the stream orders and dependencies form a cycle");
  std::vector<collective_signature> out;
  for (const auto t : sorted) {
    const auto& task = g.tasks[static_cast<std::size_t>(t)];
    if (ir::is_collective(task.kind)) out.push_back({task.axis, task.kind, task.bytes, task.name});
  }
  return out;
}

/// @brief Throws concerto::error naming the first rank and position whose collective
/// sequence differs from rank 0's; such ranks would hang or exchange the wrong buffers.
inline void verify_same_collectives(const std::vector<std::vector<collective_signature>>& per_rank) {
  if (per_rank.empty()) return;
  const auto& ref = per_rank.front();
  for (std::size_t r = 1; r < per_rank.size(); ++r) {
    const auto& mine = per_rank[r];
    for (std::size_t i = 0; i < std::max(ref.size(), mine.size()); ++i) {
      if (i < ref.size() && i < mine.size() && ref[i] == mine[i]) continue;
      const auto say = [&](const std::vector<collective_signature>& seq) {
        return i < seq.size() ? detail::describe(seq[i]) : "nothing (its sequence ends after " + std::to_string(seq.size()) + " collectives)";
      };
      fail("rank " + std::to_string(r) + " differs from rank 0 at collective " + std::to_string(i) + ": rank 0 issues " +
           say(ref) + ", rank " + std::to_string(r) + " issues " + say(mine));
    }
  }
}

} // namespace concerto::plan
