#pragma once
/// @file
/// @brief The cost model a step plans with: the preset's, and on CPU ranks each of the graph's
/// kernels priced by its measured factor (runtime/kernel_profile.hpp times them), kept on disk
/// per machine, build and graph so that the model, and the plan cache key made from it, stay
/// the same run after run.

#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/runtime/decide.hpp>
#include <concerto/runtime/kernel_profile.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/train/options.hpp>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train::detail {

/// The measured kernel factors stored at `file` (kernel -> factor); empty when there is none.
/// A file that is not such an object is reported on stderr and ignored: it will be measured again.
inline nlohmann::json read_kernel_scales(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) return nlohmann::json::object();
  try {
    auto j = nlohmann::json::parse(in);
    if (!j.is_object()) fail("not a JSON object");
    // A factor is a measured time over the roofline's: far outside these bounds it is no
    // measurement (a damaged or edited file), and would price a kernel as free or as forever.
    constexpr double lowest = 1e-6, highest = 1e6;
    for (const auto& [kernel, scale] : j.items())
      if (!scale.is_number() || !(scale.get<double>() >= lowest && scale.get<double>() <= highest))
        fail("kernel '" + kernel + "' has the factor " + scale.dump() + ", not a measured one (between 1e-6 and 1e6)");
    return j;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto: ignoring the kernel measurements in '%s' (%s); measuring again\n", file.c_str(), e.what());
    return nlohmann::json::object();
  }
}
inline void write_kernel_scales(const std::filesystem::path& file, const std::map<std::string, double, std::less<>>& scales) {
  try {
    write_file_atomically(file, nlohmann::json(scales).dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto: could not keep the kernel measurements (%s)\n", e.what());
  }
}
/// What else, besides the hardware description and the graph, decides how fast this build's
/// kernels run: the compiler and its optimisation and instruction-set flags, the machine, and how
/// many ranks share it. A kernel measured under another of these is measured again.
inline std::uint64_t kernel_build_fingerprint(const runtime::mpi::control& world) {
  hasher h;
  h.add(std::string_view("concerto.kernels.v2")); // v2: means of 3 runs (v1 kept the best of 2)
  h.add(std::string_view(__VERSION__));
#if defined(__OPTIMIZE__)
  h.add(std::string_view("optimize"));
#endif
#if defined(__FAST_MATH__)
  h.add(std::string_view("fast-math"));
#endif
#if defined(__AVX512F__)
  h.add(std::string_view("avx512f"));
#elif defined(__AVX2__)
  h.add(std::string_view("avx2"));
#elif defined(__AVX__)
  h.add(std::string_view("avx"));
#endif
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  h.add(std::string_view(host));
  h.add(std::int64_t{world.split_by_node(0, "the ranks of this node, for the kernel measurements' key").size()});
  return h.value();
}

/// The preset's model, with measured factors for the graph's kernels when measuring is on.
/// With `use_cache` the factors are kept in `cache_dir/kernels-<hardware hash>-<graph hash>-
/// <build hash>.json` (detail::kernel_build_fingerprint), so that the model, and the plan cache
/// key made from it, are the same run after run, and a kernel is priced at the shapes this
/// graph runs it at. All ranks time the kernels at once, as a step runs them, and the mean over
/// ranks is kept. An unreadable file is reported and measured again; one that cannot be
/// written costs a measurement next time, nothing else.
template <class Backend>
[[nodiscard]] cost::model planning_model(const step_options& options, [[maybe_unused]] const ir::graph& g,
                                         [[maybe_unused]] const runtime::kernel_settings& settings,
                                         [[maybe_unused]] const runtime::mpi::control& control,
                                         [[maybe_unused]] Backend& backend) {
  auto model = cost::model::preset(options.cost_preset);
  const bool measure = options.measure_kernels.value_or(!Backend::stream_ordered && options.cost_preset.starts_with("cpu"));
  if constexpr (!Backend::stream_ordered) {
    if (!measure) return model;
    const int rank = control.rank(), size = control.size();
    std::set<std::string, std::less<>> wanted;
    for (const auto& t : g.tasks)
      if (!ir::is_collective(t.kind)) wanted.emplace(cost::model::kernel_name(t));
    // Every rank knows use_cache, so all or none take part in the fingerprint's collective.
    const auto file = options.use_cache ? options.cache_dir / ("kernels-" + hasher::to_hex(model.hw().hash()) + "-" +
                                                                 hasher::to_hex(plan::hash(g)) + "-" +
                                                                 hasher::to_hex(kernel_build_fingerprint(control)) + ".json")
                                         : std::filesystem::path();
    auto known = runtime::decide_on_rank_0(backend, "the measured kernel factors from rank 0",
                                           "train step: reading the kernel measurements failed on rank 0", [&] {
                   return options.use_cache ? read_kernel_scales(file) : nlohmann::json::object();
                 }).template get<std::map<std::string, double, std::less<>>>();
    if (!std::ranges::all_of(wanted, [&](const auto& k) { return known.contains(k); })) {
      // Every rank reaches the reduction below, also one whose timing threw (out of memory on a
      // crowded node): the others would otherwise wait in it for ever.
      std::map<std::string, double, std::less<>> scales;
      std::string failure;
      try {
        scales = runtime::kernel_scales(runtime::time_kernels(g, settings), g, model);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      std::vector<double> mine;
      for (const auto& k : wanted) mine.push_back(scales.contains(k) ? scales.at(k) : 1.0); // launch-bound: 1
      mine.push_back(failure.empty() ? 0.0 : 1.0);
      auto sum = mine;
      control.sum_all(std::span(sum), "the kernel timings of every rank");
      if (sum.back() > 0)
        fail("train step: timing the kernels of graph '" + g.name + "' failed on " +
             std::to_string(static_cast<int>(sum.back())) + " rank(s)" + (failure.empty() ? "" : ": " + failure));
      known.clear();
      std::size_t i = 0;
      for (const auto& k : wanted) known[k] = sum[i++] / size;
      if (rank == 0 && options.use_cache) write_kernel_scales(file, known);
    }
    auto hw = model.hw();
    for (const auto& k : wanted) hw.kernel_scale[k] = known.at(k);
    return cost::model(std::move(hw));
  } else {
    if (measure) fail("train step: measure_kernels times the CPU kernels; this build's backend runs on a GPU");
    return model;
  }
}

} // namespace concerto::train::detail
