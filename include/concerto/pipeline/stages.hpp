#pragma once
/// @file
/// @brief From the task graph of one micro-batch to the graphs the pipeline stages run.
///
/// A pipelined step lowers the program once, for one micro-batch, on the whole mesh (the `pp`
/// axis is one the program neither splits nor sums over). `split` then says, for every task of
/// that graph, where it runs and how often:
///
/// - **chunk**: a repeat stack's layers are cut into `stages × virtual_stages` contiguous chunks
///   (`split_layers`), chunk c on stage `c % stages`; a task outside the stack goes with the
///   chunk of what it reads (the LM head and loss after the last layer), or, reading nothing
///   computed, with its first reader's (the embedding before layer 0).
/// - **role**: once per micro-batch (the forward and backward passes), once per step before
///   them (*prologue*: what depends on no input, such as a parameter gathered for the step), or
///   once per step after them (*epilogue*: the optimizer and the collectives that reduce a
///   gradient on its way to it).
/// - **pass** of a micro-batch task: F (forward), B (backward work that another chunk or the
///   input gradient waits for) or W (backward work only weight gradients need), as in the
///   zero-bubble schedules.
/// - **buffers**: as many copies of what a micro-batch computes as the schedule holds micro-batches
///   of that chunk at once on its stage (1F1B: the stages still to go; GPipe: all), micro-batch m
///   in copy m mod that count, so a schedule's activation memory is what the arena holds; inputs as one buffer
///   of all micro-batches (micro-batch m: the m-th block of rows of this rank's shard); the
///   buffers an epilogue task reads (the local gradients) and the loss *accumulate*: the first
///   write of the step overwrites them, every later one adds (the kernels' `accumulate`, or a
///   scratch buffer and an `add` for a kernel without one); one copy of parameters and optimizer
///   state. A value one chunk computes and a chunk on another stage reads is a **message**: a
///   `send` after its last writer, a `recv` at the start of the F or B block that reads it
///   (the schedule's model of where a message arrives), on the `pp` lane, with tag
///   `message × microbatches + m`.
///
/// Global-norm gradient clipping's reduction (the tasks from the norm's parts to
/// ir::grad_norm_sq_buffer, graph/lower.hpp) runs on *every* stage, over the parts of its own
/// gradients, and sums over the pipeline axis too: the one collective over it besides the messages.
/// (Dynamic loss scaling reads that norm on every stage, so all stages skip an overflowed step
/// together, and its scale, ir::loss_scale_buffer, is a copy on every stage.)
///
/// `stage_graph` emits one stage's graph in the order the pipeline schedule runs its blocks
/// (the prologue first; each epilogue collective as soon as the last micro-batch's gradient it
/// reduces exists, so the data-parallel reduction overlaps the cool-down; the optimizer last),
/// and `stage_plan` turns that order into the stage's plan: the stage runs its blocks in the
/// schedule's order and every collective in the order it was emitted, the same on every rank
/// of a tensor- or data-parallel group, and the same micro-batch order on both ends of every
/// pipeline link (what the pipeline verifier checks of the schedule; `message_sequence` lets the
/// ranks check it of their plans).
///
/// @code
/// auto g = lower(model, micro_batch_shapes, mesh, options);        // mesh has a "pp" axis
/// auto split = pipeline::split(g, {.microbatches = 8});
/// auto problem = pipeline::problem_of(split, g, cost::model::preset("cpu"));
/// auto sched = pipeline::one_f_one_b(problem);
/// auto plan = pipeline::stage_plan(pipeline::stage_graph(g, split, stage, sched), model, "1f1b");
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/pipeline/passes.hpp>
#include <concerto/pipeline/schedule.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/sim/simulate.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace concerto::pipeline {

/// @brief How a step is pipelined.
struct stage_options {
  std::string axis = "pp"; ///< the mesh axis the stages lie along
  int microbatches = 1;    ///< per step
  int virtual_stages = 1;  ///< chunks per stage (interleaved schedules)
};

/// @brief How often a task of the micro-batch graph runs in the step.
enum class task_role : std::uint8_t { microbatch, prologue, epilogue };

/// @brief Where a task of a stage's graph comes from: the micro-batch graph's task it runs, and
/// for which micro-batch (0 for a prologue or epilogue task; source -1 for a send or receive).
struct task_origin {
  ir::task_id source = -1;
  int microbatch = 0;
};

/// @brief Where one task of the micro-batch graph goes.
struct task_place {
  int chunk = -1;                     ///< -1 with every_stage
  bool every_stage = false;           ///< global-norm clipping's reduction: on every stage, once per step
  task_role role = task_role::microbatch;
  pass kind = pass::forward;          ///< a micro-batch task's pass: forward, input_grad or weight_grad
  std::vector<ir::task_id> producers; ///< the tasks whose values it reads
};

/// @brief Where one buffer of the micro-batch graph goes (set on root buffers; views follow their root).
struct buffer_place {
  bool accumulated = false;     ///< summed over the micro-batches
  bool per_microbatch = false;  ///< one copy per micro-batch
  int owner = -1;               ///< the chunk that holds it (-1: none)
  int message = -1;             ///< its index among the messages, or -1
  int message_to = -1;          ///< with a message: the chunk that reads it
  ir::task_id last_writer = -1; ///< its last micro-batch writer, or -1
};

/// @brief Where every task and buffer of a micro-batch's graph goes in the pipelined step.
struct stage_split {
  int stages = 1, virtual_stages = 1, microbatches = 1;
  int axis = -1;                     ///< the pipeline axis, an index into the graph's axes
  std::vector<int> chunk_layers;     ///< layers per chunk
  std::vector<task_place> tasks;     ///< per task, by id
  std::vector<buffer_place> buffers; ///< per buffer, by id
  int messages = 0;

  [[nodiscard]] int chunk_count() const noexcept { return stages * virtual_stages; }
  [[nodiscard]] int stage_of_chunk(int c) const noexcept { return c % stages; }
  [[nodiscard]] const task_place& task(ir::task_id t) const { return tasks[static_cast<std::size_t>(t)]; }
  [[nodiscard]] task_place& task(ir::task_id t) { return tasks[static_cast<std::size_t>(t)]; }
  [[nodiscard]] const buffer_place& buffer(ir::buffer_id b) const { return buffers[static_cast<std::size_t>(b)]; }
  [[nodiscard]] buffer_place& buffer(ir::buffer_id b) { return buffers[static_cast<std::size_t>(b)]; }
  /// The stage a named buffer of the micro-batch graph lives on, or -1 (read by no task).
  [[nodiscard]] int stage_of_buffer(const ir::graph& g, ir::buffer_id b) const {
    const auto c = buffer(g.root_of(b)).owner;
    return c < 0 ? -1 : stage_of_chunk(c);
  }
};

namespace detail::splitting {

inline std::string quoted(const ir::graph& g, ir::buffer_id b) { return "'" + g.buffer_at(b).name + "'"; }

// Whether task t writes (a view of) root buffer r.
inline bool writes_root(const ir::graph& g, const ir::task& t, ir::buffer_id r) {
  return std::any_of(t.writes.begin(), t.writes.end(), [&](auto w) { return g.root_of(w) == r; });
}

// Global-norm clipping's reduction: the tasks the norm's buffer comes from, back to the parts
// of each gradient (which run with their gradient's chunk).
inline void mark_every_stage(const ir::graph& g, stage_split& s) {
  std::vector<ir::task_id> walk;
  for (const auto& t : g.tasks)
    for (const auto b : t.writes)
      if (g.buffer_at(g.root_of(b)).name == ir::grad_norm_sq_buffer) walk.push_back(t.id);
  while (!walk.empty()) {
    auto& place = s.task(walk.back());
    walk.pop_back();
    if (place.every_stage) continue;
    place.every_stage = true;
    for (const auto p : place.producers)
      if (g.task_at(p).fn != ir::op::grad_sq_norm) walk.push_back(p);
  }
}

// The layers of the repeat stack, after the checks that the graph can be pipelined on s's axis.
inline int stack_layers(const ir::graph& g, const stage_options& o, const stage_split& s) {
  int layers = 0;
  for (const auto& t : g.tasks) {
    if (ir::is_collective(t.kind) && t.axis == s.axis && !s.task(t.id).every_stage)
      fail("pipeline: task '" + t.name + "' is a " + std::string(ir::to_string(t.kind)) + " over the pipeline axis '" +
           o.axis + "'; a pipelined program must neither split nor sum over it");
    layers = std::max(layers, t.layer + 1);
  }
  if (layers == 0)
    fail("pipeline: the mesh's axis '" + o.axis + "' has " + std::to_string(s.stages) +
         " stages but the program has no repeat stack to split over them");
  if (layers < s.chunk_count())
    fail("pipeline: " + std::to_string(layers) + " layers cannot be split into " + std::to_string(s.chunk_count()) +
         " chunks (" + std::to_string(s.stages) + " stages x " + std::to_string(s.virtual_stages) +
         " virtual stages); each chunk needs at least one layer");
  return layers;
}

// Roles: the optimizer and the collectives on a gradient's way to it are the epilogue; what
// depends on no input is the prologue.
inline void assign_roles(const ir::graph& g, stage_split& s) {
  std::vector<char> from_input(g.tasks.size(), 0);
  for (const auto& t : g.tasks) {
    auto& f = from_input[static_cast<std::size_t>(t.id)];
    for (const auto b : t.reads) f |= g.buffer_at(g.root_of(b)).role == ir::buffer_role::input;
    for (const auto p : s.task(t.id).producers) f |= from_input[static_cast<std::size_t>(p)];
  }
  for (const auto& t : g.tasks) {
    if (t.step_phase != ir::phase::optimizer) continue;
    s.task(t.id).role = task_role::epilogue;
    std::vector<ir::task_id> walk = s.task(t.id).producers;
    while (!walk.empty()) {
      const auto w = walk.back();
      walk.pop_back();
      if (!ir::is_collective(g.task_at(w).kind) || !from_input[static_cast<std::size_t>(w)]) continue;
      s.task(w).role = task_role::epilogue;
      for (const auto p : s.task(w).producers) walk.push_back(p);
    }
  }
  for (const auto& t : g.tasks) {
    auto& r = s.task(t.id).role;
    if (r != task_role::epilogue && !from_input[static_cast<std::size_t>(t.id)]) r = task_role::prologue;
  }
}

// What a micro-batch writes and the epilogue (or nobody) reads is summed over the micro-batches;
// the rest a micro-batch writes has a copy per micro-batch (inputs: one buffer of all of them).
inline void mark_sums(const ir::graph& g, stage_split& s) {
  std::vector<char> read_at_all(g.buffers.size(), 0), written_by_microbatch(g.buffers.size(), 0);
  for (const auto& t : g.tasks) {
    for (const auto b : t.reads) read_at_all[static_cast<std::size_t>(g.root_of(b))] = 1;
    if (s.task(t.id).role == task_role::microbatch)
      for (const auto b : t.writes) written_by_microbatch[static_cast<std::size_t>(g.root_of(b))] = 1;
  }
  for (const auto& t : g.tasks) {
    if (s.task(t.id).role != task_role::epilogue) continue;
    for (const auto p : s.task(t.id).producers)
      if (s.task(p).role == task_role::microbatch)
        for (const auto b : g.task_at(p).writes) s.buffer(g.root_of(b)).accumulated = true;
  }
  for (const auto& b : g.buffers) {
    const auto i = static_cast<std::size_t>(b.id);
    auto& place = s.buffer(b.id);
    if (written_by_microbatch[i] && !read_at_all[i] && b.view_of < 0) place.accumulated = true;
    place.per_microbatch = written_by_microbatch[i] && !place.accumulated && b.role != ir::buffer_role::input;
  }
  for (const auto& t : g.tasks) {
    if (s.task(t.id).role != task_role::microbatch) continue;
    for (const auto b : t.reads)
      if (s.buffer(g.root_of(b)).accumulated && !writes_root(g, t, g.root_of(b)))
        fail("pipeline: task '" + t.name + "' reads " + quoted(g, g.root_of(b)) +
             " inside a micro-batch, but that value is summed over the micro-batches for the step");
  }
}

// Chunks: a layer's by its layer; others after what they read, or before their first reader.
inline void assign_chunks(const ir::graph& g, stage_split& s, const std::vector<std::vector<ir::task_id>>& consumers) {
  std::vector<int> chunk_of_layer;
  for (int c = 0; c < s.chunk_count(); ++c)
    chunk_of_layer.insert(chunk_of_layer.end(), static_cast<std::size_t>(s.chunk_layers[static_cast<std::size_t>(c)]), c);
  for (const auto& t : g.tasks) {
    auto& c = s.task(t.id).chunk;
    if (s.task(t.id).every_stage) continue;
    if (t.layer >= 0) {
      c = chunk_of_layer[static_cast<std::size_t>(t.layer)];
      continue;
    }
    for (const auto p : s.task(t.id).producers) c = std::max(c, s.task(p).chunk);
  }
  for (auto t = static_cast<ir::task_id>(g.tasks.size()); t-- > 0;) {
    if (s.task(t).chunk >= 0 || s.task(t).every_stage) continue;
    int c = -1;
    for (const auto u : consumers[static_cast<std::size_t>(t)])
      if (const auto cu = s.task(u).chunk; cu >= 0) c = c < 0 ? cu : std::min(c, cu);
    s.task(t).chunk = std::max(c, 0);
  }
}

// Buffers: the chunk that holds each, its last micro-batch writer; a parameter read by two chunks
// is refused. The loss scale (ir::loss_scale_buffer) belongs to no chunk: every stage reads its
// own copy, which the step writes on every rank before each run, as the inputs are written.
inline void place_buffers(const ir::graph& g, stage_split& s) {
  for (const auto& t : g.tasks) {
    const auto c = s.task(t.id).chunk;
    const bool mb = s.task(t.id).role == task_role::microbatch;
    for (const auto b : t.writes) {
      auto& place = s.buffer(g.root_of(b));
      if (place.owner < 0) place.owner = c;
      if (mb) place.last_writer = t.id;
    }
    for (const auto b : t.reads) {
      const auto r = g.root_of(b);
      const auto role = g.buffer_at(r).role;
      if (role != ir::buffer_role::param && role != ir::buffer_role::optimizer_state) continue;
      if (g.buffer_at(r).name == ir::loss_scale_buffer) continue;
      auto& owner = s.buffer(r).owner;
      if (owner >= 0 && owner != c)
        fail("pipeline: parameter " + quoted(g, r) + " is read by chunks " + std::to_string(owner) + " and " +
             std::to_string(c) + " (stages " + std::to_string(s.stage_of_chunk(owner)) + " and " +
             std::to_string(s.stage_of_chunk(c)) + "); weights shared between pipeline chunks are not supported, "
             "give each chunk its own parameter");
      owner = c;
    }
  }
}

// Passes: a micro-batch's backward work is W when only weight gradients need it (passes.hpp),
// the epilogue running once per step and a W reader in the same chunk.
inline void assign_passes(const ir::graph& g, stage_split& s, const std::vector<std::vector<ir::task_id>>& consumers) {
  const auto backward = [&](ir::task_id t) {
    return s.task(t).role == task_role::microbatch && g.task_at(t).step_phase == ir::phase::backward;
  };
  const auto once_per_step = [&](ir::task_id u) { return s.task(u).role == task_role::epilogue; };
  const auto together = [&](ir::task_id t, ir::task_id u) {
    return s.task(u).role == task_role::microbatch && s.task(u).chunk == s.task(t).chunk;
  };
  const auto w = weight_grad_tasks(g, consumers, backward, once_per_step, together);
  for (const auto& t : g.tasks)
    if (backward(t.id)) s.task(t.id).kind = w[static_cast<std::size_t>(t.id)] ? pass::weight_grad : pass::input_grad;
}

// Messages: forward values to the next chunk, input gradients to the previous one.
inline void find_messages(const ir::graph& g, stage_split& s) {
  for (const auto& t : g.tasks) {
    const auto& reader = s.task(t.id);
    for (const auto p : reader.producers) {
      const auto& writer = s.task(p);
      if (writer.chunk == reader.chunk || reader.role == task_role::epilogue) continue;
      for (const auto b : t.reads) {
        const auto r = g.root_of(b);
        if (!writes_root(g, g.task_at(p), r)) continue;
        const int from = writer.chunk, to = reader.chunk;
        const bool mb = writer.role == task_role::microbatch;
        const bool forward = mb && writer.kind == pass::forward && to == from + 1;
        const bool backward = mb && writer.kind != pass::forward && to == from - 1;
        if (!forward && !backward)
          fail("pipeline: " + quoted(g, r) + ", computed by '" + g.task_at(p).name + "' in chunk " + std::to_string(from) +
               ", is read by '" + t.name + "' in chunk " + std::to_string(to) +
               "; chunks pass values forward to the next chunk and gradients back to the previous one only");
        auto& place = s.buffer(r);
        if (place.message_to >= 0 && place.message_to != to)
          fail("pipeline: " + quoted(g, r) + " is read by chunks " + std::to_string(place.message_to) + " and " +
               std::to_string(to) + "; a value goes to one other chunk only");
        if (place.message < 0) place.message = s.messages++;
        place.message_to = to;
      }
    }
  }
}

} // namespace detail::splitting

/// @brief Places every task of a micro-batch's graph in the pipelined step; see the file
/// comment. Throws concerto::error naming what cannot be pipelined: no `pp` axis, a collective
/// over it, no repeat stack, fewer layers than chunks, a parameter read by two chunks, a value
/// passed between chunks that are not neighbours, a gradient read inside a micro-batch after
/// being summed over them.
[[nodiscard]] inline stage_split split(const ir::graph& g, const stage_options& o) {
  namespace step = detail::splitting;
  stage_split s;
  const auto axis = g.axis_index(o.axis);
  if (!axis) fail("pipeline: the mesh has no axis '" + o.axis + "' to place stages along");
  s.axis = *axis;
  s.stages = g.axes[static_cast<std::size_t>(s.axis)].size;
  if (o.microbatches < 1) fail("pipeline: " + std::to_string(o.microbatches) + " micro-batches; at least 1");
  if (o.virtual_stages < 1) fail("pipeline: " + std::to_string(o.virtual_stages) + " virtual stages; at least 1");
  s.microbatches = o.microbatches;
  s.virtual_stages = o.virtual_stages;
  s.tasks.resize(g.tasks.size());
  s.buffers.resize(g.buffers.size());
  auto producers = ir::data_producers(g);
  const auto consumers = consumers_of(producers);
  for (const auto& t : g.tasks) s.task(t.id).producers = std::move(producers[static_cast<std::size_t>(t.id)]);
  step::mark_every_stage(g, s);
  s.chunk_layers = split_layers(step::stack_layers(g, o, s), s.chunk_count());
  step::assign_roles(g, s);
  step::mark_sums(g, s);
  step::assign_chunks(g, s, consumers);
  step::place_buffers(g, s);
  step::assign_passes(g, s, consumers);
  step::find_messages(g, s);
  return s;
}

/// @brief How a task the split placed is priced: its pass once per micro-batch; the epilogue's
/// collectives as the gradient reduction and its kernels, like the prologue's, as the optimizer
/// (once per step).
[[nodiscard]] inline work work_of(const task_place& place, const ir::task& t) {
  switch (place.role) {
  case task_role::epilogue: return ir::is_collective(t.kind) ? work::grad_sync : work::optimizer;
  case task_role::prologue: return work::optimizer;
  case task_role::microbatch: break;
  }
  return place.kind == pass::forward ? work::forward : place.kind == pass::input_grad ? work::input_grad : work::weight_grad;
}

/// @brief The pipeline problem of a split step, priced by `model`: per chunk and micro-batch the
/// F, B and W tasks' times (their tensor-parallel collectives included, as they run in the
/// pass), the epilogue's collectives and optimizer, the activations a micro-batch holds (the
/// per-micro-batch buffers the chunk writes or receives) and the share the W tasks read; per
/// boundary, the largest message's time on the pipeline axis.
[[nodiscard]] inline problem problem_of(const stage_split& s, const ir::graph& g, const cost::model& model) {
  problem p;
  p.name = g.name;
  p.stages = s.stages;
  p.virtual_stages = s.virtual_stages;
  p.microbatches = s.microbatches;
  p.chunks.assign(static_cast<std::size_t>(s.chunk_count()), {});
  p.send_us.assign(static_cast<std::size_t>(std::max(s.chunk_count() - 1, 0)), 0.0);
  for (int c = 0; c < s.chunk_count(); ++c) p.chunks[static_cast<std::size_t>(c)].layers = s.chunk_layers[static_cast<std::size_t>(c)];
  std::vector<double> read_by_w(p.chunks.size(), 0);
  std::vector<std::vector<char>> w_reads(p.chunks.size(), std::vector<char>(g.buffers.size(), 0));
  for (const auto& t : g.tasks) {
    const auto& place = s.task(t.id);
    if (place.every_stage) { // once per stage: with its first chunk
      for (int stage = 0; stage < s.stages; ++stage)
        charge(p.chunks[static_cast<std::size_t>(stage)], work_of(place, t), model.task_us(g, t));
      continue;
    }
    const auto c = static_cast<std::size_t>(place.chunk);
    charge(p.chunks[c], work_of(place, t), model.task_us(g, t));
    if (place.role == task_role::microbatch && place.kind == pass::weight_grad)
      for (const auto b : t.reads) w_reads[c][static_cast<std::size_t>(g.root_of(b))] = 1;
  }
  for (std::size_t b = 0; b < g.buffers.size(); ++b) {
    if (!s.buffers[b].per_microbatch || g.buffers[b].view_of >= 0) continue;
    const auto bytes = static_cast<double>(g.buffers[b].bytes);
    const auto holder = s.buffers[b].owner;
    if (holder < 0) continue;
    p.chunks[static_cast<std::size_t>(holder)].activation_bytes += bytes;
    if (w_reads[static_cast<std::size_t>(holder)][b]) read_by_w[static_cast<std::size_t>(holder)] += bytes;
    if (const auto to = s.buffers[b].message_to; to >= 0) {
      p.chunks[static_cast<std::size_t>(to)].activation_bytes += bytes;
      const auto boundary = static_cast<std::size_t>(std::min(holder, to));
      const auto& ax = g.axes[static_cast<std::size_t>(s.axis)];
      p.send_us[boundary] = std::max(p.send_us[boundary], model.collective_us(ir::op_kind::send, bytes, ax.size, ax.link));
    }
  }
  for (std::size_t c = 0; c < p.chunks.size(); ++c)
    if (p.chunks[c].activation_bytes > 0) p.chunks[c].weight_grad_share = read_by_w[c] / p.chunks[c].activation_bytes;
  return p;
}

namespace detail {

// Builds one stage's graph in the order its blocks run.
class stage_emitter {
public:
  stage_emitter(const ir::graph& g, const stage_split& s, int stage) : g_(g), s_(s), stage_(stage), b_(g.name) {
    for (const auto& a : g.axes) b_.axis(a.name, a.size, a.link);
    // Gradients flow back on a lane of their own: on one lane a send waiting for its peer would
    // hold up the receives behind it (NCCL's point-to-point calls block their stream until the
    // peer takes part), and each lane's messages flow one way along the pipeline.
    if (s.stages > 1) gradient_lane_ = b_.lane(s.axis, "comm:" + g.axes[static_cast<std::size_t>(s.axis)].name + ".grad");
    map_.assign(g.buffers.size(), std::vector<ir::buffer_id>(static_cast<std::size_t>(s.microbatches) + 1, -1));
    emitted_.assign(g.tasks.size(), 0);
    received_.assign(g.buffers.size(), std::vector<char>(static_cast<std::size_t>(s.microbatches), 0));
    written_once_.assign(g.buffers.size(), 0);
    scratch_.assign(g.buffers.size(), -1);
  }

  ir::graph run(const schedule& sched) {
    count_in_flight(sched);
    // This stage's tasks, in program order: per chunk those of a micro-batch, and once per step
    // the prologue and the epilogue.
    std::vector<std::vector<std::size_t>> chunk_tasks(static_cast<std::size_t>(s_.chunk_count()));
    std::vector<std::size_t> prologue;
    for (std::size_t t = 0; t < g_.tasks.size(); ++t) {
      if (!mine(t)) continue;
      if (s_.tasks[t].role == task_role::microbatch) chunk_tasks[static_cast<std::size_t>(s_.tasks[t].chunk)].push_back(t);
      else (s_.tasks[t].role == task_role::prologue ? prologue : epilogue_).push_back(t);
    }
    for (const auto t : prologue) emit(t, 0);
    const auto arrivals = block_arrivals(chunk_tasks);
    for (const auto& blk : sched.order.at(static_cast<std::size_t>(stage_))) {
      if (blk.kind != pass::weight_grad)
        for (const auto& [r, reader] : arrivals[static_cast<std::size_t>(blk.chunk)][blk.kind == pass::forward ? 0 : 1]) {
          received_[r][static_cast<std::size_t>(blk.microbatch)] = 1;
          b_.at(g_.tasks[reader].step_phase, g_.tasks[reader].layer);
          message(ir::op_kind::recv, r, blk.microbatch, peer_of_chunk(s_.buffers[r].owner));
        }
      for (const auto t : chunk_tasks[static_cast<std::size_t>(blk.chunk)]) {
        const auto k = s_.tasks[t].kind;
        const bool in_block = k == blk.kind || (!sched.split_backward && blk.kind == pass::input_grad && k == pass::weight_grad);
        if (in_block) emit(t, blk.microbatch);
      }
      emit_ready_collectives();
    }
    for (const auto t : epilogue_)
      if (!emitted_[t]) {
        if (!ready(t)) fail("pipeline: the schedule leaves epilogue task '" + g_.tasks[t].name + "' of stage " +
                            std::to_string(stage_) + " without its inputs (a block is missing)");
        emit(t, 0);
      }
    auto out = std::move(b_).finish();
    origins_.resize(out.tasks.size());
    for (const auto& [task, attrs] : attrs_)
      for (const auto& [k, v] : attrs) out.tasks[static_cast<std::size_t>(task)].attrs[k] = v;
    out.name = g_.name + ".stage" + std::to_string(stage_);
    return out;
  }

  /// After run: each emitted task's origin, by task id.
  [[nodiscard]] std::vector<task_origin> take_origins() && { return std::move(origins_); }

private:
  [[nodiscard]] bool mine(std::size_t t) const {
    return s_.tasks[t].every_stage || s_.stage_of_chunk(s_.tasks[t].chunk) == stage_;
  }
  [[nodiscard]] std::size_t root(ir::buffer_id b) const { return static_cast<std::size_t>(g_.root_of(b)); }

  // Per chunk of this stage, the messages its F blocks [0] and its B blocks [1] receive from
  // another stage, each with its first reader: a block receives its messages before its first
  // task, whether or not that task reads them (chunk 0's backward is all W: nothing waits for
  // its input gradient), so each link's messages arrive in the order of the receiving blocks,
  // which pipeline::verify checks against the sender's. Within a block, in the order the
  // sender sends them: by last writer, and one writer's in the order of its writes.
  using arrival = std::pair<std::size_t, std::size_t>; // root buffer, first reader
  // Whether root buffer r is a message that chunk c of this stage receives (from a chunk of
  // another stage; a value of a chunk on the same stage is shared, no message).
  [[nodiscard]] bool received_by(std::size_t r, int c) const {
    return s_.buffers[r].message >= 0 && s_.buffers[r].message_to == c && s_.stage_of_chunk(s_.buffers[r].owner) != stage_;
  }
  [[nodiscard]] std::vector<std::array<std::vector<arrival>, 2>>
  block_arrivals(const std::vector<std::vector<std::size_t>>& chunk_tasks) const {
    std::vector<std::array<std::vector<arrival>, 2>> out(chunk_tasks.size());
    std::vector<char> seen(g_.buffers.size(), 0);
    for (std::size_t c = 0; c < chunk_tasks.size(); ++c)
      for (const auto t : chunk_tasks[c])
        for (const auto rb : g_.tasks[t].reads) {
          const auto r = root(rb);
          if (seen[r] || !received_by(r, static_cast<int>(c))) continue;
          seen[r] = 1;
          out[c][gradient(r) ? 1 : 0].emplace_back(r, t);
        }
    const auto send_order = [&](const arrival& a) {
      const auto writer = s_.buffers[a.first].last_writer;
      const auto& writes = g_.tasks[static_cast<std::size_t>(writer)].writes;
      std::size_t k = 0;
      while (k < writes.size() && root(writes[k]) != a.first) ++k;
      return std::pair{writer, k};
    };
    for (auto& passes : out)
      for (auto& list : passes) std::ranges::sort(list, {}, send_order);
    return out;
  }

  [[nodiscard]] bool ready(std::size_t t) const {
    for (const auto p : s_.tasks[t].producers) {
      const auto pi = static_cast<std::size_t>(p);
      if (!mine(pi)) continue; // the norm's parts of another stage's gradients (mark_every_stage)
      const int need = s_.tasks[pi].role == task_role::microbatch ? s_.microbatches : 1;
      if (emitted_[pi] < need) return false;
    }
    return true;
  }

  // Each epilogue collective as soon as what it reduces is whole: it overlaps the blocks left.
  void emit_ready_collectives() {
    for (const auto t : epilogue_)
      if (!emitted_[t] && ir::is_collective(g_.tasks[t].kind) && ready(t)) emit(t, 0);
  }

  // How many micro-batches of each chunk of this stage a buffer must hold at most under the
  // schedule: from their forward until the end of the last pass that uses the buffer (forward
  // only: one; read by B: until B ends; by W: until W ends, as the pipeline problem's memory
  // frees them). That many copies are enough; micro-batch m uses copy m mod that count, after
  // the micro-batch before it in that copy is done with it (the builder's write-after-read
  // dependencies order the reuse). A value sent or received keeps two copies at least, so that
  // the next micro-batch's forward does not wait for the message to leave.
  void count_in_flight(const schedule& sched) {
    const auto chunks = static_cast<std::size_t>(s_.chunk_count());
    in_flight_.assign(chunks, {1, 1, 1});
    std::vector<std::array<int, 3>> live(chunks, {0, 0, 0});
    const auto fused = [&](pass k) { return !sched.split_backward && k == pass::weight_grad ? pass::input_grad : k; };
    for (const auto& blk : sched.order.at(static_cast<std::size_t>(stage_))) {
      auto& l = live.at(static_cast<std::size_t>(blk.chunk));
      auto& most = in_flight_[static_cast<std::size_t>(blk.chunk)];
      if (blk.kind == pass::forward)
        for (const auto k : {pass::input_grad, pass::weight_grad}) {
          const auto i = static_cast<std::size_t>(fused(k));
          if (k == fused(k)) most[i] = std::max(most[i], ++l[i]);
        }
      else --l[static_cast<std::size_t>(fused(blk.kind))];
    }
    last_use_.assign(g_.buffers.size(), pass::forward);
    for (std::size_t t = 0; t < g_.tasks.size(); ++t) {
      if (!mine(t) || s_.tasks[t].role != task_role::microbatch) continue;
      for (const auto* list : {&g_.tasks[t].reads, &g_.tasks[t].writes})
        for (const auto b : *list) last_use_[root(b)] = std::max(last_use_[root(b)], fused(s_.tasks[t].kind));
    }
  }
  [[nodiscard]] int copies_of(std::size_t r, int holder) const {
    const int k = in_flight_.at(static_cast<std::size_t>(holder))[static_cast<std::size_t>(last_use_[r])];
    return s_.buffers[r].message >= 0 ? std::max(k, std::min(2, s_.microbatches)) : k;
  }

  // The stage's buffer for buffer b of the micro-batch graph in micro-batch m.
  ir::buffer_id buffer(ir::buffer_id b, int m) {
    const auto r = root(b);
    const auto& rb = g_.buffers[r];
    const bool input = rb.role == ir::buffer_role::input;
    const bool copies = s_.buffers[r].per_microbatch;
    if (copies) { // the chunk of this stage that holds it: its writer's, or for a message its reader's
      const auto holder = s_.stage_of_chunk(s_.buffers[r].owner) == stage_ ? s_.buffers[r].owner : s_.buffers[r].message_to;
      m %= copies_of(r, holder);
    }
    const auto slot = static_cast<std::size_t>(copies || input ? m + 1 : 0);
    auto& id = map_[static_cast<std::size_t>(b)][slot];
    if (id >= 0) return id;
    const auto& buf = g_.buffers[static_cast<std::size_t>(b)];
    if (static_cast<std::size_t>(b) != r) {
      id = b_.view(name(buf.name, copies, m), buffer(static_cast<ir::buffer_id>(r), m), g_.root_offset(b), buf.bytes, buf.shape);
    } else if (input) { // all micro-batches' rows in one buffer, a view per micro-batch
      auto& whole = map_[r][0];
      if (whole < 0) {
        auto shape = buf.shape;
        if (shape.empty()) fail("pipeline: input '" + buf.name + "' has no shape to split into micro-batches");
        shape[0] *= s_.microbatches;
        whole = b_.buffer(buf.name, std::move(shape), buf.role, buf.type);
      }
      id = b_.view(buf.name + "@mb" + std::to_string(m), whole, static_cast<std::int64_t>(m) * buf.bytes, buf.bytes, buf.shape);
    } else {
      id = b_.buffer(name(buf.name, copies, m), buf.shape, buf.role, buf.type);
    }
    return id;
  }
  // A copy's name says which copy (`@buf1`); an input's view which micro-batch (`@mb1`).
  [[nodiscard]] std::string name(const std::string& base, bool copies, int m) const {
    return copies && s_.microbatches > 1 ? base + "@buf" + std::to_string(m) : base;
  }

  [[nodiscard]] int peer_of_chunk(int c) const { return s_.stage_of_chunk(c); }

  void emit(std::size_t t, int m) {
    const auto& src = g_.tasks[t];
    const bool mb = s_.tasks[t].role == task_role::microbatch;
    // Values from a chunk on another stage arrived at the start of their block (run).
    if (mb)
      for (const auto rb : src.reads) {
        const auto r = root(rb);
        if (!received_by(r, s_.tasks[t].chunk) || received_[r][static_cast<std::size_t>(m)]) continue;
        fail("pipeline: task '" + src.name + "' of stage " + std::to_string(stage_) + " reads message '" + g_.buffers[r].name +
             "' of micro-batch " + std::to_string(m) + " before its block received it (the schedule runs a W block before its B)");
      }
    std::vector<ir::buffer_id> reads, writes;
    for (const auto b : src.reads) reads.push_back(buffer(b, m));
    ir::attr_map attrs = src.attrs;
    if (mb) {
      if (const auto it = attrs.find("global_rows"); it != attrs.end()) it->second *= s_.microbatches;
      if (attrs.contains("seed")) attrs["microbatch"] = m; // a dropout draws a mask of its own for each micro-batch
    }
    struct addition {
      ir::buffer_id sum, scratch;
      std::int64_t elements;
    };
    std::vector<addition> add_after;
    for (const auto b : src.writes) {
      auto w = buffer(b, m);
      const auto r = root(b);
      if (mb && s_.buffers[r].accumulated) {
        if (written_once_[r]) {
          if (ir::info(src.fn).accumulates && src.writes.size() == 1) {
            attrs["accumulate"] = 1;
            if (src.fn == ir::op::matmul && std::find(reads.begin(), reads.end(), w) == reads.end()) reads.push_back(w);
          } else {
            auto& scratch = scratch_[static_cast<std::size_t>(b)];
            const auto& buf = g_.buffers[static_cast<std::size_t>(b)];
            if (scratch < 0) scratch = b_.buffer(buf.name + ".microbatch", buf.shape, ir::buffer_role::workspace, buf.type);
            add_after.push_back({w, scratch, buf.bytes / static_cast<std::int64_t>(ir::size_of(buf.type))});
            w = scratch;
          }
        }
        written_once_[r] = 1;
      }
      writes.push_back(w);
    }
    b_.at(src.step_phase, src.layer);
    const auto task_name = mb && s_.microbatches > 1 ? src.name + "@mb" + std::to_string(m) : src.name;
    const task_origin from{static_cast<ir::task_id>(t), mb ? m : 0};
    if (ir::is_collective(src.kind)) {
      const auto id = b_.collective(src.kind, task_name, src.axis, reads.at(0), writes.at(0), -1, src.fn);
      if (!attrs.empty()) attrs_.emplace_back(id, std::move(attrs));
      record_origin(id, from);
    } else {
      record_origin(b_.compute(src.kind, task_name, std::move(reads), std::move(writes), {src.fn, -1, -1, std::move(attrs)}),
                    from);
    }
    for (const auto& a : add_after)
      record_origin(b_.compute(ir::op::add, task_name + ".accumulate", {a.sum, a.scratch}, {a.sum}, {{"n", a.elements}}), from);
    ++emitted_[t];
    // Values a chunk on another stage reads leave after their last writer.
    if (mb)
      for (const auto wb : src.writes) {
        const auto r = root(wb);
        if (s_.buffers[r].message < 0 || s_.buffers[r].last_writer != static_cast<ir::task_id>(t)) continue;
        if (s_.stage_of_chunk(s_.buffers[r].message_to) == stage_) continue;
        message(ir::op_kind::send, r, m, peer_of_chunk(s_.buffers[r].message_to));
      }
  }

  void record_origin(ir::task_id id, task_origin from) {
    if (origins_.size() <= static_cast<std::size_t>(id)) origins_.resize(static_cast<std::size_t>(id) + 1);
    origins_[static_cast<std::size_t>(id)] = from;
  }

  // The send or recv of micro-batch m's copy of root buffer r, on the values' or the gradients' lane.
  void message(ir::op_kind kind, std::size_t r, int m, int peer) {
    const auto b = buffer(static_cast<ir::buffer_id>(r), m);
    const bool send = kind == ir::op_kind::send;
    const auto id = b_.collective(kind,
                                  std::string(send ? "send " : "recv ") + g_.buffers[r].name + " mb" + std::to_string(m) +
                                      ", stage " + std::to_string(stage_) + (send ? " to stage " : " from stage ") +
                                      std::to_string(peer),
                                  s_.axis, b, b);
    attrs_.emplace_back(id, ir::attr_map{{"peer", peer},
                                         {"tag", static_cast<std::int64_t>(s_.buffers[r].message) * s_.microbatches + m},
                                         {"microbatch", m}});
    if (gradient(r)) b_.on_lane(id, gradient_lane_);
  }

  // A message whose value a backward pass computed (it goes to the previous chunk).
  [[nodiscard]] bool gradient(std::size_t r) const {
    return s_.task(s_.buffers[r].last_writer).kind != pass::forward;
  }


  const ir::graph& g_;
  const stage_split& s_;
  int stage_;
  ir::builder b_;
  std::vector<std::vector<ir::buffer_id>> map_; // per buffer: shared copy, then one per copy (input: per micro-batch)
  std::vector<std::array<int, 3>> in_flight_;   // per chunk and pass: micro-batches held until it ends
  std::vector<pass> last_use_;                  // per root buffer: the last pass that uses it on this stage
  std::vector<int> emitted_;                    // per task: instances emitted
  std::vector<std::vector<char>> received_;     // per root buffer and micro-batch
  std::vector<char> written_once_;              // per accumulated root: its first write is out
  std::vector<ir::buffer_id> scratch_;          // per accumulated buffer: where a kernel without accumulate writes
  std::vector<std::pair<ir::task_id, ir::attr_map>> attrs_; // collectives' attrs, set after finish()
  ir::stream_id gradient_lane_ = -1;
  std::vector<std::size_t> epilogue_;           // this stage's once-per-step tasks after the blocks
  std::vector<task_origin> origins_;            // per emitted task
};

} // namespace detail

/// @brief The graph stage `stage` runs, its tasks in the order `sched` runs its blocks; see the
/// file comment. `sched` must be a schedule of problem_of(s, g, …) (verified by the caller).
/// With `origins`, each of the stage graph's tasks' origin in `g` (by task id).
[[nodiscard]] inline ir::graph stage_graph(const ir::graph& g, const stage_split& s, int stage, const schedule& sched,
                                           std::vector<task_origin>* origins = nullptr) {
  if (stage < 0 || stage >= s.stages)
    fail("pipeline: stage " + std::to_string(stage) + " of a pipeline of " + std::to_string(s.stages));
  if (static_cast<int>(sched.order.size()) != s.stages)
    fail("pipeline: schedule '" + sched.policy + "' has orders for " + std::to_string(sched.order.size()) +
         " stages, the step has " + std::to_string(s.stages));
  detail::stage_emitter emitter(g, s, stage);
  auto out = emitter.run(sched);
  if (origins) *origins = std::move(emitter).take_origins();
  return out;
}

/// @brief Where a task of a stage's graph lies in the causal order of the whole pipelined step,
/// the same on every stage: micro-batch by micro-batch (a prologue first, an epilogue last), and
/// within one the passes in data-flow order (chunk by chunk forward, then backward and weight
/// gradients from the last chunk down). Tasks of one stage in one pass keep the order `position`
/// gives (their place in the stage's plan). Comparable across stages: what a stage computes from
/// another's value comes later in this order.
[[nodiscard]] inline std::int64_t causal_order(const stage_split& s, task_origin o, std::int64_t position,
                                               std::int64_t positions) {
  const std::int64_t chunks = s.chunk_count(), passes = 3 * chunks;
  std::int64_t microbatch = 0, pass_rank = 0;
  if (o.source >= 0) {
    const auto t = static_cast<std::size_t>(o.source);
    const std::int64_t c = s.tasks[t].chunk;
    switch (s.tasks[t].role) {
    case task_role::prologue: break;
    case task_role::epilogue: microbatch = s.microbatches + 1; break;
    case task_role::microbatch:
      microbatch = o.microbatch + 1;
      pass_rank = s.tasks[t].kind == pass::forward      ? c
                  : s.tasks[t].kind == pass::input_grad ? chunks + (chunks - 1 - c)
                                                  : 2 * chunks + (chunks - 1 - c);
      break;
    }
  }
  return (microbatch * passes + pass_rank) * positions + position;
}

/// @brief A stage's plan: every stream in the order stage_graph emitted its tasks, start times
/// replayed with `model` (the stage alone: waits for its neighbours are the pipeline replay's).
[[nodiscard]] inline plan::plan stage_plan(ir::graph g, const cost::model& model, std::string policy) {
  std::vector<std::vector<ir::task_id>> order(g.streams.size());
  for (const auto& t : g.tasks) order[static_cast<std::size_t>(t.stream)].push_back(t.id);
  const auto durations = model.durations_us(g);
  return sim::to_plan(std::move(g), std::move(order), durations, {model.overlap_slowdown(), model.comm_overlap_slowdown()},
                      std::move(policy), model.hw().name);
}

/// @brief One send or recv of a stage's plan, as its peer must see it.
struct message_record {
  bool send = false;
  int peer = 0;
  std::int64_t tag = 0, bytes = 0;
  int lane = 0; ///< which lane of the pipeline axis: 0 values, 1 gradients
  friend bool operator==(const message_record&, const message_record&) = default;
};

/// @brief A plan's sends and recvs on the lanes of the pipeline axis, each lane in issue order.
[[nodiscard]] inline std::vector<message_record> message_sequence(const plan::plan& p, int axis) {
  std::vector<message_record> out;
  int lane = 0;
  for (std::size_t s = 1; s < p.graph.streams.size(); ++s) {
    if (p.graph.streams[s].axis != axis) continue;
    for (const auto id : p.order[s]) {
      const auto& t = p.graph.tasks[static_cast<std::size_t>(id)];
      if (t.kind != ir::op_kind::send && t.kind != ir::op_kind::recv) continue;
      const auto b = t.kind == ir::op_kind::send ? t.reads.at(0) : t.writes.at(0);
      out.push_back({t.kind == ir::op_kind::send, static_cast<int>(t.attr("peer")), t.attr("tag"),
                     p.graph.buffers[static_cast<std::size_t>(b)].bytes, lane});
    }
    ++lane;
  }
  return out;
}

} // namespace concerto::pipeline
