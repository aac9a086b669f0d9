#include <concerto/cost/model.hpp>
#include <concerto/ir/builder.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <set>
#include <sstream>

#include <unistd.h>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinRel;

namespace {

// Round numbers so that every expected value below can be checked by hand:
// intra-node 2 µs + 100 GB/s (1e5 bytes/µs), inter-node 10 µs + 10 GB/s (1e4 bytes/µs).
cost::hardware round_hardware(cost::collective_algorithm algo = cost::collective_algorithm::ring) {
  cost::hardware hw;
  hw.name = "round";
  hw.nodes = 2;
  hw.ranks_per_node = 4;
  hw.peak_tflops = 100;      // 1e8 flop/µs
  hw.vector_tflops = 10;     // 1e7 flop/µs
  hw.mem_bandwidth_gbs = 1000; // 1e6 bytes/µs
  hw.max_efficiency = 0.5;
  hw.efficiency_half_dim = 64;
  hw.efficiency_half_flops = 1e9;
  hw.launch_us = 2;
  hw.intra_node = {2.0, 100.0};
  hw.inter_node = {10.0, 10.0};
  hw.algorithm = algo;
  hw.overlap_slowdown = 1.25;
  return hw;
}

ir::task matmul_task(std::int64_t m, std::int64_t n, std::int64_t k, double elem_bytes = 2) {
  ir::task t;
  t.id = 0;
  t.name = "mm";
  t.kind = ir::op_kind::matmul;
  t.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  t.bytes = elem_bytes * static_cast<double>(m * k + k * n + m * n);
  t.attrs = {{"m", m}, {"n", n}, {"k", k}, {"batch", 1}};
  return t;
}

// Restores an environment variable when the test ends, so tests stay independent.
class env_guard {
public:
  env_guard(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~env_guard() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }
  env_guard(const env_guard&) = delete;
  env_guard& operator=(const env_guard&) = delete;

private:
  const char* name_;
  std::optional<std::string> old_;
};

class stderr_capture {
public:
  stderr_capture() : old_(std::cerr.rdbuf(text_.rdbuf())) {}
  ~stderr_capture() { std::cerr.rdbuf(old_); }
  stderr_capture(const stderr_capture&) = delete;
  stderr_capture& operator=(const stderr_capture&) = delete;
  [[nodiscard]] std::string str() const { return text_.str(); }

private:
  std::ostringstream text_;
  std::streambuf* old_;
};

std::filesystem::path fresh_temp_dir(const std::string& tag) {
  auto dir = std::filesystem::temp_directory_path() / ("concerto-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<cost::hardware> gpu_and_default_presets() {
  return {cost::presets::a800x32(), cost::presets::h100x64(), cost::presets::cpu_defaults()};
}

} // namespace

TEST_CASE("collectives follow the alpha-beta formulas on both link classes", "[cost][collective]") {
  const cost::model m(round_hardware());
  using ir::link_class;
  using ir::op_kind;
  const double n = 4e6; // bytes, p = 4: one share is 1e6 bytes

  SECTION("a ring all-reduce costs 2(p-1)(alpha + n/(pB))") {
    CHECK_THAT(m.collective_us(op_kind::all_reduce, n, 4, link_class::intra_node), WithinRel(6 * (2.0 + 10.0), 1e-12));
    CHECK_THAT(m.collective_us(op_kind::all_reduce, n, 4, link_class::inter_node), WithinRel(6 * (10.0 + 100.0), 1e-12));
  }
  SECTION("a tree all-reduce costs 2 ceil(log2 p)(alpha + n/B)") {
    const auto tree = cost::collective_algorithm::tree;
    CHECK_THAT(m.collective_us(op_kind::all_reduce, n, 4, link_class::intra_node, tree), WithinRel(4 * (2.0 + 40.0), 1e-12));
    CHECK_THAT(m.collective_us(op_kind::all_reduce, n, 4, link_class::inter_node, tree), WithinRel(4 * (10.0 + 400.0), 1e-12));
    // p = 6 rounds log2 up to 3 levels.
    CHECK_THAT(m.collective_us(op_kind::all_reduce, n, 6, link_class::intra_node, tree), WithinRel(6 * (2.0 + 40.0), 1e-12));
  }
  SECTION("all-gather, reduce-scatter and all-to-all cost (p-1)(alpha + n/(pB))") {
    for (auto kind : {op_kind::all_gather, op_kind::reduce_scatter, op_kind::all_to_all}) {
      INFO(ir::to_string(kind));
      CHECK_THAT(m.collective_us(kind, n, 4, link_class::intra_node), WithinRel(3 * (2.0 + 10.0), 1e-12));
      CHECK_THAT(m.collective_us(kind, n, 4, link_class::inter_node), WithinRel(3 * (10.0 + 100.0), 1e-12));
    }
  }
  SECTION("send and recv cost alpha + n/B") {
    for (auto kind : {op_kind::send, op_kind::recv}) {
      CHECK_THAT(m.collective_us(kind, n, 4, link_class::intra_node), WithinRel(2.0 + 40.0, 1e-12));
      CHECK_THAT(m.collective_us(kind, n, 4, link_class::inter_node), WithinRel(10.0 + 400.0, 1e-12));
    }
  }
  SECTION("a broadcast costs (p-1) alpha + n/B as a pipelined ring and ceil(log2 p)(alpha + n/B) as a tree") {
    CHECK_THAT(m.collective_us(op_kind::broadcast, n, 4, link_class::intra_node), WithinRel(3 * 2.0 + 40.0, 1e-12));
    CHECK_THAT(m.collective_us(op_kind::broadcast, n, 4, link_class::inter_node), WithinRel(3 * 10.0 + 400.0, 1e-12));
    const auto tree = cost::collective_algorithm::tree;
    CHECK_THAT(m.collective_us(op_kind::broadcast, n, 4, link_class::intra_node, tree), WithinRel(2 * (2.0 + 40.0), 1e-12));
    CHECK_THAT(m.collective_us(op_kind::broadcast, n, 4, link_class::inter_node, tree), WithinRel(2 * (10.0 + 400.0), 1e-12));
  }
  SECTION("a graph task takes its link class and group size from its mesh axis") {
    ir::builder b("two-links");
    const int tp = b.axis("tp", 4, link_class::intra_node);
    const int dp = b.axis("dp", 4, link_class::inter_node);
    const auto g1 = b.buffer("g1", {1000000}); // f32: 4e6 bytes
    const auto g2 = b.buffer("g2", {1000000});
    b.collective(op_kind::all_reduce, "ar.tp", tp, g1, g1);
    b.collective(op_kind::all_reduce, "ar.dp", dp, g2, g2);
    const auto g = std::move(b).finish();
    const auto d = m.durations_us(g);
    REQUIRE(d.size() == 2);
    CHECK_THAT(d[0], WithinRel(72.0, 1e-12));
    CHECK_THAT(d[1], WithinRel(660.0, 1e-12));
    CHECK_THAT(m.task_us(g, g.tasks[1]), WithinRel(660.0, 1e-12));
  }
}

TEST_CASE("a group of one rank communicates for free", "[cost][collective]") {
  const cost::model m(round_hardware());
  for (int k = static_cast<int>(ir::op_kind::all_reduce); k < ir::op_kind_count; ++k)
    for (auto link : {ir::link_class::intra_node, ir::link_class::inter_node}) {
      const auto kind = static_cast<ir::op_kind>(k);
      INFO(ir::to_string(kind) << " on " << ir::to_string(link));
      CHECK(m.collective_us(kind, 1e9, 1, link) == 0.0);
      CHECK(m.collective_us(kind, 1e9, 2, link) > 0.0); // and not because everything is free
    }
  ir::builder b("solo");
  const int dp = b.axis("dp", 1, ir::link_class::inter_node);
  const auto g1 = b.buffer("g", {1024});
  b.collective(ir::op_kind::all_reduce, "ar", dp, g1, g1);
  const auto g = std::move(b).finish();
  CHECK(m.task_us(g, g.tasks[0]) == 0.0);
}

TEST_CASE("the 'best' algorithm takes the cheaper of ring and tree", "[cost][collective]") {
  const cost::model ring(round_hardware(cost::collective_algorithm::ring));
  const cost::model tree(round_hardware(cost::collective_algorithm::tree));
  const cost::model best(round_hardware(cost::collective_algorithm::best));
  using ir::op_kind;

  SECTION("small messages favour the tree's fewer steps, large ones the ring's smaller shares") {
    const auto small_ring = ring.collective_us(op_kind::all_reduce, 1e3, 8, ir::link_class::intra_node);
    const auto small_tree = tree.collective_us(op_kind::all_reduce, 1e3, 8, ir::link_class::intra_node);
    CHECK(small_tree < small_ring); // 6·(2 + 0.01) < 14·(2 + 0.00125)
    CHECK(best.collective_us(op_kind::all_reduce, 1e3, 8, ir::link_class::intra_node) == small_tree);
    const auto big_ring = ring.collective_us(op_kind::all_reduce, 1e9, 8, ir::link_class::intra_node);
    const auto big_tree = tree.collective_us(op_kind::all_reduce, 1e9, 8, ir::link_class::intra_node);
    CHECK(big_ring < big_tree);
    CHECK(best.collective_us(op_kind::all_reduce, 1e9, 8, ir::link_class::intra_node) == big_ring);
  }
  SECTION("over random sizes, groups and links best is the minimum of the two") {
    std::mt19937 rng(2024);
    std::uniform_real_distribution<double> log_bytes(0, 10);
    std::uniform_int_distribution<int> group(2, 64);
    int tree_won = 0, ring_won = 0;
    for (int i = 0; i < 500; ++i) {
      const double n = std::pow(10.0, log_bytes(rng));
      const int p = group(rng);
      const auto link = i % 2 ? ir::link_class::intra_node : ir::link_class::inter_node;
      for (auto kind : {op_kind::all_reduce, op_kind::broadcast}) {
        const auto r = ring.collective_us(kind, n, p, link), t = tree.collective_us(kind, n, p, link);
        CHECK(best.collective_us(kind, n, p, link) == std::min(r, t));
        (t < r ? tree_won : ring_won) += 1;
      }
    }
    CHECK(tree_won > 0); // both regimes were exercised
    CHECK(ring_won > 0);
  }
}

TEST_CASE("compute follows the roofline with a small-shape efficiency curve", "[cost][compute]") {
  const cost::model m(round_hardware());

  SECTION("a 1024-cube bf16 matmul is compute bound at the hand-computed efficiency") {
    // eff = 0.5 · 1024/(1024+64) · f/(f+1e9), f = 2·1024³ → 0.3210757; time = f/(1e8·eff) + 2.
    const auto t = matmul_task(1024, 1024, 1024);
    CHECK_THAT(m.efficiency(t), WithinRel(0.3210757078523491, 1e-9));
    CHECK_THAT(m.compute_us(t), WithinRel(68.88402752, 1e-9));
  }
  SECTION("a task without flops costs its memory traffic plus the launch") {
    ir::task copy;
    copy.name = "copy";
    copy.kind = ir::op_kind::copy;
    copy.bytes = 6291456; // 6.291456 µs at 1e6 bytes/µs
    CHECK_THAT(m.compute_us(copy), WithinRel(8.291456, 1e-12));
  }
  SECTION("efficiency grows with the smallest extent and with the work") {
    CHECK(m.efficiency(matmul_task(64, 4096, 4096)) < m.efficiency(matmul_task(512, 4096, 4096)));
    CHECK(m.efficiency(matmul_task(512, 512, 512)) < m.efficiency(matmul_task(4096, 4096, 4096)));
    CHECK(m.efficiency(matmul_task(8192, 8192, 8192)) <= 0.5);
  }
  SECTION("pricing a collective as compute is an error naming the task") {
    ir::task t;
    t.id = 7;
    t.name = "grad.ar";
    t.kind = ir::op_kind::all_reduce;
    CHECK_THROWS_WITH(m.compute_us(t), ContainsSubstring("'grad.ar'") && ContainsSubstring("all_reduce"));
  }
  SECTION("negative sizes are errors naming the task") {
    auto t = matmul_task(8, 8, 8);
    t.bytes = -1;
    CHECK_THROWS_WITH(m.compute_us(t), ContainsSubstring("'mm'") && ContainsSubstring("bytes"));
    CHECK_THROWS_WITH(m.collective_us(ir::op_kind::all_gather, -5, 4, ir::link_class::intra_node),
                      ContainsSubstring("all_gather"));
    CHECK_THROWS_WITH(m.collective_us(ir::op_kind::all_gather, 5, 0, ir::link_class::intra_node),
                      ContainsSubstring("group size"));
  }
}

TEST_CASE("splitting a matmul into chunks costs more in total than the whole", "[cost][compute][decomposition]") {
  for (const auto& hw : gpu_and_default_presets()) {
    const cost::model m(hw);
    INFO("preset " << hw.name);
    SECTION("for a large square matmul split 2, 4 and 8 ways along each extent: " + hw.name) {
      const std::int64_t d = 4096;
      const double whole = m.compute_us(matmul_task(d, d, d));
      for (std::int64_t c : {2, 4, 8}) {
        INFO(c << " chunks");
        CHECK(c * m.compute_us(matmul_task(d / c, d, d)) > whole); // rows of A
        CHECK(c * m.compute_us(matmul_task(d, d / c, d)) > whole); // columns of B
        CHECK(c * m.compute_us(matmul_task(d, d, d / c)) > whole); // the reduction
      }
    }
    SECTION("for random shapes with a fixed seed: " + hw.name) {
      std::mt19937 rng(7);
      std::uniform_int_distribution<std::int64_t> extent(1, 1024);
      std::uniform_int_distribution<int> which(0, 2), log_chunks(1, 3);
      for (int i = 0; i < 300; ++i) {
        std::int64_t e[3] = {8 * extent(rng), 8 * extent(rng), 8 * extent(rng)};
        const double whole = m.compute_us(matmul_task(e[0], e[1], e[2]));
        const std::int64_t c = std::int64_t{1} << log_chunks(rng);
        e[which(rng)] /= c;
        const double chunked = static_cast<double>(c) * m.compute_us(matmul_task(e[0], e[1], e[2]));
        INFO("shape " << e[0] << "x" << e[1] << "x" << e[2] << " in " << c << " chunks");
        CHECK(chunked > whole);
      }
    }
  }
  SECTION("and on the GPU presets the penalty grows with the number of chunks") {
    const auto m = cost::model::preset("a800x32");
    double previous = m.compute_us(matmul_task(4096, 4096, 4096));
    for (std::int64_t c : {2, 4, 8}) {
      const double total = static_cast<double>(c) * m.compute_us(matmul_task(4096 / c, 4096, 4096));
      CHECK(total > previous);
      previous = total;
    }
  }
}

TEST_CASE("an elementwise op is memory bound", "[cost][compute]") {
  ir::builder b("ew");
  const auto x = b.buffer("x", {4096, 4096});
  const auto y = b.buffer("y", {4096, 4096});
  const auto z = b.buffer("z", {4096, 4096});
  b.compute(ir::op_kind::elementwise, "add", {x, y}, {z}, {ir::op::add, 4096.0 * 4096.0});
  b.compute(ir::op_kind::elementwise, "gelu", {x}, {z}, {ir::op::gelu, 8 * 4096.0 * 4096.0});
  const auto g = std::move(b).finish();
  for (const auto& hw : gpu_and_default_presets()) {
    const cost::model m(hw);
    for (const auto& t : g.tasks) {
      INFO(hw.name << ": " << t.name);
      const double memory = t.bytes / (hw.mem_bandwidth_gbs * 1e3);
      const double compute = t.flops / (hw.vector_tflops * 1e6 * m.efficiency(t));
      CHECK(compute < memory);
      CHECK_THAT(m.compute_us(t), WithinRel(memory + hw.launch_us, 1e-12));
    }
  }
}

TEST_CASE("a measured kernel factor multiplies that kernel's roofline time only", "[cost][compute]") {
  ir::builder b("scaled");
  const auto x = b.buffer("x", {512, 512});
  const auto w = b.buffer("w", {512, 512});
  const auto y = b.buffer("y", {512, 512});
  const auto z = b.buffer("z", {512, 512});
  b.compute(ir::op_kind::matmul, "mm", {x, w}, {y}, {ir::op::matmul, 2.0 * 512 * 512 * 512, -1, {{"m", 512}, {"n", 512}, {"k", 512}}});
  b.compute(ir::op_kind::elementwise, "act", {y}, {z}, {ir::op::gelu, 8 * 512.0 * 512.0});
  const auto g = std::move(b).finish();
  auto hw = round_hardware();
  const cost::model plain(hw);
  hw.kernel_scale = {{"gelu", 20.0}};
  const cost::model scaled(hw);
  CHECK(cost::model::kernel_name(g.tasks[0]) == "matmul"); // no fn: the op kind names it
  CHECK(cost::model::kernel_name(g.tasks[1]) == "gelu");
  CHECK(scaled.compute_us(g.tasks[0]) == plain.compute_us(g.tasks[0]));
  CHECK_THAT(scaled.compute_us(g.tasks[1]) - hw.launch_us, WithinRel(20.0 * (plain.compute_us(g.tasks[1]) - hw.launch_us), 1e-12));
}

TEST_CASE("presets are named, documented numbers", "[cost][preset]") {
  SECTION("the known presets are listed and an unknown one is an error that lists them") {
    CHECK(cost::preset_names() == std::vector<std::string>{"a800x32", "h100x64", "cpu", "cpu-netns"});
    CHECK_THROWS_AS(cost::model::preset("tpu-v5"), concerto::error);
    CHECK_THROWS_WITH(cost::model::preset("tpu-v5"),
                      ContainsSubstring("'tpu-v5'") && ContainsSubstring("a800x32, h100x64, cpu, cpu-netns"));
  }
  SECTION("the GPU presets carry the datasheet peaks and the cluster shapes") {
    const auto a = cost::model::preset("a800x32").hw();
    CHECK(a.peak_tflops == 312.0);
    CHECK(a.nodes * a.ranks_per_node == 32);
    const auto h = cost::model::preset("h100x64").hw();
    CHECK(h.peak_tflops == 989.0);
    CHECK(h.nodes * h.ranks_per_node == 64);
    // Links inside a node are faster than those between nodes, on both.
    for (const auto& hw : {a, h}) {
      CHECK(hw.intra_node.bandwidth_gbps > hw.inter_node.bandwidth_gbps);
      CHECK(hw.intra_node.alpha_us < hw.inter_node.alpha_us);
      CHECK(hw.overlap_slowdown >= 1.0);
    }
    CHECK(cost::model::preset("a800x32").overlap_slowdown() == a.overlap_slowdown);
  }
  SECTION("a hardware no machine could have is rejected, naming the field") {
    auto hw = round_hardware();
    hw.overlap_slowdown = 0.5;
    CHECK_THROWS_WITH(cost::model(hw), ContainsSubstring("overlap_slowdown"));
    hw = round_hardware();
    hw.inter_node.bandwidth_gbps = 0;
    CHECK_THROWS_WITH(cost::model(hw), ContainsSubstring("inter_node.bandwidth_gbps"));
    hw = round_hardware();
    hw.max_efficiency = 1.5;
    CHECK_THROWS_WITH(cost::model(hw), ContainsSubstring("max_efficiency"));
  }
}

TEST_CASE("hardware round-trips through JSON and hashes every number", "[cost][json]") {
  SECTION("every preset survives to_json and from_json unchanged") {
    for (auto hw : gpu_and_default_presets()) {
      const nlohmann::json j = hw;
      const auto back = nlohmann::json::parse(j.dump()).get<cost::hardware>();
      CHECK(back == hw);
      CHECK(back.hash() == hw.hash());
    }
  }
  SECTION("changing any one number or the name changes the hash") {
    const auto base = round_hardware();
    const std::vector<std::function<void(cost::hardware&)>> changes = {
        [](auto& h) { h.name = "other"; },
        [](auto& h) { h.nodes += 1; },
        [](auto& h) { h.ranks_per_node += 1; },
        [](auto& h) { h.peak_tflops *= 1.001; },
        [](auto& h) { h.vector_tflops *= 1.001; },
        [](auto& h) { h.mem_bandwidth_gbs *= 1.001; },
        [](auto& h) { h.max_efficiency *= 0.999; },
        [](auto& h) { h.efficiency_half_dim += 1; },
        [](auto& h) { h.efficiency_half_flops += 1; },
        [](auto& h) { h.launch_us += 0.001; },
        [](auto& h) { h.intra_node.alpha_us += 0.001; },
        [](auto& h) { h.intra_node.bandwidth_gbps += 0.001; },
        [](auto& h) { h.inter_node.alpha_us += 0.001; },
        [](auto& h) { h.inter_node.bandwidth_gbps += 0.001; },
        [](auto& h) { h.algorithm = cost::collective_algorithm::tree; },
        [](auto& h) { h.overlap_slowdown += 0.001; },
        [](auto& h) { h.kernel_scale["gelu"] = 2.0; },
        [](auto& h) { h.comm_overlap_slowdown = 1.5; },
    };
    std::set<std::uint64_t> seen{base.hash()};
    for (std::size_t i = 0; i < changes.size(); ++i) {
      auto hw = base;
      changes[i](hw);
      INFO("change " << i);
      CHECK(hw != base);
      CHECK(seen.insert(hw.hash()).second);
    }
    // Which link a number belongs to is part of the hash.
    auto swapped = base;
    std::swap(swapped.intra_node, swapped.inter_node);
    CHECK(swapped.hash() != base.hash());
  }
  SECTION("a JSON missing a field or with a bad one is an error naming it") {
    nlohmann::json j = round_hardware();
    auto missing = j;
    missing.erase("launch_us");
    CHECK_THROWS_WITH(missing.get<cost::hardware>(), ContainsSubstring("'launch_us'"));
    auto bad_link = j;
    bad_link["inter_node"].erase("alpha_us");
    CHECK_THROWS_WITH(bad_link.get<cost::hardware>(), ContainsSubstring("inter_node") && ContainsSubstring("'alpha_us'"));
    auto bad_algo = j;
    bad_algo["algorithm"] = "butterfly";
    CHECK_THROWS_WITH(bad_algo.get<cost::hardware>(), ContainsSubstring("'algorithm'"));
    auto negative = j;
    negative["peak_tflops"] = -3;
    CHECK_THROWS_WITH(negative.get<cost::hardware>(), ContainsSubstring("'peak_tflops'"));
  }
  SECTION("measured kernel factors round-trip, and their absence leaves the hash as it was") {
    auto hw = round_hardware();
    const auto before = hw.hash();
    CHECK_FALSE(nlohmann::json(hw).contains("kernel_scale"));
    hw.kernel_scale = {{"gelu", 19.5}, {"matmul", 0.7}};
    const auto back = nlohmann::json::parse(nlohmann::json(hw).dump()).get<cost::hardware>();
    CHECK(back == hw);
    CHECK(back.hash() == hw.hash());
    CHECK(hw.hash() != before);
    auto other = hw;
    other.kernel_scale["matmul"] = 0.71;
    CHECK(other.hash() != hw.hash());
    hw.kernel_scale.clear();
    CHECK(hw.hash() == before);
    hw.comm_overlap_slowdown = 1.9;
    CHECK(nlohmann::json(hw).at("comm_overlap_slowdown") == 1.9);
    CHECK(nlohmann::json::parse(nlohmann::json(hw).dump()).get<cost::hardware>() == hw);
    hw.comm_overlap_slowdown = 0.5;
    CHECK_THROWS_WITH(hw.validate(), ContainsSubstring("comm_overlap_slowdown"));
  }
  SECTION("a kernel factor that is not a positive number is an error naming the kernel") {
    nlohmann::json j = round_hardware();
    j["kernel_scale"] = {{"gelu", 0.0}};
    CHECK_THROWS_WITH(j.get<cost::hardware>(), ContainsSubstring("kernel_scale.gelu"));
    j["kernel_scale"] = {{"gelu", "fast"}};
    CHECK_THROWS_WITH(j.get<cost::hardware>(), ContainsSubstring("'gelu'"));
    j["kernel_scale"] = 3;
    CHECK_THROWS_WITH(j.get<cost::hardware>(), ContainsSubstring("'kernel_scale'"));
  }
  SECTION("with_links replaces both links and keeps everything else") {
    const auto hw = cost::with_links(round_hardware(), {0.5, 7.0}, {40.0, 0.1});
    CHECK(hw.intra_node == cost::link{0.5, 7.0});
    CHECK(hw.inter_node == cost::link{40.0, 0.1});
    auto expected = round_hardware();
    expected.intra_node = hw.intra_node;
    expected.inter_node = hw.inter_node;
    CHECK(hw == expected);
    CHECK_THROWS_WITH(cost::with_links(round_hardware(), {0.5, -1.0}, {1, 1}), ContainsSubstring("intra_node"));
  }
}

TEST_CASE("the cpu preset reads this machine's cached calibration", "[cost][preset][cache]") {
  const auto dir = fresh_temp_dir("cost-model-test");
  const env_guard cache("CONCERTO_CACHE_DIR", dir.string());
  const auto file = cost::cpu_cache_file();
  REQUIRE(file.parent_path() == dir);
  REQUIRE_THAT(file.filename().string(), ContainsSubstring("cost-cpu-" + cost::host_name()));

  SECTION("without a cache file it uses the documented defaults") {
    CHECK(cost::model::preset("cpu").hw() == cost::presets::cpu_defaults());
  }
  SECTION("with a valid cache file it uses the cached numbers") {
    auto measured = cost::presets::cpu_defaults();
    measured.peak_tflops = 0.123;
    measured.mem_bandwidth_gbs = 17.5;
    cost::save_cpu_cache(file, measured);
    CHECK(cost::model::preset("cpu").hw() == measured);
    for (const auto& entry : std::filesystem::directory_iterator(dir)) // no temporary file is left
      CHECK(entry.path().filename().string().find(".tmp.") == std::string::npos);
  }
  SECTION("a corrupted cache file is reported on stderr and the defaults are used") {
    auto measured = cost::presets::cpu_defaults();
    measured.peak_tflops = 0.123;
    cost::save_cpu_cache(file, measured);
    std::string text;
    {
      std::ifstream in(file);
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    SECTION("truncated") {
      std::ofstream(file, std::ios::trunc) << text.substr(0, text.size() / 2);
      stderr_capture err;
      CHECK(cost::model::preset("cpu").hw() == cost::presets::cpu_defaults());
      CHECK_THAT(err.str(), ContainsSubstring(file.filename().string()) && ContainsSubstring("not valid JSON"));
    }
    SECTION("a number edited by hand") {
      auto j = nlohmann::json::parse(text);
      j["hardware"]["peak_tflops"] = 99.0;
      std::ofstream(file, std::ios::trunc) << j.dump();
      stderr_capture err;
      CHECK(cost::model::preset("cpu").hw() == cost::presets::cpu_defaults());
      CHECK_THAT(err.str(), ContainsSubstring("checksum"));
    }
    SECTION("written by another version") {
      auto j = nlohmann::json::parse(text);
      j["version"] = cost::cpu_cache_version + 1;
      std::ofstream(file, std::ios::trunc) << j.dump();
      stderr_capture err;
      CHECK(cost::model::preset("cpu").hw() == cost::presets::cpu_defaults());
      CHECK_THAT(err.str(), ContainsSubstring("version"));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("the cpu-netns preset reads the emulated cluster's calibration file", "[cost][preset][cluster]") {
  const auto dir = fresh_temp_dir("cost-netns-test");
  const env_guard cache("CONCERTO_CACHE_DIR", dir.string());
  // What bench/cluster's probe writes for 4 hosts at 1 Gbit/s (rounded).
  auto probed = cost::presets::cpu_defaults();
  probed.name = "cpu-netns-4x1gbit";
  probed.nodes = 4;
  probed.ranks_per_node = 1;
  probed.peak_tflops = 0.0305;
  probed.inter_node = {608.0, 0.0926};
  probed.algorithm = cost::collective_algorithm::ring;
  probed.overlap_slowdown = 1.5;
  const auto write = [](const std::filesystem::path& f, const std::string& text) { std::ofstream(f, std::ios::trunc) << text; };

  SECTION("without $CONCERTO_COST_FILE it reads cost-cpu-netns.json in the cache folder") {
    const env_guard file("CONCERTO_COST_FILE", "");
    REQUIRE(cost::cpu_netns_file() == dir / "cost-cpu-netns.json");
    write(dir / "cost-cpu-netns.json", nlohmann::json(probed).dump());
    const auto m = cost::model::preset("cpu-netns");
    CHECK(m.hw() == probed);
    // Priced with the probed link: a 4-rank ring all-reduce of 16 MiB over 1 Gbit/s is
    // 2·3·(608 µs + 4 MiB / 0.0926 GB/s) = 2·3·(608 + 45295) µs, about 276 ms.
    const double n = 16.0 * 1024 * 1024;
    CHECK_THAT(m.collective_us(ir::op_kind::all_reduce, n, 4, ir::link_class::inter_node),
               WithinRel(2 * 3 * (608.0 + n / 4 / (0.0926 * 1e3)), 1e-9));
  }
  SECTION("$CONCERTO_COST_FILE names the file, whatever the cache folder holds") {
    auto other = probed;
    other.name = "cpu-netns-2x10gbit";
    other.inter_node = {108.0, 0.909};
    write(dir / "cost-cpu-netns.json", nlohmann::json(probed).dump());
    write(dir / "2x10.json", nlohmann::json(other).dump());
    const env_guard file("CONCERTO_COST_FILE", (dir / "2x10.json").string());
    CHECK(cost::model::preset("cpu-netns").hw() == other);
    CHECK(cost::model::preset("cpu-netns").hw().hash() != probed.hash());
  }
  SECTION("a missing file is an error naming the file, not a silent default") {
    const env_guard file("CONCERTO_COST_FILE", (dir / "absent.json").string());
    CHECK_THROWS_AS(cost::model::preset("cpu-netns"), concerto::error);
    CHECK_THROWS_WITH(cost::model::preset("cpu-netns"), ContainsSubstring("absent.json") && ContainsSubstring("CONCERTO_COST_FILE"));
  }
  SECTION("a file with a bad field is an error naming the file and the field") {
    auto j = nlohmann::json(probed);
    j["inter_node"].erase("bandwidth_gbps");
    write(dir / "bad.json", j.dump());
    const env_guard file("CONCERTO_COST_FILE", (dir / "bad.json").string());
    CHECK_THROWS_WITH(cost::model::preset("cpu-netns"), ContainsSubstring("bad.json") && ContainsSubstring("bandwidth_gbps"));
  }
  SECTION("a file that is not JSON is an error naming the file") {
    write(dir / "text.json", "inter_node: fast");
    const env_guard file("CONCERTO_COST_FILE", (dir / "text.json").string());
    CHECK_THROWS_WITH(cost::model::preset("cpu-netns"), ContainsSubstring("text.json"));
  }
  std::filesystem::remove_all(dir);
}
