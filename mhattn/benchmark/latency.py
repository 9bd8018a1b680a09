"""``mhattn bench --latency``: what one small attention call costs, where the host path shows.

At the shapes of encoder models (ViT, BERT, speech: N <= 512) a kernel runs for tens of microseconds, so the
Python and launch work around it can cost more than the kernel. For each shape of :data:`SHAPES` and each
implementation, forward and forward+backward, two numbers in microseconds per call:

- GPU time: the bench's timer (``triton.testing.do_bench`` median; wall clock on the CPU), what the GPU
  spends on one call when the host keeps ahead of it;
- host-loop time: ``calls`` calls in a Python loop timed on the host, with one synchronize at the end, per
  call, the best of HOST_LOOP_ROUNDS loops: what a loop of such calls runs at (the larger of the host's and the
  GPU's cost). The implementations of one (shape, mode) take turns, one loop each per round, so a drift of the
  host's speed (up to 1.5x between minutes on the H100 host) reaches them alike, and each loop runs pinned to the
  CPU that is fastest as it starts (``host_speed``: half the CPUs of the shared H200 host run at half speed at any
  moment).

Each is shown beside ``sdpa-default`` (``torch.nn.functional.scaled_dot_product_attention`` with torch's own
kernel choice) as a ratio. Planning and reporting are plain functions of plain data, tested on the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import asdict, dataclass

import torch

from mhattn.benchmark import host_speed, protocol, timing
from mhattn.benchmark.timing import describe_error, release_memory

BASELINE = "sdpa-default"
MODES = ("fwd", "fwd_bwd")
HOST_LOOP_CALLS = 300
# (5: on the shared H200 host one loop in a few still met a CPU that slowed down under it, pinned or not)
HOST_LOOP_ROUNDS = 5
WARMUP_MS, REP_MS = 25.0, 100.0


@dataclass(frozen=True)
class LatencyShape:
    """q, k, v (B, H, N, d), non-causal."""

    label: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    dtype: str  # "bf16", "fp16" or "fp32"

    def describe(self) -> str:
        return f"{self.label}: B={self.batch} H={self.heads} N={self.seqlen} d={self.head_dim} {self.dtype}"


SHAPES = (
    LatencyShape("small", 1, 16, 128, 64, "bf16"),
    LatencyShape("ViT-B/16 batch 32", 32, 12, 197, 64, "bf16"),
    LatencyShape("N=512", 8, 16, 512, 64, "bf16"),
    LatencyShape("N=512 fp32", 8, 16, 512, 64, "fp32"),
)


def default_impls(table: dict) -> list:
    """Every mhattn backend but the reference, then the baseline."""
    names = [n for n, impl in table.items() if impl.family == "mhattn" and not impl.is_reference]
    return names + [BASELINE]


def plan_cells(impl_names: list, shapes=None, modes=MODES) -> list:
    """The cells to measure (``shapes`` default :data:`SHAPES`), as dicts (impl, shape, mode); the baseline
    first in each (shape, mode) group."""
    shapes = SHAPES if shapes is None else shapes
    ordered = [BASELINE] + [n for n in impl_names if n != BASELINE] if BASELINE in impl_names else list(impl_names)
    return [{"impl": name, "shape": asdict(shape), "mode": mode}
            for shape in shapes for mode in modes for name in ordered]


def host_loop_us(fn, calls: int, device, rounds: int = HOST_LOOP_ROUNDS) -> float:
    """Microseconds per call of ``calls`` calls of ``fn`` in a loop, one synchronize at the end; the best of
    ``rounds`` such loops (on the H100 host a loop right after the GPU timer read up to 1.6x slower than the next
    one, for SDPA and mhattn alike: the best round is the host's steady cost)."""
    fn()
    _synchronize(device)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def host_loops_in_turn(calls: dict, loop_calls: int, device, rounds: int, contexts: dict = None) -> tuple:
    """Host loops of several calls taking turns (the host's speed drifts between loops, so calls timed one after
    another are compared at different speeds): ``rounds`` rounds, each one loop of ``loop_calls`` calls of each of
    ``calls`` ({name: fn}) with one synchronize at its end, inside ``contexts[name]()`` where given (entered once a
    loop, not per call). On a GPU each loop runs pinned to the CPU that is fastest as it starts
    (host_speed.on_fastest_cpu: on a shared host some CPUs run at half speed, and which ones changes by the
    second). Returns ({name: its best loop's microseconds per call}, {name: the error that stopped its loops})."""
    best, errors = dict.fromkeys(calls, float("inf")), {}
    contexts = contexts or {}
    for _ in range(rounds):
        for name, fn in calls.items():
            if name in errors:
                continue
            try:
                with host_speed.on_fastest_cpu(device), contexts.get(name, contextlib.nullcontext)():
                    best[name] = min(best[name], host_loop_us(fn, loop_calls, device, rounds=1))
            except Exception as error:  # the caller reports it
                errors[name] = error
    return {name: us for name, us in best.items() if name not in errors}, errors


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _prepared_call(impl: protocol.Implementation, cell: dict, device):
    """(row, call) of one cell: the row with status "ok" and the call of its implementation on fresh inputs, run
    once; or the row with status "unsupported" / "error" and its reason, and None."""
    shape = LatencyShape(**cell["shape"])
    row = dict(cell, gpu_us=None, host_us=None, status="ok", reason="")
    dtype = protocol.TORCH_DTYPES[shape.dtype]
    grad = cell["mode"] == "fwd_bwd"
    try:
        q, k, v = (torch.randn(shape.batch, shape.heads, shape.seqlen, shape.head_dim, device=device, dtype=dtype,
                               requires_grad=grad) for _ in range(3))
        reasons = impl.unsupported(q, k, v, False)
        if reasons:
            return dict(row, status="unsupported", reason="; ".join(reasons)), None
        if grad:
            dout = torch.randn_like(q)

            def call():
                impl(q, k, v, False).backward(dout)
        else:

            def call():
                impl(q, k, v, False)

        with impl.context():
            call()
        return row, call
    except Exception as error:  # one cell's failure is a table entry, not the end of the run
        return dict(row, status="error", reason=describe_error(error)), None


def measure_group(cells: list, table: dict, device, warmup_ms=WARMUP_MS, rep_ms=REP_MS, calls: int = 0) -> list:
    """The rows of ``cells``, one (shape, mode) in several implementations: each one's GPU time, then their host
    loops (``calls`` calls each, default HOST_LOOP_CALLS) taking turns, HOST_LOOP_ROUNDS rounds, the best loop of
    each kept."""
    calls = calls or HOST_LOOP_CALLS
    rows, ready = [], {}
    try:
        for cell in cells:
            impl = table[cell["impl"]]
            row, call = _prepared_call(impl, cell, device)
            rows.append(row)
            if call is None:
                continue
            try:
                with impl.context():
                    row["gpu_us"] = timing.bench_ms(call, warmup_ms, rep_ms, device) * 1e3
                ready[len(rows) - 1] = (impl, call)
            except Exception as error:
                row.update(status="error", reason=describe_error(error))
        loops, errors = host_loops_in_turn({index: call for index, (_, call) in ready.items()}, calls, device,
                                           HOST_LOOP_ROUNDS,
                                           {index: impl.context for index, (impl, _) in ready.items()})
        for index, us in loops.items():
            rows[index]["host_us"] = us
        for index, error in errors.items():
            rows[index].update(status="error", reason=describe_error(error), gpu_us=None, host_us=None)
    finally:
        ready.clear()
        release_memory(device)
    return rows


def run(impl_names: list, table: dict, device, shapes=None, modes=MODES, progress=None, **timing_args) -> list:
    """Measures every cell in this process, a (shape, mode) group at a time; returns the rows."""
    rows = []
    cells = plan_cells(impl_names, shapes, modes)  # a (shape, mode) group's cells stand together
    for _, group in itertools.groupby(cells, key=lambda cell: (cell["shape"], cell["mode"])):
        for row in measure_group(list(group), table, device, **timing_args):
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


# ---- reporting ---------------------------------------------------------------------------------------------------


def _ratio(value, baseline) -> str:
    if value is None or not baseline:
        return "-"
    return f"{value / baseline:.2f}x"


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(rows: list, timer: str = "") -> str:
    """The latency table as text: one line per (shape, mode, implementation)."""
    baseline = {(str(r["shape"]), r["mode"]): r for r in rows if r["impl"] == BASELINE and r["status"] == "ok"}
    lines = [f"latency: microseconds per call (GPU: {timer or 'the bench timer'}; host loop: best of {HOST_LOOP_ROUNDS} "
             f"loops of {HOST_LOOP_CALLS} calls, one synchronize at the end of each); ratios to {BASELINE}",
             f"{'shape':<44} {'mode':<8} {'impl':<14} {'GPU us':>9} {'x ' + BASELINE:>16} {'host-loop us':>13} "
             f"{'x ' + BASELINE:>16}"]
    for r in rows:
        base = baseline.get((str(r["shape"]), r["mode"]))
        shape = LatencyShape(**r["shape"]).describe()
        mode = protocol.MODE_LABELS.get(r["mode"], r["mode"]).replace("forward+backward", "fwd+bwd")
        mode = mode.replace("forward", "fwd")
        if r["status"] != "ok":
            lines.append(f"{shape:<44} {mode:<8} {r['impl']:<14} {r['status']}: {r['reason'][:90]}")
            continue
        lines.append(
            f"{shape:<44} {mode:<8} {r['impl']:<14} {_us(r['gpu_us']):>9} "
            f"{_ratio(r['gpu_us'], base and base['gpu_us']):>16} {_us(r['host_us']):>13} "
            f"{_ratio(r['host_us'], base and base['host_us']):>16}")
    return "\n".join(lines) + "\n"
