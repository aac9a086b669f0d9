// Token shards (data/token_shards.hpp): both header layouts read back; a damaged shard is refused
// with its file and byte offset; the global batch is the same on any number of data-parallel
// ranks; the order is fixed by the seed; a loader moved to a saved position serves exactly the
// batches an uninterrupted one serves next.
#include <concerto/data/token_shards.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

struct scratch {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("concerto_shards_" + std::to_string(::getpid()));
  scratch() { std::filesystem::create_directories(dir); }
  ~scratch() { std::filesystem::remove_all(dir); }
};

std::vector<std::uint32_t> counting(std::size_t n, std::uint32_t from = 0) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = from + static_cast<std::uint32_t>(i);
  return t;
}

std::string bytes_of(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void put_bytes(const std::filesystem::path& p, const std::string& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// Every (ids, labels) pair of a batch as the window's first token: windows start at multiples of seq.
std::vector<std::int64_t> firsts(const dataset::batch& b) {
  std::vector<std::int64_t> out;
  for (int r = 0; r < b.rows; ++r) out.push_back(b.ids[static_cast<std::size_t>(r * b.seq)]);
  return out;
}

} // namespace

TEST_CASE("a shard reads back in both layouts, in llm.c's header") {
  scratch s;
  const auto small = counting(1000), big = counting(300, 70000);
  dataset::write_shard(s.dir / "a.bin", small, dataset::token_width::u16);
  dataset::write_shard(s.dir / "b.bin", big, dataset::token_width::u32);
  const dataset::shard a(s.dir / "a.bin"), b(s.dir / "b.bin");
  CHECK(a.width() == dataset::token_width::u16);
  CHECK(b.width() == dataset::token_width::u32);
  REQUIRE(a.size() == 1000);
  REQUIRE(b.size() == 300);
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == small[i]);
  for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(b[i] == big[i]);
  // The header as llm.c writes it: 256 int32 of magic, version, count, zeros; then the tokens.
  const auto raw = bytes_of(s.dir / "a.bin");
  REQUIRE(raw.size() == 1024 + 2 * 1000);
  std::int32_t h[4];
  std::memcpy(h, raw.data(), sizeof h);
  CHECK(h[0] == 20240520);
  CHECK(h[1] == 1);
  CHECK(h[2] == 1000);
  CHECK(h[3] == 0);
  CHECK_THROWS_WITH(dataset::write_shard(s.dir / "c.bin", big, dataset::token_width::u16),
                    ContainsSubstring("does not fit uint16") && ContainsSubstring("token_width::u32"));
}

TEST_CASE("a damaged shard is refused with its file and the byte offset") {
  scratch s;
  const auto path = s.dir / "train_000.bin";
  dataset::write_shard(path, counting(100), dataset::token_width::u16);
  const auto good = bytes_of(path);

  put_bytes(path, good.substr(0, good.size() - 3));
  CHECK_THROWS_WITH(dataset::shard(path), ContainsSubstring("train_000.bin") && ContainsSubstring("at byte 1221") &&
                                           ContainsSubstring("truncated"));
  put_bytes(path, good.substr(0, 500));
  CHECK_THROWS_WITH(dataset::shard(path), ContainsSubstring("at byte 500") && ContainsSubstring("inside the 1024-byte header"));
  auto wrong = good;
  wrong[0] = 'x';
  put_bytes(path, wrong);
  CHECK_THROWS_WITH(dataset::shard(path), ContainsSubstring("at byte 0") && ContainsSubstring("magic") &&
                                           ContainsSubstring("not a token shard"));
  wrong = good;
  wrong[4] = 2;
  put_bytes(path, wrong);
  CHECK_THROWS_WITH(dataset::shard(path), ContainsSubstring("at byte 4") && ContainsSubstring("version 2"));
  put_bytes(path, good + "zz");
  CHECK_THROWS_WITH(dataset::shard(path), ContainsSubstring("longer than its header says"));
  CHECK_THROWS_WITH(dataset::shard(s.dir / "missing.bin"), ContainsSubstring("missing.bin") && ContainsSubstring("cannot open"));
  CHECK_THROWS_WITH(dataset::shards_in(s.dir, "val"), ContainsSubstring("no shard 'val*.bin'"));
}

TEST_CASE("the global batch is the same on 1, 2 and 4 data-parallel ranks") {
  scratch s;
  dataset::write_shard(s.dir / "train_000.bin", counting(16 * 40 + 1), dataset::token_width::u16);
  dataset::write_shard(s.dir / "train_001.bin", counting(16 * 25 + 5, 5000), dataset::token_width::u32);
  const auto files = dataset::shards_in(s.dir, "train");
  REQUIRE(files.size() == 2);
  const dataset::loader_options o{.files = files, .batch = 8, .seq = 16, .seed = 7};

  dataset::token_loader one(o, {});
  CHECK(one.windows() == 40 + 25);
  CHECK(one.batches_per_epoch() == 8);
  for (int step = 0; step < 12; ++step) { // past the end of an epoch
    const auto whole = one.next();
    REQUIRE(whole.rows == 8);
    for (std::size_t i = 0; i < whole.ids.size(); ++i) {
      // labels are the next tokens of each window
      if ((i + 1) % 16 != 0) REQUIRE(whole.labels[i] == whole.ids[i + 1]);
    }
    for (const int ranks : {2, 4}) {
      std::vector<std::int64_t> joined;
      for (int r = 0; r < ranks; ++r) {
        dataset::token_loader part(o, {.rank = r, .ranks = ranks});
        part.seek(whole.at);
        const auto b = part.next();
        REQUIRE(b.rows == 8 / ranks);
        joined.insert(joined.end(), b.ids.begin(), b.ids.end());
      }
      REQUIRE(joined == whole.ids);
    }
  }
  CHECK_THROWS_WITH(dataset::token_loader(o, {.rank = 0, .ranks = 3}), ContainsSubstring("does not split over 3"));
}

TEST_CASE("an epoch serves every window once, in an order the seed fixes") {
  scratch s;
  dataset::write_shard(s.dir / "train_000.bin", counting(8 * 64 + 1), dataset::token_width::u16);
  const dataset::loader_options o{.files = dataset::shards_in(s.dir, "train"), .batch = 4, .seq = 8, .seed = 3};
  const auto epoch = [&](dataset::token_loader& l) {
    std::vector<std::int64_t> all;
    for (std::uint64_t b = 0; b < l.batches_per_epoch(); ++b) {
      const auto f = firsts(l.next());
      all.insert(all.end(), f.begin(), f.end());
    }
    return all;
  };
  dataset::token_loader a(o, {}), b(o, {});
  const auto first = epoch(a);
  REQUIRE(first.size() == 64);
  CHECK(std::set<std::int64_t>(first.begin(), first.end()).size() == 64);
  CHECK(epoch(b) == first);            // the same seed: the same order
  const auto second = epoch(a);        // the next epoch: another permutation of the same windows
  CHECK(second != first);
  CHECK(std::set<std::int64_t>(second.begin(), second.end()) == std::set<std::int64_t>(first.begin(), first.end()));
  auto other = o;
  other.seed = 4;
  dataset::token_loader c(other, {});
  CHECK(epoch(c) != first);
  auto in_order = o;
  in_order.shuffle = false;
  dataset::token_loader d(in_order, {});
  const auto ordered = epoch(d);
  for (std::size_t i = 0; i < ordered.size(); ++i) REQUIRE(ordered[i] == static_cast<std::int64_t>(i * 8));
}

TEST_CASE("a loader moved to a saved position serves what an uninterrupted one serves next") {
  scratch s;
  dataset::write_shard(s.dir / "train_000.bin", counting(10 * 30 + 1), dataset::token_width::u16);
  const dataset::loader_options o{.files = dataset::shards_in(s.dir, "train"), .batch = 4, .seq = 10, .seed = 11};
  dataset::token_loader run(o, {.rank = 1, .ranks = 2});
  dataset::position saved;
  for (int step = 0; step < 9; ++step) {
    if (step == 5) saved = run.where();
    (void)run.next();
  }
  CHECK(saved == dataset::position{0, 5});
  dataset::token_loader resumed(o, {.rank = 1, .ranks = 2}), replay(o, {.rank = 1, .ranks = 2});
  resumed.seek(saved);
  for (int step = 0; step < 5; ++step) (void)replay.next();
  for (int step = 0; step < 10; ++step) { // across the epoch's end (7 batches an epoch)
    const auto a = resumed.next(), b = replay.next();
    REQUIRE(a.at == b.at);
    REQUIRE(a.ids == b.ids);
    REQUIRE(a.labels == b.labels);
  }
  CHECK_THROWS_WITH(resumed.seek({0, 7}), ContainsSubstring("an epoch has 7 batches"));
  CHECK_THROWS_WITH(dataset::token_loader({.files = o.files, .batch = 64, .seq = 10}, {}),
                    ContainsSubstring("fewer than one global batch"));
}
