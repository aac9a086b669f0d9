// train::compile's step object: a checkpoint saved on one mesh continues on another with the
// losses of an uninterrupted run; the plan cache answers the second compile; a loader gives the
// numbers of the global batch; parameters start identical on every mesh shape.
#include "gpt_program.hpp"
#include "train_testing.hpp"

#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>

using namespace concerto;
namespace tt = train_testing;
namespace gt = gpt_testing;

namespace {

constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 16;
const auto shapes = gt::shapes(batch, seq, vocab, hidden);

train::batch data(int step) { return gpt_testing::token_batch(step, batch, seq, vocab); }

train::step_options options(MPI_Comm comm) {
  return {.policy = planner::policy::program_order, .lower = {.name = "gpt", .heads = 4, .depth = {{"layers", 2}}},
          .use_cache = false, .world = comm};
}

// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
std::filesystem::path shared_temp_dir() {
  long pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return std::filesystem::temp_directory_path() / ("concerto-train-test-" + std::to_string(pid));
}

train::step<gt::gpt_sp.size> compile_on(MPI_Comm comm, int d, int t) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  return train::compile(gt::gpt_sp, mesh::from_world(n, {{"dp", d}, {"tp", t}}), shapes, {.adamw = {.lr = 1e-2f}},
                        options(comm));
}

} // namespace

TEST_CASE("a checkpoint saved on one mesh shape continues on another like an uninterrupted run", "[mpi][train][checkpoint]") {
  const int world = runtime::mpi::environment::world_size();
  const auto dir = shared_temp_dir();
  const auto file = dir / "gpt.ckpt";
  // Uninterrupted: 4 steps on one rank.
  std::vector<double> straight;
  {
    auto s = compile_on(MPI_COMM_SELF, 1, 1);
    for (int i = 0; i < 4; ++i) straight.push_back(s(data(i)).loss);
  }
  // Two steps on the whole world as dp x tp (2x2 on 4 ranks, 1x2 on 2), saved...
  {
    auto s = compile_on(MPI_COMM_WORLD, world / 2, 2);
    for (int i = 0; i < 2; ++i) CHECK(std::abs(s(data(i)).loss - straight[static_cast<std::size_t>(i)]) <= 1e-5 * straight[0]);
    s.save(file);
    CHECK(s.completed_steps() == 2);
  }
  // ...and continued on half the ranks as pure data parallelism.
  {
    tt::sub_world half(world / 2);
    if (half.member()) {
      auto s = compile_on(half.get(), world / 2, 1);
      s.load(file);
      CHECK(s.completed_steps() == 2);
      for (int i = 2; i < 4; ++i) {
        const auto r = s(data(i));
        CAPTURE(i, r.loss, straight[static_cast<std::size_t>(i)]);
        CHECK(r.step == i + 1);
        CHECK(std::abs(r.loss - straight[static_cast<std::size_t>(i)]) <= tt::rel_tol * straight[static_cast<std::size_t>(i)]);
      }
    }
  }
  CHECK(straight[3] < straight[0]);
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("a learning-rate schedule gives each step its rate, and a resumed run continues it", "[mpi][train][schedule]") {
  const int world = runtime::mpi::environment::world_size();
  const auto dir = shared_temp_dir();
  const float base = 1e-2f;
  const runtime::lr_schedule schedule{.decay = runtime::lr_decay::cosine, .warmup_steps = 2, .decay_steps = 5,
                                      .min_ratio = 0.2f};
  const auto compile_with = [&](MPI_Comm comm, int d, int t, float lr, runtime::lr_schedule sch) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    return train::compile(gt::gpt_sp, mesh::from_world(n, {{"dp", d}, {"tp", t}}), shapes,
                          {.adamw = {.lr = lr}, .schedule = sch}, options(comm));
  };
  // Scheduled, on the whole world as dp x tp; saved after two steps.
  std::vector<double> scheduled;
  {
    auto s = compile_with(MPI_COMM_WORLD, world / 2, 2, base, schedule);
    for (int i = 0; i < 4; ++i) {
      const auto r = s(data(i));
      CHECK(r.lr == runtime::lr_at(schedule, base, i + 1));
      scheduled.push_back(r.loss);
      if (i == 1) s.save(dir / "scheduled.ckpt");
    }
  }
  CHECK(runtime::lr_at(schedule, base, 1) == 0.5f * base); // the schedule moves the rate
  // The same steps on one rank, each at a constant rate equal to the schedule's for that step,
  // carried from step to step by checkpoints (AdamW's moments and step count with them).
  {
    tt::sub_world one(1);
    if (one.member()) {
      for (int i = 0; i < 4; ++i) {
        auto s = compile_with(one.get(), 1, 1, runtime::lr_at(schedule, base, i + 1), {});
        if (i > 0) s.load(dir / "chain.ckpt");
        const auto r = s(data(i));
        CAPTURE(i, r.loss, scheduled[static_cast<std::size_t>(i)]);
        CHECK(std::abs(r.loss - scheduled[static_cast<std::size_t>(i)]) <= tt::rel_tol * scheduled[0]);
        s.save(dir / "chain.ckpt");
      }
    }
  }
  // Resumed from step 2 with the schedule: steps 3 and 4 as the uninterrupted run's.
  {
    auto s = compile_with(MPI_COMM_WORLD, world, 1, base, schedule);
    s.load(dir / "scheduled.ckpt");
    for (int i = 2; i < 4; ++i) {
      const auto r = s(data(i));
      CHECK(r.lr == runtime::lr_at(schedule, base, i + 1));
      CHECK(std::abs(r.loss - scheduled[static_cast<std::size_t>(i)]) <= tt::rel_tol * scheduled[0]);
    }
  }
  CHECK_THROWS_WITH(compile_with(MPI_COMM_WORLD, world, 1, base, {.decay = runtime::lr_decay::linear, .decay_steps = 0}),
                    Catch::Matchers::ContainsSubstring("linear decay ends at step 0"));
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("parameters exported as safetensors on one mesh import on another, in f32 and bf16", "[mpi][train][safetensors]") {
  namespace st = train::safetensors;
  const int world = runtime::mpi::environment::world_size();
  const auto dir = shared_temp_dir();
  std::vector<double> straight;
  std::map<std::string, std::vector<float>> trained;
  {
    auto s = compile_on(MPI_COMM_WORLD, world / 2, 2);
    for (int i = 0; i < 2; ++i) (void)s(data(i));
    s.export_safetensors(dir / "f32.safetensors");
    s.export_safetensors(dir / "bf16.safetensors", st::dtype::bf16);
    for (const auto& name : s.parameter_names()) trained[name] = s.parameter(name);
    for (int i = 2; i < 4; ++i) straight.push_back(s(data(i)).loss);
  }
  // The file holds exactly the parameters, global and named as the program names them.
  const auto f32 = st::read(dir / "f32.safetensors"), bf16 = st::read(dir / "bf16.safetensors");
  CHECK(f32.tensors.size() == trained.size());
  CHECK(f32.metadata.at("format") == "pt");
  for (const auto& [name, values] : trained) {
    CAPTURE(name);
    CHECK(f32.values(name) == values);
    CHECK(bf16.tensors.at(name).type == st::dtype::bf16);
    const auto rounded = bf16.values(name);
    for (std::size_t i = 0; i < values.size(); ++i) REQUIRE(rounded[i] == st::from_bf16(st::to_bf16(values[i])));
  }
  // Imported on another mesh (pure data parallelism): the parameters are the exporter's, so the
  // first loss, computed before the update, is the exporter's next one (the optimizer's moments
  // are not in the file, so later losses would differ).
  {
    tt::sub_world half(world / 2);
    if (half.member()) {
      auto a = compile_on(half.get(), world / 2, 1);
      a.import_safetensors(dir / "f32.safetensors");
      for (const auto& [name, values] : trained) REQUIRE(a.parameter(name) == values);
      auto b = compile_on(half.get(), world / 2, 1);
      b.import_safetensors(dir / "bf16.safetensors");
      for (const auto& [name, values] : trained) REQUIRE(b.parameter(name) == bf16.values(name));
      const double la = a(data(2)).loss, lb = b(data(2)).loss;
      CHECK(std::abs(la - straight[0]) <= tt::rel_tol * straight[0]); // the loss of the same parameters
      CHECK(std::abs(lb - la) <= 1e-2 * la);                          // bf16's rounding, not another model
    }
  }
  // A file that is not this program's parameters is refused before a value changes.
  {
    auto s = compile_on(MPI_COMM_WORLD, world, 1);
    const auto before = s.parameter("wte");
    if (runtime::mpi::environment::world_rank() == 0) {
      st::writer missing, extra, misshapen;
      for (const auto& [name, values] : trained) {
        if (name != "wte") missing.add(name, s.global_shape(name), values);
        extra.add(name, s.global_shape(name), values);
        misshapen.add(name, name == "wte" ? std::vector<std::int64_t>{static_cast<std::int64_t>(values.size())} : s.global_shape(name), values);
      }
      extra.add("lm_head.bias", {3}, std::vector<float>{1, 2, 3});
      write_file_atomically(dir / "missing.safetensors", std::move(missing).finish());
      write_file_atomically(dir / "extra.safetensors", std::move(extra).finish());
      write_file_atomically(dir / "misshapen.safetensors", std::move(misshapen).finish());
    }
    MPI_Barrier(MPI_COMM_WORLD);
    using Catch::Matchers::ContainsSubstring;
    CHECK_THROWS_WITH(s.import_safetensors(dir / "missing.safetensors"), ContainsSubstring("has no tensor 'wte'"));
    CHECK_THROWS_WITH(s.import_safetensors(dir / "extra.safetensors"),
                      ContainsSubstring("'lm_head.bias', which is no parameter of the program"));
    CHECK_THROWS_WITH(s.import_safetensors(dir / "misshapen.safetensors"),
                      ContainsSubstring("tensor 'wte' has shape") && ContainsSubstring("the program expects [32,16]"));
    CHECK(s.parameter("wte") == before);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint of another model is refused naming the tensor", "[mpi][train][checkpoint]") {
  const auto dir = shared_temp_dir();
  {
    auto s = train::compile(gt::gpt_sp, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), gt::shapes(batch, seq, vocab, 2 * hidden),
                            {}, options(MPI_COMM_SELF));
    if (runtime::mpi::environment::world_rank() == 0) s.save(dir / "wide.ckpt");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto s = compile_on(MPI_COMM_SELF, 1, 1);
  try {
    s.load(dir / "wide.ckpt");
    FAIL("the load should have thrown");
  } catch (const concerto::error& e) {
    CHECK(std::string(e.what()).find("tensor 'wte' has shape [32,32], the program expects [32,16]") != std::string::npos);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("a damaged checkpoint is refused naming the file and the tensor, and the step is not changed", "[mpi][train][checkpoint]") {
  const auto dir = shared_temp_dir();
  const auto file = dir / "gpt.ckpt";
  auto s = compile_on(MPI_COMM_SELF, 1, 1);
  (void)s(data(0));
  if (runtime::mpi::environment::world_rank() == 0) {
    s.save(file);
    std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(-2, std::ios::end); // the last value's exponent byte
    f.put('\x7f');
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const auto before = s.parameter("wte");
  try {
    s.load(file);
    FAIL("the load should have thrown");
  } catch (const concerto::error& e) {
    CHECK(std::string(e.what()).find("checkpoint '" + file.string() + "': tensor '") != std::string::npos);
    CHECK(std::string(e.what()).find("' fails its checksum") != std::string::npos);
  }
  CHECK(s.parameter("wte") == before);
  CHECK(s.completed_steps() == 1);
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("the second compile of a step is answered by the plan cache", "[mpi][train][cache]") {
  const auto dir = shared_temp_dir();
  const int world = runtime::mpi::environment::world_size();
  auto o = options(MPI_COMM_WORLD);
  o.use_cache = true;
  o.cache_dir = dir;
  o.policy = planner::policy::concerto;
  o.solver.time_budget_s = 2;
  std::vector<double> loss;
  for (int round = 0; round < 2; ++round) {
    auto s = train::compile(gt::gpt_sp, mesh::from_world(world, {{"dp", world / 2}, {"tp", 2}}), shapes, {}, o);
    const auto& summary = s.summary();
    CHECK(summary.cache_hit == (round == 1));
    CHECK(summary.policy == "concerto");
    CHECK(summary.predicted_us > 0);
    CHECK(summary.sync_predicted_us >= summary.predicted_us * 0.999); // concerto never loses to its warm start
    CHECK(summary.text().find(round == 1 ? "cache hit" : "cache miss") != std::string::npos);
    loss.push_back(s(data(0)).loss);
  }
  CHECK(loss[0] == loss[1]);

  // A damaged entry is replanned, and the user is told once, with the file's name.
  MPI_Barrier(MPI_COMM_WORLD);
  const bool writer = runtime::mpi::environment::world_rank() == 0;
  if (writer)
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().extension() == ".plan") std::ofstream(entry.path(), std::ios::binary | std::ios::trunc) << "damaged";
  MPI_Barrier(MPI_COMM_WORLD);
  std::ostringstream reported;
  auto* const terminal = std::cerr.rdbuf(reported.rdbuf());
  auto s = train::compile(gt::gpt_sp, mesh::from_world(world, {{"dp", world / 2}, {"tp", 2}}), shapes, {}, o);
  const bool hit = s.summary().cache_hit; // planning happens here, at the first use
  std::cerr.rdbuf(terminal);
  CHECK_FALSE(hit);
  if (writer) {
    CHECK(reported.str().find("plan cache: '" + dir.string()) != std::string::npos);
    CHECK(reported.str().find(".plan': header garbage") != std::string::npos);
  }
  CHECK(s(data(0)).loss == loss[0]);
  MPI_Barrier(MPI_COMM_WORLD);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("the graph's kernels are timed once per machine and graph; a damaged record is timed again", "[mpi][train][kernels]") {
  const auto dir = shared_temp_dir() / "kernels";
  const int world = runtime::mpi::environment::world_size();
  const bool root = runtime::mpi::environment::world_rank() == 0;
  auto o = options(MPI_COMM_WORLD);
  o.cache_dir = dir;
  o.use_cache = true; // the kernel record lives beside the plan cache and follows its switch
  const auto compile = [&] {
    auto s = train::compile(gt::gpt_sp, mesh::from_world(world, {{"dp", world / 2}, {"tp", 2}}), shapes, {}, o);
    (void)s.summary();
    return s;
  };
  const auto records = [&] {
    std::vector<std::filesystem::path> out;
    if (std::filesystem::exists(dir))
      for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().filename().string().starts_with("kernels-")) out.push_back(e.path());
    return out;
  };
  const auto text_of = [](const std::filesystem::path& f) {
    std::ifstream in(f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };

  SECTION("off: nothing is timed or kept") {
    o.measure_kernels = false;
    auto s = compile();
    MPI_Barrier(MPI_COMM_WORLD);
    CHECK(records().empty()); // the ranks share this machine's file system
  }
  SECTION("on: one record naming every kernel of the graph, reused by the next compile") {
    o.measure_kernels = true;
    auto s = compile();
    MPI_Barrier(MPI_COMM_WORLD);
    std::string first;
    if (root) {
      const auto files = records();
      REQUIRE(files.size() == 1);
      first = text_of(files[0]);
      const auto j = nlohmann::json::parse(first);
      std::set<std::string> kernels;
      for (const auto& t : s.plan().graph.tasks)
        if (!ir::is_collective(t.kind)) kernels.emplace(cost::model::kernel_name(t));
      std::set<std::string> named;
      for (const auto& [k, v] : j.items()) {
        named.insert(k);
        CHECK(v.get<double>() > 0);
      }
      CHECK(named == kernels);
    }
    auto again = compile();
    MPI_Barrier(MPI_COMM_WORLD);
    if (root) CHECK(text_of(records().at(0)) == first); // timed again would give other numbers

    if (root) std::ofstream(records().at(0)) << "{\"gelu\": -1"; // damaged
    MPI_Barrier(MPI_COMM_WORLD);
    auto repaired = compile();
    MPI_Barrier(MPI_COMM_WORLD);
    if (root) {
      const auto j = nlohmann::json::parse(text_of(records().at(0)));
      CHECK(j.size() == nlohmann::json::parse(first).size());
    }
    CHECK(repaired(data(0)).loss == again(data(0)).loss);

    // A factor no measurement gives (an edited file) is refused as the damaged one was: timed again.
    if (root) {
      auto j = nlohmann::json::parse(first);
      j[j.begin().key()] = 1e300;
      std::ofstream(records().at(0)) << j.dump();
    }
    MPI_Barrier(MPI_COMM_WORLD);
    auto remeasured = compile();
    MPI_Barrier(MPI_COMM_WORLD);
    if (root) {
      const auto remade = nlohmann::json::parse(text_of(records().at(0)));
      for (const auto& [k, v] : remade.items()) CHECK(v.get<double>() < 1e6);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (root) std::filesystem::remove_all(dir.parent_path());
}

TEST_CASE("with a trace folder every rank writes its planned and its measured step", "[mpi][train][trace]") {
  const auto dir = shared_temp_dir() / "traces";
  const int world = runtime::mpi::environment::world_size();
  const int rank = runtime::mpi::environment::world_rank();
  auto o = options(MPI_COMM_WORLD);
  o.trace_dir = dir;
  auto s = train::compile(gt::gpt_sp, mesh::from_world(world, {{"dp", world / 2}, {"tp", 2}}), shapes, {}, o);
  (void)s(data(0));
  (void)s(data(1));
  const auto tasks = s.plan().graph.tasks.size();
  for (const char* kind : {"planned", "measured"}) {
    const auto file = dir / ("gpt.program_order." + std::string(kind) + ".rank" + std::to_string(rank) + ".json");
    INFO(file);
    REQUIRE(std::filesystem::exists(file));
    std::ifstream in(file);
    const auto j = nlohmann::json::parse(in);
    std::size_t spans = 0;
    for (const auto& e : j.at("traceEvents")) spans += e.at("ph") == "X";
    CHECK(spans == tasks); // one span per task of the executed graph
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir.parent_path());
}

TEST_CASE("a loader filling each rank's shard gives the numbers of the global batch", "[mpi][train][loader]") {
  const int world = runtime::mpi::environment::world_size();
  auto a = compile_on(MPI_COMM_WORLD, world / 2, 2);
  auto b = compile_on(MPI_COMM_WORLD, world / 2, 2);
  const auto whole = data(3);
  std::vector<std::string> seen;
  const auto by_loader = b([&](const train::shard_request& r) {
    seen.push_back(r.name);
    REQUIRE(r.global_shape == std::vector<std::int64_t>{batch, seq});
    CHECK(r.local_shape[0] * (world / 2) == batch); // split over dp only
    CHECK(r.f32.empty());
    const auto& src = whole.at(r.name).i64;
    for (std::int64_t i = 0; i < r.local_shape[0] * seq; ++i)
      r.i64[static_cast<std::size_t>(i)] = src[static_cast<std::size_t>(r.offset[0] * seq + i)];
  });
  CHECK(by_loader.loss == a(whole).loss);
  std::sort(seen.begin(), seen.end());
  CHECK(seen == std::vector<std::string>{"ids", "labels"});
}

TEST_CASE("parameters start identical on every mesh shape", "[mpi][train][init]") {
  const int world = runtime::mpi::environment::world_size();
  auto one = compile_on(MPI_COMM_SELF, 1, 1);
  auto many = compile_on(MPI_COMM_WORLD, world / 2, 2);
  const auto names = one.parameter_names();
  CHECK(names.size() == 4 + 2 * 10); // wte, lnf.g, lnf.b, head and 10 per layer
  for (const auto& name : names) {
    CAPTURE(name);
    const auto v = one.parameter(name);
    CHECK(many.parameter(name) == v);
    if (name.ends_with(".g")) CHECK(v.front() == 1.0f); // the model's gains say init::ones
    if (name.ends_with(".b")) CHECK(v.front() == 0.0f); // vectors default to zeros
  }
  const auto w = one.parameter("layers.0.wq");
  CHECK(w != one.parameter("layers.1.wq")); // layers differ
  double sq = 0;
  for (auto x : w) sq += static_cast<double>(x) * x;
  CHECK(std::sqrt(sq / static_cast<double>(w.size())) == Catch::Approx(1.0 / std::sqrt(hidden)).epsilon(0.15));
}

TEST_CASE("each parameter starts by its leaf's initialiser, whatever its name", "[mpi][train][init]") {
  // A gain named like a bias and a bias named like a gain: the initialiser decides, not the name.
  // The expert stack [experts, in, out] is scaled by its input width, not by its expert count.
  constexpr auto vec = spec(replicate);
  constexpr auto x = input<"x">(spec(replicate, replicate, replicate));
  constexpr auto experts = matmul(x, param<"stack">(spec(replicate, replicate, replicate)));
  constexpr auto y = layernorm(experts, param<"bias">(vec, init::ones), param<"gain">(vec));
  constexpr auto model = program(mse(mul(y, y), input<"t">(spec(replicate, replicate, replicate))), sgd{});
  constexpr std::int64_t e = 8, rows = 4, in = 64, out = 16;
  auto step = train::compile(model, mesh::from_world(1, {}), {{"x", {e, rows, in}}, {"t", {e, rows, out}},
                                                              {"stack", {e, in, out}}, {"bias", {out}}, {"gain", {out}}},
                             {.sgd = {.lr = 0.0f}}, {.policy = planner::policy::sync, .use_cache = false, .world = MPI_COMM_SELF});
  CHECK(step.parameter("bias") == std::vector<float>(out, 1.0f));
  CHECK(step.parameter("gain") == std::vector<float>(out, 0.0f));
  const auto w = step.parameter("stack");
  double sq = 0, largest = 0;
  for (auto v : w) {
    sq += static_cast<double>(v) * v;
    largest = std::max(largest, std::abs(static_cast<double>(v)));
  }
  CHECK(largest <= std::sqrt(3.0 / in));
  CHECK(std::sqrt(sq / static_cast<double>(w.size())) == Catch::Approx(1.0 / std::sqrt(in)).epsilon(0.1));
}

CONCERTO_MPI_TEST_MAIN
