"""Host side of varlen (packed) attention: the FlashAttention-2 kernels of forward.py and backward.py with
VARLEN=True.

A packed tensor (total, H, D) reaches the kernels as a batch of sequences whose batch stride is 0 and whose
row stride steps over tokens; each program finds its sequence's first row and length in cu_seqlens and
exits at once when its block lies past that sequence's end, so no work is spent on other sequences'
blocks and nothing is padded. Grids are sized by the longest sequence (max_seqlen_q / max_seqlen_k).
The log-sum-exp is (Hq, total_q): one row of tokens per head.
"""

from __future__ import annotations

import torch

from mhattn.backends.base import AttentionParams, Packing
from mhattn.backends.triton.launcher import COMPILE_OPTIONS


def _packed_strides(t: torch.Tensor):
    """(batch, head, row) strides of a packed (total, H, D) tensor seen as a batch of sequences."""
    return 0, t.stride(1), t.stride(0)


def _check_packed(**tensors):
    for name, t in tensors.items():
        if t.dim() != 3:
            raise ValueError(f"triton backend: {name} must be 3-D (total, H, D), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"triton backend: {name} must have a contiguous last dim, got strides {tuple(t.stride())}")


def _as_batch_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the (1, H, total, D) view the backend's checks take."""
    return t.transpose(0, 1).unsqueeze(0)


def _launch_state(q, k, v, params):
    """The backend's per-call scalars and flags (its _Launch) for packed tensors. Its Hopper switches hold for
    every sequence: the tensor descriptors start at a sequence's first row, aligned as the whole tensor's."""
    from mhattn.backends.triton.backend import _Launch

    return _Launch(*(_as_batch_view(t) for t in (q, k, v)), params)


def forward(q, k, v, packing: Packing, params: AttentionParams):
    """out (total_q, Hq, Dv) in q's dtype and lse (Hq, total_q) float32 (see Backend.forward_varlen)."""
    from mhattn.backends.triton.backend import _OnDevice, _run, kernels, triton_cdiv

    _check_packed(q=q, k=k, v=v)
    forward_module = kernels()[0]
    run = _launch_state(q, k, v, params)
    total_q, heads_q, _ = q.shape
    out = torch.empty(total_q, heads_q, run.plan.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    def launch(tile):
        num_m_blocks = triton_cdiv(packing.max_seqlen_q, tile.block_m)
        forward_module.attention_forward_kernel[(packing.batch * heads_q * num_m_blocks,)](
            q, k, v, out, lse, q, packing.cu_seqlens_q, packing.cu_seqlens_k,
            *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(out), 0, 0, 0, 0,
            0, lse.stride(0),
            heads_q, run.plan.kv_group, packing.max_seqlen_q, packing.max_seqlen_k, num_m_blocks,
            run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale,
            *run.band,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAVY_FIRST=run.plan.heavy_first, **run.plan.flags,
            **run.hopper_flags(tile), VARLEN=True, num_warps=tile.num_warps, num_stages=tile.num_stages,
            **COMPILE_OPTIONS,
        )

    with _OnDevice(q.device):
        _run("forward_varlen", run.plan.config.forward, run.plan.shrink_key + (run.tma_ok,), launch)
    return out, lse


def backward(grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams, grad_lse=None):
    """(dq, dk, dv) shaped like q, k, v (see Backend.backward_varlen). dQ comes from its own kernel (the dK/dV
    kernel's DQ_MODE stays 0, so no dQ accumulator: ``delta`` fills that argument)."""
    from mhattn.backends.triton.backend import _OnDevice, _run, kernels, triton_cdiv

    _check_packed(q=q, k=k, v=v, out=out, grad_out=grad_out)
    backward_module = kernels()[1]
    run = _launch_state(q, k, v, params)
    total_q, heads_q, _ = q.shape
    total_k, heads_kv, _ = k.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or total_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()

    delta = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    grad_lse_arg = grad_lse if grad_lse is not None else lse
    key = run.plan.shrink_key + (run.tma_ok,)
    with _OnDevice(q.device):
        # The preprocess is row-wise: the packed tokens of each head form one (1, Hq, total_q) problem.
        block_pre = 64
        num_pre_blocks = triton_cdiv(total_q, block_pre)
        backward_module.backward_preprocess_kernel[(heads_q * num_pre_blocks,)](
            out, grad_out, lse, grad_lse_arg, delta, lse2, delta,
            *_packed_strides(out), *_packed_strides(grad_out),
            0, lse.stride(0), lse.stride(1), 0, grad_lse_arg.stride(0), grad_lse_arg.stride(1),
            heads_q, total_q, num_pre_blocks, delta.stride(0), 0, 0,
            HEAD_DIM_V=run.plan.head_dim_v, BLOCK_DV=run.plan.block_dv, BLOCK_M=block_pre,
            HAS_GRAD_LSE=grad_lse is not None, ZERO_BLOCK=0, num_warps=4, num_stages=1, **COMPILE_OPTIONS,
        )

        def launch_dkdv(tile):
            num_n_blocks = triton_cdiv(packing.max_seqlen_k, tile.block_n)
            backward_module.backward_dkdv_kernel[(packing.batch * heads_kv * num_n_blocks,)](
                q, k, v, grad_out, lse2, delta, dk, dv, delta, q, packing.cu_seqlens_q, packing.cu_seqlens_k,
                *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(grad_out),
                *_packed_strides(dk), *_packed_strides(dv), 0, 0, 0, 0, 0, delta.stride(0),
                heads_q, heads_kv, run.plan.kv_group, packing.max_seqlen_q, packing.max_seqlen_k, num_n_blocks,
                run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale, run.sm_scale,
                *run.band,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, **run.plan.flags,
                **run.hopper_flags(tile, _as_batch_view(grad_out)), VARLEN=True,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **COMPILE_OPTIONS,
            )

        def launch_dq(tile):
            num_m_blocks = triton_cdiv(packing.max_seqlen_q, tile.block_m)
            backward_module.backward_dq_kernel[(packing.batch * heads_q * num_m_blocks,)](
                q, k, v, grad_out, lse2, delta, dq, q, delta, packing.cu_seqlens_q, packing.cu_seqlens_k,
                *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(grad_out),
                *_packed_strides(dq), 0, 0, 0, 0, 0, delta.stride(0),
                heads_q, run.plan.kv_group, packing.max_seqlen_q, packing.max_seqlen_k, num_m_blocks,
                run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale, run.sm_scale,
                *run.band,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, MASK_GRAD=False, HEAVY_FIRST=run.plan.heavy_first,
                **run.plan.flags, VARLEN=True,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **COMPILE_OPTIONS,
            )

        _run("dkdv_varlen", run.plan.config.dkdv, key, launch_dkdv)
        _run("dq_varlen", run.plan.config.dq, key, launch_dq)
    return dq, dk, dv
