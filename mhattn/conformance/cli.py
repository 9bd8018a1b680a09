"""``mhattn conformance``: which backends compute attention correctly on this machine, for which features.

    mhattn conformance [--backend NAME ...] [--quick | --full] [--dtype ...] [--jobs N|auto]
                       [--report FILE.md|FILE.json ...]
    mhattn conformance --backend NAME --case SPEC        # one case again, with every check printed

Exit status: 0 when nothing failed (unsupported and unavailable are not failures), 1 when a case or
the compile check failed, 2 for a usage error or when nothing at all could be run, 3 when nothing
failed but --time-limit left cases out.

``--jobs N`` runs the cases in N worker processes at once (see mhattn.conformance.pool); ``--jobs 1`` runs
them one at a time: in one worker process per backend on a GPU, in this process on the CPU.

Long runs (``--full`` on a GPU) can be split, by ``--backend`` or ``--dtype``, each with
``--report PART.json``, and joined with ``mhattn conformance --merge PART.json ... --report ALL.md``.

Without a GPU the run uses CPU tensors: the reference, the Triton kernels under Triton's interpreter
(``TRITON_INTERPRET=1`` is set here, before the Triton backend is imported, unless already set) on
small shapes, and the CUDA sources compiled by NVRTC without running them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time


def add_arguments(parser) -> None:
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend to check (repeat or comma-separate; default: every registered backend)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a few cases per feature (the default; minutes)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every head dim, (Nq, Nk) pair and feature variant (sampled; see mhattn.conformance.cases)")
    parser.set_defaults(mode="quick")
    parser.add_argument("--dtype", action="append", metavar="DTYPE",
                        help="fp16, bf16, fp32, fp64 (repeat or comma-separate; default: fp16 and bf16 on a GPU "
                             "(+ fp32 with --full), fp16 and fp32 on the CPU)")
    parser.add_argument("--feature", action="append", metavar="NAME",
                        help="only these table columns (repeat or comma-separate), e.g. causal,dropout")
    parser.add_argument("--report", action="append", metavar="FILE",
                        help="also write the report: FILE.md (Markdown) or FILE.json (repeat for both)")
    parser.add_argument("--case", metavar="SPEC",
                        help="run one case (the spec a failure prints) on the one --backend, and show every check")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible, else cpu")
    parser.add_argument("--list", action="store_true", help="print the cases (as reproduce commands) and exit")
    parser.add_argument("--compile-check", dest="compile_check", action="store_true", default=None,
                        help="also run the NVRTC compile check of the CUDA sources (default: only without a GPU)")
    parser.add_argument("--no-compile-check", dest="compile_check", action="store_false")
    parser.add_argument("--jobs", default="auto", metavar="N",
                        help="run the cases in N worker processes at once (default auto: on a GPU min(8, half "
                             "the CPU cores); on the CPU 1 with two cores or fewer, else min(4, half the cores)); "
                             "1: one case at a time, in one worker per backend on a GPU, in this process on the CPU")
    parser.add_argument("--in-process", action="store_true",
                        help="run every case in this process, one at a time, whatever --jobs says (default on a "
                             "GPU: worker processes, so a kernel that breaks the CUDA context fails only its own "
                             "case)")
    parser.add_argument("--case-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="a worker silent this long fails its case (default 600)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="start no case after this many seconds; the rest are reported as not run (exit 3 "
                             "when nothing failed)")
    parser.add_argument("--merge", nargs="+", metavar="FILE.json",
                        help="run nothing: one table from the JSON reports of several runs (with --report to write it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--tune", action="store_true",
                        help="then run `mhattn tune` (--quick with --quick) on the backends that failed no case, "
                             "writing the timing table automatic selection uses")


def _jobs(text: str, device: str) -> int:
    """The number of workers ``--jobs`` asks for on ``device``; ValueError names what was expected."""
    from mhattn.conformance.pool import auto_jobs

    if text.strip().lower() == "auto":
        return auto_jobs(device)
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ValueError(f"--jobs: expected a positive integer or 'auto', got {text!r}")
    return jobs


def _split(values) -> list:
    out = []
    for value in values or []:
        out += [v.strip() for v in value.split(",") if v.strip()]
    return out


# Runs `mhattn.cli.main` in a child process with the parent's import path.
_RESTART_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from mhattn.cli import main; sys.exit(main(sys.argv[2:]))"
)


def _interpreter_switch(selected_names) -> str:
    """How to get Triton's interpreter on a machine without a GPU: "" (not needed or already on), "set"
    (set TRITON_INTERPRET=1 here: nothing Triton-side is imported yet) or "restart" (run again in a
    child process with it set).

    Triton decides interpreter or compiler when a function is decorated, its own standard library's
    included, and ``import mhattn`` already imports ``triton.language`` through torch's compiler stack;
    so once that happened, only a fresh process can switch.
    """
    if os.environ.get("TRITON_INTERPRET", ""):
        return ""
    if "triton" not in selected_names or importlib.util.find_spec("triton") is None:
        return ""
    imported = [name for name in sys.modules if name == "triton.language" or name.startswith("mhattn.backends.triton")]
    return "restart" if imported else "set"


def _argv(args) -> list:
    """The command line of ``args`` again (for the restarted child)."""
    argv = ["conformance", f"--{args.mode}"]
    for flag, values in (("--backend", args.backend), ("--dtype", args.dtype), ("--feature", args.feature),
                         ("--report", args.report)):
        for value in values or []:
            argv += [flag, value]
    for flag, value in (("--case", args.case), ("--device", args.device), ("--jobs", args.jobs)):
        if value:
            argv += [flag, value]
    if args.compile_check is not None:
        argv.append("--compile-check" if args.compile_check else "--no-compile-check")
    for flag, on in (("--list", args.list), ("--in-process", args.in_process), ("--no-progress", args.no_progress),
                     ("--tune", args.tune)):
        if on:
            argv.append(flag)
    argv += ["--case-timeout", str(args.case_timeout)]
    if args.time_limit is not None:
        argv += ["--time-limit", str(args.time_limit)]
    return argv


def _restart_with_interpreter(args) -> int:
    env = dict(os.environ, TRITON_INTERPRET="1")
    sys.stdout.flush()
    sys.stderr.flush()
    command = [sys.executable, "-c", _RESTART_BOOT, json.dumps(sys.path)] + _argv(args)
    return subprocess.call(command, env=env)


def _what_ran(plan, device: str) -> list:
    notes = []
    counts = {}
    for case in plan.cases:
        counts[case.backend] = counts.get(case.backend, 0) + 1
    if device == "cpu":
        import torch

        gpu = "no CUDA GPU visible" if not torch.cuda.is_available() else "--device cpu"
        notes.append(f"{gpu}: cases run on CPU tensors with small shapes (Nq, Nk <= 64, head dim <= 64)")
    interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    for name, count in counts.items():
        how = "on the CPU" if device == "cpu" else "on the GPU"
        if name == "triton" and device == "cpu" and interpret:
            how = "under Triton's interpreter (TRITON_INTERPRET=1); bfloat16 is left to the GPU"
        notes.append(f"{name}: {count} cases {how}")
    for name, reasons in plan.unavailable.items():
        notes.append(f"{name}: no cases run ({'; '.join(reasons)})")
    return notes


def _resolve_backends(requested):
    from mhattn import registry
    from mhattn.errors import UnknownBackendError

    names = _split(requested)
    if not names:
        return registry.all_backends(), None
    backends = []
    for name in names:
        try:
            backend = registry.get_backend(name)
        except UnknownBackendError as error:
            return None, f"mhattn conformance: --backend: {error}"
        if backend not in backends:
            backends.append(backend)
    return backends, None


def _run_single(backend, spec: str, device_override, report_paths) -> int:
    from mhattn.conformance.cases import parse_spec
    from mhattn.conformance.environment import describe_environment
    from mhattn.conformance.report import Report, write_report
    from mhattn.conformance.runner import FAIL, UNSUPPORTED, run_case

    try:
        case = parse_spec(spec, backend.name)
    except (ValueError, TypeError) as error:
        print(f"mhattn conformance: --case: {error}", file=sys.stderr)
        return 2
    if device_override and device_override != case.device:
        import dataclasses

        case = dataclasses.replace(case, device=device_override)
    import torch

    if case.device == "cuda" and not torch.cuda.is_available():
        print("mhattn conformance: this case runs on CUDA (device=cuda in its spec) and no CUDA GPU is visible; "
              "add --device cpu to run it on CPU tensors", file=sys.stderr)
        return 2
    reasons = backend.unavailable()
    if reasons:
        print(f"{backend.name}: unavailable: {'; '.join(reasons)}")
        return 2
    print(f"{backend.name} {case.feature}: {case.describe()}")
    result = run_case(backend, case)
    for check in result.checks:
        print(f"  {check}")
    if result.error:
        print(f"  error: {result.error}")
    if result.status == UNSUPPORTED:
        print(f"unsupported: {'; '.join(result.reasons)}")
    else:
        print(f"{result.status.upper()} (worst ratio {result.worst_ratio:.3g}, {result.seconds:.1f} s)")
    print(f"reproduce: {case.command()}")
    if report_paths:
        report = Report("case", case.device, describe_environment(), results=[result], seconds=result.seconds,
                        jobs=1)
        for path in report_paths:
            write_report(report, path)
    return 1 if result.status == FAIL else 0


def run(args) -> int:
    if args.merge:
        return _merge(args.merge, args.report)
    import torch

    from mhattn.conformance.cases import COLUMNS, dtype_name

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("mhattn conformance: --device cuda: no CUDA GPU is visible", file=sys.stderr)
        return 2
    if args.case and len(_split(args.backend)) != 1:
        print("mhattn conformance: --case needs exactly one --backend", file=sys.stderr)
        return 2
    try:
        jobs = 1 if args.in_process else _jobs(args.jobs, device)
    except ValueError as error:
        print(f"mhattn conformance: {error}", file=sys.stderr)
        return 2
    try:
        dtypes = [dtype_name(d) for d in _split(args.dtype)] or None
    except ValueError as error:
        print(f"mhattn conformance: --{error}", file=sys.stderr)
        return 2
    features = _split(args.feature) or None
    unknown = [f for f in features or [] if f not in COLUMNS]
    if unknown:
        print(f"mhattn conformance: --feature: unknown {unknown}; known: {', '.join(COLUMNS)}", file=sys.stderr)
        return 2

    if device == "cpu" and not torch.cuda.is_available():
        from mhattn import registry

        selected = _split(args.backend) or registry.names()
        switch = _interpreter_switch([name.lower() for name in selected])
        if switch == "restart":
            return _restart_with_interpreter(args)
        if switch == "set":
            os.environ["TRITON_INTERPRET"] = "1"

    if device == "cpu":
        # CPU cases are small: one thread is fastest, and spares a loaded machine the threads' spinning
        torch.set_num_threads(1)

    from mhattn.conformance.compile_check import nvrtc_compile_check
    from mhattn.conformance.environment import describe_environment
    from mhattn.conformance.pool import run_isolated, run_parallel
    from mhattn.conformance.report import Report
    from mhattn.conformance.suite import make_plan, run_in_process
    from mhattn.progress import Progress

    backends, error = _resolve_backends(args.backend)
    if error:
        print(error, file=sys.stderr)
        return 2
    if args.case:
        return _run_single(backends[0], args.case, args.device, args.report)

    plan = make_plan(backends, args.mode, device, dtypes=dtypes, features=features)
    if args.list:
        for case in plan.cases:
            print(case.command())
        for name, reasons in plan.unavailable.items():
            print(f"# {name}: not run: {'; '.join(reasons)}")
        return 0

    jobs = min(jobs, max(1, len(plan.cases)))  # no more workers than cases
    start = time.perf_counter()
    deadline = None if args.time_limit is None else time.time() + args.time_limit
    progress = Progress(len(plan.cases), enabled=not args.no_progress, title="conformance")
    try:
        if jobs > 1:
            results = run_parallel(plan.cases, jobs, progress, case_timeout=args.case_timeout, deadline=deadline)
        elif device == "cuda" and not args.in_process:
            results = run_isolated(plan.cases, progress, case_timeout=args.case_timeout, deadline=deadline)
        else:
            results = run_in_process(plan.cases, progress, deadline=deadline)
    finally:
        progress.close()

    want_compile = args.compile_check
    if want_compile is None:
        want_compile = device == "cpu" and not torch.cuda.is_available() and any(b.name == "cupy" for b in backends)
    compile_check = nvrtc_compile_check(full=args.mode == "full") if want_compile else None
    notes = _what_ran(plan, device)

    report = Report(args.mode, device, describe_environment(), results=results, unavailable=plan.unavailable,
                    notes=notes, extra=[compile_check] if compile_check else [],
                    seconds=time.perf_counter() - start, jobs=jobs)
    status = _finish(report, args.report, ran_something=bool(results) or bool(report.extra))
    if args.tune:
        status = status or _tune_after(args, device, results)
    return status


def _tune_after(args, device, results) -> int:
    """``--tune``: time the backends that failed no case of this run (see mhattn.tuning.cli)."""
    from mhattn.conformance.runner import FAIL
    from mhattn.tuning.cli import tune
    from mhattn.tuning.measure import backends_to_time

    failed = sorted({r.case.backend for r in results if r.status == FAIL})
    names = [n for n in backends_to_time(device) if n not in failed]
    if failed:
        print(f"mhattn conformance --tune: not timing {', '.join(failed)} (failed cases above)")
    return tune(quick=args.mode == "quick", device=device, backends=names, progress=not args.no_progress)


def _finish(report, report_paths, ran_something: bool) -> int:
    """Print the report, write it where asked; the exit status (see the module docstring)."""
    from mhattn.conformance.report import render_text, write_report

    print(render_text(report))
    for path in report_paths or []:
        write_report(report, path)
        print(f"report written to {path}")
    if not report.ok:
        return 1
    if not ran_something:
        print("mhattn conformance: nothing could be run here", file=sys.stderr)
        return 2
    if report.not_run:
        return 3
    return 0


def _merge(paths, report_paths) -> int:
    """One report from the JSON reports of several runs (split by --backend or --dtype, say)."""
    from mhattn.conformance.report import merge_reports, read_json_report

    try:
        reports = [read_json_report(path) for path in paths]
    except (OSError, ValueError, KeyError) as error:
        print(f"mhattn conformance: --merge: {error}", file=sys.stderr)
        return 2
    merged = merge_reports(reports)
    return _finish(merged, report_paths, ran_something=bool(merged.results) or bool(merged.extra))
