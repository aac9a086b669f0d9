// Automatic sharding trains exactly: a small language model (embedding, two residual blocks with
// a layer norm and an MLP, head, cross-entropy) written with auto_ in every spec, sharded by
// autoshard::choose for dp x tp meshes of 2 and 4 ranks, gives the single-rank losses, gradients
// and parameters within train_testing::rel_tol after 3 AdamW steps: the chosen sharding and every
// other one the search planned or started from (pure data parallelism, tensor parallelism over
// each axis, ZeRO-3, what its descent found); each rank chooses alone, and all must agree. train::compile
// given the auto_ program chooses by itself (rank 0 chooses, every rank compiles the choice),
// trains to the same numbers, finds its choice in the cache folder the second time, and chooses
// again over a cache file that is no choice of this program's. The ViT example written with
// auto_ (vit_auto: its patch embedding, class token and position table decided too) trains
// through every layout the search planned or started from to the single-rank numbers.
#include "../../examples/vit/model.hpp"
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

} // namespace

TEST_CASE("every sharding automatic sharding plans trains to the single-rank numbers", "[mpi][train][autoshard]") {
  const auto reference = run(lm, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  // Each mesh on the first d·t ranks (the others skip it): dp alone, tp alone, both.
  for (const auto& [d, t] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {4, 1}, {1, 4}, {2, 2}}) {
    const int ranks = d * t;
    if (ranks > runtime::mpi::environment::world_size()) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    const auto m = mesh::from_world(ranks, {{"dp", d}, {"tp", t}});
    autoshard::options o{.lower = {.depth = {{"layers", 2}}}, .keep = 4};
    const auto chosen = autoshard::choose(lm, m, shapes, cost::model::preset("h100x64"), o);
    std::set<std::string> layouts;
    auto tried = chosen.planned;
    tried.insert(tried.end(), chosen.seeds.begin(), chosen.seeds.end());
    for (const auto& c : tried) {
      if (!c.valid || !layouts.insert(autoshard::detail::key_of(c.choice)).second) continue;
      const auto compiled = graph::respecify(lm, c.choice);
      REQUIRE(compiled.program);
      CAPTURE(ranks, d, t, c.origin, autoshard::detail::key_of(c.choice));
      tt::check_same(run(*compiled.program, sub.get(), d, t), reference);
    }
    CHECK(layouts.size() >= 3); // data and tensor parallelism at least, so the check means something
    CAPTURE(ranks, d, t, chosen.explain());
    tt::check_same(run(*chosen.program, sub.get(), d, t), reference);
  }
}

// The ViT example with every spec, each branch's .to and the ZeRO stage decided (vit_auto): images
// of 8 × 8 pixels (4 patches and the class token), width 8, 2 heads, 4 classes.
TEST_CASE("the ViT written with auto_ trains through what automatic sharding chooses to the single-rank numbers",
          "[mpi][train][autoshard]") {
  constexpr std::int64_t images = 4, side = 8, classes = 4;
  const auto vit_shapes = vit_model::shapes(images, side, 8, classes);
  train::tensor x{{images, side, side, 3}}, labels{{images}};
  for (std::int64_t i = 0; i < images * side * side * 3; ++i) x.f32.push_back(std::sin(0.37f * static_cast<float>(i)));
  for (std::int64_t i = 0; i < images; ++i) labels.i64.push_back((3 * i + 1) % classes);
  const train::batch batch{{"x", x}, {"labels", labels}};
  train::step_options vit_options{.policy = planner::policy::program_order, .lower = {.heads = 2, .depth = {{"layers", 2}}}};
  const std::vector<std::string> vit_params{"patch", "cls", "pos", "layers.0.wq", "layers.1.fc2", "layers.0.ln1.g", "head"};
  const auto vit_run = [&](const auto& p, MPI_Comm comm, int d, int t) {
    return tt::run(p, vit_shapes, comm, {{"dp", d}, {"tp", t}}, batch, 3, adam, vit_options, vit_params);
  };
  const auto reference = vit_run(vit_model::vit_auto, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  // Each mesh of the whole world (2 ranks: dp alone and tp alone; 4: both).
  for (const auto& [d, t] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 2}}) {
    const int ranks = d * t;
    if (ranks != runtime::mpi::environment::world_size()) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    const auto m = mesh::from_world(ranks, {{"dp", d}, {"tp", t}});
    const auto chosen = autoshard::choose(vit_model::vit_auto, m, vit_shapes, cost::model::preset("h100x64"),
                                          {.lower = {.heads = 2, .depth = {{"layers", 2}}}});
    // The choice and every layout the search planned or started from (data parallelism, tensor
    // parallelism with and without SP, ZeRO-3): the ViT's own leaves (the patch embedding's
    // channels, the class token, the position table) split as each decides.
    std::set<std::string> layouts;
    auto tried = chosen.planned;
    tried.insert(tried.end(), chosen.seeds.begin(), chosen.seeds.end());
    for (const auto& c : tried) {
      if (!c.valid || !layouts.insert(autoshard::detail::key_of(c.choice)).second) continue;
      const auto compiled = graph::respecify(vit_model::vit_auto, c.choice);
      REQUIRE(compiled.program);
      CAPTURE(ranks, d, t, c.origin, autoshard::detail::key_of(c.choice));
      tt::check_same(vit_run(*compiled.program, sub.get(), d, t), reference);
    }
    CHECK(layouts.size() >= 3);
    CAPTURE(ranks, d, t, chosen.explain());
    tt::check_same(vit_run(*chosen.program, sub.get(), d, t), reference);
  }
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
