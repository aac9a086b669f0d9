#include <concerto/ir/builder.hpp>
#include <concerto/ir/json.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::StartsWith;
using nlohmann::json;

namespace {

/// A graph with every op kind, views, attrs, several dtypes, roles, phases and layers.
ir::graph every_kind_graph() {
  ir::builder b("every-kind");
  b.cost_only(); // every kind and field, not operands any kernel takes
  const int dp = b.axis("dp", 4, ir::link_class::inter_node);
  const int tp = b.axis("tp", 2);
  const auto x = b.buffer("x", {8, 16}, ir::buffer_role::input, ir::dtype::bf16);
  const auto w = b.buffer("w", {16, 16}, ir::buffer_role::param);
  const auto y = b.buffer("y", {8, 16});
  const auto lo = b.view("y.lo", y, 0, 256, {4, 16});
  const auto hi = b.view("y.hi", y, 256, 256, {4, 16});
  const auto g = b.buffer("w.grad", {16, 16}, ir::buffer_role::gradient);
  const auto m = b.buffer("w.m", {16, 16}, ir::buffer_role::optimizer_state);
  const auto ws = b.buffer("ws", {64}, ir::buffer_role::workspace, ir::dtype::i32);
  const auto ids = b.buffer("ids", {8}, ir::buffer_role::input, ir::dtype::i64);
  const auto h = b.buffer("h", {8, 16}, ir::buffer_role::activation, ir::dtype::f16);
  b.at(ir::phase::forward, 0);
  b.matmul("fc", x, w, y, 8, 16, 16, 1, false, true);
  b.compute(ir::op_kind::elementwise, "gelu", {lo}, {lo}, {.fn = ir::op::gelu});
  b.compute(ir::op_kind::norm, "ln", {hi}, {hi}, {.fn = ir::op::layernorm, .attrs = {{"dim", 16}}});
  b.compute(ir::op_kind::softmax, "sm", {y}, {h}, {.fn = ir::op::softmax});
  b.compute(ir::op_kind::attention, "attn", {h}, {h},
            {.fn = ir::op::attention, .flops = 1e6, .attrs = {{"heads", 2}, {"seq", 8}, {"head_dim", 8}, {"causal", 1}}});
  b.compute(ir::op_kind::loss, "ce", {h, ids}, {ws}, {.fn = ir::op::cross_entropy, .bytes = 12.5});
  b.at(ir::phase::backward, 0);
  b.compute(ir::op_kind::copy, "copy", {y}, {h}, {.fn = ir::op::copy});
  b.compute(ir::op_kind::slice, "slice", {h}, {lo}, {.attrs = {{"offset", 0}, {"length", 4}}});
  b.compute(ir::op_kind::concat, "concat", {lo, hi}, {y});
  b.collective(ir::op_kind::all_reduce, "g.ar", dp, g, g);
  b.collective(ir::op_kind::all_gather, "y.ag", tp, lo, y);
  b.collective(ir::op_kind::reduce_scatter, "y.rs", tp, y, hi, 1024);
  b.collective(ir::op_kind::all_to_all, "h.a2a", tp, h, h);
  b.collective(ir::op_kind::send, "h.send", dp, h, h);
  b.collective(ir::op_kind::recv, "h.recv", dp, h, h);
  b.collective(ir::op_kind::broadcast, "w.bcast", dp, w, w);
  b.at(ir::phase::optimizer);
  b.compute(ir::op_kind::optimizer_update, "adamw", {g, m, w}, {w, m}, {.fn = ir::op::adamw});
  return std::move(b).finish();
}

json minimal_task(std::string name, std::string kind) { return {{"name", std::move(name)}, {"kind", std::move(kind)}}; }

} // namespace

TEST_CASE("a graph survives a JSON round trip unchanged", "[ir][json]") {
  const auto g = every_kind_graph();
  std::set<ir::op_kind> kinds;
  for (const auto& t : g.tasks) kinds.insert(t.kind);
  REQUIRE(kinds.size() == static_cast<std::size_t>(ir::op_kind_count)); // the fixture really has every kind

  const auto doc = ir::to_json(g);
  SECTION("through the JSON value") { CHECK(ir::graph_from_json(doc) == g); }
  SECTION("through text, compact and indented") {
    CHECK(ir::graph_from_json_text(doc.dump()) == g);
    CHECK(ir::graph_from_json_text(doc.dump(2)) == g);
  }
  SECTION("the document carries the schema tag and every task field") {
    CHECK(doc["schema"] == "concerto.graph/1");
    const auto& fc = doc["tasks"][0];
    for (const auto* key : {"id", "name", "kind", "stream", "flops", "bytes", "reads", "writes", "deps", "fn",
                            "attrs", "axis", "phase", "layer"})
      CHECK(fc.contains(key));
    CHECK(fc["attrs"]["trans_b"] == 1);
    CHECK(doc["buffers"][3]["view_of"] == 2);
    CHECK(doc["axes"][0]["link"] == "inter_node");
  }
}

TEST_CASE("graphs written by other tools get defaults for what they omit", "[ir][json]") {
  json doc = {{"name", "foreign"},
              {"cost_only", true},
              {"axes", {{{"name", "dp"}, {"size", 8}}, {{"name", "tp"}, {"size", 2}, {"link", "intra_node"}}}},
              {"buffers", {{{"name", "x"}, {"shape", {4, 8}}}, {{"name", "w"}, {"bytes", 64}, {"role", "param"}}}},
              {"tasks",
               {{{"name", "fc"}, {"kind", "matmul"}, {"reads", {0, 1}}, {"writes", {0}}, {"flops", 1e9}},
                {{"name", "ar"}, {"kind", "all_reduce"}, {"axis", "tp"}, {"deps", {0}}},
                {{"name", "ag"}, {"kind", "all_gather"}, {"axis", 0}, {"bytes", 1.5e6}},
                {{"name", "rs"}, {"kind", "reduce_scatter"}, {"stream", "comm:dp"}},
                {{"name", "upd"}, {"kind", "optimizer_update"}, {"phase", "optimizer"}, {"attrs", {{"fused", true}}}}}}};
  const auto g = ir::graph_from_json(doc);

  SECTION("streams are derived from the axes") {
    REQUIRE(g.streams.size() == 3);
    CHECK(g.streams[0] == ir::stream{"compute", -1});
    CHECK(g.streams[1] == ir::stream{"comm:dp", 0});
    CHECK(g.streams[2] == ir::stream{"comm:tp", 1});
    CHECK(g.axes[0].link == ir::link_class::intra_node);
  }
  SECTION("compute tasks go to the compute stream, collectives to their axis lane") {
    CHECK(g[0].stream == ir::compute_stream);
    CHECK(g[0].axis == -1);
    CHECK(g[1].axis == 1);
    CHECK(g[1].stream == 2); // axis given by name
    CHECK(g[2].stream == 1); // axis given by index
    CHECK(g[3].axis == 0);   // axis implied by the named stream
  }
  SECTION("scalar fields take their documented defaults") {
    CHECK(g[0].flops == 1e9);
    CHECK(g[0].step_phase == ir::phase::forward);
    CHECK(g[0].layer == -1);
    CHECK(g[0].fn == ir::op::none);
    CHECK(g[1].fn == ir::op::sum);  // a reducing collective without fn sums
    CHECK(g[2].fn == ir::op::none); // an all-gather has no reduction
    CHECK(g[2].bytes == 1.5e6);
    CHECK(g[4].step_phase == ir::phase::optimizer);
    CHECK(g[4].attr("fused") == 1);
  }
  SECTION("buffer sizes follow from shape and dtype") {
    CHECK(g.buffers[0].bytes == 4 * 8 * 4);
    CHECK(g.buffers[0].role == ir::buffer_role::activation);
    CHECK(g.buffers[1].bytes == 64);
    CHECK(g.buffers[1].view_of == -1);
  }
  SECTION("explicit streams may name their axis or imply it by name") {
    doc["streams"] = {{{"name", "compute"}}, {{"name", "comm:dp"}}, {{"name", "tp-lane"}, {"axis", "tp"}}};
    const auto h = ir::graph_from_json(doc);
    CHECK(h.streams[1].axis == 0);
    CHECK(h.streams[2].axis == 1);
    CHECK(h[1].stream == 2);
  }
  SECTION("ids may come in any order") {
    doc["tasks"] = {{{"id", 1}, {"name", "second"}, {"kind", "copy"}, {"deps", {0}}},
                    {{"id", 0}, {"name", "first"}, {"kind", "copy"}}};
    const auto h = ir::graph_from_json(doc);
    CHECK(h[0].name == "first");
    CHECK(h[1].deps == std::vector<ir::task_id>{0});
  }
}

TEST_CASE("malformed graphs are rejected with a message naming the culprit", "[ir][json][errors]") {
  json doc = {{"name", "bad"},
              {"cost_only", true},
              {"axes", {{{"name", "dp"}, {"size", 2}}}},
              {"buffers", {{{"name", "x"}, {"bytes", 16}}}},
              {"tasks",
               {minimal_task("a", "matmul"), minimal_task("fc0", "matmul"), minimal_task("fc.ar", "all_reduce"),
                minimal_task("fc1", "matmul")}}};
  doc["tasks"][2]["axis"] = "dp";
  REQUIRE_NOTHROW(ir::graph_from_json(doc)); // each section breaks exactly one thing

  SECTION("an unknown kind lists the valid ones") {
    doc["tasks"][3]["kind"] = "matmult";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1'") &&
                                                    ContainsSubstring("unknown kind 'matmult'") &&
                                                    ContainsSubstring("valid kinds: matmul, elementwise") &&
                                                    ContainsSubstring("broadcast"));
  }
  SECTION("a missing kind") {
    doc["tasks"][1].erase("kind");
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 1 'fc0': field 'kind' is required"));
  }
  SECTION("a dangling dependency") {
    doc["tasks"][3]["deps"] = {0, 7};
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1'") &&
                                                    ContainsSubstring("dependency 7 does not exist"));
  }
  SECTION("a cycle") {
    doc["tasks"][0]["deps"] = {3};
    doc["tasks"][3]["deps"] = {1};
    doc["tasks"][1]["deps"] = {0};
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("cycle") && ContainsSubstring("task"));
  }
  SECTION("negative sizes") {
    doc["tasks"][3]["flops"] = -5;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1': field 'flops' is negative"));
    doc["tasks"][3]["flops"] = 5;
    doc["buffers"][0]["bytes"] = -16;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("buffer 0 'x': field 'bytes' is negative"));
    doc["buffers"][0]["bytes"] = 16;
    doc["axes"][0]["size"] = 0;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("mesh axis 0 'dp': field 'size' must be at least 1"));
  }
  SECTION("wrong types name the field and the expected type") {
    doc["tasks"][3]["flops"] = "many";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1': field 'flops' must be a number") &&
                                                    ContainsSubstring("got string"));
    doc["tasks"][3]["flops"] = 1;
    doc["tasks"][3]["deps"] = "0";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1': field 'deps' must be an array"));
    doc["tasks"][3]["deps"] = {0.5};
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3 'fc1': field 'deps' must be an integer (got number 0.5)"));
    doc["tasks"][3]["deps"] = json::array();
    doc["tasks"][3]["attrs"] = {{"m", "big"}};
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("field 'attrs.m' must be an integer"));
    doc["tasks"][3]["attrs"] = json::object();
    doc["tasks"][3]["name"] = 3;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 3: field 'name' must be a string"));
  }
  SECTION("a task that is not an object") {
    doc["tasks"][2] = 42;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task at index 2 must be a JSON object"));
  }
  SECTION("a collective without an axis, or with an unknown one") {
    doc["tasks"][2].erase("axis");
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 2 'fc.ar'") && ContainsSubstring("needs field 'axis'"));
    doc["tasks"][2]["axis"] = "pp";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("names mesh axis 'pp', which does not exist (axes: dp)"));
    doc["tasks"][2]["axis"] = 3;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 2 'fc.ar': field 'axis' is 3"));
  }
  SECTION("an unknown stream, or a kind on the wrong stream") {
    doc["tasks"][1]["stream"] = "comm:pp";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 1 'fc0'") &&
                                                    ContainsSubstring("stream 'comm:pp', which does not exist"));
    doc["tasks"][1]["stream"] = "comm:dp";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 1 'fc0'") &&
                                                    ContainsSubstring("compute task on communication stream"));
  }
  SECTION("a buffer that does not exist") {
    doc["tasks"][0]["reads"] = {4};
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("task 0 'a': field 'reads' names buffer 4"));
  }
  SECTION("duplicate ids") {
    doc["tasks"][1]["id"] = 0;
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("id 0 is used by two tasks"));
  }
  SECTION("a foreign schema") {
    doc["schema"] = "concerto.graph/9";
    CHECK_THROWS_WITH(ir::graph_from_json(doc), ContainsSubstring("unsupported schema 'concerto.graph/9'"));
  }
  SECTION("a document that is not an object") {
    CHECK_THROWS_WITH(ir::graph_from_json(json::array()), ContainsSubstring("must be a JSON object"));
  }
  SECTION("two streams of one name") {
    doc["streams"] = {{{"name", "compute"}}, {{"name", "comm:dp"}, {"axis", "dp"}}, {{"name", "comm:dp"}, {"axis", "dp"}}};
    CHECK_THROWS_WITH(ir::graph_from_json(doc),
                      ContainsSubstring("stream 2: name 'comm:dp' is already stream 1's; stream names must differ"));
  }
  SECTION("a value nested 100,000 levels deep in a typed field is refused, not a crash") {
    std::string text = "{\"name\": \"deep\", \"tasks\": [{\"name\": \"t\", \"kind\": \"matmul\", \"flops\": ";
    text += std::string(100000, '[') + std::string(100000, ']') + "}]}";
    CHECK_THROWS_WITH(ir::graph_from_json_text(text),
                      ContainsSubstring("task 0 't': field 'flops' must be a number (got array [[[[...]]]])"));
  }
  SECTION("a number past a double's range is refused by the library, not the JSON parser") {
    const std::string text = "{\"name\": \"huge\", \"tasks\": [{\"name\": \"t\", \"kind\": \"matmul\", \"flops\": 1e400}]}";
    CHECK_THROWS_WITH(ir::graph_from_json_text(text), StartsWith("concerto: graph JSON: ") && ContainsSubstring("1e400"));
  }
  SECTION("JSON syntax errors report the parser's position") {
    CHECK_THROWS_WITH(ir::graph_from_json_text("{\"tasks\": [\n  {\"kind\": }]}"),
                      ContainsSubstring("syntax error") && ContainsSubstring("line 2, column"));
    CHECK_THROWS_AS(ir::graph_from_json_text(""), concerto::error);
  }
}

TEST_CASE("random corruption of a graph document never escapes as anything but concerto::error",
          "[ir][json][errors][property]") {
  const auto base = ir::to_json(every_kind_graph());
  std::mt19937 rng(2024);
  const std::vector<json> junk = {nullptr, -1, 0, 3, 1e300, -2.5, "x", "dp", true, json::array(), json::object(),
                                  json::array({1, "a"}), json::object({{"k", 1}}), 18446744073709551615ULL};
  const std::vector<std::string> task_keys = {"id", "name", "kind", "stream", "flops", "bytes", "reads", "writes",
                                              "deps", "fn", "attrs", "axis", "phase", "layer"};
  const std::vector<std::string> buffer_keys = {"id", "name", "bytes", "dtype", "role", "shape", "view_of", "offset"};
  int rejected = 0, accepted = 0;
  for (int trial = 0; trial < 400; ++trial) {
    auto doc = base;
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      const auto& value = junk[rng() % junk.size()];
      if (rng() % 3 == 0) {
        auto& b = doc["buffers"][rng() % doc["buffers"].size()];
        b[buffer_keys[rng() % buffer_keys.size()]] = value;
      } else {
        auto& t = doc["tasks"][rng() % doc["tasks"].size()];
        t[task_keys[rng() % task_keys.size()]] = value;
      }
    }
    try {
      (void)ir::graph_from_json(doc);
      ++accepted;
    } catch (const concerto::error& e) {
      CHECK(std::string(e.what()).starts_with("concerto: graph"));
      ++rejected;
    }
  }
  CHECK(rejected > 200);
  CHECK(accepted > 0); // null fields fall back to defaults, so some corruptions are harmless
}

TEST_CASE("the example in docs/graph-schema.md reads as documented", "[ir][json][docs]") {
  const auto path = std::filesystem::path(__FILE__).parent_path() / "../../docs/graph-schema.md";
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const auto doc = text.str();
  const auto from = doc.find("```json", doc.find("## A complete example"));
  REQUIRE(from != std::string::npos);
  const auto body = from + 7;
  const auto g = ir::graph_from_json_text(std::string_view(doc).substr(body, doc.find("```", body) - body));
  CHECK(g.name == "linear-dp");
  REQUIRE(g.streams.size() == 2);
  CHECK(g.streams[1].name == "comm:dp");
  CHECK(g[2].stream == 1);
  CHECK(g[0].stream == ir::compute_stream);
  CHECK(g.buffers[0].bytes == 1048576);
  CHECK(g.buffers[4].view_of == 3);
  CHECK(g[1].attr("trans_a") == 1);
  CHECK(ir::graph_from_json(ir::to_json(g)) == g);
}
