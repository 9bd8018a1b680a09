"""GPU check of the CUDA backend's Hopper kernels (backends/cupy/kernels/hopper_fwd.cu, hopper_bwd.cu) on an sm_90
GPU:

    source benchmarks/device_env.sh && cd /tmp && python3 $OLDPWD/benchmarks/check_cupy_hopper.py \
        [--part fwd,bwd] [--dtype bf16,fp16] [--head-dim 64,128,256] [--seqlen 1024,4096,16384] [--timing-only] \
        [--sweep]

1. ``mhattn.attention(..., backend="cupy", return_lse=True)`` on ragged shapes (fp16 and bf16; GQA; Nq > Nk and
   Nq < Nk; one key; one query; causal top-left and bottom-right; a sliding window; rows that see no key; a
   (B, N, H, D) memory layout) against a float64 reference, outputs poisoned with NaN: every case must run the
   Hopper forward (checked through the plan) and be within a few units in the last place; prints the failures;
2. the protocol's shapes (B * N = 16384, H = 2048 / d; causal and not), forward TFLOP/s from do_bench medians:
   sdpa-cudnn, sdpa-flash, the cupy backend with the Hopper forward and with the mma.sync forward
   (``ops.HOPPER_ENABLED = False``), all in the same run. The table is printed last.
Backward (``--part bwd``, the head dims the Hopper backward takes): 1. the gradients of the same cases against float64
autograd with CONFORMANCE.md's rule (at most 4x the error of the same computation in the input dtype, plus 1e-2),
each case checked to have run the Hopper backward; 2. ``torch.autograd.grad`` of the forward's output timed beside
sdpa-cudnn and sdpa-flash, and the mma.sync backward.

``--deterministic``: the backward with reproducible gradients asked for (MHATTN_CUPY_FAST_BACKWARD=0): the Hopper
backward's key blocks add dQ in turns, the mma.sync column is the dQ kernel's backward; each correctness case also
runs the backward twice and requires equal bits.

``--softcap X``: the correctness cases (1.) with a softcap (the timing tables have no peer with one; use
benchmarks/check_cupy_features.py).

``--sweep``: instead of 2., each candidate of SWEEP / SWEEP_BWD (set in variants.HOPPER_FWD_TILES /
HOPPER_BWD_TILES at run time) is checked (1. in bf16) and timed at the protocol's shapes beside sdpa-cudnn.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import mhattn
from mhattn.backends.cupy import ops, variants

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (B, Hq, Hkv, Nq, Nk) of the correctness pass.
RAGGED_SHAPES = ((2, 4, 4, 300, 517), (1, 8, 2, 1000, 1000), (2, 2, 1, 129, 64), (1, 2, 2, 64, 1), (1, 2, 2, 1, 300),
                 (1, 3, 3, 1500, 700))
# (is_causal, window, bottom_right) of the correctness pass: window = (left, right) about the diagonal (None: an
# unbounded side), bottom_right = the causal_lower_right mask (diagonal offset Nk - Nq).
MASKINGS = ((False, None, False), (True, None, False), (True, None, True), (False, (100, 0), False),
            (False, (37, 50), False), (True, (64, None), True))


# Candidates of --sweep per head dim, the table's first: forward HopperFwdTiles fields (block_n, stages, consumers,
# pingpong, persistent, staged_out[, masked_pingpong]); backward HopperBwdTiles fields (ring slots, dQ by the copy
# engine's bulk reduce-add, dQ buffers). Key blocks of 64, two ring slots, one CTA a tile (forward) and two dQ buffers
# (backward) were measured at d = 64 and dropped (NOTES.md B7); four ring slots let the producer run further ahead
# across the short tiles of a 1k-key forward; ping-pong off at d = 64 (NOTES.md H10), and at d = 128 and 256 on
# without a mask and off under one (H12), beside it on and off for both. Under NVRTC 12.9 for sm_90a those of d = 64
# and 128 compile without spills; d = 256's forward spills 40 bytes, the shipped one too.
# (stages, dq_bulk[, dq_buffers, query_rows]); the first candidate again last, for the spread between two timings
SWEEP_BWD = {64: ((2, False, 1, 128), (3, False), (2, False, 1, 128)), 128: ((2, True), (2, False))}
# (block_n, stages, consumers, pingpong, persistent, staged_out, masked_pingpong, lazy_rescale, turns_across_tiles):
# the shipped tiles, with the ping-pong turns the other way (on at d = 128 since H18, off at d = 256), the shipped
# again, the other way again (the spread between two timings; d = 64 takes no turns). The lazy rescaling's
# candidates: NOTES.md, H16.
SWEEP = {64: ((128, 3, 2, False, True, True), (128, 3, 2, False, True, True)),
         128: ((128, 2, 2, True, True, True, False, False, True), (128, 2, 2, True, True, True, False),
               (128, 2, 2, True, True, True, False, False, True), (128, 2, 2, True, True, True, False)),
         256: ((64, 2, 2, True, True, False, False, True), (64, 2, 2, True, True, False, False, True, True),
               (64, 2, 2, True, True, False, False, True), (64, 2, 2, True, True, False, False, True, True))}


# --softcap: the correctness cases' softcap (None: none).
SOFTCAP = None


def reference(q, k, v, causal, window, diag_offset):
    """(out, lse) in float64; rows that see no key give out 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if SOFTCAP is not None:
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
    rel = (torch.arange(k.shape[2], device=q.device)[None] - torch.arange(q.shape[2], device=q.device)[:, None]
           - diag_offset)
    hidden = torch.zeros_like(rel, dtype=torch.bool)
    if causal:
        hidden |= rel > 0
    if window is not None and window[0] is not None:
        hidden |= rel < -window[0]
    if window is not None and window[1] is not None:
        hidden |= rel > window[1]
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ vd, torch.logsumexp(scores, -1)


def run_cupy(q, k, v, causal, window, bottom_right):
    from torch.nn.attention.bias import causal_lower_right

    kwargs = {} if window is None else {"window": tuple(-1 if side is None else side for side in window)}
    if SOFTCAP is not None:
        kwargs["softcap"] = SOFTCAP
    if causal and bottom_right:
        return mhattn.attention(q, k, v, causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=True,
                                return_lse=True, backend="cupy", **kwargs)
    return mhattn.attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True, backend="cupy", **kwargs)


def make(layout, batch, heads, seqlen, head_dim, dtype):
    """A random (B, H, N, D) tensor with (B, H, N, D) or (B, N, H, D) memory."""
    if layout == "bnhd":
        return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    return torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype)


def last_plan_is_hopper(plans=None) -> bool:
    plan = next(reversed((ops._forward_plans if plans is None else plans).values()))
    return plan.maps is not None


def ragged_cases(head_dims, dtypes):
    """(dtype, layout, q, k, v, causal, window, bottom_right) over the ragged shapes and maskings, random inputs."""
    torch.manual_seed(0)
    for dtype in dtypes:
        for head_dim in head_dims:
            for batch, heads_q, heads_kv, seqlen_q, seqlen_k in RAGGED_SHAPES:
                for causal, window, bottom_right in MASKINGS:
                    for layout in ("bhnd", "bnhd"):
                        if layout == "bnhd" and (seqlen_q < 100 or causal):
                            continue
                        q, k, v = (make(layout, batch, h, n, head_dim, dtype)
                                   for h, n in ((heads_q, seqlen_q), (heads_kv, seqlen_k), (heads_kv, seqlen_k)))
                        yield dtype, layout, q, k, v, causal, window, bottom_right


def correctness_backward(head_dims, dtypes=(torch.bfloat16, torch.float16)) -> int:
    ops.POISON_OUTPUTS = True
    failures = cases = 0
    for dtype, layout, q, k, v, causal, window, bottom_right in ragged_cases(head_dims, dtypes):
        diag_offset = k.shape[2] - q.shape[2] if bottom_right else 0
        grad_out = torch.randn_like(q)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = run_cupy(*leaves, causal, window, bottom_right)[0]
        got = torch.autograd.grad(out, leaves, grad_out, retain_graph=reproducible())
        hopper = last_plan_is_hopper(ops._backward_plans)
        same = not reproducible() or all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(
            out, leaves, grad_out)))
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(reference(*exact, causal, window, diag_offset)[0], exact, grad_out.double())
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        base = torch.autograd.grad(reference(*low, causal, window, diag_offset)[0], low, grad_out)
        cases += 1
        for name, g, w, b in zip("qkv", got, want, base):
            err, base_err = (g.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
            if not hopper or not same or torch.isnan(g).any() or err > 4 * base_err + 1e-2:
                failures += 1
                print(f"FAIL backward d{name} {dtype} {layout} q{tuple(q.shape)} k{tuple(k.shape)} causal={causal} "
                      f"window={window} bottom_right={bottom_right}: hopper={hopper} err {err:.3g} vs {base_err:.3g}"
                      f", the same bits twice {same}", flush=True)
                break
    ops.POISON_OUTPUTS = False
    kind = " (reproducible gradients)" if reproducible() else ""
    print(f"Hopper backward correctness{kind}: {failures} failures in {cases} cases", flush=True)
    return failures


def reproducible() -> bool:
    """Whether the backward runs with reproducible gradients asked for (--deterministic)."""
    return os.environ.get("MHATTN_CUPY_FAST_BACKWARD") == "0"


def correctness(head_dims, dtypes=(torch.bfloat16, torch.float16)) -> int:
    ops.POISON_OUTPUTS = True
    failures = cases = 0
    for dtype, layout, q, k, v, causal, window, bottom_right in ragged_cases(head_dims, dtypes):
        diag_offset = k.shape[2] - q.shape[2] if bottom_right else 0
        out, lse = run_cupy(q, k, v, causal, window, bottom_right)
        hopper = last_plan_is_hopper()
        ref_out, ref_lse = reference(q.double(), k.double(), v.double(), causal, window, diag_offset)
        out_err = (out.double() - ref_out).abs().max().item()
        seen = torch.isfinite(ref_lse)
        lse_err = (lse[seen].double() - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
        empty_ok = bool((lse[~seen] == float("-inf")).all() and (out[~seen] == 0).all())
        bound = 2e-2 if dtype == torch.bfloat16 else 4e-3
        cases += 1
        if not (hopper and out_err < bound and lse_err < 1e-3 and empty_ok and not torch.isnan(out).any()):
            failures += 1
            print(f"FAIL {dtype} d={q.shape[-1]} {layout} q{tuple(q.shape)} k{tuple(k.shape)} causal={causal} "
                  f"window={window} bottom_right={bottom_right}: hopper={hopper} out err {out_err:.3g}, "
                  f"lse err {lse_err:.3g}, empty rows ok {empty_ok}", flush=True)
    ops.POISON_OUTPUTS = False
    print(f"Hopper forward correctness: {failures} failures in {cases} cases", flush=True)
    return failures


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def protocol_cells(dtype, head_dims, seqlens):
    """(d, N, causal, q, k, v, forward FLOPs) at PERFORMANCE.md's shapes: B * N = 16384, H = 2048 / d; q, k, v leaves
    that require grad."""
    for head_dim in head_dims:
        for seqlen in seqlens:
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype).requires_grad_()
                           for _ in range(3))
                yield head_dim, seqlen, causal, q, k, v, 4 * batch * heads * seqlen * seqlen * head_dim / (1 + causal)


def forward_time(run) -> float:
    with torch.no_grad():
        return bench(run)


def backward_time(run, leaves) -> float:
    """The backward alone: torch.autograd.grad of run()'s output (made once)."""
    out = run()
    grad_out = torch.randn_like(out)
    return bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))


def peer_and_cupy_times(time, q, k, v, causal, with_mma_sync=True) -> list:
    """time(run) of sdpa-cudnn, sdpa-flash, the cupy backend (Hopper kernels) and, with_mma_sync, the cupy backend
    with them off."""
    times = []
    for peer in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(peer):
            times.append(time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    cupy = lambda: mhattn.attention(q, k, v, is_causal=causal, backend="cupy")  # noqa: E731
    times.append(time(cupy))
    if with_mma_sync:
        ops.HOPPER_ENABLED = False
        try:
            times.append(time(cupy))
        finally:
            ops.HOPPER_ENABLED = True
    return times


def print_table(title: str, header: list, rows: list) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def timing(dtype, head_dims, seqlens, backward=False):
    """The table of the forward (backward: 2.5x the forward's FLOPs) beside the peers and the mma.sync kernels."""
    rows = []
    for d, n, causal, q, k, v, flops in protocol_cells(dtype, head_dims, seqlens):
        time = (lambda run: backward_time(run, [q, k, v])) if backward else forward_time
        cudnn, flash, hopper, mma = (flops * (2.5 if backward else 1) / ms / 1e9
                                     for ms in peer_and_cupy_times(time, q, k, v, causal))
        rows.append([str(d), str(n), "yes" if causal else "no"] + [f"{x:.0f}" for x in (cudnn, flash, hopper, mma)]
                    + [f"{hopper / cudnn:.2f}", f"{hopper / flash:.2f}"])
        print(rows[-1], flush=True)
    what = ("backward, reproducible gradients" if reproducible() else "backward") if backward else "forward"
    print_table(f"{str(dtype).replace('torch.', '')} {what}, TFLOP/s (same run)",
                ["d", "N", "causal", "sdpa-cudnn", "sdpa-flash", "cupy Hopper", "cupy mma.sync", "Hopper/cuDNN",
                 "Hopper/flash"], rows)


def sweep(dtype, head_dims, seqlens, backward=False):
    """Each candidate of SWEEP (SWEEP_BWD) set in the table at run time, checked in bf16 and timed beside cuDNN."""
    table = variants.HOPPER_BWD_TILES if backward else variants.HOPPER_FWD_TILES
    rows = []
    for head_dim in head_dims:
        default = table[head_dim]
        for candidate in (SWEEP_BWD if backward else SWEEP)[head_dim]:
            table[head_dim] = (variants.HopperBwdTiles if backward else variants.HopperFwdTiles)(*candidate)
            failures = (correctness_backward if backward else correctness)([head_dim], (torch.bfloat16,))
            for d, n, causal, q, k, v, flops in protocol_cells(dtype, [head_dim], seqlens):
                time = (lambda run: backward_time(run, [q, k, v])) if backward else forward_time
                cudnn, _, hopper = (flops * (2.5 if backward else 1) / ms / 1e9
                                    for ms in peer_and_cupy_times(time, q, k, v, causal, with_mma_sync=False))
                rows.append([str(d), str(candidate), str(failures), str(n), "yes" if causal else "no", f"{cudnn:.0f}",
                             f"{hopper:.0f}", f"{hopper / cudnn:.2f}"])
                print(rows[-1], flush=True)
        table[head_dim] = default
    what = ("tiles (stages, dq_bulk[, dq_buffers, query_rows])" if backward
            else "tiles (block_n, stages, consumers, pingpong, persistent, staged_out[, masked_pingpong, "
                 "lazy_rescale, turns_across_tiles])")
    print_table(f"{str(dtype).replace('torch.', '')} {'backward' if backward else 'forward'} sweep, TFLOP/s (same run)",
                ["d", what, "failures", "N", "causal", "sdpa-cudnn", "cupy Hopper", "ratio"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="fwd,bwd", help="comma-separated: fwd, bwd")
    parser.add_argument("--dtype", default="bf16", help="comma-separated, of the timing tables: bf16, fp16")
    parser.add_argument("--seqlen", default="1024,4096,16384", help="comma-separated sequence lengths to time")
    parser.add_argument("--head-dim", default="64,128,256", help="comma-separated head dims")
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the tile candidates of SWEEP instead")
    parser.add_argument("--deterministic", action="store_true",
                        help="the backward with reproducible gradients asked for (MHATTN_CUPY_FAST_BACKWARD=0)")
    parser.add_argument("--softcap", type=float, default=None, help="the correctness cases with this softcap")
    args = parser.parse_args()
    global SOFTCAP
    SOFTCAP = args.softcap
    if args.deterministic:
        os.environ["MHATTN_CUPY_FAST_BACKWARD"] = "0"  # read by the cupy backend at each call
    dtypes = [DTYPES[name] for name in args.dtype.split(",") if name in DTYPES]
    if not dtypes or len(dtypes) != len(args.dtype.split(",")):
        parser.error(f"--dtype: expected comma-separated names from {sorted(DTYPES)}, got {args.dtype!r}")
    head_dims = [int(d) for d in args.head_dim.split(",") if int(d) in variants.HOPPER_HEAD_DIMS]
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    seqlens = [int(n) for n in args.seqlen.split(",")]
    parts = set(args.part.split(","))
    bwd_dims = [d for d in head_dims if d in variants.HOPPER_BWD_TILES]
    if args.sweep:
        for dtype in dtypes:
            if "fwd" in parts:
                sweep(dtype, head_dims, seqlens)
            if "bwd" in parts:
                sweep(dtype, bwd_dims, seqlens, backward=True)
        return
    if not args.timing_only:
        if "fwd" in parts:
            correctness(head_dims)
        if "bwd" in parts:
            correctness_backward(bwd_dims)
    for dtype in dtypes:
        if "fwd" in parts:
            timing(dtype, head_dims, seqlens)
        if "bwd" in parts:
            timing(dtype, bwd_dims, seqlens, backward=True)


if __name__ == "__main__":
    main()
