"""Problem: the description of one attention call that the dispatcher decides on.

It holds what a backend's capabilities are checked against (device, compute capability, dtype, sizes,
features used) and nothing else, so it is hashable and decisions can be cached per problem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from mhattn.backends.base import FEATURES, AttentionParams

# Each feature as one bit, so a call's features form one int (a cheap, hashable part of a cache key).
FEATURE_BITS = {name: 1 << i for i, name in enumerate(FEATURES)}


def features_from_bits(bits: int) -> frozenset:
    return frozenset(name for name, bit in FEATURE_BITS.items() if bits & bit)


@dataclass(frozen=True)
class Problem:
    device_type: str
    device_index: Optional[int]
    compute_capability: Optional[tuple]
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    features: frozenset
    # Offset of the causal/window diagonal (Nk - Nq for bottom-right alignment, else 0): some kernels
    # align their causal mask one way only.
    diag_offset: int = 0
    # Whether q, k or v requires grad (automatic selection then weighs forward+backward time).
    needs_grad: bool = False
    # The entry point the call needs (see mhattn.backends.base.OPERATIONS). For "kvcache" /
    # "paged_kvcache" seqlen_k is the cache's capacity; for "varlen" batch is the number of sequences and
    # seqlen_q / seqlen_k the longest sequence lengths.
    operation: str = "attention"

    @classmethod
    def from_tensors(cls, q, k, v, params: AttentionParams, *, causal: bool, window: bool,
                     operation: str = "attention", sizes=None) -> "Problem":
        """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), already validated. ``sizes``: (B, Nq, Nk)
        instead of the tensors' own, for the packed and cached operations (their tensors hold the heads in
        dim 1 too: q (total_q, Hq, D) or (B, Hq, Nq, D), caches (B or num_blocks, Hkv, N, D))."""
        bits = feature_bits(q, k, v, params.mask, params.mask_requires_grad, params.dropout_p, params.softcap,
                            causal, window)
        batch, seqlen_q, seqlen_k = sizes if sizes is not None else (q.shape[0], q.shape[2], k.shape[2])
        return cls.from_shapes(q.device, q.dtype, (batch, q.shape[1], seqlen_q, q.shape[-1]), k.shape[1], seqlen_k,
                               v.shape[-1], bits, diag_offset=params.diag_offset if (causal or window) else 0,
                               needs_grad=q.requires_grad or k.requires_grad or v.requires_grad, operation=operation)

    @classmethod
    def from_shapes(cls, device: torch.device, dtype, q_shape: tuple, heads_kv: int, seqlen_k: int, head_dim_v: int,
                    bits: int, diag_offset: int = 0, needs_grad: bool = False,
                    operation: str = "attention") -> "Problem":
        """The problem of q (B, Hq, Nq, D) = q_shape against Hkv key/value heads of Nk keys, with the features
        of ``bits`` (see :func:`feature_bits`)."""
        batch, heads_q, seqlen_q, head_dim = q_shape
        return cls(
            device_type=device.type,
            device_index=device.index,
            compute_capability=device_capability(device),
            dtype=dtype,
            batch=batch,
            heads_q=heads_q,
            heads_kv=heads_kv,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            features=features_from_bits(bits),
            diag_offset=diag_offset,
            needs_grad=needs_grad,
            operation=operation,
        )

    def resized(self, batch: int, seqlen_q: int, seqlen_k: int) -> "Problem":
        """The same problem at other batch and sequence sizes; a bottom-right aligned diagonal stays aligned."""
        diag_offset = self.diag_offset
        if diag_offset != 0 and diag_offset == self.seqlen_k - self.seqlen_q:
            diag_offset = seqlen_k - seqlen_q
        return dataclasses.replace(self, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, diag_offset=diag_offset)

    @property
    def causal_hides_keys(self) -> bool:
        """Causal, and the diagonal hides some key (decoding at the end of the keys hides none)."""
        return "causal" in self.features and self.diag_offset < self.seqlen_k - 1

    def describe(self) -> str:
        cc = "" if self.compute_capability is None else " sm_%d%d" % tuple(self.compute_capability)
        feats = ", ".join(sorted(self.features)) or "none"
        operation = "" if self.operation == "attention" else f"{self.operation}: "
        return operation + (
            f"{self.device_type}{cc} {str(self.dtype).replace('torch.', '')} "
            f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Nq={self.seqlen_q} Nk={self.seqlen_k} "
            f"D={self.head_dim}" + (f" Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
            + f"; features: {feats}"
        )


_CC_CACHE: dict = {}


def device_capability(device: torch.device):
    """(major, minor) of a CUDA device, asked once per device; None for other devices."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _CC_CACHE.get(index)
    if cc is None:
        cc = _CC_CACHE[index] = tuple(torch.cuda.get_device_capability(index))
    return cc


def feature_bits(q, k, v, mask, mask_requires_grad, dropout_p, softcap, causal, window) -> int:
    """The features a call uses, as an int of FEATURE_BITS: q (B, Hq, Nq, D), k (B, Hkv, Nk, D),
    v (B, Hkv, Nk, Dv), mask None or a bool / float tensor."""
    bits = 0
    if causal:
        bits |= _CAUSAL
    if window:
        bits |= _WINDOW
    if q.shape[1] != k.shape[1]:
        bits |= _GQA
    if mask is not None:
        bits |= _BOOL_MASK if mask.dtype == torch.bool else _FLOAT_MASK
        if mask_requires_grad:
            bits |= _MASK_GRAD
    if dropout_p > 0.0:
        bits |= _DROPOUT
    if softcap is not None:
        bits |= _SOFTCAP
    if v.shape[-1] != q.shape[-1]:
        bits |= _VALUE_DIM
    return bits


(_CAUSAL, _WINDOW, _GQA, _BOOL_MASK, _FLOAT_MASK, _MASK_GRAD, _DROPOUT, _SOFTCAP, _VALUE_DIM) = (
    FEATURE_BITS[name] for name in ("causal", "window", "gqa", "bool_mask", "float_mask", "mask_grad", "dropout",
                                    "softcap", "value_dim"))
