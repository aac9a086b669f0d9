// The C++ side of the safetensors interop test (tests/interop/CMakeLists.txt):
//   write FILE   writes interop::tensors() as F32, BF16 and F16 (names suffixed .f32 / .bf16 / .f16)
//   check FILE   reads a file safetensors_check.py wrote (F32, BF16 and F16) and compares every
//                value with interop::tensors(), bf16 and f16 after concerto's own rounding of the f32
// Exits 0 when every tensor matches; otherwise prints the first mismatch and exits 1.
#include "values.hpp"

#include <concerto/core/file.hpp>
#include <concerto/train/safetensors.hpp>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

namespace st = concerto::train::safetensors;

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s write|check FILE\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], file = argv[2];
  if (mode == "write") {
    st::writer w;
    for (const auto& t : interop::tensors()) {
      w.add(t.name + ".f32", t.shape, t.values, st::dtype::f32);
      w.add(t.name + ".bf16", t.shape, t.values, st::dtype::bf16);
      w.add(t.name + ".f16", t.shape, t.values, st::dtype::f16);
    }
    concerto::write_file_atomically(file, std::move(w).finish({{"format", "pt"}, {"written_by", "concerto"}}));
    return 0;
  }
  const auto c = st::read(file);
  int checked = 0;
  for (const auto& t : interop::tensors())
    for (const auto type : {st::dtype::f32, st::dtype::bf16, st::dtype::f16}) {
      const auto name = t.name + "." + (type == st::dtype::f32 ? "f32" : type == st::dtype::bf16 ? "bf16" : "f16");
      const auto& e = c.tensors.at(name);
      if (e.type != type || e.shape != t.shape) {
        std::fprintf(stderr, "%s: dtype or shape differs\n", name.c_str());
        return 1;
      }
      const auto got = c.values(name);
      for (std::size_t i = 0; i < got.size(); ++i) {
        const float want = type == st::dtype::bf16  ? st::from_bf16(st::to_bf16(t.values[i]))
                           : type == st::dtype::f16 ? st::from_f16(st::to_f16(t.values[i]))
                                                    : t.values[i];
        if (std::memcmp(&got[i], &want, sizeof want) != 0) {
          std::fprintf(stderr, "%s[%zu]: read %.9g, expected %.9g\n", name.c_str(), i, got[i], want);
          return 1;
        }
      }
      ++checked;
    }
  std::printf("%d tensors written by Python equal concerto's values\n", checked);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "safetensors_roundtrip: %s\n", e.what());
  return 1;
}
