#pragma once
/// @file
/// @brief Gradient bucketing: backward all-reduces of gradients, adjacent in program order on
/// one mesh axis, are fused into one all-reduce over a contiguous region.
///
/// The region needs no copy: the rewrite allocates one flat bucket buffer (a new root, role
/// gradient) and turns each fused gradient into a view of it, back to back in program order,
/// so the kernels that write the gradients write into the bucket. Gradients are persistent
/// buffers already, so a bucket adds no memory. The fused all-reduce runs where the last
/// member's all-reduce was. Boundaries are chosen by simulated step time, not a fixed size
/// (docs/decomposition.md).
///
/// @code
/// auto model = cost::model::preset("a800x32");
/// planner::bucketing b = planner::choose_buckets(g, model);
/// ir::graph fused = planner::apply_buckets(g, b);
/// @endcode

#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/planner/detail/evaluate.hpp>
#include <concerto/planner/detail/progress.hpp>
#include <concerto/planner/detail/rewrite.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief Tuning of choose_buckets.
struct bucket_options {
  bool progress = true;          ///< progress on stderr once choosing takes longer than ...
  double progress_after_s = 1.0; ///< ... this many seconds
};

/// @brief Buckets of gradient all-reduces (task ids of the unbucketed graph); a bucket of one
/// task leaves it alone. Every all-reduce not listed stays as it is.
struct bucketing {
  std::vector<std::vector<ir::task_id>> buckets;
  friend bool operator==(const bucketing&, const bucketing&) = default;
};

namespace detail::bucket {

/// A gradient all-reduce that may join a bucket: backward, in place on a root gradient buffer.
[[nodiscard]] inline bool fusable(const ir::graph& g, const ir::task& t) {
  if (t.kind != ir::op_kind::all_reduce || t.step_phase != ir::phase::backward) return false;
  if (t.reads.size() != 1 || t.writes.size() != 1 || t.reads[0] != t.writes[0]) return false;
  const auto& b = g.buffers[static_cast<std::size_t>(t.reads[0])];
  return b.view_of < 0 && b.role == ir::buffer_role::gradient;
}

inline std::string where(const ir::graph& g, ir::task_id id) {
  return "bucketing of graph '" + g.name + "': task " + std::to_string(id) +
         (id >= 0 && static_cast<std::size_t>(id) < g.tasks.size() ? " '" + g[id].name + "'" : std::string{});
}

/// Throws unless the bucket's tasks can be fused; returns them in program order.
inline std::vector<ir::task_id> checked(const ir::graph& g, const std::vector<ir::task_id>& order,
                                        const std::vector<std::size_t>& pos, std::vector<ir::task_id> bucket) {
  for (auto id : bucket) {
    if (id < 0 || static_cast<std::size_t>(id) >= g.tasks.size()) fail(where(g, id) + " does not exist");
    if (!fusable(g, g[id]))
      fail(where(g, id) + " is not a backward all_reduce in place on a gradient buffer that is not a view");
  }
  std::sort(bucket.begin(), bucket.end(), [&](auto x, auto y) { return pos[static_cast<std::size_t>(x)] < pos[static_cast<std::size_t>(y)]; });
  const auto& first = g[bucket.front()];
  const auto last_pos = pos[static_cast<std::size_t>(bucket.back())];
  for (std::size_t i = 0; i < bucket.size(); ++i) {
    const auto& t = g[bucket[i]];
    if (i > 0 && bucket[i] == bucket[i - 1]) fail(where(g, t.id) + " appears twice in a bucket");
    if (t.axis != first.axis || t.fn != first.fn)
      fail(where(g, t.id) + " reduces over another axis or with another function than '" + first.name + "'");
    const auto& buf = g.buffers[static_cast<std::size_t>(t.reads[0])];
    if (buf.type != g.buffers[static_cast<std::size_t>(first.reads[0])].type)
      fail(where(g, t.id) + ": gradient '" + buf.name + "' has another element type than the bucket's first");
    // Moving the all-reduce to the bucket's end must not change what anyone reads.
    for (auto other : rewrite::touchers(g, order, buf.id)) {
      const auto at = pos[static_cast<std::size_t>(other)];
      if (at > pos[static_cast<std::size_t>(t.id)] && at <= last_pos && other != bucket.back())
        fail(where(g, t.id) + ": task '" + g[other].name + "' uses gradient '" + buf.name +
             "' before the bucket's all-reduce would run");
    }
  }
  for (std::size_t i = 0; i < bucket.size(); ++i)
    for (std::size_t j = i + 1; j < bucket.size(); ++j)
      if (g.root_of(g[bucket[i]].reads[0]) == g.root_of(g[bucket[j]].reads[0]))
        fail(where(g, bucket[j]) + " reduces the same gradient as '" + g[bucket[i]].name + "'");
  return bucket;
}

} // namespace detail::bucket

/// @brief Rewrites `g` so each bucket of two or more all-reduces is one all-reduce over a flat
/// gradient buffer whose views are the member gradients. Buffer ids shift by the number of
/// buckets (the flat buffers come first, as a view must follow its root). Throws
/// concerto::error naming the task when a bucket mixes axes, functions or element types, holds
/// a task that is not a fusable gradient all-reduce, or when a task uses a member gradient
/// between its all-reduce and the bucket's.
/// @code
/// auto fused = planner::apply_buckets(g, {{{ar1, ar2, ar3}}});
/// @endcode
[[nodiscard]] inline ir::graph apply_buckets(const ir::graph& g, const bucketing& b) {
  namespace rw = detail::rewrite;
  const auto order = rw::program_order(g);
  const auto pos = rw::positions(order);
  std::vector<std::vector<ir::task_id>> fused;
  std::vector<char> used(g.tasks.size(), 0);
  for (const auto& bucket : b.buckets) {
    if (bucket.size() < 2) continue;
    auto members = detail::bucket::checked(g, order, pos, bucket);
    for (auto id : members)
      if (used[static_cast<std::size_t>(id)]++) fail(detail::bucket::where(g, id) + " is in two buckets");
    fused.push_back(std::move(members));
  }

  const auto shift = static_cast<ir::buffer_id>(fused.size());
  rw::draft d;
  d.graph = g.empty_like();
  for (std::size_t i = 0; i < fused.size(); ++i) {
    const auto& first_buf = g.buffers[static_cast<std::size_t>(g[fused[i].front()].reads[0])];
    ir::buffer root;
    root.id = static_cast<ir::buffer_id>(i);
    root.name = rw::indexed("grad.bucket", static_cast<std::int64_t>(i));
    root.type = first_buf.type;
    root.role = ir::buffer_role::gradient;
    for (auto id : fused[i]) root.bytes += g.buffers[static_cast<std::size_t>(g[id].reads[0])].bytes;
    root.shape = {root.bytes / static_cast<std::int64_t>(ir::size_of(root.type))};
    d.graph.buffers.push_back(std::move(root));
  }
  for (const auto& old : g.buffers) {
    auto nb = old;
    nb.id += shift;
    if (nb.view_of >= 0) nb.view_of += shift;
    d.graph.buffers.push_back(std::move(nb));
  }
  std::map<ir::task_id, std::size_t> last_of; // last member -> bucket
  for (std::size_t i = 0; i < fused.size(); ++i) {
    std::int64_t offset = 0;
    for (auto id : fused[i]) {
      auto& member = d.graph.buffers[static_cast<std::size_t>(g[id].reads[0] + shift)];
      member.view_of = static_cast<ir::buffer_id>(i);
      member.offset = offset;
      offset += member.bytes;
    }
    last_of[fused[i].back()] = i;
  }
  const auto remap = [shift](std::vector<ir::buffer_id>& list) {
    for (auto& x : list) x += shift;
  };
  for (auto id : order) {
    if (used[static_cast<std::size_t>(id)] && !last_of.count(id)) continue; // folded into its bucket
    if (const auto it = last_of.find(id); it != last_of.end()) {
      const auto& members = fused[it->second];
      ir::task t = g[id];
      t.name = rw::indexed("grad.bucket", static_cast<std::int64_t>(it->second)) + ".ar";
      t.reads = t.writes = {static_cast<ir::buffer_id>(it->second)};
      t.bytes = 0;
      for (auto m : members) t.bytes += g[m].bytes;
      t.attrs["members"] = static_cast<std::int64_t>(members.size());
      d.add(std::move(t), members);
      continue;
    }
    ir::task t = g[id];
    remap(t.reads);
    remap(t.writes);
    d.add(std::move(t), {id});
  }
  return rw::finish(g, order, std::move(d));
}

/// @brief Bucket boundaries by simulated step time: per mesh axis, the fusable gradient
/// all-reduces are walked in program order and each is added to the open bucket if `judge`
/// (default: list schedule + simulator on `model`; pass one with a memory cap to respect it)
/// finds the step faster that way, else it opens a new bucket. Small gradients, whose
/// all-reduces are latency-bound, end up fused; a large one whose all-reduce is hidden stays
/// alone, since waiting for later gradients would expose it.
/// Reports progress on stderr once it takes over `options.progress_after_s`, unless
/// `options.progress` is false.
/// @code
/// auto b = planner::choose_buckets(g, model, planner::simulated_step(model, cap_bytes), {.progress = false});
/// @endcode
[[nodiscard]] inline bucketing choose_buckets(const ir::graph& g, const cost::model& model, step_fn judge = {},
                                              const bucket_options& options = {}) {
  if (!judge) judge = simulated_step(model);
  namespace rw = detail::rewrite;
  const auto order = rw::program_order(g);
  std::map<int, std::vector<ir::task_id>> lanes;
  std::size_t total = 0, done = 0;
  for (auto id : order)
    if (detail::bucket::fusable(g, g[id])) {
      lanes[g[id].axis].push_back(id);
      ++total;
    }

  detail::progress_meter meter("bucketing", g.name, options.progress, options.progress_after_s);
  bucketing best;
  const double start_step = judge(g);
  double best_step = start_step;
  const auto status = [&] {
    return std::to_string(done) + "/" + std::to_string(total) + " all-reduces placed, " +
           std::to_string(best.buckets.size()) + " buckets closed, step " + detail::progress_meter::us(start_step) +
           " -> " + detail::progress_meter::us(best_step);
  };
  for (const auto& [axis, list] : lanes) {
    std::vector<ir::task_id> open;
    for (auto id : list) {
      ++done;
      meter.tick(status);
      if (!open.empty() && g[id].fn == g[open.front()].fn) {
        auto trial = best;
        auto extended = open;
        extended.push_back(id);
        trial.buckets.push_back(extended);
        bool valid = true;
        ir::graph candidate;
        try {
          candidate = apply_buckets(g, trial);
        } catch (const concerto::error&) {
          valid = false; // a member's gradient is used in between: this boundary is forced
        }
        if (valid) {
          const double step = judge(candidate);
          if (step < best_step * (1 - 1e-9)) {
            best_step = step;
            open = std::move(extended);
            continue;
          }
        }
      }
      if (open.size() > 1) best.buckets.push_back(open);
      open = {id};
    }
    if (open.size() > 1) best.buckets.push_back(open);
  }
  meter.done(status);
  return best;
}

} // namespace concerto::planner
