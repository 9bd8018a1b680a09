"""``mhattn.attention``: scaled dot-product attention on the backend the dispatcher picks, with autograd.

One path serves every call. :func:`_prepare` checks and canonicalises the arguments in one pass (layout,
broadcast leading dims, masks, causal alignment). :func:`_resolve` then resolves the backend request
(argument > ``use_backend`` > ``MHATTN_BACKEND`` > auto) at run time and looks the decision up in the
dispatcher's cache. An eager call that returns no lse first offers the chosen backend its own
differentiable path (``Backend.native_attention``: the sdpa backend hands such calls to torch's public
SDPA, whose backward is a C++ autograd node); otherwise :meth:`_CallPlan.run` runs the backend's forward,
directly when no input needs a gradient, else inside :class:`_EagerAttention`, which keeps the chosen
backend for the backward. A call that repeats an earlier one (:func:`_call_key`: shapes, strides, dtypes,
devices, values, request and gradient needs) skips the checks and the decision: :class:`_CallPlan` holds
what they came to, the backend's own path prepared for such calls included. Under ``torch.compile`` the
same function runs inside the ``mhattn::attention_forward`` custom op, whose fake implementation
promises the layouts every built-in backend writes (:mod:`mhattn.backends.layouts`); the compiled
backward finds the forward's backend through the log-sum-exp it returned (:data:`_forward_backends`).
Because the request is resolved when the op runs, ``use_backend`` or ``MHATTN_BACKEND`` changed after
the first trace is honoured as in eager mode.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Optional

import torch

from mhattn import dispatch, dropout_rng
from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams
from mhattn.caches import put_bounded
from mhattn.errors import InputError
from mhattn.problem import Problem

try:  # torch's causal-alignment objects (torch >= 2.2)
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover
    CausalBias = CausalVariant = None


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask=None,
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
    """Scaled dot-product attention, a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        query: (..., Hq, Nq, D). Any strides; the last dim is used as is when contiguous.
        key: (..., Hkv, Nk, D), same dtype and device as ``query``; the leading dims of query, key and
            value broadcast against each other (as in SDPA).
        value: (..., Hkv, Nk, Dv).
        attn_mask: None; a bool tensor (True = attend) or float tensor (added to the scores) that
            broadcasts to (..., Hq, Nq, Nk); or ``torch.nn.attention.bias.causal_lower_right(Nq, Nk)``
            / ``causal_upper_left(Nq, Nk)`` for causal attention aligned bottom-right / top-left.
        dropout_p: probability in [0, 1] of dropping an attention weight (applied whenever > 0, as SDPA
            does; 1 gives zeros). A float or a 0-dim tensor.
        is_causal: causal attention aligned top-left (query i sees keys j <= i), as SDPA's.
        scale: score scale (a float or a 0-dim tensor); default 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (query head h uses key/value head h // (Hq // Hkv)).
        window: (left, right): query i sees keys j with -left <= j - i - offset <= right, where offset is
            Nk - Nq for a ``causal_lower_right`` mask and 0 otherwise; None or -1 = unbounded side.
        softcap: if given, scores become softcap * tanh(scores / softcap) before masking.
        return_lse: also return the per-row natural-log log-sum-exp (..., Hq, Nq), float32; a gradient
            flowing into it reaches q, k, v (and a float mask) like the output's.
        backend: name of the backend to use ("auto", "triton", "cupy", "sdpa", "reference", ...).

    Returns:
        (..., Hq, Nq, Dv) in the input dtype; with ``return_lse`` a tuple ``(out, lse)``. A query row
        that sees no key (and every row when Nk = 0) gives 0 (and lse -inf). Problems with an empty
        dimension or D = 0 run on the reference whatever the request (there is nothing to fuse).
    """
    call_key = _call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap,
                         backend)
    plan = _known_calls.get(call_key) if call_key is not None else None  # (no look-up for torch.compile to guard)
    if plan is not None:  # an earlier call with this key passed the checks and got its backend (see _call_key)
        params, mask = plan.params, None
        if plan.mask_dims is not None:  # this call's mask, in the view the first call's took (the layout is the key's)
            mask = _mask_view(attn_mask, *plan.mask_dims)
            params = params.replace(mask=mask)
        direct = plan.direct
        if direct is not None and not return_lse:  # the backend's own path, the tensors as they come (_CallPlan)
            out = direct(query, key, value, params)
            return out if out is not None else plan.run_forward(query, key, value, mask, params, False)
        if not plan.as_is:
            query, key, value = _to4d(query), _to4d(key), _to4d(value)
        if params.dropout_p > 0.0:  # a fresh dropout mask at every call
            params = params.replace(seed=dropout_rng.draw_seed(query.device))
        return plan.run(query, key, value, mask, params, return_lse)
    return _attention_in_full(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap,
                              return_lse, backend, call_key)


def _attention_in_full(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap,
                       return_lse, backend, call_key):
    """:func:`attention` with every step: checks, the request, the decision; what they came to (a _CallPlan) is
    remembered under ``call_key`` (where there is one) for the calls that repeat it."""
    (q, k, v, mask, scale, dropout_p, causal, diag_offset, window_left, window_right, softcap,
     out_shape) = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap)
    if backend is not None:
        backend = _backend_argument(backend)
    if dropout_p == 1.0:  # every weight dropped: zeros, as SDPA (the lse keeps its meaning)
        out, lse = attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window=window,
                             softcap=softcap, return_lse=True, backend=backend)
        out = out * 0
        return (out, lse) if return_lse else out

    grad = torch.is_grad_enabled()
    mask_grad = grad and mask is not None and mask.requires_grad and mask.dtype != torch.bool
    # Whether autograd differentiates this call: automatic selection then weighs forward+backward time. Read here,
    # outside the custom op, whose inputs never require grad (torch.compile guards on what it reads).
    tracked = grad and (q.requires_grad or k.requires_grad or v.requires_grad or mask_grad)
    seed = dropout_rng.draw_seed(q.device) if dropout_p > 0.0 else None
    args = (q, k, v, mask, seed, backend or "", scale, causal, diag_offset, window_left, window_right, dropout_p,
            softcap, mask_grad, tracked)
    if torch.compiler.is_compiling():  # (a call with a key is made outside compiled code: _call_key gives none here)
        out, lse = torch.ops.mhattn.attention_forward(*args)
        return _returned(out, lse, out_shape, return_lse)
    chosen = _resolve(*args)
    params = _params(mask, mask_grad, scale, causal, diag_offset, window_left, window_right, dropout_p, seed, softcap)
    plan = _CallPlan(chosen, _prepared_native(chosen, q, k, v, params), params, tracked,
                     q is query and k is key and v is value, out_shape)
    if call_key is not None and query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:  # (see _known_calls)
        if seed is not None or mask is not None:  # each repeated call draws its own seed and brings its own mask
            plan.params = _params(None, mask_grad, scale, causal, diag_offset, window_left, window_right, dropout_p,
                                  None, softcap)
        if mask is not None:
            plan.mask_dims = (out_shape[:-3], out_shape[-3], out_shape[-2], k.shape[2])
        put_bounded(_known_calls, call_key, plan, _KNOWN_CALLS_LIMIT)
    return plan.run(q, k, v, mask, params, return_lse)


class _CallPlan:
    """What a call's checks and decision came to: its backend ``chosen`` (None: the front end answers it), the
    backend's own differentiable path for such calls (``native``, see _prepared_native; None where it has none),
    the params (without a dropout seed in a plan that _known_calls keeps), whether autograd tracks the call,
    whether the tensors reach the backend as they come (4-D with a contiguous last dim: ``as_is``), and the
    output's shape. Left to each call: the layout step of other tensors, the dropout seed, the mask (``mask_dims``:
    for a call with a mask tensor, the leading dims, Hq, Nq and Nk its view is broadcast to: _mask_view)."""

    __slots__ = ("chosen", "native", "params", "tracked", "as_is", "out_shape", "direct", "mask_dims")

    def __init__(self, chosen, native, params: Optional[AttentionParams], tracked: bool, as_is: bool, out_shape):
        self.chosen, self.native, self.params, self.tracked, self.as_is, self.out_shape = (
            chosen, native, params, tracked, as_is, out_shape)
        self.mask_dims = None
        # What a repeated call may hand ``native`` at once, skipping run(): the tensors reach the backend as they come
        # and its output has the caller's shape (4-D), and no dropout seed to draw.
        plain = as_is and len(out_shape) == 4 and (params is None or params.dropout_p == 0.0)
        self.direct = native if plain else None

    def run(self, q, k, v, mask, params, return_lse: bool):
        """The call on its backend: through the backend's own path where it has one for the call and no lse is
        asked for, else through its forward, inside _EagerAttention where a gradient is needed."""
        if self.native is not None and not return_lse:
            out = self.native(q, k, v, params)
            if out is not None:  # (e.g. torch's SDPA with its C++ backward; None where the backend declines the call)
                return out.reshape(self.out_shape) if out.dim() != len(self.out_shape) else out
        return self.run_forward(q, k, v, mask, params, return_lse)

    def run_forward(self, q, k, v, mask, params, return_lse: bool):
        """The call through the backend's forward, inside _EagerAttention where a gradient is needed."""
        if self.tracked:
            # The tensors autograd tracks as arguments of their own, the rest in params (fewer for apply to scan).
            out, lse = _EagerAttention.apply(q, k, v, mask, params, self.chosen)
        else:  # nothing to differentiate: no autograd Function, no saved tensors
            out, lse = _forward_on(self.chosen, q, k, v, params)
        return _returned(out, lse, self.out_shape, return_lse)


def _returned(out, lse, out_shape, return_lse: bool):
    """What attention returns: out (and lse) with the caller's leading dims (the backends see them as one)."""
    if out.dim() != len(out_shape):
        out = out.reshape(out_shape)
        lse = lse.reshape(out_shape[:-1])
    return (out, lse) if return_lse else out


# ---- repeated calls --------------------------------------------------------------------------------------------

# Calls with plain arguments (a window of ints or None; Python floats and bools; an attn_mask tensor by its layout; see
# _call_key) whose shapes, strides, dtypes, devices, values, backend request and gradient needs equal an earlier call's:
# that call's _CallPlan, so a repeated call skips the checks and the decision. Calls whose leading dims broadcast take
# every step (the views they need are made by _prepare). Bounded (the oldest entry makes room); cleared with the
# dispatcher's cache, since it holds decisions.
_known_calls: dict = {}
_KNOWN_CALLS_LIMIT = 1024
dispatch.clears_with_cache(_known_calls)


def _call_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap, backend):
    """The key of a call in _known_calls, or None where the call is not one whose outcome it holds. The key holds
    everything _prepare checks and _resolve decides on, and what _to4d and the backend's own path (see
    SdpaBackend.native_call) read of the tensors (strides, requires_grad, grad mode), so a call found there would
    pass the same checks, take the same layout steps and get the same backend and path. Values are typed exactly
    (a bool where a float was would compare equal but is refused by _prepare); _prepare refuses NaNs, so none is
    stored."""
    if attn_mask is not None:
        # A causal alignment object (causal_lower_right / causal_upper_left: chunked prefill, speculative decoding)
        # is its variant and sizes, which _prepare turns into the causal flag and diagonal: those are the key. A mask
        # tensor is its layout (what _prepare checks and the decision reads of it: its features and whether it is
        # the same over heads and rows); its values are each call's own.
        if type(attn_mask) is _Tensor:
            attn_mask = ("tensor", attn_mask.shape, attn_mask.stride(), attn_mask.dtype, attn_mask.device,
                         attn_mask.requires_grad)
        elif CausalBias is not None and type(attn_mask) is CausalBias:
            attn_mask = ("causal", attn_mask.variant, attn_mask.seq_len_q, attn_mask.seq_len_kv)
        else:
            return None
    if window is not None:
        # A pair of ints (not bools, which would compare equal to 0 and 1 and are refused) or Nones: its values are
        # the key (each call's own checks passed for the first such call).
        if type(window) not in (tuple, list) or len(window) != 2 or not all(
                side is None or type(side) is int for side in window):
            return None
        window = tuple(window)
    if (type(dropout_p) is not float or type(is_causal) is not bool
            or type(enable_gqa) is not bool or (scale is not None and type(scale) is not float)
            or (softcap is not None and type(softcap) is not float)
            or not (isinstance(query, _Tensor) and isinstance(key, _Tensor) and isinstance(value, _Tensor))
            or _is_compiling()):
        return None
    device = query.device
    try:
        request = _requested_on(backend, device.type)
    except Exception:  # a bad request raises where the full path checks it (after the tensors)
        return None
    return (query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(), query.dtype, key.dtype,
            value.dtype, device, key.device, value.device, dropout_p, is_causal, scale, enable_gqa, softcap,
            request, query.requires_grad or key.requires_grad or value.requires_grad, _grad_enabled(), attn_mask,
            window)


# (module-level names for the checks of every call)
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_requested_on = dispatch.requested_on
_grad_enabled = torch.is_grad_enabled


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            window=None, softcap=None, return_lse=False, backend=None) -> dispatch.Decision:
    """What :func:`attention` would do with these arguments: ``str()`` of the result shows the problem,
    the request and where it came from, the choice, and every backend's reasons."""
    (q, k, v, mask, scale, dropout_p, causal, diag_offset, window_left, window_right, softcap,
     _) = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap)
    name, source = dispatch.requested_on(backend, q.device.type)
    params = _params(mask, False, scale, causal, diag_offset, window_left, window_right, dropout_p, (0, 0), softcap)
    problem = Problem.from_tensors(q, k, v, params, causal=causal, window=_uses_window(window_left, window_right, causal))
    if problem.needs_grad and not torch.is_grad_enabled():  # attention() would not be differentiated: forward time
        problem = dataclasses.replace(problem, needs_grad=False)
    return dispatch.decide(problem, name, source)


# ---- argument checking and canonical form --------------------------------------------------------


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap):
    """Checks every argument and returns the canonical call, a tuple:
    (q, k, v, mask, scale, dropout_p, causal, diag_offset, window_left, window_right, softcap, out_shape),
    with q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) (leading dims collapsed into B, last dim
    contiguous), mask None or a view broadcast to (B, Hq, Nq, Nk), and out_shape the user's (..., Hq, Nq, Dv).
    The common case costs a handful of comparisons; messages are built only for bad input."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        _raise_not_tensor(query, key, value)
    dtype, device = query.dtype, query.device
    if (query.dim() < 3 or key.dim() < 3 or value.dim() < 3 or key.dtype != dtype or value.dtype != dtype
            or not query.is_floating_point() or key.device != device or value.device != device):
        _raise_bad_tensors(query, key, value)
    q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
    heads_q, seqlen_q, head_dim = q_shape[-3:]
    heads_kv, seqlen_k, head_dim_k = k_shape[-3:]
    if head_dim_k != head_dim or v_shape[-2] != seqlen_k or v_shape[-3] != heads_kv:
        _raise_bad_sizes(query, key, value)
    if heads_q != heads_kv:
        if not enable_gqa:
            raise InputError(
                f"query has {heads_q} heads but key/value have {heads_kv}: pass enable_gqa=True for grouped-query attention"
            )
        if heads_kv == 0 or heads_q % heads_kv:
            raise InputError(f"with enable_gqa, query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")

    if type(dropout_p) is not float:  # (a float, the usual case, is already what _number gives)
        dropout_p = _number(dropout_p, "dropout_p")
    if not 0.0 <= dropout_p <= 1.0:
        raise InputError(f"dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    else:
        scale = _number(scale, "scale")
        if not math.isfinite(scale):
            raise InputError(f"scale must be a finite float or None, got {scale!r}")
    if softcap is not None:
        softcap = _number(softcap, "softcap")
        if not (softcap > 0 and math.isfinite(softcap)):
            raise InputError(f"softcap must be a positive finite float or None, got {softcap!r}")
    window_left, window_right = _window(window)

    # Leading (batch) dims: equal in the common case, else broadcast as SDPA does (stride-0 views).
    batch_shape = q_shape[:-3]
    if k_shape[:-3] != batch_shape or v_shape[:-3] != batch_shape:
        query, key, value, batch_shape = _broadcast_leading(query, key, value)

    diag_offset = 0
    causal = bool(is_causal)
    mask = None
    if attn_mask is not None:
        if CausalBias is not None and isinstance(attn_mask, CausalBias):
            if is_causal:
                raise InputError("pass either is_causal=True or a causal attn_mask object, not both")
            if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (seqlen_q, seqlen_k):
                raise InputError(
                    f"attn_mask is a causal bias for (Nq, Nk) = ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) "
                    f"but query/key have ({seqlen_q}, {seqlen_k})"
                )
            causal = True
            if attn_mask.variant == CausalVariant.LOWER_RIGHT:
                diag_offset = seqlen_k - seqlen_q
        else:
            if is_causal:
                raise InputError("is_causal=True cannot be combined with an explicit attn_mask tensor (as in SDPA)")
            mask = _canonical_mask(attn_mask, device, tuple(batch_shape) + (heads_q, seqlen_q, seqlen_k))
    window_right = _causal_right(window_right, causal)

    q, k, v = _to4d(query), _to4d(key), _to4d(value)
    if mask is not None:
        mask = _mask_view(mask, batch_shape, heads_q, seqlen_q, seqlen_k)
    out_shape = (*batch_shape, heads_q, seqlen_q, v_shape[-1])
    return (q, k, v, mask, float(scale), dropout_p, causal, diag_offset, window_left, window_right, softcap,
            out_shape)


def _mask_view(mask, batch_shape, heads_q: int, seqlen_q: int, seqlen_k: int):
    """An attn_mask as the backends take it: broadcast to (..., Hq, Nq, Nk), its leading dims as one (B, Hq, Nq,
    Nk)."""
    mask = mask.expand(*batch_shape, heads_q, seqlen_q, seqlen_k)
    if mask.dim() != 4:
        mask = mask.unsqueeze(0) if mask.dim() == 3 else mask.reshape(-1, heads_q, seqlen_q, seqlen_k)
    return mask


def _number(x, name: str) -> float:
    """A Python number or a 0-dim tensor (as SDPA takes) as a float."""
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_complex and x.dtype != torch.bool:
        return float(x.item())
    raise InputError(f"{name} must be a float (or a 0-dim tensor), got {x!r}")


def _fmt_dtype(dtype):
    return str(dtype).replace("torch.", "")


def _raise_not_tensor(query, key, value):
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")


def _raise_bad_tensors(query, key, value):
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise InputError(f"{arg} must have at least 3 dims (..., heads, seq, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise InputError(f"{arg} must be a floating-point tensor, got dtype {_fmt_dtype(t.dtype)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise InputError(
            "query, key and value must have one dtype, got "
            f"{_fmt_dtype(query.dtype)}, {_fmt_dtype(key.dtype)}, {_fmt_dtype(value.dtype)}"
        )
    raise InputError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")


def _raise_bad_sizes(query, key, value):
    if query.shape[-1] != key.shape[-1]:
        raise InputError(f"query and key must have the same head dim (last dim), got {query.shape[-1]} and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise InputError(f"key and value must have the same sequence length (dim -2), got {key.shape[-2]} and {value.shape[-2]}")
    raise InputError(f"key and value must have the same number of heads (dim -3), got {key.shape[-3]} and {value.shape[-3]}")


def _broadcast_leading(query, key, value):
    """query, key, value with their leading dims broadcast to one batch shape (views), and that shape."""
    shapes = [tuple(t.shape[:-3]) for t in (query, key, value)]
    try:
        batch_shape = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        raise InputError(
            f"the leading (batch) dims of query, key and value must broadcast, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        ) from None
    query, key, value = (t.expand(*batch_shape, *t.shape[-3:]) for t in (query, key, value))
    return query, key, value, batch_shape


def _causal_right(window_right, causal: bool):
    """The right bound of the band: causal is a right bound of 0 on the (shifted) diagonal."""
    if not causal:
        return window_right
    return 0 if window_right is None else min(window_right, 0)


def _window(window) -> tuple:
    """(left, right) of a ``window`` argument, each None where unbounded (a window of None: both)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise InputError(f"window must be None or a pair (left, right) of ints (-1 = unbounded), got {window!r}")
    bounds = []
    for side, value in zip(("left", "right"), window):
        if value is None or (isinstance(value, int) and value == -1):
            bounds.append(None)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            bounds.append(int(value))
        else:
            raise InputError(f"window {side} bound must be an int >= 0, -1 or None (unbounded), got {value!r}")
    return tuple(bounds)


def _canonical_mask(attn_mask, device, target):
    if not isinstance(attn_mask, torch.Tensor):
        raise InputError(
            "attn_mask must be None, a bool or float tensor, or a torch.nn.attention.bias causal object, "
            f"got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise InputError(f"attn_mask must be bool (True = attend) or floating point (added), got {_fmt_dtype(attn_mask.dtype)}")
    if attn_mask.device != device:
        raise InputError(f"attn_mask must be on the device of query ({device}), got {attn_mask.device}")
    try:
        shape = torch.broadcast_shapes(tuple(attn_mask.shape), target)
    except RuntimeError:
        shape = None
    if shape != target:
        raise InputError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., Hq, Nq, Nk) = {target}")
    return attn_mask


def _to4d(t: torch.Tensor) -> torch.Tensor:
    dim = t.dim()
    if dim == 3:
        t = t.unsqueeze(0)
    elif dim != 4:
        t = t.reshape(-1, *t.shape[-3:])
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()  # kernels need a contiguous last dim; other strides are kept
    return t


def _params(mask, mask_requires_grad, scale, is_causal, diag_offset, window_left, window_right, dropout_p, seed,
            softcap) -> AttentionParams:
    """The backend's view of a call (the causal bound is already folded into window_right by _prepare). Without a
    mask or a seed tensor the params are plain numbers, made once per distinct set (they are frozen)."""
    if mask is None and seed is None:
        key = (scale, diag_offset, window_left, window_right, dropout_p, softcap, mask_requires_grad)
        params = _plain_params.get(key)
        if params is None:
            params = put_bounded(_plain_params, key, AttentionParams(
                scale=scale, diag_offset=diag_offset, window_left=window_left, window_right=window_right,
                mask_requires_grad=mask_requires_grad, dropout_p=dropout_p, softcap=softcap), _PLAIN_PARAMS_LIMIT)
        return params
    return AttentionParams(scale=scale, diag_offset=diag_offset, window_left=window_left, window_right=window_right,
                           mask=mask, mask_requires_grad=mask_requires_grad, dropout_p=dropout_p,
                           seed=(0, 0) if seed is None else seed, softcap=softcap)


_plain_params: dict = {}
_PLAIN_PARAMS_LIMIT = 1024


def _backend_argument_now(backend) -> str:
    """The ``backend=`` argument checked and lowercased (an unknown name raises at the call)."""
    return dispatch.requested(backend)[0]


try:  # a pure function of a constant argument, so compiled code may evaluate it once per traced value
    _backend_argument = torch._dynamo.assume_constant_result(_backend_argument_now)
except Exception:  # pragma: no cover - torch without dynamo
    _backend_argument = _backend_argument_now


def _uses_window(window_left, window_right, causal) -> bool:
    """Whether a call needs the window feature (a causal call's right bound of 0 is the causal feature)."""
    return window_left is not None or (window_right is not None and not causal)


# ---- running a call (shared by the eager path and the custom ops) ---------------------------------------------


def _front_end_answers(q, k, v) -> bool:
    """Problems the front end answers itself: shape inference (meta tensors), an empty size, D = 0 (v shares
    k's other sizes, so k's count covers them)."""
    return q.is_meta or q.numel() == 0 or k.numel() == 0 or v.shape[3] == 0


def _resolve(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right, dropout_p,
             softcap, mask_requires_grad, needs_grad):
    """The backend object for this call's request (None where the front end answers the problem itself);
    needs_grad: whether autograd differentiates the call (automatic selection then weighs forward+backward time)."""
    if _front_end_answers(q, k, v):
        return None
    name, source = dispatch.requested_on(backend or None, q.device.type)
    return dispatch.backend_for_call(q, k, v, mask, mask_requires_grad, dropout_p, softcap, is_causal,
                                     _uses_window(window_left, window_right, is_causal), name, source, diag_offset,
                                     needs_grad)


def _prepared_native(chosen, q, k, v, params):
    """``chosen``'s own differentiable path for calls like this one (Backend.native_call), or None where it has
    none (or the front end answers the call itself)."""
    return None if chosen is None else chosen.native_call(q, k, v, params)


def _run_forward(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right, dropout_p,
                 softcap, mask_requires_grad, needs_grad):
    """The custom op's forward: resolves the request, runs the backend's forward. Returns (backend or None, out,
    lse); None for a problem the front end answers itself (empty sizes, D = 0, meta tensors)."""
    params = _params(mask, mask_requires_grad, scale, is_causal, diag_offset, window_left, window_right, dropout_p,
                     seed, softcap)
    chosen = _resolve(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right,
                      dropout_p, softcap, mask_requires_grad, needs_grad)
    out, lse = _forward_on(chosen, q, k, v, params)
    return chosen, out, lse


def _forward_on(chosen, q, k, v, params):
    """(out, lse) of the backend ``chosen``'s forward; for None, the front end's own answer (_front_end_answers)."""
    if chosen is not None:
        return chosen.forward(q, k, v, params)
    if q.is_meta:  # shape inference only
        return layouts.output_buffer(q, v), layouts.lse_buffer(q)
    return _degenerate_forward(q, k, v, params)


def _run_backward(chosen, params, grad_out, q, k, v, out, lse, grad_lse):
    """The backward of a forward that ran on ``chosen`` (None: the front end's own answer)."""
    if chosen is not None:
        return chosen.backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)
    if q.is_meta:
        return layouts.grad_buffer(q), layouts.grad_buffer(k), layouts.grad_buffer(v), _meta_dmask(params)
    return _reference().backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)


def _degenerate_forward(q, k, v, params):
    """A problem with an empty dim or D = 0, answered as SDPA does: no key at all gives zeros (lse -inf),
    otherwise the reference's arithmetic, which handles empty and zero-width matrices."""
    out, lse = layouts.output_buffer(q, v), layouts.lse_buffer(q)
    if k.shape[2] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    ref_out, ref_lse = _reference().forward(q, k, v, params)
    return out.copy_(ref_out), lse.copy_(ref_lse)


def _meta_dmask(params):
    if not params.mask_requires_grad:
        return None
    return torch.empty(params.mask.shape, dtype=params.mask.dtype, device="meta")


def _reference():
    from mhattn.reference import ReferenceBackend

    global _REFERENCE
    if _REFERENCE is None:
        _REFERENCE = ReferenceBackend()
    return _REFERENCE


_REFERENCE = None


class _EagerAttention(torch.autograd.Function):
    """The eager path when a gradient is needed: selects once, keeps the chosen backend for the backward.
    Every tensor the backward reads is saved with save_for_backward, so changing one in place after the
    forward (the mask included) raises at the backward, as SDPA does."""

    @staticmethod
    def forward(ctx, q, k, v, mask, params, chosen):
        """``mask``: ``params.mask``, passed on its own for autograd to track; ``chosen`` as in _forward_on."""
        out, lse = _forward_on(chosen, q, k, v, params)
        ctx.set_materialize_grads(False)  # an unused lse (the usual case) sends no gradient
        ctx.chosen, ctx.params = chosen, params
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, _mask = ctx.saved_tensors  # unpacking checks the saved versions
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dmask = _run_backward(ctx.chosen, ctx.params, grad_out, q, k, v, out, lse, grad_lse)
        return dq, dk, dv, (dmask if ctx.params.mask_requires_grad else None), None, None


# ---- the custom ops (the torch.compile path) ------------------------------------------------------------------

# The backend each compiled forward ran on, by the address of the lse it returned: the compiled backward
# receives that lse and runs on the same backend. Addresses are reused only after an lse is freed, and then
# overwritten by the forward that made the new one; the oldest entries make room when it is full.
_forward_backends: dict = {}
_FORWARD_BACKENDS_LIMIT = 1 << 16
_forward_backends_lock = threading.Lock()


def _remember_backend(lse: torch.Tensor, chosen) -> None:
    if lse.numel() == 0:
        return
    with _forward_backends_lock:
        put_bounded(_forward_backends, lse.data_ptr(), chosen, _FORWARD_BACKENDS_LIMIT)


def _out_strides(q, v):
    return layouts.rows_major_strides(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


@torch.library.custom_op("mhattn::attention_forward", mutates_args=())
def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[torch.Tensor],
    backend: str, scale: float, is_causal: bool, diag_offset: int, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, softcap: Optional[float], mask_requires_grad: bool,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, out, lse = _run_forward(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left,
                                    window_right, dropout_p, softcap, mask_requires_grad, needs_grad)
    # Compiled graphs assume the layouts the fake implementation promises: every built-in backend writes
    # them (no copy); a third-party backend's other layout is copied into place.
    out = layouts.placed(out, _out_strides(q, v))
    lse = layouts.placed(lse, layouts.contiguous_strides(lse.shape))
    _remember_backend(lse, chosen)
    return out, lse


@_attention_forward.register_fake
def _(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap,
      mask_requires_grad, needs_grad):
    return layouts.output_buffer(q, v), layouts.lse_buffer(q)


@torch.library.custom_op("mhattn::attention_backward", mutates_args=())
def _attention_backward(
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[torch.Tensor], backend: str,
    scale: float, is_causal: bool, diag_offset: int, window_left: Optional[int], window_right: Optional[int],
    dropout_p: float, softcap: Optional[float], mask_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    params = _params(mask, mask_requires_grad, scale, is_causal, diag_offset, window_left, window_right, dropout_p,
                     seed, softcap)
    chosen = _forward_backends.get(lse.data_ptr()) if lse.numel() else None
    if chosen is None:  # not recorded (evicted, or a forward recomputed elsewhere): the request as it stands now
        chosen = _resolve(q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right,
                          dropout_p, softcap, mask_requires_grad, True)
    dq, dk, dv, dmask = _run_backward(chosen, params, grad_out, q, k, v, out, lse, grad_lse)
    dmask = q.new_empty(0) if dmask is None else layouts.placed(dmask, layouts.contiguous_strides(dmask.shape))
    return (layouts.placed(dq, layouts.grad_strides(q)), layouts.placed(dk, layouts.grad_strides(k)),
            layouts.placed(dv, layouts.grad_strides(v)), dmask)


@_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, mask, seed, backend, scale, is_causal, diag_offset, window_left,
      window_right, dropout_p, softcap, mask_requires_grad):
    # The mask gradient in the mask's broadcast 4-D shape, contiguous (what every built-in backend returns).
    dmask = mask.new_empty(mask.shape) if (mask is not None and mask_requires_grad) else q.new_empty(0)
    return layouts.grad_buffer(q), layouts.grad_buffer(k), layouts.grad_buffer(v), dmask


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, seed, backend, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap,
     mask_requires_grad, _needs_grad) = inputs
    out, lse = output
    ctx.mask_requires_grad = mask_requires_grad
    ctx.save_for_backward(q, k, v, out, lse, mask, seed)
    ctx.args = (backend, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, mask, seed = ctx.saved_tensors
    dq, dk, dv, dmask = torch.ops.mhattn.attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, mask, seed, *ctx.args, ctx.mask_requires_grad
    )
    dmask = dmask if ctx.mask_requires_grad else None
    return (dq, dk, dv, dmask) + (None,) * 11


_attention_forward.register_autograd(_backward, setup_context=_setup_context)
