#pragma once
// The vision examples' command line and training loop: fresh images of examples/common/
// shape_images.hpp every step, the held-out set's loss and accuracy before and after training
// (the logits of each held-out batch read back with step.evaluated), and, as the other
// examples, a comma-separated --policy that runs one step per policy on the same ranks in turn
// and --json that writes each one's result (bench/cluster/run reads them).
#include "command_line.hpp"
#include "policy_runs.hpp"
#include "shape_images.hpp"

#include <concerto/core/file.hpp>
#include <concerto/train/step.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace examples {

struct vision_settings {
  int steps = 80, tp = 1;
  std::int64_t batch = 32, side = 16, heldout = 256;
  float lr = 2e-3f;
  double min_accuracy = 0; ///< fail below this held-out accuracy after training (0: only the loss must fall)
  std::string policy = "concerto", cost_preset = "cpu", json, precision = "fp32";
};

inline void add_vision_options(CLI::App& app, vision_settings& s) {
  app.add_option("--steps", s.steps, "training steps")->check(positive)->capture_default_str();
  app.add_option("--batch", s.batch, "images per step (global)")->check(positive)->capture_default_str();
  app.add_option("--side", s.side, "image height and width in pixels")->check(CLI::Range(8, 4096))->capture_default_str();
  app.add_option("--heldout", s.heldout, "held-out images (rounded up to whole batches)")->check(positive)->capture_default_str();
  app.add_option("--tp", s.tp, "tensor-parallel ranks (the rest is data parallel)")->check(positive)->capture_default_str();
  app.add_option("--lr", s.lr, "AdamW learning rate")->check(positive)->capture_default_str();
  app.add_option("--min-accuracy", s.min_accuracy, "exit with status 1 below this held-out accuracy after training")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--precision", s.precision,
                 "fp32, or bf16: activations, gradients and collectives in bf16, f32 master weights and AdamW state; "
                 "or fp16: the same in f16, with dynamic loss scaling")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--policy", s.policy, "plan policy, or a comma-separated list: sync, program_order, xla_lhs, concerto")
      ->capture_default_str();
  app.add_option("--cost-preset", s.cost_preset, "the planner's cost model (cpu-netns: the emulated cluster's)")
      ->capture_default_str();
  app.add_option("--json", s.json, "write the result of every policy to this file (a JSON array)");
}

/// Held-out loss and accuracy of a step (collective): whole batches of the held-out stream.
template <class Step>
std::pair<double, double> held_out(Step& step, const vision_settings& s) {
  double loss = 0, right = 0;
  const auto batches = (s.heldout + s.batch - 1) / s.batch;
  for (std::int64_t b = 0; b < batches; ++b) {
    const auto d = shape_images(s.batch, s.side, /*seed=*/2, b * s.batch);
    loss += step.evaluate({{"x", d.images}, {"labels", d.labels}});
    right += accuracy(step.evaluated(step.prediction_name()), d.labels.i64) * static_cast<double>(s.batch);
  }
  return {loss / static_cast<double>(batches), right / static_cast<double>(batches * s.batch)};
}

/// Trains every run on the same fresh batches; prints the held-out loss and accuracy before and
/// after; 0 when every run's held-out loss fell (and its accuracy reached --min-accuracy).
template <class Step>
int train_vision(std::vector<Step>& runs, const vision_settings& s, nlohmann::json fields) {
  const bool root = runs.front().rank() == 0;
  announce_plans(runs, root);
  const std::size_t k = runs.size();
  std::vector<double> first(k), last(k);
  std::vector<std::pair<double, double>> before(k);
  std::vector<std::vector<double>> times(k), exposed(k);
  for (std::size_t p = 0; p < k; ++p) before[p] = held_out(runs[p], s);
  for (int i = 0; i < s.steps; ++i) {
    const auto d = shape_images(s.batch, s.side, /*seed=*/1, static_cast<std::int64_t>(i) * s.batch);
    const concerto::train::batch batch{{"x", d.images}, {"labels", d.labels}};
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t p = (j + static_cast<std::size_t>(i)) % k; // rotate who goes first
      const auto r = runs[p](batch);
      if (i == 0) first[p] = r.loss;
      last[p] = r.loss;
      if (i > 0) { // the first step also warms caches and connections
        times[p].push_back(r.step_us);
        exposed[p].push_back(r.exposed_comm_us);
      }
      if (root && k == 1 && (i % 10 == 0 || i + 1 == s.steps))
        std::printf("step %4lld/%d  loss %.4f  %7.0f us\n", static_cast<long long>(r.step), s.steps, r.loss, r.step_us);
    }
  }
  nlohmann::json results = nlohmann::json::array();
  bool ok = true;
  for (std::size_t p = 0; p < k; ++p) {
    const auto [loss, acc] = held_out(runs[p], s);
    ok = ok && loss < before[p].first && acc >= s.min_accuracy; // one batch's loss is too noisy to judge by
    if (!root) continue;
    std::printf("loss %.4f -> %.4f; held-out loss %.4f -> %.4f, accuracy %.1f%% -> %.1f%% (chance %.1f%%); median step %.0f us "
                "(measured, %s plan)\n",
                first[p], last[p], before[p].first, loss, 100 * before[p].second, 100 * acc, 100.0 / shape_classes,
                concerto::median(times[p]), runs[p].summary().policy.c_str());
    auto f = fields;
    f["loss_first"] = first[p];
    f["loss_last"] = last[p];
    f["heldout_accuracy"] = acc;
    results.push_back(result_of(runs[p], f, times[p], exposed[p]));
  }
  if (root && !s.json.empty()) concerto::write_file_atomically(s.json, results.dump(2) + "\n");
  if (root) std::fflush(stdout);
  if (!ok)
    concerto::fail("a plan's held-out loss did not fall or its accuracy stayed below --min-accuracy " +
                   std::to_string(s.min_accuracy) + " (policies: " + s.policy + ")");
  return 0;
}

} // namespace examples
