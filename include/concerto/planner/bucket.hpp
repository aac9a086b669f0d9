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
#include <concerto/planner/detail/parallel.hpp>
#include <concerto/planner/detail/progress.hpp>
#include <concerto/planner/detail/rewrite.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace concerto::planner {

/// @brief Tuning of choose_buckets.
struct bucket_options {
  planner::deadline deadline;    ///< stop trying caps then, keeping the best so far (none: try all)
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
inline std::vector<ir::task_id> checked(const ir::graph& g, const rewrite::program& prog,
                                        std::vector<ir::task_id> bucket) {
  const auto& pos = prog.pos;
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
    for (auto other : rewrite::touchers(g, prog, buf.id)) {
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
  const rw::program prog(g);
  const auto& order = prog.order;
  std::vector<std::vector<ir::task_id>> fused;
  std::vector<char> used(g.tasks.size(), 0);
  for (const auto& bucket : b.buckets) {
    if (bucket.size() < 2) continue;
    auto members = detail::bucket::checked(g, prog, bucket);
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

namespace detail::bucket {

/// The gradient all-reduces that may share a bucket, per mesh axis, in program order, and for
/// each the position of the first later task that touches its gradient: an all-reduce moved to
/// the end of a bucket must still run before that task.
struct lanes {
  std::map<int, std::vector<ir::task_id>> by_axis;
  std::vector<std::size_t> next_use;
  std::size_t fusable_count = 0;

  lanes(const ir::graph& g, const rewrite::program& prog) : next_use(g.tasks.size(), prog.order.size()) {
    for (auto id : prog.order) {
      if (!fusable(g, g[id])) continue;
      by_axis[g[id].axis].push_back(id);
      ++fusable_count;
      for (auto u : rewrite::touchers(g, prog, g[id].reads[0]))
        if (prog.at(u) > prog.at(id)) {
          next_use[static_cast<std::size_t>(id)] = prog.at(u);
          break;
        }
    }
  }
};

/// Whether all-reduce `id` may join the open bucket: it reduces with the same function and
/// element type, its gradient has another root, and it comes before `must_run_before` (the
/// first later use of a member's gradient). Both searches below ask it.
inline bool may_join(const ir::graph& g, const rewrite::program& prog, const std::vector<ir::task_id>& open,
                     ir::task_id id, std::size_t must_run_before) {
  if (open.empty()) return false;
  const auto grad = [&](ir::task_id t) -> const ir::buffer& { return g.buffers[static_cast<std::size_t>(g[t].reads[0])]; };
  return g[id].fn == g[open.front()].fn && grad(id).type == grad(open.front()).type &&
         prog.at(id) < must_run_before && std::none_of(open.begin(), open.end(), [&](ir::task_id m) {
           return g.root_of(g[m].reads[0]) == g.root_of(g[id].reads[0]);
         });
}

/// Buckets of one lane filled in program order up to `cap_bytes` each: an all-reduce joins the
/// open bucket when may_join allows it and the bucket stays within the cap.
inline std::vector<std::vector<ir::task_id>> fill(const ir::graph& g, const rewrite::program& prog, const lanes& l,
                                                  const std::vector<ir::task_id>& lane, std::int64_t cap_bytes) {
  std::vector<std::vector<ir::task_id>> out;
  std::vector<ir::task_id> open;
  std::int64_t open_bytes = 0;
  std::size_t must_run_before = 0;
  const auto close = [&] {
    if (open.size() > 1) out.push_back(open);
    open.clear();
  };
  for (auto id : lane) {
    const auto bytes = g.buffers[static_cast<std::size_t>(g[id].reads[0])].bytes;
    const bool joins = open_bytes + bytes <= cap_bytes && may_join(g, prog, open, id, must_run_before);
    if (!joins) {
      close();
      open_bytes = 0;
      must_run_before = prog.order.size();
    }
    open.push_back(id);
    open_bytes += bytes;
    must_run_before = std::min(must_run_before, l.next_use[static_cast<std::size_t>(id)]);
  }
  close();
  return out;
}

/// Bucket caps worth trying for a lane: doubling from twice its smallest gradient to the whole
/// lane, so a cap between two tries is at most a factor of two from one of them.
inline std::vector<std::int64_t> caps(const ir::graph& g, const std::vector<ir::task_id>& lane) {
  std::int64_t smallest = std::numeric_limits<std::int64_t>::max(), total = 0;
  for (auto id : lane) {
    const auto bytes = g.buffers[static_cast<std::size_t>(g[id].reads[0])].bytes;
    smallest = std::min(smallest, bytes);
    total += bytes;
  }
  std::vector<std::int64_t> out;
  for (std::int64_t c = 2 * std::max<std::int64_t>(smallest, 1); c < total; c *= 2) out.push_back(c);
  out.push_back(total);
  return out;
}

/// The fine-grained search: per lane, in program order, each all-reduce joins the open bucket
/// only if `judge` finds the step faster that way (a bucket may then stop before a gradient
/// that would expose it, which no cap expresses). Each decision is judged with the all-reduces
/// not walked yet left alone, so not joining changes nothing and costs no judgement: one judged
/// plan per all-reduce. When `until` passes, the all-reduces not walked get the buckets the cap
/// sweep gave them (`rest_cap`, per axis), and that bucketing is judged. `tick` is called once
/// per all-reduce (progress).
struct walk_result {
  bucketing buckets;
  double step_us = 0;
  std::size_t walked = 0; ///< all-reduces decided by the walk (the others keep the sweep's buckets)
};

template <class Tick>
walk_result walk(const ir::graph& g, const rewrite::program& prog, const lanes& l, const step_fn& judge,
                 const std::map<int, std::int64_t>& rest_cap, double start_step, const deadline& until, Tick&& tick) {
  walk_result out;
  bucketing& decided = out.buckets;
  double best_step = start_step;
  for (const auto& [axis, lane] : l.by_axis) {
    std::vector<ir::task_id> open;
    std::size_t must_run_before = prog.order.size();
    for (std::size_t k = 0; k < lane.size(); ++k) {
      const auto id = lane[k];
      if (expired(until)) {
        // The rest of this lane and the later lanes as the sweep filled them.
        if (open.size() > 1) decided.buckets.push_back(open);
        const auto cap = [&](int a) { return rest_cap.count(a) ? rest_cap.at(a) : std::int64_t{0}; };
        const std::vector<ir::task_id> tail(lane.begin() + static_cast<std::ptrdiff_t>(k), lane.end());
        for (auto& b : fill(g, prog, l, tail, cap(axis))) decided.buckets.push_back(std::move(b));
        for (const auto& [later, later_lane] : l.by_axis)
          if (later > axis)
            for (auto& b : fill(g, prog, l, later_lane, cap(later))) decided.buckets.push_back(std::move(b));
        out.step_us = judge(apply_buckets(g, decided));
        return out;
      }
      tick();
      ++out.walked;
      if (may_join(g, prog, open, id, must_run_before)) {
        auto trial = decided;
        trial.buckets.push_back(open);
        trial.buckets.back().push_back(id);
        const double step = judge(apply_buckets(g, trial));
        if (step < best_step * (1 - 1e-9)) {
          best_step = step;
          open.push_back(id);
          must_run_before = std::min(must_run_before, l.next_use[static_cast<std::size_t>(id)]);
          continue;
        }
      }
      if (open.size() > 1) decided.buckets.push_back(open);
      open = {id};
      must_run_before = l.next_use[static_cast<std::size_t>(id)];
    }
    if (open.size() > 1) decided.buckets.push_back(open);
  }
  out.step_us = best_step;
  return out;
}

} // namespace detail::bucket

/// @brief Bucket boundaries by simulated step time, judged by `judge` (default: list schedule +
/// simulator on `model`; pass one with a memory cap to respect it); no buckets at all if none
/// helps. Two searches:
/// - a cap sweep: per mesh axis, the fusable gradient all-reduces fill buckets in program order
///   up to a cap, for caps doubling from twice the smallest gradient to the whole lane; one
///   judged plan per cap (on every core), so its cost grows with the logarithm of the gradient
///   sizes, not with their number;
/// - a walk that decides each all-reduce on its own (join the open bucket only if the step gets
///   faster): finer, since a bucket may stop before a gradient that would be exposed, but one
///   judged plan per all-reduce, in sequence. At `options.deadline` the all-reduces not walked
///   get the sweep's buckets, so a longer budget buys a finer bucketing and a short one still
///   gets the sweep's. The better of the two is kept.
/// Small gradients, whose all-reduces are latency-bound, end up fused; a large one whose
/// all-reduce is hidden stays alone, since a bucket that large would wait for later gradients
/// and expose it. Reports progress on stderr once it takes over `options.progress_after_s`,
/// unless `options.progress` is false.
/// @code
/// auto b = planner::choose_buckets(g, model, planner::simulated_step(model, cap_bytes), {.progress = false});
/// @endcode
[[nodiscard]] inline bucketing choose_buckets(const ir::graph& g, const cost::model& model, step_fn judge = {},
                                              const bucket_options& options = {}) {
  if (!judge) judge = simulated_step(model);
  namespace rw = detail::rewrite;
  const rw::program prog(g);
  const detail::bucket::lanes lanes(g, prog);

  detail::progress_meter meter("bucketing", g.name, options.progress, options.progress_after_s);
  bucketing best;
  if (lanes.fusable_count < 2) return best;
  const double start_step = judge(g);
  double best_step = start_step;
  std::size_t judged = 1;
  const auto status = [&] {
    return std::to_string(judged) + " bucketings judged, " + std::to_string(best.buckets.size()) + " buckets of " +
           std::to_string(lanes.fusable_count) + " all-reduces, step " + detail::progress_meter::us(start_step) +
           " -> " + detail::progress_meter::us(best_step);
  };
  std::map<int, std::int64_t> best_cap; // per lane, the cap of the sweep's choice (none: no buckets)
  for (const auto& [axis, lane] : lanes.by_axis) {
    const auto kept = best; // the lanes decided before this one
    std::vector<bucketing> trials;
    std::vector<std::int64_t> trial_caps;
    for (const auto cap : detail::bucket::caps(g, lane)) {
      auto trial = kept;
      for (auto& b : detail::bucket::fill(g, prog, lanes, lane, cap)) trial.buckets.push_back(std::move(b));
      // Caps too small to fuse anything, and caps that fuse as the previous one did, add nothing.
      if (trial.buckets.size() > kept.buckets.size() && (trials.empty() || !(trial == trials.back()))) {
        trials.push_back(std::move(trial));
        trial_caps.push_back(cap);
      }
    }
    // The caps are independent of each other: judge them on every core, then keep the best in
    // cap order, as a sequential sweep would. A cap judged after the deadline is skipped.
    std::vector<double> steps(trials.size(), std::numeric_limits<double>::infinity());
    detail::for_each_index(trials.size(), [&](std::size_t j) {
      if (!expired(options.deadline)) steps[j] = judge(apply_buckets(g, trials[j]));
    });
    judged += trials.size();
    for (std::size_t j = 0; j < trials.size(); ++j)
      if (steps[j] < best_step * (1 - 1e-9)) {
        best_step = steps[j];
        best = trials[j];
        best_cap[axis] = trial_caps[j];
      }
    meter.tick(status);
  }
  // The walk decides gradient by gradient until the deadline, the sweep's buckets after it.
  std::size_t walked = 0;
  const auto walk_status = [&] {
    return status() + ", walk " + std::to_string(walked) + "/" + std::to_string(lanes.fusable_count);
  };
  if (!expired(options.deadline)) {
    auto refined = detail::bucket::walk(g, prog, lanes, judge, best_cap, start_step, options.deadline, [&] {
      ++walked;
      meter.tick(walk_status);
    });
    judged += refined.walked;
    if (refined.step_us < best_step * (1 - 1e-9)) {
      best = std::move(refined.buckets);
      best_step = refined.step_us;
    }
  }
  meter.done(walk_status);
  return best;
}

} // namespace concerto::planner
