#pragma once
/// @file
/// @brief The run-time device mesh: ordered named axes whose sizes come from the world size,
/// rank <-> coordinates (row-major, the last axis varies fastest, so put the intra-node axis
/// last), and the ranks of each per-axis sub-group (what MPI_Comm_split / ncclCommSplit need).

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/axis.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace concerto {

/// @brief One axis as requested: its size, or -1 for "whatever the world size leaves".
struct axis_request {
  std::string name;
  int size = -1;
  ir::link_class link = ir::link_class::intra_node;
};

/// @brief A device mesh bound to sizes.
/// @code
/// auto m = mesh::from_world(8, {{"dp", -1, ir::link_class::inter_node}, {"tp", 2}});
/// // m.size("dp") == 4; m.coords(5) == {2, 1}; m.group("tp", 5) == {4, 5}
/// @endcode
class mesh {
public:
  mesh() = default;
  /// Axes with explicit sizes (all >= 1, distinct names).
  explicit mesh(std::vector<ir::mesh_axis> axes) : axes_(std::move(axes)) {
    for (std::size_t a = 0; a < axes_.size(); ++a) {
      if (axes_[a].name.empty() || axes_[a].name.size() > max_axis_name)
        fail("mesh axis name '" + axes_[a].name + "' must have 1 to 15 characters");
      if (axes_[a].size < 1) fail("mesh axis '" + axes_[a].name + "' has size " + std::to_string(axes_[a].size));
      for (std::size_t b = 0; b < a; ++b)
        if (axes_[b].name == axes_[a].name) fail("mesh axis '" + axes_[a].name + "' appears twice");
    }
  }

  /// Binds sizes from the world size: at most one axis may say -1 and takes the rest.
  [[nodiscard]] static mesh from_world(int world_size, const std::vector<axis_request>& request) {
    if (world_size < 1) fail("world size " + std::to_string(world_size) + " is not positive");
    int known = 1, free_axis = -1;
    for (std::size_t a = 0; a < request.size(); ++a) {
      if (request[a].size == -1) {
        if (free_axis >= 0)
          fail("mesh axes '" + request[static_cast<std::size_t>(free_axis)].name + "' and '" + request[a].name +
               "' both ask for the rest of the world; give one of them a size");
        free_axis = static_cast<int>(a);
      } else if (request[a].size < 1) {
        fail("mesh axis '" + request[a].name + "' has size " + std::to_string(request[a].size));
      } else {
        known *= request[a].size;
      }
    }
    std::vector<ir::mesh_axis> axes;
    for (const auto& r : request) axes.push_back({r.name, r.size, r.link});
    if (free_axis >= 0) {
      if (world_size % known != 0) {
        std::string fixed;
        for (const auto& r : request)
          if (r.size > 0) fixed += (fixed.empty() ? "" : " x ") + r.name + " = " + std::to_string(r.size);
        fail("the mesh axes " + fixed + " (" + std::to_string(known) + " ranks) do not divide the world's " +
             std::to_string(world_size) + " ranks, so axis '" + request[static_cast<std::size_t>(free_axis)].name +
             "' has no integral size: give them sizes whose product divides " + std::to_string(world_size) +
             ", or run on a multiple of " + std::to_string(known) + " ranks");
      }
      axes[static_cast<std::size_t>(free_axis)].size = world_size / known;
    } else if (known != world_size) {
      fail("mesh axes multiply to " + std::to_string(known) + " ranks but the world has " + std::to_string(world_size));
    }
    return mesh(std::move(axes));
  }

  [[nodiscard]] const std::vector<ir::mesh_axis>& axes() const noexcept { return axes_; }
  [[nodiscard]] int rank_count() const noexcept {
    int n = 1;
    for (const auto& a : axes_) n *= a.size;
    return n;
  }
  [[nodiscard]] std::optional<int> index_of(std::string_view name) const noexcept {
    for (std::size_t a = 0; a < axes_.size(); ++a)
      if (axes_[a].name == name) return static_cast<int>(a);
    return std::nullopt;
  }
  /// Size of a named axis; throws naming the axis if the mesh lacks it.
  [[nodiscard]] int size(std::string_view name) const { return axes_[checked(name)].size; }

  /// Coordinates of a rank, one per axis (row-major, last axis fastest).
  [[nodiscard]] std::vector<int> coords(int rank) const {
    check_rank(rank);
    std::vector<int> c(axes_.size());
    for (std::size_t a = axes_.size(); a-- > 0;) {
      c[a] = rank % axes_[a].size;
      rank /= axes_[a].size;
    }
    return c;
  }
  /// The rank at given coordinates.
  [[nodiscard]] int rank_of(const std::vector<int>& coords) const {
    if (coords.size() != axes_.size())
      fail("mesh has " + std::to_string(axes_.size()) + " axes but " + std::to_string(coords.size()) + " coordinates were given");
    int rank = 0;
    for (std::size_t a = 0; a < axes_.size(); ++a) {
      if (coords[a] < 0 || coords[a] >= axes_[a].size)
        fail("coordinate " + std::to_string(coords[a]) + " is outside mesh axis '" + axes_[a].name + "'");
      rank = rank * axes_[a].size + coords[a];
    }
    return rank;
  }
  /// The ranks of `rank`'s sub-group along an axis, ordered by their coordinate on that axis.
  [[nodiscard]] std::vector<int> group(std::string_view axis_name, int rank) const {
    const auto a = checked(axis_name);
    auto c = coords(rank);
    std::vector<int> out;
    for (int i = 0; i < axes_[a].size; ++i) {
      c[a] = i;
      out.push_back(rank_of(c));
    }
    return out;
  }
  /// Which sub-group of an axis a rank belongs to, numbered 0..rank_count()/size-1 (an MPI split colour).
  [[nodiscard]] int group_index(std::string_view axis_name, int rank) const {
    const auto a = checked(axis_name);
    auto c = coords(rank);
    int index = 0;
    for (std::size_t b = 0; b < axes_.size(); ++b)
      if (b != a) index = index * axes_[b].size + c[b];
    return index;
  }
  /// Every sub-group of an axis, by group_index.
  [[nodiscard]] std::vector<std::vector<int>> groups(std::string_view axis_name) const {
    const auto n = rank_count() / size(axis_name);
    std::vector<std::vector<int>> out(static_cast<std::size_t>(n));
    for (int r = 0; r < rank_count(); ++r) {
      auto& g = out[static_cast<std::size_t>(group_index(axis_name, r))];
      if (g.empty()) g = group(axis_name, r);
    }
    return out;
  }

private:
  [[nodiscard]] std::size_t checked(std::string_view name) const {
    const auto i = index_of(name);
    if (!i) fail("the mesh has no axis '" + std::string(name) + "'");
    return static_cast<std::size_t>(*i);
  }
  void check_rank(int rank) const {
    if (rank < 0 || rank >= rank_count())
      fail("rank " + std::to_string(rank) + " is outside a mesh of " + std::to_string(rank_count()) + " ranks");
  }
  std::vector<ir::mesh_axis> axes_;
};

} // namespace concerto
