#pragma once
/// @file
/// @brief What a training step keeps of its program once lowered (plain data, so that the
/// step's code does not depend on the program's size), and messages in the program's words.

#include <concerto/graph/lower.hpp>
#include <concerto/graph/program.hpp>
#include <concerto/mesh/mesh.hpp>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train::detail {

/// What a step needs of its program after lowering: the names, specs and initialisers of its
/// nodes, its axes and its loss. Plain data, so that the step's code does not depend on the
/// program's size N and is compiled once for every model of a trainer (and, in the separately
/// compiled mode, once for all trainers: docs/training.md).
struct program_facts {
  struct node {
    std::string name;   ///< the node's own name (a repeated block's are prefixed per layer)
    std::string repeat; ///< the repeat the node belongs to, empty if none (data leaves: none)
    op_code op = op_code::param;
    pspec spec{};
    std::vector<std::int64_t> global{};    ///< its global shape (no ZeRO padding)
    leaf_init init = leaf_init::automatic; ///< a parameter's rule (running_stats: a batch norm's running statistics)
    std::string written; ///< as the user wrote it: a name, or the op applied to its operands
    std::string written_later; ///< in a repeated block, as layers after the first compute it
  };
  std::vector<std::string> axes; ///< the program's axis names, by its axis index
  std::vector<node> nodes;
  std::string loss;
  std::uint32_t loss_partial = 0; ///< the program axes the loss is pending a sum over
  /// The value the loss compares with its target, as the loss reads it: a cross-entropy's logits
  /// (split over the vocabulary when vocab-parallel), an mse's prediction; of a sum of losses, the first's.
  std::string prediction;
};

template <std::size_t N>
program_facts facts_of(const graph::program<N>& p) {
  program_facts f;
  for (int a = 0; a < p.axes.count; ++a) f.axes.emplace_back(p.axes.names[a].view());
  for (int i = 0; i < p.size; ++i) {
    const auto& x = p.nodes[i];
    program_facts::node n;
    n.name = p.name_of(i);
    if (x.block >= 0 && x.op != op_code::data) n.repeat = std::string(p.repeats[x.block].name.view());
    n.op = x.op;
    n.spec = x.spec;
    if (x.op == op_code::param) n.init = p.inits[x.name];
    if (x.op == op_code::state && x.dim == graph::state_running) n.init = leaf_init::running_stats;
    // describe() looks through the collectives the compiler inserted; name the one that is here.
    const auto as_written = [&](bool later_layer) {
      return graph::is_redistribution(x.op) && x.name < 0
                 ? std::string(to_string(x.op)).append("(").append(p.describe(i, 3, later_layer)).append(")")
                 : p.describe(i, 3, later_layer);
    };
    n.written = as_written(false);
    n.written_later = x.block >= 0 ? as_written(true) : n.written;
    f.nodes.push_back(std::move(n));
  }
  f.loss = p.name_of(p.loss);
  f.loss_partial = p.nodes[p.loss].spec.partial;
  int loss = p.loss;
  while (p.nodes[loss].op == op_code::add || graph::is_redistribution(p.nodes[loss].op)) loss = p.nodes[loss].in[0];
  int read = p.nodes[loss].in[0];
  if (p.nodes[loss].op == op_code::vocab_ce_loss) { // from the pieces: the sum of exponentials' logits
    while (graph::is_redistribution(p.nodes[read].op)) read = p.nodes[read].in[0];
    read = p.nodes[read].in[0];
  }
  if (read >= 0) f.prediction = p.name_of(read);
  return f;
}

/// A program lowered for a step: its facts and its graph.
struct lowered_program {
  program_facts facts;
  ir::graph graph;
};

// Every step's program goes through the one size of graph/lower.hpp (lowering_size), so that
// this, like the step itself, is compiled once (and, in the separately compiled mode, in the
// library only).
template <std::size_t N>
lowered_program lower_for_step(const graph::program<N>& p, const shape_map& shapes, const mesh& m,
                               const lower_options& options) {
  lowered_program out{facts_of(p), graph::detail::lower_sized(p, shapes, m, options)};
  const auto global = graph::detail::global_shapes(p, shapes, options);
  for (std::size_t i = 0; i < out.facts.nodes.size(); ++i) out.facts.nodes[i].global = global[i];
  return out;
}

#ifdef CONCERTO_SEPARATE_COMPILATION
extern template lowered_program lower_for_step<graph::detail::lowering_size>(
    const graph::program<graph::detail::lowering_size>&, const shape_map&, const mesh&, const lower_options&);
#endif

/// Whether `before` (a message up to a generated node name) ends with "<repeat>.<layer>." for
/// a layer after the first.
[[nodiscard]] inline bool later_layer(std::string_view before, std::string_view repeat) {
  if (repeat.empty() || !before.ends_with('.')) return false;
  before.remove_suffix(1);
  std::size_t digits = 0;
  while (digits < before.size() && std::isdigit(static_cast<unsigned char>(before[before.size() - 1 - digits]))) ++digits;
  if (digits == 0) return false;
  const auto layer = before.substr(before.size() - digits);
  before.remove_suffix(digits);
  return before.ends_with(std::string(repeat) + ".") && layer != "0";
}

/// A message about tasks and buffers with the program's words: each generated name in it
/// ("matmul#12", the lowering's name of a node the user did not name) is followed by what the
/// program wrote there, e.g. "matmul#12 = matmul(rmsnorm(…), wq)".
[[nodiscard]] inline std::string as_written(const program_facts& facts, std::string_view message) {
  std::string out;
  std::size_t at = 0;
  while (at < message.size()) {
    const auto hash = message.find('#', at);
    if (hash == std::string_view::npos) break;
    auto begin = hash, end = hash + 1;
    while (begin > at && (std::isalnum(static_cast<unsigned char>(message[begin - 1])) || message[begin - 1] == '_')) --begin;
    while (end < message.size() && std::isdigit(static_cast<unsigned char>(message[end]))) ++end;
    // After a pipelined copy's suffix ("@mb1", "@buf0") and a quoted name's closing quote.
    auto past = end;
    while (past < message.size() && message[past] == '@') {
      auto next = past + 1;
      while (next < message.size() && std::isalnum(static_cast<unsigned char>(message[next]))) ++next;
      past = next;
    }
    if (past < message.size() && message[past] == '\'') ++past;
    out.append(message.substr(at, past - at));
    at = past;
    if (begin == hash || end == hash + 1) continue;
    std::size_t node = 0;
    std::from_chars(message.data() + hash + 1, message.data() + end, node);
    const auto token = message.substr(begin, end - begin);
    if (node >= facts.nodes.size() || facts.nodes[node].name != token) continue;
    // A repeated block's task is "<repeat>.<layer>.<node>": a layer after the first reads the
    // previous layer's output, not the stack's input.
    const auto& n = facts.nodes[node];
    const auto& written = later_layer(message.substr(0, begin), n.repeat) ? n.written_later : n.written;
    if (written != token) out.append(" = ").append(written);
  }
  out.append(message.substr(at));
  return out;
}

} // namespace concerto::train::detail
