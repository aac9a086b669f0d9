#pragma once
// What the text-training examples share: a text read as character ids, and its vocabulary padded
// so that it splits over the tensor-parallel ranks.
#include <concerto/core/error.hpp>
#include <concerto/runtime/deadline.hpp>
#include <concerto/runtime/mpi/control.hpp>

#include <mpi.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace examples {

struct corpus {
  std::string text;
  std::vector<int> id_of = std::vector<int>(256, -1); ///< character -> id
  std::int64_t vocab = 0;                             ///< distinct characters, padded to a multiple of 8
};

/// Rank 0 reads `path` and sends it to every rank, so that all train on the same text and a bad
/// file is reported once. Refuses a file too short to draw one sequence of `seq` characters and
/// its next one. Collective over MPI_COMM_WORLD.
inline corpus read_corpus(const std::string& path, int seq) {
  std::string message; // the text, or "!" and why there is none
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::ifstream in(path, std::ios::binary);
    message = in ? "=" + std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>())
                 : "!cannot read the training text '" + path + "'";
    if (message.front() == '=' && message.size() - 1 < static_cast<std::size_t>(seq) + 2)
      message = "!the training text '" + path + "' has " + std::to_string(message.size() - 1) + " characters; --seq " +
                std::to_string(seq) + " needs at least " + std::to_string(seq + 2);
  }
  const concerto::runtime::mpi::control world(
      MPI_COMM_WORLD, concerto::runtime::detail::env_timeout_s(concerto::runtime::default_timeout_s));
  world.broadcast(message, 0, "the training text from rank 0");
  if (message.front() == '!') concerto::fail_on_every_rank(message.substr(1));
  corpus c;
  c.text = message.substr(1);
  for (const unsigned char ch : c.text)
    if (c.id_of[ch] < 0) c.id_of[ch] = static_cast<int>(c.vocab++);
  c.vocab = (c.vocab + 7) / 8 * 8;
  return c;
}

} // namespace examples
