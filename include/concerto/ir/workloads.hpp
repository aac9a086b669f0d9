#pragma once
/// @file
/// @brief The benchmark workloads of BENCHMARKS.md as task graphs, made with ir::builder.
///
/// Each workload is one training step of one rank (SPMD): embedding, forward of L transformer
/// blocks, loss, backward (data-gradient and weight-gradient matmuls as separate tasks, as
/// Megatron-LM and PyTorch do, so that a gradient collective can overlap the rest of the
/// data-gradient chain), and the AdamW step, with the collectives the parallelism implies on
/// the right mesh axis. Buffers carry local (per-rank) shapes, matmuls their m/n/k attributes,
/// every compute task its function, so an executor can run the graph as written.
/// docs/workloads.md gives each model, its collectives per layer and its FLOP formula.
///
/// @code
/// auto g = ir::make_workload("llama-tp-sp", {.layers = 4});   // 4 of the 80 blocks
/// for (const auto& t : g.tasks) if (ir::is_collective(t.kind)) ...;
/// @endcode

#include <concerto/ir/builder.hpp>

#include <cmath>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::ir {

/// @brief Size of the model and of the machine a workload is generated for.
struct workload_options {
  int layers = 0;           ///< transformer blocks; 0 = the model's full depth
  int ranks = 32;           ///< ranks in the job
  int ranks_per_node = 8;   ///< ranks sharing a node (the tensor-parallel group where there is one)
  int micro_batch = 1;      ///< sequences per rank per step
  dtype type = dtype::bf16; ///< activations, parameters and gradients (optimizer state is f32)
};

namespace detail::workloads {

using i64 = std::int64_t;

// FLOPs from the op table, as the DSL's lowering prices the same op (member by member, so that
// users' -Wmissing-field-initializers stays quiet).
inline compute_info op_info(op fn, std::map<std::string, std::int64_t> attrs = {}) {
  compute_info c;
  c.fn = fn;
  c.attrs = std::move(attrs);
  return c;
}
// A compute task of the op's kind.
inline void add_task(builder& b, std::string name, std::vector<buffer_id> reads, std::vector<buffer_id> writes,
                     compute_info c) {
  b.compute(ir::info(c.fn).kind, std::move(name), std::move(reads), std::move(writes), std::move(c));
}

/// A transformer's sizes: GPT (LayerNorm, GELU MLP, learned positions) or Llama (RMSNorm,
/// SwiGLU MLP, RoPE, grouped-query attention); with experts > 0 the MLP is a mixture of
/// `experts` SwiGLU experts of width ffn, each token routed to `top_k` of them (Mixtral).
struct model_spec {
  i64 hidden = 0, layers = 0, seq = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  bool llama = false;
  i64 experts = 0, top_k = 0;
  bool axial = false; ///< an Evoformer pair stack (pair_stack): hidden = c_z, seq = residues, ffn = the transition's width
  /// A Vision Transformer as examples/vit writes it: seq = the class token and the patches of an
  /// image (a square grid of `patch`-pixel patches), vocab = classes; a strided convolution
  /// embeds the patches, the class token is joined before them, a position table is added, layer
  /// norms have a gain and a shift of their own, q, k and v are separate projections, attention
  /// has no mask, the class token's final state feeds the head.
  bool vit = false;
  i64 patch = 0;
};

// ZeRO-2 keeps whole parameters and shards gradients and optimizer state: each gradient is
// reduce-scattered, each rank updates its shard, and the updated shards are all-gathered back.
// ZeRO-3 also shards the parameters and gathers each before every use.
enum class grad_sync { all_reduce, zero2, zero3 };

struct param {
  std::string name;
  int layer = -1;
  i64 numel = 0;
  buffer_id store = -1;    // what the rank keeps: the whole (tensor-parallel local) tensor, or its ZeRO shard
  buffer_id use_fwd = -1;  // what forward kernels read (the gathered copy under ZeRO-3)
  buffer_id use_bwd = -1;  // what backward kernels read (gathered again under ZeRO-3)
  buffer_id grad = -1;     // what the kernels write
  buffer_id grad_out = -1; // what the optimizer reads (the reduce-scattered shard under ZeRO-2/3)
  buffer_id shard = -1;    // ZeRO-2: the rank's shard of the parameter, which the optimizer updates
  buffer_id state = -1;    // AdamW master weight, m and v in f32
  bool tp_partial = false; // gradient is a partial sum over the tensor-parallel group (sequence-parallel norms)
  bool expert = false;     // an expert's weight: replicated over dp only, not over the expert-parallel group
};

// What every workload's generator writes with: its builder, the type of its activations, and
// tasks priced by the op table.
class workload_writer {
protected:
  workload_writer(builder& b, dtype type) : b_(b), type_(type) {}
  static compute_info info(op fn, std::map<std::string, std::int64_t> attrs = {}) { return op_info(fn, std::move(attrs)); }
  void task(std::string name, std::vector<buffer_id> reads, std::vector<buffer_id> writes, compute_info c) {
    add_task(b_, std::move(name), std::move(reads), std::move(writes), std::move(c));
  }
  buffer_id act(std::string name, std::vector<i64> shape, dtype t) {
    return b_.buffer(std::move(name), std::move(shape), buffer_role::activation, t);
  }
  buffer_id act(std::string name, std::vector<i64> shape) { return act(std::move(name), std::move(shape), type_); }
  // A copy: adding buffers moves the graph's.
  [[nodiscard]] std::vector<i64> shape_of(buffer_id x) const { return b_.peek().buffers[static_cast<std::size_t>(x)].shape; }

  builder& b_;
  dtype type_;
};

class transformer : workload_writer {
public:
  transformer(builder& b, const model_spec& m, const workload_options& o, int tp, grad_sync sync)
      : workload_writer(b, o.type), m_(m), tp_(tp), sync_(sync) {
    moe_ = m.experts > 0;
    ep_ = moe_ ? o.ranks_per_node : 1;
    const int dp = o.ranks / (tp * ep_);
    batch_ = o.micro_batch;
    tok_ = batch_ * m.seq;
    tok_sp_ = tok_ / tp;
    // Megatron pads the vocabulary to a multiple of 128 × tp so that every shard is aligned.
    vocab_ = (m.vocab + 128 * tp - 1) / (128 * tp) * (128 * tp);
    head_dim_ = m.hidden / m.heads;
    qkv_n_ = (m.hidden + 2 * m.kv_heads * head_dim_) / tp;
    if (tp > 1)
      tp_axis_ = b.axis("tp", tp, o.ranks_per_node >= tp ? link_class::intra_node : link_class::inter_node);
    if (ep_ > 1)
      ep_axis_ = b.axis("ep", ep_, link_class::intra_node);
    if (dp > 1)
      dp_axis_ = b.axis("dp", dp, o.ranks > o.ranks_per_node ? link_class::inter_node : link_class::intra_node);
    dp_ = dp;
  }

  void build(int layers) {
    std::vector<buffer_id> x(static_cast<std::size_t>(layers) + 1);
    x[0] = embedding_forward();
    for (int l = 0; l < layers; ++l)
      x[static_cast<std::size_t>(l) + 1] = block_forward(l, x[static_cast<std::size_t>(l)]);
    auto dx = head(x.back());
    for (int l = layers - 1; l >= 0; --l)
      dx = block_backward(l, dx);
    embedding_backward(dx);
    for (auto& p : params_) {
      b_.at(phase::optimizer, p.layer);
      const auto updated = zero2() ? p.shard : p.store;
      // As the DSL lowers ZeRO-1/2: this rank's shard of the whole parameter, updated, gathered back.
      if (zero2()) task(p.name + ".shard", {p.store}, {p.shard}, info(op::shard_slice, {{"dim", 0}, {"parts", dp_}}));
      task(p.name + ".adamw", {p.grad_out, updated, p.state}, {updated, p.state},
                 info(op::adamw, {{"numel", local_numel(p)}}));
      if (zero2()) b_.collective(op_kind::all_gather, p.name + ".ag.update", dp_axis_, p.shard, p.store);
    }
  }

private:
  struct moe_saved {
    buffer_id n2 = -1, logits = -1, gates = -1, x = -1, u1 = -1, u3 = -1, a = -1, back = -1;
    param *router = nullptr, *w1 = nullptr, *w3 = nullptr, *w2 = nullptr; // w*: [E/ep, ...], batched
  };
  // A norm's parameters: the gain (GPT: gain and shift packed as [2h]) and, for the ViT, its
  // shift of its own, as the DSL's layernorm(x, g, b) takes them.
  struct norm_params {
    param* gain = nullptr;
    param* shift = nullptr;
  };
  struct saved_block {
    buffer_id x_in, n1, n1f, qkv, attn, lse, x_mid, n2, n2f, u, a;
    norm_params norm1, norm2;
    param *qkv_w, *o_w, *up_w, *down_w;
    // Llama: q, k, v and the MLP's gate and up projections are separate, as the DSL writes them.
    buffer_id q, k, v, gate;
    param *q_w, *k_w, *v_w, *gate_w;
  };
  // A column-parallel projection of a gathered input, for columns_backward.
  struct column {
    std::string name;
    buffer_id dy;
    param* w;
    i64 n;
  };

  [[nodiscard]] bool zero3() const { return sync_ == grad_sync::zero3 && dp_axis_ >= 0; }
  [[nodiscard]] bool zero2() const { return sync_ == grad_sync::zero2 && dp_axis_ >= 0; }
  [[nodiscard]] i64 local_numel(const param& p) const { return zero2() || zero3() ? (p.numel + dp_ - 1) / dp_ : p.numel; }
  [[nodiscard]] static double d(i64 v) { return static_cast<double>(v); }

  param& make_param(const std::string& name, std::vector<i64> shape, int layer, bool tp_partial = false) {
    param p;
    p.name = name;
    p.layer = layer;
    p.tp_partial = tp_partial && tp_axis_ >= 0;
    p.numel = 1;
    for (auto e : shape)
      p.numel *= e;
    if (zero3()) {
      // DeepSpeed flattens and pads a parameter so that it splits evenly over the group.
      const i64 shard = local_numel(p);
      auto full = p.numel % dp_ == 0 ? shape : std::vector<i64>{shard * dp_};
      p.store = b_.buffer(name, {shard}, buffer_role::param, type_);
      p.use_fwd = b_.buffer(name + ".full", full, buffer_role::workspace, type_);
      p.use_bwd = b_.buffer(name + ".full.bwd", full, buffer_role::workspace, type_);
      p.grad = b_.buffer(name + ".grad.full", full, buffer_role::gradient, type_);
      p.grad_out = b_.buffer(name + ".grad", {shard}, buffer_role::gradient, type_);
    } else if (zero2()) {
      // Whole parameters for the kernels; the shard the optimizer owns is padded as under ZeRO-3.
      const i64 shard = local_numel(p);
      p.store = p.use_fwd = p.use_bwd = b_.buffer(name, shape, buffer_role::param, type_);
      p.shard = b_.buffer(name + ".shard", {shard}, buffer_role::param, type_);
      p.grad = b_.buffer(name + ".grad.full", p.numel % dp_ == 0 ? shape : std::vector<i64>{shard * dp_},
                         buffer_role::gradient, type_);
      p.grad_out = b_.buffer(name + ".grad", {shard}, buffer_role::gradient, type_);
    } else {
      p.store = p.use_fwd = p.use_bwd = b_.buffer(name, std::move(shape), buffer_role::param, type_);
      p.grad = p.grad_out = b_.buffer(name + ".grad", b_.peek().buffers[static_cast<std::size_t>(p.store)].shape,
                                      buffer_role::gradient, type_);
    }
    p.state = b_.buffer(name + ".adamw", {3, local_numel(p)}, buffer_role::optimizer_state, dtype::f32);
    params_.push_back(std::move(p));
    return params_.back();
  }

  // ZeRO-3 gathers a parameter right before each use; the planner decides how early.
  buffer_id use(param& p, bool forward) {
    if (!zero3())
      return p.store;
    const auto out = forward ? p.use_fwd : p.use_bwd;
    b_.collective(op_kind::all_gather, p.name + (forward ? ".ag.fwd" : ".ag.bwd"), dp_axis_, p.store, out);
    return out;
  }

  // One collective per gradient as it becomes ready; bucketing is the planner's job.
  void gradient_ready(param& p) {
    if (p.tp_partial)
      b_.collective(op_kind::all_reduce, p.name + ".grad.ar.tp", tp_axis_, p.grad, p.grad);
    // The mesh is the product ep × dp, so "over all ranks" is two all-reduces: inside the node
    // first (fast links, the full gradient), then across nodes.
    if (!p.expert && ep_axis_ >= 0)
      b_.collective(op_kind::all_reduce, p.name + ".grad.ar.ep", ep_axis_, p.grad, p.grad);
    if (dp_axis_ < 0)
      return;
    if (zero2() || zero3())
      b_.collective(op_kind::reduce_scatter, p.name + ".grad.rs", dp_axis_, p.grad, p.grad_out);
    else
      b_.collective(op_kind::all_reduce, p.name + ".grad.ar", dp_axis_, p.grad, p.grad);
  }

  // Sequence parallelism: [tok/tp, k] -> [tok, k] before a column-parallel matmul.
  buffer_id gather_seq(const std::string& name, buffer_id x, i64 k) {
    if (tp_axis_ < 0)
      return x;
    const auto out = act(name + ".full", {tok_, k});
    b_.collective(op_kind::all_gather, name + ".ag", tp_axis_, x, out);
    return out;
  }
  // ... and [tok, k] partial sums -> [tok/tp, k] after a row-parallel matmul.
  buffer_id scatter_seq(const std::string& name, buffer_id x_partial, i64 k) {
    if (tp_axis_ < 0)
      return x_partial;
    const auto out = act(name, {tok_sp_, k});
    b_.collective(op_kind::reduce_scatter, name + ".rs", tp_axis_, x_partial, out);
    return out;
  }
  [[nodiscard]] std::string partial(const std::string& name) const { return tp_axis_ >= 0 ? name + ".partial" : name; }

  norm_params make_norm(const std::string& name, int layer) {
    if (m_.vit) {
      auto& g = make_param(name + ".g", {m_.hidden}, layer, true);
      return {&g, &make_param(name + ".b", {m_.hidden}, layer, true)};
    }
    return {&make_param(name + ".w", {m_.llama ? m_.hidden : 2 * m_.hidden}, layer, true)};
  }
  // Over this rank's tokens, or `rows` of them (the ViT's class tokens).
  buffer_id norm(const std::string& name, buffer_id x, norm_params w, i64 rows = 0) {
    const auto out = act(name + ".out", {rows > 0 ? rows : tok_sp_, m_.hidden});
    std::vector<buffer_id> reads{x, use(*w.gain, true)};
    if (w.shift) reads.push_back(use(*w.shift, true));
    task(name, std::move(reads), {out}, info(m_.llama ? op::rmsnorm : op::layernorm, {{"hidden", m_.hidden}}));
    return out;
  }
  buffer_id norm_backward(const std::string& name, buffer_id dy, buffer_id x, norm_params w, i64 rows = 0) {
    const auto dx = act(name + ".in.grad", {rows > 0 ? rows : tok_sp_, m_.hidden});
    const auto weight = use(*w.gain, false);
    if (m_.llama) { // as the DSL lowers RMSNorm's backward: the input's gradient, then the gain's
      task(name + ".grad", {x, weight, dy}, {dx}, info(op::rmsnorm_grad));
      task(name + ".grad.gain", {x, dy}, {w.gain->grad}, info(op::rmsnorm_grad_gain));
    } else if (w.shift) { // as the DSL lowers layernorm(x, g, b)'s: dx, the gain's, the shift's
      task(name + ".grad", {x, weight, dy}, {dx}, info(op::layernorm_grad));
      task(name + ".grad.gain", {x, dy}, {w.gain->grad}, info(op::layernorm_grad_gamma));
      task(name + ".grad.shift", {dy}, {w.shift->grad}, info(op::bias_grad));
      gradient_ready(*w.shift);
    } else {
      task(name + ".grad", {x, weight, dy}, {dx, w.gain->grad}, info(op::layernorm_grad));
    }
    gradient_ready(*w.gain);
    return dx;
  }
  buffer_id add(const std::string& name, buffer_id a, buffer_id b) {
    const auto out = act(name, {tok_sp_, m_.hidden});
    task(name, {a, b}, {out}, info(op::add));
    return out;
  }

  // y[tok, n] = x[tok, k] · W[k, n] on full (gathered) rows.
  buffer_id linear(const std::string& name, buffer_id x, param& w, i64 n, i64 k, const std::string& out_name) {
    const auto y = act(out_name, {tok_, n});
    b_.matmul(name, x, use(w, true), y, tok_, n, k);
    return y;
  }

  // Backward of y = gather_seq(x_sp) · W (column parallel). Megatron-SP gathers the input again
  // rather than keeping it, and issues that gather before the data-gradient matmul.
  buffer_id column_backward(const std::string& name, buffer_id x_sp, buffer_id x_full, buffer_id dy, param& w, i64 n,
                            i64 k) {
    auto x = x_full;
    if (tp_axis_ >= 0) {
      x = act(name + ".in.full.bwd", {tok_, k});
      b_.collective(op_kind::all_gather, name + ".in.ag.bwd", tp_axis_, x_sp, x);
    }
    const auto weight = use(w, false);
    const auto dx_full = act(partial(name + ".in.grad"), {tok_, k});
    b_.matmul(name + ".dgrad", dy, weight, dx_full, tok_, k, n, 1, false, true);
    const auto dx = scatter_seq(name + ".in.grad", dx_full, k);
    b_.matmul(name + ".wgrad", x, dy, w.grad, k, n, tok_, 1, true, false);
    gradient_ready(w);
    return dx;
  }
  // Backward of y_sp = scatter_seq(x · W) (row parallel): the output gradient is gathered first.
  buffer_id row_backward(const std::string& name, buffer_id x, buffer_id dy_sp, param& w, i64 n, i64 k) {
    const auto dy = gather_seq(name + ".out.grad", dy_sp, n);
    const auto weight = use(w, false);
    const auto dx = act(name + ".in.grad", {tok_, k});
    b_.matmul(name + ".dgrad", dy, weight, dx, tok_, k, n, 1, false, true);
    b_.matmul(name + ".wgrad", x, dy, w.grad, k, n, tok_, 1, true, false);
    gradient_ready(w);
    return dx;
  }

  // Backward of several column-parallel projections of one gathered input, in the DSL's form:
  // the gathered input is kept (not gathered again), the input gradients are summed, then
  // reduce-scattered back to sequence shards once.
  buffer_id columns_backward(const std::string& name, buffer_id x_full, const std::vector<column>& cols, i64 k) {
    buffer_id sum = -1;
    for (const auto& c : cols) {
      const auto dx = act(partial(c.name + ".in.grad"), {tok_, k});
      b_.matmul(c.name + ".dgrad", c.dy, use(*c.w, false), dx, tok_, k, c.n, 1, false, true);
      if (sum >= 0) {
        const auto total = act(partial(c.name + ".in.grad.sum"), {tok_, k});
        task(c.name + ".in.grad.sum", {sum, dx}, {total}, info(op::add));
        sum = total;
      } else {
        sum = dx;
      }
      b_.matmul(c.name + ".wgrad", x_full, c.dy, c.w->grad, k, c.n, tok_, 1, true, false);
      gradient_ready(*c.w);
    }
    return scatter_seq(name + ".in.grad", sum, k);
  }
  // Rotary embedding of a [tok, heads·head_dim] projection by the tokens' positions, and back.
  buffer_id rotate(const std::string& name, buffer_id x) {
    const auto& shape = b_.peek().buffers[static_cast<std::size_t>(x)].shape;
    const auto out = act(name + ".out", shape);
    task(name, {x, positions_}, {out}, info(op::rope, {{"head_dim", head_dim_}, {"theta", 10000}}));
    return out;
  }
  buffer_id rotate_back(const std::string& name, buffer_id dy) {
    const auto& shape = b_.peek().buffers[static_cast<std::size_t>(dy)].shape;
    const auto dx = act(name + ".out", shape);
    task(name, {dy, positions_}, {dx}, info(op::rope_grad, {{"head_dim", head_dim_}, {"theta", 10000}}));
    return dx;
  }

  // The ViT's tokens: the class token [1, hidden] (repeated over the images) before the patches,
  // a convolution of stride = kernel = patch over the images viewed as a sequence, plus the
  // position table. Its backward: the table's gradient, the class token's (summed over the
  // images), the patches' part, the kernel's.
  [[nodiscard]] i64 grid() const { return static_cast<i64>(std::llround(std::sqrt(static_cast<double>(m_.seq - 1)))); }
  [[nodiscard]] ir::dim_part token_part(i64 offset, i64 length, i64 broadcast) const {
    return {batch_, 1, m_.seq, m_.hidden, offset, length, broadcast};
  }
  [[nodiscard]] std::map<std::string, std::int64_t> patch_attrs() const {
    const i64 side = grid() * m_.patch;
    return ir::conv_geometry{batch_, side, side, 3, m_.hidden, m_.patch, m_.patch, m_.patch, 0}.attrs();
  }
  buffer_id patches_forward() {
    b_.at(phase::forward, -1);
    const i64 h = m_.hidden, side = grid() * m_.patch;
    images_ = b_.buffer("images", {batch_, side, side, 3}, buffer_role::input, type_);
    labels_ = b_.buffer("labels", {batch_}, buffer_role::input, dtype::i32);
    wte_ = &make_param("embed.patch", {m_.patch, m_.patch, 3, h}, -1);
    cls_ = &make_param("embed.cls", {1, h}, -1);
    wpe_ = &make_param("embed.pos", {m_.seq, h}, -1);
    const auto patches = act("embed.patches", {batch_, grid(), grid(), h});
    task("embed", {images_, use(*wte_, true)}, {patches}, info(op::conv2d, patch_attrs()));
    const auto tokens = act("embed.tokens", {tok_, h});
    task("embed.cls", {use(*cls_, true), patches}, {tokens}, info(op::concat_dim, token_part(0, 1, 1).attrs()));
    const auto out = act("embed.pos.out", {tok_, h});
    task("embed.pos", {tokens, use(*wpe_, true)}, {out}, info(op::bias_add));
    return out;
  }
  void patches_backward(buffer_id dx) {
    b_.at(phase::backward, -1);
    task("embed.pos.grad", {dx}, {wpe_->grad}, info(op::bias_grad));
    gradient_ready(*wpe_);
    task("embed.cls.grad", {dx}, {cls_->grad}, info(op::concat_dim_grad, token_part(0, 1, 1).attrs()));
    gradient_ready(*cls_);
    const auto dpatches = act("embed.patches.grad", {batch_, grid(), grid(), m_.hidden});
    task("embed.patches.grad", {dx}, {dpatches}, info(op::concat_dim_grad, token_part(1, m_.seq - 1, 0).attrs()));
    task("embed.grad", {images_, dpatches}, {wte_->grad}, info(op::conv2d_grad_weight, patch_attrs()));
    gradient_ready(*wte_);
  }

  buffer_id embedding_forward() {
    if (m_.vit) return patches_forward();
    b_.at(phase::forward, -1);
    const i64 h = m_.hidden;
    tokens_ = b_.buffer("tokens", {batch_, m_.seq}, buffer_role::input, dtype::i32);
    labels_ = b_.buffer("labels", {batch_, m_.seq}, buffer_role::input, dtype::i32);
    if (m_.llama) positions_ = b_.buffer("positions", {batch_, m_.seq}, buffer_role::input, dtype::i32);
    wte_ = &make_param("embed.wte", {vocab_ / tp_, h}, -1);
    if (!m_.llama)
      wpe_ = &make_param("embed.wpe", {m_.seq, h}, -1, true);
    // A vocabulary-parallel lookup leaves zeros for other shards' tokens: a partial sum over tp.
    const auto e_full = act(partial("embed.out"), {tok_, h});
    task("embed", {tokens_, use(*wte_, true)}, {e_full},
               info(op::embedding, {{"vocab", vocab_ / tp_}, {"hidden", h}}));
    auto x = scatter_seq("embed.out", e_full, h);
    if (wpe_) {
      const auto out = act("embed.pos.out", {tok_sp_, h});
      task("embed.pos", {x, use(*wpe_, true)}, {out}, info(op::add_position));
      x = out;
    }
    return x;
  }

  void embedding_backward(buffer_id dx) {
    if (m_.vit) return patches_backward(dx);
    b_.at(phase::backward, -1);
    if (wpe_) {
      task("embed.pos.grad", {dx}, {wpe_->grad},
                 info(op::position_embedding_grad));
      gradient_ready(*wpe_);
    }
    const auto dy = gather_seq("embed.out.grad", dx, m_.hidden);
    task("embed.grad", {dy, tokens_}, {wte_->grad},
               info(op::embedding_grad, {{"vocab", vocab_ / tp_}, {"hidden", m_.hidden}}));
    gradient_ready(*wte_);
  }

  // The ViT's: the class token's state (a slice of the sequence), its norm, the head over the
  // classes (vocab), the loss.
  buffer_id pooled_head(buffer_id x) {
    b_.at(phase::forward, -1);
    const i64 h = m_.hidden, classes = m_.vocab;
    const auto normf = make_norm("head.norm", -1);
    auto& w = make_param("head.w", {h, classes}, -1);
    const ir::dim_part token{1, batch_, m_.seq, h, 0, 1, 0};
    const auto cls = act("head.cls", {batch_, h});
    task("head.cls", {x}, {cls}, info(op::slice_dim, token.attrs()));
    const auto pooled = norm("head.norm", cls, normf, batch_);
    const auto logits = act("head.logits", {batch_, classes});
    b_.matmul("head.logits", pooled, use(w, true), logits, batch_, classes, h);
    const auto loss = b_.buffer("loss", {1}, buffer_role::activation, dtype::f32);
    task("loss", {logits, labels_}, {loss}, info(op::cross_entropy));
    b_.at(phase::backward, -1);
    const auto dlogits = act("head.logits.grad", {batch_, classes});
    task("loss.grad", {logits, labels_}, {dlogits}, info(op::cross_entropy_grad));
    const auto dpooled = act("head.pool.out.grad", {batch_, h});
    b_.matmul("head.logits.dgrad", dlogits, use(w, false), dpooled, batch_, h, classes, 1, false, true);
    b_.matmul("head.logits.wgrad", pooled, dlogits, w.grad, h, classes, batch_, 1, true, false);
    gradient_ready(w);
    const auto dcls = norm_backward("head.norm", dpooled, cls, normf, batch_);
    const auto dx = act("head.cls.grad", {tok_, h});
    task("head.cls.grad", {dcls}, {dx}, info(op::slice_dim_grad, token.attrs()));
    return dx;
  }

  // Final norm, logits, loss, and their backward; returns the gradient of the last block's output.
  buffer_id head(buffer_id x) {
    if (m_.vit) return pooled_head(x);
    b_.at(phase::forward, -1);
    const i64 h = m_.hidden, v = vocab_ / tp_;
    const auto normf = make_norm("head.norm", -1);
    auto& w = make_param("head.w", {h, v}, -1);
    const auto xf = norm("head.norm", x, normf);
    const auto xff = gather_seq("head.norm.out", xf, h);
    const auto logits = linear("head.logits", xff, w, v, h, "head.logits");
    const auto loss = b_.buffer("loss", {1}, buffer_role::activation, dtype::f32);
    const auto stats = b_.buffer("loss.stats", {2, tok_}, buffer_role::activation, dtype::f32);
    std::vector<buffer_id> saved{logits, labels_, stats};
    if (tp_axis_ < 0) {
      task("loss", {logits, labels_}, {loss, stats},
                 info(op::cross_entropy));
    } else {
      // Vocabulary-parallel cross-entropy (Megatron): a max and a sum of exponentials over tp.
      const auto mx = b_.buffer("loss.max", {tok_}, buffer_role::activation, dtype::f32);
      saved.push_back(mx);
      task("loss.max", {logits}, {mx}, info(op::vocab_ce_max));
      b_.collective(op_kind::all_reduce, "loss.max.ar", tp_axis_, mx, mx, -1, op::max);
      task("loss.sumexp", {logits, mx, labels_}, {stats},
                 info(op::vocab_ce_sumexp));
      b_.collective(op_kind::all_reduce, "loss.stats.ar", tp_axis_, stats, stats);
      task("loss", {stats, mx}, {loss}, info(op::vocab_ce_loss));
    }
    b_.at(phase::backward, -1);
    const auto dlogits = act("head.logits.grad", {tok_, v});
    task("loss.grad", std::move(saved), {dlogits},
               info(op::cross_entropy_grad));
    const auto dxf = column_backward("head.logits", xf, xff, dlogits, w, v, h);
    return norm_backward("head.norm", dxf, x, normf);
  }

  buffer_id block_forward(int l, buffer_id x_in) {
    const auto L = layer_prefix(l);
    const i64 h = m_.hidden, f = m_.ffn / tp_;
    b_.at(phase::forward, l);
    saved_block s{};
    s.x_in = x_in;
    const i64 kv = m_.kv_heads * head_dim_ / tp_;
    s.norm1 = make_norm(L + "ln1", l);
    if (m_.llama || m_.vit) {
      s.q_w = &make_param(L + "attn.q.w", {h, h / tp_}, l);
      s.k_w = &make_param(L + "attn.k.w", {h, kv}, l);
      s.v_w = &make_param(L + "attn.v.w", {h, kv}, l);
    } else {
      s.qkv_w = &make_param(L + "attn.qkv.w", {h, qkv_n_}, l);
    }
    s.o_w = &make_param(L + "attn.proj.w", {h / tp_, h}, l);
    s.norm2 = make_norm(L + "ln2", l);
    if (!moe_) {
      if (m_.llama) s.gate_w = &make_param(L + "mlp.gate.w", {h, f}, l);
      s.up_w = &make_param(L + "mlp.up.w", {h, f}, l);
      s.down_w = &make_param(L + "mlp.down.w", {f, h}, l);
    }

    s.n1 = norm(L + "ln1", x_in, s.norm1);
    s.n1f = gather_seq(L + "ln1.out", s.n1, h);
    s.attn = act(L + "attn.out", {tok_, h / tp_});
    s.lse = act(L + "attn.lse", {batch_, m_.heads / tp_, m_.seq}, dtype::f32);
    if (m_.llama || m_.vit) {
      // Llama: rotary embeddings on q and k; k and v with fewer heads (grouped-query attention).
      s.q = linear(L + "attn.q", s.n1f, *s.q_w, h / tp_, h, L + "attn.q.out");
      s.k = linear(L + "attn.k", s.n1f, *s.k_w, kv, h, L + "attn.k.out");
      if (m_.llama) {
        s.q = rotate(L + "attn.q.rope", s.q);
        s.k = rotate(L + "attn.k.rope", s.k);
      }
      s.v = linear(L + "attn.v", s.n1f, *s.v_w, kv, h, L + "attn.v.out");
      task(L + "attention", {s.q, s.k, s.v}, {s.attn, s.lse}, info(op::attention, attention_attrs()));
    } else {
      s.qkv = linear(L + "attn.qkv", s.n1f, *s.qkv_w, qkv_n_, h, L + "attn.qkv.out");
      task(L + "attention", {s.qkv}, {s.attn, s.lse}, info(op::attention, attention_attrs()));
    }
    const auto o = linear(L + "attn.proj", s.attn, *s.o_w, h, h / tp_, partial(L + "attn.proj.out"));
    s.x_mid = add(L + "resid1", x_in, scatter_seq(L + "attn.proj.out", o, h));

    s.n2 = norm(L + "ln2", s.x_mid, s.norm2);
    if (moe_) {
      const auto x_out = add(L + "resid2", s.x_mid, moe_forward(l, s.n2));
      saved_.push_back(s);
      return x_out;
    }
    s.n2f = gather_seq(L + "ln2.out", s.n2, h);
    s.a = act(L + "mlp.act.out", {tok_, f});
    if (m_.llama) {
      s.gate = linear(L + "mlp.gate", s.n2f, *s.gate_w, f, h, L + "mlp.gate.out");
      s.u = linear(L + "mlp.up", s.n2f, *s.up_w, f, h, L + "mlp.up.out");
      task(L + "mlp.act", {s.gate, s.u}, {s.a}, info(op::swiglu));
    } else {
      s.u = linear(L + "mlp.up", s.n2f, *s.up_w, f, h, L + "mlp.up.out");
      task(L + "mlp.act", {s.u}, {s.a}, info(op::gelu));
    }
    const auto y = linear(L + "mlp.down", s.a, *s.down_w, h, f, partial(L + "mlp.down.out"));
    const auto x_out = add(L + "resid2", s.x_mid, scatter_seq(L + "mlp.down.out", y, h));
    saved_.push_back(s);
    return x_out;
  }

  buffer_id block_backward(int l, buffer_id dx_out) {
    const auto L = layer_prefix(l);
    const i64 h = m_.hidden, f = m_.ffn / tp_;
    b_.at(phase::backward, l);
    auto& s = saved_[static_cast<std::size_t>(l)];
    if (moe_) {
      const auto dn2 = moe_backward(l, dx_out);
      const auto dx_mid = add(L + "resid1.grad", dx_out, norm_backward(L + "ln2", dn2, s.x_mid, s.norm2));
      return attention_backward(L, s, dx_mid);
    }
    // x_out = x_mid + down(act(up(norm2(x_mid)))).
    const auto da = row_backward(L + "mlp.down", s.a, dx_out, *s.down_w, h, f);
    buffer_id dn2 = -1;
    if (m_.llama) {
      // One task writes the gate's and the up projection's gradients, one after the other.
      const auto packed = act(L + "mlp.act.grad.out", {2, tok_, f});
      task(L + "mlp.act.grad", {s.gate, s.u, da}, {packed}, info(op::swiglu_grad));
      const i64 part = tok_ * f * static_cast<i64>(size_of(type_));
      const auto dgate = b_.view(L + "mlp.gate.out.grad", packed, 0, part, {tok_, f});
      const auto dup = b_.view(L + "mlp.up.out.grad", packed, part, part, {tok_, f});
      dn2 = columns_backward(L + "mlp", s.n2f, {{L + "mlp.up", dup, s.up_w, f}, {L + "mlp.gate", dgate, s.gate_w, f}}, h);
    } else {
      const auto du = act(L + "mlp.up.out.grad", {tok_, f});
      task(L + "mlp.act.grad", {s.u, da}, {du}, info(op::gelu_grad));
      dn2 = column_backward(L + "mlp.up", s.n2, s.n2f, du, *s.up_w, f, h);
    }
    const auto dx_mid = add(L + "resid1.grad", dx_out, norm_backward(L + "ln2", dn2, s.x_mid, s.norm2));
    return attention_backward(L, s, dx_mid);
  }

  // x_mid = x_in + proj(attention(qkv(norm1(x_in)))).
  buffer_id attention_backward(const std::string& L, saved_block& s, buffer_id dx_mid) {
    const i64 h = m_.hidden;
    const auto dattn = row_backward(L + "attn.proj", s.attn, dx_mid, *s.o_w, h, h / tp_);
    buffer_id dn1 = -1;
    if (m_.llama || m_.vit) {
      // dq, dk and dv one after the other (k and v are smaller under GQA); Llama's q and k rotated back.
      const i64 kv = m_.kv_heads * head_dim_ / tp_, bytes = static_cast<i64>(size_of(type_));
      const auto packed = act(L + "attention.grad.out", {tok_ * (h / tp_ + 2 * kv)});
      task(L + "attention.grad", {s.q, s.k, s.v, dattn}, {packed}, info(op::attention_grad, attention_attrs()));
      const auto dq = b_.view(L + "attn.q.out.grad", packed, 0, tok_ * (h / tp_) * bytes, {tok_, h / tp_});
      const auto dk = b_.view(L + "attn.k.out.grad", packed, tok_ * (h / tp_) * bytes, tok_ * kv * bytes, {tok_, kv});
      const auto dv = b_.view(L + "attn.v.out.grad", packed, tok_ * (h / tp_ + kv) * bytes, tok_ * kv * bytes, {tok_, kv});
      const auto unrotated = [&](const std::string& name, buffer_id d) { return m_.llama ? rotate_back(name, d) : d; };
      dn1 = columns_backward(L + "attn", s.n1f,
                             {{L + "attn.v", dv, s.v_w, kv},
                              {L + "attn.k", unrotated(L + "attn.k.rope.grad", dk), s.k_w, kv},
                              {L + "attn.q", unrotated(L + "attn.q.rope.grad", dq), s.q_w, h / tp_}},
                             h);
    } else {
      const auto dqkv = act(L + "attn.qkv.out.grad", {tok_, qkv_n_});
      task(L + "attention.grad", {s.qkv, dattn}, {dqkv}, info(op::attention_grad, attention_attrs()));
      dn1 = column_backward(L + "attn.qkv", s.n1, s.n1f, dqkv, *s.qkv_w, qkv_n_, h);
    }
    return add(L + "resid0.grad", dx_mid, norm_backward(L + "ln1", dn1, s.x_in, s.norm1));
  }

  // Mixture of experts, expert parallel (GShard / Mixtral layout), as the DSL's MoE block lowers
  // (examples/llama's make_moe: moe_route, moe_dispatch, the redistribution to the expert split,
  // batched SwiGLU experts, moe_combine). Every rank routes its own tokens, in groups of one
  // sequence, to top_k of E experts; rank r of the ep group owns experts [r·E/ep, (r+1)·E/ep).
  // Static shapes at capacity factor 1: each expert takes C = seq·top_k/E slots per sequence
  // (over-capacity tokens are dropped, empty slots are zero), so the dispatched slots are
  // [E, S, h] with S = sequences·C, and the all-to-all gives each rank its experts' slots from
  // every rank, [E/ep, ep·S, h].
  [[nodiscard]] i64 local_experts() const { return m_.experts / ep_; }
  [[nodiscard]] i64 capacity() const { return m_.seq * m_.top_k / m_.experts; }
  [[nodiscard]] i64 slots() const { return batch_ * capacity(); }
  [[nodiscard]] std::map<std::string, std::int64_t> moe_attrs() const {
    return {{"experts", m_.experts}, {"group", m_.seq}, {"capacity", capacity()}};
  }
  // The router's: the MoE attributes and top_k.
  [[nodiscard]] std::map<std::string, std::int64_t> route_attrs() const {
    auto a = moe_attrs();
    a["top_k"] = m_.top_k;
    return a;
  }
  // The exchange between the token split ([E, S, h]) and the expert split ([E/ep, ep·S, h]), or
  // nothing on one rank.
  buffer_id exchange(const std::string& task_name, buffer_id in, std::string out_name, bool to_experts) {
    if (ep_axis_ < 0)
      return in;
    const auto out = to_experts ? act(std::move(out_name), {local_experts(), ep_ * slots(), m_.hidden})
                                : act(std::move(out_name), {m_.experts, slots(), m_.hidden});
    b_.collective(op_kind::all_to_all, task_name, ep_axis_, in, out, -1, std::nullopt,
                  {{"from_dim", to_experts ? 1 : 0}, {"to_dim", to_experts ? 0 : 1}});
    return out;
  }
  // The first (part 0) or second half of a packed gradient buffer, as the DSL's packed backward
  // terms write them.
  buffer_id part_of(const std::string& name, buffer_id packed, i64 offset_elems, std::vector<i64> shape, dtype t) {
    i64 n = 1;
    for (auto e : shape)
      n *= e;
    const auto es = static_cast<i64>(size_of(t));
    return b_.view(name, packed, offset_elems * es, n * es, std::move(shape));
  }

  buffer_id moe_forward(int l, buffer_id n2) {
    const auto L = layer_prefix(l);
    const i64 h = m_.hidden, f = m_.ffn, E = m_.experts, el = local_experts(), M = ep_ * slots();
    moe_saved s{};
    s.n2 = n2;
    s.router = &make_param(L + "moe.router.w", {h, E}, l);
    s.w1 = &make_param(L + "moe.w1", {el, h, f}, l);
    s.w3 = &make_param(L + "moe.w3", {el, h, f}, l);
    s.w2 = &make_param(L + "moe.w2", {el, f, h}, l);
    for (auto* w : {s.w1, s.w3, s.w2})
      w->expert = true;
    s.logits = act(L + "moe.router.out", {tok_, E});
    b_.matmul(L + "moe.router", n2, s.router->store, s.logits, tok_, E, h);
    s.gates = act(L + "moe.gates", {tok_, E}, dtype::f32);
    task(L + "moe.route", {s.logits}, {s.gates}, info(op::moe_route, route_attrs()));
    const auto send = act(L + "moe.dispatch.out", {E, slots(), h});
    task(L + "moe.dispatch", {n2, s.gates}, {send}, info(op::moe_dispatch, moe_attrs()));
    s.x = exchange(L + "moe.dispatch.a2a", send, L + "moe.dispatch.recv", true);
    s.u1 = act(L + "moe.w1.out", {el, M, f});
    b_.matmul(L + "moe.w1", s.x, s.w1->store, s.u1, M, f, h, el);
    s.u3 = act(L + "moe.w3.out", {el, M, f});
    b_.matmul(L + "moe.w3", s.x, s.w3->store, s.u3, M, f, h, el);
    s.a = act(L + "moe.swiglu.out", {el, M, f});
    task(L + "moe.swiglu", {s.u1, s.u3}, {s.a}, info(op::swiglu));
    const auto y = act(L + "moe.w2.out", {el, M, h});
    b_.matmul(L + "moe.w2", s.a, s.w2->store, y, M, h, f, el);
    s.back = exchange(L + "moe.combine.a2a", y, L + "moe.combine.recv", false);
    const auto out = act(L + "moe.out", {tok_, h});
    task(L + "moe.combine", {s.back, s.gates}, {out}, info(op::moe_combine, moe_attrs()));
    moe_saved_.push_back(std::move(s));
    return out;
  }

  // Returns the gradient of the MoE input (ln2's output): dispatch path plus router path.
  buffer_id moe_backward(int l, buffer_id dout) {
    const auto L = layer_prefix(l);
    const i64 h = m_.hidden, f = m_.ffn, E = m_.experts, el = local_experts(), M = ep_ * slots();
    auto& s = moe_saved_[static_cast<std::size_t>(l)];
    // The combine's gradient: the slots' dy, then the gates' (one packed buffer).
    const auto packed = act(L + "moe.combine.grad.out", {E * slots() * h + tok_ * E});
    task(L + "moe.combine.grad", {s.back, s.gates, dout}, {packed}, info(op::moe_combine_grad, moe_attrs()));
    const auto dback = part_of(L + "moe.combine.in.grad", packed, 0, {E, slots(), h}, type_);
    const auto dgates = part_of(L + "moe.gates.grad", packed, E * slots() * h, {tok_, E}, type_);
    const auto dy = exchange(L + "moe.combine.a2a.bwd", dback, L + "moe.w2.out.grad", true);
    const auto da = act(L + "moe.swiglu.out.grad", {el, M, f});
    b_.matmul(L + "moe.w2.dgrad", dy, s.w2->store, da, M, f, h, el, false, true);
    b_.matmul(L + "moe.w2.wgrad", s.a, dy, s.w2->grad, f, h, M, el, true, false);
    gradient_ready(*s.w2);
    const auto du = act(L + "moe.swiglu.grad.out", {2 * el * M * f});
    task(L + "moe.swiglu.grad", {s.u1, s.u3, da}, {du}, info(op::swiglu_grad));
    const auto du1 = part_of(L + "moe.w1.out.grad", du, 0, {el, M, f}, type_);
    const auto du3 = part_of(L + "moe.w3.out.grad", du, el * M * f, {el, M, f}, type_);
    const auto dx1 = act(L + "moe.w1.in.grad", {el, M, h});
    b_.matmul(L + "moe.w1.dgrad", du1, s.w1->store, dx1, M, h, f, el, false, true);
    b_.matmul(L + "moe.w1.wgrad", s.x, du1, s.w1->grad, h, f, M, el, true, false);
    gradient_ready(*s.w1);
    const auto dx3 = act(L + "moe.w3.in.grad", {el, M, h});
    b_.matmul(L + "moe.w3.dgrad", du3, s.w3->store, dx3, M, h, f, el, false, true);
    b_.matmul(L + "moe.w3.wgrad", s.x, du3, s.w3->grad, h, f, M, el, true, false);
    gradient_ready(*s.w3);
    const auto dx = act(L + "moe.experts.in.grad", {el, M, h});
    task(L + "moe.experts.in.grad", {dx1, dx3}, {dx}, info(op::add));
    const auto dsend = exchange(L + "moe.dispatch.a2a.bwd", dx, L + "moe.dispatch.out.grad", false);
    const auto dn2_tokens = act(L + "moe.dispatch.in.grad", {tok_, h});
    task(L + "moe.dispatch.grad", {dsend, s.gates}, {dn2_tokens}, info(op::moe_dispatch_grad, moe_attrs()));
    const auto dlogits = act(L + "moe.router.out.grad", {tok_, E});
    task(L + "moe.route.grad", {s.logits, s.gates, dgates}, {dlogits}, info(op::moe_route_grad, route_attrs()));
    const auto dn2_router = act(L + "moe.router.in.grad", {tok_, h});
    b_.matmul(L + "moe.router.dgrad", dlogits, s.router->store, dn2_router, tok_, h, E, 1, false, true);
    b_.matmul(L + "moe.router.wgrad", s.n2, dlogits, s.router->grad, h, E, tok_, 1, true, false);
    gradient_ready(*s.router);
    return add(L + "moe.in.grad", dn2_tokens, dn2_router);
  }

  // Built by appending: g++ 12 warns falsely (-Wrestrict) on "L" + std::to_string(l).
  [[nodiscard]] static std::string layer_prefix(int l) {
    std::string s(1, 'L');
    s += std::to_string(l);
    s += '.';
    return s;
  }

  [[nodiscard]] std::map<std::string, std::int64_t> attention_attrs() const {
    return {{"batch", batch_},       {"seq", m_.seq}, {"heads", m_.heads / tp_}, {"kv_heads", m_.kv_heads / tp_},
            {"head_dim", head_dim_}, {"causal", m_.vit ? 0 : 1}};
  }

  model_spec m_;
  int tp_ = 1, dp_ = 1;
  grad_sync sync_;
  int tp_axis_ = -1, dp_axis_ = -1, ep_axis_ = -1;
  bool moe_ = false;
  int ep_ = 1;
  std::vector<moe_saved> moe_saved_;
  i64 batch_ = 1, tok_ = 0, tok_sp_ = 0, vocab_ = 0, head_dim_ = 0, qkv_n_ = 0;
  buffer_id tokens_ = -1, labels_ = -1, positions_ = -1, images_ = -1;
  param* wte_ = nullptr; // the ViT's: the patch embedding's kernel
  param* cls_ = nullptr; // the ViT's class token
  param* wpe_ = nullptr;
  std::deque<param> params_; // a deque keeps the references handed out valid
  std::vector<saved_block> saved_;
};

// The weights of a workload whose every rank keeps each weight whole (no tensor or ZeRO split):
// the weight, its gradient and AdamW's f32 state (master, m, v); one update per weight after the
// backward pass, in the weight's layer.
class replicated_weights {
public:
  struct weight {
    std::string name;
    int layer = -1;
    i64 numel = 0;
    buffer_id store = -1, grad = -1, state = -1;
  };
  replicated_weights(builder& b, dtype type) : b_(b), type_(type) {}
  weight& add(const std::string& name, const std::vector<i64>& shape, int layer) {
    weight w;
    w.name = name;
    w.layer = layer;
    w.numel = 1;
    for (auto e : shape) w.numel *= e;
    w.store = b_.buffer(name, shape, buffer_role::param, type_);
    w.grad = b_.buffer(name + ".grad", shape, buffer_role::gradient, type_);
    w.state = b_.buffer(name + ".adamw", {3, w.numel}, buffer_role::optimizer_state, dtype::f32);
    all_.push_back(std::move(w));
    return all_.back();
  }
  void update_all() {
    for (auto& w : all_) {
      b_.at(phase::optimizer, w.layer);
      add_task(b_, w.name + ".adamw", {w.grad, w.store, w.state}, {w.store, w.state}, op_info(op::adamw, {{"numel", w.numel}}));
    }
  }

private:
  builder& b_;
  dtype type_;
  std::deque<weight> all_; // a deque keeps the references handed out valid
};

// AlphaFold 2's Evoformer pair stack (its triangle-free core, as examples/evoformer writes it)
// under dynamic axial parallelism (FastFold): the pair representation [N, N, c] of each rank's
// protein split over the `dap` group (ranks_per_node) on one residue dimension, dp over nodes.
// Per block: row-wise gated self-attention on the row split; the transposed pair representation
// exchanged by an all-to-all to the column split, column-wise gated self-attention, transposed
// and exchanged back; the transition MLP. Every weight is replicated: its gradient is all-reduced
// over dap, then over dp. Each rank holds T = N/dap · N positions of c channels.
class pair_stack : workload_writer {
public:
  pair_stack(builder& b, const model_spec& m, const workload_options& o) : workload_writer(b, o.type), m_(m) {
    dap_ = o.ranks_per_node;
    const int dp = o.ranks / dap_;
    if (dap_ > 1) dap_axis_ = b.axis("dap", dap_, link_class::intra_node);
    if (dp > 1) dp_axis_ = b.axis("dp", dp, o.ranks > o.ranks_per_node ? link_class::inter_node : link_class::intra_node);
    rows_ = o.micro_batch * m.seq / dap_;
    tok_ = rows_ * m.seq;
  }

  void build(int blocks) {
    auto z = b_.buffer("z", {rows_, m_.seq, m_.hidden}, buffer_role::input, type_);
    for (int l = 0; l < blocks; ++l) z = block_forward(l, z);
    // The regression loss of the example: the mean squared error to a target of z's shape.
    const auto target = b_.buffer("target", {rows_, m_.seq, m_.hidden}, buffer_role::input, type_);
    const auto loss = b_.buffer("loss", {1}, buffer_role::activation, dtype::f32);
    b_.at(phase::forward);
    task("loss", {z, target}, {loss}, info(op::mse));
    b_.at(phase::backward);
    auto dz = pos("loss.grad");
    task("loss.grad", {z, target}, {dz}, info(op::mse_grad));
    for (int l = blocks - 1; l >= 0; --l) dz = block_backward(l, dz);
    weights_.update_all();
  }

private:
  using weight = replicated_weights::weight;
  struct attention_saved {
    buffer_id x, ln, q, k, v, gate, att, gated;
    weight *norm_g, *norm_b, *wq, *wk, *wv, *wg, *wo;
  };
  struct block_saved {
    attention_saved row, col;
    buffer_id t, h, a;
    weight *tr_g, *tr_b, *w1, *w2;
  };

  // A value per position of this rank's rows: [N/dap, N, c].
  buffer_id pos(const std::string& name) { return act(name, {rows_, m_.seq, m_.hidden}); }
  weight& make_weight(const std::string& name, const std::vector<i64>& shape, int layer) { return weights_.add(name, shape, layer); }
  // Replicated weights: summed over the dap group (inside the node), then across nodes.
  void gradient_ready(weight& w) {
    if (dap_axis_ >= 0) b_.collective(op_kind::all_reduce, w.name + ".grad.ar.dap", dap_axis_, w.grad, w.grad);
    if (dp_axis_ >= 0) b_.collective(op_kind::all_reduce, w.name + ".grad.ar", dp_axis_, w.grad, w.grad);
  }
  buffer_id add(const std::string& name, buffer_id a, buffer_id b) {
    const auto out = pos(name);
    task(name, {a, b}, {out}, info(op::add));
    return out;
  }
  buffer_id linear(const std::string& name, buffer_id x, weight& w, i64 n, i64 k) {
    const auto y = act(name + ".out", {tok_, n});
    b_.matmul(name, x, w.store, y, tok_, n, k);
    return y;
  }
  // dx of y = x·W, and dW (then its all-reduces).
  buffer_id linear_backward(const std::string& name, buffer_id x, buffer_id dy, weight& w, i64 n, i64 k) {
    const auto dx = act(name + ".in.grad", {tok_, k});
    b_.matmul(name + ".dgrad", dy, w.store, dx, tok_, k, n, 1, false, true);
    b_.matmul(name + ".wgrad", x, dy, w.grad, k, n, tok_, 1, true, false);
    gradient_ready(w);
    return dx;
  }
  // The residue dimension split moves between rows and columns: a transpose of the local block,
  // then an all-to-all over dap (none on one rank).
  buffer_id switch_split(const std::string& name, buffer_id x) {
    const auto t = act(name + ".t", {m_.seq, rows_, m_.hidden});
    task(name + ".transpose", {x}, {t}, info(op::transpose, {{"rows", rows_}, {"cols", m_.seq}, {"inner", m_.hidden}}));
    if (dap_axis_ < 0) return t;
    // [N, N/dap, c] -> [N/dap, N, c]: block k of dimension 0 to rank k, rank k's block along dimension 1.
    const auto out = pos(name + ".a2a.out");
    b_.collective(op_kind::all_to_all, name + ".a2a", dap_axis_, t, out, -1, std::nullopt, {{"from_dim", 1}, {"to_dim", 0}});
    return out;
  }
  [[nodiscard]] std::map<std::string, std::int64_t> attention_attrs() const {
    return {{"batch", rows_},     {"seq", m_.seq}, {"heads", m_.heads}, {"kv_heads", m_.heads},
            {"head_dim", m_.hidden / m_.heads}, {"causal", 0}};
  }

  attention_saved gated_attention(const std::string& L, buffer_id x, int l, buffer_id& out) {
    const i64 c = m_.hidden;
    attention_saved s{};
    s.x = x;
    s.norm_g = &make_weight(L + "ln.g", {c}, l);
    s.norm_b = &make_weight(L + "ln.b", {c}, l);
    s.wq = &make_weight(L + "wq", {c, c}, l);
    s.wk = &make_weight(L + "wk", {c, c}, l);
    s.wv = &make_weight(L + "wv", {c, c}, l);
    s.wg = &make_weight(L + "wg", {c, c}, l);
    s.wo = &make_weight(L + "wo", {c, c}, l);
    s.ln = pos(L + "ln.out");
    task(L + "ln", {x, s.norm_g->store, s.norm_b->store}, {s.ln}, info(op::layernorm));
    s.q = linear(L + "q", s.ln, *s.wq, c, c);
    s.k = linear(L + "k", s.ln, *s.wk, c, c);
    s.v = linear(L + "v", s.ln, *s.wv, c, c);
    const auto g = linear(L + "g", s.ln, *s.wg, c, c);
    s.gate = pos(L + "gate");
    task(L + "sigmoid", {g}, {s.gate}, info(op::sigmoid));
    s.att = pos(L + "attention.out");
    task(L + "attention", {s.q, s.k, s.v}, {s.att}, info(op::attention, attention_attrs()));
    s.gated = pos(L + "gated");
    task(L + "mul", {s.gate, s.att}, {s.gated}, info(op::mul));
    out = linear(L + "o", s.gated, *s.wo, c, c);
    return s;
  }

  buffer_id gated_attention_backward(const std::string& L, const attention_saved& s, buffer_id dout) {
    const i64 c = m_.hidden, bytes = tok_ * c * static_cast<i64>(size_of(type_));
    const auto dgated = linear_backward(L + "o", s.gated, dout, *s.wo, c, c);
    const auto dgate = pos(L + "gate.grad"), datt = pos(L + "attention.out.grad");
    task(L + "mul.grad.gate", {dgated, s.att}, {dgate}, info(op::mul));
    task(L + "mul.grad.att", {dgated, s.gate}, {datt}, info(op::mul));
    const auto dg = pos(L + "g.out.grad");
    task(L + "sigmoid.grad", {s.gate, dgate}, {dg}, info(op::sigmoid_grad));
    const auto packed = act(L + "attention.grad.out", {3 * tok_ * c});
    task(L + "attention.grad", {s.q, s.k, s.v, datt}, {packed}, info(op::attention_grad, attention_attrs()));
    const auto dq = b_.view(L + "q.out.grad", packed, 0, bytes, {tok_, c});
    const auto dk = b_.view(L + "k.out.grad", packed, bytes, bytes, {tok_, c});
    const auto dv = b_.view(L + "v.out.grad", packed, 2 * bytes, bytes, {tok_, c});
    auto dln = linear_backward(L + "g", s.ln, dg, *s.wg, c, c);
    dln = add(L + "ln.grad.v", dln, linear_backward(L + "v", s.ln, dv, *s.wv, c, c));
    dln = add(L + "ln.grad.k", dln, linear_backward(L + "k", s.ln, dk, *s.wk, c, c));
    dln = add(L + "ln.grad.q", dln, linear_backward(L + "q", s.ln, dq, *s.wq, c, c));
    const auto dx = pos(L + "in.grad");
    task(L + "ln.grad", {s.x, s.norm_g->store, dln}, {dx}, info(op::layernorm_grad));
    task(L + "ln.grad.gamma", {s.x, dln}, {s.norm_g->grad}, info(op::layernorm_grad_gamma));
    gradient_ready(*s.norm_g);
    task(L + "ln.grad.beta", {dln}, {s.norm_b->grad}, info(op::bias_grad));
    gradient_ready(*s.norm_b);
    return dx;
  }

  // Built by appending: g++ 12 warns falsely (-Wrestrict) on "L" + std::to_string(l).
  [[nodiscard]] static std::string block_prefix(int l) {
    std::string s(1, 'L');
    s += std::to_string(l);
    s += '.';
    return s;
  }

  buffer_id block_forward(int l, buffer_id z) {
    const auto L = block_prefix(l);
    const i64 c = m_.hidden, f = m_.ffn;
    b_.at(phase::forward, l);
    block_saved s{};
    buffer_id row = -1, col = -1;
    s.row = gated_attention(L + "row.", z, l, row);
    const auto z1 = add(L + "row.resid", z, row);
    s.col = gated_attention(L + "col.", switch_split(L + "col.in", z1), l, col);
    const auto z2 = add(L + "col.resid", z1, switch_split(L + "col.back", col));
    s.tr_g = &make_weight(L + "tr.ln.g", {c}, l);
    s.tr_b = &make_weight(L + "tr.ln.b", {c}, l);
    s.w1 = &make_weight(L + "tr.w1", {c, f}, l);
    s.w2 = &make_weight(L + "tr.w2", {f, c}, l);
    s.t = pos(L + "tr.ln.out");
    task(L + "tr.ln", {z2, s.tr_g->store, s.tr_b->store}, {s.t}, info(op::layernorm));
    s.h = linear(L + "tr.w1", s.t, *s.w1, f, c);
    s.a = act(L + "tr.relu.out", {tok_, f});
    task(L + "tr.relu", {s.h}, {s.a}, info(op::relu));
    const auto z3 = add(L + "tr.resid", z2, linear(L + "tr.w2", s.a, *s.w2, c, f));
    saved_.push_back(s);
    saved_z2_.push_back(z2);
    return z3;
  }

  buffer_id block_backward(int l, buffer_id dz3) {
    const auto L = block_prefix(l);
    const i64 c = m_.hidden, f = m_.ffn;
    b_.at(phase::backward, l);
    auto& s = saved_[static_cast<std::size_t>(l)];
    const auto z2 = saved_z2_[static_cast<std::size_t>(l)];
    const auto da = linear_backward(L + "tr.w2", s.a, dz3, *s.w2, c, f);
    const auto dh = act(L + "tr.relu.grad", {tok_, f});
    task(L + "tr.relu.grad", {s.h, da}, {dh}, info(op::relu_grad));
    const auto dt = linear_backward(L + "tr.w1", s.t, dh, *s.w1, f, c);
    const auto dz2_tr = pos(L + "tr.ln.in.grad");
    task(L + "tr.ln.grad", {z2, s.tr_g->store, dt}, {dz2_tr}, info(op::layernorm_grad));
    task(L + "tr.ln.grad.gamma", {z2, dt}, {s.tr_g->grad}, info(op::layernorm_grad_gamma));
    gradient_ready(*s.tr_g);
    task(L + "tr.ln.grad.beta", {dt}, {s.tr_b->grad}, info(op::bias_grad));
    gradient_ready(*s.tr_b);
    const auto dz2 = add(L + "tr.resid.grad", dz3, dz2_tr);
    // Column attention backward: the exchanges in reverse.
    const auto dcol = switch_split(L + "col.back.grad", dz2);
    const auto dzt = gated_attention_backward(L + "col.", s.col, dcol);
    const auto dz1 = add(L + "col.resid.grad", dz2, switch_split(L + "col.in.grad", dzt));
    return add(L + "row.resid.grad", dz1, gated_attention_backward(L + "row.", s.row, dz1));
  }

  model_spec m_;
  int dap_ = 1, dap_axis_ = -1, dp_axis_ = -1;
  i64 rows_ = 0, tok_ = 0;
  replicated_weights weights_{b_, type_};
  std::vector<block_saved> saved_;
  std::vector<buffer_id> saved_z2_; // the transition's input
};

} // namespace detail::workloads

// The Wide-ResNet of Alpa's benchmark suite at its smallest size (250M: 50 layers, 160 base
// channels, width factor 2; its flax model's blocks), data parallel over every rank with batch
// statistics synchronised over dp: a 7×7 stride-2 stem convolution, batch norm, relu and 3×3
// max pooling at stride 2 (the stages start at a quarter of the image's side); four stages of
// bottleneck blocks (1×1 reduce to f = 160·2^s channels, 3×3 to f·2, 1×1 expand to 4f, each
// batch-normalised, relu between; the first block of a stage strided, its shortcut a 1×1
// projection with a batch norm, the others identity shortcuts), as examples/wresnet writes a
// block; global average pooling, a linear head, cross-entropy. Each batch norm all-reduces its
// sums (2·channels values) over dp forward (and moves its running statistics by them) and its
// gradient's sums backward, which are then the gain's and the shift's gradients, summed; each
// convolution's and the head's gradient is all-reduced over dp. Images per rank:
// workload_options::micro_batch. examples/wresnet/model.hpp writes the same net in the DSL
// (wide_resnet_auto, every spec decided).
struct conv_net_spec {
  std::int64_t image = 224, stem = 160, classes = 1000;
  std::array<std::int64_t, 4> blocks{3, 4, 6, 3};
  std::array<std::int64_t, 4> reduce{160, 320, 640, 1280}; ///< the 1×1 reduce's output: f
  std::array<std::int64_t, 4> mid{320, 640, 1280, 2560};   ///< the 3×3's output: f · width factor
  std::array<std::int64_t, 4> out{640, 1280, 2560, 5120};  ///< the 1×1 expand's: 4f
};

namespace detail::workloads {

class wide_resnet : workload_writer {
public:
  wide_resnet(builder& b, const conv_net_spec& m, const workload_options& o) : workload_writer(b, o.type), m_(m) {
    dp_ = o.ranks;
    if (dp_ > 1) dp_axis_ = b.axis("dp", dp_, o.ranks > o.ranks_per_node ? link_class::inter_node : link_class::intra_node);
    batch_ = o.micro_batch;
  }

  /// `stages_blocks` > 0 keeps that many blocks per stage (a shorter model for tests).
  void build(int stage_blocks) {
    b_.at(phase::forward, -1);
    auto x = b_.buffer("x", {batch_, m_.image, m_.image, 3}, buffer_role::input, type_);
    auto& stem = make_weight("embed.stem", {7, 7, 3, m_.stem}, -1);
    saved_stem_ = conv(x, stem, 2, 3, "embed.stem");
    stem_norm_ = norm(saved_stem_.y, "embed.stem.n", -1);
    const auto stem_out = relu_forward("embed.stem.relu", stem_norm_.y);
    const auto ss = shape_of(stem_out);
    const ir::conv_geometry pool{ss[0], ss[1], ss[2], ss[3], ss[3], 3, 3, 2, 1};
    auto h = act("embed.pool.out", {pool.batch, pool.out_h(), pool.out_w(), pool.out_channels});
    task("embed.pool", {stem_out}, {h}, info(op::max_pool, pool.attrs()));
    int layer = 0;
    for (std::size_t s = 0; s < 4; ++s) {
      const auto n = stage_blocks > 0 ? std::min<i64>(stage_blocks, m_.blocks[s]) : m_.blocks[s];
      for (i64 k = 0; k < n; ++k) h = block_forward(layer++, h, s, k == 0);
    }
    // Global average pooling over the pixels, the head, the loss.
    b_.at(phase::forward, -1);
    const auto last = shape_of(h);
    const auto pooled = act("head.pool.out", {batch_, last[3]});
    task("head.pool", {h}, {pooled}, info(op::mean_dim, {{"outer", batch_}, {"extent", last[1] * last[2]}, {"inner", last[3]},
                                                   {"num", 1}, {"den", last[1] * last[2]}}));
    auto& head = make_weight("head", {last[3], m_.classes}, -1);
    const auto logits = act("head.out", {batch_, m_.classes});
    b_.matmul("head", pooled, head.store, logits, batch_, m_.classes, last[3]);
    const auto labels = b_.buffer("labels", {batch_}, buffer_role::input, dtype::i32);
    const auto loss = b_.buffer("loss", {1}, buffer_role::activation, dtype::f32);
    task("loss", {logits, labels}, {loss}, info(op::cross_entropy));
    b_.at(phase::backward, -1);
    const auto dlogits = act("head.out.grad", {batch_, m_.classes});
    task("loss.grad", {logits, labels}, {dlogits}, info(op::cross_entropy_grad));
    const auto dpooled = act("head.pool.out.grad", {batch_, last[3]});
    b_.matmul("head.dgrad", dlogits, head.store, dpooled, batch_, last[3], m_.classes, 1, false, true);
    b_.matmul("head.wgrad", pooled, dlogits, head.grad, last[3], m_.classes, batch_, 1, true, false);
    gradient_ready(head);
    auto dh = act("head.pool.in.grad", last);
    task("head.pool.grad", {dpooled}, {dh}, info(op::mean_dim_grad, {{"outer", batch_}, {"extent", last[1] * last[2]},
                                                             {"inner", last[3]}, {"num", 1}, {"den", last[1] * last[2]}}));
    for (int l = layer - 1; l >= 0; --l) dh = block_backward(l, dh);
    b_.at(phase::backward, -1);
    const auto dpool = act("embed.pool.in.grad", ss);
    task("embed.pool.grad", {stem_out, dh}, {dpool}, info(op::max_pool_grad, pool.attrs()));
    dh = norm_backward(stem_norm_, relu_backward("embed.stem.relu", stem_norm_.y, dpool), "embed.stem.n");
    conv_backward(saved_stem_, stem, dh, "embed.stem", false);
    weights_.update_all();
  }

private:
  using weight = replicated_weights::weight;
  struct conv_saved {
    buffer_id x = -1, y = -1;
    ir::conv_geometry g{};
  };
  struct norm_saved {
    buffer_id x = -1, scale = -1, y = -1;
    weight *gain = nullptr, *shift = nullptr;
  };
  struct block_saved {
    buffer_id x = -1, sum = -1;
    conv_saved a, b, c, shortcut;
    norm_saved na, nb, nc, ns;
    buffer_id ra = -1, rb = -1; // relu outputs
    weight *wa = nullptr, *wb = nullptr, *wc = nullptr, *ws = nullptr;
    bool projected = false;
  };

  weight& make_weight(const std::string& name, const std::vector<i64>& shape, int layer) { return weights_.add(name, shape, layer); }
  void gradient_ready(weight& w) {
    if (dp_axis_ >= 0) b_.collective(op_kind::all_reduce, w.name + ".grad.ar", dp_axis_, w.grad, w.grad);
  }
  conv_saved conv(buffer_id x, weight& w, i64 stride, i64 padding, const std::string& name) {
    const auto xs = shape_of(x);
    const auto ws = shape_of(w.store);
    const ir::conv_geometry g{xs[0], xs[1], xs[2], xs[3], ws[3], ws[0], ws[1], stride, padding};
    const auto y = act(name + ".out", {g.batch, g.out_h(), g.out_w(), g.out_channels});
    task(name, {x, w.store}, {y}, info(op::conv2d, g.attrs()));
    return {x, y, g};
  }
  // The convolution's kernel gradient (then its all-reduce) and, unless it is the first layer's,
  // its input's.
  buffer_id conv_backward(const conv_saved& c, weight& w, buffer_id dy, const std::string& name, bool input = true) {
    buffer_id dx = -1;
    if (input) {
      dx = act(name + ".in.grad", shape_of(c.x));
      task(name + ".dgrad", {dy, w.store}, {dx}, info(op::conv2d_grad_input, c.g.attrs()));
    }
    task(name + ".wgrad", {c.x, dy}, {w.grad}, info(op::conv2d_grad_weight, c.g.attrs()));
    gradient_ready(w);
    return dx;
  }
  // Synchronised batch norm: the sums of this rank's rows, all-reduced over dp, the scale, the normalisation.
  norm_saved norm(buffer_id x, const std::string& name, int layer) {
    const auto xs = shape_of(x);
    const i64 c = xs[3], rows = xs[0] * xs[1] * xs[2];
    norm_saved n;
    n.x = x;
    n.gain = &make_weight(name + ".g", {c}, layer);
    n.shift = &make_weight(name + ".b", {c}, layer);
    const std::map<std::string, std::int64_t> attrs{{"rows", rows}, {"cols", c}, {"count", rows * dp_}};
    const auto sums = act(name + ".sums", {2, c}, dtype::f32);
    task(name + ".stats", {x}, {sums}, info(op::batchnorm_stats, attrs));
    if (dp_axis_ >= 0) b_.collective(op_kind::all_reduce, name + ".sums.ar", dp_axis_, sums, sums);
    // The running statistics (mean, variance) moved by the batch's, for evaluation.
    const auto running = b_.buffer(name + ".g.running", {2, c}, buffer_role::optimizer_state, dtype::f32);
    auto track = attrs;
    track["num"] = ir::fraction_num(0.1); // batchnorm_config's default momentum
    track["den"] = ir::fraction_den;
    task(name + ".track", {sums, running}, {running}, info(op::batchnorm_track, track));
    n.scale = act(name + ".scale", {3, c}, dtype::f32);
    task(name + ".scale", {sums, n.gain->store}, {n.scale}, info(op::batchnorm_scale, attrs));
    n.y = act(name + ".out", xs);
    task(name, {x, n.scale, n.shift->store}, {n.y}, info(op::batchnorm, attrs));
    return n;
  }
  // dx, and the gain's and the shift's gradients: the gradient's sums, all-reduced over dp.
  buffer_id norm_backward(const norm_saved& n, buffer_id dy, const std::string& name) {
    const auto xs = shape_of(n.x);
    const i64 c = xs[3], rows = xs[0] * xs[1] * xs[2];
    const std::map<std::string, std::int64_t> attrs{{"rows", rows}, {"cols", c}, {"count", rows * dp_}};
    const auto sums = act(name + ".grad.sums", {2, c}, dtype::f32);
    task(name + ".grad.stats", {n.x, n.scale, dy}, {sums}, info(op::batchnorm_grad_stats, attrs));
    if (dp_axis_ >= 0) b_.collective(op_kind::all_reduce, name + ".grad.sums.ar", dp_axis_, sums, sums);
    // The gain's and shift's gradients are the two rows of the reduced sums (views in the DSL's lowering).
    b_.view(n.shift->name + ".grad.row", sums, 0, c * 4, {c});
    b_.view(n.gain->name + ".grad.row", sums, c * 4, c * 4, {c});
    const auto dx = act(name + ".in.grad", xs);
    task(name + ".grad", {n.x, n.scale, sums, dy}, {dx}, info(op::batchnorm_grad, attrs));
    return dx;
  }
  buffer_id relu_forward(const std::string& name, buffer_id x) {
    const auto y = act(name + ".out", shape_of(x));
    task(name, {x}, {y}, info(op::relu));
    return y;
  }
  buffer_id relu_backward(const std::string& name, buffer_id x, buffer_id dy) {
    const auto dx = act(name + ".in.grad", shape_of(x));
    task(name + ".grad", {x, dy}, {dx}, info(op::relu_grad));
    return dx;
  }
  buffer_id add(const std::string& name, buffer_id a, buffer_id b) {
    const auto out = act(name, shape_of(a));
    task(name, {a, b}, {out}, info(op::add));
    return out;
  }
  // Built by appending: g++ 12 warns falsely (-Wrestrict) on "L" + std::to_string(l).
  [[nodiscard]] static std::string layer_prefix(int l) {
    std::string s(1, 'L');
    s += std::to_string(l);
    s += '.';
    return s;
  }

  buffer_id block_forward(int l, buffer_id x, std::size_t stage, bool first) {
    const auto L = layer_prefix(l);
    b_.at(phase::forward, l);
    const i64 in = shape_of(x)[3], reduce = m_.reduce[stage], mid = m_.mid[stage], out = m_.out[stage];
    const i64 stride = first && stage > 0 ? 2 : 1; // stage 1 starts at the stem's max pool's size
    block_saved s;
    s.x = x;
    s.projected = first;
    s.wa = &make_weight(L + "wa", {1, 1, in, reduce}, l);
    s.a = conv(x, *s.wa, 1, 0, L + "a");
    s.na = norm(s.a.y, L + "na", l);
    s.ra = relu_forward(L + "a.relu", s.na.y);
    s.wb = &make_weight(L + "wb", {3, 3, reduce, mid}, l);
    s.b = conv(s.ra, *s.wb, stride, 1, L + "b");
    s.nb = norm(s.b.y, L + "nb", l);
    s.rb = relu_forward(L + "b.relu", s.nb.y);
    s.wc = &make_weight(L + "wc", {1, 1, mid, out}, l);
    s.c = conv(s.rb, *s.wc, 1, 0, L + "c");
    s.nc = norm(s.c.y, L + "nc", l);
    buffer_id shortcut = x;
    if (first) {
      s.ws = &make_weight(L + "ws", {1, 1, in, out}, l);
      s.shortcut = conv(x, *s.ws, stride, 0, L + "shortcut");
      s.ns = norm(s.shortcut.y, L + "ns", l);
      shortcut = s.ns.y;
    }
    s.sum = add(L + "resid", s.nc.y, shortcut);
    saved_.push_back(s);
    return relu_forward(L + "relu", s.sum);
  }

  buffer_id block_backward(int l, buffer_id dy) {
    const auto L = layer_prefix(l);
    b_.at(phase::backward, l);
    auto& s = saved_[static_cast<std::size_t>(l)];
    const auto dsum = relu_backward(L + "relu", s.sum, dy);
    auto d = norm_backward(s.nc, dsum, L + "nc");
    d = conv_backward(s.c, *s.wc, d, L + "c");
    d = norm_backward(s.nb, relu_backward(L + "b.relu", s.nb.y, d), L + "nb");
    d = conv_backward(s.b, *s.wb, d, L + "b");
    d = norm_backward(s.na, relu_backward(L + "a.relu", s.na.y, d), L + "na");
    d = conv_backward(s.a, *s.wa, d, L + "a");
    const auto through =
        s.projected ? conv_backward(s.shortcut, *s.ws, norm_backward(s.ns, dsum, L + "ns"), L + "shortcut") : dsum;
    return add(L + "in.grad", through, d);
  }

  conv_net_spec m_;
  int dp_ = 1, dp_axis_ = -1;
  i64 batch_ = 1;
  conv_saved saved_stem_;
  norm_saved stem_norm_;
  replicated_weights weights_{b_, type_};
  std::vector<block_saved> saved_;
};

struct workload_entry {
  std::string_view name;
  model_spec model;
  bool tensor_parallel; // tp = ranks_per_node, dp over nodes; otherwise dp over all ranks (or, with experts,
                        // ep = ranks_per_node over the experts and dp over nodes)
  grad_sync sync;
  bool wide_resnet = false; // a wide_resnet of conv_net_spec's shape, not a transformer
};

// GPT-3 XL-like (2048 hidden, 24 layers, 16 heads); Llama-2-70B (8192, 80 layers, 64 q / 8 kv heads,
// SwiGLU 28672, vocabulary 32000) at seq 8192; Megatron's GPT 5120 × 40 (the paper's gpt-ptd size);
// Llama-3-405B (16384, 126 layers, 128 q / 8 kv heads, SwiGLU 53248, vocabulary 128000) at seq 8192,
// laid out as llama-tp-sp: the planner's largest step graph. ViT-Huge/14 at 224 × 224 (1280 hidden,
// 32 layers, 16 heads, MLP 5120, a class token and 16 × 16 = 256 patches per image, 1000 classes;
// one "sequence" of micro_batch is one image) under ZeRO-2, as examples/vit writes it
// (model_spec::vit: patch embedding by a strided convolution, the class token joined before the
// patches, a position table, attention without a mask, the class token's state to the head), which
// tests/unit/workloads_test.cpp compares block by block. Alpa's Wide-ResNet at 250M (conv_net_spec:
// [3, 4, 6, 3] bottleneck blocks reducing to 160·2^s channels, 3×3s of twice that, outputs
// 640·2^s; 254.0M parameters) on 224 × 224 images, data parallel with synchronised batch norm
// (workload_options::micro_batch images per rank).
inline constexpr workload_entry workload_table[] = {
    {"gpt-dp", {2048, 24, 2048, 16, 16, 4 * 2048, 50257, false, 0, 0}, false, grad_sync::all_reduce},
    {"gpt-zero3", {2048, 24, 2048, 16, 16, 4 * 2048, 50257, false, 0, 0}, false, grad_sync::zero3},
    {"llama-tp-sp", {8192, 80, 8192, 64, 8, 28672, 32000, true, 0, 0}, true, grad_sync::all_reduce},
    {"gpt-ptd", {5120, 40, 2048, 40, 40, 4 * 5120, 50257, false, 0, 0}, true, grad_sync::all_reduce},
    {"moe-ep", {4096, 32, 4096, 32, 8, 14336, 32000, true, 8, 2}, false, grad_sync::all_reduce},
    {"llama3-405b-tp-sp", {16384, 126, 8192, 128, 8, 53248, 128000, true, 0, 0}, true, grad_sync::all_reduce},
    {"vit-zero2", {1280, 32, 257, 16, 16, 5120, 1000, false, 0, 0, false, true, 14}, false, grad_sync::zero2},
    {"evoformer-dap", {128, 48, 384, 4, 4, 4 * 128, 0, false, 0, 0, true}, false, grad_sync::all_reduce},
    {"wresnet-dp", {}, false, grad_sync::all_reduce, true},
};

inline void check_divides(i64 part, i64 whole, std::string_view what, std::string_view workload) {
  if (whole % part != 0)
    fail("workload '" + std::string(workload) + "': " + std::string(what) + " (" + std::to_string(whole) +
         ") is not divisible by the tensor-parallel size " + std::to_string(part));
}

} // namespace detail::workloads

/// @brief The names make_workload accepts.
[[nodiscard]] inline std::vector<std::string> workload_names() {
  std::vector<std::string> names;
  for (const auto& w : detail::workloads::workload_table)
    names.emplace_back(w.name);
  return names;
}

namespace detail::workloads {
// The entry of a workload, or a concerto::error listing the known names.
inline const workload_entry& find_workload(std::string_view name) {
  for (const auto& w : workload_table)
    if (w.name == name) return w;
  std::string known;
  for (const auto& n : workload_names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown workload '" + std::string(name) + "' (known: " + known + ")");
}
} // namespace detail::workloads

/// @brief The values one sequence holds between two blocks of a workload's model (hidden × seq
/// tokens): what a pipeline stage sends the next per sequence.
[[nodiscard]] inline std::int64_t block_output_values(std::string_view name) {
  const auto& m = detail::workloads::find_workload(name).model;
  return m.hidden * m.seq;
}

/// @brief Generates one training step of a benchmark workload for one rank.
///
/// Throws concerto::error for an unknown name (listing the known ones) or options that do not
/// fit the model (naming the field).
/// @code
/// auto g = ir::make_workload("gpt-zero3", {.layers = 2, .ranks = 16});
/// @endcode
[[nodiscard]] inline graph make_workload(std::string_view name, const workload_options& options = {}) {
  using namespace detail::workloads;
  const workload_entry* entry = &find_workload(name);
  const auto where = [&](std::string_view field, int value) {
    return "workload '" + std::string(name) + "': workload_options." + std::string(field) + " = " +
           std::to_string(value);
  };
  if (options.layers < 0)
    fail(where("layers", options.layers) + " is negative");
  if (options.ranks < 1)
    fail(where("ranks", options.ranks) + " must be at least 1");
  if (options.ranks_per_node < 1)
    fail(where("ranks_per_node", options.ranks_per_node) + " must be at least 1");
  if (options.micro_batch < 1)
    fail(where("micro_batch", options.micro_batch) + " must be at least 1");
  const auto& m = entry->model;
  int tp = 1;
  if (entry->tensor_parallel) {
    tp = options.ranks_per_node;
    if (options.ranks % tp != 0)
      fail(where("ranks", options.ranks) + " is not a multiple of ranks_per_node (" + std::to_string(tp) +
           "), the tensor-parallel size");
    check_divides(tp, m.heads, "heads", name);
    check_divides(tp, m.kv_heads, "kv heads", name);
    check_divides(tp, m.ffn, "ffn size", name);
    check_divides(tp, m.seq * options.micro_batch, "tokens per step (micro_batch × seq)", name);
  }
  if (m.experts > 0) {
    const int ep = options.ranks_per_node;
    if (options.ranks % ep != 0)
      fail(where("ranks", options.ranks) + " is not a multiple of ranks_per_node (" + std::to_string(ep) +
           "), the expert-parallel size");
    if (m.experts % ep != 0)
      fail(where("ranks_per_node", ep) + ": the expert-parallel size must divide the " + std::to_string(m.experts) +
           " experts");
    if (m.seq * m.top_k % m.experts != 0)
      fail("workload '" + std::string(name) + "': a sequence's " + std::to_string(m.seq) + " tokens × top_k " +
           std::to_string(m.top_k) + " must divide evenly over the " + std::to_string(m.experts) +
           " experts (the capacity per sequence)");
  }
  builder b{std::string(name)};
  b.cost_only(); // planner workloads: their learned positions and block transposes have no kernels
  if (entry->wide_resnet) { // workload_options::layers: blocks per stage at most
    wide_resnet w(b, conv_net_spec{}, options);
    w.build(options.layers);
    return std::move(b).finish();
  }
  if (m.axial) {
    if (options.micro_batch != 1)
      fail(where("micro_batch", options.micro_batch) + ": the pair stack trains one protein per rank");
    if (options.ranks % options.ranks_per_node != 0 || m.seq % options.ranks_per_node != 0)
      fail(where("ranks_per_node", options.ranks_per_node) + ": the dap group must divide the ranks and the " +
           std::to_string(m.seq) + " residues");
    pair_stack p(b, m, options);
    p.build(options.layers > 0 ? options.layers : static_cast<int>(m.layers));
    return std::move(b).finish();
  }
  transformer t(b, m, options, tp, entry->sync);
  t.build(options.layers > 0 ? options.layers : static_cast<int>(m.layers));
  return std::move(b).finish();
}

} // namespace concerto::ir
