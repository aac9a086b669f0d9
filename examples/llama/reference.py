#!/usr/bin/env python3
"""The example's Llama in plain PyTorch: loads the parameters a run exported (--export FILE,
safetensors) and prints the mean validation loss over the first N batches of token shards, which
matches concerto's own loss (the loss a step returns before its update) to about 1e-6.

  python examples/llama/reference.py --model model.safetensors --data data --seq 32 --batch 8 \
      --batches 4 --heads 4 --kv-heads 2

Conventions (concerto's CPU kernels): weights are [in, out] (y = x @ W); RMSNorm eps 1e-6;
rope rotates lane i with lane i + head_dim/2 of each head ("rotate half"), angle
position * theta^(-2i/head_dim), positions 0..seq-1; query head h reads k/v head
h // (heads / kv_heads); attention scale 1/sqrt(head_dim); SwiGLU silu(x @ w1) * (x @ w3);
the loss is the mean over every token of the batch. Layers, sizes and vocabulary come from
the tensors' shapes.
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def rmsnorm(x, g, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rope(x, theta):  # x: [batch, heads, seq, head_dim]; lanes i and i + head_dim/2 rotate together
    T, D = x.shape[-2:]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    cos, sin = angle.cos().float(), angle.sin().float()
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def llama_loss(W, ids, labels, heads, kv_heads, theta):
    B, T = ids.shape
    split = lambda x, n: x.view(B, T, n, -1).transpose(1, 2)  # [B, T, n·head_dim] -> [B, n, T, head_dim]
    layers = 1 + max(int(name.split(".")[1]) for name in W if name.startswith("layers."))
    h = W["wte"][ids]
    for l in range(layers):
        p = lambda name: W[f"layers.{l}.{name}"]
        a = rmsnorm(h, p("attn_norm.g"))
        q = rope(split(a @ p("wq"), heads), theta)
        k = rope(split(a @ p("wk"), kv_heads), theta).repeat_interleave(heads // kv_heads, 1)
        v = split(a @ p("wv"), kv_heads).repeat_interleave(heads // kv_heads, 1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # softmax(q·kᵀ/√head_dim + mask)·v
        h = h + attn.transpose(1, 2).reshape(B, T, -1) @ p("wo")
        m = rmsnorm(h, p("ffn_norm.g"))
        h = h + (F.silu(m @ p("w1")) * (m @ p("w3"))) @ p("w2")
    logits = rmsnorm(h, W["norm.g"]) @ W["head"]
    return F.cross_entropy(logits.view(B * T, -1), labels.reshape(-1))


def windows(folder, seq):
    """The windows of seq + 1 tokens concerto's token_loader (shuffle off) serves: each shard
    (llm.c layout: 256 int32 of header, then uint16 or uint32 tokens) cut one after the other;
    a window never crosses into the next shard."""
    for path in sorted(glob.glob(os.path.join(folder, "val*.bin"))):
        header = np.fromfile(path, np.int32, 256)
        width = {20240520: np.uint16, 20240801: np.uint32}[int(header[0])]
        tokens = np.fromfile(path, width, int(header[2]), offset=1024).astype(np.int64)
        for w in range((len(tokens) - 1) // seq):
            yield tokens[w * seq : w * seq + seq + 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="safetensors file a concerto run exported")
    ap.add_argument("--data", required=True, help="folder of val*.bin token shards")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    args = ap.parse_args()

    W = {name: t.float() for name, t in load_file(args.model).items()}  # F32 or BF16
    win = list(windows(args.data, args.seq))
    if len(win) < args.batches * args.batch:
        raise SystemExit(f"{args.data}: {len(win)} windows, fewer than {args.batches} batches of {args.batch}")
    losses = []
    with torch.no_grad():
        for b in range(args.batches):
            x = torch.from_numpy(np.stack(win[b * args.batch : (b + 1) * args.batch]))
            losses.append(llama_loss(W, x[:, :-1], x[:, 1:], args.heads, args.kv_heads, args.rope_theta).item())
    print(f"val loss {sum(losses) / len(losses):.8f}")


if __name__ == "__main__":
    main()
