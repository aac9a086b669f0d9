#!/usr/bin/env python3
"""concerto's CPU convolutions next to PyTorch's (oneDNN, channels-last) on the same shapes, one
thread each, in one run: build/bench/cpu_kernels/cpu-conv --csv times ours (forward, the
image's gradient, the kernel's, and a BLAS product of the same FLOPs); this times
torch.nn.functional.conv2d forward and backward. Medians of --reps.

    OPENBLAS_NUM_THREADS=1 python3 bench/cpu_kernels/conv_vs_torch.py [--binary PATH] [--reps 9]
"""
import argparse
import statistics
import subprocess
import time

import torch


def median_ms(reps, fn):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/bench/cpu_kernels/cpu-conv")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ours = subprocess.run([args.binary, "--csv", "--reps", str(args.reps)], check=True, capture_output=True, text=True).stdout
    print(f"one thread each; medians of {args.reps}; torch {torch.__version__}, mkldnn {torch.backends.mkldnn.is_available()}")
    print(f"{'convolution':<18} {'GFLOP':>8} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} {'ours GF/s':>10} "
          f"{'% of gemm':>9} {'torch GF/s':>10}")
    ratios, shares = [], []
    for line in ours.strip().splitlines():
        what, *rest = line.split(",")
        n, h, w, cin, cout, kh, kw, stride, pad = map(int, rest[:9])
        fwd, gin, gw, gemm = map(float, rest[9:])
        x = torch.randn(n, cin, h, w).to(memory_format=torch.channels_last).requires_grad_()
        weight = torch.randn(cout, cin, kh, kw).to(memory_format=torch.channels_last).requires_grad_()
        y = torch.nn.functional.conv2d(x, weight, stride=stride, padding=pad)
        dy = torch.randn_like(y).contiguous(memory_format=torch.channels_last)

        def step():
            x.grad = None
            weight.grad = None
            out = torch.nn.functional.conv2d(x, weight, stride=stride, padding=pad)
            out.backward(dy)

        theirs = median_ms(args.reps, step)
        oh, ow = y.shape[2], y.shape[3]
        flops = 2.0 * n * oh * ow * cout * kh * kw * cin
        mine = fwd + gin + gw
        ours_rate, gemm_rate = 3 * flops / (mine * 1e6), flops / (gemm * 1e6)
        ratios.append(mine / theirs)
        shares.append(ours_rate / gemm_rate)
        print(f"{what:<18} {3 * flops / 1e9:8.4f} {mine:9.3f} {theirs:9.3f} {mine / theirs:10.2f} {ours_rate:10.2f} "
              f"{100 * ours_rate / gemm_rate:8.0f}% {3 * flops / (theirs * 1e6):10.2f}")
    print(f"median ours/torch {statistics.median(ratios):.2f}; median share of our product rate {100 * statistics.median(shares):.0f}%")


if __name__ == "__main__":
    main()
