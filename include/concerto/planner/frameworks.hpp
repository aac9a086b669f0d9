#pragma once
/// @file
/// @brief The hand-tuned overlap of Megatron-LM and DeepSpeed ZeRO as planning policies
/// (`megatron`, `deepspeed`), so that concerto can be put next to the systems the paper
/// measured against, on the same graph and cost model.
///
/// Each framework is a recipe, not a search: fixed gradient buckets, a fixed rule for which
/// collectives the compute waits for, and a fixed prefetch distance for parameter all-gathers.
/// Sources and the documented defaults followed are in docs/workloads.md ("Framework baselines").
///
/// - Gradient reductions (a collective that reads a gradient buffer) are fused into buckets of
///   the framework's size, filled in program order (backward order) per mesh axis, and either
///   overlap the backward pass (issued on their lane in program order, waited on by their
///   consumers only) or block it (the compute stream waits for each).
/// - Parameter all-gathers (an all-gather of a parameter buffer, ZeRO-3 / distributed optimizer)
///   run ahead of their use by at most the framework's prefetch: the next one always, more
///   while the parameters gathered ahead stay within the prefetch size.
/// - Every other collective (tensor- and sequence-parallel activations, the loss statistics,
///   expert all-to-alls) is synchronous: neither framework overlaps them by default. The
///   `megatron_tp_overlap` variant first splits each tensor-parallel collective and its matmul
///   into as many chunks as the axis has ranks (TransformerEngine's userbuffers, Megatron's
///   `tp_comm_overlap`), and those chunks overlap.
///
/// @code
/// auto s = planner::framework_schedule(planner::megatron(), g, model);
/// auto p = planner::make_plan(g, model, {.policy = planner::policy::deepspeed});
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/planner/bucket.hpp>
#include <concerto/planner/decompose.hpp>
#include <concerto/planner/list.hpp>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace concerto::planner {

/// @brief What a framework does with each kind of collective.
struct framework {
  std::string name;
  /// Gradient bucket size in elements on a mesh axis of n ranks: max(min, per_rank × n).
  std::int64_t bucket_min_elements = 0;
  std::int64_t bucket_elements_per_rank = 0;
  bool gradients_overlap = true; ///< false: the compute stream waits for each gradient reduction
  /// Parameters (elements) that all-gathers may fetch ahead of the next one in use.
  std::int64_t prefetch_elements = 0;
  /// Split each tensor-parallel collective with its matmul into one chunk per rank of its axis,
  /// and overlap the chunks (Megatron's tp_comm_overlap through TransformerEngine).
  bool split_tensor_parallel = false;
};

/// @brief Megatron-LM's DistributedDataParallel with overlap_grad_reduce and the distributed
/// optimizer's overlap_param_gather: buckets of max(40M, 1M × data-parallel size) parameters
/// reduced during backward, parameter all-gathers one bucket ahead, tensor-parallel
/// collectives synchronous (no TransformerEngine communication overlap).
[[nodiscard]] inline framework megatron() {
  return {.name = "megatron", .bucket_min_elements = 40'000'000, .bucket_elements_per_rank = 1'000'000,
          .gradients_overlap = true, .prefetch_elements = 0};
}

/// @brief megatron() with `tp_comm_overlap`: TransformerEngine's userbuffers split each
/// all-gather -> matmul and matmul -> reduce-scatter of the tensor-parallel group into one chunk
/// per rank (a ring), fixed, whatever the shapes.
[[nodiscard]] inline framework megatron_tp_overlap() {
  auto f = megatron();
  f.name = "megatron_tp_overlap";
  f.split_tensor_parallel = true;
  return f;
}

/// @brief DeepSpeed ZeRO at its configuration defaults: reduce_bucket_size 5e8 elements,
/// overlap_comm on only at stage 3, stage3_prefetch_bucket_size 5e7 elements. The stage is read
/// from the graph: parameters gathered for their use mean stage 3.
[[nodiscard]] inline framework deepspeed(bool stage3) {
  return {.name = "deepspeed", .bucket_min_elements = 500'000'000, .bucket_elements_per_rank = 0,
          .gradients_overlap = stage3, .prefetch_elements = 50'000'000};
}

namespace detail::frameworks {

[[nodiscard]] inline const ir::buffer& root(const ir::graph& g, ir::buffer_id b) {
  return g.buffers[static_cast<std::size_t>(g.root_of(b))];
}
[[nodiscard]] inline bool reduces_gradient(const ir::graph& g, const ir::task& t) {
  return ir::is_collective(t.kind) && t.reads.size() == 1 && root(g, t.reads[0]).role == ir::buffer_role::gradient;
}
[[nodiscard]] inline bool gathers_parameter(const ir::graph& g, const ir::task& t) {
  return t.kind == ir::op_kind::all_gather && t.reads.size() == 1 && root(g, t.reads[0]).role == ir::buffer_role::param;
}
[[nodiscard]] inline std::int64_t elements(const ir::graph& g, ir::buffer_id b) {
  const auto& buf = g.buffers[static_cast<std::size_t>(b)];
  return buf.bytes / std::max<std::int64_t>(static_cast<std::int64_t>(ir::size_of(buf.type)), 1);
}

/// The framework's gradient buckets of `g`, per mesh axis at its own size.
[[nodiscard]] inline bucketing buckets(const ir::graph& g, const framework& f) {
  const rewrite::program prog(g);
  const bucket::lanes lanes(g, prog);
  bucketing out;
  for (const auto& [axis, lane] : lanes.by_axis) {
    const auto ranks = g.axes.at(static_cast<std::size_t>(axis)).size;
    const auto cap_elements = std::max(f.bucket_min_elements, f.bucket_elements_per_rank * ranks);
    const auto element_bytes =
        static_cast<std::int64_t>(ir::size_of(g.buffers[static_cast<std::size_t>(g[lane.front()].reads[0])].type));
    for (auto& b : bucket::fill(g, prog, lanes, lane, cap_elements * element_bytes)) out.buckets.push_back(std::move(b));
  }
  return out;
}

/// Every activation collective that decomposition can split with its matmul, split into one
/// chunk per rank of its axis (the first partner matmul found; each task split once).
[[nodiscard]] inline ir::graph split_tensor_parallel(const ir::graph& g, const cost::model& model) {
  decompose_options options{.chunk_choices = {}, .min_exposed_fraction = 0, .split_all_reduce = false};
  for (const auto& a : g.axes)
    if (a.size >= 2) options.chunk_choices.push_back(a.size);
  std::vector<decomposition> chosen;
  std::set<ir::task_id> split;
  for (const auto& c : find_candidates(g, model, options)) {
    const auto& t = g[c.collective];
    if (reduces_gradient(g, t) || gathers_parameter(g, t) || c.chunks != g.group_size(t)) continue;
    if (split.count(c.collective) || split.count(c.compute)) continue;
    split.insert(c.collective);
    split.insert(c.compute);
    chosen.push_back(c);
  }
  return chosen.empty() ? g : planner::apply(g, chosen);
}

inline void add_dep(ir::graph& g, ir::task_id from, ir::task_id to) {
  auto& deps = g.tasks[static_cast<std::size_t>(to)].deps;
  if (std::find(deps.begin(), deps.end(), from) == deps.end()) deps.push_back(from);
}

} // namespace detail::frameworks

/// @brief `g` rewritten as `f` rewrites it: its tensor-parallel splits (if any; `model` finds
/// their candidates), then its gradient buckets.
[[nodiscard]] inline ir::graph framework_rewrite(const framework& f, const ir::graph& g, const cost::model& model) {
  namespace fw = detail::frameworks;
  const ir::graph split = f.split_tensor_parallel ? fw::split_tensor_parallel(g, model) : g;
  return apply_buckets(split, fw::buckets(split, f));
}

/// @brief The schedule `f` gives a graph it has rewritten (framework_rewrite): each stream in
/// program order, with the edges that make the framework's synchronous collectives block the
/// compute stream and hold its parameter all-gathers to its prefetch distance. The edges follow
/// program order, so the schedule stays consistent with one topological order.
[[nodiscard]] inline ordering framework_edges(const framework& f, ir::graph rewritten) {
  namespace fw = detail::frameworks;
  ordering s{std::move(rewritten), {}};
  ir::graph& g = s.graph;
  const auto order = detail::program_order(g);
  const auto pos = ir::positions(order);
  const auto succ = g.successors();

  // The compute tasks around each position: the last one before it and the first one after.
  std::vector<ir::task_id> compute_before(order.size(), -1), compute_after(order.size(), -1);
  ir::task_id last = -1, next = -1;
  for (std::size_t i = 0; i < order.size(); ++i) {
    compute_before[i] = last;
    if (g[order[i]].stream == ir::compute_stream) last = order[i];
  }
  for (std::size_t i = order.size(); i-- > 0;) {
    compute_after[i] = next;
    if (g[order[i]].stream == ir::compute_stream) next = order[i];
  }

  std::vector<ir::task_id> gathers;
  for (const auto id : order) {
    const auto& t = g[id];
    if (!ir::is_collective(t.kind)) continue;
    if (fw::gathers_parameter(g, t)) {
      gathers.push_back(id);
      continue;
    }
    if (fw::reduces_gradient(g, t) && f.gradients_overlap) continue;
    if (f.split_tensor_parallel && ir::is_chunk(t)) continue; // a chunk of a split: overlapped
    // Synchronous: issued after the compute before it, and the compute after it waits.
    const auto at = pos[static_cast<std::size_t>(id)];
    if (const auto before = compute_before[at]; before >= 0) fw::add_dep(g, before, id);
    if (const auto after = compute_after[at]; after >= 0) fw::add_dep(g, id, after);
  }

  // Prefetch: all-gather j may start once the compute reaches the first use of all-gather i,
  // the earliest i whose followers up to j fit in the prefetch (i = j - 1 at least).
  const auto first_use = [&](ir::task_id gather) {
    ir::task_id first = -1;
    for (const auto u : succ[static_cast<std::size_t>(gather)])
      if (g[u].stream == ir::compute_stream && (first < 0 || pos[static_cast<std::size_t>(u)] < pos[static_cast<std::size_t>(first)]))
        first = u;
    return first;
  };
  for (std::size_t j = 1; j < gathers.size(); ++j) {
    std::size_t i = j - 1;
    std::int64_t ahead = fw::elements(g, g[gathers[j]].writes.front());
    while (i > 0 && ahead + fw::elements(g, g[gathers[i]].writes.front()) <= f.prefetch_elements) {
      ahead += fw::elements(g, g[gathers[i]].writes.front());
      --i;
    }
    const auto use = first_use(gathers[i]);
    if (use < 0) continue;
    const auto gate = compute_before[pos[static_cast<std::size_t>(use)]];
    if (gate >= 0 && pos[static_cast<std::size_t>(gate)] < pos[static_cast<std::size_t>(gathers[j])]) fw::add_dep(g, gate, gathers[j]);
  }
  // Every edge added runs forward in `order`, which therefore stays a topological order.
  s.order = detail::split_by_stream(g, order);
  return s;
}

/// @brief The schedule `f` gives `g`: framework_rewrite, then framework_edges.
[[nodiscard]] inline ordering framework_schedule(const framework& f, const ir::graph& g, const cost::model& model) {
  return framework_edges(f, framework_rewrite(f, g, model));
}

/// @brief The framework of policy `p` (policy_family::framework) for `g` (DeepSpeed's stage is
/// read from `g`: parameters gathered for their use mean stage 3); throws naming the policy when
/// it is not a framework's.
[[nodiscard]] inline framework framework_of(policy p, const ir::graph& g) {
  switch (p) {
  case policy::megatron: return megatron();
  case policy::megatron_tp_overlap: return megatron_tp_overlap();
  case policy::deepspeed:
    // Stage 3 gathers parameters into copies for their use; stage 2 gathers the updated shards
    // back into the parameters themselves, after the optimizer.
    return deepspeed(std::any_of(g.tasks.begin(), g.tasks.end(), [&](const ir::task& t) {
      return detail::frameworks::gathers_parameter(g, t) && !t.writes.empty() &&
             detail::frameworks::root(g, t.writes[0]).role != ir::buffer_role::param;
    }));
  case policy::sync:
  case policy::program_order:
  case policy::xla_lhs:
  case policy::concerto: break;
  }
  fail("'" + std::string(to_string(p)) + "' is not a framework policy");
}

/// @brief The schedule of the framework policy `p` for `g`.
[[nodiscard]] inline ordering framework_schedule(policy p, const ir::graph& g, const cost::model& model) {
  return framework_schedule(framework_of(p, g), g, model);
}

} // namespace concerto::planner
