#pragma once
/// @file
/// @brief Sharding specs: one placement per tensor dimension (`shard(axis...)` or `replicate`)
/// plus pending sums (`partial(axis)`). A spec written by a user is a type (`spec_t<...>`) so
/// that an expression's type carries it; `spec_value` is the same spec as a structural value
/// (usable as a template argument, comparable, printable), and `pspec` is the compact form
/// with axis indices that the constexpr passes work on.
///
/// @code
/// inline constexpr axis<"dp"> dp;  inline constexpr axis<"tp"> tp;
/// constexpr auto act = spec(shard(dp), replicate);      // [batch, hidden]: batch split over dp
/// static_assert(to_value(act).rank == 2);
/// constexpr auto pending = spec(shard(dp), replicate, partial(tp)); // a sum still to be made over tp
/// @endcode

#include <concerto/mesh/axis.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

namespace concerto {

inline constexpr int max_rank = 4;     ///< dimensions a spec can describe
inline constexpr int max_dim_axes = 2; ///< axes that can split one dimension (shard(dp, tp))
inline constexpr int max_axes = 4;     ///< distinct axes one program can use

// ---- placements (types) -----------------------------------------------------------------------

/// @brief The dimension is whole on every rank.
struct replicate_t {};
inline constexpr replicate_t replicate{};

/// @brief The dimension is split over the listed axes (the first one is the major split).
template <mesh_axis_type... Axes>
struct shard_t {
  static_assert(sizeof...(Axes) >= 1 && sizeof...(Axes) <= max_dim_axes,
                "shard(...) takes one or two mesh axes: split a dimension over at most two axes");
};
template <mesh_axis_type... Axes>
[[nodiscard]] constexpr shard_t<std::remove_cvref_t<Axes>...> shard(Axes...) noexcept {
  return {};
}

/// @brief The dimension's placement is chosen by automatic sharding (autoshard/search.hpp):
/// replicated, or split over one or two mesh axes, whichever gives the fastest step under the
/// memory cap. Until it is chosen (a program compiled as written) it is replicated.
/// @code
/// constexpr auto w1 = param<"w1">(spec(auto_, auto_)); // decide both dimensions
/// constexpr auto x = input<"x">(spec(auto_, replicate)); // the batch dimension only
/// @endcode
struct auto_t {};
inline constexpr auto_t auto_{};

/// @brief Every rank of the axis holds a part of a sum that has not been made yet.
template <mesh_axis_type Axis>
struct partial_t {};
template <mesh_axis_type Axis>
[[nodiscard]] constexpr partial_t<std::remove_cvref_t<Axis>> partial(Axis) noexcept {
  return {};
}

// ---- the value form -----------------------------------------------------------------------------

/// @brief A spec as a structural value with axis names inline (an empty name means "none").
struct spec_value {
  int rank = 0;
  axis_name dims[max_rank][max_dim_axes]{};
  axis_name partial[max_dim_axes]{};
  std::uint8_t free = 0; ///< bit per dimension written auto_: replicated until automatic sharding chooses
  friend constexpr bool operator==(const spec_value&, const spec_value&) = default;
  [[nodiscard]] constexpr bool is_free(int d) const noexcept { return (free >> d & 1u) != 0; }
};

namespace detail {
template <class P>
struct placement_traits {
  static constexpr bool is_placement = false;
};
template <>
struct placement_traits<replicate_t> {
  static constexpr bool is_placement = true, is_dim = true;
  static constexpr void apply(spec_value& s) { ++s.rank; }
};
template <>
struct placement_traits<auto_t> {
  static constexpr bool is_placement = true, is_dim = true;
  static constexpr void apply(spec_value& s) {
    if (s.rank < max_rank) s.free = static_cast<std::uint8_t>(s.free | (1u << s.rank));
    ++s.rank;
  }
};
template <mesh_axis_type... A>
struct placement_traits<shard_t<A...>> {
  static constexpr bool is_placement = true, is_dim = true;
  static constexpr void apply(spec_value& s) {
    if (s.rank < max_rank) {
      int i = 0;
      ((s.dims[s.rank][i++] = axis_name(A::name())), ...);
    }
    ++s.rank;
  }
};
template <mesh_axis_type A>
struct placement_traits<partial_t<A>> {
  static constexpr bool is_placement = true, is_dim = false;
  static constexpr void apply(spec_value& s) {
    for (auto& p : s.partial)
      if (p.empty()) {
        p = axis_name(A::name());
        return;
      }
    s.rank = 1000; // more pending sums than a spec holds; reported by spec()
  }
};

/// Pending sums commute, so their axes are kept sorted: equal specs compare equal.
constexpr spec_value canonical(spec_value s) {
  if (!s.partial[1].empty() && s.partial[1].view() < s.partial[0].view()) {
    const auto t = s.partial[0];
    s.partial[0] = s.partial[1];
    s.partial[1] = t;
  }
  return s;
}

/// The first axis named twice in a spec, or an empty name.
constexpr axis_name repeated_axis(const spec_value& s) {
  axis_name seen[max_rank * max_dim_axes + max_dim_axes]{};
  int n = 0;
  const auto visit = [&](const axis_name& a) -> bool {
    if (a.empty()) return false;
    for (int i = 0; i < n; ++i)
      if (seen[i] == a) return true;
    seen[n++] = a;
    return false;
  };
  for (int d = 0; d < s.rank && d < max_rank; ++d)
    for (const auto& a : s.dims[d])
      if (visit(a)) return a;
  for (const auto& a : s.partial)
    if (visit(a)) return a;
  return {};
}
} // namespace detail

/// @brief A spec as a type: what `spec(...)` returns and what an expression's type carries.
template <class... Placements>
struct spec_t {
  static constexpr spec_value value = [] {
    spec_value s;
    (detail::placement_traits<Placements>::apply(s), ...);
    return detail::canonical(s);
  }();
  constexpr operator spec_value() const noexcept { return value; }
  [[nodiscard]] static constexpr int rank() noexcept { return value.rank; }
};

/// @brief Builds a spec from one placement per dimension and any `partial(axis)`.
/// @code
/// constexpr auto col = spec(replicate, shard(tp)); // column-parallel weight [in, out]
/// @endcode
template <class... Placements>
[[nodiscard]] constexpr auto spec(Placements...) noexcept {
  using result = spec_t<std::remove_cvref_t<Placements>...>;
  static_assert((detail::placement_traits<std::remove_cvref_t<Placements>>::is_placement && ...),
                "spec(...) takes placements only: shard(axis...), replicate, auto_ or partial(axis)");
  static_assert(result::value.rank <= max_rank,
                "spec has more than 4 dimensions or more than 2 partial axes: concerto specs describe up to 4 "
                "dimensions and 2 pending sums");
  static_assert(detail::repeated_axis(result::value).empty(),
                "spec uses one mesh axis twice: an axis can split only one dimension and cannot also be partial; "
                "remove one of the uses");
  return result{};
}

template <class T>
struct is_spec : std::false_type {};
template <class... P>
struct is_spec<spec_t<P...>> : std::true_type {};
/// @brief Satisfied by the types `spec(...)` returns.
template <class T>
concept spec_type = is_spec<std::remove_cvref_t<T>>::value;

/// @brief The value form of a spec (identity on values).
template <class... P>
[[nodiscard]] constexpr spec_value to_value(spec_t<P...>) noexcept {
  return spec_t<P...>::value;
}
[[nodiscard]] constexpr spec_value to_value(const spec_value& s) noexcept { return s; }

/// @brief Compact text: `[dp,R]`, `[(dp,tp),R]`, `[R,tp]+P(tp)`, `[auto,R]`, `[]` for a scalar.
[[nodiscard]] inline std::string to_string(const spec_value& s) {
  std::string out = "[";
  for (int d = 0; d < s.rank; ++d) {
    if (d) out += ",";
    const auto& ax = s.dims[d];
    if (s.is_free(d)) out += "auto";
    else if (ax[0].empty()) out += "R";
    else if (ax[1].empty()) out += ax[0].view();
    else {
      out += '(';
      out += ax[0].view();
      out += ',';
      out += ax[1].view();
      out += ')';
    }
  }
  out += "]";
  if (!s.partial[0].empty()) {
    out += "+P(";
    out += s.partial[0].view();
    if (!s.partial[1].empty()) {
      out += ',';
      out += s.partial[1].view();
    }
    out += ')';
  }
  return out;
}

// ---- the indexed form used by the passes ------------------------------------------------------

/// @brief The axes of one program, in order of first use (or as declared by `on(...)`).
struct axis_table {
  axis_name names[max_axes]{};
  int count = 0;
  [[nodiscard]] constexpr int find(const axis_name& a) const noexcept {
    for (int i = 0; i < count; ++i)
      if (names[i] == a) return i;
    return -1;
  }
  /// Index of the axis, adding it if new; -1 when the table is full.
  constexpr int intern(const axis_name& a) noexcept {
    if (const int i = find(a); i >= 0) return i;
    if (count == max_axes) return -1;
    names[count] = a;
    return count++;
  }
};

/// Where a tensor stands along one mesh axis: replicated, partial, or split along a dimension (>= 0).
inline constexpr int state_replicated = -1;
inline constexpr int state_partial = -2;

/// @brief A spec with axis indices into an axis_table: cheap to copy inside constexpr passes.
struct pspec {
  std::int8_t rank = 0;
  std::int8_t dims[max_rank][max_dim_axes] = {{-1, -1}, {-1, -1}, {-1, -1}, {-1, -1}};
  std::uint8_t partial = 0; ///< bit per axis
  friend constexpr bool operator==(const pspec&, const pspec&) = default;

  /// state_replicated, state_partial or the dimension the axis splits.
  [[nodiscard]] constexpr int state(int axis) const noexcept {
    if (partial & (1u << axis)) return state_partial;
    for (int d = 0; d < rank; ++d)
      for (auto a : dims[d])
        if (a == axis) return d;
    return state_replicated;
  }
  /// Moves one axis to a new state, keeping the others.
  constexpr void set_state(int axis, int st) noexcept {
    partial = static_cast<std::uint8_t>(partial & ~(1u << axis));
    for (int d = 0; d < rank; ++d) {
      auto& ax = dims[d];
      if (ax[0] == axis) { ax[0] = ax[1]; ax[1] = -1; }
      else if (ax[1] == axis) ax[1] = -1;
    }
    if (st == state_partial) partial = static_cast<std::uint8_t>(partial | (1u << axis));
    else if (st >= 0 && st < rank) {
      auto& ax = dims[st];
      if (ax[0] < 0) ax[0] = static_cast<std::int8_t>(axis);
      else if (ax[1] < 0) ax[1] = static_cast<std::int8_t>(axis);
    }
  }
  [[nodiscard]] constexpr bool has_partial() const noexcept { return partial != 0; }
  /// The same spec with every pending sum made (what a gradient of this tensor looks like).
  [[nodiscard]] constexpr pspec without_partial() const noexcept {
    pspec s = *this;
    s.partial = 0;
    return s;
  }
  [[nodiscard]] constexpr bool dim_replicated(int d) const noexcept { return dims[d][0] < 0; }
};

/// @brief Converts a spec value into indices of `table`, adding axes; false if the table overflows.
constexpr bool to_pspec(const spec_value& v, axis_table& table, pspec& out) noexcept {
  out = pspec{};
  out.rank = static_cast<std::int8_t>(v.rank);
  for (int d = 0; d < v.rank && d < max_rank; ++d)
    for (int i = 0; i < max_dim_axes; ++i)
      if (!v.dims[d][i].empty()) {
        const int a = table.intern(v.dims[d][i]);
        if (a < 0) return false;
        out.dims[d][i] = static_cast<std::int8_t>(a);
      }
  for (const auto& p : v.partial)
    if (!p.empty()) {
      const int a = table.intern(p);
      if (a < 0) return false;
      out.partial = static_cast<std::uint8_t>(out.partial | (1u << a));
    }
  return true;
}

/// @brief Converts back to names.
[[nodiscard]] constexpr spec_value to_value(const pspec& s, const axis_table& table) noexcept {
  spec_value v;
  v.rank = s.rank;
  for (int d = 0; d < s.rank; ++d)
    for (int i = 0; i < max_dim_axes; ++i)
      if (s.dims[d][i] >= 0) v.dims[d][i] = table.names[s.dims[d][i]];
  int k = 0;
  for (int a = 0; a < table.count; ++a)
    if ((s.partial & (1u << a)) && k < max_dim_axes) v.partial[k++] = table.names[a];
  return detail::canonical(v);
}

} // namespace concerto
