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
    pipelined = sorted(glob.glob(os.path.join(d, "pipeline-*.jsonl")), key=lambda p: cfg_key(p, "pipeline-"))
    if pipelined:
        print_pipeline(pipelined)


def print_pipeline(files):
    """One row per configuration and pipeline layout: each schedule's median step, run in turn on
    the same ranks, its prediction (the pipeline replay, cpu-netns) and concerto against 1f1b."""
    schedules = ["gpipe", "1f1b", "zb_h1", "concerto"]
    print("\nGPT with pipeline stages: median step ms of the schedules run in turn on the same ranks (pred/meas)")
    print(f"{'config':>10} {'pp x dp':>8} {'m':>3} " + " ".join(f"{s:>17}" for s in schedules) + f" {'1f1b/c':>7} {'c/best':>7}")
    for f in files:
        cfg = cfg_key(f, "pipeline-")[2]
        groups = {}
        for r in (json.loads(l) for l in open(f) if l.strip().startswith("{")):
            groups.setdefault((r["pp"], r["world"] // r["pp"], r["microbatches"]), {})[r["policy"].split(":")[-1]] = r
        for (pp, dp, m), by in sorted(groups.items()):
            cells = []
            for s in schedules:
                r = by.get(s)
                cells.append(f"{r['median_step_us'] / 1e3:8.1f} ({r['predicted_us'] / r['median_step_us']:4.2f})" if r else f"{'-':>17}")
            ms = {s: by[s]["median_step_us"] for s in by}
            conc = ms.get("concerto")
            best = min((v for k, v in ms.items() if k != "concerto"), default=None)
            print(f"{cfg:>10} {f'{pp}x{dp}':>8} {m:3d} " + " ".join(cells) +
                  f" {ratio(ms.get('1f1b'), conc):7.2f} {ratio(conc, best):7.2f}")
    print("  (m = micro-batches per step; (pred/meas) = the schedule's pipeline replay with the cpu-netns calibration /"
          " measured;\n   1f1b/c = 1f1b / concerto; c/best = concerto / fastest other schedule)")


def ratio(a, b):
    return a / b if a and b else float("nan")


def print_examples(files, peer_by_cfg):
    """One row per configuration, example and mesh: the plans measured in one process, concerto
    starting from the plan its choosing run kept; then what each choosing run measured and cost."""
    print("\nconcerto examples: median step ms of the plans run in turn on the same ranks; LB, predicted with cpu-netns")
    head = (f"{'config':>10} {'model':>5} {'mesh':>7} {'comm%':>6} {'sync':>8} {'p_order':>8} {'xla_lhs':>8} {'concerto':>9}"
            f" {'chosen':>16} {'again s':>8} {'c/best':>7} {'LB':>8} {'c/LB':>6} {'pred':>8} {'pred/meas':>10} {'refit/meas':>11}"
            f" {'DDP':>8} {'DDPtuned':>9} {'TPpeer':>8} {'c/torch':>8}")
    print(head)
    choosing_rows = []
    for f in files:
        cfg = cfg_key(f, "example-")[2]
        runs = [json.loads(l) for l in open(f) if l.strip().startswith("{")]
        groups = {}
        for r in runs:
            # The MoE form of the Llama example is a model of its own, its mesh dp x ep.
            moe = r.get("experts", 0) > 0
            model = "moe" if moe else r["example"] + ("-sp" if r.get("sp") else "")  # the ViT with sequence parallelism
            groups.setdefault((model, r["tp"], r.get("ep", 1) if moe else 1), {})[r["policy"]] = r
        peer = peer_by_cfg.get(cfg, {})
        for (model, tp, ep), by in sorted(groups.items(), key=lambda kv: (kv[0][0] != "mlp", kv[0][0], kv[0][1], kv[0][2])):
            any_run = next(iter(by.values()))
            world = any_run["world"]
            mesh = f"{world // tp // ep}x{ep}e" if model == "moe" else f"{world // tp}x{tp}"
            if "concerto-choosing" in by:
                choosing_rows.append((cfg, model, mesh, by["concerto-choosing"]))
            ms = {p: by[p]["median_step_us"] / 1e3 for p in by}
            sync, po, xla, conc = ms.get("sync"), ms.get("program_order"), ms.get("xla_lhs"), ms.get("concerto")
            baselines = [v for v in (sync, po, xla) if v]
            best = min(baselines) if baselines else None
            # sync runs every collective alone: its exposed communication is all of it.
            comm = 100 * by["sync"]["median_exposed_comm_us"] / by["sync"]["median_step_us"] if "sync" in by else float("nan")
            lb = min(r["lower_bound_us"] for r in by.values() if "lower_bound_us" in r) / 1e3
            c = by.get("concerto", {})
            pred = c.get("predicted_us", float("nan")) / 1e3
            refit = c.get("refit_predicted_us", float("nan")) / 1e3
            chosen = c.get("chosen", "-")
            # The choosing run's pick measured again in this run against its close rivals, at this cost.
            again = c.get("choice_overhead_s") if c.get("chosen_from_cache") is False else None
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
            print(f"{cfg:>10} {model:>5} {mesh:>7} {comm:6.0f} {fmt(sync, 8)} {fmt(po, 8)} {fmt(xla, 8)}"
                  f" {fmt(conc, 9)} {chosen[:16]:>16} {fmt(again, 8, 2)} {ratio(conc, best):7.2f} {lb:8.1f} {ratio(conc, lb):6.2f} {pred:8.1f}"
                  f" {ratio(pred, conc):10.2f} {ratio(refit, conc):11.2f}"
                  f" {fmt(ddp, 8)} {fmt(ddp_tuned, 9)} {fmt(tp_peer, 8)} {fmt(mine, 8, 2)}")
    print("  (mesh = dp x tp, or for moe (the Llama example with 4 experts, top-2) dp x ep; comm% = sync plan's exposed communication / its step; c = concerto after its choice in this run (chosen):"
          " the choosing run's pick,\n   measured again against the rivals that came within 1.25x of it (again s = what that"
          " cost), or kept as it is when none did;\n   c/best = concerto / fastest of sync, p_order, xla_lhs; LB = the plan's lower bound;"
          " pred = the plan's simulated step when it was made;\n   refit = the kept plan simulated under the refitted model;"
          " DDPtuned = best of the tuned buckets (MLP: 4 and 100 MB, GPT: 1 and 100 MB);\n   c/torch = concerto / best"
          " PyTorch (DDP, default or tuned, for dp; Megatron TP for the MLP's tp))")
    if choosing_rows:
        print("\nconcerto's choosing runs (the concerto plan alone, choosing by measuring; median step ms)")
        print(f"{'config':>10} {'model':>5} {'mesh':>7} {'choosing':>9} {'after':>8} {'overhead s':>11}  choice")
        for cfg, model, mesh, r in choosing_rows:
            print(f"{cfg:>10} {model:>5} {mesh:>7} {r.get('median_step_us_choosing', float('nan')) / 1e3:9.1f}"
                  f" {r['median_step_us'] / 1e3:8.1f} {r.get('choice_overhead_s', float('nan')):11.2f}  {r.get('choice', '-')}")


if __name__ == "__main__":
    main()
