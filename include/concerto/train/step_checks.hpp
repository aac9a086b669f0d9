#pragma once
/// @file
/// @brief A training step's debugging aids: its traces, where a loss that is not finite began (the first
/// kernel over all ranks that wrote such a value, executor_options::find_non_finite), and whether
/// the copies of each parameter block still hold the same bits (step_options::check_replicas_every).

#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/ir/ops.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/planner/policy.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/trace/chrome_trace.hpp>
#include <concerto/train/program_facts.hpp>
#include <concerto/train/tensors.hpp>

#include <bit>
#include <cstdio>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train::detail {

/// Where the step's first value that is not finite appeared, as the rest of the message about a
/// loss that is not finite: the earliest kernel over all ranks that wrote one, when the executor
/// looked (executor_options::find_non_finite), else how to make it look. Collective.
template <class Backend>
[[nodiscard]] std::string where_non_finite_began(const runtime::step_report& rep, const runtime::executor<Backend>& ex,
                                                 const runtime::mpi::control& control, const program_facts& facts,
                                                 const pipeline::stage_split* split,
                                                 const std::vector<pipeline::task_origin>& stage_origins) {
  const int rank_here = control.rank(), ranks = control.size();
  constexpr auto none = std::numeric_limits<std::int64_t>::max();
  const auto& mine = rep.first_non_finite;
  const std::string what = "where the values that are not finite of step " + std::to_string(rep.step) + " began";
  // Pipelined, each stage runs its own plan: positions in different plans are compared by
  // where their tasks lie in the schedule (micro-batch, pass), not by place in each list.
  const auto order = [&](const runtime::non_finite_output& f) -> std::int64_t {
    if (!split) return static_cast<std::int64_t>(f.position);
    return pipeline::causal_order(*split, stage_origins.at(static_cast<std::size_t>(f.task)),
                                  static_cast<std::int64_t>(f.position), static_cast<std::int64_t>(stage_origins.size()));
  };
  const auto first = control.min_all(mine ? order(*mine) * ranks + rank_here : none, what);
  if (first == none)
    return ex.options().find_non_finite
               ? "; no kernel wrote a value that is not finite on any rank (it came from the inputs or a collective)"
               : " (executor_options::find_non_finite, or CONCERTO_FIND_NON_FINITE=1, names the first kernel whose "
                 "output is not finite)";
  const int rank = static_cast<int>(first % ranks);
  std::string text;
  if (rank == rank_here) {
    const auto& g = ex.plan().graph;
    const auto& t = g.tasks[static_cast<std::size_t>(mine->task)];
    std::string reads;
    for (const auto b : t.reads) reads.append(reads.empty() ? " reading '" : ", '").append(g.buffers[static_cast<std::size_t>(b)].name).append("'");
    text = "; the first kernel whose output is not finite is " + as_written(facts, runtime::detail::task_label(g, t.id)) + " (" +
           std::string(ir::to_string(t.fn)) + reads + ") on rank " + std::to_string(rank) + ": " +
           std::to_string(mine->value) + " at element " + std::to_string(mine->element) + " of '" +
           g.buffers[static_cast<std::size_t>(mine->buffer)].name + "'";
  }
  control.broadcast(text, rank, what);
  return text;
}

/// step_options::check_replicas_every: every rank hashes the block it holds of each parameter
/// (which block: offset and shape; what it holds: the bits); ranks with the same block must
/// hold the same bits. Collective; every rank reaches the same verdict from the same hashes.
template <class Backend>
void check_replicas(std::int64_t step, const tensor_index& tensors, Backend& backend, const runtime::mpi::control& control,
                    const std::string& graph_name) {
  const int rank_here = control.rank(), ranks = control.size();
  // Each parameter as the step holds it (f32, or its working copy in 16 bits), then each f32
  // master a 16-bit policy keeps beside one: every copy of a block must hold the same bits.
  std::vector<std::string> params;
  std::vector<const tensor_info*> held;
  for (const auto& name : tensors.params()) {
    params.push_back(name);
    held.push_back(&tensors.info(name));
  }
  for (const auto& name : tensors.params())
    if (const auto* master = tensors.master(name)) {
      params.push_back(name + " (its f32 master)");
      held.push_back(master);
    }
  std::vector<std::byte> staging;
  std::vector<std::int64_t> mine;
  mine.reserve(2 * params.size());
  for (const auto* held_tensor : held) {
    const auto& t = *held_tensor;
    hasher block, bits;
    if (t.id < 0) { // held by another pipeline stage: a block no rank of it has
      block.add(std::string_view("elsewhere")).add(rank_here);
      mine.push_back(std::bit_cast<std::int64_t>(block.value()));
      mine.push_back(0);
      continue;
    }
    staging.resize(static_cast<std::size_t>(detail::count(t.blk.local)) * ir::size_of(t.type));
    backend.read(t.id, std::span(staging));
    for (const auto d : t.blk.offset) block.add(d);
    for (const auto d : t.blk.local) block.add(d);
    bits.add_bytes(staging.data(), staging.size());
    mine.push_back(std::bit_cast<std::int64_t>(block.value()));
    mine.push_back(std::bit_cast<std::int64_t>(bits.value()));
  }
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(ranks));
  control.all_gather(std::span<const std::int64_t>(mine), std::span(all),
                       "the replica check of step " + std::to_string(step));
  const auto at = [&](int rank, std::size_t i) { return all[static_cast<std::size_t>(rank) * mine.size() + i]; };
  std::string differences;
  for (std::size_t p = 0; p < params.size(); ++p)
    for (int r = 0; r < ranks; ++r)
      for (int first = 0; first < r; ++first)
        if (at(first, 2 * p) == at(r, 2 * p)) { // the first rank that holds the same block
          if (at(first, 2 * p + 1) != at(r, 2 * p + 1)) {
            if (!differences.empty()) differences += ", ";
            differences.append("'").append(params[p]).append("' on ranks ").append(std::to_string(first));
            differences.append(" and ").append(std::to_string(r));
          }
          break;
        }
  if (!differences.empty())
    fail_on_every_rank("train step: after step " + std::to_string(step) + " of graph '" + graph_name +
                       "', copies of the same parameter block differ: " + differences +
                       " (step_options::check_replicas_every)");
}

// Writes rank `rank`'s trace of `kind` ("planned", "measured") into `dir`. A trace that cannot
// be written is reported, not thrown: one rank throwing here would leave the others waiting in the
// step's loss reduction.
inline void write_trace(const std::filesystem::path& dir, const ir::graph& g, planner::policy policy, const char* kind,
                        int rank, const sim::result& r) {
  const auto name = g.name + "." + std::string(planner::to_string(policy)) + "." + kind + ".rank" + std::to_string(rank) + ".json";
  try {
    write_file_atomically(dir / name, trace::chrome_trace(g, r, "rank " + std::to_string(rank)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto: rank %d could not write a trace (%s)\n", rank, e.what());
  }
}

} // namespace concerto::train::detail
