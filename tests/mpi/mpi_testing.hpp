#pragma once
// Shared by the MPI tests: a main that initialises MPI around Catch2, and a plan from a
// schedule with unit durations (the executor runs orders; the times only need to be valid).
#include <concerto/plan/verify.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_session.hpp>

#include <vector>

namespace mpi_testing {

inline concerto::plan::plan unit_plan(const concerto::planner::ordering& s, const char* policy) {
  std::vector<double> d(s.graph.tasks.size(), 1.0);
  auto p = concerto::sim::to_plan(s.graph, s.order, d, 1.0, policy, "test");
  concerto::plan::verify(p);
  return p;
}

} // namespace mpi_testing

// Every rank must run the same test cases and sections in the same order, since each runs
// collectives: the tests are registered with --order decl, never rand (each rank would draw
// its own seed).
#define CONCERTO_MPI_TEST_MAIN                                                                     \
  int main(int argc, char** argv) {                                                                \
    concerto::runtime::mpi::environment env(argc, argv);                                           \
    return Catch::Session().run(argc, argv);                                                       \
  }
