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
          f" {'AG ms':>8} {'RS ms':>8} {'sgemm GF/rank':>14} {'overlap max/both':>17} {'slowdown':>9} {'comm slowdown':>14}")
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
              f" {r['overlap']['compute_slowdown']:9.3f} {r['overlap'].get('comm_slowdown', float('nan')):14.3f}")
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
        first = lambda model: next((x for _, _, rs in rows for x in rs if x.get("model", "mlp") == model), None)
        if x := first("mlp"):
            print(f"  (MLP: global batch {x['batch']}, hidden {x['hidden']}, FFN x{x['ffn']}, {x['layers']} blocks,"
                  f" {x['threads']} thread per rank; ddp:MB = bucket_cap_mb MB; tp = Megatron column/row MLP)")
        if x := first("gpt"):
            print(f"  (GPT: global batch {x['batch']} x {x['seq']} tokens, {x['layers']} layers, hidden {x['hidden']},"
                  f" {x['heads']} heads, vocab {x['vocab']}, {x['params_per_rank']} parameters, AdamW, DDP;"
                  f" gpt:MB = bucket_cap_mb MB)")
    peer_by_cfg = {cfg: by_mode for cfg, by_mode, _ in rows} if peers else {}
    examples = sorted(glob.glob(os.path.join(d, "example-*.jsonl")), key=lambda p: cfg_key(p, "example-"))
    if examples:
        print_examples(examples, peer_by_cfg)


def ratio(a, b):
    return a / b if a and b else float("nan")


def print_examples(files, peer_by_cfg):
    """One row per configuration, example and mesh: the three plans measured in one process."""
    print("\nconcerto examples: median step ms of the plans run in turn on the same ranks; LB, predicted with cpu-netns")
    head = (f"{'config':>10} {'model':>5} {'mesh':>7} {'comm%':>6} {'sync':>8} {'p_order':>8} {'concerto':>9}"
            f" {'c/sync':>7} {'LB':>8} {'c/LB':>6} {'pred':>8} {'pred/meas':>10} {'DDP':>8} {'DDPtuned':>9}"
            f" {'TPpeer':>8} {'c/torch':>8}")
    print(head)
    for f in files:
        cfg = cfg_key(f, "example-")[2]
        runs = [json.loads(l) for l in open(f) if l.strip().startswith("{")]
        groups = {}
        for r in runs:
            groups.setdefault((r["example"], r["tp"]), {})[r["policy"]] = r
        peer = peer_by_cfg.get(cfg, {})
        for (model, tp), by in sorted(groups.items(), key=lambda kv: (kv[0][0] != "mlp", kv[0][0], kv[0][1])):
            any_run = next(iter(by.values()))
            world = any_run["world"]
            ms = {p: by[p]["median_step_us"] / 1e3 for p in by}
            sync, po, conc = ms.get("sync"), ms.get("program_order"), ms.get("concerto")
            # sync runs every collective alone: its exposed communication is all of it.
            comm = 100 * by["sync"]["median_exposed_comm_us"] / by["sync"]["median_step_us"] if "sync" in by else float("nan")
            lb = min(r["lower_bound_us"] for r in by.values()) / 1e3
            pred = by["concerto"]["predicted_us"] / 1e3 if "concerto" in by else float("nan")
            ddp = ddp_tuned = tp_peer = None
            mine = None  # no peer runs this model on this mesh
            if model in ("mlp", "gpt") and tp == 1:
                mode = "ddp" if model == "mlp" else "gpt"  # the peer's DDP modes of this model
                ddp = peer.get(mode)
                tuned = [v for k, v in peer.items() if k.startswith(mode + ":")]
                ddp_tuned = min(tuned) if tuned else None
                mine = ratio(conc, min(x for x in (ddp, ddp_tuned) if x) if (ddp or ddp_tuned) else None)
            elif model == "mlp" and tp == world:
                tp_peer = peer.get("tp")
                mine = ratio(conc, tp_peer)
            fmt = lambda v, w, p=1: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"
            print(f"{cfg:>10} {model:>5} {f'{world // tp}x{tp}':>7} {comm:6.0f} {fmt(sync, 8)} {fmt(po, 8)} {fmt(conc, 9)}"
                  f" {ratio(conc, sync):7.2f} {lb:8.1f} {ratio(conc, lb):6.2f} {pred:8.1f} {ratio(pred, conc):10.2f}"
                  f" {fmt(ddp, 8)} {fmt(ddp_tuned, 9)} {fmt(tp_peer, 8)} {fmt(mine, 8, 2)}")
    print("  (mesh = dp x tp; comm% = sync plan's exposed communication / its step; c = concerto; LB = the plan's lower"
          " bound;\n   pred = simulated concerto step; DDPtuned = best of the tuned buckets (MLP: 4 and 100 MB, GPT: 1"
          " and 100 MB);\n   c/torch = concerto / best PyTorch (DDP, default or tuned, for dp; Megatron TP for the MLP's"
          " tp))")


if __name__ == "__main__":
    main()
