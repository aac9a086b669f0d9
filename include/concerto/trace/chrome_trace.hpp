#pragma once
/// @file
/// @brief A timeline as Chrome trace-event JSON, which chrome://tracing and Perfetto
/// (ui.perfetto.dev) open: one process, one thread per stream, one complete ("X") event per task.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/trace/detail/check.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace concerto::trace {

/// @brief Chrome trace-event JSON of a simulated (or measured) timeline. Times are in
/// microseconds, the format's unit. Each event carries `cat` = the op kind and `args` with the
/// task id, flops, bytes, phase, layer and function; `otherData` holds the step summary.
/// @code
/// concerto::write_file_atomically("step.trace.json", trace::chrome_trace(g, sim::simulate(g, order, d)));
/// @endcode
[[nodiscard]] inline std::string chrome_trace(const ir::graph& g, const sim::result& r,
                                              std::string_view process_name = "rank 0") {
  detail::check_matches(g, r, "chrome_trace");
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", std::string(process_name)}}}});
  for (std::size_t s = 0; s < g.streams.size(); ++s) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", s},
                      {"args", {{"name", g.streams[s].name}}}});
    // Keeps the compute stream on top and the lanes in graph order, whatever the viewer's default.
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", s},
                      {"args", {{"sort_index", s}}}});
  }
  for (const auto& iv : r.timeline) {
    const auto& t = g.tasks[static_cast<std::size_t>(iv.task)];
    json args = {{"task", t.id},
                 {"flops", t.flops},
                 {"bytes", t.bytes},
                 {"phase", ir::to_string(t.step_phase)},
                 {"layer", t.layer}};
    if (t.fn != ir::op::none) args["fn"] = ir::to_string(t.fn);
    events.push_back({{"name", t.name},
                      {"cat", ir::to_string(t.kind)},
                      {"ph", "X"},
                      {"ts", iv.start_us},
                      {"dur", iv.end_us - iv.start_us},
                      {"pid", 0},
                      {"tid", iv.stream},
                      {"args", std::move(args)}});
  }
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"graph", g.name}, {"step_us", r.step_us}, {"exposed_comm_us", r.exposed_comm_us}}}};
  return doc.dump() + "\n";
}

} // namespace concerto::trace
