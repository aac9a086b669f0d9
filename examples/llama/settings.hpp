#pragma once
// The Llama example's settings and its command line, parsed in flags.cpp: the model's file
// (main.cpp) then compiles no command-line parser.
#include "../common/settings.hpp"

#include <cstdint>
#include <optional>

namespace llama_example {

struct settings : examples::text_model_settings {
  int zero_stage = 0, kv_heads = 2, ffn = 0;
  std::int64_t rope_theta = 10000;
  int experts = 0, ep = 1, top_k = 2; ///< mixture of experts: experts per layer (0: the dense block), their split, top-k
};

/// Parses argv into `s`; nullopt to go on, or the status every rank exits with (--help: 0, a
/// bad option: 1, explained by rank 0 naming the option).
std::optional<int> parse_command_line(int argc, char** argv, settings& s);

} // namespace llama_example
