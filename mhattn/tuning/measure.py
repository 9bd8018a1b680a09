"""Timing one tuned shape: every backend that can run it, forward and forward+backward, and the pair of two
backends (the forward of one, the backward of another: ``mhattn.backends.paired``) where the fastest forward and the
fastest backward were different backends'.

Each backend runs through the public ``mhattn.attention(..., backend=name)``, so what is timed is what
automatic selection would call (argument handling included, which dominates short sequences). Times are
medians from :func:`mhattn.benchmark.timing.bench_ms` (``triton.testing.do_bench`` on a GPU, the L2 cache
flushed before each run). Inputs are drawn from a generator seeded by the cell, so every process times
the same inputs.
"""

from __future__ import annotations

import math
import zlib

import torch

from mhattn.benchmark import timing
from mhattn.tuning.grid import Cell

# GPU time (ms) below which a call's host path may cost more than its kernels (on the H100 host, tens of
# microseconds per call): such calls are also timed as a host loop of HOST_LOOP_CALLS calls, HOST_LOOP_ROUNDS times,
# the backends' loops taking turns (the host's speed drifts by up to 1.6x between loops: timed one backend after
# another, a backend could win a near-tie by the moment it ran).
HOST_BOUND_MS = 0.5
HOST_LOOP_CALLS = 100
# Load (ms of back-to-back calls) before each GPU timing of a call that keeps the GPU busy (timing.settle): the cells'
# host loops, graph captures and checks leave the GPU idle between timings, and an idle GPU starts at boost clocks.
SETTLE_MS = 100.0
HOST_LOOP_ROUNDS = 5
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
PADDED_FRACTION = 8   # the bool mask hides the last 1/8 of the keys of every sequence


def make_inputs(cell: Cell, device):
    """q, k, v (requiring grad when the cell times a backward), the output gradient, and the call's keyword
    arguments (mask, causal flag, GQA) for ``mhattn.attention``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(zlib.crc32(repr(cell).encode()))
    dtype = TORCH_DTYPES[cell.dtype]

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    q = randn(cell.batch, cell.heads_q, cell.seqlen_q, cell.head_dim)
    k = randn(cell.batch, cell.heads_kv, cell.seqlen_k, cell.head_dim)
    v = randn(cell.batch, cell.heads_kv, cell.seqlen_k, cell.head_dim)
    dout = randn(cell.batch, cell.heads_q, cell.seqlen_q, cell.head_dim)
    for t in (q, k, v):
        t.requires_grad_(cell.grad)
    kwargs = call_kwargs(cell, device, randn)
    return q, k, v, dout, kwargs


def call_kwargs(cell: Cell, device, randn) -> dict:
    """The keyword arguments of cell's ``mhattn.attention`` call (mask, causal flag, GQA); ``randn(*shape)`` draws the
    float mask's values."""
    kwargs = {"enable_gqa": cell.heads_q != cell.heads_kv}
    if cell.causal == "top_left":
        kwargs["is_causal"] = True
    elif cell.causal == "bottom_right" and cell.seqlen_q > 1:
        # (One query row on the bottom-right diagonal sees every key: timed as users call such a decoding step, with
        # no mask. Where host loops decide a cell, the call's own path is what is timed: before the front end's memo
        # of repeated calls took causal alignment objects, the mask object made these loops up to 2.4x as long on the H200.)
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(cell.seqlen_q, cell.seqlen_k)
    if cell.mask == "bool":
        keep = cell.seqlen_k - max(1, cell.seqlen_k // PADDED_FRACTION)
        mask = torch.zeros(cell.batch, 1, 1, cell.seqlen_k, dtype=torch.bool, device=device)
        mask[..., :keep] = True
        kwargs["attn_mask"] = mask
    elif cell.mask == "float":
        kwargs["attn_mask"] = randn(1, 1, cell.seqlen_q, cell.seqlen_k)
    return kwargs


def backends_to_time(device) -> list:
    """Every backend of automatic selection's order on ``device`` (the reference only on the CPU), and on a GPU each
    registered variant of one of them (Backend.variant_of) right after it, which time_cell times only where its
    base backend's forward is short."""
    from mhattn import dispatch, registry

    names = []
    for device_type, _min_cc, row in dispatch.PRIORITY:
        if device_type == torch.device(device).type:
            names += [n for n in row if n not in names and n in registry.names()]
    if torch.device(device).type == "cuda":
        names = [n for n in names if n != "reference"]  # never the fastest on a GPU, and O(N^2) memory
        names = [name for base in names for name in [base] + registry.variants_of(base)]
    return names


def variant_skipped(name: str, row: dict):
    """Why the variant ``name`` (Backend.variant_of) is not timed in ``row``, or None for a backend of its own or a
    variant whose base backend's forward took under HOST_BOUND_MS there. A variant pins one of its base's choices
    (sdpa.cudnn: torch's cuDNN kernel, which the sdpa backend's calls reach after torch's own choice); what it can
    win is the host time of that choice, which counts only where a call is short, so the rest of the grid is not
    spent on it."""
    from mhattn import registry

    base = registry.variant_base(name)
    if base is None:
        return None
    base_ms = row["fwd_ms"].get(base)
    if base_ms is None:
        return f"a variant of {base}, which was not timed here"
    if base_ms >= HOST_BOUND_MS:
        return f"a variant of {base}, timed only where {base}'s forward takes under {HOST_BOUND_MS} ms"
    return None


def time_cell(cell: Cell, device, warmup_ms: float, rep_ms: float, backends=None) -> dict:
    """The table row of ``cell``: its fields, ``fwd_ms`` (the forward of inputs that need no gradient) and
    ``fwd_bwd_ms`` {backend: ms}, and ``skipped``
    {backend: why} for each backend that cannot run it or failed. Never raises for a backend's failure. A time is
    the GPU timer's median, or where that is under HOST_BOUND_MS and the host loop takes longer, the host loop's
    time per call (with_host_loops, after every backend's GPU timing). Where the cell times a backward and its
    fastest forward and fastest backward (forward+backward less forward) are two backends', ``fwd_bwd_ms`` also
    holds that pair's time under its name, "<forward>+<backward>" (time_pair). The forwards short enough for a host
    loop are also replayed from a CUDA graph, into ``fwd_graph_ms`` (graph_replays; on a GPU only)."""
    import mhattn

    device = torch.device(device)
    row = dict(cell.as_dict(), fwd_ms={}, fwd_bwd_ms={}, skipped={})
    timed = {"fwd": {}, "fwd_bwd": {}}  # mode -> {backend: the call timed}
    q, k, v, dout, kwargs = make_inputs(cell, device)
    # The forward is timed as the calls it decides are made (automatic selection reads fwd_ms for calls autograd does
    # not track): on inputs that need no gradient, so no autograd node is built (mhattn's Python Function for the
    # Triton and CuPy backends, torch's C++ node for the sdpa backend's own path) and no lse is kept for a backward.
    fq, fk, fv = q.detach(), k.detach(), v.detach()
    expected = _torch_output(q, k, v, kwargs)
    for name in backends if backends is not None else backends_to_time(device):
        reasons = mhattn.explain(q, k, v, backend=name, **kwargs).reasons.get(name, ["not registered"])
        if reasons:
            row["skipped"][name] = "; ".join(reasons)
            continue
        why_not = variant_skipped(name, row)
        if why_not:
            row["skipped"][name] = why_not
            continue

        def forward(name=name):
            return mhattn.attention(fq, fk, fv, backend=name, **kwargs)

        wrong = _differs(forward, expected, q.dtype)
        if wrong:  # a fast wrong answer must never win the table
            row["skipped"][name] = wrong
            continue

        def forward_backward(name=name):
            return torch.autograd.grad(mhattn.attention(q, k, v, backend=name, **kwargs), (q, k, v), dout)

        modes = (("fwd", forward), ("fwd_bwd", forward_backward)) if cell.grad else (("fwd", forward),)
        for mode, fn in modes:
            if not _time_into(name, mode, fn, warmup_ms, rep_ms, device, row, timed[mode]):
                break
    halves = fastest_apart(row) if cell.grad else None
    if halves is not None:
        time_pair(halves, q, k, v, dout, kwargs, warmup_ms, rep_ms, device, row, timed["fwd_bwd"])
    short_forwards = {name: timed["fwd"][name] for name, ms in row["fwd_ms"].items()
                      if ms < HOST_BOUND_MS and name in timed["fwd"]}
    for mode, calls in timed.items():
        times = with_host_loops(row[f"{mode}_ms"], calls, device, row["skipped"])
        row[f"{mode}_ms"] = {name: round(ms, 5) for name, ms in times.items()}
    replayed = graph_replays(short_forwards, device)
    if replayed:
        row["fwd_graph_ms"] = {name: round(ms, 5) for name, ms in replayed.items()}
    return row


def fastest_apart(row: dict):
    """(forward backend, backward backend): the backend with the fastest forward and the one with the fastest
    backward (forward+backward less forward) in ``row``, where those are two different backends; else None."""
    from mhattn import registry

    forward, both = row["fwd_ms"], row["fwd_bwd_ms"]
    # Not the variants (timed where calls are short, for their host path): a pair runs through mhattn's autograd
    # Function, whose backward costs more host time at such shapes than any backend's own path.
    timed = [name for name in both if name in forward and registry.variant_base(name) is None]
    if len(timed) < 2:
        return None
    fastest_forward = min(timed, key=forward.get)
    fastest_backward = min(timed, key=lambda name: both[name] - forward[name])
    return None if fastest_forward == fastest_backward else (fastest_forward, fastest_backward)


def time_pair(halves, q, k, v, dout, kwargs, warmup_ms, rep_ms, device, row: dict, calls: dict) -> None:
    """Time the forward+backward of the pair ``halves`` (forward backend, backward backend) into
    ``row["fwd_bwd_ms"]`` and ``calls`` (for the host loops), once its gradients have matched those of the backward
    backend alone (within GRADIENT_TOLERANCE of their largest magnitude): a pair whose backward misreads the other's
    forward must never win the table. Its failure or mismatch goes to ``row["skipped"]``."""
    import mhattn
    from mhattn.backends.paired import pair_name

    name = pair_name(*halves)

    def forward_backward(backend=name):
        return torch.autograd.grad(mhattn.attention(q, k, v, backend=backend, **kwargs), (q, k, v), dout)

    try:
        got, want = forward_backward(), forward_backward(halves[1])
    except Exception as error:  # report, never stop the tuning run
        row["skipped"][name] = timing.describe_error(error)
        timing.release_memory(device)
        return
    worst = max(float((a.float() - b.float()).abs().max() / max(1.0, float(b.float().abs().max())))
                for a, b in zip(got, want))
    if not worst <= GRADIENT_TOLERANCE:
        row["skipped"][name] = (f"error: its gradients differ from {halves[1]}'s own by {worst:.3g} of their "
                                "largest magnitude; not timed")
        return
    _time_into(name, "fwd_bwd", forward_backward, warmup_ms, rep_ms, device, row, calls)


def _time_into(name, mode, fn, warmup_ms, rep_ms, device, row: dict, calls: dict) -> bool:
    """Time ``fn`` (``name``'s call in ``mode``) into ``row[mode + "_ms"]`` and ``calls``; False, with why in
    ``row["skipped"]``, when it failed."""
    try:
        ms = timing.bench_ms(fn, warmup_ms, rep_ms, device, settle_ms=SETTLE_MS)
    except Exception as error:  # report, never stop the tuning run
        row["skipped"][name] = timing.describe_error(error)
        timing.release_memory(device)
        return False
    if math.isfinite(ms) and ms > 0:
        row[f"{mode}_ms"][name] = ms
        calls[name] = fn
    return True


def with_host_loops(times: dict, calls: dict, device, skipped: dict) -> dict:
    """``times`` ({backend: GPU timer ms}) with each call under HOST_BOUND_MS on a GPU taken as its host loop's time
    per call where that is longer: HOST_LOOP_ROUNDS loops of HOST_LOOP_CALLS calls (``calls``: {backend: fn}), one
    synchronize at the end of each, the backends' loops taking turns; the best loop of each counts. A backend
    whose loop fails is left out, with why in ``skipped``."""
    from mhattn.benchmark import latency

    short = {name: calls[name] for name, ms in times.items() if ms < HOST_BOUND_MS}
    if torch.device(device).type != "cuda" or not short:
        return dict(times)
    loops, errors = latency.host_loops_in_turn(short, HOST_LOOP_CALLS, device, HOST_LOOP_ROUNDS)
    for name, error in errors.items():  # report, never stop the tuning run
        skipped[name] = timing.describe_error(error)
    return {name: max(ms, loops[name] / 1e3) if name in loops else ms for name, ms in times.items()
            if name not in errors}


def graph_replays(calls: dict, device) -> dict:
    """{backend: ms per call} of the forwards ``calls`` ({backend: fn}, those short enough for a host loop)
    replayed from a CUDA graph with the L2 cache flushed before each (timing.graph_replay_ms): no host time, and the
    inputs read from memory as the GPU timer reads them, so where the host does not count these agree with fwd_ms.
    The times automatic selection compares during capture (mhattn.tuning.table). On a GPU only; a backend whose call
    cannot be captured is left out (selection then reads its fwd_ms for it, as for a call too long to replay)."""
    if torch.device(device).type != "cuda":
        return {}
    replayed = {}
    for name, fn in calls.items():
        try:
            replayed[name] = timing.graph_replay_ms(fn, device, flush_l2=True)
        except Exception:  # a call that cannot be captured: not timed this way, never a failed tuning run
            timing.release_memory(device)
    return replayed


# Largest max-abs difference from torch's SDPA accepted for randn inputs (the benchmark's suspect limit).
CHECK_TOLERANCE = {torch.float16: timing.SUSPECT_DIFF, torch.bfloat16: timing.SUSPECT_DIFF, torch.float32: 1e-3,
                   torch.float64: 1e-6}
# Largest difference accepted between a pair's gradients and its backward backend's own, relative to their largest
# magnitude (at least 1): the two forwards round differently, a misread layout is off by the gradients' size.
GRADIENT_TOLERANCE = timing.SUSPECT_DIFF


def _torch_output(q, k, v, kwargs):
    """torch's SDPA on the same call (its default kernel choice), or None when it cannot run it."""
    try:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), **kwargs)
    except Exception:
        return None


def _differs(forward, expected, dtype) -> str:
    """'' when ``forward()`` matches ``expected`` (or there is nothing to compare with), else why not."""
    try:
        with torch.no_grad():
            out = forward()
    except Exception as error:
        return timing.describe_error(error)
    if expected is None:
        return ""
    diff = (out.float() - expected.float()).abs().max().item()
    if not diff <= CHECK_TOLERANCE.get(dtype, timing.SUSPECT_DIFF):
        return f"error: its output differs from torch SDPA's by {diff:.3g} (max abs); not timed"
    return ""
