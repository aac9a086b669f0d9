#pragma once
/// @file
/// @brief Where the CPU calibration is cached, and how the cache file is read and written.
///
/// One file per machine: <cache dir>/cost-cpu-<hostname>.json, where the cache dir is
/// $CONCERTO_CACHE_DIR, else $XDG_CACHE_HOME/concerto, else ~/.cache/concerto. The file
/// holds a format tag, a version, the hardware, and a checksum (the hardware's hash), so a
/// truncated, edited or old file is recognised and never trusted. It is written to a temp
/// file in the same folder and renamed over the old one, so that a reader (another rank,
/// another test) sees either the old file or the new one, never half of one.
///
/// @code
/// auto file = cost::cpu_cache_file();
/// if (auto hw = cost::load_cpu_cache(file)) use(*hw);
/// @endcode

#include <concerto/core/file.hpp>
#include <concerto/cost/hardware.hpp>

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <system_error>

namespace concerto::cost {

/// Bump when the meaning of a field changes: older files are then re-measured.
inline constexpr int cpu_cache_version = 1;
inline constexpr std::string_view cpu_cache_format = "concerto cost-cpu calibration";

using concerto::host_name;

/// @brief The folder concerto caches into: $CONCERTO_CACHE_DIR, else $XDG_CACHE_HOME/concerto,
/// else $HOME/.cache/concerto, else <temp dir>/concerto-cache.
[[nodiscard]] inline std::filesystem::path cache_dir() {
  const auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
  };
  if (auto d = env("CONCERTO_CACHE_DIR"); !d.empty()) return d;
  if (auto d = env("XDG_CACHE_HOME"); !d.empty()) return std::filesystem::path(d) / "concerto";
  if (auto d = env("HOME"); !d.empty()) return std::filesystem::path(d) / ".cache" / "concerto";
  return std::filesystem::temp_directory_path() / "concerto-cache";
}

/// @brief The calibration file of this machine.
[[nodiscard]] inline std::filesystem::path cpu_cache_file() {
  return cache_dir() / ("cost-cpu-" + host_name() + ".json");
}

/// @brief Why a cache file was not used (empty `problem`: it was).
struct cache_read {
  std::optional<hardware> hw;
  bool existed = false;
  std::string problem; ///< for a file that exists but cannot be trusted
};

/// @brief Reads a calibration file without reporting anything.
[[nodiscard]] inline cache_read read_cpu_cache(const std::filesystem::path& file) {
  cache_read out;
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return out;
  out.existed = true;
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    out.problem = "cannot be read";
    return out;
  }
  const auto j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    out.problem = "is not valid JSON (truncated or corrupted)";
    return out;
  }
  if (j.value("format", std::string()) != cpu_cache_format) {
    out.problem = "is not a concerto CPU calibration (field 'format')";
    return out;
  }
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != cpu_cache_version) {
    out.problem = "has version " + (j.contains("version") ? j["version"].dump() : std::string("(none)")) +
                  ", this library reads version " + std::to_string(cpu_cache_version);
    return out;
  }
  hardware hw;
  try {
    hw = j.at("hardware").get<hardware>();
  } catch (const std::exception& e) { // concerto::error from our from_json, or a missing key
    out.problem = std::string("holds no valid hardware: ") + e.what();
    return out;
  }
  if (!j.contains("checksum") || !j["checksum"].is_string() ||
      j["checksum"].get<std::string>() != hasher::to_hex(hw.hash())) {
    out.problem = "fails its checksum (edited or corrupted)";
    return out;
  }
  out.hw = std::move(hw);
  return out;
}

/// @brief Reads a calibration file; a file that exists but cannot be trusted is reported on
/// stderr (naming the file and the problem) and gives nullopt, like a missing one.
[[nodiscard]] inline std::optional<hardware> load_cpu_cache(const std::filesystem::path& file) {
  auto r = read_cpu_cache(file);
  if (!r.problem.empty())
    std::cerr << "concerto: ignoring CPU calibration cache " << file << ": it " << r.problem << '\n';
  return std::move(r.hw);
}

/// @brief Writes a calibration file atomically (concerto::write_file_atomically), creating the folder.
/// Throws concerto::error naming the file when it cannot be written.
inline void save_cpu_cache(const std::filesystem::path& file, const hardware& hw) {
  hw.validate();
  const nlohmann::json j{{"format", cpu_cache_format},
                         {"version", cpu_cache_version},
                         {"host", host_name()},
                         {"checksum", hasher::to_hex(hw.hash())},
                         {"hardware", hw}};
  write_file_atomically(file, j.dump(2) + "\n");
}

} // namespace concerto::cost
