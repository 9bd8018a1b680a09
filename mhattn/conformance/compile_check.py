"""The CUDA backend's compile check for machines without a GPU: NVRTC compiles the kernel sources.

It goes through the ``mhattn build`` subcommand (``mhattn.backends.cupy.build``: ``add_arguments`` and
``run``) with its default arguments, so it checks exactly what ``mhattn build`` checks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import time

from mhattn.conformance.report import ExtraCheck

BUILD_MODULE = "mhattn.backends.cupy.build"
NAME = "cupy: NVRTC compile of the CUDA sources (compile only, nothing run)"


def nvrtc_compile_check() -> ExtraCheck:
    try:
        build = importlib.import_module(BUILD_MODULE)
    except ModuleNotFoundError as error:
        if error.name in (BUILD_MODULE, "mhattn.backends.cupy"):
            return ExtraCheck(NAME, "not available", f"{BUILD_MODULE} is not part of this build")
        return ExtraCheck(NAME, "not available", f"cannot import {BUILD_MODULE}: {error}")
    except Exception as error:
        return ExtraCheck(NAME, "fail", f"importing {BUILD_MODULE} raised {type(error).__name__}: {error}")
    if not (callable(getattr(build, "add_arguments", None)) and callable(getattr(build, "run", None))):
        return ExtraCheck(NAME, "not available", f"{BUILD_MODULE} has no add_arguments/run")
    parser = argparse.ArgumentParser(prog="mhattn build")
    build.add_arguments(parser)
    args = parser.parse_args([])
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
    last = lines[-1] if lines else ""
    if status in (0, None):
        return ExtraCheck(NAME, "pass", f"{last} [{seconds:.0f} s]".strip())
    return ExtraCheck(NAME, "fail", f"`mhattn build` exited with {status}: " + " | ".join(lines[-5:]))
