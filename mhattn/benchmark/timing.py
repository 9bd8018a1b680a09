"""Timing one attention cell: forward, backward and forward+backward of one implementation on one shape.

Times come from ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``: it runs ``fn`` once,
estimates its time from five runs, warms up for ``warmup`` ms, then times each of ``rep`` ms worth of runs
with CUDA events, flushing the L2 cache before each, and returns the median. Without Triton the same
procedure runs here on CUDA events, and either runs from the fastest CPU (``host_speed``). On the CPU (only to test
the harness) a wall clock stands in.

The backward is timed as the protocol of h100_peers.json does: (forward+backward) - forward, both on
inputs that require grad. ``bwd_method="direct"`` instead times ``torch.autograd.grad`` on a retained
graph (the forward's output reused), which leaves the forward's cost out without subtracting.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from mhattn.benchmark import host_speed, protocol

BWD_METHODS = {
    "subtract": "bwd time = (fwd+bwd) - fwd",
    "direct": "bwd timed alone: torch.autograd.grad on a retained graph",
}
# Flag a forward whose output differs from PyTorch's default SDPA by more than this (max abs, randn inputs).
SUSPECT_DIFF = 0.05


@dataclass(frozen=True)
class TimingSettings:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    bwd_method: str = "subtract"

    def __post_init__(self):
        if self.bwd_method not in BWD_METHODS:
            raise ValueError(f"bwd_method: expected one of {sorted(BWD_METHODS)}, got {self.bwd_method!r}")
        if not (self.warmup_ms > 0 and self.rep_ms > 0):
            raise ValueError(f"warmup_ms and rep_ms must be positive, got {self.warmup_ms} and {self.rep_ms}")

    def as_dict(self) -> dict:
        return asdict(self)


# ---- the timer -----------------------------------------------------------------------------------------


def _triton_do_bench():
    try:
        from triton.testing import do_bench
    except Exception:  # Triton missing or broken: the same procedure runs here
        return None
    return do_bench


def timer_name(device) -> str:
    if torch.device(device).type != "cuda":
        return "wall clock (CPU; not the protocol)"
    if _triton_do_bench() is None:
        return "CUDA events (the do_bench procedure, without Triton)"
    return "triton.testing.do_bench median"


def bench_ms(fn, warmup_ms: float, rep_ms: float, device, settle_ms: float = 0.0) -> float:
    """Median milliseconds of ``fn()`` after ``warmup_ms`` of warm-up, over ``rep_ms`` worth of runs. On a GPU the
    runs are made from the fastest CPU and the backward's from the next (host_speed.on_fastest_cpu): a call short
    enough for its host path to show (a 1k-key backward, whose Python part runs on autograd's device thread) reads
    the host at its own speed, not at the speed of whichever CPU of a shared host the threads landed on.
    ``settle_ms``: first run ``fn`` back to back for that long where one call keeps the GPU busy for SETTLE_MIN_MS or
    more (settle): a GPU that was idle runs its first tens of milliseconds of load at boost clocks."""
    if torch.device(device).type != "cuda":
        return _wall_clock_bench(fn, warmup_ms, rep_ms)
    do_bench = _triton_do_bench()
    with host_speed.on_fastest_cpu(device):
        if settle_ms > 0:
            settle(fn, settle_ms)
        if do_bench is None:
            return _cuda_event_bench(fn, warmup_ms, rep_ms)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


# A call shorter than this (ms, one call timed alone) is not settled: its timing is the host's or its clocks' too
# briefly loaded to drop (and the tuner times such calls as host loops as well).
SETTLE_MIN_MS = 0.5


def settle(fn, settle_ms: float) -> None:
    """Run ``fn`` back to back for about ``settle_ms`` of its time where one call takes SETTLE_MIN_MS or more. On the
    H200 a forward+backward after a second idle ran its first 5-10 calls at boost clocks, then 6-10% slower from about
    70 ms of load on (cuDNN's as much as Triton's or more): a timing of 5 ms of warm-up and 20 ms of runs measured the
    boost and ranked cuDNN 5% ahead of Triton at d = 128 16k causal where the steady state ranks it 1.5% behind
    (backends/triton/NOTES.md, "Clocks after an idle GPU"). Training runs at the steady clocks. The number of calls
    comes from one call timed alone (after a first that may compile): a host loop bounded by wall time would queue
    far more GPU work than that."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - start) * 1e3
    if once_ms < SETTLE_MIN_MS:
        return
    for _ in range(math.ceil(settle_ms / once_ms)):
        fn()
    torch.cuda.synchronize()


def _cuda_event_bench(fn, warmup_ms, rep_ms) -> float:
    fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # larger than the L2 of any GPU today
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n_repeat = max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_repeat):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _wall_clock_bench(fn, warmup_ms, rep_ms) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    estimate = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / estimate))):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_replay_ms(fn, device, calls: int = 20, rounds: int = 10, flush_l2: bool = False) -> float:
    """Milliseconds per call of ``fn()`` replayed from a CUDA graph, as a serving loop runs its decoding steps: ``calls``
    calls captured once (after warm-up calls on a side stream, which capture needs), the graph replayed ``rounds``
    times between CUDA events; the median round over ``calls``. No host work is timed, so a call whose GPU time is
    below its host path's shows its GPU time here. Without ``flush_l2`` nothing flushes the L2 cache between the
    calls: inputs that fit in it (50 MB on an H100) are read from it after the first call. With it, each captured call
    follows a write of L2_FLUSH_BYTES (as bench_ms's timer flushes before each run), and a graph of the writes alone,
    timed the same way, is taken off: the GPU time of calls that find their inputs in memory, as the layers of a
    captured model do. Raises what the capture raises (a call that reads a value back to the host cannot be
    captured)."""
    device = torch.device(device)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None

    def step():
        if flush is not None:
            flush.zero_()
        fn()

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    per_call = _replayed_ms(step, device, calls, rounds)
    if flush is not None:
        per_call = max(per_call - _replayed_ms(flush.zero_, device, calls, rounds), 0.0)
    return per_call


# Bytes written between two replayed calls to take their inputs out of the L2 cache (50 MB on an H100).
L2_FLUSH_BYTES = 64 * 1024 * 1024


def _replayed_ms(step, device, calls: int, rounds: int) -> float:
    """The median over ``rounds`` replays of a graph of ``calls`` captured ``step()``s, in ms per step."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


# ---- errors as table entries ----------------------------------------------------------------------------


def is_out_of_memory(error: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(error, oom_type):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def describe_error(error: BaseException, caught_warnings=()) -> str:
    """A table entry for a failed run: 'OOM', 'n/a: <why>' when the implementation cannot run the shape,
    else 'error: <type>: <message>'. ``caught_warnings`` are the warnings of the failing call: SDPA
    explains there why a kernel was not used."""
    from mhattn.errors import BackendUnavailableError

    if is_out_of_memory(error):
        return "OOM"
    message = " ".join(str(error).split())
    if isinstance(error, BackendUnavailableError):
        return "n/a: " + message
    if isinstance(error, RuntimeError) and ("No available kernel" in message or "No viable backend" in message):
        reasons = []
        for w in caught_warnings:
            text = " ".join(str(getattr(w, "message", w)).split())
            if text and text not in reasons and "Aborting" not in text:
                reasons.append(text)
        return "n/a: " + ("; ".join(reasons) if reasons else message)
    return f"error: {type(error).__name__}: {message}"


# ---- one cell ----------------------------------------------------------------------------------------------


def release_memory(device) -> None:
    """Give cached CUDA memory back after a failure or a big cell; never raises (the context may be broken)."""
    if torch.device(device).type != "cuda":
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:
        pass


def free_memory(device):
    """Bytes a new allocation can still get: free on the device plus what torch's allocator holds unused."""
    if torch.device(device).type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def time_attention(impl: protocol.Implementation, shape: protocol.Shape, inputs, modes, settings: TimingSettings,
                   device, check=None) -> dict:
    """Time ``impl`` on ``shape`` for each of ``modes`` ('fwd', 'bwd', 'fwd_bwd').

    ``inputs`` = (q, k, v, dout) from :func:`protocol.make_inputs`; ``check`` is an output (B, H, N, d)
    of the same inputs from another implementation, or None. Never raises for a failure of the
    implementation: each mode's entry in ``status`` is 'ok', 'n/a: ...', 'OOM', 'skipped: ...' or 'error: ...'.
    Returns the result row (see :func:`result_row`).
    """
    q, k, v, dout = inputs
    modes = [m for m in protocol.MODES if m in modes]
    row = result_row(impl, shape)
    row.update(warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms, bwd_method=settings.bwd_method,
               timer=timer_name(device))
    status = {}
    ms = {}

    def fail_all(entry):
        for m in modes:
            status[m] = entry
        return _finish(row, shape, modes, ms, status)

    reasons = impl.unsupported(q, k, v, shape.causal)
    if reasons:
        return fail_all("n/a: " + "; ".join(reasons))
    # An O(N^2) implementation that clearly cannot fit is not tried (an attempt can take seconds).
    free = free_memory(device)
    want_backward = any(m != "fwd" for m in modes)
    need = impl.scratch_bytes(shape, "fwd_bwd" if want_backward else "fwd")
    if free is not None and need > free:
        return fail_all(f"OOM: needs ~{need / 2**30:.1f} GiB of O(N^2) scratch, {free / 2**30:.1f} GiB free")

    causal = shape.causal

    def forward():
        return impl(q, k, v, causal)

    def forward_backward():
        out = impl(q, k, v, causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    with impl.context():
        # The first call: compiles what needs compiling, shows why a peer cannot run, checks the output.
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = forward()
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize()
        except Exception as error:  # report, never crash the sweep
            entry = describe_error(error, caught)
            out = None
            release_memory(device)
            return fail_all(entry)
        row["max_abs_diff"] = _max_abs_diff(out, check)
        del out

        need_fwd = "fwd" in modes or ("bwd" in modes and settings.bwd_method == "subtract")
        need_fwd_bwd = "fwd_bwd" in modes or ("bwd" in modes and settings.bwd_method == "subtract")
        if need_fwd:
            ms["fwd"], status["fwd"] = _timed(forward, settings, device)
        if need_fwd_bwd:
            ms["fwd_bwd"], status["fwd_bwd"] = _timed(forward_backward, settings, device)
        if "bwd" in modes:
            if settings.bwd_method == "subtract":
                status["bwd"], ms["bwd"] = _subtract(ms.get("fwd_bwd"), status["fwd_bwd"], ms.get("fwd"), status["fwd"])
            else:
                ms["bwd"], status["bwd"] = _timed_backward(forward, q, k, v, dout, settings, device)
    # Modes only measured to derive the backward are kept too: they cost nothing more to report.
    for m in ("fwd", "fwd_bwd"):
        if m in ms and m not in modes:
            modes.append(m)
    return _finish(row, shape, modes, ms, status)


def result_row(impl: protocol.Implementation, shape: protocol.Shape) -> dict:
    """The identity part of a result row, in the field names of h100_peers.json."""
    return {
        "kind": "attn",
        "impl": impl.name,
        "family": impl.family,
        "is_reference": impl.is_reference,
        "dtype": protocol.DTYPE_LONG_NAMES[shape.dtype],
        "d": shape.head_dim,
        "h": shape.heads,
        "b": shape.batch,
        "n": shape.seqlen,
        "causal": shape.causal,
    }


def _finish(row, shape, modes, ms, status):
    row["status"] = {m: status.get(m, "skipped") for m in protocol.MODES if m in modes}
    for m in protocol.MODES:
        if m not in modes:
            continue
        t = ms.get(m) if status.get(m) == "ok" else None
        row[f"{m}_ms"] = t
        row[f"{m}_tflops"] = protocol.tflops(protocol.flops(shape, m), t)
    return row


def _timed(fn, settings, device):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first call already reported what there was to say
            return bench_ms(fn, settings.warmup_ms, settings.rep_ms, device), "ok"
    except Exception as error:
        entry = describe_error(error)
        release_memory(device)
        return None, entry


def _timed_backward(forward, q, k, v, dout, settings, device):
    try:
        out = forward()
    except Exception as error:
        release_memory(device)
        return None, describe_error(error)

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    result = _timed(backward, settings, device)
    out = None  # frees the retained graph
    return result


def _subtract(fwd_bwd_ms, fwd_bwd_status, fwd_ms, fwd_status):
    if fwd_bwd_status != "ok":
        return fwd_bwd_status, None
    if fwd_status != "ok":
        return f"skipped: the forward, needed to derive it, failed ({fwd_status})", None
    difference = fwd_bwd_ms - fwd_ms
    if not difference > 0:
        return f"error: (fwd+bwd) - fwd = {difference:.4f} ms is not positive (timing noise)", None
    return "ok", difference


def _max_abs_diff(out, check):
    if check is None or out is None or out.shape != check.shape:
        return None
    with torch.no_grad():
        diff = (out.detach().float() - check.float()).abs().max().item()
    return diff if math.isfinite(diff) else "non-finite"
