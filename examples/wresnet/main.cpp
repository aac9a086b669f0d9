// A small Wide-ResNet (examples/wresnet/model.hpp: bottleneck blocks, batch normalisation
// synchronised over the data-parallel ranks, global average pooling) trained to tell five drawn
// shapes apart (examples/common/shape_images.hpp), data parallel over every rank, output-channel
// sharding of the bottlenecks over --tp.
//
//   examples/wresnet/run.sh                                # 4 ranks: dp = 4, concerto plan
//   examples/wresnet/run.sh --tp 2 --width 2 --steps 150
//   NP=2 examples/wresnet/run.sh --policy sync,program_order,concerto --json wrn.json
//
// It prints the held-out loss and accuracy before and after training, and exits with status 1
// if the held-out loss did not fall (or the accuracy stayed below --min-accuracy). --help lists every option.
#include "../common/vision.hpp"
#include "model.hpp"

using namespace concerto;

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  examples::vision_settings s;
  int width = 1, depth = 1;
  CLI::App app{"Trains a small Wide-ResNet on drawn shapes over MPI ranks (data parallel, synchronised batch norm)."};
  examples::add_vision_options(app, s);
  app.add_option("--width", width, "width factor k: stage s has 16·2^(s-1)·k bottleneck channels")
      ->check(examples::positive)
      ->capture_default_str();
  app.add_option("--depth", depth, "bottleneck blocks in stage 1")->check(examples::positive)->capture_default_str();
  if (const auto status = examples::parse_or_exit(app, argc, argv)) return *status;
  return runtime::mpi::run_or_abort([&] {
    const int world = runtime::mpi::environment::world_size();
    const auto policies = examples::plan_policies(s.policy);
    const auto shapes = wresnet_model::shapes(s.batch, s.side, width, examples::shape_classes);
    std::vector<train::basic_step<>> runs;
    for (const auto& policy : policies)
      runs.push_back(train::compile(wresnet_model::net, mesh::from_world(world, {{"dp", -1}, {"tp", s.tp}}), shapes,
                                    {.adamw = {.lr = s.lr}},
                                    {.policy = policy,
                                     .lower = {.name = "wresnet", .depth = {{"stage1", depth}}},
                                     .precision = ir::parse_precision(s.precision, "--precision"),
                                     .cost_preset = s.cost_preset}));
    if (runs.front().rank() == 0)
      std::printf("wresnet: width %d, stage-1 depth %d, %lld images of %lldx%lld per step, dp=%d x tp=%d, %s, cost preset %s\n",
                  width, depth, static_cast<long long>(s.batch), static_cast<long long>(s.side),
                  static_cast<long long>(s.side), world / s.tp, s.tp, s.precision.c_str(), s.cost_preset.c_str());
    return examples::train_vision(runs, s,
                                  {{"example", "wresnet"}, {"world", world}, {"tp", s.tp}, {"width", width}, {"depth", depth},
                                   {"batch", s.batch}, {"side", s.side}, {"precision", s.precision},
                                   {"cost_preset", s.cost_preset}});
  });
}
