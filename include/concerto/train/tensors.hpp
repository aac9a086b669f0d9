#pragma once
/// @file
/// @brief A training step's named tensors: which buffer of the plan holds each of the program's
/// nodes on this rank and which block of its global value that is, and the transfers between
/// global tensors and the ranks' shards (gather, set, initialise, the inputs, checkpoints).
///
/// Names are the lowering's: a node's own name, a repeated block's node j of layer l as
/// "<repeat>.<l>.<name>". Pipelined, every rank indexes every tensor of the program in the same
/// order (so that the collectives over them, gather and save, match), with the stage that holds
/// it; a rank of another stage has no buffer for it (id -1). An input only the stage that reads it
/// holds.
///
/// @code
/// detail::tensor_index t;
/// t.build(executed.graph, lowered, nullptr, facts, mesh, depths, rank);
/// auto w = t.gather(backend, control, "layers.0.wq");   // collective
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/graph/lower.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/ir/precision.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/float16_values.hpp>
#include <concerto/train/checkpoint.hpp>
#include <concerto/train/detail/shard.hpp>
#include <concerto/train/options.hpp>
#include <concerto/train/program_facts.hpp>
#include <concerto/train/safetensors.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace concerto::train::detail {

/// @brief Where one named tensor lives on this rank.
struct tensor_info {
  ir::buffer_id id = -1;
  ir::dtype type = ir::dtype::f32;
  pspec spec{};
  bool partial = false;
  block blk;
  int stage = -1; ///< pipelined: the stage whose ranks hold it (id is -1 on the others); -1: every rank
};

/// @brief The named tensors of an executed plan; see the file comment.
class tensor_index {
public:
  /// Indexes `executed` (the plan's graph) by the program's names. `lowered` is the graph before
  /// planning and `split` its pipeline split (null when the step is not pipelined).
  void build(const ir::graph& executed, const ir::graph& lowered, const pipeline::stage_split* split, const program_facts& facts,
             const mesh& m, const std::map<std::string, int>& depths, int rank) {
    *this = tensor_index{};
    mesh_ = m;
    axes_ = facts.axes;
    stage_axis_ = split ? split->axis : -1;
    std::map<std::string, ir::buffer_id> by_name, in_step;
    // Views included: the planner's buckets turn gradients into views of one flat buffer.
    for (const auto& b : executed.buffers) by_name.emplace(b.name, b.id);
    if (split)
      for (const auto& b : lowered.buffers) in_step.emplace(b.name, b.id);
    const auto coords = mesh_.coords(rank);
    for (const auto& x : facts.nodes)
      for (const auto& name : names_of(x, depths)) {
        if (x.op == op_code::adamw || x.op == op_code::sgd) {
          // Under a 16-bit policy the parameter is its working copy and the values are the f32
          // master's, laid out as the update (ZeRO-1/2: a shard of the parameter).
          const auto master = ir::master_name(name);
          const auto m = by_name.find(master);
          const auto whole = in_step.find(master);
          if (m == by_name.end() && whole == in_step.end()) continue;
          const auto& buf = m != by_name.end() ? executed.buffers[static_cast<std::size_t>(m->second)]
                                               : lowered.buffers[static_cast<std::size_t>(whole->second)];
          tensor_info t{m != by_name.end() ? buf.id : -1, buf.type, x.spec, false, block_of(x.spec, x.global, buf.shape, coords)};
          if (split && whole != in_step.end()) t.stage = split->stage_of_buffer(lowered, whole->second);
          masters_[name.substr(0, name.size() - std::string_view(".update").size())] = t;
          continue;
        }
        const auto it = by_name.find(name);
        const auto whole = in_step.find(name);
        const bool input = graph::is_leaf(x.op) && x.op != op_code::param;
        if (it == by_name.end() && (whole == in_step.end() || input)) continue;
        const auto& buf = it != by_name.end() ? executed.buffers[static_cast<std::size_t>(it->second)]
                                              : lowered.buffers[static_cast<std::size_t>(whole->second)];
        tensor_info t{it != by_name.end() ? buf.id : -1, buf.type, x.spec, x.spec.partial != 0,
                      block_of(x.spec, x.global, buf.shape, coords)};
        if (split && whole != in_step.end()) t.stage = split->stage_of_buffer(lowered, whole->second);
        tensors_[name] = t;
        if (input) inputs_.push_back(name);
        if (x.op == op_code::param) {
          params_.push_back(name);
          init_of_[name] = x.init;
        }
        if (x.op == op_code::state) states_.push_back(name);
        if (x.init == leaf_init::running_stats) running_.push_back(name);
      }
    loss_id_ = info(facts.loss).id;
    // The loss is a sum over the axes it is pending on and a copy over the others (pipelined:
    // the last stage's ranks hold it, the others add nothing).
    int pending = split ? split->stages : 1;
    for (std::size_t a = 0; a < facts.axes.size(); ++a)
      if (facts.loss_partial & (1u << a)) pending *= mesh_.axes()[static_cast<std::size_t>(*mesh_.index_of(facts.axes[a]))].size;
    loss_copies_ = static_cast<double>(mesh_.rank_count()) / pending;
  }

  [[nodiscard]] const tensor_info& info(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("train step: the graph has no tensor named '" + name + "'");
    return it->second;
  }
  [[nodiscard]] const std::vector<std::string>& params() const noexcept { return params_; }
  /// A parameter's f32 master where a 16-bit policy keeps one beside it (else null).
  [[nodiscard]] const tensor_info* master(const std::string& name) const {
    const auto it = masters_.find(name);
    return it == masters_.end() ? nullptr : &it->second;
  }
  /// Batch norms' running statistics: evaluation reads them, training moves them.
  [[nodiscard]] const std::vector<std::string>& running_stats() const noexcept { return running_; }
  /// Parameters, then optimizer states: what a checkpoint holds.
  [[nodiscard]] std::vector<std::string> state_names() const {
    auto all = params_;
    all.insert(all.end(), states_.begin(), states_.end());
    return all;
  }

  /// This rank's value of the loss (0 where it holds none: another pipeline stage's rank).
  template <class Backend>
  [[nodiscard]] double local_loss(Backend& backend) const {
    float local = 0;
    if (loss_id_ >= 0) backend.read(loss_id_, std::as_writable_bytes(std::span(&local, 1)));
    return double{local};
  }
  /// How many ranks hold a copy of each pending part of the loss: the sum over the ranks of
  /// local_loss counts the loss this many times.
  [[nodiscard]] double loss_copies() const noexcept { return loss_copies_; }

  /// Any named f32, bf16 or f16 tensor (the working precision's activations and gradients: widened
  /// exactly) gathered to its global shape on every rank, as f32; a parameter's f32 master where
  /// the step keeps one. Collective.
  template <class Backend>
  [[nodiscard]] std::vector<float> gather(Backend& backend, const runtime::mpi::control& control, const std::string& name) const {
    const auto master = masters_.find(name);
    const auto& t = master != masters_.end() ? master->second : info(name);
    if (t.type != ir::dtype::f32 && !ir::is_16bit_float(t.type))
      fail("train step: tensor '" + name + "' holds " + std::string(ir::to_string(t.type)) + ", not floating-point values");
    if (t.partial) fail("train step: tensor '" + name + "' is a pending sum on this mesh; it has no global value yet");
    const auto n = static_cast<std::size_t>(count(t.blk.local));
    const auto size = static_cast<std::size_t>(mesh_.rank_count());
    std::vector<float> mine(n), all(n * size), out(static_cast<std::size_t>(count(t.blk.global)));
    if (t.id >= 0 && ir::is_16bit_float(t.type)) {
      std::vector<std::uint16_t> raw(n);
      backend.read(t.id, std::as_writable_bytes(std::span(raw)));
      runtime::widen_16bit(t.type, raw, mine);
    } else if (t.id >= 0) {
      backend.read(t.id, std::as_writable_bytes(std::span(mine)));
    }
    control.all_gather(std::span<const float>(mine), std::span(all), "gathering tensor '" + name + "'");
    for (std::size_t r = 0; r < size; ++r) {
      const auto coords = mesh_.coords(static_cast<int>(r));
      if (t.stage >= 0 && coords[static_cast<std::size_t>(stage_axis_)] != t.stage) continue;
      copy_block(block_of(t.spec, t.blk.global, t.blk.local, coords), sizeof(float), reinterpret_cast<std::byte*>(out.data()),
                 reinterpret_cast<std::byte*>(all.data() + r * n), false);
    }
    return out;
  }

  /// Sets a tensor from its global value; each rank keeps its block.
  template <class Backend>
  void set(Backend& backend, const std::string& name, std::span<const float> global) const {
    const auto& t = info(name);
    if (global.size() != static_cast<std::size_t>(count(t.blk.global)))
      fail("train step: '" + name + "' has " + std::to_string(count(t.blk.global)) + " values, got " +
           std::to_string(global.size()));
    write_tensor(backend, name, std::as_bytes(global).data());
  }

  /// Every parameter by its leaf's initialiser, from a seed per global element: the same model
  /// on every mesh shape (train/detail/shard.hpp).
  template <class Backend>
  void initialise(Backend& backend, std::uint64_t seed) const {
    for (const auto& name : params_) {
      const auto& t = info(name);
      if (t.id < 0) continue; // another pipeline stage holds it
      const auto& shape = t.blk.global;
      std::vector<float> global(static_cast<std::size_t>(count(shape)));
      auto rule = init_of_.at(name);
      if (rule == leaf_init::automatic) rule = shape.size() == 1 ? leaf_init::zeros : leaf_init::fan_in;
      if (rule == leaf_init::zeros || rule == leaf_init::ones) {
        std::fill(global.begin(), global.end(), rule == leaf_init::ones ? 1.0f : 0.0f);
      } else {
        // fan_in: the contracted dimension of a [..., in, out] weight (an expert stack [E, in, out]
        // is scaled by its input width, not by its expert count); a vector's length; a
        // convolution's kernel [kernel_h, kernel_w, in, out]: its window, every dimension but the last.
        const auto fan_in = shape.size() == 1                   ? shape[0]
                            : rule == leaf_init::kernel_fan_in ? count(shape) / shape.back()
                                                                : shape[shape.size() - 2];
        const float scale = std::sqrt(3.0f / static_cast<float>(fan_in));
        for (std::size_t i = 0; i < global.size(); ++i) global[i] = scale * uniform(seed, name, i);
      }
      set(backend, name, global);
    }
    // Running statistics [2, channels]: mean 0, variance 1, as a framework's BatchNorm starts.
    for (const auto& name : running_) {
      const auto& t = info(name);
      if (t.id < 0) continue;
      std::vector<float> global(static_cast<std::size_t>(count(t.blk.global)), 0.0f);
      std::fill(global.begin() + static_cast<std::ptrdiff_t>(global.size() / 2), global.end(), 1.0f);
      set(backend, name, global);
    }
  }

  /// Each input shard of this rank, as `load` fills it.
  template <class Backend>
  void write_inputs(Backend& backend, const loader& load) {
    for (const auto& in : inputs_) {
      const auto& t = tensors_.at(in);
      shard_request r{in, t.blk.global, t.blk.offset, t.blk.local, {}, {}};
      if (t.type == ir::dtype::i64) {
        staging_i64_.resize(static_cast<std::size_t>(count(t.blk.local)));
        r.i64 = staging_i64_;
        load(r);
        backend.write(t.id, std::as_bytes(std::span(staging_i64_)));
      } else {
        staging_.resize(static_cast<std::size_t>(count(t.blk.local)));
        r.f32 = staging_;
        load(r);
        backend.write(t.id, std::as_bytes(std::span(staging_)));
      }
    }
  }

  /// What a checkpoint holds besides the tensors.
  struct saved_state {
    std::int64_t steps = 0;
    nlohmann::json trainer;      ///< the trainer's own state, or null
    nlohmann::json loss_scaling; ///< the loss scaler's state, or null
  };

  /// Writes every parameter and optimizer state, gathered, and `state` to `path` (rank 0 writes,
  /// atomically). Collective. Format and checks: train/checkpoint.hpp.
  template <class Backend>
  void save(Backend& backend, const runtime::mpi::control& control, const std::filesystem::path& path,
            const saved_state& state) const {
    checkpoint::writer file;
    for (const auto& name : state_names()) file.add(name, info(name).blk.global, gather(backend, control, name));
    if (control.rank() == 0) write_file_atomically(path, std::move(file).finish(state.steps, state.trainer, state.loss_scaling));
    control.barrier("the end of saving checkpoint '" + path.string() + "'");
  }

  /// Reads a checkpoint written by `save` (on any mesh) into this rank's shards and returns what
  /// it holds besides them; when the file fails a check on any rank, every rank throws naming it
  /// before a value is written. Collective.
  template <class Backend>
  [[nodiscard]] saved_state load(Backend& backend, const runtime::mpi::control& control, const std::filesystem::path& path) const {
    checkpoint::contents file;
    read_together(control, "checkpoint '" + path.string() + "'", [&](const std::string& what) {
      file = checkpoint::read(path);
      for (const auto& name : state_names()) {
        const auto it = file.tensors.find(name);
        if (it == file.tensors.end()) fail(what + " has no tensor '" + name + "'");
        check_shape(what, name, it->second.shape);
      }
    });
    // Straight from the file's bytes (checked above), without a copy of the global tensor.
    for (const auto& name : state_names()) write_tensor(backend, name, file.bytes(name).data());
    return {file.step, std::move(file.trainer), std::move(file.loss_scaling)};
  }

  /// Writes every parameter (not the optimizer state) and every batch norm's running statistics
  /// (`<gain>.running` [2, channels]: the means, then the variances; what evaluation normalises
  /// by), gathered, to `path` in the safetensors format as `type`, named as the program names
  /// them (rank 0 writes, atomically). Collective.
  template <class Backend>
  void export_safetensors(Backend& backend, const runtime::mpi::control& control, const std::filesystem::path& path,
                          safetensors::dtype type) const {
    safetensors::writer file;
    for (const auto& name : params_) file.add(name, info(name).blk.global, gather(backend, control, name), type);
    for (const auto& name : running_) file.add(name, info(name).blk.global, gather(backend, control, name), type);
    if (control.rank() == 0) write_file_atomically(path, std::move(file).finish({{"format", "pt"}, {"written_by", "concerto"}}));
    control.barrier("the end of exporting '" + path.string() + "'");
  }

  /// Reads every parameter from a safetensors file (F32, BF16 or F16; from any mesh or
  /// framework) into this rank's shards, and the running statistics the file holds (those it
  /// lacks keep their values: another framework's file may carry them under its own names). The
  /// file holds exactly the program's parameters with their shapes, and nothing but them and
  /// running statistics; when it does not, or fails a check, on any rank, every rank throws
  /// naming it before a value is written. Collective.
  template <class Backend>
  void import_safetensors(Backend& backend, const runtime::mpi::control& control, const std::filesystem::path& path) const {
    std::optional<safetensors::contents> file;
    read_together(control, "safetensors '" + path.string() + "'", [&](const std::string& what) {
      file = safetensors::read(path);
      for (const auto& name : params_) {
        const auto it = file->tensors.find(name);
        if (it == file->tensors.end()) fail(what + " has no tensor '" + name + "', a parameter of the program");
        check_shape(what, name, it->second.shape);
      }
      for (const auto& [name, e] : file->tensors) {
        if (std::find(params_.begin(), params_.end(), name) != params_.end()) continue;
        if (std::find(running_.begin(), running_.end(), name) == running_.end())
          fail(what + " holds tensor '" + name + "', which is no parameter of the program" +
               (running_.empty() ? "" : " nor one of its batch norms' running statistics") + " (rename it, or drop it from the file)");
        check_shape(what, name, e.shape);
      }
    });
    for (const auto& name : params_) set(backend, name, file->values(name));
    for (const auto& name : running_)
      if (file->tensors.contains(name)) set(backend, name, file->values(name));
  }

private:
  // Runs `read` (which throws concerto::error saying what is wrong, `what` naming the file) on
  // every rank: each reads the file itself (a shared file system may show one rank another
  // file), and all go on, or all stop with the first rank's message, before a value is written.
  template <class Read>
  static void read_together(const runtime::mpi::control& control, const std::string& what, Read&& read) {
    std::string problem;
    try {
      read(what);
    } catch (const error& e) {
      std::string_view why = e.what();
      if (why.starts_with("concerto: ")) why.remove_prefix(10);
      if (control.rank() != 0) problem = "on rank " + std::to_string(control.rank()) + ": ";
      problem += why;
    }
    runtime::stop_together(std::move(problem), control, "loading " + what);
  }
  // A named tensor from its global f32 values (bytes, maybe unaligned): this rank's block, and
  // the parameter's f32 master beside its working copy where the step keeps one.
  template <class Backend>
  void write_tensor(Backend& backend, const std::string& name, const std::byte* global) const {
    write_block(backend, info(name), global);
    if (const auto master = masters_.find(name); master != masters_.end()) write_block(backend, master->second, global);
  }
  // This rank's block of a global f32 tensor (bytes, maybe unaligned), written to its buffer;
  // nothing where another pipeline stage holds the tensor.
  template <class Backend>
  static void write_block(Backend& backend, const tensor_info& t, const std::byte* global) {
    if (t.id < 0) return;
    std::vector<float> local(static_cast<std::size_t>(count(t.blk.local)));
    copy_block(t.blk, sizeof(float), const_cast<std::byte*>(global), reinterpret_cast<std::byte*>(local.data()), true);
    if (ir::is_16bit_float(t.type)) {
      std::vector<std::uint16_t> rounded(local.size());
      runtime::round_to_16bit(t.type, local, rounded);
      backend.write(t.id, std::as_bytes(std::span(rounded)));
      return;
    }
    backend.write(t.id, std::as_bytes(std::span(local)));
  }
  void check_shape(const std::string& what, const std::string& name, const std::vector<std::int64_t>& shape) const {
    if (const auto& want = info(name).blk.global; shape != want)
      fail(what + ": tensor '" + name + "' has shape " + graph::detail::dims_text(shape) + ", the program expects " +
           graph::detail::dims_text(want));
  }

  // The names a node goes by: its own, or one per layer of its repeat.
  static std::vector<std::string> names_of(const program_facts::node& x, const std::map<std::string, int>& depths) {
    if (x.repeat.empty()) return {x.name};
    std::vector<std::string> names;
    for (int l = 0; l < depths.at(x.repeat); ++l) names.push_back(x.repeat + "." + std::to_string(l) + "." + x.name);
    return names;
  }

  // The block of a tensor with this spec and global shape held by the rank at `coords` in a
  // buffer of shape `local`.
  [[nodiscard]] block block_of(const pspec& spec, const std::vector<std::int64_t>& global, const std::vector<std::int64_t>& local,
                               const std::vector<int>& coords) const {
    std::vector<std::vector<axis_part>> splits(global.size());
    for (int d = 0; d < spec.rank && static_cast<std::size_t>(d) < global.size(); ++d)
      for (const auto a : spec.dims[d]) {
        if (a < 0) continue;
        const auto m = static_cast<std::size_t>(*mesh_.index_of(axes_[static_cast<std::size_t>(a)]));
        splits[static_cast<std::size_t>(d)].push_back({mesh_.axes()[m].size, coords[m]});
      }
    return detail::block_of(global, splits, local);
  }

  mesh mesh_;
  std::vector<std::string> axes_; ///< the program's axis names, by its axis index
  int stage_axis_ = -1;           ///< pipelined: the pipeline axis's index in the mesh
  std::map<std::string, tensor_info> tensors_;
  std::map<std::string, tensor_info> masters_; ///< by parameter: its f32 master, under a 16-bit policy
  std::vector<std::string> inputs_, params_, states_;
  std::vector<std::string> running_; ///< batch norms' running statistics: states the forward pass reads in evaluation
  std::map<std::string, leaf_init> init_of_; ///< each parameter's rule, from its leaf
  ir::buffer_id loss_id_ = -1;
  double loss_copies_ = 1;
  std::vector<float> staging_;
  std::vector<std::int64_t> staging_i64_;
};

/// A loader that gives each rank its shard of the global batch `b`, checking each tensor's
/// name, shape and element count against the program's.
[[nodiscard]] inline loader loader_of(const batch& b) {
  return [&b](const shard_request& r) {
    const auto it = b.find(r.name);
    if (it == b.end()) fail("train step: the batch has no tensor '" + r.name + "'");
    if (it->second.shape != r.global_shape)
      fail("train step: tensor '" + r.name + "' has shape " + graph::detail::dims_text(it->second.shape) +
           " but the program expects " + graph::detail::dims_text(r.global_shape));
    const block blk{r.global_shape, r.offset, r.local_shape};
    if (!r.f32.empty()) {
      if (it->second.f32.size() != static_cast<std::size_t>(count(r.global_shape)))
        fail("train step: tensor '" + r.name + "' needs " + std::to_string(count(r.global_shape)) + " f32 values");
      copy_block(blk, sizeof(float), reinterpret_cast<std::byte*>(const_cast<float*>(it->second.f32.data())),
                 reinterpret_cast<std::byte*>(r.f32.data()), true);
    } else {
      if (it->second.i64.size() != static_cast<std::size_t>(count(r.global_shape)))
        fail("train step: tensor '" + r.name + "' needs " + std::to_string(count(r.global_shape)) + " i64 ids");
      copy_block(blk, sizeof(std::int64_t), reinterpret_cast<std::byte*>(const_cast<std::int64_t*>(it->second.i64.data())),
                 reinterpret_cast<std::byte*>(r.i64.data()), true);
    }
  };
}

/// Each mixture-of-experts layer's balance loss in the last step of `lowered`, computed from the
/// router logits `gather` returns (global, by name) by the routing kernels' own formula.
template <class Gather>
[[nodiscard]] std::vector<moe_balance> moe_balance_losses(const ir::graph& lowered, Gather&& gather) {
  std::vector<moe_balance> out;
  for (const auto& t : lowered.tasks) {
    if (t.fn != ir::op::moe_route) continue;
    const auto logits = t.reads.at(0);
    // The weight is the backward's (moe_route_grad reads the same logits); without one, 0.
    double weight = 0;
    for (const auto& u : lowered.tasks)
      if (u.fn == ir::op::moe_route_grad && u.reads.at(0) == logits)
        weight = static_cast<double>(u.attr("weight_num")) / static_cast<double>(u.attr("weight_den", 1));
    const std::vector<float> values = gather(lowered.buffers[static_cast<std::size_t>(logits)].name);
    runtime::cpu::moe_shape shape{.group = static_cast<std::size_t>(t.attr("group")),
                                  .experts = static_cast<std::size_t>(t.attr("experts")),
                                  .top_k = static_cast<std::size_t>(t.attr("top_k"))};
    shape.groups = values.size() / (shape.group * shape.experts);
    const double balance = runtime::cpu::moe_balance_sum(values, shape) / static_cast<double>(shape.groups);
    out.push_back({lowered.buffers[static_cast<std::size_t>(t.writes.at(0))].name, balance, weight, weight * balance});
  }
  return out;
}

} // namespace concerto::train::detail
