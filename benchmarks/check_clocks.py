"""Clocks after an idle GPU: per-call times of forward+backward over 40 back-to-back calls after 1 s idle, torch's
SDPA (cuDNN) beside the Triton backend, and the GPU timer with the tuner's and the bench's settings on the same calls.

    source benchmarks/device_env.sh && python3 benchmarks/check_clocks.py

bf16, B*N = 16384, H = 2048/d (the bench's protocol) at d = 128 16k causal, d = 128 4k, d = 256 16k causal. What it
showed on the H200 is in backends/triton/NOTES.md, "Clocks after an idle GPU" (why mhattn tune settles:
timing.settle)."""
import time

import torch

import mhattn
from mhattn.benchmark.timing import bench_ms


def make(d, n, causal, backend, dev):
    """One forward+backward of mhattn.attention on ``backend`` at head dim d, N keys, the protocol's B and H."""
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)

    def call():
        mhattn.attention(q, k, v, is_causal=causal, backend=backend).backward(dout)
    return call


def per_call(fn, flush, calls=40):
    """Milliseconds of each of ``calls`` back-to-back calls (CUDA events around each; the L2 flushed before each)."""
    out = []
    for _ in range(calls):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        out.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in out]


def main():
    dev = torch.device("cuda")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)  # larger than the L2, as do_bench flushes
    for d, n, causal in ((128, 16384, True), (128, 4096, False), (256, 16384, True)):
        fns = {name: make(d, n, causal, name, dev) for name in ("sdpa", "triton")}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        print(f"== d={d} N={n} causal={causal}")
        for _ in range(2):
            for name, f in fns.items():
                time.sleep(1.0)
                t = per_call(f, flush)
                medians = f"calls 5-10 med {sorted(t[5:10])[2]:.2f} 10-20 med {sorted(t[10:20])[5]:.2f} "
                print(f"{name:7s} per call after 1 s idle: first 5 {[round(x, 2) for x in t[:5]]} {medians}"
                      f"20-40 med {sorted(t[20:40])[10]:.2f}")
        for w, r in ((5, 20), (25, 100), (100, 20), (50, 50)):
            row = {}
            for name, f in fns.items():
                time.sleep(1.0)
                row[name] = bench_ms(f, w, r, dev)
            print(f"do_bench warmup {w} rep {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                  + f"  sdpa/triton {row['sdpa'] / row['triton']:.3f}")


if __name__ == "__main__":
    main()
