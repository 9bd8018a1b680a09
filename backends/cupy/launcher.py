"""Launching a compiled variant through CuPy on PyTorch's current stream.

A launch's arguments are written once per call signature as an :class:`ArgumentTemplate`: typed values
(``(kind, value)`` pairs, see :func:`i32`, ...) with the data pointers, which change from call to call, left
open as slots (:func:`slot`). A launcher turns a template into a prepared launch once (``prepare``): the
typed values are converted to what the launch takes, and each call only splices its pointers in. The same
templates feed this launcher and the host-side emulator the tests use. CuPy only loads the module and
launches: every buffer comes from torch's allocator, so CuPy's memory pool never grows.

Per call, a prepared CuPy launch reads torch's current stream handle, checks that the tensors' device is the
current one (CuPy launches in the current device's context), and calls CuPy's kernel function with the stream
given explicitly: no context managers, no numpy scalars made, no argument converted twice.
"""

from __future__ import annotations

import functools
import operator
import threading

import numpy as np
import torch

from mhattn.backends.cupy import compiler
from mhattn.backends.streams import current_stream
from mhattn.backends.cupy.variants import Variant


# ---- typed kernel arguments ---------------------------------------------------------------------------


def ptr(tensor) -> tuple:
    """Device pointer of a tensor (None -> null)."""
    return ("ptr", 0 if tensor is None else int(tensor.data_ptr()))


def slot(index: int) -> tuple:
    """An argument filled at each call with item ``index`` of the call's pointer tuple: a data pointer, or a value
    made per call that the launcher passes as it is (a tensor map: ``CupyLauncher.struct_value``)."""
    return ("slot", int(index))


def i32(x) -> tuple:
    return ("i32", int(x))


def i64(x) -> tuple:
    return ("i64", int(x))


def u32(x) -> tuple:
    return ("u32", int(x) & 0xFFFFFFFF)


def f32(x) -> tuple:
    return ("f32", float(x))


NUMPY_TYPES = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "u32": np.uint32, "f32": np.float32}


class ArgumentTemplate:
    """A kernel's argument list with its data pointers left open.

    ``args``: ``(kind, value)`` pairs; a ``("slot", i)`` entry takes item ``i`` of each call's pointer tuple.
    :meth:`splicer` gives the per-call function that lays a call's pointers and the converted constant
    values out in argument order; :meth:`bind` gives the ``(kind, value)`` pairs of one call."""

    __slots__ = ("args", "constants", "order", "_bind")

    def __init__(self, args):
        self.args = tuple(args)
        constants = [arg for arg in self.args if arg[0] != "slot"]
        unknown = {kind for kind, _ in constants} - set(NUMPY_TYPES)
        if unknown:
            raise ValueError(f"kernel arguments: unknown kinds {sorted(unknown)}; known: {sorted(NUMPY_TYPES)}, slot")
        if any(value < 0 for kind, value in self.args if kind == "slot"):
            raise ValueError(f"kernel arguments: slots are indices into the pointer tuple, got {self.args}")
        self.constants = tuple(constants)
        # Positions in (constants + pointers): the constants come first, so a pointer tuple of the wrong length
        # fails (IndexError) instead of shifting the constants.
        order, next_constant = [], 0
        for kind, value in self.args:
            if kind == "slot":
                order.append(len(constants) + value)
            else:
                order.append(next_constant)
                next_constant += 1
        self.order = tuple(order)
        if not order:
            raise ValueError("kernel arguments: expected at least one")
        if len(order) == 1:  # itemgetter of one index gives the item, not a 1-tuple
            only = order[0]
            self._bind = lambda values: (values[only],)
        else:
            self._bind = operator.itemgetter(*order)  # the whole argument tuple in one C call

    def splicer(self, convert):
        """``splice(pointers) -> tuple`` of the launch's values in argument order: each constant is
        ``convert(kind, value)`` (once, here), each slot the call's pointer value as given."""
        constants = tuple(convert(kind, value) for kind, value in self.constants)
        pick = self._bind
        return lambda pointers: pick(constants + pointers)

    def bind(self, pointers: tuple) -> list:
        """The ``(kind, value)`` pairs of one call (for launchers that take a whole argument list)."""
        return list(self._bind(self.constants + tuple(("ptr", int(p)) for p in pointers)))


def numpy_value(kind: str, value):
    """The numpy scalar of a typed argument (CuPy launches numpy scalars with their own width)."""
    return NUMPY_TYPES[kind](value)


# ---- CuPy's launch values -------------------------------------------------------------------------------


def _cupy_value_maker():
    """A function of a numpy scalar giving the object that CuPy's kernel launch passes on as it is (a
    ``CPointer`` holding the value), or None where this CuPy has none we can make; CuPy then converts the
    numpy scalar at every launch (what it did before).

    CuPy 13 and older: ``cupy.cuda.function.CInt32`` / ``CInt64`` (what CuPy itself makes from a numpy scalar
    of that width, the scalar's bits seen as a signed integer). CuPy 14: ``cupy._core._scalar.CScalar``,
    checked here by reading its stored bytes back."""
    try:
        from cupy.cuda.function import CInt32, CInt64  # CuPy <= 13
    except Exception:
        pass
    else:
        makers = {4: (CInt32, np.int32), 8: (CInt64, np.int64)}

        def make(x):
            cls, signed = makers[x.itemsize]
            return cls(int(x.view(signed)))

        return make
    try:
        import ctypes

        from cupy._core._scalar import CScalar  # CuPy >= 14

        for probe in (np.int32(-7), np.uint32(0xFFFFFFFE), np.int64(-(1 << 40)), np.float32(-0.0), np.uint64(1 << 63)):
            if ctypes.string_at(CScalar(probe).ptr, probe.itemsize) != probe.tobytes():
                return None
        return CScalar
    except Exception:
        return None


_CUPY_VALUE = []


def cupy_value(kind: str, value):
    """A typed argument as CuPy's launch takes it with the least work per launch (see _cupy_value_maker)."""
    if not _CUPY_VALUE:
        _CUPY_VALUE.append(_cupy_value_maker())
    scalar = numpy_value(kind, value)
    make = _CUPY_VALUE[0]
    return scalar if make is None else make(scalar)


class _StreamRef:
    """What CuPy's kernel launch reads a stream from: an object with the stream handle as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, handle: int):
        self.ptr = handle


# Above this much dynamic shared memory a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize).
_DEFAULT_DYNAMIC_SMEM = 48 * 1024
# Stream references kept per launcher; beyond this they are dropped and made again (cheap).
_STREAMS_LIMIT = 256


@functools.lru_cache(maxsize=1)
def _struct_maker():
    try:
        from cupy._core._scalar import CScalar  # CuPy >= 14: holds the bytes, converted once
    except Exception:
        return lambda value: value  # older CuPy converts the structured scalar at the launch
    return CScalar


class CupyLauncher:
    """Compiles (through the disk cache), loads and launches variants; one instance per process."""

    # Kernel arguments may be tensor maps (structured numpy scalars passed by value, see tensor_maps.py).
    tensor_maps = True

    @staticmethod
    def struct_value(value):
        """A structured numpy scalar (a tensor map) as CuPy's launch takes it."""
        return _struct_maker()(value)

    def __init__(self):
        self._kernels = {}   # (variant, device index) -> cupy.RawKernel
        self._streams = {}   # raw stream handle -> _StreamRef
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

    def _device(self, index: int):
        device = self._devices.get(index)
        if device is None:
            import cupy

            device = self._devices[index] = cupy.cuda.Device(index)
        return device

    def prepare(self, variant: Variant, grid: tuple, template: ArgumentTemplate, device, cc):
        """``launch(pointers)``: runs ``variant`` (built for compute capability ``cc``) on ``grid`` (x, y, z)
        with ``template``'s arguments and the call's data pointers (Python ints) on torch's current stream of
        ``device``."""
        import cupy

        index = _device_index(device)
        raw = self.kernel(variant, index, cc)
        cupy_device = self._device(index)
        grid, block, smem = tuple(int(g) for g in grid), (variant.num_threads,), variant.smem_bytes
        splice = template.splicer(cupy_value)
        with cupy_device:
            function = raw.kernel  # CuPy's Function loaded in this device's context; it takes a stream
        get_device = cupy.cuda.runtime.getDevice
        streams = self._streams

        def launch(pointers: tuple) -> None:
            handle = current_stream(index)
            stream = streams.get(handle)
            if stream is None:
                if len(streams) >= _STREAMS_LIMIT:
                    streams.clear()
                stream = streams[handle] = _StreamRef(handle)
            args = splice(pointers)
            if get_device() == index:
                function(grid, block, args, smem, stream)
            else:  # the kernel's module lives in that device's context
                with cupy_device:
                    function(grid, block, args, smem, stream)

        return launch

    def launch(self, variant: Variant, grid: tuple, args: list, device, cc) -> None:
        """Run ``variant`` on ``grid`` with ``args`` (``(kind, value)`` pairs, pointers included) on torch's
        current stream of ``device`` (prepares the launch each time: for one-off launches)."""
        self.prepare(variant, grid, ArgumentTemplate(args), device, cc)(())


def _device_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
