#pragma once
/// @file
/// @brief Writing a file so that readers see the old content or the new one, never a torn mix.
///
/// The plan cache and the trace writers share this: several ranks or processes may write the
/// same path at once, and a crash in the middle of a write must not leave a truncated plan that
/// a later run would load.

#include <concerto/core/error.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

namespace concerto {

/// @brief Writes `content` to `path` through a temporary file in the same directory and a
/// rename, which POSIX makes atomic on one file system. Creates missing parent directories.
/// Throws concerto::error naming the path when anything fails; the temporary file is removed.
///
/// @code
/// concerto::write_file_atomically("out/step.trace.json", concerto::trace::chrome_trace(g, r));
/// @endcode
inline void write_file_atomically(const std::filesystem::path& path, std::string_view content) {
  namespace fs = std::filesystem;
  if (path.empty() || !path.has_filename()) fail("write_file_atomically: '" + path.string() + "' names no file");
  std::error_code ec;
  const fs::path parent = path.parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) fail("cannot create directory '" + parent.string() + "' for '" + path.string() + "': " + ec.message());
  }
  // A random suffix (not the pid alone) keeps two threads of one process from sharing a temp file.
  std::random_device entropy;
  const auto suffix = std::to_string(entropy()) + std::to_string(entropy());
  fs::path temp = path;
  temp += ".tmp." + suffix;
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot open '" + temp.string() + "' to write '" + path.string() + "'");
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    if (!out) {
      out.close();
      fs::remove(temp, ec);
      fail("cannot write '" + path.string() + "' (through '" + temp.string() + "')");
    }
  }
  fs::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    fail("cannot rename '" + temp.string() + "' to '" + path.string() + "': " + ec.message());
  }
}

} // namespace concerto
