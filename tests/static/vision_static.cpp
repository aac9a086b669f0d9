// The vision ops' sharding rules, checked at compile time: conv2d as a product over its window
// (batch, output channels, input channels as a pending sum; height and width whole), flatten
// (split as its first merged dim), sum and mean over a dim (a split dim becomes a pending sum),
// and a table broadcast over the leading dims (laid out like x's last dims), max and average
// pooling (height and width whole; the average linear, the maximum not), concat and slice along
// a dim (the dim whole; a lower-rank operand laid out like the other's last dims).
#include <concerto/concerto.hpp>

namespace {
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto fwd = static_cast<int>(ir::phase::forward);
constexpr auto bwd = static_cast<int>(ir::phase::backward);

template <class P>
constexpr int first_node(const P& p, op_code op) {
  for (int i = 0; i < p.size; ++i)
    if (p.nodes[i].op == op) return i;
  return -1;
}

constexpr auto image = spec(shard(dp), replicate, replicate, replicate);
constexpr auto column = spec(replicate, replicate, replicate, shard(tp)); // output channels split
constexpr auto row = spec(replicate, replicate, shard(tp), replicate);    // input channels split

// Column-parallel then row-parallel convolutions: one tp all-reduce forward (the row-parallel
// sum) and one backward (the image's gradient of the column-parallel one), as for an MLP.
constexpr auto convs = program(mse(conv2d(relu(conv2d<{.padding = 1}>(input<"x">(image), param<"k1">(column))), param<"k2">(row)),
                                   input<"target">(image)),
                               sgd{}, on(dp, tp));
static_assert(convs.count(collective::all_reduce, tp, fwd) == 1 && convs.count(collective::all_reduce, tp, bwd) == 1);
static_assert(convs.count(collective::all_reduce, dp, bwd) == 2); // the kernels' gradients
static_assert(convs.count(collective::all_gather) == 0);
static_assert(convs.spec_at(first_node(convs, op_code::conv2d)) == spec(shard(dp), replicate, replicate, shard(tp)));
static_assert(convs.spec_of("k1.grad") == column && convs.spec_of("x.grad") == image);
static_assert(convs.count(op_code::conv2d_grad_input) == 2 && convs.count(op_code::conv2d_grad_weight) == 2);

// An image split over its height is gathered first: a window would need its neighbours' rows.
constexpr auto tall = program(mse(conv2d(input<"x">(spec(replicate, shard(dp), replicate, replicate), no_grad), param<"k">(column)),
                                  input<"target">(image)),
                              sgd{}, on(dp, tp));
constexpr int tall_conv = first_node(tall, op_code::conv2d);
static_assert(tall.nodes[tall.nodes[tall_conv].in[0]].op == op_code::all_gather && tall.spec_at(tall.nodes[tall_conv].in[0]) ==
                                                                                      spec(replicate, replicate, replicate, replicate));

// Pooling keeps split channels and the batch; a split height is gathered; the average of a
// pending sum stays pending (made once, after it), the maximum makes it first.
constexpr auto row_out = conv2d(relu(conv2d<{.padding = 1}>(input<"x">(image, no_grad), param<"k1">(column))), param<"k2">(row));
constexpr auto avg_of_sum = program(mse(avg_pool(row_out), input<"target">(image)), sgd{}, on(dp, tp));
static_assert(avg_of_sum.spec_at(first_node(avg_of_sum, op_code::avg_pool)) == spec(shard(dp), replicate, replicate, replicate, partial(tp)));
static_assert(avg_of_sum.count(collective::all_reduce, tp, fwd) == 1);
constexpr auto max_of_sum = program(mse(max_pool(row_out), input<"target">(image)), sgd{}, on(dp, tp));
constexpr int max_node = first_node(max_of_sum, op_code::max_pool);
static_assert(max_of_sum.nodes[max_of_sum.nodes[max_node].in[0]].op == op_code::all_reduce);
static_assert(max_of_sum.spec_at(max_node) == image);
constexpr auto split_channels =
    program(mse(max_pool<{.window = 3, .stride = 2, .padding = 1}>(conv2d(input<"x">(image, no_grad), param<"k">(column))),
                input<"target">(spec(shard(dp), replicate, replicate, shard(tp)))),
            sgd{}, on(dp, tp));
static_assert(split_channels.spec_at(first_node(split_channels, op_code::max_pool)) == spec(shard(dp), replicate, replicate, shard(tp)));
static_assert(split_channels.count(collective::all_gather) == 0 && split_channels.count(op_code::max_pool_grad) == 1);
constexpr auto tall_pool =
    program(mse(avg_pool(input<"x">(spec(replicate, shard(dp), replicate, replicate))), input<"target">(image)), sgd{}, on(dp, tp));
static_assert(tall_pool.nodes[tall_pool.nodes[first_node(tall_pool, op_code::avg_pool)].in[0]].op == op_code::all_gather);

// Global average pooling of a column-parallel convolution, a position table split like the
// channels, a row-parallel head: the logits' pending sum is the one tp all-reduce forward.
constexpr auto pooled = flatten<1, 2>(relu(conv2d<{.padding = 1}>(input<"x">(image, no_grad), param<"k">(column))));
constexpr auto classifier =
    program(cross_entropy(matmul(mean<1>(bias(pooled, param<"pos">(spec(replicate, shard(tp))))), param<"head">(spec(shard(tp), replicate))),
                          data<"labels">(spec(shard(dp)))),
            sgd{}, on(dp, tp));
static_assert(classifier.spec_at(first_node(classifier, op_code::flatten)) == spec(shard(dp), replicate, shard(tp)));
static_assert(classifier.spec_at(first_node(classifier, op_code::mean_dim)) == spec(shard(dp), shard(tp)));
static_assert(classifier.spec_of("pos.grad") == spec(replicate, shard(tp)));
static_assert(classifier.count(collective::all_reduce, tp, fwd) == 1 && classifier.count(collective::all_reduce, tp, bwd) == 0);
static_assert(classifier.count(collective::all_reduce, dp, bwd) == 3); // k, pos, head
static_assert(classifier.count(op_code::flatten_grad) == 1 && classifier.count(op_code::mean_dim_grad) == 1);

// A sum over a split dim is a pending sum over its axis; a flatten gathers a split later part.
constexpr auto summed = program(mse(sum<1>(input<"x">(spec(shard(dp), shard(tp)))), input<"target">(spec(shard(dp)))), sgd{}, on(dp, tp));
static_assert(summed.spec_at(first_node(summed, op_code::sum_dim)) == spec(shard(dp), partial(tp)));
constexpr auto merged = program(mse(flatten<0, 1>(input<"x">(spec(shard(dp), shard(tp)))), input<"target">(spec(shard(dp)))), sgd{},
                                on(dp, tp));
static_assert(merged.count(collective::all_gather, tp, fwd) == 1);
static_assert(merged.spec_at(first_node(merged, op_code::flatten)) == spec(shard(dp)));

// unflatten: the first of the two dims split as the dim was, the second whole, no collective
// (a view); transpose<1>: each axis follows its dim (tp moves from dim 2 to dim 1), linear.
constexpr auto unmerged = program(mse(flatten<0, 1>(unflatten<0, 4>(input<"x">(spec(shard(dp), shard(tp))))), input<"target">(spec(shard(dp), shard(tp)))),
                                  sgd{}, on(dp, tp));
static_assert(unmerged.spec_at(first_node(unmerged, op_code::unflatten)) == spec(shard(dp), replicate, shard(tp)));
static_assert(unmerged.count(collective::all_gather, dp) == 0);
constexpr auto swapped = program(mse(transpose<1>(input<"x">(spec(shard(dp), replicate, shard(tp)))), input<"target">(spec(shard(dp), shard(tp), replicate))),
                                 sgd{}, on(dp, tp));
static_assert(swapped.spec_at(first_node(swapped, op_code::transpose)) == spec(shard(dp), shard(tp), replicate));
static_assert(swapped.count(collective::all_gather) == 0 && swapped.count(collective::all_to_all) == 0);
constexpr auto pending = program(mse(transpose<1>(input<"x">(spec(shard(dp), replicate, replicate, partial(tp)))),
                                     input<"target">(spec(shard(dp), replicate, replicate))),
                                 sgd{}, on(dp, tp));
static_assert(pending.spec_at(first_node(pending, op_code::transpose)) == spec(shard(dp), replicate, replicate, partial(tp)));
static_assert(pending.count(collective::all_reduce, tp, fwd) == 1); // made after the transpose, for the loss

// Batch normalisation between the convolutions, gamma and beta split like the channels.
// Synchronised: the sums are all-reduced over dp forward and backward, and the backward sums are
// dgamma and dbeta already summed (no all-reduce of their own); local: no forward all-reduce,
// and dgamma and dbeta are all-reduced with the kernels' gradients.
template <batchnorm_config C>
constexpr auto normed = program(mse(conv2d(relu(batchnorm<C>(conv2d<{.padding = 1}>(input<"x">(image), param<"k1">(column)),
                                                             param<"g">(spec(shard(tp)), init::ones), param<"b">(spec(shard(tp))))),
                                           param<"k2">(row)),
                                    input<"target">(image)),
                                sgd{}, on(dp, tp));
constexpr auto synced = normed<batchnorm_config{}>;
constexpr auto local = normed<batchnorm_config{.sync = false}>;
static_assert(synced.count(collective::all_reduce, dp, fwd) == 1 && synced.count(collective::all_reduce, dp, bwd) == 3);
static_assert(local.count(collective::all_reduce, dp, fwd) == 0 && local.count(collective::all_reduce, dp, bwd) == 4);
static_assert(synced.spec_of("g.grad") == spec(shard(tp)) && local.spec_of("b.grad") == spec(shard(tp)));
static_assert(synced.count(op_code::batchnorm_stats) == 1 && synced.count(op_code::batchnorm_grad) == 1);
static_assert(synced.count(collective::all_reduce, tp, fwd) == 1); // the row-parallel convolution's sum only

// A class token [1, hidden] joined before a sequence split over tp along its hidden size: the
// table like the sequence's last dims, no gather; its gradient summed over the batch (dp) and
// all-reduced over dp as a parameter's.
constexpr auto seq_split = spec(shard(dp), replicate, shard(tp));
constexpr auto with_token = program(mse(concat<1>(param<"cls">(spec(replicate, shard(tp))), input<"x">(seq_split, no_grad)),
                                        input<"target">(seq_split)),
                                    sgd{}, on(dp, tp));
static_assert(with_token.spec_at(first_node(with_token, op_code::concat_dim)) == seq_split);
static_assert(with_token.count(collective::all_gather) == 0 && with_token.count(op_code::concat_dim_grad) == 1);
static_assert(with_token.spec_at(first_node(with_token, op_code::concat_dim_grad)) == spec(replicate, shard(tp), partial(dp)));
// Joining or slicing along a split dim gathers it first (a sequence-parallel split of the tokens).
constexpr auto along_split = program(mse(slice<1, 0, 1>(concat<1>(param<"cls">(spec(replicate, replicate)),
                                                                  input<"x">(spec(shard(dp), shard(tp), replicate), no_grad))),
                                         input<"target">(spec(shard(dp), replicate, replicate))),
                                     sgd{}, on(dp, tp));
static_assert(along_split.count(collective::all_gather, tp, fwd) == 1);
static_assert(along_split.spec_at(first_node(along_split, op_code::slice_dim)) == spec(shard(dp), replicate, replicate));
// A slice is linear: a pending sum goes through it.
constexpr auto sliced_sum = program(mse(slice<2, 1, 3>(conv2d(input<"x">(spec(shard(dp), replicate, replicate, shard(tp)), no_grad), param<"k">(row))),
                                        input<"target">(image)),
                                    sgd{}, on(dp, tp));
static_assert(sliced_sum.spec_at(first_node(sliced_sum, op_code::slice_dim)) ==
              spec(shard(dp), replicate, replicate, replicate, partial(tp)));

} // namespace
