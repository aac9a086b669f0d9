#include <concerto/cost/calibrate_cpu.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <unistd.h>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

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

// Points the cache at a fresh folder for the test's lifetime, then restores the variable.
class temp_cache_dir {
public:
  temp_cache_dir() {
    dir_ = std::filesystem::temp_directory_path() / ("concerto-calibrate-test-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    if (const char* old = std::getenv("CONCERTO_CACHE_DIR")) old_ = old;
    ::setenv("CONCERTO_CACHE_DIR", dir_.c_str(), 1);
  }
  ~temp_cache_dir() {
    if (old_) ::setenv("CONCERTO_CACHE_DIR", old_->c_str(), 1);
    else ::unsetenv("CONCERTO_CACHE_DIR");
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  temp_cache_dir(const temp_cache_dir&) = delete;
  temp_cache_dir& operator=(const temp_cache_dir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return dir_; }

private:
  std::filesystem::path dir_;
  std::optional<std::string> old_;
};

std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), {}};
}

bool positive(double x) { return std::isfinite(x) && x > 0; }

ir::task matmul_task(std::int64_t m, std::int64_t n, std::int64_t k) {
  ir::task t;
  t.name = "mm";
  t.kind = ir::op_kind::matmul;
  t.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  t.bytes = 4.0 * static_cast<double>(m * k + k * n + m * n);
  t.attrs = {{"m", m}, {"n", n}, {"k", k}};
  return t;
}

// Every measurement costs a few hundred ms, so the first one is shared by all sections: the
// cache folder and the first result live for the whole process.
const cost::calibration& first_calibration() {
  static const temp_cache_dir cache;
  static const cost::calibration first = [] {
    REQUIRE_FALSE(std::filesystem::exists(cost::cpu_cache_file()));
    return cost::calibrate_cpu_report();
  }();
  return first;
}

// Later sections may have planted or damaged the file; put the measured one back.
void restore_first_cache() { cost::save_cpu_cache(first_calibration().file, first_calibration().hw); }

} // namespace

TEST_CASE("calibration measures this machine and writes its cache", "[cost][calibrate]") {
  const auto& first = first_calibration();
  CHECK_FALSE(first.from_cache);
  CHECK(first.file == cost::cache_dir() / ("cost-cpu-" + cost::host_name() + ".json"));
  CHECK(first.file.parent_path().filename().string().starts_with("concerto-calibrate-test-"));
  CHECK(std::filesystem::exists(first.file));

  SECTION("every measured number is positive and within what one core can do") {
    const auto& hw = first.hw;
    CHECK(hw.name == "cpu");
    CHECK(positive(hw.peak_tflops));
    CHECK(positive(hw.vector_tflops));
    CHECK(positive(hw.mem_bandwidth_gbs));
    CHECK(positive(hw.launch_us));
    CHECK(hw.max_efficiency == 1.0);
    CHECK(hw.overlap_slowdown >= 1.0);
    CHECK(hw.overlap_slowdown <= 2.0);
    CHECK(hw.efficiency_half_dim >= 0);
    CHECK(hw.efficiency_half_flops >= 0);
    REQUIRE(first.samples.size() >= 8);
    for (const auto& s : first.samples) CHECK(positive(s.us));
    // A single core cannot beat a few TFLOP/s nor stream more than a few hundred GB/s: a
    // number outside these is a unit error, not a fast machine.
    CHECK(hw.peak_tflops < 5.0);
    CHECK(hw.mem_bandwidth_gbs < 500.0);
  }
  SECTION("the links stay the documented defaults until the MPI runtime measures them") {
    CHECK(first.hw.intra_node == cost::presets::cpu_defaults().intra_node);
    CHECK(first.hw.inter_node == cost::presets::cpu_defaults().inter_node);
    const auto linked = cost::with_links(first.hw, {0.7, 6.0}, {30.0, 0.1});
    CHECK(linked.inter_node == cost::link{30.0, 0.1});
    CHECK(linked.peak_tflops == first.hw.peak_tflops);
  }
  SECTION("the fitted curve makes a chunked matmul cost more than the whole") {
    const cost::model m(first.hw);
    const double whole = m.compute_us(matmul_task(1024, 1024, 1024));
    for (std::int64_t c : {2, 4, 8}) CHECK(c * m.compute_us(matmul_task(1024 / c, 1024, 1024)) > whole);
  }
}

TEST_CASE("a second calibration reads the cache", "[cost][calibrate][cache]") {
  const auto& first = first_calibration();
  restore_first_cache();

  SECTION("and gets the same numbers without measuring") {
    const auto second = cost::calibrate_cpu_report();
    CHECK(second.from_cache);
    CHECK(second.samples.empty());
    CHECK(second.hw == first.hw);
    CHECK(cost::model::preset("cpu").hw() == first.hw); // the core reads the same file
  }
  SECTION("and trusts a valid file as written") {
    auto planted = first.hw;
    planted.peak_tflops = 0.125;
    cost::save_cpu_cache(first.file, planted);
    CHECK(cost::calibrate_cpu() == planted);
  }
  SECTION("unless asked not to: use_cache = false measures again and refreshes the file") {
    auto planted = first.hw;
    planted.peak_tflops = 0.125;
    cost::save_cpu_cache(first.file, planted);
    const auto fresh = cost::calibrate_cpu_report(false);
    CHECK_FALSE(fresh.from_cache);
    CHECK(fresh.hw.peak_tflops != 0.125);
    CHECK(cost::read_cpu_cache(first.file).hw == fresh.hw);
  }
}

// Calibrates over a damaged file and checks that the damage was reported and repaired.
void check_recalibrates(const std::filesystem::path& file, const std::string& expected_message) {
  REQUIRE_FALSE(cost::read_cpu_cache(file).hw); // the damage is real
  stderr_capture err;
  const auto again = cost::calibrate_cpu_report();
  CHECK_FALSE(again.from_cache);
  CHECK_FALSE(again.samples.empty());
  CHECK_THAT(err.str(), ContainsSubstring(file.filename().string()) && ContainsSubstring(expected_message));
  const auto reread = cost::read_cpu_cache(file);
  REQUIRE(reread.hw);
  CHECK(*reread.hw == again.hw);
  CHECK(reread.problem.empty());
}

TEST_CASE("a damaged cache file is reported on stderr, measured again and replaced", "[cost][calibrate][cache]") {
  const auto& first = first_calibration();
  restore_first_cache();
  const auto text = read_text(first.file);
  SECTION("when it is truncated") {
    std::ofstream(first.file, std::ios::trunc) << text.substr(0, text.size() / 3);
    check_recalibrates(first.file, "not valid JSON");
  }
  SECTION("when it has another version") {
    auto j = nlohmann::json::parse(text);
    j["version"] = 0;
    std::ofstream(first.file, std::ios::trunc) << j.dump(2);
    check_recalibrates(first.file, "version");
  }
  SECTION("when a number was changed behind the checksum's back") {
    auto j = nlohmann::json::parse(text);
    j["hardware"]["mem_bandwidth_gbs"] = 1e6;
    std::ofstream(first.file, std::ios::trunc) << j.dump(2);
    check_recalibrates(first.file, "checksum");
  }
}
