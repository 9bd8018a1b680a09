"""Train a small causal transformer with its sequence sharded over the ranks (context parallelism), and
compare the loss, step by step, with the same model trained on the whole sequence without sharding.

    torchrun --nproc-per-node 2 examples/ring_train.py                 # GPUs: NCCL, attention in bf16
    torchrun --nproc-per-node 2 examples/ring_train.py --cpu           # CPU: gloo, float32, tiny sizes
    torchrun --nproc-per-node 2 examples/ring_train.py --layout contiguous

Sharded run: every rank holds the same model and the same batch, keeps the tokens of its shard
(mhattn.distributed.shard_sequence, positions included), runs attention with ring_attention and every other
layer on its own tokens, and sums the parameter gradients over the ranks (each rank's loss is its tokens'
share of the mean), so every rank takes the same optimizer step. Unsharded run: the same model, data and
steps with mhattn.attention over the whole sequence. The two losses agree to rounding (float32 on the CPU)
or to bf16 noise (GPU); the script exits with 1 when they differ by more than --tolerance (relative).
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mhattn
from mhattn.distributed import ring_attention, shard_sequence


class CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        """x (B, n, dim); attend(q, k, v) -> (B, heads, n, head_dim), causal over the whole sequence."""
        batch, n, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, n, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        o = attend(q, k, v)
        x = x + self.proj(o.transpose(1, 2).reshape(batch, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions, attend):
        """tokens (B, n) int64, positions (n,) global token indices -> logits (B, n, vocab)."""
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def batch_for(step: int, args, device):
    """(B, N + 1) tokens: a random first half repeated, so attention has something to learn (copying)."""
    gen = torch.Generator().manual_seed(1000 + step)
    half = torch.randint(0, args.vocab, (args.batch, args.seqlen // 2 + 1), generator=gen)
    return torch.cat([half, half], dim=1)[:, : args.seqlen + 1].to(device)


def train(args, device, sharded: bool) -> list:
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.kv_heads, args.layers, args.seqlen).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    attn_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def attend(q, k, v):
        q, k, v = (t.to(attn_dtype) for t in (q, k, v))
        if sharded:
            out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, layout=args.layout)
        else:
            out = mhattn.attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.float()

    losses = []
    for step in range(args.steps):
        tokens = batch_for(step, args, device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(args.seqlen, device=device)
        if sharded:
            inputs, targets = (shard_sequence(t, layout=args.layout, dim=1) for t in (inputs, targets))
            positions = shard_sequence(positions, layout=args.layout, dim=0)
        logits = model(inputs, positions, attend)
        # This rank's tokens' share of the mean over all B * N tokens.
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
        if sharded:
            loss = loss / dist.get_world_size()
        loss.backward()
        total = loss.detach().clone()
        if sharded:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU with tiny sizes")
    parser.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seqlen", type=int, default=None, help="total tokens per sequence")
    parser.add_argument("--tolerance", type=float, default=None, help="largest relative loss difference")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
        sizes = dict(vocab=256, dim=512, heads=8, kv_heads=2, layers=4, batch=2, lr=1e-3, seqlen=8192, steps=20,
                     tolerance=2e-2)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        sizes = dict(vocab=32, dim=64, heads=4, kv_heads=2, layers=2, batch=2, lr=3e-3, seqlen=128, steps=8,
                     tolerance=1e-4)
    for name, value in sizes.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    rank, world = dist.get_rank(), dist.get_world_size()

    reference = train(args, device, sharded=False)
    sharded = train(args, device, sharded=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, reference))
    if rank == 0:
        print(f"{args.steps} steps, B={args.batch} N={args.seqlen} over {world} ranks ({args.layout}), "
              f"{'GPU bf16 attention' if cuda else 'CPU float32'}")
        print(f"{'step':>4} {'unsharded':>10} {'sharded':>10} {'rel. diff':>10}")
        for step, (a, b) in enumerate(zip(reference, sharded)):
            print(f"{step:>4} {a:>10.5f} {b:>10.5f} {abs(b - a) / abs(a):>10.2e}")
        verdict = "OK" if worst <= args.tolerance else "DIFFERENT"
        print(f"largest relative difference {worst:.2e} (tolerance {args.tolerance:.0e}): {verdict}")
    dist.destroy_process_group()
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
