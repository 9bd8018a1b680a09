"""Ring attention on several GPUs against one: agreement (bf16, the conformance tolerance) and scaling.

    source benchmarks/device_env.sh
    torchrun --nproc-per-node 2 benchmarks/check_ring.py                 # the checks, then N = 128k and 256k
    torchrun --nproc-per-node 2 benchmarks/check_ring.py --seqlen 128k   # timings at 128k only
    torchrun --nproc-per-node 2 benchmarks/check_ring.py --backend cupy --seqlen ""   # the checks on cupy

1. Agreement: for both layouts, causal and not, and causal with a sliding window of three quarters of a shard and
   softcap, and (contiguous) causal on shards of different lengths with a key-padding mask (N = 8k, GQA 8/2,
   d = 128, bf16), every rank's shard of the ring's
   output, lse, dq, dk and dv is judged by CONFORMANCE.md's rule (mhattn.conformance.tolerance): gold =
   the reference in float32 over the whole sequence, low precision = the reference in bf16; the single-GPU
   result of the fused backend is judged the same way beside it, and the largest ring vs single-GPU
   difference is printed.
2. Scaling: causal bf16, B = 1, H = 32, d = 128, forward+backward (torch.autograd.grad), the total sequence
   N split over the W ranks, against one GPU running mhattn.attention over all N. For each layout: the
   ring's time (slowest rank), the time of the same local kernels with the exchange replaced by a local
   copy ("compute only"), and the time of the same exchanges alone ("comm only"). Hidden communication =
   1 - (ring - compute only) / comm only. TFLOP/s count 7 * B * H * N^2 * d for the causal forward+backward.

On a machine without a GPU it runs on the CPU over gloo with the reference backend (tiny sizes only, for
checking the script): torchrun --nproc-per-node 2 benchmarks/check_ring.py --cpu-smoke.
Logs: $OUT/check_ring.log and $OUT/check_ring.json when OUT is set. The table is printed last.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines

import torch
import torch.distributed as dist

import mhattn
from mhattn import dispatch
from mhattn.conformance.tolerance import compare
from mhattn.distributed import PeerRing, _run_ring, ring_attention, shard_sequence

START = time.perf_counter()
LOG_LINES = []


def parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LOG_LINES.append(line)
    if dist.get_rank() == 0:
        print(line, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LoopbackRing:
    """The ring's interface without communication: the "received" buffer is a copy of the sent one, so the
    ring runs the same local kernels on the same shapes (its own shard at every step)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def start(self, send, recv):
        recv.copy_(send)
        return _Done()


class _Done:
    def wait(self):
        pass


def timed(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up, the slowest rank's."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


# ---- 1. agreement ------------------------------------------------------------------------------------


def agreement(args, device, dtype, backend) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, heads_q, heads_kv, dim = 1, args.check_heads, max(1, args.check_heads // 4), args.head_dim
    n = args.check_seqlen
    ok = True
    say(f"\n== agreement: {str(dtype).replace('torch.', '')}, B={batch} Hq={heads_q} Hkv={heads_kv} N={n} "
        f"d={dim}, W={world}, local backend {backend or 'auto'}")
    # A sliding window of three quarters of a shard (it crosses the shards' boundaries) with softcap, causal; and
    # (contiguous) shards of different lengths with a key-padding mask, causal.
    windowed = dict(window=(3 * n // (4 * world), 0), softcap=30.0)
    shift = n // (4 * world) if world > 1 else 0
    uneven = tuple(n // world + (shift if r == 0 else -shift if r == world - 1 else 0) for r in range(world))
    for layout in ("contiguous", "zigzag"):
        cases = [(True, {}), (False, {}), (True, windowed)] + ([(True, "uneven")] if layout == "contiguous" else [])
        for causal, features in cases:
            gen = torch.Generator(device=device).manual_seed(7)
            q = torch.randn(batch, heads_q, n, dim, generator=gen, device=device, dtype=dtype)
            k = torch.randn(batch, heads_kv, n, dim, generator=gen, device=device, dtype=dtype)
            v = torch.randn(batch, heads_kv, n, dim, generator=gen, device=device, dtype=dtype)
            grad = torch.randn(batch, heads_q, n, dim, generator=gen, device=device, dtype=dtype)
            kwargs = dict(is_causal=causal, enable_gqa=True, return_lse=True)
            lengths = key_mask = None
            full_kwargs, label = dict(kwargs), ""
            if features == "uneven":  # the full run's mask: the key mask and the causal mask together
                lengths = uneven
                key_mask = torch.rand(batch, n, generator=gen, device=device) > 0.1
                rows = torch.arange(n, device=device)
                full_kwargs.update(is_causal=False,
                                   attn_mask=key_mask[:, None, None, :] & (rows[None, :] <= rows[:, None]))
                label = f" lengths={lengths} key_mask"
            elif features:
                kwargs.update(features)
                full_kwargs.update(features)
                label = f" window={features['window']} softcap={features['softcap']}"

            def full_run(inputs, name):
                leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
                out, lse = mhattn.attention(*leaves, backend=name, **full_kwargs)
                grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
                return [out, lse, *grads]

            gold = full_run([t.float() for t in (q, k, v)], "reference")
            lowp = full_run((q, k, v), "reference")
            single = full_run((q, k, v), backend)

            def shard(t, dim=-2):
                return shard_sequence(t, layout=layout, dim=dim, lengths=lengths)

            local = [shard(t).detach().clone().requires_grad_(True) for t in (q, k, v)]
            out, lse = ring_attention(*local, layout=layout, backend=backend, lengths=lengths,
                                      key_mask=None if key_mask is None else shard(key_mask, -1), **kwargs)
            grads = torch.autograd.grad(out, local, shard(grad))
            ring = [out, lse, *grads]

            verdicts, worst = [], 0.0
            for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
                sd = -1 if name == "lse" else -2
                g, lp, one = shard(gold[i], sd), shard(lowp[i], sd), shard(single[i], sd)
                mine = compare(name, ring[i], g, lp, dtype=dtype)
                theirs = compare(name, one, g, lp, dtype=dtype)
                verdicts.append((mine, theirs))
                worst = max(worst, float((ring[i].detach().float() - one.detach().float()).abs().max()))
            bad = torch.tensor([sum(not m.ok for m, _ in verdicts)], device=device)
            dist.all_reduce(bad)
            ok &= int(bad) == 0
            say(f"{layout:<10} causal={str(causal):<5}{label} {'ok' if int(bad) == 0 else 'FAIL'} "
                f"(rank 0; max |ring - single GPU| = {worst:.3g})")
            for mine, theirs in verdicts:
                say(f"    ring {mine}    | single GPU {theirs.ratio:.2f}")
            if rank != 0 and int(bad):
                print(f"rank {rank}: " + "; ".join(str(m) for m, _ in verdicts if not m.ok), flush=True)
    return ok


# ---- 2. scaling --------------------------------------------------------------------------------------


def comm_only(ring, kv_numel, dtype, device, reps) -> float:
    """The exchanges of one forward+backward alone: W-1 K/V shards forward, W-1 K/V shards and W dK/dV
    accumulators (float32) backward, one after another."""
    world = ring.size
    kv = [torch.empty(kv_numel, device=device, dtype=dtype) for _ in range(2)]  # contents do not matter
    dkv = [torch.empty(kv_numel, device=device, dtype=torch.float32) for _ in range(2)]

    def run():
        for _ in range(2 * (world - 1)):
            ring.start(kv[0], kv[1]).wait()
        for _ in range(world):
            ring.start(dkv[0], dkv[1]).wait()

    return timed(run, device, reps)


def scaling(args, device, dtype, backend) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, heads, dim = 1, args.heads, args.head_dim
    request = dispatch.requested(backend)
    rows = []
    seqlens = [parse_size(s) for s in args.seqlen.split(",") if s.strip()]
    previous = None  # (N, seconds the previous size took)
    for n in seqlens:
        if previous is not None:
            estimate = previous[1] * (n / previous[0]) ** 2
            go = torch.tensor([1 if time.perf_counter() - START + estimate < args.budget_s else 0], device=device)
            dist.broadcast(go, 0)
            if not int(go):
                say(f"\nN={n}: skipped (estimated {estimate:.0f} s would pass the --budget-s {args.budget_s} s)")
                continue
        began = time.perf_counter()
        flops = 7.0 * batch * heads * n * n * dim
        say(f"\n== scaling: causal, N={n} over {world} ranks (N_local={n // world}), B={batch} H={heads} d={dim}")

        gen = torch.Generator(device=device).manual_seed(11)
        q, k, v = (torch.randn(batch, heads, n, dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
        grad = torch.randn(batch, heads, n, dim, generator=gen, device=device, dtype=dtype)
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        chosen = mhattn.explain(*leaves, is_causal=True, backend=backend).chosen
        say(f"one GPU runs on {chosen} (request: {request[0]}, from {request[1]})")

        def single():
            out = mhattn.attention(*leaves, is_causal=True, backend=backend)
            torch.autograd.grad(out, leaves, grad)

        t_single = timed(single, device, args.reps)
        say(f"one GPU, all N:     {t_single * 1e3:9.1f} ms  {flops / t_single / 1e12:7.1f} TFLOP/s")
        for layout in ("contiguous", "zigzag"):
            local = [shard_sequence(t.detach(), layout=layout).contiguous().requires_grad_(True) for t in (q, k, v)]
            grad_local = shard_sequence(grad, layout=layout).contiguous()
            scale = dim ** -0.5
            loopback = LoopbackRing(rank, world)

            def ring_run():
                out = ring_attention(*local, is_causal=True, layout=layout, backend=backend)
                torch.autograd.grad(out, local, grad_local)

            def compute_run():
                out, _ = _run_ring(*local, loopback, layout, True, scale, request)
                torch.autograd.grad(out, local, grad_local)

            t_ring = timed(ring_run, device, args.reps)
            t_compute = timed(compute_run, device, args.reps)
            t_comm = comm_only(PeerRing(None, device), local[1].numel() + local[2].numel(), dtype, device, args.reps)
            exposed = max(0.0, t_ring - t_compute)
            hidden = 1.0 - min(1.0, exposed / t_comm) if t_comm > 0 else 1.0
            row = dict(seqlen=n, world=world, layout=layout, ring_ms=t_ring * 1e3, compute_ms=t_compute * 1e3,
                       comm_ms=t_comm * 1e3, hidden=hidden, single_ms=t_single * 1e3,
                       ring_tflops=flops / t_ring / 1e12, single_tflops=flops / t_single / 1e12,
                       speedup=t_single / t_ring)
            rows.append(row)
            say(f"ring {layout:<10}:   {t_ring * 1e3:9.1f} ms  {row['ring_tflops']:7.1f} TFLOP/s  "
                f"(compute only {t_compute * 1e3:.1f} ms, comm only {t_comm * 1e3:.1f} ms, hidden {hidden:.0%}; "
                f"{row['speedup']:.2f}x one GPU)")
            del local, grad_local
        del q, k, v, grad, leaves
        if device.type == "cuda":
            say(f"peak memory rank {rank}: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        previous = (n, time.perf_counter() - began)
    return rows


def table(rows) -> list:
    lines = ["| N | W | layout | ring ms | TFLOP/s | one GPU ms | TFLOP/s | speed-up | zigzag/contig | "
             "compute-only ms | comm-only ms | comm hidden |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["seqlen"], r["layout"]): r for r in rows}
    for r in rows:
        contiguous = by_key.get((r["seqlen"], "contiguous"))
        ratio = f"{contiguous['ring_ms'] / r['ring_ms']:.2f}x" if r["layout"] == "zigzag" and contiguous else ""
        size = f"{r['seqlen'] // 1024}k" if r["seqlen"] % 1024 == 0 else str(r["seqlen"])
        lines.append(f"| {size} | {r['world']} | {r['layout']} | {r['ring_ms']:.1f} | {r['ring_tflops']:.0f} | "
                     f"{r['single_ms']:.1f} | {r['single_tflops']:.0f} | {r['speedup']:.2f}x | {ratio} | "
                     f"{r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {r['hidden']:.0%} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", default=None, help="total sequence lengths to time (comma-separated; default "
                        "128k,256k, 256,512 with --cpu-smoke; empty: the checks only)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2, help="timed runs after one warm-up (median)")
    parser.add_argument("--check-seqlen", type=int, default=8192,
                        help="total N of the agreement checks (8k: the kernels' long-sequence tiles, as timed)")
    parser.add_argument("--check-heads", type=int, default=8)
    parser.add_argument("--backend", default=None, help="mhattn backend of the local work (default: auto)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip a size whose estimate passes this")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="CPU over gloo, reference backend, tiny sizes (checks the script, times nothing real)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        args.backend = "reference"
        args.heads, args.head_dim, args.check_seqlen, args.check_heads = 2, 16, 64, 4
    if args.seqlen is None:
        args.seqlen = "128k,256k" if cuda else "256,512"
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(device) if cuda else "CPU (gloo smoke run)"
    say(f"check_ring: {dist.get_world_size()} ranks, {name}, torch {torch.version.__version__}, "
        f"backend {dist.get_backend()}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")

    ok = True if args.skip_check else agreement(args, device, dtype, args.backend)
    rows = scaling(args, device, dtype, args.backend)
    lines = table(rows) if rows else ["(no timings asked for)"]
    say(f"\nagreement (bf16, conformance tolerance, both layouts): {'skipped' if args.skip_check else ('PASS' if ok else 'FAIL')}")
    say(f"total {time.perf_counter() - START:.0f} s\n")
    for line in lines:
        say(line)
    out_dir = os.environ.get("OUT")
    if out_dir and dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "check_ring.log"), "w") as f:
            f.write("\n".join(LOG_LINES) + "\n")
        with open(os.path.join(out_dir, "check_ring.json"), "w") as f:
            json.dump(dict(agreement=ok, rows=rows, device=name, world=dist.get_world_size()), f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
