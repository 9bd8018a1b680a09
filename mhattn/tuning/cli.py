"""``mhattn tune``: time every backend on a grid of shapes and write the timing table automatic selection reads.

    mhattn tune --quick          # 67 shapes, a few minutes on an H100 (compiling kernels included)
    mhattn tune                  # the full grid (266 shapes)
    mhattn tune --quick --output mhattn/tables/h100.json   # the table shipped in the package
    mhattn tune --quick --passes 2 --output mhattn/tables/h100.json   # host loops: the smaller of two passes'
    mhattn tune --merge a.json b.json --output c.json      # host loops: the smaller of two runs'; GPU times: a's
    mhattn tune --quick --head-dim 96,192   # the training shapes at these head dims, added to this device's table

The cells run in a worker process (the benchmark engine's supervisor): a kernel that crashes, hangs or
breaks its CUDA context loses its own cell, not the run. The table goes to ``$MHATTN_CACHE_DIR/tables``
(default ``~/.cache/mhattn/tables``) unless ``--output`` says otherwise; the next process that makes an
automatic choice on this device reads it, and ``mhattn.explain`` shows the times behind a choice.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from mhattn.tuning import grid, table

# Timing per do_bench call (ms of warm-up, ms of timed runs): quick keeps the whole run to minutes.
QUICK_TIMING = (5.0, 20.0)
FULL_TIMING = (10.0, 50.0)


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"the quick grid ({len(grid.quick_grid())} shapes)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible, else cpu")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="time only these backends (repeat or comma-separate); default: every backend of "
                             "automatic selection's order on the device")
    parser.add_argument("--max-n", type=int, default=0, metavar="N", help="leave out shapes with Nq or Nk > N")
    parser.add_argument("--warmup-ms", type=float, default=None, help="warm-up per timing (default 5 quick, 10 full)")
    parser.add_argument("--rep-ms", type=float, default=None, help="timed runs per timing (default 20 quick, 50 full)")
    parser.add_argument("--output", metavar="FILE", help="where to write the table (default: the cache directory)")
    parser.add_argument("--time-limit", type=float, default=0.0, metavar="S", help="start no shape after S seconds")
    parser.add_argument("--task-timeout", type=float, default=300.0, metavar="S",
                        help="a shape running longer is stopped and reported (default 300)")
    parser.add_argument("--no-isolate", action="store_true", help="run the shapes in this process")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--passes", type=int, default=1, metavar="N",
                        help="time the grid N times and keep each host loop's smallest time (a busy host only adds to "
                             "a host loop; GPU times and graph replays from the first pass: table.merged)")
    parser.add_argument("--head-dim", metavar="D[,D...]", type=_head_dims,
                        help="time the grid's training shapes at these head dims instead (those of a model that the "
                             "grid lacks, such as 96 or 192) and add them to the table this device uses (the cache "
                             "directory's, else the shipped one), written to --output or the cache directory")
    parser.add_argument("--merge", nargs="+", metavar="TABLE",
                        help="time nothing: write the merge of these tables of one device (each host loop's smallest "
                             "time, GPU times and graph replays from the first table: table.merged) to --output")


def run(args) -> int:
    if args.merge:
        return merge(args.merge, args.output)
    return tune(quick=args.quick, device=args.device, backends=_names(args.backend), max_n=args.max_n,
                warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, output=args.output, time_limit=args.time_limit,
                task_timeout=args.task_timeout, isolate=not args.no_isolate, progress=not args.no_progress,
                passes=args.passes, head_dims=args.head_dim)


def _head_dims(text: str) -> tuple:
    """--head-dim's value as a tuple of positive ints (argparse reports the error, naming the option)."""
    try:
        dims = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive head dims separated by commas, got {text!r}")
    return dims


def _names(values):
    if not values:
        return None
    return [n.strip().lower() for v in values for n in v.split(",") if n.strip()]


def tune(*, quick=True, device=None, backends=None, max_n=0, warmup_ms=None, rep_ms=None, output=None,
         time_limit=0.0, task_timeout=300.0, isolate=True, progress=True, stream=None, passes=1,
         head_dims=None) -> int:
    """Time the grid, write the table, print a summary. Returns the exit status (0 = a table was written).
    ``passes`` > 1: the grid is timed that many times, one pass after another, and the table keeps each host loop's
    smallest time and the first pass's GPU times (table.merged; the time limit counts from the start of the first
    pass). ``head_dims``: the grid's training shapes at these head dims instead (grid.head_dim_cells), and the table
    written is the one this device uses now (table.active_table) with them added (table.with_cells), so a model's
    head dims join the shapes already measured."""
    from mhattn.progress import Progress
    from mhattn.benchmark.supervisor import run_tasks
    from mhattn.tuning.measure import backends_to_time

    stream = stream or sys.stdout
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    default_warmup, default_rep = QUICK_TIMING if quick else FULL_TIMING
    settings = {"warmup_ms": warmup_ms or default_warmup, "rep_ms": rep_ms or default_rep}
    device_type = torch.device(device).type
    shapes = grid.head_dim_cells(device_type, quick, head_dims) if head_dims else grid.cells_for(device_type, quick)
    cells = grid.limit(shapes, max_n)
    names = backends or backends_to_time(device)
    tasks = [{"kind": "tune", "cell": c.as_dict(), "timing": settings, "backends": names, "label": c.label()}
             for c in cells]
    print(f"mhattn tune{' --quick' if quick else ''}: {len(cells)} shapes x {', '.join(names)} on {device}, "
          f"warm-up {settings['warmup_ms']:g} ms, runs {settings['rep_ms']:g} ms per timing", file=stream, flush=True)
    started = time.time()
    if torch.device(device).type == "cuda" and "cupy" in names and not _unavailable("cupy"):
        _compile_cupy_kernels(stream, {c.head_dim for c in cells}, cupy_defines_left_out(cells))
    bar = Progress(len(tasks) * max(1, passes), enabled=progress, title="tune")
    runs = []
    try:
        for _ in range(max(1, passes)):
            outcome = run_tasks(tasks, device=device, isolate=isolate, progress=bar, task_timeout=task_timeout,
                                deadline=started + time_limit if time_limit else None)
            runs.append(outcome)
            if outcome.interrupted or outcome.deadline_reached:
                break
    finally:
        bar.close()
    tables = [table.TimingTable({}, [_table_row(r) for r in run.results]) for run in runs]
    rows = table.merged(tables).cells if len(tables) > 1 else tables[0].cells
    measured = [r for r in rows if r["fwd_ms"] or r["fwd_bwd_ms"]]
    wall = time.time() - started
    print(summary(rows), file=stream)
    for note in (note for run in runs for note in run.notes):
        print(f"note: {note}", file=stream)
    if not measured:
        print("no shape was timed: no table written", file=stream)
        return 1
    key = table.environment_key(device)
    command = "mhattn tune" + (" --quick" if quick else "") + (
        f" --head-dim {','.join(map(str, head_dims))}" if head_dims else "")
    made = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "unix_time": time.time(), "timing": dict(settings, timer=_timer(device)), "wall_s": round(wall, 1),
            "backends": names, "passes": len(runs),
            "complete": not any(run.interrupted or run.deadline_reached for run in runs)}
    result = table.TimingTable(key, rows, made)
    base = table.active_table(device_type, torch.device(device).index) if head_dims else None
    if base is not None and base.matches(table.device_identity_of(key)):
        result = table.with_cells(base, result)
        print(f"added {len(rows)} shapes to the table {base.path} ({len(base.cells)} shapes)", file=stream)
    path = result.save(output or table.cache_tables_dir() / table.table_file_name(key))
    table.clear_cache()
    print(f"wrote {path} ({len(measured)}/{len(rows)} shapes timed, {wall:.0f} s)", file=stream)
    return 0


def merge(paths, output, stream=None) -> int:
    """``mhattn tune --merge``: table.merged of the tables at ``paths``, written to ``output``."""
    stream = stream or sys.stdout
    if not output:
        print("mhattn tune --merge needs --output FILE", file=stream)
        return 2
    result = table.merged([table.TimingTable.load(p) for p in paths])
    result.save(output)
    table.clear_cache()
    print(f"wrote {output}: {len(result.cells)} cells from {len(paths)} tables (each host loop's smallest time, "
          "the first table's GPU times)", file=stream)
    return 0


def _unavailable(name) -> list:
    from mhattn import registry

    return registry.get_backend(name).unavailable()


def cupy_defines_left_out(cells) -> tuple:
    """The (define, value) pairs of the CuPy kernel variants that none of ``cells`` launches: a cell (grid.Cell) has
    no softcap, dropout, window or deterministic backward and runs plain attention (no packed sequences, no paged
    cache; a one-row decoding step does run the contiguous cache's kernels), and head dims that are multiples of 8
    with the value's head dim equal take no ANY_DIMS variant (ops.feature_flags). A cell that did launch one would
    compile it when it runs: slower, not wrong. (tests/test_tuning.py records every variant the quick grid's
    cells launch on sm_90 and checks that none is left out.)"""
    left_out = [("SOFTCAP", 1), ("DETERMINISTIC", 1), ("VARLEN", 1), ("KV_CACHE", 2)]
    if all(cell.head_dim % 8 == 0 for cell in cells):
        left_out.append(("ANY_DIMS", 1))
    if not any(cell.mask == "float" for cell in cells):
        left_out.append(("FLOAT_MASK", 1))
    return tuple(left_out)


def _compile_cupy_kernels(stream, head_dims, leave_out=()) -> None:
    """Compile the CuPy kernel variants of the timed cells' head dims for this GPU into the kernel cache, on all CPU
    cores at once, the Hopper family too on sm_90 (the cells' own kernels there): the timed cells would otherwise
    compile the ones they use one after another. Variants of other head dims (half of them), and those with the
    ``leave_out`` defines (cupy_defines_left_out: features no cell uses; of the quick grid's 590 variants on sm_90
    180 remain), are left out."""
    import argparse

    try:
        from mhattn.backends.cupy import build, variants

        cc = torch.cuda.get_device_capability()
        archs = [f"sm_{cc[0]}{cc[1]}"] + (["sm_90a"] if tuple(cc) == tuple(variants.HOPPER_CC) else [])
        with contextlib.redirect_stdout(stream):
            build.run_cupy(argparse.Namespace(jobs=0, no_cache=False, list=False), archs, sorted(head_dims),
                           leave_out=leave_out)
    except Exception as error:  # the cells compile what they need, slower
        print(f"mhattn tune: compiling the CuPy kernels ahead failed ({error}); the cells will compile them", file=stream)


def _timer(device):
    from mhattn.benchmark.timing import timer_name

    return timer_name(device)


def _table_row(row: dict) -> dict:
    """A worker's row as a table cell: the Cell fields, the times and the reasons, nothing else."""
    keep = set(grid.Cell.__dataclass_fields__) | {"fwd_ms", "fwd_bwd_ms", "fwd_graph_ms", "skipped"}
    cell = {k: v for k, v in row.items() if k in keep}
    if row.get("status", "ok") != "ok" and not cell.get("skipped"):
        cell["skipped"] = {"*": row["status"]}
    return cell


def summary(rows) -> str:
    """One line per shape: each backend's forward / forward+backward milliseconds, the fastest marked."""
    lines = ["shape                                              times in ms (forward / forward+backward; * fastest)"]
    for row in rows:
        names = sorted(set(row.get("fwd_ms", {})) | set(row.get("fwd_bwd_ms", {})))
        parts = []
        for name in names:
            fwd, both = row["fwd_ms"].get(name), row["fwd_bwd_ms"].get(name)
            star_f = "*" if fwd is not None and fwd == min(row["fwd_ms"].values()) else ""
            star_b = "*" if both is not None and both == min(row["fwd_bwd_ms"].values()) else ""
            text = f"{name} {_ms(fwd)}{star_f}" + (f" / {_ms(both)}{star_b}" if row.get("grad", True) else "")
            parts.append(text)
        if not parts:
            parts = ["not timed: " + "; ".join(f"{k}: {v}" for k, v in row.get("skipped", {}).items())[:160]]
        lines.append(f"{table.cell_label(row):50s} " + ", ".join(parts))
    return "\n".join(lines)


def _ms(value):
    return "-" if value is None else f"{value:.4g}"
