"""Key padding masks as per-batch key bounds, so the kernels skip padded key blocks.

A boolean mask that is the same for every head and query row (stride 0 or size 1 along H and Nq: what a
key padding mask becomes, e.g. ``MultiheadAttention``'s ``key_padding_mask``) lets no query of batch entry b
see a key past its last True. :func:`key_bounds` computes that bound on the device (no host read-back);
the FlashAttention-2 forward and backward kernels (``KEY_LENGTHS``) stop their key loops there and still apply the
mask inside, so any such mask is handled exactly and a right-padding mask skips every padded block.

The Gluon Hopper kernels read no mask: they take a right-padding mask (True exactly on a prefix of each batch entry's
keys) as those bounds alone, and a left-padding one (True exactly on one run of keys: a batch of prompts padded on
the left, or on both sides) as each entry's first key and bound. :func:`padding_kind` says which a
mask is, read back from the GPU once per mask (not once per layer that uses it).
"""

from __future__ import annotations

from typing import Optional

import torch

from mhattn.arguments import host_checks_allowed
from mhattn.backends.streams import current_stream
from mhattn.caches import kept_for, put_bounded


def shared_by_heads_and_rows(mask: torch.Tensor) -> bool:
    """True for a (B, H, Nq, Nk) mask that does not vary along H and Nq."""
    return all(mask.shape[i] == 1 or mask.stride(i) == 0 for i in (1, 2))


def applies(mask: Optional[torch.Tensor]) -> bool:
    """Whether ``mask`` (None or (B, H, Nq, Nk)) has key bounds: a bool mask with keys, shared by heads and
    query rows (a function of its dtype, shape and strides)."""
    return mask is not None and mask.dtype == torch.bool and mask.shape[3] > 0 and shared_by_heads_and_rows(mask)


def key_bounds(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B,) int32: one past the last key each batch entry's queries may see (0: none), for a mask that
    :func:`applies`; None for any other mask (or none). Made once per stream while the mask is unchanged
    (_kept_on_stream: the model's layers that share one padding mask, a call's forward and backward, repeated calls
    with it), except during CUDA graph capture or torch.compile tracing, where the bounds are made in the captured work
    from what the mask holds at each replay. Callers only read the tensor."""
    if not applies(mask):
        return None
    keys = mask[:, 0, 0, :]
    if not host_checks_allowed(keys):
        return _bounds_of(keys)
    return _kept_on_stream(_key_bounds, keys, _bounds_of)


def _bounds_of(keys: torch.Tensor) -> torch.Tensor:
    """key_bounds of a mask's (B, Nk) keys, made on the device (no read-back)."""
    positions = torch.arange(1, keys.shape[1] + 1, dtype=torch.int32, device=keys.device)
    return torch.where(keys, positions, 0).amax(dim=1).to(torch.int32)


# What padding_kind says of a mask: True on a prefix of each batch entry's keys; on one run of them that starts past
# the first key for some entry; neither (holes, or no answer during graph capture).
RIGHT_PADDING = "right"
SPAN = "span"
OTHER = "other"


def padding_kind(mask: torch.Tensor, bounds: torch.Tensor) -> tuple:
    """(kind, spans) of ``mask`` (one that :func:`applies`) and its ``bounds`` (:func:`key_bounds`): RIGHT_PADDING
    where it is True exactly on keys [0, bounds[b]) of each batch entry b, so that ``bounds`` says all it says; SPAN
    where it is True exactly on keys [starts[b], bounds[b]) and some start is past 0 (left padding, or padding on both
    sides), with spans the (2B,) int32 tensor of bounds and then starts (an entry with no key has start 0); else
    OTHER. spans is None but for SPAN.

    Answered by a read-back from the GPU (one synchronisation) the first time a mask comes on a stream, then kept
    while the mask is unchanged: the same storage, layout and version (an in-place change bumps it), so the model's
    layers that share one padding mask read it back once (_kept_on_stream). A kept entry holds its mask, so its memory cannot be taken by another tensor at
    the same address while the entry lives. OTHER for an empty batch, and during CUDA graph capture (or torch.compile
    tracing: arguments.host_checks_allowed) even for a mask answered before: a captured call replays with whatever the
    mask holds at each replay, so only kernels that read the mask may be captured."""
    keys = mask[:, 0, 0, :]
    if keys.numel() == 0 or not host_checks_allowed(keys):
        return OTHER, None
    return _kept_on_stream(_padding_kinds, keys, lambda keys: _read_padding_kind(keys, bounds))


def kernel_bounds(mask: torch.Tensor) -> tuple:
    """(kind, bounds) of a mask that :func:`applies`: its padding_kind and what the Gluon kernels read for it, its
    key_bounds or, for SPAN, its spans (both kept per mask and stream)."""
    bounds = key_bounds(mask)
    kind, spans = padding_kind(mask, bounds)
    return kind, bounds if spans is None else spans


def _read_padding_kind(keys: torch.Tensor, bounds: torch.Tensor) -> tuple:
    """padding_kind of the (B, Nk) keys of a mask (bool or its uint8 view), by one read-back."""
    seqlen_k = keys.shape[1]
    positions = torch.arange(seqlen_k, dtype=torch.int32, device=keys.device)
    # Each entry's first kept key (none kept: the bound, 0, so that the span is empty).
    starts = torch.minimum(torch.where(keys.bool(), positions, seqlen_k).amin(dim=1).to(torch.int32), bounds)
    one_run = (keys.sum(dim=1, dtype=torch.int32) == bounds - starts).all()
    from_first = (starts == 0).all()
    one_run, from_first = torch.stack((one_run, from_first)).tolist()
    if not one_run:
        return OTHER, None
    if from_first:
        return RIGHT_PADDING, None
    return SPAN, torch.cat((bounds, starts))


def _kept_on_stream(cache: dict, keys: torch.Tensor, make):
    """kept_for of ``keys`` in ``cache``'s part for the current stream of keys' GPU (0 for CPU tensors): the tensors
    kept (the bounds, the spans) are made by work queued on the stream that then reads them, so a kernel on another
    stream never reads one before that work has run; another stream makes its own."""
    stream = _stream_of(keys)
    per_stream = cache.get(stream)
    if per_stream is None:
        per_stream = put_bounded(cache, stream, {}, STREAMS_LIMIT)
    return kept_for(per_stream, keys, make, PADDING_KINDS_LIMIT)


def _stream_of(keys: torch.Tensor) -> int:
    """The raw handle of the current stream of keys' GPU; 0 for CPU tensors."""
    return current_stream(keys.device.index) if keys.is_cuda else 0


# key_bounds' and padding_kind's answers by stream (_kept_on_stream), then by mask (each entry holds its mask): a few
# masks are live at a time (one per model's padding, per micro-batch in flight), on a stream or a few.
_key_bounds: dict = {}
_padding_kinds: dict = {}
PADDING_KINDS_LIMIT = 16
STREAMS_LIMIT = 8
