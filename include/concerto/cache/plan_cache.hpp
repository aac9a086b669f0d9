#pragma once
/// @file
/// @brief The plan cache: a directory of plans keyed by what they were made from.
///
/// A file `<key hex>.plan` is one header line and a payload:
///
///     concerto-plan-cache <format version> <key hex> <payload bytes> <payload checksum hex>\n
///     <binary payload: every key field, the plan's graph hash, the plan (cache/binary.hpp)>
///
/// Version 1 payloads were JSON; version 2 is the library's own binary form, which loads a
/// 4,000-task plan several times faster (docs/plan-cache.md). The checksum is FNV-1a over the payload bytes; it detects a torn or corrupted
/// file, not tampering. Writes go through concerto::write_file_atomically, so readers see a
/// whole old file or a whole new one. A file that fails any check is reported, moved aside to
/// `<key hex>.plan.bad` for inspection and never used: the caller replans. Format and checks:
/// docs/plan-cache.md.

#include <concerto/cache/binary.hpp>
#include <concerto/cache/key.hpp>
#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/plan/verify.hpp>

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace concerto::cache {

/// @brief The file format this library writes and reads.
inline constexpr int format_version = 3;

/// @brief Where plans are cached: `$CONCERTO_CACHE_DIR`, else `$XDG_CACHE_HOME/concerto`,
/// else `$HOME/.cache/concerto`, else `concerto-cache` in the system's temporary directory.
/// Empty variables count as unset; a relative `XDG_CACHE_HOME` is ignored, as the XDG base
/// directory specification asks.
[[nodiscard]] inline std::filesystem::path default_directory() {
  namespace fs = std::filesystem;
  const auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
  };
  if (auto dir = env("CONCERTO_CACHE_DIR"); !dir.empty()) return fs::path(dir);
  if (auto xdg = env("XDG_CACHE_HOME"); !xdg.empty() && fs::path(xdg).is_absolute()) return fs::path(xdg) / "concerto";
  if (auto home = env("HOME"); !home.empty()) return fs::path(home) / ".cache" / "concerto";
  std::error_code ec;
  const auto temp = fs::temp_directory_path(ec);
  return (ec ? fs::path("/tmp") : temp) / "concerto-cache";
}

namespace detail {

inline constexpr std::string_view magic = "concerto-plan-cache";

/// The payload document of a plan stored under `key`.
inline document envelope(const cache_key& key, const plan::plan& p) { return {key, plan::hash(p.graph), p}; }

/// A whole cache file around `payload`, filed under `key_hex`.
inline std::string encode(std::string_view key_hex, std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 96);
  out += magic;
  out += ' ' + std::to_string(format_version) + ' ' + std::string(key_hex) + ' ' + std::to_string(payload.size()) +
         ' ' + hasher::to_hex(hash_bytes(payload)) + '\n';
  out += payload;
  return out;
}

inline std::string encode(std::string_view key_hex, const document& d) { return encode(key_hex, to_binary(d)); }

inline std::string encode(const cache_key& key, const plan::plan& p) { return encode(key.hex(), envelope(key, p)); }

inline bool is_hex16(std::string_view s) {
  return s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

/// What the checks found wrong with a file, or nothing.
struct verdict {
  std::optional<plan::plan> plan;
  std::string problem;
};

/// Every check on a file's bytes, in the order that names the most specific problem first.
inline verdict examine(std::string_view file, const cache_key& key) {
  const auto bad = [](std::string why) { return verdict{std::nullopt, std::move(why)}; };
  // A header is well under 128 bytes; a longer first line is not one.
  const auto eol = file.substr(0, 128).find('\n');
  if (eol == std::string_view::npos) return bad("header garbage: no header line in the first 128 bytes");
  const auto header = file.substr(0, eol);
  std::vector<std::string_view> fields;
  for (std::size_t at = 0; at <= header.size();) {
    const auto space = std::min(header.find(' ', at), header.size());
    fields.push_back(header.substr(at, space - at));
    at = space + 1;
  }
  const auto shown = "'" + std::string(header) + "'";
  if (fields.empty() || fields[0] != magic) return bad("header garbage: not a plan cache file (header " + shown + ")");
  if (fields.size() != 5)
    return bad("header garbage: " + std::to_string(fields.size()) + " fields instead of 5 (header " + shown + ")");
  int version = 0;
  if (auto [p, ec] = std::from_chars(fields[1].data(), fields[1].data() + fields[1].size(), version);
      ec != std::errc() || p != fields[1].data() + fields[1].size())
    return bad("header garbage: format version '" + std::string(fields[1]) + "' is not a number");
  if (version != format_version)
    return bad("unknown format version " + std::to_string(version) + " (this library reads version " +
               std::to_string(format_version) + ")");
  if (!is_hex16(fields[2]) || !is_hex16(fields[4]))
    return bad("header garbage: key or checksum is not 16 hex digits (header " + shown + ")");
  std::uint64_t declared = 0;
  if (auto [p, ec] = std::from_chars(fields[3].data(), fields[3].data() + fields[3].size(), declared);
      ec != std::errc() || p != fields[3].data() + fields[3].size())
    return bad("header garbage: payload size '" + std::string(fields[3]) + "' is not a number");
  if (const auto want = key.hex(); fields[2] != want)
    return bad("key mismatch: the file holds key " + std::string(fields[2]) + ", expected " + want);

  const auto payload = file.substr(eol + 1);
  if (payload.size() < declared)
    return bad("truncated: the header promises " + std::to_string(declared) + " payload bytes, the file holds " +
               std::to_string(payload.size()));
  if (payload.size() > declared)
    return bad("size mismatch: the header promises " + std::to_string(declared) + " payload bytes, the file holds " +
               std::to_string(payload.size()));
  if (const auto sum = hasher::to_hex(hash_bytes(payload)); sum != fields[4])
    return bad("checksum mismatch: the payload hashes to " + sum + ", the header says " + std::string(fields[4]));

  document doc;
  try {
    doc = from_binary(payload);
  } catch (const error& e) {
    return bad(std::string("payload is not a readable plan: ") + e.what());
  }
  // The header key is a 64-bit hash; the fields rule out a collision and name what differs.
  const auto& have = doc.key;
  if (have.graph != key.graph)
    return bad("stale: the plan was made for graph " + hasher::to_hex(have.graph) + ", the key names graph " +
               hasher::to_hex(key.graph));
  const auto differs = [&](const char* field, const std::string& found, const std::string& want) {
    return bad(std::string("key mismatch: key field '") + field + "' is '" + found + "', expected '" + want + "'");
  };
  if (have.mesh != key.mesh) return differs("mesh", hasher::to_hex(have.mesh), hasher::to_hex(key.mesh));
  if (have.cost_model != key.cost_model)
    return differs("cost_model", hasher::to_hex(have.cost_model), hasher::to_hex(key.cost_model));
  if (have.backend != key.backend) return differs("backend", have.backend, key.backend);
  if (have.library_version != key.library_version)
    return differs("library_version", have.library_version, key.library_version);
  if (have.policy != key.policy) return differs("policy", have.policy, key.policy);
  if (have.options != key.options) return differs("options", hasher::to_hex(have.options), hasher::to_hex(key.options));

  auto& p = doc.plan;
  // A planner may add dependency edges or split tasks, so the plan's graph need not hash to
  // key.graph; what it must hash to is the value recorded when it was stored.
  if (const auto h = plan::hash(p.graph); h != doc.plan_graph)
    return bad("stale: the plan's graph hashes to " + hasher::to_hex(h) + ", the file recorded " +
               hasher::to_hex(doc.plan_graph) + " (written by a library that hashes graphs differently, or edited)");
  try {
    plan::verify(p);
  } catch (const error& e) {
    return bad(std::string("the plan fails verification: ") + e.what());
  }
  return {std::move(p), {}};
}

} // namespace detail

/// @brief A directory of cached plans. Loading never trusts a file that fails a check; storing
/// is atomic, so concurrent ranks or processes may share the directory.
/// @code
/// cache::plan_cache cache;                         // cache::default_directory()
/// auto key = cache::make_key(graph, model, "nccl", "concerto");
/// bool hit = false;
/// plan::plan p = cache.get_or_plan(key, [&] { return planner::make_plan(graph, model); }, &hit);
/// @endcode
class plan_cache {
public:
  /// @brief A cache in `dir`; nothing is created until the first store.
  explicit plan_cache(std::filesystem::path dir = default_directory()) : dir_(std::move(dir)) {}

  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }

  /// @brief The file that holds the plan of `key`.
  [[nodiscard]] std::filesystem::path path_of(const cache_key& key) const { return dir_ / (key.hex() + ".plan"); }

  /// @brief Stops (or restarts) the reports of rejected files and failed writes on stderr.
  plan_cache& silence(bool on = true) noexcept {
    quiet_ = on;
    return *this;
  }

  /// @brief The cached plan of `key`, or nullopt. A missing file is a plain miss; a file that
  /// fails a check (header, version, key, size, checksum, payload, verification, stale graph) is
  /// reported on stderr unless silenced, moved aside to `<file>.bad` and not used. `why_not`
  /// receives the reason for a nullopt, naming the file.
  [[nodiscard]] std::optional<plan::plan> load(const cache_key& key, std::string* why_not = nullptr) const {
    namespace fs = std::filesystem;
    const auto path = path_of(key);
    const auto say = [&](const std::string& why) {
      if (why_not) *why_not = why;
    };
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      say("plan cache: no plan for key " + key.hex() + " ('" + path.string() + "')");
      return std::nullopt;
    }
    std::string bytes;
    std::string problem;
    if (!read_all(path, bytes)) {
      problem = "cannot read the file";
    } else {
      auto v = detail::examine(bytes, key);
      if (v.plan) return std::move(v.plan);
      problem = std::move(v.problem);
    }
    auto why = "plan cache: '" + path.string() + "': " + problem + "; " + set_aside(path);
    if (!quiet_) std::cerr << "concerto: " << why << '\n';
    say(why);
    return std::nullopt;
  }

  /// @brief Writes `p` as the plan of `key`, atomically. Throws concerto::error naming the file
  /// when it cannot be written, or the plan when it fails plan::verify (an unsound plan would
  /// be rejected by every load).
  void store(const cache_key& key, const plan::plan& p) const {
    const auto path = path_of(key);
    try {
      plan::verify(p);
    } catch (const error& e) {
      fail("plan cache: refusing to store an invalid plan as '" + path.string() + "': " + e.what());
    }
    std::string content;
    try {
      content = detail::encode(key, p);
    } catch (const error& e) {
      fail("plan cache: cannot encode the plan for '" + path.string() + "': " + e.what());
    }
    write_file_atomically(path, content);
  }

  /// @brief The cached plan of `key`, or `make_plan()`'s result, which is then stored. A failed
  /// store is reported (unless silenced) and the fresh plan returned anyway: a read-only cache
  /// must not stop training. `hit` says whether the cache answered.
  template <class F>
  plan::plan get_or_plan(const cache_key& key, F&& make_plan, bool* hit = nullptr) const {
    if (auto cached = load(key)) {
      if (hit) *hit = true;
      return std::move(*cached);
    }
    if (hit) *hit = false;
    plan::plan fresh = std::forward<F>(make_plan)();
    try {
      store(key, fresh);
    } catch (const error& e) {
      if (!quiet_) std::cerr << e.what() << " (the plan is used without caching it)\n";
    }
    return fresh;
  }

private:
  static bool read_all(const std::filesystem::path& path, std::string& out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return false;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) return false;
    out.resize(static_cast<std::size_t>(size));
    in.read(out.data(), static_cast<std::streamsize>(size));
    out.resize(static_cast<std::size_t>(in.gcount())); // a concurrent truncation shows as a short read
    return !in.bad();
  }

  /// Moves a rejected file out of the way (kept for inspection), or removes it.
  static std::string set_aside(const std::filesystem::path& path) {
    std::error_code ec;
    auto aside = path;
    aside += ".bad";
    std::filesystem::remove_all(aside, ec);
    std::filesystem::rename(path, aside, ec);
    if (!ec) return "moved aside to '" + aside.string() + "'; replanning";
    std::filesystem::remove_all(path, ec);
    return ec ? "could not remove it (" + ec.message() + "); replanning" : "removed it; replanning";
  }

  std::filesystem::path dir_;
  bool quiet_ = false;
};

} // namespace concerto::cache
