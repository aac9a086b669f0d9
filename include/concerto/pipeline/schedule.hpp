#pragma once
/// @file
/// @brief Pipeline schedules: the micro-batch problem of a pipelined step, its exact replay,
/// its verifier and its lower bound.
///
/// A pipelined step splits the model's layers into contiguous chunks; chunk c runs on stage
/// `c % stages` (one chunk per stage, or `virtual_stages` of them, interleaved). Each
/// micro-batch passes forward through every chunk (F), then backward: the input-gradient part
/// (B), which the previous chunk waits for, and the weight-gradient part (W), which nobody
/// waits for. A schedule is each stage's order of its blocks (chunk, micro-batch, pass); with
/// `split_backward` false, B and W are one block (B's time is B + W), as in GPipe and 1F1B.
///
/// Between chunks, one message per micro-batch and direction: F(c, m) sends its output to
/// F(c + 1, m), B(c, m) sends its input gradient to B(c - 1, m). A message crosses the link from
/// its sender's stage to its receiver's, one message at a time per direction, in the order the
/// sender finishes its blocks. After its chunks' last backward block, a stage reduces their
/// gradients over data parallelism (one chunk at a time, on its own lane) and then runs the
/// optimizer; the step ends when the last stage's optimizer does.
///
/// Memory: a micro-batch's activations in chunk c (`activation_bytes`) are held from the start
/// of F(c, m); after B(c, m) only `weight_grad_share` of them remain (what W reads), freed when
/// W(c, m) ends (all at once after a fused B).
///
/// docs/pipeline.md defines the policies and gives the numbers.
///
/// @code
/// pipeline::problem p = pipeline::uniform_problem(4, 8, {.forward_us = 1, .input_grad_us = 1, .weight_grad_us = 1});
/// auto t = pipeline::simulate(p, pipeline::one_f_one_b(p));   // (8 + 3) × 3 us
/// @endcode

#include <concerto/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::pipeline {

/// @brief The three passes of a micro-batch through a chunk.
enum class pass : std::uint8_t { forward, input_grad, weight_grad };
[[nodiscard]] constexpr std::string_view letter(pass p) noexcept {
  return p == pass::forward ? "F" : p == pass::input_grad ? "B" : "W";
}

/// @brief What one chunk of layers costs for one micro-batch on its stage.
struct chunk_cost {
  double forward_us = 0;
  double input_grad_us = 0;
  double weight_grad_us = 0;
  double activation_bytes = 0;  ///< held per micro-batch from F's start
  double weight_grad_share = 0; ///< fraction of them still held between B and W (what W reads)
  double grad_sync_us = 0;      ///< the data-parallel reduction of the chunk's gradients, once per step
  double optimizer_us = 0;      ///< the optimizer over the chunk's parameters, once per step
  int layers = 0;               ///< transformer blocks in the chunk (embedding and head not counted)
};

/// @brief What a task of a pipelined step is priced as: work of one of a micro-batch's passes, or
/// work done once per step (the data-parallel gradient reduction, the optimizer).
enum class work : std::uint8_t { forward, input_grad, weight_grad, grad_sync, optimizer };

/// @brief Charges `us` of work `w` to chunk `c`: the one pricing of pipelined work, which the
/// stage split (problem_of) and the benchmark workloads (make_problem) both use.
inline void charge(chunk_cost& c, work w, double us) {
  switch (w) {
  case work::forward: c.forward_us += us; return;
  case work::input_grad: c.input_grad_us += us; return;
  case work::weight_grad: c.weight_grad_us += us; return;
  case work::grad_sync: c.grad_sync_us += us; return;
  case work::optimizer: c.optimizer_us += us; return;
  }
}

/// @brief One pipelined training step: stages, chunks and micro-batches with their costs.
struct problem {
  std::string name;
  int stages = 1;         ///< devices along the pipeline axis
  int virtual_stages = 1; ///< chunks per stage (interleaved schedules use more than one)
  int microbatches = 1;
  std::vector<chunk_cost> chunks; ///< stages × virtual_stages, in model order; chunk c runs on stage c % stages
  std::vector<double> send_us;    ///< per boundary c → c + 1: one micro-batch's message (either direction)
  double memory_cap_bytes = 0;    ///< per stage, for the activations in flight; 0: no cap

  [[nodiscard]] int chunk_count() const noexcept { return stages * virtual_stages; }
  [[nodiscard]] int stage_of(int chunk) const noexcept { return chunk % stages; }
  [[nodiscard]] const chunk_cost& chunk(int c) const { return chunks.at(static_cast<std::size_t>(c)); }
  /// The optimizer time of a stage: of all its chunks.
  [[nodiscard]] double optimizer_us(int stage) const {
    double sum = 0;
    for (int c = stage; c < chunk_count(); c += stages) sum += chunk(c).optimizer_us;
    return sum;
  }

  /// Throws concerto::error naming the first field that does not fit.
  void check() const {
    const auto where = "pipeline problem '" + name + "': ";
    if (stages < 1) fail(where + "stages = " + std::to_string(stages) + "; at least 1");
    if (virtual_stages < 1) fail(where + "virtual_stages = " + std::to_string(virtual_stages) + "; at least 1");
    if (microbatches < 1) fail(where + "microbatches = " + std::to_string(microbatches) + "; at least 1");
    if (chunks.size() != static_cast<std::size_t>(chunk_count()))
      fail(where + std::to_string(chunks.size()) + " chunk costs for " + std::to_string(stages) + " stages × " +
           std::to_string(virtual_stages) + " virtual stages");
    if (send_us.size() + 1 != chunks.size())
      fail(where + std::to_string(send_us.size()) + " message costs for " + std::to_string(chunks.size()) +
           " chunks (one per boundary)");
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const auto& k = chunks[c];
      if (k.forward_us < 0 || k.input_grad_us < 0 || k.weight_grad_us < 0 || k.activation_bytes < 0 ||
          k.grad_sync_us < 0 || k.optimizer_us < 0)
        fail(where + "chunk " + std::to_string(c) + " has a negative cost");
      if (k.weight_grad_share < 0 || k.weight_grad_share > 1)
        fail(where + "chunk " + std::to_string(c) + " has weight_grad_share " + std::to_string(k.weight_grad_share) +
             "; a fraction in [0, 1]");
    }
    for (const auto s : send_us)
      if (s < 0) fail(where + "a message has a negative cost");
    if (memory_cap_bytes < 0) fail(where + "memory_cap_bytes is negative");
  }
};

/// @brief One block of a stage's order.
struct block {
  int chunk = 0;
  int microbatch = 0;
  pass kind = pass::forward;
  friend bool operator==(const block&, const block&) = default;
};

[[nodiscard]] inline std::string to_string(const block& b) {
  return std::string(letter(b.kind)) + "(chunk " + std::to_string(b.chunk) + ", micro-batch " +
         std::to_string(b.microbatch) + ")";
}

/// @brief A pipeline schedule: each stage's blocks in the order it runs them.
struct schedule {
  std::string policy;
  bool split_backward = false; ///< W blocks of their own; otherwise B includes W
  std::vector<std::vector<block>> order; ///< per stage
};

/// @brief A schedule replayed: every block's times, every stage's peak memory and the step.
struct timing {
  double step_us = 0;
  std::vector<double> start_us, end_us;     ///< per block, indexed by block_index
  std::vector<double> peak_memory_bytes;    ///< per stage
};

/// Index of a block in timing's per-block vectors.
[[nodiscard]] inline std::size_t block_index(const problem& p, const block& b) {
  return (static_cast<std::size_t>(b.chunk) * static_cast<std::size_t>(p.microbatches) +
          static_cast<std::size_t>(b.microbatch)) * 3 + static_cast<std::size_t>(b.kind);
}
/// The block of an index (block_index's inverse).
[[nodiscard]] inline block block_at(const problem& p, std::size_t index) {
  const auto passes = static_cast<int>(index % 3), run = static_cast<int>(index / 3);
  return {run / p.microbatches, run % p.microbatches, static_cast<pass>(passes)};
}

/// The duration of a block under a schedule (a fused B carries W's time).
[[nodiscard]] inline double duration_us(const problem& p, const block& b, bool split_backward) {
  const auto& k = p.chunk(b.chunk);
  switch (b.kind) {
  case pass::forward: return k.forward_us;
  case pass::input_grad: return split_backward ? k.input_grad_us : k.input_grad_us + k.weight_grad_us;
  case pass::weight_grad: return k.weight_grad_us;
  }
  return 0;
}

/// The block that receives a block's message: F(c, m) sends to F(c + 1, m), B(c, m) to
/// B(c - 1, m); nullopt for W and at the ends of the chain. The message crosses boundary
/// min(c, receiver's c).
[[nodiscard]] inline std::optional<block> receiver(const problem& p, const block& b) {
  if (b.kind == pass::forward && b.chunk + 1 < p.chunk_count()) return block{b.chunk + 1, b.microbatch, pass::forward};
  if (b.kind == pass::input_grad && b.chunk > 0) return block{b.chunk - 1, b.microbatch, pass::input_grad};
  return std::nullopt;
}

/// @brief A problem with `stages` equal chunks (one per stage) and free messages.
[[nodiscard]] inline problem uniform_problem(int stages, int microbatches, chunk_cost cost, double send_us = 0) {
  problem p;
  p.name = "uniform";
  p.stages = stages;
  p.microbatches = microbatches;
  p.chunks.assign(static_cast<std::size_t>(std::max(stages, 0)), cost);
  p.send_us.assign(static_cast<std::size_t>(std::max(stages - 1, 0)), send_us);
  return p;
}

/// @brief How many layers each of `parts` contiguous chunks gets: as even as possible, the
/// extra layers going to the middle chunks first, then the last, then the first (the end
/// chunks also hold the embedding and the head, as Llama 3's 126 layers over 16 stages
/// give 7 to the first and last stage and 8 to the others).
[[nodiscard]] inline std::vector<int> split_layers(int layers, int parts) {
  if (parts < 1) fail("split_layers: " + std::to_string(parts) + " parts; at least 1");
  if (layers < parts)
    fail("cannot split " + std::to_string(layers) + " layers over " + std::to_string(parts) +
         " pipeline chunks: each chunk needs at least one layer");
  std::vector<int> out(static_cast<std::size_t>(parts), layers / parts);
  int extra = layers % parts;
  for (int c = 1; c + 1 < parts && extra > 0; ++c, --extra) ++out[static_cast<std::size_t>(c)];
  if (extra > 0 && parts > 1) { ++out.back(); --extra; }
  if (extra > 0) ++out.front();
  return out;
}

namespace detail {

// The replay's graph: blocks of the schedule and the messages between them, with the stage
// and link orders as edges; times are longest paths. Streams: stage st is stream st, the link
// between an ordered pair of stages a stream after them.
struct replay_graph {
  std::vector<double> duration;
  std::vector<int> stream;
  std::vector<int> block_of;  // per node: the block's index, or -1 for a message
  std::vector<int> sender;    // per node: a message's sending block node, -1 for a block
  std::vector<int> message_to; // per block index: the node of the message it receives, or -1
  std::vector<std::vector<int>> succ, pred;
  std::vector<int> node;      // per block index: its node, or -1 when the schedule has no such block
  int streams = 0;
  int add(double d, int on_stream, int block) {
    duration.push_back(d);
    stream.push_back(on_stream);
    block_of.push_back(block);
    sender.push_back(-1);
    succ.emplace_back();
    pred.emplace_back();
    return static_cast<int>(duration.size()) - 1;
  }
  void edge(int from, int to) {
    if (from < 0 || to < 0) return;
    succ[static_cast<std::size_t>(from)].push_back(to);
    pred[static_cast<std::size_t>(to)].push_back(from);
  }
  [[nodiscard]] std::size_t size() const noexcept { return duration.size(); }
};

inline void check_orders(const problem& p, const schedule& s) {
  const auto where = "pipeline schedule '" + s.policy + "': ";
  if (s.order.size() != static_cast<std::size_t>(p.stages))
    fail(where + std::to_string(s.order.size()) + " stage orders for " + std::to_string(p.stages) + " stages");
  std::vector<char> seen(static_cast<std::size_t>(p.chunk_count() * p.microbatches * 3), 0);
  for (int st = 0; st < p.stages; ++st)
    for (const auto& b : s.order[static_cast<std::size_t>(st)]) {
      if (b.chunk < 0 || b.chunk >= p.chunk_count() || b.microbatch < 0 || b.microbatch >= p.microbatches)
        fail(where + "stage " + std::to_string(st) + " holds " + to_string(b) + ", which the problem does not have");
      if (p.stage_of(b.chunk) != st)
        fail(where + "stage " + std::to_string(st) + " holds " + to_string(b) + ", a block of stage " +
             std::to_string(p.stage_of(b.chunk)));
      if (b.kind == pass::weight_grad && !s.split_backward)
        fail(where + "stage " + std::to_string(st) + " holds " + to_string(b) +
             " but the schedule does not split the backward (its B blocks include W)");
      auto& mark = seen[block_index(p, b)];
      if (mark) fail(where + "stage " + std::to_string(st) + " runs " + to_string(b) + " twice");
      mark = 1;
    }
  for (int c = 0; c < p.chunk_count(); ++c)
    for (int m = 0; m < p.microbatches; ++m)
      for (const auto k : {pass::forward, pass::input_grad, pass::weight_grad}) {
        if (k == pass::weight_grad && !s.split_backward) continue;
        const block b{c, m, k};
        if (!seen[block_index(p, b)])
          fail(where + "stage " + std::to_string(p.stage_of(c)) + " never runs " + to_string(b));
      }
}

// The schedule's blocks and messages as one graph (orders checked first).
inline replay_graph build_replay(const problem& p, const schedule& s) {
  replay_graph g;
  g.node.assign(static_cast<std::size_t>(p.chunk_count() * p.microbatches * 3), -1);
  g.message_to = g.node;
  for (int st = 0; st < p.stages; ++st)
    for (const auto& b : s.order[static_cast<std::size_t>(st)])
      g.node[block_index(p, b)] = g.add(duration_us(p, b, s.split_backward), st, static_cast<int>(block_index(p, b)));
  const auto at = [&](int c, int m, pass k) { return g.node[block_index(p, {c, m, k})]; };
  for (const auto& order : s.order)
    for (std::size_t i = 1; i < order.size(); ++i) g.edge(at(order[i - 1].chunk, order[i - 1].microbatch, order[i - 1].kind),
                                                           at(order[i].chunk, order[i].microbatch, order[i].kind));
  // Data dependencies; a message is a node on its sender's outgoing link, in the sender's order.
  std::map<std::pair<int, int>, std::pair<int, int>> links; // (from, to) -> (stream, last message + 1)
  for (const auto& order : s.order)
    for (const auto& b : order) {
      const int self = at(b.chunk, b.microbatch, b.kind);
      if (b.kind == pass::input_grad) g.edge(at(b.chunk, b.microbatch, pass::forward), self);
      if (b.kind == pass::weight_grad) g.edge(at(b.chunk, b.microbatch, pass::input_grad), self);
      const auto to = receiver(p, b);
      if (!to) continue;
      const auto it = links.try_emplace({p.stage_of(b.chunk), p.stage_of(to->chunk)}, p.stages + static_cast<int>(links.size()), 0).first;
      const int msg = g.add(p.send_us[static_cast<std::size_t>(std::min(b.chunk, to->chunk))], it->second.first, -1);
      g.edge(self, msg);
      g.edge(msg, at(to->chunk, to->microbatch, to->kind));
      g.sender[static_cast<std::size_t>(msg)] = self;
      g.message_to[block_index(p, *to)] = msg;
      if (it->second.second > 0) g.edge(it->second.second - 1, msg);
      it->second.second = msg + 1;
    }
  g.streams = p.stages + static_cast<int>(links.size());
  return g;
}

// Earliest start of every node (longest paths, in Kahn's order). With a cycle, the nodes on or
// behind it keep a positive count of unfinished predecessors in `waiting`.
struct longest_paths {
  std::vector<double> start;
  std::vector<int> waiting;
  bool acyclic = true;
};
inline longest_paths node_starts(const replay_graph& g) {
  longest_paths r{std::vector<double>(g.size(), 0), std::vector<int>(g.size()), true};
  std::vector<int> ready;
  for (std::size_t i = 0; i < g.size(); ++i)
    if ((r.waiting[i] = static_cast<int>(g.pred[i].size())) == 0) ready.push_back(static_cast<int>(i));
  std::size_t done = 0;
  while (!ready.empty()) {
    const auto u = static_cast<std::size_t>(ready.back());
    ready.pop_back();
    ++done;
    for (const auto v : g.succ[u]) {
      auto& sv = r.start[static_cast<std::size_t>(v)];
      sv = std::max(sv, r.start[u] + g.duration[u]);
      if (--r.waiting[static_cast<std::size_t>(v)] == 0) ready.push_back(v);
    }
  }
  r.acyclic = done == g.size();
  return r;
}

// Per link (an ordered pair of different stages) and sending pass (F: activations, B: input
// gradients), the link's messages, each named by its sending block: in the sender's order, and
// in the order the receiver's blocks take them. One pass over the orders.
struct link_orders {
  std::vector<std::vector<block>> sent, received; // at link_index
};
[[nodiscard]] inline std::size_t link_index(const problem& p, int from, int to, pass kind) {
  return (static_cast<std::size_t>(from) * static_cast<std::size_t>(p.stages) + static_cast<std::size_t>(to)) * 2 +
         (kind == pass::forward ? 0 : 1);
}
[[nodiscard]] inline link_orders link_messages(const problem& p, const schedule& s) {
  const auto links = static_cast<std::size_t>(p.stages) * static_cast<std::size_t>(p.stages) * 2;
  link_orders out{std::vector<std::vector<block>>(links), std::vector<std::vector<block>>(links)};
  for (int st = 0; st < p.stages; ++st)
    for (const auto& b : s.order[static_cast<std::size_t>(st)]) {
      if (b.kind == pass::weight_grad) continue;
      if (const auto r = receiver(p, b); r && p.stage_of(r->chunk) != st)
        out.sent[link_index(p, st, p.stage_of(r->chunk), b.kind)].push_back(b);
      const int c = b.kind == pass::forward ? b.chunk - 1 : b.chunk + 1; // the chunk it receives from
      if (c >= 0 && c < p.chunk_count() && p.stage_of(c) != st)
        out.received[link_index(p, p.stage_of(c), st, b.kind)].push_back({c, b.microbatch, b.kind});
    }
  return out;
}

} // namespace detail

/// @brief Replays a schedule exactly (no contention between stages; a stage runs one block at
/// a time). Throws concerto::error when an order misses or repeats a block, holds another
/// stage's block, or deadlocks (naming each stage's first block that can never start).
[[nodiscard]] inline timing simulate(const problem& p, const schedule& s);

namespace detail {

// simulate without checking the problem and the orders again (verify has).
inline timing replay(const problem& p, const schedule& s) {
  const auto n_blocks = static_cast<std::size_t>(p.chunk_count() * p.microbatches * 3);
  const auto g = build_replay(p, s);
  const auto& node = g.node;
  const auto paths = node_starts(g);
  if (!paths.acyclic) {
    // Kahn's order stops at the blocks on a cycle; name each stage's first one.
    std::string msg = "pipeline schedule '" + s.policy + "' deadlocks:";
    for (int st = 0; st < p.stages; ++st)
      for (const auto& b : s.order[static_cast<std::size_t>(st)])
        if (paths.waiting[static_cast<std::size_t>(node[block_index(p, b)])] > 0) {
          msg += " stage " + std::to_string(st) + " waits for ever at " + to_string(b) + ";";
          break;
        }
    msg.pop_back();
    fail(msg);
  }
  timing t;
  t.start_us.assign(n_blocks, 0);
  t.end_us.assign(n_blocks, 0);
  t.peak_memory_bytes.assign(static_cast<std::size_t>(p.stages), 0);
  for (std::size_t i = 0; i < n_blocks; ++i)
    if (const auto u = node[i]; u >= 0) {
      t.start_us[i] = paths.start[static_cast<std::size_t>(u)];
      t.end_us[i] = t.start_us[i] + g.duration[static_cast<std::size_t>(u)];
    }
  for (int st = 0; st < p.stages; ++st) {
    const auto& order = s.order[static_cast<std::size_t>(st)];
    // Memory: +a at F's start, -(1 - share)·a at B's end, -share·a at W's end (all at a fused B).
    std::vector<std::pair<double, double>> events;
    double last_block_end = 0;
    std::map<int, double> last_backward; // chunk -> end of its last backward block
    for (const auto& b : order) {
      const auto i = block_index(p, b);
      const auto& k = p.chunk(b.chunk);
      last_block_end = std::max(last_block_end, t.end_us[i]);
      if (b.kind == pass::forward) events.emplace_back(t.start_us[i], k.activation_bytes);
      if (b.kind == pass::input_grad)
        events.emplace_back(t.end_us[i], -k.activation_bytes * (s.split_backward ? 1 - k.weight_grad_share : 1.0));
      if (b.kind == pass::weight_grad) events.emplace_back(t.end_us[i], -k.activation_bytes * k.weight_grad_share);
      if (b.kind != pass::forward) last_backward[b.chunk] = std::max(last_backward[b.chunk], t.end_us[i]);
    }
    std::sort(events.begin(), events.end()); // at equal times frees (negative) come first
    double held = 0, peak = 0;
    for (const auto& [time, delta] : events) peak = std::max(peak, held += delta);
    t.peak_memory_bytes[static_cast<std::size_t>(st)] = peak;
    // Gradient reductions in the order the chunks finish, then the optimizer.
    std::vector<std::pair<double, int>> finished;
    for (const auto& [c, e] : last_backward) finished.emplace_back(e, c);
    std::sort(finished.begin(), finished.end());
    double lane = 0;
    for (const auto& [e, c] : finished) lane = std::max(lane, e) + p.chunk(c).grad_sync_us;
    t.step_us = std::max(t.step_us, std::max(last_block_end, lane) + p.optimizer_us(st));
  }
  return t;
}

} // namespace detail

inline timing simulate(const problem& p, const schedule& s) {
  p.check();
  detail::check_orders(p, s);
  return detail::replay(p, s);
}

/// @brief The largest per-stage peak of a replay.
[[nodiscard]] inline double peak_memory(const timing& t) {
  return t.peak_memory_bytes.empty() ? 0 : *std::max_element(t.peak_memory_bytes.begin(), t.peak_memory_bytes.end());
}

/// @brief Checks a schedule before it runs: every block once on its own stage; every pair of
/// neighbouring stages sends and receives each boundary's messages in the same micro-batch
/// order (a mismatch names both stages, the boundary and the first position that differs),
/// and, where several chunk boundaries share a link (chunks interleaved over the stages), the
/// link's messages in one order at both ends (a mismatch names both stages and the first
/// message that differs); no deadlock; every stage's peak within the problem's memory cap.
/// Returns the replay.
inline timing verify(const problem& p, const schedule& s) {
  p.check();
  detail::check_orders(p, s);
  const auto sequence = [&](int chunk, pass kind) {
    std::vector<int> out;
    for (const auto& b : s.order[static_cast<std::size_t>(p.stage_of(chunk))])
      if (b.chunk == chunk && b.kind == kind) out.push_back(b.microbatch);
    return out;
  };
  const auto join = [](const std::vector<int>& v) {
    std::string out;
    for (std::size_t i = 0; i < v.size() && i < 12; ++i) {
      if (i > 0) out += ',';
      out += std::to_string(v[i]);
    }
    return v.size() > 12 ? out + ",..." : out;
  };
  for (int c = 0; c + 1 < p.chunk_count(); ++c)
    for (const auto kind : {pass::forward, pass::input_grad}) {
      // Forward messages go c -> c + 1, after F(c) and before F(c + 1); gradients the other way.
      const bool fwd = kind == pass::forward;
      const int from = fwd ? c : c + 1, to = fwd ? c + 1 : c;
      const auto sent = sequence(from, kind), received = sequence(to, kind);
      if (sent == received) continue;
      std::size_t i = 0;
      while (i < sent.size() && i < received.size() && sent[i] == received[i]) ++i;
      fail("pipeline schedule '" + s.policy + "': stage " + std::to_string(p.stage_of(from)) + " sends the " +
           (fwd ? "activations" : "input gradients") + " of chunk " + std::to_string(from) + " in micro-batch order " +
           join(sent) + " but stage " + std::to_string(p.stage_of(to)) + " receives them for chunk " +
           std::to_string(to) + " in order " + join(received) + " (first difference at message " + std::to_string(i) +
           "); with untagged point-to-point messages (NCCL) the two stages would exchange the wrong tensors or hang");
    }
  // With several chunks per stage, several boundaries share a link: stage a's activations for
  // stage b come from every chunk of a whose successor lies on b, and one lane carries them all
  // (the stages' plans issue a link's messages in their blocks' order, values forward and
  // gradients back on lanes of their own: pipeline/stages.hpp). The two ends must then agree on
  // how the boundaries interleave, not only on each boundary's micro-batch order (above): else
  // the training step's check of the stages' plans (train::detail::check_stage_agreement) stops
  // the run, and without that check a stage would wait for ever or read another tensor.
  if (p.virtual_stages > 1) { // with one chunk per stage a link carries one boundary, checked above
    const auto links = detail::link_messages(p, s);
    for (int from = 0; from < p.stages; ++from)
      for (int to = 0; to < p.stages; ++to)
        for (const auto kind : {pass::forward, pass::input_grad}) {
          if (from == to) continue;
          const auto& sent = links.sent[detail::link_index(p, from, to, kind)];
          const auto& received = links.received[detail::link_index(p, from, to, kind)];
          if (sent == received) continue;
          std::size_t i = 0;
          while (i < sent.size() && i < received.size() && sent[i] == received[i]) ++i;
          const auto named = [&](const std::vector<block>& v) {
            return i < v.size() ? "the message of " + to_string(v[i]) : std::string("none");
          };
          fail("pipeline schedule '" + s.policy + "': stage " + std::to_string(from) + " sends its " +
               (kind == pass::forward ? "activations" : "input gradients") + " for stage " + std::to_string(to) +
               " in another order than stage " + std::to_string(to) + " receives them: message " + std::to_string(i) +
               " on that link is " + named(sent) + " at the sender but " + named(received) +
               " at the receiver (several chunk boundaries share the link); the two stages' plans would disagree on "
               "their messages");
        }
  }
  auto t = detail::replay(p, s);
  if (p.memory_cap_bytes > 0)
    for (int st = 0; st < p.stages; ++st)
      if (t.peak_memory_bytes[static_cast<std::size_t>(st)] > p.memory_cap_bytes * (1 + 1e-9))
        fail("pipeline schedule '" + s.policy + "': stage " + std::to_string(st) + " holds " +
             std::to_string(t.peak_memory_bytes[static_cast<std::size_t>(st)] / 1048576.0) +
             " MiB of activations at its peak, over the cap of " + std::to_string(p.memory_cap_bytes / 1048576.0) + " MiB");
  return t;
}

/// @brief A lower bound on any schedule's step, whatever its order (with the backward split,
/// which can only help), within the problem's memory cap.
///
/// For each stage: nothing starts before the first micro-batch's forward reaches its first
/// chunk (`head`), and then all its blocks run one at a time, the gradient reduction of the
/// chunk that finishes last (at least the smallest of its chunks') and its optimizer; and after its
/// last B the gradient still has to travel down to chunk 0 (the B of every chunk before, the
/// messages between them), where W and the gradient reduction and optimizer of chunk 0's
/// stage follow. Under a memory cap, with one chunk per stage, a stage can run only the
/// forwards that fit in the cap before its first gradient can arrive. Also the path of one
/// micro-batch through every chunk and back.
[[nodiscard]] inline double lower_bound(const problem& p) {
  p.check();
  const int C = p.chunk_count();
  const double M = p.microbatches;
  std::vector<double> head(static_cast<std::size_t>(C), 0), down(static_cast<std::size_t>(C), 0);
  for (int c = 1; c < C; ++c) {
    head[static_cast<std::size_t>(c)] = head[static_cast<std::size_t>(c) - 1] + p.chunk(c - 1).forward_us + p.send_us[static_cast<std::size_t>(c) - 1];
    down[static_cast<std::size_t>(c)] = down[static_cast<std::size_t>(c) - 1] + p.chunk(c - 1).input_grad_us + p.send_us[static_cast<std::size_t>(c) - 1];
  }
  // After chunk 0's last B: its W, its gradient reduction and its stage's optimizer.
  const double stage0_after = p.chunk(0).weight_grad_us + p.chunk(0).grad_sync_us + p.optimizer_us(0);
  // The B chain from the last chunk down to c + 1, and when the first forward leaves the last chunk.
  std::vector<double> back(static_cast<std::size_t>(C), 0);
  for (int c = C - 2; c >= 0; --c)
    back[static_cast<std::size_t>(c)] = back[static_cast<std::size_t>(c) + 1] + p.chunk(c + 1).input_grad_us + p.send_us[static_cast<std::size_t>(c)];
  const double last_forward = head[static_cast<std::size_t>(C) - 1] + p.chunk(C - 1).forward_us;
  const double inf = std::numeric_limits<double>::infinity();
  double bound = 0;
  for (int st = 0; st < p.stages; ++st) {
    double first = inf, work = 0, fb = 0, tail = inf, sync = inf, first_gradient = inf, whole = 0;
    std::vector<std::pair<double, int>> by_rate; // forward time per byte, chunk
    for (int c = st; c < C; c += p.stages) {
      const auto& k = p.chunk(c);
      first = std::min(first, head[static_cast<std::size_t>(c)]);
      sync = std::min(sync, k.grad_sync_us);
      work += M * (k.forward_us + k.input_grad_us + k.weight_grad_us);
      fb += M * (k.forward_us + k.input_grad_us);
      tail = std::min(tail, down[static_cast<std::size_t>(c)] + stage0_after);
      first_gradient = std::min(first_gradient, last_forward + back[static_cast<std::size_t>(c)]);
      if (p.memory_cap_bytes > 0) {
        const double alone = k.activation_bytes > 0 ? std::floor(p.memory_cap_bytes * (1 + 1e-9) / k.activation_bytes) : M;
        whole += std::min(alone, M) * k.forward_us;
        by_rate.emplace_back(k.activation_bytes > 0 ? k.forward_us / k.activation_bytes : inf, c);
      }
    }
    const double optimizer = p.optimizer_us(st);
    bound = std::max({bound, first + work + sync + optimizer, first + fb + tail});
    // Under a memory cap: until the first gradient can come back to one of the stage's chunks
    // (the first micro-batch's forward through every chunk and its B down to that chunk), the
    // stage can only run forwards, and only as many as fit in the cap together (at most the
    // fractional knapsack of forward time per byte, and each chunk's whole count that fits
    // alone); the rest of its work follows.
    if (p.memory_cap_bytes > 0) {
      std::sort(by_rate.rbegin(), by_rate.rend());
      double room = p.memory_cap_bytes * (1 + 1e-9), knapsack = 0;
      for (const auto& [rate, c] : by_rate) {
        const auto& k = p.chunk(c);
        const double n = k.activation_bytes > 0 ? std::min(M, room / k.activation_bytes) : M;
        knapsack += n * k.forward_us;
        room -= n * k.activation_bytes;
      }
      const double early = std::max(0.0, std::min({first_gradient - first, knapsack, whole}));
      bound = std::max(bound, first_gradient + work - early + sync + optimizer);
    }
  }
  double one = 0;
  for (int c = 0; c < C; ++c) one += p.chunk(c).forward_us + p.chunk(c).input_grad_us;
  for (const auto s : p.send_us) one += 2 * s;
  return std::max(bound, one + stage0_after);
}

} // namespace concerto::pipeline
