"""Key padding masks as per-batch key bounds, so the kernels skip padded key blocks.

A boolean mask that is the same for every head and query row (stride 0 or size 1 along H and Nq: what a
key padding mask becomes, e.g. ``MultiheadAttention``'s ``key_padding_mask``) lets no query of batch entry b
see a key past its last True. :func:`key_bounds` computes that bound on the device (no host read-back);
the forward and backward kernels (``KEY_LENGTHS``) stop their key loops there and still apply the mask
inside, so any such mask is handled exactly and a right-padding mask skips every padded block.
"""

from __future__ import annotations

from typing import Optional

import torch


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
