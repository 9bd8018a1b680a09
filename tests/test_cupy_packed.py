"""The CUDA C++ backend's KV-cache and packed (varlen) entry points (backends/cupy/packed.py, the mma.sync kernels
with per-sequence addressing of kernels/sequences.cuh).

CPU (CI): the kernels run on the host-side emulator (small shapes) against the naive reference of each sequence
alone, with CONFORMANCE.md's rule (float64 gold, the reference in the input dtype as the rounding bar), random
inputs and outputs poisoned with NaN: contiguous and paged caches with uneven lengths (one shorter than Nq, one
empty), GQA / MQA, causal, window, softcap, unaligned cache rows; varlen forward and backward with uneven
lengths, an empty sequence and one without keys, causal, window, softcap, dropout, grad_lse, odd head dims.

GPU (@pytest.mark.gpu): the same cases at larger shapes, and the public entry points with backend="cupy".
"""

from __future__ import annotations

import math

import pytest
import torch

from mhattn.backends.base import AttentionParams, KVCache, Packing
from mhattn.backends.cupy import CupyBackend, ops, packed, variants
from mhattn.conformance.packed import PackedInputs, _varlen_reference, kvcache_reference
from mhattn.conformance.tolerance import compare
from mhattn.dropout_rng import keep_mask
from mhattn.problem import Problem
# the emulator / GPU fixtures and marks of the dense tests (poisoned: ops.POISON_OUTPUTS on)
from test_cupy_backend import emulated_backend, gpu, gpu_backend, needs_gpu, poisoned  # noqa: F401
from test_cupy_backend import _check as check_dense, _inputs as dense_inputs, _params as dense_params


def _params(d, causal=False, window=None, softcap=None, dropout_p=0.0, seed=(0, 0)) -> AttentionParams:
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return AttentionParams(scale=1.0 / math.sqrt(d), window_left=left, window_right=right, softcap=softcap,
                           dropout_p=dropout_p, seed=seed)


def _randn(gen, shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def _failures(got: dict, gold: dict, lowp: dict, dtype, floor_names=()) -> list:
    """CONFORMANCE.md's comparisons that fail (dq and dk with the floor of the conformance suite's packed cases)."""
    scale = max((float(gold[n].abs().max()) for n in floor_names if gold[n].numel()), default=0.0)
    results = [compare(name, got[name], gold[name], lowp[name], dtype=dtype,
                       floor_scale=scale if name in floor_names else None) for name in got]
    return [str(r) for r in results if not r.ok]


# ---- KV cache ------------------------------------------------------------------------------------------------------


def kvcache_inputs(case: dict, device):
    """q (B, Hq, Nq, D) and a KVCache (contiguous, or paged over a shuffled pool with spare blocks) holding
    ``case["lengths"]`` keys per sequence; ``unaligned``: cache rows one element apart from 16-byte alignment (views of
    wider rows), which the kernels must read as they are."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, lengths = case["dtype"], case["lengths"]
    batch, hq, hkv, nq, d = case["shape"]
    dv = case.get("d_v", d)
    capacity = case["capacity"]
    q = _randn(gen, (batch, hq, nq, d), dtype, device)
    pad = 1 if case.get("unaligned") else 0
    block_size = case.get("block_size")
    table = None
    if block_size is None:
        rows = (batch, hkv, capacity)
    else:
        max_blocks = -(-capacity // block_size)
        pool = batch * max_blocks + 3
        table = torch.randperm(pool, generator=gen)[:batch * max_blocks].view(batch, max_blocks)
        table = table.to(torch.int32).to(device)
        rows = (pool, hkv, block_size)
    k = _randn(gen, rows + (d + pad,), dtype, device)[..., :d]
    v = _randn(gen, rows + (dv + pad,), dtype, device)[..., :dv]
    cache = KVCache(k, v, torch.tensor(lengths, dtype=torch.int32, device=device), table)
    return q, cache


def check_kvcache(backend, case: dict, device) -> list:
    q, cache = kvcache_inputs(case, device)
    params = _params(q.shape[-1], case.get("causal", False), case.get("window"), case.get("softcap"))
    before = (cache.k.clone(), cache.v.clone())
    out, lse = backend.forward_kvcache(q, cache, params)
    assert out.shape == (*q.shape[:3], cache.v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.equal(before[0], cache.k) and torch.equal(before[1], cache.v), "forward_kvcache wrote into the cache"
    got = {"out": out, "lse": lse}
    lengths = cache.seqlens.tolist()
    return _failures(got, kvcache_reference(q, cache, params, lengths, torch.float64),
                     kvcache_reference(q, cache, params, lengths, q.dtype), q.dtype)


KVCACHE_CASES = {
    # GQA, bottom-right causal per sequence: one sequence shorter than Nq (its first rows see nothing), one empty
    "contiguous_causal_gqa": dict(shape=(4, 4, 2, 3, 32), capacity=48, lengths=[7, 40, 2, 0], causal=True,
                                  dtype=torch.float16),
    # paged, blocks that do not divide the key tile, MQA, window and softcap, bf16
    "paged_window_softcap_mqa": dict(shape=(3, 4, 1, 2, 40), capacity=70, block_size=7, lengths=[70, 13, 33],
                                     causal=True, window=(10, None), softcap=3.0, dtype=torch.bfloat16),
    # paged, not causal, head dims that are not multiples of 8 (ANY_DIMS), a value dim of its own
    "paged_odd_dims": dict(shape=(2, 2, 2, 5, 20), d_v=12, capacity=64, block_size=16, lengths=[50, 5],
                           dtype=torch.float16),
    # a decoding step at d = 128 (decoding tiles of 16 keys, Q from shared memory)
    "paged_d128_decode": dict(shape=(2, 2, 1, 1, 128), capacity=64, block_size=16, lengths=[60, 9], causal=True,
                              dtype=torch.bfloat16),
    # more query rows than a decoding step (the forward's own tiles, no KV_SPLIT): a chunk of a prompt over a cache,
    # one sequence shorter than the chunk
    "paged_prompt_chunk": dict(shape=(2, 4, 2, 20, 64), capacity=96, block_size=32, lengths=[90, 12], causal=True,
                               dtype=torch.float16),
    # a contiguous cache whose rows are not 16-byte aligned: read as it is (ANY_DIMS), never copied
    "contiguous_unaligned": dict(shape=(2, 2, 1, 1, 32), capacity=40, lengths=[40, 17], causal=True, unaligned=True,
                                 dtype=torch.bfloat16),
    # decoding steps whose query heads are packed as rows of one CTA per key/value head: 20 heads on one (two query
    # blocks of rows, the second partly empty), an empty sequence; a right window and softcap, paged
    "contiguous_mqa_decode": dict(shape=(2, 20, 1, 1, 64), capacity=50, lengths=[50, 0], causal=True,
                                  dtype=torch.float16),
    "paged_gqa_decode_right_window": dict(shape=(3, 8, 2, 1, 32), capacity=40, block_size=8, lengths=[30, 1, 17],
                                          window=(None, 5), softcap=2.5, dtype=torch.bfloat16),
    # a left window bounds each query head's row by its own position: one CTA a query head
    "paged_gqa_decode_left_window": dict(shape=(2, 4, 2, 1, 32), capacity=32, block_size=8, lengths=[20, 3],
                                         causal=True, window=(6, None), dtype=torch.float16),
}


# ---- varlen --------------------------------------------------------------------------------------------------------


def varlen_inputs(case: dict, device):
    """Packed q, k, v, grad_out, grad_lse (or None), the Packing and the lengths of ``case``."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, (lengths_q, lengths_k) = case["dtype"], case["lengths"]
    hq, hkv, d = case["heads"] + (case["d"],)
    dv = case.get("d_v", d)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = _randn(gen, (total_q, hq, d), dtype, device)
    k = _randn(gen, (total_k, hkv, d), dtype, device)
    v = _randn(gen, (total_k, hkv, dv), dtype, device)
    grad_out = _randn(gen, (total_q, hq, dv), dtype, device)
    grad_lse = torch.randn(hq, total_q, generator=gen).to(device) if case.get("grad_lse") else None

    def prefix(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)

    packing = Packing(prefix(lengths_q), prefix(lengths_k), max(lengths_q), max(lengths_k))
    return q, k, v, grad_out, grad_lse, packing


def varlen_reference(q, k, v, grad_out, grad_lse, packing, lengths, params: AttentionParams, dtype) -> dict:
    """out, lse and (autograd) dq, dk, dv of each sequence alone, packed again (the conformance suite's gold)."""
    keep = None
    if params.dropout_p > 0:  # sequence b draws the words of batch index b at its own positions
        keep = keep_mask(params.seed, packing.batch, q.shape[1], packing.max_seqlen_q, packing.max_seqlen_k,
                         params.dropout_p, device=q.device)
    inputs = PackedInputs(q, params, None, k=k, v=v, packing=packing, lengths=lengths, grad_out=grad_out,
                          grad_lse=grad_lse)
    return _varlen_reference(inputs, dtype, keep)


def check_varlen(backend, case: dict, device) -> list:
    q, k, v, grad_out, grad_lse, packing = varlen_inputs(case, device)
    params = _params(q.shape[-1], case.get("causal", False), case.get("window"), case.get("softcap"),
                     case.get("dropout_p", 0.0), (1234, 5678))
    out, lse = backend.forward_varlen(q, k, v, packing, params)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and lse.shape == (q.shape[1], q.shape[0])
    dq, dk, dv = backend.backward_varlen(grad_out, q, k, v, out, lse, packing, params, grad_lse=grad_lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    args = (q, k, v, grad_out, grad_lse, packing, case["lengths"], params)
    return _failures(got, varlen_reference(*args, torch.float64), varlen_reference(*args, q.dtype), q.dtype,
                     floor_names=("dq", "dk"))


VARLEN_CASES = {
    # causal top-left per sequence, GQA, an empty sequence, a gradient into lse
    "causal_gqa_grad_lse": dict(heads=(4, 2), d=32, lengths=([5, 0, 70, 33], [5, 0, 70, 33]), causal=True,
                                grad_lse=True, dtype=torch.float16),
    # not causal, sequences with more / fewer keys than queries and one without keys (rows that see nothing)
    "uneven_no_keys": dict(heads=(2, 2), d=64, lengths=([20, 45, 3, 9], [11, 60, 0, 9]), dtype=torch.bfloat16),
    # the two-dimensional dK/dV kernel (bucket 128): window around the causal diagonal, softcap, MQA
    "window_softcap_2d": dict(heads=(2, 1), d=128, lengths=([40, 66], [50, 66]), causal=True, window=(15, None),
                              softcap=4.0, dtype=torch.bfloat16),
    # dropout: each sequence draws the RNG words of its batch index at its own positions
    "dropout": dict(heads=(2, 1), d=32, lengths=([30, 0, 41], [25, 7, 41]), dropout_p=0.17, dtype=torch.float16),
    # head dims that are not multiples of 8, a value dim of its own (ANY_DIMS)
    "odd_dims": dict(heads=(3, 1), d=20, d_v=36, lengths=([17, 33], [40, 33]), causal=True, grad_lse=True,
                     dtype=torch.float16),
}


# ---- CPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KVCACHE_CASES))
def test_emulated_kvcache_matches_reference(emulated_backend, poisoned, name):
    failures = check_kvcache(emulated_backend, KVCACHE_CASES[name], "cpu")
    assert not failures, failures


@pytest.mark.parametrize("name", sorted(VARLEN_CASES))
def test_emulated_varlen_matches_reference(emulated_backend, poisoned, name):
    failures = check_varlen(emulated_backend, VARLEN_CASES[name], "cpu")
    assert not failures, failures


def check_append(backend, device, dtype, paged: bool, heads_kv=2, seqlen_q=3, head_dim=40, head_dim_v=24):
    """The backend's append (kernels/kv_append.cu) against torch's indexing: new rows with strided (B, Hkv, Nq)
    dims, a strided cache_seqlens and a block table whose blocks are not adjacent in memory (a transposed view),
    three sequences, the last one's rows running past the cache (those are not written, and nothing else is). The
    cache and the returned counts (cache_seqlens + Nq) equal the indexing's; returns failure messages."""
    from mhattn.decode import _append_by_indexing

    gen = torch.Generator().manual_seed(17 + paged)
    batch, capacity, block_size = 3, 48, 16
    if paged:
        blocks = capacity // block_size
        table = torch.randperm(batch * blocks + 2, generator=gen)[:batch * blocks].to(torch.int32)
        table = table.view(blocks, batch).t().to(device)  # (B, max_blocks), columns one apart by B
        k_cache = _randn(gen, (batch * blocks + 2, heads_kv, block_size, head_dim), dtype, device)
        v_cache = _randn(gen, (batch * blocks + 2, heads_kv, block_size, head_dim_v), dtype, device)
    else:
        table = None
        k_cache = _randn(gen, (batch, heads_kv, capacity, head_dim), dtype, device)
        v_cache = _randn(gen, (batch, heads_kv, capacity, head_dim_v), dtype, device)
    new_k = _randn(gen, (batch, seqlen_q, heads_kv, head_dim), dtype, device).transpose(1, 2)
    new_v = _randn(gen, (batch, seqlen_q, heads_kv, head_dim_v), dtype, device).transpose(1, 2)
    seqlens = torch.tensor([5, 0, 30, 0, capacity - 1, 0], dtype=torch.int32, device=device)[::2]  # stride 2
    want_k, want_v = k_cache.clone(), v_cache.clone()

    def indexed(sequences: slice, rows: int):  # torch's indexing: the first ``rows`` new rows of ``sequences``
        caches = (want_k, want_v) if paged else (want_k[sequences], want_v[sequences])  # (its batch: k's)
        _append_by_indexing(*caches, new_k[sequences, :, :rows], new_v[sequences, :, :rows], seqlens[sequences],
                            table[sequences] if paged else None)

    indexed(slice(0, 2), seqlen_q)
    indexed(slice(2, 3), 1)  # the last sequence: only its first new row lies inside the cache
    counts = backend.append_kvcache(k_cache, v_cache, new_k, new_v, seqlens, table)
    failures = []
    if counts is None:
        return ["append_kvcache declined the call"]
    if not torch.equal(counts.cpu(), (seqlens + seqlen_q).cpu()):
        failures.append(f"counts {counts.tolist()} != {(seqlens + seqlen_q).tolist()}")
    for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        if not torch.equal(got, want):
            failures.append(f"{name}: {int((got != want).any(-1).sum())} rows differ from torch's indexing")
    return failures


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_emulated_append_matches_indexing(emulated_backend, poisoned, dtype, paged):
    failures = check_append(emulated_backend, "cpu", dtype, paged)
    assert not failures, failures


DECODING_CASES = sorted(name for name, case in KVCACHE_CASES.items() if case["shape"][3] <= variants.DECODE_MAX_ROWS)
DECODING_CASES = sorted(name for name, case in KVCACHE_CASES.items() if case["shape"][3] <= variants.DECODE_MAX_ROWS)


@pytest.mark.parametrize("name", DECODING_CASES)
def test_emulated_split_kv_decoding_matches_reference(emulated_backend, poisoned, monkeypatch, name):
    """Split-KV decoding (KV_SPLIT, kernels/kv_combine.cu): as if the GPU had 64 SMs and splits of 16 keys paid off,
    so every case splits its sequences' keys (splits that see no key of a short or empty sequence included)."""
    monkeypatch.setattr(packed, "EMULATED_SM_COUNT", 64)
    monkeypatch.setattr(packed, "SPLIT_MIN_KEYS", 16)
    case = KVCACHE_CASES[name]
    batch, heads_q = case["shape"][:2]
    assert packed.kv_splits(batch * heads_q, case["capacity"], 64) > 1
    failures = check_kvcache(emulated_backend, case, "cpu")
    assert not failures, failures


def test_split_counts():
    assert packed.kv_splits(132, 1 << 20, 132) == 1  # the unsplit grid fills the GPU
    assert packed.kv_splits(8, 200, 132) == 1  # a short cache
    assert packed.kv_splits(32, 1 << 17, 132) == 9  # two CTAs per SM
    assert packed.kv_splits(1, 1 << 20, 132) == packed.MAX_SPLITS
    assert packed.kv_splits(1, 1000, 132) == 4  # at least SPLIT_MIN_KEYS keys a split


def recorded_calls(monkeypatch, name: str) -> list:
    """The positional arguments of every call of packed.<name> from now on (the function still runs)."""
    calls, real = [], getattr(packed, name)

    def recording(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(packed, name, recording)
    return calls


@pytest.mark.parametrize("name, packs", [("contiguous_mqa_decode", True), ("paged_gqa_decode_right_window", True),
                                         ("paged_d128_decode", True), ("paged_gqa_decode_left_window", False),
                                         ("paged_prompt_chunk", False)])
def test_emulated_decoding_step_packs_query_heads_as_rows(emulated_backend, poisoned, monkeypatch, name, packs):
    """A step of one query under GQA launches one CTA per (sequence, key/value head) over its query heads as rows
    (without the causal or right bound, which hide none of that query's keys); a left window or several queries keep
    one CTA a query head. Either way the result is the reference's."""
    launches = recorded_calls(monkeypatch, "_forward_launch")
    monkeypatch.setattr(packed, "_plans", ops._Plans())  # plan this call afresh
    case = KVCACHE_CASES[name]
    failures = check_kvcache(emulated_backend, case, "cpu")
    assert not failures, failures
    batch, heads_q, heads_kv, seqlen_q, _ = case["shape"]
    (q_seen, params_seen, heads_seen, rows_seen), = [(a[3], a[6], a[10], a[12]) for a in launches]
    if packs:
        assert (heads_seen, rows_seen, tuple(q_seen.shape[:3])) == (heads_kv, heads_q // heads_kv,
                                                                    (batch, heads_kv, heads_q // heads_kv))
        assert params_seen.window_right is None
    else:
        assert (heads_seen, rows_seen) == (heads_q, seqlen_q)


# (B, Hq, Hkv, Nq, Nk, d), causal ("bottom_right" / "top_left" / None), window, softcap, decodes (runs as a
# decoding step)
DENSE_DECODING_CASES = {
    "gqa_one_query": ((2, 8, 2, 1, 70, 64), None, None, None, True),
    "bottom_right_window_softcap": ((2, 4, 2, 1, 50, 32), "bottom_right", (5, None), 2.0, True),
    "mqa_one_key": ((1, 4, 1, 1, 1, 32), "bottom_right", None, None, True),
    # a window about the top-left diagonal (keys 0..5 for the one query): not the cache's alignment
    "top_left_window": ((1, 4, 2, 1, 40, 32), None, (None, 5), None, False),
    "four_queries": ((1, 4, 2, 4, 40, 32), "bottom_right", None, None, False),
    "short_cache": ((1, 4, 2, 1, 40, 32), None, None, None, False),  # below DENSE_DECODING_MIN_KEYS as shipped
}


@pytest.mark.parametrize("name", sorted(DENSE_DECODING_CASES))
def test_emulated_dense_decoding_step_runs_the_cache_kernels(emulated_backend, poisoned, monkeypatch, name):
    """CupyBackend.forward of one query row over enough keys, with bottom-right or no bounds, reads k and v as a
    full cache (forward_kvcache, split-KV decoding); other calls keep the dense kernels. The forward and the backward
    that uses its out and lse match the reference either way, and forward_path says which kernels run."""
    (batch, hq, hkv, nq, nk, d), causal, window, softcap, decodes = DENSE_DECODING_CASES[name]
    monkeypatch.setattr(packed, "EMULATED_SM_COUNT", 64)  # splits of the keys pay off
    monkeypatch.setattr(packed, "SPLIT_MIN_KEYS", 16)
    if name != "short_cache":  # the emulator's shapes are short: route from one key
        monkeypatch.setattr(packed, "DENSE_DECODING_MIN_KEYS", 1)
    cache_calls = recorded_calls(monkeypatch, "forward_kvcache")
    q, k, v, grad_out = dense_inputs(batch, hq, hkv, nq, nk, d, torch.bfloat16, "cpu")
    params = dense_params(nq, nk, d, causal=causal, window=window, softcap=softcap)
    failures = check_dense(emulated_backend, q, k, v, grad_out, params)
    assert not failures, failures
    assert bool(cache_calls) == decodes
    if decodes:
        cache = cache_calls[0][3]
        assert cache.k is k and cache.v is v and cache.seqlens.tolist() == [nk] * batch
        assert cache.seqlens is packed._full_lengths[(q.device, batch, nk)]  # made once for the loop's steps
    problem = Problem.from_tensors(q, k, v, params, causal=causal is not None, window=window is not None)
    assert ("decoding step" in emulated_backend.forward_path(problem)) == decodes


# (B, Hq, Hkv, Nk, d), causal ("bottom_right" or None), mask kind, whether the query heads stay packed: a boolean mask
# on a decoding step. "left": a batch of left-padded prompts' padding mask (B, 1, 1, Nk) broadcast over the heads (entry
# 1 with 40 padded keys, more than a split's); "per_head": random keys hidden per head (B, Hq, 1, Nk).
MASKED_DECODING_CASES = {
    "left_padding_gqa": ((2, 8, 2, 70, 64), None, "left", True),
    "left_padding_mqa_bottom_right": ((3, 4, 1, 50, 32), "bottom_right", "left", True),
    "per_head_gqa": ((2, 4, 2, 60, 32), None, "per_head", False),
    "left_padding_no_gqa": ((2, 2, 2, 45, 32), "bottom_right", "left", False),
}


def _decoding_mask(kind, batch, heads_q, seqlen_k):
    gen = torch.Generator().manual_seed(11)
    if kind == "left":  # True = attend: each entry's first keys are padding
        pads = torch.tensor([3, 40, 0][:batch])
        keep = torch.arange(seqlen_k)[None, :] >= pads[:, None]
        return keep[:, None, None, :].expand(batch, heads_q, 1, seqlen_k)
    keep = torch.rand(batch, heads_q, 1, seqlen_k, generator=gen) > 0.3
    keep[..., -1] = True
    return keep


@pytest.mark.parametrize("name", sorted(MASKED_DECODING_CASES))
def test_emulated_dense_decoding_step_with_a_boolean_mask(emulated_backend, poisoned, monkeypatch, name):
    """A decoding step with a boolean mask runs the cache kernels with the keys split over CTAs, the query heads of a
    key/value head packed as one CTA's rows where the mask is the same for every head (each row reads the batch
    entry's one mask row); the forward and the backward that uses its out and lse match the reference. A float mask
    keeps the dense kernels."""
    (batch, hq, hkv, nk, d), causal, kind, packs = MASKED_DECODING_CASES[name]
    monkeypatch.setattr(packed, "EMULATED_SM_COUNT", 64)  # splits of the keys pay off
    monkeypatch.setattr(packed, "SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(packed, "DENSE_DECODING_MIN_KEYS", 1)
    monkeypatch.setattr(packed, "_plans", ops._Plans())  # plan this call afresh
    cache_calls = recorded_calls(monkeypatch, "forward_kvcache")
    launches = recorded_calls(monkeypatch, "_forward_launch")
    q, k, v, grad_out = dense_inputs(batch, hq, hkv, 1, nk, d, torch.bfloat16, "cpu")
    params = dense_params(1, nk, d, causal=causal, mask=_decoding_mask(kind, batch, hq, nk))
    failures = check_dense(emulated_backend, q, k, v, grad_out, params)
    assert not failures, failures
    assert len(cache_calls) == 1 and cache_calls[0][4].mask is params.mask
    (heads_seen, rows_seen, splits), = [(a[10], a[12], a[-1]) for a in launches]
    assert (heads_seen, rows_seen) == ((hkv, hq // hkv) if packs else (hq, 1)) and splits > 1
    problem = Problem.from_tensors(q, k, v, params, causal=causal is not None, window=False)
    assert "decoding step" in emulated_backend.forward_path(problem)
    float_params = dense_params(1, nk, d, causal=causal,
                                mask=torch.zeros(batch, hq, 1, nk, dtype=torch.bfloat16).masked_fill(
                                    ~params.mask, float("-inf")))
    cache_calls.clear()
    failures = check_dense(emulated_backend, q, k, v, grad_out, float_params)
    assert not failures and not cache_calls, failures


def test_emulated_decoding_steps_share_a_plan(emulated_backend, poisoned):
    """Lengths and block tables are read on the device: steps that only advance them reuse the plan of the first,
    and each step's result is that of its own lengths."""
    case = dict(KVCACHE_CASES["paged_window_softcap_mqa"], lengths=[12, 3, 30])
    for step in range(3):
        case["lengths"] = [n + 1 for n in case["lengths"]]
        failures = check_kvcache(emulated_backend, case, "cpu")
        assert not failures, (step, failures)
        if step == 0:
            plans = len(packed._plans)
    assert len(packed._plans) == plans


def test_declares_the_operations_and_names_its_kernels():
    from mhattn.backends.base import OPERATIONS
    from mhattn.problem import Problem

    backend = CupyBackend()
    assert backend.capabilities.operations == frozenset(OPERATIONS)
    q = torch.empty(3, 4, 1, 64, dtype=torch.float16)
    k = torch.empty(3, 2, 100, 64, dtype=torch.float16)
    for operation in ("kvcache", "paged_kvcache", "varlen"):
        problem = Problem.from_tensors(q, k, k, _params(64, causal=True), causal=True, window=False,
                                       operation=operation,
                                       sizes=(3, 1, 100))
        assert "kernels/fwd.cu" in backend.forward_path(problem) and "Hopper" in backend.forward_path(problem)
    assert "VARLEN" in backend.backward_path(problem)


def test_sequence_variants_leave_the_dense_ones_alone():
    cc = (9, 0)
    dense = variants.all_variants(cc, sequences=False)
    every = variants.all_variants(cc)
    assert every[:len(dense)] == dense
    assert not any(name in ("VARLEN", "KV_CACHE") for v in dense for name, _ in v.defines)
    added = every[len(dense):]
    assert {v.kernel for v in added if not (dict(v.defines).get("VARLEN") or dict(v.defines).get("KV_CACHE"))} == {
        "kv_combine", "kv_append"}
    assert {dict(v.defines).get("KV_CACHE") for v in added if dict(v.defines).get("KV_SPLIT")} == {1, 2}
    assert not any(v.kernel.startswith("hopper") or "FLOAT_MASK" in dict(v.defines) for v in added)
    assert not any(dict(v.defines).get("DKDV_MODE") == 3 for v in added)  # varlen takes dQ from its own kernel
    assert not any((dict(v.defines).get("KV_CACHE") or dict(v.defines).get("KV_SPLIT")) and v.kernel != "fwd"
                   for v in added)
    with pytest.raises(ValueError, match="forward only"):
        variants.dq_variant(cc, "float16", 64, "plain", sequences="kvcache")
    with pytest.raises(ValueError, match="no atomic dQ"):
        variants.dkdv_variants(cc, "float16", 64, "plain", atomic_dq=True, sequences="varlen")


def test_vector_stretches_of_packed_sequences_do_not_overlap():
    VECTOR_GAP, VECTOR_PAD, vector_length = packed.VECTOR_GAP, packed.VECTOR_PAD, packed.vector_length
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(0, 300, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        starts, end, cu = [], 0, 0
        for b, n in enumerate(lengths):
            start = (cu + 3) // 4 * 4 + b * VECTOR_GAP  # kernels/sequences.cuh's vector_start
            assert start % 4 == 0 and start >= end
            end = start + -(-n // VECTOR_PAD) * VECTOR_PAD
            cu += n
        assert end <= vector_length(cu, len(lengths)) and vector_length(cu, len(lengths)) % 4 == 0


# ---- GPU -----------------------------------------------------------------------------------------------------------


def _gpu_cases(check, cases: dict, grow) -> list:
    out = []
    for name, case in sorted(cases.items()):
        for dtype in (torch.float16, torch.bfloat16):
            out.append(pytest.param(check, dict(grow(case), dtype=dtype),
                                    id=f"{check.__name__[6:]}-{name}-{str(dtype)[6:]}"))
    return out


def _larger_kvcache(case):
    batch, hq, hkv, nq, d = case["shape"]
    lengths = [n * 37 + 5 if n else 0 for n in case["lengths"]]
    return dict(case, shape=(batch, hq * 2, hkv * 2, nq, d), lengths=lengths, capacity=max(lengths) + 64)


def _larger_varlen(case):
    lengths_q, lengths_k = case["lengths"]
    return dict(case, lengths=([n * 13 for n in lengths_q], [n * 13 for n in lengths_k]))


GPU_CASES = _gpu_cases(check_kvcache, KVCACHE_CASES, _larger_kvcache) + _gpu_cases(check_kvcache, {
    "decode_d128_long": dict(shape=(2, 32, 8, 1, 128), capacity=4096, block_size=256, lengths=[4000, 1], causal=True),
    "d256_paged_block_16": dict(shape=(3, 8, 2, 4, 256), capacity=1000, block_size=16, lengths=[999, 4, 600],
                                causal=True),
}, dict) + _gpu_cases(check_varlen, VARLEN_CASES, _larger_varlen) + _gpu_cases(check_varlen, {
    "d128_many": dict(heads=(8, 2), d=128, lengths=([1, 900, 0, 257, 33, 1024], [1, 900, 0, 257, 33, 1024]),
                      causal=True, grad_lse=True),
    "d256": dict(heads=(4, 4), d=256, lengths=([300, 17], [333, 17])),
    "d96": dict(heads=(4, 2), d=96, lengths=([200, 129], [150, 300]), window=(40, 40)),
}, dict)


@gpu
@needs_gpu
@pytest.mark.parametrize("check, case", GPU_CASES)
def test_gpu_matches_reference(gpu_backend, poisoned, check, case):
    failures = check(gpu_backend, case, "cuda")
    assert not failures, failures


@gpu
@needs_gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_append_matches_indexing(gpu_backend, poisoned, dtype, paged):
    failures = check_append(gpu_backend, "cuda", dtype, paged, heads_kv=8, seqlen_q=4, head_dim=128, head_dim_v=128)
    assert not failures, failures


@gpu
@needs_gpu
@pytest.mark.parametrize("kind, heads_q", [("left", 32), ("per_head", 8)])
def test_gpu_dense_decoding_step_with_a_boolean_mask(gpu_backend, poisoned, monkeypatch, kind, heads_q):
    """On the GPU at a decoding step's real size (B = 3, 8 key/value heads, 5000 keys, d = 128): a boolean mask's step
    takes the split-KV cache kernels (query heads packed for a left-padding mask) and matches the reference."""
    cache_calls = recorded_calls(monkeypatch, "forward_kvcache")
    batch, nk = 3, 5000
    q, k, v, grad_out = dense_inputs(batch, heads_q, 8, 1, nk, 128, torch.bfloat16, "cuda")
    params = dense_params(1, nk, 128, causal="bottom_right", mask=_decoding_mask(kind, batch, heads_q, nk).cuda())
    failures = check_dense(gpu_backend, q, k, v, grad_out, params)
    assert not failures, failures
    assert len(cache_calls) == 1


@gpu
@needs_gpu
def test_gpu_public_entry_points_with_backend_cupy():
    import mhattn

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=gen).half().cuda()
    k_cache = torch.randn(16, 2, 64, 64, generator=gen).half().cuda()
    v_cache = torch.randn(16, 2, 64, 64, generator=gen).half().cuda()
    table = torch.randperm(16, generator=gen)[:8].view(2, 4).to(torch.int32).cuda()
    new_k = torch.randn(2, 2, 1, 64, generator=gen).half().cuda()
    new_v = torch.randn(2, 2, 1, 64, generator=gen).half().cuda()
    seqlens = torch.tensor([100, 7], dtype=torch.int32).cuda()
    args = (q, k_cache, v_cache, new_k, new_v, seqlens, table)
    assert mhattn.decode.explain(*args, backend="cupy").chosen == "cupy"
    with torch.no_grad():
        out = mhattn.attention_with_kvcache(*args, backend="cupy")
        gold = mhattn.attention_with_kvcache(*args, backend="reference")
    assert (out.float() - gold.float()).abs().max() < 1e-2

    lengths = [100, 0, 333]
    cu = torch.tensor([0, 100, 100, 433], dtype=torch.int32).cuda()
    q, k, v = (torch.randn(433, h, 64, generator=gen).half().cuda().requires_grad_() for h in (8, 2, 2))
    out = mhattn.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True, enable_gqa=True,
                                  backend="cupy")
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    gold = mhattn.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True, enable_gqa=True,
                                   backend="reference")
    gold.float().square().sum().backward()
    assert (out.float() - gold.float()).abs().max() < 1e-2
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.isfinite(mine).all() and (mine.float() - theirs.float()).abs().max() < 5e-2 * max(
            1.0, float(theirs.abs().max()))
