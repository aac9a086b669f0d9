#pragma once
/// @file
/// @brief The redistribution table: which collective (or local step) turns one spec into
/// another, axis by axis.
///
/// | from \ to  | replicate     | shard(d)          | partial        |
/// |------------|---------------|-------------------|----------------|
/// | partial    | all_reduce    | reduce_scatter(d) | (nothing)      |
/// | shard(e)   | all_gather(e) | all_to_all(e->d)  | all_gather + keep_one |
/// | replicate  | (nothing)     | local slice(d)    | keep_one (local: other ranks hold zero) |
///
/// Steps are ordered so that data shrinks before it grows: slices, then reduce-scatters,
/// all-to-alls, all-reduces and all-gathers last. A dimension split over two axes (`shard(dp, ep)`,
/// dp major) only gains or loses its minor axis in one step; the compiler refuses a redistribution
/// that would take out a major axis under a minor one.
///
/// @code
/// constexpr auto plan = redistribute(spec(replicate, replicate, partial(tp)), spec(shard(tp), replicate));
/// static_assert(plan.size == 1 && plan.steps[0].kind == redist_kind::reduce_scatter);
/// @endcode

#include <concerto/spec/spec.hpp>

namespace concerto {

/// @brief One step of a redistribution.
enum class redist_kind : std::uint8_t { local_slice, reduce_scatter, all_to_all, all_reduce, all_gather, keep_one };

[[nodiscard]] constexpr std::string_view to_string(redist_kind k) noexcept {
  constexpr std::string_view names[] = {"local_slice", "reduce_scatter", "all_to_all", "all_reduce", "all_gather",
                                        "keep_one"};
  return names[static_cast<int>(k)];
}
[[nodiscard]] constexpr bool is_collective(redist_kind k) noexcept {
  return k != redist_kind::local_slice && k != redist_kind::keep_one;
}

struct redist_step {
  redist_kind kind{};
  std::int8_t axis = -1;     ///< index in the axis table
  std::int8_t from_dim = -1; ///< dimension split before (all_gather, all_to_all)
  std::int8_t to_dim = -1;   ///< dimension split after (local_slice, reduce_scatter, all_to_all)
  axis_name name{};          ///< the axis's name (filled by the named overload)
  friend constexpr bool operator==(const redist_step&, const redist_step&) = default;
};

/// @brief The steps from one spec to another; `ok` is false when the ranks differ.
struct redist_plan {
  redist_step steps[2 * max_axes]{};
  int size = 0;
  bool ok = true;
  [[nodiscard]] constexpr int count(redist_kind k) const noexcept {
    int n = 0;
    for (int i = 0; i < size; ++i) n += steps[i].kind == k;
    return n;
  }
};

/// @brief The table over indexed specs with `axes` axes.
[[nodiscard]] constexpr redist_plan plan_redistribution(const pspec& from, const pspec& to, int axes) noexcept {
  redist_plan plan;
  if (from.rank != to.rank) {
    plan.ok = false;
    return plan;
  }
  redist_step found[2 * max_axes]{};
  int n = 0;
  for (int a = 0; a < axes; ++a) {
    const int f = from.state(a), t = to.state(a);
    const auto ax = static_cast<std::int8_t>(a);
    if (f == t) continue;
    if (f == state_partial) {
      found[n++] = t == state_replicated ? redist_step{redist_kind::all_reduce, ax, -1, -1}
                                         : redist_step{redist_kind::reduce_scatter, ax, -1, static_cast<std::int8_t>(t)};
    } else if (f == state_replicated) {
      found[n++] = t == state_partial ? redist_step{redist_kind::keep_one, ax, -1, -1}
                                      : redist_step{redist_kind::local_slice, ax, -1, static_cast<std::int8_t>(t)};
    } else if (t == state_replicated) {
      found[n++] = {redist_kind::all_gather, ax, static_cast<std::int8_t>(f), -1};
    } else if (t == state_partial) {
      found[n++] = {redist_kind::all_gather, ax, static_cast<std::int8_t>(f), -1};
      found[n++] = {redist_kind::keep_one, ax, -1, -1};
    } else {
      found[n++] = {redist_kind::all_to_all, ax, static_cast<std::int8_t>(f), static_cast<std::int8_t>(t)};
    }
  }
  // Stable order by kind: cheap local steps and shrinking collectives first. Within a kind, a
  // dimension split over two axes loses its minor (second) axis before its major one and gains
  // its major axis before its minor one: a step can only take out or put in a dimension's last axis.
  const auto rank_of = [&](const redist_step& st) {
    const bool minor_before = st.from_dim >= 0 && from.dims[st.from_dim][1] == st.axis;
    const bool minor_after = st.to_dim >= 0 && to.dims[st.to_dim][1] == st.axis;
    return static_cast<int>(st.kind) * 4 + (minor_before ? 0 : 2) + (minor_after ? 1 : 0);
  };
  for (int k = 0; k < 4 * (static_cast<int>(redist_kind::keep_one) + 1); ++k)
    for (int i = 0; i < n; ++i)
      if (rank_of(found[i]) == k) plan.steps[plan.size++] = found[i];
  return plan;
}

/// @brief Whether `step` may be taken from a tensor laid out as `s`: gathering (or exchanging) a
/// dimension's major axis while a minor one still splits it would interleave the minor axis's
/// blocks, which is not the layout the spec describes.
[[nodiscard]] constexpr bool keeps_axis_order(const pspec& s, const redist_step& step) noexcept {
  return !(step.from_dim >= 0 && s.dims[step.from_dim][1] >= 0 && s.dims[step.from_dim][0] == step.axis);
}

/// @brief Applies one step to a spec (what the tensor looks like after it).
[[nodiscard]] constexpr pspec apply(pspec s, const redist_step& step) noexcept {
  switch (step.kind) {
  case redist_kind::all_reduce: s.set_state(step.axis, state_replicated); break;
  case redist_kind::all_gather: s.set_state(step.axis, state_replicated); break;
  case redist_kind::keep_one: s.set_state(step.axis, state_partial); break;
  default: s.set_state(step.axis, step.to_dim); break;
  }
  return s;
}

/// @brief The table over specs as written by users; steps carry axis names.
/// @code
/// static_assert(redistribute(spec(shard(dp), replicate), spec(replicate, replicate)).count(redist_kind::all_gather) == 1);
/// @endcode
[[nodiscard]] constexpr redist_plan redistribute(const spec_value& from, const spec_value& to) noexcept {
  axis_table table;
  pspec f, t;
  if (!to_pspec(from, table, f) || !to_pspec(to, table, t)) return redist_plan{{}, 0, false};
  auto plan = plan_redistribution(f, t, table.count);
  for (int i = 0; i < plan.size; ++i) plan.steps[i].name = table.names[plan.steps[i].axis];
  return plan;
}

} // namespace concerto
