#pragma once
// The training tests check the GPT example's own model.
#include "../../examples/gpt/model.hpp"

#include <concerto/train/step.hpp>

namespace gpt_testing {

using namespace gpt_model;

/// The size the MPI tests train it at: 4 sequences of 8 tokens, a vocabulary of 32, width 16.
inline constexpr std::int64_t test_batch = 4, test_seq = 8, test_vocab = 32, test_hidden = 16;
inline concerto::shape_map test_shapes() { return shapes(test_batch, test_seq, test_vocab, test_hidden); }

/// Token ids and next-token labels for step `step`: a fixed pattern every test can recompute.
inline concerto::train::batch token_batch(int step, std::int64_t batch, std::int64_t seq, std::int64_t vocab) {
  concerto::train::tensor ids{{batch, seq}}, labels{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    ids.i64.push_back((i * 5 + step) % vocab);
    labels.i64.push_back((i * 5 + step + 1) % vocab);
  }
  return {{"ids", ids}, {"labels", labels}};
}

} // namespace gpt_testing
