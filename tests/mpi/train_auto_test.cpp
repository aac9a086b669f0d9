// Automatic sharding trains exactly: a small language model (embedding, two residual blocks with
// a layer norm and an MLP, head, cross-entropy) written with auto_ in every spec, sharded by
// autoshard::choose for dp x tp meshes of 2 and 4 ranks, gives the single-rank losses, gradients
// and parameters within train_testing::rel_tol after 3 AdamW steps: the chosen sharding and every
// other one the search planned or started from (pure data parallelism, tensor parallelism over
// each axis, ZeRO-3, what its descent found); each rank chooses alone, and all must agree. train::compile
// given the auto_ program chooses by itself (rank 0 chooses, every rank compiles the choice),
// trains to the same numbers, finds its choice in the cache folder the second time, and chooses
// again over a cache file that is no choice of this program's. The ViT example written with
// auto_ (vit_auto: its patch embedding, class token and position table decided too) and the
// wresnet-dp workload's Wide-ResNet (wide_resnet_auto, small) train through every layout the
// search planned or started from to the single-rank numbers.
#include "../../examples/vit/model.hpp"
#include "../../examples/wresnet/model.hpp"
#include "auto_lm_program.hpp"
#include "token_batch.hpp"
#include "train_testing.hpp"

#include <concerto/autoshard/search.hpp>
#include <concerto/concerto.hpp>

#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>

using namespace concerto;
namespace tt = train_testing;

namespace {

using auto_lm::lm;
constexpr std::int64_t B = 8, S = 4, V = 16, H = 8;
const shape_map shapes = auto_lm::shapes(B, S, V, H);
const std::vector<std::string> params{"wte", "layers.0.ln.b", "layers.0.fc1", "layers.1.fc2", "head"};

train::batch data() { return token_data::token_batch(3, B, S, V); }

const train::optimizer_settings adam{.adamw = {.lr = 2e-2f}};
train::step_options options() { return {.policy = planner::policy::program_order, .lower = {.depth = {{"layers", 2}}}}; }

template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, int d, int t) {
  return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, data(), 3, adam, options(), params);
}

// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
std::filesystem::path shared_temp_dir() {
  long pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return std::filesystem::temp_directory_path() / ("concerto-auto-test-" + std::to_string(pid));
}

// Every loss, gradient and parameter of `got` within `tol` of `want` (relative, as check_same).
void check_within(const tt::run_result& got, const tt::run_result& want, double tol) {
  REQUIRE(got.loss.size() == want.loss.size());
  for (std::size_t s = 0; s < got.loss.size(); ++s) {
    CAPTURE(s, got.loss[s], want.loss[s]);
    CHECK(std::abs(got.loss[s] - want.loss[s]) <= tol * std::abs(want.loss[s]));
  }
  for (const auto& [name, g] : want.grads) {
    CAPTURE(name);
    CHECK(tt::worst_relative(got.grads.at(name), g) <= tol);
    CHECK(tt::worst_relative(got.params.at(name), want.params.at(name)) <= tol);
  }
}

// dp × tp meshes (dp, tp sizes).
using meshes = std::vector<std::pair<int, int>>;

// The meshes of the whole world: dp alone and tp alone on 2 ranks, both on 4.
meshes whole_world_meshes() {
  meshes out;
  for (const auto& [d, t] : meshes{{2, 1}, {1, 2}, {2, 2}})
    if (d * t == runtime::mpi::environment::world_size()) out.push_back({d, t});
  return out;
}

// Trains `p` on each mesh (on its first d·t ranks; the others skip it) through what automatic
// sharding chooses with options `o`, and through every layout the search planned or started from
// (data parallelism, tensor parallelism with and without SP, ZeRO-3, ...), checking each against
// `reference` (within `tol`: check_same's tolerance unless given); at least `min_layouts`
// distinct layouts per mesh, so that the check means something.
template <std::size_t N, class Run>
void trains_through_every_layout(const graph::program<N>& p, const shape_map& shapes, const meshes& on, const autoshard::options& o,
                                 const Run& train, const tt::run_result& reference, std::size_t min_layouts,
                                 double tol = tt::rel_tol) {
  const auto check = [&](const tt::run_result& got) {
    if (tol == tt::rel_tol) tt::check_same(got, reference);
    else check_within(got, reference, tol);
  };
  for (const auto& [d, t] : on) {
    const int ranks = d * t;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    const auto m = mesh::from_world(ranks, {{"dp", d}, {"tp", t}});
    const auto chosen = autoshard::choose(p, m, shapes, cost::model::preset("h100x64"), o);
    std::set<std::string> layouts;
    auto tried = chosen.planned;
    tried.insert(tried.end(), chosen.seeds.begin(), chosen.seeds.end());
    for (const auto& c : tried) {
      if (!c.valid || !layouts.insert(autoshard::detail::key_of(c.choice)).second) continue;
      const auto compiled = graph::respecify(p, c.choice);
      REQUIRE(compiled.program);
      CAPTURE(ranks, d, t, c.origin, autoshard::detail::key_of(c.choice));
      check(train(*compiled.program, sub.get(), d, t));
    }
    CHECK(layouts.size() >= min_layouts);
    CAPTURE(ranks, d, t, chosen.explain());
    check(train(*chosen.program, sub.get(), d, t));
  }
}

// `images` images of side × side × 3 drawn from a sine, their labels cycling through `classes`.
train::batch image_batch(std::int64_t images, std::int64_t side, std::int64_t classes) {
  train::tensor x{{images, side, side, 3}}, labels{{images}};
  for (std::int64_t i = 0; i < images * side * side * 3; ++i) x.f32.push_back(std::sin(0.37f * static_cast<float>(i)));
  for (std::int64_t i = 0; i < images; ++i) labels.i64.push_back((3 * i + 1) % classes);
  return {{"x", x}, {"labels", labels}};
}

} // namespace

TEST_CASE("every sharding automatic sharding plans trains to the single-rank numbers", "[mpi][train][autoshard]") {
  const auto reference = run(lm, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  // Each mesh of at most the world's ranks: dp alone, tp alone, both.
  meshes on;
  for (const auto& [d, t] : meshes{{2, 1}, {1, 2}, {4, 1}, {1, 4}, {2, 2}})
    if (d * t <= runtime::mpi::environment::world_size()) on.push_back({d, t});
  const auto train = [](const auto& p, MPI_Comm comm, int d, int t) { return run(p, comm, d, t); };
  trains_through_every_layout(lm, shapes, on, {.lower = {.depth = {{"layers", 2}}}, .keep = 4}, train, reference, 3);
}


// The ViT example with every spec, each branch's .to and the ZeRO stage decided (vit_auto): images
// of 8 × 8 pixels (4 patches and the class token), width 8, 2 heads, 4 classes. Its own leaves
// (the patch embedding's channels, the class token, the position table) split as each layout decides.
TEST_CASE("the ViT written with auto_ trains through what automatic sharding chooses to the single-rank numbers",
          "[mpi][train][autoshard]") {
  constexpr std::int64_t images = 4, side = 8, classes = 4;
  const auto vit_shapes = vit_model::shapes(images, side, 8, classes);
  const auto batch = image_batch(images, side, classes);
  const lower_options lower{.heads = 2, .depth = {{"layers", 2}}};
  const std::vector<std::string> vit_params{"patch", "cls", "pos", "layers.0.wq", "layers.1.fc2", "layers.0.ln1.g", "head"};
  const auto vit_run = [&](const auto& p, MPI_Comm comm, int d, int t) {
    return tt::run(p, vit_shapes, comm, {{"dp", d}, {"tp", t}}, batch, 3, adam,
                   {.policy = planner::policy::program_order, .lower = lower}, vit_params);
  };
  const auto reference = vit_run(vit_model::vit_auto, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  trains_through_every_layout(vit_model::vit_auto, vit_shapes, whole_world_meshes(), {.lower = lower}, vit_run, reference, 3);
}

// The planner's wresnet-dp model written with every spec and the ZeRO stage decided
// (wide_resnet_auto: a 7×7 stride-2 stem, four stages of bottlenecks with batch-normalised
// projections, two blocks each), at a small size: 64 × 64 images, 4 to 16 channels, 4 classes.
// Its kernels split on their channels, its batch norms' statistics over the split batch, and
// under ZeRO its kernels on their last dim (a 1×1 kernel's height would not divide). Within
// 1e-3, not 1e-5: 29 batch-normalised convolutions over 4 images are that sensitive to the
// summation order. Before any update the two-rank data-parallel gradients already differ from one
// rank's by up to 1.9e-5 (the first loss by 1.4e-6), and AdamW moves a gradient near zero by its
// full rate whatever its size, so 3 steps at 5e-4 part them by up to 3.6e-4 (at 2e-2, with the
// last stage on 1 × 1 pixels, by 10%).
TEST_CASE("the Wide-ResNet written with auto_ trains through what automatic sharding chooses to the single-rank numbers",
          "[mpi][train][autoshard]") {
  // On 2 ranks (dp alone, tp alone): on 4 ranks of CI's 2 cores its choice, reference and
  // layouts take over 30 s; the 4-rank meshes are the language model's and the ViT's.
  if (runtime::mpi::environment::world_size() != 2) SKIP("the Wide-ResNet trains on 2 ranks");
  constexpr std::int64_t images = 4, classes = 4;
  const ir::conv_net_spec small{.image = 64, .stem = 4, .classes = classes, .blocks = {2, 2, 2, 2}, .reduce = {4, 4, 8, 8},
                                .mid = {4, 8, 8, 16}, .out = {8, 8, 16, 16}};
  const auto shapes = wresnet_model::wide_resnet_shapes(images, small);
  const auto batch = image_batch(images, small.image, classes);
  const lower_options lower{.depth = wresnet_model::wide_resnet_depths(small)};
  const std::vector<std::string> names{"stem", "stem.n.g", "s1.wa", "s1.ns.b", "stage1.0.r1.wb", "stage4.0.r4.nc.g", "s4.ws", "head"};
  const auto train = [&](const auto& p, MPI_Comm comm, int d, int t) {
    return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, batch, 3, {.adamw = {.lr = 5e-4f}},
                   {.policy = planner::policy::program_order, .lower = lower}, names);
  };
  const auto reference = train(wresnet_model::wide_resnet_auto, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  trains_through_every_layout(wresnet_model::wide_resnet_auto, shapes, whole_world_meshes(), {.lower = lower}, train, reference, 2,
                              1e-3);
}

TEST_CASE("train::compile chooses the sharding of a program written with auto_, once", "[mpi][train][autoshard]") {
  const auto reference = run(lm, MPI_COMM_SELF, 1, 1);
  const auto dir = shared_temp_dir();
  for (const auto& [d, t] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}}) {
    const int ranks = d * t;
    if (ranks > runtime::mpi::environment::world_size()) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    auto o = options();
    o.world = sub.get();
    o.cache_dir = dir / std::to_string(ranks);
    o.sharding.explain = true;
    const auto m = mesh::from_world(ranks, {{"dp", d}, {"tp", t}});
    auto first = train::compile(lm, m, shapes, adam, o);
    REQUIRE(first.sharding());
    CHECK_FALSE(first.sharding()->cached);
    CHECK_THAT(first.sharding()->account, Catch::Matchers::ContainsSubstring("planned candidates"));
    tt::run_result got;
    for (int s = 0; s < 3; ++s) got.loss.push_back(first(data()).loss);
    for (const auto& name : params) {
      got.grads[name] = first.gradient(name);
      got.params[name] = first.parameter(name);
    }
    CAPTURE(ranks, first.sharding()->account);
    tt::check_same(got, reference);
    auto second = train::compile(lm, m, shapes, adam, o);
    REQUIRE(second.sharding());
    CHECK(second.sharding()->cached);
    CHECK(autoshard::detail::key_of(second.sharding()->choice) == autoshard::detail::key_of(first.sharding()->choice));
    // A cache file that is no choice of this program's (valid JSON naming a leaf it lacks) is
    // chosen again and rewritten, not an error.
    int files = 0;
    if (runtime::mpi::environment::world_rank() == 0)
      for (const auto& f : std::filesystem::directory_iterator(o.cache_dir))
        if (f.path().filename().string().starts_with("sharding-")) {
          ++files;
          std::ofstream(f.path()) << R"({"choice": {"leaves": {"nope": [[]]}, "zero_stage": 0, "zero_axis": ""}, "account": "x"})";
        }
    MPI_Barrier(sub.get());
    if (runtime::mpi::environment::world_rank() == 0) CHECK(files == 1);
    auto third = train::compile(lm, m, shapes, adam, o);
    REQUIRE(third.sharding());
    CHECK_FALSE(third.sharding()->cached);
    CHECK(autoshard::detail::key_of(third.sharding()->choice) == autoshard::detail::key_of(first.sharding()->choice));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("a program written by hand has no automatic sharding", "[mpi][train][autoshard]") {
  // Every rank alone (MPI_COMM_SELF).
  const auto hand = graph::respecify(lm, {}).program; // nothing chosen: every auto_ still open
  REQUIRE(hand->has_free_dims());
  auto o = options();
  o.world = MPI_COMM_SELF;
  o.use_cache = false;
  const auto m = mesh::from_world(1, {{"dp", 1}, {"tp", 1}});
  CHECK(train::compile(lm, m, shapes, adam, o).sharding());
  graph::sharding_choice all;
  for (const auto& name : {"ids", "labels"}) all.leaves.push_back({name, to_value(spec(replicate, replicate))});
  for (const auto& name : {"wte", "fc1", "fc2", "head"}) all.leaves.push_back({name, to_value(spec(replicate, replicate))});
  for (const auto& name : {"ln.g", "ln.b"}) all.leaves.push_back({name, to_value(spec(replicate))});
  const auto decided = graph::respecify(lm, all).program;
  REQUIRE_FALSE(decided->has_free_dims());
  CHECK_FALSE(train::compile(*decided, m, shapes, adam, o).sharding());
}

CONCERTO_MPI_TEST_MAIN
