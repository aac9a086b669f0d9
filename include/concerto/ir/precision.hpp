#pragma once
/// @file
/// @brief A training step's precision policy, and the pass that applies it to a task graph.
///
/// Under a lower working precision (bf16, or f16 with dynamic loss scaling), a step keeps f32
/// master parameters and optimizer state and runs everything else in the working type, as
/// Megatron-Core, DeepSpeed and torchtitan do:
/// - a parameter the step updates is stored in the working type, and its f32 master beside it
///   (`master_name`, optimizer state: kept between steps) with the update's extent: the update
///   reads and writes the master and also writes the parameter's working copy, the new master
///   rounded (the op table's optional `working` write), which the next step's forward reads as it
///   is. ZeRO-3 gathers the working-precision shards; ZeRO-1/2, which update a shard and gather
///   it back into the parameter, keep the shard's master (no slice of the parameter each step)
///   and gather the rounded shard, half the bytes of an f32 gather. A parameter without an
///   update (evaluation's forward-only graph) is cast into a working copy before its first reader,
///   once per step;
/// - activations and their gradients are stored in the working type; a kernel widens its operands
///   to f32, computes in f32 and rounds what it writes (runtime/dispatch.hpp);
/// - a loss, the row statistics it is summed from, the routing's probabilities and the gradient
///   norm stay f32 (the op table's `full_precision`);
/// - a weight gradient is summed in f32 where it is made (`accumulate_gradients_in_f32`: several
///   uses of one weight, a pipeline's micro-batches), cast to the working type before the
///   collective that reduces it unless `reduce_gradients_in_f32` (Megatron's
///   `grad_reduce_in_fp32`), and read by its update in whatever type the reduction left it.
///
/// The pass retypes buffers (a view keeps its root's type; sizes and offsets scale with it),
/// inserts the casts, and recomputes the affected tasks' bytes, so the cost model, the planner's
/// bucket caps and decompositions, the simulator and the memory cap price the bytes that move.
///
/// @code
/// ir::graph g16 = ir::apply_precision(g, ir::precision_policy::bf16());
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/ir/ops.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::ir {

/// @brief How a step stores and moves its values (see the file comment).
struct precision_policy {
  /// Activations, their gradients and the parameters' working copies: f32 or bf16.
  dtype working = dtype::f32;
  /// Sum a weight gradient in f32 where it is made (several uses, micro-batches); else in the
  /// working type.
  bool accumulate_gradients_in_f32 = true;
  /// Reduce weight gradients across ranks in f32; else in the working type (half the bytes).
  bool reduce_gradients_in_f32 = false;
  /// Dynamic loss scaling, which f16's narrow range needs (its largest value is 65504, its
  /// smallest normal 6.1e-5: small gradients flush to zero unless scaled up): the loss gradients
  /// are multiplied by the step's loss scale (ir::loss_scale_buffer) and every update divides by
  /// it; a step whose gradients overflowed is skipped on every rank and the scale halved
  /// (train/loss_scaling.hpp). The lowering adds the global gradient norm's tasks for it.
  bool loss_scaling = false;

  [[nodiscard]] static constexpr precision_policy fp32() noexcept { return {}; }
  [[nodiscard]] static constexpr precision_policy bf16() noexcept { return {.working = dtype::bf16}; }
  [[nodiscard]] static constexpr precision_policy fp16() noexcept { return {.working = dtype::f16, .loss_scaling = true}; }
  [[nodiscard]] constexpr bool lowered() const noexcept { return working != dtype::f32; }
  friend constexpr bool operator==(const precision_policy&, const precision_policy&) = default;
};

/// @brief The policy's name for flags and messages: "fp32", "bf16", "fp16" (with loss scaling),
/// with "+f32-reduce", "+16bit-accumulate", "+loss-scaling" or "-unscaled" where it departs from
/// the defaults.
[[nodiscard]] inline std::string to_string(const precision_policy& p) {
  std::string out = p.working == dtype::f32    ? "fp32"
                    : p.working == dtype::bf16 ? "bf16"
                    : p.working == dtype::f16  ? "fp16"
                                               : std::string(to_string(p.working));
  if (p.lowered() && p.reduce_gradients_in_f32) out += "+f32-reduce";
  if (p.lowered() && !p.accumulate_gradients_in_f32) out += "+16bit-accumulate";
  if (p.working == dtype::f16 && !p.loss_scaling) out += "-unscaled";
  if (p.working != dtype::f16 && p.loss_scaling) out += "+loss-scaling";
  return out;
}

/// @brief The name of the f32 master of the parameter an update task of this name writes, under a
/// 16-bit policy: "w1.update" -> "w1.master" (train/tensors.hpp reads the checkpoint's values from it).
[[nodiscard]] inline std::string master_name(std::string_view update) {
  constexpr std::string_view suffix = ".update";
  if (update.ends_with(suffix)) update.remove_suffix(suffix.size());
  return std::string(update) + ".master";
}

/// @brief The policy a flag names: "fp32", "bf16" or "fp16" (with dynamic loss scaling).
/// Throws naming `where` and the choices.
[[nodiscard]] inline precision_policy parse_precision(std::string_view name, const std::string& where) {
  if (name == "fp32" || name == "f32") return precision_policy::fp32();
  if (name == "bf16") return precision_policy::bf16();
  if (name == "fp16" || name == "f16") return precision_policy::fp16();
  fail(where + ": precision '" + std::string(name) + "' is not one concerto knows; use fp32, bf16 or fp16");
}

namespace detail::precision {

// Ops that move bytes without looking at them: their output has their input's type.
[[nodiscard]] constexpr bool moves_bytes(op fn) noexcept {
  return fn == op::copy || fn == op::slice || fn == op::concat || fn == op::shard_slice || fn == op::keep_one ||
         fn == op::zero;
}
[[nodiscard]] constexpr bool is_float(dtype t) noexcept { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; }

class pass {
public:
  pass(const graph& g, const precision_policy& p) : g_(g), p_(p), order_(program_order(g)) {
    type_.assign(g.buffers.size(), std::nullopt);
    copy_of_.assign(g.buffers.size(), -1);
    casts_.resize(g.tasks.size());
    new_reads_.resize(g.tasks.size());
    new_writes_.resize(g.tasks.size());
    for (const auto& b : g.buffers)
      if (b.view_of < 0 && (!is_float(b.type) || fixed_role(b.role))) type_[static_cast<std::size_t>(b.id)] = b.type;
  }

  graph run() {
    find_weight_gradients();
    find_masters();
    for (const auto id : order_) visit(g_.tasks[static_cast<std::size_t>(id)]);
    return rebuild();
  }

private:
  static bool fixed_role(buffer_role r) noexcept {
    return r == buffer_role::param || r == buffer_role::optimizer_state || r == buffer_role::input;
  }
  // The root of b; a buffer this pass added is its own.
  [[nodiscard]] std::size_t root(buffer_id b) const {
    return static_cast<std::size_t>(b) < g_.buffers.size() ? static_cast<std::size_t>(g_.root_of(b)) : static_cast<std::size_t>(b);
  }
  [[nodiscard]] bool weight_gradient(buffer_id b) const {
    const auto r = root(b);
    return r < made_.size() && (made_[r] || carried_[r]);
  }
  [[nodiscard]] dtype reduce_type() const noexcept { return p_.reduce_gradients_in_f32 ? dtype::f32 : p_.working; }
  [[nodiscard]] dtype accumulate_type() const noexcept { return p_.accumulate_gradients_in_f32 ? dtype::f32 : p_.working; }

  // The roots a weight gradient passes through from where it is made to its update: walking back
  // from each update's `grad` operand through collectives and byte moves. `made_` marks the roots a
  // kernel writes (where the gradient is summed), `carried_` the rest of the way.
  void find_weight_gradients() {
    made_.assign(g_.buffers.size(), 0);
    carried_.assign(g_.buffers.size(), 0);
    std::vector<std::vector<task_id>> writers(g_.buffers.size());
    for (const auto id : order_)
      for (const auto w : g_.tasks[static_cast<std::size_t>(id)].writes) writers[root(w)].push_back(id);
    std::vector<std::size_t> work;
    for (const auto& t : g_.tasks)
      if (t.kind == op_kind::optimizer_update && t.reads.size() > 1) work.push_back(root(t.reads[1]));
    while (!work.empty()) {
      const auto r = work.back();
      work.pop_back();
      if (made_[r] || carried_[r]) continue;
      bool computed = false;
      for (const auto w : writers[r]) {
        const auto& t = g_.tasks[static_cast<std::size_t>(w)];
        if (is_collective(t.kind) || moves_bytes(t.fn)) {
          for (const auto b : t.reads) work.push_back(root(b));
        } else if (t.kind != op_kind::optimizer_update) {
          computed = true;
        }
      }
      (computed ? made_ : carried_)[r] = 1;
    }
  }

  // Each update's f32 master (see the file comment): the update's first read was the parameter
  // itself (in place), or a shard that a shard_slice copied out of it (ZeRO-1/2), which is dropped.
  // An update of anything else keeps its operands.
  void find_masters() {
    master_.assign(g_.tasks.size(), -1);
    dropped_.assign(g_.tasks.size(), 0);
    own_copy_.assign(g_.buffers.size(), 0);
    std::vector<task_id> sliced_by(g_.buffers.size(), -1);
    for (const auto& t : g_.tasks)
      if (t.fn == op::shard_slice && !t.writes.empty()) sliced_by[root(t.writes[0])] = t.id;
    for (const auto& t : g_.tasks) {
      if (t.kind != op_kind::optimizer_update || t.reads.empty() || t.writes.empty() || t.writes[0] != t.reads[0]) continue;
      const auto updated = t.reads[0];
      auto param = root(updated);
      if (g_.buffers[param].role != buffer_role::param) {
        const auto slice = sliced_by[param];
        if (slice < 0 || g_.buffers[root(g_.tasks[static_cast<std::size_t>(slice)].reads[0])].role != buffer_role::param) continue;
        dropped_[static_cast<std::size_t>(slice)] = 1;
        type_[param] = p_.working; // the shard: its rounded master, gathered into the parameter
        param = root(g_.tasks[static_cast<std::size_t>(slice)].reads[0]);
      }
      type_[param] = p_.working;
      own_copy_[param] = 1;
      master_[static_cast<std::size_t>(t.id)] =
          add_buffer(master_name(t.name), g_.buffers[static_cast<std::size_t>(updated)], dtype::f32, buffer_role::optimizer_state);
    }
  }

  [[nodiscard]] dtype type_of(buffer_id b) const {
    const auto& t = type_[root(b)];
    return t ? *t : g_.buffers[root(b)].type; // every buffer this pass adds has its type decided
  }
  void decide(buffer_id b, dtype t, const task& by) {
    auto& slot = type_[root(b)];
    if (!slot) {
      slot = t;
      return;
    }
    if (*slot != t && moves_bytes(by.fn))
      fail("precision " + to_string(p_) + ": task '" + by.name + "' (" + std::string(to_string(by.fn)) + ") moves " +
           std::string(ir::to_string(t)) + " values into '" + g_.buffers[root(b)].name + "', which holds " +
           std::string(ir::to_string(*slot)) + "; a byte move cannot convert (report this graph)");
  }

  // The working copy of parameter buffer b, made (with its cast before `reader`) on first use.
  buffer_id working_copy(buffer_id b, const task& reader) {
    if (own_copy_[root(b)]) return b;
    auto& copy = copy_of_[static_cast<std::size_t>(b)];
    if (copy >= 0) return copy;
    const auto& src = g_.buffers[static_cast<std::size_t>(b)];
    copy = add_buffer(src.name + "." + std::string(ir::to_string(p_.working)), src, p_.working, buffer_role::activation);
    casts_[static_cast<std::size_t>(reader.id)].push_back({b, copy});
    return copy;
  }
  // A buffer of b's shape in type t (a weight gradient cast before its reduction, a working copy).
  buffer_id add_buffer(std::string name, const buffer& like, dtype t, buffer_role role) {
    buffer nb;
    nb.id = static_cast<buffer_id>(g_.buffers.size() + added_.size());
    nb.name = std::move(name);
    nb.type = t;
    nb.role = role;
    nb.shape = like.shape;
    nb.bytes = like.bytes / static_cast<std::int64_t>(size_of(like.type)) * static_cast<std::int64_t>(size_of(t));
    added_.push_back(nb);
    type_.push_back(t);
    return nb.id;
  }

  void visit(const task& t) {
    auto reads = t.reads;
    auto writes = t.writes;
    if (const auto master = master_[static_cast<std::size_t>(t.id)]; master >= 0) {
      reads[0] = writes[0] = master;
      writes.push_back(t.writes[0]); // the working copy
    } else if (is_collective(t.kind)) {
      // A parameter gathered for use (ZeRO-3) is gathered as its working copy; one gathered into
      // the parameter itself (ZeRO-1/2, after the update) stays the master.
      if (t.kind == op_kind::all_gather && !reads.empty() && g_.buffers[root(reads[0])].role == buffer_role::param &&
          !t.writes.empty() && g_.buffers[root(t.writes[0])].role != buffer_role::param)
        reads[0] = working_copy(reads[0], t);
      // A weight gradient is reduced in the reduction's type: cast where it is not (out of place only).
      if (reduces(t.kind) && !reads.empty() && weight_gradient(reads[0]) &&
          type_of(reads[0]) != reduce_type() && !t.writes.empty() && root(t.writes[0]) != root(reads[0])) {
        const auto& src = g_.buffers[static_cast<std::size_t>(reads[0])];
        const auto cast = add_buffer(src.name + "." + std::string(ir::to_string(reduce_type())), src, reduce_type(),
                                     buffer_role::gradient);
        casts_[static_cast<std::size_t>(t.id)].push_back({reads[0], cast});
        reads[0] = cast;
      }
      for (const auto w : t.writes) decide(w, type_of(reads.empty() ? w : reads[0]), t);
    } else if (moves_bytes(t.fn)) {
      for (const auto w : t.writes)
        if (!reads.empty()) decide(w, type_of(reads[0]), t);
    } else if (t.kind != op_kind::optimizer_update) {
      for (auto& r : reads)
        if (g_.buffers[root(r)].role == buffer_role::param) r = working_copy(r, t);
      const bool working_operand = std::any_of(reads.begin(), reads.end(), [&](buffer_id r) { return type_of(r) == p_.working; });
      for (const auto w : t.writes) {
        if (type_[root(w)]) continue;
        if (info(t.fn).full_precision) decide(w, dtype::f32, t);
        else if (made_[root(w)]) decide(w, accumulate_type(), t);
        else decide(w, working_operand ? p_.working : dtype::f32, t);
      }
    }
    new_reads_[static_cast<std::size_t>(t.id)] = std::move(reads);
    new_writes_[static_cast<std::size_t>(t.id)] = std::move(writes);
  }

  // The graph with the decided types, the new buffers and the casts before their readers.
  graph rebuild() const {
    graph out = g_.empty_like();
    out.buffers = g_.buffers;
    for (auto& b : out.buffers) {
      const auto want = type_of(b.id);
      if (want == b.type) continue;
      const auto from = static_cast<std::int64_t>(size_of(b.type)), to = static_cast<std::int64_t>(size_of(want));
      if (b.bytes % from != 0 || b.offset % from != 0)
        fail("precision " + to_string(p_) + ": buffer '" + b.name + "' is not a whole number of " +
             std::string(ir::to_string(b.type)) + " values");
      b.bytes = b.bytes / from * to;
      b.offset = b.offset / from * to;
      b.type = want;
    }
    out.buffers.insert(out.buffers.end(), added_.begin(), added_.end());

    std::vector<task_id> new_id(g_.tasks.size(), -1);
    std::vector<std::vector<task_id>> old_deps;
    for (const auto id : order_) {
      const auto& old = g_.tasks[static_cast<std::size_t>(id)];
      if (dropped_[static_cast<std::size_t>(id)]) continue;
      for (const auto& c : casts_[static_cast<std::size_t>(id)]) {
        task cast;
        cast.name = out.buffers[static_cast<std::size_t>(c.to)].name + ".cast";
        cast.kind = op_kind::copy;
        cast.fn = op::cast;
        cast.reads = {c.from};
        cast.writes = {c.to};
        cast.step_phase = old.step_phase;
        cast.layer = old.layer;
        const auto& to = out.buffers[static_cast<std::size_t>(c.to)];
        cast.attrs = {{"n", to.bytes / static_cast<std::int64_t>(size_of(to.type))}};
        cast.bytes = static_cast<double>(out.buffers[static_cast<std::size_t>(c.from)].bytes + to.bytes);
        push(out, std::move(cast), {});
      }
      task t = old;
      t.reads = new_reads_[static_cast<std::size_t>(id)];
      t.writes = new_writes_[static_cast<std::size_t>(id)];
      const double before = traffic(g_, old), after = traffic(out, t);
      if (before > 0) t.bytes = old.bytes * after / before;
      new_id[static_cast<std::size_t>(id)] = static_cast<task_id>(out.tasks.size());
      push(out, std::move(t), old.deps);
    }
    // A dropped task's readers now read the master it no longer fills; the hazards below order the rest.
    for (auto& t : out.tasks) {
      for (auto& d : t.deps) d = new_id[static_cast<std::size_t>(d)];
      std::erase(t.deps, task_id{-1});
    }
    return with_buffer_hazards(std::move(out));
  }
  static void push(graph& out, task t, std::vector<task_id> deps) {
    t.id = static_cast<task_id>(out.tasks.size());
    t.deps = std::move(deps); // old ids, remapped once every task has its new one
    out.tasks.push_back(std::move(t));
  }
  // The bytes a task's cost is priced from: a kernel's reads and writes, a collective's larger side.
  static double traffic(const graph& g, const task& t) {
    const auto size = [&](buffer_id b) { return static_cast<double>(g.buffers[static_cast<std::size_t>(b)].bytes); };
    double sum = 0, most = 0;
    for (const auto b : t.reads) sum += size(b), most = std::max(most, size(b));
    for (const auto b : t.writes) sum += size(b), most = std::max(most, size(b));
    return is_collective(t.kind) ? most : sum;
  }
  struct cast_site {
    buffer_id from = -1, to = -1;
  };
  const graph& g_;
  const precision_policy& p_;
  std::vector<task_id> order_;
  std::vector<std::optional<dtype>> type_; // per root buffer (added ones too): decided type
  std::vector<char> made_, carried_;       // per buffer: weight gradients (find_weight_gradients)
  std::vector<buffer_id> copy_of_;                  // per parameter buffer: its working copy, or -1
  std::vector<buffer> added_;
  std::vector<std::vector<cast_site>> casts_;      // per task: the casts made just before it
  std::vector<std::vector<buffer_id>> new_reads_;  // per task: its reads, parameters redirected
  std::vector<std::vector<buffer_id>> new_writes_; // per task: its writes (an update's: master, state, working copy)
  std::vector<buffer_id> master_;                  // per task: an update's f32 master, or -1
  std::vector<char> dropped_;                      // per task: a ZeRO-1/2 slice of a parameter its master replaces
  std::vector<char> own_copy_;                     // per original root: a parameter stored in the working type
};

} // namespace detail::precision

/// @brief `g` under policy `p` (see the file comment); `g` itself when `p` keeps f32. Every rank
/// applies the same pass to the same graph, so collectives stay matched.
[[nodiscard]] inline graph apply_precision(const graph& g, const precision_policy& p) {
  if (!p.lowered()) return g;
  CONCERTO_CHECK(is_16bit_float(p.working), "precision " + to_string(p) + ": the working type must be f32, bf16 or f16");
  return detail::precision::pass(g, p).run();
}

} // namespace concerto::ir
