// The tutorial's MLP (docs/tutorial.md step 3) lowered, planned and trained through train::compile
// on 1, 2 and 4 ranks with every mesh shape that divides (DP, TP, DP x TP): the loss of each step,
// and the gradients and parameters after the last one, match the single-rank run within
// train_testing::rel_tol (1e-5 relative); so do the sync, program_order and concerto plans, and a
// repeated MLP whose input has no gradient matches the same stack with it. The tanh MLP (the op
// added last, through its table entry and kernels alone) trains alike on every mesh, its gradients
// the central differences of the loss.
#include "train_testing.hpp"

#include <catch2/matchers/catch_matchers_string.hpp>

#include <concerto/concerto.hpp>

#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <functional>

using namespace concerto;
namespace tt = train_testing;

namespace {

inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto act = spec(shard(dp), replicate);
constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(act), param<"w1">(spec(replicate, shard(tp))))),
                                        param<"w2">(spec(shard(tp), replicate))),
                                 input<"target">(act)),
                             sgd{});

constexpr std::int64_t B = 8, K = 12, H = 16;
const shape_map shapes{{"x", {B, K}}, {"target", {B, K}}, {"w1", {K, H}}, {"w2", {H, K}}};
const std::vector<std::string> params{"w1", "w2"};

train::batch data() {
  train::tensor x{{B, K}}, t{{B, K}};
  for (std::int64_t i = 0; i < B * K; ++i) {
    x.f32.push_back(std::sin(0.37f * static_cast<float>(i)));
    t.f32.push_back(0.5f * std::cos(0.23f * static_cast<float>(i)));
  }
  return {{"x", x}, {"target", t}};
}

// The MLP as a residual stack of two blocks, on features with and without gradient: without, the
// step has no task for layer 0's input gradient (lower drops it), which changes no other number.
constexpr auto block = [](auto h) {
  return h + matmul(gelu(matmul(h, param<"w1">(spec(replicate, shard(tp))))), param<"w2">(spec(shard(tp), replicate)));
};
constexpr auto stack = program(mse(repeat<"layers">(block, input<"x">(act)), input<"target">(act)), sgd{});
constexpr auto frozen_stack = program(mse(repeat<"layers">(block, input<"x">(act, no_grad)), input<"target">(act)), sgd{});
const shape_map stack_shapes{{"x", {B, K}}, {"target", {B, K}}, {"w1", {K, H}}, {"w2", {H, K}}};

// Dropout on the column-parallel hidden layer (split over tp) and on the row-parallel output's
// pending sum (linear: it goes through), and in a repeated block (each layer its own mask).
constexpr auto dropped_mlp =
    program(mse(dropout<{.rate = 0.3f, .seed = 5}>(matmul(dropout<{.rate = 0.2f}>(gelu(matmul(input<"x">(act), param<"w1">(spec(replicate, shard(tp)))))),
                                                          param<"w2">(spec(shard(tp), replicate)))),
                input<"target">(act)),
            sgd{});
constexpr auto dropped_block = [](auto h) {
  return h + dropout<{.rate = 0.25f}>(
                 matmul(gelu(matmul(h, param<"w1">(spec(replicate, shard(tp))))), param<"w2">(spec(shard(tp), replicate))));
};
constexpr auto dropped_stack = program(mse(repeat<"layers">(dropped_block, input<"x">(act)), input<"target">(act)), sgd{});

constexpr auto tanh_mlp = program(mse(matmul(tanh(matmul(input<"x">(act), param<"w1">(spec(replicate, shard(tp))))),
                                             param<"w2">(spec(shard(tp), replicate))),
                                      input<"target">(act)),
                                  sgd{});

// A small convolutional net (conv2d: the einsum rule over NHWC images): a 3×3 convolution at
// stride 2 with its output channels split over tp (column-parallel), relu, a 1×1 convolution with
// its input channels split over tp (row-parallel: a pending sum), against a target.
constexpr auto image = spec(shard(dp), replicate, replicate, replicate);
constexpr auto cnn =
    program(mse(conv2d(relu(conv2d<{.stride = 2, .padding = 1}>(input<"x">(image),
                                                                 param<"k1">(spec(replicate, replicate, replicate, shard(tp))))),
                       param<"k2">(spec(replicate, replicate, shard(tp), replicate))),
                input<"target">(image)),
            sgd{}, on(dp, tp));
// Forward: the row-parallel sum; backward: the image's gradient of the column-parallel convolution.
static_assert(cnn.count(collective::all_reduce, tp) == 2);
static_assert(cnn.count(collective::all_reduce, dp) == 2); // the two kernels' gradients
static_assert(cnn.count(op_code::conv2d_grad_weight) == 2 && cnn.count(op_code::conv2d_grad_input) == 2);

constexpr std::int64_t N = 4, S = 6, C = 3, F = 8;
const shape_map cnn_shapes{{"x", {N, S, S, C}}, {"target", {N, S / 2, S / 2, C}}, {"k1", {3, 3, C, F}}, {"k2", {1, 1, F, C}}};
const std::vector<std::string> cnn_params{"k1", "k2"};

train::batch images() {
  train::tensor x{{N, S, S, C}}, t{{N, S / 2, S / 2, C}};
  for (std::int64_t i = 0; i < N * S * S * C; ++i) x.f32.push_back(std::sin(0.41f * static_cast<float>(i)));
  for (std::int64_t i = 0; i < N * (S / 2) * (S / 2) * C; ++i) t.f32.push_back(0.5f * std::cos(0.29f * static_cast<float>(i)));
  return {{"x", x}, {"target", t}};
}

// An image classifier: a column-parallel convolution, a position table added to its pixels as a
// sequence (flatten: a view), global average pooling (mean over the pixels), a row-parallel head
// and cross-entropy over the classes.
constexpr auto pixels = flatten<1, 2>(relu(conv2d<{.padding = 1}>(input<"x">(image, no_grad),
                                                                  param<"k">(spec(replicate, replicate, replicate, shard(tp))))));
constexpr auto classifier =
    program(cross_entropy(matmul(mean<1>(bias(pixels, param<"pos">(spec(replicate, shard(tp))))),
                                 param<"head">(spec(shard(tp), replicate))),
                          data<"labels">(spec(shard(dp)))),
            sgd{}, on(dp, tp));
constexpr std::int64_t classes = 5;
const shape_map classifier_shapes{
    {"x", {N, S, S, C}}, {"k", {3, 3, C, F}}, {"pos", {S * S, F}}, {"head", {F, classes}}, {"labels", {N}}};
const std::vector<std::string> classifier_params{"k", "pos", "head"};

// A class token: a learned table [1, F] joined before the pixels (a table repeated over the
// batch, its gradient summed over it), positions added, and the features the token's slice next
// to the pixels' mean (equal ranks joined along the channels, which tp splits: gathered first).
constexpr auto tokens = scale(bias(concat<1>(param<"cls">(spec(replicate, shard(tp))), pixels), param<"pos">(spec(replicate, shard(tp)))),
                              param<"ls">(spec(shard(tp)), init::ones)); // a per-channel scale (LayerScale)
constexpr auto token_classifier =
    program(cross_entropy(matmul(concat<1>(flatten<1, 2>(slice<1, 0, 1>(relu(tokens))), mean<1>(relu(tokens))),
                                 param<"head">(spec(replicate, replicate))),
                          data<"labels">(spec(shard(dp)))),
            sgd{}, on(dp, tp));
static_assert(token_classifier.count(op_code::concat_dim_grad) == 4 && token_classifier.count(op_code::slice_dim_grad) == 1);
const shape_map token_shapes{{"x", {N, S, S, C}},       {"k", {3, 3, C, F}},          {"cls", {1, F}}, {"ls", {F}},
                             {"pos", {S * S + 1, F}}, {"head", {2 * F, classes}}, {"labels", {N}}};
const std::vector<std::string> token_params{"k", "cls", "pos", "ls", "head"};

train::batch labelled_images() {
  auto b = images();
  b.erase("target");
  train::tensor labels{{N}};
  for (std::int64_t i = 0; i < N; ++i) labels.i64.push_back((3 * i + 1) % classes);
  b.emplace("labels", labels);
  return b;
}

// A ViT's patch embedding two ways: the image cut into 2×2 patches by views and one transpose
// ([N, S, S, C] -> [N, S·S/4, 4·C], each patch's values in a kernel's order: row, column,
// channel) times a column-parallel [4·C, F], and a convolution at stride 2 whose kernel
// [2, 2, C, F] holds the same values (both are "k": one initialiser, one fan-in). The features
// are transposed to [N, F, patches] (the tp split follows the channels to dim 1) and averaged
// over the patches; a row-parallel head and cross-entropy.
constexpr std::int64_t P = 2;
constexpr auto patches = [](auto x) {
  auto rows = flatten<0, 1>(unflatten<1, P>(flatten<2, 3>(x)));          // [N·S/P, P, S·C]
  auto cut = flatten<2, 3>(transpose<1>(unflatten<2, P * C>(rows)));      // [N·S/P, S/P, P·P·C]
  return unflatten<0, (S / P) * (S / P)>(flatten<0, 1>(cut));             // [N, patches, P·P·C]
};
constexpr auto patch_head = [](auto features) { // [N, patches, F] -> logits
  return matmul(mean<2>(transpose<1>(relu(features))), param<"head">(spec(shard(tp), replicate)));
};
constexpr auto patch_classifier =
    program(cross_entropy(patch_head(matmul(patches(input<"x">(image, no_grad)), param<"k">(spec(replicate, shard(tp))))),
                          data<"labels">(spec(shard(dp)))),
            sgd{}, on(dp, tp));
static_assert(patch_classifier.count(op_code::transpose) == 3); // the patches', the features' and the latter's gradient
constexpr auto strided_classifier = program(
    cross_entropy(patch_head(flatten<1, 2>(conv2d<{.stride = P}>(input<"x">(image, no_grad),
                                                                 param<"k">(spec(replicate, replicate, replicate, shard(tp)))))),
                  data<"labels">(spec(shard(dp)))),
    sgd{}, on(dp, tp));
const shape_map patch_shapes{{"x", {N, S, S, C}}, {"k", {P * P * C, F}}, {"head", {F, classes}}, {"labels", {N}}};
const std::vector<std::string> patch_params{"k", "head"};

// Pooling between convolutions: a column-parallel 3×3 convolution, a ResNet stem's max pooling
// (3×3 windows at stride 2, padded: the channels stay split), a row-parallel 1×1 convolution (a
// pending sum) and an average pooling that lets the pending sum through (it is linear).
constexpr auto pooled_cnn = program(
    mse(avg_pool<{.window = 2, .stride = 1}>(
            conv2d(max_pool<{.window = 3, .stride = 2, .padding = 1}>(relu(conv2d<{.padding = 1}>(
                       input<"x">(image), param<"k1">(spec(replicate, replicate, replicate, shard(tp)))))),
                   param<"k2">(spec(replicate, replicate, shard(tp), replicate)))),
        input<"target">(image)),
    sgd{}, on(dp, tp));
static_assert(pooled_cnn.count(op_code::max_pool_grad) == 1 && pooled_cnn.count(op_code::avg_pool_grad) == 1);
// Forward: one all-reduce of the row-parallel sum, after the average pooling (before the loss).
static_assert(pooled_cnn.count(collective::all_reduce, tp) == 2);
const shape_map pooled_shapes{{"x", {N, S, S, C}}, {"target", {N, S / 2 - 1, S / 2 - 1, C}}, {"k1", {3, 3, C, F}}, {"k2", {1, 1, F, C}}};

train::batch pooled_images() {
  auto b = images();
  train::tensor t{{N, S / 2 - 1, S / 2 - 1, C}};
  for (std::int64_t i = 0; i < N * (S / 2 - 1) * (S / 2 - 1) * C; ++i) t.f32.push_back(0.5f * std::cos(0.37f * static_cast<float>(i)));
  b["target"] = t;
  return b;
}

// The convolutional net with batch normalisation between its convolutions (gamma and beta split
// like the channels over tp): synchronised statistics, or each rank's own.
template <batchnorm_config Norm>
constexpr auto normed_cnn = program(
    mse(conv2d(relu(batchnorm<Norm>(conv2d<{.stride = 2, .padding = 1}>(
                                        input<"x">(image), param<"k1">(spec(replicate, replicate, replicate, shard(tp)))),
                                    param<"g">(spec(shard(tp)), init::ones), param<"b">(spec(shard(tp))))),
               param<"k2">(spec(replicate, replicate, shard(tp), replicate))),
        input<"target">(image)),
    sgd{}, on(dp, tp));
const shape_map normed_shapes = [] {
  auto s = cnn_shapes;
  s.emplace("g", std::vector<std::int64_t>{F});
  s.emplace("b", std::vector<std::int64_t>{F});
  return s;
}();
const std::vector<std::string> normed_params{"k1", "g", "b", "k2"};

tt::run_result run(MPI_Comm comm, int d, int t, planner::policy policy, int steps = 3,
                   std::function<ir::graph(const ir::graph&)> rewrite = {}) {
  return tt::run(mlp, shapes, comm, {{"dp", d}, {"tp", t}}, data(), steps, {.sgd = {.lr = 0.2f}},
                 {.policy = policy, .solver = {.time_budget_s = 2, .progress = false}, .rewrite = std::move(rewrite)},
                 params);
}



// Runs f(comm, dp, tp) on every mesh of 2 and 4 ranks (as many as the job has): dp × tp for
// tp = 1, 2, ... ranks.
template <class F>
void on_every_mesh(F&& f) {
  const int world = runtime::mpi::environment::world_size();
  for (int ranks = 2; ranks <= world; ranks *= 2)
    for (int t = 1; t <= ranks; t *= 2) {
      tt::sub_world sub(ranks);
      if (!sub.member()) continue;
      CAPTURE(ranks, t);
      f(sub.get(), ranks / t, t);
    }
}

// One rank's step of `p` (at learning rate 0) run once on `b`, returned after its gradients were
// checked against central differences of its loss; a piecewise-linear model (relu) passes over
// the entries whose probe crosses a kink.
template <class P>
auto checked_gradients(const P& p, const shape_map& shapes, const train::batch& b, const std::vector<std::string>& params,
                       bool piecewise) {
  auto step = train::compile(p, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.sgd = {.lr = 0.0f}},
                             {.policy = planner::policy::sync, .use_cache = false, .world = MPI_COMM_SELF});
  const double loss = step(b).loss;
  if (piecewise) tt::check_gradients_by_differences(step, b, params, {.eps = 1e-3f, .kinks_around = loss});
  else tt::check_gradients_by_differences(step, b, params, {});
  return step;
}


// What a net trains to over 3 SGD steps: on one rank (the loss must fall), then on every mesh
// with the sync plan and, with `concerto`, on the whole world with the concerto plan, each the
// single rank's numbers.
template <class P>
tt::run_result same_on_every_mesh(const P& p, const shape_map& shapes, const train::batch& b, float lr,
                                  const std::vector<std::string>& params, bool concerto, std::map<std::string, int> depth = {}) {
  const auto trained = [&](MPI_Comm comm, int d, int t, planner::policy policy) {
    return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, b, 3, {.sgd = {.lr = lr}},
                   {.policy = policy, .lower = {.depth = depth}, .solver = {.time_budget_s = 2, .progress = false}}, params);
  };
  auto reference = trained(MPI_COMM_SELF, 1, 1, planner::policy::sync);
  REQUIRE(reference.loss.back() < reference.loss.front());
  on_every_mesh([&](MPI_Comm comm, int d, int t) { tt::check_same(trained(comm, d, t, planner::policy::sync), reference); });
  if (concerto) {
    const int world = runtime::mpi::environment::world_size(), t = world >= 4 ? 2 : 1;
    tt::check_same(trained(MPI_COMM_WORLD, world / t, t, planner::policy::concerto), reference);
  }
  return reference;
}
} // namespace

TEST_CASE("the DSL MLP trains to the single-rank numbers on every mesh that divides", "[mpi][train][mlp]") {
  const auto reference = run(MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  REQUIRE(reference.loss.back() < reference.loss.front()); // it learns, so equal numbers mean something
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    for (auto [d, t] : std::vector<std::pair<int, int>>{{ranks, 1}, {1, ranks}, {2, 2}}) {
      if (d * t != ranks) continue;
      if (!sub.member()) continue;
      CAPTURE(ranks, d, t);
      tt::check_same(run(sub.get(), d, t, planner::policy::sync), reference);
    }
  }
}

TEST_CASE("the sync, program_order and concerto plans of the DP x TP MLP give the same numbers", "[mpi][train][mlp]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = world >= 4 ? 2 : 1, d = world / t;
  const auto reference = run(MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  for (const auto policy : {planner::policy::sync, planner::policy::program_order, planner::policy::concerto}) {
    CAPTURE(policy);
    const auto r = run(MPI_COMM_WORLD, d, t, policy);
    CHECK(r.summary.policy == planner::to_string(policy));
    CHECK(r.summary.predicted_us > 0);
    tt::check_same(r, reference);
  }
}

TEST_CASE("a stack without its input's gradient trains to the numbers of the stack with it", "[mpi][train][mlp][no_grad]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = world >= 4 ? 2 : world, d = world / t;
  const std::vector<std::string> stack_params{"layers.0.w1", "layers.0.w2", "layers.1.w1", "layers.1.w2"};
  const auto go = [&](const auto& p) {
    return tt::run(p, stack_shapes, MPI_COMM_WORLD, {{"dp", d}, {"tp", t}}, data(), 3, {.sgd = {.lr = 0.2f}},
                   {.policy = planner::policy::program_order, .lower = {.depth = {{"layers", 2}}}, .solver = {.time_budget_s = 2, .progress = false}},
                   stack_params);
  };
  const auto with = go(stack);
  const auto without = go(frozen_stack);
  REQUIRE(with.loss.back() < with.loss.front());
  CHECK(without.summary.tasks < with.summary.tasks);
  tt::check_same(without, with);
}

TEST_CASE("a decomposed plan gives the numbers of the undecomposed one", "[mpi][train][mlp][decompose]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = world >= 4 ? 2 : world, d = world / t;
  const auto plain = run(MPI_COMM_WORLD, d, t, planner::policy::program_order);
  const auto split = run(MPI_COMM_WORLD, d, t, planner::policy::program_order, 3, tt::split_everything);
  REQUIRE(split.summary.rewritten);
  CHECK(split.summary.tasks > plain.summary.tasks);
  tt::check_same(split, plain);
}

TEST_CASE("the tanh MLP trains to the single-rank numbers, its gradients the finite differences", "[mpi][train][mlp][tanh]") {
  const auto trained = [](MPI_Comm comm, int d, int t) {
    return tt::run(tanh_mlp, shapes, comm, {{"dp", d}, {"tp", t}}, data(), 3, {.sgd = {.lr = 0.2f}},
                   {.policy = planner::policy::sync, .solver = {.progress = false}}, params);
  };
  const auto reference = trained(MPI_COMM_SELF, 1, 1);
  CHECK(reference.loss.back() < reference.loss.front());
  on_every_mesh([&](MPI_Comm comm, int d, int t) { tt::check_same(trained(comm, d, t), reference); });
  checked_gradients(tanh_mlp, shapes, data(), params, false);
}

TEST_CASE("dropout draws the single rank's masks on every mesh; evaluation passes its input through", "[mpi][train][dropout]") {
  same_on_every_mesh(dropped_mlp, shapes, data(), 0.2f, params, true);
  same_on_every_mesh(dropped_stack, shapes, data(), 0.2f, {"layers.0.w1", "layers.0.w2", "layers.1.w1", "layers.1.w2"}, true,
                     {{"layers", 2}});
  // Pipelined over 2 stages: each micro-batch draws a mask of its own, and the step trains.
  if (runtime::mpi::environment::world_size() >= 2) {
    tt::sub_world sub(2);
    if (sub.member()) {
      train::step_options o{.policy = planner::policy::sync, .lower = {.depth = {{"layers", 2}}}};
      o.pipeline = {.microbatches = 2, .schedule = "1f1b"};
      auto two = data(); // a step of two micro-batches of the shapes' rows
      for (auto& [name, t] : two) {
        t.shape[0] *= 2;
        const auto rows = t.f32;
        t.f32.insert(t.f32.end(), rows.begin(), rows.end());
      }
      const auto piped = tt::run(dropped_stack, shapes, sub.get(), {{"pp", 2}, {"dp", 1}, {"tp", 1}}, two, 3,
                                 {.sgd = {.lr = 0.2f}}, o, {"layers.0.w1", "layers.1.w2"});
      CHECK(piped.loss.back() < piped.loss.front());
    }
  }
  // The same parameters without dropout: evaluation gives the same loss, a training step another.
  const auto one_rank = [](const auto& p) {
    return train::compile(p, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.sgd = {.lr = 0.0f}},
                          {.policy = planner::policy::sync, .use_cache = false, .world = MPI_COMM_SELF});
  };
  auto with = one_rank(dropped_mlp);
  auto without = one_rank(mlp);
  CHECK(with.evaluate(data()) == without.evaluate(data()));
  CHECK(with(data()).loss != without(data()).loss);
}

TEST_CASE("a convolutional net trains to the single-rank numbers on every mesh, its gradients the finite differences",
          "[mpi][train][conv2d]") {
  same_on_every_mesh(cnn, cnn_shapes, images(), 0.1f, cnn_params, true);
  auto step = checked_gradients(cnn, cnn_shapes, images(), cnn_params, true);
  // The kernels start scaled by their window's fan-in (3·3·3 and 1·1·8 values), not by `in` alone.
  const auto k1 = step.parameter("k1");
  double top = 0;
  for (float v : k1) top = std::max(top, static_cast<double>(std::abs(v)));
  CHECK(top <= std::sqrt(3.0 / 27.0));
  CHECK(top > 0.5 * std::sqrt(3.0 / 27.0));
}

TEST_CASE("an image classifier (position table, global average pooling) trains alike on every mesh", "[mpi][train][conv2d][pool]") {
  same_on_every_mesh(classifier, classifier_shapes, labelled_images(), 0.5f, classifier_params, false);
  checked_gradients(classifier, classifier_shapes, labelled_images(), classifier_params, true);
}

TEST_CASE("max and average pooling train to the single-rank numbers on every mesh, their gradients the finite differences",
          "[mpi][train][conv2d][pool]") {
  same_on_every_mesh(pooled_cnn, pooled_shapes, pooled_images(), 0.2f, cnn_params, true);
  checked_gradients(pooled_cnn, pooled_shapes, pooled_images(), cnn_params, true);
}

TEST_CASE("a class token joined to the pixels, scaled per channel and sliced back trains alike on every mesh",
          "[mpi][train][conv2d][parts]") {
  same_on_every_mesh(token_classifier, token_shapes, labelled_images(), 0.5f, token_params, false);
  checked_gradients(token_classifier, token_shapes, labelled_images(), token_params, true);
}

TEST_CASE("patches cut by unflatten, transpose and flatten give the strided convolution's numbers on every mesh",
          "[mpi][train][conv2d][reshape]") {
  const auto patched = same_on_every_mesh(patch_classifier, patch_shapes, labelled_images(), 0.5f, patch_params, true);
  checked_gradients(patch_classifier, patch_shapes, labelled_images(), patch_params, true);
  auto strided_shapes = patch_shapes;
  strided_shapes["k"] = {P, P, C, F};
  const auto strided = tt::run(strided_classifier, strided_shapes, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}}, labelled_images(), 3,
                               {.sgd = {.lr = 0.5f}}, {.policy = planner::policy::sync}, patch_params);
  tt::check_same(strided, patched);
}

TEST_CASE("batch normalisation: synchronised statistics give the single-rank numbers on every mesh, local ones each rank's",
          "[mpi][train][conv2d][batchnorm]") {
  const auto trained = [](const auto& program, MPI_Comm comm, int d, int t) {
    return tt::run(program, normed_shapes, comm, {{"dp", d}, {"tp", t}}, images(), 3, {.sgd = {.lr = 0.1f}},
                   {.policy = planner::policy::sync, .solver = {.progress = false}}, normed_params);
  };
  constexpr auto& synced = normed_cnn<batchnorm_config{}>;
  constexpr auto& local = normed_cnn<batchnorm_config{.sync = false}>;
  const auto reference = trained(synced, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  on_every_mesh([&](MPI_Comm comm, int d, int t) {
    tt::check_same(trained(synced, comm, d, t), reference);
    // Local statistics are the batch's when each rank holds the whole batch (tp alone), and
    // each rank's own rows' under data parallelism: another model, other numbers.
    const auto own = trained(local, comm, d, t);
    if (d == 1) tt::check_same(own, reference);
    else CHECK(std::abs(own.loss.front() - reference.loss.front()) > 1e-3 * std::abs(reference.loss.front()));
  });
  checked_gradients(synced, normed_shapes, images(), normed_params, true);
}

TEST_CASE("batch normalisation's running statistics: every mesh keeps the single rank's, and evaluation normalises each "
          "image by them alone",
          "[mpi][train][conv2d][batchnorm]") {
  constexpr auto& synced = normed_cnn<batchnorm_config{}>;
  const auto compiled = [](MPI_Comm comm, int d, int t) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    return train::compile(synced, mesh::from_world(n, {{"dp", d}, {"tp", t}}), normed_shapes, {.sgd = {.lr = 0.1f}},
                          {.policy = planner::policy::sync, .use_cache = false, .world = comm});
  };
  auto one = compiled(MPI_COMM_SELF, 1, 1);
  // Before a step: mean 0, variance 1 (a framework's BatchNorm's start).
  const auto start = one.parameter("g.running");
  REQUIRE(start.size() == 2 * F);
  CHECK(std::count(start.begin(), start.begin() + F, 0.0f) == F);
  CHECK(std::count(start.begin() + F, start.end(), 1.0f) == F);
  for (int s = 0; s < 3; ++s) (void)one(images());
  const auto running = one.parameter("g.running");
  CHECK(running != start);
  on_every_mesh([&](MPI_Comm comm, int d, int t) {
    auto step = compiled(comm, d, t);
    for (int s = 0; s < 3; ++s) (void)step(images());
    CHECK(tt::worst_relative(step.parameter("g.running"), running) <= tt::rel_tol);
  });
  // Evaluation normalises by the running statistics: an image's prediction does not depend on
  // the other images of the batch (with the batch's statistics it would).
  auto mixed = images();
  for (std::size_t i = mixed.at("x").f32.size() / N; i < mixed.at("x").f32.size(); ++i) mixed.at("x").f32[i] *= -2.0f;
  const auto first_image = [&](const train::batch& b) {
    (void)one.evaluate(b);
    const auto out = one.evaluated(one.prediction_name());
    return std::vector<float>(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(out.size() / N));
  };
  CHECK(first_image(images()) == first_image(mixed));
  // ... and leaves them as they are; the next training step moves them again.
  CHECK(one.parameter("g.running") == running);
  // A safetensors export carries them with the parameters (a model evaluates as it was trained):
  // a fresh step that imports the file evaluates to the same loss.
  const auto file = std::filesystem::temp_directory_path() / ("concerto_running_" + std::to_string(::getpid()) + ".safetensors");
  one.export_safetensors(file);
  const auto contents = train::safetensors::read(file);
  REQUIRE(contents.tensors.contains("g.running"));
  CHECK(contents.values("g.running") == running);
  auto fresh = compiled(MPI_COMM_SELF, 1, 1);
  CHECK(fresh.evaluate(images()) != one.evaluate(images()));
  fresh.import_safetensors(file);
  CHECK(fresh.parameter("g.running") == running);
  CHECK(fresh.evaluate(images()) == one.evaluate(images()));
  // Running statistics of another shape, or a tensor that is neither, are refused by name.
  const auto write = [&](const std::string& name, std::vector<std::int64_t> shape) {
    train::safetensors::writer w;
    for (const auto& [tensor, t] : contents.tensors) w.add(tensor, t.shape, contents.values(tensor));
    w.add(name, shape, std::vector<float>(static_cast<std::size_t>(shape[0] * shape[1]), 1.0f));
    write_file_atomically(file, std::move(w).finish());
  };
  write("g.running.extra", {2, F});
  CHECK_THROWS_WITH(fresh.import_safetensors(file),
                    Catch::Matchers::ContainsSubstring("'g.running.extra', which is no parameter of the program nor one of its "
                                                       "batch norms' running statistics"));
  std::filesystem::remove(file);
  (void)one(images());
  CHECK(one.parameter("g.running") != running);
}

CONCERTO_MPI_TEST_MAIN
