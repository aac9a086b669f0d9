#pragma once
/// @file
/// @brief The safetensors format (Hugging Face's): parameters that PyTorch, JAX and Hugging Face
/// code load, and that concerto loads from them, in fp32, bf16 or fp16.
///
/// A file is
///
///     8 bytes     N, the header's size, a little-endian uint64
///     N bytes     a JSON object: per tensor {"dtype": "F32" | "BF16", "shape": [...],
///                 "data_offsets": [begin, end]}, and an optional "__metadata__" of strings;
///                 padded with spaces so that the data starts 8-byte aligned
///     the data    each tensor's little-endian values, row-major, at [begin, end) of this part
///
/// Reading checks everything before a value is used, as the format's own implementation does:
/// the header's size against the file, the JSON, each entry's dtype (F32, BF16 and F16 are read;
/// others are refused by name), shape, and that its offsets hold exactly its values and lie in
/// the data, which the tensors must cover without gaps or overlaps. A failure throws
/// concerto::error naming the file and, where one is at fault, the tensor. bf16 and f16 are
/// written with round-to-nearest-even from f32 (NaN stays NaN; f16 past 65504 is infinite) and
/// widened exactly when read.
///
/// @code
/// train::safetensors::writer w;
/// w.add("wte", {32, 16}, values, train::safetensors::dtype::bf16);
/// concerto::write_file_atomically("model.safetensors", std::move(w).finish({{"format", "pt"}}));
/// const auto file = train::safetensors::read("model.safetensors");
/// const auto wte = file.values("wte"); // as f32
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace concerto::train::safetensors {

static_assert(std::endian::native == std::endian::little, "safetensors holds little-endian values, read as the host's");

/// @brief The element types this reader and writer know.
enum class dtype : std::uint8_t { f32, bf16, f16 };

[[nodiscard]] constexpr std::string_view to_string(dtype t) noexcept {
  return t == dtype::f32 ? "F32" : t == dtype::bf16 ? "BF16" : "F16";
}
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

/// f32 <-> bf16: concerto::to_bf16 and from_bf16 (core/bfloat16.hpp).
using concerto::from_bf16;
using concerto::to_bf16;

/// f32 <-> f16: concerto::to_f16 and from_f16 (core/float16.hpp).
using concerto::from_f16;
using concerto::to_f16;

/// @brief Collects tensors in order and produces the file's bytes.
class writer {
public:
  /// Appends one tensor; `values` holds the product of `shape` floats, stored as `type`.
  void add(const std::string& name, const std::vector<std::int64_t>& shape, std::span<const float> values,
           dtype type = dtype::f32) {
    if (name.empty() || name == "__metadata__") fail("safetensors: '" + name + "' cannot name a tensor");
    std::int64_t n = 1;
    for (const auto d : shape) {
      if (d < 0) fail("safetensors: tensor '" + name + "' has a negative dimension");
      n *= d;
    }
    if (static_cast<std::size_t>(n) != values.size())
      fail("safetensors: tensor '" + name + "' has shape of " + std::to_string(n) + " values but " +
           std::to_string(values.size()) + " were given");
    if (header_.contains(name)) fail("safetensors: tensor '" + name + "' added twice");
    const auto begin = data_.size();
    if (type == dtype::f32) {
      data_.resize(begin + values.size() * 4);
      std::memcpy(data_.data() + begin, values.data(), values.size() * 4);
    } else {
      data_.resize(begin + values.size() * 2);
      for (std::size_t i = 0; i < values.size(); ++i) {
        const auto b = type == dtype::bf16 ? to_bf16(values[i]) : to_f16(values[i]);
        std::memcpy(data_.data() + begin + 2 * i, &b, 2);
      }
    }
    header_[name] = {{"dtype", to_string(type)}, {"shape", shape}, {"data_offsets", {begin, data_.size()}}};
  }

  /// The file's bytes, with `metadata` (string pairs; Hugging Face reads "format": "pt").
  [[nodiscard]] std::string finish(const std::map<std::string, std::string>& metadata = {}) && {
    auto header = header_;
    if (!metadata.empty()) header["__metadata__"] = metadata;
    auto text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    std::string out(8, '\0');
    const auto n = static_cast<std::uint64_t>(text.size());
    std::memcpy(out.data(), &n, 8);
    out += text;
    out += data_;
    return out;
  }

private:
  nlohmann::json header_ = nlohmann::json::object();
  std::string data_;
};

/// @brief One tensor of a read file.
struct entry {
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0; ///< in the data
};

/// @brief A checked file in memory.
class contents {
public:
  std::map<std::string, entry> tensors;
  std::map<std::string, std::string> metadata;

  /// A tensor's values as f32 (bf16 and f16 widened exactly). Throws naming it when absent.
  [[nodiscard]] std::vector<float> values(const std::string& name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end()) fail("safetensors '" + source_ + "': no tensor '" + name + "'");
    const auto& e = it->second;
    const char* at = data_.data() + e.begin;
    std::vector<float> out((e.end - e.begin) / size_of(e.type));
    if (e.type == dtype::f32) {
      std::memcpy(out.data(), at, e.end - e.begin);
      return out;
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t h;
      std::memcpy(&h, at + 2 * i, 2);
      out[i] = e.type == dtype::bf16 ? from_bf16(h) : from_f16(h);
    }
    return out;
  }

  contents(std::string source, std::string data) : source_(std::move(source)), data_(std::move(data)) {}

private:
  std::string source_;
  std::string data_;
};

namespace detail {

inline dtype dtype_of(const nlohmann::json& j, const std::string& where) {
  if (!j.is_string()) fail(where + ": dtype is not a string");
  const auto s = j.get<std::string>();
  if (s == "F32") return dtype::f32;
  if (s == "BF16") return dtype::bf16;
  if (s == "F16") return dtype::f16;
  fail(where + ": dtype '" + s + "' is not one concerto reads (F32, BF16, F16); convert the tensor to one of them");
}

// One entry of the header, checked against the data's size.
inline entry entry_of(const nlohmann::json& j, const std::string& where, std::size_t data_bytes) {
  if (!j.is_object() || !j.contains("dtype") || !j.contains("shape") || !j.contains("data_offsets"))
    fail(where + ": an entry needs dtype, shape and data_offsets");
  entry e;
  e.type = dtype_of(j["dtype"], where);
  const auto& shape = j["shape"];
  if (!shape.is_array()) fail(where + ": shape is not a list");
  std::uint64_t n = 1;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned()) fail(where + ": shape " + shape.dump() + " holds something other than sizes");
    e.shape.push_back(d.get<std::int64_t>());
    n *= d.get<std::uint64_t>();
  }
  const auto& off = j["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    fail(where + ": data_offsets is not [begin, end]");
  e.begin = off[0].get<std::size_t>();
  e.end = off[1].get<std::size_t>();
  if (e.begin > e.end || e.end > data_bytes)
    fail(where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") lie outside the " +
         std::to_string(data_bytes) + " bytes of data; the file is truncated or its header is wrong");
  if (e.end - e.begin != n * size_of(e.type))
    fail(where + ": data_offsets hold " + std::to_string(e.end - e.begin) + " bytes, but shape " + shape.dump() + " of " +
         std::string(to_string(e.type)) + " needs " + std::to_string(n * size_of(e.type)));
  return e;
}

} // namespace detail

/// @brief Checks a file's bytes (see the file comment); `source` names it in messages.
[[nodiscard]] inline contents parse(std::string file, const std::string& source) {
  const auto where = "safetensors '" + source + "'";
  if (file.size() < 8) fail(where + ": " + std::to_string(file.size()) + " bytes, shorter than the 8-byte header size");
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  if (n > file.size() - 8)
    fail(where + ": the header is " + std::to_string(n) + " bytes but the file has " + std::to_string(file.size() - 8) +
         " after the size; it is truncated or not a safetensors file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(std::string_view(file).substr(8, n));
  } catch (const nlohmann::json::exception& e) {
    fail(where + ": the header is not JSON (" + e.what() + ")");
  }
  if (!header.is_object()) fail(where + ": the header is not a JSON object");
  const auto data_bytes = file.size() - 8 - n;
  file.erase(0, 8 + n); // the data, kept without a second copy of the file
  contents c(source, std::move(file));
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(where + ": __metadata__ is not an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail(where + ": __metadata__ '" + k + "' is not a string");
        c.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    c.tensors[name] = detail::entry_of(value, where + ": tensor '" + name + "'", data_bytes);
  }
  // The data is covered exactly: sorted by offset, each tensor starts where the last ended.
  std::vector<std::pair<std::size_t, const std::string*>> order;
  for (const auto& [name, e] : c.tensors) order.emplace_back(e.begin, &name);
  std::sort(order.begin(), order.end());
  std::size_t at = 0;
  for (const auto& [begin, name] : order) {
    const auto& e = c.tensors.at(*name);
    if (begin != at)
      fail(where + ": tensor '" + *name + "' starts at byte " + std::to_string(begin) + " of the data, where " +
           std::to_string(at) + (begin < at ? " is still another tensor's (they overlap)" : " would follow (a gap)"));
    at = e.end;
  }
  if (at != data_bytes)
    fail(where + ": the tensors end at byte " + std::to_string(at) + " of the data but it has " + std::to_string(data_bytes) +
         " bytes");
  return c;
}

/// @brief Reads and checks a file; throws concerto::error naming it.
[[nodiscard]] inline contents read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("safetensors '" + path.string() + "': cannot open it");
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parse(std::move(bytes), path.string());
}

} // namespace concerto::train::safetensors
