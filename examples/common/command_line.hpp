#pragma once
// The examples' command lines, parsed by CLI11 on every rank (the same argv everywhere).
#include "settings.hpp"

#include <concerto/pipeline/policies.hpp>
#include <concerto/runtime/mpi/environment.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
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

/// A weight or threshold that may be zero but not negative: `--clip -1` is refused by name.
inline const CLI::Validator non_negative(
    [](std::string& text) {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(v >= 0)) return "must be 0 or a positive number, not '" + text + "'";
      return std::string();
    },
    "NON-NEGATIVE");

/// A comma-separated list that names at least one thing (`what`): `--schedule ""` is refused by name.
inline CLI::Validator names_list(const std::string& what) {
  return CLI::Validator(
      [what](std::string& text) {
        return text.find_first_not_of(',') == std::string::npos ? "needs at least one " + what + " name" : std::string();
      },
      "LIST");
}

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
  app.add_option("--lr-schedule", s.lr_schedule, "decay after the warmup, to --min-lr-ratio at the last step")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}))
      ->capture_default_str();
  app.add_option("--warmup", s.warmup, "steps of linear learning-rate warmup")->check(non_negative)->capture_default_str();
  app.add_option("--min-lr-ratio", s.min_lr_ratio, "the decay's floor as a share of --lr")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--weight-decay", s.weight_decay, "AdamW's decoupled weight decay")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--clip", s.clip, "clip the gradients' global norm to this (0: no clipping)")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--precision", s.precision,
                 "fp32, or bf16: activations, gradients and collectives in bf16, f32 master weights and AdamW state; "
                 "or fp16: the same in f16, with dynamic loss scaling")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  auto* data = app.add_option("--data", s.data, "train on token shards DIR/train*.bin (examples/shards writes them) instead of --text");
  app.add_option("--vocab", s.vocab, "with --data: the vocabulary, above every token id (256: byte-level)")
      ->check(positive)
      ->capture_default_str()
      ->needs(data);
  app.add_option("--seed", s.seed, "with --data: the order of the training windows")->capture_default_str()->needs(data);
  auto* val = app.add_option("--val-every", s.val_every, "validation loss on DIR/val*.bin every N steps")
                  ->check(positive)
                  ->needs(data);
  app.add_option("--val-batches", s.val_batches, "validation batches (the first, always the same)")
      ->check(positive)
      ->capture_default_str()
      ->needs(val);
  auto* save = app.add_option("--save", s.save, "write a checkpoint (parameters, optimizer, data position) here at the end");
  app.add_option("--save-every", s.save_every, "and every N steps")->check(positive)->needs(save);
  app.add_option("--resume", s.resume, "continue from this checkpoint (the exact next batch)");
  app.add_option("--metrics", s.metrics, "append one JSON record per step to this file (JSONL)");
  app.add_option("--log-every", s.log_every, "a progress line every N steps")->check(positive)->capture_default_str();
  app.add_option("--export", s.export_path, "write the trained parameters to this safetensors file");
  app.add_option("--export-dtype", s.export_dtype, "f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--policy", s.policy, "plan policy, or a comma-separated list: sync, program_order, xla_lhs, concerto")
      ->check(names_list("policy"))
      ->capture_default_str();
  app.add_option("--text", s.text, "training text")->capture_default_str();
  app.add_option("--cost-preset", s.cost_preset, "the planner's cost model (cpu-netns: the emulated cluster's)")
      ->capture_default_str();
  app.add_option("--json", s.json, "write the result of every policy to this file (a JSON array)");
  auto* automatic = app.add_flag("--auto", s.auto_shard,
                                 "every spec chosen by automatic sharding for the mesh, shapes and --cost-preset (not --sp, --pp)");
  app.add_flag("--explain", s.explain, "with --auto: print each leaf's spec, the collectives, memory and the alternatives")
      ->needs(automatic);
  app.add_option("--memory-cap-mib", s.memory_cap_mib, "with --auto: peak memory per rank the sharding must respect")
      ->check(positive)
      ->needs(automatic);
  // The trainer's options train one plan; several plans compared run the text loop alone.
  // (parse_complete_callback: the pipeline options and the Llama's checks take final_callback.)
  app.parse_complete_callback([&app, &s] {
    if (s.auto_shard && s.sp) throw CLI::ValidationError("--auto", "decides the layout itself: leave out --sp");
    if (s.policy.find(',') == std::string::npos && s.schedule.find(',') == std::string::npos) return;
    for (const char* name : {"--data", "--val-every", "--save", "--resume", "--metrics"})
      if (app.count(name) > 0)
        throw CLI::ValidationError(name, "trains one plan: give one --policy (and one --schedule) to use it");
  });
}

/// Adds the pipeline options (--pp, --microbatches, --schedule, --virtual-stages) and refuses,
/// when the line is parsed (so rank 0 alone explains it), a schedule without stages or
/// micro-batches to order, and a schedule that does not take the layout, with the fix
/// (pipeline::policy_table says what each takes).
inline void add_pipeline_options(CLI::App& app, text_model_settings& s) {
  app.add_option("--pp", s.pp, "pipeline stages (the layers split over them)")->check(positive)->capture_default_str();
  app.add_option("--microbatches", s.microbatches, "micro-batches per step (divides --batch)")
      ->check(positive)
      ->capture_default_str();
  auto* schedule = app.add_option("--schedule", s.schedule,
                                  "pipeline schedule, or a comma-separated list: " + concerto::pipeline::policy_list())
                       ->check(names_list("schedule"))
                       ->capture_default_str();
  auto* chunks = app.add_option("--virtual-stages", s.virtual_stages,
                                "chunks of layers per pipeline stage (2 or more: gpipe, interleaved_1f1b, concerto)")
                     ->check(positive)
                     ->capture_default_str();
  app.final_callback([&s, schedule, chunks] {
    if (s.pp == 1 && s.microbatches == 1) {
      for (const auto* o : {schedule, chunks})
        if (o->count() > 0)
          throw CLI::ValidationError(o->get_name(), "needs pipeline stages or micro-batches to apply to: give --pp N or "
                                                    "--microbatches M (above 1) with it");
      return;
    }
    std::stringstream list(s.schedule);
    for (std::string name; std::getline(list, name, ',');) {
      if (name.empty()) continue;
      const auto* policy = concerto::pipeline::find_policy(name);
      if (!policy)
        throw CLI::ValidationError("--schedule", "'" + name + "' is not one of " + concerto::pipeline::policy_list());
      auto why = concerto::pipeline::refusal(*policy, s.pp, s.virtual_stages, s.microbatches);
      if (why.empty()) continue;
      // The library's option, as this command line spells it.
      const std::string option = "virtual_stages = ";
      for (auto at = why.find(option); at != std::string::npos; at = why.find(option, at))
        why.replace(at, option.size(), "--virtual-stages ");
      throw CLI::ValidationError("--schedule", why);
    }
  });
}

/// Parses argv; nullopt to go on, or the status every rank exits with: 0 after --help (printed by
/// rank 0 only), 1 after a bad option or value (explained by rank 0 only, in one line naming the
/// option, before the launcher's own lines).
inline std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    const bool root = concerto::runtime::mpi::environment::world_rank() == 0;
    if (e.get_exit_code() == 0) return root ? app.exit(e) : 0;
    if (root) {
      std::fprintf(stderr, "%s (--help lists the options)\n", e.what());
      std::fflush(stderr);
    }
    return 1;
  }
}

} // namespace examples
