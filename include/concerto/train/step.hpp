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
/// auto step = train::compile(mlp, m, shapes, {.sgd = {.lr = 0.1f}}, {.policy = "concerto"});
/// for (int i = 0; i < 100; ++i) {
///   const auto r = step({{"x", {{64, 512}, x}}, {"target", {{64, 512}, y}}});
///   if (r.rank == 0) std::printf("step %lld loss %.4f\n", (long long)r.step, r.loss);
/// }
/// @endcode

#include <concerto/cache/key.hpp>
#include <concerto/cache/plan_cache.hpp>
#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/graph/lower.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/planner/decompose.hpp>
#include <concerto/planner/pipeline.hpp>
#include <concerto/runtime/cpu/moe.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/kernel_profile.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/runtime/mpi/settings.hpp>
#include <concerto/train/agreement.hpp>
#include <concerto/train/backend_select.hpp>
#include <concerto/train/checkpoint.hpp>
#include <concerto/train/pipeline.hpp>
#include <concerto/train/plan_choice.hpp>
#include <concerto/trace/chrome_trace.hpp>
#include <concerto/train/detail/shard.hpp>

#include <mpi.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train {

/// @brief Optimizer hyperparameters (the program chose sgd or adamw).
struct optimizer_settings {
  runtime::cpu::sgd_config sgd{};
  runtime::cpu::adamw_config adamw{};
};

namespace detail {
/// The measured kernel factors stored at `file` (kernel -> factor); empty when there is none.
/// A file that is not such an object is reported on stderr and ignored: it will be measured again.
inline nlohmann::json read_kernel_scales(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) return nlohmann::json::object();
  try {
    auto j = nlohmann::json::parse(in);
    if (!j.is_object()) fail("not a JSON object");
    // A factor is a measured time over the roofline's: far outside these bounds it is no
    // measurement (a damaged or edited file), and would price a kernel as free or as forever.
    constexpr double lowest = 1e-6, highest = 1e6;
    for (const auto& [kernel, scale] : j.items())
      if (!scale.is_number() || !(scale.get<double>() >= lowest && scale.get<double>() <= highest))
        fail("kernel '" + kernel + "' has the factor " + scale.dump() + ", not a measured one (between 1e-6 and 1e6)");
    return j;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto: ignoring the kernel measurements in '%s' (%s); measuring again\n", file.c_str(), e.what());
    return nlohmann::json::object();
  }
}
inline void write_kernel_scales(const std::filesystem::path& file, const std::map<std::string, double, std::less<>>& scales) {
  try {
    write_file_atomically(file, nlohmann::json(scales).dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto: could not keep the kernel measurements (%s)\n", e.what());
  }
}
/// What else, besides the hardware description and the graph, decides how fast this build's
/// kernels run: the compiler and its optimisation and instruction-set flags, the machine, and how
/// many ranks share it. A kernel measured under another of these is measured again.
inline std::uint64_t kernel_build_fingerprint(const runtime::mpi::control& world) {
  hasher h;
  h.add(std::string_view("concerto.kernels.v2")); // v2: means of 3 runs (v1 kept the best of 2)
  h.add(std::string_view(__VERSION__));
#if defined(__OPTIMIZE__)
  h.add(std::string_view("optimize"));
#endif
#if defined(__FAST_MATH__)
  h.add(std::string_view("fast-math"));
#endif
#if defined(__AVX512F__)
  h.add(std::string_view("avx512f"));
#elif defined(__AVX2__)
  h.add(std::string_view("avx2"));
#elif defined(__AVX__)
  h.add(std::string_view("avx"));
#endif
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  h.add(std::string_view(host));
  h.add(std::int64_t{world.split_by_node(0, "the ranks of this node, for the kernel measurements' key").size()});
  return h.value();
}
/// The collectives of a graph that move data: those over an axis of one rank are copies at most.
inline std::size_t communicating_collectives(const ir::graph& g) {
  std::size_t n = 0;
  for (const auto& t : g.tasks)
    n += ir::is_collective(t.kind) && t.axis >= 0 && g.axes[static_cast<std::size_t>(t.axis)].size > 1;
  return n;
}
/// A plan's step time under `model` (its own start times may come from another model).
inline double replayed_us(const plan::plan& p, const cost::model& model) {
  return sim::simulate(p, model.durations_us(p.graph), {model.overlap_slowdown(), model.comm_overlap_slowdown()}).step_us;
}
/// An environment variable that must be 0 or 1; nullopt when unset or empty. `off` and `on`
/// say what each value means, for the error on any other value.
inline std::optional<bool> env_flag(const char* name, std::string_view off, std::string_view on) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  if (std::string_view(v) != "0" && std::string_view(v) != "1")
    fail(std::string(name) + "='" + v + "' must be 0 (" + std::string(off) + ") or 1 (" + std::string(on) + ")");
  return std::string_view(v) == "1";
}
/// An environment variable as a path; empty when unset.
inline std::filesystem::path env_path(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::filesystem::path(v) : std::filesystem::path();
}
} // namespace detail

/// @brief How a step is planned and run.
struct step_options {
  std::string policy = "concerto";   ///< sync, program_order, xla_lhs or concerto
  /// Time the graph's CPU kernels before planning and price each with its measured factor
  /// (cost::hardware::kernel_scale; see prepare()). Default: on a host backend with a "cpu*"
  /// preset, where the roofline is furthest from the kernels; off on a GPU.
  std::optional<bool> measure_kernels;
  lower_options lower{};             ///< name, attention heads, repeat depths
  std::string cost_preset = "cpu";   ///< cost::model preset the planner uses
  planner::windowed_options solver{.time_budget_s = 10, .progress = false};
  bool decompose = true;             ///< concerto policy: split exposed collectives with their matmuls
  bool bucket = true;                ///< concerto policy: fuse small gradient collectives
  std::optional<std::int64_t> memory_cap_bytes; ///< peak memory per rank the plan must respect
  /// Applied to the lowered graph before planning, on rank 0 (experiments and tests, e.g. forcing
  /// a decomposition the cost model would not choose). Must keep the graph's buffers and names.
  std::function<ir::graph(const ir::graph&)> rewrite;
  bool use_cache = true;             ///< look the plan up in (and store it to) the plan cache
  std::filesystem::path cache_dir = cache::default_directory();
  std::uint64_t seed = 1;            ///< parameter initialisation
  /// A step whose loss is NaN or infinite throws, naming the step (the parameters then hold that
  /// step's update); false: the loss is returned and training goes on.
  bool stop_on_non_finite_loss = true;
  /// Every this many steps (0: never), compare bit for bit the parameters that ranks hold copies
  /// of (data-parallel replicas, replicated weights); a difference stops training on every rank,
  /// naming the parameter and the ranks. A debugging aid: one hash of every parameter and one
  /// small all-gather. CONCERTO_CHECK_REPLICAS=N, when set, overrides it.
  std::int64_t check_replicas_every = 0;
  MPI_Comm world = MPI_COMM_WORLD;   ///< the ranks of the mesh, in mesh order
  runtime::executor_options executor{};
  /// The `concerto` policy measures its first plan, refits the cost model, re-plans, and keeps
  /// whichever candidate measured fastest (train/plan_choice.hpp). CONCERTO_CHOOSE_PLAN=0 turns it off.
  plan_choice_options choice{};
  /// When set, every rank writes Chrome traces here: the plan's simulated step once
  /// (`<graph>.<policy>.planned.rank<r>.json`) and each executed step's measured timeline,
  /// overwritten step by step (`<graph>.<policy>.measured.rank<r>.json`), outside the measured
  /// time. Defaults to $CONCERTO_TRACE_DIR.
  std::filesystem::path trace_dir = detail::env_path("CONCERTO_TRACE_DIR");
  /// On the GPU backend, fp32 matrix products run on the TF32 tensor cores (about 8x cuBLASLt's
  /// fp32 throughput on an H200, inputs rounded to 10 mantissa bits: ~1e-3 relative error). No
  /// effect on the CPU backend. CONCERTO_TF32=0/1, when set, overrides it.
  bool allow_tf32 = false;
  /// Pipeline parallelism, when the mesh has the pipeline axis (`pp`): micro-batches, the
  /// schedule policy, virtual stages (train/pipeline.hpp, docs/pipeline.md).
  pipeline_options pipeline{};
};

/// @brief What the first call decided (the same on every rank).
struct plan_summary {
  std::string policy;
  double solver_seconds = 0;    ///< planning wall time on rank 0 (0 when the cache answered... as stored)
  double predicted_us = 0;      ///< the plan's simulated step time
  double sync_predicted_us = 0; ///< the `sync` policy's simulated step time on the same graph
  bool cache_hit = false;
  bool rewritten = false;       ///< the executed graph differs from the lowered one (split, buckets)
  std::size_t tasks = 0, collectives = 0;
  std::string baseline = "sync"; ///< what sync_predicted_us is: `sync`, or for a pipelined step `gpipe`
  std::string pipeline;          ///< a pipelined step's stages, micro-batches and lower bound; empty otherwise
  /// One line: "plan concerto: 212 tasks (58 collectives), solver 1.2 s, predicted 830 us vs sync 1020 us (1.23x), cache miss".
  [[nodiscard]] std::string text() const {
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "plan %s: %zu tasks (%zu collectives)%s, solver %.2f s, predicted %.0f us vs %s %.0f us (%.2fx), cache %s",
                  policy.c_str(), tasks, collectives, rewritten ? ", rewritten" : "", solver_seconds, predicted_us,
                  baseline.c_str(), sync_predicted_us, predicted_us > 0 ? sync_predicted_us / predicted_us : 0.0,
                  cache_hit ? "hit" : "miss");
    return pipeline.empty() ? std::string(buf) : std::string(buf).append(", ").append(pipeline);
  }
};

/// @brief A global tensor given to a step: f32 values or i64 ids, row-major.
struct tensor {
  std::vector<std::int64_t> shape;
  std::vector<float> f32{};
  std::vector<std::int64_t> i64{};
};
/// @brief Global inputs by leaf name.
using batch = std::map<std::string, tensor>;

/// @brief One rank's shard of an input, for a loader to fill (exactly one span is non-empty).
struct shard_request {
  std::string name;
  std::vector<std::int64_t> global_shape, offset, local_shape;
  std::span<float> f32;
  std::span<std::int64_t> i64;
};
/// @brief Fills each input shard of this rank.
using loader = std::function<void(const shard_request&)>;

/// @brief What one step returns on every rank.
struct step_result {
  std::int64_t step = 0;        ///< counting from 1 (continues after a checkpoint load)
  double loss = 0;              ///< the loss of the whole global batch
  double step_us = 0;           ///< measured wall time of the executor's step on this rank
  double exposed_comm_us = 0;   ///< compute idle while collectives were outstanding
  int rank = 0;
};

/// @brief One mixture-of-experts layer's load-balancing loss in the last step
/// (basic_step::moe_balance_losses).
struct moe_balance {
  std::string router;   ///< the layer's routing node, e.g. "layers.0.moe_route#23"
  double balance = 0;   ///< experts·Σ_e f_e·P_e averaged over the step's groups: 1 when perfectly balanced, up to E
  double weight = 0;    ///< the layer's balance loss weight (moe_config::aux_weight)
  double loss = 0;      ///< weight · balance: the loss whose gradient the router's gets
};

/// @brief A compiled training step; see the file comment. Move-only.
namespace detail {

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
    leaf_init init = leaf_init::automatic; ///< a parameter's rule
    std::string written; ///< as the user wrote it: a name, or the op applied to its operands
    std::string written_later; ///< in a repeated block, as layers after the first compute it
  };
  std::vector<std::string> axes; ///< the program's axis names, by its axis index
  std::vector<node> nodes;
  std::string loss;
  std::uint32_t loss_partial = 0; ///< the program axes the loss is pending a sum over
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

} // namespace detail

/// @brief A compiled training step (what `train::compile` returns is a `step<N>`, which adds
/// only its constructor from the program): lowering done, planning on the first call.
template <class Backend = default_backend>
class basic_step {
public:
  basic_step(detail::lowered_program lowered, concerto::mesh m, shape_map shapes, optimizer_settings opt,
             step_options o)
      : facts_(std::move(lowered.facts)), mesh_(std::move(m)), shapes_(std::move(shapes)), options_(std::move(o)) {
    settings_.sgd = opt.sgd;
    settings_.adamw = opt.adamw;
    MPI_Comm_rank(options_.world, &rank_);
    MPI_Comm_size(options_.world, &size_);
    if (mesh_.rank_count() != size_)
      fail("train::compile: the mesh has " + std::to_string(mesh_.rank_count()) + " ranks but the communicator has " +
           std::to_string(size_));
    if (const char* every = std::getenv("CONCERTO_CHECK_REPLICAS"); every != nullptr && *every != '\0') {
      const auto [end, ec] = std::from_chars(every, every + std::strlen(every), options_.check_replicas_every);
      if (ec != std::errc() || *end != '\0' || options_.check_replicas_every < 0)
        fail(std::string("CONCERTO_CHECK_REPLICAS='") + every + "' is not a number of steps (0: never)");
    }
    if (options_.check_replicas_every < 0) fail("train step: check_replicas_every must not be negative");
    if (const auto on = detail::env_flag("CONCERTO_CHOOSE_PLAN", "keep the first plan", "choose by measuring"))
      options_.choice.enabled = *on;
    if (const auto on = detail::env_flag("CONCERTO_TF32", "fp32 products", "TF32 tensor cores on the GPU"))
      options_.allow_tf32 = *on;
    if (const auto& c = options_.choice; c.warmup_steps < 0 || c.profile_steps < 1 || c.trial_steps < 1 || c.rounds < 1)
      fail("train step: plan choice needs warmup_steps >= 0, profile_steps >= 1, trial_steps >= 1 and rounds >= 1 (got " +
           std::to_string(c.warmup_steps) + ", " + std::to_string(c.profile_steps) + ", " + std::to_string(c.trial_steps) +
           ", " + std::to_string(c.rounds) + ")");
    if (!(options_.choice.confirm_within >= 1))
      fail("train step: plan choice needs confirm_within >= 1 (got " + std::to_string(options_.choice.confirm_within) +
           "; 1 trusts an earlier run's pick)");
    if (const auto known = planner::policy_names(); std::find(known.begin(), known.end(), options_.policy) == known.end()) {
      std::string list;
      for (const auto& name : known) list.append(list.empty() ? "" : ", ").append(name);
      fail("train step: policy '" + options_.policy + "' is not one of " + list);
    }
    for (const auto& policy : options_.choice.also_try)
      if (const auto known = planner::policy_names(); std::find(known.begin(), known.end(), policy) == known.end())
        fail("train step: plan choice: also_try names '" + policy + "', which is not a policy");
    graph_ = std::move(lowered.graph);
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

  /// @brief The lowered graph (before planning).
  [[nodiscard]] const ir::graph& graph() const noexcept { return graph_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// @brief Plans (rank 0, or the cache), builds the executor and initialises the parameters;
  /// the first step does it if nobody did. Collective over the step's ranks.
  void prepare() {
    if (ex_) return;
    // First, before any other collective: a rank with other settings would run rank 0's plan
    // with its own numbers, or wait in a collective the others never start.
    check_agreement(settings_record_of(), *control_);
    backend_ = make_backend(options_.world, settings_, control_->timeout_s(), options_.allow_tf32);
    const auto model = planning_model();
    if (split_) {
      plan_stage(model);
    } else {
      std::string summary_text, choice_text;
      auto p = runtime::distribute_plan(*backend_, [&] {
        const runtime::mpi::channel::busy announced(runtime::mpi::channel::get(), "planning the step");
        plan_summary s;
        s.policy = options_.policy;
        const auto started = std::chrono::steady_clock::now();
        const ir::graph g = options_.rewrite ? options_.rewrite(graph_) : graph_;
        const auto planning = planning_options();
        const auto make = [&] { return planner::make_plan(g, model, planning); };
        plan::plan made;
        // The model both predictions below are made with: an earlier run's pick is priced, as is
        // sync beside it, by the model refitted to what that run measured.
        cost::model priced = model;
        if (auto kept = chooses() && options_.use_cache ? load_chosen(g, model, choice_text) : std::nullopt) {
          made = std::move(*kept);
          s.cache_hit = true;
          priced = cost::model(nlohmann::json::parse(choice_text).at("refitted_model").get<cost::hardware>());
        } else if (options_.use_cache) {
          const auto key = cache::make_key(g, model, default_backend_name, options_.policy, planner::hash(planning));
          // Not silenced: a damaged or unwritable entry is said once (this runs on rank 0 only).
          made = cache::plan_cache(options_.cache_dir).get_or_plan(key, make, &s.cache_hit);
        } else {
          made = make();
        }
        s.rewritten = !(made.graph.tasks.size() == graph_.tasks.size() && made.graph.buffers == graph_.buffers);
        s.solver_seconds = s.cache_hit ? 0.0 : std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        s.predicted_us = s.cache_hit && !choice_text.empty() ? detail::replayed_us(made, priced) : made.step_us();
        s.sync_predicted_us =
            options_.policy == "sync" ? s.predicted_us : planner::make_plan(g, priced, {.policy = "sync"}).step_us();
        s.tasks = made.graph.tasks.size();
        s.collectives = detail::communicating_collectives(made.graph);
        summary_text = nlohmann::json{{"policy", s.policy}, {"solver", s.solver_seconds}, {"predicted", s.predicted_us},
                                      {"sync", s.sync_predicted_us}, {"hit", s.cache_hit}, {"rewritten", s.rewritten},
                                      {"tasks", s.tasks}, {"collectives", s.collectives}, {"choice", choice_text}}
                           .dump();
        return made;
      });
      backend_->broadcast(summary_text, 0, "the plan summary from rank 0");
      const auto j = nlohmann::json::parse(summary_text);
      summary_ = {j.at("policy"), j.at("solver"), j.at("predicted"), j.at("sync"), j.at("hit"), j.at("rewritten"),
                  j.at("tasks"), j.at("collectives")};
      if (const auto& kept = j.at("choice").get_ref<const std::string&>(); !kept.empty()) {
        auto record = nlohmann::json::parse(kept);
        if (record.at("confirm").empty()) {
          choice_ = report_of_record(record);
        } else { // measured again against its close rivals, from the first steps on
          choosing_.emplace();
          choosing_->prior = model;
          choosing_->earlier = std::move(record);
        }
      } else if (chooses()) {
        choosing_.emplace();
        choosing_->prior = model;
      }
      ex_ = std::make_unique<runtime::executor<Backend>>(std::move(p), *backend_, options_.executor);
    }
    if (!options_.trace_dir.empty()) {
      const auto& planned = ex_->plan();
      write_trace("planned", sim::simulate(planned, planned.duration_us)); // durations already priced with contention
    }
    index_tensors();
    initialise();
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
    return next_plan_ ? *next_plan_ : ex_->plan();
  }

  /// @brief One step on the global batch: every rank keeps its shard of each input.
  step_result operator()(const batch& b) {
    return (*this)([&](const shard_request& r) {
      const auto it = b.find(r.name);
      if (it == b.end()) fail("train step: the batch has no tensor '" + r.name + "'");
      if (it->second.shape != r.global_shape)
        fail("train step: tensor '" + r.name + "' has shape " + graph::detail::dims_text(it->second.shape) +
             " but the program expects " + graph::detail::dims_text(r.global_shape));
      const detail::block blk{r.global_shape, r.offset, r.local_shape};
      if (!r.f32.empty()) {
        if (it->second.f32.size() != static_cast<std::size_t>(detail::count(r.global_shape)))
          fail("train step: tensor '" + r.name + "' needs " + std::to_string(detail::count(r.global_shape)) + " f32 values");
        detail::copy_block(blk, sizeof(float), reinterpret_cast<std::byte*>(const_cast<float*>(it->second.f32.data())),
                           reinterpret_cast<std::byte*>(r.f32.data()), true);
      } else {
        if (it->second.i64.size() != static_cast<std::size_t>(detail::count(r.global_shape)))
          fail("train step: tensor '" + r.name + "' needs " + std::to_string(detail::count(r.global_shape)) + " i64 ids");
        detail::copy_block(blk, sizeof(std::int64_t),
                           reinterpret_cast<std::byte*>(const_cast<std::int64_t*>(it->second.i64.data())),
                           reinterpret_cast<std::byte*>(r.i64.data()), true);
      }
    });
  }

  /// @brief One step whose inputs a loader fills, shard by shard, on each rank.
  step_result operator()(const loader& load) {
    prepare();
    start_pending_plan();
    for (const auto& in : inputs_) {
      const auto& info = tensors_.at(in);
      shard_request r{in, info.blk.global, info.blk.offset, info.blk.local, {}, {}};
      if (info.type == ir::dtype::i64) {
        staging_i64_.resize(static_cast<std::size_t>(detail::count(info.blk.local)));
        r.i64 = staging_i64_;
        load(r);
        backend_->write(info.id, std::as_bytes(std::span(staging_i64_)));
      } else {
        staging_.resize(static_cast<std::size_t>(detail::count(info.blk.local)));
        r.f32 = staging_;
        load(r);
        backend_->write(info.id, std::as_bytes(std::span(staging_)));
      }
    }
    const auto& rep = [&]() -> const runtime::step_report& {
      // The executor names tasks by the lowering's names; say what the program wrote there.
      try {
        return ex_->run_step();
      } catch (const runtime::mpi::remote_failure&) {
        throw; // another rank's message, as it wrote it
      } catch (const collective_error& e) {
        throw collective_error(as_written(e.what()));
      } catch (const error& e) {
        throw error(as_written(e.what()));
      }
    }();
    if (!options_.trace_dir.empty()) write_trace("measured", rep.measured);
    float local = 0;
    if (loss_id_ >= 0) backend_->read(loss_id_, std::as_writable_bytes(std::span(&local, 1)));
    const double loss = control_->sum_all(double{local}, "the loss of step " + std::to_string(rep.step)) / loss_copies_;
    // Every rank holds the same sum, so every rank stops here, together.
    if (options_.stop_on_non_finite_loss && !std::isfinite(loss))
      fail_on_every_rank("train step: the loss of step " + std::to_string(rep.step) + " of graph '" + graph_.name + "' is " +
                         std::to_string(loss) + where_non_finite_began(rep) +
                         "; training stopped (the parameters hold this step's update; a smaller learning rate usually "
                         "helps; step_options::stop_on_non_finite_loss = false goes on)");
    if (options_.check_replicas_every > 0 && rep.step % options_.check_replicas_every == 0) check_replicas(rep.step);
    const step_result out{rep.step, loss, rep.measured.step_us, rep.measured.exposed_comm_us, rank_};
    if (choosing_) advance_choice(rep); // may replace the executor, and `rep` with it
    return out;
  }

  /// @brief What the plan choice measured and kept (train/plan_choice.hpp); `decided()` is false
  /// while it is still measuring, and when the step does not choose (another policy, or off).
  [[nodiscard]] const plan_choice_report& choice() const noexcept { return choice_; }

  /// @brief Names of the trained parameters (as in the graph: `w1`, `layers.0.wq`, ...).
  [[nodiscard]] std::vector<std::string> parameter_names() {
    prepare();
    return params_;
  }
  /// @brief A parameter gathered to its global shape, on every rank (collective).
  [[nodiscard]] std::vector<float> parameter(const std::string& name) { return gather(name); }
  /// @brief The final gradient of a parameter of the last step (`name` without ".grad"), global, on every rank.
  [[nodiscard]] std::vector<float> gradient(const std::string& name) { return gather(name + ".grad"); }
  /// @brief Sets a parameter (or optimizer state) from its global value; each rank keeps its shard.
  void set_parameter(const std::string& name, std::span<const float> global) {
    prepare();
    const auto& t = info(name);
    if (global.size() != static_cast<std::size_t>(detail::count(t.blk.global)))
      fail("train step: '" + name + "' has " + std::to_string(detail::count(t.blk.global)) + " values, got " +
           std::to_string(global.size()));
    if (t.id < 0) return; // another pipeline stage holds it
    std::vector<float> local(static_cast<std::size_t>(detail::count(t.blk.local)));
    detail::copy_block(t.blk, sizeof(float), reinterpret_cast<std::byte*>(const_cast<float*>(global.data())),
                       reinterpret_cast<std::byte*>(local.data()), true);
    backend_->write(t.id, std::as_bytes(std::span(local)));
  }
  /// @brief The global shape of a named tensor of the graph.
  [[nodiscard]] std::vector<std::int64_t> global_shape(const std::string& name) {
    prepare();
    return info(name).blk.global;
  }

  /// @brief Any named f32 tensor of the graph (parameters, gradients, optimizer state `w.m`),
  /// gathered to its global shape on every rank. Collective.
  [[nodiscard]] std::vector<float> gather(const std::string& name) {
    prepare();
    const auto& t = info(name);
    if (t.type != ir::dtype::f32) fail("train step: tensor '" + name + "' is not f32");
    if (t.partial) fail("train step: tensor '" + name + "' is a pending sum on this mesh; it has no global value yet");
    const auto n = static_cast<std::size_t>(detail::count(t.blk.local));
    std::vector<float> mine(n), all(n * static_cast<std::size_t>(size_)), out(static_cast<std::size_t>(detail::count(t.blk.global)));
    if (t.id >= 0) backend_->read(t.id, std::as_writable_bytes(std::span(mine)));
    control_->all_gather(std::span<const float>(mine), std::span(all), "gathering tensor '" + name + "'");
    for (int r = 0; r < size_; ++r) {
      const auto coords = mesh_.coords(r);
      if (t.stage >= 0 && coords[static_cast<std::size_t>(split_->axis)] != t.stage) continue;
      const auto blk = block_of(t.spec, t.blk.global, t.blk.local, coords);
      detail::copy_block(blk, sizeof(float), reinterpret_cast<std::byte*>(out.data()),
                         reinterpret_cast<std::byte*>(all.data() + static_cast<std::size_t>(r) * n), false);
    }
    return out;
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
    std::vector<moe_balance> out;
    for (const auto& t : graph_.tasks) {
      if (t.fn != ir::op::moe_route) continue;
      const auto logits = t.reads.at(0);
      // The weight is the backward's (moe_route_grad reads the same logits); without one, 0.
      double weight = 0;
      for (const auto& u : graph_.tasks)
        if (u.fn == ir::op::moe_route_grad && u.reads.at(0) == logits)
          weight = static_cast<double>(u.attr("weight_num")) / static_cast<double>(u.attr("weight_den", 1));
      const auto values = gather(graph_.buffers[static_cast<std::size_t>(logits)].name);
      runtime::cpu::moe_shape shape{.group = static_cast<std::size_t>(t.attr("group")),
                                    .experts = static_cast<std::size_t>(t.attr("experts")),
                                    .top_k = static_cast<std::size_t>(t.attr("top_k"))};
      shape.groups = values.size() / (shape.group * shape.experts);
      const double balance = runtime::cpu::moe_balance_sum(values, shape) / static_cast<double>(shape.groups);
      out.push_back({graph_.buffers[static_cast<std::size_t>(t.writes.at(0))].name, balance, weight, weight * balance});
    }
    return out;
  }

  /// @brief Writes every parameter and optimizer state, gathered to global tensors, and the step
  /// count to `path` (rank 0 writes, atomically); loadable on any mesh the shapes divide over.
  /// Collective. Format and checks: train/checkpoint.hpp.
  void save(const std::filesystem::path& path) {
    prepare();
    checkpoint::writer file;
    for (const auto& name : state_names()) file.add(name, info(name).blk.global, gather(name));
    if (rank_ == 0) write_file_atomically(path, std::move(file).finish(completed_steps()));
    control_->barrier("the end of saving checkpoint '" + path.string() + "'");
  }

  /// @brief Reads a checkpoint written by `save` (on any mesh): each rank keeps its shards;
  /// the step count continues from the checkpoint's. Collective: when the file fails a check on
  /// any rank, every rank throws (concerto::collective_error) naming the file and what is wrong:
  /// a damaged header, index or tensor (checksums, train/checkpoint.hpp), a missing or misshapen
  /// tensor. A refused checkpoint leaves the step as it was.
  void load(const std::filesystem::path& path) {
    prepare();
    checkpoint::contents file;
    std::string problem;
    try {
      file = checkpoint::read(path);
      for (const auto& name : state_names()) {
        const auto it = file.tensors.find(name);
        if (it == file.tensors.end()) fail("checkpoint '" + path.string() + "' has no tensor '" + name + "'");
        if (const auto& want = info(name).blk.global; it->second.shape != want)
          fail("checkpoint '" + path.string() + "': tensor '" + name + "' has shape " +
               graph::detail::dims_text(it->second.shape) + ", the program expects " + graph::detail::dims_text(want));
      }
    } catch (const error& e) {
      std::string_view why = e.what();
      if (why.starts_with("concerto: ")) why.remove_prefix(10);
      if (rank_ != 0) {
        problem = "on rank ";
        problem += std::to_string(rank_);
        problem += ": ";
      }
      problem += why;
    }
    // Every rank reads the file itself (a shared file system may show one rank another file):
    // all go on, or all stop, before the first value is written.
    runtime::stop_together(std::move(problem), *control_, "loading checkpoint '" + path.string() + "'");
    for (const auto& name : state_names()) {
      const auto& t = info(name);
      if (t.id < 0) continue; // another pipeline stage holds it
      std::vector<float> local(static_cast<std::size_t>(detail::count(t.blk.local)));
      detail::copy_block(t.blk, sizeof(float), const_cast<std::byte*>(file.bytes(name).data()),
                         reinterpret_cast<std::byte*>(local.data()), true);
      backend_->write(t.id, std::as_bytes(std::span(local)));
    }
    ex_->set_completed_steps(file.step);
  }

  /// @brief Steps run so far (including those before a loaded checkpoint).
  [[nodiscard]] std::int64_t completed_steps() const noexcept { return ex_ ? ex_->completed_steps() : 0; }

private:
  /// The preset's model, with measured factors for the graph's kernels when measuring is on.
  /// With `use_cache` the factors are kept in `cache_dir/kernels-<hardware hash>-<graph hash>-
  /// <build hash>.json` (detail::kernel_build_fingerprint), so that the model, and the plan cache
  /// key made from it, are the same run after run, and a kernel is priced at the shapes this
  /// graph runs it at. All ranks time the kernels at once, as a step runs them, and the mean over
  /// ranks is kept. An unreadable file is reported and measured again; one that cannot be
  /// written costs a measurement next time, nothing else.
  cost::model planning_model() {
    auto model = cost::model::preset(options_.cost_preset);
    const bool measure = options_.measure_kernels.value_or(!Backend::stream_ordered && options_.cost_preset.starts_with("cpu"));
    if constexpr (!Backend::stream_ordered) {
      if (!measure) return model;
      std::set<std::string, std::less<>> wanted;
      for (const auto& t : graph_.tasks)
        if (!ir::is_collective(t.kind)) wanted.emplace(cost::model::kernel_name(t));
      // Every rank knows use_cache, so all or none take part in the fingerprint's collective.
      const auto file = options_.use_cache ? options_.cache_dir / ("kernels-" + hasher::to_hex(model.hw().hash()) + "-" +
                                                                   hasher::to_hex(plan::hash(graph_)) + "-" +
                                                                   hasher::to_hex(detail::kernel_build_fingerprint(*control_)) + ".json")
                                           : std::filesystem::path();
      std::string known_text = "{}";
      if (rank_ == 0 && options_.use_cache) known_text = detail::read_kernel_scales(file).dump();
      backend_->broadcast(known_text, 0, "the measured kernel factors from rank 0");
      auto known = nlohmann::json::parse(known_text).get<std::map<std::string, double, std::less<>>>();
      if (!std::ranges::all_of(wanted, [&](const auto& k) { return known.contains(k); })) {
        // Every rank reaches the reduction below, also one whose timing threw (out of memory on a
        // crowded node): the others would otherwise wait in it for ever.
        std::map<std::string, double, std::less<>> scales;
        std::string failure;
        try {
          scales = runtime::kernel_scales(runtime::time_kernels(graph_, settings_), graph_, model);
        } catch (const std::exception& e) {
          failure = e.what();
        }
        std::vector<double> mine;
        for (const auto& k : wanted) mine.push_back(scales.contains(k) ? scales.at(k) : 1.0); // launch-bound: 1
        mine.push_back(failure.empty() ? 0.0 : 1.0);
        auto sum = mine;
        control_->sum_all(std::span(sum), "the kernel timings of every rank");
        if (sum.back() > 0)
          fail("train step: timing the kernels of graph '" + graph_.name + "' failed on " +
               std::to_string(static_cast<int>(sum.back())) + " rank(s)" + (failure.empty() ? "" : ": " + failure));
        known.clear();
        std::size_t i = 0;
        for (const auto& k : wanted) known[k] = sum[i++] / size_;
        if (rank_ == 0 && options_.use_cache) detail::write_kernel_scales(file, known);
      }
      auto hw = model.hw();
      for (const auto& k : wanted) hw.kernel_scale[k] = known.at(k);
      return cost::model(std::move(hw));
    } else {
      if (measure) fail("train step: measure_kernels times the CPU kernels; this build's backend runs on a GPU");
      return model;
    }
  }

  /// The graph the planner is given: the lowered one, or the test's rewrite of it.
  [[nodiscard]] ir::graph planner_input() const { return options_.rewrite ? options_.rewrite(graph_) : graph_; }

  [[nodiscard]] bool chooses() const { return options_.policy == "concerto" && options_.choice.enabled; }

  /// Where an earlier run's winner is kept: the plan in the plan cache under its own key (the
  /// first plan's, policy "concerto+measured"), and beside it what was measured, which names the
  /// plan by hash. Both must be whole and agree, or the choice is made again.
  [[nodiscard]] cache::cache_key chosen_key(const ir::graph& g, const cost::model& model) const {
    return cache::make_key(g, model, default_backend_name, options_.policy + "+measured", planner::hash(planning_options()));
  }
  [[nodiscard]] std::filesystem::path chosen_record_path(const cache::cache_key& key) const {
    return options_.cache_dir / ("choice-" + key.hex() + ".json");
  }
  /// A plan the choice measured and did not keep, under its own key, for the next run to
  /// measure the winner against again.
  [[nodiscard]] cache::cache_key rival_key(const ir::graph& g, const cost::model& model, const std::string& name) const {
    return cache::make_key(g, model, default_backend_name, options_.policy + "+measured:" + name, planner::hash(planning_options()));
  }
  /// Rank 0: the winner, and in `record_text` the record with "confirm" added: the rivals it is
  /// measured against again ([name, predicted us] each; their plans wait in rivals_).
  std::optional<plan::plan> load_chosen(const ir::graph& g, const cost::model& model, std::string& record_text) {
    const auto key = chosen_key(g, model);
    const auto path = chosen_record_path(key);
    if (!std::filesystem::exists(path)) return std::nullopt;
    try {
      std::ifstream in(path);
      auto record = nlohmann::json::parse(in);
      std::string why;
      cache::plan_cache cache(options_.cache_dir);
      auto kept = cache.load(key, &why);
      if (!kept) fail("its plan is missing from the plan cache" + (why.empty() ? std::string() : " (" + why + ")"));
      if (hasher::to_hex(plan::hash(*kept)) != record.at("plan_hash").get<std::string>())
        fail("it names another plan than the one the plan cache holds");
      (void)report_of_record(record); // every field readable
      const auto& candidates = record.at("candidates");
      std::vector<double> medians;
      std::size_t winner = candidates.size();
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        medians.push_back(candidates[i].at("measured_us").get<double>());
        if (candidates[i].at("plan_hash") == record.at("plan_hash") && candidates[i].at("name") == record.at("winner"))
          winner = i;
      }
      if (winner == candidates.size())
        fail("its winner '" + record.at("winner").get<std::string>() + "' (plan " + record.at("plan_hash").get<std::string>() +
             ") is not among its candidates");
      rivals_.clear();
      auto confirm = nlohmann::json::array();
      for (const auto i : detail::close_rivals(medians, winner, options_.choice.confirm_within)) {
        const auto& rival = candidates[i];
        const auto name = rival.at("name").get<std::string>();
        why.clear();
        auto p = cache.load(rival_key(g, model, name), &why);
        if (!p || hasher::to_hex(plan::hash(*p)) != rival.at("plan_hash").get<std::string>()) {
          std::fprintf(stderr, "concerto: the plan '%s' that an earlier run measured is not in the plan cache%s; its winner is "
                       "measured again without it\n", name.c_str(), why.empty() ? "" : (" (" + why + ")").c_str());
          continue;
        }
        confirm.push_back({name, rival.at("predicted_us").get<double>()});
        rivals_.push_back(std::move(*p));
      }
      record["confirm"] = std::move(confirm);
      record_text = record.dump();
      return kept;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "concerto: ignoring the plan chosen by an earlier run ('%s': %s); choosing again\n",
                   path.c_str(), e.what());
      return std::nullopt;
    }
  }
  [[nodiscard]] static plan_choice_report report_of_record(const nlohmann::json& record) {
    plan_choice_report r;
    r.from_cache = true;
    r.winner = 0;
    r.decided_at_step = record.at("decided_at_step").get<std::int64_t>();
    r.refit = record.at("refit").get<std::string>();
    r.candidates.push_back({record.at("winner").get<std::string>(), record.at("plan_hash").get<std::string>(),
                            record.at("predicted_us").get<double>(), record.at("measured_us").get<double>(),
                            record.at("steps").get<int>()});
    return r;
  }
  /// Rank 0, with the plan cache on: the winner, the plans it beat and what was measured, for
  /// the next run.
  void store_chosen(const plan_choice_report& r, std::span<const plan::plan> plans, const nlohmann::json& refitted_model) const {
    if (rank_ != 0 || !options_.use_cache) return;
    try {
      const auto g = planner_input();
      const auto& prior = choosing_->prior;
      cache::plan_cache cache(options_.cache_dir);
      const auto key = chosen_key(g, prior);
      nlohmann::json candidates = nlohmann::json::array();
      for (std::size_t i = 0; i < r.candidates.size(); ++i) {
        const auto& c = r.candidates[i];
        if (static_cast<int>(i) != r.winner) cache.store(rival_key(g, prior, c.name), plans[i]);
        candidates.push_back(
            {{"name", c.name}, {"plan_hash", c.plan_hash}, {"predicted_us", c.predicted_us}, {"measured_us", c.measured_us}});
      }
      cache.store(key, plans[static_cast<std::size_t>(r.winner)]);
      const auto& w = r.candidates[static_cast<std::size_t>(r.winner)];
      const nlohmann::json record{{"winner", w.name},          {"plan_hash", w.plan_hash},      {"predicted_us", w.predicted_us},
                                  {"measured_us", w.measured_us}, {"steps", w.steps},           {"decided_at_step", r.decided_at_step},
                                  {"candidates", candidates}, {"refit", r.refit}, {"refitted_model", refitted_model}};
      write_file_atomically(chosen_record_path(key), record.dump(2) + "\n");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "concerto: could not keep the chosen plan for the next run (%s)\n", e.what());
    }
  }

  /// One step more of the plan choice (train/plan_choice.hpp), after step `rep` ran.
  void advance_choice(const runtime::step_report& rep) {
    auto& c = *choosing_;
    const auto& o = options_.choice;
    ++c.seen;
    if (c.order.empty()) { // measuring the first plan
      if (c.seen <= o.warmup_steps) return;
      if (c.earlier) {
        start_confirmation();
        return;
      }
      c.profile.push_back(rep.measured);
      if (static_cast<int>(c.profile.size()) == o.profile_steps) start_trials(rep.step);
      return;
    }
    const int ran = c.order[c.position];
    double t = rep.measured.step_us;
    if (o.adjust_measured) t = o.adjust_measured(rank_, c.names[static_cast<std::size_t>(ran)], t);
    c.times.push_back(t);
    if (++c.position < c.order.size()) {
      switch_plan(c.order[c.position]);
      return;
    }
    finish_choice(rep.step);
  }

  /// Refit (host backends), re-plan and make the candidates on rank 0, send them to every rank.
  void start_trials(std::int64_t step) {
    auto& c = *choosing_;
    const auto started = std::chrono::steady_clock::now();
    const auto& first = ex_->plan();
    cost::model refitted = c.prior;
    bool refit = false;
    if constexpr (!Backend::stream_ordered) {
      const auto mine = detail::pack(planner::observe(first.graph, c.profile));
      std::vector<double> all(mine.size() * static_cast<std::size_t>(size_));
      control_->all_gather(std::span<const double>(mine), std::span(all), "the measured steps of the first plan");
      if (rank_ == 0) {
        const auto fit = planner::refit(first, c.prior, detail::combine(first.graph, all, size_, static_cast<int>(c.profile.size())));
        refitted = fit.model;
        c.refitted = fit.model;
        c.refit = fit.text();
      }
      refit = true;
    }
    std::vector<double> profiled;
    for (const auto& r : c.profile) profiled.push_back(r.step_us);
    const double profile_median = concerto::median(std::move(profiled));
    c.profile.clear();
    // Rank 0 makes the candidates and says which there are; a failure there stops every rank.
    std::vector<plan::plan> made;
    std::string header;
    if (rank_ == 0) {
      const runtime::mpi::channel::busy busy(runtime::mpi::channel::get(), "planning the plan choice's candidates");
      try {
        const auto g = planner_input();
        auto planning = planning_options();
        // Candidate 0 is the plan running (the executor's, not copied); made[i] is candidate i + 1.
        std::vector<std::string> names{"concerto"};
        if (refit) {
          names.emplace_back("concerto (re-planned)");
          made.push_back(planner::make_plan(g, refitted, planning));
        }
        std::optional<plan::plan> best;
        std::string best_name;
        const auto frameworks = planner::framework_policy_names();
        for (const auto& policy : planner::policy_names()) {
          const bool framework = std::find(frameworks.begin(), frameworks.end(), policy) != frameworks.end();
          if (policy == "concerto" || (planning.memory_cap_bytes && framework)) continue; // frameworks ignore caps
          planning.policy = policy;
          auto p = planner::make_plan(g, refitted, planning);
          if (!best || p.step_us() < best->step_us()) best = std::move(p), best_name = policy;
        }
        names.push_back(best_name);
        made.push_back(std::move(*best));
        // Each list baseline runs too, as does every policy the options add: the model's ranking
        // of them is not to be trusted where it mispriced the first plan. On one H200 (no refit:
        // the executor sees when tasks were issued, not how long they ran) the model put xla_lhs
        // first for a small GPT that ran 1.2x slower under it than under sync; on the emulated
        // cluster, a refitted model still ranked plans within 10-30% of each other wrongly.
        auto more = planner::list_policy_names();
        more.insert(more.end(), options_.choice.also_try.begin(), options_.choice.also_try.end());
        for (const auto& policy : more) {
          planning.policy = policy;
          names.push_back(policy);
          made.push_back(planner::make_plan(g, refitted, planning));
        }
        const auto replayed_us = [&](const plan::plan& p) { return detail::replayed_us(p, refitted); };
        nlohmann::json candidates = nlohmann::json::array();
        candidates.push_back({names[0], replayed_us(first)});
        std::set<std::uint64_t> seen{plan::hash(first)};
        std::vector<plan::plan> kept;
        for (std::size_t i = 0; i < made.size(); ++i) {
          if (!seen.insert(plan::hash(made[i])).second) continue;
          candidates.push_back({names[i + 1], replayed_us(made[i])});
          kept.push_back(std::move(made[i]));
        }
        made = std::move(kept);
        header = nlohmann::json{{"candidates", candidates}, {"refit", c.refit}}.dump();
      } catch (const std::exception& e) {
        header = std::string("!") + e.what();
      }
    }
    control_->broadcast(header, 0, "the candidate plans from rank 0");
    if (header.starts_with("!"))
      fail_on_every_rank("train step: planning the candidates of the plan choice failed on rank 0: " + header.substr(1));
    const auto h = nlohmann::json::parse(header);
    c.refit = h.at("refit");
    c.plans.clear();
    c.names.clear();
    c.predicted_us.clear();
    for (std::size_t i = 0; i < h.at("candidates").size(); ++i) {
      const auto& candidate = h.at("candidates")[i];
      c.names.push_back(candidate.at(0));
      c.predicted_us.push_back(candidate.at(1));
      c.plans.push_back(i == 0 ? ex_->plan() : runtime::distribute_plan(*backend_, [&] { return made[i - 1]; }));
    }
    c.planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (c.plans.size() == 1) { // nothing else to try
      c.times.assign(1, profile_median);
      finish_choice(step);
      return;
    }
    c.order = detail::trial_order(static_cast<int>(c.plans.size()), options_.choice.rounds, options_.choice.trial_steps);
    switch_plan(c.order.front());
  }

  /// An earlier run's winner (the plan running) against the rivals rank 0 loaded with it, by
  /// the same trials; no refit, no planning.
  void start_confirmation() {
    auto& c = *choosing_;
    const auto started = std::chrono::steady_clock::now();
    const nlohmann::json& earlier = *c.earlier;
    c.names = {earlier.at("winner").get<std::string>()};
    c.predicted_us = {earlier.at("predicted_us").get<double>()};
    c.plans = {ex_->plan()};
    const auto& rivals = earlier.at("confirm");
    for (std::size_t i = 0; i < rivals.size(); ++i) {
      c.names.push_back(rivals[i].at(0));
      c.predicted_us.push_back(rivals[i].at(1));
      c.plans.push_back(runtime::distribute_plan(*backend_, [&] { return rivals_.at(i); }));
    }
    rivals_.clear();
    c.refit = earlier.at("refit");
    c.planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    c.order = detail::trial_order(static_cast<int>(c.plans.size()), options_.choice.rounds, options_.choice.trial_steps);
    switch_plan(c.order.front());
  }

  /// Rank 0 judges the trials; every rank switches to the winner; the report; the cache.
  void finish_choice(std::int64_t step) {
    auto& c = *choosing_;
    const auto k = static_cast<int>(c.plans.size());
    // Each rank's trial step times, then its planning and switching seconds: one all-gather.
    auto mine = c.times;
    mine.push_back(c.planning_s);
    mine.push_back(c.switching_s);
    std::vector<double> all(mine.size() * static_cast<std::size_t>(size_));
    control_->all_gather(std::span<const double>(mine), std::span(all), "the plan choice's measured steps");
    std::string decision;
    if (rank_ == 0) {
      const auto order = c.order.empty() ? std::vector<int>{0} : c.order;
      std::vector<double> times;
      for (int r = 0; r < size_; ++r) {
        const auto from = all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * mine.size());
        times.insert(times.end(), from, from + static_cast<std::ptrdiff_t>(c.times.size()));
      }
      const auto v = detail::judge_trials(order, times, size_, k);
      decision = nlohmann::json{{"winner", v.winner}, {"median_us", v.median_us}, {"steps", v.steps}, {"trying_us", v.excess_us}}.dump();
    }
    control_->broadcast(decision, 0, "the plan choice from rank 0");
    const auto d = nlohmann::json::parse(decision);
    plan_choice_report r;
    r.winner = d.at("winner");
    r.decided_at_step = step;
    r.refit = c.refit;
    r.trial_cost_us = d.at("trying_us");
    for (int i = 0; i < size_; ++i) {
      const auto spent = static_cast<std::size_t>(i + 1) * mine.size();
      r.planning_seconds = std::max(r.planning_seconds, all[spent - 2]);
      r.switching_seconds = std::max(r.switching_seconds, all[spent - 1]);
    }
    for (int i = 0; i < k; ++i) {
      const auto at = static_cast<std::size_t>(i);
      // One candidate only: its "trial" is the first plan's measured profile, which has no time here.
      const auto& median = d.at("median_us")[at];
      r.candidates.push_back({c.names[at], hasher::to_hex(plan::hash(c.plans[at])), c.predicted_us[at],
                              median.is_number() ? median.get<double>() : 0.0, d.at("steps")[at].get<int>()});
    }
    r.confirmed = c.earlier.has_value();
    choice_ = r;
    store_chosen(r, c.plans, c.earlier ? c.earlier->at("refitted_model") : nlohmann::json(c.refitted.value_or(c.prior).hw()));
    switch_plan(r.winner);
    choosing_.reset();
  }

  /// Runs candidate `index` from the next step on. The executor changes when that step starts
  /// (start_pending_plan), not now: until then every tensor the last step wrote, activations
  /// included, is still there to read (gather, save), whichever candidate ran it.
  void switch_plan(int index) {
    auto& c = *choosing_;
    if (c.next == index) return;
    c.next = index;
    next_plan_ = c.plans[static_cast<std::size_t>(index)];
  }

  /// Before a step: the plan the choice switched to, on a new executor over the same backend,
  /// every named tensor that outlives a step (parameters, optimizer states, the last step's
  /// gradients) carried over by name. Collective: every rank switches before the same step.
  void start_pending_plan() {
    if (!next_plan_) return;
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
    ex_ = std::make_unique<runtime::executor<Backend>>(std::move(*next_plan_), *backend_, options_.executor);
    next_plan_.reset();
    ex_->set_completed_steps(steps);
    tensors_.clear();
    inputs_.clear();
    params_.clear();
    states_.clear();
    index_tensors();
    const auto& now = ex_->plan().graph;
    for (const auto& b : now.buffers)
      if (const auto it = kept.find(b.name); it != kept.end() && static_cast<std::int64_t>(it->second.size()) == b.bytes)
        backend_->write(b.id, it->second);
    if (choosing_) choosing_->switching_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }

  // Pipelined: rank 0 chooses the schedule of the whole pipeline and sends it; every rank builds
  // the plan of its own stage from it (deterministic, no cache), and the stages check that their
  // plans agree on every message before any is sent.
  void plan_stage(const cost::model& model) {
    const auto& o = options_.pipeline;
    const auto problem = pipeline::problem_of(*split_, graph_, model);
    const auto started = std::chrono::steady_clock::now();
    std::string text;
    if (rank_ == 0) {
      const runtime::mpi::channel::busy busy(runtime::mpi::channel::get(), "choosing the pipeline schedule");
      try {
        text = detail::to_json(detail::choose_schedule(o, problem));
      } catch (const error& e) {
        text = std::string("!") + e.what();
      }
    }
    backend_->broadcast(text, 0, "the pipeline schedule from rank 0");
    if (text.starts_with("!")) fail_on_every_rank("train step: choosing the pipeline schedule failed on rank 0: " + text.substr(1));
    const auto schedule = detail::schedule_from_json(text);
    const auto timing = pipeline::verify(problem, schedule);
    const int stage = mesh_.coords(rank_)[static_cast<std::size_t>(split_->axis)];
    auto p = pipeline::stage_plan(pipeline::stage_graph(graph_, *split_, stage, schedule, &stage_origins_), model,
                                  "pipeline:" + o.schedule);
    detail::check_stage_agreement(p, split_->axis, mesh_, *control_);
    summary_ = {};
    summary_.policy = "pipeline:" + o.schedule;
    summary_.solver_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    summary_.predicted_us = timing.step_us;
    summary_.baseline = "gpipe";
    summary_.sync_predicted_us = pipeline::simulate(problem, pipeline::gpipe(problem)).step_us;
    summary_.rewritten = true;
    summary_.tasks = p.graph.tasks.size();
    summary_.collectives = detail::communicating_collectives(p.graph);
    p.stats.lower_bound_us = pipeline::lower_bound(problem); // of the whole pipelined step
    char line[160];
    std::snprintf(line, sizeof line, "%d stages x %d micro-batches (%d chunk%s per stage), lower bound %.0f us",
                  split_->stages, split_->microbatches, split_->virtual_stages, split_->virtual_stages == 1 ? "" : "s",
                  p.stats.lower_bound_us);
    summary_.pipeline = line;
    ex_ = std::make_unique<runtime::executor<Backend>>(std::move(p), *backend_, options_.executor);
  }

  // A trace that cannot be written is reported, not thrown: one rank throwing here would leave the
  // others waiting in the step's loss reduction.
  void write_trace(const char* kind, const sim::result& r) {
    const auto& g = ex_->plan().graph;
    const auto name = g.name + "." + options_.policy + "." + kind + ".rank" + std::to_string(rank_) + ".json";
    try {
      write_file_atomically(options_.trace_dir / name, trace::chrome_trace(g, r, "rank " + std::to_string(rank_)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "concerto: rank %d could not write a trace (%s)\n", rank_, e.what());
    }
  }

  struct tensor_info {
    ir::buffer_id id = -1;
    ir::dtype type = ir::dtype::f32;
    pspec spec{};
    bool partial = false;
    detail::block blk;
    int stage = -1; ///< pipelined: the stage whose ranks hold it (id is -1 on the others); -1: every rank
  };

  // The block of a tensor with this spec and global shape held by the rank at `coords` in a
  // buffer of shape `local`.
  detail::block block_of(const pspec& spec, const std::vector<std::int64_t>& global, const std::vector<std::int64_t>& local,
                         const std::vector<int>& coords) const {
    std::vector<std::vector<detail::axis_part>> splits(global.size());
    for (int d = 0; d < spec.rank && static_cast<std::size_t>(d) < global.size(); ++d)
      for (const auto a : spec.dims[d]) {
        if (a < 0) continue;
        const auto m = static_cast<std::size_t>(*mesh_.index_of(facts_.axes[static_cast<std::size_t>(a)]));
        splits[static_cast<std::size_t>(d)].push_back({mesh_.axes()[m].size, coords[m]});
      }
    return detail::block_of(global, splits, local);
  }

  const tensor_info& info(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("train step: the graph has no tensor named '" + name + "'");
    return it->second;
  }

  /// A message about tasks and buffers with the program's words: each generated name in it
  /// ("matmul#12", the lowering's name of a node the user did not name) is followed by what the
  /// program wrote there, e.g. "matmul#12 = matmul(rmsnorm(…), wq)".
  [[nodiscard]] std::string as_written(std::string_view message) const {
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
      if (node >= facts_.nodes.size() || facts_.nodes[node].name != token) continue;
      // A repeated block's task is "<repeat>.<layer>.<node>": a layer after the first reads the
      // previous layer's output, not the stack's input.
      const auto& n = facts_.nodes[node];
      const auto& written = later_layer(message.substr(0, begin), n.repeat) ? n.written_later : n.written;
      if (written != token) out.append(" = ").append(written);
    }
    out.append(message.substr(at));
    return out;
  }

  /// Whether `before` (a message up to a generated node name) ends with "<repeat>.<layer>." for
  /// a layer after the first.
  [[nodiscard]] static bool later_layer(std::string_view before, std::string_view repeat) {
    if (repeat.empty() || !before.ends_with('.')) return false;
    before.remove_suffix(1);
    std::size_t digits = 0;
    while (digits < before.size() && std::isdigit(static_cast<unsigned char>(before[before.size() - 1 - digits]))) ++digits;
    if (digits == 0) return false;
    const auto layer = before.substr(before.size() - digits);
    before.remove_suffix(digits);
    return before.ends_with(std::string(repeat) + ".") && layer != "0";
  }

  /// Where the step's first value that is not finite appeared, as the rest of the message about a
  /// loss that is not finite: the earliest kernel over all ranks that wrote one, when the executor
  /// looked (executor_options::find_non_finite), else how to make it look. Collective.
  std::string where_non_finite_began(const runtime::step_report& rep) {
    constexpr auto none = std::numeric_limits<std::int64_t>::max();
    const auto& mine = rep.first_non_finite;
    const std::string what = "where the values that are not finite of step " + std::to_string(rep.step) + " began";
    // Pipelined, each stage runs its own plan: positions in different plans are compared by
    // where their tasks lie in the schedule (micro-batch, pass), not by place in each list.
    const auto order = [&](const runtime::non_finite_output& f) -> std::int64_t {
      if (!split_) return static_cast<std::int64_t>(f.position);
      return pipeline::causal_order(*split_, stage_origins_.at(static_cast<std::size_t>(f.task)),
                                    static_cast<std::int64_t>(f.position), static_cast<std::int64_t>(stage_origins_.size()));
    };
    const auto first = control_->min_all(mine ? order(*mine) * size_ + rank_ : none, what);
    if (first == none)
      return ex_->options().find_non_finite
                 ? "; no kernel wrote a value that is not finite on any rank (it came from the inputs or a collective)"
                 : " (executor_options::find_non_finite, or CONCERTO_FIND_NON_FINITE=1, names the first kernel whose "
                   "output is not finite)";
    const int rank = static_cast<int>(first % size_);
    std::string text;
    if (rank == rank_) {
      const auto& g = ex_->plan().graph;
      const auto& t = g.tasks[static_cast<std::size_t>(mine->task)];
      std::string reads;
      for (const auto b : t.reads) reads.append(reads.empty() ? " reading '" : ", '").append(g.buffers[static_cast<std::size_t>(b)].name).append("'");
      text = "; the first kernel whose output is not finite is " + as_written(runtime::detail::task_label(g, t.id)) + " (" +
             std::string(ir::to_string(t.fn)) + reads + ") on rank " + std::to_string(rank) + ": " +
             std::to_string(mine->value) + " at element " + std::to_string(mine->element) + " of '" +
             g.buffers[static_cast<std::size_t>(mine->buffer)].name + "'";
    }
    control_->broadcast(text, rank, what);
    return text;
  }

  /// step_options::check_replicas_every: every rank hashes the block it holds of each parameter
  /// (which block: offset and shape; what it holds: the bits); ranks with the same block must
  /// hold the same bits. Collective; every rank reaches the same verdict from the same hashes.
  void check_replicas(std::int64_t step) {
    std::vector<std::int64_t> mine;
    mine.reserve(2 * params_.size());
    for (const auto& name : params_) {
      const auto& t = info(name);
      hasher block, bits;
      if (t.id < 0) { // held by another pipeline stage: a block no rank of it has
        block.add(std::string_view("elsewhere")).add(rank_);
        mine.push_back(std::bit_cast<std::int64_t>(block.value()));
        mine.push_back(0);
        continue;
      }
      staging_.resize(static_cast<std::size_t>(detail::count(t.blk.local)));
      backend_->read(t.id, std::as_writable_bytes(std::span(staging_)));
      for (const auto d : t.blk.offset) block.add(d);
      for (const auto d : t.blk.local) block.add(d);
      bits.add_bytes(staging_.data(), staging_.size() * sizeof(float));
      mine.push_back(std::bit_cast<std::int64_t>(block.value()));
      mine.push_back(std::bit_cast<std::int64_t>(bits.value()));
    }
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size_));
    control_->all_gather(std::span<const std::int64_t>(mine), std::span(all),
                         "the replica check of step " + std::to_string(step));
    const auto at = [&](int rank, std::size_t i) { return all[static_cast<std::size_t>(rank) * mine.size() + i]; };
    std::string differences;
    for (std::size_t p = 0; p < params_.size(); ++p)
      for (int r = 0; r < size_; ++r)
        for (int first = 0; first < r; ++first)
          if (at(first, 2 * p) == at(r, 2 * p)) { // the first rank that holds the same block
            if (at(first, 2 * p + 1) != at(r, 2 * p + 1)) {
              if (!differences.empty()) differences += ", ";
              differences.append("'").append(params_[p]).append("' on ranks ").append(std::to_string(first));
              differences.append(" and ").append(std::to_string(r));
            }
            break;
          }
    if (!differences.empty())
      fail_on_every_rank("train step: after step " + std::to_string(step) + " of graph '" + graph_.name +
                         "', copies of the same parameter block differ: " + differences +
                         " (step_options::check_replicas_every)");
  }

  // Names the graph's buffers after the program's nodes (the lowering's naming: a repeated
  // block's node j of layer l is "<repeat>.<l>.<name>"), with each node's spec.
  //
  // Pipelined, every rank indexes every tensor of the program in the same order (so that the
  // collectives over them, gather and save, match), with the stage that holds it; a rank of
  // another stage has no buffer for it (id -1). An input only the stage that reads it holds.
  void index_tensors() {
    const auto& g = ex_->plan().graph;
    std::map<std::string, ir::buffer_id> by_name, in_step;
    // Views included: the planner's buckets turn gradients into views of one flat buffer.
    for (const auto& b : g.buffers) by_name.emplace(b.name, b.id);
    if (split_)
      for (const auto& b : graph_.buffers) in_step.emplace(b.name, b.id);
    const auto coords = mesh_.coords(rank_);
    for (const auto& x : facts_.nodes) {
      std::vector<std::string> names;
      if (!x.repeat.empty()) {
        const auto depth = options_.lower.depth.at(x.repeat);
        for (int l = 0; l < depth; ++l) names.push_back(x.repeat + "." + std::to_string(l) + "." + x.name);
      } else {
        names.push_back(x.name);
      }
      for (const auto& name : names) {
        const auto it = by_name.find(name);
        const auto whole = in_step.find(name);
        const bool input = graph::is_leaf(x.op) && x.op != op_code::param;
        if (it == by_name.end() && (whole == in_step.end() || input)) continue;
        const auto& buf = it != by_name.end() ? g.buffers[static_cast<std::size_t>(it->second)]
                                              : graph_.buffers[static_cast<std::size_t>(whole->second)];
        tensor_info t{it != by_name.end() ? buf.id : -1, buf.type, x.spec, x.spec.partial != 0,
                      block_of(x.spec, x.global, buf.shape, coords)};
        if (split_ && whole != in_step.end()) t.stage = split_->stage_of_buffer(graph_, whole->second);
        tensors_[name] = t;
        if (input) inputs_.push_back(name);
        if (x.op == op_code::param) {
          params_.push_back(name);
          init_of_[name] = x.init;
        }
        if (x.op == op_code::state) states_.push_back(name);
      }
    }
    loss_id_ = info(facts_.loss).id;
    // The loss is a sum over the axes it is pending on and a copy over the others (pipelined:
    // the last stage's ranks hold it, the others add nothing).
    int pending = split_ ? split_->stages : 1;
    for (std::size_t a = 0; a < facts_.axes.size(); ++a)
      if (facts_.loss_partial & (1u << a))
        pending *= mesh_.axes()[static_cast<std::size_t>(*mesh_.index_of(facts_.axes[a]))].size;
    loss_copies_ = static_cast<double>(size_) / pending;
  }

  std::vector<std::string> state_names() const {
    auto all = params_;
    all.insert(all.end(), states_.begin(), states_.end());
    return all;
  }

  void initialise() {
    for (const auto& name : params_) {
      const auto& t = info(name);
      if (t.id < 0) continue; // another pipeline stage holds it
      const auto& shape = t.blk.global;
      std::vector<float> global(static_cast<std::size_t>(detail::count(shape)));
      auto rule = init_of_.at(name);
      if (rule == leaf_init::automatic) rule = shape.size() == 1 ? leaf_init::zeros : leaf_init::fan_in;
      if (rule == leaf_init::zeros || rule == leaf_init::ones) {
        std::fill(global.begin(), global.end(), rule == leaf_init::ones ? 1.0f : 0.0f);
      } else {
        // fan_in: the contracted dimension of a [..., in, out] weight (an expert stack [E, in, out]
        // is scaled by its input width, not by its expert count); a vector's length.
        const auto fan_in = shape.size() == 1 ? shape[0] : shape[shape.size() - 2];
        const float scale = std::sqrt(3.0f / static_cast<float>(fan_in));
        for (std::size_t i = 0; i < global.size(); ++i) global[i] = scale * detail::uniform(options_.seed, name, i);
      }
      std::vector<float> local(static_cast<std::size_t>(detail::count(t.blk.local)));
      detail::copy_block(t.blk, sizeof(float), reinterpret_cast<std::byte*>(global.data()),
                         reinterpret_cast<std::byte*>(local.data()), true);
      backend_->write(t.id, std::as_bytes(std::span(local)));
    }
  }

  /// What the step asks of the planner.
  [[nodiscard]] planner::plan_options planning_options() const {
    return {.policy = options_.policy,
            .solver = options_.solver,
            .decompose = options_.decompose,
            .bucket = options_.bucket,
            .memory_cap_bytes = options_.memory_cap_bytes};
  }

  /// Everything that must be identical on every rank, for check_agreement.
  [[nodiscard]] settings_record settings_record_of() const {
    const auto number = [](float v) { // the shortest text that reads back as the same float
      char buf[32];
      const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
      return std::string(buf, ec == std::errc() ? end : buf);
    };
    const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
    settings_record record{{"library version", std::string(cache::library_version)},
                           {"shapes", nlohmann::json(shapes_).dump()},
                           {"lower.heads", std::to_string(options_.lower.heads)},
                           {"lower.rope_theta", std::to_string(options_.lower.rope_theta)},
                           {"lower.depth", nlohmann::json(options_.lower.depth).dump()},
                           {"policy", options_.policy},
                           {"cost_preset", options_.cost_preset},
                           {"measure_kernels", options_.measure_kernels ? flag(*options_.measure_kernels) : "default"},
                           {"use_cache", flag(options_.use_cache)},
                           {"planner options", hasher::to_hex(planner::hash(planning_options()))},
                           {"seed", std::to_string(options_.seed)},
                           {"sgd.lr", number(settings_.sgd.lr)},
                           {"sgd.momentum", number(settings_.sgd.momentum)},
                           {"sgd.weight_decay", number(settings_.sgd.weight_decay)},
                           {"adamw.lr", number(settings_.adamw.lr)},
                           {"adamw.beta1", number(settings_.adamw.beta1)},
                           {"adamw.beta2", number(settings_.adamw.beta2)},
                           {"adamw.eps", number(settings_.adamw.eps)},
                           {"adamw.weight_decay", number(settings_.adamw.weight_decay)},
                           {"stop_on_non_finite_loss", flag(options_.stop_on_non_finite_loss)},
                           {"check_replicas_every", std::to_string(options_.check_replicas_every)},
                           {"allow_tf32", flag(options_.allow_tf32)},
                           {"pipeline", nlohmann::json{options_.pipeline.microbatches, options_.pipeline.schedule,
                                                       options_.pipeline.virtual_stages, options_.pipeline.axis,
                                                       options_.pipeline.search_budget_s}
                                            .dump()},
                           {"plan choice", nlohmann::json{options_.choice.enabled, options_.choice.warmup_steps,
                                                          options_.choice.profile_steps, options_.choice.trial_steps,
                                                          options_.choice.rounds, options_.choice.also_try}
                                               .dump()},
                           // Last of the step's own: what the settings above make of the program,
                           // so that a difference in them is named before the graph it changes.
                           {"lowered graph (program, mesh, shapes)", hasher::to_hex(plan::hash(graph_))}};
    // The MPI library's collective algorithms: ranks that differ deadlock or truncate in them.
    for (auto& [name, value] : runtime::mpi::collective_settings()) record.emplace_back("MPI " + name, std::move(value));
    return record;
  }

  detail::program_facts facts_;
  concerto::mesh mesh_;
  shape_map shapes_;
  step_options options_;
  runtime::kernel_settings settings_;
  int rank_ = 0, size_ = 1;
  ir::graph graph_;
  std::optional<runtime::mpi::control> control_; ///< the step's own collectives, with deadlines
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<runtime::executor<Backend>> ex_;
  plan_summary summary_;
  /// While the plan choice runs: the candidates, where the trials stand, what was measured.
  struct choosing {
    cost::model prior = cost::model::preset("a800x32"); ///< the model the first plan was made with
    std::optional<cost::model> refitted;                ///< rank 0: the prior refitted to the measured steps
    int seen = 0;                       ///< steps since the first
    std::vector<sim::result> profile;   ///< measured steps of the first plan
    std::vector<plan::plan> plans;      ///< the candidates; 0 is the first plan
    std::vector<std::string> names;
    std::vector<double> predicted_us;
    std::vector<int> order;             ///< candidate of each trial step
    std::size_t position = 0;           ///< next trial step
    int next = 0;                       ///< the candidate the next step runs
    std::vector<double> times;          ///< this rank's trial step times
    std::string refit;
    double planning_s = 0, switching_s = 0;
    std::optional<nlohmann::json> earlier; ///< confirming an earlier run's pick: its record, with "confirm"
  };
  std::optional<choosing> choosing_;
  std::vector<plan::plan> rivals_; ///< rank 0: the plans an earlier pick is measured against again
  std::optional<plan::plan> next_plan_; ///< the plan choice's switch, made when the next step starts
  std::vector<std::byte> carried_; ///< what outlives a step, while start_pending_plan changes executors
  plan_choice_report choice_;
  std::map<std::string, tensor_info> tensors_;
  std::optional<pipeline::stage_split> split_; ///< set when the mesh has the pipeline axis
  std::vector<pipeline::task_origin> stage_origins_; ///< pipelined: each task of this stage's plan, in the split graph
  std::vector<std::string> inputs_, params_, states_;
  std::map<std::string, leaf_init> init_of_; ///< each parameter's rule, from its leaf
  ir::buffer_id loss_id_ = -1;
  double loss_copies_ = 1;
  std::vector<float> staging_;
  std::vector<std::int64_t> staging_i64_;
};

/// @brief The step of a program of N nodes: lowers it, keeps what the step needs of it.
template <std::size_t N, class Backend = default_backend>
class step : public basic_step<Backend> {
public:
  // Copies, not moves, of the arguments both the lowering and the base read: the order in
  // which a constructor's arguments are evaluated is unspecified.
  step(const graph::program<N>& p, const concerto::mesh& m, const shape_map& shapes, optimizer_settings opt,
       step_options o)
      : basic_step<Backend>(graph::detail::at_lowering_size(
                                p,
                                [&](const auto& sized) {
                                  return detail::lower_for_step(
                                      sized, detail::microbatch_shapes(sized, shapes, o.pipeline.microbatches), m, o.lower);
                                }),
                            m, shapes, opt, o) {}
};

/// @brief Compiles a training step: lowers `p` for `m` and `shapes`; plans on the first call.
/// @code
/// auto step = train::compile(gpt, mesh, shapes, {.adamw = {.lr = 3e-3f}},
///                            {.policy = "concerto", .lower = {.heads = 4, .depth = {{"layers", 2}}}});
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
