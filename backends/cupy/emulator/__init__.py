"""A launcher that runs the CUDA kernels on the CPU through a host-side emulator of their PTX layer.

For tests and development on machines without a GPU: each variant is compiled with the host C++
compiler against ``emulator.h`` (fibers for threads, per-lane semantics of ldmatrix / mma.sync / shfl,
cp.async copies that land at the wait) and run on torch CPU tensors. It checks the kernels' logic (index
arithmetic, masking, pipelining, fragment layouts as the PTX ISA defines them), not their speed, and
not the hardware's own rounding inside mma. Slow: keep problems to a few hundred rows.

    backend = CupyBackend(launcher=EmulatorLauncher(), compute_capability=(9, 0))
    out, lse = backend.forward(q_cpu_bf16, k, v, params)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from mhattn.backends.cupy import compiler
from mhattn.backends.cupy.launcher import ArgumentTemplate
from mhattn.backends.cupy.variants import Variant

HERE = Path(__file__).resolve().parent
_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32,
           "f32": ctypes.c_float}


def host_compiler():
    """Path of a C++17 compiler (``$CXX``, g++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class EmulatorLauncher:
    def __init__(self, cache_dir=None, optimize="-O1"):
        self.cache_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), "mhattn-emulator"))
        self.optimize = optimize
        self._libs = {}
        self._lock = threading.Lock()

    def library(self, variant: Variant):
        lib = self._libs.get(variant)
        if lib is not None:
            return lib
        cxx = host_compiler()
        if cxx is None:
            raise RuntimeError("the kernel emulator needs a host C++ compiler (g++ or clang++)")
        source = (
            '#include "emulator.h"\n'
            + compiler.kernel_source(variant.source_file)
            + '\n#include "entry.h"\n'
        )
        defines = [f"-D{k}={v}" for k, v in variant.defines] + [f"-DEMU_KERNEL={variant.function_name}"]
        digest = hashlib.sha256()
        for part in (source, (HERE / "emulator.h").read_text(), (HERE / "entry.h").read_text(), " ".join(defines),
                     self.optimize):
            digest.update(part.encode())
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        so_path = self.cache_dir / f"{variant.kernel}-{digest.hexdigest()[:24]}.so"
        with self._lock:
            if not so_path.exists():
                with tempfile.TemporaryDirectory() as tmp:
                    cpp = Path(tmp) / "kernel.cpp"
                    cpp.write_text(source)
                    out = Path(tmp) / "kernel.so"
                    cmd = [cxx, "-std=c++17", self.optimize, "-fPIC", "-shared", "-w", f"-I{HERE}", *defines,
                           str(cpp), "-o", str(out)]
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    if run.returncode != 0:
                        raise RuntimeError(f"emulator build of {variant.label} failed:\n{run.stderr[-6000:]}")
                    shutil.move(str(out), so_path)
            lib = ctypes.CDLL(str(so_path))
            lib.emu_launch.restype = ctypes.c_int
            lib.emu_launch.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
            self._libs[variant] = lib
        return lib

    def prepare(self, variant: Variant, grid: tuple, template: ArgumentTemplate, device, cc):
        """``launch(pointers)`` for ``template``'s arguments with each call's data pointers (as CupyLauncher's)."""
        if device.type != "cpu":
            raise ValueError(f"the emulator runs on CPU tensors, got device {device}")
        lib = self.library(variant)
        splice = template.splicer(lambda kind, value: _CTYPES[kind](value))
        grid = tuple(int(g) for g in grid)

        def launch(pointers: tuple) -> None:
            values = splice(tuple(map(ctypes.c_uint64, pointers)))
            argv = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
            err = ctypes.create_string_buffer(1024)
            rc = lib.emu_launch(grid[0], grid[1], grid[2], variant.num_threads, variant.smem_bytes, argv, err,
                                len(err))
            if rc != 0:
                raise RuntimeError(f"emulated {variant.label} on grid {grid}: {err.value.decode()}")

        return launch

    def launch(self, variant: Variant, grid: tuple, args: list, device, cc) -> None:
        self.prepare(variant, grid, ArgumentTemplate(args), device, cc)(())
