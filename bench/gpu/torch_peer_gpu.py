#!/usr/bin/env python3
"""The PyTorch peer of bench/gpu/run's GPU-sized models (step 5): the same GPT or Llama, the same
shapes, optimizer and precision, trained on the same GPU, so that one run gives both step times
and both MFUs (bench/gpu/mfu_table.py puts them side by side).

  python3 bench/gpu/torch_peer_gpu.py --model gpt --hidden 1024 --heads 16 --layers 4 --seq 256 \\
      --batch 32 --steps 20 --text /usr/share/common-licenses/GPL-3 --precision bf16 --json out.json

Models:
  gpt    examples/gpt/model.hpp: bench/cluster/peer/torch_peer.py's gpt_model (pre-layernorm
         blocks, GELU (tanh) MLP of 4x, no positional embedding, untied head, no matmul biases),
         its attention replaced by scaled_dot_product_attention(is_causal=True) where torch has it.
  llama  examples/llama/model.hpp as examples/llama/reference.py writes it (RMSNorm eps 1e-6,
         rotate-half RoPE, grouped-query attention, SwiGLU of --ffn, default 8/3 of hidden rounded
         up to 8, untied head), as modules here: reference.py takes a dict of exported tensors
         and recomputes RoPE's angles on the host at every call.
Weights are [in, out] (y = x @ W), uniform with variance 1/rows as concerto's initialisation.
The vocabulary is the example's: the distinct bytes of --text padded to a multiple of 8
(examples/common/corpus.hpp), or --vocab. Batches are random token ids of that shape.

Precision as concerto's: fp32 (TF32 off), tf32 (TF32 matmuls), bf16 (autocast to bf16 with f32
master weights and AdamW state). AdamW with the examples' defaults (lr 3e-3, betas 0.9/0.999,
eps 1e-8, weight decay 0.01 on every parameter; examples/common/settings.hpp), fused where
torch has it. Eager first, then (--compile) the loss under torch.compile; the JSON is written
after each, so that a run cut short (--max-seconds, or the caller's timeout) keeps the eager
figures. Model FLOPs per token: examples/common/trainer.hpp's flops_per_token, 6 per parameter
plus 12 * layers * hidden * seq; MFU against the device's dense bf16 peak (PEAK_TFLOPS).

Without CUDA it runs on the CPU (bf16 through CPU autocast, no fused AdamW, no MFU), which is
how it is checked where there is no GPU. torch 1.13 (no SDPA, no torch.compile) works: the
attention is then an explicit masked softmax and --compile records why it fell back.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "cluster", "peer"))

# Dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, by a piece of
# torch.cuda.get_device_name() / nvidia-smi's name; the first piece found wins, so the PCIe and
# NVL H100s come before the plain "H100" of the SXM part ("NVIDIA H100 80GB HBM3"). None: a part
# whose peak this table does not claim to know (MFU omitted rather than guessed).
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", None),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
]


def peak_tflops(device_name):
    """The dense bf16 peak of `device_name` in TFLOP/s, or None when the table has none."""
    for piece, peak in PEAK_TFLOPS:
        if piece.lower() in (device_name or "").lower():
            return peak
    return None


def corpus_vocab(path):
    """The examples' vocabulary of a text: its distinct bytes, padded to a multiple of 8 (so that
    it splits over tensor-parallel ranks; examples/common/corpus.hpp)."""
    with open(path, "rb") as f:
        distinct = len(set(f.read()))
    return (distinct + 7) // 8 * 8


def default_ffn(hidden):
    """The Llama example's feed-forward width: 8/3 of hidden rounded up to 8 (examples/llama/main.cpp)."""
    return (8 * hidden // 3 + 7) // 8 * 8


def parameter_count(model, hidden, heads, kv_heads, layers, vocab, ffn=None):
    """The parameters of the examples' models, from their shapes (examples/gpt/model.hpp,
    examples/llama/model.hpp): what concerto's step.parameter_names() lists."""
    h = hidden
    if model == "gpt":
        block = 4 * h * h + 2 * h * 4 * h + 4 * h  # wq wk wv wo, fc1 fc2, two layernorms' gain and bias
        return 2 * vocab * h + layers * block + 2 * h
    kv = h // heads * kv_heads
    f = ffn or default_ffn(h)
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # wq wo, wk wv, w1 w3 w2, two RMSNorm gains
    return 2 * vocab * h + layers * block + h


def flops_per_token(params, layers, hidden, seq):
    """examples/common/trainer.hpp's count for one training step: 6 per parameter (the matmuls,
    forward and backward) and the attention's scores and weighted sums, 12 * layers * hidden * seq."""
    return 6.0 * params + 12.0 * layers * hidden * seq


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "llama"), required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="Llama's k/v heads (default: --heads)")
    p.add_argument("--ffn", type=int, default=None, help="Llama's feed-forward width (default 8/3 of hidden, rounded up to 8)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, per mode (default 3, at least 3)")
    p.add_argument("--vocab", type=int, default=80,
                   help="vocabulary (default 80: the examples' characters of GPL-3, padded to 8); --text overrides")
    p.add_argument("--text", default=None, help="the examples' training text: the vocabulary is its distinct bytes, padded to 8")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   default=True, help="also time the step under torch.compile (default on; --no-compile: eager only)")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop after this long, keeping what was measured (0: no limit); a cold compile can take a minute")
    p.add_argument("--json", default=None, help="write the result (one JSON object) here")
    a = p.parse_args()
    a.kv_heads = a.kv_heads or a.heads
    a.warmup = max(a.warmup, 3)
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.text:
        a.vocab = corpus_vocab(a.text)
    return a


def write_json(path, result):
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file, even when a timeout cuts the run


def build_model(a, torch, device):
    import torch.nn as nn
    import torch.nn.functional as F

    sdpa = getattr(F, "scaled_dot_product_attention", None)
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    # SDPA's own grouped-query path (no copies of k and v) from torch 2.5.
    gqa = sdpa is not None and major_minor >= (2, 5)

    if a.model == "gpt":
        from torch_peer import gpt_model

        model = gpt_model(a.hidden, a.heads, a.layers, a.vocab, a.seq)
        if sdpa is not None:
            d = a.hidden // a.heads

            def attention(q, k, v):
                b, t, _ = q.shape
                q, k, v = (x.view(b, t, a.heads, d).transpose(1, 2) for x in (q, k, v))
                return sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, a.hidden)

            model.attention = attention  # an instance attribute: shadows the class's masked softmax
        model = model.to(device)
        model.future = model.future.to(device)  # a plain attribute, which .to() leaves behind
        return model, ("sdpa" if sdpa is not None else "masked_softmax")

    heads, kv_heads, hidden, seq = a.heads, a.kv_heads, a.hidden, a.seq
    ffn = a.ffn or default_ffn(hidden)
    d = hidden // heads
    rms_norm = getattr(F, "rms_norm", None)

    def rmsnorm(x, g):  # examples/llama/reference.py's rmsnorm, eps 1e-6
        if rms_norm is not None:
            return rms_norm(x, (x.shape[-1],), g, eps=1e-6)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    class llama(nn.Module):
        """examples/llama/reference.py's llama_loss as a module (parameter names as the example's)."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(1234)

            def matrix(rows, cols):  # uniform, variance 1/rows (concerto's initialisation)
                return nn.Parameter((torch.rand(rows, cols) * 2 - 1) * (3 / rows) ** 0.5)

            kv = d * kv_heads
            self.wte = matrix(a.vocab, hidden)
            self.layers = nn.ModuleList()
            for _ in range(a.layers):
                blk = nn.Module()
                blk.attn_norm = nn.Parameter(torch.ones(hidden))
                blk.wq, blk.wk, blk.wv, blk.wo = matrix(hidden, hidden), matrix(hidden, kv), matrix(hidden, kv), matrix(hidden, hidden)
                blk.ffn_norm = nn.Parameter(torch.ones(hidden))
                blk.w1, blk.w3, blk.w2 = matrix(hidden, ffn), matrix(hidden, ffn), matrix(ffn, hidden)
                self.layers.append(blk)
            self.norm = nn.Parameter(torch.ones(hidden))
            self.head = matrix(hidden, a.vocab)
            # RoPE's angles once, in f64 as reference.py, then f32 on the device: lane i turns with
            # lane i + d/2 by position * theta^(-2i/d).
            angle = torch.arange(seq, dtype=torch.float64)[:, None] * a.rope_theta ** (
                -2 * torch.arange(d // 2, dtype=torch.float64) / d)
            self.register_buffer("cos", angle.cos().float(), persistent=False)
            self.register_buffer("sin", angle.sin().float(), persistent=False)
            self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

        def rope(self, x):  # [b, heads, t, d], rotate half
            t = x.shape[-2]
            cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)  # keep autocast's bf16
            lo, hi = x[..., : d // 2], x[..., d // 2:]
            return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], -1)

        def attention(self, q, k, v):
            group = heads // kv_heads
            if gqa:
                return sdpa(q, k, v, is_causal=True, enable_gqa=group > 1)
            # Query head h reads k/v head h // group, as reference.py's repeat_interleave.
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            if sdpa is not None:
                return sdpa(q, k, v, is_causal=True)
            t = q.shape[-2]
            scores = (q @ k.transpose(-2, -1)) * d ** -0.5
            return scores.masked_fill(self.future[:t, :t], float("-inf")).softmax(-1) @ v

        def forward(self, ids):
            b, t = ids.shape
            split = lambda x, n: x.view(b, t, n, d).transpose(1, 2)  # noqa: E731
            h = F.embedding(ids, self.wte)
            for blk in self.layers:
                x = rmsnorm(h, blk.attn_norm)
                q = self.rope(split(x @ blk.wq, heads))
                k = self.rope(split(x @ blk.wk, kv_heads))
                v = split(x @ blk.wv, kv_heads)
                h = h + self.attention(q, k, v).transpose(1, 2).reshape(b, t, hidden) @ blk.wo
                m = rmsnorm(h, blk.ffn_norm)
                h = h + (F.silu(m @ blk.w1) * (m @ blk.w3)) @ blk.w2
            return rmsnorm(h, self.norm) @ self.head

    return llama().to(device), ("sdpa" if sdpa is not None else "masked_softmax") + ("+gqa" if gqa else "")


def make_optimizer(torch, params, cuda):
    """AdamW as the examples' (examples/common/settings.hpp): fused on CUDA where torch has it,
    else foreach, else the loop; returns it and which."""
    hyper = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    tries = [("fused", {"fused": True}), ("foreach", {"foreach": True})] if cuda else []
    for name, extra in tries:
        try:
            return torch.optim.AdamW(params, **hyper, **extra), name
        except (TypeError, RuntimeError, ValueError):
            continue
    return torch.optim.AdamW(params, **hyper), "default"


def main():
    a = parse()
    started = time.monotonic()
    result = {"peer": "pytorch", "model": a.model, "precision": a.precision, "hidden": a.hidden, "heads": a.heads,
              "kv_heads": a.kv_heads if a.model == "llama" else a.heads,
              "ffn": (a.ffn or default_ffn(a.hidden)) if a.model == "llama" else 4 * a.hidden,
              "layers": a.layers, "seq": a.seq, "batch": a.batch, "vocab": a.vocab, "steps": a.steps,
              "warmup": a.warmup, "compile_requested": bool(a.compile), "modes": {}}

    phase = ["importing torch"]  # what the run was doing, should --max-seconds cut it

    def out_of_time(signum, frame):
        # The figures measured so far are already in the JSON; say what was cut and leave now
        # (a compile in progress holds worker processes a normal exit would wait for).
        result["cut"] = f"stopped at --max-seconds {a.max_seconds:g} while {phase[0]}"
        write_json(a.json, result)
        print(summary_line(result), flush=True)
        os._exit(0)

    if a.max_seconds > 0:
        signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, a.max_seconds)

    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_tflops(name) if cuda else None
    if cuda:
        # The legacy switches, not fp32_precision: torch.compile's caches still read them, and
        # mixing the two APIs is an error in some torch versions.
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    result.update({"torch": torch.__version__, "cuda": torch.version.cuda, "device": device.type, "device_name": name,
                   "peak_tflops": peak})
    if cuda and peak is None:
        print(f"torch_peer_gpu.py: unknown peak for '{name}': no MFU", file=sys.stderr)

    phase[0] = "building the model"
    model, attention = build_model(a, torch, device)
    opt, opt_kind = make_optimizer(torch, list(model.parameters()), cuda)
    params = sum(p.numel() for p in model.parameters())
    expected = parameter_count(a.model, a.hidden, a.heads, a.kv_heads, a.layers, a.vocab, a.ffn)
    if params != expected:  # the FLOP count (and concerto's side of the table) assumes the example's shapes
        print(f"torch_peer_gpu.py: {params} parameters, the example's shapes give {expected}", file=sys.stderr)
    per_token = flops_per_token(params, a.layers, a.hidden, a.seq)
    tokens = a.batch * a.seq
    result.update({"attention": attention, "optimizer": "adamw " + opt_kind, "params": params,
                   "flops_per_token": per_token, "flops_per_step": per_token * tokens, "tokens_per_step": tokens})

    torch.manual_seed(99)
    # A few fixed batches in turn: new ones every step would time the random generator too.
    batches = [(torch.randint(0, a.vocab, (a.batch, a.seq), device=device),
                torch.randint(0, a.vocab, (a.batch, a.seq), device=device)) for _ in range(4)]
    autocast = (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)) if a.precision == "bf16" \
        else contextlib.nullcontext

    def loss_of(ids, labels):
        return F.cross_entropy(model(ids).view(-1, a.vocab).float(), labels.view(-1))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(mode, fn):
        phase[0] = "compiling and timing" if mode == "compiled" else f"timing {mode}"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        first_s = None
        for i in range(a.warmup + a.steps):
            ids, labels = batches[i % len(batches)]
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = fn(ids, labels)
            loss.backward()
            opt.step()
            sync()
            dt = time.perf_counter() - t0
            first_s = dt if first_s is None else first_s
            if i >= a.warmup:
                times.append(dt)
            losses.append(loss.item())  # after the step's clock stopped
        median_s = statistics.median(times)
        m = {"median_step_ms": 1e3 * median_s, "min_step_ms": 1e3 * min(times), "max_step_ms": 1e3 * max(times),
             "first_step_s": first_s, "tokens_per_s": tokens / median_s, "tflops": per_token * tokens / median_s / 1e12,
             "loss_first": losses[0], "loss_last": losses[-1]}
        if peak:
            m["mfu"] = m["tflops"] / peak
        if cuda:
            m["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
        else:
            import resource
            m["peak_memory_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's, KiB on Linux
        if not all(math.isfinite(x) for x in losses):
            m["nonfinite_loss"] = True
        result["modes"][mode] = m
        best = min(result["modes"], key=lambda k: result["modes"][k]["median_step_ms"])
        result.update({"mode": best, **{k: result["modes"][best][k] for k in
                                        ("median_step_ms", "tokens_per_s", "tflops", "peak_memory_mib")}})
        result["mfu"] = result["modes"][best].get("mfu")
        result["elapsed_s"] = time.monotonic() - started
        write_json(a.json, result)

    measure("eager", loss_of)
    if a.compile:
        compile_fn = getattr(torch, "compile", None)
        if compile_fn is None:
            result["compile_error"] = f"torch {torch.__version__} has no torch.compile"
        else:
            try:
                measure("compiled", compile_fn(loss_of))
            except Exception as e:  # noqa: BLE001 - any failure to compile leaves the eager figures
                result["compile_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        result["compiled"] = "compiled" in result["modes"]
        result["elapsed_s"] = time.monotonic() - started
        write_json(a.json, result)
    if a.max_seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, 0)
    print(summary_line(result), flush=True)


def summary_line(r):
    """One line for a log or a summary: each mode's median step and the best one's MFU."""
    parts = [f"{mode} {m['median_step_ms']:.2f} ms" for mode, m in r.get("modes", {}).items()]
    mfu = r.get("mfu")
    tail = f"; MFU {100 * mfu:.1f}% of {r['peak_tflops']:g} TFLOP/s" if mfu else ""
    notes = "; ".join(x for x in (r.get("compile_error"), r.get("cut")) if x)
    return (f"torch {r.get('torch', '?')} {r['model']} {r['precision']} on {r.get('device_name', '?')}: "
            f"{', '.join(parts) or 'nothing measured'}{tail}{'; ' + notes if notes else ''}")


if __name__ == "__main__":
    main()
