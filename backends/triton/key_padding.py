"""Key padding masks as per-batch key bounds, so the kernels skip padded key blocks.

A boolean mask that is the same for every head and query row (stride 0 or size 1 along H and Nq: what a
key padding mask becomes, e.g. ``MultiheadAttention``'s ``key_padding_mask``) lets no query of batch entry b
see a key past its last True. :func:`key_bounds` computes that bound on the device (no host read-back);
the FlashAttention-2 forward and backward kernels (``KEY_LENGTHS``) stop their key loops there and still apply the
mask inside, so any such mask is handled exactly and a right-padding mask skips every padded block.

The Gluon Hopper kernels read no mask: they take a right-padding mask (True exactly on a prefix of each batch entry's
keys) as those bounds alone. :func:`is_right_padding` says whether a mask is one, read back from the GPU once per
mask (not once per layer that uses it).
"""

from __future__ import annotations

from typing import Optional

import torch

from mhattn.arguments import host_checks_allowed
from mhattn.caches import kept_for


def shared_by_heads_and_rows(mask: torch.Tensor) -> bool:
    """True for a (B, H, Nq, Nk) mask that does not vary along H and Nq."""
    return all(mask.shape[i] == 1 or mask.stride(i) == 0 for i in (1, 2))


def applies(mask: Optional[torch.Tensor]) -> bool:
    """Whether ``mask`` (None or (B, H, Nq, Nk)) has key bounds: a bool mask with keys, shared by heads and
    query rows (a function of its dtype, shape and strides)."""
    return mask is not None and mask.dtype == torch.bool and mask.shape[3] > 0 and shared_by_heads_and_rows(mask)


def key_bounds(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B,) int32: one past the last key each batch entry's queries may see (0: none), for a mask that
    :func:`applies`; None for any other mask (or none)."""
    if not applies(mask):
        return None
    keys = mask[:, 0, 0, :]
    positions = torch.arange(1, keys.shape[1] + 1, dtype=torch.int32, device=keys.device)
    return torch.where(keys, positions, 0).amax(dim=1).to(torch.int32)


def is_right_padding(mask: torch.Tensor, bounds: torch.Tensor) -> bool:
    """Whether ``mask`` (one that :func:`applies`) is True exactly on keys [0, bounds[b]) of each batch entry b, so
    that ``bounds`` (:func:`key_bounds`) says all it says. Answered by a read-back from the GPU (one synchronisation)
    the first time a mask comes, then kept while the mask is unchanged: the same storage, layout and version (an
    in-place change bumps it), so the model's layers that share one padding mask read it back once. A kept entry holds
    its mask, so its memory cannot be taken by another tensor at the same address while the entry lives. False for an
    empty batch, and during CUDA graph capture (or torch.compile tracing: arguments.host_checks_allowed) even for a
    mask answered before: a captured call replays with whatever the mask holds at each replay, so only kernels that
    read the mask may be captured."""
    keys = mask[:, 0, 0, :]
    if keys.numel() == 0 or not host_checks_allowed(keys):
        return False
    return kept_for(_right_padding, keys, lambda keys: bool((keys.sum(dim=1, dtype=torch.int32) == bounds).all()),
                    RIGHT_PADDING_LIMIT)


# is_right_padding's answers by mask (each entry holds its mask); a few masks are live at a time (one per model's
# padding, per micro-batch in flight).
_right_padding: dict = {}
RIGHT_PADDING_LIMIT = 16
