"""The backend contract: capabilities declared as data, reasons as sentences, one forward and one backward
per operation.

Every backend (built-in or third-party) subclasses :class:`Backend`. The dispatcher only ever calls
``unsupported(problem)`` and the entry point of the problem's operation (``forward``/``backward`` for
dense attention, ``forward_kvcache`` for attention over a KV cache, ``forward_varlen``/``backward_varlen``
for packed variable-length batches); the conformance suite generates its cases from ``capabilities``. A backend never sees the module, the masks in their user-facing forms or the
environment: it receives canonical tensors and an :class:`AttentionParams`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

# Feature names shared by Capabilities, Problem.features and the conformance tables.
FEATURES = (
    "causal",          # a causal diagonal, top-left or bottom-right aligned
    "gqa",             # fewer key/value heads than query heads
    "bool_mask",       # boolean attn_mask (True = attend), broadcasting over (B, H, Nq, Nk)
    "float_mask",      # additive float attn_mask, broadcasting over (B, H, Nq, Nk)
    "mask_grad",       # gradient of a float attn_mask that requires grad
    "dropout",         # dropout on P with an in-kernel counter-based RNG
    "window",          # sliding window (left, right) around the diagonal
    "softcap",         # S = softcap * tanh(S / softcap)
    "deterministic",   # bitwise-reproducible backward
    "value_dim",       # value head dim different from the query/key head dim
)

# Operations (entry points) a backend may implement; Capabilities.operations lists the ones it does.
OPERATIONS = (
    "attention",       # forward / backward: dense (B, H, N, D) attention (every backend)
    "kvcache",         # forward_kvcache with a contiguous (B, Hkv, Nmax, D) cache
    "paged_kvcache",   # forward_kvcache with a paged (num_blocks, Hkv, block_size, D) cache and a block table
    "varlen",          # forward_varlen / backward_varlen: packed sequences described by cu_seqlens
)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as plain data (the dispatcher and the tests read it)."""

    device_types: frozenset = frozenset({"cuda"})
    dtypes: frozenset = frozenset({torch.float16, torch.bfloat16})
    min_head_dim: int = 1
    max_head_dim: int = 256
    # Lowest CUDA compute capability (major, minor); None when not a CUDA backend.
    min_compute_capability: Optional[tuple] = (8, 0)
    features: frozenset = frozenset()
    operations: frozenset = frozenset({"attention"})

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"Capabilities.features: unknown feature names {sorted(unknown)}; known: {FEATURES}")
        unknown = set(self.operations) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"Capabilities.operations: unknown names {sorted(unknown)}; known: {OPERATIONS}")


@dataclass(frozen=True)
class AttentionParams:
    """Everything about one attention call except the q, k, v tensors, in canonical form.

    Key ``j`` is visible to query ``i`` when ``-window_left <= j - i - diag_offset <= window_right``
    (a ``None`` bound is unbounded), the mask (if any) allows it, and for a float mask the mask value
    is added to the (soft-capped) score. Causal attention is ``window_right = 0``; top-left alignment is
    ``diag_offset = 0`` and bottom-right alignment ``diag_offset = Nk - Nq``.
    """

    scale: float
    diag_offset: int = 0
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    # None, or a 4-D tensor broadcast (stride 0 allowed) to (B, H, Nq, Nk): bool (True = attend) or float.
    mask: Optional[torch.Tensor] = field(default=None, compare=False)
    mask_requires_grad: bool = False
    dropout_p: float = 0.0
    # The two 32-bit words seeding the counter-based dropout RNG (see mhattn.dropout_rng): an int64 tensor (2,)
    # on the tensors' device (what mhattn.attention passes, so kernels read it from memory and captured CUDA
    # graphs draw fresh words), or a pair of ints. mhattn.dropout_rng.seed_words gives ints for either.
    seed: tuple = field(default=(0, 0), compare=False)
    softcap: Optional[float] = None

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def replace(self, **changes) -> "AttentionParams":
        """A copy with ``changes`` (field names) set. The front end's memo path calls this per call (each call's
        mask, a dropout call's seed), so it copies the fields' dict instead of going through dataclasses.replace,
        which rebuilds the object through __init__ (4-5 us a call against about 1 us); neither runs any check."""
        unknown = changes.keys() - _PARAM_FIELDS
        if unknown:
            raise TypeError(f"AttentionParams.replace: unknown fields {sorted(unknown)}")
        copy = object.__new__(type(self))
        state = copy.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return copy


_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionParams))


def tracked_by_autograd(q, k, v, params: AttentionParams) -> bool:
    """Whether autograd differentiates a call with these inputs: grad mode on, and q, k, v or a float mask
    requiring grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or params.mask_requires_grad)


@dataclass(frozen=True)
class KVCache:
    """The key/value cache of one ``forward_kvcache`` call, new tokens already written into it.

    Contiguous: ``k`` (B, Hkv, Nmax, D), ``v`` (B, Hkv, Nmax, Dv), ``block_table`` None.
    Paged: ``k`` (num_blocks, Hkv, block_size, D), ``v`` (num_blocks, Hkv, block_size, Dv) and
    ``block_table`` (B, max_blocks) int32: key j of sequence b lives in block ``block_table[b, j // block_size]``
    at row ``j % block_size``. ``seqlens`` (B,) int32: the number of keys sequence b attends over (cached plus
    new), validated to fit the cache. Last dims contiguous; other strides as they come.
    """

    k: torch.Tensor = field(compare=False)
    v: torch.Tensor = field(compare=False)
    seqlens: torch.Tensor = field(compare=False)
    block_table: Optional[torch.Tensor] = field(default=None, compare=False)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def capacity(self) -> int:
        """The most keys any sequence can hold (Nmax, or max_blocks * block_size)."""
        return cache_capacity(self.k, self.block_table)


def cache_capacity(k: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """The most keys any sequence of a cache can hold: Nmax of a contiguous cache k (B, Hkv, Nmax, D), or
    max_blocks * block_size of a paged pool k (num_blocks, Hkv, block_size, D) with ``block_table``."""
    return k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]


def new_rows_contiguous(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a decoding step's new keys k and values v have contiguous head dims, as the backends' append kernels
    read them (a backend's append_kvcache or forward_kvcache_appending declines other new rows)."""
    return (k.stride(-1) == 1 or k.shape[-1] <= 1) and (v.stride(-1) == 1 or v.shape[-1] <= 1)


@dataclass(frozen=True)
class Packing:
    """How a varlen batch is packed: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1
    of q (total_q, Hq, D), its keys rows cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1 of k and v.

    ``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1,) int32 prefix sums starting at 0 (validated);
    ``max_seqlen_q`` / ``max_seqlen_k`` bound every sequence's length (they size the kernels' grids).
    """

    cu_seqlens_q: torch.Tensor = field(compare=False)
    cu_seqlens_k: torch.Tensor = field(compare=False)
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


class Backend:
    """Base class of every attention backend.

    Subclasses set ``name`` and ``capabilities`` and implement ``forward`` and ``backward``; they may
    extend ``unavailable()`` (reasons the backend cannot run at all on this machine) and
    ``unsupported()`` (reasons it cannot run one problem).
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    description: str = ""
    # The name of the backend this one is a form of (the same kernels with one of its choices pinned, such as the
    # sdpa backend pinned to one of torch's kernels): automatic selection weighs it wherever that backend is a
    # candidate and a timing table measured it (mhattn.dispatch.decide), and ``mhattn tune`` times it where that
    # backend's calls are short (mhattn.tuning.measure). None for a backend of its own.
    variant_of: Optional[str] = None

    # ---- availability -------------------------------------------------------------------------
    def unavailable(self) -> list:
        """Reasons this backend cannot run anything here (package missing, no GPU...). Cached by callers."""
        return []

    def unsupported(self, problem) -> list:
        """Every reason this backend cannot run ``problem`` (a :class:`mhattn.problem.Problem`); [] = it can."""
        caps = self.capabilities
        reasons = list(self.unavailable())
        if problem.device_type not in caps.device_types:
            reasons.append(f"runs on {sorted(caps.device_types)} tensors, got {problem.device_type}")
        if problem.dtype not in caps.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in caps.dtypes)
            reasons.append(f"supports dtypes {names}, got {str(problem.dtype).replace('torch.', '')}")
        if not caps.min_head_dim <= problem.head_dim <= caps.max_head_dim:
            reasons.append(
                f"supports head dims {caps.min_head_dim}..{caps.max_head_dim}, got {problem.head_dim}"
            )
        if (
            caps.min_compute_capability is not None
            and problem.device_type == "cuda"
            and problem.compute_capability is not None
            and tuple(problem.compute_capability) < tuple(caps.min_compute_capability)
        ):
            want = "sm_%d%d" % tuple(caps.min_compute_capability)
            got = "sm_%d%d" % tuple(problem.compute_capability)
            reasons.append(f"needs compute capability {want} or newer, the device is {got}")
        for feature in sorted(problem.features - caps.features):
            reasons.append(f"does not support {FEATURE_SENTENCES.get(feature, feature)}")
        operation = getattr(problem, "operation", "attention")
        if operation not in caps.operations:
            reasons.append(f"does not implement {OPERATION_SENTENCES.get(operation, operation)}")
        return reasons

    # ---- computation --------------------------------------------------------------------------
    def forward(self, q, k, v, params: AttentionParams):
        """q: (B, Hq, Nq, D), k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv), last dim contiguous, any other strides.

        Returns ``(out, lse)``: out (B, Hq, Nq, Dv) in q's dtype, lse (B, Hq, Nq) float32 (float64 for float64
        inputs), the natural-log
        log-sum-exp of each row's (masked, soft-capped, scaled) scores before dropout; -inf for a row
        that sees no key (whose output is 0).
        """
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None):
        """Returns ``(dq, dk, dv, dmask)`` in the dtypes of q, k, v.

        ``grad_lse`` (B, Hq, Nq) float32 or None is the gradient flowing into the returned lse; it adds
        ``grad_lse * P`` to dS, i.e. the row term delta = rowsum(dO * O) becomes delta - grad_lse.
        dmask is None unless ``params.mask_requires_grad``; else the gradient of the float mask in its
        broadcast 4-D shape (B, H, Nq, Nk) (the caller's autograd reduces it to the user's shape)."""
        raise NotImplementedError

    def forward_path(self, problem) -> Optional[str]:
        """Which of the backend's kernel families runs ``problem``'s forward, and why, for ``explain``; None
        for a backend with one family."""
        return None

    def backward_path(self, problem) -> Optional[str]:
        """The same for the backward; None for a backend with one family."""
        return None

    def native_attention(self, q, k, v, params: AttentionParams):
        """Optional: the output alone (no lse) through a differentiable path of the backend's own (e.g. an
        operator with a C++ autograd node), for calls that return no lse; None where it has none for this call.

        ``mhattn.attention`` tries it first for such calls, so the backward skips mhattn's Python autograd
        Function. It must compute what :meth:`forward` computes and give the gradients :meth:`backward`
        gives. The default has none."""
        return None

    def native_call(self, q, k, v, params: AttentionParams):
        """Optional: :meth:`native_attention` prepared for calls like this one, as a callable of (q, k, v, params)
        giving what native_attention would; None where calls like this one have no such path. The front end asks
        once per call signature (shapes, strides, dtype, device, params but the dropout seed and the mask tensor,
        whose layout is part of the signature, the inputs' ``requires_grad`` and grad mode) and keeps the answer for
        the calls that repeat it, so anything else the choice depends on (a mask's values) must be checked inside the
        callable, which gets each call's params. For calls that autograd does not track (the grad
        mode and ``requires_grad`` are part of the signature), the callable need not be differentiable: it may be a
        forward that skips what only a backward would read (the Triton backend writes such calls' lse into a kept
        scratch buffer). The default: native_attention itself, where the backend has one."""
        has_own = type(self).native_attention is not Backend.native_attention
        return self.native_attention if has_own else None

    def forward_kvcache(self, q, cache: KVCache, params: AttentionParams):
        """Attention of q (B, Hq, Nq, D) over each sequence's first ``cache.seqlens[b]`` cached keys.

        Query row i of sequence b sits at position L_b - Nq + i (L_b = cache.seqlens[b]): the causal/window
        bounds of ``params`` are relative to that diagonal, so ``params.diag_offset`` is ignored (each
        sequence has its own). No mask, no dropout. Returns ``(out, lse)`` as :meth:`forward` does.
        Backends declaring "kvcache" / "paged_kvcache" in ``capabilities.operations`` implement it.
        """
        raise NotImplementedError

    def append_kvcache(self, k_cache, v_cache, k, v, cache_seqlens, block_table) -> Optional[torch.Tensor]:
        """A decoding step's append, before :meth:`forward_kvcache`: write the new keys k (B, Hkv, Nq, D) and values
        v (B, Hkv, Nq, Dv) into the cache at positions cache_seqlens[b] + i of each sequence b (through block_table,
        (B, max_blocks) int32, when the cache is paged), in place, and return the key counts after the append
        (cache_seqlens + Nq, (B,) int32). The caller has checked the shapes, dtypes and devices, and that every
        position and block lies inside the cache. Return None (the default) to leave the append to the front end,
        which writes it with torch's indexing."""
        return None

    def kvcache_call(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, params: AttentionParams,
                     return_lse: bool):
        """Optional: a KV-cache step prepared for calls like this one (``attention_with_kvcache``'s arguments, k and v
        None for a step that appends nothing), as a callable of (q, k_cache, v_cache, k, v, cache_seqlens,
        block_table) that appends k and v (where given) and returns ``(out, lse)`` as :meth:`forward_kvcache_appending`
        or :meth:`forward_kvcache` would; where ``return_lse`` is False the lse may be a scratch buffer a later call
        overwrites. The front end asks once per call signature (shapes, strides, dtypes and devices of every tensor,
        params, return_lse) after checking the arguments, keeps the answer, and before each call checks the index
        values as for the other KV-cache methods. None (the default): each call goes through those methods."""
        return None

    def forward_kvcache_appending(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                  params: AttentionParams):
        """A decoding step's append and attention in one: write k and v into the cache as :meth:`append_kvcache`
        does, and return :meth:`forward_kvcache`'s ``(out, lse)`` over each sequence's cache_seqlens[b] + Nq keys
        (cache_seqlens counts the keys before the step and is not changed). The caller has checked what it checks
        for append_kvcache. Return None (the default) to have the front end append (append_kvcache, else torch's
        indexing) and then call forward_kvcache."""
        return None

    def forward_varlen(self, q, k, v, packing: Packing, params: AttentionParams):
        """Attention over packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv),
        last dims contiguous. Sequence b's queries see only its own keys, causal/window bounds aligned
        top-left per sequence (``params.diag_offset`` is 0). No mask.

        Returns ``(out, lse)``: out (total_q, Hq, Dv) in q's dtype, lse (Hq, total_q) float32 (natural log,
        -inf for a row that sees no key). Backends declaring "varlen" implement it and
        :meth:`backward_varlen`."""
        raise NotImplementedError

    def backward_varlen(self, grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams,
                        grad_lse=None):
        """``(dq, dk, dv)`` of :meth:`forward_varlen`, in the shapes and dtypes of q, k, v; grad_out
        (total_q, Hq, Dv), grad_lse (Hq, total_q) float32 or None."""
        raise NotImplementedError

    def dropout_keep_mask(self, batch, heads, seqlen_q, seqlen_k, params: AttentionParams, device):
        """The boolean keep-mask (B, H, Nq, Nk) this backend's dropout draws for ``params.seed``.

        Every built-in backend uses the same counter-based RNG, so the default materialises it in torch.
        """
        from mhattn.dropout_rng import keep_mask

        return keep_mask(params.seed, batch, heads, seqlen_q, seqlen_k, params.dropout_p, device=device)

    def __repr__(self):
        return f"<mhattn backend {self.name!r}>"


class OutputOnlyForward(Backend):
    """A backend whose forward can skip what only a backward reads: ``_forward(q, k, v, params, keep_lse)`` gives
    (out, lse), and with keep_lse False its lse may be a kept scratch buffer (one allocation fewer a call).
    :meth:`native_call` hands the front end that output-only forward for calls autograd does not track."""

    def forward(self, q, k, v, params: AttentionParams):
        return self._forward(q, k, v, params, True)

    def native_call(self, q, k, v, params: AttentionParams):
        """The forward's output alone (_output_only) for calls that autograd does not track and that return no lse;
        None for tracked calls, whose lse the backward reads."""
        return None if tracked_by_autograd(q, k, v, params) else self._output_only

    def _output_only(self, q, k, v, params: AttentionParams):
        return self._forward(q, k, v, params, False)[0]

    def _forward(self, q, k, v, params: AttentionParams, keep_lse: bool):
        raise NotImplementedError


FEATURE_SENTENCES = {
    "causal": "causal masking",
    "gqa": "grouped-query attention (fewer key/value heads than query heads)",
    "bool_mask": "boolean attn_mask",
    "float_mask": "additive float attn_mask",
    "mask_grad": "the gradient of a float attn_mask",
    "dropout": "dropout",
    "window": "a sliding window",
    "softcap": "softcap",
    "deterministic": "a deterministic backward",
    "value_dim": "a value head dim different from the query head dim",
}

OPERATION_SENTENCES = {
    "attention": "dense attention",
    "kvcache": "attention over a contiguous KV cache (attention_with_kvcache)",
    "paged_kvcache": "attention over a paged KV cache (attention_with_kvcache with a block_table)",
    "varlen": "variable-length packed attention (varlen_attention)",
}
