"""Tensor maps (``CUtensorMap``) for the Hopper kernels' TMA loads, encoded by the CUDA driver on the host.

The encoding goes through ``cuTensorMapEncodeTiled`` of the driver library itself (``libcuda``, loaded with
ctypes): the driver is present wherever a GPU is, so this adds no dependency (``cuda-python`` would add one for a
single call, and CuPy exposes no binding of it). A map describes a (B, H, N, D) view as a 4-D tensor over
(column, row, head, batch), innermost first, read in boxes of 64 columns x ``box_rows`` rows into the 128-byte
swizzled shared-memory layout the kernels' wgmma read; rows past a head's end read as zeros.

A map holds the tensor's address. :class:`RowMaps` encodes one per call signature and, per call, only writes the
new address into a copy of it: the position of the address in the map is found once per process by encoding the
same map at two addresses (:func:`address_field`); where the driver's encoding does not keep the address as one
plain 64-bit word, every call encodes its maps in full (correct, about 1 us more a map). The kernel argument made for
an address is kept (the last ADDRESSES_KEPT per layout): a loop's tensors come back at the same addresses from torch's
caching allocator, and making the argument again (a copy, the address written, CuPy's scalar) took 1.7 us a map on
the CPU against 0.07 us to find it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import numpy as np
import torch

from mhattn.caches import put_bounded

MAP_BYTES = 128
ADDRESSES_KEPT = 64  # kernel arguments kept per RowMaps, by address (the oldest goes)
BOX_COLUMNS = 64  # 128 bytes of 16-bit elements: the widest box the 128-byte swizzle takes

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill, CUtensorMapInterleave
_DATA_TYPES = {torch.float16: 6, torch.bfloat16: 9}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0
_INTERLEAVE_NONE = 0


class TensorMapError(RuntimeError):
    """The driver refused to encode a map (names the shape, strides and the driver's error code)."""


@functools.lru_cache(maxsize=1)
def _encode_function():
    """``cuTensorMapEncodeTiled`` from the driver library, with its argument types."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            library = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise TensorMapError("the CUDA driver library (libcuda) cannot be loaded: tensor maps need a CUDA driver")
    encode = library.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode


def _map_dtype():
    """The numpy type of a map as a kernel argument: 128 bytes, 64-byte aligned (CuPy passes a structured scalar
    of it by value)."""
    import cupy

    return cupy.make_aligned_dtype(np.dtype([("words", np.uint64, (MAP_BYTES // 8,))]), alignment=64)


class _Encoder:
    """The fixed arguments of one map (shape, strides, box), ready for ctypes: each encode passes an address."""

    def __init__(self, shape, strides, element_size: int, dtype, box_rows: int):
        batch, heads, rows, columns = shape
        self.description = f"shape {tuple(shape)}, strides {tuple(strides)}, box {BOX_COLUMNS} x {box_rows}"
        self.dims = (ctypes.c_uint64 * 4)(columns, rows, heads, batch)
        # byte strides of dims 1..3 (row, head, batch); a dim of extent 1 gets any legal stride
        byte_strides = [strides[2] * element_size, strides[1] * element_size, strides[0] * element_size]
        for i, extent in enumerate((rows, heads, batch)):
            if extent == 1:
                byte_strides[i] = max(16, byte_strides[i] if byte_strides[i] % 16 == 0 else 16)
        self.strides = (ctypes.c_uint64 * 3)(*byte_strides)
        self.box = (ctypes.c_uint32 * 4)(BOX_COLUMNS, box_rows, 1, 1)
        self.unit = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        self.data_type = _DATA_TYPES[dtype]

    def encode_into(self, buffer, address: int) -> None:
        code = _encode_function()(ctypes.addressof(buffer), self.data_type, 4, ctypes.c_void_p(address), self.dims,
                                  self.strides, self.box, self.unit, _INTERLEAVE_NONE, _SWIZZLE_128B,
                                  _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
        if code != 0:
            raise TensorMapError(f"cuTensorMapEncodeTiled failed with CUresult {code} ({self.description}, "
                                 f"address {address:#x})")


def why_not_mappable(t: torch.Tensor) -> Optional[str]:
    """Why a (B, H, N, D) tensor cannot be read through a map as it is (None: it can): contiguous rows, 16-byte
    aligned start and strides, no broadcast (zero-stride) dims, D a multiple of 64."""
    if t.dtype not in _DATA_TYPES:
        return f"dtype {t.dtype}"
    if t.shape[-1] % BOX_COLUMNS:
        return f"head dim {t.shape[-1]} (whole {BOX_COLUMNS}-column chunks)"
    if t.stride(-1) != 1:
        return "rows that are not contiguous"
    if t.data_ptr() % 16:
        return "a start that is not 16-byte aligned"
    for extent, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if extent > 1 and (stride == 0 or (stride * t.element_size()) % 16):
            return f"strides {t.stride()} (batch, head and row strides must be non-zero multiples of 16 bytes)"
    return None


@functools.lru_cache(maxsize=1)
def address_field() -> Optional[int]:
    """The byte offset of the 64-bit word holding the tensor's address in an encoded map, found by encoding one
    map at two addresses; None when the maps differ anywhere else (then every call encodes in full)."""
    encoder = _Encoder((1, 1, 64, 64), (4096, 4096, 64, 1), 2, torch.bfloat16, 64)
    first, second = (ctypes.create_string_buffer(MAP_BYTES) for _ in range(2))
    a, b = 0x7F0000000000, 0x7F0012345600
    encoder.encode_into(first, a)
    encoder.encode_into(second, b)
    words_a = np.frombuffer(first.raw, dtype=np.uint64)
    words_b = np.frombuffer(second.raw, dtype=np.uint64)
    differ = np.flatnonzero(words_a != words_b)
    if len(differ) == 1 and int(words_a[differ[0]]) == a and int(words_b[differ[0]]) == b:
        return int(differ[0]) * 8
    return None


class RowMaps:
    """The map of one tensor layout (shape, strides, dtype, box) at any address: ``maps(address)`` gives the kernel
    argument (a structured numpy scalar, or what ``wrap`` makes of it)."""

    def __init__(self, t: torch.Tensor, box_rows: int, wrap=None):
        self._encoder = _Encoder(tuple(t.shape), tuple(t.stride()), t.element_size(), t.dtype, box_rows)
        self._dtype = _map_dtype()
        self._wrap = wrap or (lambda x: x)
        self._buffer = ctypes.create_string_buffer(MAP_BYTES)
        self._field = address_field()
        self._template = None
        self._made = {}  # address -> the kernel argument made for it
        if self._field is not None:
            self._encoder.encode_into(self._buffer, t.data_ptr())
            self._template = np.frombuffer(self._buffer.raw, dtype=self._dtype).copy()

    def __call__(self, address: int):
        made = self._made.get(address)
        if made is None:
            made = put_bounded(self._made, address, self._make(address), ADDRESSES_KEPT)
        return made

    def _make(self, address: int):
        if self._template is not None:
            value = self._template.copy()
            value.view(np.uint64)[self._field // 8] = address
            return self._wrap(value[0])
        self._encoder.encode_into(self._buffer, address)
        return self._wrap(np.frombuffer(self._buffer.raw, dtype=self._dtype)[0])
