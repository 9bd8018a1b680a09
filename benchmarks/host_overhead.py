"""Host-side cost of one attention call, beside the kernel time, on a GPU.

For each shape: the backend's forward called directly, mhattn.attention without and with grad-tracking
inputs (do_bench medians, ms), and the host time of one call on a tiny problem (the launch floor).
    python3 benchmarks/host_overhead.py [backend ...]
"""

import sys
import time

import torch
from triton.testing import do_bench

import mhattn
from mhattn.backends.base import AttentionParams

SHAPES = [(32, 32, 512, 64, True), (16, 16, 1024, 128, False), (16, 16, 1024, 128, True), (8, 16, 2048, 128, True)]


def host_us(fn, calls=300):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main(names):
    print(f"{'backend':<8} {'B':>3} {'H':>3} {'N':>5} {'d':>4} causal  direct_ms  attn_ms  attn_grad_ms  host_us_tiny")
    for name in names:
        backend = mhattn.get_backend(name)
        tiny = [torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        tiny_us = host_us(lambda: mhattn.attention(*tiny, is_causal=True, backend=name))
        for b, h, n, d, causal in SHAPES:
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            params = AttentionParams(scale=d**-0.5, window_right=0 if causal else None)
            direct = do_bench(lambda: backend.forward(q, k, v, params), return_mode="median")
            plain = do_bench(lambda: mhattn.attention(q, k, v, is_causal=causal, backend=name), return_mode="median")
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            grad = do_bench(lambda: mhattn.attention(qg, kg, vg, is_causal=causal, backend=name), return_mode="median")
            print(f"{name:<8} {b:>3} {h:>3} {n:>5} {d:>4} {str(causal):<6} {direct:>10.3f} {plain:>8.3f} {grad:>13.3f} "
                  f"{tiny_us:>13.1f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["triton", "cupy"])
