"""``mhattn.attention``: scaled dot-product attention on the backend the dispatcher picks, with autograd.

The public function validates and canonicalises its arguments (layout, masks, causal alignment), then
calls the ``mhattn::attention_forward`` custom op. The op selects the backend from a :class:`Problem`
and the request captured at the call (argument > ``use_backend`` > ``MHATTN_BACKEND`` > auto); its
backward is a second custom op that runs on the same backend. Both ops have fake implementations,
so ``torch.compile(fullgraph=True)`` traces a call without a graph break.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from mhattn import dispatch
from mhattn.backends.base import AttentionParams
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
        key: (..., Hkv, Nk, D), same leading dims, dtype and device as ``query``.
        value: (..., Hkv, Nk, Dv).
        attn_mask: None; a bool tensor (True = attend) or float tensor (added to the scores) that
            broadcasts to (..., Hq, Nq, Nk); or ``torch.nn.attention.bias.causal_lower_right(Nq, Nk)``
            / ``causal_upper_left(Nq, Nk)`` for causal attention aligned bottom-right / top-left.
        dropout_p: probability of dropping an attention weight (applied whenever > 0, as SDPA does).
        is_causal: causal attention aligned top-left (query i sees keys j <= i), as SDPA's.
        scale: score scale; default 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (query head h uses key/value head h // (Hq // Hkv)).
        window: (left, right): query i sees keys j with -left <= j - i - offset <= right, where offset is
            Nk - Nq for a ``causal_lower_right`` mask and 0 otherwise; None or -1 = unbounded side.
        softcap: if given, scores become softcap * tanh(scores / softcap) before masking.
        return_lse: also return the per-row natural-log log-sum-exp (..., Hq, Nq), float32; a gradient
            flowing into it reaches q, k, v (and a float mask) like the output's.
        backend: name of the backend to use ("auto", "triton", "cupy", "sdpa", "reference", ...).

    Returns:
        (..., Hq, Nq, Dv) in the input dtype; with ``return_lse`` a tuple ``(out, lse)``. A query row
        that sees no key gives 0 (and lse -inf).
    """
    call = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap)
    name, source = _requested_backend(backend)
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**32, (2,), dtype=torch.int64)  # torch's CPU generator: manual_seed reproduces it
    else:
        seed = None
    args = (call.q, call.k, call.v, call.mask, seed, name, source, call.scale, call.is_causal, call.diag_offset,
            call.window_left, call.window_right, float(dropout_p), call.softcap, call.mask_requires_grad)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.mhattn.attention_forward(*args)
    else:
        # Eager calls skip the custom op's dispatch (about 100 us a call on a fast host), which would
        # dominate short sequences; the computation and the chosen backend are the same.
        out, lse = _EagerAttention.apply(*args)
    out = out.reshape(call.out_shape)
    if return_lse:
        return out, lse.reshape(call.out_shape[:-1])
    return out


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            window=None, softcap=None, return_lse=False, backend=None) -> dispatch.Decision:
    """What :func:`attention` would do with these arguments: ``str()`` of the result shows the problem,
    the request and where it came from, the choice, and every backend's reasons."""
    call = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap)
    name, source = dispatch.requested(backend)
    params = call.params(seed=(0, 0), dropout_p=float(dropout_p))  # the seed does not affect the choice
    problem = Problem.from_tensors(call.q, call.k, call.v, params, causal=call.is_causal,
                                   window=call.window_left is not None or call.window_right is not None)
    return dispatch.decide(problem, name, source)


# ---- argument checking and canonical form --------------------------------------------------------


@dataclass
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    scale: float
    is_causal: bool
    diag_offset: int
    window_left: Optional[int]
    window_right: Optional[int]
    softcap: Optional[float]
    out_shape: tuple

    @property
    def mask_requires_grad(self) -> bool:
        return self.mask is not None and self.mask.requires_grad and self.mask.dtype != torch.bool

    def params(self, seed, dropout_p) -> AttentionParams:
        return _params(self.mask, self.mask_requires_grad, self.scale, self.is_causal, self.diag_offset, self.window_left,
                       self.window_right, dropout_p, seed, self.softcap)


def _params(mask, mask_requires_grad, scale, is_causal, diag_offset, window_left, window_right, dropout_p, seed,
            softcap):
    right = window_right
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return AttentionParams(
        scale=scale,
        diag_offset=diag_offset,
        window_left=window_left,
        window_right=right,
        mask=mask,
        mask_requires_grad=bool(mask_requires_grad),
        dropout_p=dropout_p,
        seed=seed,
        softcap=softcap,
    )


def _fmt_dtype(dtype):
    return str(dtype).replace("torch.", "")


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, softcap) -> _Call:
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise InputError(f"{arg} must have at least 3 dims (..., heads, seq, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise InputError(f"{arg} must be a floating-point tensor, got dtype {_fmt_dtype(t.dtype)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise InputError(
            "query, key and value must have one dtype, got "
            f"{_fmt_dtype(query.dtype)}, {_fmt_dtype(key.dtype)}, {_fmt_dtype(value.dtype)}"
        )
    if not (query.device == key.device == value.device):
        raise InputError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    if not (query.dim() == key.dim() == value.dim()):
        raise InputError(
            f"query, key and value must have the same number of dims, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        raise InputError(
            f"query, key and value must share their batch dims, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise InputError(f"query and key must have the same head dim (last dim), got {query.shape[-1]} and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise InputError(f"key and value must have the same sequence length (dim -2), got {key.shape[-2]} and {value.shape[-2]}")
    if key.shape[-3] != value.shape[-3]:
        raise InputError(f"key and value must have the same number of heads (dim -3), got {key.shape[-3]} and {value.shape[-3]}")
    heads_q, heads_kv = query.shape[-3], key.shape[-3]
    if heads_q != heads_kv:
        if not enable_gqa:
            raise InputError(
                f"query has {heads_q} heads but key/value have {heads_kv}: pass enable_gqa=True for grouped-query attention"
            )
        if heads_kv == 0 or heads_q % heads_kv:
            raise InputError(f"with enable_gqa, query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    head_dim = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale must be a finite float or None, got {scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0 or not math.isfinite(softcap)):
        raise InputError(f"softcap must be a positive finite float or None, got {softcap!r}")
    window_left, window_right = _window(window)

    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    diag_offset = 0
    causal = bool(is_causal)
    mask = None
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
    elif attn_mask is not None:
        if is_causal:
            raise InputError("is_causal=True cannot be combined with an explicit attn_mask tensor (as in SDPA)")
        mask = _canonical_mask(attn_mask, query, seqlen_q, seqlen_k)

    # Collapse leading dims into one batch dim (a view whenever the strides allow).
    batch_shape = query.shape[:-3]
    q = _to4d(query)
    k = _to4d(key)
    v = _to4d(value)
    if mask is not None:
        mask = mask.expand(*batch_shape, heads_q, seqlen_q, seqlen_k)
        mask = mask.unsqueeze(0) if mask.dim() == 3 else mask.reshape(-1, heads_q, seqlen_q, seqlen_k)
    out_shape = tuple(batch_shape) + (heads_q, seqlen_q, value.shape[-1])
    return _Call(q, k, v, mask, float(scale), causal, diag_offset, window_left, window_right,
                 None if softcap is None else float(softcap), out_shape)


def _window(window):
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


def _canonical_mask(attn_mask, query, seqlen_q, seqlen_k):
    if not isinstance(attn_mask, torch.Tensor):
        raise InputError(
            "attn_mask must be None, a bool or float tensor, or a torch.nn.attention.bias causal object, "
            f"got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise InputError(f"attn_mask must be bool (True = attend) or floating point (added), got {_fmt_dtype(attn_mask.dtype)}")
    if attn_mask.device != query.device:
        raise InputError(f"attn_mask must be on the device of query ({query.device}), got {attn_mask.device}")
    target = tuple(query.shape[:-3]) + (query.shape[-3], seqlen_q, seqlen_k)
    try:
        shape = torch.broadcast_shapes(tuple(attn_mask.shape), target)
    except RuntimeError:
        shape = None
    if shape != target:
        raise InputError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., Hq, Nq, Nk) = {target}")
    return attn_mask


def _to4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        out = t
    elif t.dim() == 3:
        out = t.unsqueeze(0)
    else:
        out = t.reshape(-1, *t.shape[-3:])
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        out = out.contiguous()  # kernels need a contiguous last dim; other strides are kept
    return out


def _requested_backend(backend):
    # Resolved outside the op, at the call (or at trace time under torch.compile), so the choice is
    # the one in force where the user called attention(), and the backward reuses it.
    return _requested_constant(backend)


def _requested_name_impl(backend):
    return dispatch.requested(backend)


try:
    _requested_constant = torch._dynamo.assume_constant_result(_requested_name_impl)
except Exception:  # pragma: no cover - torch without dynamo
    _requested_constant = _requested_name_impl


# ---- the custom ops --------------------------------------------------------------------------------


def _seed_words(seed: Optional[torch.Tensor]):
    if seed is None:
        return (0, 0)
    words = seed.tolist()
    return int(words[0]), int(words[1])


def _problem_and_params(q, k, v, mask, mask_requires_grad, seed, scale, is_causal, diag_offset, window_left,
                        window_right, dropout_p, softcap):
    params = _params(mask, mask_requires_grad, scale, is_causal, diag_offset, window_left, window_right, dropout_p,
                     _seed_words(seed), softcap)
    problem = Problem.from_tensors(q, k, v, params, causal=is_causal,
                                   window=window_left is not None or window_right is not None)
    return problem, params


@torch.library.custom_op("mhattn::attention_forward", mutates_args=())
def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[torch.Tensor],
    backend: str, source: str, scale: float, is_causal: bool, diag_offset: int, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, softcap: Optional[float], mask_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    problem, params = _problem_and_params(q, k, v, mask, mask_requires_grad, seed, scale, is_causal, diag_offset, window_left,
                                          window_right, dropout_p, softcap)
    chosen = dispatch.select(problem, backend, source)
    out, lse = chosen.forward(q, k, v, params)
    # Compiled graphs assume the layouts the fake implementation promises; backends may differ.
    return _in_layout(out, _forward_out_layout(q, v)), _in_layout(lse, _contiguous_layout(lse))


def _forward_out_layout(q, v):
    """(shape, strides) of the op's output: (B, H, N, Dv) with (B, N, H, Dv) memory, one token's heads side
    by side (what the Triton backend writes, and a view of (B, N, H * Dv) after a transpose)."""
    batch, heads, seqlen = q.shape[:3]
    dim_v = v.shape[-1]
    return (batch, heads, seqlen, dim_v), (seqlen * heads * dim_v, dim_v, heads * dim_v, 1)


def _contiguous_layout(t):
    return tuple(t.shape), torch.empty(tuple(t.shape), device="meta").stride()


def _grad_layout(t):
    """The layout torch.empty_like(t) gives (a dense t keeps its strides; else contiguous)."""
    return tuple(t.shape), torch.empty_like(t, device="meta").stride()


def _in_layout(t, layout):
    shape, strides = layout
    if tuple(t.stride()) == tuple(strides) or t.numel() == 0:
        return t
    placed = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)
    placed.copy_(t)
    return placed


@_attention_forward.register_fake
def _(q, k, v, mask, seed, backend, source, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap,
      mask_requires_grad):
    shape, strides = _forward_out_layout(q, v)
    out = q.new_empty_strided(shape, strides)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


@torch.library.custom_op("mhattn::attention_backward", mutates_args=())
def _attention_backward(
    grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], seed: Optional[torch.Tensor], backend: str,
    source: str, scale: float, is_causal: bool, diag_offset: int, window_left: Optional[int], window_right: Optional[int],
    dropout_p: float, softcap: Optional[float], mask_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    problem, params = _problem_and_params(q, k, v, mask, mask_requires_grad, seed, scale, is_causal, diag_offset, window_left,
                                          window_right, dropout_p, softcap)
    chosen = dispatch.select(problem, backend, source)
    dq, dk, dv, dmask = chosen.backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)
    if dmask is None:
        dmask = q.new_empty(0)
    else:
        dmask = _in_layout(dmask, _grad_layout(mask))
    return (_in_layout(dq, _grad_layout(q)), _in_layout(dk, _grad_layout(k)), _in_layout(dv, _grad_layout(v)),
            dmask)


@_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, mask, seed, backend, source, scale, is_causal, diag_offset, window_left,
      window_right, dropout_p, softcap, mask_requires_grad):
    dmask = mask.new_empty(mask.shape, dtype=mask.dtype) if (mask is not None and mask_requires_grad) else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, seed, backend, source, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap,
     mask_requires_grad) = inputs
    out, lse = output
    ctx.mask_requires_grad = mask_requires_grad
    ctx.save_for_backward(q, k, v, out, lse, mask, seed)
    ctx.args = (backend, source, scale, is_causal, diag_offset, window_left, window_right, dropout_p, softcap)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, mask, seed = ctx.saved_tensors
    dq, dk, dv, dmask = torch.ops.mhattn.attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, mask, seed, *ctx.args, ctx.mask_requires_grad
    )
    dmask = dmask if ctx.mask_requires_grad else None
    return (dq, dk, dv, dmask) + (None,) * 11


_attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager-mode twin of the custom ops: selects once, keeps the chosen backend for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, seed, backend, source, scale, is_causal, diag_offset, window_left, window_right,
                dropout_p, softcap, mask_requires_grad):
        problem, params = _problem_and_params(q, k, v, mask, mask_requires_grad, seed, scale, is_causal, diag_offset,
                                              window_left, window_right, dropout_p, softcap)
        chosen = dispatch.select(problem, backend, source)
        out, lse = chosen.forward(q, k, v, params)
        ctx.set_materialize_grads(False)  # an unused lse (the usual case) sends no gradient
        ctx.chosen, ctx.params = chosen, params
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dmask = ctx.chosen.backward(grad_out, q, k, v, out, lse, ctx.params, grad_lse=grad_lse)
        return (dq, dk, dv, dmask if ctx.params.mask_requires_grad else None) + (None,) * 11
