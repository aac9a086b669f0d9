#pragma once
// The examples' command lines, parsed by CLI11 on every rank (the same argv everywhere).
#include <concerto/runtime/mpi/environment.hpp>

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <optional>
#include <string>

namespace examples {

/// A size, count or rate that must be above zero: `--steps 0` is refused by name.
inline const CLI::Validator positive(
    [](std::string& text) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(v > 0)) return "must be a positive number, not '" + text + "'";
      return std::string();
    },
    "POSITIVE");

/// Parses argv; nullopt to go on, or the status every rank exits with: 0 after --help (printed by
/// rank 0 only), 1 after a bad option or value (explained by rank 0 only, naming the option).
inline std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (concerto::runtime::mpi::environment::world_rank() == 0) return app.exit(e);
    return e.get_exit_code() == 0 ? 0 : 1;
  }
}

} // namespace examples
