// A small Vision Transformer (examples/vit/model.hpp: patch embedding, position table,
// bidirectional attention blocks, mean pooling) trained to tell five drawn shapes apart
// (examples/common/shape_images.hpp), ZeRO-2 over the data-parallel ranks, tensor (--tp) and
// sequence (--sp) parallelism by flags.
//
//   examples/vit/run.sh                                   # 4 ranks: dp = 4 (ZeRO-2), concerto plan
//   examples/vit/run.sh --tp 2 --sp --layers 4 --steps 150
//   NP=2 examples/vit/run.sh --policy sync,program_order,concerto --json vit.json
//
// It prints the held-out loss and accuracy before and after training, and exits with status 1
// if the held-out loss did not fall (or the accuracy stayed below --min-accuracy). --help lists every option.
#include "../common/vision.hpp"
#include "model.hpp"

using namespace concerto;

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  examples::vision_settings s;
  int layers = 2, heads = 4;
  std::int64_t hidden = 64;
  bool sp = false;
  CLI::App app{"Trains a small Vision Transformer on drawn shapes over MPI ranks (ZeRO-2 over dp, TP/SP over --tp)."};
  examples::add_vision_options(app, s);
  app.add_option("--layers", layers, "transformer blocks")->check(examples::positive)->capture_default_str();
  app.add_option("--hidden", hidden, "width of the residual stream")->check(examples::positive)->capture_default_str();
  app.add_option("--heads", heads, "attention heads")->check(examples::positive)->capture_default_str();
  app.add_flag("--sp", sp, "sequence parallelism: the residual stream split over tp on the patches");
  if (const auto status = examples::parse_or_exit(app, argc, argv)) return *status;
  if (s.side % vit_model::patch != 0) {
    std::fprintf(stderr, "--side %lld is not a multiple of the %d-pixel patch\n", static_cast<long long>(s.side), vit_model::patch);
    return 2;
  }
  return runtime::mpi::run_or_abort([&] {
    const int world = runtime::mpi::environment::world_size();
    const auto policies = examples::plan_policies(s.policy);
    const auto shapes = vit_model::shapes(s.batch, s.side, hidden, examples::shape_classes, !sp);
    const auto m = mesh::from_world(world, {{"dp", -1}, {"tp", s.tp}});
    const train::optimizer_settings opt{.adamw = {.lr = s.lr}};
    const auto options = [&](planner::policy policy) {
      return train::step_options{.policy = policy,
                                 .lower = {.name = "vit", .heads = heads, .depth = {{"layers", layers}}},
                                 .precision = ir::parse_precision(s.precision, "--precision"),
                                 .cost_preset = s.cost_preset};
    };
    std::vector<train::basic_step<>> runs;
    for (const auto& policy : policies)
      if (sp) runs.push_back(train::compile(vit_model::vit_sp, m, shapes, opt, options(policy)));
      else runs.push_back(train::compile(vit_model::vit_tp, m, shapes, opt, options(policy)));
    if (runs.front().rank() == 0)
      std::printf("vit: %d layers, hidden %lld, %d heads, %lld patches of %dx%d, %lld images per step, dp=%d (ZeRO-2) x tp=%d%s, "
                  "%s, cost preset %s\n",
                  layers, static_cast<long long>(hidden), heads, static_cast<long long>((s.side / 4) * (s.side / 4)),
                  vit_model::patch, vit_model::patch, static_cast<long long>(s.batch), world / s.tp, s.tp, sp ? " (SP; the head reads the patches' mean)" : " (class token)",
                  s.precision.c_str(), s.cost_preset.c_str());
    return examples::train_vision(runs, s,
                                  {{"example", "vit"}, {"world", world}, {"tp", s.tp}, {"sp", sp}, {"layers", layers},
                                   {"hidden", hidden}, {"heads", heads}, {"batch", s.batch}, {"side", s.side},
                                   {"precision", s.precision}, {"cost_preset", s.cost_preset}});
  });
}
