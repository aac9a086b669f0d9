// The Llama example's command line (see settings.hpp).
#include "settings.hpp"

#include "../common/command_line.hpp"

#include <cstdlib>
#include <string>

namespace llama_example {

std::optional<int> parse_command_line(int argc, char** argv, settings& s) {
  CLI::App app{"Trains a small Llama-family decoder on a text over MPI ranks (DP x TP mesh)."};
  examples::add_text_model_options(app, s, "decoder blocks");
  app.add_option("--zero", s.zero_stage, "ZeRO stage over dp: 0, 1 or 3")->check(CLI::IsMember({0, 1, 3}))->capture_default_str();
  app.add_option("--kv-heads", s.kv_heads, "key/value heads (grouped-query attention; = heads for MHA)")->check(examples::positive)->capture_default_str();
  app.add_option("--ffn", s.ffn, "feed-forward width (default: 8/3 of hidden, rounded up to 8)")->check(examples::positive);
  app.add_option("--rope-theta", s.rope_theta, "base of the rotary embedding's angles")->check(examples::positive)->capture_default_str();
  const CLI::Validator experts(
      [](std::string& text) {
        char* end = nullptr;
        const long v = std::strtol(text.c_str(), &end, 10);
        if (text.empty() || *end != '\0' || v < 0) return "must be 0 (the dense block) or a number of experts, not '" + text + "'";
        return std::string();
      },
      "E");
  app.add_option("--experts", s.experts, "mixture of experts: SwiGLU experts per layer in place of the feed-forward block (0: dense)")
      ->check(experts)->capture_default_str();
  app.add_option("--ep", s.ep, "expert-parallel ranks: the experts split over them, the tokens over dp x ep")
      ->check(examples::positive)->capture_default_str();
  app.add_option("--top-k", s.top_k, "experts per token: 1 (Switch) or 2 (GShard, Mixtral)")
      ->check(CLI::IsMember({1, 2}))->capture_default_str();
  // Options that only mean something together are refused apart, by name, rather than ignored.
  app.callback([&] {
    if (s.auto_shard && (s.sp || s.zero_stage != 0))
      throw CLI::ValidationError("--auto", "decides the layout (sequence parallelism included) and the ZeRO stage: leave out --sp and --zero");
    if (s.experts == 0 && s.ep != 1)
      throw CLI::ValidationError("--ep", "splits the experts of a mixture of experts: give --experts E too (without "
                                         "experts the mesh is dp x tp)");
    if (s.experts == 0 && app.count("--top-k") > 0)
      throw CLI::ValidationError("--top-k", "routes tokens to experts: give --experts E too");
    if (s.experts > 0 && (s.sp || s.zero_stage != 0))
      throw CLI::ValidationError("--experts", "the mixture of experts runs without --sp and --zero");
    if (s.experts > 0 && s.experts % s.ep != 0)
      throw CLI::ValidationError("--ep", std::to_string(s.ep) + " ranks cannot split " + std::to_string(s.experts) +
                                             " experts evenly: give --experts a multiple of --ep");
  });
  return examples::parse_or_exit(app, argc, argv);
}

} // namespace llama_example
