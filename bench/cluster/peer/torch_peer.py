#!/usr/bin/env python3
"""The peer of the concerto MLP and GPT examples: PyTorch on CPU with gloo, on the same hosts.

Modes (run one after the other in one launch, so that torch is imported once per rank):
  ddp          DistributedDataParallel, default bucket_cap_mb (25)
  ddp:MB       DistributedDataParallel with bucket_cap_mb=MB (the tuned variants)
  tp           a hand-written Megatron-style tensor-parallel MLP: column-parallel W1, GELU,
               row-parallel W2, one all-reduce of the block's output forward and one of its
               input gradient backward (Shoeybi et al., "Megatron-LM", 2019, section 3)
  gpt          examples/gpt's model (below) under DistributedDataParallel, default bucket_cap_mb
  gpt:MB       the same with bucket_cap_mb=MB

MLP model (ddp, tp): `layers` blocks of Linear(hidden, ffn*hidden) -> GELU -> Linear(ffn*hidden,
hidden) (no bias unless --bias, like examples/mlp), MSE loss against fixed random targets, plain
SGD. `--batch` is the global batch: DDP splits it over the ranks, TP gives every rank all of it.
One thread per rank unless --threads says.

GPT model (gpt), the one of examples/gpt/model.hpp, parameter for parameter (same names, same
[in, out] shapes, x @ W): a token embedding wte[vocab, hidden] and no positional embedding;
`layers` pre-layernorm blocks h += (causal attention of layernorm(h)) @ wo, h += GELU(layernorm(h)
@ fc1) @ fc2, the attention with `--heads` heads of hidden/heads, softmax(q k^T / sqrt(head_dim)
+ causal mask) v, written by hand (torch 1.13 has no scaled_dot_product_attention); GELU's tanh
approximation; no bias in any matmul; layernorms with gain and bias, eps 1e-5; a final layernorm,
an untied head[hidden, vocab]; the mean cross-entropy over all tokens; AdamW (lr 3e-3, betas 0.9
and 0.999, eps 1e-8, weight decay 0.01 on every parameter) as the example. `--batch` sequences
of `--seq` random token ids in [0, vocab) (the global batch, split over the ranks); --hidden,
--layers and --batch are the GPT's in a gpt run (the bench launches the GPT modes separately).

Launched with one process per host (rank and size come from Open MPI's environment):
  $CLUSTER_MPIRUN -np 4 -x GLOO_SOCKET_IFNAME=$CLUSTER_IFNAME \\
      /usr/bin/python3 bench/cluster/peer/torch_peer.py --master $CLUSTER_MASTER --modes ddp,ddp:4,tp
  $CLUSTER_MPIRUN -np 4 -x GLOO_SOCKET_IFNAME=$CLUSTER_IFNAME \\
      /usr/bin/python3 bench/cluster/peer/torch_peer.py --master $CLUSTER_MASTER --modes gpt,gpt:1 \\
      --layers 2 --hidden 256 --heads 4 --seq 64 --batch 16
Rank 0 prints one JSON object per mode on stdout.
"""

import argparse
import json
import os
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--ffn", type=int, default=4, help="FFN expansion factor (default 4)")
    p.add_argument("--layers", type=int, default=1, help="MLP blocks (default 1, as examples/mlp)")
    p.add_argument("--bias", action="store_true", help="linear layers with bias (examples/mlp has none)")
    p.add_argument("--heads", type=int, default=4, help="GPT attention heads (default 4)")
    p.add_argument("--seq", type=int, default=64, help="GPT sequence length (default 64)")
    p.add_argument("--vocab", type=int, default=80,
                   help="GPT vocabulary (default 80: examples/gpt's characters of GPL-3, padded to 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="GPT AdamW learning rate (default 3e-3, as examples/gpt)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--modes", default="ddp,ddp:4,tp", help="comma-separated: ddp, ddp:MB, tp, gpt, gpt:MB")
    p.add_argument("--master", default=os.environ.get("CLUSTER_MASTER", "127.0.0.1"),
                   help="address of rank 0 for the rendezvous")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--label", default="", help="copied into the output")
    return p.parse_args()


def env_int(*names):
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    sys.exit(f"torch_peer.py: none of {', '.join(names)} is set; launch it with mpirun (one rank per host)")


def gpt_model(hidden, heads, layers, vocab, seq):
    """examples/gpt's model in PyTorch (the module comment says what it is); also the model that
    bench/cpu_kernels/gpt_vs_torch.py times op by op."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class gpt(nn.Module):
        """examples/gpt/model.hpp in PyTorch: the same parameters, named and shaped as there."""

        def __init__(self):
            super().__init__()
            if hidden % heads:
                sys.exit(f"torch_peer.py: hidden {hidden} is not divisible by {heads} heads")
            torch.manual_seed(1234)  # the same weights on every rank, as DDP expects

            # As concerto's train::step: matrices uniform with variance 1/rows, gains 1, biases 0.
            def matrix(rows, cols):
                return nn.Parameter((torch.rand(rows, cols) * 2 - 1) * (3 / rows) ** 0.5)

            def norm():
                return nn.ParameterDict({"g": nn.Parameter(torch.ones(hidden)), "b": nn.Parameter(torch.zeros(hidden))})

            # Registered about in the order of use (DDP fills its first buckets in reverse order); DDP
            # rebuilds its buckets in the order the gradients came after the first (warm-up) step.
            self.wte = matrix(vocab, hidden)
            self.blocks = nn.ModuleList()
            for _ in range(layers):
                blk = nn.Module()
                blk.ln1 = norm()
                blk.wq, blk.wk, blk.wv, blk.wo = (matrix(hidden, hidden) for _ in range(4))
                blk.ln2 = norm()
                blk.fc1, blk.fc2 = matrix(hidden, 4 * hidden), matrix(4 * hidden, hidden)
                self.blocks.append(blk)
            self.lnf = norm()
            # In a submodule: a module's own parameters come before its submodules' in parameters().
            self.out = nn.ParameterDict({"head": matrix(hidden, vocab)})
            # A plain attribute, not a buffer: DDP would broadcast a buffer before every forward.
            self.future = torch.ones(seq, seq, dtype=torch.bool).triu(1)

        @staticmethod
        def layernorm(x, ln):
            return F.layer_norm(x, (x.shape[-1],), ln["g"], ln["b"], eps=1e-5)

        def attention(self, q, k, v):
            b, t, _ = q.shape
            d = hidden // heads
            # [b, t, heads*d] -> [b, heads, t, d]: head i is columns [i*d, (i+1)*d), as concerto's kernel.
            q, k, v = (x.view(b, t, heads, d).transpose(1, 2) for x in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * d ** -0.5
            scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, hidden)

        def forward(self, ids):
            x = F.embedding(ids, self.wte)
            for blk in self.blocks:
                m = self.layernorm(x, blk.ln1)
                x = x + self.attention(m @ blk.wq, m @ blk.wk, m @ blk.wv) @ blk.wo
                m = self.layernorm(x, blk.ln2)
                x = x + F.gelu(m @ blk.fc1, approximate="tanh") @ blk.fc2
            return self.layernorm(x, self.lnf) @ self.out["head"]


    return gpt()


def main():
    a = parse()
    rank = env_int("OMPI_COMM_WORLD_RANK", "RANK")
    world = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=rank, world_size=world)
    h, f = a.hidden, a.ffn * a.hidden

    def mlp():
        torch.manual_seed(1234)  # the same weights on every rank, as DDP expects
        blocks = []
        for _ in range(a.layers):
            blocks += [nn.Linear(h, f, bias=a.bias), nn.GELU(), nn.Linear(f, h, bias=a.bias)]
        return nn.Sequential(*blocks)

    # Megatron's f and g: f is the identity forward and an all-reduce backward (the block's
    # input gradient sums the partial gradients of every shard); g is the reverse.
    class copy_to_tp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad)
            return grad

    class reduce_from_tp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    class tp_block(nn.Module):
        def __init__(self):
            super().__init__()
            if f % world:
                sys.exit(f"torch_peer.py: ffn width {f} is not divisible by {world} ranks")
            shard = f // world
            self.w1 = nn.Parameter(torch.randn(shard, h) * h ** -0.5)   # column-parallel: rows of W1
            self.b1 = nn.Parameter(torch.zeros(shard)) if a.bias else None
            self.w2 = nn.Parameter(torch.randn(h, shard) * f ** -0.5)   # row-parallel: columns of W2
            self.b2 = nn.Parameter(torch.zeros(h)) if a.bias else None  # added once, after the sum

        def forward(self, x):
            x = copy_to_tp.apply(x)
            y = F.gelu(F.linear(x, self.w1, self.b1))
            out = reduce_from_tp.apply(F.linear(y, self.w2))
            return out if self.b2 is None else out + self.b2

    def run(mode):
        torch.manual_seed(99 + rank)
        if mode == "gpt" or mode.startswith("gpt:"):
            return run_gpt(mode)
        if mode == "tp":
            torch.manual_seed(1234 + rank)
            model = nn.Sequential(*[tp_block() for _ in range(a.layers)])
            local_batch = a.batch
            bucket = None
        else:
            if a.batch % world:
                sys.exit(f"torch_peer.py: batch {a.batch} is not divisible by {world} ranks")
            local_batch = a.batch // world
            bucket = float(mode.split(":")[1]) if ":" in mode else None
            kwargs = {} if bucket is None else {"bucket_cap_mb": bucket}
            model = nn.parallel.DistributedDataParallel(mlp(), **kwargs)
        x = torch.randn(local_batch, h)
        target = torch.randn(local_batch, h)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for step in range(a.warmup + a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            # The step ends when its slowest rank ends: a second barrier, as cheap as a few RTTs.
            dist.barrier()
            if step >= a.warmup:
                times.append(time.perf_counter() - t0)
        params = sum(p.numel() for p in model.parameters())
        return {"peer": "pytorch-gloo", "torch": torch.__version__, "label": a.label, "model": "mlp", "mode": mode,
                "bucket_cap_mb": bucket if mode != "tp" else None, "ranks": world, "threads": a.threads,
                "batch": a.batch, "hidden": h, "ffn": a.ffn, "layers": a.layers, "bias": a.bias,
                "params_per_rank": params, "steps": a.steps,
                "median_step_ms": 1e3 * statistics.median(times),
                "min_step_ms": 1e3 * min(times), "max_step_ms": 1e3 * max(times)}

    def run_gpt(mode):
        if a.batch % world:
            sys.exit(f"torch_peer.py: batch {a.batch} is not divisible by {world} ranks")
        bucket = float(mode.split(":")[1]) if ":" in mode else None
        kwargs = {} if bucket is None else {"bucket_cap_mb": bucket}
        model = nn.parallel.DistributedDataParallel(gpt_model(h, a.heads, a.layers, a.vocab, a.seq), **kwargs)
        torch.manual_seed(99 + rank)  # each rank its own sequences
        ids = torch.randint(0, a.vocab, (a.batch // world, a.seq))
        labels = torch.randint(0, a.vocab, (a.batch // world, a.seq))
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        times, losses = [], []
        for step in range(a.warmup + a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(ids).view(-1, a.vocab), labels.view(-1))
            loss.backward()
            opt.step()
            dist.barrier()
            if step >= a.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())  # after the second barrier: not timed
        params = sum(p.numel() for p in model.parameters())
        return {"peer": "pytorch-gloo", "torch": torch.__version__, "label": a.label, "model": "gpt", "mode": mode,
                "bucket_cap_mb": bucket, "ranks": world, "threads": a.threads, "batch": a.batch, "seq": a.seq,
                "hidden": h, "heads": a.heads, "layers": a.layers, "vocab": a.vocab, "lr": a.lr,
                "params_per_rank": params, "steps": a.steps, "loss_first": losses[0], "loss_last": losses[-1],
                "median_step_ms": 1e3 * statistics.median(times),
                "min_step_ms": 1e3 * min(times), "max_step_ms": 1e3 * max(times)}

    for mode in a.modes.split(","):
        mode = mode.strip()
        kind, _, mb = mode.partition(":")
        known = mode in ("tp", "ddp", "gpt") or (kind in ("ddp", "gpt") and mb.replace(".", "", 1).isdigit())
        if not known:
            sys.exit(f"torch_peer.py: unknown mode '{mode}' (ddp, ddp:MB, tp, gpt or gpt:MB, MB a number)")
        result = run(mode)
        if rank == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
