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
#include <concerto/planner/detail/evaluate.hpp>
#include <concerto/planner/detail/progress.hpp>
#include <concerto/planner/detail/rewrite.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief How a decomposition rewrites its collective.
enum class split_kind : std::uint8_t {
  chunks,                   ///< the collective and its matmul, split into `chunks` chunks
  reduce_scatter_all_gather ///< an in-place all_reduce, split into a reduce_scatter where it was and
                            ///< an all_gather just before the next task that touches the buffer
};

/// @brief One split: a collective, its neighbouring matmul, and the number of chunks; or, with
/// kind reduce_scatter_all_gather, an all_reduce alone (compute = -1, chunks unused).
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
  for (const char* key : {"dim", "from_dim", "to_dim"}) {
    const auto dim = c.attr(key, 0);
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
inline std::optional<match_info> match(const ir::graph& g, const std::vector<ir::task_id>& order,
                                       const std::vector<std::size_t>& pos, ir::task_id coll, ir::task_id comp,
                                       int chunks, std::string& why) {
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
  if (t.attr("batch", 1) != 1) return why = "batched matmuls are not split", std::nullopt;
  if (t.attr("accumulate") != 0) return why = "an accumulating matmul is not split", std::nullopt;
  if (t.reads.size() != 2 || t.writes.size() != 1) return why = "the matmul must read A, B and write C", std::nullopt;
  if (c.reads.size() != 1 || c.writes.size() != 1) return why = "the collective must read and write one buffer", std::nullopt;
  match_info info{};
  info.m = t.attr("m");
  info.n = t.attr("n");
  info.k = t.attr("k");
  info.trans_a = t.attr("trans_a") != 0;
  if (info.m <= 0 || info.n <= 0 || info.k <= 0) return why = "the matmul lacks m, n, k attributes", std::nullopt;
  const auto a = t.reads[0], y = t.writes[0];
  const auto es_a = static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(a)].type));
  const auto es_y = static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(y)].type));
  if (bytes_of(a) != info.m * info.k * es_a || bytes_of(y) != info.m * info.n * es_y)
    return why = "the sizes of A or C do not match the matmul's m, n, k", std::nullopt;
  const std::int64_t p = g.group_size(c);
  const auto only = [&](ir::buffer_id b, std::vector<ir::task_id> allowed) {
    auto who = rewrite::touchers(g, order, b);
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
      for (auto other : rewrite::touchers(g, order, b)) {
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
      for (auto other : rewrite::touchers(g, order, a)) {
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
inline std::optional<ir::task_id> match_split(const ir::graph& g, const std::vector<ir::task_id>& order,
                                              const std::vector<std::size_t>& pos, ir::task_id coll, std::string& why) {
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
  for (auto u : rewrite::touchers(g, order, b.id))
    if (pos[static_cast<std::size_t>(u)] > pos[static_cast<std::size_t>(coll)]) {
      next = u;
      break;
    }
  return next;
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

/// @brief The rewrite: each decomposition's collective and matmul are replaced by `chunks`
/// chunk collectives and `chunks` chunk matmuls (plus slice / concat tasks where the chunks are
/// not contiguous); dependencies are recomputed from the buffer accesses in program order, and
/// ordering edges of `g` that its accesses do not imply are kept. Throws concerto::error naming
/// the tasks when a decomposition does not fit its tasks or two decompositions share a task.
/// @code
/// ir::graph split = planner::apply(g, std::vector{planner::decomposition{ag, mm, 4}});
/// @endcode
[[nodiscard]] inline ir::graph apply(const ir::graph& g, std::span<const decomposition> decompositions) {
  using namespace detail::decompose;
  namespace rw = detail::rewrite;
  const auto order = rw::program_order(g);
  const auto pos = rw::positions(order);

  rw::draft d;
  d.graph = g.empty_like();
  d.graph.buffers = g.buffers;
  auto& bufs = d.graph.buffers;
  const auto new_buffer = [&](std::string name, std::vector<std::int64_t> shape, std::int64_t bytes,
                              const ir::buffer& like, ir::buffer_id view_of = -1, std::int64_t offset = 0) {
    ir::buffer b;
    b.id = static_cast<ir::buffer_id>(bufs.size());
    b.name = std::move(name);
    b.bytes = bytes;
    b.type = like.type;
    b.role = view_of >= 0 ? like.role : (like.role == ir::buffer_role::workspace ? like.role : ir::buffer_role::activation);
    b.shape = std::move(shape);
    b.view_of = view_of;
    b.offset = offset;
    bufs.push_back(std::move(b));
    return bufs.back().id;
  };

  // What replaces each old task, emitted at its program position; what goes right before one.
  std::map<ir::task_id, std::vector<ir::task>> replacement;
  std::map<ir::task_id, std::vector<std::pair<ir::task_id, ir::task>>> before; // (origin, task)
  std::vector<std::pair<ir::task_id, ir::task>> at_end;
  for (const auto& dec : decompositions) {
    std::string why;
    if (dec.kind == split_kind::reduce_scatter_all_gather) {
      const auto next = match_split(g, order, pos, dec.collective, why);
      if (!next) fail(describe(g, dec.collective, -1) + " into reduce_scatter + all_gather: " + why);
      if (replacement.count(dec.collective))
        fail(describe(g, dec.collective, -1) + ": task '" + g[dec.collective].name +
             "' is already part of another decomposition");
      const auto& ar = g[dec.collective];
      const ir::buffer whole = bufs[static_cast<std::size_t>(ar.reads[0])];
      const std::int64_t p = g.group_size(ar);
      const auto shard = new_buffer(whole.name + ".shard", {whole.bytes / static_cast<std::int64_t>(ir::size_of(whole.type)) / p},
                                    whole.bytes / p, whole);
      ir::task rs = ar;
      rs.name = ar.name + ".rs";
      rs.kind = ir::op_kind::reduce_scatter;
      rs.writes = {shard};
      replacement[dec.collective].push_back(std::move(rs));
      ir::task ag = ar;
      ag.name = ar.name + ".ag";
      ag.kind = ir::op_kind::all_gather;
      ag.reads = {shard};
      if (*next >= 0) {
        // Stamped like the task it precedes: it runs with that phase (the optimizer's, typically).
        ag.step_phase = g[*next].step_phase;
        ag.layer = g[*next].layer;
        before[*next].emplace_back(dec.collective, std::move(ag));
      } else {
        at_end.emplace_back(dec.collective, std::move(ag));
      }
      continue;
    }
    const auto info = match(g, order, pos, dec.collective, dec.compute, dec.chunks, why);
    if (!info) fail(describe(g, dec.collective, dec.compute) + " into " + std::to_string(dec.chunks) + " chunks: " + why);
    for (auto id : {dec.collective, dec.compute})
      if (replacement.count(id))
        fail(describe(g, dec.collective, dec.compute) + ": task '" + g[id].name +
             "' is already part of another decomposition");
    const auto& coll = g[dec.collective];
    const auto& mm = g[dec.compute];
    const std::int64_t k = dec.chunks, q = info->blocks, m = info->m, n = info->n, kk = info->k;
    const std::int64_t c = m / (q * k); // rows per block per chunk
    const auto a = mm.reads[0], b = mm.reads[1], y = mm.writes[0];
    const ir::buffer ya = bufs[static_cast<std::size_t>(y)]; // copies: bufs grows below
    const ir::buffer aa = bufs[static_cast<std::size_t>(a)];
    const std::int64_t a_row = aa.bytes / m, y_row = ya.bytes / m;
    auto& at_coll = replacement[dec.collective];
    auto& at_comp = replacement[dec.compute];

    const auto chunk_collective = [&](std::int64_t j, ir::buffer_id in, ir::buffer_id out) {
      ir::task t = coll;
      t.name = rw::indexed(coll.name + ".chunk", j);
      t.reads = {in};
      t.writes = {out};
      t.bytes = coll.bytes / static_cast<double>(k);
      t.attrs["chunk"] = j;
      t.attrs["chunks"] = k;
      // The layout attrs index the shape of the collective's buffers. The chunk buffers are
      // [rows, columns] with the rank blocks along the rows (splits_outer_dimension admits only
      // collectives with nothing but 1s before their dim), so an inherited dim = 1 of a
      // [1, seq, hidden] original would make a backend interleave the chunk's columns.
      for (const char* key : {"dim", "from_dim", "to_dim"})
        if (t.attrs.contains(key)) t.attrs[key] = 0;
      at_coll.push_back(std::move(t));
    };
    const auto chunk_matmul = [&](std::int64_t j, ir::buffer_id in_a, ir::buffer_id out) {
      ir::task t = mm;
      t.name = rw::indexed(mm.name + ".chunk", j);
      t.reads = {in_a, b};
      t.writes = {out};
      t.flops = mm.flops / static_cast<double>(k);
      t.bytes = mm.bytes / static_cast<double>(k);
      t.attrs["m"] = q * c;
      t.attrs["chunk"] = j;
      t.attrs["chunks"] = k;
      at_comp.push_back(std::move(t));
    };
    // The interleaved rows {r·m/q + j·c + i} of a row-major [m, inner] matrix (or of the
    // columns of a transposed [kk, m] one) as a contiguous chunk: a view when q = 1 and rows
    // are rows, else a slice task.
    const auto rows_of_a = [&](std::int64_t j) {
      const auto name = rw::indexed(aa.name + ".c", j);
      if (q == 1 && !info->trans_a) return new_buffer(name, {c, kk}, c * a_row, aa, a, j * c * a_row);
      const auto out = new_buffer(name, info->trans_a ? std::vector<std::int64_t>{kk, q * c} : std::vector<std::int64_t>{q * c, kk},
                                  q * c * a_row, aa);
      ir::task s;
      s.name = rw::indexed(mm.name + ".slice", j);
      s.kind = ir::op_kind::slice;
      s.stream = ir::compute_stream;
      s.fn = ir::op::slice;
      s.reads = {a};
      s.writes = {out};
      s.bytes = 2.0 * static_cast<double>(q * c * a_row);
      s.attrs = info->trans_a ? std::map<std::string, std::int64_t>{{"outer", kk * q}, {"extent", m / q}, {"inner", 1},
                                                                      {"offset", j * c}, {"length", c}}
                              : std::map<std::string, std::int64_t>{{"outer", q}, {"extent", m / q}, {"inner", kk},
                                                                      {"offset", j * c}, {"length", c}};
      s.step_phase = mm.step_phase;
      s.layer = mm.layer;
      at_comp.push_back(std::move(s));
      return out;
    };
    const auto rows_of_y = [&](std::int64_t j) {
      const auto name = rw::indexed(ya.name + ".c", j);
      if (q == 1) return new_buffer(name, {c, n}, c * y_row, ya, y, j * c * y_row);
      return new_buffer(name, {q * c, n}, q * c * y_row, ya);
    };

    switch (info->shape) {
    case pattern::gather_matmul: {
      const auto x = coll.reads[0];
      const ir::buffer xa = bufs[static_cast<std::size_t>(x)];
      std::vector<ir::buffer_id> parts;
      for (std::int64_t j = 0; j < k; ++j) {
        const auto xv = new_buffer(rw::indexed(xa.name + ".c", j), {c, kk}, c * a_row, xa, x, j * c * a_row);
        const auto gathered = new_buffer(rw::indexed(aa.name + ".c", j), {q * c, kk}, q * c * a_row, aa);
        chunk_collective(j, xv, gathered);
        const auto out = rows_of_y(j);
        chunk_matmul(j, gathered, out);
        parts.push_back(out);
      }
      if (q > 1) {
        ir::task t;
        t.name = mm.name + ".concat";
        t.kind = ir::op_kind::concat;
        t.stream = ir::compute_stream;
        t.fn = ir::op::concat;
        t.reads = parts;
        t.writes = {y};
        t.bytes = 2.0 * static_cast<double>(ya.bytes);
        t.attrs = {{"outer", q}, {"inner", n}, {"length", c}, {"parts", k}};
        t.step_phase = mm.step_phase;
        t.layer = mm.layer;
        at_comp.push_back(std::move(t));
      }
      break;
    }
    case pattern::matmul_scatter: {
      const auto z = coll.writes[0];
      const ir::buffer za = bufs[static_cast<std::size_t>(z)];
      for (std::int64_t j = 0; j < k; ++j) {
        const auto in = rows_of_a(j);
        const auto out = rows_of_y(j);
        chunk_matmul(j, in, out);
        chunk_collective(j, out, new_buffer(rw::indexed(za.name + ".c", j), {c, n}, c * y_row, za, z, j * c * y_row));
      }
      break;
    }
    case pattern::exchange_matmul: {
      // Chunk j sends rows [j·c, (j+1)·c) of each destination block (a slice of the input)
      // and receives them from each source: rows {r·m/q + j·c + i} of the exchanged buffer.
      const auto x = coll.reads[0];
      const ir::buffer xa = bufs[static_cast<std::size_t>(x)];
      std::vector<ir::buffer_id> parts, received;
      for (std::int64_t j = 0; j < k; ++j) {
        ir::buffer_id send = -1;
        if (q == 1) {
          send = new_buffer(rw::indexed(xa.name + ".c", j), {c, kk}, c * a_row, xa, x, j * c * a_row);
        } else {
          send = new_buffer(rw::indexed(xa.name + ".c", j), {q * c, kk}, q * c * a_row, xa);
          ir::task s;
          s.name = rw::indexed(coll.name + ".slice", j);
          s.kind = ir::op_kind::slice;
          s.stream = ir::compute_stream;
          s.fn = ir::op::slice;
          s.reads = {x};
          s.writes = {send};
          s.bytes = 2.0 * static_cast<double>(q * c * a_row);
          s.attrs = {{"outer", q}, {"extent", m / q}, {"inner", kk}, {"offset", j * c}, {"length", c}};
          s.step_phase = coll.step_phase;
          s.layer = coll.layer;
          at_coll.push_back(std::move(s));
        }
        const auto got = q == 1 ? new_buffer(rw::indexed(aa.name + ".c", j), {c, kk}, c * a_row, aa, a, j * c * a_row)
                                : new_buffer(rw::indexed(aa.name + ".c", j), {q * c, kk}, q * c * a_row, aa);
        chunk_collective(j, send, got);
        const auto out = rows_of_y(j);
        chunk_matmul(j, got, out);
        parts.push_back(out);
        received.push_back(got);
      }
      const auto join = [&](std::string name, std::vector<ir::buffer_id> from, ir::buffer_id to, std::int64_t inner) {
        ir::task t;
        t.name = std::move(name);
        t.kind = ir::op_kind::concat;
        t.stream = ir::compute_stream;
        t.fn = ir::op::concat;
        t.reads = std::move(from);
        t.writes = {to};
        t.bytes = 2.0 * static_cast<double>(bufs[static_cast<std::size_t>(to)].bytes);
        t.attrs = {{"outer", q}, {"inner", inner}, {"length", c}, {"parts", k}};
        t.step_phase = mm.step_phase;
        t.layer = mm.layer;
        at_comp.push_back(std::move(t));
      };
      if (q > 1) {
        join(mm.name + ".concat", parts, y, n);
        if (info->restore_a) join(coll.name + ".concat", received, a, kk);
      }
      break;
    }
    case pattern::matmul_exchange: {
      // Chunk j computes the rows it sends to each rank ({r·m/q + j·c + i}, a slice of A), and
      // receives rows j·c.. of each source's block; a concat puts them back in place.
      const auto z = coll.writes[0];
      const ir::buffer za = bufs[static_cast<std::size_t>(z)];
      std::vector<ir::buffer_id> parts;
      for (std::int64_t j = 0; j < k; ++j) {
        const auto in = rows_of_a(j);
        const auto out = rows_of_y(j);
        chunk_matmul(j, in, out);
        const auto got = q == 1 ? new_buffer(rw::indexed(za.name + ".c", j), {c, n}, c * y_row, za, z, j * c * y_row)
                                : new_buffer(rw::indexed(za.name + ".c", j), {q * c, n}, q * c * y_row, za);
        chunk_collective(j, out, got);
        parts.push_back(got);
      }
      if (q > 1) {
        ir::task t;
        t.name = coll.name + ".concat";
        t.kind = ir::op_kind::concat;
        t.stream = ir::compute_stream;
        t.fn = ir::op::concat;
        t.reads = parts;
        t.writes = {z};
        t.bytes = 2.0 * static_cast<double>(za.bytes);
        t.attrs = {{"outer", q}, {"inner", n}, {"length", c}, {"parts", k}};
        t.step_phase = coll.step_phase;
        t.layer = coll.layer;
        at_coll.push_back(std::move(t));
      }
      break;
    }
    case pattern::matmul_reduce: {
      const auto out_all = coll.writes[0];
      const ir::buffer oa = bufs[static_cast<std::size_t>(out_all)];
      for (std::int64_t j = 0; j < k; ++j) {
        const auto in = rows_of_a(j);
        const auto out = rows_of_y(j);
        chunk_matmul(j, in, out);
        const auto reduced =
            out_all == y ? out : new_buffer(rw::indexed(oa.name + ".c", j), {c, n}, c * y_row, oa, out_all, j * c * y_row);
        chunk_collective(j, out, reduced);
      }
      break;
    }
    }
  }

  for (auto id : order) {
    if (const auto b = before.find(id); b != before.end())
      for (auto& [origin, t] : b->second) d.add(std::move(t), {origin});
    const auto it = replacement.find(id);
    if (it == replacement.end()) {
      d.add(g[id], {id});
      continue;
    }
    for (auto& t : it->second) d.add(std::move(t), {id});
  }
  for (auto& [origin, t] : at_end) d.add(std::move(t), {origin});
  return rw::finish(g, order, std::move(d));
}

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
  using namespace detail::decompose;
  namespace rw = detail::rewrite;
  const auto order = rw::program_order(g);
  const auto pos = rw::positions(order);
  const auto p = list_plan(g, model);
  const auto exposed = exposed_us(p);
  std::vector<std::pair<double, decomposition>> found;
  for (const auto& c : g.tasks) {
    if (!ir::is_collective(c.kind) || c.reads.size() != 1 || c.writes.size() != 1) continue;
    if (!splits_outer_dimension(g, c)) continue;
    const double duration = p.duration_us[static_cast<std::size_t>(c.id)];
    const double idle = exposed[static_cast<std::size_t>(c.id)];
    if (!(duration > 0) || idle < options.min_exposed_fraction * duration) continue;
    const auto at = pos[static_cast<std::size_t>(c.id)];
    // The matmul the collective feeds (the first one after it reading its output as A) ...
    const auto consumer = [&] {
      for (auto u : rw::touchers(g, order, c.writes[0]))
        if (pos[static_cast<std::size_t>(u)] > at && g[u].kind == ir::op_kind::matmul && g[u].reads[0] == c.writes[0])
          return u;
      return ir::task_id{-1};
    };
    // ... or the one it drains (the last task before it touching its input, when a matmul).
    const auto producer = [&] {
      ir::task_id last = -1;
      for (auto u : rw::touchers(g, order, c.reads[0])) {
        if (pos[static_cast<std::size_t>(u)] >= at) break;
        last = g[u].kind == ir::op_kind::matmul ? u : -1;
      }
      return last;
    };
    std::vector<ir::task_id> partners;
    if (c.kind == ir::op_kind::all_gather) {
      for (auto u : rw::touchers(g, order, c.writes[0]))
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
        if (match(g, order, pos, c.id, partner, k, why)) found.push_back({idle, {c.id, partner, k}});
      }
    }
    if (options.split_all_reduce && c.kind == ir::op_kind::all_reduce) {
      std::string why;
      if (match_split(g, order, pos, c.id, why))
        found.push_back({idle, {c.id, -1, 1, split_kind::reduce_scatter_all_gather}});
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<decomposition> out;
  out.reserve(found.size());
  for (auto& f : found) out.push_back(f.second);
  return out;
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
  const auto candidates = find_candidates(g, model, options);
  std::size_t collectives = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (i == 0 || candidates[i].collective != candidates[i - 1].collective) ++collectives;
  const auto to_try = std::min<std::size_t>(collectives, static_cast<std::size_t>(std::max(0, options.max_candidates)));
  std::size_t tried = 0;
  for (std::size_t i = 0; i < candidates.size() && tried < to_try;) {
    std::size_t end = i;
    while (end < candidates.size() && candidates[end].collective == candidates[i].collective) ++end;
    ++tried;
    std::optional<decomposition> best;
    ir::graph best_graph;
    double best_step = result.step_us_after;
    for (; i < end; ++i) {
      // A matmul already split with another collective cannot be split again.
      const bool taken = std::any_of(result.chosen.begin(), result.chosen.end(), [&](const decomposition& d) {
        return candidates[i].compute >= 0 && (d.compute == candidates[i].compute || d.collective == candidates[i].compute);
      });
      if (taken) continue;
      auto trial = result.chosen;
      trial.push_back(candidates[i]);
      auto candidate_graph = planner::apply(g, std::span<const decomposition>(trial));
      const double step = judge(candidate_graph);
      if (step < best_step * (1 - 1e-9)) {
        best_step = step;
        best = candidates[i];
        best_graph = std::move(candidate_graph);
      }
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
