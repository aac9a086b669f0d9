#include <concerto/cache/plan_cache.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under the system's temp directory, removed at the end of the test.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device entropy;
    path = fs::temp_directory_path() / ("concerto-cache-test-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(entropy()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// fc -> fc.dw -> w.grad.ar (dp lane), fc -> act; `dp` ranks on the data-parallel axis.
ir::graph small_graph(int dp = 4, ir::link_class link = ir::link_class::inter_node) {
  ir::builder b("mlp");
  b.cost_only(); // planned, not run
  const int axis = b.axis("dp", dp, link);
  const auto x = b.buffer("x", {4, 8}, ir::buffer_role::input);
  const auto w = b.buffer("w", {8, 8}, ir::buffer_role::param);
  const auto y = b.buffer("y", {4, 8});
  const auto g = b.buffer("w.grad", {8, 8}, ir::buffer_role::gradient);
  const auto z = b.buffer("z", {4, 8});
  b.matmul("fc", x, w, y, 4, 8, 8);
  b.matmul("fc.dw", x, y, g, 8, 8, 4, 1, true);
  b.collective(ir::op_kind::all_reduce, "w.grad.ar", axis, g, g);
  b.compute(ir::op_kind::elementwise, "act", {y}, {z}, {.fn = ir::op::gelu, .flops = 0});
  return std::move(b).finish();
}

/// A plan as the pipeline makes one; "sync" adds dependency edges, so the plan's graph is not
/// the input graph, as with every rewriting planner.
plan::plan make_plan(const ir::graph& g, const cost::model& m, planner::policy policy = planner::policy::sync) {
  const auto d = m.durations_us(g);
  auto s = planner::list_schedule(policy, g, d);
  return sim::to_plan(std::move(s.graph), std::move(s.order), d, m.overlap_slowdown(), std::string(planner::to_string(policy)),
                      m.hw().name);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_file(const fs::path& p, const std::string& content) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << content;
}

/// Sets an environment variable for one scope and restores it.
struct scoped_env {
  std::string name;
  std::optional<std::string> old;
  scoped_env(std::string n, const char* value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    if (value) ::setenv(name.c_str(), value, 1);
    else ::unsetenv(name.c_str());
  }
  ~scoped_env() {
    if (old) ::setenv(name.c_str(), old->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
};

/// What most cases start from: a fresh cache folder, the small graph's sync plan and its key.
struct stored_plan {
  temp_dir dir;
  const ir::graph g = small_graph();
  const cost::model m = cost::model::preset("a800x32");
  const cache::cache_key key = cache::make_key(g, m, "mpi", "sync");
  const plan::plan p = make_plan(g, m);
};

} // namespace

TEST_CASE("a stored plan loads back equal", "[cache]") {
  stored_plan fixture;
  auto& [dir, g, m, key, p] = fixture;
  REQUIRE(plan::hash(p.graph) != key.graph); // the scheduler added edges
  cache::plan_cache cache(dir.path);

  SECTION("a cache that never stored the key misses, without a file appearing") {
    std::string why;
    CHECK_FALSE(cache.load(key, &why));
    CHECK_THAT(why, ContainsSubstring("no plan for key " + key.hex()));
    CHECK_FALSE(fs::exists(cache.path_of(key)));
  }
  SECTION("store then load gives the same plan, from a file named by the key") {
    cache.store(key, p);
    CHECK(cache.path_of(key) == dir.path / (key.hex() + ".plan"));
    const auto text = read_file(cache.path_of(key));
    CHECK(text.starts_with("concerto-plan-cache 3 " + key.hex() + " "));
    const auto loaded = cache.load(key);
    REQUIRE(loaded);
    CHECK(*loaded == p);
    SECTION("and a second cache object on the same directory sees it too") {
      const auto again = cache::plan_cache(dir.path).load(key);
      REQUIRE(again);
      CHECK(*again == p);
    }
  }
  SECTION("storing again replaces the plan and leaves no temporary file") {
    cache.store(key, p);
    auto q = make_plan(g, m, planner::policy::program_order);
    cache.store(key, q);
    const auto loaded = cache.load(key);
    REQUIRE(loaded);
    CHECK(*loaded == q);
    int files = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++files;
    CHECK(files == 1);
  }
}

TEST_CASE("the key changes with everything the plan depends on", "[cache][key]") {
  const auto g = small_graph();
  const auto m = cost::model::preset("a800x32");
  const auto base = cache::make_key(g, m, "mpi", "concerto");

  SECTION("the same inputs give the same key, holding the library version") {
    CHECK(cache::make_key(small_graph(), cost::model::preset("a800x32"), "mpi", "concerto") == base);
    CHECK(cache::make_key(g, m, "mpi", "concerto").hex() == base.hex());
    CHECK(base.hex().size() == 16);
    CHECK(base.library_version == std::string(cache::library_version));
    CHECK_FALSE(base.library_version.empty());
    CHECK(base.graph == plan::hash(g));
    CHECK(base.cost_model == m.hw().hash());
  }
  SECTION("each input changes the key and its hex") {
    auto other_graph = small_graph();
    other_graph.tasks[0].flops *= 2;
    const auto k_graph = cache::make_key(other_graph, m, "mpi", "concerto");
    CHECK(k_graph.graph != base.graph);
    CHECK(k_graph.mesh == base.mesh);

    const auto k_mesh_size = cache::make_key(small_graph(8), m, "mpi", "concerto");
    const auto k_mesh_link = cache::make_key(small_graph(4, ir::link_class::intra_node), m, "mpi", "concerto");
    CHECK(k_mesh_size.mesh != base.mesh);
    CHECK(k_mesh_link.mesh != base.mesh);
    CHECK(k_mesh_size.mesh != k_mesh_link.mesh);

    auto hw = m.hw();
    hw.inter_node.bandwidth_gbps *= 1.5;
    const auto k_cost = cache::make_key(g, cost::model(hw), "mpi", "concerto");
    const auto k_preset = cache::make_key(g, cost::model::preset("h100x64"), "mpi", "concerto");
    CHECK(k_cost.cost_model != base.cost_model);
    CHECK(k_preset.cost_model != base.cost_model);

    const auto k_backend = cache::make_key(g, m, "nccl", "concerto");
    const auto k_policy = cache::make_key(g, m, "mpi", "xla_lhs");
    const auto k_options = cache::make_key(g, m, "mpi", "concerto", 42);
    auto k_version = base;
    k_version.library_version = "99.0.0";

    for (const auto* k : std::initializer_list<const cache::cache_key*>{&k_graph, &k_mesh_size, &k_mesh_link, &k_cost, &k_preset, &k_backend, &k_policy,
                          &k_options, &k_version}) {
      CHECK_FALSE(*k == base);
      CHECK(k->hex() != base.hex());
    }
  }
  SECTION("a string moved between fields changes the key") {
    auto a = base, b = base;
    a.backend = "ab";
    a.policy = "c";
    b.backend = "a";
    b.policy = "bc";
    CHECK(a.hex() != b.hex());
  }
}

TEST_CASE("a bad cache file is reported, set aside and replanned, never trusted", "[cache][failure]") {
  stored_plan fixture;
  auto& [dir, g, m, key, p] = fixture;
  cache::plan_cache cache(dir.path);
  cache.silence();
  cache.store(key, p);
  const auto path = cache.path_of(key);
  const auto good = read_file(path);
  const auto payload_at = good.find('\n') + 1;
  REQUIRE(payload_at > 1);

  // The reason for the rejection; afterwards the file must be gone and the next load a miss.
  const auto rejection = [&] {
    std::string why;
    const auto loaded = cache.load(key, &why);
    CHECK_FALSE(loaded);
    CHECK_THAT(why, ContainsSubstring(path.string()));
    CHECK_FALSE(fs::exists(path));
    CHECK(fs::exists(fs::path(path.string() + ".bad")));
    std::string then;
    CHECK_FALSE(cache.load(key, &then));
    CHECK_THAT(then, ContainsSubstring("no plan for key"));
    return why;
  };
  // A whole file around a payload document, with a correct checksum.
  const auto forge = [&](const cache::detail::document& d) { write_file(path, cache::detail::encode(key.hex(), d)); };

  SECTION("a truncated file") {
    write_file(path, good.substr(0, good.size() - 17));
    CHECK_THAT(rejection(), ContainsSubstring("truncated") && ContainsSubstring(std::to_string(good.size() - payload_at)));
  }
  SECTION("a file cut inside its header") {
    write_file(path, good.substr(0, 20));
    CHECK_THAT(rejection(), ContainsSubstring("header garbage"));
  }
  SECTION("an empty file") {
    write_file(path, "");
    CHECK_THAT(rejection(), ContainsSubstring("header garbage"));
  }
  SECTION("a file with bytes after the payload") {
    write_file(path, good + "x");
    CHECK_THAT(rejection(), ContainsSubstring("size mismatch"));
  }
  SECTION("one flipped byte in the payload") {
    auto bad = good;
    bad[payload_at + (bad.size() - payload_at) / 2] ^= 0x01;
    write_file(path, bad);
    CHECK_THAT(rejection(), ContainsSubstring("checksum mismatch"));
  }
  SECTION("a file of format version 1 (JSON payload), which this library no longer reads") {
    auto bad = good;
    bad.replace(0, std::string("concerto-plan-cache 3").size(), "concerto-plan-cache 1");
    write_file(path, bad);
    CHECK_THAT(rejection(), ContainsSubstring("unknown format version 1 (this library reads version 3)"));
  }
  SECTION("an unknown format version") {
    auto bad = good;
    bad.replace(0, std::string("concerto-plan-cache 1").size(), "concerto-plan-cache 7");
    write_file(path, bad);
    CHECK_THAT(rejection(), ContainsSubstring("unknown format version 7"));
  }
  SECTION("a header that is garbage") {
    write_file(path, "GIF89a garbage\n" + good.substr(payload_at));
    CHECK_THAT(rejection(), ContainsSubstring("header garbage: not a plan cache file"));
  }
  SECTION("a header with a field that is not a number") {
    auto bad = good;
    bad.replace(0, std::string("concerto-plan-cache 1").size(), "concerto-plan-cache one");
    write_file(path, bad);
    CHECK_THAT(rejection(), ContainsSubstring("header garbage: format version 'one'"));
  }
  SECTION("a file filed under another key") {
    const auto other = cache::make_key(g, m, "nccl", "sync");
    fs::rename(path, cache.path_of(other));
    std::string why;
    CHECK_FALSE(cache.load(other, &why));
    CHECK_THAT(why, ContainsSubstring("key mismatch: the file holds key " + key.hex() + ", expected " + other.hex()));
    CHECK_FALSE(fs::exists(cache.path_of(other)));
  }
  SECTION("a payload whose key fields differ from the header's key") {
    auto doc = cache::detail::envelope(key, p);
    doc.key.backend = "nccl";
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("key mismatch: key field 'backend' is 'nccl', expected 'mpi'"));
  }
  SECTION("a checksummed payload that is not a plan") {
    write_file(path, cache::detail::encode(key.hex(), std::string_view("{\"key\": ")));
    CHECK_THAT(rejection(), ContainsSubstring("not a readable plan") && ContainsSubstring("byte-order mark"));
  }
  SECTION("a checksummed payload cut short") {
    const auto payload = cache::detail::to_binary(cache::detail::envelope(key, p));
    write_file(path, cache::detail::encode(key.hex(), std::string_view(payload).substr(0, payload.size() - 9)));
    CHECK_THAT(rejection(), ContainsSubstring("not a readable plan") && ContainsSubstring("ends inside durations"));
  }
  SECTION("a checksummed payload with bytes after the plan") {
    write_file(path, cache::detail::encode(key.hex(), cache::detail::to_binary(cache::detail::envelope(key, p)) + "!"));
    CHECK_THAT(rejection(), ContainsSubstring("bytes follow the plan"));
  }
  SECTION("a checksummed payload with a count larger than the file") {
    auto payload = cache::detail::to_binary(cache::detail::envelope(key, p));
    // The mesh axis count follows the byte-order mark, the key, the hash, the plan's header and
    // the graph's name and cost-only flag.
    const auto axes_at = 4 + 3 * 8 + (4 + key.backend.size()) + (4 + key.library_version.size()) +
                         (4 + key.policy.size()) + 8 + 8 + (4 + p.policy.size()) + (4 + p.preset.size()) + 8 + 8 + 4 +
                         4 + (4 + p.graph.name.size()) + 1;
    std::uint32_t axes = 0;
    std::memcpy(&axes, payload.data() + axes_at, 4);
    REQUIRE(axes == p.graph.axes.size());
    axes = 0xfffffff0u;
    std::memcpy(payload.data() + axes_at, &axes, 4);
    write_file(path, cache::detail::encode(key.hex(), std::string_view(payload)));
    CHECK_THAT(rejection(), ContainsSubstring("mesh axis count 4294967280 exceeds the payload"));
  }
  SECTION("a checksummed payload with an enum out of range") {
    auto doc = cache::detail::envelope(key, p);
    doc.plan.graph.tasks[1].kind = static_cast<ir::op_kind>(99);
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("task kind 99 is out of range"));
  }
  SECTION("a checksummed plan whose graph is invalid") {
    auto doc = cache::detail::envelope(key, p);
    doc.plan.graph.tasks[0].deps = {42};
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("not a readable plan") && ContainsSubstring("task 42"));
  }
  SECTION("a checksummed plan whose stream order names a missing task") {
    auto doc = cache::detail::envelope(key, p);
    doc.plan.order[0].push_back(77);
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("stream 'compute': the order names task 77"));
  }
  SECTION("a checksummed plan that fails verification") {
    auto unsound = p;
    // The all-reduce now starts with the task that writes the gradient it reduces.
    const auto& ar = *std::find_if(unsound.graph.tasks.begin(), unsound.graph.tasks.end(),
                                   [](const ir::task& t) { return t.name == "w.grad.ar"; });
    REQUIRE_FALSE(ar.deps.empty());
    unsound.start_us[static_cast<std::size_t>(ar.id)] = unsound.start_us[static_cast<std::size_t>(ar.deps.front())];
    REQUIRE_FALSE(plan::check(unsound).empty());
    forge(cache::detail::envelope(key, unsound));
    CHECK_THAT(rejection(), ContainsSubstring("fails verification") && ContainsSubstring("w.grad.ar"));
  }
  SECTION("a plan made for another graph") {
    auto doc = cache::detail::envelope(key, p);
    doc.key.graph ^= 1;
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("stale: the plan was made for graph"));
  }
  SECTION("a plan whose graph no longer hashes to the recorded value") {
    auto doc = cache::detail::envelope(key, p);
    doc.plan_graph = plan::hash(p.graph) + 1;
    forge(doc);
    CHECK_THAT(rejection(), ContainsSubstring("stale: the plan's graph hashes to " + hasher::to_hex(plan::hash(p.graph))));
  }
  SECTION("a directory where the file should be") {
    fs::remove(path);
    fs::create_directories(path / "inside");
    CHECK_THAT(rejection(), ContainsSubstring("cannot read"));
  }
  SECTION("get_or_plan replans over a corrupted file and repairs it") {
    write_file(path, good.substr(0, good.size() / 2));
    int calls = 0;
    bool hit = true;
    const auto fresh = cache.get_or_plan(key, [&] { ++calls; return p; }, &hit);
    CHECK(calls == 1);
    CHECK_FALSE(hit);
    CHECK(fresh == p);
    CHECK(read_file(path) == good);
  }
}

TEST_CASE("a failed write throws naming the path and leaves no file", "[cache][failure]") {
  stored_plan fixture;
  auto& [dir, g, m, key, p] = fixture;

  SECTION("when the cache directory is a regular file") {
    const auto not_a_dir = dir.path / "file";
    write_file(not_a_dir, "x");
    cache::plan_cache cache(not_a_dir / "cache");
    CHECK_THROWS_WITH(cache.store(key, p), ContainsSubstring((not_a_dir / "cache").string()));
    CHECK(read_file(not_a_dir) == "x");
  }
  SECTION("when the file's path is a directory") {
    cache::plan_cache cache(dir.path);
    fs::create_directories(cache.path_of(key) / "occupied");
    CHECK_THROWS_WITH(cache.store(key, p), ContainsSubstring(cache.path_of(key).string()));
    int entries = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++entries;
    CHECK(entries == 1); // the directory itself; no temporary file left behind
    CHECK(fs::is_directory(cache.path_of(key)));
  }
  SECTION("get_or_plan still returns the plan when the store fails") {
    const auto not_a_dir = dir.path / "file";
    write_file(not_a_dir, "x");
    cache::plan_cache cache(not_a_dir);
    cache.silence();
    int calls = 0;
    bool hit = true;
    CHECK(cache.get_or_plan(key, [&] { ++calls; return p; }, &hit) == p);
    CHECK(calls == 1);
    CHECK_FALSE(hit);
  }
  SECTION("an unsound plan is refused before anything is written") {
    auto unsound = p;
    unsound.order[ir::compute_stream].pop_back();
    cache::plan_cache cache(dir.path);
    CHECK_THROWS_WITH(cache.store(key, unsound), ContainsSubstring("refusing to store an invalid plan"));
    CHECK_FALSE(fs::exists(cache.path_of(key)));
  }
}

TEST_CASE("two jobs storing the same key at once leave one whole plan file and nothing else", "[cache][failure]") {
  stored_plan fixture;
  auto& [dir, g, m, key, p] = fixture;
  // Two processes, as two jobs cold-starting on one cache folder: each stores the key and reads
  // it back, again and again, while the other does the same. Every read must find a whole plan
  // (its own or the other's: the same), never a torn or rejected file.
  std::vector<pid_t> jobs;
  for (int j = 0; j < 2; ++j) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int bad_reads = 0;
      try {
        cache::plan_cache cache(dir.path);
        for (int i = 0; i < 30; ++i) {
          cache.store(key, p);
          const auto read = cache.load(key);
          bad_reads += !read || !(*read == p);
        }
      } catch (...) {
        bad_reads = 100;
      }
      ::_exit(bad_reads);
    }
    jobs.push_back(pid);
  }
  for (const pid_t pid : jobs) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{key.hex() + ".plan"});
}

TEST_CASE("get_or_plan plans once, then answers from the cache", "[cache]") {
  temp_dir dir;
  const auto g = small_graph();
  const auto m = cost::model::preset("a800x32");
  cache::plan_cache cache(dir.path);
  int calls = 0;
  const auto planner = [&] {
    ++calls;
    return make_plan(g, m, planner::policy::xla_lhs);
  };
  const auto key = cache::make_key(g, m, "mpi", "xla_lhs");
  bool hit = true;
  const auto first = cache.get_or_plan(key, planner, &hit);
  CHECK(calls == 1);
  CHECK_FALSE(hit);
  const auto second = cache.get_or_plan(key, planner, &hit);
  CHECK(calls == 1);
  CHECK(hit);
  CHECK(second == first);
  SECTION("another key is planned separately") {
    CHECK(cache.get_or_plan(cache::make_key(g, m, "nccl", "xla_lhs"), planner, &hit) == first);
    CHECK(calls == 2);
    CHECK_FALSE(hit);
  }
}

TEST_CASE("the cache directory follows the environment", "[cache][env]") {
  scoped_env home("HOME", "/home/someone");
  SECTION("CONCERTO_CACHE_DIR wins") {
    scoped_env mine("CONCERTO_CACHE_DIR", "/var/cache/plans");
    scoped_env xdg("XDG_CACHE_HOME", "/xdg");
    CHECK(cache::default_directory() == fs::path("/var/cache/plans"));
  }
  SECTION("then XDG_CACHE_HOME, when it is absolute") {
    scoped_env mine("CONCERTO_CACHE_DIR", "");
    scoped_env xdg("XDG_CACHE_HOME", "/xdg");
    CHECK(cache::default_directory() == fs::path("/xdg/concerto"));
  }
  SECTION("then HOME, also when XDG_CACHE_HOME is relative") {
    scoped_env mine("CONCERTO_CACHE_DIR", nullptr);
    scoped_env xdg("XDG_CACHE_HOME", "relative/dir");
    CHECK(cache::default_directory() == fs::path("/home/someone/.cache/concerto"));
  }
  SECTION("then the temporary directory") {
    scoped_env mine("CONCERTO_CACHE_DIR", nullptr);
    scoped_env xdg("XDG_CACHE_HOME", nullptr);
    scoped_env no_home("HOME", nullptr);
    const auto dir = cache::default_directory();
    CHECK(dir.filename() == "concerto-cache");
    CHECK(dir.is_absolute());
  }
}

// Not run by default: `unit_cache_test "[.bench]"` prints the load time of a large plan.
TEST_CASE("load time of a plan of 4,000-5,000 tasks (llama-tp-sp, full depth and 100 blocks)", "[.bench][cache]") {
  temp_dir dir;
  const int layers = GENERATE(0, 100); // 0: the model's 80
  const auto g = ir::make_workload("llama-tp-sp", {.layers = layers});
  const auto m = cost::model::preset("h100x64");
  const auto p = make_plan(g, m, planner::policy::xla_lhs);
  const auto key = cache::make_key(g, m, "nccl", "xla_lhs");
  cache::plan_cache cache(dir.path);
  cache.store(key, p);
  double best_ms = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto loaded = cache.load(key);
    const auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best_ms = std::min(best_ms, ms);
    REQUIRE(loaded);
    CHECK(loaded->graph.tasks.size() == p.graph.tasks.size());
  }
  WARN(std::to_string(p.graph.tasks.size()) + " tasks, " + std::to_string(fs::file_size(cache.path_of(key))) +
       " bytes: best load " + std::to_string(best_ms) + " ms");
}
