#pragma once
// What the text-trained decoder examples (GPT, Llama) share on their command lines, without the
// parser (common/command_line.hpp), so that a trainer's model file need not compile CLI11.
#include <cstdint>
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
  float weight_decay = 0.01f;           ///< AdamW's decoupled weight decay (torch.optim.AdamW's default)
  float clip = 0.0f;                    ///< global-norm gradient clipping's max norm (0: none)
  std::string precision = "fp32";       ///< fp32, bf16 or fp16 (f32 masters and optimizer state; fp16 scales the loss)
  std::string data;                     ///< token shards: DIR/train*.bin and DIR/val*.bin (else --text)
  int vocab = 256;                      ///< with --data: above every token id (256: byte-level shards)
  std::uint64_t seed = 1;               ///< with --data: the order of the training windows
  int val_every = 0, val_batches = 4;   ///< validation loss every N steps on the first M val batches
  std::string save, resume;             ///< checkpoint written (at the end, and every --save-every), and read first
  int save_every = 0;
  std::string metrics;                  ///< one JSON record per step
  int log_every = 10;                   ///< a progress line every N steps
  std::string export_path;              ///< write the trained parameters here (safetensors)
  std::string export_dtype = "f32";     ///< f32 or bf16
  bool auto_shard = false;              ///< every spec chosen by automatic sharding (docs/auto-sharding.md)
  bool explain = false;                 ///< with auto_shard: print what it chose, why, and the alternatives
  int memory_cap_mib = 0;               ///< with auto_shard: peak memory per rank the sharding respects (0: none)
  std::string schedule = "1f1b"; ///< pipeline schedule, or a comma-separated list
  std::string policy = "concerto", text = "/usr/share/common-licenses/GPL-3", cost_preset = "cpu", json;
};

} // namespace examples
