"""Problem: the description of one attention call that the dispatcher decides on.

It holds what a backend's capabilities are checked against (device, compute capability, dtype, sizes,
features used) and nothing else, so it is hashable and decisions can be cached per problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mhattn.backends.base import AttentionParams


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
        features = set()
        if causal:
            features.add("causal")
        if window:
            features.add("window")
        if q.shape[1] != k.shape[1]:
            features.add("gqa")
        if params.mask is not None:
            features.add("bool_mask" if params.mask.dtype == torch.bool else "float_mask")
            if params.mask_requires_grad:
                features.add("mask_grad")
        if params.dropout_p > 0.0:
            features.add("dropout")
        if params.softcap is not None:
            features.add("softcap")
        if v.shape[-1] != q.shape[-1]:
            features.add("value_dim")
        batch, seqlen_q, seqlen_k = sizes if sizes is not None else (q.shape[0], q.shape[2], k.shape[2])
        return cls(
            device_type=q.device.type,
            device_index=q.device.index,
            compute_capability=_compute_capability(q.device),
            dtype=q.dtype,
            batch=batch,
            heads_q=q.shape[1],
            heads_kv=k.shape[1],
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            head_dim=q.shape[-1],
            head_dim_v=v.shape[-1],
            features=frozenset(features),
            operation=operation,
        )

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


def _compute_capability(device: torch.device):
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _CC_CACHE.get(index)
    if cc is None:
        cc = _CC_CACHE[index] = tuple(torch.cuda.get_device_capability(index))
    return cc
