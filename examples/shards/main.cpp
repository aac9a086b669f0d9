// Writes token shards (data/token_shards.hpp: llm.c's layout) from text files with a byte-level
// tokenizer: each byte is its own token (vocabulary 256), so nothing is downloaded and any text
// will do. The last --val-fraction of each file goes to the validation shards.
//
//   example_shards --text /usr/share/common-licenses/GPL-3 --out data --val-fraction 0.1
//   -> data/train_000.bin ..., data/val_000.bin ...
#include <concerto/data/token_shards.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace concerto;

namespace {

// Writes `tokens` as shards `prefix_000.bin`, ... of at most `per_shard` tokens; returns how many.
int write_split(const std::filesystem::path& out, const std::string& prefix, const std::vector<std::uint32_t>& tokens,
                std::size_t per_shard, dataset::token_width width) {
  int count = 0;
  for (std::size_t first = 0; first < tokens.size(); first += per_shard, ++count) {
    const auto n = std::min(per_shard, tokens.size() - first);
    char name[64];
    std::snprintf(name, sizeof name, "%s_%03d.bin", prefix.c_str(), count);
    dataset::write_shard(out / name, std::span(tokens).subspan(first, n), width);
    const dataset::shard check(out / name); // read back: the header and size as a reader will see them
    if (check.size() != n) fail(std::string(name) + ": wrote " + std::to_string(n) + " tokens, read " + std::to_string(check.size()));
  }
  return count;
}

} // namespace

int main(int argc, char** argv) try {
  CLI::App app{"Writes token shards (llm.c's layout) from text files with a byte-level tokenizer."};
  std::vector<std::string> texts;
  std::string out;
  double val_fraction = 0.1;
  std::size_t per_shard = 100'000'000;
  std::string width_name = "u16";
  app.add_option("--text", texts, "text files (their bytes are the tokens)")->required()->check(CLI::ExistingFile);
  app.add_option("--out", out, "folder for train_NNN.bin and val_NNN.bin")->required();
  app.add_option("--val-fraction", val_fraction, "the share of each file held out for validation")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--shard-tokens", per_shard, "tokens per shard at most")->check(CLI::PositiveNumber);
  app.add_option("--width", width_name, "token width in the file: u16 or u32")->check(CLI::IsMember({"u16", "u32"}));
  CLI11_PARSE(app, argc, argv);

  std::vector<std::uint32_t> train, val;
  for (const auto& path : texts) {
    std::ifstream in(path, std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (!in.good() && !in.eof()) fail("cannot read '" + path + "'");
    const auto held = static_cast<std::size_t>(static_cast<double>(text.size()) * val_fraction);
    for (std::size_t i = 0; i < text.size(); ++i)
      (i < text.size() - held ? train : val).push_back(static_cast<unsigned char>(text[i]));
  }
  if (train.empty()) fail("the texts hold no bytes");
  std::filesystem::create_directories(out);
  const auto width = width_name == "u32" ? dataset::token_width::u32 : dataset::token_width::u16;
  const int train_shards = write_split(out, "train", train, per_shard, width);
  const int val_shards = val.empty() ? 0 : write_split(out, "val", val, per_shard, width);
  std::printf("%zu training tokens in %d shard(s), %zu validation tokens in %d shard(s), vocabulary 256 (bytes), in %s\n",
              train.size(), train_shards, val.size(), val_shards, out.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example_shards: %s\n", e.what());
  return 1;
}
