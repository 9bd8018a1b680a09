"""KV-cache and varlen attention by definition: one dense reference call per sequence.

Each sequence's keys are gathered into a plain (1, Hkv, L, D) tensor (through the block table for a
paged cache) and its queries into (1, Hq, Nq, D); the dense reference then runs with that sequence's
own diagonal. Slow on purpose (a Python loop over sequences, O(N^2) memory): the gold standard the
kernels are checked against and the CPU path.
"""

from __future__ import annotations

import torch

from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams, KVCache, Packing


def cached_keys(cache: KVCache, batch_index: int, length: int):
    """(k, v) of sequence ``batch_index``'s first ``length`` cached keys, each (1, Hkv, length, D)."""
    if not cache.paged:
        return cache.k[batch_index:batch_index + 1, :, :length], cache.v[batch_index:batch_index + 1, :, :length]
    block_size = cache.k.shape[2]
    num_blocks = -(-length // block_size)
    pages = cache.block_table[batch_index, :num_blocks].long()

    def gather(pool):
        heads, dim = pool.shape[1], pool.shape[3]
        rows = pool[pages].transpose(0, 1).reshape(heads, num_blocks * block_size, dim)
        return rows[:, :length].unsqueeze(0)

    return gather(cache.k), gather(cache.v)


def _empty_rows(out, lse):
    out.zero_()
    lse.fill_(float("-inf"))


def kvcache_forward(backend, q, cache: KVCache, params: AttentionParams):
    """q (B, Hq, Nq, D) over each sequence's first cache.seqlens[b] keys; query row i of sequence b at
    position L_b - Nq + i. Returns (out (B, Hq, Nq, Dv), lse (B, Hq, Nq) float32)."""
    batch, heads_q, seqlen_q, _ = q.shape
    dim_v = cache.v.shape[-1]
    out = q.new_empty(batch, heads_q, seqlen_q, dim_v)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=layouts.lse_dtype(q.dtype), device=q.device)
    for b, length in enumerate(cache.seqlens.tolist()):
        if length == 0:
            _empty_rows(out[b], lse[b])
            continue
        k, v = cached_keys(cache, b, length)
        out[b:b + 1], lse[b:b + 1] = backend.forward(q[b:b + 1], k, v, params.replace(diag_offset=length - seqlen_q))
    return out, lse


def _sequences(packing: Packing):
    """(b, q_start, q_end, k_start, k_end) of every sequence."""
    cu_q = packing.cu_seqlens_q.tolist()
    cu_k = packing.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield b, cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]


def _dense(t, start, end):
    """Rows start..end-1 of a packed (total, H, D) tensor as a (1, H, n, D) view."""
    return t[start:end].transpose(0, 1).unsqueeze(0)


def _keep(params: AttentionParams, packing: Packing, heads_q: int, device):
    """The batch's dropout keep-mask (B, Hq, max_seqlen_q, max_seqlen_k): sequence b draws the words of batch
    index b at its own (query, key) positions, as the kernels do; None without dropout."""
    if params.dropout_p == 0.0:
        return None
    from mhattn.dropout_rng import keep_mask

    return keep_mask(params.seed, packing.batch, heads_q, packing.max_seqlen_q, packing.max_seqlen_k,
                     params.dropout_p, device=device)


def varlen_forward(backend, q, k, v, packing: Packing, params: AttentionParams):
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv). Returns (out (total_q, Hq, Dv),
    lse (Hq, total_q) float32)."""
    total_q, heads_q, _ = q.shape
    out = q.new_empty(total_q, heads_q, v.shape[-1])
    lse = torch.empty(heads_q, total_q, dtype=layouts.lse_dtype(q.dtype), device=q.device)
    keep = _keep(params, packing, heads_q, q.device)
    for b, qs, qe, ks, ke in _sequences(packing):
        if qe == qs:
            continue
        if ke == ks:
            _empty_rows(out[qs:qe], lse[:, qs:qe])
            continue
        keep_b = None if keep is None else keep[b:b + 1, :, :qe - qs, :ke - ks]
        out_b, lse_b = backend.forward(_dense(q, qs, qe), _dense(k, ks, ke), _dense(v, ks, ke), params, keep=keep_b)
        out[qs:qe] = out_b[0].transpose(0, 1)
        lse[:, qs:qe] = lse_b[0]
    return out, lse


def varlen_backward(backend, grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams, grad_lse=None):
    """(dq, dk, dv) of :func:`varlen_forward`, shaped like q, k, v."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    keep = _keep(params, packing, q.shape[1], q.device)
    for b, qs, qe, ks, ke in _sequences(packing):
        if qe == qs or ke == ks:
            continue  # no query or no key: every gradient of the sequence is 0
        keep_b = None if keep is None else keep[b:b + 1, :, :qe - qs, :ke - ks]
        glse = None if grad_lse is None else grad_lse[:, qs:qe].unsqueeze(0)
        grads = backend.backward(_dense(grad_out, qs, qe), _dense(q, qs, qe), _dense(k, ks, ke), _dense(v, ks, ke),
                                 _dense(out, qs, qe), lse[:, qs:qe].unsqueeze(0), params, grad_lse=glse, keep=keep_b)
        for full, part, start, end in ((dq, grads[0], qs, qe), (dk, grads[1], ks, ke), (dv, grads[2], ks, ke)):
            full[start:end] = part[0].transpose(0, 1)
    return dq, dk, dv
