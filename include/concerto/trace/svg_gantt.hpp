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

namespace detail {

// The drawing of one Gantt chart: its geometry from the graph, timeline and options, then each
// layer of the picture in turn.
class gantt_drawing {
public:
  gantt_drawing(const ir::graph& g, const sim::result& r, const svg_options& options)
      : g_(g), r_(r), options_(options), streams_(g.streams.size()) {
    row_h_ = std::max(options.row_height_px, 8.0);
    left_ = std::max(options.label_width_px, 0.0);
    plot_w_ = std::max(options.width_px - left_ - right_margin, 100.0);
    width_ = left_ + plot_w_ + right_margin;
    // Exposed spans: per lane, its busy time minus compute busy time; overall, the union of lanes.
    intervals::span_list comm_busy;
    lane_busy_.resize(streams_);
    for (const auto& iv : r.timeline) {
      const auto s = static_cast<std::size_t>(iv.stream);
      (g.streams[s].is_compute() ? compute_busy_ : comm_busy).emplace_back(iv.start_us, iv.end_us);
      lane_busy_[s].emplace_back(iv.start_us, iv.end_us);
    }
    compute_busy_ = intervals::merged(std::move(compute_busy_));
    exposed_all_ = intervals::minus(intervals::merged(std::move(comm_busy)), compute_busy_);
    rows_ = streams_ + (options.show_exposed ? 1 : 0);
    axis_y_ = top + static_cast<double>(rows_) * row_h_;
    for (const auto& t : g.tasks) kind_used_[static_cast<std::size_t>(t.kind)] = true;
    per_line_ = static_cast<std::size_t>(std::max(1.0, std::floor((width_ - 20) / legend_item_w)));
    std::size_t legend_items = options.show_exposed ? 1 : 0;
    for (const bool used : kind_used_) legend_items += used ? 1 : 0;
    legend_y_ = axis_y_ + 40;
    height_ = legend_y_ + static_cast<double>((legend_items + per_line_ - 1) / per_line_) * 20 + 10;
    scale_ = plot_w_ / (r.step_us > 0 ? r.step_us : 1);
  }

  std::string draw() && {
    out_.reserve(512 + r_.timeline.size() * 220);
    header();
    rows();
    tasks();
    if (options_.show_exposed) exposed();
    axis();
    legend();
    out_ += "</svg>\n";
    return std::move(out_);
  }

private:
  static constexpr double right_margin = 24, top = 34, legend_item_w = 160;

  [[nodiscard]] double x_of(double t_us) const { return left_ + t_us * scale_; }

  void header() {
    out_ += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + fixed(width_, 0) + "\" height=\"" + fixed(height_, 0) +
            "\" viewBox=\"0 0 " + fixed(width_, 0) + " " + fixed(height_, 0) +
            "\" font-family=\"sans-serif\" font-size=\"12\">\n";
    out_ += "<rect class=\"background\" x=\"0\" y=\"0\" width=\"" + fixed(width_, 0) + "\" height=\"" + fixed(height_, 0) +
            "\" fill=\"white\"/>\n";
    std::string title = options_.title;
    if (title.empty())
      title = g_.name + ": step " + fixed(r_.step_us / 1000, 3) + " ms, exposed communication " +
              fixed(r_.exposed_comm_us / 1000, 3) + " ms";
    out_ += "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">";
    append_escaped(out_, title);
    out_ += "</text>\n";
  }

  // Row backgrounds and labels.
  void rows() {
    out_ += "<g class=\"rows\">\n";
    for (std::size_t row = 0; row < rows_; ++row) {
      const double y = top + static_cast<double>(row) * row_h_;
      out_ += "<rect class=\"row\" x=\"" + fixed(left_) + "\" y=\"" + fixed(y) + "\" width=\"" + fixed(plot_w_) +
              "\" height=\"" + fixed(row_h_) + "\" fill=\"" + (row % 2 ? "#ffffff" : "#f4f4f4") + "\"/>\n";
      out_ += "<text x=\"" + fixed(left_ - 6) + "\" y=\"" + fixed(y + row_h_ / 2 + 4) + "\" text-anchor=\"end\">";
      append_escaped(out_, row < streams_ ? std::string_view(g_.streams[row].name) : "exposed comm");
      out_ += "</text>\n";
    }
    out_ += "</g>\n";
  }

  void tasks() {
    out_ += "<g class=\"tasks\">\n";
    for (const auto& iv : r_.timeline) {
      const auto& t = g_.tasks[static_cast<std::size_t>(iv.task)];
      const double x = x_of(iv.start_us);
      const double w = std::max((iv.end_us - iv.start_us) * scale_, 0.75); // a zero-length task stays visible
      const double y = top + static_cast<double>(iv.stream) * row_h_ + 3;
      const double h = row_h_ - (options_.show_exposed ? 10 : 6);
      out_ += "<rect class=\"task\" x=\"" + fixed(x) + "\" y=\"" + fixed(y) + "\" width=\"" + fixed(w) + "\" height=\"" +
              fixed(h) + "\" fill=\"" + std::string(kind_colours[static_cast<std::size_t>(t.kind)]) +
              "\" stroke=\"#333\" stroke-width=\"0.3\"><title>";
      append_escaped(out_, t.name);
      out_ += " (" + std::string(ir::to_string(t.kind)) + ", task " + std::to_string(t.id) + ")\n" +
              fixed(iv.start_us, 3) + " - " + fixed(iv.end_us, 3) + " us (" + fixed(iv.end_us - iv.start_us, 3) +
              " us)</title></rect>\n";
      if (options_.label_tasks && w > 7.0 * static_cast<double>(t.name.size()) + 6) {
        out_ += "<text x=\"" + fixed(x + 3) + "\" y=\"" + fixed(y + h / 2 + 4) + "\" font-size=\"11\">";
        append_escaped(out_, t.name);
        out_ += "</text>\n";
      }
    }
    out_ += "</g>\n";
  }

  void exposed() {
    out_ += "<g class=\"exposed\" fill=\"" + std::string(exposed_colour) + "\">\n";
    const auto exposed_rect = [&](double y, double h, double a, double b) {
      out_ += "<rect class=\"exposed\" x=\"" + fixed(x_of(a)) + "\" y=\"" + fixed(y) + "\" width=\"" +
              fixed(std::max((b - a) * scale_, 0.75)) + "\" height=\"" + fixed(h) + "\"><title>exposed " +
              fixed(a, 3) + " - " + fixed(b, 3) + " us</title></rect>\n";
    };
    for (std::size_t s = 0; s < streams_; ++s) {
      if (g_.streams[s].is_compute()) continue;
      const double y = top + static_cast<double>(s + 1) * row_h_ - 6;
      for (const auto& [a, b] : intervals::minus(intervals::merged(std::move(lane_busy_[s])), compute_busy_))
        exposed_rect(y, 4, a, b);
    }
    const double y = top + static_cast<double>(streams_) * row_h_ + 3;
    for (const auto& [a, b] : exposed_all_) exposed_rect(y, row_h_ - 6, a, b);
    out_ += "</g>\n";
  }

  // Time axis in ms.
  void axis() {
    out_ += "<g class=\"axis\" stroke=\"#333\">\n";
    out_ += "<line x1=\"" + fixed(left_) + "\" y1=\"" + fixed(axis_y_) + "\" x2=\"" + fixed(left_ + plot_w_) + "\" y2=\"" +
            fixed(axis_y_) + "\"/>\n";
    const double span_ms = r_.step_us / 1000;
    const double tick = tick_step_ms(span_ms);
    const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(tick) + 1e-9)));
    for (int k = 0;; ++k) {
      const double t_ms = k * tick;
      if (t_ms > span_ms * (1 + 1e-9) && k > 0) break;
      const double x = x_of(t_ms * 1000);
      out_ += "<line x1=\"" + fixed(x) + "\" y1=\"" + fixed(axis_y_) + "\" x2=\"" + fixed(x) + "\" y2=\"" +
              fixed(axis_y_ + 5) + "\"/>\n";
      out_ += "<text x=\"" + fixed(x) + "\" y=\"" + fixed(axis_y_ + 18) + "\" text-anchor=\"middle\" stroke=\"none\">" +
              fixed(t_ms, decimals) + " ms</text>\n";
      if (k > 1000) break; // a degenerate span cannot make the picture huge
    }
    out_ += "</g>\n";
  }

  // Legend: the kinds present in the graph.
  void legend() {
    out_ += "<g class=\"legend\">\n";
    std::size_t item = 0;
    const auto legend_entry = [&](std::string_view colour, std::string_view label) {
      const double x = 10 + static_cast<double>(item % per_line_) * legend_item_w;
      const double y = legend_y_ + static_cast<double>(item / per_line_) * 20;
      out_ += "<rect class=\"legend\" x=\"" + fixed(x) + "\" y=\"" + fixed(y - 10) +
              "\" width=\"12\" height=\"12\" fill=\"" + std::string(colour) + "\"/>\n";
      out_ += "<text x=\"" + fixed(x + 18) + "\" y=\"" + fixed(y) + "\">";
      append_escaped(out_, label);
      out_ += "</text>\n";
      ++item;
    };
    for (int k = 0; k < ir::op_kind_count; ++k)
      if (kind_used_[static_cast<std::size_t>(k)])
        legend_entry(kind_colours[static_cast<std::size_t>(k)], ir::to_string(static_cast<ir::op_kind>(k)));
    if (options_.show_exposed) legend_entry(exposed_colour, "exposed communication");
    out_ += "</g>\n";
  }

  const ir::graph& g_;
  const sim::result& r_;
  const svg_options& options_;
  std::size_t streams_, rows_ = 0, per_line_ = 1;
  double row_h_ = 0, left_ = 0, plot_w_ = 0, width_ = 0, axis_y_ = 0, legend_y_ = 0, height_ = 0, scale_ = 0;
  intervals::span_list compute_busy_, exposed_all_;
  std::vector<intervals::span_list> lane_busy_;
  std::array<bool, ir::op_kind_count> kind_used_{};
  std::string out_;
};

} // namespace detail

/// @brief An SVG Gantt chart of a timeline; open it in any browser. Every task is one
/// `<rect class="task">` with a `<title>` tooltip (name, kind, start, end); exposed
/// communication is drawn as `<rect class="exposed">`. Text is XML-escaped.
/// @code
/// concerto::write_file_atomically("step.svg", trace::svg_gantt(g, sim::simulate(g, order, d, 1.2)));
/// @endcode
[[nodiscard]] inline std::string svg_gantt(const ir::graph& g, const sim::result& r, svg_options options = {}) {
  detail::check_matches(g, r, "svg_gantt");
  return detail::gantt_drawing(g, r, options).draw();
}

} // namespace concerto::trace
