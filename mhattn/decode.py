"""``mhattn.attention_with_kvcache``: attention over a KV cache (contiguous or paged), forward only.

The new tokens' keys and values (when given) are written into the cache in place first, then each
sequence's queries attend over its cached keys on the backend the dispatcher picks (operation "kvcache"
or "paged_kvcache"). Decoding steps (Nq = 1) and speculative decoding (small Nq) are the intended uses.
"""

from __future__ import annotations

from typing import Optional

import torch

from mhattn import dispatch
from mhattn.arguments import (check_heads, check_index_tensor, check_same, check_softcap, check_tensor,
                              check_values_once, host_checks_allowed, scale_or_default)
from mhattn.backends import layouts
from mhattn.backends.base import KVCache, cache_capacity
from mhattn.caches import put_bounded
from mhattn.errors import InputError
from mhattn.functional import _backend_argument, _causal_right, _params, _window
from mhattn.problem import Problem


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    *,
    is_causal: bool = True,
    scale: Optional[float] = None,
    window=None,
    softcap: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
):
    """Attention of new queries over a KV cache, appending the new keys/values to it first (forward only).

    Args:
        q: (B, Hq, Nq, D), the queries of the newest Nq tokens of each sequence.
        k_cache: contiguous (B, Hkv, Nmax, D), or paged (num_blocks, Hkv, block_size, D) with ``block_table``.
        v_cache: (B, Hkv, Nmax, Dv), or paged (num_blocks, Hkv, block_size, Dv). Same dtype/device as q.
        k: None, or (B, Hkv, Nq, D): written into the cache at positions cache_seqlens[b] .. cache_seqlens[b]
            + Nq - 1 of sequence b (through the block table when paged), in place, before attending.
        v: None, or (B, Hkv, Nq, Dv); given together with ``k``.
        cache_seqlens: (B,) int32, the number of valid cached tokens per sequence before the append; it is
            not changed (the caller advances it). None: every sequence's cache is full (no append possible).
        block_table: None (contiguous cache), or (B, max_blocks) int32: sequence b's blocks of the pool, in
            order. Entries past a sequence's last used block are not read.
        is_causal: query row i of sequence b sits at position L_b - Nq + i (L_b = keys it attends over,
            cached plus new) and sees keys up to that position (bottom-right alignment).
        scale: score scale; default 1 / sqrt(D).
        window: (left, right) around each query's position, as in :func:`mhattn.attention`; -1/None unbounded.
        softcap: scores become softcap * tanh(scores / softcap).
        return_lse: also return the log-sum-exp (B, Hq, Nq), float32, natural log.
        backend: a backend name, as in :func:`mhattn.attention`.

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype; with ``return_lse`` a tuple (out, lse). Hq must be a multiple of Hkv
        (grouped-query attention needs no flag here and never copies K/V). A row that sees no key gives 0.

    Under ``torch.compile`` the call is one custom op (``mhattn::attention_with_kvcache``) that writes the cache in
    place: no graph break, and the backend request is read when the compiled code runs.
    """
    if torch.compiler.is_compiling():
        out, lse = _compiled_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window,
                                  softcap, backend)
    else:
        out, lse = _attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap,
                           backend, bool(return_lse))
    return (out, lse) if return_lse else out


def _attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap, backend,
            return_lse: bool = True):
    """The eager call: (out, lse), the cache appended to in place (lse a scratch buffer the next call may overwrite
    where ``return_lse`` is False)."""
    key = _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap, backend,
                    return_lse)
    known = _known_calls.get(key) if key is not None else None
    if known is None:  # every check, then the selection; a repeated signature skips both (see _call_key)
        call = _prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap)
        name, source = dispatch.requested_on(backend, q.device.type)
        chosen = dispatch.select(call.problem, name, source)
        known = (call.params, chosen, q.shape[2] if k is not None else 0, cache_capacity(k_cache, block_table),
                 chosen.kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, call.params, return_lse))
        if key is not None:
            put_bounded(_known_calls, key, known, _KNOWN_CALLS_LIMIT)
    params, chosen, appended, capacity, prepared = known
    _check_index_values(q, k_cache, cache_seqlens, block_table, appended, capacity)
    if prepared is not None:  # the backend's step prepared for calls like this one
        return prepared(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    if appended:  # the backend's step that appends as it attends, where it has one
        step = chosen.forward_kvcache_appending(q, k_cache, v_cache, k, v, cache_seqlens, block_table, params)
        if step is not None:
            return step
    cache = _cache_of_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, chosen)
    return chosen.forward_kvcache(q, cache, params)


# Calls whose arguments passed _prepare's checks and whose backend was selected, by _call_key: (params, backend, the
# number of appended tokens, the cache's capacity, the backend's step prepared for such calls or None). A decoding
# loop calls with one signature per layer and step, so only the per-call part (the index values' checks, the append,
# the attention) runs again. Cleared with the dispatcher's cache.
_known_calls: dict = {}
_KNOWN_CALLS_LIMIT = 1024
dispatch.clears_with_cache(_known_calls)


def _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap, backend,
              return_lse: bool):
    """Everything _prepare checks and the selection reads, and whether the lse is returned (a prepared step may write
    it into a scratch buffer otherwise), as a tuple of primitives; None where the call is not memoised (under
    torch.compile, or arguments of types the key cannot hold exactly)."""
    if (type(is_causal) is not bool or not (scale is None or type(scale) is float) or window is not None
            or not (softcap is None or type(softcap) is float) or torch.compiler.is_compiling()):
        return None
    try:
        request = dispatch.requested_on(backend, q.device.type)
    except Exception:  # a bad request raises where the full path checks it
        return None
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k_cache, tensor) and isinstance(v_cache, tensor)
            and (k is None or isinstance(k, tensor)) and (v is None or isinstance(v, tensor))
            and (cache_seqlens is None or isinstance(cache_seqlens, tensor))
            and (block_table is None or isinstance(block_table, tensor))):
        return None
    # What _check_forward_only reads of autograd: grad mode and whether q, k or v requires grad.
    tracked = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)
                                           or (v is not None and v.requires_grad))
    return (request, is_causal, scale, softcap, tracked, return_lse,
            q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            None if k is None else (k.shape, k.stride(), k.dtype, k.device),
            None if v is None else (v.shape, v.stride(), v.dtype, v.device),
            None if cache_seqlens is None else (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
                                                cache_seqlens.device),
            None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                              block_table.device))


def _check_index_values(q, k_cache, cache_seqlens, block_table, appended: int, capacity: int) -> None:
    """The positions a call appends to and reads checked against the cache's ``capacity`` and the block table's
    entries against the pool, once per index tensor value (check_values_once; none while a CUDA graph is captured or
    torch.compile traces)."""
    if cache_seqlens is None:
        checked = () if block_table is None else (block_table,)
    else:
        checked = (cache_seqlens,) if block_table is None else (cache_seqlens, block_table)
    if checked and host_checks_allowed(q):
        pool_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
        # (a full cache's lengths made only when the check runs, not at every call)
        check_values_once(checked, (appended, capacity, pool_blocks, block_size),
                          lambda: _check_lengths(_full_lengths(q, capacity) if cache_seqlens is None else cache_seqlens,
                                                 appended, block_table, pool_blocks, block_size, capacity))


def _full_lengths(q, capacity: int) -> torch.Tensor:
    return torch.full((q.shape[0],), capacity, dtype=torch.int32, device=q.device)


def _cache_of_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int, backend) -> KVCache:
    """The KVCache of a call whose index values were checked: k and v appended first where given (by the backend's
    own append_kvcache where it has one, else torch's indexing), with each sequence's key count (cached plus
    appended, int32 like cache_seqlens)."""
    if cache_seqlens is None:
        seqlens = _full_lengths(q, capacity)
    elif k is None:
        seqlens = cache_seqlens
    else:
        seqlens = backend.append_kvcache(k_cache, v_cache, k, v, cache_seqlens, block_table)
        if seqlens is None:
            seqlens = _append_by_indexing(k_cache, v_cache, k, v, cache_seqlens, block_table)
    return KVCache(k_cache, v_cache, seqlens, block_table)


# ---- under torch.compile: one custom op --------------------------------------------------------------------------


def _check_forward_only(q, k, v) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        raise InputError("attention_with_kvcache is forward only (no autograd): call it under torch.no_grad() "
                         "or pass tensors that do not require grad")


def _check_causal(is_causal) -> None:
    if is_causal not in (True, False):
        raise InputError(f"is_causal must be a bool, got {is_causal!r}")


def _compiled_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap, backend):
    """The call as the custom op takes it: the window split into its bounds, the backend request checked now but
    resolved when the compiled code runs (as mhattn.attention's op does). The op has no autograd: inputs that
    require grad are refused here, at trace time."""
    _check_forward_only(q, k, v)
    _check_causal(is_causal)  # before the op's schema makes it a bool
    left, right = _window(window)
    request = "" if backend is None else _backend_argument(backend)
    return torch.ops.mhattn.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, bool(is_causal), None if scale is None else float(scale),
        left, right, None if softcap is None else float(softcap), request)


@torch.library.custom_op("mhattn::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attention_with_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
    v: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
    is_causal: bool, scale: Optional[float], window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # No window as None: the repeated-call memo (_call_key) holds calls without a window only.
    window = None if window_left is None and window_right is None else (window_left, window_right)
    out, lse = _attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap,
                       backend or None)
    # Compiled graphs assume the layouts the fake implementation promises (a backend's other layout is copied).
    return (layouts.placed(out, layouts.rows_major_strides(*out.shape)),
            layouts.placed(lse, layouts.contiguous_strides(lse.shape)))


@_attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_left, window_right, softcap,
      backend):
    # Every check that needs no tensor's values raises here, at trace time, as the eager call would.
    _prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, (window_left, window_right),
             softcap)
    return layouts.output_buffer(q, v_cache), layouts.lse_buffer(q)


def explain(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, *, is_causal=True,
            scale=None, window=None, softcap=None, return_lse=False, backend=None) -> dispatch.Decision:
    """What :func:`attention_with_kvcache` would do: ``str()`` shows the problem, the choice and every
    backend's reasons. Nothing is written into the cache."""
    call = _prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap)
    name, source = dispatch.requested_on(backend, q.device.type)
    return dispatch.decide(call.problem, name, source)


class _Call:
    def __init__(self, problem, params):
        self.problem, self.params = problem, params


def _prepare(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window, softcap) -> _Call:
    """Every check of a call's arguments but the index tensors' values (_check_index_values), then its Problem and
    params. What it reads is what _call_key holds."""
    paged = block_table is not None
    cache_shape = "(num_blocks, Hkv, block_size, D)" if paged else "(B, Hkv, Nmax, D)"
    check_tensor("q", q, 4, "(B, Hq, Nq, D)")
    check_tensor("k_cache", k_cache, 4, cache_shape)
    check_tensor("v_cache", v_cache, 4, cache_shape.replace("D)", "Dv)"))
    check_same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    _check_forward_only(q, k, v)
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise InputError(f"k_cache and v_cache must agree in all dims but the last, got shapes "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise InputError(f"k_cache's head dim (last dim) must be q's ({head_dim}), got {k_cache.shape[3]}")
    if not paged and k_cache.shape[0] != batch:
        raise InputError(f"k_cache must have q's batch ({batch}) in dim 0 (contiguous cache {cache_shape}), got "
                         f"shape {tuple(k_cache.shape)}")
    check_heads(heads_q, heads_kv)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise InputError(f"{name} must have a contiguous last dim (it is written in place, so it is never "
                             f"copied), got strides {tuple(t.stride())}")
    if (k is None) != (v is None):
        raise InputError("pass k and v together (the new tokens' keys and values), or neither")
    if k is not None:
        check_tensor("k", k, 4, "(B, Hkv, Nq, D)")
        check_tensor("v", v, 4, "(B, Hkv, Nq, Dv)")
        check_same(("q", "k", "v"), (q, k, v))
        want_k = (batch, heads_kv, seqlen_q, head_dim)
        want_v = (batch, heads_kv, seqlen_q, v_cache.shape[3])
        if tuple(k.shape) != want_k:
            raise InputError(f"k must have shape (B, Hkv, Nq, D) = {want_k}, got {tuple(k.shape)}")
        if tuple(v.shape) != want_v:
            raise InputError(f"v must have shape (B, Hkv, Nq, Dv) = {want_v}, got {tuple(v.shape)}")
        if cache_seqlens is None:
            raise InputError("cache_seqlens is required when k and v are appended (it says where they go)")
    if cache_seqlens is not None:
        check_index_tensor("cache_seqlens", cache_seqlens, 1, "(B,)", q.device)
        if cache_seqlens.shape[0] != batch:
            raise InputError(f"cache_seqlens must have shape (B,) = ({batch},), got {tuple(cache_seqlens.shape)}")
    if paged:
        check_index_tensor("block_table", block_table, 2, "(B, max_blocks)", q.device)
        if block_table.shape[0] != batch:
            raise InputError(f"block_table must have shape (B, max_blocks) with B = {batch}, got "
                             f"{tuple(block_table.shape)}")
    _check_causal(is_causal)

    capacity = cache_capacity(k_cache, block_table)
    left, right = _window(window)
    params = _params(None, False, scale_or_default(scale, head_dim), bool(is_causal), 0, left,
                     _causal_right(right, bool(is_causal)), 0.0, (0, 0),
                     check_softcap(softcap))
    problem = Problem.from_tensors(q, k_cache, v_cache, params, causal=bool(is_causal),
                                   window=left is not None or right is not None,
                                   operation="paged_kvcache" if paged else "kvcache",
                                   sizes=(batch, seqlen_q, capacity))
    return _Call(problem, params)


def _check_lengths(cache_seqlens, appended: int, block_table, num_blocks, block_size, capacity) -> None:
    """Every sequence fits its cache with ``appended`` more tokens and every block it uses is in the pool: one
    read-back to the host."""
    before = cache_seqlens.tolist()
    lengths = [n0 + appended for n0 in before]
    for b, (n0, n) in enumerate(zip(before, lengths)):
        if n0 < 0:
            raise InputError(f"cache_seqlens[{b}] = {n0} is negative")
        if n > capacity:
            where = "max_blocks * block_size" if block_table is not None else "Nmax"
            raise InputError(f"sequence {b} needs {n} cache positions (cache_seqlens[{b}] = {n0} plus the new "
                             f"tokens) but its cache holds {where} = {capacity}")
    if block_table is None:
        return
    seqlens = cache_seqlens + appended
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < seqlens[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0].tolist())
        raise InputError(f"block_table[{b}, {j}] = {int(block_table[b, j])} points outside the pool of {num_blocks} "
                         f"blocks (k_cache.shape[0]); sequence {b} uses its first "
                         f"{-(-lengths[b] // block_size)} blocks")


def _append_by_indexing(k_cache, v_cache, k, v, cache_seqlens, block_table) -> torch.Tensor:
    """Write k, v (B, Hkv, Nq, D) at positions cache_seqlens[b] + i of each sequence, in place, with torch's indexing
    (for backends without an append of their own); returns the key counts after it, cache_seqlens + Nq."""
    batch, _, seqlen_q, _ = k.shape
    rows, steps = _append_ranges(k.device, batch, seqlen_q)
    positions = cache_seqlens.long()[:, None] + steps  # (B, Nq)
    if block_table is not None:
        block_size = k_cache.shape[2]
        blocks = block_table.long()[rows, positions // block_size]
        index = (blocks, slice(None), positions % block_size)
    else:
        index = (rows, slice(None), positions)
    # Advanced indices around a slice put their (B, Nq) dims first: the values go in as (B, Nq, Hkv, D).
    k_cache[index] = k.transpose(1, 2)
    v_cache[index] = v.transpose(1, 2)
    return cache_seqlens + seqlen_q


def _append_ranges(device, batch: int, seqlen_q: int) -> tuple:
    """(rows, steps): each sequence's index (B, Nq) and 0 .. Nq - 1 as a row (1, Nq), int64 on ``device``, made once
    per (device, B, Nq): a decoding step with appends then launches no arange of its own (each is a kernel launch,
    several microseconds of a short step's host time)."""
    key = (device, batch, seqlen_q)
    found = _append_range_cache.get(key)
    if found is None:
        rows = torch.arange(batch, device=device)[:, None].expand(batch, seqlen_q)
        found = put_bounded(_append_range_cache, key, (rows, torch.arange(seqlen_q, device=device)[None, :]),
                            _APPEND_RANGES_LIMIT)
    return found


_append_range_cache: dict = {}
_APPEND_RANGES_LIMIT = 256
