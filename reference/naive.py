"""Naive attention: materialises S = Q K^T * scale and P = softmax(S), O(N^2) memory.

This is the gold standard every kernel is checked against and the path for CPUs, for dtypes no
kernel takes, and for ``need_weights``. It computes in the dtype of its inputs (upcast them for a
float64 gold) and is differentiable through torch's autograd, the mask included.
"""

from __future__ import annotations

from typing import Optional

import torch

from mhattn.backends.base import AttentionParams


def visible(seqlen_q: int, seqlen_k: int, params: AttentionParams, device=None) -> Optional[torch.Tensor]:
    """Bool (Nq, Nk): key j visible to query i under the causal/window bounds; None when unbounded."""
    if params.window_left is None and params.window_right is None:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    rel = j - i - params.diag_offset
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if params.window_left is not None:
        ok &= rel >= -params.window_left
    if params.window_right is not None:
        ok &= rel <= params.window_right
    return ok


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionParams,
    *,
    mask: Optional[torch.Tensor] = None,
    keep: Optional[torch.Tensor] = None,
    return_probs: bool = False,
):
    """Attention by definition.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); Hq a multiple of Hkv (query head h uses
    key/value head h // (Hq // Hkv)). ``mask`` overrides ``params.mask`` (so a caller can pass an upcast
    or grad-tracking copy); bool = attend where True, float = added to the scores. ``keep`` is the
    dropout keep-mask (B, Hq, Nq, Nk); when None and ``params.dropout_p > 0`` it is drawn from
    ``params.seed`` with the counter-based RNG all backends share.

    Returns ``(out, lse)`` or ``(out, lse, probs)``: out (B, Hq, Nq, Dv), lse (B, Hq, Nq) (natural log,
    -inf for a row that sees no key), probs (B, Hq, Nq, Nk) after dropout. Rows that see no key give 0.
    """
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if heads_q != heads_kv:
        group = heads_q // heads_kv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if mask is None:
        mask = params.mask

    scores = torch.matmul(q, k.transpose(-1, -2)) * params.scale
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    allowed = visible(seqlen_q, seqlen_k, params, device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = mask if allowed is None else (allowed & mask)
        else:
            scores = scores + mask.to(scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))

    # Softmax with the row max as shift. The shift is detached: softmax and log-sum-exp do not depend
    # on it, and a row that sees no key (max = -inf) then gives exp(-inf) = 0 with finite gradients.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    exp_scores = torch.exp(scores - row_max)
    row_sum = exp_scores.sum(dim=-1, keepdim=True)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    probs = exp_scores / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)

    if params.dropout_p > 0.0:
        if keep is None:
            from mhattn.dropout_rng import keep_mask

            keep = keep_mask(params.seed, batch, heads_q, seqlen_q, seqlen_k, params.dropout_p, device=q.device)
        probs = probs * keep.to(probs.dtype) / (1.0 - params.dropout_p)

    out = torch.matmul(probs, v)
    if return_probs:
        return out, lse, probs
    return out, lse
