#pragma once
// The examples' command lines, parsed by CLI11 on every rank (the same argv everywhere).
#include "settings.hpp"

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

/// Adds the shared options to `app`, bound to `s`; `blocks` names the model's layers in --help.
inline void add_text_model_options(CLI::App& app, text_model_settings& s, const std::string& blocks) {
  app.add_option("--tp", s.tp, "tensor-parallel ranks (the rest is data parallel)")->check(positive)->capture_default_str();
  app.add_flag("--sp", s.sp, "sequence parallelism: the residual stream split over tp on the sequence");
  app.add_option("--steps", s.steps, "training steps")->check(positive)->capture_default_str();
  app.add_option("--layers", s.layers, blocks)->check(positive)->capture_default_str();
  app.add_option("--hidden", s.hidden, "model width")->check(positive)->capture_default_str();
  app.add_option("--heads", s.heads, "attention (query) heads")->check(positive)->capture_default_str();
  app.add_option("--seq", s.seq, "sequence length")->check(positive)->capture_default_str();
  app.add_option("--batch", s.batch, "global batch (sequences per step)")->check(positive)->capture_default_str();
  app.add_option("--lr", s.lr, "AdamW learning rate")->check(positive)->capture_default_str();
  app.add_option("--policy", s.policy, "plan policy, or a comma-separated list: sync, program_order, xla_lhs, concerto")
      ->capture_default_str();
  app.add_option("--text", s.text, "training text")->capture_default_str();
  app.add_option("--cost-preset", s.cost_preset, "the planner's cost model (cpu-netns: the emulated cluster's)")
      ->capture_default_str();
  app.add_option("--json", s.json, "write the result of every policy to this file (a JSON array)");
}

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
