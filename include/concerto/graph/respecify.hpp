#pragma once
/// @file
/// @brief `respecify(program, choice)`: the program compiled again at run time with other specs
/// for some leaves and, optionally, another ZeRO stage: what automatic sharding
/// (autoshard/search.hpp) does with each candidate it prices.
///
/// A program keeps its traced expression (`program::raw`: one node per distinct subexpression,
/// the leaves with the specs the program wrote). The compiler's passes are constexpr functions,
/// so the same propagation, collective insertion, autodiff and optimizer passes that made the
/// program at compile time run here on that trace with the chosen leaf specs; a mistake a choice
/// makes (a contraction split on one side only, an order of axes a redistribution cannot reach)
/// is the compiler's own error code, reported instead of a program.
///
/// @code
/// constexpr auto step = program(loss, adamw{}, on(dp, tp));  // w1 written spec(auto_, auto_)
/// graph::sharding_choice c;
/// c.leaves.push_back({"w1", to_value(spec(replicate, shard(tp)))});
/// auto r = graph::respecify(step, c);
/// if (r.program) ir::graph g = lower(*r.program, shapes, mesh);
/// @endcode

#include <concerto/graph/lower.hpp>
#include <concerto/graph/program.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace concerto::graph {

/// @brief What automatic sharding chose for one leaf, or for one `.to(...)` written with auto_
/// (named by redistribution_name): its spec (no pending sums).
struct leaf_choice {
  std::string leaf;
  spec_value spec;
};

/// @brief The name a choice gives a `.to(...)` written with auto_: "to#" and its node in
/// program::raw (stable for one program: the trace is deterministic).
[[nodiscard]] inline std::string redistribution_name(int raw) { return "to#" + std::to_string(raw); }

/// @brief A sharding of a program: the specs of some leaves and redistributions (the others keep
/// the program's) and optionally the ZeRO stage over a mesh axis (stage 0: none).
struct sharding_choice {
  std::vector<leaf_choice> leaves;
  std::optional<int> zero_stage;
  std::string zero_axis; ///< with zero_stage > 0
  /// The mesh's axes in its order, known to the program before any chosen spec: the rules lay a
  /// dimension split over two axes out in this order (a program written with `on(...)` has its
  /// own), so a choice compiles alike wherever it is compiled. Empty: as the specs name them.
  std::vector<std::string> axes;
};

/// @brief The size of the program a respecified program<N> is: the lowering's own size (so that
/// its code is generated once), or N for a larger one.
template <std::size_t N>
inline constexpr std::size_t respecified_size = N > detail::lowering_size ? N : detail::lowering_size;

/// @brief The program, or the compiler's error and where it was found.
template <std::size_t N>
struct respecified {
  std::unique_ptr<graph::program<respecified_size<N>>> program;
  errc err = errc::none;
  std::string where; ///< the node of the mistake as the program wrote it, e.g. "matmul(x, w1)"
  /// The `.to(...)`s written with auto_ that the choice left open, as they were decided: each the
  /// layout its value arrived in (graph::kept_where_free), so that the program is one written by
  /// hand.
  std::vector<leaf_choice> kept;
  /// The mistake in the sentence the compile-time diagnostic uses (message_of), and where.
  [[nodiscard]] std::string message() const {
    return err == errc::none ? std::string{} : std::string(message_of(err)) + " (at " + where + ")";
  }
};

namespace detail {
/// The compiler's work area holding p's trace (its leaves with the specs and free dims written),
/// names, axes, optimizer and repeats, no ZeRO stage, ready for its passes to run again on other
/// specs (respecify, autoshard::auto_shard).
template <std::size_t N>
[[nodiscard]] std::unique_ptr<work<respecified_size<N>, respecified_size<N>>> retrace(const program<N>& p) {
  constexpr std::size_t M = respecified_size<N>;
  auto w = std::make_unique<work<M, M>>();
  w->raw_n = p.raw_size;
  for (int i = 0; i < p.raw_size; ++i) w->raw[i] = p.raw[i];
  w->raw_root = p.raw_root;
  w->axes = p.axes;
  w->name_count = p.name_count;
  for (int l = 0; l < max_leaves; ++l) {
    w->names[l] = p.names[l];
    w->inits[l] = p.inits[l];
    w->free_dims[l] = p.free_dims[l];
    w->grad_of[l] = w->update_of[l] = -1;
  }
  w->opt = p.optimizer;
  w->repeat_count = p.repeat_count;
  for (int k = 0; k < p.repeat_count; ++k) {
    const auto& r = p.repeats[k];
    w->repeats[k] = repeat_info{.name = r.name, .raw_in = r.raw_in, .raw_x = r.raw_x, .raw_out = r.raw_out};
  }
  return w;
}
} // namespace detail

/// @brief Compiles `p` again with the leaf and redistribution specs and ZeRO stage of `choice`
/// (a `.to(...)` written with auto_ and not named keeps the layout its value arrives in, and is
/// listed in respecified::kept). Throws concerto::error for a choice that names a leaf or
/// redistribution the program lacks, gives a spec of another rank or with pending sums, or a
/// ZeRO stage outside 0-3; a choice the compiler refuses comes back as `err`.
template <std::size_t N>
[[nodiscard]] respecified<N> respecify(const program<N>& p, const sharding_choice& choice) {
  constexpr std::size_t M = respecified_size<N>;
  auto w = detail::retrace(p);
  for (const auto& a : choice.axes)
    if (w->axes.intern(axis_name(a)) < 0)
      fail("respecify: the choice's axes overflow the program's " + std::to_string(max_axes) + " (sharding_choice::axes)");
  w->stage = choice.zero_stage.value_or(p.zero_stage);
  w->zero_axis = p.zero_axis;
  if (w->stage < 0 || w->stage > 3) fail("respecify: ZeRO stage " + std::to_string(w->stage) + " is not 0, 1, 2 or 3");
  if (choice.zero_stage && *choice.zero_stage > 0) {
    w->zero_axis = w->axes.intern(axis_name(choice.zero_axis));
    if (choice.zero_axis.empty() || w->zero_axis < 0)
      fail("respecify: ZeRO stage " + std::to_string(w->stage) + " needs a mesh axis (sharding_choice::zero_axis), one of at most " +
           std::to_string(max_axes) + " the program uses");
  }
  std::vector<bool> used(choice.leaves.size(), false);
  const auto take = [&](node& x, std::size_t c, std::string_view what) -> bool {
    const auto& s = choice.leaves[c].spec;
    if (s.rank != x.use.rank || !s.partial[0].empty())
      fail("respecify: the spec " + to_string(s) + " chosen for " + std::string(what) + " must have rank " + std::to_string(x.use.rank) +
           " and no pending sum");
    if (!to_pspec(s, w->axes, x.use)) return false;
    used[c] = true;
    return true;
  };
  for (int i = 0; i < w->raw_n; ++i) {
    node& x = w->raw[i];
    if (x.op == op_code::to && x.free != 0) {
      const auto name = redistribution_name(i);
      for (std::size_t c = 0; c < choice.leaves.size(); ++c) {
        if (choice.leaves[c].leaf != name) continue;
        if (!take(x, c, "redistribution '" + name + "'")) return {nullptr, errc::too_many_axes, name};
        x.free = 0;
      }
    }
    if (!is_leaf(x.op)) continue;
    if (x.zero_dim >= 0) { // the trace stored it split for ZeRO-3: back to the spec written
      x.spec = x.use;
      x.zero_dim = -1;
    }
    const std::string_view name = p.names[x.name].view();
    for (std::size_t c = 0; c < choice.leaves.size(); ++c) {
      if (choice.leaves[c].leaf != name) continue;
      const std::string what = "leaf '" + std::string(name) + "'";
      if (!take(x, c, what)) return {nullptr, errc::too_many_axes, what};
      x.spec = x.use;
      x.flags = static_cast<std::uint8_t>(x.flags & ~flag_pinned);
      w->free_dims[x.name] = 0; // decided: the result is a program written by hand
    }
    w->store_zero3(x);
  }
  for (std::size_t c = 0; c < choice.leaves.size(); ++c)
    if (!used[c]) fail("respecify: the program has no leaf or redistribution written with auto_ named '" + choice.leaves[c].leaf + "'");
  w->run_passes();
  if (w->err != errc::none) return {nullptr, w->err, std::string(detail::describe(*w).view())};
  // The open redistributions decided as their values arrived, written into the trace, so that the
  // program (and a later respecify of it) has nothing left to decide: the same passes with those
  // layouts written make the same nodes.
  std::vector<leaf_choice> kept;
  for (int i = 0; i < w->raw_n; ++i) {
    node& x = w->raw[i];
    if (x.op != op_code::to || x.free == 0) continue;
    x.use = w->nodes[w->map[i]].spec;
    x.free = 0;
    kept.push_back({redistribution_name(i), to_value(x.use, w->axes)});
  }
  auto out = std::make_unique<program<M>>();
  detail::fill(*out, *w);
  return {std::move(out), errc::none, {}, std::move(kept)};
}

} // namespace concerto::graph
