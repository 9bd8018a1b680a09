"""attention_with_kvcache (contiguous and paged caches) and varlen_attention against the float64 definition.

Groups, as in test_triton_backend.py:

- the reference backend on the CPU against a float64 gold written independently here (gathering each
  sequence's keys by hand, SDPA-style masks), input checks, and the dispatcher's reasons;
- the Triton kernels under TRITON_INTERPRET=1 (one worker process, ``check_*`` functions of this file),
  judged by CONFORMANCE.md's tolerance rule, with NaN-poisoned allocations;
- GPU tests (marker ``gpu``): the same checks on CUDA in fp16 and bf16 at decoding shapes.
"""

from __future__ import annotations


import pytest
import torch

import mhattn
from mhattn.backends.base import AttentionParams
from mhattn.conformance.tolerance import compare
from mhattn.dropout_rng import draw_seed, seed_words as words_of
from mhattn.reference.naive import naive_attention

from test_triton_backend import interpreter_worker, poisoned_allocations

HAS_CUDA = torch.cuda.is_available()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# ---- inputs ---------------------------------------------------------------------------------------------


def _compiled(fn):
    """fn through torch.compile as one graph (aot_eager: the graph runs op by op, so values match eager's)."""
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def make_cache(dtype, device, batch, heads_q, heads_kv, seqlen_q, head_dim, cached, capacity, block_size, append,
               generator, head_dim_v=None):
    """q, the cache (contiguous, or a shuffled paged pool with its block table), the new k/v (or None), and
    cache_seqlens. ``cached``: tokens already in each sequence's cache; a contiguous cache holds NaN past each
    sequence's keys (cached plus appended)."""
    head_dim_v = head_dim_v or head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = randn(batch, heads_q, seqlen_q, head_dim)
    new_k = randn(batch, heads_kv, seqlen_q, head_dim) if append else None
    new_v = randn(batch, heads_kv, seqlen_q, head_dim_v) if append else None
    seqlens = torch.tensor(cached, dtype=torch.int32, device=device)
    if block_size is None:
        k_cache, v_cache = randn(batch, heads_kv, capacity, head_dim), randn(batch, heads_kv, capacity, head_dim_v)
        for b, c in enumerate(cached):  # rows past each sequence's keys are never to be read: NaN shows it
            end = c + (seqlen_q if append else 0)
            k_cache[b, :, end:] = float("nan")
            v_cache[b, :, end:] = float("nan")
        return q, k_cache, v_cache, new_k, new_v, seqlens, None
    max_blocks = -(-capacity // block_size)
    num_blocks = batch * max_blocks + 3  # a few blocks no sequence uses
    order = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks]
    table = order.reshape(batch, max_blocks).to(torch.int32).to(device)
    return q, randn(num_blocks, heads_kv, block_size, head_dim), randn(num_blocks, heads_kv, block_size, head_dim_v), \
        new_k, new_v, seqlens, table


def sequence_keys(k_cache, v_cache, table, b, length):
    """Sequence b's first ``length`` keys and values as (1, Hkv, length, D): written here independently of
    mhattn.reference.packed (a plain loop over positions)."""
    if table is None:
        return k_cache[b:b + 1, :, :length], v_cache[b:b + 1, :, :length]
    block_size = k_cache.shape[2]
    rows_k = [k_cache[int(table[b, j // block_size]), :, j % block_size] for j in range(length)]
    rows_v = [v_cache[int(table[b, j // block_size]), :, j % block_size] for j in range(length)]
    if not rows_k:
        return k_cache[:1, :, :0], v_cache[:1, :, :0]
    return torch.stack(rows_k, 1)[None], torch.stack(rows_v, 1)[None]


def kvcache_gold(q, k_cache, v_cache, table, lengths, params, dtype):
    """out, lse of every sequence by naive_attention in ``dtype`` (float64 for the gold)."""
    seqlen_q = q.shape[2]
    outs, lses = [], []
    for b, length in enumerate(lengths):
        k, v = sequence_keys(k_cache, v_cache, table, b, length)
        if length == 0:
            outs.append(torch.zeros_like(q[b:b + 1, :, :, :1]).expand(-1, -1, -1, v_cache.shape[-1]).to(dtype))
            lses.append(torch.full(q[b:b + 1].shape[:-1], float("-inf"), dtype=dtype))
            continue
        out, lse = naive_attention(q[b:b + 1].to(dtype), k.to(dtype), v.to(dtype),
                                   params.replace(diag_offset=length - seqlen_q))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs).cpu(), torch.cat(lses).cpu()


def _params_for(scale, is_causal, window, softcap, dropout_p=0.0, seed=(0, 0)):
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return AttentionParams(scale=scale, window_left=left, window_right=right, softcap=softcap, dropout_p=dropout_p,
                           seed=seed)


def check_kvcache(backend="triton", dtype="float16", device="cpu", batch=2, heads_q=4, heads_kv=2, seqlen_q=1,
                  head_dim=32, head_dim_v=None, cached=(37, 90), capacity=100, block_size=None, append=True,
                  is_causal=True, window=None, softcap=None, seed=0, compiled=False):
    """attention_with_kvcache on ``backend`` against the float64 gold (CONFORMANCE.md's rule), and the cache
    holding the appended tokens afterwards; ``compiled``: called through torch.compile (its custom op)."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(100 + seed)
    q, k_cache, v_cache, new_k, new_v, seqlens, table = make_cache(
        dt, device, batch, heads_q, heads_kv, seqlen_q, head_dim, list(cached), capacity, block_size, append, gen,
        head_dim_v)
    lengths = [c + (seqlen_q if append else 0) for c in cached]
    call = _compiled(mhattn.attention_with_kvcache) if compiled else mhattn.attention_with_kvcache
    with poisoned_allocations():
        out, lse = call(q, k_cache, v_cache, new_k, new_v, seqlens, table, is_causal=is_causal, window=window,
                        softcap=softcap, return_lse=True, backend=backend)
    assert out.shape == (batch, heads_q, seqlen_q, v_cache.shape[-1]) and out.dtype == dt
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype in (torch.float32, torch.float64)
    assert seqlens.tolist() == list(cached), "cache_seqlens must not change"
    if append:  # the new tokens sit in the cache at their positions
        for b, c in enumerate(cached):
            k, v = sequence_keys(k_cache, v_cache, table, b, c + seqlen_q)
            assert torch.equal(k[0, :, c:], new_k[b]) and torch.equal(v[0, :, c:], new_v[b])
    params = _params_for(head_dim ** -0.5, is_causal, window, softcap)
    gold = kvcache_gold(q, k_cache, v_cache, table, lengths, params, torch.float64)
    lowp = None if dt in (torch.float32, torch.float64) else kvcache_gold(q, k_cache, v_cache, table, lengths, params, dt)
    results = [compare(name, x.cpu(), gold[i], None if lowp is None else lowp[i], dtype=dt)
               for i, (name, x) in enumerate((("out", out), ("lse", lse)))]
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "; ".join(failed)


def make_packed(dtype, device, lengths_q, lengths_k, heads_q, heads_kv, head_dim, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0).tolist()), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0).tolist()), dtype=torch.int32, device=device)
    q = randn(sum(lengths_q), heads_q, head_dim)
    k = randn(sum(lengths_k), heads_kv, head_dim)
    v = randn(sum(lengths_k), heads_kv, head_dim)
    return q, k, v, cu_q, cu_k


def varlen_gold(q, k, v, lengths_q, lengths_k, params, dtype, grad_out, grad_lse):
    """(out, lse, dq, dk, dv) by naive_attention per sequence in ``dtype``, gradients by torch autograd."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_(True) for t in (q, k, v)]
    keep = None
    if params.dropout_p > 0.0:
        from mhattn.dropout_rng import keep_mask

        keep = keep_mask(params.seed, len(lengths_q), q.shape[1], max(lengths_q), max(lengths_k), params.dropout_p)
    outs, lses = [], []
    qs = ks = 0
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        qb = leaves[0][qs:qs + nq].transpose(0, 1)[None]
        if nk == 0:
            outs.append(qb[0].transpose(0, 1) * 0)
            lses.append(torch.full((q.shape[1], nq), float("-inf"), dtype=dtype))
        else:
            kb, vb = (t[ks:ks + nk].transpose(0, 1)[None] for t in leaves[1:])
            keep_b = None if keep is None else keep[b:b + 1, :, :nq, :nk]
            out, lse = naive_attention(qb, kb, vb, params, keep=keep_b)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        qs, ks = qs + nq, ks + nk
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    loss = (out * grad_out.cpu().to(dtype)).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0, lse) * grad_lse.cpu().to(dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out.detach(), lse.detach(), *grads)


def check_varlen(backend="triton", dtype="float16", device="cpu", lengths_q=(5, 0, 35, 1), lengths_k=(9, 3, 38, 0),
                 heads_q=4, heads_kv=2, head_dim=32, is_causal=False, window=None, softcap=None, dropout_p=0.0,
                 grad_lse=False, seed=0, compiled=False):
    """varlen_attention forward and backward on ``backend`` against the float64 gold; ``compiled``: called
    through torch.compile (its custom ops)."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(200 + seed)
    q, k, v, cu_q, cu_k = make_packed(dt, device, lengths_q, lengths_k, heads_q, heads_kv, head_dim, gen)
    grad_out = torch.randn(q.shape[0], heads_q, head_dim, generator=gen).to(device=device, dtype=dt)
    glse = torch.randn(heads_q, q.shape[0], generator=gen).to(device) if grad_lse else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(5 + seed)  # the dropout seed varlen_attention draws
    seed_words = words_of(draw_seed(q.device)) if dropout_p else (0, 0)
    torch.manual_seed(5 + seed)
    call = _compiled(mhattn.varlen_attention) if compiled else mhattn.varlen_attention
    with poisoned_allocations():
        out, lse = call(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=dropout_p, is_causal=is_causal,
                        enable_gqa=heads_q != heads_kv, window=window, softcap=softcap, return_lse=True,
                        backend=backend)
        loss = (out * grad_out).float().sum()
        if grad_lse:
            loss = loss + (torch.where(torch.isinf(lse), 0, lse) * glse).sum()
        dq, dk, dv = torch.autograd.grad(loss, leaves)
    assert out.shape == (q.shape[0], heads_q, head_dim) and lse.shape == (heads_q, q.shape[0])
    params = _params_for(head_dim ** -0.5, is_causal, window, softcap, dropout_p, seed_words)
    gold = varlen_gold(q, k, v, list(lengths_q), list(lengths_k), params, torch.float64, grad_out, glse)
    lowp = None if dt in (torch.float32, torch.float64) else varlen_gold(q, k, v, list(lengths_q), list(lengths_k),
                                                                          params, dt, grad_out, glse)
    grad_scale = max(float(g.abs().max()) for g in gold[2:5] if g.numel())
    results = []
    for i, (name, x) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))):
        floor_scale = grad_scale if name in ("dq", "dk") else None
        results.append(compare(name, x.detach().cpu(), gold[i], None if lowp is None else lowp[i], dtype=dt,
                               floor_scale=floor_scale))
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "; ".join(failed) + " | all: " + "; ".join(str(r) for r in results)


def check_varlen_through_descriptors(**kwargs):
    """check_varlen with a pinned tile that loads K/V (and Q/dO in the dK/dV kernel) through tensor
    descriptors: each descriptor starts at its sequence's first row."""
    from mhattn.backends.triton import configs

    with configs.pin("16,16,4,1,tma"):
        check_varlen(**kwargs)


def check_dense_decode(dtype="float16", device="cpu", batch=1, heads_q=8, heads_kv=2, seqlen_q=1, seqlen_k=300,
                       head_dim=32, causal=None, window=None, softcap=None, mask=None):
    """mhattn.attention with few query rows per key/value head (the split-KV path of the Triton backend),
    forward and backward, against the float64 reference; ``mask``: a mask kind of test_triton_backend.make_mask (a
    key-padding mask or bias (B, 1, 1, Nk), or a bool mask (B, 1, Nq, Nk), broadcast over the heads)."""
    from test_triton_backend import check_attention

    check_attention(dtype=dtype, device=device, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                    seqlen_k=seqlen_k, head_dim=head_dim, causal=causal, window=window, softcap=softcap, mask=mask)


def check_split_kv_path_taken(device="cpu"):
    """The Triton backend's forward runs the split-KV kernels for decoding shapes and several splits happen."""
    from mhattn.backends.triton import decode_launch

    calls = []
    original = decode_launch._split_kv_launches  # (every split-KV launch, prepared step or not, goes through it)

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    decode_launch._split_kv_launches = spy
    try:
        q = torch.randn(1, 8, 2, 32, device=device, dtype=torch.float16)
        k = torch.randn(1, 2, 300, 32, device=device, dtype=torch.float16)
        mhattn.attention(q, k, k, enable_gqa=True, backend="triton")
        assert calls, "the split-KV path was not taken for Nq = 2, 4 query heads per key/value head"
        calls.clear()
        # A key-padding mask (B, 1, 1, Nk) or bias is read by the split kernel.
        padding = torch.arange(300, device=device) >= 100
        for mask in (padding.view(1, 1, 1, 300), torch.zeros(1, 1, 1, 300, device=device).masked_fill(
                ~padding, float("-inf"))):
            mhattn.attention(q, k, k, attn_mask=mask, enable_gqa=True, backend="triton")
            assert calls, f"a {mask.dtype} key-padding mask must keep the split-KV path"
            calls.clear()
        # A mask that varies over the query rows (a speculative step's) or over the heads (a per-head bias) is read by
        # it too; one whose gradient is asked for is not.
        rows_mask = torch.rand(1, 1, 2, 300, device=device) > 0.5
        mhattn.attention(q, k, k, attn_mask=rows_mask, enable_gqa=True, backend="triton")
        assert calls, "a mask the same for every head must keep the split-KV path"
        calls.clear()
        heads_mask = torch.rand(1, 8, 2, 300, device=device) > 0.5
        mhattn.attention(q, k, k, attn_mask=heads_mask, enable_gqa=True, backend="triton")
        assert calls, "a mask that varies over the heads must keep the split-KV path"
        calls.clear()
        bias = torch.randn(1, 8, 2, 300, device=device, requires_grad=True)
        mhattn.attention(q, k, k, attn_mask=bias, enable_gqa=True, backend="triton")
        assert not calls, "a mask whose gradient is asked for must take the FlashAttention-2 forward"
        q = torch.randn(1, 8, 40, 32, device=device, dtype=torch.float16)
        mhattn.attention(q, k, k, enable_gqa=True, backend="triton")
        assert not calls, "160 rows per key/value head must take the FlashAttention-2 forward"
    finally:
        decode_launch._split_kv_launches = original
    if device == "cpu":
        assert decode_launch.num_splits(2, 300, decode_launch.INTERPRETER_SM_COUNT,
                                        decode_launch.INTERPRETER_MIN_KEYS_PER_SPLIT) > 1


def check_split_partials_kept(device="cpu", streams=False):
    """Decoding steps of one shape on one stream share the split kernel's partials (made once, decode_launch
    .split_partials) and each step's output is its own: a step with other inputs right after gives the float64
    reference's answer, not the one before. Another shape (other split counts) gets other partials; with
    ``streams`` (CUDA) a step on another stream gets its own, and a step captured into a CUDA graph allocates its own
    and replays correctly."""
    from mhattn.backends.triton import decode_launch

    given = []
    original = decode_launch.split_partials

    def spy(*args):
        given.append(original(*args))
        return given[-1]

    def step(q, k, v):
        return mhattn.attention(q, k, v, enable_gqa=True, backend="triton")

    def expected(q, k, v):
        return mhattn.attention(q.double(), k.double(), v.double(), enable_gqa=True, backend="reference")

    def inputs(seqlen_k, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        return tuple(torch.randn(1, heads, rows, 32, device=device, dtype=torch.float16, generator=gen)
                     for heads, rows in ((8, 1), (2, seqlen_k), (2, seqlen_k)))

    decode_launch.split_partials = spy
    try:
        # Cache lengths with different split counts (the interpreter's rule splits finer than the GPU's).
        length, shorter_length = (300, 100) if device == "cpu" else (1000, 300)
        first, second, shorter = inputs(length, 1), inputs(length, 2), inputs(shorter_length, 3)
        results = [(step(*x), expected(*x)) for x in (first, second, first, shorter)]
        assert len(given) == 4 and all(p[0] is given[0][0] and p[1] is given[0][1] for p in given[:3]), \
            "steps of one shape on one stream must reuse the split partials"
        assert given[3][0] is not given[0][0], "another split shape must get partials of its own"
        for out, gold in results:
            torch.testing.assert_close(out.double(), gold, atol=2e-3, rtol=2e-3)
        if streams:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                on_side = step(*second)
            torch.cuda.current_stream().wait_stream(side)
            assert given[-1][0] is not given[0][0], "a step on another stream must not share the partials"
            torch.testing.assert_close(on_side.double(), results[1][1], atol=2e-3, rtol=2e-3)
            static = [x.clone() for x in first]
            with torch.cuda.stream(side):  # warm-up on a side stream, as capture needs
                step(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step(*static)
            assert all(given[-1][0] is not p[0] for p in decode_launch._split_partials.values()), \
                "a captured step must allocate its own partials"
            for x, new in zip(static, second):
                x.copy_(new)
            step(*first)  # an eager step on the kept partials between the capture and the replay
            graph.replay()
            torch.testing.assert_close(captured.double(), results[1][1], atol=2e-3, rtol=2e-3)
    finally:
        decode_launch.split_partials = original


def check_append_kernel(paged=False, device="cpu", dtype="float16", seqlen_q=3):
    """The Triton backend's append (decode.append_kv_kernel, one launch) against torch's indexing on the same inputs,
    outputs poisoned: the rows it writes, the key counts it returns, nothing written past the cache or through a
    block-table entry outside the pool (as while a CUDA graph is captured, when no host check runs first), and
    strided inputs: cache_seqlens a strided view, the block table a transposed one, k and v with other batch and head
    strides, the cache a view of a longer buffer."""
    from mhattn.backends.triton import decode_launch
    from mhattn.decode import _append_by_indexing

    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(7)
    batch, heads_kv, head_dim, head_dim_v, capacity = 3, 2, 32, 24, 40

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    # k, v: (B, Hkv, Nq, D) views of (Nq, B, Hkv, D) tensors (last dim contiguous, the others not)
    k = randn(seqlen_q, batch, heads_kv, head_dim).permute(1, 2, 0, 3)
    v = randn(seqlen_q, batch, heads_kv, head_dim_v).permute(1, 2, 0, 3)
    # sequence 2's last new token falls one past the cache: not written
    cached = torch.tensor([5, 99, 0, 99, capacity - seqlen_q + 1, 99], dtype=torch.int32, device=device)[::2]
    if paged:
        block_size = 8
        pool = batch * capacity // block_size + 2
        k_cache, v_cache = randn(pool, heads_kv, block_size, head_dim), randn(pool, heads_kv, block_size, head_dim_v)
        order = torch.randperm(pool, generator=gen)[:batch * capacity // block_size].to(torch.int32)
        table = order.reshape(capacity // block_size, batch).to(device).t()  # (B, max_blocks), transposed strides
        table[0, 0] = pool  # sequence 0's first block lies outside the pool: its positions 5 .. 7 are not written
        before_k, before_v = k_cache.clone(), v_cache.clone()
        targets = (k_cache, v_cache)
    else:
        table = None
        longer_k, longer_v = randn(batch, heads_kv, capacity + 8, head_dim), randn(batch, heads_kv, capacity + 8,
                                                                                     head_dim_v)
        before_k, before_v = longer_k.clone(), longer_v.clone()
        targets = (longer_k[:, :, :capacity], longer_v[:, :, :capacity])
    sites = len(decode_launch._append_sites)
    with poisoned_allocations():
        seqlens = decode_launch.append_kv(*targets, k, v, cached, table)
    assert seqlens is not None, "the kernel must take these inputs"
    assert len(decode_launch._append_sites) == sites + 1 or sites == decode_launch.APPEND_SITES_LIMIT
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [c + seqlen_q for c in cached.tolist()]

    # What torch's indexing writes for the positions inside the cache (and, paged, inside the pool).
    want_k, want_v = before_k.clone(), before_v.clone()
    for b, start in enumerate(cached.tolist()):
        for i in range(seqlen_q):
            position = start + i
            if position >= capacity:
                continue
            if paged:
                block = int(table[b, position // block_size])
                if not 0 <= block < want_k.shape[0]:
                    continue
                want_k[block, :, position % block_size] = k[b, :, i]
                want_v[block, :, position % block_size] = v[b, :, i]
            else:
                want_k[b, :, position] = k[b, :, i]
                want_v[b, :, position] = v[b, :, i]
    got_k, got_v = (k_cache, v_cache) if paged else (longer_k, longer_v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    # Inside the cache the two appends agree (fresh copies, positions that all fit).
    fitting = torch.tensor([5, 0, 7], dtype=torch.int32, device=device)
    if paged:
        table[0, 0] = 0
    ours = [t.clone() for t in targets]
    theirs = [t.clone() for t in targets]
    counts = decode_launch.append_kv(*ours, k, v, fitting, table)
    assert torch.equal(counts, _append_by_indexing(*theirs, k, v, fitting, table))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def check_kvcache_appends_inside_the_split_kernel(device="cpu"):
    """attention_with_kvcache on the Triton backend appends inside the split kernel (forward_kvcache_appending): neither
    the backend's append kernel nor torch's indexing runs, contiguous and paged; a new key whose head dim is not
    contiguous goes through torch's indexing (neither kernel takes it)."""
    import mhattn.decode as decode_module
    from mhattn.backends.triton.backend import TritonBackend

    calls = []
    original, own_append = decode_module._append_by_indexing, TritonBackend.append_kvcache
    decode_module._append_by_indexing = lambda *args: calls.append("indexing") or original(*args)
    TritonBackend.append_kvcache = lambda self, *args: calls.append("append kernel") or own_append(self, *args)
    try:
        check_kvcache(device=device, seqlen_q=2)
        check_kvcache(device=device, block_size=16, seqlen_q=2)
        assert not calls, f"the Triton backend's step must append inside the split kernel, got {calls}"
        gen = torch.Generator().manual_seed(3)
        q, k_cache, v_cache, new_k, new_v, seqlens, _ = make_cache(torch.float16, device, 2, 4, 2, 1, 32, [4, 9], 20,
                                                                   None, True, gen)
        wide = torch.zeros(*new_k.shape[:-1], 2 * new_k.shape[-1], dtype=new_k.dtype, device=device)
        wide[..., ::2] = new_k
        strided_k = wide[..., ::2]  # head dim not contiguous
        mhattn.attention_with_kvcache(q, k_cache, v_cache, strided_k, new_v, seqlens, backend="triton")
        assert calls == ["append kernel", "indexing"]
        for b, c in enumerate((4, 9)):
            assert torch.equal(k_cache[b, :, c], new_k[b, :, 0]) and torch.equal(v_cache[b, :, c], new_v[b, :, 0])
    finally:
        decode_module._append_by_indexing, TritonBackend.append_kvcache = original, own_append


def check_kvcache_prepared_steps(device="cpu"):
    """Repeated attention_with_kvcache calls on the Triton backend run the step it prepared at their signature's first
    call (kvcache_call, asked once per signature: return_lse is part of it), appending or not; a returned lse is
    each call's own (the scratch lse only serves calls that return none), and the outputs are the reference's."""
    import mhattn.decode as decode_module
    from mhattn.backends.triton.backend import TritonBackend

    asked = []
    own = TritonBackend.kvcache_call
    TritonBackend.kvcache_call = lambda self, *args: asked.append(args[-1]) or own(self, *args)
    decode_module._known_calls.clear()
    try:
        gen = torch.Generator().manual_seed(5)
        q, k_cache, v_cache, new_k, new_v, seqlens, _ = make_cache(torch.float32, device, 2, 4, 2, 1, 16, [7, 30], 40,
                                                                   None, True, gen)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        for step in range(3):
            for return_lse in (True, False):
                positions = seqlens + (2 * step + (0 if return_lse else 1))
                got = mhattn.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, positions, backend="triton",
                                                    return_lse=return_lse)
                want = mhattn.attention_with_kvcache(q, want_k, want_v, new_k, new_v, positions, backend="reference",
                                                     return_lse=return_lse)
                if return_lse:
                    (out, lse), (want_out, want_lse) = got, want
                    if step:
                        assert lse.data_ptr() != last_lse.data_ptr(), "a returned lse must be the call's own"
                    last_lse = lse
                    torch.testing.assert_close(lse, want_lse.float(), atol=1e-5, rtol=1e-5)
                else:
                    out, want_out = got, want
                    assert isinstance(got, torch.Tensor)
                torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
                for cache, want_cache in ((k_cache, want_k), (v_cache, want_v)):  # (NaN past the keys)
                    torch.testing.assert_close(cache, want_cache, atol=0, rtol=0, equal_nan=True)
        mhattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, backend="triton")
        mhattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, backend="triton")
        assert asked == [True, False, False], asked  # once per signature
    finally:
        TritonBackend.kvcache_call = own
        decode_module._known_calls.clear()


def check_kvcache_rows_across_splits(device="cuda", steps=3, dtype=torch.bfloat16):
    """Steps that append 16 rows to each of 16 sequences (one key/value head, so 16 programs, each sequence's keys
    split among several): at the first step every sequence's new rows straddle two programs' shares, which each write
    and read their own part (the split kernel's APPEND). The caches equal
    torch's indexing's and the outputs the float64 reference's at every step, the later steps through the step
    prepared at the first."""
    from mhattn.backends.base import AttentionParams, KVCache
    from mhattn.backends.triton import decode_launch
    from mhattn.conformance.packed import kvcache_reference
    from mhattn.decode import _append_by_indexing

    gen = torch.Generator(device=device).manual_seed(21)
    batch, nq, head_dim, capacity = 16, 16, 128, 8192
    # The shares as the split kernel cuts them (a whole number of key blocks each): sequence lengths after the first
    # step from 4096 up whose new rows hold a boundary between two shares, spread over the ones there are.
    splits, tile = decode_launch.split_and_tile(torch.device(device), batch, capacity, head_dim, head_dim, 2, False)
    assert splits > 1

    def straddles(length):
        share = -(-(-(-length // splits)) // tile.block_n) * tile.block_n
        return (length - 1) // share != (length - nq) // share

    lengths = [n for n in range(4096, capacity - 2 * nq) if straddles(n)]
    assert len(lengths) >= batch, (splits, tile)
    cached = torch.tensor(lengths[::len(lengths) // batch][:batch], dtype=torch.int32, device=device) - nq

    k_cache, v_cache = (torch.randn(batch, 1, capacity, head_dim, device=device, dtype=dtype, generator=gen)
                        for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for step in range(steps):
        q, new_k, new_v = (torch.randn(batch, 1, nq, head_dim, device=device, dtype=dtype, generator=gen)
                           for _ in range(3))
        out = mhattn.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, cached, backend="triton")
        _append_by_indexing(want_k, want_v, new_k, new_v, cached, None)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), f"step {step}: caches differ"
        lengths = [n + nq for n in cached.tolist()]
        gold = kvcache_reference(q.double(), KVCache(want_k.double(), want_v.double(), None),
                                 AttentionParams(scale=head_dim ** -0.5, window_right=0), lengths, torch.float64)
        error = float((out.double() - gold["out"]).abs().max())
        assert error < 2e-2, f"step {step}: max error {error} against the float64 reference"
        cached += nq


def check_kvcache_prepared_step_takes_each_call_s_tensors(device="cpu"):
    """A step prepared at a signature's first call (kvcache_call) launches later calls with their own tensors only
    (decode_launch.PreparedSplitStep): calls with other q, caches, new keys and values, cache_seqlens and block table
    of the same shapes, contiguous and paged, each equal the reference's and write their own cache, and one call's
    output is not overwritten by the next (float32: on a GPU the split kernel's dots may round to TF32)."""
    import mhattn.decode as decode_module
    from mhattn.backends.triton.backend import TritonBackend

    tolerance = 1e-5 if device == "cpu" else 5e-3

    asked = []
    own = TritonBackend.kvcache_call
    TritonBackend.kvcache_call = lambda self, *args: asked.append(args) or own(self, *args)
    decode_module._known_calls.clear()
    try:
        for block_size in (None, 8):
            asked.clear()
            earlier = None
            for step in range(3):
                gen = torch.Generator().manual_seed(40 + step)
                q, k_cache, v_cache, new_k, new_v, seqlens, table = make_cache(
                    torch.float32, device, 2, 4, 2, 1, 16, [5 + 9 * step, 30 - 7 * step], 40, block_size, True, gen)
                want_k, want_v = k_cache.clone(), v_cache.clone()
                out = mhattn.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, seqlens, table,
                                                    backend="triton")
                want = mhattn.attention_with_kvcache(q, want_k, want_v, new_k, new_v, seqlens, table,
                                                     backend="reference")
                torch.testing.assert_close(out, want, atol=tolerance, rtol=tolerance)
                for cache, want_cache in ((k_cache, want_k), (v_cache, want_v)):  # (NaN past the keys)
                    torch.testing.assert_close(cache, want_cache, atol=0, rtol=0, equal_nan=True)
                if earlier is not None:
                    torch.testing.assert_close(earlier[0], earlier[1], atol=0, rtol=0)
                earlier = (out, out.clone())
            assert len(asked) == 1, f"block size {block_size}: kvcache_call asked {len(asked)} times"
    finally:
        TritonBackend.kvcache_call = own
        decode_module._known_calls.clear()


def check_prepared_split_steps_keep_their_launches(device="cpu"):
    """A decoding step through mhattn.attention (16-bit, untracked: TritonBackend.native_call) and a KV-cache step
    (kvcache_call) launch every call after their signature's first through the launches that call prepared: the split
    plan and launch arguments are worked out once (decode_launch._split_kv_launches runs once) while each call's own
    tensors are read (outputs equal the reference's, an earlier output is left alone). A float32 KV-cache step whose
    dot precision changes with torch's matmul setting prepares its launches again."""
    from mhattn import dispatch
    from mhattn.backends.triton import decode_launch

    made = []
    original = decode_launch._split_kv_launches

    def counting(*args, **kwargs):
        made.append(args[0].dtype)
        return original(*args, **kwargs)

    decode_launch._split_kv_launches = counting
    dispatch.clear_cache()
    precision = torch.get_float32_matmul_precision()
    try:
        earlier = None
        for step in range(3):
            gen = torch.Generator().manual_seed(60 + step)
            q = torch.randn(2, 8, 1, 32, generator=gen).to(device, torch.float16)
            k, v = (torch.randn(2, 2, 150, 32, generator=gen).to(device, torch.float16) for _ in range(2))
            out = mhattn.attention(q, k, v, enable_gqa=True, backend="triton")
            want = mhattn.attention(q.double(), k.double(), v.double(), enable_gqa=True, backend="reference")
            torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
            if earlier is not None:
                torch.testing.assert_close(earlier[0], earlier[1], atol=0, rtol=0)
            earlier = (out, out.clone())
        assert made == [torch.float16], f"the dense step's launches were prepared {len(made)} times"
        made.clear()
        # A padding mask (B, 1, 1, Nk): the steps share the first one's launches (the mask's layout is part of the
        # signature) and each reads its own mask (here the padding moves).
        for step in range(3):
            gen = torch.Generator().manual_seed(70 + step)
            q = torch.randn(2, 8, 1, 32, generator=gen).to(device, torch.float16)
            k, v = (torch.randn(2, 2, 150, 32, generator=gen).to(device, torch.float16) for _ in range(2))
            keys = torch.arange(150, device=device) >= torch.tensor([[20 + 40 * step], [100 - 30 * step]],
                                                                      device=device)
            mask = keys.view(2, 1, 1, 150)
            out = mhattn.attention(q, k, v, attn_mask=mask, enable_gqa=True, backend="triton")
            want = mhattn.attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True,
                                    backend="reference")
            torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
        assert made == [torch.float16], f"the masked step's launches were prepared {len(made)} times"
        made.clear()
        gen = torch.Generator().manual_seed(66)
        q, k_cache, v_cache, _, _, seqlens, _ = make_cache(torch.float32, device, 2, 4, 2, 1, 16, [7, 30], 40, None,
                                                           False, gen)
        for setting in ("highest", "highest", "high", "high"):
            torch.set_float32_matmul_precision(setting)
            mhattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, backend="triton")
        assert len(made) == 2, f"the float32 KV-cache step prepared its launches {len(made)} times, not once a setting"
    finally:
        decode_launch._split_kv_launches = original
        torch.set_float32_matmul_precision(precision)
        dispatch.clear_cache()


def check_kvcache_index_strides(device="cpu"):
    """cache_seqlens with a stride and a block table whose blocks are not adjacent in memory (a transposed view) give
    the same steps as their contiguous copies, with and without an append, against the float64 reference."""
    from mhattn.backends.base import AttentionParams, KVCache
    from mhattn.conformance.packed import kvcache_reference
    from mhattn.decode import _append_by_indexing

    gen = torch.Generator().manual_seed(11)
    batch, heads_kv, block_size, head_dim, blocks = 3, 2, 16, 16, 4
    pool = batch * blocks + 1
    q = torch.randn(batch, 4, 2, head_dim, generator=gen).to(device)
    k_pool, v_pool = (torch.randn(pool, heads_kv, block_size, head_dim, generator=gen).to(device) for _ in range(2))
    new_k, new_v = (torch.randn(batch, heads_kv, 2, head_dim, generator=gen).to(device) for _ in range(2))
    table = torch.randperm(batch * blocks, generator=gen).to(torch.int32).view(blocks, batch).t().to(device)
    cached = torch.tensor([5, 0, 40, 0, 61, 0], dtype=torch.int32).to(device)[::2]  # stride 2
    assert table.stride(1) != 1 and cached.stride(0) != 1
    for append in (False, True):
        k_cache, v_cache = k_pool.clone(), v_pool.clone()
        k_want, v_want = k_pool.clone(), v_pool.clone()
        if append:
            _append_by_indexing(k_want, v_want, new_k, new_v, cached, table)
        args = (new_k, new_v) if append else (None, None)
        out = mhattn.attention_with_kvcache(q, k_cache, v_cache, *args, cached, table, backend="triton")
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), f"append={append}: caches differ"
        lengths = [int(n) + (2 if append else 0) for n in cached.tolist()]
        gold = kvcache_reference(q.double(), KVCache(k_want.double(), v_want.double(), None, table),
                                 AttentionParams(scale=head_dim ** -0.5, window_right=0), lengths, torch.float64)
        error = float((out.double() - gold["out"]).abs().max())
        assert error < 1e-4, f"append={append}: max error {error} against the float64 reference"


# ---- the reference on the CPU (no kernel) ---------------------------------------------------------------

KVCACHE_CASES = {
    "decode_append": dict(),
    "decode_no_append": dict(append=False, cached=(40, 100)),
    "speculative_nq4": dict(seqlen_q=4, cached=(0, 60)),
    "empty_sequence_no_append": dict(append=False, cached=(0, 17)),
    "nq_longer_than_keys": dict(append=False, seqlen_q=6, cached=(3, 50)),  # first rows see nothing
    "not_causal": dict(is_causal=False, seqlen_q=3),
    "window": dict(window=(20, 0), seqlen_q=2),
    "softcap": dict(softcap=3.0, seqlen_q=2),
    "mha": dict(heads_q=2, heads_kv=2),
    "mqa_value_dim": dict(heads_q=4, heads_kv=1, head_dim_v=24),
    "paged_block_8": dict(block_size=8, seqlen_q=3, cached=(37, 90)),
    "paged_block_5": dict(block_size=5, cached=(0, 93)),
    "paged_window": dict(block_size=16, window=(30, 0), seqlen_q=2),
}


@pytest.mark.parametrize("case", list(KVCACHE_CASES))
def test_reference_kvcache(case):
    check_kvcache(backend="reference", dtype="float64", **KVCACHE_CASES[case])


VARLEN_CASES = {
    "uneven": dict(),
    "causal": dict(is_causal=True),
    "causal_q_ne_k": dict(is_causal=True, lengths_q=(7, 20), lengths_k=(12, 15)),
    "window_gqa": dict(window=(5, 3), heads_q=6, heads_kv=2),
    "softcap_grad_lse": dict(softcap=4.0, grad_lse=True),
    "dropout": dict(dropout_p=0.2, lengths_q=(6, 17), lengths_k=(11, 20)),
    "one_sequence": dict(lengths_q=(30,), lengths_k=(30,), is_causal=True),
}


@pytest.mark.parametrize("case", ["uneven", "causal_q_ne_k", "window_gqa", "softcap_grad_lse", "dropout"])
def test_reference_varlen(case):
    check_varlen(backend="reference", dtype="float64", **VARLEN_CASES[case])


def test_varlen_matches_attention_per_sequence():
    """Packing changes nothing: each sequence's output is mhattn.attention's on that sequence alone."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu_q, cu_k = make_packed(torch.float64, "cpu", (4, 9), (4, 9), 2, 2, 8, gen)
    out = mhattn.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, is_causal=True)
    for start, end in ((0, 4), (4, 13)):
        one = mhattn.attention(*(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=True)
        assert torch.allclose(out[start:end], one.transpose(0, 1), atol=1e-12)


def _kv_inputs(paged=False):
    q = torch.randn(2, 4, 1, 8)
    if paged:
        return q, torch.randn(6, 2, 4, 8), torch.randn(6, 2, 4, 8), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8), None


def _kv_call(q, kc, vc, table=None, **kw):
    seqlens = kw.pop("cache_seqlens", torch.tensor([3, 5], dtype=torch.int32))
    return mhattn.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, **kw)


@pytest.mark.parametrize("bad, match", [
    (lambda q, kc, vc, t: _kv_call(q[0], kc, vc), "q must have 4 dims"),
    (lambda q, kc, vc, t: _kv_call(q.double(), kc, vc), "k_cache must have the dtype of q"),
    (lambda q, kc, vc, t: _kv_call(q, kc[:, :, :, :4], vc), "head dim"),
    (lambda q, kc, vc, t: _kv_call(q, kc[:1], vc[:1]), "batch"),
    (lambda q, kc, vc, t: _kv_call(q[:, :3], kc, vc), "multiple"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, cache_seqlens=torch.tensor([3, 5])), "cache_seqlens must be int32"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, cache_seqlens=torch.tensor([3], dtype=torch.int32)), "cache_seqlens"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, cache_seqlens=torch.tensor([3, 11], dtype=torch.int32)),
     "sequence 1 needs 11"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, k=torch.randn(2, 2, 1, 8), v=torch.randn(2, 2, 1, 8),
                                   cache_seqlens=torch.tensor([3, 10], dtype=torch.int32)), "sequence 1 needs 11"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, k=torch.randn(2, 2, 1, 8)), "k and v together"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, k=torch.randn(2, 2, 2, 8), v=torch.randn(2, 2, 2, 8)), "k must have shape"),
    (lambda q, kc, vc, t: mhattn.attention_with_kvcache(q, kc, vc, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)),
     "cache_seqlens is required"),
    (lambda q, kc, vc, t: _kv_call(q.requires_grad_(), kc, vc), "forward only"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, window=(1, 2, 3)), "window"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, softcap=-1.0), "softcap"),
])
def test_kvcache_input_errors(bad, match):
    q, kc, vc, table = _kv_inputs()
    with pytest.raises(mhattn.InputError, match=match):
        bad(q, kc, vc, table)


@pytest.mark.parametrize("bad, match", [
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, t.long()), "block_table must be int32"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, t[:1]), "block_table must have shape"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32),
                                   cache_seqlens=torch.tensor([5, 1], dtype=torch.int32)), r"block_table\[0, 1\] = 9"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)),
     r"block_table\[1, 0\] = -1"),
    (lambda q, kc, vc, t: _kv_call(q, kc, vc, t, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)),
     "max_blocks \\* block_size = 8"),
])
def test_paged_kvcache_input_errors(bad, match):
    q, kc, vc, table = _kv_inputs(paged=True)
    with pytest.raises(mhattn.InputError, match=match):
        bad(q, kc, vc, table)


def test_paged_table_checked_without_cache_seqlens():
    """No cache_seqlens: every sequence fills its blocks, so every table entry must be in the pool."""
    q, kc, vc, _ = _kv_inputs(paged=True)
    with pytest.raises(mhattn.InputError, match=r"block_table\[1, 1\] = 6"):
        mhattn.attention_with_kvcache(q, kc, vc, block_table=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32))
    out = mhattn.attention_with_kvcache(q, kc, vc, block_table=torch.tensor([[0, 1], [2, 5]], dtype=torch.int32))
    assert out.shape == (2, 4, 1, 8)


def test_paged_table_entries_past_a_sequence_are_not_read():
    """Entries past a sequence's last used block may be anything (e.g. -1 padding)."""
    q, kc, vc, _ = _kv_inputs(paged=True)
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    out = _kv_call(q, kc, vc, table, cache_seqlens=torch.tensor([4, 6], dtype=torch.int32))
    assert torch.isfinite(out).all()


def test_cache_values_are_read_back_once_per_change(monkeypatch):
    """The same cache_seqlens (a decoding step's layers) is checked once; changed in place, it is checked again."""
    from mhattn import decode

    calls = []
    original = decode._check_lengths
    monkeypatch.setattr(decode, "_check_lengths", lambda *a: (calls.append(1), original(*a)))
    q, kc, vc, _ = _kv_inputs()
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    for _ in range(3):
        _kv_call(q, kc, vc, cache_seqlens=seqlens)
    assert len(calls) == 1
    seqlens += 5
    _kv_call(q, kc, vc, cache_seqlens=seqlens)
    assert len(calls) == 2
    seqlens[1] = 11  # in place, past the cache: caught on the next call
    with pytest.raises(mhattn.InputError, match="sequence 1 needs 11"):
        _kv_call(q, kc, vc, cache_seqlens=seqlens)
    with pytest.raises(mhattn.InputError, match="sequence 1 needs 11"):
        _kv_call(q, kc, vc, cache_seqlens=torch.tensor([3, 11], dtype=torch.int32))  # a new tensor


def test_values_are_checked_again_for_another_tensor_at_a_freed_ones_address():
    """check_values_once remembers tensors by address and version: a new tensor that gets a freed one's address (and
    so its key) is checked, not taken for the freed one (whose weak reference is dead)."""
    import weakref

    from mhattn import arguments

    tensor, checks = torch.zeros(3, dtype=torch.int32), []
    freed = weakref.ref(torch.zeros(1, dtype=torch.int32))  # its tensor is gone at once
    assert freed() is None
    arguments._checked[(id(tensor),)] = ((freed,), (tensor._version,), ("context",))  # as the freed one left it
    arguments.check_values_once((tensor,), ("context",), lambda: checks.append(1))
    assert checks == [1]
    arguments.check_values_once((tensor,), ("context",), lambda: checks.append(1))
    assert checks == [1]  # remembered now


def test_repeated_kvcache_calls_skip_the_checks_but_not_the_request(monkeypatch):
    """A call with the signature of an earlier one (shapes, strides, dtypes, flags, request) skips the argument
    checks and the selection; another signature, or another request, does not."""
    from mhattn import decode, dispatch

    dispatch.clear_cache()  # (the memo of calls goes with it: earlier tests made calls of this signature)
    prepared = []
    original = decode._prepare
    monkeypatch.setattr(decode, "_prepare", lambda *a: prepared.append(1) or original(*a))
    q, kc, vc, _ = _kv_inputs()
    first = _kv_call(q, kc, vc)
    again = _kv_call(q.clone(), kc, vc)
    assert len(prepared) == 1 and torch.equal(first, again)
    _kv_call(q, kc[:, :, :8], vc[:, :, :8])  # a smaller cache: another signature
    _kv_call(q, kc, vc, window=(2, 0))       # windows are not memoised
    assert len(prepared) == 3
    with mhattn.use_backend("triton"), pytest.raises(mhattn.BackendUnavailableError, match="triton"):
        _kv_call(q, kc, vc)  # the request is part of the signature: no GPU here, so triton refuses
    with pytest.raises(mhattn.InputError, match="forward only"):
        _kv_call(q.clone().requires_grad_(), kc, vc)  # requires_grad is part of it too


def test_varlen_cu_seqlens_checked_once_per_change():
    q, k, v, cq, ck = _varlen_inputs()
    mhattn.varlen_attention(q, k, v, cq, ck, 6, 7)
    cq[1] = 7  # sequence 1 now has 3 queries, sequence 0 has 7 > max_seqlen_q
    with pytest.raises(mhattn.InputError, match="more than max_seqlen_q = 6"):
        mhattn.varlen_attention(q, k, v, cq, ck, 6, 7)


def _varlen_inputs():
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    return q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q[None], k, v, cq, ck, 6, 7), "q must have 3 dims"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k.half(), v, cq, ck, 6, 7), "dtype"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v[:11], cq, ck, 6, 7), "k and v must agree"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq.long(), ck, 6, 7), "cu_seqlens_q must be int32"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck[:2], 6, 7), "shape"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq + 1, ck, 6, 7), "start at 0"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, torch.tensor([0, 5, 11], dtype=torch.int32), 6, 7),
     "end at the number of packed tokens"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                                                     torch.tensor([0, 5, 6, 12], dtype=torch.int32), 6, 7),
     "non-decreasing"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 5, 7), "more than max_seqlen_q = 5"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7.0), "max_seqlen_k"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k[:, :1], v[:, :1], cq, ck, 6, 7), "enable_gqa"),
    (lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7, dropout_p=1.0), "dropout_p"),
])
def test_varlen_input_errors(bad, match):
    with pytest.raises(mhattn.InputError, match=match):
        bad(*_varlen_inputs())


# ---- under torch.compile -----------------------------------------------------------------------------------


def _operations(recording):
    """The KV-cache and varlen entry points a recording backend ran (the reference's varlen runs its forward per
    sequence, recorded too)."""
    return [call for call in recording.calls if call.startswith(("kvcache", "varlen"))]


@pytest.mark.parametrize("paged", [False, True])
def test_compiled_kvcache_step_is_one_graph_writing_the_cache_in_place(paged):
    torch.manual_seed(0)
    q, kc, vc, table = _kv_inputs(paged)
    new_k, new_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)

    def step(q, kc, vc, k, v, seqlens, table):
        return mhattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, window=(2, -1),
                                             softcap=4.0, return_lse=True)

    assert torch._dynamo.explain(step)(q, kc.clone(), vc.clone(), new_k, new_v, seqlens, table).graph_break_count == 0
    want_k, want_v, got_k, got_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = step(q, want_k, want_v, new_k, new_v, seqlens, table)
    got = _compiled(step)(q, got_k, got_v, new_k, new_v, seqlens, table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and not torch.equal(got_k, kc)  # appended


def test_compiled_kvcache_checks_its_arguments():
    q, kc, vc, _ = _kv_inputs()
    new_k, new_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    step = _compiled(lambda q, kc, vc, k, v, n: mhattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n))
    with pytest.raises(mhattn.InputError, match="cache holds Nmax = 10"):  # a value: checked when the step runs
        step(q, kc, vc, new_k, new_v, torch.tensor([3, 10], dtype=torch.int32))
    with pytest.raises(Exception, match="multiple of k/v's heads"):  # a shape: checked at trace time
        step(q[:, :3], kc, vc, new_k, new_v, torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(Exception, match="forward only"):  # the op has no autograd
        step(q.requires_grad_(True), kc, vc, new_k, new_v, torch.tensor([3, 5], dtype=torch.int32))


def test_compiled_kvcache_and_varlen_read_the_request_when_they_run(recorders):
    a, b = recorders
    q, kc, vc, _ = _kv_inputs()
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    decode = _compiled(lambda q, kc, vc, n: mhattn.attention_with_kvcache(q, kc, vc, cache_seqlens=n))
    varlen_q, varlen_k, varlen_v, cq, ck = _varlen_inputs()
    varlen = _compiled(lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7))
    for backend in (a, b):
        with mhattn.use_backend(backend.name):
            decode(q, kc, vc, seqlens)
            varlen(varlen_q, varlen_k, varlen_v, cq, ck)
    assert _operations(a) == _operations(b) == ["kvcache", "varlen_forward"]


def test_compiled_varlen_gives_the_eager_values_and_gradients_on_the_forwards_backend(recorders):
    a, b = recorders
    torch.manual_seed(0)
    q, k, v = (torch.randn(20, heads, 16, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 12, 12, 20], dtype=torch.int32)

    def loss(q, k, v):
        out, lse = mhattn.varlen_attention(q, k, v, cu, cu, 8, 8, is_causal=True, enable_gqa=True, window=(3, -1),
                                           return_lse=True)
        return out.square().sum() + lse.nan_to_num(neginf=0.0).sum()

    assert torch._dynamo.explain(loss)(q, k, v).graph_break_count == 0
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    with mhattn.use_backend("rec_a"):
        value = _compiled(loss)(q, k, v)
    with mhattn.use_backend("rec_b"):  # the request in force at the backward does not matter
        got = torch.autograd.grad(value, (q, k, v))
    assert _operations(a) == ["varlen_forward", "varlen_backward"] and b.calls == []
    assert torch.allclose(value, loss(q, k, v), rtol=0, atol=1e-12)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-12


def test_compiled_varlen_checks_its_arguments():
    q, k, v, cq, ck = _varlen_inputs()
    with pytest.raises(mhattn.InputError, match="end at the number of packed tokens"):  # a value: when it runs
        _compiled(lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7))(
            q, k, v, cq, torch.tensor([0, 5, 11], dtype=torch.int32))
    with pytest.raises(Exception, match="max_seqlen_k must be an int"):  # a Python argument: before the op
        _compiled(lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7.0))(q, k, v, cq, ck)
    with pytest.raises(Exception, match="enable_gqa"):  # a shape: checked at trace time
        _compiled(lambda q, k, v, cq, ck: mhattn.varlen_attention(q, k, v, cq, ck, 6, 7))(
            q, k[:, :1], v[:, :1], cq, ck)


def test_dispatcher_reasons_for_the_new_operations():
    """Backends declare the operations as data; one that lacks one says so, and a forced one raises."""
    from mhattn.backends.base import OPERATIONS

    assert mhattn.get_backend("reference").capabilities.operations == frozenset(OPERATIONS)
    sdpa = mhattn.get_backend("sdpa")
    assert sdpa.capabilities.operations == frozenset({"attention"})
    q, kc, vc, table = _kv_inputs(paged=True)
    decision = mhattn.decode.explain(q, kc, vc, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                                     block_table=table)
    assert decision.chosen == "reference" and decision.problem.operation == "paged_kvcache"
    assert any("paged KV cache" in r for r in decision.reasons["sdpa"])
    assert "paged_kvcache" in str(decision)
    q, k, v, cq, ck = _varlen_inputs()
    decision = mhattn.varlen.explain(q, k, v, cq, ck, 6, 7)
    assert any("variable-length" in r for r in decision.reasons["sdpa"])
    with pytest.raises(mhattn.BackendUnavailableError, match="variable-length"):
        mhattn.varlen_attention(q, k, v, cq, ck, 6, 7, backend="sdpa")


def test_a_backend_without_an_operation_is_refused_with_its_reason():
    class DenseOnly(mhattn.Backend):
        name = "denseonly"
        capabilities = mhattn.Capabilities(device_types=frozenset({"cpu"}),
                                           dtypes=frozenset({torch.float32}), min_compute_capability=None)

    mhattn.register_backend(DenseOnly())
    try:
        q, kc, vc, _ = _kv_inputs()
        with pytest.raises(mhattn.BackendUnavailableError, match="contiguous KV cache"):
            _kv_call(q, kc, vc, backend="denseonly")
        assert float(kc[0, 0, 3].abs().sum()) != 0  # nothing was written before the refusal
    finally:
        mhattn.unregister_backend("denseonly")


# ---- the Triton kernels under the interpreter -----------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_worker(__file__, globals())


INTERPRETER_KVCACHE = {
    "decode_fp16": dict(),
    "decode_fp32_one_sequence": dict(dtype="float32", batch=1, cached=(150,), capacity=160),
    "speculative_nq4_fp32": dict(dtype="float32", seqlen_q=4, cached=(0, 60)),
    "no_append_empty_and_short": dict(append=False, seqlen_q=5, cached=(0, 3)),
    "window_softcap": dict(window=(25, 0), softcap=5.0, seqlen_q=2),
    "not_causal_mqa_value_dim": dict(is_causal=False, heads_q=4, heads_kv=1, head_dim=24, head_dim_v=40),
    "paged_block_16": dict(block_size=16, seqlen_q=3),
    # pages of two key blocks (one table entry a block), a window whose left end is not on a block's start
    "paged_block_32_window": dict(block_size=32, window=(21, 0), seqlen_q=2, cached=(37, 90)),
    # 16 programs fill the interpreter's 16 "SMs": one split, a table entry per key
    "paged_block_32_unsplit": dict(block_size=32, heads_q=8, heads_kv=8, cached=(37, 90)),
    "paged_block_5_fp32": dict(block_size=5, dtype="float32", cached=(1, 93)),
    "many_rows_two_row_blocks": dict(seqlen_q=40, heads_q=4, heads_kv=1, cached=(10, 45)),  # 160 rows
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(INTERPRETER_KVCACHE))
def test_interpreter_kvcache(interpreter, case):
    interpreter.run("check_kvcache", **INTERPRETER_KVCACHE[case])


INTERPRETER_DENSE_DECODE = {
    "nq1_gqa": dict(),
    "nq2_causal_bottom_right_fp32": dict(seqlen_q=2, causal="bottom_right", dtype="float32"),
    "nq3_top_left_window": dict(seqlen_q=3, heads_q=4, causal="top_left", window=(40, 10), seqlen_k=120),
    "nq1_mha_softcap_batch2": dict(batch=2, heads_q=2, heads_kv=2, softcap=2.0, seqlen_k=77),
    # Key-padding masks (B, 1, 1, Nk) on the split kernel: left padding (a batch of prompts padded on the left, entry
    # 0 all padding: its rows see no key), scattered holes under a bottom-right causal mask, an additive bias.
    "nq1_left_padding_batch3": dict(batch=3, mask="key_padding_left"),
    "nq2_padding_holes_causal_batch2": dict(batch=2, seqlen_q=2, causal="bottom_right", mask="key_padding_holes"),
    "nq1_key_bias_batch2_fp32": dict(batch=2, mask="key_bias", dtype="float32", seqlen_k=130),
    # Masks that vary over the query rows but not the heads (a speculative step's), some rows seeing no key.
    "nq4_rows_mask_causal": dict(batch=2, seqlen_q=4, causal="bottom_right", mask="bool_empty_rows"),
    "nq3_rows_mask_window_batch2": dict(batch=2, seqlen_q=3, window=(60, 0), mask="bool"),
    # Masks that vary over the heads: a per-head bias broadcast over the batch (ALiBi's kind), one with -inf entries,
    # and a boolean mask of each head's own.
    "nq1_per_head_bias_batch2": dict(batch=2, mask="float"),
    "nq2_per_head_bias_neginf_causal": dict(seqlen_q=2, causal="bottom_right", mask="float_neginf"),
    "nq2_per_head_bool_batch2": dict(batch=2, seqlen_q=2, mask="bool_per_head"),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(INTERPRETER_DENSE_DECODE))
def test_interpreter_dense_decode(interpreter, case):
    interpreter.run("check_dense_decode", **INTERPRETER_DENSE_DECODE[case])


@pytest.mark.interpret
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_interpreter_append_kernel(interpreter, paged):
    interpreter.run("check_append_kernel", paged=paged)


@pytest.mark.interpret
def test_interpreter_kvcache_appends_inside_the_split_kernel(interpreter):
    interpreter.run("check_kvcache_appends_inside_the_split_kernel")


@pytest.mark.interpret
def test_interpreter_kvcache_prepared_steps(interpreter):
    interpreter.run("check_kvcache_prepared_steps")


@pytest.mark.interpret
def test_interpreter_kvcache_prepared_step_takes_each_call_s_tensors(interpreter):
    interpreter.run("check_kvcache_prepared_step_takes_each_call_s_tensors")


@pytest.mark.interpret
def test_interpreter_prepared_split_steps_keep_their_launches(interpreter):
    interpreter.run("check_prepared_split_steps_keep_their_launches")


@pytest.mark.interpret
def test_interpreter_kvcache_index_strides(interpreter):
    interpreter.run("check_kvcache_index_strides")


@pytest.mark.interpret
def test_interpreter_split_kv_path_taken(interpreter):
    interpreter.run("check_split_kv_path_taken")


@pytest.mark.interpret
def test_interpreter_split_partials_kept(interpreter):
    interpreter.run("check_split_partials_kept")


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_interpreter_varlen(interpreter, case):
    dtype = "float32" if case in ("causal_q_ne_k", "dropout") else "float16"
    interpreter.run("check_varlen", dtype=dtype, **VARLEN_CASES[case])


@pytest.mark.interpret
def test_interpreter_compiled_kvcache_and_varlen(interpreter):
    """The Triton kernels through the torch.compile custom ops: a paged decoding step and a varlen forward and
    backward, against the float64 gold."""
    interpreter.run("check_kvcache", block_size=16, seqlen_q=2, compiled=True)
    interpreter.run("check_varlen", is_causal=True, compiled=True)


@pytest.mark.interpret
@pytest.mark.parametrize("case", ["uneven", "causal_q_ne_k"])
def test_interpreter_varlen_through_descriptors(interpreter, case):
    interpreter.run("check_varlen_through_descriptors", **VARLEN_CASES[case])


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_kvcache_new_rows_across_split_shares():
    check_kvcache_rows_across_splits(device="cuda")


@pytest.mark.gpu
def test_gpu_kvcache_prepared_step_takes_each_call_s_tensors():
    check_kvcache_prepared_step_takes_each_call_s_tensors(device="cuda")


@pytest.mark.gpu
def test_gpu_prepared_split_steps_keep_their_launches():
    check_prepared_split_steps_keep_their_launches(device="cuda")


@pytest.mark.gpu
def test_gpu_split_partials_kept_per_stream_and_not_captured():
    check_split_partials_kept(device="cuda", streams=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [None, 16, 256])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_gpu_kvcache(dtype, paged, seqlen_q):
    check_kvcache(dtype=dtype, device="cuda", batch=3, heads_q=32, heads_kv=8, seqlen_q=seqlen_q, head_dim=128,
                  cached=(0, 1000, 5000), capacity=6144, block_size=paged)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 32, 8, 1, 8192), (8, 32, 8, 1, 1000), (2, 16, 16, 3, 4097), (1, 8, 1, 16, 2000)])
def test_gpu_dense_decode(dtype, shape):
    batch, heads_q, heads_kv, seqlen_q, seqlen_k = shape
    check_dense_decode(dtype=dtype, device="cuda", batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, head_dim=128, causal="bottom_right")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", ["key_padding_left", "key_padding_holes", "key_bias", "bool_empty_rows"])
def test_gpu_dense_decode_with_a_key_padding_mask(dtype, mask):
    """A batch of decoding steps with a padding mask (B, 1, 1, Nk) on the split-KV kernels: several splits, some of
    them all padding; and speculative steps of 4 query rows with a mask that varies over them (not over the heads)."""
    rows = 4 if mask == "bool_empty_rows" else 1
    check_dense_decode(dtype=dtype, device="cuda", batch=4, heads_q=32, heads_kv=8, seqlen_q=rows, seqlen_k=8192,
                       head_dim=128, causal="bottom_right", mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dependent", [True, False])
def test_gpu_decode_steps_on_a_side_stream_and_in_a_cuda_graph(monkeypatch, dependent):
    """Split-KV decoding steps (B = 1, 8k keys: several splits and a combine; on sm_90 the combine as a programmatic
    dependent launch, or after the splits) give the same output on a second stream, back to back with other work, and
    captured in a CUDA graph replayed with new queries, as an eager step on the default stream."""
    import mhattn
    from mhattn.backends.triton import decode_launch

    monkeypatch.setattr(decode_launch, "DEPENDENT_LAUNCH", dependent)
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

    def step():
        return mhattn.attention(q, k, v, enable_gqa=True, backend="triton")

    want = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [step() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(stream)
    assert all(torch.equal(out, want) for out in outs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, step())


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_kvcache_steps_replayed_from_a_cuda_graph_follow_the_advancing_lengths(paged):
    """A serving loop's decoding step captured once in a CUDA graph (append one token to each sequence's cache, attend
    over it), replayed while the caller advances cache_seqlens in place and writes new q, k, v into the captured
    buffers, gives bitwise what the same eager steps give on a copy of the cache, and leaves the same cache."""
    import mhattn

    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, heads_q, heads_kv, head_dim, capacity, block = 2, 8, 2, 128, 2048, 256
    dtype = torch.bfloat16
    if paged:
        pool = (batch * capacity // block, heads_kv, block, head_dim)
        table = torch.randperm(pool[0], device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    else:
        pool, table = (batch, heads_kv, capacity, head_dim), None
    k_cache, v_cache = (torch.randn(pool, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([700, 1500], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads_q, 1, head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, heads_kv, 1, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))

    def step(k_cache, v_cache):
        return mhattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                             backend="triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (it writes the same positions the first replay writes)
        step(k_cache, v_cache)
        step(k_eager, v_eager)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(k_cache, v_cache)
    for _ in range(3):
        seqlens.add_(1)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=dtype, generator=gen))
        graph.replay()
        want = step(k_eager, v_eager)
        torch.cuda.synchronize()
        assert torch.equal(captured, want)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_varlen(dtype, is_causal):
    check_varlen(dtype=dtype, device="cuda", lengths_q=(100, 0, 1000, 257, 1), lengths_k=(100, 5, 1000, 300, 64),
                 heads_q=8, heads_kv=2, head_dim=128, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cupy"])
def test_gpu_compiled_kvcache_and_varlen(backend):
    """The custom ops under torch.compile on the GPU: a paged decoding step and a varlen forward and backward."""
    if mhattn.registry.get_backend(backend).unavailable():
        pytest.skip(f"{backend} is unavailable here")
    check_kvcache(backend=backend, dtype="bfloat16", device="cuda", batch=3, heads_q=32, heads_kv=8, head_dim=128,
                  cached=(0, 1000, 5000), capacity=6144, block_size=256, compiled=True)
    check_varlen(backend=backend, dtype="bfloat16", device="cuda", lengths_q=(100, 0, 1000, 257, 1),
                 lengths_k=(100, 5, 1000, 300, 64), heads_q=8, heads_kv=2, head_dim=128, is_causal=True,
                 compiled=True)


def test_decode_tiles_fit_shared_memory_for_every_width():
    """The split-KV kernel's tile follows the wider head dim and the element size: K and V stages of any padded
    dims up to 256, 16- or 32-bit, stay within 96 KiB (float32 at d = 16, dv = 256 once asked for 288 KB), and split
    grids on Hopper within the 227 KiB a block may hold there."""
    from mhattn.backends.triton import decode_launch

    for block_d in (16, 32, 64, 128, 256):
        for block_dv in (16, 32, 64, 128, 256):
            for size in (2, 4):
                for paged in (False, True):
                    tile = decode_launch.decode_tile(block_d, block_dv, size, paged)
                    stages = tile.block_n * (block_d + block_dv) * size * tile.num_stages
                    assert stages <= 96 << 10, (block_d, block_dv, size, paged, tile)
                    # split grids on Hopper: within the 227 KiB of shared memory a block may hold there
                    tile = decode_launch.decode_tile(block_d, block_dv, size, paged, hopper_split=True)
                    stages = tile.block_n * (block_d + block_dv) * size * tile.num_stages
                    assert stages <= 227 << 10, (block_d, block_dv, size, paged, tile)
    # 16-bit, equal dims: the table's entry, the paged cache's or the contiguous one's; split grids on Hopper their own.
    assert decode_launch.decode_tile(128, 128, 2, paged=True) == decode_launch.GPU_TILES[128]
    assert decode_launch.decode_tile(128, 128, 2) == decode_launch.CONTIGUOUS_TILES[128]
    for paged in (False, True):
        hopper = decode_launch.decode_tile(128, 128, 2, paged, hopper_split=True)
        assert hopper == decode_launch.HOPPER_SPLIT_TILES[128] != decode_launch.decode_tile(128, 128, 2, paged)
        narrower = decode_launch.decode_tile(64, 64, 2, paged)  # (no entry of its own: the table's)
        assert decode_launch.decode_tile(64, 64, 2, paged, hopper_split=True) == narrower
