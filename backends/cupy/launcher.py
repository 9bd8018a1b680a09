"""Launching a compiled variant through CuPy on PyTorch's current stream.

Kernel arguments are built once, as ``(kind, value)`` pairs (see :func:`ptr`, :func:`i32`, ...), so the
same host code can feed this launcher or the host-side emulator the tests use. CuPy only loads the
module and launches: every buffer comes from torch's allocator, so CuPy's memory pool never grows.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from mhattn.backends.cupy import compiler
from mhattn.backends.cupy.variants import Variant


# ---- typed kernel arguments ---------------------------------------------------------------------------


def ptr(tensor) -> tuple:
    """Device pointer of a tensor (None -> null)."""
    return ("ptr", 0 if tensor is None else int(tensor.data_ptr()))


def i32(x) -> tuple:
    return ("i32", int(x))


def i64(x) -> tuple:
    return ("i64", int(x))


def u32(x) -> tuple:
    return ("u32", int(x) & 0xFFFFFFFF)


def f32(x) -> tuple:
    return ("f32", float(x))


_NUMPY = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "u32": np.uint32, "f32": np.float32}

# Typed scalars of the non-pointer arguments, by (kind, value): sizes, strides and scales repeat from call to
# call, and a dict look-up costs a tenth of making a numpy scalar. Bounded (cleared when full).
_scalars: dict = {}
_SCALARS_LIMIT = 8192


def typed_values(args: list) -> tuple:
    """The numpy scalars CuPy launches with, for ``(kind, value)`` arguments."""
    values = []
    for arg in args:
        kind, value = arg
        if kind == "ptr":
            values.append(np.uint64(value))
            continue
        scalar = _scalars.get(arg)
        if scalar is None:
            if len(_scalars) >= _SCALARS_LIMIT:
                _scalars.clear()
            scalar = _scalars[arg] = _NUMPY[kind](value)
        values.append(scalar)
    return tuple(values)

# Above this much dynamic shared memory a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize).
_DEFAULT_DYNAMIC_SMEM = 48 * 1024


class CupyLauncher:
    """Compiles (through the disk cache), loads and launches variants; one instance per process."""

    def __init__(self):
        self._kernels = {}   # (variant, device index) -> cupy.RawKernel
        self._streams = {}   # (stream pointer, device index) -> cupy.cuda.ExternalStream
        self._devices = {}   # device index -> cupy.cuda.Device
        self._lock = threading.Lock()

    def kernel(self, variant: Variant, device_index: int, cc):
        key = (variant, device_index)
        kernel = self._kernels.get(key)
        if kernel is None:
            import cupy

            with self._lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    path = compiler.cubin_path(variant, cc)
                    with cupy.cuda.Device(device_index):
                        kernel = cupy.RawModule(path=str(path)).get_function(variant.function_name)
                        if variant.smem_bytes > _DEFAULT_DYNAMIC_SMEM:
                            kernel.max_dynamic_shared_size_bytes = variant.smem_bytes
                    self._kernels[key] = kernel
        return kernel

    def _stream(self, device_index: int):
        import cupy
        import torch

        handle = torch.cuda.current_stream(device_index).cuda_stream
        key = (handle, device_index)
        stream = self._streams.get(key)
        if stream is None:
            with warnings.catch_warnings():  # deprecated in CuPy 14 in favour of Stream.from_external; still works
                warnings.simplefilter("ignore")
                stream = self._streams[key] = cupy.cuda.ExternalStream(handle, device_index)
        return stream

    def launch(self, variant: Variant, grid: tuple, args: list, device, cc) -> None:
        """Run ``variant`` (built for compute capability ``cc``) on ``grid`` (x, y, z) with ``args`` on torch's
        current stream of ``device``."""
        import cupy
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self.kernel(variant, index, cc)
        values = typed_values(args)
        cupy_device = self._devices.get(index)
        if cupy_device is None:
            cupy_device = self._devices[index] = cupy.cuda.Device(index)
        with cupy_device, self._stream(index):  # CuPy launches on its current stream
            kernel(tuple(grid), (variant.num_threads,), values, shared_mem=variant.smem_bytes)
