"""The CUDA backend's compile check for machines without a GPU: NVRTC compiles the kernel sources.

``--full`` compiles every variant ``mhattn build`` compiles (through that subcommand, with ``--no-cache``
so nothing is read from or written to the kernel cache). ``--quick`` compiles a sample: for each
architecture and kernel, the first and the last variant of ``mhattn build``'s list (float16 with the
smallest head-dim bucket, bfloat16 with the largest), which takes seconds instead of minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import time

from mhattn.conformance.report import ExtraCheck

BUILD_MODULE = "mhattn.backends.cupy.build"
COMPILER_MODULE = "mhattn.backends.cupy.compiler"
ARCHS = ("sm_80", "sm_90")
NAME = "cupy: NVRTC compile of the CUDA sources for " + ", ".join(ARCHS) + " (compile only, nothing run)"


def _import(name: str):
    """(module, None) or (None, ExtraCheck saying why not)."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as error:
        if error.name in (name, "mhattn.backends.cupy"):
            return None, ExtraCheck(NAME, "not available", f"{name} is not part of this build")
        return None, ExtraCheck(NAME, "not available", f"cannot import {name}: {error}")
    except Exception as error:
        return None, ExtraCheck(NAME, "fail", f"importing {name} raised {type(error).__name__}: {error}")


def _sample(tasks) -> list:
    """First and last task per (architecture, kernel), in the original order."""
    groups = {}
    for index, task in enumerate(tasks):
        variant, cc = task[0], task[1]
        label = getattr(variant, "label", str(variant))
        key = (tuple(cc), label.split("[")[0])
        groups.setdefault(key, []).append(index)
    chosen = sorted({i for indices in groups.values() for i in (indices[0], indices[-1])})
    return [tasks[i] for i in chosen]


def _compile_sample(build) -> ExtraCheck:
    compiler, why_not = _import(COMPILER_MODULE)
    if compiler is None:
        return why_not
    try:
        tasks = build.tasks_for(list(ARCHS), use_cache=False)
        version = ".".join(map(str, compiler.nvrtc_version()))
    except ImportError as error:
        return ExtraCheck(NAME, "not available", f"NVRTC cannot be loaded: {error}")
    sample = _sample(tasks)
    failures = []
    start = time.perf_counter()
    for task in sample:
        variant, cc = task[0], task[1]
        try:
            compiler.compile_cubin(variant, cc)
        except Exception as error:  # every failing variant is named, not only the first
            failures.append(f"{compiler.arch_name(cc)} {variant.label}: {str(error).splitlines()[0]}")
    seconds = time.perf_counter() - start
    what = f"{len(sample)} of {len(tasks)} variants (a sample; --full compiles all) with NVRTC {version}"
    if failures:
        return ExtraCheck(NAME, "fail", f"{len(failures)} of {what} failed: " + " | ".join(failures[:5]))
    return ExtraCheck(NAME, "pass", f"{what} [{seconds:.0f} s]")


def _compile_all(build) -> ExtraCheck:
    parser = argparse.ArgumentParser(prog="mhattn build")
    build.add_arguments(parser)
    args = parser.parse_args(["--no-cache"] if "--no-cache" in parser.format_help() else [])
    captured = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            status = build.run(args)
    except ImportError as error:
        return ExtraCheck(NAME, "not available", f"{type(error).__name__}: {error}")
    except Exception as error:
        return ExtraCheck(NAME, "fail", f"{type(error).__name__}: {error}")
    seconds = time.perf_counter() - start
    lines = [line.strip() for line in captured.getvalue().splitlines() if line.strip()]
    if status in (0, None):
        return ExtraCheck(NAME, "pass", f"{lines[-1] if lines else 'mhattn build passed'} [{seconds:.0f} s]")
    if status == 2:
        return ExtraCheck(NAME, "not available", " | ".join(lines[-2:]))
    return ExtraCheck(NAME, "fail", f"`mhattn build --no-cache` exited with {status}: " + " | ".join(lines[-6:]))


def nvrtc_compile_check(full: bool = False) -> ExtraCheck:
    """Compile the CUDA kernel variants with NVRTC: all of them when ``full``, else a sample."""
    build, why_not = _import(BUILD_MODULE)
    if build is None:
        return why_not
    if full or not callable(getattr(build, "tasks_for", None)):
        if not (callable(getattr(build, "add_arguments", None)) and callable(getattr(build, "run", None))):
            return ExtraCheck(NAME, "not available", f"{BUILD_MODULE} has no add_arguments/run")
        return _compile_all(build)
    return _compile_sample(build)
