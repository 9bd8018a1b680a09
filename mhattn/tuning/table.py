"""Timing tables: what ``mhattn tune`` measured on one GPU, and the lookup automatic selection makes in them.

A table is a small JSON file: ``key`` (device name, compute capability, driver and library versions),
``cells`` (one per timed shape: the :class:`~mhattn.tuning.grid.Cell` fields, and per backend the median
milliseconds of the forward on inputs that need no gradient, ``fwd_ms``, and of forward+backward, ``fwd_bwd_ms``) and
how it was made.

Which table applies: ``MHATTN_TABLE=off`` disables tables, ``MHATTN_TABLE=<file>`` uses that file;
otherwise the tables in ``$MHATTN_CACHE_DIR/tables`` (default ``~/.cache/mhattn/tables``, where
``mhattn tune`` writes), then those shipped in ``mhattn/tables/``, whose device name and compute
capability equal this device's; among several, one made with this torch version first, then the newest.

The nearest tuned shape to a problem: among the table's cells with the same dtype, the same causal
kind (the diagonal hides keys or not) and the same mask kind (none, bool, float), and that timed at
least one of the backends that can run the problem in the mode needed (forward+backward when q, k or
v requires grad, else forward), the one with the smallest distance

    2 |dlog2 d| + |dlog2 Nq| + |dlog2 Nk| + 0.5 |dlog2 (B * Hq)| + |dlog2 (Hq / Hkv)|

(ties: the first in the table), if that distance is at most :data:`MAX_DISTANCE`. The backend measured
fastest there is the choice; by forward+backward time, those within :data:`TIE` of the fastest are a tie (the
spread of two timings of one kernel), which the faster forward breaks (a forward+backward pair "a+b" runs a's
forward), so that a call with grad that is never differentiated does not pay for a difference the backward does
not make. With no such cell the priority list decides.

During CUDA graph capture (``replayed``: the dispatcher's request says so), a forward is chosen with the cell's
``fwd_graph_ms`` for the backends whose calls there are host-bound: the time per call of calls replayed from a CUDA
graph with the L2 cache flushed before each, which ``mhattn tune`` measures for the calls it also times as host loops
(under its HOST_BOUND_MS). A call is host-bound where its ``fwd_ms`` exceeds its replay by more than REPLAY_MARGIN
(its host loop took longer than its kernels); the others keep their ``fwd_ms`` (both are GPU times then, and the
GPU timer's is the one every cell has). A replay pays none of a call's host path, so at short shapes the fastest
kernel and the cheapest call are different backends. A differentiated call
under capture is chosen by ``fwd_bwd_ms`` as outside it (backwards are not replayed by the tuner).
"""

from __future__ import annotations

import json
import math
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

FORMAT = 1
TABLE_ENV = "MHATTN_TABLE"
MAX_DISTANCE = 4.0
# Forward+backward times within this fraction of the fastest are a tie, broken by the forward's time.
TIE = 0.03
# During capture a backend's graph replay replaces its forward time where the forward time is more than this times
# the replay (a host-bound call); below it the two are GPU timings that differ by their methods' spread.
REPLAY_MARGIN = 1.2
# Weights of the log2 distances: head dim (tiles change with it), Nq, Nk, B * Hq, the GQA group size.
WEIGHTS = (2.0, 1.0, 1.0, 0.5, 1.0)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tables"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def cache_tables_dir() -> Path:
    """Where ``mhattn tune`` writes tables: ``$MHATTN_CACHE_DIR/tables``, else ``~/.cache/mhattn/tables``."""
    root = os.environ.get("MHATTN_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "mhattn")
    return Path(root) / "tables"


def device_identity(device_type: str, device_index: Optional[int] = None) -> dict:
    """What a table must match: the device's name and compute capability (None on the CPU)."""
    if device_type == "cuda":
        index = torch.cuda.current_device() if device_index is None else device_index
        return {"device": torch.cuda.get_device_name(index),
                "compute_capability": list(torch.cuda.get_device_capability(index))}
    return {"device": f"cpu {platform.machine()} {os.cpu_count()} cores", "compute_capability": None}


# ---- the table ----------------------------------------------------------------------------------------------


@dataclass
class TimingTable:
    key: dict                                  # device, compute_capability, driver and library versions
    cells: list                                # dicts: Cell fields + fwd_ms / fwd_bwd_ms {backend: ms}
    made: dict = field(default_factory=dict)   # command, date, timing settings, wall time
    path: Optional[str] = None

    def matches(self, identity: dict) -> bool:
        return (self.key.get("device") == identity["device"]
                and self.key.get("compute_capability") == identity["compute_capability"])

    def as_json(self) -> dict:
        return {"format": FORMAT, "key": self.key, "made": self.made, "cells": self.cells}

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.as_json(), indent=1, sort_keys=False) + "\n")
        os.replace(tmp, path)  # a reader never sees half a table
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path) -> "TimingTable":
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: table format {data.get('format')!r}, this mhattn reads {FORMAT}")
        for name in ("key", "cells"):
            if name not in data:
                raise ValueError(f"{path}: a timing table needs {name!r}")
        return cls(data["key"], data["cells"], data.get("made", {}), str(path))


def merged(tables: list) -> TimingTable:
    """One table from several ``mhattn tune`` runs on one device: each cell (the same Cell fields) with, per backend,
    the ``fwd_ms`` and ``fwd_bwd_ms`` of the first table that timed the cell, except where another table's time or its
    own is under the tuner's HOST_BOUND_MS (measure.py: a time it may have taken from a host loop): there the smallest
    (a busy host only ever adds to a host loop's time, so the smaller of two is the better estimate). A longer time is
    the GPU's, and the smallest of several runs would favour the backend whose timings vary most between runs (on the
    H200 cuDNN's forward+backward read 6.38 and 6.98 ms in two runs at d = 128 16k causal), so the first table (the one
    measured as the caller trusts most) decides those: a backend it did not time in the cell (a pair, a variant) takes
    no GPU time from another table, whose timings may not be comparable (a table timed on a GPU at boost clocks,
    timing.settle).
    ``fwd_graph_ms`` come from the first table alone (the run whose replays to keep; replays take no host time), and
    the reasons from the first table that timed the cell. Cells some tables lack come from those that have them. The
    key and ``made`` are the first table's, ``made["merged"]`` naming the others' dates. Raises ValueError for tables
    of different devices."""
    from mhattn.tuning.measure import HOST_BOUND_MS

    if not tables:
        raise ValueError("no table to merge")
    first = tables[0]
    for other in tables[1:]:
        if not other.matches(device_identity_of(first.key)):
            raise ValueError(f"cannot merge tables of {first.key.get('device')} and {other.key.get('device')}")
    cells: dict = {}
    for index, t in enumerate(tables):
        for cell in t.cells:
            at = cell_key(cell)
            if at not in cells:
                cells[at] = dict(cell, fwd_ms=dict(cell.get("fwd_ms") or {}), fwd_bwd_ms=dict(cell.get("fwd_bwd_ms") or {}))
                if index > 0:
                    cells[at].pop("fwd_graph_ms", None)
                continue
            kept = cells[at]
            for mode in ("fwd_ms", "fwd_bwd_ms"):
                for name, ms in (cell.get(mode) or {}).items():
                    first_ms = kept[mode].get(name)
                    if first_ms is None:
                        if ms < HOST_BOUND_MS:
                            kept[mode][name] = ms
                    elif min(ms, first_ms) < HOST_BOUND_MS:
                        kept[mode][name] = min(ms, first_ms)
    made = dict(first.made, merged=[t.made.get("date", "?") for t in tables[1:]])
    return TimingTable(dict(first.key), list(cells.values()), made)


def with_cells(base: TimingTable, added: TimingTable) -> TimingTable:
    """``base`` with ``added``'s cells (a run over other shapes, ``mhattn tune --head-dim``): base's cells as they are
    (their replays and reasons too), but where ``added`` timed the same Cell, whose times replace them. The key and
    ``made`` are ``added``'s (the newest run), ``made["added_to"]`` naming base's file and ``made["base"]`` its
    ``made``. Raises ValueError for tables of different devices."""
    if not base.matches(device_identity_of(added.key)):
        raise ValueError(f"cannot add cells of {added.key.get('device')} to a table of {base.key.get('device')}")
    timed = {cell_key(cell) for cell in added.cells}
    kept = [cell for cell in base.cells if cell_key(cell) not in timed]
    made = dict(added.made, added_to=base.path or "a table in memory", base=dict(base.made))
    return TimingTable(dict(added.key), kept + list(added.cells), made)


def cell_key(cell: dict) -> tuple:
    """A table cell's shape, its Cell fields in order: equal for two timings of one shape."""
    from mhattn.tuning.grid import Cell

    return tuple(cell.get(f) for f in Cell.__dataclass_fields__)


def device_identity_of(key: dict) -> dict:
    """The device identity part of a table's key (what :meth:`TimingTable.matches` compares)."""
    return {"device": key.get("device"), "compute_capability": key.get("compute_capability")}


def table_file_name(key: dict) -> str:
    cc = key.get("compute_capability")
    parts = [key.get("device", "device"), "sm_%d%d" % tuple(cc) if cc else "", "torch-" + key.get("torch", "")]
    slug = "-".join(p for p in parts if p)
    return "".join(ch if ch.isalnum() or ch in "-._" else "_" for ch in slug) + ".json"


# ---- which table applies ------------------------------------------------------------------------------------


def _tables_in(folder: Path) -> list:
    found = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.json")):
        try:
            found.append(TimingTable.load(path))
        except Exception as error:  # a broken file must not break attention calls
            warnings.warn(f"mhattn: ignoring timing table {path}: {error}")
    return found


_active: dict = {}   # (device type, index) -> the table found for it, or None


def active_table(device_type: str, device_index: Optional[int]) -> Optional[TimingTable]:
    """The table automatic selection uses on this device, or None (see the module docstring). Cached
    until :func:`clear_cache` (which ``mhattn.dispatch.clear_cache`` calls)."""
    key = (device_type, device_index)
    if key not in _active:
        _active[key] = _find_table(device_type, device_index)
    return _active[key]


def _find_table(device_type, device_index) -> Optional[TimingTable]:
    setting = os.environ.get(TABLE_ENV, "").strip()
    if setting.lower() == "off":
        return None
    if setting:
        return TimingTable.load(setting)
    identity = device_identity(device_type, device_index)
    for folder in (cache_tables_dir(), SHIPPED_DIR):
        tables = [t for t in _tables_in(folder) if t.matches(identity)]
        if tables:
            same_torch = [t for t in tables if t.key.get("torch") == torch.__version__]
            pool = same_torch or tables
            return max(pool, key=lambda t: t.made.get("unix_time", 0))
    return None


def clear_cache() -> None:
    _active.clear()


# ---- the nearest tuned shape --------------------------------------------------------------------------------


def _bucket_of_problem(problem) -> tuple:
    mask = "bool" if "bool_mask" in problem.features else "float" if "float_mask" in problem.features else "none"
    return _DTYPE_NAMES.get(problem.dtype, str(problem.dtype)), problem.causal_hides_keys, mask


def _bucket_of_cell(cell: dict) -> tuple:
    offset = cell["seqlen_k"] - cell["seqlen_q"] if cell["causal"] == "bottom_right" else 0
    hides = cell["causal"] != "none" and offset < cell["seqlen_k"] - 1
    return cell["dtype"], hides, cell["mask"]


def _coordinates(head_dim, seqlen_q, seqlen_k, batch, heads_q, heads_kv) -> tuple:
    return tuple(math.log2(max(1, x)) for x in (head_dim, seqlen_q, seqlen_k, batch * heads_q, heads_q / heads_kv))


def distance(problem, cell: dict) -> float:
    a = _coordinates(problem.head_dim, problem.seqlen_q, problem.seqlen_k, problem.batch, problem.heads_q,
                     problem.heads_kv)
    b = _coordinates(cell["head_dim"], cell["seqlen_q"], cell["seqlen_k"], cell["batch"], cell["heads_q"],
                     cell["heads_kv"])
    return sum(w * abs(x - y) for w, x, y in zip(WEIGHTS, a, b))


def cell_label(cell: dict) -> str:
    from mhattn.tuning.grid import Cell

    fields = {k: cell[k] for k in Cell.__dataclass_fields__ if k in cell}
    return Cell(**fields).label()


@dataclass
class Evidence:
    """Why automatic selection took a backend: the measured times at the nearest tuned shape."""

    chosen: str
    mode: str            # "fwd" or "fwd_bwd"
    cell: dict
    distance: float
    times: dict          # backend -> ms, for the backends that can run the problem
    table: TimingTable
    replayed: bool = False  # the times are those of calls replayed from a CUDA graph (fwd_graph_ms) where timed

    def __str__(self):
        mode = "forward+backward" if self.mode == "fwd_bwd" else "forward"
        if self.replayed:
            mode += ", replayed from a CUDA graph"
        ranked = sorted(self.times.items(), key=lambda item: item[1])
        fastest = ranked[0][0]
        if self.chosen == fastest:
            note = " (fastest)"
        elif self.chosen == _variant_base(fastest):
            note = f" (chosen: within {TIE:.0%} of its variant {fastest}, which pins one of its kernels)"
        else:
            note = f" (chosen: within {TIE:.0%} of the fastest, with the faster forward)"
        times = ", ".join(f"{name} {ms:.4g} ms" + (note if name == self.chosen else "") for name, ms in ranked)
        versions = ", ".join(f"{k} {self.table.key[k]}" for k in ("torch", "triton", "cupy", "driver")
                             if self.table.key.get(k))
        stale = "" if self.table.key.get("torch") == torch.__version__ else f" (this process: torch {torch.__version__})"
        return (f"measured ({mode}) at the nearest tuned shape {cell_label(self.cell)}, distance {self.distance:.2f}: "
                f"{times}\n  table: {self.table.path or 'in memory'} ({self.table.key.get('device')}; {versions}){stale}")


def nearest(table: TimingTable, problem, candidates, replayed: bool = False) -> Optional[Evidence]:
    """The evidence for the fastest of ``candidates`` (backend names that can run ``problem``) at the
    nearest tuned shape, or None when the table has no cell close enough that timed one of them. ``replayed``:
    the call is being captured into a CUDA graph, so a forward's graph-replay times decide where the cell has them
    (see the module's docstring)."""
    mode = "fwd_bwd" if problem.needs_grad else "fwd"
    bucket = _bucket_of_problem(problem)
    best = None
    for cell in table.cells:
        if _bucket_of_cell(cell) != bucket:
            continue
        times = {n: ms for n, ms in (cell.get(f"{mode}_ms") or {}).items() if n in candidates and ms}
        if not times:
            continue
        d = distance(problem, cell)
        if d <= MAX_DISTANCE and (best is None or d < best[0]):
            best = (d, cell, times)
    if best is None:
        return None
    d, cell, times = best
    forward_ms = (cell.get("fwd_ms") or {}) if mode == "fwd_bwd" else None
    replayed_ms = (cell.get("fwd_graph_ms") or {}) if replayed and mode == "fwd" else {}
    host_bound = {name: replayed_ms[name] for name, ms in times.items()
                  if name in replayed_ms and ms > REPLAY_MARGIN * replayed_ms[name]}
    if host_bound:
        times = {**times, **host_bound}
        return Evidence(_fastest(times, None), mode, cell, d, times, table, replayed=True)
    return Evidence(_fastest(times, forward_ms), mode, cell, d, times, table)


def _fastest(times: dict, forward_ms: Optional[dict]) -> str:
    """The name with the smallest of ``times``. Given ``forward_ms`` (``times`` are then forward+backward times and
    ``forward_ms`` the cell's forward times): among the names within TIE of the smallest, the one whose forward (of a
    pair "a+b", a's) is fastest, where the cell timed every tied name's forward. Then a variant gives way to its base
    within TIE (_base_if_tied)."""
    return _base_if_tied(_fastest_by_forward(times, forward_ms), times)


def _fastest_by_forward(times: dict, forward_ms: Optional[dict]) -> str:
    """_fastest before the variant rule."""
    fastest = min(times, key=times.get)
    if forward_ms is None:
        return fastest
    tied = [name for name, ms in times.items() if ms <= times[fastest] * (1 + TIE)]
    forwards = {name: forward_ms.get(name.split("+")[0]) for name in tied}
    if len(tied) < 2 or not all(forwards.values()):
        return fastest
    return min(tied, key=lambda name: (forwards[name], times[name]))


def _variant_base(name: str):
    from mhattn import registry

    return registry.variant_base(name)


def _base_if_tied(name: str, times: dict) -> str:
    """``name``, or its base where ``name`` is a variant (Backend.variant_of: the sdpa backend pinned to one of torch's
    kernels) whose base's time is within TIE of its own: there the two are most often one kernel with host paths a
    few microseconds apart, which noise ranks, and the base (torch's public op) follows torch's own kernel choice. (On
    the H100 host the pinned cuDNN op's host loop at the ViT-B/16 forward read 1.08x the public op's, on the H200 the
    table had it 2% ahead: backends/triton/NOTES.md, "torch's fused kernels through their private ops' bindings".)"""
    base = _variant_base(name)
    if base is not None and base in times and times[base] <= times[name] * (1 + TIE):
        return base
    return name


def measured_choice(problem, candidates, replayed: bool = False) -> Optional[Evidence]:
    """The dispatcher's hook: evidence for a choice among ``candidates``, or None (no table, no close cell);
    ``replayed``: the call is being captured into a CUDA graph (nearest)."""
    if len(candidates) < 2:
        return None
    try:
        table = active_table(problem.device_type, problem.device_index)
    except Exception as error:  # a table that cannot be read must not break attention calls
        warnings.warn(f"mhattn: timing table not used: {error}")
        return None
    return None if table is None else nearest(table, problem, candidates, replayed)


def environment_key(device) -> dict:
    """The key ``mhattn tune`` writes: the device identity and the versions of everything that was timed."""
    from mhattn.conformance.environment import describe_environment

    device = torch.device(device)
    key = device_identity(device.type, device.index)
    env = describe_environment()
    key["torch"] = torch.__version__
    key["cuda"] = torch.version.cuda
    for name in ("driver", "triton", "cupy", "nvrtc", "mhattn"):
        if name in env:
            key[name] = env[name]
    return key
