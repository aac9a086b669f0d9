#pragma once
// The example's Evoformer pair stack, the triangle-free core of AlphaFold 2's Evoformer block on
// the pair representation z [N_res, N_res, c_z]: row-wise gated self-attention (each residue i
// attends over j), column-wise gated self-attention (each j over i) and the transition MLP, each
// pre-normalised and added to z. Dynamic axial parallelism (DAP, FastFold) splits z over `dap` on
// one residue dimension: the rows for row attention and the transition, the columns for column
// attention. Column attention runs as row attention of the transposed z; the switch between the
// row and the column split is written as a redistribution (`.to(rows)` of a transposed tensor),
// which lowers to an all-to-all over dap, forward and backward. Every weight is replicated and
// summed over dap. tests/mpi/train_evoformer_test.cpp checks this very model.
#include <concerto/concerto.hpp>

namespace evoformer_model {

using namespace concerto;
inline constexpr axis<"dap"> dap;

inline constexpr auto rows = spec(shard(dap), replicate, replicate); ///< z [i, j, c] split on i
inline constexpr auto vec = spec(replicate);
inline constexpr auto weight = spec(replicate, replicate);

/// Gated self-attention along dimension 1 of z (AlphaFold 2's, without pair bias): q, k, v and a
/// sigmoid gate from the normalised z, heads over the channels, the gated heads projected back.
template <fixed_string Prefix, class Layout, class Z>
constexpr auto gated_attention(Z z) {
  auto a = layernorm(z, param<join<Prefix, "ln.g">()>(Layout::vec, init::ones), param<join<Prefix, "ln.b">()>(Layout::vec));
  auto q = matmul(a, param<join<Prefix, "wq">()>(Layout::weight));
  auto k = matmul(a, param<join<Prefix, "wk">()>(Layout::weight));
  auto v = matmul(a, param<join<Prefix, "wv">()>(Layout::weight));
  auto gate = sigmoid(matmul(a, param<join<Prefix, "wg">()>(Layout::weight)));
  return matmul(gate * attention(q, k, v), param<join<Prefix, "wo">()>(Layout::weight));
}

/// DAP's specs as written: z split on its rows, every weight replicated.
struct dap_written {
  static constexpr auto z = rows;
  static constexpr auto vec = evoformer_model::vec;
  static constexpr auto weight = evoformer_model::weight;
};
/// Every spec and both switches decided by automatic sharding (bench_autoshard --model evoformer):
/// which residue dimension each attention reads split, where the all-to-alls go, or none.
struct dap_decided {
  static constexpr auto z = spec(auto_, auto_, replicate);
  static constexpr auto vec = spec(auto_);
  static constexpr auto weight = spec(auto_, auto_);
};

template <class Layout>
inline constexpr auto block_of = [](auto z) {
  auto z1 = z + gated_attention<"row.", Layout>(z);
  // Columns: attention over i for each j is row attention of the transposed z; its split moves
  // from j to i (an all-to-all over dap) and back.
  auto zt = transpose(z1).to(Layout::z);
  auto z2 = z1 + transpose(gated_attention<"col.", Layout>(zt)).to(Layout::z);
  auto t = layernorm(z2, param<"tr.ln.g">(Layout::vec, init::ones), param<"tr.ln.b">(Layout::vec));
  return z2 + matmul(relu(matmul(t, param<"tr.w1">(Layout::weight))), param<"tr.w2">(Layout::weight));
};
inline constexpr auto block = block_of<dap_written>;

/// z0 (an input without gradient, the stack's pair features) through `depth` blocks, regressed on a target.
template <class Layout>
constexpr auto make_pair_stack() {
  constexpr auto z0 = input<"z">(Layout::z, no_grad);
  constexpr auto zn = repeat<"blocks">(block_of<Layout>, z0);
  return program(mse(zn, input<"target">(Layout::z, no_grad)), adamw{});
}
inline constexpr auto pair_stack = make_pair_stack<dap_written>();
inline constexpr auto pair_stack_auto = make_pair_stack<dap_decided>();

/// Shapes for N residues, c channels, `heads` heads (attention over c / heads lanes) and a
/// transition of factor 4, AlphaFold 2's pair stack widths at c = 128 and 4 heads.
inline shape_map shapes(std::int64_t residues, std::int64_t channels) {
  const auto n = residues, c = channels;
  shape_map s{{"z", {n, n, c}}, {"target", {n, n, c}}, {"tr.ln.g", {c}}, {"tr.ln.b", {c}}, {"tr.w1", {c, 4 * c}},
              {"tr.w2", {4 * c, c}}};
  for (const std::string p : {"row.", "col."}) {
    s[p + "ln.g"] = s[p + "ln.b"] = {c};
    for (const char* w : {"wq", "wk", "wv", "wg", "wo"}) s[p + w] = {c, c};
  }
  return s;
}

} // namespace evoformer_model
