// The fault-injection suite: tests/faults/faults.cpp under mpirun on 2 ranks, one fault per case,
// with CONCERTO_TIMEOUT_S=2. Each case checks that the job ends (well before ctest's own limit:
// a hang fails here, not by a timing claim), with a non-zero exit status, with the message that
// names the fault, once and before the launcher's abort banner, from a rank that saw it (a stopped
// rank does not report), and that the checkpoint folder keeps its file and holds no temporary file.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

struct outcome {
  int status = -1;      ///< exit status of mpirun
  std::string output;   ///< stdout and stderr
  double seconds = 0;
};

/// Runs `program arguments` under mpirun on 2 ranks with CONCERTO_TIMEOUT_S=`timeout` and the
/// `environment` assignments.
outcome launch(const std::string& program, const std::string& arguments, const std::string& timeout = "2",
               const std::string& environment = "") {
  const std::string command = "CONCERTO_TIMEOUT_S=" + timeout + " " + environment + " " + CONCERTO_MPIEXEC +
                              " -n 2 --oversubscribe " + program + " " + arguments + " 2>&1";
  const auto started = std::chrono::steady_clock::now();
  outcome o;
  std::FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) o.output.append(buf, n);
  const int raw = ::pclose(pipe);
  o.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return o;
}

/// Runs the fault program with `fault`, its checkpoints in `dir`.
outcome run(const std::string& fault, const fs::path& dir, const std::string& timeout = "2",
            const std::string& environment = "") {
  return launch(CONCERTO_FAULTS, fault + " " + dir.string(), timeout, environment);
}

std::set<std::string> names_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

/// A fresh folder per case, removed at the end.
struct folder {
  fs::path path = fs::temp_directory_path() / ("concerto-faults-" + std::to_string(::getpid()));
  folder() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~folder() { fs::remove_all(path); }
};

// The job must end by itself: mpirun start-up, lowering and planning take a few seconds on a
// loaded 2-core machine, the injected stall lasts 60 s. Ending before the stall is over shows
// that the deadline, not the stall, ended it.
constexpr double ends_before_stall_s = 55;

std::size_t count_of(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

/// The job failed with `message`, said once, before the launcher's abort banner.
void check_failed(const outcome& o, const std::string& message) {
  CAPTURE(o.output, o.seconds);
  CHECK(o.status != 0);
  CHECK(count_of(o.output, message) == 1);
  CHECK(count_of(o.output, "concerto: rank ") == 1);
  if (const auto banner = o.output.find("MPI_ABORT was invoked"); banner != std::string::npos)
    CHECK(o.output.find(message) < banner);
  CHECK(o.seconds < ends_before_stall_s);
  CHECK_THAT(o.output, !ContainsSubstring("finished"));
}

} // namespace

// What a rank that timed out says of a rank that stopped: it asked, and got no answer.
const std::string silent_rank_1 = "rank 1 does not answer (stopped, or busy outside concerto's waits)";

TEST_CASE("a rank stopped before step 1 ends the job at the deadline, reported by the rank that waited", "[faults][deadline]") {
  folder f;
  const auto o = run("stall-start", f.path);
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 waiting for the settings agreement check "
                  "before step 1: " + silent_rank_1 + " (set CONCERTO_TIMEOUT_S to wait longer)");
  CHECK_THAT(o.output, !ContainsSubstring("rank 1 failed"));
}

TEST_CASE("a rank that never makes its communicators ends the job at the deadline, naming the axis", "[faults][deadline]") {
  folder f;
  const auto o = run("stall-communicators", f.path);
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 waiting for the communicators of mesh axis '");
  CHECK_THAT(o.output, ContainsSubstring(silent_rank_1));
  CHECK_THAT(o.output, !ContainsSubstring("rank 1 failed"));
}

TEST_CASE("a rank that stops inside a communicator split ends the job at the deadline", "[faults][deadline]") {
  folder f;
  const auto o = run("stall-split", f.path);
  // MPI_Comm_split cannot be interrupted: the watchdog of the rank inside it says why and ends it.
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 inside MPI_Comm_split for the communicator of "
                  "the injected split: a rank of the group entered it late or not at all");
}

TEST_CASE("a rank stopped between steps ends the job at the deadline, naming the step, the collective and the rank",
          "[faults][deadline]") {
  folder f;
  const auto o = run("stall-mid", f.path);
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s in step 2 waiting for ");
  CHECK_THAT(o.output, ContainsSubstring("collective(s) in flight: " + silent_rank_1 + " (set CONCERTO_TIMEOUT_S to wait longer)"));
  CHECK_THAT(o.output, !ContainsSubstring("rank 1 failed"));
}

TEST_CASE("a rank stopped after its last step ends the job at the deadline instead of spinning in MPI_Finalize",
          "[faults][deadline]") {
  folder f;
  const auto o = run("stall-finalize", f.path);
  CAPTURE(o.output, o.seconds);
  CHECK(o.status != 0);
  CHECK(o.seconds < ends_before_stall_s);
  CHECK(count_of(o.output, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 waiting for the other ranks at the "
                           "end of the job (MPI_Finalize): " + silent_rank_1) == 1);
  CHECK(count_of(o.output, "concerto: rank ") == 1);
}

TEST_CASE("a rank 0 that plans past the deadline is reported as planning, not as stopped", "[faults][deadline]") {
  folder f;
  const auto o = run("slow-plan", f.path);
  // Rank 0 is busy planning (it answers nobody): rank 1, which waited, says so itself.
  check_failed(o, "concerto: rank 1 failed: timed out after 2 s on rank 1 of 2 waiting for the plan from rank 0 (rank 0 plans, or loads it from the cache): rank 0 is "
                  "planning the step (");
  CHECK_THAT(o.output, !ContainsSubstring("does not answer"));
}

TEST_CASE("a mistake every rank makes alike is said once", "[faults]") {
  folder f;
  const auto o = run("bad-shape", f.path);
  check_failed(o, "concerto: rank 0 failed: ");
  CHECK_THAT(o.output, ContainsSubstring("(2 ranks alike)"));
  CHECK_THAT(o.output, ContainsSubstring("wq"));
}

TEST_CASE("a pipeline stage stopped between steps ends the job at the deadline, naming the message", "[faults][deadline][pipeline]") {
  folder f;
  const auto o = run("stall-stage", f.path);
  // Stage 0 waits for its first message of the step with stage 1: the activation it sends (a
  // send completes when the peer takes it) or the gradient it receives.
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s in step 2 waiting for ");
  CHECK_THAT(o.output, ContainsSubstring("mb0, stage 0 to stage 1' (task ") || ContainsSubstring("mb0, stage 0 from stage 1' (task "));
  CHECK_THAT(o.output, ContainsSubstring("on lane 'comm:pp")); // values' lane, or gradients' ('comm:pp.grad')
  CHECK_THAT(o.output, !ContainsSubstring("rank 1 failed"));
}

TEST_CASE("a rank that never joins the loss reduction ends the job at the deadline", "[faults][deadline]") {
  folder f;
  const auto o = run("stall-reduction", f.path);
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 waiting for the loss of step 1");
  CHECK_THAT(o.output, !ContainsSubstring("rank 1 failed"));
}

TEST_CASE("a rank stopped before a save ends the job at the deadline, and nothing is written", "[faults][deadline][checkpoint]") {
  folder f;
  const auto o = run("stall-save", f.path);
  check_failed(o, "concerto: rank 0 failed: timed out after 2 s on rank 0 of 2 waiting for gathering tensor '");
  CHECK(names_in(f.path).empty());
}

TEST_CASE("ranks given other settings are refused before step 1, naming the field and the ranks", "[faults][agreement]") {
  folder f;
  SECTION("a learning rate") {
    check_failed(run("lr", f.path), "the ranks disagree on 'adamw.lr': rank 0 has '0.01', rank 1 has '0.02' (ranks that differ from rank 0: 1)");
  }
  SECTION("a model depth") {
    check_failed(run("layers", f.path), "the ranks disagree on 'lower.depth': rank 0 has '{\"layers\":2}', rank 1 has '{\"layers\":3}'");
  }
  SECTION("a policy") {
    check_failed(run("policy", f.path), "the ranks disagree on 'policy': rank 0 has 'program_order', rank 1 has 'sync'");
  }
  // Every collective setting of the MPI library is compared, by messages no such setting changes.
  SECTION("Open MPI's non-blocking all-reduce algorithm") {
    check_failed(run("mpi-setting", f.path),
                 "the ranks disagree on 'MPI coll_libnbc_iallreduce_algorithm': rank 0 has '1', rank 1 has '2'");
  }
  SECTION("Open MPI's non-blocking broadcast algorithm") {
    check_failed(run("mpi-setting-ibcast", f.path),
                 "the ranks disagree on 'MPI coll_libnbc_ibcast_algorithm': rank 0 has '0', rank 1 has '2'");
  }
  SECTION("Open MPI's non-blocking all-gather algorithm") {
    check_failed(run("mpi-setting-iallgather", f.path),
                 "the ranks disagree on 'MPI coll_libnbc_iallgather_algorithm': rank 0 has '0', rank 1 has '2'");
  }
  SECTION("micro-batches per step, named before the graph they change") {
    check_failed(run("microbatches", f.path), "the ranks disagree on 'pipeline': rank 0 has '[2,");
  }
  SECTION("TF32 products (CONCERTO_TF32)") {
    check_failed(run("tf32", f.path), "the ranks disagree on 'allow_tf32': rank 0 has 'false', rank 1 has 'true'");
  }
}

TEST_CASE("a loss that is not finite stops training, naming the step", "[faults][nan]") {
  folder f;
  SECTION("and how to find where it began") {
    const auto o = run("nan", f.path);
    check_failed(o, "train step: the loss of step 1 of graph 'gpt' is nan (executor_options::find_non_finite, or "
                    "CONCERTO_FIND_NON_FINITE=1, names the first kernel whose output is not finite); training stopped");
  }
  SECTION("and, when asked, the first kernel that wrote one") {
    const auto o = run("nan", f.path, "2", "CONCERTO_FIND_NON_FINITE=1");
    check_failed(o, "train step: the loss of step 1 of graph 'gpt' is nan; the first kernel whose output is not finite is ");
    // The NaN is in the embedding table: the lookup that reads it is where it began, on both ranks.
    CHECK_THAT(o.output, ContainsSubstring("(embedding reading 'ids', 'wte') on rank 0: nan at element 0 of '"));
    // The lookup is a node the user did not name: the message says what the program wrote.
    CHECK_THAT(o.output, ContainsSubstring("#2' = embedding(ids, wte) (embedding reading"));
  }
  SECTION("a kernel of a later layer is described as that layer computes it") {
    const auto o = run("nan-layer", f.path, "2", "CONCERTO_FIND_NON_FINITE=1");
    check_failed(o, "the first kernel whose output is not finite is matmul 'layers.1.matmul#");
    // Layer 1 reads layer 0's output, not the embedding (the stack's input, which layer 0 reads).
    CHECK_THAT(o.output, ContainsSubstring("= matmul(layernorm(the previous layer's output, ln1.g, ln1.b), wq) (matmul reading"));
    CHECK_THAT(o.output, !ContainsSubstring("embedding(ids, wte)"));
  }
  SECTION("pipelined, the first in the schedule's order across the stages") {
    const auto o = run("nan-stage", f.path, "2", "CONCERTO_FIND_NON_FINITE=1");
    // Stage 1 (rank 1) reads the NaN stage 0 sends with its first kernel; stage 0 (rank 0) wrote it
    // with layer 0's second MLP product, later in its own list: micro-batch 0's forward on stage 0
    // comes first.
    check_failed(o, "the first kernel whose output is not finite is matmul 'layers.0.matmul#");
    CHECK_THAT(o.output, ContainsSubstring(") on rank 0: nan at element "));
  }
}

TEST_CASE("copies of a parameter that drift apart stop training when replicas are checked", "[faults][agreement]") {
  folder f;
  SECTION("they are found after the step") {
    const auto o = run("replica-drift", f.path, "2", "CONCERTO_CHECK_REPLICAS=1");
    check_failed(o, "train step: after step 1 of graph 'gpt', copies of the same parameter block differ: 'lnf.g' on ranks 0 and 1");
  }
  SECTION("copies that agree pass the check") {
    const auto o = run("ok", f.path, "2", "CONCERTO_CHECK_REPLICAS=1");
    CAPTURE(o.output);
    CHECK(o.status == 0);
    CHECK_THAT(o.output, ContainsSubstring("rank 0: finished"));
  }
}

TEST_CASE("a rank that fails while the plan is chosen ends the job with its message", "[faults][choice]") {
  folder f;
  const auto o = run("choice-fails", f.path);
  check_failed(o, "concerto: rank 1 failed: injected failure while reporting a trial step of the plan choice");
}

TEST_CASE("a damaged checkpoint is refused naming the file and what is wrong, and stays on disk", "[faults][checkpoint]") {
  folder f;
  const auto file = (f.path / "model.ckpt").string();
  SECTION("a NaN written over a value") {
    check_failed(run("corrupt-nan", f.path), "checkpoint '" + file + "': tensor 'head.v' fails its checksum");
  }
  SECTION("a flipped exponent bit") {
    check_failed(run("corrupt-flip", f.path), "checkpoint '" + file + "': tensor 'head.v' fails its checksum");
  }
  SECTION("an edited offset") {
    check_failed(run("corrupt-offset", f.path), "checkpoint '" + file + "': the index fails its checksum");
  }
  SECTION("a truncated file") {
    check_failed(run("corrupt-truncate", f.path), "checkpoint '" + file + "': truncated: the index promises ");
  }
  CHECK(names_in(f.path) == std::set<std::string>{"model.ckpt"});
}

TEST_CASE("a writer killed mid-save leaves the previous checkpoint whole; the next save removes its temporary file",
          "[faults][checkpoint]") {
  folder f;
  const auto killed = run("kill-save", f.path);
  CAPTURE(killed.output, killed.seconds);
  CHECK(killed.status != 0);
  CHECK(killed.seconds < ends_before_stall_s);
  CHECK_THAT(killed.output, !ContainsSubstring("finished"));
  const auto left = names_in(f.path);
  CHECK(left.size() == 2);
  CHECK(left.contains("model.ckpt"));
  CHECK(std::ranges::any_of(left, [](const std::string& n) { return n.starts_with("model.ckpt.tmp."); }));

  const auto resumed = run("resume", f.path);
  CAPTURE(resumed.output);
  CHECK(resumed.status == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("rank 0: resumed after step 2")); // the checkpoint before the kill
  CHECK_THAT(resumed.output, ContainsSubstring("rank 1: finished"));
  CHECK(names_in(f.path) == std::set<std::string>{"model.ckpt"});
}

TEST_CASE("a timeout past the clock's range means no deadline", "[faults][deadline]") {
  folder f;
  for (const std::string timeout : {"inf", "1e10", "9.3e9"}) {
    const auto o = run("ok", f.path, timeout);
    CAPTURE(timeout, o.output);
    CHECK(o.status == 0);
    CHECK_THAT(o.output, ContainsSubstring("rank 0: finished"));
    CHECK_THAT(o.output, ContainsSubstring("rank 1: finished"));
  }
}

#if defined(CONCERTO_EXAMPLES)
namespace {

// A user's bad command line, or a setting every rank refuses alike: exactly one line of ours, naming
// the problem, before the launcher's own lines (its banners start with dashes, its logs with '[').
void refused(const std::string& example, const std::string& arguments, const std::string& message) {
  const auto o = launch(example, arguments);
  CAPTURE(example, arguments, o.output);
  CHECK(o.status != 0);
  std::vector<std::string> ours;
  for (std::size_t at = 0; at < o.output.size();) {
    const auto end = std::min(o.output.find('\n', at), o.output.size());
    const auto line = o.output.substr(at, end - at);
    at = end + 1;
    if (line.starts_with("-----") || line.starts_with("[")) break;
    if (!line.empty()) ours.push_back(line);
  }
  REQUIRE(ours.size() == 1);
  CHECK_THAT(ours.front(), ContainsSubstring(message));
  CHECK(ours.front().size() < 400);
  CHECK_THAT(o.output, !ContainsSubstring("step "));
}

} // namespace

TEST_CASE("the GPT example refuses bad flags by name, once, and answers --help", "[faults][flags]") {
  folder f;
  const std::string gpt = CONCERTO_EXAMPLE_GPT;
  refused(gpt, "--steps 0", "--steps: must be a positive number, not '0'");
  refused(gpt, "--steps many", "--steps: must be a positive number, not 'many'");
  refused(gpt, "--heads 0", "--heads: must be a positive number, not '0'");
  refused(gpt, "--lr=-1", "--lr: must be a positive number, not '-1'");
  refused(gpt, "--layers", "--layers: 1 required INT:POSITIVE missing");
  refused(gpt, "--bogus 1", "The following arguments were not expected: 1 --bogus");
  // Pipeline flags: a schedule with nothing to order, an empty list, a layout the schedule does not take.
  refused(gpt, "--schedule zb_h1", "--schedule: needs pipeline stages or micro-batches to apply to: give --pp N or");
  refused(gpt, "--virtual-stages 2", "--virtual-stages: needs pipeline stages or micro-batches to apply to");
  refused(gpt, "--pp 2 --tp 1 --schedule ''", "--schedule: needs at least one schedule name");
  refused(gpt, "--policy ,", "--policy: needs at least one policy name");
  refused(gpt, "--pp 2 --tp 1 --layers 4 --microbatches 2 --virtual-stages 2 --schedule gpipe,1f1b",
          "--schedule: pipeline schedule '1f1b' runs one chunk per stage (--virtual-stages 2): set --virtual-stages 1, "
          "or use gpipe, interleaved_1f1b or concerto, which take 2 chunks per stage");
  refused(gpt, "--pp 2 --tp 1 --microbatches 3 --batch 12 --virtual-stages 2 --schedule interleaved_1f1b",
          "--schedule: pipeline schedule 'interleaved_1f1b' needs the micro-batches (3) to be a multiple of the stages (2)");
  const auto short_text = f.path / "short.txt";
  std::FILE* out = std::fopen(short_text.c_str(), "w");
  REQUIRE(out != nullptr);
  std::fputs("ten chars.", out);
  std::fclose(out);
  // Found by every rank alike, after the command line: said once.
  refused(gpt, "--text " + short_text.string() + " --seq 32",
          "the training text '" + short_text.string() + "' has 10 characters; --seq 32 needs at least 34");
  refused(gpt, "--tp 2 --heads 3 --hidden 48", "3 query heads and 3 k/v heads cannot be split over tp = 2 (2 ranks)");

  const auto help = launch(gpt, "--help");
  CAPTURE(help.output);
  CHECK(help.status == 0);
  CHECK(count_of(help.output, "Trains a small character-level GPT") == 1);
  CHECK_THAT(help.output, ContainsSubstring("--steps"));
}

TEST_CASE("the Llama example refuses options that only mean something together, by name, once", "[faults][flags]") {
  const std::string llama = CONCERTO_EXAMPLE_LLAMA;
  refused(llama, "--ep 2", "--ep: splits the experts of a mixture of experts: give --experts E too");
  refused(llama, "--top-k 1", "--top-k: routes tokens to experts: give --experts E too");
  refused(llama, "--experts -1", "--experts: must be 0 (the dense block) or a number of experts, not '-1'");
  refused(llama, "--experts 4 --tp 1 --zero 1", "--experts: the mixture of experts runs without --sp and --zero");
  refused(llama, "--experts 3 --ep 2 --tp 1", "--ep: 2 ranks cannot split 3 experts evenly");
  refused(llama, "--policy bogus", "--policy: 'bogus' is not a plan policy (sync, program_order");
  // The mesh and the model are checked by every rank alike: one line.
  refused(llama, "--tp 3", "the mesh axes tp = 3 (3 ranks) do not divide the world's 2 ranks");
}

TEST_CASE("the MLP and Evoformer examples refuse bad flags once", "[faults][flags]") {
  refused(CONCERTO_EXAMPLE_MLP, "--hidden 0", "--hidden: must be a positive number, not '0'");
  refused(CONCERTO_EXAMPLE_MLP, "--tp 3", "the mesh axes tp = 3 (3 ranks) do not divide the world's 2 ranks");
  refused(CONCERTO_EXAMPLE_EVOFORMER, "--heads 0", "--heads: must be a positive number, not '0'");
}
#endif
