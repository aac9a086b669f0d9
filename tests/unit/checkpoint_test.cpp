// The checkpoint file (train/checkpoint.hpp): what is written reads back; every kind of damage
// (a flipped byte anywhere, NaN, an edited offset, truncation, a bad header) is refused with a
// message naming the file and, where one is at fault, the tensor.
#include <concerto/core/file.hpp>
#include <concerto/train/checkpoint.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
namespace ckpt = concerto::train::checkpoint;

namespace {

const std::vector<float> a_values{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
const std::vector<float> b_values{0.5f, 0.25f, -0.125f};

std::string small_file(std::int64_t step = 40) {
  ckpt::writer w;
  w.add("a", {2, 3}, a_values);
  w.add("layers.0.b", {3}, b_values);
  return std::move(w).finish(step);
}

/// The message of the error that parsing `bytes` throws, or "" when it does not throw.
std::string refusal(std::string bytes) {
  try {
    (void)ckpt::parse(std::move(bytes), "model.ckpt");
  } catch (const concerto::error& e) {
    return e.what();
  }
  return "";
}

std::string header_of(const std::string& file) { return file.substr(0, file.find('\n')); }

/// `file` with its index replaced by `index` and the header's size and checksum made to match.
std::string with_index(const std::string& file, const std::string& index) {
  const auto eol = file.find('\n');
  const auto old_size = std::stoul(header_of(file).substr(std::string(ckpt::magic).size() + 3));
  const auto payload = file.substr(eol + 1 + old_size);
  return std::string(ckpt::magic) + " " + std::to_string(ckpt::format_version) + " " + std::to_string(index.size()) +
         " " + hasher::to_hex(hash_bytes(index)) + "\n" + index + payload;
}

std::string index_of(const std::string& file) {
  const auto eol = file.find('\n');
  const auto size = std::stoul(header_of(file).substr(std::string(ckpt::magic).size() + 3));
  return file.substr(eol + 1, size);
}

} // namespace

TEST_CASE("a checkpoint reads back its step, shapes and values", "[checkpoint]") {
  const auto c = ckpt::parse(small_file(), "model.ckpt");
  CHECK(c.step == 40);
  REQUIRE(c.tensors.size() == 2);
  CHECK(c.tensors.at("a").shape == std::vector<std::int64_t>{2, 3});
  CHECK(c.tensors.at("layers.0.b").shape == std::vector<std::int64_t>{3});
  CHECK(c.values("a") == a_values);
  CHECK(c.values("layers.0.b") == b_values);
  CHECK_THAT(header_of(small_file()), ContainsSubstring("concerto-checkpoint 2 "));
}

TEST_CASE("a checkpoint through a file on disk", "[checkpoint]") {
  const auto dir = std::filesystem::temp_directory_path() / ("concerto-ckpt-test-" + std::to_string(::getpid()));
  const auto file = dir / "model.ckpt";
  write_file_atomically(file, small_file(7));
  CHECK(ckpt::read(file).values("a") == a_values);
  CHECK(ckpt::read(file).step == 7);
  CHECK_THROWS_WITH(ckpt::read(dir / "missing.ckpt"), ContainsSubstring("missing.ckpt' cannot be opened"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a writer refuses values that do not fill the shape", "[checkpoint]") {
  ckpt::writer w;
  CHECK_THROWS_WITH(w.add("w", {2, 2}, a_values), ContainsSubstring("tensor 'w' has 6 values for its shape's 4"));
}

TEST_CASE("any single flipped byte of a checkpoint is refused with the file's name", "[checkpoint][corrupt]") {
  const auto file = small_file();
  for (std::size_t at = 0; at < file.size(); ++at) {
    for (const unsigned char flip : {0x01, 0x80}) {
      auto damaged = file;
      damaged[at] = static_cast<char>(static_cast<unsigned char>(damaged[at]) ^ flip);
      CAPTURE(at, flip);
      CHECK_THAT(refusal(damaged), ContainsSubstring("checkpoint 'model.ckpt': "));
    }
  }
}

TEST_CASE("damage in a tensor's bytes names the tensor", "[checkpoint][corrupt]") {
  const auto file = small_file();
  const auto payload_at = file.size() - (a_values.size() + b_values.size()) * sizeof(float);
  SECTION("a NaN written over a value") {
    auto damaged = file;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(damaged.data() + payload_at + a_values.size() * sizeof(float) + 4, &nan, sizeof nan);
    CHECK_THAT(refusal(damaged), ContainsSubstring("tensor 'layers.0.b' fails its checksum"));
  }
  SECTION("a flipped exponent byte") {
    auto damaged = file;
    damaged[payload_at + 3] = static_cast<char>(damaged[payload_at + 3] ^ 0x40); // the top byte of a[0]
    CHECK_THAT(refusal(damaged), ContainsSubstring("tensor 'a' fails its checksum: its bytes hash to "));
  }
  SECTION("a tensor saved with a value that is not finite") {
    ckpt::writer w;
    w.add("w", {2}, std::vector<float>{1.0f, std::numeric_limits<float>::infinity()});
    CHECK_THAT(refusal(std::move(w).finish(1)), ContainsSubstring("tensor 'w' holds a value that is not finite (inf) at element 1"));
  }
}

TEST_CASE("damage in the index is refused", "[checkpoint][corrupt]") {
  const auto file = small_file();
  auto index = index_of(file);
  SECTION("an edited offset, checksum not updated") {
    auto edited = file;
    const auto at = edited.find("\"offset\":24");
    REQUIRE(at != std::string::npos);
    edited.replace(at, 11, "\"offset\":20");
    CHECK_THAT(refusal(edited), ContainsSubstring("the index fails its checksum: it hashes to "));
  }
  SECTION("an edited offset, checksum updated: the tensor's own checksum refuses it") {
    index.replace(index.find("\"offset\":24"), 11, "\"offset\":20");
    CHECK_THAT(refusal(with_index(file, index)), ContainsSubstring("tensor 'layers.0.b' fails its checksum"));
  }
  SECTION("an offset past the payload") {
    index.replace(index.find("\"offset\":24"), 11, "\"offset\":99");
    CHECK_THAT(refusal(with_index(file, index)), ContainsSubstring("tensor 'layers.0.b' lies outside the payload"));
  }
  SECTION("a shape too large for the file") {
    index.replace(index.find("[2,3]"), 5, "[4611686018427387904,4]");
    CHECK_THAT(refusal(with_index(file, index)), ContainsSubstring("tensor 'a' has a shape [4611686018427387904,4] larger than the file"));
  }
  SECTION("an index that is not JSON") {
    CHECK_THAT(refusal(with_index(file, index.substr(0, index.size() - 1))), ContainsSubstring("the index is not JSON"));
  }
  SECTION("an index without its fields") {
    CHECK_THAT(refusal(with_index(file, "{\"step\":1}")), ContainsSubstring("the index lacks 'step', 'payload_bytes' or 'tensors'"));
  }
  SECTION("a tensor listed twice") {
    const auto first = index.find("{\"checksum\"");
    const auto second = index.find("{\"checksum\"", first + 1);
    REQUIRE(second != std::string::npos);
    const auto a_entry = index.substr(first, second - first - 1);
    index.insert(second, a_entry + ",");
    CHECK_THAT(refusal(with_index(file, index)), ContainsSubstring("tensor 'a' appears twice in the index"));
  }
}

TEST_CASE("a truncated or misheaded checkpoint is refused by name, never with an allocation failure", "[checkpoint][corrupt]") {
  const auto file = small_file();
  for (std::size_t length = 0; length < file.size(); ++length) {
    CAPTURE(length);
    CHECK_THAT(refusal(file.substr(0, length)), ContainsSubstring("checkpoint 'model.ckpt': "));
  }
  CHECK_THAT(refusal(file.substr(0, file.size() - 1)), ContainsSubstring("truncated: the index promises 36 payload bytes, the file holds 35"));
  CHECK_THAT(refusal(file + "x"), ContainsSubstring("size mismatch: the index promises 36 payload bytes, the file holds 37"));
  CHECK_THAT(refusal("PK\x03\x04 a zip file"), ContainsSubstring("not a concerto checkpoint"));
  CHECK_THAT(refusal("concerto-checkpoint 1 12\n{\"step\": 1}"), ContainsSubstring("format version 1; this library reads version 2 (version 1 has no checksums)"));
  CHECK_THAT(refusal("concerto-checkpoint 2 99999999999999999999999 0123456789abcdef\n{}"), ContainsSubstring("header garbage"));
  CHECK_THAT(refusal("concerto-checkpoint 2 999999999999 0123456789abcdef\n{}"),
             ContainsSubstring("truncated: the header promises an index of 999999999999 bytes"));
  CHECK_THAT(refusal(std::string(200, 'x')), ContainsSubstring("no header line in the first 128 bytes"));
}
