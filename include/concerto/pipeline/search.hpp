#pragma once
/// @file
/// @brief The `concerto` pipeline policy: every stage's order of F, B and W blocks found by Z3,
/// under a memory cap, warm-started from the best baseline and never worse than it.
///
/// Candidates: every baseline of every layout it applies to (one chunk per stage, or
/// interleaved chunks), each replayed and checked against the cap (by default the peak of
/// `memory_reference`, 1F1B's or with chunks interleaved 1F1B's, so that the comparison is at
/// equal activation memory), and concerto's own seeds: greedy list schedules under the cap,
/// ZB-H1's shape with the deferrals the cap allows, and the reference order where interleaved
/// 1F1B does not take the micro-batches. The fastest that fits is the start (a baseline's
/// backward split: W right after B, never slower).
/// Then windows of consecutive blocks and messages (by start time) become Z3 problems
/// (planner/z3_window.hpp): the blocks' stages and the messages' links are the unary
/// resources, the data dependencies, the micro-batch order of each chunk's passes (which keeps
/// neighbouring stages' messages in the same order) and a necessary form of the memory cap
/// (chunk c's forward of micro-batch m waits for its B of micro-batch m - k when k micro-batches
/// of it fill the cap) are precedences, the rest of the schedule is the boundary (stream free
/// times, releases, tails). A window's solution becomes the stages' new orders only if the
/// whole schedule, replayed and verified (deadlock, message order, exact memory), gets shorter;
/// a local search that swaps neighbouring blocks on the exact replay alternates with the
/// windows. So the result is never slower than the start and always within the cap.
///
/// With several chunks per stage, several chunk boundaries share a link, and the verifier also
/// wants its two ends to take its messages in one order (the stages' plans issue them so; see
/// `verify`). The greedy seeds take a link's messages in the order they were sent; a window's
/// solution or a swap that breaks that is first repaired (`detail::align_links`: the receiver
/// follows the sender) and then replayed and verified like any other proposal. However short
/// the search (its budget, or the machine's load, decides how far it gets), what it returns
/// has passed `verify`.

#include <concerto/pipeline/policies.hpp>
#include <concerto/planner/z3_window.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace concerto::pipeline {

/// @brief Tuning of the search.
struct search_options {
  double time_budget_s = 20;         ///< the whole search; the best schedule so far is returned
  int window = 48;                   ///< the largest window, in blocks and messages
  int rounds = 4;                    ///< passes over the schedule; the first two use half windows
  double window_time_limit_s = 0.25; ///< Z3 time per window
  /// A problem of at most this many blocks and messages is first solved as one window, for up
  /// to whole_time_limit_s (Z3 proves most 4-stage problems optimal in under a second).
  int whole_problem = 200;
  double whole_time_limit_s = 5;
  int cycles = 4;          ///< rounds of windows then exchanges, while either improves
  int exchange_passes = 8; ///< passes of the neighbour exchange per cycle
  /// When positive, Z3 work ("rlimit") per window instead of time: the same schedule on any
  /// machine (the budget is then not read either).
  std::uint64_t window_work_limit = 0;
  /// Activation memory per stage; 0: the largest stage peak of `memory_reference` on the first
  /// layout (1F1B's with one chunk per stage, interleaved 1F1B's with several).
  double memory_cap_bytes = 0;
};

/// @brief A candidate the search compared: a baseline on one layout, or why it could not run.
struct candidate {
  std::string policy;
  int virtual_stages = 1;
  double step_us = 0;           ///< 0 when it does not apply
  double peak_memory_bytes = 0;
  bool fits = false;            ///< within the memory cap
  std::string note;             ///< why it does not apply or does not fit
};

/// @brief What the search returns.
struct search_result {
  problem layout;               ///< the problem the schedule is for (with the cap)
  schedule best;
  timing time;
  std::string warm_start;       ///< the baseline it started from
  double warm_start_us = 0;
  double lower_bound_us = 0;
  std::vector<candidate> candidates;
  int windows_solved = 0, windows_improved = 0;
  bool proven_optimal = false; ///< see improve_stats
  double seconds = 0;
};

namespace detail {

// The window's precedences that the replay graph does not hold as edges: each chunk's passes in
// micro-batch order, and the necessary form of the memory cap.
inline std::vector<int> search_preds(const problem& p, const replay_graph& g, int u) {
  std::vector<int> out;
  const int bi = g.block_of[static_cast<std::size_t>(u)];
  if (bi < 0) {
    out.push_back(g.sender[static_cast<std::size_t>(u)]);
    return out;
  }
  const auto [c, m, kind] = block_at(p, static_cast<std::size_t>(bi));
  const auto node = [&](int cc, int mm, pass k) { return g.node[block_index(p, {cc, mm, k})]; };
  if (g.message_to[static_cast<std::size_t>(bi)] >= 0) out.push_back(g.message_to[static_cast<std::size_t>(bi)]);
  if (kind == pass::input_grad) out.push_back(node(c, m, pass::forward));
  if (kind == pass::weight_grad) out.push_back(node(c, m, pass::input_grad));
  if (m > 0) out.push_back(node(c, m - 1, kind));
  const auto& k = p.chunk(c);
  if (kind == pass::forward && p.memory_cap_bytes > 0 && k.activation_bytes > 0) {
    const int fill = static_cast<int>(std::floor(p.memory_cap_bytes * (1 + 1e-9) / k.activation_bytes));
    if (fill >= 1 && m - fill >= 0) out.push_back(node(c, m - fill, pass::input_grad));
  }
  return out;
}

// One window over nodes sorted[from, to): solved, spliced into the stages' orders.
inline schedule solve_one_window(const problem& p, const schedule& cur, const replay_graph& g,
                                 const std::vector<double>& start, const std::vector<int>& sorted, std::size_t from,
                                 std::size_t to, double step_us, double time_limit_s, std::uint64_t work_limit,
                                 bool& optimal, double& makespan) {
  const auto n = g.size();
  std::vector<int> local(n, -1), rank(n, 0);
  for (std::size_t r = 0; r < sorted.size(); ++r) rank[static_cast<std::size_t>(sorted[r])] = static_cast<int>(r);
  for (std::size_t r = from; r < to; ++r) local[static_cast<std::size_t>(sorted[r])] = static_cast<int>(r - from);
  std::vector<double> end(n);
  for (std::size_t i = 0; i < n; ++i) end[i] = start[i] + g.duration[i];
  // Work after each node to the end of its stage (longest path), with the stage's optimizer.
  std::vector<double> post(static_cast<std::size_t>(p.stages), 0), tail(n, 0);
  for (int st = 0; st < p.stages; ++st) post[static_cast<std::size_t>(st)] = p.optimizer_us(st);
  for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) {
    const auto u = static_cast<std::size_t>(*it);
    double t = g.stream[u] < p.stages ? post[static_cast<std::size_t>(g.stream[u])] : 0;
    for (const auto v : g.succ[u]) t = std::max(t, g.duration[static_cast<std::size_t>(v)] + tail[static_cast<std::size_t>(v)]);
    tail[u] = t;
  }
  planner::window_problem w;
  w.stream_free.assign(static_cast<std::size_t>(g.streams), 0);
  std::vector<double> after(static_cast<std::size_t>(g.streams), 0); // the first outside node after the window
  std::vector<char> after_set(static_cast<std::size_t>(g.streams), 0);
  for (std::size_t r = 0; r < sorted.size(); ++r) {
    const auto u = static_cast<std::size_t>(sorted[r]);
    const auto s = static_cast<std::size_t>(g.stream[u]);
    if (r < from) w.stream_free[s] = std::max(w.stream_free[s], end[u]);
    if (r >= to && !after_set[s]) { after[s] = g.duration[u] + tail[u]; after_set[s] = 1; }
  }
  for (std::size_t r = from; r < to; ++r) {
    const auto u = sorted[r];
    const auto uu = static_cast<std::size_t>(u);
    planner::window_task t;
    t.stream = g.stream[uu];
    t.duration = g.duration[uu];
    t.tail = after[static_cast<std::size_t>(t.stream)];
    for (const auto v : g.succ[uu])
      if (local[static_cast<std::size_t>(v)] < 0) t.tail = std::max(t.tail, g.duration[static_cast<std::size_t>(v)] + tail[static_cast<std::size_t>(v)]);
    if (t.stream < p.stages) t.tail = std::max(t.tail, post[static_cast<std::size_t>(t.stream)]);
    for (const auto v : search_preds(p, g, u)) {
      if (v < 0) continue;
      if (local[static_cast<std::size_t>(v)] >= 0) {
        if (rank[static_cast<std::size_t>(v)] < static_cast<int>(r)) t.preds.push_back(local[static_cast<std::size_t>(v)]);
      } else {
        t.release = std::max(t.release, end[static_cast<std::size_t>(v)]);
      }
    }
    w.tasks.push_back(std::move(t));
    w.hint_start.push_back(start[uu]);
  }
  w.upper_bound = step_us;
  planner::window_options wo;
  wo.time_limit_s = time_limit_s;
  wo.work_limit = work_limit;
  const auto sol = planner::solve_window(w, wo);
  optimal = sol.optimal;
  makespan = sol.makespan;
  if (!sol.improved) return cur;
  // The stages' window blocks in the solution's order, between the blocks before and after.
  schedule out{cur.policy, cur.split_backward, std::vector<std::vector<block>>(static_cast<std::size_t>(p.stages))};
  for (int st = 0; st < p.stages; ++st) {
    std::vector<std::pair<double, block>> inside;
    std::vector<block> before, behind;
    for (const auto& b : cur.order[static_cast<std::size_t>(st)]) {
      const auto u = static_cast<std::size_t>(g.node[block_index(p, b)]);
      const auto r = static_cast<std::size_t>(rank[u]);
      if (r < from) before.push_back(b);
      else if (r >= to) behind.push_back(b);
      else inside.emplace_back(sol.start[r - from], b);
    }
    std::stable_sort(inside.begin(), inside.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    auto& o = out.order[static_cast<std::size_t>(st)];
    o = std::move(before);
    for (const auto& [s, b] : inside) o.push_back(b);
    o.insert(o.end(), behind.begin(), behind.end());
  }
  return out;
}

// A non-delay list schedule under the memory cap, the backward split: at each event time every
// idle stage takes, among its chunks, a B that can run (the oldest micro-batch first), else a
// forward that can run and fits in memory (the deepest chunk first, or the shallowest with
// shallow_first), else the oldest W; with forward_first a fitting forward goes before a B.
// Time then moves to the next completion or message arrival. These are the search's seeds
// besides the baselines: where the cap leaves later stages room that 1F1B's shape does not
// use (ZB-H2's observation), or where interleaved chunks fit in it, they fill it.
inline std::optional<schedule> greedy(const problem& p, bool forward_first, bool shallow_first) {
  const int P = p.stages, C = p.chunk_count(), M = p.microbatches;
  const double inf = std::numeric_limits<double>::infinity();
  const double cap = p.memory_cap_bytes > 0 ? p.memory_cap_bytes * (1 + 1e-9) : inf;
  schedule s{std::string("greedy") + (forward_first ? "_forward_first" : "") + (shallow_first ? "_shallow" : ""), true,
             std::vector<std::vector<block>>(static_cast<std::size_t>(P))};
  std::vector<double> end(static_cast<std::size_t>(C * M * 3), inf), arrival_f(static_cast<std::size_t>(C * M), inf),
      arrival_b(static_cast<std::size_t>(C * M), inf), free_at(static_cast<std::size_t>(P), 0);
  std::map<std::pair<int, int>, double> link_free;
  // Per link and pass (F or B), the blocks its messages go to, in the order they were sent:
  // a receiver takes them in that order (verify: with chunks interleaved, several boundaries
  // share a link, and the two ends' plans must agree on its order).
  std::map<std::tuple<int, int, pass>, std::deque<block>> unread;
  const auto sending_chunk = [&](const block& to) { return to.kind == pass::forward ? to.chunk - 1 : to.chunk + 1; };
  const auto link_of = [&](const block& to) {
    return std::tuple{p.stage_of(sending_chunk(to)), p.stage_of(to.chunk), to.kind};
  };
  const auto receives = [&](const block& b) { // a message from another stage
    const int c = sending_chunk(b);
    return b.kind != pass::weight_grad && c >= 0 && c < C && p.stage_of(c) != p.stage_of(b.chunk);
  };
  const auto next_on_link = [&](const block& b) {
    if (!receives(b)) return true;
    const auto it = unread.find(link_of(b));
    return it != unread.end() && !it->second.empty() && it->second.front() == b;
  };
  std::vector<int> next_f(static_cast<std::size_t>(C), 0), next_b = next_f, next_w = next_f;
  const auto cm = [&](int c, int m) { return static_cast<std::size_t>(c * M + m); };
  const auto ready = [&](const block& b) {
    if (b.kind == pass::forward) return b.chunk == 0 ? 0.0 : arrival_f[cm(b.chunk, b.microbatch)];
    if (b.kind == pass::weight_grad) return end[block_index(p, {b.chunk, b.microbatch, pass::input_grad})];
    return std::max(end[block_index(p, {b.chunk, b.microbatch, pass::forward})],
                    b.chunk + 1 == C ? 0.0 : arrival_b[cm(b.chunk, b.microbatch)]);
  };
  const auto place = [&](const block& b, double at) {
    const double e = at + duration_us(p, b, true);
    end[block_index(p, b)] = e;
    if (receives(b)) unread[link_of(b)].pop_front(); // b is its front (next_on_link)
    const auto to = receiver(p, b);
    if (!to) return;
    if (receives(*to)) unread[link_of(*to)].push_back(*to);
    auto& link = link_free[{p.stage_of(b.chunk), p.stage_of(to->chunk)}];
    link = std::max(link, e) + p.send_us[static_cast<std::size_t>(std::min(b.chunk, to->chunk))];
    (b.kind == pass::forward ? arrival_f : arrival_b)[cm(to->chunk, b.microbatch)] = link;
  };
  std::size_t left_blocks = static_cast<std::size_t>(C * M * 3);
  double t = 0;
  for (;;) {
    bool placed = true;
    while (placed) {
      placed = false;
      for (int st = 0; st < P; ++st) {
        const auto i = static_cast<std::size_t>(st);
        if (free_at[i] > t) continue;
        double held = 0;
        for (int c = st; c < C; c += P) {
          const auto& k = p.chunk(c);
          const auto j = static_cast<std::size_t>(c);
          held += k.activation_bytes * (next_f[j] - next_b[j] * (1 - k.weight_grad_share) - next_w[j] * k.weight_grad_share);
        }
        std::optional<block> b, f, w;
        for (int c = st; c < C; c += P) {
          const auto j = static_cast<std::size_t>(c);
          const block nb{c, next_b[j], pass::input_grad}, nf{c, next_f[j], pass::forward}, nw{c, next_w[j], pass::weight_grad};
          if (next_b[j] < M && ready(nb) <= t && next_on_link(nb) &&
              (!b || nb.microbatch < b->microbatch || nb.microbatch == b->microbatch))
            b = nb;
          if (next_f[j] < M && ready(nf) <= t && next_on_link(nf) && held + p.chunk(c).activation_bytes <= cap &&
              (!f || !shallow_first))
            f = nf;
          if (next_w[j] < next_b[j] && (!w || nw.microbatch < w->microbatch || nw.microbatch == w->microbatch)) w = nw;
        }
        const auto pick = b && !(forward_first && f) ? b : f ? f : w;
        if (!pick) continue;
        place(*pick, t);
        free_at[i] = t + duration_us(p, *pick, true);
        s.order[i].push_back(*pick);
        const auto j = static_cast<std::size_t>(pick->chunk);
        ++(pick->kind == pass::forward ? next_f[j] : pick->kind == pass::input_grad ? next_b[j] : next_w[j]);
        --left_blocks;
        placed = true;
      }
    }
    if (left_blocks == 0) return s;
    double next = inf;
    for (const auto* times : {&end, &arrival_f, &arrival_b, &free_at})
      for (const auto e : *times)
        if (e > t) next = std::min(next, e);
    if (next == inf) return std::nullopt; // the cap leaves some stage nothing it can run
    t = next;
  }
}

// ZB-H1's shape with each stage deferring as many W passes (up to its index) as the cap
// leaves room for: 1F1B's stage s holds stages - s micro-batches, each deferred W keeps its share.
// Not for several chunks per stage: ZB-H1 is defined on 1F1B's one chunk per stage (the greedy
// seeds and interleaved 1F1B are the interleaved layout's starts).
inline std::optional<schedule> deferred_within_cap(const problem& p) {
  if (p.virtual_stages != 1 || p.memory_cap_bytes <= 0) return std::nullopt;
  std::vector<int> deferral(static_cast<std::size_t>(p.stages), 0);
  for (int st = 0; st < p.stages; ++st) {
    const auto& k = p.chunk(st);
    const double room = p.memory_cap_bytes - (p.stages - st) * k.activation_bytes;
    const double each = k.activation_bytes * k.weight_grad_share;
    deferral[static_cast<std::size_t>(st)] =
        each <= 0 ? st : std::clamp(static_cast<int>(std::floor(room / each + 1e-9)), 0, st);
  }
  return deferred_weight_grads(p, deferral, "zb_h1_within_cap");
}

// Megatron-LM's interleaved 1F1B when the micro-batches are not a multiple of the stages (its
// definition needs them to be): its order for the next multiple, the micro-batches beyond the
// step's left out. A block waits only on blocks of its own micro-batch, so what is left keeps
// the stages free of deadlock and the neighbours' messages in one order, and each stage, whose
// memory follows its own order, holds at most what the whole schedule holds.
inline schedule interleaved_any_microbatches(const problem& p) {
  auto whole = p;
  whole.microbatches = (p.microbatches + p.stages - 1) / p.stages * p.stages;
  auto s = interleaved_one_f_one_b(whole);
  for (auto& o : s.order) std::erase_if(o, [&](const block& b) { return b.microbatch >= p.microbatches; });
  if (whole.microbatches != p.microbatches) s.policy = "interleaved_1f1b_of_" + std::to_string(whole.microbatches);
  return s;
}

// With several chunks per stage, a link carries the messages of several chunk boundaries, and
// its two ends must take them in one order (verify; the stages' plans issue them in their
// blocks' order). What the search proposes keeps each chunk's passes in micro-batch order but
// not that: a greedy seed, a window's solution or a swap may let the receiver take a later
// message first. This puts the receiver's blocks that take a link's messages, in the places
// they hold in its order, in the order the messages leave the sender (where the replay has them
// arrive). A receiver is a sender further on, so it goes over the links in the direction the
// messages flow, again while something moves (a bounded number of times: with three or more
// chunks per stage two links can feed each other). The result still has to verify (it can
// deadlock or exceed the cap); the caller replays it. Returns whether anything moved.
inline bool align_links(const problem& p, schedule& s) {
  if (p.virtual_stages == 1 || p.stages == 1 || s.order.size() != static_cast<std::size_t>(p.stages)) return false;
  bool any = false;
  for (int round = 0; round < 2 * p.chunk_count(); ++round) {
    bool moved = false;
    auto links = link_messages(p, s);
    for (const auto kind : {pass::forward, pass::input_grad})
      for (int i = 0; i < p.stages; ++i) {
        const int from = kind == pass::forward ? i : p.stages - 1 - i;
        for (int to = 0; to < p.stages; ++to) {
          if (to == from) continue;
          const auto& sent = links.sent[link_index(p, from, to, kind)];
          const auto& received = links.received[link_index(p, from, to, kind)];
          if (sent == received || sent.size() != received.size()) continue; // the latter: not a whole schedule
          std::size_t k = 0;
          for (auto& b : s.order[static_cast<std::size_t>(to)]) {
            const int c = kind == pass::forward ? b.chunk - 1 : b.chunk + 1;
            if (b.kind != kind || c < 0 || c >= p.chunk_count() || p.stage_of(c) != from) continue;
            const auto& m = sent[k++];
            b = {kind == pass::forward ? m.chunk + 1 : m.chunk - 1, m.microbatch, kind};
          }
          moved = true;
          links = link_messages(p, s); // what `to` sends on follows what it now receives first
        }
      }
    if (!moved) break;
    any = true;
  }
  return any;
}

} // namespace detail

/// @brief The schedule whose activation memory `concerto` matches by default (the cap: the
/// largest stage's peak), the one that plays 1F1B's role for the layout: 1F1B with one chunk per
/// stage; with several, Megatron-LM's interleaved 1F1B (for micro-batches that are not a
/// multiple of the stages, its order for the next multiple without the micro-batches beyond).
[[nodiscard]] inline schedule memory_reference(const problem& p) {
  if (p.virtual_stages == 1) return one_f_one_b(p);
  p.check();
  return detail::interleaved_any_microbatches(p);
}

namespace detail {

// Local search over the exact replay: swap two neighbouring blocks of a stage (not of one
// chunk's pass chain, not a block and its own predecessor) when the schedule stays valid and
// gets shorter, or as short with blocks ending earlier in sum (which moves work off the
// critical path and lets the next swap shorten it). It catches what the windows' relaxed
// memory cannot: a window proposal over the exact cap is dropped whole, a swap is judged alone.
template <class Stop>
schedule exchange_neighbours(const problem& p, schedule s, int passes, const Stop& stop, int& exchanges) {
  const auto score = [&](const schedule& x) -> std::optional<std::pair<double, double>> {
    try {
      const auto t = verify(p, x);
      return std::pair{t.step_us, std::accumulate(t.end_us.begin(), t.end_us.end(), 0.0)};
    } catch (const concerto::error&) {
      return std::nullopt;
    }
  };
  auto current = *score(s);
  const auto better = [](const std::pair<double, double>& a, const std::pair<double, double>& b) {
    return a.first < b.first * (1 - 1e-9) || (a.first <= b.first * (1 + 1e-12) && a.second < b.second * (1 - 1e-9));
  };
  for (int pass_no = 0; pass_no < passes && !stop(); ++pass_no) {
    bool moved = false;
    for (auto& o : s.order)
      for (std::size_t i = 0; i + 1 < o.size() && !stop(); ++i) {
        const auto a = o[i], b = o[i + 1];
        if (a.chunk == b.chunk && (a.kind == b.kind || a.microbatch == b.microbatch)) continue;
        std::swap(o[i], o[i + 1]);
        auto sc = score(s);
        if (!sc && p.virtual_stages > 1) {
          // The swap may only have put a link's messages out of order at one end: the swap
          // with the receivers following the senders is judged instead.
          auto aligned = s;
          if (align_links(p, aligned) && (sc = score(aligned)) && better(*sc, current))
            for (std::size_t st = 0; st < s.order.size(); ++st) s.order[st] = aligned.order[st]; // `o` stays valid
        }
        if (sc && better(*sc, current)) {
          current = *sc;
          ++exchanges;
          moved = true;
        } else {
          std::swap(o[i], o[i + 1]);
        }
      }
    if (!moved) break;
  }
  return s;
}

} // namespace detail

/// @brief What improve found besides the schedule.
struct improve_stats {
  int windows_solved = 0, windows_improved = 0;
  int exchanges = 0; ///< neighbouring blocks swapped by the local search
  /// The whole problem was one window and Z3 proved that no schedule keeping each chunk's
  /// passes in micro-batch order is shorter (up to 0.05%), under the window's form of the cap.
  bool proven_optimal = false;
};

/// @brief Improves a schedule of `p` window by window (see the file comment); never returns a
/// slower one, nor one over `p.memory_cap_bytes`, nor one that `verify` refuses (`s` must pass
/// it). A problem of at most `whole_problem` blocks and messages is first solved as one window.
inline schedule improve(const problem& p, schedule s, const search_options& o, improve_stats* stats = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto left_s = [&] {
    return o.time_budget_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const auto out_of_time = [&] { return o.window_work_limit == 0 && left_s() <= 0; };
  improve_stats local;
  auto& st = stats ? *stats : local;
  double step = verify(p, s).step_us;
  // One window, solved and kept when the replay is shorter; whether Z3 proved it optimal.
  const auto attempt = [&](std::size_t from, std::size_t size, double limit_s) {
    const auto g = detail::build_replay(p, s);
    const auto start = detail::node_starts(g).start; // acyclic: s verified
    std::vector<int> sorted(g.size());
    std::iota(sorted.begin(), sorted.end(), 0);
    std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) {
      return start[static_cast<std::size_t>(a)] < start[static_cast<std::size_t>(b)];
    });
    if (from >= sorted.size()) return std::pair{false, false};
    const auto to = std::min(sorted.size(), from + size);
    bool optimal = false;
    double model_makespan = 0;
    auto next = detail::solve_one_window(p, s, g, start, sorted, from, to, step, limit_s, o.window_work_limit, optimal,
                                         model_makespan);
    ++st.windows_solved;
    // Z3's model has each link's messages in any order at the receiver (see align_links).
    detail::align_links(p, next);
    try {
      const auto t = verify(p, next);
      if (t.step_us < step * (1 - 1e-9)) {
        s = std::move(next);
        step = t.step_us;
        ++st.windows_improved;
      }
    } catch (const concerto::error&) {
      // The window's model is a relaxation of the whole (its boundary is frozen, its memory
      // precedences only necessary): a proposal that deadlocks or overflows is dropped.
      optimal = false;
    }
    // The whole problem's window is a relaxation of it (no gradient reductions, messages in any
    // order, memory in its necessary form): its proven optimum bounds every schedule that keeps
    // the passes in micro-batch order, so meeting it proves the kept schedule optimal.
    return std::pair{true, optimal && from == 0 && to == sorted.size() && step <= model_makespan * (1 + 5e-4)};
  };
  const auto nodes = detail::build_replay(p, s).size();
  // Solved again after an improvement: from the kept schedule the proof is usually immediate.
  for (int again = 0; again < 3 && nodes <= static_cast<std::size_t>(o.whole_problem) && !out_of_time(); ++again) {
    const int before = st.windows_improved;
    const auto [ran, proven] = attempt(0, nodes, std::max(o.window_time_limit_s, std::min(o.whole_time_limit_s, left_s())));
    if (ran && proven) {
      st.proven_optimal = true;
      return s;
    }
    if (st.windows_improved == before) break;
  }
  // Windows, then exchanges of neighbouring blocks, in turn while either finds something.
  for (int cycle = 0; cycle < o.cycles && !out_of_time(); ++cycle) {
    const int before = st.windows_improved + st.exchanges;
    for (int round = 0; round < o.rounds && !out_of_time(); ++round) {
      const auto size = static_cast<std::size_t>(std::max(2, round < 2 ? o.window / 2 : o.window));
      for (std::size_t from = round % 2 ? size / 2 : 0; !out_of_time(); from += size)
        if (!attempt(from, size, o.window_time_limit_s).first) break;
    }
    s = detail::exchange_neighbours(p, std::move(s), o.exchange_passes, out_of_time, st.exchanges);
    step = verify(p, s).step_us;
    if (st.windows_improved + st.exchanges == before) break;
  }
  return s;
}

/// @brief The `concerto` pipeline policy over one or more layouts of the same step (say one
/// chunk per stage, and two interleaved): every baseline that applies and concerto's own seeds,
/// the fastest under the cap as the warm start, then the window search on its layout.
inline search_result plan_concerto(std::span<const problem> layouts, const search_options& o = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  if (layouts.empty()) fail("pipeline::plan_concerto: no layout to plan");
  search_result res;
  double cap = o.memory_cap_bytes;
  if (cap <= 0) cap = peak_memory(simulate(layouts[0], memory_reference(layouts[0])));
  res.warm_start_us = std::numeric_limits<double>::infinity();
  schedule start;
  for (std::size_t l = 0; l < layouts.size(); ++l) {
    auto p = layouts[l];
    p.memory_cap_bytes = cap;
    for (const auto& name : baseline_names()) {
      candidate c{name, p.virtual_stages, 0, 0, false, ""};
      try {
        const auto s = baseline(name, p);
        // Verified (the cap is judged below): the start must run as it is.
        auto uncapped = p;
        uncapped.memory_cap_bytes = 0;
        const auto t = verify(uncapped, s);
        c.step_us = t.step_us;
        c.peak_memory_bytes = peak_memory(t);
        c.fits = c.peak_memory_bytes <= cap * (1 + 1e-9);
        if (!c.fits) c.note = "over the memory cap";
        if (c.fits && c.step_us < res.warm_start_us) {
          res.warm_start = name;
          res.warm_start_us = c.step_us;
          start = split_backward(s);
          res.layout = p;
        }
      } catch (const concerto::error& e) {
        c.note = e.what();
      }
      res.candidates.push_back(std::move(c));
    }
  }
  // The seeds compete with the best baseline for the start (they are not baselines: concerto's
  // own constructions, reported as where the search started): the greedy list schedules, ZB-H1's
  // shape within the cap, and for interleaved chunks with micro-batches that are not a multiple
  // of the stages the reference order, which interleaved_1f1b itself does not take.
  for (const auto& layout : layouts)
    for (int variant = 0; variant < 6; ++variant) {
      auto p = layout;
      p.memory_cap_bytes = cap;
      std::optional<schedule> seed;
      if (variant < 4) seed = detail::greedy(p, variant & 1, variant & 2);
      else if (variant == 4) seed = detail::deferred_within_cap(p);
      else if (p.virtual_stages > 1 && p.microbatches % p.stages != 0) seed = split_backward(memory_reference(p));
      if (!seed) continue;
      detail::align_links(p, *seed); // the greedy seeds need not (they keep link order), but a start must verify
      try {
        const auto t = verify(p, *seed);
        if (t.step_us < res.warm_start_us) {
          res.warm_start = seed->policy;
          res.warm_start_us = t.step_us;
          res.layout = p;
          start = *seed;
        }
      } catch (const concerto::error&) {
      }
    }
  if (start.order.empty())
    fail("pipeline::plan_concerto: no baseline or seed fits the memory cap of " + std::to_string(cap) + " bytes");
  start.policy = "concerto";
  search_options left = o;
  left.time_budget_s = std::max(0.0, o.time_budget_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  improve_stats stats;
  res.best = improve(res.layout, std::move(start), left, &stats);
  res.windows_solved = stats.windows_solved;
  res.windows_improved = stats.windows_improved;
  res.proven_optimal = stats.proven_optimal;
  res.time = verify(res.layout, res.best);
  res.lower_bound_us = lower_bound(res.layout);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

} // namespace concerto::pipeline
