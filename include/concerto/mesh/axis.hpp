#pragma once
/// @file
/// @brief Named mesh axes: `axis<"dp">` is a type whose name travels into specs, programs,
/// diagnostics and dumps. Sizes are not part of the type: they are bound at run time (mesh.hpp).

#include <concerto/core/fixed_string.hpp>

#include <string_view>
#include <type_traits>

namespace concerto {

/// @brief Longest axis name a spec can hold (the value form of a spec stores names inline).
inline constexpr std::size_t max_axis_name = 15;
using axis_name = short_name<max_axis_name + 1>;

/// @brief A named axis of the device mesh.
/// @code
/// inline constexpr axis<"dp"> dp;
/// static_assert(dp.name() == "dp");
/// @endcode
template <fixed_string Name>
struct axis {
  static_assert(Name.size() > 0 && Name.size() <= max_axis_name,
                "axis name must have 1 to 15 characters: shorten the name given to axis<...>");
  static constexpr auto label = Name;
  [[nodiscard]] static constexpr std::string_view name() noexcept { return Name.view(); }
};

namespace detail {
template <class T>
struct is_axis : std::false_type {};
template <fixed_string N>
struct is_axis<axis<N>> : std::true_type {};
} // namespace detail

/// @brief Satisfied by `axis<"...">` types.
template <class T>
concept mesh_axis_type = detail::is_axis<std::remove_cvref_t<T>>::value;

/// @brief The axes a program may use, in mesh order (outermost first). Passing one to
/// `program(...)` turns any other axis in a spec into a compile-time error.
/// @code
/// constexpr auto step = program(loss, sgd{}, on(dp, tp));
/// @endcode
template <mesh_axis_type... Axes>
struct mesh_decl {
  static constexpr std::size_t size = sizeof...(Axes);
};
template <mesh_axis_type... Axes>
[[nodiscard]] constexpr mesh_decl<std::remove_cvref_t<Axes>...> on(Axes...) noexcept {
  return {};
}

} // namespace concerto
