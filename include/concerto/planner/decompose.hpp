#pragma once
/// @file
/// @brief Auto-decomposition: a synchronous collective exposed on the critical path is split,
/// with its neighbouring matmul, into k chunks, so that chunk i's communication overlaps chunk
/// i±1's compute. The rewrite is a new ir::graph that stays executable: chunks are views of
/// the original buffers where their bytes are contiguous, and real `slice` / `concat` tasks
/// where they are not; the numerics are those of the unsplit graph (docs/decomposition.md).
///
/// Three shapes are recognised (m is the matmul's row count, p the collective's group size):
/// - all_gather → matmul (A operand): chunk j gathers rows [j·c, (j+1)·c) of every rank's shard
///   (c = m / (p·k)) and multiplies them; with p > 1 the chunk results are rows {r·m/p + j·c + i}
///   of the output, so one `concat` task interleaves them back;
/// - matmul → reduce_scatter: chunk j computes the same interleaved rows (a `slice` of A feeds
///   it) and reduce-scatters them into rows [j·c, (j+1)·c) of the output, a view;
/// - matmul → all_reduce: chunk j computes output rows [j·m/k, (j+1)·m/k) (a view) and
///   all-reduces them in place; A is sliced only when it is stored transposed.
///
/// Which candidates to apply, and with how many chunks, is chosen greedily by simulated step
/// time on the cost model (smaller chunks run at lower efficiency: the model charges it).
///
/// @code
/// auto model = cost::model::preset("h100x64");
/// auto result = planner::decompose(graph, model);          // list schedule + simulator as the judge
/// std::printf("%.1f -> %.1f us with %zu splits\n", result.step_us_before, result.step_us_after,
///             result.chosen.size());
/// @endcode

#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/planner/detail/evaluate.hpp>
#include <concerto/planner/detail/parallel.hpp>
#include <concerto/planner/detail/progress.hpp>
#include <concerto/planner/detail/rewrite.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief How a decomposition rewrites its collective.
enum class split_kind : std::uint8_t {
  chunks,                   ///< the collective and its matmul, split into `chunks` chunks
  reduce_scatter_all_gather, ///< an in-place all_reduce, split into a reduce_scatter where it was and
                             ///< an all_gather just before the next task that touches the buffer
  expert_exchanges           ///< an MoE layer's four all_to_alls (dispatch, combine and their gradients),
                             ///< each in `chunks` chunks over contiguous views, the slots laid out
                             ///< chunk-major (`compute`: the layer's moe_dispatch task)
};

/// @brief One split: a collective, its neighbouring matmul, and the number of chunks; or, with
/// kind reduce_scatter_all_gather, an all_reduce alone (compute = -1, chunks unused); or, with
/// kind expert_exchanges, an MoE layer's dispatch all_to_all and its moe_dispatch task.
struct decomposition {
  ir::task_id collective = -1;
  ir::task_id compute = -1;
  int chunks = 2;
  split_kind kind = split_kind::chunks;
  friend bool operator==(const decomposition&, const decomposition&) = default;
};

/// @brief Whether a collective gathers, scatters or exchanges along the outermost dimension of
/// its buffers that is not 1. Only then is a chunk of rows a contiguous range of every rank's
/// block, which the rewrite assumes; a collective along an inner dimension (the sequence
/// dimension of [batch, seq, hidden] under sequence parallelism) is left whole.
[[nodiscard]] inline bool splits_outer_dimension(const ir::graph& g, const ir::task& c) {
  for (const auto key : ir::layout_dim_attrs) {
    const auto dim = ir::layout_dim(c, key);
    for (const auto* list : {&c.reads, &c.writes})
      for (auto b : *list) {
        const auto& shape = g.buffers.at(static_cast<std::size_t>(b)).shape;
        for (std::int64_t d = 0; d < dim && d < static_cast<std::int64_t>(shape.size()); ++d)
          if (shape[static_cast<std::size_t>(d)] != 1) return false;
      }
  }
  return true;
}

/// @brief Tuning of find_candidates and decompose.
struct decompose_options {
  std::vector<int> chunk_choices{2, 4, 8}; ///< k values tried for each candidate
  double min_exposed_fraction = 0.05;      ///< a collective is a candidate when at least this fraction of it
                                           ///< runs while the compute stream is idle
  int max_candidates = 64;                 ///< collectives evaluated, most exposed first
  bool split_all_reduce = true;            ///< also try all_reduce -> reduce_scatter + delayed all_gather
  planner::deadline deadline;              ///< stop trying candidates then, keeping the splits chosen (none: try all)
  bool progress = true;                    ///< progress on stderr once choosing takes longer than ...
  double progress_after_s = 1.0;           ///< ... this many seconds
};

/// @brief What decompose chose and what it gained.
struct decompose_result {
  ir::graph graph;                      ///< the rewritten graph (the input when nothing helped)
  std::vector<decomposition> chosen;    ///< task ids of the input graph
  double step_us_before = 0;            ///< judged step time of the input
  double step_us_after = 0;             ///< judged step time of `graph`
};

namespace detail::decompose {

enum class pattern : std::uint8_t { gather_matmul, matmul_scatter, matmul_reduce, exchange_matmul, matmul_exchange };

struct match_info {
  pattern shape;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t blocks = 1; ///< row blocks of the collective's layout: p for all_gather / reduce_scatter, else 1
  bool trans_a = false;
  bool restore_a = false; ///< exchange_matmul: A has users after the matmul, so the chunks are joined back into it
};

inline std::string describe(const ir::graph& g, ir::task_id coll, ir::task_id comp) {
  const auto name = [&](ir::task_id id) {
    return id >= 0 && static_cast<std::size_t>(id) < g.tasks.size() ? "'" + g.tasks[static_cast<std::size_t>(id)].name + "'"
                                                                      : "#" + std::to_string(id);
  };
  return "decomposition of collective " + name(coll) + " with matmul " + name(comp) + " in graph '" + g.name + "'";
}

/// Whether (coll, comp, chunks) is a split this file knows how to rewrite; `why` says why not.
inline std::optional<match_info> match(const ir::graph& g, const rewrite::program& prog, ir::task_id coll,
                                       ir::task_id comp, int chunks, std::string& why) {
  const auto& pos = prog.pos;
  const auto n_tasks = static_cast<ir::task_id>(g.tasks.size());
  if (coll < 0 || coll >= n_tasks || comp < 0 || comp >= n_tasks) {
    why = "a task id does not exist";
    return std::nullopt;
  }
  const auto& c = g[coll];
  const auto& t = g[comp];
  const auto bytes_of = [&](ir::buffer_id b) { return g.buffers[static_cast<std::size_t>(b)].bytes; };
  if (chunks < 2) return why = "chunks = " + std::to_string(chunks) + " must be at least 2", std::nullopt;
  if (t.kind != ir::op_kind::matmul) return why = "the compute task is not a matmul", std::nullopt;
  const auto mm = ir::matmul_attrs::of(t);
  if (mm.batch != 1) return why = "batched matmuls are not split", std::nullopt;
  if (mm.accumulate) return why = "an accumulating matmul is not split", std::nullopt;
  if (t.reads.size() != 2 || t.writes.size() != 1) return why = "the matmul must read A, B and write C", std::nullopt;
  if (c.reads.size() != 1 || c.writes.size() != 1) return why = "the collective must read and write one buffer", std::nullopt;
  match_info info{};
  info.m = mm.m;
  info.n = mm.n;
  info.k = mm.k;
  info.trans_a = mm.trans_a;
  if (info.m <= 0 || info.n <= 0 || info.k <= 0) return why = "the matmul lacks m, n, k attributes", std::nullopt;
  const auto a = t.reads[0], y = t.writes[0];
  const auto es_a = static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(a)].type));
  const auto es_y = static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(y)].type));
  if (bytes_of(a) != info.m * info.k * es_a || bytes_of(y) != info.m * info.n * es_y)
    return why = "the sizes of A or C do not match the matmul's m, n, k", std::nullopt;
  const std::int64_t p = g.group_size(c);
  const auto only = [&](ir::buffer_id b, std::vector<ir::task_id> allowed) {
    auto who = rewrite::touchers(g, prog, b);
    std::sort(who.begin(), who.end());
    std::sort(allowed.begin(), allowed.end());
    return who == allowed;
  };
  switch (c.kind) {
  case ir::op_kind::all_gather:
    info.shape = pattern::gather_matmul;
    info.blocks = p;
    if (c.writes[0] != a) return why = "the all_gather does not produce the matmul's A operand", std::nullopt;
    if (info.trans_a) return why = "A is stored transposed, so its gathered rows are not the matmul's rows", std::nullopt;
    if (pos[static_cast<std::size_t>(coll)] > pos[static_cast<std::size_t>(comp)])
      return why = "the all_gather comes after the matmul", std::nullopt;
    if (bytes_of(c.reads[0]) * p != bytes_of(a)) return why = "the all_gather's input is not 1/p of its output", std::nullopt;
    if (!only(a, {coll, comp})) return why = "the gathered buffer has other users", std::nullopt;
    break;
  case ir::op_kind::reduce_scatter:
    info.shape = pattern::matmul_scatter;
    info.blocks = p;
    if (c.reads[0] != y) return why = "the reduce_scatter does not read the matmul's output", std::nullopt;
    if (pos[static_cast<std::size_t>(coll)] < pos[static_cast<std::size_t>(comp)])
      return why = "the reduce_scatter comes before the matmul", std::nullopt;
    if (bytes_of(c.writes[0]) * p != bytes_of(y)) return why = "the reduce_scatter's output is not 1/p of its input", std::nullopt;
    if (!only(y, {coll, comp})) return why = "the matmul's output has other users", std::nullopt;
    break;
  case ir::op_kind::all_reduce: {
    info.shape = pattern::matmul_reduce;
    info.blocks = 1;
    if (c.reads[0] != y) return why = "the all_reduce does not read the matmul's output", std::nullopt;
    const auto out = c.writes[0];
    if (bytes_of(out) != bytes_of(y) || (out != y && g.overlap(out, y)))
      return why = "the all_reduce's output is not a buffer of the matmul output's size", std::nullopt;
    const auto from = pos[static_cast<std::size_t>(comp)], to = pos[static_cast<std::size_t>(coll)];
    if (to < from) return why = "the all_reduce comes before the matmul", std::nullopt;
    for (auto b : {y, out})
      for (auto other : rewrite::touchers(g, prog, b)) {
        const auto at = pos[static_cast<std::size_t>(other)];
        if (at > from && at < to) return why = "a task between the matmul and the all_reduce uses their buffer", std::nullopt;
      }
    break;
  }
  case ir::op_kind::all_to_all: {
    info.blocks = p;
    const auto from = pos[static_cast<std::size_t>(coll)], at = pos[static_cast<std::size_t>(comp)];
    if (bytes_of(c.reads[0]) != bytes_of(c.writes[0]) || g.overlap(c.reads[0], c.writes[0]))
      return why = "the all_to_all does not exchange between two distinct buffers of one size", std::nullopt;
    if (c.writes[0] == a) {
      // Tokens in, expert matmul after: chunk j exchanges rows [j·c, (j+1)·c) of every rank's block.
      info.shape = pattern::exchange_matmul;
      if (info.trans_a) return why = "A is stored transposed, so the exchanged rows are not the matmul's rows", std::nullopt;
      if (from > at) return why = "the all_to_all comes after the matmul", std::nullopt;
      for (auto other : rewrite::touchers(g, prog, a)) {
        if (other == coll || other == comp) continue;
        if (pos[static_cast<std::size_t>(other)] < at)
          return why = "a task between the all_to_all and the matmul uses the exchanged buffer", std::nullopt;
        info.restore_a = true; // later users (the weight gradient) read it whole again
      }
    } else if (c.reads[0] == y) {
      info.shape = pattern::matmul_exchange;
      if (from < at) return why = "the all_to_all comes before the matmul", std::nullopt;
      if (!only(y, {coll, comp})) return why = "the matmul's output has other users", std::nullopt;
    } else {
      return why = "the all_to_all neither produces the matmul's A operand nor reads its output", std::nullopt;
    }
    break;
  }
  default:
    return why = "the collective is a " + std::string(ir::to_string(c.kind)) +
                 " (all_gather, reduce_scatter, all_reduce and all_to_all are split)",
           std::nullopt;
  }
  if (info.m % info.blocks != 0 || (info.m / info.blocks) % chunks != 0)
    return why = "the rows per rank block (" + std::to_string(info.m / std::max<std::int64_t>(1, info.blocks)) +
                 ") do not divide into " + std::to_string(chunks) + " chunks",
           std::nullopt;
  return info;
}

/// Whether an all_reduce can become reduce_scatter + all_gather: in place on one buffer whose
/// elements divide evenly over the group. Returns the task that the all_gather must precede
/// (the next task touching the buffer), or -1 for the end of the step.
inline std::optional<ir::task_id> match_split(const ir::graph& g, const rewrite::program& prog, ir::task_id coll,
                                              std::string& why) {
  const auto& pos = prog.pos;
  if (coll < 0 || static_cast<std::size_t>(coll) >= g.tasks.size()) return why = "a task id does not exist", std::nullopt;
  const auto& c = g[coll];
  if (c.kind != ir::op_kind::all_reduce) return why = "the collective is not an all_reduce", std::nullopt;
  if (c.reads.size() != 1 || c.writes.size() != 1 || c.reads[0] != c.writes[0])
    return why = "the all_reduce is not in place on one buffer", std::nullopt;
  const auto p = static_cast<std::int64_t>(g.group_size(c));
  if (p < 2) return why = "the group has one rank", std::nullopt;
  const auto& b = g.buffers[static_cast<std::size_t>(c.reads[0])];
  const auto es = static_cast<std::int64_t>(ir::size_of(b.type));
  if (b.bytes % (es * p) != 0)
    return why = "the buffer's " + std::to_string(b.bytes / es) + " elements do not split over " + std::to_string(p) +
                 " ranks",
           std::nullopt;
  ir::task_id next = -1;
  for (auto u : rewrite::touchers(g, prog, b.id))
    if (pos[static_cast<std::size_t>(u)] > pos[static_cast<std::size_t>(coll)]) {
      next = u;
      break;
    }
  return next;
}

/// An MoE layer's expert region: moe_dispatch → all_to_all → experts → all_to_all → moe_combine,
/// and backward moe_combine_grad → all_to_all → experts → all_to_all → moe_dispatch_grad. Every
/// task between the exchanges treats the slot rows alike (matmuls over rows, elementwise
/// functions, weight gradients summing over rows), so the rows may be in any order as long as
/// all four exchanges and the four MoE kernels agree on it: chunk-major, where chunk j of every
/// expert's slots is one contiguous block, makes each exchange's chunk a view on both sides.
struct expert_region {
  ir::task_id dispatch = -1, combine = -1, combine_grad = -1, dispatch_grad = -1;
  /// The exchanges: dispatch, combine, the combine gradient's, the dispatch gradient's; each with
  /// its token side (the MoE kernel's buffer) and expert side (the experts' rows).
  std::array<ir::task_id, 4> exchange{-1, -1, -1, -1};
  std::array<bool, 4> expert_side_is_output{true, false, true, false};
  /// Matmuls next to an exchange on the expert side, split with it: the ones reading the
  /// received rows as A (after dispatch and the combine gradient), the one writing the rows sent
  /// (before combine and the dispatch gradient); none where those tasks are not plain matmuls.
  std::array<std::vector<ir::task_id>, 4> matmuls;
  std::int64_t slots = 0; ///< rows per expert and rank (groups·capacity)
};

inline std::optional<expert_region> match_region(const ir::graph& g, const rewrite::program& prog, ir::task_id dispatch,
                                                 int chunks, std::string& why) {
  const auto& pos = prog.pos;
  if (dispatch < 0 || static_cast<std::size_t>(dispatch) >= g.tasks.size()) return why = "a task id does not exist", std::nullopt;
  const auto& d = g[dispatch];
  if (d.fn != ir::op::moe_dispatch || d.reads.size() != 2 || d.writes.size() != 1)
    return why = "the task is not a moe_dispatch", std::nullopt;
  if (ir::moe_attrs::of(d).slot_chunks != 1) return why = "the slots are already chunk-major", std::nullopt;
  expert_region r;
  r.dispatch = dispatch;
  const auto gates = d.reads[1];
  for (const auto& t : g.tasks) {
    if (t.reads.size() < 2 || t.reads[1] != gates) continue;
    if (t.fn == ir::op::moe_combine) r.combine = t.id;
    if (t.fn == ir::op::moe_combine_grad) r.combine_grad = t.id;
    if (t.fn == ir::op::moe_dispatch_grad) r.dispatch_grad = t.id;
  }
  if (r.combine < 0 || r.combine_grad < 0 || r.dispatch_grad < 0)
    return why = "the layer's combine, combine gradient or dispatch gradient is missing (a forward-only graph)", std::nullopt;
  const auto experts = ir::moe_attrs::of(d).experts;
  const auto token_bytes = g.buffers[static_cast<std::size_t>(d.writes[0])].bytes;
  // The exchange that reads (side = input) or writes a buffer: its only such all_to_all.
  const auto exchange_of = [&](ir::buffer_id b, bool reads) -> ir::task_id {
    ir::task_id found = -1;
    for (auto u : rewrite::touchers(g, prog, b)) {
      const auto& t = g[u];
      if (t.kind != ir::op_kind::all_to_all) continue;
      if ((reads ? t.reads[0] : t.writes[0]) != b) continue;
      if (found >= 0) return -2;
      found = u;
    }
    return found;
  };
  // The combine gradient's dy is the first part of its packed output, or its first output.
  const auto& cg = g[r.combine_grad];
  ir::buffer_id dy = cg.writes[0];
  if (cg.writes.size() == 1)
    for (const auto& b : g.buffers)
      if (b.view_of == cg.writes[0] && b.offset == 0 && b.bytes == token_bytes) dy = b.id;
  // An all_reduce between an exchange and the kernel reading its result (the tensor-parallel
  // sum of the experts' partial outputs) adds element by element: the layout passes through it.
  const auto through_sums = [&](ir::buffer_id b) {
    for (int hop = 0; hop < 4; ++hop) {
      ir::task_id writer = -1;
      for (auto u : rewrite::touchers(g, prog, b))
        if (std::find(g[u].writes.begin(), g[u].writes.end(), b) != g[u].writes.end()) writer = u;
      if (writer < 0 || g[writer].kind != ir::op_kind::all_reduce || g[writer].reads.size() != 1 ||
          g[writer].reads[0] == b)
        break;
      b = g[writer].reads[0];
    }
    return b;
  };
  const std::array<std::pair<ir::buffer_id, bool>, 4> token_sides{{{d.writes[0], true},
                                                                   {through_sums(g[r.combine].reads[0]), false},
                                                                   {dy, true},
                                                                   {through_sums(g[r.dispatch_grad].reads[0]), false}}};
  for (std::size_t i = 0; i < 4; ++i) {
    const auto [b, reads] = token_sides[i];
    if (g.buffers[static_cast<std::size_t>(b)].bytes != token_bytes)
      return why = "the exchanged buffers of the layer differ in size", std::nullopt;
    const auto x = exchange_of(b, reads);
    if (x < 0) return why = "a slot buffer is not exchanged by exactly one all_to_all", std::nullopt;
    const auto& t = g[x];
    if (t.reads.size() != 1 || t.writes.size() != 1 || g.overlap(t.reads[0], t.writes[0]) ||
        g.buffers[static_cast<std::size_t>(t.reads[0])].bytes != g.buffers[static_cast<std::size_t>(t.writes[0])].bytes)
      return why = "an all_to_all of the layer does not exchange between two distinct buffers of one size", std::nullopt;
    // One expert per rank: a destination's block is its expert's rows, whole.
    if (g.group_size(t) != experts)
      return why = "the experts (" + std::to_string(experts) + ") are not one per rank of the all_to_all's group (" +
                   std::to_string(g.group_size(t)) + ")",
             std::nullopt;
    r.exchange[i] = x;
  }
  const auto hidden_bytes = [&] {
    const auto& shape = g.buffers[static_cast<std::size_t>(d.writes[0])].shape;
    return shape.empty() ? std::int64_t{0} : shape.back() * static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(d.writes[0])].type));
  }();
  if (hidden_bytes <= 0 || token_bytes % (hidden_bytes * experts) != 0) return why = "the slot buffer has no row shape", std::nullopt;
  r.slots = token_bytes / (hidden_bytes * experts);
  if (r.slots % chunks != 0)
    return why = "the " + std::to_string(r.slots) + " slots per expert do not divide into " + std::to_string(chunks) + " chunks",
           std::nullopt;
  // The matmuls split with each exchange: plain (not batched, A not transposed) and over exactly
  // the exchanged rows.
  const auto plain_over = [&](ir::task_id u, ir::buffer_id rows_buffer, bool as_a) {
    const auto& t = g[u];
    const auto mm = ir::matmul_attrs::of(t);
    if (t.kind != ir::op_kind::matmul || !mm.plain() || mm.trans_a) return false;
    const auto rows = mm.m;
    if (rows <= 0 || rows % (experts * chunks) != 0) return false;
    return as_a ? t.reads[0] == rows_buffer : (t.writes.size() == 1 && t.writes[0] == rows_buffer);
  };
  for (std::size_t i = 0; i < 4; ++i) {
    const auto& x = g[r.exchange[i]];
    if (r.expert_side_is_output[i]) {
      // Readers of the received rows as A; none may write them.
      for (auto u : rewrite::touchers(g, prog, x.writes[0])) {
        if (u == x.id || pos[static_cast<std::size_t>(u)] < pos[static_cast<std::size_t>(x.id)]) continue;
        if (std::find(g[u].writes.begin(), g[u].writes.end(), x.writes[0]) != g[u].writes.end()) break;
        if (plain_over(u, x.writes[0], true)) r.matmuls[i].push_back(u);
      }
    } else {
      // The last task before the exchange touching the rows sent, when a matmul writing them whole.
      ir::task_id last = -1;
      for (auto u : rewrite::touchers(g, prog, x.reads[0])) {
        if (pos[static_cast<std::size_t>(u)] >= pos[static_cast<std::size_t>(x.id)]) break;
        last = u;
      }
      if (last >= 0 && plain_over(last, x.reads[0], false)) {
        // Its output must have no other reader than the exchange.
        bool alone = true;
        for (auto u : rewrite::touchers(g, prog, x.reads[0])) alone = alone && (u == last || u == x.id);
        if (alone) r.matmuls[i].push_back(last);
      }
    }
  }
  return r;
}

/// Compute-idle time while each task runs (meaningful for collectives), from a plan's times.
inline std::vector<double> exposed_us(const plan::plan& p) {
  const auto& g = p.graph;
  std::vector<std::pair<double, double>> busy;
  for (const auto& t : g.tasks)
    if (t.stream == ir::compute_stream)
      busy.emplace_back(p.start_us[static_cast<std::size_t>(t.id)],
                        p.start_us[static_cast<std::size_t>(t.id)] + p.duration_us[static_cast<std::size_t>(t.id)]);
  std::sort(busy.begin(), busy.end());
  std::vector<double> out(g.tasks.size(), 0);
  for (const auto& t : g.tasks) {
    if (!ir::is_collective(t.kind)) continue;
    const double s = p.start_us[static_cast<std::size_t>(t.id)], e = s + p.duration_us[static_cast<std::size_t>(t.id)];
    double covered = 0;
    for (const auto& [b0, b1] : busy) {
      if (b0 >= e) break;
      covered += std::max(0.0, std::min(e, b1) - std::max(s, b0));
    }
    out[static_cast<std::size_t>(t.id)] = std::max(0.0, (e - s) - covered);
  }
  return out;
}

} // namespace detail::decompose

namespace detail::decompose {

// What every rewrite of one graph reads: its program order and the dependencies its accesses
// imply. decompose tries hundreds of rewrites of one graph; they share one.
struct base {
  const ir::graph& g;
  rewrite::program prog;
  std::vector<std::vector<ir::task_id>> derived;
  explicit base(const ir::graph& graph) : g(graph), prog(graph), derived(ir::derived_deps(graph, prog.order)) {}
};

// The rewrite of one graph: what replaces each old task (emitted at its program position), what
// goes right before one, and at the end; one method per decomposition pattern.
class splitter {
public:
  explicit splitter(const base& b) : g_(b.g), prog_(b.prog), derived_(b.derived) {
    d_.graph = g_.empty_like();
    d_.graph.buffers = g_.buffers;
  }

  void add(const decomposition& dec) {
    if (dec.kind == split_kind::reduce_scatter_all_gather) return split_all_reduce(dec);
    if (dec.kind == split_kind::expert_exchanges) return split_region(dec);
    std::string why;
    const auto info = match(g_, prog_, dec.collective, dec.compute, dec.chunks, why);
    if (!info) fail(describe(g_, dec.collective, dec.compute) + " into " + std::to_string(dec.chunks) + " chunks: " + why);
    for (auto id : {dec.collective, dec.compute}) claim(id, describe(g_, dec.collective, dec.compute));
    chunks split{g_[dec.collective], g_[dec.compute], *info, dec.chunks};
    switch (info->shape) {
    case pattern::gather_matmul: return gather_matmul(split);
    case pattern::matmul_scatter: return matmul_scatter(split);
    case pattern::exchange_matmul: return exchange_matmul(split);
    case pattern::matmul_exchange: return matmul_exchange(split);
    case pattern::matmul_reduce: return matmul_reduce(split);
    }
  }

  ir::graph finish() && {
    for (auto id : prog_.order) {
      if (const auto b = before_.find(id); b != before_.end())
        for (auto& [origin, t] : b->second) d_.add(std::move(t), {origin});
      const auto it = replacement_.find(id);
      if (it == replacement_.end()) {
        d_.add(g_[id], {id});
        continue;
      }
      for (auto& t : it->second) d_.add(std::move(t), {id});
    }
    for (auto& [origin, t] : at_end_) d_.add(std::move(t), {origin});
    return rewrite::finish(g_, derived_, std::move(d_));
  }

private:
  // One (collective, matmul) pair split into k chunks of c rows per row block (q blocks).
  struct chunks {
    const ir::task& coll;
    const ir::task& mm;
    match_info info;
    std::int64_t k, q, c, a_row, y_row;
    ir::buffer aa, ya; // copies: the buffer list grows
    chunks(const ir::task& coll, const ir::task& mm, const match_info& info, std::int64_t k)
        : coll(coll), mm(mm), info(info), k(k), q(info.blocks), c(info.m / (info.blocks * k)) {}
  };

  [[nodiscard]] std::vector<ir::buffer>& bufs() { return d_.graph.buffers; }
  [[nodiscard]] const ir::buffer& buffer(ir::buffer_id id) { return bufs()[static_cast<std::size_t>(id)]; }

  void claim(ir::task_id id, const std::string& what) {
    if (replacement_.count(id)) fail(what + ": task '" + g_[id].name + "' is already part of another decomposition");
    replacement_[id];
  }

  ir::buffer_id new_buffer(std::string name, std::vector<std::int64_t> shape, std::int64_t bytes, const ir::buffer& like,
                           ir::buffer_id view_of = -1, std::int64_t offset = 0) {
    ir::buffer b;
    b.id = static_cast<ir::buffer_id>(bufs().size());
    b.name = std::move(name);
    b.bytes = bytes;
    b.type = like.type;
    b.role = view_of >= 0 ? like.role : (like.role == ir::buffer_role::workspace ? like.role : ir::buffer_role::activation);
    b.shape = std::move(shape);
    b.view_of = view_of;
    b.offset = offset;
    bufs().push_back(std::move(b));
    return bufs().back().id;
  }

  // A slice or concat copy on the compute stream, stamped like the task it serves.
  static ir::task copy_task(std::string name, ir::op fn, std::vector<ir::buffer_id> reads, ir::buffer_id write,
                            double bytes, std::map<std::string, std::int64_t> attrs, const ir::task& like) {
    ir::task t;
    t.name = std::move(name);
    t.kind = ir::info(fn).kind;
    t.stream = ir::compute_stream;
    t.fn = fn;
    t.reads = std::move(reads);
    t.writes = {write};
    t.bytes = bytes;
    t.attrs = std::move(attrs);
    t.step_phase = like.step_phase;
    t.layer = like.layer;
    return t;
  }
  // The q·k parts of `parts` (row blocks of c rows) joined back into `to`.
  ir::task join(std::string name, std::vector<ir::buffer_id> parts, ir::buffer_id to, std::int64_t inner, const chunks& s,
                const ir::task& like) {
    return copy_task(std::move(name), ir::op::concat, std::move(parts), to, 2.0 * static_cast<double>(buffer(to).bytes),
                     {{"outer", s.q}, {"inner", inner}, {"length", s.c}, {"parts", s.k}}, like);
  }

  void chunk_collective(const chunks& s, std::int64_t j, ir::buffer_id in, ir::buffer_id out) {
    ir::task t = s.coll;
    t.name = rewrite::indexed(s.coll.name + ".chunk", j);
    t.reads = {in};
    t.writes = {out};
    t.bytes = s.coll.bytes / static_cast<double>(s.k);
    ir::mark_chunk(t, j, s.k);
    // The layout attrs index the shape of the collective's buffers. The chunk buffers are
    // [rows, columns] with the rank blocks along the rows (splits_outer_dimension admits only
    // collectives with nothing but 1s before their dim), so an inherited dim = 1 of a
    // [1, seq, hidden] original would make a backend interleave the chunk's columns.
    ir::reset_layout_dims(t);
    replacement_[s.coll.id].push_back(std::move(t));
  }
  void chunk_matmul(const chunks& s, std::int64_t j, ir::buffer_id in_a, ir::buffer_id out) {
    ir::task t = s.mm;
    t.name = rewrite::indexed(s.mm.name + ".chunk", j);
    t.reads = {in_a, s.mm.reads[1]};
    t.writes = {out};
    t.flops = s.mm.flops / static_cast<double>(s.k);
    t.bytes = s.mm.bytes / static_cast<double>(s.k);
    ir::set_matmul_rows(t, s.q * s.c);
    ir::mark_chunk(t, j, s.k);
    replacement_[s.mm.id].push_back(std::move(t));
  }
  // The interleaved rows {r·m/q + j·c + i} of the matmul's row-major [m, inner] A (or of the
  // columns of a transposed [kk, m] one) as a contiguous chunk: a view when q = 1 and rows are
  // rows, else a slice task.
  ir::buffer_id rows_of_a(const chunks& s, std::int64_t j) {
    const auto a = s.mm.reads[0];
    const auto kk = s.info.k, m = s.info.m;
    const auto name = rewrite::indexed(s.aa.name + ".c", j);
    if (s.q == 1 && !s.info.trans_a) return new_buffer(name, {s.c, kk}, s.c * s.a_row, s.aa, a, j * s.c * s.a_row);
    const auto out = new_buffer(name, s.info.trans_a ? std::vector<std::int64_t>{kk, s.q * s.c} : std::vector<std::int64_t>{s.q * s.c, kk},
                                s.q * s.c * s.a_row, s.aa);
    auto attrs = s.info.trans_a ? std::map<std::string, std::int64_t>{{"outer", kk * s.q}, {"extent", m / s.q}, {"inner", 1},
                                                                       {"offset", j * s.c}, {"length", s.c}}
                                : std::map<std::string, std::int64_t>{{"outer", s.q}, {"extent", m / s.q}, {"inner", kk},
                                                                       {"offset", j * s.c}, {"length", s.c}};
    replacement_[s.mm.id].push_back(copy_task(rewrite::indexed(s.mm.name + ".slice", j), ir::op::slice, {a}, out,
                                              2.0 * static_cast<double>(s.q * s.c * s.a_row), std::move(attrs), s.mm));
    return out;
  }
  ir::buffer_id rows_of_y(const chunks& s, std::int64_t j) {
    const auto name = rewrite::indexed(s.ya.name + ".c", j);
    if (s.q == 1) return new_buffer(name, {s.c, s.info.n}, s.c * s.y_row, s.ya, s.mm.writes[0], j * s.c * s.y_row);
    return new_buffer(name, {s.q * s.c, s.info.n}, s.q * s.c * s.y_row, s.ya);
  }
  // Chunk j of a buffer laid out in q row blocks (`whole`): a view when q = 1, else a new buffer.
  ir::buffer_id rows_of(const chunks& s, std::int64_t j, ir::buffer_id whole, std::int64_t cols, std::int64_t row_bytes) {
    const ir::buffer w = buffer(whole);
    const auto name = rewrite::indexed(w.name + ".c", j);
    if (s.q == 1) return new_buffer(name, {s.c, cols}, s.c * row_bytes, w, whole, j * s.c * row_bytes);
    return new_buffer(name, {s.q * s.c, cols}, s.q * s.c * row_bytes, w);
  }
  chunks& prepared(chunks& s) {
    s.aa = buffer(s.mm.reads[0]);
    s.ya = buffer(s.mm.writes[0]);
    s.a_row = s.aa.bytes / s.info.m;
    s.y_row = s.ya.bytes / s.info.m;
    return s;
  }

  // all_gather → matmul: chunk j gathers rows j·c.. of every rank's block and multiplies them.
  void gather_matmul(chunks& split) {
    auto& s = prepared(split);
    const auto x = s.coll.reads[0];
    const ir::buffer xa = buffer(x);
    std::vector<ir::buffer_id> parts;
    for (std::int64_t j = 0; j < s.k; ++j) {
      const auto xv = new_buffer(rewrite::indexed(xa.name + ".c", j), {s.c, s.info.k}, s.c * s.a_row, xa, x, j * s.c * s.a_row);
      const auto gathered = new_buffer(rewrite::indexed(s.aa.name + ".c", j), {s.q * s.c, s.info.k}, s.q * s.c * s.a_row, s.aa);
      chunk_collective(s, j, xv, gathered);
      const auto out = rows_of_y(s, j);
      chunk_matmul(s, j, gathered, out);
      parts.push_back(out);
    }
    if (s.q > 1) replacement_[s.mm.id].push_back(join(s.mm.name + ".concat", parts, s.mm.writes[0], s.info.n, s, s.mm));
  }
  // matmul → reduce_scatter: chunk j's rows are reduced into rows j·c.. of the output.
  void matmul_scatter(chunks& split) {
    auto& s = prepared(split);
    for (std::int64_t j = 0; j < s.k; ++j) {
      const auto out = rows_of_y(s, j);
      chunk_matmul(s, j, rows_of_a(s, j), out);
      const auto z = s.coll.writes[0];
      const ir::buffer za = buffer(z);
      chunk_collective(s, j, out, new_buffer(rewrite::indexed(za.name + ".c", j), {s.c, s.info.n}, s.c * s.y_row, za, z, j * s.c * s.y_row));
    }
  }
  // all_to_all → matmul: chunk j sends rows [j·c, (j+1)·c) of each destination block (a slice of
  // the input) and receives them from each source: rows {r·m/q + j·c + i} of the exchanged buffer.
  void exchange_matmul(chunks& split) {
    auto& s = prepared(split);
    const auto x = s.coll.reads[0], a = s.mm.reads[0];
    const ir::buffer xa = buffer(x);
    std::vector<ir::buffer_id> parts, received;
    for (std::int64_t j = 0; j < s.k; ++j) {
      ir::buffer_id send = -1;
      if (s.q == 1) {
        send = new_buffer(rewrite::indexed(xa.name + ".c", j), {s.c, s.info.k}, s.c * s.a_row, xa, x, j * s.c * s.a_row);
      } else {
        send = new_buffer(rewrite::indexed(xa.name + ".c", j), {s.q * s.c, s.info.k}, s.q * s.c * s.a_row, xa);
        replacement_[s.coll.id].push_back(copy_task(
            rewrite::indexed(s.coll.name + ".slice", j), ir::op::slice, {x}, send, 2.0 * static_cast<double>(s.q * s.c * s.a_row),
            {{"outer", s.q}, {"extent", s.info.m / s.q}, {"inner", s.info.k}, {"offset", j * s.c}, {"length", s.c}}, s.coll));
      }
      const auto got = rows_of(s, j, a, s.info.k, s.a_row);
      chunk_collective(s, j, send, got);
      const auto out = rows_of_y(s, j);
      chunk_matmul(s, j, got, out);
      parts.push_back(out);
      received.push_back(got);
    }
    if (s.q > 1) {
      replacement_[s.mm.id].push_back(join(s.mm.name + ".concat", parts, s.mm.writes[0], s.info.n, s, s.mm));
      if (s.info.restore_a) replacement_[s.mm.id].push_back(join(s.coll.name + ".concat", received, a, s.info.k, s, s.mm));
    }
  }
  // matmul → all_to_all: chunk j computes the rows it sends to each rank ({r·m/q + j·c + i}, a
  // slice of A) and receives rows j·c.. of each source's block; a concat puts them back in place.
  void matmul_exchange(chunks& split) {
    auto& s = prepared(split);
    const auto z = s.coll.writes[0];
    std::vector<ir::buffer_id> parts;
    for (std::int64_t j = 0; j < s.k; ++j) {
      const auto out = rows_of_y(s, j);
      chunk_matmul(s, j, rows_of_a(s, j), out);
      const auto got = rows_of(s, j, z, s.info.n, s.y_row);
      chunk_collective(s, j, out, got);
      parts.push_back(got);
    }
    if (s.q > 1) replacement_[s.coll.id].push_back(join(s.coll.name + ".concat", parts, z, s.info.n, s, s.coll));
  }
  // matmul → all_reduce: each chunk's rows reduced as soon as they are computed.
  void matmul_reduce(chunks& split) {
    auto& s = prepared(split);
    const auto out_all = s.coll.writes[0];
    for (std::int64_t j = 0; j < s.k; ++j) {
      const auto out = rows_of_y(s, j);
      chunk_matmul(s, j, rows_of_a(s, j), out);
      const ir::buffer oa = buffer(out_all);
      const auto reduced = out_all == s.mm.writes[0]
                               ? out
                               : new_buffer(rewrite::indexed(oa.name + ".c", j), {s.c, s.info.n}, s.c * s.y_row, oa, out_all,
                                            j * s.c * s.y_row);
      chunk_collective(s, j, out, reduced);
    }
  }
  // An MoE layer's exchanges in k chunks over contiguous views of chunk-major slot buffers: the
  // four MoE kernels read and write their slots chunk-major (attr slot_chunks), chunk j of every
  // exchange moves rows [j·R/k, (j+1)·R/k) of both its buffers, and the matmuls next to the
  // exchanges compute the same rows of theirs. No copies.
  void split_region(const decomposition& dec) {
    std::string why;
    const auto r = match_region(g_, prog_, dec.compute, dec.chunks, why);
    const auto what = "expert exchanges of '" + (dec.compute >= 0 && static_cast<std::size_t>(dec.compute) < g_.tasks.size()
                                                     ? g_[dec.compute].name
                                                     : std::to_string(dec.compute)) +
                      "' in graph '" + g_.name + "'";
    if (!r) fail(what + " into " + std::to_string(dec.chunks) + " chunks: " + why);
    const std::int64_t k = dec.chunks;
    for (auto id : {r->dispatch, r->combine, r->combine_grad, r->dispatch_grad}) {
      claim(id, what);
      ir::task t = g_[id];
      ir::set_slot_chunks(t, k);
      replacement_[id].push_back(std::move(t));
    }
    // Row chunk j of a buffer whose whole is `rows` rows: a 2-D view.
    const auto rows_view = [&](ir::buffer_id whole, std::int64_t rows, std::int64_t j) {
      const ir::buffer w = buffer(whole);
      const auto part = w.bytes / k;
      return new_buffer(rewrite::indexed(w.name + ".c", j), {rows / k, w.bytes / (rows * static_cast<std::int64_t>(ir::size_of(w.type)))},
                        part, w, whole, j * part);
    };
    const auto rows = r->slots * ir::moe_attrs::of(g_[r->dispatch]).experts; // of each exchanged buffer
    for (std::size_t i = 0; i < 4; ++i) {
      const auto& x = g_[r->exchange[i]];
      claim(x.id, what);
      for (auto m : r->matmuls[i]) claim(m, what);
      std::vector<ir::buffer_id> ins, outs;
      for (std::int64_t j = 0; j < k; ++j) {
        ins.push_back(rows_view(x.reads[0], rows, j));
        outs.push_back(rows_view(x.writes[0], rows, j));
        ir::task t = x;
        t.name = rewrite::indexed(x.name + ".chunk", j);
        t.reads = {ins.back()};
        t.writes = {outs.back()};
        t.bytes = x.bytes / static_cast<double>(k);
        ir::mark_chunk(t, j, k);
        // Every chunk is [experts·slots/k, hidden] rows: one expert (and one rank) per block.
        ir::reset_layout_dims(t);
        replacement_[x.id].push_back(std::move(t));
      }
      for (auto m : r->matmuls[i]) {
        const auto& mm = g_[m];
        const auto mrows = ir::matmul_attrs::of(mm).m;
        for (std::int64_t j = 0; j < k; ++j) {
          ir::task t = mm;
          t.name = rewrite::indexed(mm.name + ".chunk", j);
          t.reads[0] = r->expert_side_is_output[i] ? outs[static_cast<std::size_t>(j)] : rows_view(mm.reads[0], mrows, j);
          t.writes = {r->expert_side_is_output[i] ? rows_view(mm.writes[0], mrows, j) : ins[static_cast<std::size_t>(j)]};
          t.flops = mm.flops / static_cast<double>(k);
          t.bytes = mm.bytes / static_cast<double>(k);
          ir::set_matmul_rows(t, mrows / k);
          ir::mark_chunk(t, j, k);
          replacement_[m].push_back(std::move(t));
        }
      }
    }
  }
  // all_reduce → reduce_scatter now, all_gather right before the next reader of its result.
  void split_all_reduce(const decomposition& dec) {
    std::string why;
    const auto next = match_split(g_, prog_, dec.collective, why);
    if (!next) fail(describe(g_, dec.collective, -1) + " into reduce_scatter + all_gather: " + why);
    claim(dec.collective, describe(g_, dec.collective, -1));
    const auto& ar = g_[dec.collective];
    const ir::buffer whole = buffer(ar.reads[0]);
    const std::int64_t p = g_.group_size(ar);
    const auto shard = new_buffer(whole.name + ".shard", {whole.bytes / static_cast<std::int64_t>(ir::size_of(whole.type)) / p},
                                  whole.bytes / p, whole);
    ir::task rs = ar;
    rs.name = ar.name + ".rs";
    rs.kind = ir::op_kind::reduce_scatter;
    rs.writes = {shard};
    replacement_[dec.collective].push_back(std::move(rs));
    ir::task ag = ar;
    ag.name = ar.name + ".ag";
    ag.kind = ir::op_kind::all_gather;
    ag.fn = ir::op::none; // it moves the reduced shards, combines nothing
    ag.reads = {shard};
    if (*next >= 0) {
      // Stamped like the task it precedes: it runs with that phase (the optimizer's, typically).
      ag.step_phase = g_[*next].step_phase;
      ag.layer = g_[*next].layer;
      before_[*next].emplace_back(dec.collective, std::move(ag));
    } else {
      at_end_.emplace_back(dec.collective, std::move(ag));
    }
  }

  const ir::graph& g_;
  const rewrite::program& prog_;
  const std::vector<std::vector<ir::task_id>>& derived_;
  rewrite::draft d_;
  std::map<ir::task_id, std::vector<ir::task>> replacement_;
  std::map<ir::task_id, std::vector<std::pair<ir::task_id, ir::task>>> before_; // (origin, task)
  std::vector<std::pair<ir::task_id, ir::task>> at_end_;
};

inline ir::graph apply(const base& b, std::span<const decomposition> decompositions) {
  splitter s(b);
  for (const auto& dec : decompositions) s.add(dec);
  return std::move(s).finish();
}

} // namespace detail::decompose

/// @brief The rewrite: each decomposition's collective and matmul are replaced by `chunks`
/// chunk collectives and `chunks` chunk matmuls (plus slice / concat tasks where the chunks are
/// not contiguous); dependencies are recomputed from the buffer accesses in program order, and
/// ordering edges of `g` that its accesses do not imply are kept. Throws concerto::error naming
/// the tasks when a decomposition does not fit its tasks or two decompositions share a task.
/// @code
/// ir::graph split = planner::apply(g, std::vector{planner::decomposition{ag, mm, 4}});
/// @endcode
[[nodiscard]] inline ir::graph apply(const ir::graph& g, std::span<const decomposition> decompositions) {
  return detail::decompose::apply(detail::decompose::base(g), decompositions);
}

namespace detail::decompose {
// find_candidates on `prog`, g's program order (decompose's base holds it already).
[[nodiscard]] inline std::vector<decomposition> find_candidates(const ir::graph& g, const rewrite::program& prog,
                                                                const cost::model& model, const decompose_options& options) {
  namespace rw = detail::rewrite;
  const auto& pos = prog.pos;
  const auto p = list_plan(g, model);
  const auto exposed = exposed_us(p);
  std::vector<std::pair<double, decomposition>> found;
  // MoE layers whose exchanges can go chunk-major: one candidate per k, exposed as much as its
  // four exchanges together; their exchanges are not also offered one by one (with copies).
  std::vector<bool> in_region(g.tasks.size(), false);
  for (const auto& t : g.tasks) {
    if (t.fn != ir::op::moe_dispatch) continue;
    double idle = 0;
    bool matched = false;
    for (int k : options.chunk_choices) {
      std::string why;
      const auto r = match_region(g, prog, t.id, k, why);
      if (!r) continue;
      if (!matched) {
        for (auto x : r->exchange) {
          idle += exposed[static_cast<std::size_t>(x)];
          in_region[static_cast<std::size_t>(x)] = true;
        }
        matched = true;
      }
      if (idle > 0) found.push_back({idle, {r->exchange[0], t.id, k, split_kind::expert_exchanges}});
    }
  }
  for (const auto& c : g.tasks) {
    if (!ir::is_collective(c.kind) || c.reads.size() != 1 || c.writes.size() != 1) continue;
    if (in_region[static_cast<std::size_t>(c.id)]) continue;
    if (!splits_outer_dimension(g, c)) continue;
    const double duration = p.duration_us[static_cast<std::size_t>(c.id)];
    const double idle = exposed[static_cast<std::size_t>(c.id)];
    if (!(duration > 0) || idle < options.min_exposed_fraction * duration) continue;
    const auto at = pos[static_cast<std::size_t>(c.id)];
    // The matmul the collective feeds (the first one after it reading its output as A) ...
    const auto consumer = [&] {
      for (auto u : rw::touchers(g, prog, c.writes[0]))
        if (pos[static_cast<std::size_t>(u)] > at && g[u].kind == ir::op_kind::matmul && g[u].reads[0] == c.writes[0])
          return u;
      return ir::task_id{-1};
    };
    // ... or the one it drains (the last task before it touching its input, when a matmul).
    const auto producer = [&] {
      ir::task_id last = -1;
      for (auto u : rw::touchers(g, prog, c.reads[0])) {
        if (pos[static_cast<std::size_t>(u)] >= at) break;
        last = g[u].kind == ir::op_kind::matmul ? u : -1;
      }
      return last;
    };
    std::vector<ir::task_id> partners;
    if (c.kind == ir::op_kind::all_gather) {
      for (auto u : rw::touchers(g, prog, c.writes[0]))
        if (u != c.id && g[u].kind == ir::op_kind::matmul) partners = {u};
    } else if (c.kind == ir::op_kind::reduce_scatter || c.kind == ir::op_kind::all_reduce) {
      partners = {producer()};
    } else if (c.kind == ir::op_kind::all_to_all) {
      partners = {consumer(), producer()};
    }
    for (auto partner : partners) {
      if (partner < 0) continue;
      for (int k : options.chunk_choices) {
        std::string why;
        if (match(g, prog, c.id, partner, k, why)) found.push_back({idle, {c.id, partner, k}});
      }
    }
    if (options.split_all_reduce && c.kind == ir::op_kind::all_reduce) {
      std::string why;
      if (match_split(g, prog, c.id, why))
        found.push_back({idle, {c.id, -1, 1, split_kind::reduce_scatter_all_gather}});
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<decomposition> out;
  out.reserve(found.size());
  for (auto& f : found) out.push_back(f.second);
  return out;
}
} // namespace detail::decompose

/// @brief The splits worth trying: every (collective, matmul, k) the rewrite supports, and every
/// all_reduce that can become reduce_scatter + all_gather, whose collective is exposed (runs at
/// least `min_exposed_fraction` of its time while the compute stream idles) in the best list
/// schedule of `g` on `model`. Most exposed first; one collective's alternatives are adjacent.
/// @code
/// for (const auto& c : planner::find_candidates(g, model))
///   std::cout << g[c.collective].name << " x" << c.chunks << '\n';
/// @endcode
[[nodiscard]] inline std::vector<decomposition> find_candidates(const ir::graph& g, const cost::model& model,
                                                                const decompose_options& options = {}) {
  return detail::decompose::find_candidates(g, detail::rewrite::program(g), model, options);
}

/// @brief Chooses which candidates to split and how: in order of exposure, each collective's
/// alternatives (every k with each partner matmul, and the reduce_scatter + all_gather split)
/// are tried on top of the splits already kept, judged by `judge` (default: list schedule +
/// simulator on `model`), and the best is kept only if the step time improves. Never returns a
/// graph judged slower than `g`. Reports progress on stderr once it takes over a second, unless
/// `options.progress` is false.
/// @code
/// auto r = planner::decompose(g, model, planner::simulated_step(model, /*memory cap*/ 40LL << 30));
/// @endcode
[[nodiscard]] inline decompose_result decompose(const ir::graph& g, const cost::model& model, step_fn judge = {},
                                                const decompose_options& options = {}) {
  if (!judge) judge = simulated_step(model);
  detail::progress_meter meter("decomposing", g.name, options.progress, options.progress_after_s);
  decompose_result result{g, {}, 0, 0};
  result.step_us_before = result.step_us_after = judge(g);
  const detail::decompose::base original(g);
  const auto candidates = detail::decompose::find_candidates(g, original.prog, model, options);
  std::size_t collectives = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (i == 0 || candidates[i].collective != candidates[i - 1].collective) ++collectives;
  const auto to_try = std::min<std::size_t>(collectives, static_cast<std::size_t>(std::max(0, options.max_candidates)));
  std::size_t tried = 0;
  for (std::size_t i = 0; i < candidates.size() && tried < to_try && !expired(options.deadline);) {
    std::size_t end = i;
    while (end < candidates.size() && candidates[end].collective == candidates[i].collective) ++end;
    ++tried;
    // One collective's alternatives are independent of each other: judge them on every core,
    // then keep the best in candidate order, as a sequential search would.
    std::vector<std::size_t> open;
    for (; i < end; ++i) {
      // A matmul already split with another collective cannot be split again.
      const bool taken = std::any_of(result.chosen.begin(), result.chosen.end(), [&](const decomposition& d) {
        return candidates[i].compute >= 0 && (d.compute == candidates[i].compute || d.collective == candidates[i].compute);
      });
      if (!taken) open.push_back(i);
    }
    std::vector<ir::graph> graphs(open.size());
    std::vector<double> steps(open.size());
    detail::for_each_index(open.size(), [&](std::size_t j) {
      auto trial = result.chosen;
      trial.push_back(candidates[open[j]]);
      // Two splits may claim one task (an expert region and a matmul another split took): the
      // later one is not possible on top of the kept ones, and is skipped.
      try {
        graphs[j] = detail::decompose::apply(original, std::span<const decomposition>(trial));
      } catch (const error&) {
        steps[j] = std::numeric_limits<double>::infinity();
        return;
      }
      steps[j] = judge(graphs[j]);
    });
    std::optional<decomposition> best;
    ir::graph best_graph;
    double best_step = result.step_us_after;
    for (std::size_t j = 0; j < open.size(); ++j)
      if (steps[j] < best_step * (1 - 1e-9)) {
        best_step = steps[j];
        best = candidates[open[j]];
        best_graph = std::move(graphs[j]);
      }
    if (best) {
      result.chosen.push_back(*best);
      result.graph = std::move(best_graph);
      result.step_us_after = best_step;
    }
    meter.tick([&] {
      return std::to_string(tried) + "/" + std::to_string(to_try) + " collectives tried, " +
             std::to_string(result.chosen.size()) + " split, step " + detail::progress_meter::us(result.step_us_before) +
             " -> " + detail::progress_meter::us(result.step_us_after);
    });
  }
  meter.done([&] {
    return std::to_string(result.chosen.size()) + " of " + std::to_string(to_try) + " collectives split, step " +
           detail::progress_meter::us(result.step_us_before) + " -> " + detail::progress_meter::us(result.step_us_after);
  });
  return result;
}

} // namespace concerto::planner
