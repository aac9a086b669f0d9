#pragma once
/// @file
/// @brief `train::compile(program, mesh, shapes, optimizer, options)`: a training step object.
///
/// Nothing runs at compile: the program is lowered (every rank, cheap). The first call of the
/// step (or `prepare()`) plans on rank 0 (or loads the plan from the cache), broadcasts and
/// verifies it, makes the executor over the backend of the build (train/backend_select.hpp) and
/// initialises the parameters; later calls only run. Each call takes the global batch (every rank
/// keeps its shard) or a loader that fills each rank's shard, and returns the loss of the whole
/// batch on every rank.
///
/// Parameters are initialised from a seed per global element (train/detail/shard.hpp), so a
/// model starts identical on every mesh shape, by each parameter's initialiser (`param<"g">(spec,
/// init::ones)`; by default rank-1 parameters are zeros and the rest uniform with standard
/// deviation 1/√fan_in, fan_in the next-to-last dimension: the `in` of an `[in, out]` or
/// `[experts, in, out]` weight).
///
/// @code
/// runtime::mpi::environment env(argc, argv);
/// const auto m = mesh::from_world(runtime::mpi::environment::world_size(), {{"dp", -1}, {"tp", 2}});
/// auto step = train::compile(mlp, m, shapes, {.sgd = {.lr = 0.1f}}, {.policy = planner::policy::concerto});
/// for (int i = 0; i < 100; ++i) {
///   const auto r = step({{"x", {{64, 512}, x}}, {"target", {{64, 512}, y}}});
///   if (r.rank == 0) std::printf("step %lld loss %.4f\n", (long long)r.step, r.loss);
/// }
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/graph/lower.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/train/agreement.hpp>
#include <concerto/train/backend_select.hpp>
#include <concerto/train/choice.hpp>
#include <concerto/train/choice_store.hpp>
#include <concerto/train/kernel_factors.hpp>
#include <concerto/train/loss_scaling.hpp>
#include <concerto/train/options.hpp>
#include <concerto/train/pipeline.hpp>
#include <concerto/train/plan_choice.hpp>
#include <concerto/train/planning.hpp>
#include <concerto/train/program_facts.hpp>
#include <concerto/train/sharding.hpp>
#include <concerto/train/step_checks.hpp>
#include <concerto/train/tensors.hpp>

#include <mpi.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace concerto::train {

/// @brief A compiled training step (what `train::compile` returns is a `step<N>`, which adds
/// only its constructor from the program): lowering done, planning on the first call. Its parts:
/// the plan (train/planning.hpp, the kernel factors of train/kernel_factors.hpp), the plan
/// choice (train/choice.hpp, its record train/choice_store.hpp), the named tensors and
/// checkpoints (train/tensors.hpp), the settings agreement (train/agreement.hpp) and the
/// debugging aids (train/step_checks.hpp); this class runs them in order.
template <class Backend = default_backend>
class basic_step {
public:
  /// `forward`: the program's forward pass alone on the whole batch (lower_options::forward_only),
  /// which evaluate() plans and runs.
  basic_step(detail::lowered_program lowered, ir::graph forward, concerto::mesh m, shape_map shapes, optimizer_settings opt,
             step_options o)
      : facts_(std::move(lowered.facts)), mesh_(std::move(m)), shapes_(std::move(shapes)), options_(std::move(o)),
        graph_(std::move(lowered.graph)), forward_graph_(std::move(forward)) {
    settings_.sgd = opt.sgd;
    settings_.adamw = opt.adamw;
    settings_.schedule = opt.schedule;
    settings_.clip_norm = opt.clip_norm;
    for (const auto& t : graph_.tasks) uses_adamw_ = uses_adamw_ || t.fn == ir::op::adamw;
    MPI_Comm_rank(options_.world, &rank_);
    MPI_Comm_size(options_.world, &size_);
    if (mesh_.rank_count() != size_)
      fail("train::compile: the mesh has " + std::to_string(mesh_.rank_count()) + " ranks but the communicator has " +
           std::to_string(size_));
    detail::read_environment(options_);
    detail::check_options(options_, settings_);
    scaler_ = loss_scaler(options_.loss_scaling);
    if (const auto& pp = options_.pipeline; const auto axis = mesh_.index_of(pp.axis)) {
      detail::check_pipeline_options(pp, mesh_.axes()[static_cast<std::size_t>(*axis)].size);
      // Checked here, on every rank, rather than at the first step.
      split_ = pipeline::split(graph_, {.axis = pp.axis, .microbatches = pp.microbatches, .virtual_stages = pp.virtual_stages});
      options_.choice.enabled = false; // one plan per stage; the schedule is the choice
    } else if (pp.microbatches != 1) {
      fail("train step: " + std::to_string(pp.microbatches) + " micro-batches need the mesh axis '" + pp.axis +
           "' to pipeline over (of size 1 to accumulate gradients over micro-batches without stages)");
    }
    control_.emplace(options_.world, runtime::detail::resolve_timeout_s(options_.executor.timeout_s,
                                                                        options_.executor.timeout_from_env, "train step"));
  }

  /// @brief The rate the optimizer uses at step `step` (from 1): the schedule's for the
  /// program's optimizer (optimizer_settings).
  [[nodiscard]] float learning_rate(std::int64_t step) const {
    return runtime::lr_at(settings_.schedule, uses_adamw_ ? settings_.adamw.lr : settings_.sgd.lr, step);
  }

  /// @brief The lowered graph (before planning).
  [[nodiscard]] const ir::graph& graph() const noexcept { return graph_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// @brief Plans (rank 0, or the cache), builds the executor and initialises the parameters;
  /// the first step does it if nobody did. Collective over the step's ranks.
  void prepare() {
    if (ex_) return;
    // First, before any other collective: a rank with other settings would run rank 0's plan
    // with its own numbers, or wait in a collective the others never start.
    check_agreement(settings_record_of(options_, settings_, shapes_, graph_), *control_);
    backend_ = make_backend(options_.world, settings_, control_->timeout_s(), options_.allow_tf32);
    model_ = detail::planning_model(options_, graph_, settings_, *control_, *backend_);
    const auto& model = *model_;
    if (split_) {
      auto stage = detail::plan_stage(options_.pipeline, graph_, *split_, mesh_, model, *backend_, *control_);
      summary_ = std::move(stage.summary);
      stage_origins_ = std::move(stage.origins);
      ex_ = std::make_unique<runtime::executor<Backend>>(std::move(stage.plan), *backend_, options_.executor);
    } else {
      auto first = detail::plan_first(options_, graph_, model, *backend_, choice_store(), chooses());
      summary_ = std::move(first.summary);
      if (first.earlier && first.earlier->at("confirm").empty())
        chooser_.decided(detail::choice_store::report_of(*first.earlier));
      else if (first.earlier || chooses()) // measured again against its close rivals, or chosen anew
        chooser_.begin({.prior = model, .options = options_.choice, .planning = detail::planning_options(options_),
                        .store = choice_store(), .keeps_choice = options_.use_cache, .earlier = std::move(first.earlier),
                        .rivals = std::move(first.rivals)});
      ex_ = std::make_unique<runtime::executor<Backend>>(std::move(first.plan), *backend_, options_.executor);
    }
    if (!options_.trace_dir.empty()) {
      const auto& planned = ex_->plan();
      write_trace("planned", sim::simulate(planned, planned.duration_us)); // durations already priced with contention
    }
    index_tensors();
    tensors_.initialise(*backend_, options_.seed);
  }

  /// @brief What the first call decided.
  [[nodiscard]] const plan_summary& summary() {
    prepare();
    return summary_;
  }
  /// @brief The plan the next step runs (after prepare): the one the last step ran, unless the
  /// plan choice has just switched to another.
  [[nodiscard]] const plan::plan& plan() {
    prepare();
    if (const auto* next = chooser_.pending_switch()) return *next;
    return ex_->plan();
  }

  /// @brief One step on the global batch: every rank keeps its shard of each input.
  step_result operator()(const batch& b) { return (*this)(detail::loader_of(b)); }

  /// @brief One step whose inputs a loader fills, shard by shard, on each rank.
  step_result operator()(const loader& load) {
    prepare();
    start_pending_plan();
    tensors_.write_inputs(*backend_, load);
    const float loss_scale = write_loss_scale();
    ++parameters_version_;
    const auto& rep = run_step();
    if (!options_.trace_dir.empty()) write_trace("measured", rep.measured);
    const double loss = control_->sum_all(tensors_.local_loss(*backend_), "the loss of step " + std::to_string(rep.step)) /
                        tensors_.loss_copies();
    // Every rank holds the same sum, so every rank stops here, together.
    if (options_.stop_on_non_finite_loss && !std::isfinite(loss))
      fail_on_every_rank("train step: the loss of step " + std::to_string(rep.step) + " of graph '" + graph_.name + "' is " +
                         std::to_string(loss) +
                         detail::where_non_finite_began(rep, *ex_, *control_, facts_, split_ ? &*split_ : nullptr,
                                                        stage_origins_) +
                         "; training stopped (the parameters hold this step's update; a smaller learning rate usually "
                         "helps; step_options::stop_on_non_finite_loss = false goes on)");
    if (options_.check_replicas_every > 0 && rep.step % options_.check_replicas_every == 0)
      detail::check_replicas(rep.step, tensors_, *backend_, *control_, graph_.name);
    step_result out{rep.step, loss, rep.measured.step_us, rep.measured.exposed_comm_us, rank_, learning_rate(rep.step)};
    const float norm_sq = grad_norm_sq();
    if (grad_norm_sq_ >= 0) out.grad_norm = std::sqrt(static_cast<double>(norm_sq)) / loss_scale;
    if (loss_scale_ >= 0) {
      // The norm is the same sum on every rank, so every rank skips (or not) and moves the scale alike.
      out.loss_scale = loss_scale;
      out.skipped = runtime::overflowed(norm_sq);
      scaler_.after_step(out.skipped);
      if (out.skipped) ex_->set_completed_steps(ex_->completed_steps() - 1); // no update was applied
    }
    if (chooser_.active())
      chooser_.advance(rep, *control_, *backend_, ex_->plan(), [&] { return detail::planner_input(options_, graph_); });
    return out;
  }

  /// @brief The loss of the global batch under the current parameters, by the forward pass
  /// alone: no gradient, no update, the step count unchanged (validation). Its plan is made at
  /// the first call (rank 0, through the plan cache: a forward-only graph is an entry of its
  /// own) and runs on a backend of its own, to which a call copies the parameters when they
  /// changed since the last (a pipelined step gathers them: evaluation runs the whole forward
  /// pass on every rank, without stages). Collective.
  /// @code
  /// if (step.completed_steps() % 100 == 0) std::printf("val loss %.4f\n", step.evaluate(val_batch));
  /// @endcode
  [[nodiscard]] double evaluate(const batch& b) { return evaluate(detail::loader_of(b)); }
  /// @brief As above, the inputs filled by a loader, shard by shard, on each rank.
  [[nodiscard]] double evaluate(const loader& load) {
    prepare();
    prepare_evaluation();
    auto& e = *eval_;
    // The parameters as training left them, once per change (validating on several batches
    // copies them once): a rank's own shard where both graphs shard alike.
    if (e.copied != parameters_version_) {
      auto copied = tensors_.params();
      copied.insert(copied.end(), tensors_.running_stats().begin(), tensors_.running_stats().end());
      for (const auto& name : copied) {
        const auto& from = tensors_.info(name);
        const auto& to = e.tensors.info(name);
        const auto bytes = from.id >= 0 ? static_cast<std::size_t>(ex_->plan().graph.buffer_at(from.id).bytes) : 0;
        if (!split_ && from.id >= 0 && to.id >= 0 && from.blk.local == to.blk.local && from.blk.offset == to.blk.offset &&
            bytes == static_cast<std::size_t>(e.ex->plan().graph.buffer_at(to.id).bytes)) {
          if (e.staging.size() < bytes) e.staging.resize(bytes);
          const auto staged = std::span(e.staging).first(bytes);
          backend_->read(from.id, staged);
          e.backend->write(to.id, staged);
        } else {
          e.tensors.set(*e.backend, name, gather(name));
        }
      }
      e.copied = parameters_version_;
    }
    e.tensors.write_inputs(*e.backend, load);
    e.ex->run_step();
    return control_->sum_all(e.tensors.local_loss(*e.backend), "the evaluation loss after step " +
                                                                   std::to_string(completed_steps())) /
           e.tensors.loss_copies();
  }
  /// @brief A value of the last evaluate()'s forward pass, gathered to its global shape on every
  /// rank (collective): a node of the program by its name in the step's messages, e.g. the
  /// prediction (prediction_name()) to score a held-out set by.
  /// @code
  /// step.evaluate(heldout);
  /// const auto logits = step.evaluated(step.prediction_name()); // [examples, classes]
  /// @endcode
  [[nodiscard]] std::vector<float> evaluated(const std::string& name) {
    if (!eval_) fail("train step: evaluated('" + name + "') reads the last evaluation; call evaluate(batch) first");
    return eval_->tensors.gather(*eval_->backend, *control_, name);
  }
  /// @brief The name of what the loss compares with its target (program_facts::prediction): a
  /// cross-entropy's logits, an mse's prediction.
  [[nodiscard]] const std::string& prediction_name() const noexcept { return facts_.prediction; }

  /// @brief What the evaluation's first call decided (after a first evaluate).
  [[nodiscard]] const plan_summary& evaluation_summary() {
    prepare();
    prepare_evaluation();
    return eval_->summary;
  }

  /// @brief What the plan choice measured and kept (train/plan_choice.hpp); `decided()` is false
  /// while it is still measuring, and when the step does not choose (another policy, or off).
  [[nodiscard]] const plan_choice_report& choice() const noexcept { return chooser_.report(); }

  /// @brief Names of the trained parameters (as in the graph: `w1`, `layers.0.wq`, ...).
  [[nodiscard]] std::vector<std::string> parameter_names() {
    prepare();
    return tensors_.params();
  }
  /// @brief A parameter gathered to its global shape, on every rank (collective).
  [[nodiscard]] std::vector<float> parameter(const std::string& name) { return gather(name); }
  /// @brief The final gradient of a parameter of the last step (`name` without ".grad"), global,
  /// on every rank; under loss scaling the true gradient (the step's scale divided out).
  [[nodiscard]] std::vector<float> gradient(const std::string& name) {
    auto g = gather(name + ".grad");
    if (last_loss_scale_ != 1.0f)
      for (auto& v : g) v /= last_loss_scale_;
    return g;
  }
  /// @brief Sets a parameter (or optimizer state) from its global value; each rank keeps its shard.
  void set_parameter(const std::string& name, std::span<const float> global) {
    prepare();
    tensors_.set(*backend_, name, global);
    ++parameters_version_;
  }
  /// @brief The global shape of a named tensor of the graph.
  [[nodiscard]] std::vector<std::int64_t> global_shape(const std::string& name) {
    prepare();
    return tensors_.info(name).blk.global;
  }

  /// @brief Any named f32 tensor of the graph (parameters, gradients, optimizer state `w.m`, an
  /// activation of the last step), gathered to its global shape on every rank. Collective.
  [[nodiscard]] std::vector<float> gather(const std::string& name) {
    prepare();
    return tensors_.gather(*backend_, *control_, name);
  }

  /// @brief Each mixture-of-experts layer's balance loss in the last step, in layer order, on
  /// every rank (collective: it gathers each layer's router logits). Not part of the step's
  /// returned loss: the routing adds its gradient in the backward pass (docs/moe.md).
  /// @code
  /// for (const auto& l : step.moe_balance_losses()) std::printf("%s: %.3f\n", l.router.c_str(), l.balance);
  /// @endcode
  [[nodiscard]] std::vector<moe_balance> moe_balance_losses() {
    prepare();
    if (split_ && split_->microbatches > 1)
      fail("train step: moe_balance_losses reads one micro-batch's router logits; a pipelined step with " +
           std::to_string(split_->microbatches) + " micro-batches keeps several");
    return detail::moe_balance_losses(graph_, [&](const std::string& name) { return gather(name); });
  }

  /// @brief Writes every parameter and optimizer state, gathered to global tensors, and the step
  /// count to `path` (rank 0 writes, atomically); loadable on any mesh the shapes divide over.
  /// `trainer`: the trainer's own state (a JSON object: a data loader's position, ...), which
  /// load() returns. Collective. Format and checks: train/checkpoint.hpp.
  void save(const std::filesystem::path& path, const nlohmann::json& trainer = nullptr) {
    prepare();
    tensors_.save(*backend_, *control_, path,
                  {completed_steps(), trainer, loss_scale_ >= 0 ? scaler_.state() : nlohmann::json(nullptr)});
  }

  /// @brief Reads a checkpoint written by `save` (on any mesh): each rank keeps its shards;
  /// the step count continues from the checkpoint's. Collective: when the file fails a check on
  /// any rank, every rank throws (concerto::collective_error) naming the file and what is wrong:
  /// a damaged header, index or tensor (checksums, train/checkpoint.hpp), a missing or misshapen
  /// tensor. A refused checkpoint leaves the step as it was. Returns the trainer state saved with
  /// it (null when none was).
  nlohmann::json load(const std::filesystem::path& path) {
    prepare();
    auto saved = tensors_.load(*backend_, *control_, path);
    ++parameters_version_;
    ex_->set_completed_steps(saved.steps);
    // A checkpoint without a scaler's state (saved in another precision) keeps the initial scale.
    if (loss_scale_ >= 0 && !saved.loss_scaling.is_null()) scaler_.restore(saved.loss_scaling, "checkpoint '" + path.string() + "'");
    return std::move(saved.trainer);
  }

  /// @brief Writes the parameters and the batch norms' running statistics (`<gain>.running`),
  /// gathered to their global shapes and named as the program names them, to `path` in the
  /// safetensors format (F32, BF16 or F16), which PyTorch and Hugging Face code load (rank 0 writes,
  /// atomically). Collective. Format and checks: train/safetensors.hpp.
  void export_safetensors(const std::filesystem::path& path, safetensors::dtype type = safetensors::dtype::f32) {
    prepare();
    tensors_.export_safetensors(*backend_, *control_, path, type);
  }
  /// @brief Sets every parameter from a safetensors file (F32, BF16 or F16; written here on any
  /// mesh, or by another framework) holding exactly the program's parameters, and the running
  /// statistics it holds. Collective: a file that fails a check on any rank makes every rank
  /// throw, naming it, before a value changes.
  void import_safetensors(const std::filesystem::path& path) {
    prepare();
    tensors_.import_safetensors(*backend_, *control_, path);
    ++parameters_version_;
  }

  /// @brief Steps run so far (including those before a loaded checkpoint).
  [[nodiscard]] std::int64_t completed_steps() const noexcept { return ex_ ? ex_->completed_steps() : 0; }

private:
  // The forward pass's plan (rank 0 plans it, or the cache has it), its backend, executor and
  // named tensors. Collective.
  void prepare_evaluation() {
    if (eval_) return;
    auto o = options_;
    o.rewrite = nullptr; // the user's rewrite is of the training graph
    evaluation e;
    e.backend = make_backend(options_.world, settings_, control_->timeout_s(), options_.allow_tf32);
    auto first = detail::plan_first(o, forward_graph_, *model_, *e.backend, choice_store(), false);
    e.summary = std::move(first.summary);
    e.ex = std::make_unique<runtime::executor<Backend>>(std::move(first.plan), *e.backend, options_.executor);
    e.tensors.build(e.ex->plan().graph, forward_graph_, nullptr, facts_, mesh_, options_.lower.depth, rank_);
    eval_ = std::move(e);
  }

  [[nodiscard]] bool chooses() const { return options_.policy == planner::policy::concerto && options_.choice.enabled; }

  [[nodiscard]] detail::choice_store choice_store() const {
    return {options_.cache_dir, std::string(planner::to_string(options_.policy)),
            planner::hash(detail::planning_options(options_)), options_.choice.confirm_within};
  }

  // The squared global gradient norm of the last step (the tasks of graph/lower.hpp leave it in
  // `grad_norm_sq`, the same on every rank; loss-scaled under loss scaling); NaN when the step
  // neither clips nor scales its loss.
  [[nodiscard]] float grad_norm_sq() {
    if (grad_norm_sq_ < 0) return std::numeric_limits<float>::quiet_NaN();
    float sq = 0;
    backend_->read(grad_norm_sq_, std::as_writable_bytes(std::span(&sq, 1)));
    return sq;
  }
  // Under loss scaling: the scale this step multiplies its loss gradient by, written where its
  // tasks read it (before the step, outside any captured graph); 1 otherwise. The step's
  // gradients carry it (last_loss_scale_).
  float write_loss_scale() {
    last_loss_scale_ = 1.0f;
    if (loss_scale_ < 0) return last_loss_scale_;
    last_loss_scale_ = scaler_.scale();
    backend_->write(loss_scale_, std::as_bytes(std::span(&last_loss_scale_, 1)));
    return last_loss_scale_;
  }

  // The executor's step; a message names tasks by the lowering's names, and says what the
  // program wrote there.
  const runtime::step_report& run_step() {
    try {
      return ex_->run_step();
    } catch (const runtime::mpi::remote_failure&) {
      throw; // another rank's message, as it wrote it
    } catch (const collective_error& e) {
      throw collective_error(detail::as_written(facts_, e.what()));
    } catch (const error& e) {
      throw error(detail::as_written(facts_, e.what()));
    }
  }

  void index_tensors() {
    tensors_.build(ex_->plan().graph, graph_, split_ ? &*split_ : nullptr, facts_, mesh_, options_.lower.depth, rank_);
    const auto& buffers = ex_->plan().graph.buffers;
    const auto named = [&](std::string_view name) {
      const auto it = std::find_if(buffers.begin(), buffers.end(), [&](const ir::buffer& b) { return b.name == name; });
      return it == buffers.end() ? ir::buffer_id{-1} : it->id;
    };
    grad_norm_sq_ = named(ir::grad_norm_sq_buffer);
    loss_scale_ = named(ir::loss_scale_buffer);
  }

  /// Before a step: the plan the choice switched to, on a new executor over the same backend,
  /// every named tensor that outlives a step (parameters, optimizer states, the last step's
  /// gradients) carried over by name. The switch waits for the next step, so that until then
  /// every tensor the last step wrote, activations included, is still there to read (gather,
  /// save), whichever plan ran it. Collective: every rank switches before the same step.
  void start_pending_plan() {
    auto next = chooser_.take_switch();
    if (!next) return;
    const auto started = std::chrono::steady_clock::now();
    const auto& g = ex_->plan().graph;
    // Only what outlives a step travels: parameters (and their shards), optimizer states, and
    // the last step's gradients (gradient() reads them), by buffer name, so that a gradient that
    // is a view of a bucket in one plan and a buffer of its own in the other still arrives.
    // Activations are written again by the next step, and on a GPU every byte carried crosses
    // the host twice (a width-1024 GPT's activations took 1.6 s per switch on an H200).
    std::set<ir::buffer_id> bucketed;
    for (const auto& b : g.buffers)
      if (b.view_of >= 0) bucketed.insert(b.view_of);
    std::vector<const ir::buffer*> persistent;
    for (const auto& b : g.buffers)
      if ((b.role == ir::buffer_role::param || b.role == ir::buffer_role::optimizer_state ||
           b.role == ir::buffer_role::gradient) && !bucketed.contains(b.id))
        persistent.push_back(&b);
    std::size_t total = 0;
    for (const auto* b : persistent) total += static_cast<std::size_t>(b->bytes);
    // One buffer kept from switch to switch: its pages are touched once.
    if (carried_.size() < total) carried_.resize(total);
    std::map<std::string, std::span<std::byte>> kept;
    std::size_t at = 0;
    for (const auto* b : persistent) {
      const auto bytes = std::span(carried_).subspan(at, static_cast<std::size_t>(b->bytes));
      backend_->read(b->id, bytes);
      kept.emplace(b->name, bytes);
      at += bytes.size();
    }
    const auto steps = ex_->completed_steps();
    ex_.reset();
    ex_ = std::make_unique<runtime::executor<Backend>>(std::move(*next), *backend_, options_.executor);
    ex_->set_completed_steps(steps);
    index_tensors();
    for (const auto& b : ex_->plan().graph.buffers)
      if (const auto it = kept.find(b.name); it != kept.end() && static_cast<std::int64_t>(it->second.size()) == b.bytes)
        backend_->write(b.id, it->second);
    chooser_.switched(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }

  void write_trace(const char* kind, const sim::result& r) const {
    detail::write_trace(options_.trace_dir, ex_->plan().graph, options_.policy, kind, rank_, r);
  }

  detail::program_facts facts_;
  concerto::mesh mesh_;
  shape_map shapes_;
  step_options options_;
  runtime::kernel_settings settings_;
  bool uses_adamw_ = false; // the program's optimizer: AdamW, else SGD
  int rank_ = 0, size_ = 1;
  ir::graph graph_;
  ir::graph forward_graph_; ///< the forward pass alone, for evaluate
  struct evaluation {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<runtime::executor<Backend>> ex;
    detail::tensor_index tensors;
    plan_summary summary;
    std::vector<std::byte> staging; ///< a parameter on its way from the training backend
    std::uint64_t copied = 0;       ///< the parameters_version_ it holds (0: none yet)
  };
  std::optional<evaluation> eval_;
  std::optional<cost::model> model_; ///< what the training step was planned with
  std::uint64_t parameters_version_ = 1; ///< counts every change of the parameters (a step, set, load, import)
  ir::buffer_id grad_norm_sq_ = -1;      ///< in the executed plan, with clipping or loss scaling
  ir::buffer_id loss_scale_ = -1;        ///< in the executed plan, with loss scaling
  loss_scaler scaler_;                   ///< with loss scaling: the scale of the next step
  float last_loss_scale_ = 1.0f;         ///< the scale the last step's gradients carry
  std::optional<runtime::mpi::control> control_; ///< the step's own collectives, with deadlines
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<runtime::executor<Backend>> ex_;
  plan_summary summary_;
  detail::plan_chooser<Backend> chooser_;
  detail::tensor_index tensors_;
  std::optional<pipeline::stage_split> split_; ///< set when the mesh has the pipeline axis
  std::vector<pipeline::task_origin> stage_origins_; ///< pipelined: each task of this stage's plan, in the split graph
  std::vector<std::byte> carried_; ///< what outlives a step, while start_pending_plan changes executors
};

/// @brief The step of a program of N nodes: lowers it, keeps what the step needs of it.
template <std::size_t N, class Backend = default_backend>
class step : public basic_step<Backend> {
public:
  // Copies, not moves, of the arguments both the lowering and the base read: the order in
  // which a constructor's arguments are evaluated is unspecified.
  step(const graph::program<N>& p, const concerto::mesh& m, const shape_map& shapes, optimizer_settings opt,
       step_options o)
      : step(p, m, shapes, opt, o, detail::decide_sharding(p, m, shapes, opt, o)) {}

  /// @brief For a program written with auto_: the sharding chosen (the same on every rank), and
  /// whether rank 0 found it in the cache; nullopt for a program written by hand.
  [[nodiscard]] const std::optional<detail::decided_sharding>& sharding() const noexcept { return sharding_; }

private:
  step(const graph::program<N>& p, const concerto::mesh& m, const shape_map& shapes, const optimizer_settings& opt,
       const step_options& o, std::optional<detail::decided_sharding> decided)
      : basic_step<Backend>(graph::detail::at_lowering_size(
                                p,
                                [&](const auto& sized) {
                                  return detail::with_sharding(sized, decided, [&](const auto& chosen) {
                                    return detail::lower_for_step(
                                        chosen, detail::microbatch_shapes(chosen, shapes, o.pipeline.microbatches), m,
                                        detail::lowering_options(o, opt, m));
                                  });
                                }),
                            graph::detail::at_lowering_size(
                                p,
                                [&](const auto& sized) {
                                  return detail::with_sharding(sized, decided, [&](const auto& chosen) {
                                    return graph::detail::lower_sized(chosen, shapes, m, detail::evaluation_lowering_options(o));
                                  });
                                }),
                            m, shapes, opt, o),
        sharding_(std::move(decided)) {}

  std::optional<detail::decided_sharding> sharding_;
};

/// @brief Compiles a training step: lowers `p` for `m` and `shapes`; plans on the first call.
/// @code
/// auto step = train::compile(gpt, mesh, shapes, {.adamw = {.lr = 3e-3f}},
///                            {.policy = planner::policy::concerto, .lower = {.heads = 4, .depth = {{"layers", 2}}}});
/// @endcode
template <std::size_t N>
[[nodiscard]] step<N> compile(const graph::program<N>& p, concerto::mesh m, shape_map shapes,
                              optimizer_settings opt, step_options options) {
  return step<N>(p, std::move(m), std::move(shapes), opt, std::move(options));
}

/// @brief As above with the default step_options. (A separate overload rather than a default
/// argument: g++ 12 warns falsely, -Wmaybe-uninitialized, about a defaulted step_options
/// temporary in the caller's frame, which would break users' -Werror builds.)
template <std::size_t N>
[[nodiscard]] step<N> compile(const graph::program<N>& p, concerto::mesh m, shape_map shapes,
                              optimizer_settings opt = {}) {
  step_options defaults;
  return compile(p, std::move(m), std::move(shapes), opt, std::move(defaults));
}

} // namespace concerto::train

#ifdef CONCERTO_SEPARATE_COMPILATION
// Compiled once, in the translation unit that includes <concerto/impl/src.hpp>.
extern template class concerto::train::basic_step<concerto::train::default_backend>;
#endif
