// Kernel figures for the cost model on one GPU: cuBLASLt matmul efficiency by shape (fp32,
// TF32 and bf16, on random inputs: tensor-core power and clocks depend on the data), and the
// slowdown of a matmul while a device copy or an NCCL all-reduce runs on another stream (SM and
// memory contention). Run as one rank (bench/gpu/run does), NCCL has nothing to reduce with and
// runs each all-reduce as a device copy (cudaMemcpyAsync, no NCCL kernel, so max_channels
// changes nothing): those rows are labelled as such, and measure copy contention, not NCCL's.
// Then the time of each kernel one block of the GPU-sized GPT of bench/gpu/run calls (width
// 1024, 16 heads, 256 tokens x 32 sequences, ffn 4096; fp32 products with and without TF32),
// so that its measured step can be taken apart kernel by kernel, and the 16-bit-native kernels on
// bf16 operands beside them. Then convolutions at Wide-ResNet
// shapes (the 250M model's stem, a 1x1 reduce, 3x3 convs at stride 1 and 2; 8 images): forward
// and both gradients, concerto's own kernels next to cuDNN's plans (fp32 and TF32). Then causal
// attention at a long-context shape (batch 4, seq 2048, 16 heads of 128): cuDNN's fused SDPA in
// bf16 (where built with its frontend) next to concerto's own tiled fp32 kernels, as TFLOP/s and
// % of the device's dense bf16 peak.
// Writes JSON to argv[1] (default gpu_bench.json).
// Build: bench/gpu/run does it (nvcc, one translation unit).
#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/convolution.hpp>
#include <concerto/runtime/cuda/cudnn_attention.hpp>
#include <concerto/runtime/cuda/kernels.cuh>
#include <concerto/runtime/cuda/memory.hpp>
#include <concerto/runtime/cuda/stream.hpp>
#include <concerto/runtime/nccl/communicator.hpp>

#include <cuda_bf16.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace cu = concerto::runtime::cuda;

namespace {

// Uniform values in [-1, 1) from a hash of the index: random enough to keep the tensor cores
// busy with real data (zeros let the hardware save power and boost clocks), and reproducible.
template <class T>
__global__ void fill_uniform(T* out, std::size_t n, std::uint32_t seed) {
  const std::size_t step = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += step) {
    std::uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float v = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
    if constexpr (sizeof(T) == 4) out[i] = v;
    else out[i] = __float2bfloat16(v);
  }
}

// Fills `p` with random values of a product's input type, and waits: the timed streams are
// non-blocking and would not wait for work on the legacy stream.
void fill_random(const cu::device_buffer& p, cu::gemm_type type, std::uint32_t seed) {
  if (type == cu::gemm_type::f32)
    fill_uniform<<<1024, 256>>>(p.as<float>(), p.size() / 4, seed);
  else
    fill_uniform<<<1024, 256>>>(p.as<__nv_bfloat16>(), p.size() / 2, seed);
  cu::check(cudaGetLastError(), "fill_uniform");
  cu::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// Mean milliseconds of `reps` back-to-back runs of f on s, after a warm-up.
template <class F>
float time_ms(cudaStream_t s, int reps, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  cu::event a(true), b(true);
  a.record(s);
  for (int i = 0; i < reps; ++i) f();
  b.record(s);
  b.synchronize();
  return cu::event::elapsed_ms(a, b) / static_cast<float>(reps);
}

// Convolutions at Wide-ResNet shapes (8 images), each pass by concerto's own kernels and by
// cuDNN's plans (fp32, TF32): JSON rows, printed as they are measured. A, B, C are random
// buffers large enough for every operand.
std::string conv_rows(const cu::device_buffer& A, const cu::device_buffer& B, const cu::device_buffer& C,
                      const cu::device_buffer& ws, cudaStream_t s) {
  std::string json;
  bool first = true;
  struct conv_case {
    const char* name;
    concerto::ir::conv_geometry g;
  };
  const conv_case cases[] = {{"stem 7x7/2 3->160 224^2", {8, 224, 224, 3, 160, 7, 7, 2, 3}},
                             {"reduce 1x1 640->160 56^2", {8, 56, 56, 640, 160, 1, 1, 1, 0}},
                             {"mid 3x3 320->320 56^2", {8, 56, 56, 320, 320, 3, 3, 1, 1}},
                             {"mid 3x3/2 640->640 56^2", {8, 56, 56, 640, 640, 3, 3, 2, 1}}};
  const char* pass_names[] = {"forward", "grad_input", "grad_weight"};
  cu::dnn_handle dnn;
  float* x = A.as<float>();  // x, or dy for the image's gradient
  float* w = B.as<float>();  // w, or dy for the kernel's gradient
  float* y = C.as<float>();
  for (const auto& c : cases)
    for (int pass = 0; pass < 3; ++pass) {
      const auto& g = c.g;
      const float own = time_ms(s, 3, [&] {
        if (pass == 0) cu::conv2d(x, w, y, g, s);
        else if (pass == 1) cu::conv2d_grad_input(x, w, y, g, s);
        else cu::conv2d_grad_weight(x, w, y, g, false, s);
      });
      float dnn_ms[2] = {-1.0f, -1.0f};
      std::string layout[2] = {"none", "none"};
      for (const bool tf32 : {false, true}) {
        const cu::conv_plan plan(dnn, {.geometry = g, .pass = static_cast<cu::conv_pass>(pass), .allow_tf32 = tf32,
                                       .workspace_limit = ws.size()});
        if (!plan) {
          std::printf("conv %s %s: cuDNN %s: %s\n", c.name, pass_names[pass], tf32 ? "tf32" : "fp32", plan.reason().c_str());
          continue;
        }
        // A KRSC plan's kernel transpose (dispatch.cuh stages it) is not timed: it moves the weights once.
        layout[tf32] = plan.filter() == cu::filter_layout::hwio ? "hwio" : "krsc";
        dnn_ms[tf32] = time_ms(s, 5, [&] { plan.run(dnn, x, w, y, ws.data(), s); });
      }
      const double tflop = g.flops() / 1e12;
      char row[400];
      std::snprintf(row, sizeof row,
                    "%s    {\"conv\": \"%s\", \"pass\": \"%s\", \"gflop\": %.2f, \"own_ms\": %.4f, "
                    "\"cudnn_fp32_ms\": %.4f, \"cudnn_tf32_ms\": %.4f, \"cudnn_filter\": [\"%s\", \"%s\"]}",
                    first ? "" : ",\n", c.name, pass_names[pass], tflop * 1e3, own, dnn_ms[0], dnn_ms[1],
                    layout[0].c_str(), layout[1].c_str());
      json += row;
      first = false;
      std::printf("conv %-26s %-11s own %8.3f ms (%6.1f TFLOP/s)  cuDNN fp32 %8.3f ms (%6.1f)  tf32 %8.3f ms (%6.1f)\n",
                  c.name, pass_names[pass], own, tflop / (own * 1e-3), dnn_ms[0],
                  dnn_ms[0] > 0 ? tflop / (dnn_ms[0] * 1e-3) : 0.0, dnn_ms[1],
                  dnn_ms[1] > 0 ? tflop / (dnn_ms[1] * 1e-3) : 0.0);
    }
  return json;
}

// Dense bf16 tensor-core peak of the device in TFLOP/s from NVIDIA's data sheets (no runtime
// query gives it), or 0 where the device is not listed (the rows then carry no percentage).
double bf16_peak_tflops(const cudaDeviceProp& prop) {
  const std::string name = prop.name;
  const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  if (has("H200")) return 989.4;
  if (has("H100")) return has("PCIe") ? 756.5 : has("NVL") ? 835.5 : 989.4;
  if (has("A100")) return 312.0;
  return 0.0;
}

// Causal attention, batch 4, seq 2048, 16 heads of 128 (a long-context layer): cuDNN's fused SDPA
// in bf16, forward (with lse), backward from the forward's out and lse, and backward recomputing
// them (what a pipeline keeping neither runs); then concerto's own tiled kernels, which take fp32
// (the inputs widened once, outside the timing). FLOPs count the products the causal mask leaves
// (half the square): forward 2 of them, 4·b·h·s²·d/2; backward 5, 10·b·h·s²·d/2.
std::string attention_rows(const cudaDeviceProp& prop, cudaStream_t s) {
  const concerto::runtime::cpu::attention_shape att{.batch = 4, .seq = 2048, .heads = 16, .head_dim = 128};
  const double square = static_cast<double>(att.batch * att.heads) * static_cast<double>(att.seq * att.seq) *
                        static_cast<double>(att.head_dim) / 2.0;
  const double fwd_flops = 4.0 * square, bwd_flops = 10.0 * square, peak = bf16_peak_tflops(prop);
  std::string json;
  const auto row = [&](const char* impl, const char* pass, std::optional<float> ms, double flops) {
    char line[320];
    const double tflops = ms ? flops / (*ms * 1e-3) / 1e12 : 0.0;
    if (!ms)
      std::snprintf(line, sizeof line, "%s    {\"impl\": \"%s\", \"pass\": \"%s\", \"ms\": null, \"note\": \"not run: no frontend, or cuDNN refused\"}",
                    json.empty() ? "" : ",\n", impl, pass);
    else if (peak > 0)
      std::snprintf(line, sizeof line, "%s    {\"impl\": \"%s\", \"pass\": \"%s\", \"ms\": %.4f, \"tflops\": %.2f, \"bf16_peak_pct\": %.1f}",
                    json.empty() ? "" : ",\n", impl, pass, *ms, tflops, 100.0 * tflops / peak);
    else
      std::snprintf(line, sizeof line, "%s    {\"impl\": \"%s\", \"pass\": \"%s\", \"ms\": %.4f, \"tflops\": %.2f, \"bf16_peak_pct\": null}",
                    json.empty() ? "" : ",\n", impl, pass, *ms, tflops);
    json += line;
    if (ms)
      std::printf("attention b4 s2048 h16 d128 causal %-16s %-28s %8.3f ms (%6.1f TFLOP/s, %5.1f%% of bf16 peak %.0f)\n", impl, pass,
                  *ms, tflops, peak > 0 ? 100.0 * tflops / peak : 0.0, peak);
    else
      std::printf("attention b4 s2048 h16 d128 causal %-16s %-28s not run (no frontend, or cuDNN refused)\n", impl, pass);
  };
  const std::size_t nq = att.q_floats(), nkv = att.kv_floats(), nl = att.lse_floats();
  const auto bf16 = concerto::ir::dtype::bf16;
  // bf16 operands: q, k, v, dout random; out, dq, dk, dv written.
  cu::device_buffer q(nq * 2), k(nkv * 2), v(nkv * 2), dout(nq * 2), out(nq * 2), dq(nq * 2), dk(nkv * 2), dv(nkv * 2),
      lse(nl * 4);
  std::uint32_t seed = 50;
  for (const auto* b : {&q, &k, &v, &dout}) fill_random(*b, cu::gemm_type::bf16, seed++);
  if constexpr (cu::cudnn_attention_available) {
    cu::dnn_handle dnn;
    cu::cudnn_attention_cache cache(dnn.get());
    const auto fwd_bytes = cu::cudnn_attention_workspace_bytes(cache, att, bf16, cu::cudnn_attention_pass::forward_with_lse);
    const auto bwd_bytes = cu::cudnn_attention_workspace_bytes(cache, att, bf16, cu::cudnn_attention_pass::backward, true);
    if (!fwd_bytes || !bwd_bytes)
      concerto::fail("gpu_bench: cuDNN's SDPA refused the attention rows' shape (" + cache.last_refusal() +
                     "); a cuDNN older than 9 or a device before sm_80 lacks it");
    cu::device_buffer ws(std::max<std::size_t>({*fwd_bytes, *bwd_bytes, 1}));
    cu::cudnn_attention_operands ops{.q = q.data(), .k = k.data(), .v = v.data(), .out = out.data(), .lse = lse.as<float>(),
                                     .dout = dout.data(), .dq = dq.data(), .dk = dk.data(), .dv = dv.data()};
    const auto must = [&](bool ran) {
      if (!ran) concerto::fail("gpu_bench: cuDNN's SDPA refused a call whose graph it had built (operand alignment?)");
    };
    const float fwd = time_ms(s, 10, [&] { must(cu::cudnn_attention_forward(cache, s, bf16, att, ops, ws.data(), ws.size())); });
    const float bwd = time_ms(s, 10, [&] { must(cu::cudnn_attention_backward(cache, s, bf16, att, ops, ws.data(), ws.size())); });
    auto recomputing = ops;
    recomputing.out = nullptr;
    recomputing.lse = nullptr;
    const float bwd_re =
        time_ms(s, 10, [&] { must(cu::cudnn_attention_backward(cache, s, bf16, att, recomputing, ws.data(), ws.size())); });
    // cuDNN's own choice for the backward (atomics into dQ, not repeatable): what determinism costs.
    cu::cudnn_attention_cache any_order(dnn.get(), {.deterministic = false});
    const auto free_bytes = cu::cudnn_attention_workspace_bytes(any_order, att, bf16, cu::cudnn_attention_pass::backward);
    std::optional<float> bwd_any;
    if (free_bytes) {
      cu::device_buffer free_ws(std::max<std::size_t>(*free_bytes, 1));
      bwd_any = time_ms(s, 10, [&] { must(cu::cudnn_attention_backward(any_order, s, bf16, att, ops, free_ws.data(), free_ws.size())); });
    }
    row("cudnn bf16", "forward", fwd, fwd_flops);
    row("cudnn bf16", "backward", bwd, bwd_flops);
    row("cudnn bf16", "forward+backward", fwd + bwd, fwd_flops + bwd_flops);
    row("cudnn bf16", "backward recomputing forward", bwd_re, bwd_flops); // the forward's flops not counted: useful work only
    row("cudnn bf16", "backward nondeterministic", bwd_any, bwd_flops);
    std::printf("attention workspace bytes: forward %zu, deterministic backward recomputing %zu, nondeterministic backward %zu\n",
                *fwd_bytes, *bwd_bytes, free_bytes.value_or(0));
  } else {
    row("cudnn bf16", "forward", std::nullopt, fwd_flops);
    row("cudnn bf16", "backward", std::nullopt, bwd_flops);
  }
  // The own kernels on fp32 copies of the same values.
  cu::device_buffer q32(nq * 4), k32(nkv * 4), v32(nkv * 4), dout32(nq * 4), out32(nq * 4), lse32(nl * 4), dq32(nq * 4),
      dk32(nkv * 4), dv32(nkv * 4), delta(cu::causal_attention_grad_workspace_floats(att) * 4);
  cu::convert(bf16, q.data(), concerto::ir::dtype::f32, q32.data(), nq, s);
  cu::convert(bf16, k.data(), concerto::ir::dtype::f32, k32.data(), nkv, s);
  cu::convert(bf16, v.data(), concerto::ir::dtype::f32, v32.data(), nkv, s);
  cu::convert(bf16, dout.data(), concerto::ir::dtype::f32, dout32.data(), nq, s);
  const auto f = [](const cu::device_buffer& b) { return b.as<float>(); };
  const float own_fwd = time_ms(s, 3, [&] { cu::causal_attention(f(q32), f(k32), f(v32), f(out32), f(lse32), att, s); });
  const float own_bwd = time_ms(s, 3, [&] {
    cu::causal_attention_grad(f(q32), f(k32), f(v32), f(out32), f(dout32), f(lse32), f(dq32), f(dk32), f(dv32), f(delta), att, s);
  });
  row("own tiled fp32", "forward", own_fwd, fwd_flops);
  row("own tiled fp32", "backward", own_bwd, bwd_flops);
  row("own tiled fp32", "forward+backward", own_fwd + own_bwd, fwd_flops + bwd_flops);
  return json;
}

} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::string out_path = argc > 1 ? argv[1] : "gpu_bench.json";
  if (cu::device_count() == 0) {
    std::fprintf(stderr, "gpu_bench: no CUDA device\n");
    MPI_Finalize();
    return 4;
  }
  cudaDeviceProp prop{};
  cu::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  cu::stream compute(cu::stream_priorities().least), side(cu::stream_priorities().greatest);
  cu::blas_handle lt;
  cu::device_buffer ws(cu::gemm::default_workspace);
  const std::size_t max_elems = std::size_t{8192} * 8192;
  // Inputs of each type hold random values of that type (bf16 would read fp32 bits as garbage).
  cu::device_buffer A(max_elems * 4), B(max_elems * 4), C(max_elems * 4), A16(max_elems * 2), B16(max_elems * 2);
  fill_random(A, cu::gemm_type::f32, 1);
  fill_random(B, cu::gemm_type::f32, 2);
  fill_random(A16, cu::gemm_type::bf16, 3);
  fill_random(B16, cu::gemm_type::bf16, 4);
  std::string json = "{\n  \"device\": \"" + std::string(prop.name) + "\",\n  \"sms\": " + std::to_string(prop.multiProcessorCount) +
                     ",\n  \"matmul\": [\n";
  const std::size_t shapes[][3] = {{256, 256, 256},   {512, 512, 512},    {1024, 1024, 1024}, {2048, 2048, 2048},
                                   {4096, 4096, 4096}, {8192, 8192, 8192}, {2048, 768, 768},   {2048, 3072, 768},
                                   {2048, 768, 3072},  {8192, 4096, 1024}, {128, 4096, 4096}};
  bool first = true;
  for (const auto& sh : shapes)
    for (int kind = 0; kind < 3; ++kind) { // fp32, tf32, bf16
      cu::gemm_shape g{.m = sh[0], .n = sh[1], .k = sh[2]};
      if (kind == 1) g.allow_tf32 = true;
      if (kind == 2) g.ab = g.c = cu::gemm_type::bf16;
      cu::gemm p(lt, g, ws.size());
      const double flops = 2.0 * static_cast<double>(sh[0] * sh[1]) * static_cast<double>(sh[2]);
      const int reps = flops > 1e11 ? 5 : 20;
      const auto& a = kind == 2 ? A16 : A;
      const auto& b = kind == 2 ? B16 : B;
      const float ms = time_ms(compute.get(), reps, [&] { p.run(lt, a.data(), b.data(), C.data(), ws.data(), compute.get()); });
      const char* names[] = {"fp32", "tf32", "bf16"};
      char line[256];
      std::snprintf(line, sizeof line, "%s    {\"m\": %zu, \"n\": %zu, \"k\": %zu, \"type\": \"%s\", \"ms\": %.4f, \"tflops\": %.2f}",
                    first ? "" : ",\n", sh[0], sh[1], sh[2], names[kind], ms, flops / (ms * 1e-3) / 1e12);
      json += line;
      first = false;
      std::printf("matmul %5zu x %5zu x %5zu %s: %.3f ms, %.1f TFLOP/s\n", sh[0], sh[1], sh[2], names[kind], ms,
                  flops / (ms * 1e-3) / 1e12);
    }
  json += "\n  ],\n  \"gpt_block_kernels\": [\n";
  first = true;
  const auto kernel_row = [&](const char* name, float ms) {
    char row[200];
    std::snprintf(row, sizeof row, "%s    {\"kernel\": \"%s\", \"ms\": %.4f}", first ? "" : ",\n", name, ms);
    json += row;
    first = false;
    std::printf("gpt block (8192 x 1024, 16 heads of 64, seq 256): %-34s %.3f ms\n", name, ms);
  };
  {
    constexpr std::size_t rows = 8192, width = 1024, ffn = 4096, vocab = 80;
    const concerto::runtime::cpu::attention_shape att{.batch = 32, .seq = 256, .heads = 16, .head_dim = 64};
    for (const bool tf32 : {false, true})
      for (const auto& sh : {std::array<std::size_t, 3>{rows, 3 * width, width}, {rows, width, width}, {rows, ffn, width},
                             {rows, width, ffn}}) {
        cu::gemm p(lt, {.m = sh[0], .n = sh[1], .k = sh[2], .allow_tf32 = tf32}, ws.size());
        const float ms = time_ms(compute.get(), 10, [&] { p.run(lt, A.data(), B.data(), C.data(), ws.data(), compute.get()); });
        const std::string name = std::string("matmul ") + std::to_string(sh[0]) + "x" + std::to_string(sh[1]) + "x" +
                                 std::to_string(sh[2]) + (tf32 ? " tf32" : " fp32");
        kernel_row(name.c_str(), ms);
      }
    // Distinct random buffers, each as large as the largest operand (rows x ffn floats).
    std::vector<cu::device_buffer> t;
    for (int i = 0; i < 8; ++i) {
      t.emplace_back(rows * ffn * 4);
      fill_random(t.back(), cu::gemm_type::f32, 10 + i);
    }
    const auto f = [&](int i) { return t[static_cast<std::size_t>(i)].as<float>(); };
    cu::device_buffer targets(rows * 4), status(4), step(8);
    cu::check(cudaMemset(targets.data(), 0, rows * 4), "cudaMemset");
    cu::check(cudaMemset(status.data(), 0, 4), "cudaMemset");
    const std::int64_t one = 1;
    cu::check(cudaMemcpy(step.data(), &one, 8, cudaMemcpyHostToDevice), "cudaMemcpy");
    const auto s = compute.get();
    kernel_row("causal_attention", time_ms(s, 10, [&] { cu::causal_attention(f(0), f(1), f(2), f(3), f(4), att, s); }));
    kernel_row("causal_attention_grad", time_ms(s, 10, [&] {
                 cu::causal_attention_grad(f(0), f(1), f(2), f(3), f(5), f(4), f(6), f(7), f(3), C.as<float>(), att, s);
               }));
    kernel_row("layernorm", time_ms(s, 10, [&] { cu::layernorm(f(0), f(1), f(2), f(3), f(4), f(5), rows, width, 1e-5f, s); }));
    kernel_row("layernorm_grad", time_ms(s, 10, [&] {
                 cu::layernorm_grad(f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), rows, width, false, s);
               }));
    kernel_row("gelu (8192 x 4096)", time_ms(s, 10, [&] { cu::gelu(f(0), f(1), rows * ffn, s); }));
    kernel_row("gelu_grad (8192 x 4096)", time_ms(s, 10, [&] { cu::gelu_grad(f(0), f(1), f(2), rows * ffn, s); }));
    kernel_row("bias_add_grad (8192 x 4096)", time_ms(s, 10, [&] { cu::bias_add_grad(f(0), f(1), rows, ffn, false, s); }));
    kernel_row("add (8192 x 1024)", time_ms(s, 10, [&] { cu::add(f(0), f(1), f(2), rows * width, s); }));
    kernel_row("adamw_update (one block, 12.6M)", time_ms(s, 10, [&] {
                 cu::adamw_update(f(0), f(1), f(2), f(3), 12 * width * width, {}, {}, step.as<std::int64_t>(), nullptr, 0.0f, s);
               }));
    kernel_row("cross_entropy (8192 x 80)", time_ms(s, 10, [&] {
                 cu::cross_entropy(f(0), targets.as<std::int32_t>(), f(1), f(2), rows, vocab, status.as<int>(), 1, s);
               }));
    kernel_row("cross_entropy_grad (8192 x 80)", time_ms(s, 10, [&] {
                 cu::cross_entropy_grad(f(0), targets.as<std::int32_t>(), f(1), f(2), rows, vocab, 1.0f, s);
               }));
    // The same kernels on bf16 activations read in place (dispatch.cuh's reads_16bit_natively;
    // statistics, lse and weight gradients in f32), and the gain and bias sums in two levels.
    std::vector<cu::device_buffer> h;
    for (int i = 0; i < 8; ++i) {
      h.emplace_back(rows * ffn * 2);
      fill_random(h.back(), cu::gemm_type::bf16, 20 + i);
    }
    const auto bf = [&](int i) { return cu::float_in{h[static_cast<std::size_t>(i)].data(), concerto::ir::dtype::bf16}; };
    const auto bf_out = [&](int i) { return cu::float_out{h[static_cast<std::size_t>(i)].data(), concerto::ir::dtype::bf16}; };
    const std::size_t sums = std::max(cu::column_sum_workspace_floats(rows, width, 2), cu::column_sum_workspace_floats(rows, ffn));
    cu::device_buffer partials(sums * 4 + 4);
    float* const two_level = partials.as<float>();
    kernel_row("causal_attention bf16", time_ms(s, 10, [&] { cu::causal_attention(bf(0), bf(1), bf(2), bf_out(3), f(4), att, s); }));
    kernel_row("causal_attention_grad bf16", time_ms(s, 10, [&] {
                 cu::causal_attention_grad(bf(0), bf(1), bf(2), f(3), bf(5), f(4), bf_out(6), bf_out(7), bf_out(3), C.as<float>(), att, s);
               }));
    kernel_row("layernorm bf16", time_ms(s, 10, [&] { cu::layernorm(bf(0), f(1), f(2), bf_out(3), f(4), f(5), rows, width, 1e-5f, s); }));
    kernel_row("layernorm_grad bf16, two-level sums", time_ms(s, 10, [&] {
                 cu::layernorm_grad(bf(0), bf(1), f(2), f(3), f(4), bf_out(5), f(6), f(7), rows, width, false, s, two_level);
               }));
    kernel_row("gelu bf16 (8192 x 4096)", time_ms(s, 10, [&] { cu::gelu(bf(0), bf_out(1), rows * ffn, s); }));
    kernel_row("gelu_grad bf16 (8192 x 4096)", time_ms(s, 10, [&] { cu::gelu_grad(bf(0), bf(1), bf_out(2), rows * ffn, s); }));
    kernel_row("bias_add_grad two-level (8192 x 4096)", time_ms(s, 10, [&] { cu::bias_add_grad(f(0), f(1), rows, ffn, false, s, two_level); }));
    kernel_row("bias_add_grad bf16, two-level (8192 x 4096)", time_ms(s, 10, [&] {
                 cu::bias_add_grad(bf(0), f(1), rows, ffn, false, s, two_level);
               }));
    kernel_row("add bf16 (8192 x 1024)", time_ms(s, 10, [&] { cu::add(bf(0), bf(1), bf_out(2), rows * width, s); }));
    kernel_row("cross_entropy_grad bf16 (8192 x 80)", time_ms(s, 10, [&] {
                 cu::cross_entropy_grad(bf(0), targets.as<std::int32_t>(), f(1), bf_out(2), rows, vocab, 1.0f, s);
               }));
  }
  json += "\n  ],\n  \"attention\": [\n" + attention_rows(prop, compute.get());
  json += "\n  ],\n  \"conv\": [\n" + conv_rows(A, B, C, ws, compute.get());
  // Overlap: a bf16 4096^3 matmul alone, then
  // while a 256 MiB D2D copy or an NCCL all-reduce of 256 MiB runs on a second stream. With
  // one rank the all-reduce is a device copy (see the file comment), labelled so.
  cu::gemm big(lt, {.m = 4096, .n = 4096, .k = 4096, .ab = cu::gemm_type::bf16, .c = cu::gemm_type::bf16}, ws.size());
  const auto run_big = [&] { big.run(lt, A16.data(), B16.data(), C.data(), ws.data(), compute.get()); };
  const float alone = time_ms(compute.get(), 20, run_big);
  const std::size_t copy_bytes = std::size_t{256} << 20;
  cu::device_buffer src(copy_bytes), dst(copy_bytes);
  const auto overlapped = [&](auto&& side_work) {
    // The side stream's work is queued long enough to cover every timed matmul.
    for (int i = 0; i < 40; ++i) side_work();
    const float ms = time_ms(compute.get(), 20, run_big);
    side.synchronize();
    return ms;
  };
  const float with_copy = overlapped([&] {
    cu::check(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, side.get()), "cudaMemcpyAsync");
  });
  std::string nccl_json;
  for (const int channels : {-1, 2, 8}) {
    auto comm = concerto::runtime::nccl::communicator::from_mpi(
        concerto::runtime::mpi::control(MPI_COMM_WORLD, concerto::runtime::default_timeout_s), {.max_channels = channels});
    const float with_ar = overlapped([&] {
      concerto::runtime::nccl::check(ncclAllReduce(src.data(), dst.data(), copy_bytes / 4, ncclFloat32, ncclSum, comm.get(),
                                                   side.get()),
                                     "ncclAllReduce");
    });
    char line[200];
    std::snprintf(line, sizeof line, "%s    {\"ranks\": %d, \"max_channels\": %d, \"ms\": %.4f, \"slowdown\": %.3f}",
                  nccl_json.empty() ? "" : ",\n", ranks, channels, with_ar, with_ar / alone);
    nccl_json += line;
    if (ranks == 1)
      std::printf("matmul while a one-rank all-reduce (NCCL runs it as a device copy; max_channels %d): %.3f ms (x%.2f)\n",
                  channels, with_ar, with_ar / alone);
    else
      std::printf("matmul while an all-reduce over %d ranks (max_channels %d): %.3f ms (x%.2f)\n", ranks, channels, with_ar,
                  with_ar / alone);
  }
  char line[400];
  std::snprintf(line, sizeof line,
                "\n  ],\n  \"overlap\": {\"matmul\": \"bf16 4096^3\", \"alone_ms\": %.4f, \"with_copy_ms\": %.4f, "
                "\"copy_slowdown\": %.3f,\n  \"with_allreduce\": [\n",
                alone, with_copy, with_copy / alone);
  json += line;
  json += nccl_json + "\n  ],\n  \"with_allreduce_note\": \"" +
          std::string(ranks == 1 ? "one rank: NCCL runs each all-reduce as a device copy (no NCCL kernel; max_channels has "
                                   "no effect), so these rows measure copy contention"
                                 : "all-reduce across the ranks") +
          "\"}\n}\n";
  std::printf("matmul alone %.3f ms, with a D2D copy %.3f ms (x%.2f)\n", alone, with_copy, with_copy / alone);
  if (FILE* f = std::fopen(out_path.c_str(), "w")) {
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  MPI_Finalize();
  return 0;
}
