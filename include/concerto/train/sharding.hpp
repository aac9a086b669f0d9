#pragma once
/// @file
/// @brief Internal to train::compile: a program whose leaves are written `auto_` gets its
/// sharding chosen before it is lowered (docs/auto-sharding.md). Rank 0 chooses (or finds the
/// choice it made for the same program, mesh, shapes, memory cap and cost model in the cache
/// folder), prints what it chose, and every rank compiles the program with that choice.

#include <concerto/autoshard/search.hpp>
#include <concerto/cache/key.hpp>
#include <concerto/core/file.hpp>
#include <concerto/runtime/decide.hpp>
#include <concerto/runtime/deadline.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/train/options.hpp>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace concerto::train::detail {

/// What train::compile decided for a program written with auto_.
struct decided_sharding {
  graph::sharding_choice choice;
  bool cached = false;   ///< rank 0 found it in the cache folder
  std::string account;   ///< what rank 0 printed (brief, or explain with sharding_options::explain)
};

// The cache file's name: every input of the choice (the program as written lowered, so its shapes,
// depths and precision; which dims are free; the mesh; the cost model; the cap; the options).
template <std::size_t N>
std::string sharding_key(const graph::program<N>& p, const ir::graph& as_written, const cost::model& model,
                         const step_options& o) {
  hasher h;
  // /3: `.to`s written with auto_ are decided too, named by their traced node, and a choice
  // carries the mesh's axis order; a choice cached before is made again.
  h.add(std::string_view("concerto.sharding/3")).add(cache::library_version);
  h.add(plan::hash(as_written)).add(cache::mesh_hash(as_written)).add(model.hw().hash());
  for (int l = 0; l < p.name_count; ++l) h.add(p.names[l].view()).add(p.free_dims[l]);
  for (int i = 0; i < p.raw_size; ++i)
    if (p.raw[i].free != 0) h.add(i).add(p.raw[i].free);
  h.add(o.memory_cap_bytes.value_or(-1)).add(o.sharding.keep).add(o.sharding.decide_zero);
  return h.hex();
}

// Rank 0's choice, from the cache or from autoshard::choose; printed once.
template <std::size_t N>
nlohmann::json choose_on_rank_0(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const lower_options& lo,
                                const step_options& o) {
  const auto model = cost::model::preset(o.cost_preset);
  const auto key = sharding_key(p, lower(p, shapes, m, lo), model, o);
  const auto file = o.cache_dir / ("sharding-" + key + ".json");
  if (o.use_cache) {
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    const auto stored = nlohmann::json::parse(text.str(), nullptr, false);
    // A file that is not a choice this program compiles (cut short, edited, another version's)
    // is chosen again and overwritten.
    const auto usable = [&] {
      if (!in || stored.is_discarded() || !stored.contains("choice") || !stored.contains("account")) return false;
      try {
        return graph::respecify(p, autoshard::sharding_from_json(stored.at("choice"))).program != nullptr;
      } catch (const std::exception&) {
        return false;
      }
    };
    if (usable()) {
      const auto account = "automatic sharding (cached in " + file.string() + "):\n" + stored.at("account").get<std::string>();
      std::printf("%s", account.c_str());
      std::fflush(stdout);
      return {{"choice", stored.at("choice")}, {"cached", true}, {"account", account}};
    }
  }
  autoshard::options ao{.memory_cap_bytes = o.memory_cap_bytes, .lower = lo, .decide_zero = o.sharding.decide_zero,
                        .keep = o.sharding.keep};
  const auto chosen = autoshard::choose(p, m, shapes, model, ao);
  const auto account = o.sharding.explain ? chosen.explain() : chosen.brief();
  std::printf("%s", account.c_str());
  std::fflush(stdout);
  nlohmann::json record{{"choice", autoshard::to_json(chosen.chosen.choice)}, {"account", account}};
  if (o.use_cache) write_file_atomically(file, record.dump(1));
  record["cached"] = false;
  return record;
}

/// The sharding of a program written with auto_ (nullopt for one without): chosen on rank 0 of
/// `o.world`, the same on every rank. Throws concerto::error on every rank when rank 0's choice fails.
template <std::size_t N>
std::optional<decided_sharding> decide_sharding(const graph::program<N>& p, const mesh& m, const shape_map& shapes,
                                                const optimizer_settings& opt, const step_options& o) {
  if (!p.has_free_dims()) return std::nullopt;
  if (m.index_of(o.pipeline.axis))
    fail("train::compile: automatic sharding chooses data- and tensor-parallel layouts; a pipelined mesh (axis '" +
         o.pipeline.axis + "') needs the specs written by hand (no auto_)");
  const auto lo = lowering_options(o, opt, m);
  const runtime::mpi::control world(o.world, runtime::detail::env_timeout_s(runtime::default_timeout_s));
  const nlohmann::json decision = runtime::decide_on_rank_0(world, "the automatic sharding from rank 0", "automatic sharding failed on rank 0",
                                                  [&] { return choose_on_rank_0(p, m, shapes, lo, o); });
  return decided_sharding{autoshard::sharding_from_json(decision.at("choice")), decision.at("cached").get<bool>(),
                          decision.at("account").get<std::string>()};
}

/// f(program) with `p` as written, or compiled with the decided sharding.
template <std::size_t N, class F>
auto with_sharding(const graph::program<N>& p, const std::optional<decided_sharding>& s, F&& f) {
  if (!s) return f(p);
  const auto compiled = graph::respecify(p, s->choice);
  if (!compiled.program) fail("train::compile: the automatic sharding does not compile: " + compiled.message());
  return f(*compiled.program);
}

} // namespace concerto::train::detail
