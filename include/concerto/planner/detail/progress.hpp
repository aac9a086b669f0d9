#pragma once
/// @file
/// @brief Progress lines on stderr for planning steps that run long (decomposition, bucketing,
/// the memory limit), in the solver's format: nothing during the first second, then at most
/// one line a second, and a closing line only if something was printed. Not public API.

#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>

namespace concerto::planner::detail {

class progress_meter {
public:
  /// `step` names what runs ("decomposing"), `graph` the graph; `enabled` false prints nothing.
  progress_meter(std::string step, std::string graph, bool enabled, double quiet_seconds = 1.0)
      : step_(std::move(step)), graph_(std::move(graph)), enabled_(enabled), quiet_(quiet_seconds),
        start_(std::chrono::steady_clock::now()) {}

  /// Prints `describe()` when over the quiet time and a second after the last line; the text is
  /// only built when printed, so a tick costs a clock read.
  template <class F> void tick(F&& describe) {
    if (!enabled_) return;
    const double now = elapsed();
    if (now <= quiet_ || (printed_ && now - last_ < 1.0)) return;
    last_ = now;
    printed_ = true;
    print(std::forward<F>(describe)(), now);
  }

  /// The closing line, printed only when earlier lines were.
  template <class F> void done(F&& describe) {
    if (enabled_ && printed_) print("done: " + std::forward<F>(describe)(), elapsed());
  }

  [[nodiscard]] bool printed() const noexcept { return printed_; }

  [[nodiscard]] double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  [[nodiscard]] static std::string us(double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f us", v);
    return text;
  }

private:
  void print(const std::string& what, double now) const {
    std::fprintf(stderr, "concerto: %s '%s': %s (%.1f s)\n", step_.c_str(), graph_.c_str(), what.c_str(), now);
  }

  std::string step_, graph_;
  bool enabled_;
  double quiet_;
  double last_ = 0;
  bool printed_ = false;
  std::chrono::steady_clock::time_point start_;
};

} // namespace concerto::planner::detail
