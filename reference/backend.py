"""The reference backend: the naive attention wrapped in the backend contract (CPU and CUDA, any dtype)."""

from __future__ import annotations

import torch

from mhattn.backends import layouts
from mhattn.backends.base import FEATURES, OPERATIONS, AttentionParams, Backend, Capabilities, KVCache, Packing
from mhattn.reference.naive import naive_attention, visible

# Half-precision inputs are computed in float32 so the fallback is as accurate as a fused kernel.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class ReferenceBackend(Backend):
    name = "reference"
    description = "naive PyTorch attention materialising S and P (O(N^2) memory); CPU path and gold standard"
    capabilities = Capabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        min_head_dim=1,
        max_head_dim=1 << 20,
        min_compute_capability=None,
        features=frozenset(FEATURES),
        operations=frozenset(OPERATIONS),
    )

    @staticmethod
    def _compute(q, k, v, params, mask, keep=None):
        dtype = _UPCAST.get(q.dtype, q.dtype)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        return naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), params, mask=mask, keep=keep)

    def forward(self, q, k, v, params: AttentionParams, keep=None):
        """As :meth:`Backend.forward`; ``keep`` (B, Hq, Nq, Nk) bool overrides the dropout keep-mask drawn
        from ``params.seed`` (the varlen path passes each sequence's slice of the batch's mask)."""
        out, lse = self._compute(q, k, v, params, params.mask, keep)
        # Written in the layouts every built-in backend uses (mhattn.backends.layouts).
        return layouts.output_buffer(q, v).copy_(out), layouts.lse_buffer(q).copy_(lse)

    def forward_kvcache(self, q, cache: KVCache, params: AttentionParams):
        from mhattn.reference.packed import kvcache_forward

        return kvcache_forward(self, q, cache, params)

    def forward_varlen(self, q, k, v, packing: Packing, params: AttentionParams):
        from mhattn.reference.packed import varlen_forward

        return varlen_forward(self, q, k, v, packing, params)

    def backward_varlen(self, grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams,
                        grad_lse=None):
        from mhattn.reference.packed import varlen_backward

        return varlen_backward(self, grad_out, q, k, v, out, lse, packing, params, grad_lse)

    def backward(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None, keep=None):
        """As :meth:`Backend.backward`; ``keep`` as in :meth:`forward`."""
        # The backward written out (custom ops run below autograd, so no recording here):
        #   dV = Pd^T dO,  dPd = dO V^T,  dP = dPd * keep / (1 - p),
        #   dS = P * (dP - delta) with delta = rowsum(dO * O) - grad_lse,
        #   dmask = dS (float mask), through softcap: dS *= 1 - tanh^2,  dQ = scale dS K,  dK = scale dS^T Q.
        dtype = _UPCAST.get(q.dtype, q.dtype)
        qc, kc, vc, doc, oc = (t.to(dtype) for t in (q, k, v, grad_out, out))
        batch, heads_q, seqlen_q, _ = q.shape
        heads_kv, seqlen_k = k.shape[1], k.shape[2]
        group = heads_q // heads_kv if heads_kv else 1  # no head at all: nothing to group
        if group > 1:
            kc = kc.repeat_interleave(group, dim=1)
            vc = vc.repeat_interleave(group, dim=1)
        mask = params.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        raw = torch.matmul(qc, kc.transpose(-1, -2)) * params.scale
        capped = params.softcap * torch.tanh(raw / params.softcap) if params.softcap is not None else raw
        scores = capped
        allowed = visible(seqlen_q, seqlen_k, params, device=q.device)
        if mask is not None:
            if mask.dtype == torch.bool:
                allowed = mask if allowed is None else (allowed & mask)
            else:
                scores = scores + mask
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse_c = lse.to(dtype)[..., None]
        probs = torch.exp(scores - torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), lse_c))
        probs = torch.where(torch.isinf(lse_c), torch.zeros_like(probs), probs)

        grad_probs = torch.matmul(doc, vc.transpose(-1, -2))
        dropped = probs
        if params.dropout_p > 0.0:
            if keep is None:
                keep = self.dropout_keep_mask(batch, heads_q, seqlen_q, seqlen_k, params, q.device)
            keep = keep.to(dtype) / (1.0 - params.dropout_p)
            dropped = probs * keep
            grad_probs = grad_probs * keep
        delta = (doc * oc).sum(-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), grad_lse.to(dtype)[..., None])
        grad_scores = probs * (grad_probs - delta)
        dmask = grad_scores if params.mask_requires_grad else None
        if params.softcap is not None:
            grad_scores = grad_scores * (1.0 - (capped / params.softcap) ** 2)
        dv = torch.matmul(dropped.transpose(-1, -2), doc)
        dq = torch.matmul(grad_scores, kc) * params.scale
        dk = torch.matmul(grad_scores.transpose(-1, -2), qc) * params.scale
        if group > 1:
            dk = dk.view(batch, heads_kv, group, seqlen_k, -1).sum(2)
            dv = dv.view(batch, heads_kv, group, seqlen_k, -1).sum(2)
        if dmask is not None:
            dmask = dmask.to(params.mask.dtype)
        return (layouts.grad_buffer(q).copy_(dq), layouts.grad_buffer(k).copy_(dk), layouts.grad_buffer(v).copy_(dv),
                dmask)
