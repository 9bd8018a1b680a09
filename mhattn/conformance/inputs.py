"""The tensors and parameters of one conformance case, drawn fresh from the case's seed.

Everything random comes from one CPU generator seeded with ``case.seed``, drawn in a fixed order, so
the reproduce command of a failing case gives bit-identical inputs on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from mhattn.backends.base import AttentionParams
from mhattn.conformance.cases import Case
from mhattn.problem import Problem

# Share of bool-mask entries that attend, and of float-mask entries that are -inf.
BOOL_MASK_KEEP = 0.8
FLOAT_MASK_NEG_INF = 0.1


@dataclass
class CaseInputs:
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), grad_out (B, Hq, Nq, Dv) in the case's dtype;
    grad_lse (B, Hq, Nq) float32 or None; mask: None or a (B, Hq, Nq, Nk) broadcast view (stride 0 where
    the mask is shared) that ``params.mask`` also holds."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    params: AttentionParams
    problem: Problem


def masked_rows(seqlen_q: int) -> list:
    """The query rows a fully-masked mask case blanks out: the first and the middle one."""
    return sorted({0, seqlen_q // 2})


def _diagonal_keys(case: Case) -> torch.Tensor:
    # For each query row, a key every causal/window bound lets it see when any key is visible (the
    # diagonal, clamped into range), so random masks never blank a row by chance.
    return (torch.arange(case.seqlen_q) + case.diag_offset).clamp(0, case.seqlen_k - 1)


def _mask(case: Case, gen: torch.Generator, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The mask in its stored (broadcastable) shape, on the CPU."""
    if case.mask is None:
        return None
    nq, nk = case.seqlen_q, case.seqlen_k
    if case.mask in ("key_padding", "key_padding_left"):
        lengths = torch.randint(1, nk + 1, (case.batch,), generator=gen)
        if case.fully_masked:
            lengths[-1] = 0  # the last batch element has every key padded
        keys = torch.arange(nk)[None, :] < lengths[:, None]
        if case.mask == "key_padding_left":  # the padding first, as prompts padded on the left have it
            keys = keys.flip(1)
        return keys.view(case.batch, 1, 1, nk)
    shape = (case.batch if case.mask_dims[0] == "b" else 1, case.heads_q if case.mask_dims[1] == "h" else 1, nq, nk)
    rows = torch.arange(nq)
    diagonal = _diagonal_keys(case)
    if case.mask == "bool":
        mask = torch.rand(shape, generator=gen) < BOOL_MASK_KEEP
        mask[..., rows, diagonal] = True
        if case.fully_masked:
            mask[..., masked_rows(nq), :] = False
        return mask
    values = torch.randn(shape, generator=gen)
    blocked = torch.rand(shape, generator=gen) < FLOAT_MASK_NEG_INF
    blocked[..., rows, diagonal] = False
    values = values.masked_fill(blocked, float("-inf"))
    if case.fully_masked:
        values[..., masked_rows(nq), :] = float("-inf")
    return values.to(dtype)


def _heads_view(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    # (B, N, heads * dim) -> (B, heads, N, dim), a view with the last dim contiguous
    b, n, _ = t.shape
    return t.view(b, n, heads, dim).transpose(1, 2)


def make_inputs(case: Case, device) -> CaseInputs:
    """Fresh inputs for ``case`` on ``device`` (normal, std 1; q * 5 and k * 3 for overflow cases)."""
    device = torch.device(device)
    dtype = case.torch_dtype
    gen = torch.Generator().manual_seed(case.seed)
    b, hq, hkv = case.batch, case.heads_q, case.heads_kv
    nq, nk, d, dv = case.seqlen_q, case.seqlen_k, case.head_dim, case.value_dim
    q_scale, k_scale = (5.0, 3.0) if case.overflow else (1.0, 1.0)

    if case.strided:
        # Views of packed projections (as MultiheadAttention's in_proj gives): one (B, N, Hq*D + Hkv*D +
        # Hkv*Dv) buffer when Nq == Nk, else Q apart and K, V packed. Strides stay as they come.
        widths = (hq * d, hkv * d, hkv * dv)
        if nq == nk:
            packed = torch.randn(b, nq, sum(widths), generator=gen)
            packed[..., : widths[0]] *= q_scale
            packed[..., widths[0]: widths[0] + widths[1]] *= k_scale
            packed = packed.to(device=device, dtype=dtype)
            q_flat, k_flat, v_flat = packed.split(widths, dim=-1)
        else:
            q_flat = (torch.randn(b, nq, widths[0], generator=gen) * q_scale).to(device=device, dtype=dtype)
            kv = torch.randn(b, nk, widths[1] + widths[2], generator=gen)
            kv[..., : widths[1]] *= k_scale
            kv = kv.to(device=device, dtype=dtype)
            k_flat, v_flat = kv.split(widths[1:], dim=-1)
        q, k, v = _heads_view(q_flat, hq, d), _heads_view(k_flat, hkv, d), _heads_view(v_flat, hkv, dv)
        grad_out = _heads_view(torch.randn(b, nq, hq * dv, generator=gen).to(device=device, dtype=dtype), hq, dv)
    else:
        q = (torch.randn(b, hq, nq, d, generator=gen) * q_scale).to(device=device, dtype=dtype)
        k = (torch.randn(b, hkv, nk, d, generator=gen) * k_scale).to(device=device, dtype=dtype)
        v = torch.randn(b, hkv, nk, dv, generator=gen).to(device=device, dtype=dtype)
        grad_out = torch.randn(b, hq, nq, dv, generator=gen).to(device=device, dtype=dtype)
    grad_lse = torch.randn(b, hq, nq, generator=gen).to(device) if case.grad_lse else None

    stored_mask = _mask(case, gen, dtype)
    mask = None if stored_mask is None else stored_mask.to(device).expand(b, hq, nq, nk)

    seed = tuple(int(w) for w in torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=gen))
    window_left, window_right = case.window if case.window is not None else (None, None)
    if case.causal is not None:
        window_right = 0 if window_right is None else min(window_right, 0)
    params = AttentionParams(
        scale=1.0 / math.sqrt(d),
        diag_offset=case.diag_offset,
        window_left=window_left,
        window_right=window_right,
        mask=mask,
        mask_requires_grad=case.mask_grad,
        dropout_p=case.dropout_p,
        seed=seed if case.dropout_p > 0 else (0, 0),
        softcap=case.softcap,
    )
    problem = Problem.from_tensors(q, k, v, params, causal=case.causal is not None, window=case.window is not None)
    if case.det_runs:
        problem = dataclasses.replace(problem, features=problem.features | {"deterministic"})
    return CaseInputs(q, k, v, grad_out, grad_lse, mask, params, problem)
