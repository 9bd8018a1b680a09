"""Conformance of the KV-cache and varlen entry points (``forward_kvcache``, ``forward_varlen``,
``backward_varlen``): the inputs of a "kvcache" or "varlen" case and how its results are judged.

Like the dense cases: inputs drawn from the case's seed, NaN-poisoned allocations, the float64 reference
as gold and the reference in the input dtype as the low-precision bar (CONFORMANCE.md's rule). The gold is
the naive reference run on each sequence alone (its keys gathered from the cache, its rows cut out of the
packed tensors).

- kvcache: ``seqlen_k`` is the cache's capacity; each sequence has a random number of cached tokens (the
  first none) and Nq new ones, written into the cache (through the block table when paged) before the
  call, as :func:`mhattn.attention_with_kvcache` does.
- varlen: ``batch`` sequences of random lengths up to ``seqlen_q`` (one of them that long; with three or
  more, one empty); without causal masking, the first sequence has fewer keys than queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from mhattn.backends.base import AttentionParams, KVCache, Packing
from mhattn.conformance import tolerance
from mhattn.conformance.cases import Case
from mhattn.conformance.poison import poisoned_allocations
from mhattn.conformance.tolerance import Comparison
from mhattn.problem import Problem
from mhattn.reference.naive import naive_attention
from mhattn.reference.packed import cached_keys

FEATURES = ("kvcache", "varlen")
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class PackedInputs:
    """kvcache: q (B, Hq, Nq, D), the cache (new tokens already written by torch's indexing), the new tokens' k/v
    (B, Hkv, Nq, D) and ``before_append`` (k_cache, v_cache, cache_seqlens) as they were before it;
    varlen: q (total_q, Hq, D), k/v (total_k, Hkv, D), grad_out and grad_lse (Hq, total_q) or None."""

    q: torch.Tensor
    params: AttentionParams
    problem: Problem
    cache: Optional[KVCache] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    packing: Optional[Packing] = None
    lengths: tuple = ()          # varlen: (lengths_q, lengths_k); kvcache: keys per sequence
    grad_out: Optional[torch.Tensor] = None
    grad_lse: Optional[torch.Tensor] = None
    before_append: Optional[tuple] = None


def _params(case: Case) -> AttentionParams:
    left, right = case.window if case.window is not None else (None, None)
    if case.causal is not None:
        right = 0 if right is None else min(right, 0)
    return AttentionParams(scale=1.0 / math.sqrt(case.head_dim), window_left=left, window_right=right,
                           dropout_p=case.dropout_p, softcap=case.softcap)


def _randn(gen, shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def make_inputs(case: Case, device) -> PackedInputs:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(case.seed)
    return (_kvcache_inputs if case.feature == "kvcache" else _varlen_inputs)(case, device, gen)


def _kvcache_inputs(case: Case, device, gen) -> PackedInputs:
    from mhattn.decode import _append_by_indexing

    dtype = case.torch_dtype
    b, hq, hkv, nq, capacity, d, dv = (case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k,
                                       case.head_dim, case.value_dim)
    q_scale, k_scale = (5.0, 3.0) if case.overflow else (1.0, 1.0)
    q = _randn(gen, (b, hq, nq, d), device, dtype, q_scale)
    cached = torch.randint(0, capacity - nq + 1, (b,), generator=gen)
    cached[0] = 0
    table = None
    if case.block_size is None:
        k_cache = _randn(gen, (b, hkv, capacity, d), device, dtype, k_scale)
        v_cache = _randn(gen, (b, hkv, capacity, dv), device, dtype)
    else:
        max_blocks = -(-capacity // case.block_size)
        pool = b * max_blocks + 2
        table = torch.randperm(pool, generator=gen)[:b * max_blocks].view(b, max_blocks).to(torch.int32).to(device)
        k_cache = _randn(gen, (pool, hkv, case.block_size, d), device, dtype, k_scale)
        v_cache = _randn(gen, (pool, hkv, case.block_size, dv), device, dtype)
    new_k = _randn(gen, (b, hkv, nq, d), device, dtype, k_scale)
    new_v = _randn(gen, (b, hkv, nq, dv), device, dtype)
    cache_seqlens = cached.to(torch.int32).to(device)
    before_append = (k_cache.clone(), v_cache.clone(), cache_seqlens)
    cache = KVCache(k_cache, v_cache, _append_by_indexing(k_cache, v_cache, new_k, new_v, cache_seqlens, table), table)
    params = _params(case)
    problem = Problem.from_tensors(q, k_cache, v_cache, params, causal=case.causal is not None,
                                   window=case.window is not None,
                                   operation="kvcache" if table is None else "paged_kvcache", sizes=(b, nq, capacity))
    return PackedInputs(q, params, problem, cache=cache, k=new_k, v=new_v, lengths=tuple((cached + nq).tolist()),
                        before_append=before_append)


def varlen_lengths(case: Case, gen) -> tuple:
    """(lengths_q, lengths_k) of a varlen case's sequences."""
    longest = case.seqlen_q
    lengths = torch.randint(1, longest + 1, (case.batch,), generator=gen)
    lengths[torch.randint(0, case.batch, (1,), generator=gen)] = longest
    lengths_q = lengths.tolist()
    if case.batch >= 3:
        lengths_q[1] = 0
    lengths_k = list(lengths_q)
    if case.causal is None:
        lengths_k[0] = lengths_q[0] // 2 + 1
    return tuple(lengths_q), tuple(lengths_k)


def _varlen_inputs(case: Case, device, gen) -> PackedInputs:
    dtype = case.torch_dtype
    lengths_q, lengths_k = varlen_lengths(case, gen)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q_scale, k_scale = (5.0, 3.0) if case.overflow else (1.0, 1.0)
    q = _randn(gen, (total_q, case.heads_q, case.head_dim), device, dtype, q_scale)
    k = _randn(gen, (total_k, case.heads_kv, case.head_dim), device, dtype, k_scale)
    v = _randn(gen, (total_k, case.heads_kv, case.value_dim), device, dtype)
    grad_out = _randn(gen, (total_q, case.heads_q, case.value_dim), device, dtype)
    grad_lse = torch.randn(case.heads_q, total_q, generator=gen).to(device) if case.grad_lse else None
    seed = tuple(int(w) for w in torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=gen))

    def prefix(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)

    packing = Packing(prefix(lengths_q), prefix(lengths_k), max(lengths_q), max(lengths_k))
    params = _params(case)
    if case.dropout_p > 0:
        params = params.replace(seed=seed)
    problem = Problem.from_tensors(q, k, v, params, causal=case.causal is not None, window=case.window is not None,
                                   operation="varlen", sizes=(case.batch, packing.max_seqlen_q, packing.max_seqlen_k))
    return PackedInputs(q, params, problem, k=k, v=v, packing=packing, lengths=(lengths_q, lengths_k),
                        grad_out=grad_out, grad_lse=grad_lse)


# ---- judging ----------------------------------------------------------------------------------------


def judge(backend, case: Case, inputs: PackedInputs) -> list:
    return (_judge_kvcache if case.feature == "kvcache" else _judge_varlen)(backend, case, inputs)


def _relative(case: Case):
    return {torch.float32: tolerance.FP32_RELATIVE, torch.float64: tolerance.FP64_RELATIVE}.get(case.torch_dtype)


def _compare_all(got: dict, gold: dict, lowp: Optional[dict], case: Case, floor_names=()) -> list:
    grad_scale = max((float(gold[n].abs().max()) for n in floor_names if gold[n].numel()), default=0.0)
    return [tolerance.compare(name, tensor, gold[name], None if lowp is None else lowp[name], dtype=case.torch_dtype,
                              relative=_relative(case), floor_scale=grad_scale if name in floor_names else None)
            for name, tensor in got.items()]


def kvcache_reference(q, cache, params, lengths, dtype) -> dict:
    """out and lse of q over each sequence's first ``lengths[b]`` cached keys, by the naive reference in ``dtype``
    (a sequence with no key gives out 0 and lse -inf)."""
    nq, dv = q.shape[2], cache.v.shape[-1]
    outs, lses = [], []
    for b, length in enumerate(lengths):
        if length == 0:
            outs.append(torch.zeros(1, q.shape[1], nq, dv, dtype=dtype, device=q.device))
            lses.append(torch.full((1, q.shape[1], nq), float("-inf"), dtype=dtype, device=q.device))
            continue
        k, v = cached_keys(cache, b, length)
        out, lse = naive_attention(q[b:b + 1].to(dtype), k.to(dtype), v.to(dtype),
                                   params.replace(diag_offset=length - nq))
        outs.append(out)
        lses.append(lse)
    return {"out": torch.cat(outs), "lse": torch.cat(lses)}


def _judge_kvcache(backend, case: Case, inputs: PackedInputs) -> list:
    cache_before = (inputs.cache.k.clone(), inputs.cache.v.clone())
    with poisoned_allocations():
        out, lse = backend.forward_kvcache(inputs.q, inputs.cache, inputs.params)
    got = {"out": out, "lse": lse}
    gold = kvcache_reference(inputs.q, inputs.cache, inputs.params, inputs.lengths, torch.float64)
    lowp = (kvcache_reference(inputs.q, inputs.cache, inputs.params, inputs.lengths, case.torch_dtype)
            if case.torch_dtype in HALF_DTYPES else None)
    checks = _compare_all(got, gold, lowp, case)
    unchanged = torch.equal(cache_before[0], inputs.cache.k) and torch.equal(cache_before[1], inputs.cache.v)
    checks.append(Comparison("cache unchanged by forward_kvcache", unchanged, 0.0, 0.0, 0.0 if unchanged else math.inf,
                             "" if unchanged else " (the backend wrote into the cache)"))
    return checks + _judge_append(backend, inputs) + _judge_appending_step(backend, case, inputs, gold, lowp)


def _judge_append(backend, inputs: PackedInputs) -> list:
    """The backend's own append (append_kvcache), where it has one, on the cache as it was before the new tokens:
    the same cache and key counts as torch's indexing gave (nothing to compare for a backend without one)."""
    k_cache, v_cache, cache_seqlens = (t.clone() for t in inputs.before_append)
    with poisoned_allocations():
        counts = backend.append_kvcache(k_cache, v_cache, inputs.k, inputs.v, cache_seqlens, inputs.cache.block_table)
    if counts is None:
        return []
    same = (torch.equal(k_cache, inputs.cache.k) and torch.equal(v_cache, inputs.cache.v)
            and torch.equal(counts, inputs.cache.seqlens))
    return [Comparison("append_kvcache writes what torch's indexing writes", same, 0.0, 0.0, 0.0 if same else math.inf,
                       "" if same else " (new tokens or key counts differ)")]


def _judge_appending_step(backend, case: Case, inputs: PackedInputs, gold: dict, lowp: Optional[dict]) -> list:
    """The backend's steps that append as they attend, where it has them, each on the cache as it was before the new
    tokens: forward_kvcache_appending, and the step kvcache_call prepares (returning the lse), called twice, each time
    on a cache of its own (a prepared step serves every call of its signature, and may keep what its first call
    worked out). forward_kvcache's out and lse against the same gold, and the cache torch's indexing gave."""
    q, k, v, table, params = inputs.q, inputs.k, inputs.v, inputs.cache.block_table, inputs.params
    prepared = backend.kvcache_call(q, *inputs.before_append[:2], k, v, inputs.before_append[2], table, params, True)
    steps = [("forward_kvcache_appending",
              lambda k_cache, v_cache, seqlens: backend.forward_kvcache_appending(q, k_cache, v_cache, k, v, seqlens,
                                                                                  table, params))]
    if prepared is not None:
        def run_prepared(k_cache, v_cache, seqlens):
            return prepared(q, k_cache, v_cache, k, v, seqlens, table)

        steps += [("kvcache_call", run_prepared), ("kvcache_call again", run_prepared)]
    checks = []
    for name, run in steps:
        k_cache, v_cache, cache_seqlens = (t.clone() for t in inputs.before_append)
        with poisoned_allocations():
            step = run(k_cache, v_cache, cache_seqlens)
        if step is None:
            continue
        checks += [replace(check, name=f"{name}: {check.name}")
                   for check in _compare_all({"out": step[0], "lse": step[1]}, gold, lowp, case)]
        same = (torch.equal(k_cache, inputs.cache.k) and torch.equal(v_cache, inputs.cache.v)
                and torch.equal(cache_seqlens, inputs.before_append[2]))
        note = "" if same else " (new tokens differ, or cache_seqlens changed)"
        checks.append(Comparison(f"{name} writes what torch's indexing writes", same, 0.0, 0.0,
                                 0.0 if same else math.inf, note))
    return checks


def _varlen_reference(inputs: PackedInputs, dtype, keep) -> dict:
    """out, lse and (autograd) dq, dk, dv of each sequence alone, packed again."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    outs, lses = [], []
    qs = ks = 0
    heads_q = inputs.q.shape[1]
    for b, (nq, nk) in enumerate(zip(*inputs.lengths)):
        q = leaves[0][qs:qs + nq].transpose(0, 1)[None]
        if nk == 0:
            outs.append(leaves[0][qs:qs + nq, :, :1].expand(-1, -1, inputs.v.shape[-1]) * 0)
            lses.append(torch.full((heads_q, nq), float("-inf"), dtype=dtype, device=q.device))
        else:
            k, v = (t[ks:ks + nk].transpose(0, 1)[None] for t in leaves[1:])
            out, lse = naive_attention(q, k, v, inputs.params,
                                       keep=None if keep is None else keep[b:b + 1, :, :nq, :nk])
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        qs, ks = qs + nq, ks + nk
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    outputs, grads = [out], [inputs.grad_out.to(dtype)]
    if inputs.grad_lse is not None:
        outputs.append(lse)
        grads.append(inputs.grad_lse.to(dtype).masked_fill(torch.isinf(lse.detach()), 0.0))
    dq, dk, dv = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    dq, dk, dv = (torch.zeros_like(x) if g is None else g for g, x in zip((dq, dk, dv), leaves))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _judge_varlen(backend, case: Case, inputs: PackedInputs) -> list:
    params, packing = inputs.params, inputs.packing
    keep = None
    if params.dropout_p > 0.0:
        keep = backend.dropout_keep_mask(case.batch, case.heads_q, packing.max_seqlen_q, packing.max_seqlen_k, params,
                                         inputs.q.device)
    with poisoned_allocations():
        out, lse = backend.forward_varlen(inputs.q, inputs.k, inputs.v, packing, params)
        dq, dk, dv = backend.backward_varlen(inputs.grad_out, inputs.q, inputs.k, inputs.v, out, lse, packing, params,
                                             grad_lse=inputs.grad_lse)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    gold = _varlen_reference(inputs, torch.float64, keep)
    lowp = _varlen_reference(inputs, case.torch_dtype, keep) if case.torch_dtype in HALF_DTYPES else None
    return _compare_all(got, gold, lowp, case, floor_names=("dq", "dk"))
