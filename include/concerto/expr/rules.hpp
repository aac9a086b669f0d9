#pragma once
/// @file
/// @brief The sharding rules (ir::sharding) over indexed specs: given the input specs, the spec each input
/// must be brought to (the caller inserts the redistribution, see spec/redistribute.hpp) and
/// the output spec, or the mistake that has no meaning.
///
/// The contraction rule is an einsum rule: operands and output have one label per dimension.
/// Along each mesh axis: a label split in both operands stays split (or becomes a pending sum if
/// it is contracted); a contracted label split in one operand only is a mismatch; a replicated
/// operand is sliced locally to match a split batch label; two different output labels split
/// over one axis gather the first operand (the activation) so the weight keeps its layout.

#include <concerto/spec/spec.hpp>

namespace concerto {

/// @brief The mistakes a program can contain; each has a compile-time message (graph/program.hpp).
enum class errc : std::uint8_t {
  none,
  mismatched_contraction, ///< a contracted dimension split over an axis in one operand only
  partial_into_nonlinear, ///< a pinned pending sum fed to a nonlinear op
  rank_mismatch,          ///< an operand's spec has a rank the op cannot take
  unknown_axis,           ///< a spec names an axis that the declared mesh lacks
  too_many_axes,          ///< more than max_axes distinct axes
  leaf_redefined,         ///< two leaves with one name but another kind, spec or initialiser
  loss_not_scalar,        ///< program(...) was given a non-scalar expression
  no_parameters,          ///< nothing to train
  capacity,               ///< internal node capacity exceeded
  repeat_spec_changed,    ///< a repeated block returns another spec than it takes
  repeat_leaf_scope,      ///< a leaf is used both inside and outside a repeated block, or an input inside one
  repeat_nested,          ///< a repeat inside a repeated block
  moe_gates,              ///< moe_dispatch / moe_combine given gates that are not a moe_route's
  axis_order,             ///< a redistribution that would need one dimension's axes in another order
  unbuildable_op,         ///< a node of an op the compiler has no rule or construction for (a bug of concerto's)
};

namespace rules {

struct result {
  errc err = errc::none;
  pspec need[4]{};
  pspec out{};
};

/// Label sets are short char arrays; 0 ends them.
struct labels {
  char l[max_rank + 1]{};
  [[nodiscard]] constexpr int find(char c) const noexcept {
    for (int i = 0; i < max_rank && l[i]; ++i)
      if (l[i] == c) return i;
    return -1;
  }
  [[nodiscard]] constexpr int size() const noexcept {
    int n = 0;
    while (n < max_rank && l[n]) ++n;
    return n;
  }
};

/// Leading batch labels 'a','b',... then the given trailing ones.
[[nodiscard]] constexpr labels make_labels(int rank, char second_last, char last) noexcept {
  labels out;
  for (int i = 0; i < rank - 2 && i < max_rank; ++i) out.l[i] = static_cast<char>('a' + i);
  if (rank >= 2) {
    out.l[rank - 2] = second_last;
    out.l[rank - 1] = last;
  }
  return out;
}

/// @brief The einsum rule (see the file comment). `out` has rank lo.size().
[[nodiscard]] constexpr result contract(const pspec& a, const labels& la, const pspec& b, const labels& lb,
                                        const labels& lo, int axes) noexcept {
  result r;
  r.need[0] = a;
  r.need[1] = b;
  r.out.rank = static_cast<std::int8_t>(lo.size());
  for (int x = 0; x < axes; ++x) {
    int sa = a.state(x), sb = b.state(x);
    if (sa == state_partial && sb != state_replicated) {
      r.need[0].set_state(x, state_replicated); // a pending sum times a split operand has no local meaning
      sa = state_replicated;
    } else if (sb == state_partial && sa != state_replicated) {
      r.need[1].set_state(x, state_replicated);
      sb = state_replicated;
    }
    if (sa == state_partial || sb == state_partial) {
      r.out.set_state(x, state_partial); // linear in each operand
      continue;
    }
    if (sa == state_replicated && sb == state_replicated) continue;
    const char ca = sa >= 0 ? la.l[sa] : 0, cb = sb >= 0 ? lb.l[sb] : 0;
    const auto contracted_shared = [&](char c) { return c && la.find(c) >= 0 && lb.find(c) >= 0 && lo.find(c) < 0; };
    if (ca && cb && ca == cb) {
      r.out.set_state(x, lo.find(ca) >= 0 ? lo.find(ca) : state_partial);
      continue;
    }
    if (contracted_shared(ca) || contracted_shared(cb)) {
      r.err = errc::mismatched_contraction;
      return r;
    }
    if (ca && cb) { // two output labels over one axis: gather the activation operand
      r.need[0].set_state(x, lb.find(cb) >= 0 && la.find(cb) >= 0 ? la.find(cb) : state_replicated);
      r.out.set_state(x, lo.find(cb));
      continue;
    }
    const char c = ca ? ca : cb;
    const int other = ca ? 1 : 0;
    const labels& lother = ca ? lb : la;
    if (lother.find(c) >= 0) r.need[other].set_state(x, lother.find(c)); // slice the replicated operand
    r.out.set_state(x, lo.find(c) >= 0 ? lo.find(c) : state_partial);
  }
  return r;
}

/// @brief conv2d's labels: x [batch, height, width, in], w [kernel_h, kernel_w, in, out], y [batch,
/// out_h, out_w, out]. A product over (kernel_h, kernel_w, in); its gradients are the einsum
/// rule over the same labels (dx from dy and w, dw from x and dy).
inline constexpr labels conv_image{{'b', 'h', 'w', 'c'}};
inline constexpr labels conv_kernel{{'r', 's', 'c', 'o'}};
inline constexpr labels conv_output{{'b', 'h', 'w', 'o'}};

/// @brief conv2d(x, w): the einsum rule with the window's dimensions whole (an image split over
/// height or width would need its neighbours' rows, a kernel split over its rows their offsets).
[[nodiscard]] constexpr result convolution(pspec x, pspec w, int axes) noexcept {
  for (int a = 0; a < axes; ++a) {
    if (x.state(a) == 1 || x.state(a) == 2) x.set_state(a, state_replicated);
    if (w.state(a) == 0 || w.state(a) == 1) w.set_state(a, state_replicated);
  }
  return contract(x, conv_image, w, conv_kernel, conv_output, axes);
}

/// @brief Two operands of one shape combined elementwise and linearly (add, gradient sums).
[[nodiscard]] constexpr result unify(const pspec& a, const pspec& b, int axes) noexcept {
  result r;
  if (a.rank != b.rank) {
    r.err = errc::rank_mismatch;
    return r;
  }
  r.need[0] = a;
  r.need[1] = b;
  for (int x = 0; x < axes; ++x) {
    const int sa = a.state(x), sb = b.state(x);
    if (sa == sb) continue;
    if (sa == state_partial) r.need[0].set_state(x, sb);       // make the sum where the other one lives
    else if (sb == state_partial) r.need[1].set_state(x, sa);
    else if (sa >= 0) r.need[1].set_state(x, sa);              // slice or all-to-all the second
    else r.need[0].set_state(x, sb);                           // slice the replicated first
  }
  r.out = r.need[0];
  return r;
}

/// @brief A nonlinear elementwise op: pending sums must be made first; `pinned` ones are an error.
[[nodiscard]] constexpr result nonlinear(const pspec& a, bool pinned) noexcept {
  result r;
  if (a.has_partial() && pinned) {
    r.err = errc::partial_into_nonlinear;
    return r;
  }
  r.need[0] = a.without_partial();
  r.out = r.need[0];
  return r;
}

/// @brief A nonlinear op that also needs whole rows along `dim` (normalisations, softmax).
[[nodiscard]] constexpr result rowwise(const pspec& a, bool pinned, int dim, int axes) noexcept {
  result r = nonlinear(a, pinned);
  if (r.err != errc::none) return r;
  for (int x = 0; x < axes; ++x)
    if (r.need[0].state(x) == dim) r.need[0].set_state(x, state_replicated);
  r.out = r.need[0];
  return r;
}

/// @brief A vector [n] laid out like the last dimension of `x`.
[[nodiscard]] constexpr pspec like_last_dim(const pspec& x, int axes) noexcept {
  pspec v;
  v.rank = 1;
  for (int a = 0; a < axes; ++a)
    if (x.state(a) == x.rank - 1) v.set_state(a, 0);
  return v;
}

/// @brief The leading dimensions of `x` (all but the last), laid out as in `x`: rope's positions,
/// cross-entropy's labels.
[[nodiscard]] constexpr pspec leading_dims_of(const pspec& x, int axes) noexcept {
  pspec v;
  v.rank = static_cast<std::int8_t>(x.rank - 1);
  for (int a = 0; a < axes; ++a)
    if (const int s = x.state(a); s >= 0 && s < x.rank - 1) v.set_state(a, s);
  return v;
}
/// @brief embedding(ids, table [vocab, hidden]): rows follow the ids; an axis splitting both the
/// ids and the table leaves the table replicated over it; a vocabulary split alone gives a pending
/// sum, a hidden split a split last dimension.
[[nodiscard]] constexpr result embedding(const pspec& ids, const pspec& table, int axes) noexcept {
  result r;
  r.need[0] = ids;
  r.need[1] = table.without_partial();
  r.out.rank = static_cast<std::int8_t>(ids.rank + 1);
  for (int a = 0; a < axes; ++a) {
    const int si = ids.state(a), st = r.need[1].state(a);
    if (si >= 0 && st >= 0) {
      r.need[1].set_state(a, state_replicated);
      r.out.set_state(a, si);
    } else if (si >= 0) r.out.set_state(a, si);
    else if (st == 0) r.out.set_state(a, state_partial);
    else if (st == 1) r.out.set_state(a, ids.rank);
  }
  return r;
}
/// @brief The axes that split any of the given dimensions of `x` (first..last inclusive), as pending sums
/// of a result that sums over those dimensions.
[[nodiscard]] constexpr std::uint8_t axes_splitting(const pspec& x, int first, int last, int axes) noexcept {
  std::uint8_t mask = 0;
  for (int a = 0; a < axes; ++a) {
    const int s = x.state(a);
    if (s >= first && s <= last) mask = static_cast<std::uint8_t>(mask | (1u << a));
  }
  return mask;
}

/// @brief flatten: dims first..last of x as one, split as the first of them; an axis splitting
/// a later one is gathered first (the merged dim's blocks would interleave otherwise).
[[nodiscard]] constexpr result merge(const pspec& x, int first, int last, int axes) noexcept {
  result r;
  r.need[0] = x;
  for (int a = 0; a < axes; ++a)
    if (const int s = x.state(a); s > first && s <= last) r.need[0].set_state(a, state_replicated);
  const int gone = last - first;
  r.out.rank = static_cast<std::int8_t>(x.rank - gone);
  r.out.partial = r.need[0].partial;
  // (The bounds on max_rank hold whenever the caller checked the dims; they let g++ see it when
  // the compiler's passes run at run time, graph/respecify.hpp.)
  for (int d = 0; d < r.out.rank && d < max_rank; ++d)
    if (const int from = d <= first ? d : d + gone; from < max_rank)
      for (int k = 0; k < max_dim_axes; ++k) r.out.dims[d][k] = r.need[0].dims[from][k];
  return r;
}

/// @brief unflatten: dim `dim` of x as two, the first split as it was, the second whole (its
/// rows are whole blocks of the first's: a rank's contiguous block of dim `dim` stays one).
[[nodiscard]] constexpr result unmerge(const pspec& x, int dim) noexcept {
  result r;
  r.need[0] = x;
  r.out.rank = static_cast<std::int8_t>(x.rank + 1);
  r.out.partial = x.partial;
  for (int d = 0; d < r.out.rank && d < max_rank; ++d)
    for (int k = 0; k < max_dim_axes; ++k) r.out.dims[d][k] = d == dim + 1 ? std::int8_t{-1} : x.dims[d <= dim ? d : d - 1][k];
  return r;
}

/// @brief Pooling over the windows of x [batch, h, w, c]: height and width whole (a split is
/// gathered: windows cross it), the batch and the channels as they are. The average is linear (a
/// pending sum goes through); the maximum is not.
[[nodiscard]] constexpr result pooling(const pspec& x, bool linear, bool pinned, int axes) noexcept {
  result r;
  if (linear) r.need[0] = x;
  else if (r = nonlinear(x, pinned); r.err != errc::none) return r;
  for (int a = 0; a < axes; ++a)
    if (const int s = r.need[0].state(a); s == 1 || s == 2) r.need[0].set_state(a, state_replicated);
  r.out = r.need[0];
  return r;
}

/// @brief sum / mean over `dim`: the axes splitting it become pending sums, later dims move down.
[[nodiscard]] constexpr result reduce_dim(const pspec& x, int dim, int axes) noexcept {
  result r;
  r.need[0] = x;
  r.out.rank = static_cast<std::int8_t>(x.rank - 1);
  r.out.partial = static_cast<std::uint8_t>(x.partial | axes_splitting(x, dim, dim, axes));
  for (int d = 0; d < r.out.rank; ++d)
    for (int k = 0; k < max_dim_axes; ++k) r.out.dims[d][k] = x.dims[d < dim ? d : d + 1][k];
  return r;
}

/// @brief A table of x's last `rank` dims laid out as they are in x (a broadcast operand).
[[nodiscard]] constexpr pspec like_trailing_dims(const pspec& x, int rank, int axes) noexcept {
  pspec v;
  v.rank = static_cast<std::int8_t>(rank);
  for (int a = 0; a < axes; ++a)
    if (const int s = x.state(a); s >= x.rank - rank) v.set_state(a, s - (x.rank - rank));
  return v;
}

/// @brief The axes splitting `dim` of x made whole (gathered), the others kept.
[[nodiscard]] constexpr pspec whole_dim(pspec x, int dim, int axes) noexcept {
  for (int a = 0; a < axes; ++a)
    if (x.state(a) == dim) x.set_state(a, state_replicated);
  return x;
}

/// @brief concat along `dim` of a (rank ra) and b (rank rb): the higher-rank operand whole along
/// the dim, its pending sums made; the other laid out like it, or, of lower rank, like its last
/// dims (a table repeated over the leading ones).
[[nodiscard]] constexpr result join(const pspec& a, bool pinned_a, const pspec& b, bool pinned_b, int dim, int axes) noexcept {
  const bool a_full = a.rank >= b.rank;
  const pspec& full = a_full ? a : b;
  const pspec& table = a_full ? b : a;
  result r = nonlinear(full, a_full ? pinned_a : pinned_b);
  if (r.err != errc::none) return r;
  if ((a_full ? pinned_b : pinned_a) && table.has_partial()) {
    r.err = errc::partial_into_nonlinear;
    return r;
  }
  const pspec laid = whole_dim(r.need[0], dim, axes);
  const pspec other = table.rank == full.rank ? laid : like_trailing_dims(laid, table.rank, axes);
  r.need[a_full ? 0 : 1] = laid;
  r.need[a_full ? 1 : 0] = other;
  r.out = laid;
  return r;
}

/// @brief A slice of `dim`: the dim whole, the rest as it is; linear (a pending sum stays).
[[nodiscard]] constexpr result part(const pspec& x, int dim, int axes) noexcept {
  result r;
  r.need[0] = whole_dim(x, dim, axes);
  r.out = r.need[0];
  return r;
}

/// @brief The spec of `s`'s tensor with dimensions `d` and `d + 1` swapped (transpose<d>).
[[nodiscard]] constexpr pspec swap_dims(pspec s, int d) noexcept {
  if (d < 0 || d + 1 >= max_rank) return s; // callers check; the bound is for g++'s eyes at run time
  for (int i = 0; i < max_dim_axes; ++i) {
    const auto a = s.dims[d][i];
    s.dims[d][i] = s.dims[d + 1][i];
    s.dims[d + 1][i] = a;
  }
  return s;
}

/// @brief `s` with dimensions `first` and later whole (the axes splitting them replicated).
[[nodiscard]] constexpr pspec keep_dims(pspec s, int first, int axes) noexcept {
  for (int a = 0; a < axes; ++a)
    if (s.state(a) >= first) s.set_state(a, state_replicated);
  return s;
}

/// @brief moe_dispatch(x[groups, tokens, h], gates): a group's tokens whole, the gates split like
/// x's groups; the output [experts, groups·capacity, h] has x's groups split on dimension 1
/// (in x's order of axes) and x's hidden split on dimension 2.
[[nodiscard]] constexpr result dispatch(const pspec& x, bool pinned) noexcept {
  result r = nonlinear(x, pinned);
  if (r.err != errc::none) return r;
  pspec xs = r.need[0];
  for (auto& a : xs.dims[1]) a = -1;
  r.need[0] = xs;
  r.need[1] = pspec{};
  r.need[1].rank = 3;
  r.out = pspec{};
  r.out.rank = 3;
  for (int i = 0; i < max_dim_axes; ++i) {
    r.need[1].dims[0][i] = xs.dims[0][i];
    r.out.dims[1][i] = xs.dims[0][i];
    r.out.dims[2][i] = xs.dims[2][i];
  }
  return r;
}

/// @brief moe_combine(y[experts, groups·capacity, h], gates[groups, tokens, experts]): the gates
/// with a group's tokens and the experts whole; y with its groups split as the gates' (the
/// all-to-all back from an expert split), its experts whole, its hidden split kept; the output
/// [groups, tokens, h] split as the gates on the groups and as y on the hidden.
[[nodiscard]] constexpr result combine(const pspec& y, const pspec& gates, bool pinned, int axes) noexcept {
  result r = nonlinear(y, pinned);
  if (r.err != errc::none) return r;
  const pspec g = keep_dims(gates.without_partial(), 1, axes);
  r.need[1] = g;
  pspec need{};
  need.rank = 3;
  r.out = pspec{};
  r.out.rank = 3;
  int k = 0;
  for (int i = 0; i < max_dim_axes; ++i) {
    need.dims[1][i] = g.dims[0][i];
    r.out.dims[0][i] = g.dims[0][i];
    const auto a = r.need[0].dims[2][i];
    if (a >= 0 && g.state(a) == state_replicated) {
      need.dims[2][k] = a;
      r.out.dims[2][k++] = a;
    }
  }
  r.need[0] = need;
  return r;
}

} // namespace rules
} // namespace concerto
