"""``mhattn bench``: PERFORMANCE.md's protocol in one run, with tables, JSON, Markdown and PNG plots.

    mhattn bench                                  # full bf16 sweep: every mhattn backend, the SDPA peers, the reference
    mhattn bench --quick                          # bf16, d 64/128, N 1k/4k, short timing
    mhattn bench --dtype bf16,fp16 --memory --module --json bench.json --plot-dir plots
    mhattn bench --impl triton,sdpa-flash --head-dim 128 --seqlen 4k,16k --causal yes --mode fwd
    mhattn bench --from-json bench.json --summary # re-print (and re-plot) a saved run, no GPU needed
    mhattn bench --list                           # the implementations and whether each can run here
    mhattn bench --latency --impl triton,cupy,sdpa-default   # per-call GPU and host-loop time at small shapes
    mhattn bench --decode                         # decoding: triton (dense, KV cache, paged) beside SDPA
    mhattn bench --decode --batch 1,8 --seqlen 8k,128k --nq 1 --dtype bf16,fp16
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import signal
import sys
import time

from mhattn.benchmark import latency, memory, module_bench, plan, protocol, report
from mhattn.benchmark.timing import BWD_METHODS, TimingSettings, timer_name

PAPER_TIMING = (25.0, 100.0)      # do_bench defaults, as in PERFORMANCE.md
SHORT_TIMING = (10.0, 40.0)       # used when a sweep would otherwise take long (said in the output)
LONG_SWEEP_SECONDS = 240.0
QUICK = {"dtypes": ["bf16"], "head_dims": [64, 128], "seqlens": [1024, 4096], "memory_seqlens": [8192, 32768],
         "module_seqlens": [1024, 4096]}


# ---- arguments -------------------------------------------------------------------------------------------


def _int_list(text: str) -> list:
    values = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        scale = 1
        if part[-1] in "kK":
            part, scale = part[:-1], 1024
        try:
            value = int(float(part) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of integers (512, 1k, 16k), got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one size, got {text!r}")
    return values


def _dtype_list(text: str) -> list:
    names = [p for p in text.replace(" ", "").split(",") if p]
    if names in (["all"], ["both"]):  # (the two 16-bit dtypes the protocol times)
        return list(protocol.DTYPES)
    try:
        values = [protocol.canonical_dtype(n) for n in names]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
    bad = [v for v in values if v not in protocol.DTYPES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"expected dtypes among {', '.join(protocol.DTYPES)}, got {text!r}")
    return list(dict.fromkeys(values))


def _mode_list(text: str) -> list:
    aliases = {"fwd": "fwd", "forward": "fwd", "bwd": "bwd", "backward": "bwd", "fwd_bwd": "fwd_bwd",
               "fwd+bwd": "fwd_bwd", "fwdbwd": "fwd_bwd", "all": "all"}
    names = [p for p in text.replace(" ", "").split(",") if p]
    unknown = [n for n in names if n not in aliases]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected modes among fwd, bwd, fwd_bwd, got {text!r}")
    values = [aliases[n] for n in names]
    return list(protocol.MODES) if "all" in values else [m for m in protocol.MODES if m in values]


def _name_list(text: str) -> list:
    return [p for p in text.replace(" ", "").split(",") if p]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2]
    what = parser.add_argument_group("what to measure")
    what.add_argument("--quick", action="store_true",
                      help="a short subset: bf16, d 64,128, N 1k,4k, warmup 10 ms / rep 40 ms (filters still apply)")
    what.add_argument("--impl", action="extend", nargs="+", type=_name_list, default=None, metavar="NAME",
                      help="implementations (names or comma lists; default: every mhattn backend, sdpa-flash, "
                           "sdpa-cudnn, sdpa-efficient and the reference; sdpa-math on request; see --list)")
    what.add_argument("--dtype", type=_dtype_list, default=None,
                      help="bf16, fp16, a comma list or 'both' (default bf16; 'all' = 'both')")
    what.add_argument("--head-dim", type=_int_list, default=None, help="head dims (default 64,128,256)")
    what.add_argument("--seqlen", type=_int_list, default=None, help="sequence lengths (default 512,1k,2k,4k,8k,16k)")
    what.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="causal, non-causal or both")
    what.add_argument("--mode", type=_mode_list, default=None,
                      help="fwd, bwd, fwd_bwd (default all three; bwd is derived from fwd and fwd_bwd)")
    what.add_argument("--memory", action="store_true",
                      help="also the peak-memory table (fwd+bwd, causal, B=1, H=16, d=128, N=1k..32k)")
    what.add_argument("--memory-seqlen", type=_int_list, default=None, help="N of the memory table (default 1k..32k)")
    what.add_argument("--module", action="store_true",
                      help="also the module benchmark (a training step of a 12-layer encoder, torch vs mhattn)")
    what.add_argument("--module-seqlen", type=_int_list, default=None,
                      help="N of the module benchmark (default 1k..8k)")
    what.add_argument("--module-layers", type=int, default=None, help="encoder layers (default 12)")
    what.add_argument("--module-steps", type=int, default=None, help="timed training steps per cell (default 10)")
    what.add_argument("--module-tokens", type=int, default=None, help="tokens per training step (default 16384)")
    what.add_argument("--module-variant", action="extend", nargs="+", type=_name_list, default=None,
                      help="torch, mhattn (automatic backend) or mhattn:<backend> (default: torch and one per "
                           "selected mhattn backend)")
    what.add_argument("--no-sweep", action="store_true", help="skip the TFLOP/s sweep (memory and module only)")
    what.add_argument("--latency", action="store_true",
                      help="only the latency table: per-call GPU and host-loop time, forward and forward+backward, "
                           "at small shapes (B=1 H=16 N=128, ViT-B/16 batch 32, B=8 H=16 N=512 bf16 and fp32), "
                           f"beside {latency.BASELINE} (default --impl: every mhattn backend and {latency.BASELINE})")
    what.add_argument("--decode", action="store_true",
                      help="the decoding table instead (mhattn.benchmark.decode_bench): Hq=32, Hkv=8, d=128; "
                           "--seqlen is Nk (default 1k,8k,32k,128k); --impl among sdpa, sdpa-cudnn, triton, "
                           "kvcache, paged")
    what.add_argument("--batch", type=_int_list, default=None, help="--decode: batch sizes (default 1,8,64)")
    what.add_argument("--nq", type=_int_list, default=None, help="--decode: query rows per step (default 1,4)")
    what.add_argument("--block-size", type=int, default=None, help="--decode: paged cache block size (default 256)")

    how = parser.add_argument_group("how to measure")
    how.add_argument("--warmup", type=float, default=None,
                     help=f"do_bench warm-up in ms (default {PAPER_TIMING[0]:g}; {SHORT_TIMING[0]:g} for long sweeps)")
    how.add_argument("--rep", type=float, default=None,
                     help=f"do_bench repetition time in ms (default {PAPER_TIMING[1]:g}; "
                          f"{SHORT_TIMING[1]:g} for long sweeps)")
    how.add_argument("--bwd-timing", choices=sorted(BWD_METHODS), default="subtract",
                     help="subtract: bwd = (fwd+bwd) - fwd (the protocol); "
                          "direct: time autograd.grad on a retained graph")
    how.add_argument("--tokens", type=int, default=protocol.TOKENS, help="B * N of every sweep cell (default 16384)")
    how.add_argument("--reference-max-n", type=int, default=0,
                     help="largest N the naive reference is timed at (default: any that fits in memory)")
    how.add_argument("--time-limit", type=float, default=0.0,
                     help="seconds after which no new task starts; the rest is reported as not run (default: none)")
    how.add_argument("--task-timeout", type=float, default=600.0,
                     help="seconds one task may take before its worker process is killed (default 600)")
    how.add_argument("--no-isolate", action="store_true",
                     help="run in this process (by default a worker process runs the tasks, and a crash or a "
                          "broken CUDA context costs one cell, not the run)")
    how.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the CPU only to test the harness

    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="write every result to FILE (updated while it runs)")
    output.add_argument("--plot-dir", metavar="DIR", help="write PNG plots to DIR (needs matplotlib)")
    output.add_argument("--markdown", metavar="FILE", help="write a Markdown section (date, command, tables, plots)")
    output.add_argument("--summary", action="store_true", help="print only the short table, the targets, memory "
                                                               "and module tables (not every sweep table)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    output.add_argument("--from-json", metavar="FILE", help="report a saved run instead of measuring")
    output.add_argument("--list", action="store_true", help="list the implementations and exit")


# ---- from arguments to a selection ---------------------------------------------------------------------------


def _flatten(values):
    if values is None:
        return None
    flat = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    return list(dict.fromkeys(flat))


def build_selection(args, table: dict) -> plan.Selection:
    """The :class:`plan.Selection` for ``args``; raises ValueError for unknown implementation names."""
    impls = _flatten(args.impl)
    if impls:
        table.update(protocol.with_pairs(table, impls))
        unknown = [n for n in impls if n not in table]
        if unknown:
            raise ValueError(f"--impl: unknown implementation(s) {', '.join(unknown)}; known: {', '.join(table)}")
        impls = [n for n in table if n in impls]  # display order of the table
    else:
        impls = protocol.default_implementation_names(table)
    quick = QUICK if args.quick else {}
    selection = plan.Selection(impls=impls)
    selection.dtypes = args.dtype or quick.get("dtypes", ["bf16"])
    selection.head_dims = args.head_dim or quick.get("head_dims", list(protocol.HEAD_DIMS))
    selection.seqlens = args.seqlen or quick.get("seqlens", list(protocol.SEQLENS))
    selection.causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    selection.modes = args.mode or list(protocol.MODES)
    selection.sweep = not args.no_sweep
    selection.memory = bool(args.memory)
    selection.memory_seqlens = args.memory_seqlen or quick.get("memory_seqlens", list(memory.SEQLENS))
    selection.module = bool(args.module)
    selection.module_seqlens = args.module_seqlen or quick.get("module_seqlens", list(module_bench.SEQLENS))
    selection.module_variants = _flatten(args.module_variant) or []
    config = module_bench.ModuleConfig()
    overrides = {}
    if args.module_layers:
        overrides["layers"] = args.module_layers
    if args.module_steps:
        overrides["steps"] = args.module_steps
    if args.module_tokens:
        overrides["tokens"] = args.module_tokens
    selection.module_config = module_bench.ModuleConfig(**{**config.as_dict(), **overrides})
    selection.tokens = args.tokens
    selection.reference_max_n = args.reference_max_n
    selection.timing = TimingSettings(PAPER_TIMING[0], PAPER_TIMING[1], args.bwd_timing)
    return selection


def choose_timing(args, selection: plan.Selection, tasks: list):
    """(TimingSettings, a sentence saying why): the paper's 25/100 ms unless the sweep would be long or
    --quick asked for short, or --warmup/--rep were given."""
    warmup, rep = PAPER_TIMING
    why = "do_bench defaults of the protocol"
    if args.quick:
        warmup, rep = SHORT_TIMING
        why = "--quick"
    else:
        calls = plan.timed_calls(tasks)
        estimate = calls * (sum(PAPER_TIMING) + 40.0) / 1e3
        if estimate > LONG_SWEEP_SECONDS:
            warmup, rep = SHORT_TIMING
            why = (f"shortened: {calls} timed calls would take ~{estimate / 60:.0f} min at "
                   f"{PAPER_TIMING[0]:g}/{PAPER_TIMING[1]:g} ms")
    if args.warmup is not None or args.rep is not None:
        warmup = args.warmup if args.warmup is not None else warmup
        rep = args.rep if args.rep is not None else rep
        why = "--warmup/--rep"
    settings = TimingSettings(warmup, rep, selection.timing.bwd_method)
    return settings, f"warmup {warmup:g} ms, rep {rep:g} ms ({why}); {BWD_METHODS[settings.bwd_method]}"


# ---- the run ----------------------------------------------------------------------------------------------------


def _versions() -> dict:
    import torch

    import mhattn

    versions = {"mhattn": mhattn.__version__, "torch": torch.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    for name in ("triton", "cupy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            pass
    versions["python"] = platform.python_version()
    return versions


def _device_text(device) -> str:
    import torch

    if torch.device(device).type != "cuda":
        return f"CPU ({platform.processor() or platform.machine()}; harness test only)"
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return f"{props.name} (sm_{major}{minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"


# Options that say where results go or how long to wait, not what is measured: left out of the command
# shown with the results (the README's "how to reproduce").
_PLACE_OPTIONS = {"--json", "--plot-dir", "--markdown", "--time-limit", "--task-timeout"}


def _command_line(args, *, measured_only: bool = False) -> str:
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    if measured_only:
        kept, skip = [], False
        for word in argv:
            if skip:
                skip = False
                continue
            name = word.split("=", 1)[0]
            if name in _PLACE_OPTIONS or name in ("--no-progress", "--summary"):
                skip = "=" not in word and name in _PLACE_OPTIONS
                continue
            kept.append(word)
        argv = kept
    return "mhattn bench" + ("" if not argv else " " + shlex.join(argv))


def _backend_states() -> dict:
    from mhattn import registry

    states = {}
    for backend in registry.all_backends():
        reasons = backend.unavailable()
        states[backend.name] = "available" if not reasons else "unavailable: " + "; ".join(reasons)
    return states


def make_meta(args, selection, settings, timing_note, device) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command_line(args, measured_only=True),
        "full_command": _command_line(args),
        "device": _device_text(device),
        "versions": _versions(),
        "backends": _backend_states(),
        "protocol": (f"q, k, v (B, H, N, d) ~ randn, B*N = {selection.tokens}, H = {protocol.HIDDEN}/d; "
                     "FLOPs fwd 4*B*H*N^2*d (halved when causal), bwd 2.5x, fwd+bwd 3.5x"),
        "tokens": selection.tokens,
        "timing": settings.as_dict(),
        "timer": timer_name(device),
        "bwd_method_text": BWD_METHODS[settings.bwd_method],
        "timing_note": timing_note,
        "isolated": not args.no_isolate,
        "selection": {
            "impls": selection.impls, "dtypes": selection.dtypes, "head_dims": selection.head_dims,
            "seqlens": selection.seqlens, "causal": selection.causal, "modes": selection.modes,
            "memory_seqlens": selection.memory_seqlens if selection.memory else [],
            "module_seqlens": selection.module_seqlens if selection.module else [],
        },
    }


def list_implementations(table: dict) -> int:
    defaults = set(protocol.default_implementation_names(table))
    states = _backend_states()
    for name, impl in table.items():
        state = states.get(name, "") if impl.family == "mhattn" else ""
        tag = "default" if name in defaults else "on request"
        print(f"{name:<16} {impl.family:<7} {tag:<11} {impl.description}" + (f"  [{state}]" if state else ""))
    return 0


def render(document: dict, args) -> None:
    """Print the report and write the Markdown and plots asked for."""
    print(report.summary_report(document) if args.summary else report.full_report(document), end="", flush=True)
    plots = write_plots(document, args.plot_dir) if args.plot_dir else []
    if args.markdown:
        base = os.path.dirname(os.path.abspath(args.markdown))
        relative = [os.path.relpath(os.path.abspath(p), base) for p in plots]
        try:
            with open(args.markdown, "w") as f:
                f.write(report.markdown_report(document, relative))
            print(f"wrote {args.markdown}", file=sys.stderr)
        except OSError as error:
            print(f"mhattn bench: could not write --markdown {args.markdown}: {error}", file=sys.stderr)


def write_plots(document: dict, folder: str) -> list:
    from mhattn.benchmark import plots

    os.makedirs(folder, exist_ok=True)
    written = []
    jobs = [(f"attention_{dtype}.png", plots.plot_sweep, {"dtype": dtype})
            for dtype in dict.fromkeys(report.short_dtype(r["dtype"]) for r in document.get("rows", []))]
    if document.get("memory") or document.get("module"):
        jobs.append(("memory_module.png", plots.plot_memory_module, {}))
    for name, function, kwargs in jobs:
        path = os.path.join(folder, name)
        try:
            written.append(function(document, path, **kwargs))
        except plots.PlotUnavailable as error:
            print(f"plots skipped: {error}", file=sys.stderr)
            return written
        except Exception as error:  # a plot must not cost the tables
            print(f"plot {name} failed: {type(error).__name__}: {error}", file=sys.stderr)
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)
    return written


def run_latency(args, table: dict, device) -> int:
    """``--latency``: the latency table, measured in this process (small shapes, a minute or two)."""
    impls = _flatten(args.impl) or latency.default_impls(table)
    table = protocol.with_pairs(table, impls)
    unknown = [n for n in impls if n not in table]
    if unknown:
        print(f"mhattn bench: --impl: unknown implementation(s) {', '.join(unknown)}; known: {', '.join(table)}",
              file=sys.stderr)
        return 2
    timer = timer_name(device)
    print(f"mhattn bench --latency on {_device_text(device)}; {len(latency.plan_cells(impls))} cells", file=sys.stderr,
          flush=True)
    warmup = args.warmup if args.warmup is not None else latency.WARMUP_MS
    rep = args.rep if args.rep is not None else latency.REP_MS

    def progress(row):
        if not args.no_progress:
            value = "-" if row["host_us"] is None else f"{row['host_us']:.1f} us host loop"
            print(f"  {row['impl']:<14} {row['mode']:<8} {latency.LatencyShape(**row['shape']).label}: {value}",
                  file=sys.stderr, flush=True)

    rows = latency.run(impls, table, device, progress=progress, warmup_ms=warmup, rep_ms=rep)
    text = latency.format_table(rows, timer)
    if args.json:
        document = {"meta": {"command": _command_line(args, measured_only=True), "device": _device_text(device),
                             "versions": _versions(), "timer": timer, "backends": _backend_states()},
                    "latency": rows}
        try:
            report.write_json(args.json, document)
            print(f"wrote {args.json}", file=sys.stderr)
        except OSError as error:
            print(f"mhattn bench: could not write --json {args.json}: {error}", file=sys.stderr)
    print(text, end="", flush=True)
    return 0 if all(r["status"] != "error" for r in rows) else 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    import torch

    if args.from_json:
        try:
            document = report.read_json(args.from_json)
        except (OSError, ValueError) as error:
            print(f"mhattn bench: --from-json: {error}", file=sys.stderr)
            return 2
        render(document, args)
        return 0
    if args.decode:
        from mhattn.benchmark import decode_bench

        return decode_bench.run(args)
    table = protocol.implementations()
    if args.list:
        return list_implementations(table)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("mhattn bench needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False). "
              "--list and --from-json FILE work without one.", file=sys.stderr)
        return 2
    if args.latency:
        return run_latency(args, table, device)
    try:
        selection = build_selection(args, table)
    except ValueError as error:
        print(f"mhattn bench: {error}", file=sys.stderr)
        return 2
    for path in (args.json, args.markdown):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tasks = plan.plan_tasks(selection, table)
    settings, timing_note = choose_timing(args, selection, tasks)
    selection.timing = settings
    for task in tasks:
        if task["kind"] == "attn":
            task["timing"] = settings.as_dict()
    if not tasks:
        print("mhattn bench: nothing to measure with these filters", file=sys.stderr)
        return 2

    meta = make_meta(args, selection, settings, timing_note, device)
    print(report.header_text(meta), file=sys.stderr)
    print(f"{len(tasks)} tasks ({plan.timed_calls(tasks)} timed calls), "
          f"{'a worker process' if not args.no_isolate else 'in this process'}", file=sys.stderr, flush=True)

    from mhattn.progress import Progress
    from mhattn.benchmark.supervisor import run_tasks

    progress = Progress(len(tasks), enabled=not args.no_progress, title="bench")
    saved = {"at": 0.0}
    results_so_far = [None] * len(tasks)

    def on_result(index, row):
        results_so_far[index] = row
        if args.json and time.monotonic() - saved["at"] > 5.0:
            done = [r for r in results_so_far if r is not None]
            report.write_json(args.json, report.make_document({**meta, "partial": True}, done))
            saved["at"] = time.monotonic()

    deadline = time.time() + args.time_limit if args.time_limit else None
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        outcome = run_tasks(tasks, device=str(device), isolate=not args.no_isolate, deadline=deadline,
                            task_timeout=args.task_timeout, progress=progress, on_result=on_result)
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
    meta["elapsed_s"] = round(time.monotonic() - progress.started, 1)
    meta["notes"] = outcome.notes
    if outcome.interrupted:
        meta["notes"].append("interrupted: the rows not run are marked so")
    if outcome.deadline_reached:
        meta["notes"].append(f"the time limit ({args.time_limit:g} s) stopped the run early")
    document = report.make_document(meta, outcome.results)
    if args.json:
        try:
            report.write_json(args.json, document)
            print(f"wrote {args.json}", file=sys.stderr)
        except OSError as error:
            print(f"mhattn bench: could not write --json {args.json}: {error}", file=sys.stderr)
    for note in meta["notes"]:
        print(f"note: {note}", file=sys.stderr)
    render(document, args)
    return 130 if outcome.interrupted else 0
