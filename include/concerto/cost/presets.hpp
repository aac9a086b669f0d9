#pragma once
/// @file
/// @brief The hardware presets: two GPU clusters from datasheets and published measurements,
/// and the machine this runs on (its cached calibration, else conservative defaults).
///
/// Every number carries its source. "Achievable" numbers are datasheet peaks times a measured
/// fraction; where only a neighbouring product was measured (A100 for A800), the scaling is
/// written out.
///
/// @code
/// for (const auto& name : cost::preset_names()) std::cout << cost::preset_hardware(name).peak_tflops;
/// @endcode

#include <concerto/cost/cpu_cache.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

namespace concerto::cost {

namespace presets {

/// @brief 32 × A800-80GB SXM: 4 nodes of 8, NVLink 400 GB/s, 800 Gbit/s per node (the paper's cluster).
[[nodiscard]] inline hardware a800x32() {
  hardware hw;
  hw.name = "a800x32";
  hw.nodes = 4;          // Concerto (ASPLOS'25) evaluation: 4 nodes × 8 A800-80GB
  hw.ranks_per_node = 8;
  // NVIDIA A800 datasheet (same SMs and clocks as A100 SXM 80GB): 312 TFLOP/s BF16 dense
  // tensor core, 19.5 TFLOP/s FP32 on CUDA cores, HBM2e 2039 GB/s.
  hw.peak_tflops = 312.0;
  hw.vector_tflops = 19.5;
  // Stream-like copy kernels (BabelStream) reach roughly 85-90% of HBM peak on A100-class
  // GPUs; 88% of 2039 GB/s.
  hw.mem_bandwidth_gbs = 2039.0 * 0.88;
  // Large cuBLAS BF16 GEMMs reach roughly 80% of the 312 TFLOP/s on A100 (NVIDIA Deep Learning
  // Performance guide, "Matrix Multiplication Background"); Megatron-LM reports 163 TFLOP/s per A100
  // (52% MFU) end to end on GPT-3 175B (Narayanan et al., SC'21), which includes non-GEMM
  // kernels, communication and the pipeline bubble that this model prices separately.
  hw.max_efficiency = 0.80;
  // Ampere CUTLASS/cuBLAS tiles are 128×128 or 128×256 with 64-wide minimum tiles: an
  // extent of 64 wastes about half of a tile.
  hw.efficiency_half_dim = 64;
  // A kernel worth ~2 µs at peak cannot fill 108 SMs nor hide its prologue and epilogue
  // (wave quantisation; cf. NVIDIA "GPU Performance Background": tile and wave quantisation).
  hw.efficiency_half_flops = 312e12 * 2e-6;
  // NVIDIA "Getting Started with CUDA Graphs" blog: a few µs of launch overhead per kernel.
  hw.launch_us = 2.0;
  // NCCL src/graph/tuning.cc: per-step hardware latency of Ring/Simple is 3.4 µs on NVLink and
  // 9.6 µs over the network (hwLat table).
  // NVLink 400 GB/s bidirectional on A800 = 200 GB/s per direction; nccl-tests all_reduce busbw
  // on 8×A100 SXM is ~230 of 300 GB/s (~77%), the same fraction of 200 gives ~155 GB/s.
  hw.intra_node = link{3.4, 155.0};
  // 800 Gbit/s per node = 100 GB/s shared by 8 ranks = 12.5 GB/s per rank when every rank of
  // the node talks across nodes (a data-parallel axis outside a tensor-parallel node);
  // nccl-tests over InfiniBand reach ~92% of line rate.
  hw.inter_node = link{9.6, 12.5 * 0.92};
  hw.algorithm = collective_algorithm::best;
  // Concerto slides: measured compute slowdowns of 18.2%, 21.9% and 23.8% under concurrent
  // NCCL collectives; the authors use 1.2.
  hw.overlap_slowdown = 1.2;
  return hw;
}

/// @brief 64 × H100 SXM: 8 nodes of 8, NVLink 900 GB/s, 8 × 400 Gbit/s per node.
[[nodiscard]] inline hardware h100x64() {
  hardware hw;
  hw.name = "h100x64";
  hw.nodes = 8;
  hw.ranks_per_node = 8;
  // NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense (1979 with sparsity), 67 TFLOP/s FP32,
  // HBM3 3.35 TB/s.
  hw.peak_tflops = 989.0;
  hw.vector_tflops = 67.0;
  hw.mem_bandwidth_gbs = 3350.0 * 0.88; // same achievable fraction as A800 (BabelStream-like)
  // Large BF16 GEMMs reach ~700-750 TFLOP/s on H100 SXM (cuBLAS 12, 8192² shapes);
  // end to end, the Llama 3 paper reports 38-43% MFU on 16K H100s.
  hw.max_efficiency = 0.75;
  // Hopper WGMMA tiles are 128 × (64..256): thin shapes waste more than on Ampere.
  hw.efficiency_half_dim = 128;
  // Same ~2 µs-at-peak rule as A800: 132 SMs need proportionally more work to fill.
  hw.efficiency_half_flops = 989e12 * 2e-6;
  hw.launch_us = 2.0; // NVIDIA CUDA Graphs blog, as for A800
  // NCCL tuning.cc hwLat as above. NVLink 4: 900 GB/s bidirectional = 450 per direction;
  // nccl-tests ring all_reduce busbw on 8×H100 SXM is ~360 GB/s (~80%; NVLS reaches more).
  hw.intra_node = link{3.4, 360.0};
  // One 400 Gbit/s NIC per GPU = 50 GB/s per rank, ~92% reachable (nccl-tests over NDR IB).
  hw.inter_node = link{9.6, 50.0 * 0.92};
  hw.algorithm = collective_algorithm::best;
  hw.overlap_slowdown = 1.2; // Concerto slides (measured on A800); no separate H100 figure
  return hw;
}

/// @brief The conservative defaults of the "cpu" preset, used until calibrate_cpu has run.
///
/// They describe one modest x86 core so that a plan made before calibration is not
/// optimistic about compute: a single AVX2 core at ~3 GHz peaks near 100 GFLOP/s FP32
/// (2 FMA units × 8 lanes × 2 flops); half of that is assumed. A single core streams
/// 10-15 GB/s on DDR4; 5 is assumed.
[[nodiscard]] inline hardware cpu_defaults() {
  hardware hw;
  hw.name = "cpu";
  hw.nodes = 1;
  hw.ranks_per_node = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  hw.peak_tflops = 0.05;
  hw.vector_tflops = 0.01;       // auto-vectorised loops: a fifth of the BLAS rate
  hw.mem_bandwidth_gbs = 5.0;
  hw.max_efficiency = 1.0;       // peak_tflops is already the reachable sgemm rate
  hw.efficiency_half_dim = 16;   // OpenBLAS micro-kernels are ~16×(4..8) register tiles
  hw.efficiency_half_flops = 1e6; // ~20 µs of work: call overhead, packing, cache warm-up
  hw.launch_us = 1.0;            // a task handed to a thread: a futex wake-up is ~1 µs
  // Open MPI shared memory (vader/sm BTL): OSU osu_latency reports 0.2-0.5 µs and osu_bw
  // several GB/s on idle servers; this machine's 2 cores are shared, so 2 µs and 2 GB/s.
  hw.intra_node = link{2.0, 2.0};
  // The emulated cluster of BENCHMARKS.md §3: veth pairs shaped with tc to 1 Gbit/s
  // (0.125 GB/s, ~94% TCP goodput) and tens of µs of TCP latency through the namespaces.
  hw.inter_node = link{50.0, 0.125 * 0.94};
  hw.algorithm = collective_algorithm::best;
  // Compute and a shared-memory collective contend for memory bandwidth and, with 2 cores,
  // for the cores themselves; calibrate_cpu measures it.
  hw.overlap_slowdown = 1.1;
  return hw;
}

} // namespace presets

/// @brief Where the "cpu-netns" preset reads its calibration: $CONCERTO_COST_FILE if set, else
/// cost-cpu-netns.json in cache_dir() ($CONCERTO_CACHE_DIR first).
///
/// The emulated cluster (bench/cluster) is measured, not derived from a datasheet: its probe
/// writes a hardware JSON per cluster configuration, and the runner points this at the one of
/// the configuration being measured, so one name serves every configuration.
[[nodiscard]] inline std::filesystem::path cpu_netns_file() {
  if (const char* f = std::getenv("CONCERTO_COST_FILE"); f && *f) return f;
  return cache_dir() / "cost-cpu-netns.json";
}

/// @brief The hardware in a calibration file written by bench/cluster's probe (or any
/// cost::hardware JSON). Throws concerto::error naming the file when it is missing or bad.
/// @code
/// auto hw = cost::load_hardware_file("build-cluster/cluster-results/full/cpu-netns-4x1gbit.json");
/// @endcode
[[nodiscard]] inline hardware load_hardware_file(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in)
    fail("cost calibration file '" + file.string() +
         "' cannot be read (the cpu-netns preset reads $CONCERTO_COST_FILE, else cost-cpu-netns.json in "
         "$CONCERTO_CACHE_DIR; bench/cluster/run writes one per cluster configuration)");
  try {
    return nlohmann::json::parse(in).get<hardware>();
  } catch (const std::exception& e) { // a parse error, or concerto::error naming the field
    fail("cost calibration file '" + file.string() + "': " + e.what());
  }
}

/// @brief Names accepted by model::preset and preset_hardware.
[[nodiscard]] inline std::vector<std::string> preset_names() { return {"a800x32", "h100x64", "cpu", "cpu-netns"}; }

/// @brief The hardware of a named preset; "cpu" reads this machine's cached calibration
/// (see cpu_cache.hpp) and falls back to presets::cpu_defaults(); "cpu-netns" reads
/// cpu_netns_file() and has no fallback (a guess would make every prediction meaningless). Throws concerto::error
/// naming an unknown preset and listing the known ones.
[[nodiscard]] inline hardware preset_hardware(std::string_view name) {
  if (name == "a800x32") return presets::a800x32();
  if (name == "h100x64") return presets::h100x64();
  if (name == "cpu") return load_cpu_cache(cpu_cache_file()).value_or(presets::cpu_defaults());
  if (name == "cpu-netns") return load_hardware_file(cpu_netns_file());
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown hardware preset '" + std::string(name) + "'; known presets: " + known);
}

} // namespace concerto::cost
