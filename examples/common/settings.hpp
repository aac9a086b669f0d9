#pragma once
// What the text-trained decoder examples (GPT, Llama) share on their command lines, without the
// parser (common/command_line.hpp), so that a trainer's model file need not compile CLI11.
#include <string>

namespace examples {

struct text_model_settings {
  int tp = 2, steps = 150, layers = 2, hidden = 64, heads = 4, seq = 32, batch = 16;
  int pp = 1, microbatches = 1; ///< pipeline stages and micro-batches per step (the GPT example's)
  int virtual_stages = 1;       ///< chunks of layers per pipeline stage (interleaved)
  bool sp = false;
  float lr = 3e-3f;
  std::string lr_schedule = "constant"; ///< constant, linear or cosine decay over the run's steps
  int warmup = 0;                       ///< steps of linear warmup
  float min_lr_ratio = 0.1f;            ///< the decay's floor as a share of --lr
  std::string export_path;              ///< write the trained parameters here (safetensors)
  std::string export_dtype = "f32";     ///< f32 or bf16
  std::string schedule = "1f1b"; ///< pipeline schedule, or a comma-separated list
  std::string policy = "concerto", text = "/usr/share/common-licenses/GPL-3", cost_preset = "cpu", json;
};

} // namespace examples
