"""``mhattn build``: compile every CUDA kernel variant with NVRTC, no GPU needed.

    mhattn build --arch sm_80,sm_90 [--jobs N] [--no-cache] [--list]
    mhattn build --arch sm_90a            # both backends' Hopper kernels (TMA, wgmma) for sm_90a

Each variant that a GPU of the given architecture may launch is compiled to a cubin; by default the
cubins go to the kernel cache (``$MHATTN_CACHE_DIR``, else ``~/.cache/mhattn/cupy-kernels``) so a
container image built this way starts without compiling. ``sm_90a`` names the Hopper-specific target:
for it the command compiles the CUDA backend's Hopper family (kernels/hopper_*.cu, variants.hopper_variants)
with NVRTC and the Triton backend's Hopper kernels through Triton's compiler (backends/triton/ahead.py).
Exits 1 and names every variant that failed (with the compiler's log) when any does: CI uses it as the
check that the sources compile.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def add_arguments(parser) -> None:
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help="comma-separated GPU architectures (sm_80, sm_86, sm_89, sm_90, ...); default sm_80,sm_90")
    parser.add_argument("--jobs", "-j", type=int, default=0, help="parallel compiler processes (default: all CPUs)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile only (do not read or write the kernel cache)")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")


def _compile_one(task):
    """Runs in a worker process: (variant, cc, use_cache) -> (label, arch, seconds, error or None)."""
    variant, cc, use_cache = task
    from mhattn.backends.cupy import compiler

    start = time.perf_counter()
    try:
        if use_cache:
            compiler.cubin_path(variant, cc)
        else:
            compiler.compile_cubin(variant, cc)
        error = None
    except Exception as exc:  # one failing variant must not hide the others
        error = f"{type(exc).__name__}: {exc}"
    return variant.label, compiler.target_name(variant, cc), time.perf_counter() - start, error


def tasks_for(archs, use_cache=True, head_dims=None, leave_out=()) -> list:
    """(variant, cc, use_cache) for every variant a GPU of each of ``archs`` may launch; ``head_dims``: only the
    variants that run those head dims (their buckets, variants.head_dim_bucket) and those without one (the split-KV
    combine); ``leave_out``: (define, value) pairs, a variant with any of them is left out (a feature the caller's
    problems never use, e.g. ``("SOFTCAP", 1)``)."""
    from mhattn.backends.cupy import variants

    tasks = []
    for arch in archs:
        cc, features = variants.parse_target(arch)
        if features:
            if (cc, features) != (variants.HOPPER_CC, "a"):
                raise ValueError(f"arch: the only architecture-specific target with kernels is sm_90a, got {arch!r}")
            tasks.extend((variant, cc, use_cache) for variant in variants.hopper_variants())
        else:
            tasks.extend((variant, cc, use_cache) for variant in variants.all_variants(cc))
    if head_dims is not None:
        buckets = {None} | {variants.head_dim_bucket(d) for d in head_dims}
        tasks = [task for task in tasks if dict(task[0].defines).get("HEAD_DIM") in buckets]
    if leave_out:
        unwanted = set(leave_out)
        tasks = [task for task in tasks if not unwanted.intersection(task[0].defines)]
    return tasks


def run_triton(arch: str, jobs: int) -> int:
    """Compile the Triton backend's kernels of the configuration table for ``arch`` (sm_90a: its Hopper
    entries). Returns the number of failures."""
    try:
        from mhattn.backends.triton import ahead

        tasks = ahead.table_tasks(arch)
    except ImportError as error:
        print(f"mhattn build: Triton kernels skipped for {arch}: {error}", file=sys.stderr)
        return 0
    cc = ahead.ARCHS[arch]
    print(f"mhattn build: {len(tasks)} Triton kernels for {arch}, {jobs} jobs")
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(tasks)))) as pool:
        results = list(pool.map(ahead.compile_task, [(task, cc) for task in tasks]))
    failures = [(label, error) for label, error in results if error]
    for label, error in failures:
        print(f"  FAILED {arch} triton {label}\n    {error}", file=sys.stderr)
    print(f"mhattn build: {len(tasks) - len(failures)} of {len(tasks)} Triton kernels compiled for {arch} "
          f"({time.perf_counter() - start:.0f} s)")
    return len(failures)


def run(args) -> int:
    archs = [a for a in (s.strip() for s in args.arch.split(",")) if a]
    failed = 0
    if "sm_90a" in archs and not args.list:
        failed = run_triton("sm_90a", args.jobs or os.cpu_count() or 1)
    code = run_cupy(args, archs)
    return 1 if failed else code


def run_cupy(args, archs, head_dims=None, leave_out=()) -> int:
    try:
        tasks = tasks_for(archs, use_cache=not args.no_cache, head_dims=head_dims, leave_out=leave_out)
    except ValueError as error:
        print(f"mhattn build: {error}", file=sys.stderr)
        return 2
    if args.list:
        from mhattn.backends.cupy.compiler import target_name

        for variant, cc, _ in tasks:
            print(f"{target_name(variant, cc)}  {variant.label}  smem={variant.smem_bytes}")
        return 0
    try:
        from mhattn.backends.cupy import compiler

        version = ".".join(map(str, compiler.nvrtc_version()))
    except Exception as error:
        print(f"mhattn build: NVRTC cannot be loaded ({type(error).__name__}: {error}); install "
              "cupy-cuda12x with nvidia-cuda-nvrtc-cu12, or cupy-cuda13x", file=sys.stderr)
        return 2
    jobs = args.jobs or os.cpu_count() or 1
    where = "no cache" if args.no_cache else f"cache {compiler.cache_dir()}"
    print(f"mhattn build: {len(tasks)} variants for {', '.join(archs)} with NVRTC {version}, {jobs} jobs, {where}")
    start = time.perf_counter()
    failures = []
    if jobs == 1:
        results = map(_compile_one, tasks)
    else:
        pool = ProcessPoolExecutor(max_workers=jobs)
        results = pool.map(_compile_one, tasks, chunksize=1)
    for label, arch, seconds, error in results:
        if error:
            failures.append((arch, label, error))
            print(f"  FAILED {arch} {label}", flush=True)
    if jobs != 1:
        pool.shutdown()
    elapsed = time.perf_counter() - start
    if failures:
        print(f"mhattn build: {len(failures)} of {len(tasks)} variants failed to compile ({elapsed:.0f} s):",
              file=sys.stderr)
        for arch, label, error in failures:
            print(f"--- {arch} {label}\n{error}", file=sys.stderr)
        return 1
    print(f"mhattn build: all {len(tasks)} variants compiled ({elapsed:.0f} s)")
    return 0
