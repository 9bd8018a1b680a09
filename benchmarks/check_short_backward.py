"""The Triton backend's short backward (one launch: backward.backward_short_kernel) beside its three-kernel
FlashAttention-2 backward, torch's SDPA and the CuPy backend (on sm_90 its Hopper backward with dQ stored directly,
DQ_DIRECT, and with the float32 dQ buffer), in one process and taking turns, at short shapes (every key in one block):
per forward+backward, the GPU time (do_bench median, host-bound at these sizes) and the host loop (300 calls, one
synchronize, the best of 7 rounds, each loop from the fastest CPU: latency.host_loops_in_turn). The three-kernel rows
run with configs.SHORT_BACKWARD_ACCUMULATORS = 0 (the short backward off) and fresh signatures, the CuPy buffer rows
with ops.HOPPER_BWD_DIRECT_DQ = False and fresh plans.

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_short_backward.py

Prints a line per shape as it goes and the table last.
"""

import contextlib

import torch

import mhattn
from mhattn.backends.cupy import ops as cupy_ops
from mhattn.backends.triton import backend as triton_backend
from mhattn.backends.triton import configs
from mhattn.benchmark import latency, timing

# (label, (B, Hq, N, d, causal, Hkv or None)), bf16
SHAPES = [
    ("B=1 H=16 N=128 d=64", (1, 16, 128, 64, False, None)),
    ("B=1 H=16 N=128 d=64 causal", (1, 16, 128, 64, True, None)),
    ("B=32 H=12 N=128 d=64", (32, 12, 128, 64, False, None)),
    ("B=8 H=16 N=64 d=128 causal", (8, 16, 64, 128, True, None)),
    ("B=4 H=32/8 N=128 d=64 GQA", (4, 32, 128, 64, False, 8)),
]
LOOP_CALLS, ROUNDS = 300, 7


def _fresh_signatures():
    triton_backend._signatures.clear()
    triton_backend._plans.clear()


@contextlib.contextmanager
def short_backward(on: bool):
    """The Triton backend with its short backward on or off, on fresh signatures (a plan keeps its tile)."""
    saved = configs.SHORT_BACKWARD_ACCUMULATORS
    configs.SHORT_BACKWARD_ACCUMULATORS = saved if on else 0
    _fresh_signatures()
    try:
        yield
    finally:
        configs.SHORT_BACKWARD_ACCUMULATORS = saved
        _fresh_signatures()


@contextlib.contextmanager
def cupy_direct_dq(on: bool):
    """The CuPy backend's Hopper backward storing dQ directly where every key fits one CTA, or always through its
    float32 buffer, on fresh plans."""
    saved = cupy_ops.HOPPER_BWD_DIRECT_DQ
    cupy_ops.HOPPER_BWD_DIRECT_DQ = on
    cupy_ops._backward_plans.clear()
    try:
        yield
    finally:
        cupy_ops.HOPPER_BWD_DIRECT_DQ = saved
        cupy_ops._backward_plans.clear()


def forward_backward(shape, backend: str):
    batch, heads_q, seqlen, head_dim, causal, heads_kv = shape
    gqa = heads_kv is not None
    q = torch.randn(batch, heads_q, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, heads_kv or heads_q, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad_out = torch.randn_like(q)
    if backend == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                        enable_gqa=gqa).backward(grad_out)
    return lambda: mhattn.attention(q, k, v, is_causal=causal, enable_gqa=gqa, backend=backend).backward(grad_out)


def main():
    rows = []
    for label, shape in SHAPES:
        calls = {"sdpa": forward_backward(shape, "sdpa"), "triton short": forward_backward(shape, "triton"),
                 "triton 3 kernels": forward_backward(shape, "triton"),
                 "cupy direct dQ": forward_backward(shape, "cupy"), "cupy dQ buffer": forward_backward(shape, "cupy")}
        contexts = {"triton short": lambda: short_backward(True), "triton 3 kernels": lambda: short_backward(False),
                    "cupy direct dQ": lambda: cupy_direct_dq(True), "cupy dQ buffer": lambda: cupy_direct_dq(False)}
        gpu_us = {}
        for name, call in calls.items():
            with contexts.get(name, contextlib.nullcontext)():
                call()
                gpu_us[name] = timing.bench_ms(call, 25, 100, "cuda") * 1e3
        loops, errors = latency.host_loops_in_turn(calls, LOOP_CALLS, "cuda", ROUNDS, contexts)
        rows += [(label, name, gpu_us[name], loops.get(name), errors.get(name)) for name in calls]
        print(label, {name: (round(gpu_us[name], 1), round(loops.get(name, float("nan")), 1)) for name in calls},
              errors or "", flush=True)
    print()
    print(f"{'shape':30s} {'impl':17s} {'GPU us':>8s} {'host loop us':>13s} {'x sdpa loop':>12s}")
    sdpa = {label: us for label, name, _, us, _ in rows if name == "sdpa"}
    for label, name, gpu, loop, error in rows:
        ratio = f"{loop / sdpa[label]:.2f}x" if loop and sdpa.get(label) else "-"
        print(f"{label:30s} {name:17s} {gpu:8.1f} {loop or float('nan'):13.1f} {ratio:>12s}"
              + (f"  {error}" if error else ""))


if __name__ == "__main__":
    main()
