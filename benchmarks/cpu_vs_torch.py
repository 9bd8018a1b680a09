"""On the CPU: mhattn on automatic selection against torch, fp32, B=1, H=8, d=64, N = 512..4k.

    python benchmarks/cpu_vs_torch.py [--seqlens 512,1024,2048,4096] [--repeats 7] [--threads N]

Rows: ``mhattn.attention`` against ``torch.nn.functional.scaled_dot_product_attention`` (forward, and
forward+backward), causal and not; ``mhattn.MultiheadAttention`` against ``torch.nn.MultiheadAttention``
(embed 512, 8 heads, batch_first, need_weights=False; forward+backward). Each time is the median of
``--repeats`` runs, the two sides alternating so a load change on the machine hits both alike.
The last column is torch's time / mhattn's (>= 1: mhattn is at least as fast).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mhattn


def median_ms(fns, repeats):
    """Median ms of each of ``fns``, calling them in turn ``repeats`` times (after one warm-up call each)."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            samples[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def functional_rows(seqlen, repeats):
    q, k, v = (torch.randn(1, 8, seqlen, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 8, seqlen, 64)
    rows = []
    for causal in (False, True):
        ours = lambda: mhattn.attention(q, k, v, is_causal=causal)  # noqa: E731
        theirs = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        with torch.no_grad():
            fwd = median_ms([ours, theirs], repeats)
        both = median_ms([lambda: torch.autograd.grad(ours(), (q, k, v), dout),
                          lambda: torch.autograd.grad(theirs(), (q, k, v), dout)], repeats)
        label = f"attention N={seqlen}{' causal' if causal else ''}"
        rows.append((label + " fwd", *fwd))
        rows.append((label + " fwd+bwd", *both))
    return rows


def module_rows(seqlen, repeats):
    ours = mhattn.MultiheadAttention(512, 8, batch_first=True)
    theirs = torch.nn.MultiheadAttention(512, 8, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(1, seqlen, 512)

    def step(module):
        out, _ = module(x, x, x, need_weights=False)
        out.sum().backward()

    return [(f"module N={seqlen} fwd+bwd", *median_ms([lambda: step(ours), lambda: step(theirs)], repeats))]


_PEAK_CHILD = """
import resource, sys, torch, mhattn
impl, n = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))
dout = torch.randn(1, 8, n, 64)
call = {"mhattn": lambda *t: mhattn.attention(*t), "torch": torch.nn.functional.scaled_dot_product_attention,
        "reference": lambda *t: mhattn.attention(*t, backend="reference")}[impl]
small = [t[:, :, :16].detach().requires_grad_() for t in (q, k, v)]
torch.autograd.grad(call(*small), small, dout[:, :, :16])  # imports and first-call set-up are not counted
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.autograd.grad(call(q, k, v), (q, k, v), dout)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def peak_rows(seqlens):
    """Growth of the peak resident memory (MiB) over one forward+backward, each in a fresh process."""
    import subprocess
    import sys

    rows = []
    for n in seqlens:
        got = {}
        for impl in ("mhattn", "torch", "reference"):
            done = subprocess.run([sys.executable, "-c", _PEAK_CHILD, impl, str(n)], capture_output=True, text=True)
            got[impl] = float(done.stdout.strip() or "nan")
        rows.append((n, got))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--memory", action="store_true", help="also the peak memory growth of a forward+backward")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seqlens = [int(n) for n in args.seqlens.split(",")]
    q = torch.randn(1, 8, seqlens[0], 64)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; auto chooses "
          f"{mhattn.explain(q, q, q).chosen!r} for fp32 on the CPU")
    rows = []
    for n in seqlens:
        rows += functional_rows(n, args.repeats) + module_rows(n, args.repeats)
    print(f"{'what':34s} {'mhattn ms':>10s} {'torch ms':>10s} {'torch/mhattn':>12s}")
    for label, ours, theirs in rows:
        print(f"{label:34s} {ours:10.2f} {theirs:10.2f} {theirs / ours:11.2f}x")
    if args.memory:
        print("peak resident memory growth of one forward+backward, MiB (fresh process each)")
        print(f"{'N':>6s} {'mhattn auto':>12s} {'torch sdpa':>11s} {'reference':>10s}")
        for n, got in peak_rows(seqlens):
            print(f"{n:6d} {got['mhattn']:12.1f} {got['torch']:11.1f} {got['reference']:10.1f}")


if __name__ == "__main__":
    main()
