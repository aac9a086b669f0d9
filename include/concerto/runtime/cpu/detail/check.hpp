#pragma once
/// @file
/// @brief Argument checks shared by the CPU kernels (internal).

#include <concerto/core/error.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace concerto::runtime::cpu::detail {

// Buffers come from the executor's arena as spans, so a wrong extent in a plan shows up as a
// size mismatch here; the message names the kernel and the argument so the plan can be fixed.
template <class T>
inline void require_size(std::span<T> s, std::size_t expected, std::string_view kernel,
                         std::string_view argument) {
  CONCERTO_CHECK(s.size() == expected,
                 std::string(kernel) + ": `" + std::string(argument) + "` holds " +
                     std::to_string(s.size()) + " elements, the extents need " +
                     std::to_string(expected));
}

// For outputs a caller may leave out (an input that needs no gradient, momentum 0).
template <class T>
inline void require_size_or_empty(std::span<T> s, std::size_t expected, std::string_view kernel,
                                  std::string_view argument) {
  if (!s.empty()) require_size(s, expected, kernel, argument);
}

} // namespace concerto::runtime::cpu::detail
