#!/usr/bin/env python3
"""The emulated cluster's GPT step on one CPU core, kernel group by kernel group: concerto's
CPU kernels next to PyTorch's on the same model and shapes, in one run.

Ours: examples/gpt (one rank, the sync plan, so that no two tasks overlap) writes each executed
step's measured timeline (CONCERTO_TRACE_DIR); the last step's tasks are summed by op. PyTorch:
the same model (bench/cluster/peer/torch_peer.py's gpt_model, the cluster's peer), one thread,
torch.profiler's self CPU time per aten op over the timed steps. Both are grouped alike (products,
attention, layernorm, GELU, loss, embedding, optimizer, the rest), each group's median over
--runs runs, and the step's own median.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/cpu_kernels/gpt_vs_torch.py [--batch 4] [--runs 5]

/usr/bin/python3 is Debian's, with python3-torch (1.13, the emulated cluster's peer; bench/cluster/run installs it).

--batch is the sequences one rank holds (the cluster's 4 x 1 rows hold 16 / 4 = 4).
"""
import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "cluster", "peer"))

GROUPS = ["products", "attention", "layernorm", "gelu", "loss", "embedding", "optimizer", "rest"]

# concerto's ops by group (ir::op names, docs/dsl-reference.md); what is not listed is "rest".
OURS = {
    "products": {"matmul"},
    "attention": {"attention", "attention_grad"},
    "layernorm": {"layernorm", "layernorm_grad", "layernorm_grad_gamma"},
    "gelu": {"gelu", "gelu_grad"},
    "loss": {"cross_entropy", "cross_entropy_grad", "vocab_ce_max", "vocab_ce_sumexp", "vocab_ce_target", "vocab_ce_loss",
             "vocab_ce_grad"},
    "embedding": {"embedding", "embedding_grad"},
    "optimizer": {"adamw", "grad_sq_norm"},
}
# PyTorch's aten ops by group (self time, so a composite op's children count where they run).
TORCH = {
    "products": {"aten::mm", "aten::bmm", "aten::addmm"},
    "attention": {"aten::_softmax", "aten::_softmax_backward_data", "aten::masked_fill_", "aten::masked_fill"},
    "layernorm": {"aten::native_layer_norm", "aten::native_layer_norm_backward"},
    "gelu": {"aten::gelu", "aten::gelu_backward"},
    "loss": {"aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
             "aten::nll_loss_backward"},
    "embedding": {"aten::embedding", "aten::index_select", "aten::embedding_dense_backward",
                  "aten::embedding_backward", "aten::index_add_"},
    "optimizer": {"aten::_foreach_mul_", "aten::_foreach_add_", "aten::_foreach_addcmul_", "aten::_foreach_addcdiv_",
                  "aten::_foreach_sqrt", "aten::_foreach_div_", "aten::_foreach_lerp_", "aten::mul_", "aten::addcmul_",
                  "aten::addcdiv_", "aten::sqrt", "aten::div_", "aten::lerp_", "aten::add_"},
}


def group_of(name, table):
    for group, names in table.items():
        if name in names:
            return group
    return "rest"


def ours_once(a, trace_dir):
    cmd = ["mpirun", "-np", "1", a.binary, "--tp", "1", "--policy", "sync", "--layers", "2", "--hidden", "256",
           "--heads", "4", "--seq", "64", "--batch", str(a.batch), "--steps", str(a.steps)]
    env = dict(os.environ, CONCERTO_TRACE_DIR=trace_dir, OPENBLAS_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    [path] = glob.glob(os.path.join(trace_dir, "*.measured.rank0.json"))
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    ms = collections.Counter()
    first, last = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        first, last = min(first, e["ts"]), max(last, e["ts"] + e["dur"])
        if e.get("tid") == 0:  # the compute stream; one rank's collectives (copies) count in the step only
            ms[group_of(e.get("args", {}).get("fn", ""), OURS)] += e["dur"] / 1e3
    ms["step"] = (last - first) / 1e3
    return ms


def torch_once(a):
    import torch
    import torch.nn.functional as F
    from torch_peer import gpt_model

    torch.set_num_threads(1)
    vocab, seq = 80, 64
    model = gpt_model(256, 4, 2, vocab, seq)
    torch.manual_seed(99)
    ids = torch.randint(0, vocab, (a.batch, seq))
    labels = torch.randint(0, vocab, (a.batch, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids).view(-1, vocab), labels.view(-1)).backward()
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    ms = collections.Counter()
    for e in prof.key_averages():
        ms[group_of(e.key, TORCH)] += e.self_cpu_time_total / 1e3 / a.steps
    ms["step"] = statistics.median(times)  # without the profiler's overhead
    return ms, torch.__version__


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", default="build/examples/gpt/example_gpt")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    ours, theirs = [], []
    version = ""
    for _ in range(a.runs):  # alternated, so that a slow spell of the machine hits both
        with tempfile.TemporaryDirectory() as d:
            ours.append(ours_once(a, d))
        t, version = torch_once(a)
        theirs.append(t)
    print(f"GPT (2 layers, hidden 256, 4 heads, seq 64, vocab 80), {a.batch} sequences, one core; "
          f"torch {version}; medians of {a.runs} runs (ms per step)")
    print(f"{'group':<11} {'ours':>8} {'torch':>8} {'ours/torch':>10}")
    for g in GROUPS + ["step"]:
        o = statistics.median(r[g] for r in ours)
        t = statistics.median(r[g] for r in theirs)
        print(f"{g:<11} {o:8.2f} {t:8.2f} {o / t if t > 0 else float('nan'):10.2f}")
    print("(ours: the sync plan's last step, tasks summed by op; its step includes the gaps between tasks.\n"
          " torch: profiler self CPU time per aten op; its step is timed without the profiler.\n"
          " attention: ours is the whole kernel, its two products per head included; torch's products\n"
          " (bmm) are under products, its softmax and mask here.)")


if __name__ == "__main__":
    main()
