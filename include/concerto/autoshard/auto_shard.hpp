#pragma once
/// @file
/// @brief `autoshard::auto_shard(program)`: a program written by hand, with every placement left
/// to automatic sharding, and the program as written as a choice to start from.
///
/// `auto_` marks single dimensions as decided and keeps the others as constraints. A user who
/// wants the whole program decided (a layout written for another mesh, or none worth keeping)
/// passes it through auto_shard: every dimension of every leaf becomes free, every `.to(...)`
/// keeps the layout its value arrives in until decided (one that pins a pending sum stays as
/// written), and the ZeRO stage is chosen too. The layout the program was written with comes back
/// as a choice, so the search prices it and keeps it unless something is better.
///
/// @code
/// auto whole = autoshard::auto_shard(gpt_tp);  // written for dp x tp with Megatron's specs
/// auto r = autoshard::choose(*whole.program, m, shapes, model, {.seeds = {{"as written", whole.as_written}}});
/// auto step = train::compile(*r.program, m, shapes, optimizer, options);
/// @endcode

#include <concerto/graph/respecify.hpp>

#include <memory>
#include <set>
#include <string>

namespace concerto::autoshard {

/// @brief A program with every placement free, and the program's own placements as a choice.
template <std::size_t N>
struct whole_program {
  std::unique_ptr<graph::program<graph::respecified_size<N>>> program;
  /// Every leaf's spec and every `.to`'s layout as the program wrote them, its ZeRO stage and its
  /// axes' order: respecify(*program, as_written) is the program as written.
  graph::sharding_choice as_written;
};

/// @brief `p` with every dimension of every leaf and of every `.to(...)` (but those pinning a
/// pending sum) left to automatic sharding, and no ZeRO stage written; see the file comment.
template <std::size_t N>
[[nodiscard]] whole_program<N> auto_shard(const graph::program<N>& p) {
  using namespace graph;
  using namespace graph::detail;
  constexpr std::size_t M = graph::respecified_size<N>;
  auto w = retrace(p);
  whole_program<N> out;
  auto& written = out.as_written;
  written.zero_stage = p.zero_stage;
  if (p.zero_stage > 0 && p.zero_axis >= 0) written.zero_axis = std::string(p.axes.names[p.zero_axis].view());
  for (int a = 0; a < p.axes.count; ++a) written.axes.emplace_back(p.axes.names[a].view());
  std::set<std::string> named;
  for (int i = 0; i < w->raw_n; ++i) {
    node& x = w->raw[i];
    const bool open_to = x.op == op_code::to && !x.has(flag_pinned);
    if (!is_leaf(x.op) && !open_to) continue;
    const pspec whole{.rank = x.use.rank};
    const auto every_dim = static_cast<std::uint8_t>((1u << x.use.rank) - 1);
    if (open_to) {
      if (x.free == 0) written.leaves.push_back({graph::redistribution_name(i), to_value(x.use, p.axes)});
      x.use = whole;
      x.free = every_dim;
      continue;
    }
    const std::string name(p.names[x.name].view());
    if (named.insert(name).second) written.leaves.push_back({name, to_value(x.use, p.axes)}); // its auto_ dims replicated, as compiled
    x.use = x.spec = whole;
    x.zero_dim = -1;
    w->free_dims[x.name] = every_dim;
  }
  w->run_passes();
  if (w->err != errc::none)
    fail("auto_shard: the program with every placement free does not compile: " + std::string(message_of(w->err)) + " (at " +
         std::string(describe(*w).view()) + ")");
  out.program = std::make_unique<graph::program<M>>();
  fill(*out.program, *w);
  return out;
}

} // namespace concerto::autoshard
