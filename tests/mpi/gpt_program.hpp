#pragma once
// The training tests check the GPT example's own model.
#include "../../examples/gpt/model.hpp"
#include "token_batch.hpp"

#include <concerto/train/step.hpp>

namespace gpt_testing {

using namespace gpt_model;

/// The size the MPI tests train it at: 4 sequences of 8 tokens, a vocabulary of 32, width 16.
inline constexpr std::int64_t test_batch = 4, test_seq = 8, test_vocab = 32, test_hidden = 16;
inline concerto::shape_map test_shapes() { return shapes(test_batch, test_seq, test_vocab, test_hidden); }

using token_data::token_batch;

} // namespace gpt_testing
