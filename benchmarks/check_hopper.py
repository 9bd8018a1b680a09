"""GPU check of the Triton backend's Gluon Hopper kernels (backends/triton/hopper_forward.py, hopper_backward.py),
on an sm_90 GPU:

    source benchmarks/device_env.sh && cd /tmp && python3 $OLDPWD/benchmarks/check_hopper.py \
        [--dtype fp16|bf16] [--part fwd,bwd] [--head-dim 64,128,256] [--timing-only] [--seqlen 1024,4096,16384]

1. each kernel launched directly on ragged shapes (fp16 and bf16; its head dims; GQA; Nq > Nk; one key; one
   query; causal top-left and bottom-right, rows that see no key) against a float64 reference, outputs
   poisoned with NaN before the launch: prints the failures and their count;
   The forward runs on each of its schedules (SCHEDULES: one program per tile, persistent, persistent on a few
   programs; causal persistent grids take their tiles from a counter);
2. the protocol's shapes (B * N = 16384, H = 2048 / d; N 1k, 4k, 16k; causal and not), TFLOP/s from do_bench
   medians beside sdpa-cudnn in the same run. Forward: the Triton backend (``mhattn.attention(backend="triton")``)
   as it chooses, the same with the Gluon forward on a persistent grid and on one program per tile whatever the
   key count, and the FlashAttention-2 kernel (``MHATTN_TRITON_HOPPER=0``).
   Backward (``torch.autograd.grad`` of the forward's output): the Triton backend as it chooses, with
   ``MHATTN_TRITON_HOPPER=always`` (the Gluon backward below hopper_launch.BACKWARD_MIN_KEYS too) and with
   ``MHATTN_TRITON_HOPPER=0``. The tables are printed last. ``--breakdown`` first prints each kernel's GPU time
   in one causal backward of each length; ``--compare-query-rows ROWS`` adds the Gluon backward with ROWS query
   rows a step; ``--repeat N`` runs the backend's backward N times at 1k keys per head dim and compares the runs;
   ``--backend-only`` times sdpa-cudnn and the backend as it chooses, nothing else (quicker A/B runs);
   ``--sweep`` times only the forward under the settings of SWEEP beside the shipped ones.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import mhattn
from mhattn.backends.triton import hopper_backward, hopper_forward, hopper_launch
from mhattn.backends.triton.launcher import COMPILE_OPTIONS

LOG2E = 1.4426950408889634
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (B, Hq, Hkv, Nq, Nk) of the correctness pass.
RAGGED_SHAPES = ((2, 4, 4, 300, 517), (1, 8, 2, 1000, 1000), (2, 2, 1, 129, 64), (1, 2, 2, 64, 1), (1, 2, 2, 1, 300),
                 (1, 3, 3, 1500, 700))


def launch(q, k, v, causal, diag_offset, poison=True, persistent=None, sm_count=None):
    """The forward kernel alone, with the launch constants, schedule and tensor maps of hopper_launch: (out, lse).
    persistent: True / False for a persistent grid or one program per tile (None: hopper_launch's choice);
    sm_count: the programs a persistent grid may have (default the GPU's SMs; a few make programs take many tiles)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    make = torch.full_like if poison else (lambda t, _: torch.empty_like(t))
    out = make(q, float("nan"))
    lse = make(q[..., 0].float(), float("nan"))
    sm_count = sm_count or torch.cuda.get_device_properties(q.device).multi_processor_count
    head_bytes = hopper_launch.forward_head_bytes(seqlen_k, head_dim, q.element_size(), heads_q // heads_kv)
    schedule = hopper_launch.forward_schedule(batch, heads_q, seqlen_q, seqlen_k, causal, head_bytes, sm_count,
                                              persistent)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if schedule.tile_counter else lse
    hopper_forward.hopper_forward_kernel[(schedule.programs,)](
        *hopper_launch.forward_maps(q, k, v, out, head_dim), out, lse, counter, counter, counter, *out.stride()[:3],
        lse.stride(0), lse.stride(1), heads_q, heads_q // heads_kv, seqlen_q, seqlen_k,
        *schedule[1:4], LOG2E / math.sqrt(head_dim), diag_offset, 0, 0, 1.0, 0.0,
        **hopper_launch.compile_time_args(head_dim, causal, schedule.tile_counter, seqlen_k), num_warps=4,
        **COMPILE_OPTIONS)
    return out, lse


def launch_backward(q, k, v, out, lse, grad_out, causal, diag_offset, convert_in_kernel=True):
    """The backward kernel alone (lse2 and delta made here as backward.py's preprocess makes them): (dq, dk, dv),
    poisoned with NaN before the launch; dQ's float32 sums converted into dq by the kernel or after it."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    # Rows padded to 16 bytes, as the backend allocates them (the kernel reads them through tensor maps).
    padded = torch.empty(batch, heads_q, 2, -(-seqlen_q // 4) * 4, dtype=torch.float32, device=q.device)
    lse2, delta = padded[:, :, 0, :seqlen_q], padded[:, :, 1, :seqlen_q]
    lse2.copy_(torch.where(lse == float("-inf"), float("inf"), lse * LOG2E))
    delta.copy_((out.float() * grad_out.float()).sum(-1))
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    counters = torch.zeros(batch * heads_kv, dtype=torch.int32, device=q.device)
    num_n_blocks = triton.cdiv(seqlen_k, hopper_launch.BACKWARD_KEY_BLOCK[hopper_launch.TILE_WIDTH[head_dim]])
    scale = 1 / math.sqrt(head_dim)
    hopper_backward.hopper_backward_kernel[(batch * heads_kv * num_n_blocks,)](
        *hopper_launch.backward_maps(q, k, v, grad_out, lse2, delta, dq_acc, dk, dv, head_dim), dk, dv, dq, dq_acc,
        counters, counters, counters, counters, *dk.stride()[:3], *dv.stride()[:3], *dq.stride()[:3], heads_kv,
        heads_q // heads_kv, seqlen_q, seqlen_k, num_n_blocks, scale * LOG2E, scale, diag_offset, 0, 0, 1.0, 0,
        heads_q, 0.0, int(convert_in_kernel),
        **hopper_launch.backward_compile_time_args(head_dim, causal), num_warps=8, **COMPILE_OPTIONS)
    if not convert_in_kernel:
        dq.copy_(dq_acc)
    return dq, dk, dv


def reference(q, k, v, causal, diag_offset):
    """(out, lse) in float64, differentiable; rows that see no key give out 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None]
        scores = scores.masked_fill(cols > rows + diag_offset, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ vd, torch.logsumexp(scores, -1)


def ragged_cases(head_dims):
    """(dtype, q, k, v, causal, diag_offset) over the ragged shapes, random inputs."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in head_dims:
            for batch, heads_q, heads_kv, seqlen_q, seqlen_k in RAGGED_SHAPES:
                for causal, diag_offset in ((False, 0), (True, 0), (True, seqlen_k - seqlen_q)):
                    q = torch.randn(batch, heads_q, seqlen_q, head_dim, device="cuda", dtype=dtype)
                    k = torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=dtype)
                    v = torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=dtype)
                    yield dtype, q, k, v, causal, diag_offset


def max_error(got, want) -> float:
    return (got.double() - want).abs().max().item() if want.numel() else 0.0


def kernel_head_dims(kernel_dims, wanted):
    """The head dims a kernel has (kernel_dims), those in ``wanted`` only when it is given."""
    return sorted(d for d in kernel_dims if wanted is None or d in wanted)


# The forward's schedules checked: one program per tile, persistent on every SM, persistent on 3 programs (each
# takes many tiles, so ring slots and barrier phases run on across tiles).
SCHEDULES = (("per tile", False, None), ("persistent", True, None), ("persistent, 3 programs", True, 3))


def correctness(wanted=None) -> int:
    failures = 0
    for dtype, q, k, v, causal, diag_offset in ragged_cases(kernel_head_dims(hopper_launch.KEY_BLOCK, wanted)):
        ref_out, ref_lse = reference(q.double(), k.double(), v.double(), causal, diag_offset)
        seen = torch.isfinite(ref_lse)
        for schedule, persistent, sm_count in SCHEDULES:
            out, lse = launch(q, k, v, causal, diag_offset, persistent=persistent, sm_count=sm_count)
            out_err = max_error(out, ref_out)
            lse_err = max_error(lse[seen], ref_lse[seen])
            empty_rows_ok = bool((lse[~seen] == float("-inf")).all())
            bound = 2e-2 if dtype == torch.bfloat16 else 4e-3  # a few units in the last place of |out| <~ 1
            if not (out_err < bound and lse_err < 1e-3 and empty_rows_ok and not torch.isnan(out).any()):
                failures += 1
                print(f"FAIL forward ({schedule}) {dtype} d={q.shape[-1]} q{tuple(q.shape)} k{tuple(k.shape)} "
                      f"causal={causal} diag={diag_offset}: out err {out_err:.3g}, lse err {lse_err:.3g}, "
                      f"empty rows ok {empty_rows_ok}", flush=True)
    print(f"forward correctness ({len(SCHEDULES)} schedules): {failures} failures", flush=True)
    return failures


def correctness_backward(wanted=None) -> int:
    """The backward kernel against float64 autograd, with CONFORMANCE.md's rule: the error of the kernel at most
    a few times that of the same computation in the input dtype (torch's math path), plus a small floor."""
    failures = 0
    for dtype, q, k, v, causal, diag_offset in ragged_cases(kernel_head_dims(hopper_launch.BACKWARD_MIN_KEYS, wanted)):
        grad_out = torch.randn_like(q)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference(*leaves, causal, diag_offset)
        ref_grads = torch.autograd.grad(ref_out, leaves, grad_out.double())
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        low_out, _ = reference(*low, causal, diag_offset)
        low_grads = torch.autograd.grad(low_out, low, grad_out)
        out, lse = ref_out.detach().to(dtype), ref_lse.detach().float()
        for convert_in_kernel in (True, False):  # dQ converted by the kernel or after it (the backend's two ways)
            got = launch_backward(q, k, v, out, lse, grad_out, causal, diag_offset, convert_in_kernel)
            for name, g, want, base in zip("qkv", got, ref_grads, low_grads):
                err, base_err = max_error(g, want), max_error(base, want)
                if torch.isnan(g).any() or err > 4 * base_err + 1e-2:
                    failures += 1
                    print(f"FAIL backward d{name} {dtype} d={q.shape[-1]} q{tuple(q.shape)} k{tuple(k.shape)} "
                          f"causal={causal} diag={diag_offset} convert_in_kernel={convert_in_kernel}: err {err:.3g} "
                          f"vs {base_err:.3g} in {dtype} (nan: {bool(torch.isnan(g).any())})", flush=True)
    print(f"backward correctness: {failures} failures", flush=True)
    return failures


def repeated_backward(head_dims, repeats: int, dtype=torch.bfloat16) -> int:
    """The backend's Gluon backward ``repeats`` times on one protocol shape per head dim (1k keys, causal and not):
    each dQ, dK, dV against the first run's (the float32 additions' order varies, so within 1% of the largest
    magnitude). A race in the conversion of dQ by the kernel (a head converted before its last addition landed)
    shows as a run far off the others."""
    failures = 0
    for head_dim in head_dims:
        for causal in (False, True):
            batch, heads, seqlen = 16, 2048 // head_dim, 1024
            leaves = [torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                      for _ in range(3)]
            out = mhattn.attention(*leaves, is_causal=causal, backend="triton")
            grad_out = torch.randn_like(out)
            first = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
            worst = 0.0
            for _ in range(repeats):
                grads = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
                for got, want in zip(grads, first):
                    worst = max(worst, ((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
            failures += worst > 1e-2
            print(f"repeated backward d={head_dim} causal={causal}: {repeats} runs, largest difference to the first "
                  f"{worst:.2e} of the largest magnitude{' FAIL' if worst > 1e-2 else ''}", flush=True)
    return failures


def with_hopper_off(fn):
    """fn() with the Hopper kernels off; the switch's previous value (e.g. "always") is restored after."""
    return with_hopper_switch(fn, "0")


def with_hopper_always(fn):
    """fn() with the Hopper kernels at every key count (below hopper_launch's MIN_KEYS / BACKWARD_MIN_KEYS too)."""
    return with_hopper_switch(fn, "always")


def with_hopper_switch(fn, value: str):
    """fn() with MHATTN_TRITON_HOPPER set to ``value``; its previous value is restored after."""
    before = os.environ.get(hopper_launch.ENV_SWITCH)
    os.environ[hopper_launch.ENV_SWITCH] = value
    try:
        return fn()
    finally:
        if before is None:
            del os.environ[hopper_launch.ENV_SWITCH]
        else:
            os.environ[hopper_launch.ENV_SWITCH] = before


def with_schedule(fn, persistent_max_keys, causal_persistent_max_keys, causal_group_bytes):
    """fn() with the Gluon forward's schedule rules set to these (hopper_launch's constants of those names)."""
    return with_forward_settings(fn, {"PERSISTENT_MAX_KEYS": persistent_max_keys,
                                      "CAUSAL_PERSISTENT_MAX_KEYS": causal_persistent_max_keys,
                                      "CAUSAL_GROUP_BYTES": causal_group_bytes})


def with_forward_settings(fn, settings: dict):
    """fn() with hopper_launch's forward settings replaced: ``settings`` maps a constant's name to its value, or for a
    per-head-dim table ("FORWARD_STAGES") to a {head dim: value} update; every plan's forward schedule is made again
    before and after."""
    from mhattn.backends.triton import backend as triton_backend

    def forget_schedules():
        for plan in triton_backend._plans.values():
            plan.hopper_schedule = None

    before = {}
    for name, value in settings.items():
        current = getattr(hopper_launch, name)
        if isinstance(current, dict):
            before[name] = dict(current)
            current.update(value)
        else:
            before[name] = current
            setattr(hopper_launch, name, value)
    forget_schedules()
    try:
        return fn()
    finally:
        for name, value in before.items():
            current = getattr(hopper_launch, name)
            if isinstance(current, dict):
                current.clear()
                current.update(value)
            else:
                setattr(hopper_launch, name, value)
        forget_schedules()


# Forward settings the sweep times beside the shipped ones: (label, applies to (head_dim, causal), settings).
SWEEP = (
    ("causal tiles head by head", lambda d, causal: causal, {"CAUSAL_GROUP_BYTES": 0}),
    ("causal tiles over all heads", lambda d, causal: causal, {"CAUSAL_GROUP_BYTES": 1 << 40}),
    ("one loop over key blocks", lambda d, causal: d in (128, 256), {"FORWARD_SPLIT_MASKED": {128: False, 256: False}}),
    ("full-width diagonal at d = 64", lambda d, causal: causal and d == 64,
     {"FORWARD_HALF_DIAGONAL_MAX_KEYS": {64: 0}}),
    ("half-width diagonal at d = 128", lambda d, causal: causal and d == 128,
     {"FORWARD_HALF_DIAGONAL_MAX_KEYS": {128: 1 << 31}}),
    ("two fixed Q slots at d = 256", lambda d, causal: d == 256, {"FORWARD_Q_ROTATING_MAX_KEYS": {256: 0}}),
    ("three rotating Q slots at d = 256", lambda d, causal: d == 256, {"FORWARD_Q_ROTATING_MAX_KEYS": {256: 1 << 31}}),
) + tuple((f"lazy rescaling at d = {dim}", lambda d, causal, dim=dim: d == dim, {"FORWARD_LAZY_RESCALE": {dim: True}})
          for dim in (64, 128, 256))
# Measured and dropped (backends/triton/NOTES.md): 64-key blocks at d = 64 (3 or 4 K/V slots, one or two loops),
# 32-key blocks with two Q buffers at d = 256 (2 or 3 K/V slots); a kernel with three softmax warpgroups at d = 64.
# Settings that change the kernel's build (its compile-time arguments): the sweep runs the correctness pass with each.
BUILD_SETTINGS = ("KEY_BLOCK", "FORWARD_STAGES", "FORWARD_SPLIT_MASKED", "Q_BUFFERS",
                  "FORWARD_HALF_DIAGONAL_MAX_KEYS", "FORWARD_LAZY_RESCALE", "FORWARD_Q_ROTATING_MAX_KEYS")


def forward_sweep(dtype, seqlens, wanted=None, labels=None):
    """The backend's forward (as mhattn.attention runs it) under each SWEEP setting that applies to a cell, beside
    the shipped settings and sdpa-cudnn, timed in turn; prints TFLOP/s (blank where a setting does not apply).
    Settings that change the kernel's build (BUILD_SETTINGS) first run the correctness pass at their head dims.
    labels: the SWEEP entries to time (default every one)."""
    sweep = [entry for entry in SWEEP if labels is None or entry[0] in labels]
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    for label, _, settings in sweep:
        # once per setting, at the head dims its build settings name (and the run asked for)
        build_dims = {d for name in BUILD_SETTINGS if name in settings for d in settings[name]}
        build_dims &= set(kernel_head_dims(hopper_launch.KEY_BLOCK, wanted))
        if build_dims:
            print(f"correctness with {label}:", flush=True)
            with_forward_settings(lambda: correctness(build_dims), settings)
    rows = []
    for head_dim in kernel_head_dims(hopper_launch.KEY_BLOCK, wanted):
        for seqlen in seqlens:
            for causal in (False, True):
                if not any(applies(head_dim, causal) for _, applies, _ in sweep):
                    continue
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                run = lambda: mhattn.attention(q, k, v, is_causal=causal, backend="triton")  # noqa: E731
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    times = [bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))]
                times.append(bench(run))
                times += [with_forward_settings(lambda: bench(run), settings) if applies(head_dim, causal) else None
                          for _, applies, settings in sweep]
                times.append(bench(run))  # the shipped settings again: the spread between two timings
                rows.append((head_dim, seqlen, causal, [None if t is None else flops / t / 1e9 for t in times]))
                print(rows[-1], flush=True)
    labels = ["sdpa-cudnn", "shipped"] + [label for label, _, _ in sweep] + ["shipped again"]
    print(f"\n{str(dtype).replace('torch.', '')} forward sweep, TFLOP/s (same run)\n")
    print("| d | N | causal | " + " | ".join(labels) + " |")
    print("|---" * (3 + len(labels)) + "|")
    for d, n, causal, values in rows:
        cells = " | ".join("" if x is None else f"{x:.0f}" for x in values)
        print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cells} |")


def with_persistent(fn, on: bool):
    """fn() with the Gluon forward on a persistent grid at every key count (on) or on one program per tile (off),
    causal or not; the causal groups as hopper_launch sets them."""
    keys = 1 << 40 if on else 0
    return with_schedule(fn, keys, keys, hopper_launch.CAUSAL_GROUP_BYTES)


def with_backward_query_rows(fn, head_dim: int, rows: int):
    """fn() with the Gluon backward taking ``rows`` query rows a step at ``head_dim`` (hopper_launch's
    BACKWARD_QUERY_BLOCK), so the step heights compare in one process."""
    from mhattn.backends.triton import backend as triton_backend

    def forget_constants():
        for plan in triton_backend._plans.values():
            plan.hopper_backward_constexprs = plan.hopper_backward_slices = None

    before = hopper_launch.BACKWARD_QUERY_BLOCK[head_dim]
    hopper_launch.BACKWARD_QUERY_BLOCK[head_dim] = rows
    forget_constants()
    try:
        return fn()
    finally:
        hopper_launch.BACKWARD_QUERY_BLOCK[head_dim] = before
        forget_constants()


def timing(dtype, parts, seqlens, wanted=None, compare_rows=0, backend_only=False):
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    forward_rows, backward_rows = [], []
    head_dims = set(kernel_head_dims(hopper_launch.KEY_BLOCK, wanted) if "fwd" in parts else ())
    head_dims = sorted(head_dims | set(kernel_head_dims(hopper_launch.BACKWARD_MIN_KEYS, wanted) if "bwd" in parts
                                       else ()))
    for head_dim in head_dims:
        for seqlen in seqlens:
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                if "fwd" in parts and head_dim in hopper_launch.KEY_BLOCK:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        cudnn = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    run_triton = lambda: mhattn.attention(q, k, v, is_causal=causal, backend="triton")  # noqa: E731
                    backend = bench(run_triton)
                    persistent = per_tile = flash2 = float("inf")
                    if not backend_only:
                        persistent = with_persistent(lambda: bench(run_triton), True)
                        per_tile = with_persistent(lambda: bench(run_triton), False)
                        flash2 = with_hopper_off(lambda: bench(run_triton))
                    forward_rows.append((head_dim, seqlen, causal, *(flops / ms / 1e9 for ms in (
                        cudnn, backend, persistent, per_tile, flash2)), cudnn / backend))
                    print(forward_rows[-1], flush=True)
                if "bwd" in parts and head_dim in hopper_launch.BACKWARD_MIN_KEYS:
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    grad_out = torch.randn_like(q)

                    def backward_time(run):
                        out = run()
                        return bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True))

                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        cudnn = backward_time(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal))
                    run_triton = lambda: mhattn.attention(*leaves, is_causal=causal, backend="triton")  # noqa: E731
                    backend = backward_time(run_triton)
                    gluon = flash2 = float("inf")
                    if not backend_only:
                        gluon = with_hopper_always(lambda: backward_time(run_triton))
                        flash2 = with_hopper_off(lambda: backward_time(run_triton))
                    other_rows = float("nan")
                    if compare_rows and compare_rows != hopper_launch.BACKWARD_QUERY_BLOCK[head_dim]:
                        other_rows = with_backward_query_rows(
                            lambda: with_hopper_always(lambda: backward_time(run_triton)), head_dim, compare_rows)
                    bwd_flops = 2.5 * flops
                    backward_rows.append((head_dim, seqlen, causal, *(bwd_flops / ms / 1e9 for ms in (
                        cudnn, backend, gluon, flash2, other_rows)), cudnn / backend))
                    print(backward_rows[-1], flush=True)
    name = str(dtype).replace("torch.", "")
    if forward_rows:
        print(f"\n{name} forward, TFLOP/s (same run)\n")
        print("| d | N | causal | sdpa-cudnn | triton backend | backend, persistent grid | backend, a program per "
              "tile | FlashAttention-2 kernel | cuDNN/backend time |")
        print("|---|---|---|---|---|---|---|---|---|")
        for d, n, causal, cudnn, backend, persistent, per_tile, flash2, ratio in forward_rows:
            print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cudnn:.0f} | {backend:.0f} | {persistent:.0f} | "
                  f"{per_tile:.0f} | {flash2:.0f} | {ratio:.2f} |")
    if backward_rows:
        print(f"\n{name} backward, TFLOP/s (same run)\n")
        other = f" Gluon, {compare_rows} queries a step |" if compare_rows else ""
        print("| d | N | causal | sdpa-cudnn | triton backend | Gluon kernel at any length | FlashAttention-2 kernels "
              f"| triton/cuDNN |{other}")
        print("|---|---|---|---|---|---|---|---|" + ("---|" if compare_rows else ""))
        for d, n, causal, cudnn, backend, gluon, flash2, other_rows, ratio in backward_rows:
            other = f" {other_rows:.0f} |" if compare_rows else ""
            print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cudnn:.0f} | {backend:.0f} | {gluon:.0f} | "
                  f"{flash2:.0f} | {ratio:.2f} |{other}")


def backward_breakdown(dtype, seqlens, wanted=None):
    """GPU time of each kernel in one causal backward of the Triton backend (the protocol's shapes), from
    torch.profiler over 20 backwards: where the time goes besides the Gluon kernel."""
    from torch.profiler import ProfilerActivity, profile

    for head_dim in kernel_head_dims(hopper_launch.BACKWARD_MIN_KEYS, wanted):
        for seqlen in seqlens:
            batch, heads = 16384 // seqlen, 2048 // head_dim
            leaves = [torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                      for _ in range(3)]
            out = mhattn.attention(*leaves, is_causal=True, backend="triton")
            grad_out = torch.randn_like(out)
            step = lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)  # noqa: E731
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            times = {}
            for event in prof.key_averages():
                if event.device_type.name == "CUDA" and event.count:
                    total_us = getattr(event, "device_time_total", None) or event.cuda_time_total
                    times[event.key[:60]] = total_us / 20
            print(f"\nd = {head_dim}, N = {seqlen}, causal: {sum(times.values()):.0f} us of kernels")
            for name, us in sorted(times.items(), key=lambda item: -item[1]):
                print(f"  {us:7.1f} us  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of the timing tables")
    parser.add_argument("--part", default="fwd,bwd", help="comma-separated: fwd, bwd")
    parser.add_argument("--seqlen", default="1024,4096,16384", help="comma-separated sequence lengths to time")
    parser.add_argument("--head-dim", default="", help="comma-separated head dims (default: every one a kernel has)")
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--compare-query-rows", type=int, default=0, metavar="ROWS",
                        help="also time the Gluon backward with ROWS query rows a step (where its table differs)")
    parser.add_argument("--repeat", type=int, default=0, metavar="N",
                        help="also run the backend's backward N times per head dim and compare the runs")
    parser.add_argument("--backend-only", action="store_true",
                        help="time sdpa-cudnn and the backend as it chooses only (the other columns read 0)")
    parser.add_argument("--sweep", action="store_true",
                        help="only the forward under the settings of SWEEP beside the shipped ones (no correctness)")
    parser.add_argument("--sweep-settings", default="", metavar="LABELS",
                        help="with --sweep: comma-separated labels of the SWEEP entries to time (default all)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also each kernel's GPU time in one causal backward (torch.profiler), first")
    args = parser.parse_args()
    head_dims = {int(d) for d in args.head_dim.split(",")} if args.head_dim else None
    parts = set(args.part.split(","))
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    if args.sweep:
        labels = set(args.sweep_settings.split(",")) if args.sweep_settings else None
        forward_sweep(DTYPES[args.dtype], [int(n) for n in args.seqlen.split(",")], head_dims, labels)
        return
    if args.breakdown:
        backward_breakdown(DTYPES[args.dtype], [int(n) for n in args.seqlen.split(",")], head_dims)
    if not args.timing_only:
        if "fwd" in parts:
            correctness(head_dims)
        if "bwd" in parts:
            correctness_backward(head_dims)
    if args.repeat:
        repeated_backward(kernel_head_dims(hopper_launch.BACKWARD_MIN_KEYS, head_dims), args.repeat)
    timing(DTYPES[args.dtype], parts, [int(n) for n in args.seqlen.split(",")], head_dims, args.compare_query_rows,
           args.backend_only)


if __name__ == "__main__":
    main()
