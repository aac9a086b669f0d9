#include <concerto/core/file.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/trace/chrome_trace.hpp>
#include <concerto/trace/svg_gantt.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::EndsWith;
using Catch::Matchers::StartsWith;

namespace {

/// fc (0-4 us) → w.grad all-reduce (4-10 us, exposed: nothing to overlap) → sgd (10-13 us) → "a<b&c"
/// (13-15 us), a name that needs escaping; the graph's name needs JSON and XML escaping too.
struct fixture {
  ir::graph g;
  std::vector<std::vector<ir::task_id>> order;
  std::vector<double> d;
  sim::result r;

  fixture() {
    ir::builder b("tiny \"mlp\"");
    b.cost_only(); // planned, not run
    const int dp = b.axis("dp", 2);
    const auto x = b.buffer("x", {4, 8}, ir::buffer_role::input);
    const auto w = b.buffer("w", {8, 8}, ir::buffer_role::param);
    const auto gw = b.buffer("w.grad", {8, 8}, ir::buffer_role::gradient);
    b.at(ir::phase::backward, 3);
    b.matmul("fc", x, x, gw, 8, 8, 4, 1, true);
    b.collective(ir::op_kind::all_reduce, "w.grad.ar", dp, gw, gw);
    b.at(ir::phase::optimizer);
    b.compute(ir::op_kind::optimizer_update, "sgd", {gw, w}, {w}, {.fn = ir::op::sgd, .flops = 0});
    b.compute(ir::op_kind::elementwise, "a<b&c", {w}, {x}, {.fn = ir::op::scale, .flops = 0});
    g = std::move(b).finish();
    order = {{0, 2, 3}, {1}};
    d = {4, 6, 3, 2};
    r = sim::simulate(g, order, d);
  }
};

std::size_t count(const std::string& text, std::string_view needle) {
  std::size_t n = 0;
  for (auto p = text.find(needle); p != std::string::npos; p = text.find(needle, p + needle.size())) ++n;
  return n;
}

} // namespace

TEST_CASE("the Chrome trace has one complete event per task on its stream's thread", "[trace][chrome]") {
  const fixture f;
  REQUIRE(f.r.step_us == 15); // fc 0-4, ar 4-10, sgd 10-13, a<b&c 13-15
  const auto doc = nlohmann::json::parse(trace::chrome_trace(f.g, f.r, "rank 3"));
  const auto& events = doc.at("traceEvents");

  std::vector<nlohmann::json> complete;
  std::map<int, std::string> thread_names;
  std::string process;
  for (const auto& e : events) {
    if (e.at("ph") == "X") complete.push_back(e);
    if (e.at("ph") == "M" && e.at("name") == "thread_name") thread_names[e.at("tid").get<int>()] = e.at("args").at("name");
    if (e.at("ph") == "M" && e.at("name") == "process_name") process = e.at("args").at("name");
  }
  CHECK(process == "rank 3");
  CHECK(thread_names == std::map<int, std::string>{{0, "compute"}, {1, "comm:dp"}});
  REQUIRE(complete.size() == f.g.size());

  SECTION("each event carries the task's kind, times and attributes") {
    std::vector<int> seen(f.g.size(), 0);
    for (const auto& e : complete) {
      const auto id = e.at("args").at("task").get<std::size_t>();
      REQUIRE(id < f.g.size());
      ++seen[id];
      const auto& t = f.g.tasks[id];
      CHECK(e.at("name") == t.name);
      CHECK(e.at("cat") == std::string(ir::to_string(t.kind)));
      CHECK(e.at("tid") == t.stream);
      CHECK(e.at("ts").get<double>() == f.r.start_us[id]);
      CHECK(e.at("dur").get<double>() == f.r.end_us[id] - f.r.start_us[id]);
      CHECK(e.at("args").at("flops").get<double>() == t.flops);
      CHECK(e.at("args").at("bytes").get<double>() == t.bytes);
      CHECK(e.at("args").at("phase") == std::string(ir::to_string(t.step_phase)));
      CHECK(e.at("args").at("layer") == t.layer);
    }
    CHECK(seen == std::vector<int>(f.g.size(), 1));
  }
  SECTION("hand-checked values of the all-reduce") {
    const auto& ar = *std::find_if(complete.begin(), complete.end(), [](auto& e) { return e.at("name") == "w.grad.ar"; });
    CHECK(ar.at("cat") == "all_reduce");
    CHECK(ar.at("ts") == 4.0);
    CHECK(ar.at("dur") == 6.0);
    CHECK(ar.at("args").at("bytes") == 256.0);
    CHECK(ar.at("args").at("phase") == "backward");
    CHECK(ar.at("args").at("layer") == 3);
  }
  SECTION("names that need JSON escaping survive") {
    CHECK(doc.at("otherData").at("graph") == "tiny \"mlp\"");
    CHECK(std::any_of(complete.begin(), complete.end(), [](auto& e) { return e.at("name") == "a<b&c"; }));
    CHECK(doc.at("otherData").at("exposed_comm_us") == 6.0);
  }
}

TEST_CASE("the SVG Gantt chart has one rectangle per task and escapes text", "[trace][svg]") {
  const fixture f;
  const auto svg = trace::svg_gantt(f.g, f.r);

  CHECK_THAT(svg, StartsWith("<svg"));
  CHECK_THAT(svg, EndsWith("</svg>\n"));
  CHECK(count(svg, "<rect class=\"task\"") == f.g.size());
  CHECK(count(svg, "<svg") == 1);

  SECTION("it is well formed: every element closed, groups balanced") {
    CHECK(count(svg, "<g") == count(svg, "</g>"));
    CHECK(count(svg, "<title>") == count(svg, "</title>"));
    CHECK(count(svg, "<text") == count(svg, "</text>"));
    CHECK(count(svg, "<rect") == count(svg, "</rect>") + count(svg, "\"/>\n") - count(svg, "<line"));
  }
  SECTION("text is XML-escaped") {
    CHECK(svg.find("a<b&c") == std::string::npos);
    CHECK_THAT(svg, ContainsSubstring("a&lt;b&amp;c"));
    CHECK_THAT(svg, ContainsSubstring("tiny &quot;mlp&quot;"));
    CHECK(count(svg, "&") == count(svg, "&amp;") + count(svg, "&lt;") + count(svg, "&gt;") + count(svg, "&quot;") +
                                 count(svg, "&apos;"));
  }
  SECTION("tooltips give the name and times") {
    CHECK_THAT(svg, ContainsSubstring("<title>w.grad.ar (all_reduce, task 1)\n4.000 - 10.000 us (6.000 us)</title>"));
  }
  SECTION("the axis ticks are in ms: a 15 us step gets ticks every 0.002 ms") {
    CHECK_THAT(svg, ContainsSubstring(">0.000 ms<"));
    CHECK_THAT(svg, ContainsSubstring(">0.014 ms<"));
    CHECK(svg.find(">0.016 ms<") == std::string::npos);
  }
  SECTION("the legend names the kinds present and the exposed communication") {
    for (const auto* kind : {"matmul", "all_reduce", "optimizer_update", "elementwise", "exposed communication"})
      CHECK_THAT(svg, ContainsSubstring(std::string(">") + kind + "</text>"));
    CHECK(svg.find(">softmax</text>") == std::string::npos);
  }
  SECTION("exposed communication is highlighted: under its lane and in its own row") {
    // The all-reduce (4-10 us) runs while compute is idle: one strip under the lane, one in the row.
    CHECK(count(svg, "<rect class=\"exposed\"") == 2);
    CHECK_THAT(svg, ContainsSubstring("<title>exposed 4.000 - 10.000 us</title>"));
    trace::svg_options plain;
    plain.show_exposed = false;
    CHECK(count(trace::svg_gantt(f.g, f.r, plain), "class=\"exposed\"") == 0);
  }
}

TEST_CASE("trace writers reject a result of another graph", "[trace][errors]") {
  const fixture f;
  auto other = f.g;
  other.tasks.pop_back();
  CHECK_THROWS_WITH(trace::chrome_trace(other, f.r), ContainsSubstring("chrome_trace") && ContainsSubstring("4 timeline"));
  CHECK_THROWS_WITH(trace::svg_gantt(other, f.r), ContainsSubstring("svg_gantt") && ContainsSubstring("3 tasks"));
}

namespace {
std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
} // namespace

TEST_CASE("write_file_atomically replaces a file whole and leaves no temporary behind", "[core][file]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("concerto_file_test_" + std::to_string(std::random_device{}()));
  fs::remove_all(dir);
  const auto path = dir / "nested" / "plan.json";

  SECTION("it creates missing directories, then overwrites") {
    write_file_atomically(path, "first version, longer than the second");
    CHECK(slurp(path) == "first version, longer than the second");
    write_file_atomically(path, std::string_view("second\0bytes", 12));
    CHECK(slurp(path) == std::string("second\0bytes", 12));
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path.parent_path())) names.push_back(entry.path().filename());
    CHECK(names == std::vector<std::string>{"plan.json"});
  }
  SECTION("a path it cannot write is named in the error") {
    write_file_atomically(dir / "blocker", "a file where a directory should be");
    CHECK_THROWS_WITH(write_file_atomically(dir / "blocker" / "plan.json", "x"), ContainsSubstring("blocker"));
    CHECK_THROWS_AS(write_file_atomically(dir / "blocker" / "plan.json", "x"), concerto::error);
  }
  fs::remove_all(dir);
}
