// The two-layer MLP of issue 4 under every parallelism, checked at compile time.
#include <concerto/concerto.hpp>

namespace {
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

template <class Act, class W1, class W2>
constexpr auto mlp(Act act, W1 s1, W2 s2) {
  return mse(matmul(gelu(matmul(input<"x">(act), param<"w1">(s1))), param<"w2">(s2)), input<"target">(act));
}
constexpr auto fwd = static_cast<int>(ir::phase::forward);
constexpr auto bwd = static_cast<int>(ir::phase::backward);
constexpr auto opt = static_cast<int>(ir::phase::optimizer);

// The issue's example, verbatim apart from the static_asserts added below.
constexpr auto act = spec(shard(dp), replicate);
constexpr auto x = input<"x">(act);
constexpr auto w1 = param<"w1">(spec(replicate, shard(tp))); // column-parallel
constexpr auto w2 = param<"w2">(spec(shard(tp), replicate)); // row-parallel
constexpr auto loss = mse(matmul(gelu(matmul(x, w1)), w2), input<"target">(act));
constexpr auto step = program(loss, sgd{});
static_assert(step.count(collective::all_reduce, tp) == 2); // forward and backward
static_assert(step.count(collective::all_reduce, tp, fwd) == 1 && step.count(collective::all_reduce, tp, bwd) == 1);
static_assert(step.count(collective::all_reduce, dp, bwd) == 2); // one per weight gradient
static_assert(step.count(collective::all_gather) == 0 && step.count(collective::reduce_scatter) == 0);
static_assert(step.spec_of("w1.grad") == spec(replicate, shard(tp)));
static_assert(step.spec_of("x.grad") == act);
static_assert(step.find("target.grad") == -1); // the target gets no gradient
static_assert(step.count(op_code::sgd) == 2 && step.count(op_code::matmul) == 6);
// Identical named leaves are one node.
static_assert(step.count(op_code::input) == 2 && step.count(op_code::param) == 2);

// Inputs without gradient: no x.grad, so neither the backward matmul that makes it nor the tp
// all-reduce that sums it (the work a framework skips for inputs that do not require grad).
constexpr auto frozen = program(mse(matmul(gelu(matmul(input<"x">(act, no_grad), w1)), w2), input<"target">(act, no_grad)), sgd{});
static_assert(frozen.find("x.grad") == -1 && frozen.find("x") >= 0);
static_assert(frozen.count(op_code::matmul) == 5);
static_assert(frozen.count(collective::all_reduce, tp, fwd) == 1 && frozen.count(collective::all_reduce, tp, bwd) == 0);
static_assert(frozen.count(collective::all_reduce, dp, bwd) == 2);
static_assert(frozen.count(op_code::input) == 2);

// The issue's form with plain `auto` leaves: the program comes from the expression's type alone.
[[maybe_unused]] void issue_form() {
  auto x = input<"x">(act);
  auto w1 = param<"w1">(spec(replicate, shard(tp)));
  auto w2 = param<"w2">(spec(shard(tp), replicate));
  auto loss = mse(matmul(gelu(matmul(x, w1)), w2), input<"target">(act));
  constexpr auto step = program(loss, sgd{});
  static_assert(step.count(collective::all_reduce, tp) == 2);
}

// Data parallel only: the gradient all-reduces and nothing else.
constexpr auto dp_step = program(mlp(act, spec(replicate, replicate), spec(replicate, replicate)), sgd{});
static_assert(dp_step.count(collective::all_reduce, dp) == 2 && dp_step.count(collective::all_reduce, tp) == 0);
static_assert(dp_step.count(collective::all_reduce) == 2);

// Tensor parallel only: Megatron-LM's f and g.
constexpr auto tp_step = program(mlp(spec(replicate, replicate), spec(replicate, shard(tp)), spec(shard(tp), replicate)), sgd{});
static_assert(tp_step.count(collective::all_reduce, tp) == 2 && tp_step.count(collective::all_reduce, dp) == 0);
static_assert(tp_step.count(collective::all_reduce) == 2);

// Inputs declared as data get no gradient: the backward tp all-reduce disappears.
constexpr auto no_dx = program(
    mse(matmul(gelu(matmul(data<"x">(act), w1)), w2), data<"target">(act)), sgd{});
static_assert(no_dx.count(collective::all_reduce, tp) == 1 && no_dx.find("x.grad") == -1);

// An explicit .to() replaces the automatic all-reduce; counts are the same.
constexpr auto explicit_to = program(mse(matmul(gelu(matmul(x, w1)), w2).to(act), input<"target">(act)), sgd{});
static_assert(explicit_to.count(collective::all_reduce, tp) == 2 && explicit_to.size == step.size);

// A common subexpression is one node.
constexpr auto cse = program(mse(matmul(x, w1) + matmul(x, w1), input<"t">(spec(shard(dp), shard(tp)))), sgd{});
static_assert(cse.count(op_code::matmul) == 1 + 2);

// ZeRO-1: gradients all-reduced, optimizer state sharded, parameters gathered after the update.
constexpr auto z1 = program(loss, zero<1>(adamw{}, dp));
static_assert(z1.count(collective::all_reduce, dp, bwd) == 2);
static_assert(z1.count(collective::all_gather, dp, opt) == 2 && z1.count(collective::reduce_scatter, dp) == 0);
static_assert(z1.count(op_code::state) == 4 && z1.count(op_code::shard_slice) == 4);
static_assert(z1.spec_of("w1.update") == spec(shard(dp), shard(tp)) && z1.spec_of("w1") == spec(replicate, shard(tp)));

// ZeRO-2: gradients reduce-scattered instead.
constexpr auto z2 = program(loss, zero<2>(adamw{}, dp));
static_assert(z2.count(collective::reduce_scatter, dp, bwd) == 2 && z2.count(collective::all_reduce, dp) == 0);
static_assert(z2.count(collective::all_gather, dp, opt) == 2);
static_assert(z2.spec_of("w2.grad") == spec(shard(tp), shard(dp)));
static_assert(z2.count(collective::all_reduce, tp) == 2);

// ZeRO-3: parameters stored sharded, gathered for forward and again for backward.
constexpr auto z3 = program(loss, zero<3>(adamw{}, dp));
static_assert(z3.count(collective::all_gather, dp, fwd) == 2 && z3.count(collective::all_gather, dp, bwd) == 2);
static_assert(z3.count(collective::reduce_scatter, dp, bwd) == 2 && z3.count(collective::all_reduce, dp) == 0);
static_assert(z3.count(collective::all_gather, dp, opt) == 0);
static_assert(z3.spec_of("w1") == spec(shard(dp), shard(tp)) && z3.spec_of("w1.grad") == spec(shard(dp), shard(tp)));
// Each parameter records the dimension ZeRO split (lowering may pad it; a split the user wrote, never).
static_assert(z3.nodes[z3.find("w1")].zero_dim == 0 && z3.nodes[z3.find("w2")].zero_dim == 1);
static_assert(z1.nodes[z1.find("w2")].zero_dim == 1 && step.nodes[step.find("w2")].zero_dim == -1);

// The same with explicit storage specs and a plain optimizer.
constexpr auto fsdp = program(
    mse(matmul(gelu(matmul(x, param<"w1">(spec(replicate, shard(tp)), stored(spec(shard(dp), shard(tp)))))),
               param<"w2">(spec(shard(tp), replicate), stored(spec(shard(tp), shard(dp))))),
        input<"target">(act)),
    sgd{});
static_assert(fsdp.count(collective::all_gather, dp) == 4 && fsdp.count(collective::reduce_scatter, dp) == 2);
static_assert(fsdp.nodes[fsdp.find("w1")].zero_dim == -1);

// Declaring the mesh does not change the program.
constexpr auto declared = program(loss, sgd{}, on(dp, tp));
static_assert(declared.size == step.size && declared.count(collective::all_reduce, tp) == 2);
} // namespace
