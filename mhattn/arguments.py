"""Argument checks shared by the packed and cached entry points (mhattn.decode, mhattn.varlen).

Each raises :class:`mhattn.InputError` naming the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from mhattn.errors import InputError


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, dims: int, what: str) -> None:
    """t is a floating-point tensor with ``dims`` dims; ``what`` names them, e.g. "(B, Hq, Nq, D)"."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.dim() != dims:
        raise InputError(f"{name} must have {dims} dims {what}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got dtype {dtype_name(t.dtype)}")


def check_same(names, tensors) -> None:
    """One dtype and one device for all of ``tensors``."""
    first = tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first.dtype:
            raise InputError(f"{name} must have the dtype of {names[0]} ({dtype_name(first.dtype)}), "
                             f"got {dtype_name(t.dtype)}")
        if t.device != first.device:
            raise InputError(f"{name} must be on the device of {names[0]} ({first.device}), got {t.device}")


def check_index_tensor(name: str, t, dims: int, what: str, device) -> None:
    """An int32 index tensor (cu_seqlens, cache_seqlens, block_table) with ``dims`` dims on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be an int32 torch.Tensor {what}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InputError(f"{name} must be int32 {what}, got dtype {dtype_name(t.dtype)}")
    if t.dim() != dims:
        raise InputError(f"{name} must have {dims} dim{'s' if dims > 1 else ''} {what}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} must be on the device of q ({device}), got {t.device}")


def check_heads(heads_q: int, heads_kv: int, enable_gqa: bool = True) -> None:
    if heads_q == heads_kv:
        return
    if not enable_gqa:
        raise InputError(f"q has {heads_q} heads but k/v have {heads_kv}: pass enable_gqa=True for grouped-query "
                         "attention")
    if heads_kv == 0 or heads_q % heads_kv:
        raise InputError(f"q's heads ({heads_q}) must be a multiple of k/v's heads ({heads_kv})")


def scale_or_default(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def check_softcap(softcap):
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (0 < softcap < math.inf):
        raise InputError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return float(softcap)


def host_checks_allowed(t: torch.Tensor) -> bool:
    """Whether value checks that read tensors back to the host may run: not while a CUDA graph is being
    captured or torch.compile traces (there the caller vouches for the values)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


# Index tensors whose values were read back and found valid: id -> (weak references, version counters,
# what they were checked against). A decoding step calls attention once per layer with the same
# cache_seqlens / block_table (a training step, varlen with the same cu_seqlens): reading them back
# once, not once per layer, spares a host synchronisation per call.
_checked: dict = {}
_CHECKED_LIMIT = 256


def check_values_once(tensors, context, check) -> None:
    """Run ``check()`` unless these very tensors (alive, unchanged since: torch's version counter) already
    passed it against the same ``context`` (the sizes the values were checked against)."""
    key = tuple(map(id, tensors))
    versions = tuple(map(_VERSION, tensors))
    entry = _checked.get(key)
    if entry is not None and entry[1] == versions and entry[2] == context:
        for ref, tensor in zip(entry[0], tensors):
            if ref() is not tensor:  # another tensor at a freed one's address
                break
        else:
            return
    check()
    if len(_checked) >= _CHECKED_LIMIT:
        _checked.clear()
    _checked[key] = (tuple(map(weakref.ref, tensors)), versions, context)


_VERSION = operator.attrgetter("_version")
