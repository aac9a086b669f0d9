// The Llama example's command line (see settings.hpp).
#include "settings.hpp"

#include "../common/command_line.hpp"

namespace llama_example {

std::optional<int> parse_command_line(int argc, char** argv, settings& s) {
  CLI::App app{"Trains a small Llama-family decoder on a text over MPI ranks (DP x TP mesh)."};
  examples::add_text_model_options(app, s, "decoder blocks");
  app.add_option("--zero", s.zero_stage, "ZeRO stage over dp: 0, 1 or 3")->check(CLI::IsMember({0, 1, 3}))->capture_default_str();
  app.add_option("--kv-heads", s.kv_heads, "key/value heads (grouped-query attention; = heads for MHA)")->check(examples::positive)->capture_default_str();
  app.add_option("--ffn", s.ffn, "feed-forward width (default: 8/3 of hidden, rounded up to 8)")->check(examples::positive);
  app.add_option("--rope-theta", s.rope_theta, "base of the rotary embedding's angles")->check(examples::positive)->capture_default_str();
  app.add_option("--experts", s.experts, "mixture of experts: SwiGLU experts per layer in place of the feed-forward block (0: dense)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--ep", s.ep, "expert-parallel ranks: the experts split over them, the tokens over dp x ep")
      ->check(examples::positive)->capture_default_str();
  app.add_option("--top-k", s.top_k, "experts per token: 1 (Switch) or 2 (GShard, Mixtral)")
      ->check(CLI::IsMember({1, 2}))->capture_default_str();
  return examples::parse_or_exit(app, argc, argv);
}

} // namespace llama_example
