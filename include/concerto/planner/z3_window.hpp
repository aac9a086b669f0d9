#pragma once
/// @file
/// @brief One window of the task list as a scheduling problem solved exactly by Z3.
///
/// A window is a small resource-constrained scheduling problem: tasks with durations, each on
/// one unary resource (a stream), precedence inside the window, and the state at the window's
/// boundary carried in from the rest of the plan: when each stream becomes free, the earliest
/// start of each task given its dependencies outside the window (release), and the work that
/// must follow each task after the window (tail). The objective is the window's makespan,
/// max(start + duration + tail).
///
/// The model uses integer start times in scaled units. Durations, releases and tails are
/// rounded up, so a schedule of the integer model is feasible in real time; the solution is then
/// re-timed with the real durations (each task as early as its stream order and predecessors
/// allow), which can only shorten it. The rounding costs at most one unit per task on a path,
/// and the unit is chosen so that this is below 0.05% of the makespan.
///
/// Search: a binary search on the makespan with an incremental `z3::solver` for difference
/// logic, starting from the incumbent (upper bound) and probing the lower bound first. The
/// alternative, `z3::optimize`, is kept selectable for measurement (bench/solver_window); see
/// docs/planner.md for the numbers that chose the default.

#include <concerto/core/error.hpp>

#include <z3++.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief One task of a window.
struct window_task {
  int stream = 0;          ///< the unary resource it occupies
  double duration = 0;     ///< >= 0
  double release = 0;      ///< earliest start, from dependencies outside the window
  double tail = 0;         ///< work that must follow it after the window (longest path)
  std::vector<int> preds;  ///< indices of window tasks that must finish before it starts
};

/// @brief A window: its tasks, the boundary state, and the incumbent as a warm start.
struct window_problem {
  std::vector<window_task> tasks;
  std::vector<double> stream_free; ///< per stream, when it becomes free; empty means all free at 0
  double upper_bound = 0;          ///< makespan of the incumbent; 0 when there is none
  double lower_bound = 0;          ///< a valid lower bound on the makespan (0: none known)
  std::vector<double> hint_start;  ///< incumbent start per task; empty when there is none
};

/// @brief The solver's answer. `start` is always a feasible schedule of the window.
struct window_solution {
  std::vector<double> start;
  double makespan = 0;      ///< max(start + duration + tail)
  bool optimal = false;     ///< proven optimal (up to the model's time resolution)
  bool improved = false;    ///< strictly better than the incumbent (upper_bound, else hint)
  double solve_seconds = 0;
};

/// @brief How a window is searched; the default is the one measured faster.
enum class window_method {
  binary_search, ///< incremental z3::solver, lower bound probed first, then bisection
  optimize,      ///< z3::optimize minimising the makespan
};

/// @brief Tuning for solve_window.
struct window_options {
  double time_limit_s = 1.0;
  /// When positive, the search is bounded by this much Z3 work (its resource counter,
  /// "rlimit") instead of time_limit_s: the same window gives the same answer on any machine.
  /// binary_search only.
  std::uint64_t work_limit = 0;
  window_method method = window_method::binary_search;
  /// Units per makespan per task: the integer unit is LB / (resolution * (n + 2)).
  double resolution = 2000;
};

namespace detail {

// Transitive closure of the window's precedence, as bit rows (reach[i] holds j when i -> ... -> j).
class reach_matrix {
public:
  explicit reach_matrix(std::size_t n) : n_(n), words_((n + 63) / 64), bits_(n * words_, 0) {}
  [[nodiscard]] bool get(std::size_t i, std::size_t j) const {
    return (bits_[i * words_ + j / 64] >> (j % 64)) & 1u;
  }
  void set(std::size_t i, std::size_t j) { bits_[i * words_ + j / 64] |= std::uint64_t{1} << (j % 64); }
  void merge_row(std::size_t into, std::size_t from) {
    for (std::size_t w = 0; w < words_; ++w) bits_[into * words_ + w] |= bits_[from * words_ + w];
  }
  [[nodiscard]] std::size_t size() const { return n_; }

private:
  std::size_t n_, words_;
  std::vector<std::uint64_t> bits_;
};

struct window_index {
  std::vector<int> topo;                   // a topological order of the window's tasks
  std::vector<std::vector<int>> succ;
  int streams = 0;
};

inline window_index check_and_index(const window_problem& p) {
  const int n = static_cast<int>(p.tasks.size());
  window_index ix;
  ix.succ.assign(static_cast<std::size_t>(n), {});
  std::vector<int> indeg(static_cast<std::size_t>(n), 0);
  for (int i = 0; i < n; ++i) {
    const auto& t = p.tasks[static_cast<std::size_t>(i)];
    const auto who = "window task " + std::to_string(i);
    if (!(t.duration >= 0) || !std::isfinite(t.duration)) fail(who + " has an invalid duration");
    if (!(t.release >= 0) || !std::isfinite(t.release)) fail(who + " has an invalid release time");
    if (!(t.tail >= 0) || !std::isfinite(t.tail)) fail(who + " has an invalid tail");
    if (t.stream < 0) fail(who + " runs on negative stream " + std::to_string(t.stream));
    if (!p.stream_free.empty() && static_cast<std::size_t>(t.stream) >= p.stream_free.size())
      fail(who + " runs on stream " + std::to_string(t.stream) + ", but stream_free has only " +
           std::to_string(p.stream_free.size()) + " entries");
    ix.streams = std::max(ix.streams, t.stream + 1);
    for (int d : t.preds) {
      if (d < 0 || d >= n) fail(who + " depends on window task " + std::to_string(d) + ", which does not exist");
      if (d == i) fail(who + " depends on itself");
      ix.succ[static_cast<std::size_t>(d)].push_back(i);
      ++indeg[static_cast<std::size_t>(i)];
    }
  }
  for (double f : p.stream_free)
    if (!(f >= 0) || !std::isfinite(f)) fail("window_problem.stream_free holds an invalid time");
  if (!p.hint_start.empty() && p.hint_start.size() != p.tasks.size())
    fail("window_problem.hint_start has " + std::to_string(p.hint_start.size()) + " entries for " +
         std::to_string(n) + " tasks");
  for (int i = 0; i < n; ++i)
    if (indeg[static_cast<std::size_t>(i)] == 0) ix.topo.push_back(i);
  for (std::size_t h = 0; h < ix.topo.size(); ++h)
    for (int s : ix.succ[static_cast<std::size_t>(ix.topo[h])])
      if (--indeg[static_cast<std::size_t>(s)] == 0) ix.topo.push_back(s);
  if (static_cast<int>(ix.topo.size()) != n) {
    for (int i = 0; i < n; ++i)
      if (indeg[static_cast<std::size_t>(i)] > 0) fail("window task " + std::to_string(i) + " lies on a dependency cycle");
  }
  return ix;
}

// Times in one unit system (real or scaled integers, both held as double here).
struct window_times {
  std::vector<double> dur, ready, tail; // ready = max(release, stream free)
};

// Each task as early as its predecessors and its stream order allow; nullopt when the stream
// orders contradict the precedence (a cycle).
inline std::optional<std::vector<double>> left_shift(const window_problem& p, const window_index& ix,
                                                     const window_times& tm,
                                                     const std::vector<std::vector<int>>& stream_order) {
  const auto n = p.tasks.size();
  std::vector<int> indeg(n, 0), next_on_stream(n, -1);
  for (std::size_t i = 0; i < n; ++i) indeg[i] = static_cast<int>(p.tasks[i].preds.size());
  for (const auto& ord : stream_order)
    for (std::size_t k = 1; k < ord.size(); ++k) {
      next_on_stream[static_cast<std::size_t>(ord[k - 1])] = ord[k];
      ++indeg[static_cast<std::size_t>(ord[k])];
    }
  std::vector<double> start(n, 0), earliest(tm.ready);
  std::vector<int> queue;
  for (std::size_t i = 0; i < n; ++i)
    if (indeg[i] == 0) queue.push_back(static_cast<int>(i));
  std::size_t done = 0;
  while (!queue.empty()) {
    const auto i = static_cast<std::size_t>(queue.back());
    queue.pop_back();
    ++done;
    start[i] = earliest[i];
    const double end = start[i] + tm.dur[i];
    auto release_to = [&](int j) {
      auto& e = earliest[static_cast<std::size_t>(j)];
      e = std::max(e, end);
      if (--indeg[static_cast<std::size_t>(j)] == 0) queue.push_back(j);
    };
    for (int s : ix.succ[i]) release_to(s);
    if (next_on_stream[i] >= 0) release_to(next_on_stream[i]);
  }
  if (done != n) return std::nullopt;
  return start;
}

inline std::vector<std::vector<int>> orders_by_start(const window_problem& p, const window_index& ix,
                                                     const std::vector<double>& start) {
  std::vector<int> rank(p.tasks.size());
  for (std::size_t k = 0; k < ix.topo.size(); ++k) rank[static_cast<std::size_t>(ix.topo[k])] = static_cast<int>(k);
  std::vector<int> all(p.tasks.size());
  std::iota(all.begin(), all.end(), 0);
  // Ties (zero-length tasks) break by topological rank so that a dependency is never reversed.
  std::sort(all.begin(), all.end(), [&](int a, int b) {
    const auto sa = start[static_cast<std::size_t>(a)], sb = start[static_cast<std::size_t>(b)];
    return sa != sb ? sa < sb : rank[static_cast<std::size_t>(a)] < rank[static_cast<std::size_t>(b)];
  });
  std::vector<std::vector<int>> ord(static_cast<std::size_t>(ix.streams));
  for (int i : all) ord[static_cast<std::size_t>(p.tasks[static_cast<std::size_t>(i)].stream)].push_back(i);
  return ord;
}

// Serial list schedule: the ready task that can start first, longest remaining work on ties.
inline std::vector<std::vector<int>> greedy_orders(const window_problem& p, const window_index& ix,
                                                   const window_times& tm) {
  const auto n = p.tasks.size();
  std::vector<int> missing(n);
  for (std::size_t i = 0; i < n; ++i) missing[i] = static_cast<int>(p.tasks[i].preds.size());
  std::vector<double> earliest(tm.ready), stream_end(static_cast<std::size_t>(ix.streams), 0);
  std::vector<char> done(n, 0);
  std::vector<std::vector<int>> ord(static_cast<std::size_t>(ix.streams));
  for (std::size_t k = 0; k < n; ++k) {
    int best = -1;
    double best_start = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (done[i] || missing[i] > 0) continue;
      const double s = std::max(earliest[i], stream_end[static_cast<std::size_t>(p.tasks[i].stream)]);
      const auto bi = static_cast<std::size_t>(best);
      if (best < 0 || s < best_start ||
          (s == best_start && tm.dur[i] + tm.tail[i] > tm.dur[bi] + tm.tail[bi])) {
        best = static_cast<int>(i);
        best_start = s;
      }
    }
    const auto b = static_cast<std::size_t>(best);
    done[b] = 1;
    const double end = best_start + tm.dur[b];
    stream_end[static_cast<std::size_t>(p.tasks[b].stream)] = end;
    ord[static_cast<std::size_t>(p.tasks[b].stream)].push_back(best);
    for (int s : ix.succ[b]) {
      earliest[static_cast<std::size_t>(s)] = std::max(earliest[static_cast<std::size_t>(s)], end);
      --missing[static_cast<std::size_t>(s)];
    }
  }
  return ord;
}

inline double makespan_of(const window_times& tm, const std::vector<double>& start) {
  double m = 0;
  for (std::size_t i = 0; i < start.size(); ++i) m = std::max(m, start[i] + tm.dur[i] + tm.tail[i]);
  return m;
}

// Earliest start by precedence (head) and the least work that must follow a task's end (tail
// through the window's successors, then its own tail): both hold in every schedule.
struct heads_tails {
  std::vector<double> head, tail;
};

inline heads_tails heads_and_tails(const window_index& ix, const window_times& tm) {
  heads_tails ht{tm.ready, tm.tail};
  for (int i : ix.topo) {
    const auto u = static_cast<std::size_t>(i);
    for (int s : ix.succ[u])
      ht.head[static_cast<std::size_t>(s)] = std::max(ht.head[static_cast<std::size_t>(s)], ht.head[u] + tm.dur[u]);
  }
  for (auto it = ix.topo.rbegin(); it != ix.topo.rend(); ++it) {
    const auto u = static_cast<std::size_t>(*it);
    for (int s : ix.succ[u]) {
      const auto v = static_cast<std::size_t>(s);
      ht.tail[u] = std::max(ht.tail[u], tm.dur[v] + ht.tail[v]);
    }
  }
  return ht;
}

// Per stream, Jackson's preemptive schedule with heads and tails: the optimum of the one-stream
// relaxation that may interrupt tasks, computed in O(n^2). It subsumes "the stream's work" and
// "the critical path", and is what lets the lower-bound probe close most windows at once.
inline double own_lower_bound(const window_problem& p, const window_index& ix, const window_times& tm) {
  const auto n = p.tasks.size();
  const auto ht = heads_and_tails(ix, tm);
  double lb = 0;
  for (std::size_t i = 0; i < n; ++i) lb = std::max(lb, ht.head[i] + tm.dur[i] + ht.tail[i]);
  for (int s = 0; s < ix.streams; ++s) {
    std::vector<std::size_t> mine;
    for (std::size_t i = 0; i < n; ++i)
      if (p.tasks[i].stream == s && tm.dur[i] > 0) mine.push_back(i);
    std::vector<double> left(n, 0);
    for (auto i : mine) left[i] = tm.dur[i];
    std::size_t remaining = mine.size();
    double t = 0;
    while (remaining > 0) {
      // Run the released task with the longest tail until it ends or the next release.
      std::size_t pick = n;
      double next_release = std::numeric_limits<double>::infinity();
      for (auto i : mine) {
        if (left[i] <= 0) continue;
        if (ht.head[i] <= t) {
          if (pick == n || ht.tail[i] > ht.tail[pick]) pick = i;
        } else {
          next_release = std::min(next_release, ht.head[i]);
        }
      }
      if (pick == n) {
        t = next_release;
        continue;
      }
      const double run = std::min(left[pick], next_release - t);
      t += run;
      left[pick] -= run;
      if (left[pick] <= 0) {
        --remaining;
        lb = std::max(lb, t + ht.tail[pick]);
      }
    }
  }
  return lb;
}

inline window_times real_timing(const window_problem& p) {
  window_times tm;
  for (const auto& t : p.tasks) {
    tm.dur.push_back(t.duration);
    const double fr = p.stream_free.empty() ? 0.0 : p.stream_free[static_cast<std::size_t>(t.stream)];
    tm.ready.push_back(std::max(t.release, fr));
    tm.tail.push_back(t.tail);
  }
  return tm;
}

// Rounded up so that an integer schedule stays feasible with the real numbers.
inline window_times scaled_timing(const window_times& real, double unit) {
  window_times tm;
  const auto up = [unit](double x) { return x <= 0 ? 0.0 : std::ceil(x / unit - 1e-9); };
  for (std::size_t i = 0; i < real.dur.size(); ++i) {
    tm.dur.push_back(up(real.dur[i]));
    tm.ready.push_back(up(real.ready[i]));
    tm.tail.push_back(up(real.tail[i]));
  }
  return tm;
}

// Built by appending: g++ 12 warns falsely (-Wrestrict) on "literal" + std::to_string(...).
inline std::string z3_name(const char* prefix, std::size_t a, std::size_t b = SIZE_MAX) {
  std::string s(prefix);
  s.append(std::to_string(a));
  if (b != SIZE_MAX) s.append("_").append(std::to_string(b));
  return s;
}

class window_model {
public:
  window_model(z3::context& ctx, const window_problem& p, const window_index& ix, const window_times& tm,
               const std::vector<std::vector<int>>& incumbent_order)
      : ctx_(ctx), m_(ctx.int_const("makespan")), asms_(ctx) {
    const auto n = p.tasks.size();
    for (std::size_t i = 0; i < n; ++i) s_.push_back(ctx.int_const(z3_name("s", i).c_str()));
    reach_matrix reach(n);
    for (auto it = ix.topo.rbegin(); it != ix.topo.rend(); ++it) {
      const auto i = static_cast<std::size_t>(*it);
      for (int j : ix.succ[i]) {
        reach.set(i, static_cast<std::size_t>(j));
        reach.merge_row(i, static_cast<std::size_t>(j));
      }
    }
    const auto num = [&](double v) { return ctx.int_val(static_cast<std::int64_t>(v)); };
    // Heads and tails are implied by precedence; stating them saves the solver deriving them.
    const auto ht = heads_and_tails(ix, tm);
    for (std::size_t i = 0; i < n; ++i) {
      constraints_.push_back(s_[i] >= num(ht.head[i]));
      constraints_.push_back(m_ - s_[i] >= num(tm.dur[i] + ht.tail[i]));
      for (int d : p.tasks[i].preds) {
        const auto u = static_cast<std::size_t>(d);
        constraints_.push_back(s_[i] - s_[u] >= num(tm.dur[u]));
      }
    }
    // Unary resources: one ordering literal per pair on a stream that precedence leaves open.
    // The literal is oriented so that false means the incumbent's order; the primed first check
    // assumes the incumbent's order, so the solver's saved phases start from it.
    std::vector<int> pos(n, 0);
    for (const auto& ord : incumbent_order)
      for (std::size_t k = 0; k < ord.size(); ++k) pos[static_cast<std::size_t>(ord[k])] = static_cast<int>(k);
    for (std::size_t a = 0; a < n; ++a)
      for (std::size_t b = a + 1; b < n; ++b) {
        if (p.tasks[a].stream != p.tasks[b].stream || reach.get(a, b) || reach.get(b, a)) continue;
        const auto [i, j] = pos[a] < pos[b] ? std::pair{a, b} : std::pair{b, a};  // incumbent: i before j
        auto swap = ctx.bool_const(z3_name("o", i, j).c_str());
        constraints_.push_back(z3::implies(!swap, s_[j] - s_[i] >= num(tm.dur[i])));
        constraints_.push_back(z3::implies(swap, s_[i] - s_[j] >= num(tm.dur[j])));
        asms_.push_back(!swap);
      }
  }

  [[nodiscard]] const std::vector<z3::expr>& constraints() const { return constraints_; }
  [[nodiscard]] const z3::expr& makespan() const { return m_; }
  [[nodiscard]] const z3::expr_vector& incumbent_literals() const { return asms_; }

  [[nodiscard]] std::vector<double> starts(const z3::model& model) const {
    std::vector<double> out;
    for (const auto& s : s_) {
      const auto v = model.eval(s, true);
      std::int64_t x = 0;
      if (!v.is_numeral_i64(x)) fail("the Z3 window model returned a non-integer start time");
      out.push_back(static_cast<double>(x));
    }
    return out;
  }

private:
  z3::context& ctx_;
  z3::expr m_;
  std::vector<z3::expr> s_;
  std::vector<z3::expr> constraints_;
  z3::expr_vector asms_;
};

inline unsigned ms_left(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  return left <= 0 ? 0u : static_cast<unsigned>(std::min<std::int64_t>(left, std::numeric_limits<unsigned>::max()));
}

// The work Z3 has counted on this solver so far (its "rlimit count" statistic).
inline std::uint64_t work_done(const z3::solver& solver) {
  const auto stats = solver.statistics();
  for (unsigned i = 0; i < stats.size(); ++i)
    if (stats.key(i) == "rlimit count") return stats.is_uint(i) ? stats.uint_value(i) : static_cast<std::uint64_t>(stats.double_value(i));
  return 0;
}

// What a window's search may still spend: milliseconds until a deadline, or units of Z3 work
// (the deterministic mode). Each query is given its share before it runs.
class search_budget {
public:
  search_budget(std::chrono::steady_clock::time_point deadline, std::uint64_t work_limit)
      : deadline_(deadline), work_limit_(work_limit) {}

  [[nodiscard]] std::uint64_t left() const {
    return work_limit_ > 0 ? work_limit_ - std::min(work_limit_, used_) : ms_left(deadline_);
  }
  // Limits the next query to `whole` of what is left, else a third of it (at least a
  // twentieth of the whole, or 50 ms).
  void limit(z3::solver& solver, bool whole) {
    const std::uint64_t rest = left();
    const std::uint64_t floor = work_limit_ > 0 ? std::max<std::uint64_t>(work_limit_ / 20, 1) : 50;
    const std::uint64_t share = whole ? rest : std::max(rest / 3, std::min(rest, floor));
    const auto as_param = static_cast<unsigned>(std::min<std::uint64_t>(share, std::numeric_limits<unsigned>::max()));
    if (work_limit_ > 0) {
      solver.set("rlimit", as_param);
      before_ = work_done(solver);
    } else {
      solver.set("timeout", as_param);
    }
  }
  // Charges the query that just ran.
  void charge(const z3::solver& solver) {
    if (work_limit_ > 0) used_ += work_done(solver) - std::min(before_, work_done(solver));
  }

private:
  std::chrono::steady_clock::time_point deadline_;
  std::uint64_t work_limit_;
  std::uint64_t used_ = 0, before_ = 0;
};

struct search_result {
  std::optional<std::vector<double>> start;  // best integer schedule found by the solver
  double best = 0;                           // its integer makespan (or the incumbent's)
  bool optimal = false;
};

// Bisection on the makespan. A query that runs out of its share of the time does not end the
// search: the next one aims higher, where a better schedule is easier to find, and only the
// proof of optimality is lost. Each query gets at most a third of what is left, so one hard
// proof cannot starve the improvement.
inline search_result search_binary(z3::context& ctx, const window_model& model, double lo, double hi,
                                   search_budget budget) {
  search_result res;
  res.best = hi;
  z3::solver solver(ctx, "QF_IDL");
  for (const auto& c : model.constraints()) solver.add(c);
  solver.add(model.makespan() <= ctx.int_val(static_cast<std::int64_t>(hi)));
  const auto check = [&](z3::expr_vector& asms, bool whole) {
    if (budget.left() == 0) return z3::unknown;
    budget.limit(solver, whole);
    const auto r = solver.check(asms);
    budget.charge(solver);
    return r;
  };
  {
    auto asms = model.incumbent_literals();  // phase priming: immediate, by propagation
    if (check(asms, true) == z3::unknown) return res;
  }
  double proven = lo;  // no schedule is shorter than this
  std::size_t probe = 0;
  while (lo < hi && budget.left() > 0) {
    // Probe the lower bound first: when it is tight this is the whole proof.
    const double target = probe++ == 0 ? lo : std::floor((lo + hi) / 2);
    auto guard = ctx.bool_const(z3_name("le", probe).c_str());
    solver.add(z3::implies(guard, model.makespan() <= ctx.int_val(static_cast<std::int64_t>(target))));
    z3::expr_vector asms(ctx);
    asms.push_back(guard);
    const auto r = check(asms, hi - lo <= 1);
    if (r == z3::sat) {
      const auto m = solver.get_model();
      res.start = model.starts(m);
      std::int64_t x = 0;
      if (!m.eval(model.makespan(), true).is_numeral_i64(x))
        fail("the Z3 window model returned a non-integer makespan");
      hi = std::min(static_cast<double>(x), target);
      res.best = hi;
    } else {
      if (r == z3::unsat) proven = std::max(proven, target + 1);
      lo = target + 1;
    }
  }
  res.optimal = proven >= hi;
  return res;
}

inline search_result search_optimize(z3::context& ctx, const window_model& model, double lo, double hi,
                                     std::chrono::steady_clock::time_point deadline) {
  search_result res;
  res.best = hi;
  z3::optimize opt(ctx);
  for (const auto& c : model.constraints()) opt.add(c);
  opt.add(model.makespan() <= ctx.int_val(static_cast<std::int64_t>(hi)));
  opt.add(model.makespan() >= ctx.int_val(static_cast<std::int64_t>(lo)));
  const unsigned left = ms_left(deadline);
  if (left == 0) return res;
  z3::params prm(ctx);
  prm.set("timeout", left);
  opt.set(prm);
  opt.minimize(model.makespan());
  const auto r = opt.check();
  if (r == z3::unsat) return res;  // cannot happen: the incumbent satisfies the bounds
  // On a timeout z3::optimize still holds the best model it found.
  try {
    const auto m = opt.get_model();
    res.start = model.starts(m);
    std::int64_t x = 0;
    if (m.eval(model.makespan(), true).is_numeral_i64(x)) res.best = static_cast<double>(x);
  } catch (const z3::exception&) {
    res.start.reset();
  }
  res.optimal = r == z3::sat;
  return res;
}

} // namespace detail

/// @brief Solves one window: the schedule of its tasks that minimises max(start + duration + tail).
///
/// Returns a feasible schedule always: the solver's best, or the incumbent (hint_start, else a
/// list schedule of the window) when the time limit ends the search before it finds a better
/// one. `optimal` is set only when the solver proved that no shorter makespan exists (up to the
/// model's integer resolution, below 0.05% of the makespan).
///
/// @code
/// planner::window_problem w;
/// w.tasks = {{0, 3.0, 0, 0, {}}, {1, 2.0, 0, 0, {0}}, {0, 1.0, 0, 0, {}}};  // compute, collective of it, compute
/// w.stream_free = {0, 0};
/// auto sol = planner::solve_window(w, {.time_limit_s = 0.5});
/// // sol.makespan == 5: the second compute overlaps the collective
/// @endcode
inline window_solution solve_window(const window_problem& problem, const window_options& options,
                                    z3::context* context = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.work_limit > 0 && options.method != window_method::binary_search)
    fail("solve_window: a work limit (the deterministic mode) needs the binary_search method");
  const auto deadline =
      options.work_limit > 0
          ? std::chrono::steady_clock::time_point::max()
          : t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(std::clamp(options.time_limit_s, 0.0, 1e6)));
  const auto ix = detail::check_and_index(problem);
  const auto n = problem.tasks.size();
  window_solution sol;
  const auto finish = [&](window_solution& s) -> window_solution {
    s.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  };
  if (n == 0) {
    sol.optimal = true;
    return finish(sol);
  }
  const auto real = detail::real_timing(problem);

  // The incumbent: the hint's stream orders re-timed, or a list schedule when the hint is
  // absent or contradicts the precedence.
  std::vector<std::vector<int>> inc_order;
  std::optional<std::vector<double>> inc_start;
  if (!problem.hint_start.empty()) {
    inc_order = detail::orders_by_start(problem, ix, problem.hint_start);
    inc_start = detail::left_shift(problem, ix, real, inc_order);
  }
  if (!inc_start) {
    inc_order = detail::greedy_orders(problem, ix, real);
    inc_start = detail::left_shift(problem, ix, real, inc_order);
  }
  const double inc_makespan = detail::makespan_of(real, *inc_start);
  const double reference = problem.upper_bound > 0 ? problem.upper_bound
                           : problem.hint_start.empty() ? inc_makespan
                                                        : detail::makespan_of(real, problem.hint_start);
  const double lb_real = std::max(problem.lower_bound, detail::own_lower_bound(problem, ix, real));

  sol.start = *inc_start;
  sol.makespan = inc_makespan;
  if (inc_makespan <= lb_real * (1 + 1e-12)) {  // the incumbent meets the bound: nothing to search
    sol.optimal = true;
  } else {
    const double scale_base = lb_real > 0 ? lb_real : inc_makespan;
    const double unit = scale_base / (options.resolution * static_cast<double>(n + 2));
    const auto tm = detail::scaled_timing(real, unit);
    const auto inc_int = detail::left_shift(problem, ix, tm, inc_order);
    const double hi = detail::makespan_of(tm, *inc_int);
    const double lo = std::max(std::floor(problem.lower_bound / unit - 1e-6),
                               detail::own_lower_bound(problem, ix, tm));
    std::optional<z3::context> own;
    z3::context& ctx = context ? *context : own.emplace();
    detail::search_result found;
    {
      const detail::window_model model(ctx, problem, ix, tm, inc_order);
      found = options.method == window_method::optimize ? detail::search_optimize(ctx, model, lo, hi, deadline)
                                                        : detail::search_binary(ctx, model, lo, hi,
                                                                                {deadline, options.work_limit});
    }
    if (found.start) {
      const auto order = detail::orders_by_start(problem, ix, *found.start);
      if (auto retimed = detail::left_shift(problem, ix, real, order)) {
        const double mk = detail::makespan_of(real, *retimed);
        if (mk < sol.makespan) {
          sol.start = std::move(*retimed);
          sol.makespan = mk;
        }
      }
    }
    sol.optimal = found.optimal;
  }
  sol.improved = sol.makespan < reference * (1 - 1e-9);
  return finish(sol);
}

/// @brief solve_window with a time limit in seconds and the default method.
inline window_solution solve_window(const window_problem& problem, double time_limit_s,
                                    z3::context* context = nullptr) {
  window_options o;
  o.time_limit_s = time_limit_s;
  return solve_window(problem, o, context);
}

} // namespace concerto::planner
