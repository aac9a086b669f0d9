// The safetensors format (train/safetensors.hpp): f32 and bf16 round-trip; bf16 rounds to nearest
// even and f16 widens exactly; the bytes follow the format (size, JSON header, 8-byte aligned
// data); a damaged or foreign file is refused naming the file and the tensor.
#include <concerto/train/safetensors.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
namespace st = concerto::train::safetensors;

namespace {

std::string small_file(st::dtype second = st::dtype::bf16) {
  st::writer w;
  const std::vector<float> a{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f}, b{0.5f, 0.25f, -0.125f};
  w.add("layers.0.w", {2, 3}, a);
  w.add("b", {3}, b, second);
  return std::move(w).finish({{"format", "pt"}});
}

// The file with its JSON header replaced (the size rewritten to match).
std::string with_header(const std::string& file, const std::string& header) {
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  std::string out(8, '\0');
  const std::uint64_t m = header.size();
  std::memcpy(out.data(), &m, 8);
  return out + header + file.substr(8 + n);
}

std::string header_of(const std::string& file) {
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  return file.substr(8, n);
}

} // namespace

TEST_CASE("f32 and bf16 tensors read back; the bytes follow the format") {
  const auto file = small_file();
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  CHECK(n % 8 == 0); // the data starts aligned
  CHECK(file.size() == 8 + n + 6 * 4 + 3 * 2);
  const auto json = nlohmann::json::parse(header_of(file));
  CHECK(json["layers.0.w"]["dtype"] == "F32");
  CHECK(json["layers.0.w"]["shape"] == nlohmann::json::array({2, 3}));
  CHECK(json["layers.0.w"]["data_offsets"] == nlohmann::json::array({0, 24}));
  CHECK(json["b"]["dtype"] == "BF16");
  CHECK(json["b"]["data_offsets"] == nlohmann::json::array({24, 30}));
  CHECK(json["__metadata__"]["format"] == "pt");

  const auto c = st::parse(file, "m.safetensors");
  CHECK(c.metadata.at("format") == "pt");
  CHECK(c.tensors.at("layers.0.w").shape == std::vector<std::int64_t>{2, 3});
  CHECK(c.values("layers.0.w") == std::vector<float>{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f});
  CHECK(c.values("b") == std::vector<float>{0.5f, 0.25f, -0.125f}); // exact in bf16
  CHECK_THROWS_WITH(c.values("c"), ContainsSubstring("m.safetensors") && ContainsSubstring("no tensor 'c'"));
}

TEST_CASE("bf16 rounds to nearest even; f16 widens exactly") {
  CHECK(st::to_bf16(1.0f) == 0x3f80);
  CHECK(st::to_bf16(std::bit_cast<float>(0x3f808000u)) == 0x3f80); // a tie: to the even 0x3f80
  CHECK(st::to_bf16(std::bit_cast<float>(0x3f818000u)) == 0x3f82); // a tie: to the even 0x3f82
  CHECK(st::to_bf16(std::bit_cast<float>(0x3f808001u)) == 0x3f81); // above the tie
  CHECK(std::isnan(st::from_bf16(st::to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(st::from_bf16(st::to_bf16(std::numeric_limits<float>::infinity())) == std::numeric_limits<float>::infinity());
  CHECK(st::to_bf16(std::numeric_limits<float>::max()) == 0x7f80); // past bf16's largest: rounds to infinity
  for (float x : {0.1f, -1.7f, 123456.0f, 1e-30f}) // within half a bf16 step (2^-8 relative)
    CHECK(std::abs(st::from_bf16(st::to_bf16(x)) - x) <= std::abs(x) * 0x1p-8f);
  CHECK(st::from_f16(0x3c00) == 1.0f);
  CHECK(st::from_f16(0xc000) == -2.0f);
  CHECK(st::from_f16(0x7bff) == 65504.0f);
  CHECK(st::from_f16(0x0001) == 0x1p-24f); // the smallest subnormal
  CHECK(st::from_f16(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(st::from_f16(0x7e00)));
}

TEST_CASE("f16 rounds to nearest even, saturates to infinity past 65504, keeps subnormals; files hold it") {
  CHECK(st::to_f16(1.0f) == 0x3c00);
  CHECK(st::to_f16(-2.0f) == 0xc000);
  CHECK(st::to_f16(1.0f + 0x1p-11f) == 0x3c00);              // a tie: to the even 0x3c00
  CHECK(st::to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);          // a tie: to the even 0x3c02
  CHECK(st::to_f16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);   // above the tie
  CHECK(st::to_f16(65504.0f) == 0x7bff);
  CHECK(st::to_f16(65519.0f) == 0x7bff);                     // below the halfway point to 65536
  CHECK(st::to_f16(65520.0f) == 0x7c00);                     // the halfway point rounds to infinity
  CHECK(st::to_f16(-1e6f) == 0xfc00);
  CHECK(st::to_f16(0x1p-24f) == 0x0001);                     // the smallest subnormal
  CHECK(st::to_f16(0x1p-25f) == 0x0000);                     // half of it: a tie, to the even zero
  CHECK(st::to_f16(0x1.8p-25f) == 0x0001);                   // above the tie
  CHECK(st::to_f16(3 * 0x1p-25f) == 0x0002);                 // 1.5 units: a tie, to the even 2
  CHECK(st::to_f16(0x1.ffcp-15f) == 0x0400);                 // rounds up into the smallest normal
  CHECK(std::isnan(st::from_f16(st::to_f16(std::numeric_limits<float>::quiet_NaN()))));
  int changed = 0; // every finite f16 survives the round trip
  for (std::uint32_t h = 0; h < 0x10000; ++h)
    changed += (h & 0x7c00u) != 0x7c00u && st::to_f16(st::from_f16(static_cast<std::uint16_t>(h))) != h;
  CHECK(changed == 0);
  st::writer w;
  w.add("h", {3}, std::vector<float>{0.1f, -70000.0f, 3.0f}, st::dtype::f16);
  const auto c = st::parse(std::move(w).finish(), "h.safetensors");
  const auto v = c.values("h");
  CHECK(v[0] == st::from_f16(st::to_f16(0.1f)));
  CHECK(v[1] == -std::numeric_limits<float>::infinity());
  CHECK(v[2] == 3.0f);
}

TEST_CASE("a damaged or foreign file is refused naming the file and the tensor") {
  const auto file = small_file();
  const auto refuse = [](const std::string& bytes, const std::string& what) {
    CHECK_THROWS_WITH(st::parse(bytes, "m.safetensors"), ContainsSubstring("m.safetensors") && ContainsSubstring(what));
  };
  refuse(file.substr(0, 5), "shorter than the 8-byte header size");
  refuse(file.substr(0, 20), "the file has 12 after the size");
  refuse(file.substr(0, file.size() - 2), "lie outside the 28 bytes of data");
  refuse(file + "xx", "the tensors end at byte 30 of the data but it has 32");
  refuse(with_header(file, "{not json"), "the header is not JSON");
  refuse(with_header(file, "[1, 2]"), "not a JSON object");
  auto h = nlohmann::json::parse(header_of(file));
  h["b"]["dtype"] = "I64";
  refuse(with_header(file, h.dump()), "tensor 'b': dtype 'I64' is not one concerto reads");
  h = nlohmann::json::parse(header_of(file));
  h["b"]["shape"] = {4};
  refuse(with_header(file, h.dump()), "tensor 'b': data_offsets hold 6 bytes, but shape [4] of BF16 needs 8");
  h = nlohmann::json::parse(header_of(file));
  h["b"]["data_offsets"] = {20, 26};
  refuse(with_header(file, h.dump()), "tensor 'b' starts at byte 20 of the data, where 24 is still another tensor's");
  h = nlohmann::json::parse(header_of(file));
  h["b"]["shape"] = {-1};
  refuse(with_header(file, h.dump()), "holds something other than sizes");
  h = nlohmann::json::parse(header_of(file));
  h.erase("b");
  refuse(with_header(file, h.dump()), "the tensors end at byte 24 of the data but it has 30");
  CHECK_THROWS_WITH(st::read("/nonexistent/m.safetensors"), ContainsSubstring("cannot open"));
  st::writer w;
  CHECK_THROWS_WITH(w.add("x", {2, 2}, std::vector<float>{1, 2, 3}), ContainsSubstring("shape of 4 values but 3"));
}
