#!/usr/bin/env python3
"""Prints the emulated-cluster table from the JSON that bench/cluster/run wrote to DIR.

usage: table.py DIR
"""
import glob
import json
import os
import sys


def cfg_key(path, prefix):
    cfg = os.path.basename(path)[len(prefix):].rsplit(".", 1)[0]
    n, rate = cfg.split("x", 1)
    return (int(n), int(rate.replace("gbit", "000").replace("mbit", "")), cfg)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    probes = sorted(glob.glob(os.path.join(d, "probe-*.json")), key=lambda p: cfg_key(p, "probe-"))
    if not probes:
        sys.exit(f"table.py: no probe-*.json in {d}")
    print("\nemulated cluster: collectives, compute and overlap (cluster-probe)")
    print(f"{'config':>10} {'MB':>5} {'AR ms':>8} {'AR busbw %line':>15} {'fit alpha us':>13} {'fit GB/s':>9}"
          f" {'AG ms':>8} {'RS ms':>8} {'sgemm GF/rank':>14} {'overlap max/both':>17} {'slowdown':>9}")
    for p in probes:
        r = json.load(open(p))
        n, mbit, cfg = cfg_key(p, "probe-")
        c = r["collectives"]
        largest = lambda k: c[k]["samples"][-1]
        ar = largest("iallreduce")
        line = mbit / 8 / 1000  # GB/s
        print(f"{cfg:>10} {ar['bytes'] / 2**20:5.1f} {ar['median_us'] / 1e3:8.1f} {100 * ar['bus_gbps'] / line:15.0f}"
              f" {c['iallreduce']['fit']['alpha_us']:13.0f} {c['iallreduce']['fit']['bandwidth_gbps']:9.4f}"
              f" {largest('iallgather')['median_us'] / 1e3:8.1f} {largest('ireduce_scatter_block')['median_us'] / 1e3:8.1f}"
              f" {r['compute']['gemm_gflops_per_rank']:14.1f} {r['overlap']['ideal_overlap_ratio']:17.3f}"
              f" {r['overlap']['compute_slowdown']:9.3f}")
    print("  (AR = MPI_Iallreduce ring, AG = MPI_Iallgather, RS = MPI_Ireduce_scatter_block, at the largest size MB;"
          " busbw = 2(p-1)/p * bytes / time)")

    peers = sorted(glob.glob(os.path.join(d, "peer-*.jsonl")), key=lambda p: cfg_key(p, "peer-"))
    if peers:
        print("\nPyTorch 1.13 CPU + gloo peer: median step ms")
        rows = []
        modes = []
        for p in peers:
            results = [json.loads(l) for l in open(p) if l.strip().startswith("{")]
            for x in results:
                if x["mode"] not in modes:
                    modes.append(x["mode"])
            rows.append((cfg_key(p, "peer-")[2], {x["mode"]: x["median_step_ms"] for x in results}, results))
        print(f"{'config':>10} " + " ".join(f"{m:>10}" for m in modes))
        for cfg, by_mode, results in rows:
            print(f"{cfg:>10} " + " ".join(f"{by_mode.get(m, float('nan')):10.1f}" for m in modes))
        if rows and rows[0][2]:
            x = rows[0][2][0]
            print(f"  (MLP: global batch {x['batch']}, hidden {x['hidden']}, FFN x{x['ffn']}, {x['layers']} blocks,"
                  f" {x['threads']} thread per rank; ddp:MB = bucket_cap_mb MB; tp = Megatron column/row MLP)")
    examples = sorted(glob.glob(os.path.join(d, "example-*.json")))
    if examples:
        print("\nconcerto examples: see", ", ".join(os.path.basename(e) for e in examples))


if __name__ == "__main__":
    main()
