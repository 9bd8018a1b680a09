"""Hugging Face transformers on mhattn: ``register()`` makes ``attn_implementation="mhattn"`` available.

    import mhattn.integrations.transformers as mhattn_hf
    mhattn_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mhattn")

It registers one attention function with transformers' ``AttentionInterface`` and one mask function with its
``AttentionMaskInterface``. As for the flash-attention implementations, the mask function hands the attention
a 2-D padding mask (or None when nothing is padded) instead of a 4-D mask; the attention then runs

- packed sequences on :func:`mhattn.varlen_attention`: from the ``cu_seq_lens_q/k`` and ``max_length_q/k``
  keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or from position ids that
  restart inside one row (``DataCollatorWithFlattening``'s default);
- everything else on :func:`mhattn.attention`: causal attention aligned bottom-right (a decoding step with
  the cache sees all cached keys), sliding windows and softcap from the model's keyword arguments, and the
  padding mask as a boolean mask: a (B, 1, 1, Nk) key-padding mask beside the causal and window bounds where
  queries and keys are as many (a prompt, a training batch: the kernels then read one row of it per key block
  and skip the padded blocks past each sequence's end); for one query row (a decoding step) the same key-padding
  mask, which is all it needs; else one mask of the queries' rows with the bounds in it, made once for the layers
  of a step.

Requires transformers >= 5 (the optional extra ``mhattn[transformers]``); importing this module does not
import transformers, ``register()`` does.
"""

from __future__ import annotations

import torch

import mhattn
from mhattn.caches import kept_for, put_bounded

NAME = "mhattn"


def register(name: str = NAME) -> None:
    """Register ``name`` (default "mhattn") with transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """The mask the attention receives: the (B, kv_length) bool padding mask (True = a real token), or None
    when no token is padded. Causal, window and packing bounds are applied by the attention itself."""
    if kwargs.get("use_vmap"):
        # transformers sets it for custom (or/and) mask functions, which a padding mask cannot express.
        raise NotImplementedError("attn_implementation='mhattn' supports causal, sliding-window, padding and packed "
                                  "masks; this model combines custom mask functions (use 'sdpa' or 'eager')")
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function contract: query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D); returns
    ((B, Nq, Hq, Dv), None) (no attention weights)."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("attn_implementation='mhattn' does not return attention weights (use 'eager')")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap = kwargs.get("softcap")
    sliding_window = kwargs.get("sliding_window")
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, -1 if is_causal else sliding_window - 1)
    batch, heads_q, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]

    packed = _packed_lengths(query, key, attention_mask, kwargs)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
        out = mhattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, is_causal=is_causal,
                                      scale=scaling, enable_gqa=True, window=window, softcap=softcap)
        return out.reshape(batch, seqlen_q, heads_q, -1), None

    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seqlen_k):
            raise ValueError(f"attn_implementation='mhattn' expects a (batch, kv_length) = {(batch, seqlen_k)} padding "
                             f"mask from its mask function, got shape {tuple(attention_mask.shape)}")
        if seqlen_q == seqlen_k:
            # Queries and keys of one length (a prompt, a training batch): the top-left and bottom-right diagonals
            # coincide, so the causal and window bounds go to mhattn.attention as its window, and the padding stays
            # a (B, 1, 1, Nk) key-padding mask, which the kernels read a row of keys at a time (skipping the key
            # blocks past each sequence's last token) instead of a (B, 1, Nq, Nk) mask made for the call.
            mask = attention_mask[:, None, None, :].to(torch.bool)
            window = _band(is_causal, window)
        elif seqlen_q == 1 and window is None:
            # One query row (a decoding step) sits on the bottom-right diagonal and sees every key: the causal bound
            # hides none, so the padding alone is the mask, as a view of it that every layer of the step shares (what
            # the backends make once per mask, such as the Triton backend's key bounds, is then made once a step,
            # not once a layer).
            mask = attention_mask[:, None, None, :].to(torch.bool)
        else:
            mask = _step_mask(attention_mask, seqlen_q, is_causal, window)
            window = None  # inside the mask
    elif is_causal and (seqlen_q > 1 or window is not None):
        # Bottom-right: the queries are the newest tokens (a window is relative to that diagonal too).
        mask = torch.nn.attention.bias.causal_lower_right(seqlen_q, seqlen_k)
    out = mhattn.attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True,
                           window=window, softcap=softcap)
    return out.transpose(1, 2), None


def _band(is_causal, window):
    """mhattn.attention's window (top-left, which is the bottom-right one when Nq = Nk) for the causal bound and a
    sliding window (left, right) (-1: unbounded side); None when neither bounds anything."""
    left, right = window if window is not None else (-1, -1)
    if is_causal:
        right = 0  # no key after the diagonal, whatever the window allows to its right
    return None if (left, right) == (-1, -1) else (left, right)


# The (B, 1, Nq, Nk) masks made from a step's padding mask, so that all the layers of a step share one: per argument
# set (Nq, causal, window), caches.kept_for's entry for the newest padding mask; at most STEP_MASK_KINDS argument sets
# (a model's layer kinds: full and sliding-window attention, say).
_step_masks: dict = {}
STEP_MASK_KINDS = 8


def _step_mask(padding, seqlen_q, is_causal, window):
    """_padded_causal_mask, made once per padding mask (each layer of a step gets the same one) and argument set; made
    afresh while torch.compile traces."""
    if torch.compiler.is_compiling():
        return _padded_causal_mask(padding, seqlen_q, is_causal, window)
    kind = (seqlen_q, is_causal, window)
    kept = _step_masks.get(kind)
    if kept is None:
        kept = put_bounded(_step_masks, kind, {}, STEP_MASK_KINDS)
    return kept_for(kept, padding, lambda mask: _padded_causal_mask(mask, seqlen_q, is_causal, window), 1)


def _padded_causal_mask(padding, seqlen_q, is_causal, window):
    """(B, 1, Nq, Nk) bool: the padding mask and the causal/window bounds around the bottom-right diagonal."""
    seqlen_k = padding.shape[1]
    rel = (torch.arange(seqlen_k, device=padding.device)[None, :]
           - torch.arange(seqlen_q, device=padding.device)[:, None] - (seqlen_k - seqlen_q))
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=padding.device)
    if is_causal:
        allowed &= rel <= 0
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= rel >= -left
        if right >= 0:
            allowed &= rel <= right
    return padding[:, None, None, :] & allowed


def _packed_lengths(query, key, attention_mask, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the batch row packs several sequences, else
    None: from the flash-attention keyword arguments, or from position ids that restart (batch 1, no padding)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if (position_ids is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]
            or query.shape[2] < 2):
        return None
    positions = position_ids.reshape(-1)
    if positions.numel() != query.shape[2]:
        return None
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).reshape(-1) + 1
    if starts.numel() == 0:
        return None
    total = positions.numel()
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), total)])
    cu = bounds.to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return cu, cu, longest, longest
