#pragma once
/// @file
/// @brief Compile-time strings: `fixed_string` names things in template arguments (`axis<"tp">`,
/// `param<"w1">`) so that error messages and dumps print the user's names; `short_name` is the
/// same text as a fixed-capacity value that constexpr passes can copy and compare cheaply.

#include <cstddef>
#include <string_view>

namespace concerto {

/// @brief A string literal usable as a template argument.
/// @code
/// template <fixed_string Name> struct tag { static constexpr std::string_view name = Name.view(); };
/// static_assert(tag<"dp">::name == "dp");
/// @endcode
template <std::size_t N>
struct fixed_string {
  char data[N + 1]{};
  constexpr fixed_string(const char (&text)[N + 1]) noexcept {
    for (std::size_t i = 0; i <= N; ++i) data[i] = text[i];
  }
  [[nodiscard]] constexpr std::string_view view() const noexcept { return {data, N}; }
  [[nodiscard]] static constexpr std::size_t size() noexcept { return N; }
};
template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N - 1>;

/// @brief Two compile-time strings one after the other: names made from a prefix.
/// @code
/// template <fixed_string Prefix> constexpr auto w = param<join<Prefix, "wq">()>(spec(replicate, replicate));
/// @endcode
template <fixed_string A, fixed_string B>
[[nodiscard]] constexpr fixed_string<A.size() + B.size()> join() noexcept {
  char text[A.size() + B.size() + 1]{};
  for (std::size_t i = 0; i < A.size(); ++i) text[i] = A.data[i];
  for (std::size_t i = 0; i < B.size(); ++i) text[A.size() + i] = B.data[i];
  return fixed_string<A.size() + B.size()>(text);
}

/// @brief Up to Cap-1 characters held by value; structural, so it can be a template argument too.
template <std::size_t Cap>
struct short_name {
  char data[Cap]{};
  constexpr short_name() noexcept = default;
  constexpr short_name(std::string_view text) noexcept {
    for (std::size_t i = 0; i < text.size() && i + 1 < Cap; ++i) data[i] = text[i];
  }
  [[nodiscard]] constexpr std::string_view view() const noexcept {
    std::size_t n = 0;
    while (n < Cap && data[n] != '\0') ++n;
    return {data, n};
  }
  [[nodiscard]] constexpr bool empty() const noexcept { return data[0] == '\0'; }
  friend constexpr bool operator==(const short_name& a, const short_name& b) noexcept { return a.view() == b.view(); }
  friend constexpr bool operator==(const short_name& a, std::string_view b) noexcept { return a.view() == b; }
};

} // namespace concerto
