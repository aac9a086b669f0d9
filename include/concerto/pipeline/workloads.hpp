#pragma once
/// @file
/// @brief Pipeline problems of the benchmark workloads: `gpt-ptd` (GPT 5120 × 40, the paper's
/// pipeline × tensor × data setting) and `llama-ptd` (Llama-3-405B's shape, 126 layers over
/// 16 stages), priced by the cost model from the workloads' own task graphs.
///
/// A stage's graph is the workload's step for its tensor × data group (ir/workloads.hpp, two
/// blocks deep, on tp × dp ranks); its tasks become the chunks' costs:
/// - F: a block's forward kernels and its tensor-parallel collectives (synchronous, as
///   Megatron-LM runs them by default), plus the embedding on the first chunk and the head and
///   loss on the last;
/// - W and B: the backward kernels and tensor-parallel collectives, W those only weight
///   gradients need (pipeline/passes.hpp, the classification the stage split uses);
/// - the data-parallel gradient collectives (once per step, after the chunk's last backward) and
///   the optimizer;
/// - activations: the bytes of the forward's activation buffers that the backward reads, and
///   the share of them that weight-gradient kernels read;
/// - a message: one micro-batch's block output, sequence-sharded over tp (Megatron's scatter /
///   gather optimisation), sent across nodes.
/// The layers are split with split_layers (uneven counts give the first and last chunk fewer).

#include <concerto/cost/model.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/pipeline/passes.hpp>
#include <concerto/pipeline/schedule.hpp>

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::pipeline {

/// @brief How a pipelined workload is laid out.
struct workload_layout {
  int stages = 4;            ///< pipeline stages (one per node group)
  int virtual_stages = 1;    ///< chunks per stage
  int microbatches = 8;      ///< per step
  int tensor_parallel = 8;   ///< ranks per stage group along tp (within a node)
  int data_parallel = 1;
  int layers = 0;            ///< 0: the model's full depth
  int micro_batch = 1;       ///< sequences per micro-batch
};

/// @brief The pipelined workloads and the model each is made from.
[[nodiscard]] inline std::vector<std::string> workload_names() { return {"gpt-ptd", "llama-ptd"}; }

namespace detail {
// A pipelined workload's name with its layout: `gpt-ptd pp4x2 tp8 dp1 m8`.
inline std::string layout_name(std::string_view workload, const workload_layout& layout) {
  return std::string(workload) + " pp" + std::to_string(layout.stages) +
         (layout.virtual_stages > 1 ? "x" + std::to_string(layout.virtual_stages) : "") + " tp" +
         std::to_string(layout.tensor_parallel) + " dp" + std::to_string(layout.data_parallel) + " m" +
         std::to_string(layout.microbatches);
}
// Adds `times` a part's costs (a block's, the embedding's, the head's) to a chunk's.
inline void add_times(chunk_cost& k, const chunk_cost& part, double times) {
  k.forward_us += times * part.forward_us;
  k.input_grad_us += times * part.input_grad_us;
  k.weight_grad_us += times * part.weight_grad_us;
  k.grad_sync_us += times * part.grad_sync_us;
  k.optimizer_us += times * part.optimizer_us;
  k.activation_bytes += times * part.activation_bytes;
}
} // namespace detail

/// @brief The pipeline problem of a workload under a layout, priced by `model`. Throws
/// concerto::error naming the workload or the field that does not fit.
[[nodiscard]] inline problem make_problem(std::string_view workload, const cost::model& model,
                                          const workload_layout& layout) {
  std::string base;
  int full_layers = 0;
  if (workload == "gpt-ptd") { base = "gpt-ptd"; full_layers = 40; }
  else if (workload == "llama-ptd") { base = "llama3-405b-tp-sp"; full_layers = 126; }
  else {
    std::string known;
    for (const auto& n : workload_names()) known += (known.empty() ? "" : ", ") + n;
    fail("unknown pipeline workload '" + std::string(workload) + "' (known: " + known + ")");
  }
  const auto where = "pipeline workload '" + std::string(workload) + "': ";
  if (layout.stages < 1 || layout.virtual_stages < 1 || layout.microbatches < 1 || layout.tensor_parallel < 1 ||
      layout.data_parallel < 1 || layout.micro_batch < 1 || layout.layers < 0)
    fail(where + "every size of the layout must be at least 1 (layers: 0 for the full depth)");
  const int layers = layout.layers > 0 ? layout.layers : full_layers;
  const int chunks = layout.stages * layout.virtual_stages;
  const auto per_chunk = split_layers(layers, chunks);

  ir::workload_options wo;
  wo.layers = 2;
  wo.ranks = layout.tensor_parallel * layout.data_parallel;
  wo.ranks_per_node = layout.tensor_parallel;
  wo.micro_batch = layout.micro_batch;
  const auto g = ir::make_workload(base, wo);
  const auto d = model.durations_us(g);

  // Which part of the model each task belongs to: the embedding, block 0, or the head.
  enum part_id { embedding = 0, block = 1, head = 2 };
  int first_block_forward = -1, first_block_backward = -1;
  for (const auto& t : g.tasks) {
    if (t.layer < 0) continue;
    if (t.step_phase == ir::phase::forward && first_block_forward < 0) first_block_forward = t.id;
    if (t.step_phase == ir::phase::backward && first_block_backward < 0) first_block_backward = t.id;
  }
  const auto part_of = [&](const ir::task& t) -> int {
    if (t.layer == 0) return block;
    if (t.layer > 0) return -1; // the second block: the same as the first
    if (t.step_phase == ir::phase::forward) return t.id < first_block_forward ? embedding : head;
    if (t.step_phase == ir::phase::backward) return t.id < first_block_backward ? head : embedding;
    return embedding; // the embedding's and final norm's optimizer steps go with the first stage
  };
  const int tp_axis = g.axis_index("tp").value_or(-1);
  // Once per step: the optimizer and the data-parallel gradient collectives; the rest of the
  // backward is B or W by data flow (passes.hpp), as the stage split classifies it.
  const auto once_per_step = [&](ir::task_id u) {
    const auto& t = g.task_at(u);
    return t.step_phase == ir::phase::optimizer || (ir::is_collective(t.kind) && t.axis != tp_axis);
  };
  const auto backward = [&](ir::task_id t) { return g.task_at(t).step_phase == ir::phase::backward && !once_per_step(t); };
  // A W reader counts in the same part of the model only (the split: the same chunk), so a block's
  // input gradient, which the previous block (or stage) waits for, stays B.
  const auto section = [&](ir::task_id t) { return g.task_at(t).layer >= 0 ? 3 + g.task_at(t).layer : part_of(g.task_at(t)); };
  const auto is_w = weight_grad_tasks(g, consumers_of(ir::data_producers(g)), backward, once_per_step,
                                      [&](ir::task_id t, ir::task_id u) { return section(t) == section(u); });
  // Each part's costs; its weight_grad_share is found per chunk from the bytes W reads.
  chunk_cost parts[3];
  double weight_grad_bytes[3] = {0, 0, 0};
  std::vector<char> read_by_backward(g.buffers.size(), 0), read_by_weight_grad(g.buffers.size(), 0);
  for (const auto& t : g.tasks) {
    if (t.step_phase != ir::phase::backward) continue;
    for (const auto b : t.reads) {
      read_by_backward[static_cast<std::size_t>(g.root_of(b))] = 1;
      if (is_w[static_cast<std::size_t>(t.id)]) read_by_weight_grad[static_cast<std::size_t>(g.root_of(b))] = 1;
    }
  }
  std::set<ir::buffer_id> counted;
  for (const auto& t : g.tasks) {
    const int part = part_of(t);
    if (part < 0) continue;
    auto& c = parts[part];
    const auto w = t.step_phase == ir::phase::optimizer ? work::optimizer
                   : once_per_step(t.id)                ? work::grad_sync
                   : t.step_phase == ir::phase::forward  ? work::forward
                   : is_w[static_cast<std::size_t>(t.id)] ? work::weight_grad
                                                          : work::input_grad;
    charge(c, w, d[static_cast<std::size_t>(t.id)]);
    if (t.step_phase != ir::phase::forward) continue;
    for (const auto b : t.writes) {
      const auto root = g.root_of(b);
      const auto& buf = g.buffers[static_cast<std::size_t>(root)];
      if (buf.role != ir::buffer_role::activation || !read_by_backward[static_cast<std::size_t>(root)] ||
          !counted.insert(root).second)
        continue;
      c.activation_bytes += static_cast<double>(buf.bytes);
      if (read_by_weight_grad[static_cast<std::size_t>(root)]) weight_grad_bytes[part] += static_cast<double>(buf.bytes);
    }
  }

  problem p;
  p.name = detail::layout_name(workload, layout);
  p.stages = layout.stages;
  p.virtual_stages = layout.virtual_stages;
  p.microbatches = layout.microbatches;
  for (int c = 0; c < chunks; ++c) {
    chunk_cost k;
    double w_bytes = 0;
    const auto add = [&](int part, double times) {
      detail::add_times(k, parts[part], times);
      w_bytes += times * weight_grad_bytes[part];
    };
    add(block, per_chunk[static_cast<std::size_t>(c)]);
    if (c == 0) add(embedding, 1);
    if (c == chunks - 1) add(head, 1);
    k.weight_grad_share = k.activation_bytes > 0 ? w_bytes / k.activation_bytes : 0;
    k.layers = per_chunk[static_cast<std::size_t>(c)];
    p.chunks.push_back(k);
  }
  const auto& hw = model.hw();
  const double message = static_cast<double>(ir::block_output_values(base)) * layout.micro_batch /
                         layout.tensor_parallel * static_cast<double>(ir::size_of(wo.type));
  const auto link = layout.stages > 1 && hw.ranks_per_node <= layout.tensor_parallel * layout.data_parallel
                        ? ir::link_class::inter_node
                        : ir::link_class::intra_node;
  p.send_us.assign(static_cast<std::size_t>(chunks - 1), model.collective_us(ir::op_kind::send, message, 2, link));
  p.check();
  return p;
}

} // namespace concerto::pipeline
