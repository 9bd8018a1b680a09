"""What a deterministic backward costs on the Triton backend, beside cuDNN's (SDPA's cuDNN backend), in one process.

Three Triton backwards at PERFORMANCE.md's protocol shapes (B * N = 16k tokens, H * d = 2048): the Gluon Hopper
backward as it runs by default (dQ's shares added in any order), its deterministic build (under
``torch.use_deterministic_algorithms(True)``: each query block's shares added by its key blocks in their order,
hopper_backward.dq_turn), and the deterministic FlashAttention-2 backward (backward.py's separate dQ kernel, with
``MHATTN_TRITON_HOPPER=0``), which such calls ran before and still run below hopper_launch.DETERMINISTIC_MIN_KEYS
(the Gluon columns run with ``MHATTN_TRITON_HOPPER=always``, so at every key count). Backward ms = (forward+backward)
- forward, do_bench medians (timing.bench_ms, settled, as check_features.py times a call). Before timing, each
deterministic backward runs twice and its gradients are compared bit for bit.

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_deterministic.py \\
        [--head-dims 64,128,256] [--seqlens 1024,4096,16384] [--dtype bf16]

Prints a line per case as it goes and the table last.
"""

import argparse

import torch

import mhattn
from check_features import timed  # (this script's folder is on the path when it runs)
from check_hopper import with_hopper_switch

TOKENS, WIDTH = 16384, 2048
# (column, deterministic, Gluon kernels on)
VARIANTS = (("gluon", False, True), ("gluon det", True, True), ("fa2 det", True, False))


def inputs(head_dim: int, seqlen: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (TOKENS // seqlen, WIDTH // head_dim, seqlen, head_dim)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3)]


def backward_ms(call, q, k, v) -> float:
    """(forward+backward) - forward of ``call``, in ms, timed as check_features.py times a call."""
    times = timed(call, q, k, v)
    if isinstance(times, str):
        raise RuntimeError(times)
    return times[1] - times[0]


def reproducible(call, q, k, v) -> bool:
    """Whether two backward passes of one forward give the same gradients bit for bit."""
    out = call()
    grad_out = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), grad_out)
    return all(torch.equal(a, b) for a, b in zip(first, second))


def with_setting(deterministic: bool, gluon: bool, fn):
    """fn() under torch.use_deterministic_algorithms(deterministic), with the Gluon kernels at every key count
    ("always": below their thresholds too, DETERMINISTIC_MIN_KEYS among them) or off."""
    def run():
        torch.use_deterministic_algorithms(deterministic)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(False)

    return with_hopper_switch(run, "always" if gluon else "0")


def main(head_dims, seqlens, dtype):
    rows = []
    for head_dim in head_dims:
        for seqlen in seqlens:
            q, k, v = inputs(head_dim, seqlen, dtype)
            for causal in (False, True):
                triton_call = lambda: mhattn.attention(q, k, v, is_causal=causal, backend="triton")  # noqa: E731
                times, same = {}, {}
                for name, deterministic, gluon in VARIANTS:
                    times[name] = with_setting(deterministic, gluon, lambda: backward_ms(triton_call, q, k, v))
                    if deterministic:
                        same[name] = with_setting(deterministic, gluon, lambda: reproducible(triton_call, q, k, v))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    times["cudnn"] = backward_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), q, k, v)
                rows.append((head_dim, seqlen, causal, times, same))
                print(head_dim, seqlen, causal, {n: round(t, 3) for n, t in times.items()}, same, flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    names = [name for name, _, _ in VARIANTS] + ["cudnn"]
    print(f"\nbackward ms ({dtype}, B * N = {TOKENS}, H * d = {WIDTH}; (forward+backward) - forward, do_bench "
          "medians); det / gluon: the deterministic build's time over the default's; bitwise: two passes equal")
    print(f"{'d':>4} {'N':>6} {'causal':>6} " + " ".join(f"{n:>10}" for n in names)
          + f" {'det/gluon':>9} {'cudnn/det':>9} {'bitwise':>8}")
    for head_dim, seqlen, causal, times, same in rows:
        print(f"{head_dim:>4} {seqlen:>6} {'yes' if causal else 'no':>6} "
              + " ".join(f"{times[n]:>10.3f}" for n in names)
              + f" {times['gluon det'] / times['gluon']:>8.2f}x {times['cudnn'] / times['gluon det']:>8.2f}x"
              + f" {'yes' if all(same.values()) else 'NO':>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    main([int(d) for d in args.head_dims.split(",")], [int(n) for n in args.seqlens.split(",")],
         torch.bfloat16 if args.dtype == "bf16" else torch.float16)
