#!/usr/bin/env python3
"""The MFU table of bench/gpu/run: concerto's GPU-sized GPT and Llama (step 5) against their
PyTorch peer (bench/gpu/torch_peer_gpu.py), on the same GPU, as markdown on stdout.

  python3 bench/gpu/mfu_table.py OUTDIR [--device NAME] [--text PATH | --vocab N]

Reads from OUTDIR (one row per model, width and precision; the width from each file's contents):
  <model>_w<width>_<precision>_<rep>.json  the example's --json: one object per plan policy
                                           (policy, median_step_us, layers, hidden, heads, seq,
                                           batch; the Llama's kv_heads and ffn); earlier runs'
                                           <model>_sized_<precision>_<rep>.json too
  <model>_w<width>_<precision>_<rep>.log   its log, whose first line names the vocabulary
  torch_<model>_w<width>_<precision>_<rep>.json  the peer's result (hidden, modes.eager,
                                           modes.compiled)
Step times are medians over the runs (reps) of each run's median step; concerto's row is its
fastest policy, PyTorch's MFU and the ratio use its faster mode. Both sides' FLOPs come from one
formula (torch_peer_gpu.flops_per_token, examples/common/trainer.hpp's) over the example's
parameter count, and both MFUs from one peak (the device's dense bf16, torch_peer_gpu.PEAK_TFLOPS),
whatever the precision. A missing or unreadable file leaves "-" in its cells.
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peer_gpu import corpus_vocab, flops_per_token, parameter_count, peak_tflops  # noqa: E402

MODELS = ("gpt", "llama")
PRECISIONS = ("fp32", "tf32", "bf16")


def load(path, problems):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"{os.path.basename(path)}: {type(e).__name__}")
        return None


def width_of(fields):
    """The model width (hidden) an example's or the peer's result states, or None."""
    try:
        return int(fields.get("hidden"))
    except (TypeError, ValueError):
        return None


def rep_of(path):
    m = re.search(r"_(\d+)\.json$", path)
    return int(m.group(1)) if m else 0


def log_vocab(json_path):
    """The vocabulary the example's log states ("..., vocab 80, ..."), or None."""
    try:
        with open(json_path[: -len(".json")] + ".log", errors="replace") as f:
            for line in f:
                m = re.search(r"\bvocab (\d+)\b", line)
                if m:
                    return int(m.group(1))
    except OSError:
        pass
    return None


def gpu_name(peer_results, given):
    if given:
        return given
    for r in peer_results:
        if r.get("device") == "cuda" and r.get("device_name"):
            return r["device_name"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return names[0] if out.returncode == 0 and names else None
    except (OSError, subprocess.SubprocessError):
        return None


def step_flops(fields, model, vocab):
    """Model FLOPs of one step of the shapes `fields` names (an example's JSON object or the
    peer's), or None when a shape is missing."""
    try:
        h, layers, seq, batch = (int(fields[k]) for k in ("hidden", "layers", "seq", "batch"))
        heads = int(fields["heads"])
        kv_heads = int(fields.get("kv_heads") or heads)
        ffn = int(fields["ffn"]) if model == "llama" and fields.get("ffn") else None
    except (KeyError, TypeError, ValueError):
        return None
    if vocab is None:
        return None
    params = parameter_count(model, h, heads, kv_heads, layers, vocab, ffn)
    return flops_per_token(params, layers, h, seq) * batch * seq


def median_or_none(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def fmt_ms(x):
    return "-" if x is None else f"{x:.2f}"


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def mfu(flops, ms, peak):
    if flops is None or ms is None or not peak or ms <= 0:
        return None
    return flops / (ms * 1e-3) / (peak * 1e12)


def table(outdir, device=None, fallback_vocab=None):
    problems, notes = [], []
    peers = {}
    for path in sorted(glob.glob(os.path.join(outdir, "torch_*_*_*.json"))):
        r = load(path, problems)
        if isinstance(r, dict):
            peers.setdefault((r.get("model"), width_of(r), r.get("precision")), []).append(r)
    name = gpu_name([r for rs in peers.values() for r in rs], device)
    peak = peak_tflops(name) if name else None

    ours = {}
    for model in MODELS:
        for precision in PRECISIONS:
            paths = glob.glob(os.path.join(outdir, f"{model}_w*_{precision}_*.json"))
            paths += glob.glob(os.path.join(outdir, f"{model}_sized_{precision}_*.json"))
            for path in sorted(paths, key=rep_of):
                r = load(path, problems)
                if isinstance(r, list):
                    results = [p for p in r if isinstance(p, dict)]
                    width = next((width_of(p) for p in results if width_of(p)), None)
                    ours.setdefault((model, width, precision), []).append((path, results))

    rows = []
    widths = sorted({k[1] for k in list(ours) + list(peers) if k[1]}, reverse=True)
    for model in MODELS:
        for width, precision in ((w, p) for w in widths for p in PRECISIONS):
            runs = ours.get((model, width, precision), [])
            peer = peers.get((model, width, precision), [])
            if not runs and not peer:
                continue
            # concerto: each policy's median over the runs, the fastest policy's row.
            by_policy = {}
            for _, results in runs:
                for p in results:
                    if isinstance(p.get("median_step_us"), (int, float)) and p.get("policy"):
                        by_policy.setdefault(p["policy"], []).append(p["median_step_us"] / 1e3)
            best_policy = min(by_policy, key=lambda k: statistics.median(by_policy[k])) if by_policy else None
            c_ms = statistics.median(by_policy[best_policy]) if best_policy else None
            vocab = next((v for v in (log_vocab(path) for path, _ in runs) if v), None)
            vocab = vocab or next((r.get("vocab") for r in peer if r.get("vocab")), None) or fallback_vocab
            c_fields = next((p for _, results in runs for p in results), None)
            c_flops = step_flops(c_fields, model, vocab) if c_fields else None
            # PyTorch: each mode's median over the runs; the faster mode for the MFU and the ratio.
            eager = median_or_none([r.get("modes", {}).get("eager", {}).get("median_step_ms") for r in peer])
            compiled = median_or_none([r.get("modes", {}).get("compiled", {}).get("median_step_ms") for r in peer])
            p_ms = min((x for x in (eager, compiled) if x is not None), default=None)
            p_flops = step_flops(peer[0], model, peer[0].get("vocab")) if peer else None
            for r in peer:
                for why in (r.get("compile_error"), r.get("cut")):
                    if why and f"{model} {precision}: {why}" not in notes:
                        notes.append(f"{model} {precision}: {why}")
            if c_flops and p_flops and abs(c_flops - p_flops) > 1e-6 * c_flops:
                notes.append(f"{model} {width} {precision}: the two sides' shapes differ ({c_flops:.4g} against {p_flops:.4g} FLOPs a step)")
            ratio = c_ms / p_ms if c_ms and p_ms else None
            rows.append([model, str(width), precision, best_policy or "-", fmt_ms(c_ms), fmt_pct(mfu(c_flops, c_ms, peak)),
                         fmt_ms(eager), fmt_ms(compiled), fmt_pct(mfu(p_flops, p_ms, peak)),
                         "-" if ratio is None else f"{ratio:.2f}", f"{len(runs)}/{len(peer)}"])

    lines = [f"## concerto against PyTorch on {name or 'an unknown device'}"
             + (f" (dense bf16 peak {peak:g} TFLOP/s)" if peak else " (unknown peak: no MFU)"), ""]
    if not rows:
        lines.append(f"no results in {outdir} (neither <model>_w<width>_<precision>_<rep>.json nor torch_<model>_w<width>_<precision>_<rep>.json)")
    else:
        head = ["model", "width", "precision", "concerto plan", "concerto ms", "concerto MFU", "PyTorch eager ms",
                "PyTorch compiled ms", "PyTorch MFU", "concerto / PyTorch", "runs (concerto/PyTorch)"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join("---" for _ in head) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", "Step ms: the median over runs of each run's median step; concerto's fastest plan, PyTorch's "
                  "faster mode for its MFU and the ratio (below 1: concerto is faster). MFU: model FLOPs (6 per "
                  "parameter + 12 x layers x hidden x seq per token) a second over the dense bf16 peak, in every precision."]
    lines += [f"- {n}" for n in notes + problems]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--device", default=None, help="the GPU's name (default: the peer's, else nvidia-smi's)")
    ap.add_argument("--text", default=None, help="the examples' text, for the vocabulary where no log states it")
    ap.add_argument("--vocab", type=int, default=None, help="the vocabulary where no log states it")
    a = ap.parse_args()
    vocab = a.vocab
    if a.text and vocab is None:
        try:
            vocab = corpus_vocab(a.text)
        except OSError:
            vocab = None
    print(table(a.outdir, a.device, vocab))


if __name__ == "__main__":
    main()
