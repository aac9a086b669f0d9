#pragma once
/// @file
/// @brief The checkpoint file: global f32 tensors and a step count, checked when read.
///
/// A checkpoint is one header line, a JSON index and the raw values:
///
///     concerto-checkpoint <format version> <index bytes> <index checksum hex>\n
///     {"step": 40, "payload_bytes": N,
///      "tensors": [{"name": "wte", "shape": [32, 16], "offset": 0, "checksum": "<hex>"}, ...],
///      "trainer": {...}, "loss_scaling": {"scale": 32768, "good_steps": 17}}
///
/// `trainer` (optional) is the trainer's own state, kept with the model so that a resumed run
/// continues exactly: the examples keep their data loader's position there. `loss_scaling`
/// (optional) is the fp16 loss scaler's (train/loss_scaling.hpp).
///     <payload: each tensor's little-endian f32 values, at its offset>
///
/// Checksums are FNV-1a (core/hash.hpp) over the index bytes and over each tensor's bytes: they
/// find a torn, truncated or edited file, not tampering. Reading checks everything before a value
/// is used (header, sizes, index checksum, index fields, every tensor's bounds, checksum and
/// finiteness) and throws concerto::error naming the file and what is wrong: the tensor, where
/// one is at fault. The step object (train/step.hpp) gathers, scatters and writes atomically;
/// this header only knows the bytes.
///
/// @code
/// train::checkpoint::writer w;
/// w.add("wte", {32, 16}, values);
/// concerto::write_file_atomically("model.ckpt", std::move(w).finish(/*step=*/40));
/// const auto c = train::checkpoint::read("model.ckpt"); // throws on any damage
/// const auto wte = c.values("wte");
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>

#include <nlohmann/json.hpp>

#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace concerto::train::checkpoint {

static_assert(std::endian::native == std::endian::little, "checkpoints store little-endian f32 as the host's bytes");

/// @brief The file format this library writes and reads. Version 1 (no checksums) is refused.
inline constexpr int format_version = 2;
inline constexpr std::string_view magic = "concerto-checkpoint";

/// @brief Collects tensors in order and produces the file's bytes.
class writer {
public:
  /// Appends one tensor; `values` must hold the product of `shape` floats.
  void add(const std::string& name, const std::vector<std::int64_t>& shape, std::span<const float> values) {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    if (n != static_cast<std::int64_t>(values.size()))
      fail("checkpoint: tensor '" + name + "' has " + std::to_string(values.size()) + " values for its shape's " +
           std::to_string(n));
    const std::string_view bytes(reinterpret_cast<const char*>(values.data()), values.size_bytes());
    tensors_.push_back({{"name", name},
                        {"shape", shape},
                        {"offset", payload_.size()},
                        {"checksum", hasher::to_hex(hash_bytes(bytes))}});
    payload_ += bytes;
  }

  /// The whole file: header, index and payload.
  /// `trainer`: the trainer's own state (a JSON object), or null for none; `loss_scaling`: the
  /// loss scaler's state (train::loss_scaler::state), or null.
  [[nodiscard]] std::string finish(std::int64_t step, nlohmann::json trainer = nullptr, nlohmann::json loss_scaling = nullptr) && {
    if (!trainer.is_null() && !trainer.is_object()) fail("checkpoint: the trainer's state must be a JSON object");
    nlohmann::json fields{{"step", step}, {"payload_bytes", payload_.size()}, {"tensors", std::move(tensors_)}};
    if (!trainer.is_null()) fields["trainer"] = std::move(trainer);
    if (!loss_scaling.is_null()) fields["loss_scaling"] = std::move(loss_scaling);
    const auto index = fields.dump();
    std::string out(magic);
    out += ' ';
    out += std::to_string(format_version);
    out += ' ';
    out += std::to_string(index.size());
    out += ' ';
    out += hasher::to_hex(hash_bytes(index));
    out += '\n';
    out += index;
    out += payload_;
    return out;
  }

private:
  nlohmann::json tensors_ = nlohmann::json::array();
  std::string payload_;
};

/// @brief Where a tensor's values lie in the file.
struct entry {
  std::vector<std::int64_t> shape;
  std::size_t offset = 0; ///< in the payload
  std::size_t bytes = 0;
};

/// @brief A checked checkpoint in memory.
class contents {
public:
  explicit contents(std::string payload = {}) : payload_(std::move(payload)) {}

  std::int64_t step = 0;
  std::map<std::string, entry> tensors;
  nlohmann::json trainer; ///< the trainer's own state (writer::finish), null when none was saved
  nlohmann::json loss_scaling; ///< the loss scaler's state (writer::finish), null when none was saved

  /// The raw bytes of a tensor (unaligned: copy before reading as floats).
  [[nodiscard]] std::span<const std::byte> bytes(const std::string& name) const {
    const auto& e = tensors.at(name);
    return std::as_bytes(std::span(payload_.data() + e.offset, e.bytes));
  }
  /// A tensor's values.
  [[nodiscard]] std::vector<float> values(const std::string& name) const {
    const auto b = bytes(name);
    std::vector<float> v(b.size() / sizeof(float));
    std::memcpy(v.data(), b.data(), b.size());
    return v;
  }

private:
  std::string payload_;
};

namespace detail {

inline std::vector<std::string_view> fields_of(std::string_view line) {
  std::vector<std::string_view> out;
  for (std::size_t at = 0; at <= line.size();) {
    const auto space = std::min(line.find(' ', at), line.size());
    out.push_back(line.substr(at, space - at));
    at = space + 1;
  }
  return out;
}

template <class T>
bool parse_number(std::string_view s, T& out) {
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

/// One tensor's index record, checked against the payload.
inline entry check_tensor(const nlohmann::json& t, std::string_view payload, std::size_t position,
                          const std::string& where) {
  const auto name = t.contains("name") && t["name"].is_string() ? t["name"].get<std::string>() : std::string();
  const auto bad = [&](const std::string& why) {
    fail(where + ": " + (name.empty() ? "index entry " + std::to_string(position) : "tensor '" + name + "'") + " " + why);
  };
  if (name.empty()) bad("has no name");
  if (!t.contains("shape") || !t["shape"].is_array()) bad("has no shape");
  if (!t.contains("offset") || !t["offset"].is_number_unsigned()) bad("has no offset");
  if (!t.contains("checksum") || !t["checksum"].is_string()) bad("has no checksum");
  entry e;
  std::uint64_t count = 1;
  for (const auto& d : t["shape"]) {
    if (!d.is_number_integer() || d.get<std::int64_t>() < 0) bad("has a shape that is not a list of sizes");
    const auto size = d.get<std::uint64_t>();
    if (size != 0 && count > payload.size() / size) bad("has a shape " + t["shape"].dump() + " larger than the file");
    count *= size;
    e.shape.push_back(d.get<std::int64_t>());
  }
  e.offset = t["offset"].get<std::size_t>();
  e.bytes = static_cast<std::size_t>(count) * sizeof(float);
  if (e.offset > payload.size() || e.bytes > payload.size() - e.offset)
    bad("lies outside the payload (bytes " + std::to_string(e.offset) + " to " + std::to_string(e.offset + e.bytes) +
        " of " + std::to_string(payload.size()) + ")");
  const auto bytes = payload.substr(e.offset, e.bytes);
  if (const auto sum = hasher::to_hex(hash_bytes(bytes)); sum != t["checksum"].get<std::string>())
    bad("fails its checksum: its bytes hash to " + sum + ", the index says " + t["checksum"].get<std::string>());
  for (std::size_t i = 0; i < count; ++i) {
    float v;
    std::memcpy(&v, bytes.data() + i * sizeof(float), sizeof v);
    if (!std::isfinite(v)) bad("holds a value that is not finite (" + std::to_string(v) + ") at element " + std::to_string(i));
  }
  return e;
}

} // namespace detail

/// @brief Checks a whole checkpoint file's bytes; `source` names it in messages.
[[nodiscard]] inline contents parse(std::string file, const std::string& source) {
  const auto where = "checkpoint '" + source + "'";
  const auto bad = [&](const std::string& why) { fail(where + ": " + why); };
  const std::string_view all(file);
  // A header is well under 128 bytes; a longer first line is not one.
  const auto eol = all.substr(0, 128).find('\n');
  if (eol == std::string_view::npos) bad("not a concerto checkpoint (no header line in the first 128 bytes)");
  const auto header = all.substr(0, eol);
  const auto fields = detail::fields_of(header);
  const auto shown = " (header '" + std::string(header) + "')";
  if (fields[0] != magic) bad("not a concerto checkpoint" + shown);
  int version = 0;
  if (fields.size() < 2 || !detail::parse_number(fields[1], version)) bad("header garbage: no format version" + shown);
  if (version != format_version)
    bad("format version " + std::to_string(version) + "; this library reads version " + std::to_string(format_version) +
        (version == 1 ? " (version 1 has no checksums)" : ""));
  std::size_t index_bytes = 0;
  if (fields.size() != 4 || !detail::parse_number(fields[2], index_bytes) || fields[3].size() != 16)
    bad("header garbage: expected '" + std::string(magic) + " <version> <index bytes> <index checksum>'" + shown);
  const auto rest = all.substr(eol + 1);
  if (index_bytes > rest.size())
    bad("truncated: the header promises an index of " + std::to_string(index_bytes) + " bytes, the file holds " +
        std::to_string(rest.size()) + " after the header");
  const auto index_text = rest.substr(0, index_bytes);
  if (const auto sum = hasher::to_hex(hash_bytes(index_text)); sum != fields[3])
    bad("the index fails its checksum: it hashes to " + sum + ", the header says " + std::string(fields[3]));
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(index_text);
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("the index is not JSON: ") + e.what());
  }
  if (!index.is_object() || !index.contains("step") || !index["step"].is_number_integer() ||
      !index.contains("payload_bytes") || !index["payload_bytes"].is_number_unsigned() || !index.contains("tensors") ||
      !index["tensors"].is_array())
    bad("the index lacks 'step', 'payload_bytes' or 'tensors'");
  if (index.contains("trainer") && !index["trainer"].is_object()) bad("its trainer state is not a JSON object");
  if (index.contains("loss_scaling") && !index["loss_scaling"].is_object()) bad("its loss scaling state is not a JSON object");
  const auto payload = rest.substr(index_bytes);
  if (const auto promised = index["payload_bytes"].get<std::size_t>(); promised != payload.size())
    bad((payload.size() < promised ? "truncated: the index promises " : "size mismatch: the index promises ") +
        std::to_string(promised) + " payload bytes, the file holds " + std::to_string(payload.size()));
  std::map<std::string, entry> tensors;
  std::size_t position = 0;
  for (const auto& t : index["tensors"]) {
    auto e = detail::check_tensor(t, payload, position++, where);
    const auto name = t["name"].get<std::string>();
    if (!tensors.emplace(name, std::move(e)).second) bad("tensor '" + name + "' appears twice in the index");
  }
  file.erase(0, static_cast<std::size_t>(payload.data() - file.data()));
  contents c(std::move(file));
  c.step = index["step"].get<std::int64_t>();
  c.tensors = std::move(tensors);
  if (index.contains("trainer")) c.trainer = std::move(index["trainer"]);
  if (index.contains("loss_scaling")) c.loss_scaling = std::move(index["loss_scaling"]);
  return c;
}

/// @brief Reads and checks a checkpoint file (see parse).
[[nodiscard]] inline contents read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("checkpoint '" + path.string() + "' cannot be opened");
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail("checkpoint '" + path.string() + "' cannot be read");
  return parse(std::move(file), path.string());
}

} // namespace concerto::train::checkpoint
