"""NaN-poisoned memory for the tensors a backend allocates, so an element it never writes shows up.

Backends allocate their own outputs, so the suite cannot hand them NaN-filled buffers. Two ways around it:

- :func:`poisoned_allocations` swaps torch's ``empty`` family (``torch.empty``, ``empty_like``,
  ``empty_strided``, ``Tensor.new_empty``) for versions that fill floating-point results with NaN, for
  the duration of a backend call. This catches Python-level allocations on every device.
- :func:`prefill_cuda_cache` allocates NaN-filled blocks of the sizes the backend is about to allocate
  and frees them, so the CUDA caching allocator hands that memory back to allocations made from C++.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.Lock()


def _poison(result):
    if isinstance(result, torch.Tensor) and result.is_floating_point() and result.numel():
        with torch.no_grad():
            result.fill_(float("nan"))
    return result


def _wrap(fn):
    def poisoned(*args, **kwargs):
        return _poison(fn(*args, **kwargs))

    poisoned.__wrapped__ = fn
    return poisoned


@contextlib.contextmanager
def poisoned_allocations():
    """Inside the block, torch.empty & co. return NaN-filled floating-point tensors."""
    with _lock:
        saved = {
            (torch, "empty"): torch.empty,
            (torch, "empty_like"): torch.empty_like,
            (torch, "empty_strided"): torch.empty_strided,
            (torch.Tensor, "new_empty"): torch.Tensor.new_empty,
        }
        try:
            for (owner, name), fn in saved.items():
                setattr(owner, name, _wrap(fn))
            yield
        finally:
            for (owner, name), fn in saved.items():
                setattr(owner, name, fn)


def prefill_cuda_cache(shapes_and_dtypes, device) -> None:
    """Allocate NaN-filled tensors of these (shape, dtype) pairs on ``device`` and free them again.

    The caching allocator keeps the freed blocks and gives them to the next allocations of the same
    sizes, which are the backend's outputs. A no-op off CUDA.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    blocks = []
    for shape, dtype in shapes_and_dtypes:
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.is_floating_point():
            t.fill_(float("nan"))
        blocks.append(t)
    torch.cuda.synchronize(device)
    del blocks
