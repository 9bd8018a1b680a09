"""``mhattn.MultiheadAttention``: ``torch.nn.MultiheadAttention`` with its attention run by mhattn.

The module is a subclass, so ``isinstance`` checks, parameter names, state_dict keys and the
initialisation are torch's own. Only ``forward`` is new: it does the projections, ``bias_k``/``bias_v``,
``add_zero_attn`` and the mask handling with the semantics of torch's slow path, then calls
:func:`mhattn.attention` (or, when the attention weights are asked for, the naive reference, which
materialises them). :func:`replace_multihead_attention` swaps the modules of an existing model.
"""


import collections
import copy
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from mhattn.arguments import host_checks_allowed
from mhattn.backends.base import AttentionParams
from mhattn.caches import kept_for
from mhattn.dropout_rng import draw_seed
from mhattn.errors import InputError
from mhattn.functional import attention
from mhattn.reference.naive import naive_attention

# The weights path computes half precision in float32, as the reference backend does.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class MultiheadAssertionError(InputError, AssertionError):
    """Bad input where ``torch.nn.MultiheadAttention`` raises ``AssertionError``; catchable as either."""


class MultiheadValueError(InputError):
    """Bad input where ``torch.nn.MultiheadAttention`` raises ``ValueError`` (InputError is one)."""


class MultiheadRuntimeError(InputError, RuntimeError):
    """Bad input where ``torch.nn.MultiheadAttention`` raises ``RuntimeError``; catchable as either."""


def _keeps_module_forward(module, args):
    """A forward pre-hook that does nothing.

    ``torch.nn.TransformerEncoderLayer`` has an inference fast path that reads ``self_attn``'s weights
    and runs a fused C++ layer without ever calling ``self_attn.forward``. It takes that path only when
    no module inside the layer has a forward hook or pre-hook, so this hook's presence is what sends
    the layer through ``self_attn(...)``, i.e. through mhattn. It is a module-level function so models
    holding the module stay picklable. TorchScript does not see it (see
    ``MultiheadAttention.__prepare_scriptable__``).
    """
    return None


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in ``torch.nn.MultiheadAttention`` whose attention runs on mhattn's backends.

    Construction, parameters, state_dict and ``forward``'s signature are torch's:
    ``MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None)``; a
    torch module's state_dict loads into it unchanged (and back).

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)``, with L the target and S the source length,
    N the batch, E = embed_dim:

    - query (L, E), (L, N, E) or with ``batch_first`` (N, L, E); key (S, kdim) / (S, N, kdim) /
      (N, S, kdim); value likewise with vdim. 2-D inputs are one unbatched sequence.
    - key_padding_mask (N, S) or (S,): bool (True = the key is ignored) or float (added).
    - attn_mask (L, S) or (N * num_heads, L, S): bool (True = NOT allowed) or float (added). Both masks
      may be given; as in torch they are summed after bool entries become -inf, and mixing a bool
      with a float mask warns (torch deprecates it).
    - is_causal: torch's hint that ``attn_mask`` is the causal mask. As in torch it needs ``attn_mask``
      (else ``RuntimeError``); with ``need_weights=False`` and no key_padding_mask the mask is then not
      read at all (even a mask that is not causal) and attention is causal with query i seeing keys
      j <= i (top-left; the extra ``bias_k``/zero keys count as keys S, S + 1); otherwise the hint is
      ignored and ``attn_mask`` is used.
    - dropout (the constructor's) applies only in training mode.

    Returns ``(attn_output, attn_weights)``: attn_output shaped like query with E features;
    attn_weights None when ``need_weights=False``, else the post-dropout attention probabilities
    (N, L, S') averaged over heads or (N, num_heads, L, S') with ``average_attn_weights=False``
    (batch dim dropped for unbatched input), S' = S plus the bias_k and zero-attention keys.

    ``need_weights=False`` runs :func:`mhattn.attention` (the dispatcher picks the backend). Each mask
    reaches it in its own size, as a broadcast view (key padding (N, 1, 1, S), a 2-D attn_mask (L, S),
    a 3-D one (N, heads, L, S)); only when both masks are given is their combination materialised, in
    their broadcast shape. ``need_weights=True`` runs the naive reference, which materialises the
    weights and is differentiable through autograd.

    Differences from torch, on purpose:

    - A query row that sees no key (every key masked) gives attention output 0 (so the module returns
      ``out_proj.bias`` there) and attention weights 0, with finite gradients. Torch gives NaN on its
      ``need_weights=True`` path (its CPU SDPA path gives 0, as here).
    - Dropout draws from mhattn's counter-based RNG (seeded from torch's default generator, so
      ``torch.manual_seed`` reproduces it), not torch's: same distribution, different draws.
    - There is no inference fast path and no NestedTensor input (torch only accepts those on its fast
      path); a nested input raises. Inside ``torch.nn.TransformerEncoderLayer`` this module carries a
      no-op forward pre-hook so the layer calls it instead of its fused kernel (see
      :func:`_keeps_module_forward`); ``torch.nn.TransformerEncoder`` must not convert its input to
      nested tensors, which :func:`replace_multihead_attention` switches off.
    - Bad input raises :class:`mhattn.InputError` subclasses that are also the ``AssertionError`` /
      ``RuntimeError`` torch raises for the same input.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        self.register_forward_pre_hook(_keeps_module_forward)

    def __prepare_scriptable__(self):
        """What ``torch.jit.script`` compiles: this module without the no-op pre-hook (TorchScript would
        type its argument tuple strictly). A scripted TransformerEncoderLayer may then take torch's fused
        inference path, which computes the same attention from the same weights."""
        scriptable = copy.copy(self)
        scriptable._forward_pre_hooks = collections.OrderedDict(
            (k, hook) for k, hook in self._forward_pre_hooks.items() if hook is not _keeps_module_forward)
        return scriptable

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        # TorchScript compiles only this signature; the body runs in Python (mhattn's dispatch is Python),
        # so torch.jit.script(module) works and a scripted model runs, but cannot be saved without Python.
        return self._forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                             is_causal)

    @torch.jit.ignore
    def _forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor],
        need_weights: bool,
        attn_mask: Optional[torch.Tensor],
        average_attn_weights: bool,
        is_causal: bool,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.is_nested:
                raise MultiheadAssertionError(
                    f"{name} is a NestedTensor; mhattn.MultiheadAttention takes padded tensors with a "
                    "key_padding_mask (build torch.nn.TransformerEncoder with enable_nested_tensor=False, "
                    "or convert the model with mhattn.replace_multihead_attention)"
                )
        # Identity decides the packed projections; record it before any reshaping makes new tensors.
        same_qkv = query is key and key is value
        same_kv = key is value
        is_batched = _check_ranks(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        _check_mask_dtypes(key_padding_mask, attn_mask)

        if is_causal and attn_mask is None:
            raise MultiheadRuntimeError(
                "is_causal=True is a hint that attn_mask is the causal mask, so attn_mask is needed, got None "
                "(torch.nn.Transformer.generate_square_subsequent_mask(L) builds one)"
            )
        # torch's rule: the hint replaces the mask only where nothing else needs the mask.
        causal = bool(is_causal) and key_padding_mask is None and not need_weights
        if causal:
            attn_mask = None

        # Internal layout: unbatched input becomes batch-first with N = 1; batched keeps its own layout,
        # with seq_dim the sequence dim (0 for (L, N, E), 1 for (N, L, E)).
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            seq_dim = 1
        else:
            seq_dim = 1 if self.batch_first else 0
        batch_dim = 1 - seq_dim
        batch, tgt_len, src_len = query.shape[batch_dim], query.shape[seq_dim], key.shape[seq_dim]
        _Self._check_shapes(self, query, key, value, key_padding_mask, attn_mask, batch_dim, seq_dim)

        q, k, v = _Self._project(self, query, key, value, same_qkv, same_kv)
        extra_keys = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, _bias_row(self.bias_k, batch, seq_dim)], dim=seq_dim)
            v = torch.cat([v, _bias_row(self.bias_v, batch, seq_dim)], dim=seq_dim)
            extra_keys += 1
        elif self.bias_k is not None or self.bias_v is not None:
            raise MultiheadAssertionError("bias_k and bias_v must be both set or both None")
        q, k, v = (_Self._split_heads(self, t, seq_dim) for t in (q, k, v))  # (N, H, len, head_dim) views
        if self.add_zero_attn:
            zeros = k.new_zeros(batch, self.num_heads, 1, self.head_dim)
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            extra_keys += 1

        mask = _merged_mask(attn_mask, key_padding_mask, batch, self.num_heads, tgt_len, src_len, extra_keys,
                            query.dtype)
        dropout_p = float(self.dropout) if self.training else 0.0
        if not 0.0 <= dropout_p <= 1.0:  # checked where it applies, as torch's dropout does
            raise MultiheadValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
        if need_weights:
            out, weights = _attention_with_weights(q, k, v, mask, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                weights = weights.squeeze(0)
        else:
            out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
            weights = None

        out = _Self._merge_heads(self, out, seq_dim)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(0)
        return out, weights

    # ---- pieces of forward -------------------------------------------------------------------------

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask, batch_dim, seq_dim):
        """Shapes against the module and each other, with inputs already 3-D in the internal layout."""
        if query.shape[-1] != self.embed_dim:
            raise MultiheadAssertionError(
                f"query must have embed_dim = {self.embed_dim} features (last dim), got shape {tuple(query.shape)}"
            )
        if self._qkv_same_embed_dim and key.shape != value.shape:
            raise MultiheadAssertionError(
                f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if key.shape[:2] != value.shape[:2]:
            raise MultiheadAssertionError(
                f"key and value must share their sequence and batch dims, got shapes {tuple(key.shape)} and "
                f"{tuple(value.shape)}"
            )
        for name, t, features in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != features:
                dim = "kdim" if name == "key" else "vdim"
                raise MultiheadRuntimeError(
                    f"{name} must have {dim} = {features} features (last dim), got shape {tuple(t.shape)}"
                )
        batch, tgt_len, src_len = query.shape[batch_dim], query.shape[seq_dim], key.shape[seq_dim]
        if key.shape[batch_dim] != batch:
            raise MultiheadRuntimeError(
                f"key must have the batch size of query ({batch}), got shapes query {tuple(query.shape)}, "
                f"key {tuple(key.shape)}"
            )
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, src_len):
            raise MultiheadAssertionError(
                f"key_padding_mask must have shape (N, S) = ({batch}, {src_len}) (or (S,) unbatched), "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if attn_mask is not None:
            want = (tgt_len, src_len) if attn_mask.dim() == 2 else (batch * self.num_heads, tgt_len, src_len)
            if tuple(attn_mask.shape) != want:
                form = "(L, S)" if attn_mask.dim() == 2 else "(N * num_heads, L, S)"
                raise MultiheadRuntimeError(f"attn_mask must have shape {form} = {want}, got {tuple(attn_mask.shape)}")

    def _project(self, query, key, value, same_qkv, same_kv):
        """The input projections, in the input's layout: (.., E) each, views of one packed result where
        the inputs are one tensor (one matmul instead of three)."""
        e = self.embed_dim
        bias = self.in_proj_bias
        if self.in_proj_weight is not None:
            weight = self.in_proj_weight
            if same_qkv:
                return F.linear(query, weight, bias).chunk(3, dim=-1)
            bq, bkv = (None, None) if bias is None else (bias[:e], bias[e:])
            q = F.linear(query, weight[:e], bq)
            if same_kv:
                k, v = F.linear(key, weight[e:], bkv).chunk(2, dim=-1)
                return q, k, v
            bk, bv = (None, None) if bias is None else (bias[e:2 * e], bias[2 * e:])
            return q, F.linear(key, weight[e:2 * e], bk), F.linear(value, weight[2 * e:], bv)
        bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3)
        return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                F.linear(value, self.v_proj_weight, bv))

    def _split_heads(self, t, seq_dim):
        """(N, len, E) or (len, N, E) -> (N, H, len, head_dim), a view (last dim stays contiguous)."""
        if seq_dim == 1:
            batch, length = t.shape[0], t.shape[1]
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        length, batch = t.shape[0], t.shape[1]
        return t.view(length, batch, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _merge_heads(self, out, seq_dim):
        """(N, H, L, head_dim) -> (N, L, E) or (L, N, E)."""
        batch, _, tgt_len, _ = out.shape
        if seq_dim == 1:
            return out.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim)
        return out.permute(2, 0, 1, 3).reshape(tgt_len, batch, self.embed_dim)


# _forward runs with self a scripted module after torch.jit.script, which has only the compiled methods:
# it calls the helper methods through the class.
_Self = MultiheadAttention


# ---- helpers -----------------------------------------------------------------------------------------


def _check_ranks(query, key, value, key_padding_mask, attn_mask, num_heads) -> bool:
    """Whether the input is batched; the ranks torch accepts for each argument."""
    if query.dim() not in (2, 3):
        raise MultiheadAssertionError(
            f"query must be 2-D (L, E) unbatched or 3-D batched, got a {query.dim()}-D tensor of shape "
            f"{tuple(query.shape)}"
        )
    is_batched = query.dim() == 3
    rank = query.dim()
    if key.dim() != rank or value.dim() != rank:
        raise MultiheadAssertionError(
            f"key and value must be {rank}-D like query, got {key.dim()}-D and {value.dim()}-D tensors"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != rank - 1:
        raise MultiheadAssertionError(
            f"key_padding_mask must be None or {rank - 1}-D ({'(N, S)' if is_batched else '(S,)'}) for "
            f"{rank}-D query, got a {key_padding_mask.dim()}-D tensor"
        )
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise MultiheadAssertionError(
                f"attn_mask must be None, 2-D (L, S) or 3-D (N * num_heads, L, S), got a {attn_mask.dim()}-D tensor"
            )
        if not is_batched and attn_mask.dim() == 3:
            want = (num_heads, query.shape[0], key.shape[0])
            if tuple(attn_mask.shape) != want:
                raise MultiheadAssertionError(
                    f"3-D attn_mask for unbatched query must have shape (num_heads, L, S) = {want}, "
                    f"got {tuple(attn_mask.shape)}"
                )
    return is_batched


def _check_mask_dtypes(key_padding_mask, attn_mask) -> None:
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise MultiheadAssertionError(
                f"{name} must be bool or floating point, got {str(mask.dtype).replace('torch.', '')}"
            )
    if key_padding_mask is not None and attn_mask is not None and key_padding_mask.dtype != attn_mask.dtype:
        # torch warns here too: mismatched mask types are deprecated there.
        warnings.warn(
            f"mismatched mask types: key_padding_mask is {str(key_padding_mask.dtype).replace('torch.', '')} "
            f"and attn_mask is {str(attn_mask.dtype).replace('torch.', '')}; torch.nn.MultiheadAttention "
            "deprecates this, pass both as bool or both as float",
            UserWarning,
            stacklevel=3,
        )


def _bias_row(bias, batch, seq_dim):
    """bias_k / bias_v (1, 1, E) as one extra key row for every batch entry, in the layout of seq_dim."""
    row = bias.reshape(1, 1, -1)
    return row.expand(batch, 1, -1) if seq_dim == 1 else row.expand(1, batch, -1)


def _merged_mask(attn_mask, key_padding_mask, batch, heads, tgt_len, src_len, extra_keys, dtype):
    """torch's masks as one mask in mhattn's convention, broadcasting to (N, H, L, S + extra_keys).

    attn_mask (L, S) stays 2-D, (N*H, L, S) becomes an (N, H, L, S) view, key_padding_mask (N, S) a
    (N, 1, 1, S) view: only combining the two materialises a tensor, of their broadcast shape. Bool
    masks stay bool (True = attend) when every given mask is bool; otherwise bool entries become -inf in
    the query's dtype and the masks are summed, exactly as torch does. The extra keys (bias_k, zero
    attention) are appended as visible, as torch pads its masks with 0.
    """
    parts = []
    if attn_mask is not None:
        parts.append(attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(batch, heads, tgt_len, src_len))
    if key_padding_mask is not None:
        parts.append(key_padding_mask.reshape(batch, 1, 1, src_len))
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        mask = _kept_inverse(parts[0]) if len(parts) == 1 else (parts[0] | parts[1]).logical_not_()
    else:
        floats = [torch.zeros_like(p, dtype=dtype).masked_fill_(p, float("-inf")) if p.dtype == torch.bool else p
                  for p in parts]
        mask = floats[0] if len(floats) == 1 else floats[0] + floats[1]
    if extra_keys:
        fill = True if mask.dtype == torch.bool else 0.0
        mask = torch.cat([mask, mask.new_full(mask.shape[:-1] + (extra_keys,), fill)], dim=-1)
    return mask


def _kept_inverse(mask: torch.Tensor) -> torch.Tensor:
    """~mask, the same tensor again for the same unchanged mask (its storage, layout and version): the layers of a
    model given one padding mask pass one mask on, so a backend that reads a mask's values back once per mask (the
    Triton backend's right-padding check, backends/triton/key_padding.py) does so once per step, not once per layer.
    An entry holds its mask, so no other tensor can take its address while the entry lives. Made anew while
    torch.compile traces (the graph holds the inversion) and during CUDA graph capture (a captured call must invert
    whatever the mask holds at each replay)."""
    if not host_checks_allowed(mask):
        return ~mask
    return kept_for(_inverses, mask, torch.logical_not, _INVERSES_LIMIT)


_inverses: dict = {}  # _kept_inverse's (mask, ~mask) by mask: a few padding masks are live at a time
_INVERSES_LIMIT = 16


def _attention_with_weights(q, k, v, mask, dropout_p):
    """Attention through the naive reference, which also returns the (post-dropout) probabilities.

    q (N, H, L, D), k and v (N, H, S, D), mask None or broadcasting to (N, H, L, S). Returns
    out (N, H, L, D) and probs (N, H, L, S) in q's dtype; differentiable through autograd.
    """
    batch, heads, tgt_len, head_dim = q.shape
    src_len = k.shape[2]
    compute = _UPCAST.get(q.dtype, q.dtype)
    if mask is not None:
        mask = mask.expand(batch, heads, tgt_len, src_len)
        if mask.dtype != torch.bool:
            mask = mask.to(compute)
    seed = (0, 0)
    if dropout_p >= 1.0:  # every weight dropped, as torch's dropout: zero weights, zero output
        out, _, probs = naive_attention(q.to(compute), k.to(compute), v.to(compute),
                                        AttentionParams(scale=params_scale(head_dim), mask=mask), return_probs=True)
        return (out * 0).to(q.dtype), (probs * 0).to(q.dtype)
    if dropout_p > 0.0:
        # Drawn as mhattn.attention draws it, so one torch.manual_seed gives the same keep-mask on both paths.
        seed = draw_seed(q.device)
    params = AttentionParams(scale=params_scale(head_dim), mask=mask,
                             dropout_p=dropout_p, seed=seed)
    out, _, probs = naive_attention(q.to(compute), k.to(compute), v.to(compute), params, return_probs=True)
    return out.to(q.dtype), probs.to(q.dtype)


def params_scale(head_dim: int) -> float:
    """The default score scale 1 / sqrt(D) (1 for D = 0)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


# ---- converting a model ------------------------------------------------------------------------------


def replace_multihead_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every ``torch.nn.MultiheadAttention`` in ``model`` for :class:`MultiheadAttention`, in place.

    Only modules whose type is exactly ``torch.nn.MultiheadAttention`` are swapped (subclasses, such
    as quantizable ones or a user's own, keep their behaviour). Each replacement is built with the old
    module's constructor arguments and takes over its Parameter objects (a strict state_dict load by
    assignment: same keys, same shapes, same tensors), so weights are shared rather than copied and
    optimizers or tied weights that hold them stay valid; its train/eval mode is the old one's. A
    module registered in several places is replaced by one shared new module. Forward hooks on the
    old modules are not carried over (a warning says so).

    ``torch.nn.TransformerEncoderLayer``'s inference fast path bypasses ``self_attn.forward``; the new
    modules carry a no-op forward pre-hook that makes the layer take its module path instead. Every
    ``torch.nn.TransformerEncoder`` that now holds an mhattn module gets ``use_nested_tensor = False``,
    because its nested-tensor path hands nested inputs to the layers (mhattn takes padded tensors and
    a key_padding_mask). Side effect: outputs at padded positions of ``src`` are then the computed
    values, as on torch's own non-nested path, instead of the zeros of the nested path.

    Returns ``model`` (or the new module when ``model`` itself is a ``torch.nn.MultiheadAttention``).
    """
    if type(model) is torch.nn.MultiheadAttention:
        return _converted(model)
    replaced = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is torch.nn.MultiheadAttention:
                if id(child) not in replaced:
                    replaced[id(child)] = _converted(child)
                setattr(parent, name, replaced[id(child)])
    for module in model.modules():
        if isinstance(module, torch.nn.TransformerEncoder) and any(
            isinstance(m, MultiheadAttention) for m in module.modules()
        ):
            module.use_nested_tensor = False
    return model


def _converted(old: torch.nn.MultiheadAttention) -> MultiheadAttention:
    weight = old.in_proj_weight if old.in_proj_weight is not None else old.q_proj_weight
    # Built on the meta device: no memory, no initialisation (and no draw from the user's RNG); every
    # tensor is then the old module's own.
    new = MultiheadAttention(
        old.embed_dim, old.num_heads, dropout=old.dropout, bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None, add_zero_attn=old.add_zero_attn, kdim=old.kdim, vdim=old.vdim,
        batch_first=old.batch_first, device="meta", dtype=weight.dtype,
    )
    old_state = old.state_dict(keep_vars=True)
    new_state = new.state_dict(keep_vars=True)
    if old_state.keys() != new_state.keys():
        raise InputError(
            f"cannot replace {type(old).__name__}: its state_dict keys {sorted(old_state)} differ from "
            f"mhattn.MultiheadAttention's {sorted(new_state)}"
        )
    for key, tensor in old_state.items():
        if tensor.shape != new_state[key].shape:
            raise InputError(
                f"cannot replace {type(old).__name__}: {key} has shape {tuple(tensor.shape)}, "
                f"mhattn.MultiheadAttention expects {tuple(new_state[key].shape)}"
            )
        owner_name, _, attr = key.rpartition(".")
        owner = new.get_submodule(owner_name) if owner_name else new
        setattr(owner, attr, tensor)
    new.train(old.training)
    hooks = sum(len(getattr(old, d, {})) for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                    "_backward_pre_hooks"))
    if hooks:
        warnings.warn(
            f"replace_multihead_attention: {hooks} hook(s) registered on a torch.nn.MultiheadAttention were "
            "not carried over to its mhattn replacement",
            UserWarning,
            stacklevel=3,
        )
    return new
