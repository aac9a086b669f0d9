#pragma once
/// @file
/// @brief What a training step is given and what it gives back: its options, the batches and
/// loaders it takes, the result of a step and the summary of its plan (train/step.hpp runs it).
///
/// @code
/// train::step_options o{.policy = planner::policy::concerto, .lower = {.heads = 4, .depth = {{"layers", 2}}}};
/// train::batch b{{"ids", {{8, 32}, {}, ids}}, {"labels", {{8, 32}, {}, labels}}};
/// @endcode

#include <concerto/cache/plan_cache.hpp>
#include <concerto/core/error.hpp>
#include <concerto/graph/lower.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/planner/policy.hpp>
#include <concerto/runtime/cpu/optimizer.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/kernel_call.hpp>
#include <concerto/runtime/lr_schedule.hpp>
#include <concerto/train/loss_scaling.hpp>
#include <concerto/train/pipeline.hpp>
#include <concerto/train/plan_choice.hpp>

#include <mpi.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train {

/// @brief Optimizer hyperparameters (the program chose sgd or adamw), and the schedule of the
/// rate: `schedule` gives step t the rate `runtime::lr_at(schedule, lr, t)` (warmup, then
/// constant, linear or cosine decay to a floor; runtime/lr_schedule.hpp). Weight decay is the
/// optimizer's `weight_decay` (decoupled for AdamW, scaled by the scheduled rate).
struct optimizer_settings {
  runtime::cpu::sgd_config sgd{};
  runtime::cpu::adamw_config adamw{};
  runtime::lr_schedule schedule{};
  /// Global-norm gradient clipping (torch.nn.utils.clip_grad_norm_'s max_norm): every update
  /// scales its gradient by min(1, clip_norm / (‖g‖ + 1e-6)), ‖g‖ the norm of all the gradients
  /// of the step. 0: none. Its tasks are part of the step graph (graph/lower.hpp).
  float clip_norm = 0.0f;
};

namespace detail {
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
/// @brief How train::compile chooses the specs of a program whose leaves are written `auto_`
/// (docs/auto-sharding.md): for the step's mesh, shapes, lowering, cost preset and memory cap.
struct sharding_options {
  bool explain = false;    ///< print the whole account (each leaf's spec, collectives, memory, alternatives), not two lines
  int keep = 3;            ///< the best candidates the planner schedules before the final choice
  bool decide_zero = true; ///< also choose the ZeRO stage and its axis
};

struct step_options {
  planner::policy policy = planner::policy::concerto; ///< planner/policy.hpp
  /// Time the graph's CPU kernels before planning and price each with its measured factor
  /// (cost::hardware::kernel_scale; see prepare()). Default: on a host backend with a "cpu*"
  /// preset, where the roofline is furthest from the kernels; off on a GPU.
  std::optional<bool> measure_kernels;
  lower_options lower{};             ///< name, attention heads, repeat depths
  /// How values are stored and moved (ir/precision.hpp, docs/training.md "Precision"): f32
  /// throughout (the default), or bf16 activations, gradients and collectives beside f32 master
  /// parameters and optimizer state (`ir::precision_policy::bf16()`), or the same in f16 with
  /// dynamic loss scaling (`ir::precision_policy::fp16()`). Sets lower.precision.
  ir::precision_policy precision{};
  /// How the loss scale moves when the precision scales the loss (train/loss_scaling.hpp).
  loss_scaling_settings loss_scaling{};
  std::string cost_preset = "cpu";   ///< cost::model preset the planner uses
  planner::windowed_options solver{.time_budget_s = 10, .progress = false};
  bool decompose = true;             ///< concerto policy: split exposed collectives with their matmuls
  bool bucket = true;                ///< concerto policy: fuse small gradient collectives
  std::optional<std::int64_t> memory_cap_bytes; ///< peak memory per rank the plan (and an automatic sharding) must respect
  /// A program with leaves written auto_: how their specs are chosen (rank 0 chooses before the
  /// step is lowered, the choice is kept in the cache folder beside the plans).
  sharding_options sharding{};
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
  float lr = 0;                 ///< the rate this step's optimizer used (optimizer_settings::schedule)
  /// With clipping (optimizer_settings::clip_norm) or loss scaling: the global gradient norm
  /// before clipping (of the true gradients: the loss scale divided out; infinite or NaN when the
  /// step overflowed); NaN without either (the step computes no norm then).
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  /// Under loss scaling: the scale this step's loss gradient was multiplied by; 1 without.
  float loss_scale = 1.0f;
  /// Under loss scaling: some gradient overflowed, so no parameter or optimizer state changed on
  /// any rank and the step count did not advance (the next step has this step's number again).
  bool skipped = false;
};

/// @brief One mixture-of-experts layer's load-balancing loss in the last step
/// (basic_step::moe_balance_losses).
struct moe_balance {
  std::string router;   ///< the layer's routing node, e.g. "layers.0.moe_route#23"
  double balance = 0;   ///< experts·Σ_e f_e·P_e averaged over the step's groups: 1 when perfectly balanced, up to E
  double weight = 0;    ///< the layer's balance loss weight (moe_config::aux_weight)
  double loss = 0;      ///< weight · balance: the loss whose gradient the router's gets
};

namespace detail {

/// CONCERTO_CHECK_REPLICAS, CONCERTO_CHOOSE_PLAN and CONCERTO_TF32 override their options.
inline void read_environment(step_options& o) {
  if (const char* every = std::getenv("CONCERTO_CHECK_REPLICAS"); every != nullptr && *every != '\0') {
    const auto [end, ec] = std::from_chars(every, every + std::strlen(every), o.check_replicas_every);
    if (ec != std::errc() || *end != '\0' || o.check_replicas_every < 0)
      fail(std::string("CONCERTO_CHECK_REPLICAS='") + every + "' is not a number of steps (0: never)");
  }
  if (const auto on = env_flag("CONCERTO_CHOOSE_PLAN", "keep the first plan", "choose by measuring")) o.choice.enabled = *on;
  if (const auto on = env_flag("CONCERTO_TF32", "fp32 products", "TF32 tensor cores on the GPU")) o.allow_tf32 = *on;
}

/// The user's lowering, which the training step and evaluation both start from: the lowering
/// options and the precision policy (a step option, so that evaluation cannot miss it).
inline lower_options users_lowering(const step_options& o) {
  auto out = o.lower;
  out.precision = o.precision;
  return out;
}

/// What the step lowers with: the user's lowering, and what the optimizer settings and the
/// mesh imply (clipping's tasks, the pipeline's axis).
inline lower_options lowering_options(const step_options& o, const optimizer_settings& opt, const mesh& m) {
  auto out = users_lowering(o);
  out.clip_gradients = opt.clip_norm > 0.0f;
  if (m.index_of(o.pipeline.axis)) out.pipeline_axis = o.pipeline.axis;
  return out;
}

/// What `evaluate` lowers with: the user's lowering, the forward pass alone (no gradient to
/// clip, no pipeline stages).
inline lower_options evaluation_lowering_options(const step_options& o) {
  auto out = users_lowering(o);
  out.forward_only = true;
  return out;
}

/// Throws concerto::error naming the first option (or the schedule's field) that cannot be.
inline void check_options(const step_options& o, const runtime::kernel_settings& settings) {
  settings.schedule.check();
  if (!(settings.clip_norm >= 0.0f) || !std::isfinite(settings.clip_norm))
    fail("train step: optimizer_settings::clip_norm " + std::to_string(settings.clip_norm) +
         " must be a finite norm above 0 (or 0: no clipping)");
  if (o.check_replicas_every < 0) fail("train step: check_replicas_every must not be negative");
  if (o.precision.loss_scaling) o.loss_scaling.check();
  if (const auto& c = o.choice; c.warmup_steps < 0 || c.profile_steps < 1 || c.trial_steps < 1 || c.rounds < 1)
    fail("train step: plan choice needs warmup_steps >= 0, profile_steps >= 1, trial_steps >= 1 and rounds >= 1 (got " +
         std::to_string(c.warmup_steps) + ", " + std::to_string(c.profile_steps) + ", " + std::to_string(c.trial_steps) +
         ", " + std::to_string(c.rounds) + ")");
  if (!(o.choice.confirm_within >= 1))
    fail("train step: plan choice needs confirm_within >= 1 (got " + std::to_string(o.choice.confirm_within) +
         "; 1 trusts an earlier run's pick)");
}

} // namespace detail

} // namespace concerto::train
