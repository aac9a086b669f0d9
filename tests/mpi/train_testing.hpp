#pragma once
// Shared by the training tests: runs a compiled program for a few steps on the first `ranks`
// ranks of the world (a sub-communicator), and compares results with a tolerance.
#include "mpi_testing.hpp"

#include <concerto/planner/decompose.hpp>
#include <concerto/train/step.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <initializer_list>
#include <vector>

namespace train_testing {

/// The loss with parameter `name`'s element i moved by +eps and by -eps (restored after): the
/// two sides of a central difference. `value` is the parameter's current value.
template <class Step>
std::pair<double, double> losses_around(Step& step, const concerto::train::batch& b, const std::string& name,
                                        std::vector<float>& value, std::size_t i, float eps) {
  const float keep = value[i];
  value[i] = keep + eps;
  step.set_parameter(name, value);
  const double up = step(b).loss;
  value[i] = keep - eps;
  step.set_parameter(name, value);
  const double down = step(b).loss;
  value[i] = keep;
  step.set_parameter(name, value);
  return {up, down};
}

/// How check_gradients_by_differences probes the loss.
struct difference_probe {
  float eps = 1e-2f;
  double min_largest_gradient = 1e-4; ///< every parameter checked takes part in the loss
  /// Set for a piecewise-smooth loss (routing): an entry whose second difference around this
  /// loss is far above rounding sits on a kink and is passed over (up to 12 entries tried).
  std::optional<double> kinks_around;
};

/// Each parameter's gradient, at three entries, against the central difference of the loss
/// (within 2e-3 + 5% of the difference). The step has run batch `b` once.
template <class Step>
void check_gradients_by_differences(Step& step, const concerto::train::batch& b, const std::vector<std::string>& params,
                                    const difference_probe& probe) {
  for (const auto& name : params) {
    const auto grad = step.gradient(name);
    auto value = step.parameter(name);
    double largest = 0;
    for (auto g : grad) largest = std::max(largest, std::abs(static_cast<double>(g)));
    CAPTURE(name, largest);
    REQUIRE(largest > probe.min_largest_gradient);
    int checked = 0;
    for (std::size_t k = 0; k < 12 && checked < 3; ++k) {
      const auto i = (k * 7919 + 13) % value.size();
      const auto [up, down] = losses_around(step, b, name, value, i, probe.eps);
      if (probe.kinks_around && std::abs(up + down - 2 * *probe.kinks_around) > 1e-4) continue;
      ++checked;
      const double fd = (up - down) / (2.0 * probe.eps);
      CAPTURE(i, fd, grad[i]);
      CHECK(std::abs(fd - grad[i]) <= 2e-3 + 5e-2 * std::abs(fd));
    }
    CHECK(checked == 3);
  }
}

// Splits every collective the planner could split into 2 chunks with its matmul, exposed or not,
// so that the decomposed graph really runs, whatever the cost model would have chosen.
inline concerto::ir::graph split_everything(const concerto::ir::graph& g) {
  const auto candidates = concerto::planner::find_candidates(g, concerto::cost::model::preset("h100x64"),
                                                   {.chunk_choices = {2}, .min_exposed_fraction = 0, .progress = false});
  std::vector<concerto::planner::decomposition> chosen;
  std::set<concerto::ir::task_id> used;
  for (const auto& c : candidates)
    if (!used.contains(c.collective) && !used.contains(c.compute)) {
      chosen.push_back(c);
      used.insert(c.collective);
      used.insert(c.compute);
    }
  return concerto::planner::apply(g, chosen);
}


// The tolerance every comparison with the single-rank run uses: relative 1e-5 of the largest
// reference value (the sums differ only in their order across ranks), plus 1e-7 absolute.
inline constexpr double rel_tol = 1e-5, abs_tol = 1e-7;

struct run_result {
  std::vector<double> loss;                              // per step
  std::map<std::string, std::vector<float>> grads, params; // after the last step, global
  concerto::train::plan_summary summary;
};

/// The first `ranks` ranks of the world, or nullopt on the others (which skip the run).
class sub_world {
public:
  explicit sub_world(int ranks) {
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_split(MPI_COMM_WORLD, me < ranks ? 0 : MPI_UNDEFINED, me, &comm_);
  }
  ~sub_world() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  sub_world(const sub_world&) = delete;
  sub_world& operator=(const sub_world&) = delete;
  [[nodiscard]] bool member() const noexcept { return comm_ != MPI_COMM_NULL; }
  [[nodiscard]] MPI_Comm get() const noexcept { return comm_; }

private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// Calls `f(comm, ranks)` on the first `ranks` ranks for each of `sizes` the world holds (the
/// other ranks skip that size).
template <class F>
void on_sub_worlds(std::initializer_list<int> sizes, F&& f) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  for (const int ranks : sizes) {
    if (ranks > world) continue;
    sub_world sub(ranks);
    if (!sub.member()) continue;
    CAPTURE(ranks);
    f(sub.get(), ranks);
  }
}

template <std::size_t N>
run_result run(const concerto::graph::program<N>& p, const concerto::shape_map& shapes, MPI_Comm comm,
               std::vector<concerto::axis_request> axes, const concerto::train::batch& b, int steps,
               concerto::train::optimizer_settings opt, concerto::train::step_options o,
               const std::vector<std::string>& params) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  o.world = comm;
  o.use_cache = false;
  auto step = concerto::train::compile(p, concerto::mesh::from_world(n, axes), shapes, opt, o);
  run_result r;
  for (int s = 0; s < steps; ++s) r.loss.push_back(step(b).loss);
  for (const auto& name : params) {
    r.grads[name] = step.gradient(name);
    r.params[name] = step.parameter(name);
  }
  r.summary = step.summary();
  return r;
}

inline double worst_relative(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double scale = 0, worst = 0;
  for (auto v : want) scale = std::max(scale, std::abs(static_cast<double>(v)));
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) / (scale + abs_tol / rel_tol));
  return worst;
}

/// Every loss, gradient and parameter of `got` matches `want` within the tolerance.
inline void check_same(const run_result& got, const run_result& want) {
  REQUIRE(got.loss.size() == want.loss.size());
  for (std::size_t s = 0; s < got.loss.size(); ++s) {
    CAPTURE(s, got.loss[s], want.loss[s]);
    CHECK(std::abs(got.loss[s] - want.loss[s]) <= rel_tol * std::abs(want.loss[s]) + abs_tol);
  }
  for (const auto& [name, g] : want.grads) {
    CAPTURE(name);
    CHECK(worst_relative(got.grads.at(name), g) <= rel_tol);
    CHECK(worst_relative(got.params.at(name), want.params.at(name)) <= rel_tol);
  }
}

} // namespace train_testing
