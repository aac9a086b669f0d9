// cluster-probe: measures an MPI job's machine as the cost model sees it, on whatever the ranks
// run on (meant for the emulated cluster of bench/cluster/netns-cluster.sh, one rank per host):
//
//   1. all-reduce / all-gather / reduce-scatter time against size, as the MPI executor runs them
//      (non-blocking, ring all-reduce), plus blocking all-reduce for reference; an alpha-beta fit
//      per collective in the cost model's own formula (cost/model.hpp);
//   2. sgemm throughput per rank with every rank computing at once (ranks share the cores);
//   3. overlap: a non-blocking all-reduce beside a BLAS matmul cut in chunks, polled by MPI_Test
//      between chunks, against each alone.
//
// Rank 0 prints a table and writes a `cpu-netns` cost::hardware JSON (readable by
// cost::from_json) and a report JSON with every sample.
//
//   $CLUSTER_MPIRUN -np 4 build-cluster/bench/cluster/probe/cluster-probe
//       --calibration cpu-netns.json --report probe-4x1gbit.json --label 4x1gbit

#include <concerto/cost/calibrate_cpu.hpp>
#include <concerto/cost/model.hpp>

#include <mpi.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace {

using concerto::cost::hardware;
using concerto::cost::link;
using json = nlohmann::json;

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) concerto::fail(std::string("cluster-probe: ") + what + " failed");
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The slowest rank's time: a collective is done when its last rank is.
double max_over_ranks(double us) {
  double out = 0;
  check(MPI_Allreduce(&us, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce(max)");
  return out;
}

double median_over_ranks(double x, int ranks) {
  std::vector<double> all(static_cast<std::size_t>(ranks));
  check(MPI_Allgather(&x, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD), "MPI_Allgather");
  return median(all);
}

struct options {
  double min_bytes = 16 * 1024;
  double max_bytes = 16 * 1024 * 1024;
  double budget_us = 250e3;        // per size and collective, at least min_reps
  int min_reps = 3;
  double fit_min_bytes = 256 * 1024; // below it tbf's bucket (1 ms of traffic) hides the rate
  double overlap_bytes = 8 * 1024 * 1024;
  int chunk_dim = 192;             // one polled matmul chunk is chunk_dim³ (≈0.5 ms on one core)
  int overlap_reps = 5;
  int gemm_m = 64, gemm_n = 4096, gemm_k = 1024; // the MLP example's first layer at batch 64
  std::string calibration_file, report_file, label = "cluster";
};

options parse(int argc, char** argv) {
  options o;
  const auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) concerto::fail(std::string("cluster-probe: option '") + argv[i] + "' needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--min-bytes") o.min_bytes = std::stod(need(i));
    else if (a == "--max-bytes") o.max_bytes = std::stod(need(i));
    else if (a == "--budget-ms") o.budget_us = 1e3 * std::stod(need(i));
    else if (a == "--fit-min-bytes") o.fit_min_bytes = std::stod(need(i));
    else if (a == "--overlap-bytes") o.overlap_bytes = std::stod(need(i));
    else if (a == "--chunk-dim") o.chunk_dim = std::stoi(need(i));
    else if (a == "--overlap-reps") o.overlap_reps = std::stoi(need(i));
    else if (a == "--gemm") {
      o.gemm_m = std::stoi(need(i));
      o.gemm_n = std::stoi(need(i));
      o.gemm_k = std::stoi(need(i));
    } else if (a == "--calibration") o.calibration_file = need(i);
    else if (a == "--report") o.report_file = need(i);
    else if (a == "--label") o.label = need(i);
    else if (a == "--help" || a == "-h") {
      std::puts("cluster-probe [--min-bytes B] [--max-bytes B] [--budget-ms MS] [--fit-min-bytes B]\n"
                "              [--overlap-bytes B]\n"
                "              [--chunk-dim D] [--overlap-reps N] [--gemm M N K]\n"
                "              [--calibration FILE] [--report FILE] [--label NAME]");
      std::exit(0);
    } else concerto::fail("cluster-probe: unknown option '" + a + "' (try --help)");
  }
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes)
    concerto::fail("cluster-probe: need 4 <= --min-bytes <= --max-bytes");
  if (o.chunk_dim < 8) concerto::fail("cluster-probe: --chunk-dim must be at least 8");
  return o;
}

enum class coll { allreduce, iallreduce, iallgather, ireduce_scatter };
constexpr const char* name(coll c) {
  switch (c) {
  case coll::allreduce: return "allreduce (blocking, tuned ring)";
  case coll::iallreduce: return "iallreduce (libnbc ring)";
  case coll::iallgather: return "iallgather (libnbc)";
  case coll::ireduce_scatter: return "ireduce_scatter_block (libnbc)";
  }
  return "?";
}
constexpr const char* key(coll c) {
  switch (c) {
  case coll::allreduce: return "allreduce";
  case coll::iallreduce: return "iallreduce";
  case coll::iallgather: return "iallgather";
  case coll::ireduce_scatter: return "ireduce_scatter_block";
  }
  return "?";
}
concerto::ir::op_kind kind_of(coll c) {
  using concerto::ir::op_kind;
  return c == coll::iallgather ? op_kind::all_gather
         : c == coll::ireduce_scatter ? op_kind::reduce_scatter
                                      : op_kind::all_reduce;
}

// One collective of `bytes` in the convention of ir/graph.hpp (all-gather: the gathered output,
// reduce-scatter: the unreduced input), run as the MPI executor runs it.
struct collective_runner {
  std::vector<float> in, out;
  int ranks;
  explicit collective_runner(double max_bytes, int p)
      : in(static_cast<std::size_t>(max_bytes / 4) + 16, 1.0f), out(in.size(), 0.0f), ranks(p) {}
  void run(coll c, double bytes) {
    const int n = static_cast<int>(bytes / 4);
    const int shard = n / ranks;
    MPI_Request r = MPI_REQUEST_NULL;
    switch (c) {
    case coll::allreduce:
      check(MPI_Allreduce(in.data(), out.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
      return;
    case coll::iallreduce:
      check(MPI_Iallreduce(in.data(), out.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r), "MPI_Iallreduce");
      break;
    case coll::iallgather:
      check(MPI_Iallgather(in.data(), shard, MPI_FLOAT, out.data(), shard, MPI_FLOAT, MPI_COMM_WORLD, &r),
            "MPI_Iallgather");
      break;
    case coll::ireduce_scatter:
      check(MPI_Ireduce_scatter_block(in.data(), out.data(), shard, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r),
            "MPI_Ireduce_scatter_block");
      break;
    }
    check(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait");
  }
};

struct sample {
  double bytes = 0, us = 0;
};

// Timed repetitions: every rank starts together (barrier), the rep costs its slowest rank.
// The number of reps is agreed from a warm-up so that every rank runs the same count.
template <class Fn>
std::vector<double> timed_reps(Fn&& fn, double budget_us, int min_reps) {
  check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  double t0 = now_us();
  fn();
  const double warm = max_over_ranks(now_us() - t0);
  const int reps = std::clamp(static_cast<int>(budget_us / std::max(warm, 1.0)), min_reps, 50);
  std::vector<double> out;
  for (int i = 0; i < reps; ++i) {
    check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    t0 = now_us();
    fn();
    out.push_back(max_over_ranks(now_us() - t0));
  }
  return out;
}

// Steps and per-step bytes of the cost model's ring formulas, so that t = steps·α + volume/B.
struct ring_terms {
  double steps, volume;
};
ring_terms terms(coll c, double bytes, int p) {
  const double s = c == coll::allreduce || c == coll::iallreduce ? 2.0 * (p - 1) : p - 1.0;
  return {s, s * bytes / p};
}

// Least squares in relative error (weights 1/t²), so that small messages fix α and large ones B.
link fit_link(coll c, const std::vector<sample>& all, double min_bytes, int p) {
  std::vector<sample> samples;
  for (const auto& s : all)
    if (s.bytes >= min_bytes) samples.push_back(s);
  if (samples.size() < 2) samples = all;
  double sxx = 0, sxy = 0, syy = 0, sx = 0, sy = 0;
  for (const auto& s : samples) {
    const auto [steps, volume] = terms(c, s.bytes, p);
    const double w = 1.0 / (s.us * s.us);
    sxx += w * steps * steps;
    sxy += w * steps * volume;
    syy += w * volume * volume;
    sx += w * steps * s.us;
    sy += w * volume * s.us;
  }
  const double det = sxx * syy - sxy * sxy;
  double alpha = (sx * syy - sy * sxy) / det;
  double per_byte = (sxx * sy - sxy * sx) / det; // µs per byte
  if (!(alpha >= 0)) { // latency below the noise: fit bandwidth alone
    alpha = 0;
    per_byte = sy / syy;
  }
  per_byte = std::max(per_byte, 1e-9);
  return link{alpha, 1.0 / (per_byte * 1e3)};
}

// sgemm of m×n×k, row-major, the executor's kernel call.
struct gemm {
  int m, n, k;
  std::vector<float> a, b, c;
  gemm(int m_, int n_, int k_)
      : m(m_), n(n_), k(k_), a(static_cast<std::size_t>(m) * k, 0.5f), b(static_cast<std::size_t>(k) * n, 0.25f),
        c(static_cast<std::size_t>(m) * n, 0.0f) {}
  void run() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  }
  [[nodiscard]] double flops() const { return 2.0 * m * n * static_cast<double>(k); }
};

struct overlap_result {
  double bytes = 0, chunks = 0, comm_us = 0, compute_us = 0, both_us = 0, compute_during_us = 0, comm_during_us = 0;
  [[nodiscard]] double ideal_ratio() const { return std::max(comm_us, compute_us) / both_us; }
  [[nodiscard]] double efficiency() const {
    return (comm_us + compute_us - both_us) / std::min(comm_us, compute_us);
  }
  // Both factors are read in the simulator's model (sim::contention): each side runs slowed while
  // the other is in flight and at full rate alone, so that replaying this experiment in the
  // simulator gives the times measured here. The matmuls' rate beside the collective: if the
  // collective finished first, the matmul work done until then, (compute - the time after it),
  // took comm_during; otherwise the matmuls ran beside it throughout. (Taking compute_during /
  // compute in the first case, as an earlier probe did, spreads over the whole loop a slowdown
  // that only the overlapped part had: at 10 Gbit/s the matmuls ran 5x slower beside the
  // all-reduce, which receives its data inside the MPI_Test calls of the same thread, and that
  // read as 1.8x.)
  [[nodiscard]] double compute_slowdown() const {
    if (comm_during_us >= compute_during_us) return compute_during_us / compute_us;
    const double beside = compute_us - (compute_during_us - comm_during_us); // work done while comm ran
    return beside > 0 ? comm_during_us / beside : std::numeric_limits<double>::infinity();
  }
  // The collective's rate beside the matmuls: finished during the compute, it ran slowed
  // throughout; finished after, it did compute_during / slowdown of its work beside the compute
  // and the rest alone.
  [[nodiscard]] double comm_slowdown() const {
    if (comm_during_us <= compute_during_us) return comm_during_us / comm_us;
    const double beside = comm_us - (comm_during_us - compute_during_us); // work done while compute ran
    return beside > 0 ? compute_during_us / beside : std::numeric_limits<double>::infinity();
  }
};

overlap_result measure_overlap(const options& o, collective_runner& runner, int p) {
  gemm chunk(o.chunk_dim, o.chunk_dim, o.chunk_dim);
  overlap_result r;
  r.bytes = o.overlap_bytes;
  const int n = static_cast<int>(o.overlap_bytes / 4);
  r.comm_us = median(timed_reps([&] { runner.run(coll::iallreduce, o.overlap_bytes); }, 0, o.overlap_reps));
  // Ranks that share a core run a loop slower than one timed chunk says: size the loop from a
  // first guess, then rescale once from the loop's own time.
  const double chunk_us = median(timed_reps([&] { chunk.run(); }, 20e3, 5));
  int chunks = std::max(1, static_cast<int>(std::lround(r.comm_us / chunk_us)));
  const auto loop = [&] {
    for (int i = 0; i < chunks; ++i) chunk.run();
  };
  const double first = median(timed_reps(loop, 0, 1));
  chunks = std::max(1, static_cast<int>(std::lround(chunks * r.comm_us / first)));
  r.chunks = chunks;
  r.compute_us = median(timed_reps(loop, 0, o.overlap_reps));
  std::vector<double> during, comm_during;
  r.both_us = median(timed_reps(
      [&] {
        MPI_Request req = MPI_REQUEST_NULL;
        check(MPI_Iallreduce(runner.in.data(), runner.out.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req),
              "MPI_Iallreduce");
        const double t0 = now_us();
        int done = 0;
        double comm_done = 0;
        for (int i = 0; i < chunks; ++i) {
          chunk.run();
          // libnbc and the TCP BTL move data only inside MPI calls: the poll is the progress.
          if (!done) {
            check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
            if (done) comm_done = now_us() - t0;
          }
        }
        during.push_back(now_us() - t0);
        if (!done) {
          check(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait");
          comm_done = now_us() - t0;
        }
        comm_during.push_back(comm_done);
      },
      0, o.overlap_reps));
  r.compute_during_us = max_over_ranks(median(during));
  r.comm_during_us = max_over_ranks(median(comm_during));
  (void)p;
  return r;
}

void write_json(const std::string& file, const json& j) {
  std::ofstream f(file);
  if (!f) concerto::fail("cluster-probe: cannot write '" + file + "'");
  f << j.dump(2) << '\n';
  if (!f) concerto::fail("cluster-probe: writing '" + file + "' failed");
}

int probe(int argc, char** argv) {
  const options o = parse(argc, argv);
  int rank = 0, p = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  if (p < 2) concerto::fail("cluster-probe: needs at least 2 ranks (one per host), got 1");
  const bool root = rank == 0;
  json report{{"label", o.label}, {"ranks", p}};
  if (root) std::printf("cluster-probe '%s': %d ranks\n", o.label.c_str(), p);

  // ---- collectives --------------------------------------------------------------------
  collective_runner runner(std::max(o.max_bytes, o.overlap_bytes), p);
  const coll kinds[] = {coll::allreduce, coll::iallreduce, coll::iallgather, coll::ireduce_scatter};
  std::vector<double> sizes;
  for (double b = o.min_bytes; b <= o.max_bytes * 1.0001; b *= 4)
    sizes.push_back(std::floor(b / (4.0 * p)) * 4.0 * p); // whole floats per rank
  std::map<coll, std::vector<sample>> samples;
  std::map<coll, link> fits;
  for (coll c : kinds) {
    for (double bytes : sizes)
      samples[c].push_back({bytes, median(timed_reps([&] { runner.run(c, bytes); }, o.budget_us, o.min_reps))});
    fits[c] = fit_link(c, samples[c], o.fit_min_bytes, p);
  }

  // ---- compute: every rank at once, as in a training step ------------------------------
  const auto cal = concerto::cost::measure_cpu(); // one BLAS thread, the cores shared by all ranks
  hardware hw = cal.hw;
  hw.peak_tflops = median_over_ranks(hw.peak_tflops, p);
  hw.efficiency_half_dim = median_over_ranks(hw.efficiency_half_dim, p);
  hw.efficiency_half_flops = median_over_ranks(hw.efficiency_half_flops, p);
  hw.mem_bandwidth_gbs = median_over_ranks(hw.mem_bandwidth_gbs, p);
  hw.vector_tflops = median_over_ranks(hw.vector_tflops, p);
  hw.launch_us = median_over_ranks(hw.launch_us, p);
  gemm layer(o.gemm_m, o.gemm_n, o.gemm_k);
  const double layer_us = median(timed_reps([&] { layer.run(); }, 200e3, 3));
  const double layer_gflops = layer.flops() / layer_us / 1e3;
  // measure_cpu keeps each shape's best time, which is a rank that had a core to itself; a step
  // runs at the sustained rate of ranks sharing the cores. The fitted shape curve stays and the
  // peak is scaled so that the model prices the layer's sgemm at its median time.
  {
    const double d = std::min({o.gemm_m, o.gemm_n, o.gemm_k});
    const double f = layer.flops();
    const double eff = hw.max_efficiency * d / (d + hw.efficiency_half_dim) * f / (f + hw.efficiency_half_flops);
    const double sustained = f / (std::max(layer_us - hw.launch_us, 1.0) * eff * 1e6);
    report["compute_best_case_peak_gflops"] = hw.peak_tflops * 1e3;
    hw.peak_tflops = sustained;
  }

  // ---- overlap --------------------------------------------------------------------------
  const overlap_result ov = measure_overlap(o, runner, p);

  // ---- the calibration ------------------------------------------------------------------
  hw.name = "cpu-netns";
  hw.nodes = p;
  hw.ranks_per_node = 1;
  hw.algorithm = concerto::cost::collective_algorithm::ring; // forced by the launcher
  // Clamped: a side that made (almost) no progress beside the other would read as infinite.
  hw.overlap_slowdown = std::clamp(ov.compute_slowdown(), 1.0, 8.0);
  hw.comm_overlap_slowdown = std::clamp(ov.comm_slowdown(), 1.0, 8.0);
  // The executor's all-reduce is the non-blocking ring; it prices every collective. Every rank is
  // its own host here, so no two ranks share a node: a mesh axis crosses the network whatever
  // link class it is labelled with (mesh::from_world labels axes intra_node by default), and
  // both classes get the measured link.
  hw = concerto::cost::with_links(hw, fits[coll::iallreduce], fits[coll::iallreduce]);
  const concerto::cost::model model(hw);

  if (!root) return 0;
  std::printf("\n%-34s %12s %12s %10s %12s\n", "collective", "bytes", "median ms", "GB/s bus", "model err %");
  json colls = json::object();
  for (coll c : kinds) {
    json rows = json::array();
    for (const auto& s : samples[c]) {
      const auto [steps, volume] = terms(c, s.bytes, p);
      const double busbw = volume / s.us / 1e3;
      // The calibrated model prices every collective with the iallreduce link; the error shows
      // how far that is from what each collective really costs.
      const double pred = model.collective_us(kind_of(c), s.bytes, p, concerto::ir::link_class::inter_node);
      std::printf("%-34s %12.0f %12.3f %10.4f %+12.1f\n", name(c), s.bytes, s.us / 1e3, busbw,
                  100.0 * (pred - s.us) / s.us);
      rows.push_back({{"bytes", s.bytes}, {"median_us", s.us}, {"bus_gbps", busbw}, {"model_us", pred}});
      (void)steps;
    }
    colls[key(c)] = {{"samples", rows},
                     {"fit", {{"alpha_us", fits[c].alpha_us}, {"bandwidth_gbps", fits[c].bandwidth_gbps}}}};
    std::printf("%-34s fit: alpha %.1f us, bandwidth %.4f GB/s (%.2f Gbit/s)\n", name(c), fits[c].alpha_us,
                fits[c].bandwidth_gbps, 8 * fits[c].bandwidth_gbps);
  }
  std::printf("\nsgemm per rank, all %d ranks at once: peak fit %.1f GFLOP/s; %dx%dx%d: %.3f ms = %.1f GFLOP/s\n", p,
              hw.peak_tflops * 1e3, o.gemm_m, o.gemm_n, o.gemm_k, layer_us / 1e3, layer_gflops);
  std::printf("overlap, iallreduce %.0f B beside %d polled %d^3 sgemm chunks: comm %.2f ms, compute %.2f ms, "
              "both %.2f ms\n  ideal-overlap ratio max/both %.3f, overlap efficiency %.3f, compute slowdown %.3f, "
              "collective slowdown %.3f\n",
              ov.bytes, static_cast<int>(ov.chunks), o.chunk_dim, ov.comm_us / 1e3, ov.compute_us / 1e3,
              ov.both_us / 1e3, ov.ideal_ratio(), ov.efficiency(), ov.compute_slowdown(), ov.comm_slowdown());

  report["collectives"] = colls;
  report["compute"] = {{"peak_gflops_per_rank", hw.peak_tflops * 1e3},
                       {"gemm", {{"m", o.gemm_m}, {"n", o.gemm_n}, {"k", o.gemm_k}}},
                       {"gemm_median_us", layer_us},
                       {"gemm_gflops_per_rank", layer_gflops}};
  report["overlap"] = {{"bytes", ov.bytes},
                       {"chunk_dim", o.chunk_dim},
                       {"chunks", ov.chunks},
                       {"comm_us", ov.comm_us},
                       {"compute_us", ov.compute_us},
                       {"both_us", ov.both_us},
                       {"compute_during_us", ov.compute_during_us},
                       {"ideal_overlap_ratio", ov.ideal_ratio()},
                       {"overlap_efficiency", ov.efficiency()},
                       {"compute_slowdown", ov.compute_slowdown()},
                       {"comm_during_us", ov.comm_during_us},
                       {"comm_slowdown", ov.comm_slowdown()}};
  report["hardware"] = hw;
  if (!o.calibration_file.empty()) write_json(o.calibration_file, json(hw));
  if (!o.report_file.empty()) write_json(o.report_file, report);
  std::printf("\ncalibration '%s': inter_node alpha %.1f us, %.4f GB/s; peak %.1f GFLOP/s; overlap_slowdown %.3f, "
              "comm_overlap_slowdown %.3f\n",
              hw.name.c_str(), hw.inter_node.alpha_us, hw.inter_node.bandwidth_gbps, hw.peak_tflops * 1e3,
              hw.overlap_slowdown, hw.comm_overlap_slowdown);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rc = 0;
  try {
    rc = probe(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1); // one rank's failure must not leave the others waiting
  }
  MPI_Finalize();
  return rc;
}
