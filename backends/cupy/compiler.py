"""NVRTC compilation of the kernel variants, with an on-disk cache of the cubins.

The kernels include no CUDA header, so NVRTC alone (the pip wheel ``nvidia-cuda-nvrtc-cu12`` or the
one CuPy finds for cupy-cuda13x) compiles them: no toolkit and no GPU are needed, which is what
``mhattn build`` relies on. A cubin is cached under a key made of the expanded source, the options and
the NVRTC version, in ``$MHATTN_CACHE_DIR`` (default ``~/.cache/mhattn/cupy-kernels``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from pathlib import Path

from mhattn.backends.cupy.variants import Variant

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


class KernelCompileError(RuntimeError):
    """NVRTC rejected a variant; the message names the variant, the architecture and NVRTC's log."""


def expand_source(filename: str, _seen=None) -> str:
    """The kernel file with its local ``#include "..."`` files inlined (each once), as NVRTC gets it."""
    seen = set() if _seen is None else _seen
    lines = []
    for line in (KERNEL_DIR / filename).read_text().splitlines():
        match = _INCLUDE.match(line)
        if match:
            name = match.group(1)
            if name not in seen:
                seen.add(name)
                lines.append(expand_source(name, seen))
            continue
        if line.strip() == "#pragma once":
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def kernel_source(filename: str) -> str:
    """The expanded source of a kernel file (read once per process)."""
    return expand_source(filename)


def arch_name(cc) -> str:
    return "sm_%d%d" % tuple(cc)


def target_name(variant: Variant, cc) -> str:
    """The compile target of a variant: the compute capability's, with the variant's architecture features
    ("sm_90a" for the Hopper family)."""
    return arch_name(cc) + variant.arch_features


def nvrtc_options(variant: Variant, cc, ptx_only: bool = False) -> tuple:
    target = target_name(variant, cc)
    if ptx_only:
        target = target.replace("sm_", "compute_")
    return ("-std=c++17", f"--gpu-architecture={target}") + tuple(
        f"-D{name}={value}" for name, value in variant.defines
    )


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


def compile_cubin(variant: Variant, cc, ptx_only: bool = False, ptxas_log: list = None) -> bytes:
    """Compile one variant for compute capability ``cc`` with NVRTC; raises KernelCompileError.

    ``ptx_only`` stops after NVRTC's code generator and returns PTX (about 3x faster: every C++ and
    code-generation error shows, but the inline PTX is only assembled when a cubin is built). ``ptxas_log``: a list
    that gets the compilation's log with ptxas's report (registers, spills, its performance notes)."""
    nvrtc = _nvrtc()
    source = kernel_source(variant.source_file)
    options = nvrtc_options(variant, cc, ptx_only) + (("--ptxas-options=-v",) if ptxas_log is not None else ())
    program = nvrtc.createProgram(source, variant.source_file, (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(
                f"NVRTC {'.'.join(map(str, nvrtc_version()))} failed to compile {variant.label} for "
                f"{target_name(variant, cc)} ({error}):\n{log}"
            ) from None
        if ptxas_log is not None:
            ptxas_log.append(nvrtc.getProgramLog(program))
        if ptx_only:
            ptx = nvrtc.getPTX(program)
            return ptx if isinstance(ptx, bytes) else ptx.encode()
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


def cache_dir() -> Path:
    root = os.environ.get("MHATTN_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mhattn" / "cupy-kernels"


def cache_key(variant: Variant, cc) -> str:
    digest = hashlib.sha256()
    digest.update(kernel_source(variant.source_file).encode())
    digest.update("\0".join(nvrtc_options(variant, cc)).encode())
    digest.update(repr(nvrtc_version()).encode())
    return f"{variant.kernel}-{target_name(variant, cc)}-{digest.hexdigest()[:24]}"


def cubin_path(variant: Variant, cc) -> Path:
    """Path of the cached cubin of ``variant`` for ``cc``, compiling it first if it is not cached."""
    path = cache_dir() / f"{cache_key(variant, cc)}.cubin"
    if path.exists():
        return path
    cubin = compile_cubin(variant, cc)
    path.parent.mkdir(parents=True, exist_ok=True)
    # write then rename: concurrent processes never see a half-written cubin
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return path
