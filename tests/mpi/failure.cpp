// Failure modes under mpirun, checked by ctest against the output:
//   abort:   rank 1 throws before the step; the others block in a gradient all-reduce. The job
//            must end at once with "concerto: rank 1 failed: ..." instead of hanging.
//   timeout: rank 1 never joins the all-reduce; rank 0's wait times out after 1 s with an
//            error naming the lane and the collective, and the job ends.
#include <concerto/ir/builder.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>
#include <concerto/sim/simulate.hpp>

#include <chrono>
#include <cstdio>
#include <string_view>
#include <thread>

using namespace concerto;
namespace rt = concerto::runtime;

int main(int argc, char** argv) {
  rt::mpi::environment env(argc, argv);
  const std::string_view mode = argc > 1 ? argv[1] : "abort";
  return rt::mpi::run_or_abort([&] {
    rt::mpi::backend be;
    ir::builder b("failure");
    const int dp = b.axis("dp", be.world_size());
    const auto x = b.buffer("x", {64}, ir::buffer_role::input);
    const auto g = b.buffer("g", {64}, ir::buffer_role::gradient);
    b.compute(ir::op_kind::elementwise, "grad", {x}, {g}, {ir::op::relu});
    b.collective(ir::op_kind::all_reduce, "g.ar", dp, g, g);
    const auto graph = std::move(b).finish();
    const auto s = planner::program_order_schedule(graph);
    const auto p = sim::to_plan(s.graph, s.order, std::vector<double>(graph.tasks.size(), 1.0), 1.0, "program_order", "test");
    rt::executor_options options;
    if (mode == "timeout") options = {.timeout_s = 1, .timeout_from_env = false};
    rt::executor ex(p, be, options);
    if (be.rank() == 1) {
      if (mode == "abort") fail("injected failure on rank 1");
      std::this_thread::sleep_for(std::chrono::seconds(20)); // the others must not wait for this
    }
    ex.run_step();
    std::printf("rank %d: step finished\n", be.rank());
  });
}
