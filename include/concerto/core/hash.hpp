#pragma once
/// @file
/// @brief A stable 64-bit hash (FNV-1a) for plans, graphs and cache keys: the same bytes give
/// the same value on every machine and build, unlike std::hash.

#include <bit>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace concerto {

/// @brief Incremental FNV-1a hasher.
/// @code
/// concerto::hasher h; h.add("gpt"); h.add(std::int64_t{24}); auto key = h.hex();
/// @endcode
class hasher {
public:
  hasher& add_bytes(const void* data, std::size_t size) noexcept {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < size; ++i) {
      state_ ^= bytes[i];
      state_ *= 0x100000001b3ULL;
    }
    return *this;
  }
  hasher& add(std::string_view s) noexcept {
    add(static_cast<std::uint64_t>(s.size())); // length prefix: "ab","c" differs from "a","bc"
    return add_bytes(s.data(), s.size());
  }
  template <class T>
    requires std::is_arithmetic_v<T> || std::is_enum_v<T>
  hasher& add(T value) noexcept {
    if constexpr (std::is_floating_point_v<T>) {
      const double d = value == 0 ? 0.0 : static_cast<double>(value); // -0.0 == 0.0
      return add(std::bit_cast<std::uint64_t>(d));
    } else {
      const auto v = static_cast<std::uint64_t>(value);
      unsigned char le[8];
      for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i)); // endian-free
      return add_bytes(le, 8);
    }
  }
  [[nodiscard]] std::uint64_t value() const noexcept { return state_; }
  [[nodiscard]] std::string hex() const { return to_hex(state_); }

  static std::string to_hex(std::uint64_t v) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return buf;
  }

private:
  std::uint64_t state_ = 0xcbf29ce484222325ULL;
};

/// @brief Hash of a byte string in one call.
inline std::uint64_t hash_bytes(std::string_view s) noexcept {
  return hasher{}.add_bytes(s.data(), s.size()).value();
}

} // namespace concerto
