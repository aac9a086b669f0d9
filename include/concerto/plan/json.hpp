#pragma once
/// @file
/// @brief JSON form of a plan (schema "concerto.plan/1", see docs/plan-schema.md).
///
/// The document carries a flat task summary (id, name, kind, stream, start, duration, deps)
/// and the per-stream orders, so that a person or a script can check the schedule without the
/// library, plus the full graph under "graph" for executors. Reading takes the graph, the
/// orders and the times; the summary's other fields must agree with the graph.

#include <concerto/ir/json.hpp>
#include <concerto/plan/plan.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::plan {

/// @brief The plan as JSON.
/// @code
/// std::ofstream("step.plan.json") << plan::to_json(p).dump(1);
/// @endcode
[[nodiscard]] inline nlohmann::json to_json(const plan& p) {
  using nlohmann::json;
  const auto& g = p.graph;
  const auto stream_name = [&](ir::stream_id s) -> json {
    if (s >= 0 && static_cast<std::size_t>(s) < g.streams.size()) return g.streams[static_cast<std::size_t>(s)].name;
    return s; // an invalid plan is still written, so that it can be inspected
  };
  const auto at = [](const std::vector<double>& v, std::size_t i) -> json {
    if (i < v.size()) return v[i];
    return nullptr;
  };
  json tasks = json::array();
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    const auto& t = g.tasks[i];
    tasks.push_back({{"id", t.id},
                     {"name", t.name},
                     {"kind", ir::to_string(t.kind)},
                     {"stream", stream_name(t.stream)},
                     {"start_us", at(p.start_us, i)},
                     {"duration_us", at(p.duration_us, i)},
                     {"deps", t.deps}});
  }
  json streams = json::array();
  for (std::size_t s = 0; s < p.order.size(); ++s)
    streams.push_back({{"name", s < g.streams.size() ? json(g.streams[s].name) : json(nullptr)}, {"order", p.order[s]}});
  return {{"schema", "concerto.plan/1"},
          {"policy", p.policy},
          {"preset", p.preset},
          {"step_us", p.step_us()},
          {"stats",
           {{"plan_seconds", p.stats.plan_seconds},
            {"lower_bound_us", p.stats.lower_bound_us},
            {"windows_total", p.stats.windows_total},
            {"windows_optimal", p.stats.windows_optimal}}},
          {"tasks", std::move(tasks)},
          {"streams", std::move(streams)},
          {"graph", ir::to_json(g)}};
}

namespace detail {

inline void read_times(plan& p, const nlohmann::json& doc) {
  namespace jd = ir::detail;
  const auto& g = p.graph;
  const auto* tasks = jd::array_field(doc, "tasks", "plan JSON");
  if (!tasks) fail("plan JSON: field 'tasks' is required (start_us and duration_us of every task)");
  const auto n = g.tasks.size();
  if (tasks->size() != n)
    fail("plan JSON: 'tasks' lists " + std::to_string(tasks->size()) + " tasks, but the graph has " +
         std::to_string(n));
  p.start_us.assign(n, 0.0);
  p.duration_us.assign(n, 0.0);
  std::vector<bool> seen(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    const auto& j = (*tasks)[i];
    const auto at = "plan JSON: 'tasks' entry " + std::to_string(i);
    jd::require_object(j, at);
    const auto* idv = jd::find_field(j, "id");
    if (!idv) fail(at + ": field 'id' is required");
    const auto id = jd::to_integer(*idv, at, "id");
    if (id < 0 || static_cast<std::size_t>(id) >= n) fail(at + ": task " + std::to_string(id) + " is not in the graph");
    const auto k = static_cast<std::size_t>(id);
    if (seen[k]) fail(at + ": task " + std::to_string(id) + " is listed twice");
    seen[k] = true;
    const auto& t = g.tasks[k];
    const auto who = "plan JSON: task " + std::to_string(id) + " '" + t.name + "'";
    for (const auto* key : {"start_us", "duration_us"}) {
      const auto* v = jd::find_field(j, key);
      if (!v) fail(who + ": field '" + key + "' is required");
      (std::string_view(key) == "start_us" ? p.start_us : p.duration_us)[k] = jd::to_number(*v, who, key);
    }
    // The summary is for readers; one that disagrees with the graph was edited by hand.
    if (const auto name = jd::string_field(j, "name", who, t.name); name != t.name)
      fail(who + ": the summary calls it '" + name + "'");
    if (const auto kind = jd::string_field(j, "kind", who, std::string(ir::to_string(t.kind)));
        kind != ir::to_string(t.kind))
      fail(who + ": the summary says kind '" + kind + "', the graph says '" + std::string(ir::to_string(t.kind)) + "'");
    if (jd::find_field(j, "deps")) {
      const auto deps = jd::integer_list(j, "deps", who);
      if (!std::equal(deps.begin(), deps.end(), t.deps.begin(), t.deps.end()))
        fail(who + ": the summary's 'deps' differ from the graph's");
    }
    if (const auto* s = jd::find_field(j, "stream"); s && ir::detail::stream_ref(g, *s, who) != t.stream)
      fail(who + ": the summary puts it on another stream than the graph does");
  }
}

inline void read_orders(plan& p, const nlohmann::json& doc) {
  namespace jd = ir::detail;
  const auto& g = p.graph;
  const auto* streams = jd::array_field(doc, "streams", "plan JSON");
  if (!streams) fail("plan JSON: field 'streams' is required (the task order of every stream)");
  if (streams->size() != g.streams.size())
    fail("plan JSON: 'streams' lists " + std::to_string(streams->size()) + " streams, but the graph has " +
         std::to_string(g.streams.size()));
  p.order.assign(g.streams.size(), {});
  std::vector<bool> seen(g.streams.size(), false);
  for (std::size_t i = 0; i < streams->size(); ++i) {
    const auto& s = (*streams)[i];
    const auto at = "plan JSON: 'streams' entry " + std::to_string(i);
    jd::require_object(s, at);
    // Matched by name when named, so that a tool may list the streams in any order.
    std::size_t k = i;
    if (const auto* name = jd::find_field(s, "name")) k = static_cast<std::size_t>(jd::stream_ref(g, *name, at));
    if (seen[k]) fail(at + ": stream '" + g.streams[k].name + "' is listed twice");
    seen[k] = true;
    const auto who = "plan JSON: stream '" + g.streams[k].name + "'";
    const auto* order = jd::array_field(s, "order", who);
    if (!order) fail(who + ": field 'order' is required");
    for (const auto id : jd::integer_list(s, "order", who)) {
      if (id < 0 || static_cast<std::size_t>(id) >= g.tasks.size())
        fail(who + ": 'order' names task " + std::to_string(id) + ", which is not in the graph");
      p.order[k].push_back(static_cast<ir::task_id>(id));
    }
  }
}

} // namespace detail

/// @brief Reads a plan; throws concerto::error naming the offending task, stream or field.
/// Structure is checked here; whether the schedule is sound is plan::verify's job.
[[nodiscard]] inline plan plan_from_json(const nlohmann::json& doc) {
  namespace jd = ir::detail;
  try {
    jd::require_object(doc, "plan JSON");
    const auto schema = jd::string_field(doc, "schema", "plan JSON", "concerto.plan/1");
    if (schema != "concerto.plan/1")
      fail("plan JSON: unsupported schema '" + schema + "' (this library reads 'concerto.plan/1')");
    const auto* graph = jd::find_field(doc, "graph");
    if (!graph) fail("plan JSON: field 'graph' is required");
    plan p;
    p.graph = ir::graph_from_json(*graph);
    p.policy = jd::string_field(doc, "policy", "plan JSON");
    p.preset = jd::string_field(doc, "preset", "plan JSON");
    if (const auto* stats = jd::find_field(doc, "stats")) {
      jd::require_object(*stats, "plan JSON: field 'stats'");
      const std::string at = "plan JSON: stats";
      p.stats.plan_seconds = jd::number_field(*stats, "plan_seconds", at, 0);
      p.stats.lower_bound_us = jd::number_field(*stats, "lower_bound_us", at, 0);
      p.stats.windows_total = jd::int_field(*stats, "windows_total", at, 0);
      p.stats.windows_optimal = jd::int_field(*stats, "windows_optimal", at, 0);
    }
    detail::read_orders(p, doc);
    detail::read_times(p, doc);
    return p;
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("plan JSON: ") + e.what());
  }
}

/// @brief Parses JSON text and reads a plan; a syntax error reports the parser's position.
[[nodiscard]] inline plan plan_from_json_text(std::string_view text) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    fail("plan JSON: syntax error at byte " + std::to_string(e.byte) + ": " + e.what());
  } catch (const nlohmann::json::exception& e) { // e.g. a number past a double's range (1e400)
    fail(std::string("plan JSON: cannot be read: ") + e.what());
  }
  return plan_from_json(doc);
}

} // namespace concerto::plan
