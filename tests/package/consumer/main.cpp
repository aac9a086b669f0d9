// Uses the installed headers the way a user would; fails loudly if the package is broken.
#include <concerto/ir/builder.hpp>
#include <z3++.h>

#include <iostream>

int main() {
  concerto::ir::builder b("consumer");
  const auto x = b.buffer("x", {8});
  b.compute(concerto::ir::op_kind::elementwise, "fill", {}, {x}, {.fn = concerto::ir::op::zero, .flops = 0});
  const auto g = std::move(b).finish();
  z3::context ctx; // Z3 must be found and linked through the package
  std::cout << "consumer built a graph of " << g.size() << " task(s)\n";
  return g.size() == 1 ? 0 : 1;
}
