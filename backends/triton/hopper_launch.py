"""When the Triton backend's forward runs the Hopper kernel (hopper_forward.py), and its launch.

The Hopper kernel covers the dense training shapes: sm_90, fp16/bf16, head dims 64/128/256 with equal value
head dim, no mask, no dropout, no softcap, no sliding window (a causal mask of either alignment is fine), no
key padding bounds, 16-byte aligned rows. It pays once each program has enough key blocks to amortise its
start (tensor maps, the first copies) and its output write; below MIN_KEYS the FlashAttention-2 kernel
(forward.py) is faster on the H100 (backends/triton/NOTES.md, version 5). Everything else runs forward.py.

``MHATTN_TRITON_HOPPER=0`` turns the Hopper kernel off (forward.py everywhere), e.g. to compare the two.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from mhattn.backends.triton import configs
from mhattn.backends.triton.launcher import CompiledLauncher

# Head dim -> key block: the largest whose K/V ring, both Q tiles and the register budget fit.
KEY_BLOCK = {64: 128, 128: 128, 256: 64}
QUERY_ROWS_PER_CONSUMER = 64   # one wgmma row block per consumer warpgroup
NUM_STAGES = 2
# Fewest keys at which the Hopper kernel beat forward.py on the H100 (bf16, PERFORMANCE.md's shapes).
MIN_KEYS = {64: 8192, 128: 2048, 256: 1}
ENV_SWITCH = "MHATTN_TRITON_HOPPER"

_launcher: list = []
_gluon: list = []


def gluon_available() -> bool:
    if not _gluon:
        _gluon.append(importlib.util.find_spec("triton.experimental.gluon") is not None)
    return _gluon[0]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def why_not(plan, run) -> Optional[str]:
    """None when the Hopper kernel runs this call's forward; otherwise the reason it does not."""
    if plan.has_right and run.window_right != 0:
        return "a right window bound other than causal"
    reason = _rule(plan.sm90, plan.dtype, plan.head_dim, plan.head_dim_v, plan.seqlen_q, plan.seqlen_k,
                   plan.mask_kind or plan.has_dropout or plan.has_softcap or plan.has_left or plan.key_lengths)
    if reason is None and not run.tma_ok:
        return "rows or starts not 16-byte aligned for the copy engine"
    return reason


def why_not_problem(problem) -> Optional[str]:
    """:func:`why_not` from a dispatcher Problem (no tensors: alignment is not known there)."""
    extras = problem.features & {"bool_mask", "float_mask", "dropout", "window", "softcap", "value_dim"}
    return _rule(problem.compute_capability == (9, 0), problem.dtype, problem.head_dim, problem.head_dim_v,
                 problem.seqlen_q, problem.seqlen_k, bool(extras))


def _rule(sm90, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, extras) -> Optional[str]:
    if not enabled():
        return f"{ENV_SWITCH}=0"
    if not sm90:
        return "not an sm_90 GPU"
    if not gluon_available():
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if configs.pinned() is not None:
        return "a pinned tile configuration (forward.py's tiles)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (fp16/bf16 only)"
    if head_dim != head_dim_v or head_dim not in KEY_BLOCK:
        return f"head dims {head_dim}/{head_dim_v} (equal, one of {sorted(KEY_BLOCK)})"
    if extras:
        return "a mask, dropout, softcap, a sliding window or key padding bounds"
    if seqlen_q == 0 or seqlen_k == 0:
        return "an empty query or key set"
    if seqlen_k < MIN_KEYS[head_dim]:
        return f"{seqlen_k} keys < {MIN_KEYS[head_dim]} (forward.py is faster there)"
    return None


def compile_time_args(head_dim: int, causal: bool) -> dict:
    """The kernel's compile-time arguments for a head dim and causal or not (the launch, `mhattn build` and the
    GPU check script use the same)."""
    return dict(HEAD_DIM=head_dim, BLOCK_M=QUERY_ROWS_PER_CONSUMER, BLOCK_N=KEY_BLOCK[head_dim],
                NUM_STAGES=NUM_STAGES, CAUSAL=causal, HEAVY_FIRST=causal)


def forward(q, k, v, out, lse, run, plan, device_index: int) -> None:
    """Launch the Hopper kernel into ``out`` and ``lse`` (allocated by the caller)."""
    from mhattn.backends.triton import backend

    if not _launcher:
        from mhattn.backends.triton import hopper_forward

        _launcher.append(CompiledLauncher(hopper_forward.hopper_forward_kernel))
    launcher = _launcher[0]
    backend._ensure_descriptor_allocator()
    rows_per_program = 2 * QUERY_ROWS_PER_CONSUMER
    num_m_blocks = -(-plan.seqlen_q // rows_per_program)
    constexprs = plan.hopper_constexprs
    if constexprs is None:
        constexprs = plan.hopper_constexprs = launcher.constexprs(4, 1, **compile_time_args(plan.head_dim,
                                                                                            plan.has_right))
    launcher.launch((plan.batch * plan.heads_q * num_m_blocks,), (
        q, k, v, out, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        lse.stride(0), lse.stride(1),
        plan.heads_q, plan.kv_group, plan.seqlen_q, plan.seqlen_k, num_m_blocks, run.qk_scale2, run.diag_offset,
    ), constexprs, device_index)
