// A small GPT trainer that injects one fault, chosen by argv[1], for tests/faults/fault_injection_test.cpp
// to run under mpirun (2 ranks) and judge by its exit status, its output and the files it leaves.
// argv[2] is a folder for checkpoints. Every rank prints "rank R: finished" when nothing failed.
//
//   ok                  two steps (run with a huge or infinite CONCERTO_TIMEOUT_S)
//   stall-start         rank 1 sleeps before its first step: the others wait in the agreement check
//   stall-communicators rank 1 sleeps before a second executor of the plan makes its lane
//                       communicators: the others wait where MPI_Comm_split would hold them
//   stall-mid           rank 1 sleeps between step 1 and step 2: the others wait in a step's collective
//   stall-stage         pipelined over 2 stages: rank 1 (stage 1) sleeps between step 1 and step 2,
//                       stage 0 waits for its gradient
//   stall-reduction     rank 1 never joins a control-path reduction (the one each step's loss uses)
//   stall-save          rank 1 sleeps before saving: the others wait in the checkpoint's gather
//   lr, layers, policy  rank 1 compiles the step with another learning rate, depth or policy
//   microbatches        pipelined over 2 stages, rank 1 with 1 micro-batch per step, rank 0 with 2
//   stall-finalize      rank 1 sleeps after its last step, before the end of the job (MPI_Finalize)
//   stall-split         rank 1 passes the barrier before a communicator split, then never splits:
//                       rank 0 waits inside MPI_Comm_split, which cannot be interrupted
//   slow-plan           rank 0 plans for longer than the deadline: rank 1 waits for the plan
//   mpi-setting         rank 1 starts MPI with another non-blocking all-reduce algorithm
//   mpi-setting-ibcast, mpi-setting-iallgather
//                       the same with another non-blocking broadcast or all-gather algorithm
//   bad-shape           every rank compiles the step with a misshapen parameter (a mistake all
//                       ranks make alike: said once)
//   tf32                rank 1 asks for TF32 products (CONCERTO_TF32=1), rank 0 does not
//   nan                 the embedding holds NaN: the first loss is not finite
//   nan-layer           layer 1's query weight holds NaN (the first kernel to write one is layer 1's)
//   nan-stage           pipelined over 2 stages: layer 0's last weight (stage 0) holds NaN, late in
//                       stage 0's list, while stage 1's first kernel already reads the NaN it sends
//   replica-drift       rank 1's copy of the replicated final layernorm gain differs in one value
//   choice-fails        the concerto policy chooses its plan by measuring; rank 1 throws while it
//                       reports its first trial step
//   kill-save           after saving at step 2, rank 0 is killed (SIGKILL) while it writes the
//                       checkpoint of step 3 (a wider model, so that the write lasts milliseconds)
//   resume              the same model loads the checkpoint, trains a step and saves again
//   corrupt-nan, corrupt-flip, corrupt-offset, corrupt-truncate
//                       a checkpoint damaged after the save is loaded
#include "../mpi/gpt_program.hpp"

#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/train/step.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <thread>

#include <signal.h>
#include <unistd.h>

using namespace concerto;
namespace gm = gpt_testing;

namespace {

constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 16;

train::batch data(int step) { return gpt_testing::token_batch(step, batch, seq, vocab); }

void stall() { std::this_thread::sleep_for(std::chrono::seconds(60)); } // the others must not wait for this

/// Kills this process as soon as a temporary file of `dir/model.ckpt` appears: mid-save.
void kill_when_saving(const std::filesystem::path& dir) {
  std::thread([dir] {
    for (;;) {
      std::error_code ec;
      for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
        if (it->path().filename().string().starts_with("model.ckpt.tmp.")) ::kill(::getpid(), SIGKILL);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }).detach();
}

/// Changes the bytes of `file` as the fault names.
void damage(const std::filesystem::path& file, std::string_view how) {
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  const auto size = static_cast<std::streamoff>(std::filesystem::file_size(file));
  if (how == "corrupt-nan") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.seekp(size - 8);
    f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  } else if (how == "corrupt-flip") {
    f.seekg(size - 1);
    const char top = static_cast<char>(f.get());
    f.seekp(size - 1);
    f.put(static_cast<char>(top ^ 0x40)); // an exponent bit of the last value
  } else if (how == "corrupt-offset") {
    std::string text(static_cast<std::size_t>(size), '\0');
    f.read(text.data(), size);
    const auto at = text.find("\"offset\":");
    text[at + 9] = text[at + 9] == '1' ? '2' : '1';
    f.seekp(0);
    f.write(text.data(), size);
  } else if (how == "corrupt-truncate") {
    f.close();
    std::filesystem::resize_file(file, static_cast<std::uintmax_t>(size / 2));
  }
}

} // namespace

int main(int argc, char** argv) {
  const std::string_view fault = argc > 1 ? argv[1] : "ok";
  const std::filesystem::path dir = argc > 2 ? argv[2] : std::filesystem::temp_directory_path();
  // Before MPI starts: the launcher's rank variable tells which process is rank 1.
  const char* launcher_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool second = launcher_rank != nullptr && std::string_view(launcher_rank) == "1";
  if (fault == "mpi-setting" && second) ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "2", 1);
  if (fault == "mpi-setting-ibcast" && second) ::setenv("OMPI_MCA_coll_libnbc_ibcast_algorithm", "2", 1);
  if (fault == "mpi-setting-iallgather" && second) ::setenv("OMPI_MCA_coll_libnbc_iallgather_algorithm", "2", 1);
  if (fault == "tf32") ::setenv("CONCERTO_TF32", second ? "1" : "0", 1);
  runtime::mpi::environment env(argc, argv);
  return runtime::mpi::run_or_abort([&] {
    const int rank = runtime::mpi::environment::world_rank();
    const int world = runtime::mpi::environment::world_size();
    if (fault == "stall-split") {
      const runtime::mpi::control c(MPI_COMM_WORLD, runtime::detail::env_timeout_s(runtime::default_timeout_s));
      const std::string what = "the communicator of the injected split";
      if (rank == 1) {
        c.barrier(what); // as control::split begins
        stall();
      }
      (void)c.split(0, rank, what);
      return;
    }
    if (fault == "stall-reduction") {
      const runtime::mpi::control c(MPI_COMM_WORLD, runtime::detail::env_timeout_s(runtime::default_timeout_s));
      if (rank == 1) stall();
      (void)c.sum_all(1.0, "the loss of step 1");
      return;
    }
    train::step_options o{.policy = fault == "policy" && rank == 1 ? planner::policy::sync : planner::policy::program_order,
                          .measure_kernels = false,
                          .lower = {.name = "gpt", .heads = 4, .depth = {{"layers", fault == "layers" && rank == 1 ? 3 : 2}}},
                          .use_cache = false};
    if (fault == "choice-fails") {
      o.policy = planner::policy::concerto;
      o.solver = {.time_budget_s = 0.5, .progress = false};
      o.choice = {.warmup_steps = 0, .profile_steps = 1, .trial_steps = 1, .rounds = 1, .also_try = {planner::policy::sync}};
      o.choice.adjust_measured = [](int r, std::string_view, double us) {
        if (r == 1) fail("injected failure while reporting a trial step of the plan choice");
        return us;
      };
    }
    if (fault == "slow-plan") // rank 0 alone plans (and rewrites): the others wait for its plan
      o.rewrite = [](const ir::graph& g) {
        std::this_thread::sleep_for(std::chrono::seconds(6));
        return g;
      };
    const float lr = fault == "lr" && rank == 1 ? 2e-2f : 1e-2f;
    const std::int64_t width = fault == "kill-save" || fault == "resume" ? 256 : hidden;
    if (fault == "stall-stage" || fault == "nan-stage" || fault == "microbatches") {
      o.pipeline = {.microbatches = fault == "microbatches" && rank == 1 ? 1 : 2};
      auto p = train::compile(gm::gpt_tp, mesh::from_world(world, {{"pp", world}, {"dp", 1}, {"tp", 1}}),
                              gm::shapes(batch, seq, vocab, width), {.adamw = {.lr = lr}}, o);
      if (fault == "nan-stage") {
        p.prepare();
        p.set_parameter("layers.0.fc2", std::vector<float>(static_cast<std::size_t>(4 * width * width), std::nanf("")));
      }
      (void)p(data(0));
      if (rank == 1) stall();
      (void)p(data(1));
      std::printf("rank %d: finished\n", rank);
      return;
    }
    auto shapes = gm::shapes(batch, seq, vocab, width);
    if (fault == "bad-shape") shapes["wq"] = {width, width + 1}; // wq is [hidden, hidden]
    auto s = train::compile(gm::gpt_sp, mesh::from_world(world, {{"dp", 1}, {"tp", world}}), shapes, {.adamw = {.lr = lr}}, o);
    if (fault == "resume") {
      s.load(dir / "model.ckpt");
      std::printf("rank %d: resumed after step %lld\n", rank, static_cast<long long>(s.completed_steps()));
      (void)s(data(2));
      s.save(dir / "model.ckpt");
      std::printf("rank %d: finished\n", rank);
      return;
    }
    if (fault == "stall-start" && rank == 1) stall();
    if (fault == "nan") {
      s.prepare();
      s.set_parameter("wte", std::vector<float>(static_cast<std::size_t>(vocab * hidden), std::nanf("")));
    }
    if (fault == "nan-layer") {
      s.prepare();
      s.set_parameter("layers.1.wq", std::vector<float>(static_cast<std::size_t>(hidden * hidden), std::nanf("")));
    }
    if (fault == "replica-drift") {
      std::vector<float> gain(static_cast<std::size_t>(hidden), 1.0f);
      if (rank == 1) gain[3] = 1.5f;
      s.set_parameter("lnf.g", gain); // each rank keeps its own block of the value it is given
    }
    (void)s(data(0));
    if (fault == "stall-communicators") {
      if (rank == 1) stall();
      runtime::mpi::backend be;
      runtime::executor ex(s.plan(), be);
    }
    if (fault == "stall-mid" && rank == 1) stall();
    (void)s(data(1));
    // Rank 1 fails after step 2's collectives: rank 0 would finish without a step that needs it.
    if (fault == "choice-fails") (void)s(data(2));
    if (fault.starts_with("stall-save") && rank == 1) stall();
    if (fault.starts_with("stall-save") || fault.starts_with("corrupt-") || fault == "kill-save") s.save(dir / "model.ckpt");
    if (fault == "kill-save") {
      (void)s(data(2));
      if (rank == 0) kill_when_saving(dir);
      s.save(dir / "model.ckpt");
    }
    if (fault.starts_with("corrupt-")) {
      if (rank == 0) damage(dir / "model.ckpt", fault);
      MPI_Barrier(MPI_COMM_WORLD);
      s.load(dir / "model.ckpt");
    }
    std::printf("rank %d: finished\n", rank);
    if (fault == "stall-finalize") {
      std::fflush(stdout);
      if (rank == 1) stall();
    }
  });
}
