#pragma once
/// @file
/// @brief Writing a file so that readers see the old content or the new one, never a torn mix.
///
/// The plan cache and the trace writers share this: several ranks or processes may write the
/// same path at once, and a crash in the middle of a write must not leave a truncated plan that
/// a later run would load.

#include <concerto/core/error.hpp>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream> // kept: includers of this header write streams too
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

namespace concerto {

/// @brief This machine's host name, reduced to characters safe in a file name.
[[nodiscard]] inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown-host";
  std::string out(buf);
  for (auto& c : out)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) c = '_';
  return out;
}

/// @brief Removes the temporary files `<path>.tmp.<pid>-<random>.<host>` that a writer of
/// `path` killed mid-write left behind: those of this host whose process no longer exists.
/// Temporaries of live writers, of other hosts (a shared file system) and names it does not
/// recognise are kept. Best effort: errors are ignored, as the write that follows reports its own.
inline void remove_abandoned_temporaries(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const auto prefix = path.filename().string() + ".tmp.";
  std::string suffix(".");
  suffix += host_name();
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  std::vector<fs::path> abandoned;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (!name.starts_with(prefix) || !name.ends_with(suffix)) continue;
    const auto owner = std::string_view(name).substr(prefix.size());
    const auto dash = owner.find('-');
    if (dash == std::string_view::npos) continue;
    long pid = 0;
    const auto [end_of_pid, bad] = std::from_chars(owner.data(), owner.data() + dash, pid);
    if (bad != std::errc() || end_of_pid != owner.data() + dash || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) abandoned.push_back(it->path());
  }
  for (const auto& p : abandoned) fs::remove(p, ec);
}

/// @brief Writes `content` to `path` through a temporary file in the same directory and a
/// rename, which POSIX makes atomic on one file system. Creates missing parent directories.
/// Throws concerto::error naming the path when anything fails; the temporary file is removed.
/// Temporaries of earlier writers of the same path that were killed mid-write are removed first
/// (remove_abandoned_temporaries).
/// The temporary file is fsynced before the rename and the directory after it, so that after a
/// crash or power loss the path holds the old content or the whole new one, never a prefix.
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
  remove_abandoned_temporaries(path);
  // The pid and host name tell a later writer whether the temp file's owner still lives; the
  // random part keeps two threads of one process from sharing a temp file.
  std::random_device entropy;
  fs::path temp = path;
  temp += ".tmp." + std::to_string(::getpid()) + "-" + std::to_string(entropy()) + std::to_string(entropy()) + "." +
          host_name();
  {
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
      fail("cannot open '" + temp.string() + "' to write '" + path.string() + "': " + std::strerror(errno));
    const auto give_up = [&](std::string_view what) {
      const int saved = errno;
      ::close(fd);
      std::error_code ignored;
      fs::remove(temp, ignored);
      fail("cannot " + std::string(what) + " '" + path.string() + "' (through '" + temp.string() +
           "'): " + std::strerror(saved));
    };
    for (std::size_t done = 0; done < content.size();) {
      const auto n = ::write(fd, content.data() + done, content.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) give_up("write");
      done += static_cast<std::size_t>(n);
    }
    // Without this, the rename can reach the disk before the data: a crash would leave the
    // new name on an empty or partial file.
    if (::fsync(fd) != 0) give_up("flush to disk");
    if (::close(fd) != 0) {
      const int saved = errno;
      std::error_code ignored;
      fs::remove(temp, ignored);
      fail("cannot write '" + path.string() + "' (closing '" + temp.string() + "'): " + std::strerror(saved));
    }
  }
  fs::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    fail("cannot rename '" + temp.string() + "' to '" + path.string() + "': " + ec.message());
  }
  // The rename lives in the directory; syncing it makes the new name durable. Best effort:
  // the content is already complete under the new name, and some file systems refuse fsync
  // on a directory.
  const fs::path dir = parent.empty() ? fs::path(".") : parent;
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

} // namespace concerto
