"""``mhattn.varlen_attention``: attention over packed variable-length sequences, forward and backward.

The tokens of all sequences are packed along one dim (no padding); ``cu_seqlens`` prefix sums say where
each sequence starts. The backend the dispatcher picks (operation "varlen") runs forward and backward;
autograd keeps the chosen backend for the backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from mhattn import dispatch
from mhattn.arguments import (check_heads, check_index_tensor, check_same, check_softcap, check_tensor,
                              check_values_once, host_checks_allowed, scale_or_default)
from mhattn.backends import layouts
from mhattn.backends.base import Packing
from mhattn.errors import InputError
from mhattn.functional import (_backend_argument, _causal_right, _forward_backends, _params, _remember_backend,
                               _window)
from mhattn.problem import Problem


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window=None,
    softcap: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
):
    """Attention over B packed sequences: sequence b's queries see only its own keys.

    Args:
        q: (total_q, Hq, D), the queries of all sequences one after the other.
        k: (total_k, Hkv, D); v: (total_k, Hkv, Dv). Same dtype and device as q; last dims contiguous
            (other strides are used as they are).
        cu_seqlens_q: (B + 1,) int32 on q's device: sequence b's queries are rows cu_seqlens_q[b] ..
            cu_seqlens_q[b + 1] - 1 of q; starts at 0, non-decreasing, ends at total_q.
        cu_seqlens_k: (B + 1,) int32, the same for k and v (ends at total_k).
        max_seqlen_q / max_seqlen_k: ints >= every sequence's query / key length.
        dropout_p: probability of dropping an attention weight (applied whenever > 0); sequence b draws the
            counter-based RNG's words of batch index b at its own (query, key) positions.
        is_causal: causal attention aligned top-left within each sequence (query i sees keys j <= i).
        scale: score scale; default 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (no copies of K/V).
        window: (left, right) around each sequence's top-left diagonal, as in :func:`mhattn.attention`.
        softcap: scores become softcap * tanh(scores / softcap).
        return_lse: also return the log-sum-exp (Hq, total_q), float32, natural log (its gradient flows).
        backend: a backend name, as in :func:`mhattn.attention`.

    Returns:
        out (total_q, Hq, Dv) in q's dtype; with ``return_lse`` a tuple (out, lse). A query row that sees no
        key (a sequence with no keys) gives 0 and lse -inf.

    Under ``torch.compile`` the forward and the backward are custom ops (``mhattn::varlen_forward`` /
    ``varlen_backward``): no graph break, the backend request read when the compiled code runs, the backward on
    the forward's backend.
    """
    seed = None
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and 0.0 < dropout_p < 1.0:
        from mhattn.dropout_rng import draw_seed

        # Drawn on the tensors' device, as mhattn.attention does (graph-safe; torch.manual_seed reproduces it).
        seed = draw_seed(q.device)
    if torch.compiler.is_compiling():
        out, lse = _compiled_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  is_causal, scale, enable_gqa, window, softcap, seed, backend)
        return (out, lse) if return_lse else out
    packing, params, problem = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        is_causal, scale, enable_gqa, window, softcap)
    name, source = dispatch.requested_on(backend, q.device.type)
    chosen = dispatch.select(problem, name, source)
    if seed is not None:
        params = params.replace(seed=seed)
    out, lse = _VarlenAttention.apply(q, k, v, chosen, packing, params)
    return (out, lse) if return_lse else out


def explain(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, is_causal=False,
            scale=None, enable_gqa=False, *, window=None, softcap=None, return_lse=False,
            backend=None) -> dispatch.Decision:
    """What :func:`varlen_attention` would do: ``str()`` shows the problem, the choice and every backend's
    reasons."""
    _, _, problem = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
                             scale, enable_gqa, window, softcap)
    name, source = dispatch.requested_on(backend, q.device.type)
    return dispatch.decide(problem, name, source)


class _VarlenAttention(torch.autograd.Function):
    """Forward on the chosen backend; the backward on the same one."""

    @staticmethod
    def forward(ctx, q, k, v, chosen, packing, params):
        out, lse = chosen.forward_varlen(q, k, v, packing, params)
        ctx.set_materialize_grads(False)
        ctx.chosen, ctx.packing, ctx.params = chosen, packing, params
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        elif grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = ctx.chosen.backward_varlen(grad_out, q, k, v, out, lse, ctx.packing, ctx.params,
                                                grad_lse=grad_lse)
        return dq, dk, dv, None, None, None


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, enable_gqa,
             window, softcap, check_values=True):
    """Every check of a call's arguments (the prefix sums' values too, once per value, unless check_values is
    off: the compiled path's trace has no values), then its Packing, params and Problem."""
    check_tensor("q", q, 3, "(total_q, Hq, D)")
    check_tensor("k", k, 3, "(total_k, Hkv, D)")
    check_tensor("v", v, 3, "(total_k, Hkv, Dv)")
    check_same(("q", "k", "v"), (q, k, v))
    if k.shape[:2] != v.shape[:2]:
        raise InputError(f"k and v must agree in (total_k, Hkv), got shapes {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"q and k must have the same head dim (last dim), got {q.shape[2]} and {k.shape[2]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise InputError(f"{name} must have a contiguous last dim, got strides {tuple(t.stride())}")
    check_heads(q.shape[1], k.shape[1], enable_gqa)
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(B + 1,)", q.device)
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, 1, "(B + 1,)", q.device)
    if cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InputError(f"cu_seqlens_q and cu_seqlens_k must both have shape (B + 1,), got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    _check_numbers(max_seqlen_q, max_seqlen_k, dropout_p)
    if check_values and host_checks_allowed(q):
        check_values_once((cu_seqlens_q, cu_seqlens_k), (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k), lambda: (
            _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
            _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)))
    left, right = _window(window)
    params = _params(None, False, scale_or_default(scale, q.shape[2]), bool(is_causal), 0, left,
                     _causal_right(right, bool(is_causal)),
                     float(dropout_p), (0, 0), check_softcap(softcap))
    packing = Packing(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    problem = Problem.from_tensors(q, k, v, params, causal=bool(is_causal), window=left is not None or right is not None,
                                   operation="varlen", sizes=(packing.batch, packing.max_seqlen_q, packing.max_seqlen_k))
    return packing, params, problem


# ---- under torch.compile: custom ops ---------------------------------------------------------------------------


def _compiled_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale,
                   enable_gqa, window, softcap, seed, backend):
    """The call as the custom ops take it: the Python arguments checked here (at trace time), the window split into
    its bounds, the backend request checked now but resolved when the compiled code runs."""
    _check_numbers(max_seqlen_q, max_seqlen_k, dropout_p)
    left, right = _window(window)
    request = "" if backend is None else _backend_argument(backend)
    return torch.ops.mhattn.varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(dropout_p), bool(is_causal),
        None if scale is None else float(scale), bool(enable_gqa), left, right,
        None if softcap is None else float(softcap), seed, request)


def _op_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale,
             enable_gqa, window_left, window_right, softcap, seed, check_values=True):
    """(packing, params, problem) of a custom op's arguments."""
    packing, params, problem = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        is_causal, scale, enable_gqa, (window_left, window_right), softcap,
                                        check_values)
    return packing, (params if seed is None else params.replace(seed=seed)), problem


def _op_backend(problem, backend: str):
    name, source = dispatch.requested_on(backend or None, problem.device_type)
    return dispatch.select(problem, name, source)


@torch.library.custom_op("mhattn::varlen_forward", mutates_args=())
def _varlen_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, is_causal: bool, scale: Optional[float],
    enable_gqa: bool, window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    seed: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    packing, params, problem = _op_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        is_causal, scale, enable_gqa, window_left, window_right, softcap, seed)
    chosen = _op_backend(problem, backend)
    out, lse = chosen.forward_varlen(q, k, v, packing, params)
    # Compiled graphs assume the layouts the fake implementation promises (a backend's other layout is copied).
    out = layouts.placed(out, layouts.contiguous_strides(out.shape))
    lse = layouts.placed(lse, layouts.contiguous_strides(lse.shape))
    _remember_backend(lse, chosen)  # by the lse's address, as mhattn.attention's op: the backward runs there too
    return out, lse


@_varlen_forward_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, enable_gqa,
      window_left, window_right, softcap, seed, backend):
    # Every check that needs no tensor's values raises here, at trace time, as the eager call would.
    _op_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, enable_gqa,
             window_left, window_right, softcap, seed, check_values=False)
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=layouts.lse_dtype(q.dtype)))


@torch.library.custom_op("mhattn::varlen_backward", mutates_args=())
def _varlen_backward_op(
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float], seed: Optional[torch.Tensor],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packing, params, problem = _op_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        is_causal, scale, enable_gqa, window_left, window_right, softcap, seed)
    chosen = _forward_backends.get(lse.data_ptr()) if lse.numel() else None
    if chosen is None:  # not recorded (evicted, or a forward recomputed elsewhere): the request as it stands now
        chosen = _op_backend(problem, backend)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = chosen.backward_varlen(grad_out, q, k, v, out, lse, packing, params, grad_lse=grad_lse)
    return tuple(layouts.placed(g, layouts.contiguous_strides(g.shape)) for g in (dq, dk, dv))


@_varlen_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      is_causal, scale, enable_gqa, window_left, window_right, softcap, seed, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *rest = inputs
    seed = rest[-2]
    ctx.set_materialize_grads(False)  # an unused lse (the usual case) sends no gradient
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens_q, cu_seqlens_k, seed)
    ctx.args = tuple(rest[:-2]) + (rest[-1],)  # max_seqlen_q .. softcap, backend


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    *numbers, backend = ctx.args
    dq, dk, dv = torch.ops.mhattn.varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                  *numbers, seed, backend)
    return (dq, dk, dv) + (None,) * 13


_varlen_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_numbers(max_seqlen_q, max_seqlen_k, dropout_p) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name} must be an int >= 0, got {value!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _check_cu_seqlens(name, cu, total, max_name, max_seqlen) -> None:
    values = cu.tolist()
    if values[0] != 0:
        raise InputError(f"{name} must start at 0, got {values[0]}")
    if values[-1] != total:
        raise InputError(f"{name} must end at the number of packed tokens ({total}), got {values[-1]}")
    for b in range(len(values) - 1):
        length = values[b + 1] - values[b]
        if length < 0:
            raise InputError(f"{name} must be non-decreasing, got {name}[{b}] = {values[b]} > "
                             f"{name}[{b + 1}] = {values[b + 1]}")
        if length > max_seqlen:
            raise InputError(f"sequence {b} has {length} tokens, more than {max_name} = {max_seqlen}")
