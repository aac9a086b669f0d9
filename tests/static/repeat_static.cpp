// repeat: a block traced once counts its collectives once, exactly as the same block written
// out; vocab-parallel cross-entropy replaces the gathered logits.
#include <concerto/concerto.hpp>

namespace {
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto fwd = static_cast<int>(ir::phase::forward);
constexpr auto bwd = static_cast<int>(ir::phase::backward);

constexpr auto vec = spec(replicate);
constexpr auto col = spec(replicate, shard(tp));
constexpr auto row = spec(shard(tp), replicate);
constexpr auto tp_act = spec(shard(dp), replicate, replicate);
constexpr auto sp_act = spec(shard(dp), shard(tp), replicate);

constexpr auto block = [](auto h) {
  auto a = layernorm(h, param<"ln1.g">(vec), param<"ln1.b">(vec));
  auto att = causal_attention(matmul(a, param<"wq">(col)), matmul(a, param<"wk">(col)), matmul(a, param<"wv">(col)));
  auto h2 = h + matmul(att, param<"wo">(row));
  auto m = layernorm(h2, param<"ln2.g">(vec), param<"ln2.b">(vec));
  return h2 + matmul(gelu(matmul(m, param<"fc1">(col))), param<"fc2">(row));
};
template <class S, class Opt>
constexpr auto stacked(S s, Opt opt) {
  return program(mse(repeat<"layers">(block, input<"x">(s)), data<"y">(s)), opt);
}
template <class S, class Opt>
constexpr auto single(S s, Opt opt) {
  return program(mse(block(input<"x">(s)), data<"y">(s)), opt);
}

// TP: the repeated block has the written-out block's collectives, all of them inside the block.
constexpr auto tp_rep = stacked(tp_act, sgd{});
constexpr auto tp_one = single(tp_act, sgd{});
static_assert(tp_rep.repeat_count == 1 && tp_rep.repeat_index("layers") == 0 && tp_rep.repeat_index("other") == -1);
static_assert(tp_rep.count_in("layers", collective::all_reduce, tp, fwd) == 2);
static_assert(tp_rep.count_in("layers", collective::all_reduce, tp, bwd) == 2);
static_assert(tp_rep.count_in("layers", collective::all_reduce, dp) == 10);
static_assert(tp_rep.count(collective::all_reduce, tp) == tp_one.count(collective::all_reduce, tp));
static_assert(tp_rep.count(collective::all_reduce, dp) == tp_one.count(collective::all_reduce, dp));
static_assert(tp_rep.count_in("other", collective::all_reduce, tp) == -1);
// Unrolled to L layers: L times the block's, plus nothing outside (mse reduces over dp only).
static_assert(tp_rep.count_unrolled({1}, collective::all_reduce, tp) == 4);
static_assert(tp_rep.count_unrolled({24}, collective::all_reduce, tp) == 24 * 4);
static_assert(tp_rep.count_unrolled({24}, collective::all_reduce, dp, bwd) == 24 * 10);
// Parameters keep their names and specs; the stack's input gets its gradient.
static_assert(tp_rep.spec_of("wq.grad") == col && tp_rep.spec_of("x.grad") == tp_act);
static_assert(tp_rep.nodes[tp_rep.find("wq")].block == 0 && tp_rep.nodes[tp_rep.find("x")].block == -1);
static_assert(tp_rep.nodes[tp_rep.find("wq.update")].block == 0);

// Sequence parallelism and ZeRO-3 compose with repeat the same way.
constexpr auto sp_rep = stacked(sp_act, sgd{});
static_assert(sp_rep.count_in("layers", collective::all_gather, tp, fwd) == 2);
static_assert(sp_rep.count_in("layers", collective::reduce_scatter, tp, fwd) == 2);
static_assert(sp_rep.count_in("layers", collective::all_reduce, tp, bwd) == 4);
constexpr auto z3_rep = stacked(tp_act, zero<3>(adamw{}, dp));
constexpr auto z3_one = single(tp_act, zero<3>(adamw{}, dp));
static_assert(z3_rep.count_in("layers", collective::all_gather, dp, fwd) == 10);
static_assert(z3_rep.count_in("layers", collective::all_gather, dp, bwd) == 8);
static_assert(z3_rep.count_in("layers", collective::reduce_scatter, dp, bwd) == 10);
static_assert(z3_rep.count(collective::all_gather, dp) == z3_one.count(collective::all_gather, dp));
static_assert(z3_rep.count(op_code::state) == 20 && z3_rep.spec_of("wo") == spec(shard(tp), shard(dp)));

// A stack used twice on one input is one stack.
constexpr auto twice = program(mse(repeat<"layers">(block, input<"x">(tp_act)) + repeat<"layers">(block, input<"x">(tp_act)),
                                   data<"y">(tp_act)),
                               sgd{});
static_assert(twice.repeat_count == 1 && twice.count(op_code::sgd) == 10);

// Two stacks in sequence, each with its own parameters.
constexpr auto mlp = [](auto h) { return h + matmul(relu(matmul(h, param<"a.w1">(col))), param<"a.w2">(row)); };
constexpr auto mlp2 = [](auto h) { return h + matmul(relu(matmul(h, param<"b.w1">(col))), param<"b.w2">(row)); };
constexpr auto two = program(mse(repeat<"dec">(mlp2, repeat<"enc">(mlp, input<"x">(tp_act))), data<"y">(tp_act)), sgd{});
static_assert(two.repeat_count == 2 && two.repeat_index("enc") == 0 && two.repeat_index("dec") == 1);
static_assert(two.count_in("enc", collective::all_reduce, tp) == 2 && two.count_in("dec", collective::all_reduce, tp) == 2);
static_assert(two.count_unrolled({3, 5}, collective::all_reduce, tp) == 3 * 2 + 5 * 2);

// A block whose output is a pending sum over its input's spec has the sum made inside it.
constexpr auto pending = [](auto h) { return matmul(relu(matmul(h, param<"w1">(col))), param<"w2">(row)); };
constexpr auto pend = program(mse(repeat<"layers">(pending, input<"x">(tp_act)), data<"y">(tp_act)), sgd{});
static_assert(pend.count_in("layers", collective::all_reduce, tp, fwd) == 1);

// Vocab-parallel cross-entropy: logits [batch, seq, vocab] split over tp on the vocabulary.
constexpr auto labels = data<"labels">(spec(shard(dp), replicate));
constexpr auto hidden = input<"h">(tp_act);
constexpr auto head = param<"head">(col);
constexpr auto vp = program(cross_entropy(matmul(hidden, head), labels), sgd{});
static_assert(vp.count(collective::all_reduce, tp, fwd) == 3); // row max, target logit, sum of exponentials
static_assert(vp.count(collective::all_gather) == 0 && vp.count(op_code::vocab_ce_max) == 1 && vp.count(op_code::vocab_ce_grad) == 1);
static_assert(vp.count(collective::all_reduce, tp, bwd) == 1); // d(hidden) of the column-parallel head
static_assert(vp.spec_of("head.grad") == col);
// Gathering the logits explicitly keeps the plain cross-entropy.
constexpr auto gathered = program(cross_entropy(matmul(hidden, head).to(tp_act), labels), sgd{});
static_assert(gathered.count(collective::all_gather, tp, fwd) == 1 && gathered.count(op_code::cross_entropy) == 1);
static_assert(gathered.count(op_code::vocab_ce_max) == 0 && gathered.count(collective::all_reduce, tp, fwd) == 0);
// Logits split over two axes on the vocabulary are gathered too.
constexpr auto both = program(
    cross_entropy(matmul(input<"h2">(spec(replicate, replicate, replicate)), param<"head2">(spec(replicate, shard(dp, tp)))),
                  data<"labels2">(spec(replicate, replicate))),
    sgd{});
static_assert(both.count(op_code::vocab_ce_max) == 0 && both.count(collective::all_gather) == 2);
} // namespace
