#pragma once
/// @file
/// @brief A timeline as a self-contained SVG Gantt chart: one row per stream, one rectangle per
/// task coloured by op kind, a time axis in milliseconds, a legend, tooltips, and the exposed
/// communication (a collective running while compute is idle) marked in red.

#include <concerto/core/intervals.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/trace/detail/check.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace concerto::trace {

/// @brief Layout of svg_gantt.
struct svg_options {
  double width_px = 1200;       ///< whole picture
  double row_height_px = 28;    ///< one stream
  double label_width_px = 150;  ///< stream names on the left
  std::string title;            ///< empty: "<graph name>: step <t> ms, exposed communication <t> ms"
  bool show_exposed = true;     ///< mark exposed communication under each lane and in its own row
  bool label_tasks = true;      ///< write a task's name inside its rectangle when it fits
};

namespace detail {

inline void append_escaped(std::string& out, std::string_view text) {
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
}

inline std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  append_escaped(out, text);
  return out;
}

inline std::string fixed(double v, int decimals = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

/// Compute kinds in blues and greens, collectives in warm colours: a lane's colour says at a
/// glance which collective it is. Indexed by ir::op_kind.
inline constexpr std::array<std::string_view, ir::op_kind_count> kind_colours = {
    "#1f77b4", // matmul
    "#6baed6", // elementwise
    "#17becf", // norm
    "#2ca02c", // softmax
    "#98df8a", // attention
    "#8c564b", // loss
    "#7f7f7f", // optimizer_update
    "#c7c7c7", // copy
    "#bcbd22", // slice
    "#dbdb8d", // concat
    "#ff7f0e", // all_reduce
    "#9467bd", // all_gather
    "#e377c2", // reduce_scatter
    "#d4a017", // all_to_all
    "#f7b6d2", // send
    "#c5b0d5", // recv
    "#ffbb78", // broadcast
};

inline constexpr std::string_view exposed_colour = "#d62728";

/// Tick spacing of 1, 2 or 5 × 10^k ms giving about eight ticks.
inline double tick_step_ms(double span_ms) {
  if (!(span_ms > 0)) return 1;
  const double raw = span_ms / 8;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

} // namespace detail

/// @brief An SVG Gantt chart of a timeline; open it in any browser. Every task is one
/// `<rect class="task">` with a `<title>` tooltip (name, kind, start, end); exposed
/// communication is drawn as `<rect class="exposed">`. Text is XML-escaped.
/// @code
/// concerto::write_file_atomically("step.svg", trace::svg_gantt(g, sim::simulate(g, order, d, 1.2)));
/// @endcode
[[nodiscard]] inline std::string svg_gantt(const ir::graph& g, const sim::result& r, svg_options options = {}) {
  detail::check_matches(g, r, "svg_gantt");
  using detail::fixed;
  const std::size_t streams = g.streams.size();
  const double row_h = std::max(options.row_height_px, 8.0);
  const double left = std::max(options.label_width_px, 0.0);
  const double right_margin = 24;
  const double plot_w = std::max(options.width_px - left - right_margin, 100.0);
  const double width = left + plot_w + right_margin;
  const double top = 34;

  // Exposed spans: per lane, its busy time minus compute busy time; overall, the union of lanes.
  intervals::span_list compute_busy, comm_busy;
  std::vector<intervals::span_list> lane_busy(streams);
  for (const auto& iv : r.timeline) {
    const auto s = static_cast<std::size_t>(iv.stream);
    (g.streams[s].is_compute() ? compute_busy : comm_busy).emplace_back(iv.start_us, iv.end_us);
    lane_busy[s].emplace_back(iv.start_us, iv.end_us);
  }
  compute_busy = intervals::merged(std::move(compute_busy));
  const auto exposed_all = intervals::minus(intervals::merged(std::move(comm_busy)), compute_busy);

  const std::size_t rows = streams + (options.show_exposed ? 1 : 0);
  const double axis_y = top + static_cast<double>(rows) * row_h;

  std::array<bool, ir::op_kind_count> kind_used{};
  for (const auto& t : g.tasks) kind_used[static_cast<std::size_t>(t.kind)] = true;
  const double legend_item_w = 160;
  const auto per_line = static_cast<std::size_t>(std::max(1.0, std::floor((width - 20) / legend_item_w)));
  std::size_t legend_items = options.show_exposed ? 1 : 0;
  for (const bool used : kind_used) legend_items += used ? 1 : 0;
  const double legend_y = axis_y + 40;
  const double height = legend_y + static_cast<double>((legend_items + per_line - 1) / per_line) * 20 + 10;

  const double span_us = r.step_us > 0 ? r.step_us : 1;
  const double scale = plot_w / span_us;
  const auto x_of = [&](double t_us) { return left + t_us * scale; };

  std::string out;
  out.reserve(512 + r.timeline.size() * 220);
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + fixed(width, 0) + "\" height=\"" + fixed(height, 0) +
         "\" viewBox=\"0 0 " + fixed(width, 0) + " " + fixed(height, 0) +
         "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  out += "<rect class=\"background\" x=\"0\" y=\"0\" width=\"" + fixed(width, 0) + "\" height=\"" + fixed(height, 0) +
         "\" fill=\"white\"/>\n";

  std::string title = options.title;
  if (title.empty())
    title = g.name + ": step " + fixed(r.step_us / 1000, 3) + " ms, exposed communication " +
            fixed(r.exposed_comm_us / 1000, 3) + " ms";
  out += "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">";
  detail::append_escaped(out, title);
  out += "</text>\n";

  // Row backgrounds and labels.
  out += "<g class=\"rows\">\n";
  for (std::size_t row = 0; row < rows; ++row) {
    const double y = top + static_cast<double>(row) * row_h;
    out += "<rect class=\"row\" x=\"" + fixed(left) + "\" y=\"" + fixed(y) + "\" width=\"" + fixed(plot_w) +
           "\" height=\"" + fixed(row_h) + "\" fill=\"" + (row % 2 ? "#ffffff" : "#f4f4f4") + "\"/>\n";
    out += "<text x=\"" + fixed(left - 6) + "\" y=\"" + fixed(y + row_h / 2 + 4) + "\" text-anchor=\"end\">";
    detail::append_escaped(out, row < streams ? std::string_view(g.streams[row].name) : "exposed comm");
    out += "</text>\n";
  }
  out += "</g>\n";

  // Tasks.
  out += "<g class=\"tasks\">\n";
  for (const auto& iv : r.timeline) {
    const auto& t = g.tasks[static_cast<std::size_t>(iv.task)];
    const double x = x_of(iv.start_us);
    const double w = std::max((iv.end_us - iv.start_us) * scale, 0.75); // a zero-length task stays visible
    const double y = top + static_cast<double>(iv.stream) * row_h + 3;
    const double h = row_h - (options.show_exposed ? 10 : 6);
    out += "<rect class=\"task\" x=\"" + fixed(x) + "\" y=\"" + fixed(y) + "\" width=\"" + fixed(w) + "\" height=\"" +
           fixed(h) + "\" fill=\"" + std::string(detail::kind_colours[static_cast<std::size_t>(t.kind)]) +
           "\" stroke=\"#333\" stroke-width=\"0.3\"><title>";
    detail::append_escaped(out, t.name);
    out += " (" + std::string(ir::to_string(t.kind)) + ", task " + std::to_string(t.id) + ")\n" +
           fixed(iv.start_us, 3) + " - " + fixed(iv.end_us, 3) + " us (" + fixed(iv.end_us - iv.start_us, 3) +
           " us)</title></rect>\n";
    if (options.label_tasks && w > 7.0 * static_cast<double>(t.name.size()) + 6) {
      out += "<text x=\"" + fixed(x + 3) + "\" y=\"" + fixed(y + h / 2 + 4) + "\" font-size=\"11\">";
      detail::append_escaped(out, t.name);
      out += "</text>\n";
    }
  }
  out += "</g>\n";

  if (options.show_exposed) {
    out += "<g class=\"exposed\" fill=\"" + std::string(detail::exposed_colour) + "\">\n";
    const auto exposed_rect = [&](double y, double h, double a, double b) {
      out += "<rect class=\"exposed\" x=\"" + fixed(x_of(a)) + "\" y=\"" + fixed(y) + "\" width=\"" +
             fixed(std::max((b - a) * scale, 0.75)) + "\" height=\"" + fixed(h) + "\"><title>exposed " +
             fixed(a, 3) + " - " + fixed(b, 3) + " us</title></rect>\n";
    };
    for (std::size_t s = 0; s < streams; ++s) {
      if (g.streams[s].is_compute()) continue;
      const double y = top + static_cast<double>(s + 1) * row_h - 6;
      for (const auto& [a, b] : intervals::minus(intervals::merged(std::move(lane_busy[s])), compute_busy))
        exposed_rect(y, 4, a, b);
    }
    const double y = top + static_cast<double>(streams) * row_h + 3;
    for (const auto& [a, b] : exposed_all) exposed_rect(y, row_h - 6, a, b);
    out += "</g>\n";
  }

  // Time axis in ms.
  out += "<g class=\"axis\" stroke=\"#333\">\n";
  out += "<line x1=\"" + fixed(left) + "\" y1=\"" + fixed(axis_y) + "\" x2=\"" + fixed(left + plot_w) + "\" y2=\"" +
         fixed(axis_y) + "\"/>\n";
  const double span_ms = r.step_us / 1000;
  const double tick = detail::tick_step_ms(span_ms);
  const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(tick) + 1e-9)));
  for (int k = 0;; ++k) {
    const double t_ms = k * tick;
    if (t_ms > span_ms * (1 + 1e-9) && k > 0) break;
    const double x = x_of(t_ms * 1000);
    out += "<line x1=\"" + fixed(x) + "\" y1=\"" + fixed(axis_y) + "\" x2=\"" + fixed(x) + "\" y2=\"" +
           fixed(axis_y + 5) + "\"/>\n";
    out += "<text x=\"" + fixed(x) + "\" y=\"" + fixed(axis_y + 18) + "\" text-anchor=\"middle\" stroke=\"none\">" +
           fixed(t_ms, decimals) + " ms</text>\n";
    if (k > 1000) break; // a degenerate span cannot make the picture huge
  }
  out += "</g>\n";

  // Legend: the kinds present in the graph.
  out += "<g class=\"legend\">\n";
  std::size_t item = 0;
  const auto legend_entry = [&](std::string_view colour, std::string_view label) {
    const double x = 10 + static_cast<double>(item % per_line) * legend_item_w;
    const double y = legend_y + static_cast<double>(item / per_line) * 20;
    out += "<rect class=\"legend\" x=\"" + fixed(x) + "\" y=\"" + fixed(y - 10) + "\" width=\"12\" height=\"12\" fill=\"" +
           std::string(colour) + "\"/>\n";
    out += "<text x=\"" + fixed(x + 18) + "\" y=\"" + fixed(y) + "\">";
    detail::append_escaped(out, label);
    out += "</text>\n";
    ++item;
  };
  for (int k = 0; k < ir::op_kind_count; ++k)
    if (kind_used[static_cast<std::size_t>(k)])
      legend_entry(detail::kind_colours[static_cast<std::size_t>(k)], ir::to_string(static_cast<ir::op_kind>(k)));
  if (options.show_exposed) legend_entry(detail::exposed_colour, "exposed communication");
  out += "</g>\n";

  out += "</svg>\n";
  return out;
}

} // namespace concerto::trace
