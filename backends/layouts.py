"""The memory layouts every built-in backend writes, and that the ``torch.compile`` fake implementations
promise, so compiled and eager calls return the same strides with no copy.

- out (B, H, N, Dv): (B, N, H, Dv) memory, one token's heads side by side, as a packed projection lays
  them out (reshaping the result to (B, N, H * Dv) after a transpose is a view).
- lse (B, H, N): contiguous.
- dq, dk, dv: the input's own layout when it is dense (``torch.empty_like`` keeps it), else the row-major
  heads layout of out (for views of a packed QKV projection, whose gradient buffers are not dense).

And the scratch that a forward whose lse nobody reads may write it into (scratch_rows).
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch


def empty_rows_major(batch: int, heads: int, seqlen: int, dim: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """(B, H, N, D) with (B, N, H, D) memory, on like's device, in ``dtype`` (default like's)."""
    shape, strides = rows_major_layout(batch, heads, seqlen, dim)
    return torch.empty_strided(shape, strides, dtype=dtype or like.dtype, device=like.device)


def rows_major_layout(batch: int, heads: int, seqlen: int, dim: int) -> tuple:
    """(shape, strides) of :func:`empty_rows_major`: the strides torch.empty(batch, seqlen, heads, dim)
    .transpose(1, 2) has (an empty dim counts as 1), for one empty_strided call (callers may keep them)."""
    head_stride = max(dim, 1)
    row_stride = head_stride * max(heads, 1)
    return (batch, heads, seqlen, dim), (row_stride * max(seqlen, 1), head_stride, row_stride, 1)


def output_buffer(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention output of q (B, H, Nq, D) and v (B, Hkv, Nk, Dv): (B, H, Nq, Dv) in q's dtype."""
    return empty_rows_major(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of ``dtype``: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_buffer(q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp of q (B, H, Nq, D): (B, H, Nq), float32 (float64 for float64 inputs), contiguous."""
    return torch.empty(q.shape[:3], dtype=lse_dtype(q.dtype), device=q.device)


def grad_buffer(t: torch.Tensor, dense: Optional[bool] = None) -> torch.Tensor:
    """A gradient buffer for the 4-D tensor t: t's layout when t is dense, else row-major heads. ``dense``:
    :func:`is_dense` (t) when the caller has it already (a plan of t's strides)."""
    if is_dense(t) if dense is None else dense:
        return torch.empty_like(t)  # preserve_format keeps a dense tensor's strides
    b, h, n, d = t.shape
    return empty_rows_major(b, h, n, d, t)


def is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill a block of memory exactly (no gaps, no overlaps), in any dim order."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def rows_major_strides(batch: int, heads: int, seqlen: int, dim: int) -> tuple:
    """The strides of :func:`empty_rows_major` (B, H, N, D)."""
    return (seqlen * heads * dim, dim, heads * dim, 1)


def contiguous_strides(shape, order=None) -> tuple:
    """Dense strides for ``shape``, its dims laid out outermost first in ``order`` (default: their own order)."""
    strides, step = [0] * len(shape), 1
    for i in reversed(range(len(shape)) if order is None else order):
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def strides_in_order_of(template: torch.Tensor, shape) -> tuple:
    """Dense strides for ``shape`` whose dims are laid out in the order of template's strides (largest first, ties
    in dim order): what torch's cuDNN attention gives its output, which follows the query's layout."""
    return contiguous_strides(shape, sorted(range(template.dim()), key=lambda i: (-template.stride(i), i)))


def grad_strides(t: torch.Tensor) -> tuple:
    """The strides of :func:`grad_buffer` (t)."""
    return tuple(t.stride()) if is_dense(t) else rows_major_strides(*t.shape)


def placed(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """t itself when it has ``strides`` (or is empty), else a copy with them."""
    if t.numel() == 0 or tuple(t.stride()) == tuple(strides):
        return t
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(t)


# Device -> the float32 buffers that forwards whose lse nobody reads write it into (see scratch_rows). Never freed:
# a launch captured in a CUDA graph keeps writing into its buffer at every replay, whatever became of its plan.
_scratch_buffers: dict = {}
_scratch_lock = threading.Lock()


def scratch_rows(device, shape) -> torch.Tensor:
    """A contiguous float32 (B, Hq, Nq) view that a forward may write its lse into when nothing reads it (calls that
    return no lse and that autograd does not track): one allocation fewer per call. Views of one device share the
    largest buffer made for it so far (a larger shape makes a buffer twice the size, and the older ones stay):
    concurrent forwards may overwrite each other's values there, which nothing reads."""
    numel = math.prod(shape)
    key = (device.type, device.index)
    # Ordinary tensors even when the first call runs under torch.inference_mode: an inference tensor could not be
    # written in place by a later call outside it.
    with _scratch_lock, torch.inference_mode(False):
        buffers = _scratch_buffers.setdefault(key, [])
        if not buffers or buffers[-1].numel() < numel:
            size = max(numel, 2 * buffers[-1].numel()) if buffers else numel
            buffers.append(torch.empty(size, dtype=torch.float32, device=device))
        return buffers[-1][:numel].view(shape)
