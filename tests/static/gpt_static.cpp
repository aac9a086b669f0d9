// A GPT block (pre-LN, no biases) under TP, TP+SP and ZeRO-3, with Megatron-LM's collective counts.
#include <concerto/concerto.hpp>

namespace {
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto fwd = static_cast<int>(ir::phase::forward);
constexpr auto bwd = static_cast<int>(ir::phase::backward);

constexpr auto vec = spec(replicate);
constexpr auto col = spec(replicate, shard(tp)); // column-parallel [in, out]
constexpr auto row = spec(shard(tp), replicate); // row-parallel

template <class H>
constexpr auto block(H h) {
  auto a = layernorm(h, param<"ln1.g">(vec), param<"ln1.b">(vec));
  auto att = causal_attention(matmul(a, param<"wq">(col)), matmul(a, param<"wk">(col)), matmul(a, param<"wv">(col)));
  auto h2 = h + matmul(att, param<"wo">(row));
  auto m = layernorm(h2, param<"ln2.g">(vec), param<"ln2.b">(vec));
  return h2 + matmul(gelu(matmul(m, param<"fc1">(col))), param<"fc2">(row));
}
template <class S>
constexpr auto block_loss(S s) {
  return mse(block(input<"x">(s)), data<"y">(s));
}

// TP (+DP): 2 all-reduces forward, 2 backward, nothing else on tp; one dp all-reduce per parameter.
constexpr auto tp_step = program(block_loss(spec(shard(dp), replicate, replicate)), sgd{});
static_assert(tp_step.count(collective::all_reduce, tp, fwd) == 2);
static_assert(tp_step.count(collective::all_reduce, tp, bwd) == 2);
static_assert(tp_step.count(collective::all_gather, tp) == 0 && tp_step.count(collective::reduce_scatter, tp) == 0);
static_assert(tp_step.count(collective::all_reduce, dp, bwd) == 10 && tp_step.count(op_code::sgd) == 10);
static_assert(tp_step.count(op_code::attention) == 1 && tp_step.count(op_code::attention_grad) == 1);
static_assert(tp_step.spec_of("wq.grad") == col && tp_step.spec_of("x.grad") == spec(shard(dp), replicate, replicate));

// TP + sequence parallel: the residual stream is split over tp along the sequence; all-gather /
// reduce-scatter pairs replace the all-reduces, and the layernorm gradients are all-reduced over tp.
constexpr auto sp_step = program(block_loss(spec(shard(dp), shard(tp), replicate)), sgd{});
static_assert(sp_step.count(collective::all_gather, tp, fwd) == 2 && sp_step.count(collective::reduce_scatter, tp, fwd) == 2);
static_assert(sp_step.count(collective::all_gather, tp, bwd) == 2 && sp_step.count(collective::reduce_scatter, tp, bwd) == 2);
static_assert(sp_step.count(collective::all_reduce, tp, fwd) == 0);
static_assert(sp_step.count(collective::all_reduce, tp, bwd) == 4); // ln1.g, ln1.b, ln2.g, ln2.b
static_assert(sp_step.spec_of("x.grad") == spec(shard(dp), shard(tp), replicate));

// ZeRO-3 over dp with TP: every parameter gathered in forward, the eight that backward reads
// gathered again, every gradient reduce-scattered.
constexpr auto z3 = program(block_loss(spec(shard(dp), replicate, replicate)), zero<3>(adamw{}, dp));
static_assert(z3.count(collective::all_gather, dp, fwd) == 10);
static_assert(z3.count(collective::all_gather, dp, bwd) == 8);
static_assert(z3.count(collective::reduce_scatter, dp, bwd) == 10 && z3.count(collective::all_reduce, dp) == 0);
static_assert(z3.count(collective::all_reduce, tp) == 4 && z3.count(op_code::state) == 20);
static_assert(z3.spec_of("ln1.g") == spec(shard(dp)) && z3.spec_of("wo") == spec(shard(tp), shard(dp)));

// ZeRO-3 with sequence parallelism composes.
constexpr auto z3sp = program(block_loss(spec(shard(dp), shard(tp), replicate)), zero<3>(adamw{}, dp));
static_assert(z3sp.count(collective::reduce_scatter, tp) == 4 && z3sp.count(collective::reduce_scatter, dp) == 10);

// Embedding (vocab-parallel) and a language-model head with cross-entropy.
constexpr auto ids = data<"ids">(spec(shard(dp), replicate));
constexpr auto wte = param<"wte">(spec(shard(tp), replicate));
constexpr auto lm = program(
    cross_entropy(matmul(block(embedding(ids, wte)), param<"head">(col)), data<"labels">(spec(shard(dp), replicate))),
    adamw{});
// Forward on tp: the embedding's pending sum, the block's two, and the vocab-parallel cross-entropy's
// row max, target logit and sum of exponentials; the logits stay split over the vocabulary.
static_assert(lm.count(collective::all_reduce, tp, fwd) == 6 && lm.count(collective::all_gather, tp) == 0);
static_assert(lm.count(op_code::vocab_ce_grad) == 1 && lm.count(op_code::cross_entropy) == 0);
static_assert(lm.spec_of("wte.grad") == spec(shard(tp), replicate) && lm.find("ids.grad") == -1);
static_assert(lm.count(op_code::embedding_grad) == 1 && lm.count(op_code::cross_entropy_grad) == 0);
} // namespace
