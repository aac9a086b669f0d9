#pragma once
// A batch of token ids and next-token labels that every training test can recompute.
#include <concerto/train/options.hpp>

#include <cstdint>

namespace token_data {

/// Token ids and next-token labels for step `step`: a fixed pattern every test can recompute.
inline concerto::train::batch token_batch(int step, std::int64_t batch, std::int64_t seq, std::int64_t vocab) {
  concerto::train::tensor ids{{batch, seq}}, labels{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    ids.i64.push_back((i * 5 + step) % vocab);
    labels.i64.push_back((i * 5 + step + 1) % vocab);
  }
  return {{"ids", ids}, {"labels", labels}};
}

} // namespace token_data
