#pragma once
// The vision examples' data, drawn here (no downloads): NHWC images of one shape on a noisy
// background, labelled by the shape's class -- a horizontal bar, a vertical bar, a filled square,
// a ring, a diagonal line -- at a random place, size and colour. Image i of a stream is a
// function of (seed, i) alone, so every rank draws the same global batch and a held-out set is
// a seed no training step uses.
#include <concerto/train/options.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace examples {

inline constexpr std::int64_t shape_classes = 5;
inline constexpr const char* shape_names[shape_classes] = {"horizontal bar", "vertical bar", "square", "ring", "diagonal"};

namespace detail {
// splitmix64: a well-mixed 64-bit value of a counter.
inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
struct draw {
  std::uint64_t state;
  double unit() { return static_cast<double>(mix(state++) >> 11) * 0x1.0p-53; } // [0, 1)
  std::int64_t below(std::int64_t n) { return std::min<std::int64_t>(static_cast<std::int64_t>(unit() * static_cast<double>(n)), n - 1); }
};
} // namespace detail

/// Images [count, side, side, 3] and labels [count] of stream `seed` from image `first`.
struct labelled_images {
  concerto::train::tensor images, labels;
};
inline labelled_images shape_images(std::int64_t count, std::int64_t side, std::uint64_t seed, std::int64_t first) {
  labelled_images out{{{count, side, side, 3}}, {{count}}};
  out.images.f32.resize(static_cast<std::size_t>(count * side * side * 3));
  for (std::int64_t n = 0; n < count; ++n) {
    detail::draw d{detail::mix(seed * 0x100000001b3ull + static_cast<std::uint64_t>(first + n))};
    const auto label = d.below(shape_classes);
    out.labels.i64.push_back(label);
    const std::int64_t size = side / 4 + d.below(side / 4 + 1); // the shape's extent
    const std::int64_t y0 = d.below(side - size + 1), x0 = d.below(side - size + 1);
    const double colour[3] = {0.4 + 0.6 * d.unit(), 0.4 + 0.6 * d.unit(), 0.4 + 0.6 * d.unit()};
    const double centre = static_cast<double>(size - 1) / 2, radius = centre;
    for (std::int64_t y = 0; y < side; ++y)
      for (std::int64_t x = 0; x < side; ++x) {
        const std::int64_t u = y - y0, v = x - x0; // in the shape's box
        bool on = false;
        if (u >= 0 && u < size && v >= 0 && v < size) {
          const double du = static_cast<double>(u) - centre, dv = static_cast<double>(v) - centre;
          switch (label) {
          case 0: on = std::abs(du) < 1.0; break;                              // horizontal bar through the middle
          case 1: on = std::abs(dv) < 1.0; break;                              // vertical bar
          case 2: on = true; break;                                            // filled square
          case 3: on = std::abs(std::sqrt(du * du + dv * dv) - radius) < 0.75; break; // ring
          default: on = u == v || u == v + 1; break;                           // diagonal line
          }
        }
        for (int c = 0; c < 3; ++c) {
          const double noise = 0.3 * (d.unit() - 0.5);
          out.images.f32[static_cast<std::size_t>(((n * side + y) * side + x) * 3 + c)] =
              static_cast<float>((on ? colour[c] : 0.0) + noise);
        }
      }
  }
  return out;
}

/// The share of rows of `logits` [rows, classes] whose largest entry is at the row's label.
inline double accuracy(const std::vector<float>& logits, const std::vector<std::int64_t>& labels) {
  const auto rows = labels.size(), classes = logits.size() / std::max<std::size_t>(rows, 1);
  std::size_t right = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const auto* row = logits.data() + r * classes;
    right += static_cast<std::int64_t>(std::max_element(row, row + classes) - row) == labels[r];
  }
  return rows == 0 ? 0.0 : static_cast<double>(right) / static_cast<double>(rows);
}

} // namespace examples
