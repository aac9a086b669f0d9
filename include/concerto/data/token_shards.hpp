#pragma once
/// @file
/// @brief Tokenized training data: shards in the flat binary layout llm.c and nanoGPT-style
/// pipelines write, memory-mapped, served as global batches of which each data-parallel rank
/// reads its own rows, so the global batch is the same whatever the mesh.
///
/// A shard is a header of 256 little-endian int32 followed by the tokens:
///
///     int32[0]   magic: 20240520 (tokens are uint16) or 20240801 (tokens are uint32)
///     int32[1]   version: 1 with magic 20240520, 7 with magic 20240801
///     int32[2]   the number of tokens
///     int32[3..255] zero (not read)
///     tokens     that many uint16 or uint32, little-endian
///
/// These are the two layouts llm.c's `write_datafile` produces (GPT-2's vocabulary in uint16,
/// Llama 3's in uint32). A file whose size is not the header plus its count of tokens, whose
/// magic or version is another, or whose count is negative is refused with the file and the
/// byte offset at fault.
///
/// The loader cuts each shard into windows of `seq + 1` tokens (a sequence and its next-token
/// labels), one after the other, and serves them in an order fixed by the seed: every epoch a
/// new permutation of all windows of all shards. Global batch b holds the windows at positions
/// [b·batch, (b+1)·batch) of that order; data-parallel rank r of D reads rows
/// [r·batch/D, (r+1)·batch/D). Its position (epoch, batch) is what a checkpoint saves: restored,
/// the loader serves exactly the batch the run would have served next.
///
/// @code
/// dataset::write_shard("train_000.bin", tokens, dataset::token_width::u16);
/// dataset::token_loader train({.files = dataset::shards_in("data", "train"), .batch = 8, .seq = 64,
///                           .seed = 1},
///                          {.rank = dp_coord, .ranks = dp_size});
/// const auto b = train.next();      // this rank's rows: b.ids, b.labels ([rows, seq] each)
/// const auto at = train.position(); // save with the checkpoint; restore with seek(at)
/// @endcode

#include <concerto/core/error.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace concerto::dataset {

static_assert(std::endian::native == std::endian::little, "shards hold little-endian integers, read as the host's");

/// @brief How wide a shard's tokens are.
enum class token_width : std::uint8_t { u16 = 2, u32 = 4 };

/// @brief The header's fields, in the layout above.
inline constexpr std::int32_t magic_u16 = 20240520, version_u16 = 1;
inline constexpr std::int32_t magic_u32 = 20240801, version_u32 = 7;
inline constexpr std::size_t header_ints = 256, header_bytes = header_ints * sizeof(std::int32_t);

/// @brief Writes `tokens` as one shard (atomically: a temporary file renamed). Throws
/// concerto::error when a token does not fit the width or the file cannot be written.
inline void write_shard(const std::filesystem::path& path, std::span<const std::uint32_t> tokens, token_width width) {
  if (tokens.size() > static_cast<std::size_t>(INT32_MAX))
    fail("shard '" + path.string() + "': " + std::to_string(tokens.size()) +
         " tokens; the header counts at most 2^31 - 1, split the data over more shards");
  std::array<std::int32_t, header_ints> header{};
  header[0] = width == token_width::u16 ? magic_u16 : magic_u32;
  header[1] = width == token_width::u16 ? version_u16 : version_u32;
  header[2] = static_cast<std::int32_t>(tokens.size());
  std::string bytes(header_bytes + tokens.size() * static_cast<std::size_t>(width), '\0');
  std::memcpy(bytes.data(), header.data(), header_bytes);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (width == token_width::u16 && tokens[i] > 0xffff)
      fail("shard '" + path.string() + "': token " + std::to_string(i) + " is " + std::to_string(tokens[i]) +
           ", which does not fit uint16; write the shard with token_width::u32");
    char* at = bytes.data() + header_bytes + i * static_cast<std::size_t>(width);
    if (width == token_width::u16) {
      const auto v = static_cast<std::uint16_t>(tokens[i]);
      std::memcpy(at, &v, sizeof v);
    } else {
      std::memcpy(at, &tokens[i], sizeof tokens[i]);
    }
  }
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) fail("shard '" + path.string() + "': cannot write '" + tmp.string() + "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail("shard '" + path.string() + "': cannot rename '" + tmp.string() + "' to it: " + ec.message());
}

/// @brief One shard, memory-mapped and checked when opened.
class shard {
public:
  explicit shard(const std::filesystem::path& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("shard '" + path.string() + "': cannot open it: " + std::strerror(errno));
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      fail("shard '" + path.string() + "': cannot stat it: " + std::strerror(errno));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        fail("shard '" + path.string() + "': cannot map it: " + std::strerror(errno));
      }
      map_ = static_cast<const std::byte*>(p);
    }
    ::close(fd);
    check();
  }
  shard(const shard&) = delete;
  shard& operator=(const shard&) = delete;
  shard(shard&& o) noexcept
      : path_(std::move(o.path_)), map_(std::exchange(o.map_, nullptr)), size_(std::exchange(o.size_, 0)),
        width_(o.width_), tokens_(o.tokens_) {}
  shard& operator=(shard&&) = delete;
  ~shard() {
    if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), size_);
  }

  [[nodiscard]] std::size_t size() const noexcept { return tokens_; }
  [[nodiscard]] token_width width() const noexcept { return width_; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// Token i (i < size()).
  [[nodiscard]] std::uint32_t operator[](std::size_t i) const noexcept {
    const std::byte* at = map_ + header_bytes + i * static_cast<std::size_t>(width_);
    if (width_ == token_width::u16) {
      std::uint16_t v;
      std::memcpy(&v, at, sizeof v);
      return v;
    }
    std::uint32_t v;
    std::memcpy(&v, at, sizeof v);
    return v;
  }

private:
  void check() {
    const auto where = [&](std::size_t offset) {
      return "shard '" + path_.string() + "' at byte " + std::to_string(offset) + ": ";
    };
    if (size_ < header_bytes)
      fail(where(size_) + "the file ends inside the " + std::to_string(header_bytes) +
           "-byte header; it is truncated or not a token shard");
    std::array<std::int32_t, 3> h{};
    std::memcpy(h.data(), map_, sizeof h);
    if (h[0] == magic_u16) width_ = token_width::u16;
    else if (h[0] == magic_u32) width_ = token_width::u32;
    else
      fail(where(0) + "magic " + std::to_string(h[0]) + " is neither " + std::to_string(magic_u16) + " (uint16 tokens) nor " +
           std::to_string(magic_u32) + " (uint32 tokens); not a token shard (see data/token_shards.hpp)");
    const auto version = width_ == token_width::u16 ? version_u16 : version_u32;
    if (h[1] != version)
      fail(where(4) + "version " + std::to_string(h[1]) + " with magic " + std::to_string(h[0]) + "; this reader takes " +
           std::to_string(version));
    if (h[2] < 0) fail(where(8) + "a token count of " + std::to_string(h[2]));
    tokens_ = static_cast<std::size_t>(h[2]);
    const auto want = header_bytes + tokens_ * static_cast<std::size_t>(width_);
    if (size_ != want)
      fail(where(std::min(size_, want)) + "the header counts " + std::to_string(tokens_) + " tokens (" + std::to_string(want) +
           " bytes with the header) but the file holds " + std::to_string(size_) + " bytes; it is " +
           (size_ < want ? "truncated" : "longer than its header says"));
  }

  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  std::size_t size_ = 0;
  token_width width_ = token_width::u16;
  std::size_t tokens_ = 0;
};

/// @brief The shards of `dir` whose names start with `prefix` and end in `.bin`, sorted by name
/// (`train_000.bin`, `train_001.bin`, ...). Throws naming the folder when there is none.
[[nodiscard]] inline std::vector<std::filesystem::path> shards_in(const std::filesystem::path& dir, const std::string& prefix) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) fail("data folder '" + dir.string() + "' does not exist");
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (e.is_regular_file() && name.starts_with(prefix) && e.path().extension() == ".bin") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  if (out.empty())
    fail("data folder '" + dir.string() + "' has no shard '" + prefix + "*.bin'; write them with examples/shards");
  return out;
}

/// @brief What the loader serves.
struct loader_options {
  std::vector<std::filesystem::path> files; ///< the shards, in this order before shuffling
  int batch = 8;                            ///< sequences per global batch (over every data-parallel rank)
  int seq = 64;                             ///< tokens per sequence (each window holds seq + 1)
  std::uint64_t seed = 1;                   ///< the order of the windows, per epoch
  bool shuffle = true;                      ///< false: the windows in file order every epoch (evaluation)
};

/// @brief Which rows of each global batch this rank reads.
struct rank_slice {
  int rank = 0;  ///< this rank's coordinate on the data-parallel axes
  int ranks = 1; ///< their size; divides loader_options::batch
};

/// @brief Where a loader is: the next batch it serves is batch `batch` of epoch `epoch`.
struct position {
  std::uint64_t epoch = 0;
  std::uint64_t batch = 0;
  friend bool operator==(const position&, const position&) = default;
};

/// @brief This rank's rows of one global batch: ids and next-token labels, [rows, seq] each,
/// row-major, as int64 (the DSL's `data` leaves).
struct batch {
  int rows = 0, seq = 0;
  std::vector<std::int64_t> ids, labels;
  position at; ///< which batch this is
};

/// @brief Serves global batches of windows from token shards; see the file comment.
class token_loader {
public:
  token_loader(loader_options o, rank_slice r) : o_(std::move(o)), slice_(r) {
    if (o_.files.empty()) fail("token_loader: no shards given (loader_options::files)");
    if (o_.seq < 1 || o_.batch < 1)
      fail("token_loader: batch " + std::to_string(o_.batch) + " and seq " + std::to_string(o_.seq) + "; both must be positive");
    if (slice_.ranks < 1 || slice_.rank < 0 || slice_.rank >= slice_.ranks)
      fail("token_loader: rank " + std::to_string(slice_.rank) + " of " + std::to_string(slice_.ranks));
    if (o_.batch % slice_.ranks != 0)
      fail("token_loader: a global batch of " + std::to_string(o_.batch) + " sequences does not split over " +
           std::to_string(slice_.ranks) + " data-parallel ranks; make the batch a multiple of the data-parallel size");
    std::size_t total = 0;
    for (const auto& f : o_.files) {
      shards_.emplace_back(f);
      const auto n = shards_.back().size();
      const auto windows = n > 0 ? (n - 1) / static_cast<std::size_t>(o_.seq) : 0;
      first_window_.push_back(total);
      total += windows;
    }
    windows_ = total;
    if (windows_ < static_cast<std::size_t>(o_.batch))
      fail("token_loader: the shards hold " + std::to_string(windows_) + " windows of " + std::to_string(o_.seq + 1) +
           " tokens, fewer than one global batch of " + std::to_string(o_.batch) + "; give more data or a smaller batch/seq");
    order_for(0);
  }

  /// Global batches per epoch (the windows left over at an epoch's end are skipped).
  [[nodiscard]] std::uint64_t batches_per_epoch() const noexcept { return windows_ / static_cast<std::size_t>(o_.batch); }
  [[nodiscard]] std::size_t windows() const noexcept { return windows_; }
  [[nodiscard]] const position& where() const noexcept { return at_; }

  /// The next batch's rows for this rank; then the position moves on (to the next epoch after
  /// its last batch).
  [[nodiscard]] batch next() {
    batch b;
    b.at = at_;
    b.rows = o_.batch / slice_.ranks;
    b.seq = o_.seq;
    const auto seq = static_cast<std::size_t>(o_.seq);
    b.ids.resize(static_cast<std::size_t>(b.rows) * seq);
    b.labels.resize(b.ids.size());
    for (int row = 0; row < b.rows; ++row) {
      const auto slot = at_.batch * static_cast<std::uint64_t>(o_.batch) +
                        static_cast<std::uint64_t>(slice_.rank * b.rows + row);
      const auto [s, first] = locate(order_[static_cast<std::size_t>(slot)]);
      for (std::size_t t = 0; t < seq; ++t) {
        b.ids[static_cast<std::size_t>(row) * seq + t] = shards_[s][first + t];
        b.labels[static_cast<std::size_t>(row) * seq + t] = shards_[s][first + t + 1];
      }
    }
    if (++at_.batch == batches_per_epoch()) seek({at_.epoch + 1, 0});
    return b;
  }

  /// Moves to `p` (a saved position): the next batch served is batch p.batch of epoch p.epoch.
  void seek(position p) {
    if (p.batch >= batches_per_epoch())
      fail("token_loader: position batch " + std::to_string(p.batch) + " of epoch " + std::to_string(p.epoch) +
           ", but an epoch has " + std::to_string(batches_per_epoch()) +
           " batches; the checkpoint was written with other data, batch or seq");
    if (p.epoch != at_.epoch || order_.empty()) order_for(p.epoch);
    at_ = p;
  }

private:
  // Window w of the concatenated shards: its shard and first token.
  [[nodiscard]] std::pair<std::size_t, std::size_t> locate(std::size_t w) const {
    const auto it = std::upper_bound(first_window_.begin(), first_window_.end(), w);
    const auto s = static_cast<std::size_t>(it - first_window_.begin()) - 1;
    return {s, (w - first_window_[s]) * static_cast<std::size_t>(o_.seq)};
  }

  // SplitMix64: a stream of well-mixed 64-bit numbers from one seed, the same on every machine
  // (std::shuffle's engine distributions are not specified bit for bit).
  static std::uint64_t mix(std::uint64_t& state) {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // The order of epoch e: Fisher-Yates with a generator seeded by (seed, e).
  void order_for(std::uint64_t epoch) {
    order_.resize(windows_);
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    if (!o_.shuffle) return;
    std::uint64_t state = o_.seed * 0x100000001b3ULL ^ (epoch + 1) * 0x9e3779b97f4a7c15ULL;
    for (std::size_t i = windows_; i > 1; --i) {
      // The remainder's bias is below i / 2^64: nothing a training run can see.
      const auto j = static_cast<std::size_t>(mix(state) % i);
      std::swap(order_[i - 1], order_[j]);
    }
  }

  loader_options o_;
  rank_slice slice_;
  std::vector<shard> shards_;
  std::vector<std::size_t> first_window_; // per shard: the index of its first window
  std::size_t windows_ = 0;
  std::vector<std::size_t> order_;
  position at_{};
};

} // namespace concerto::dataset
