"""The dispatcher: which backend runs a problem, and why.

Precedence: the ``backend=`` argument > ``use_backend(...)`` > ``MHATTN_BACKEND`` > automatic.
Automatic selection takes, among the backends of the priority table below (data, not nested ifs) with
no reason against the problem (and their registered variants, ``Backend.variant_of``, such as ``sdpa.cudnn``), the
one a timing table (``mhattn.tuning.table``, written by ``mhattn tune``) measured fastest at the nearest tuned shape;
with no table for this device, the first of the priority table's. During CUDA graph
capture on the current stream, an automatic request reads the table's graph-replay times for the host-bound calls
(:func:`requested_on`, ``mhattn.tuning.table``): a replayed call pays none of its host path, so the fastest kernel
wins, not the cheapest call. A backend asked for by name that cannot run the problem raises
:class:`BackendUnavailableError` with its reasons: never a silent fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from mhattn import environment, registry
from mhattn.backends.paired import pair_name
from mhattn.caches import put_bounded
from mhattn.errors import BackendUnavailableError, UnknownBackendError
from mhattn.problem import Problem, feature_bits
from mhattn.tuning import table as timing_table

ENV_VAR = "MHATTN_BACKEND"
AUTO = "auto"

# Priority per device type and compute capability: the first row whose device type matches and whose
# minimum compute capability the device reaches gives the order in which backends are tried.
PRIORITY = [
    # (device type, minimum compute capability, backend names, most preferred first)
    ("cuda", (8, 0), ("triton", "cupy", "sdpa", "reference")),
    ("cuda", (0, 0), ("triton", "sdpa", "reference")),
    ("cpu", None, ("sdpa", "reference")),
]

_override: contextvars.ContextVar = contextvars.ContextVar("mhattn_backend_override", default=None)


def set_priority(device_type: str, names, min_compute_capability=None) -> None:
    """Put a priority row first: on ``device_type`` (and compute capability >= the minimum, for CUDA),
    try ``names`` in this order. Used to enter third-party backends into automatic selection."""
    names = tuple(n.lower() for n in names)
    for n in names:
        registry.get_backend(n)  # unknown names fail here, not at the first call
    PRIORITY.insert(0, (device_type, min_compute_capability, names))
    clear_cache()


def priority_for(problem: Problem) -> tuple:
    for device_type, min_cc, names in PRIORITY:
        if device_type != problem.device_type:
            continue
        if min_cc is not None and problem.compute_capability is not None and tuple(problem.compute_capability) < min_cc:
            continue
        return names
    return ("reference",)


# ---- the requested name ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _parse_name(value: str, source: str) -> str:
    name = value.strip().lower()
    if name == "" and source == ENV_VAR:
        return AUTO
    if name == AUTO:
        return name
    if not registry.is_backend_name(name):
        raise UnknownBackendError(f"{source}={value!r} is not a backend; {registry.valid_names()}")
    return registry.get_backend(name).name  # a pair's name as the pair spells it ("triton + sdpa" -> "triton+sdpa")


_AUTOMATIC = (AUTO, "automatic selection")

_environ, _ENV_KEY = environment.raw_store(ENV_VAR)  # MHATTN_BACKEND, read at every call


def requested(backend: Optional[str] = None) -> tuple:
    """``(name, source)``: the backend asked for and where the request came from. Read at every call (a
    ``use_backend`` block or ``MHATTN_BACKEND`` may change between calls); the answers to each string are cached."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str) or None, got {type(backend).__name__}")
        return _argument_request(backend)
    override = _override.get()
    if override is not None:
        return override
    env = _environ.get(_ENV_KEY)
    return _AUTOMATIC if env is None else _environment_request(env)


# Appended to an automatic request's source during CUDA graph capture (requested_on): decide() then reads the timing
# table's graph-replay times, and the decision caches, whose keys hold the request, keep the two choices apart.
CAPTURE_NOTE = ", during CUDA graph capture"


def requested_on(backend: Optional[str], device_type: str) -> tuple:
    """:func:`requested` for a call on a device of ``device_type``: an automatic request made while the current CUDA
    stream is being captured into a graph comes back with CAPTURE_NOTE on its source. One query of the stream's
    capture state per automatic call on a GPU; nothing more for a backend asked for by name or a call on the CPU."""
    request = requested(backend)
    if request[0] != AUTO or device_type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return request
    return _during_capture(request)


@functools.lru_cache(maxsize=16)
def _during_capture(request: tuple) -> tuple:
    return request[0], request[1] + CAPTURE_NOTE


@functools.lru_cache(maxsize=64)
def _argument_request(backend: str) -> tuple:
    return _parse_name(backend, "backend"), "the backend= argument"


@functools.lru_cache(maxsize=64)
def _environment_request(raw) -> tuple:
    """The request of MHATTN_BACKEND's value as os.environ stores it (bytes on POSIX)."""
    env = environment.decoded(raw)
    return _parse_name(env, ENV_VAR), f"{ENV_VAR}={env}"


@contextlib.contextmanager
def use_backend(name: str):
    """Run the calls inside the ``with`` block on backend ``name`` (or ``"auto"``); restores on exit.

    Per thread and per asyncio task (a context variable), so concurrent code is not affected.
    """
    parsed = _parse_name(name, "use_backend") if isinstance(name, str) else None
    if parsed is None:
        raise TypeError(f"use_backend: name must be a str, got {type(name).__name__}")
    token = _override.set((parsed, "use_backend()"))  # the request as requested() returns it
    try:
        yield registry.get_backend(parsed) if parsed != AUTO else None
    finally:
        _override.reset(token)


# ---- the decision ----------------------------------------------------------------------------------


@dataclass
class Decision:
    """The outcome of selection for one problem: the chosen backend and every candidate's reasons."""

    problem: Problem
    requested: str
    source: str
    chosen: Optional[str]
    reasons: dict = field(default_factory=dict)  # backend name -> list of reasons ([] = could run it)
    candidates: tuple = ()
    measured: object = None  # mhattn.tuning.table.Evidence when a timing table made the choice

    @property
    def path(self) -> Optional[str]:
        """The chosen backend's kernel family for the forward, and why (Backend.forward_path); worked out when
        asked, since only explain shows it."""
        return registry.get_backend(self.chosen).forward_path(self.problem) if self.chosen is not None else None

    @property
    def backward_path(self) -> Optional[str]:
        """The same for the backward (Backend.backward_path), when the problem needs gradients."""
        if self.chosen is None or not self.problem.needs_grad:
            return None
        return registry.get_backend(self.chosen).backward_path(self.problem)

    def __str__(self):
        lines = [f"problem: {self.problem.describe()}", f"requested: {self.requested} (from {self.source})"]
        lines.append(f"chosen: {self.chosen}" if self.chosen else "chosen: none (no backend can run this problem)")
        path = self.path
        if path:
            lines.append(f"  forward: {path}")
        backward_path = self.backward_path
        if backward_path:
            lines.append(f"  backward: {backward_path}")
        if self.measured is not None:
            lines.append(f"  {self.measured}")
        for name, why in self.reasons.items():
            tag = " [auto order]" if name in self.candidates else ""
            if why:
                lines.append(f"  {name}{tag}: cannot run: " + "; ".join(why))
            else:
                lines.append(f"  {name}{tag}: can run")
        return "\n".join(lines)

    __repr__ = __str__


# The decision cache of the call path: key (request, device, dtype, heads, head dims, features, size buckets;
# see backend_for) -> backend object. Bounded; when full, the oldest entry makes room (no wholesale flush).
_cache: dict = {}
_selected: dict = {}  # select()'s cache: (problem, request name, source) -> backend object
_by_call: dict = {}  # backend_for_call's memo: a call's exact sizes and flags -> backend object
_dependent: list = []  # other modules' caches holding decisions (see clears_with_cache)
_CACHE_LIMIT = 4096
_cache_lock = threading.Lock()
_warned: set = set()


def _remember(cache: dict, key, backend) -> None:
    """Store a decision in one of the bounded caches above; when full, the oldest entry makes room."""
    with _cache_lock:
        put_bounded(cache, key, backend, _CACHE_LIMIT)


def clears_with_cache(cache: dict) -> None:
    """Clear ``cache`` (a dict holding decisions, e.g. the call path's memo of repeated calls) whenever the
    decision cache is cleared."""
    _dependent.append(cache)


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
        _selected.clear()
        _by_call.clear()
        for cache in _dependent:
            cache.clear()
    # names a registry change may (in)validate
    for parsed in (_parse_name, _argument_request, _environment_request, _during_capture):
        parsed.cache_clear()
    timing_table.clear_cache()


registry.on_change(clear_cache)


def decide(problem: Problem, name: str, source: str) -> Decision:
    """Every registered backend's reasons for ``problem`` and the choice for the request ``name`` (not cached:
    :func:`backend_for` caches the outcome per call signature)."""
    reasons = {b.name: b.unsupported(problem) for b in registry.all_backends()}
    if name != AUTO and name not in reasons:  # a pair asked for by name
        reasons[name] = registry.get_backend(name).unsupported(problem)
    candidates = priority_for(problem) if name == AUTO else (name,)
    runnable = [n for n in candidates if n in reasons and not reasons[n]]
    chosen = runnable[0] if runnable else None
    # The fastest measured on this GPU, if a table has a close enough shape: a backend, a variant of one (the same
    # kernels with a choice pinned: Backend.variant_of), or a pair of two where the problem needs gradients (the
    # table holds a variant's or a pair's time only where mhattn tune measured it).
    measured = None
    if name == AUTO:
        weighed = runnable + _runnable_variants(reasons, runnable) + _runnable_pairs(problem, runnable)
        measured = timing_table.measured_choice(problem, weighed, replayed=source.endswith(CAPTURE_NOTE))
    chosen = measured.chosen if measured is not None else chosen
    return Decision(problem, name, source, chosen, reasons, candidates if name == AUTO else (), measured)


def _runnable_variants(reasons: dict, runnable: list) -> list:
    """The names of the registered variants (Backend.variant_of) of ``runnable`` backends that can run the problem
    (``reasons``: every registered backend's reasons)."""
    return [name for base in runnable for name in registry.variants_of(base) if not reasons.get(name, [None])]


def _runnable_pairs(problem: Problem, runnable: list) -> list:
    """The names of the pairs (forward on one, backward on another) of ``runnable`` backends that can run
    ``problem``, where it needs gradients."""
    if not problem.needs_grad or len(runnable) < 2:
        return []
    pairs = (registry.get_backend(pair_name(a, b)) for a in runnable for b in runnable if a != b)
    return [pair.name for pair in pairs if not pair.unsupported(problem)]


def size_bucket(n: int) -> int:
    """Sizes that share a cached decision: 0, 1, 2, 3..4, 5..8, ... (the next power of two), so calls whose
    batch or sequence lengths vary (dynamic shapes) keep hitting the cache."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def _bucket_range(n: int) -> tuple:
    return (n, n) if n <= 2 else (size_bucket(n) // 2 + 1, size_bucket(n))


def backend_for(q, k, v, features: int, name: str, source: str, diag_offset: int = 0,
                needs_grad: Optional[bool] = None):
    """The backend object that runs attention of q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with
    the features ``features`` (an int of :data:`mhattn.problem.FEATURE_BITS`) and the causal/window diagonal
    at ``diag_offset``, for the request ``(name, source)`` of :func:`requested`. ``needs_grad``: whether the call
    will be differentiated (automatic selection then weighs forward+backward time); None reads it from q, k and v's
    requires_grad. The hot path: one tuple of primitives, one dict look-up; a :class:`Problem` is built only on a
    miss. Raises :class:`BackendUnavailableError` with every reason when nothing can run it."""
    device = q.device
    batch, heads_q, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    if needs_grad is None:
        needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    # The diagonal as the backends see it: top-left, bottom-right, and whether it hides any key.
    key = (name, source, device.type, device.index, q.dtype, heads_q, k.shape[1], head_dim, v.shape[3], features,
           diag_offset == 0, diag_offset == seqlen_k - seqlen_q, diag_offset < seqlen_k - 1, needs_grad,
           size_bucket(batch), size_bucket(seqlen_q), size_bucket(seqlen_k))
    backend = _cache.get(key)
    if backend is None:
        # A choice that differs inside the size buckets (a limit, or a timing table) is cached per exact size.
        exact_key = key + (batch, seqlen_q, seqlen_k, diag_offset)
        backend = _cache.get(exact_key)
        if backend is not None:
            return backend
        problem = Problem.from_shapes(device, q.dtype, (batch, heads_q, seqlen_q, head_dim), k.shape[1], seqlen_k,
                                      v.shape[3], features, diag_offset=diag_offset, needs_grad=needs_grad)
        backend = _select(problem, name, source)
        _remember(_cache, key if _bucket_agrees(problem, name, source, backend.name) else exact_key, backend)
    return backend


def backend_for_call(q, k, v, mask, mask_requires_grad: bool, dropout_p: float, softcap, causal: bool,
                     window: bool, name: str, source: str, diag_offset: int = 0, needs_grad: Optional[bool] = None):
    """:func:`backend_for` of a call's own arguments (q, k, v as there; mask None or a tensor; ``causal``,
    ``window``: whether the call uses those features; ``needs_grad`` as there), memoised by their exact sizes and
    flags: a repeated call builds neither the feature bits nor the size buckets. The memo holds only what
    backend_for answered, and is cleared with its cache."""
    if needs_grad is None:
        needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    key = (name, source, q.device, q.dtype, q.shape, k.shape, v.shape[3], None if mask is None else mask.dtype,
           mask_requires_grad, dropout_p > 0.0, softcap is not None, causal, window, diag_offset, needs_grad)
    backend = _by_call.get(key)
    if backend is None:
        features = feature_bits(q, k, v, mask, mask_requires_grad, dropout_p, softcap, causal, window)
        backend = backend_for(q, k, v, features, name, source, diag_offset, needs_grad)
        _remember(_by_call, key, backend)
    return backend


def _bucket_agrees(problem: Problem, name: str, source: str, chosen: str) -> bool:
    """Whether the smallest and the largest sizes of ``problem``'s size buckets get the same backend (a limit
    inside a bucket, such as a grid size, would otherwise be cached for sizes on its other side). This takes
    a backend's reasons about batch and sequence sizes to be limits (a size works, or every size beyond it
    fails), as every built-in backend's are; a choice that varies inside a bucket otherwise (a timing table
    read by :func:`decide`) may be missed, and is then made per bucket."""
    ranges = [_bucket_range(n) for n in (problem.batch, problem.seqlen_q, problem.seqlen_k)]
    exact = (problem.batch, problem.seqlen_q, problem.seqlen_k)
    for corner in (tuple(lo for lo, _ in ranges), tuple(hi for _, hi in ranges)):
        if corner != exact and decide(problem.resized(*corner), name, source).chosen != chosen:
            return False
    return True


def select(problem: Problem, name: str, source: str = "automatic selection"):
    """The backend object that runs ``problem`` for the request ``name``; raises with reasons otherwise.

    Cached per (problem, request) like :func:`backend_for`'s decisions (the entry points that build a
    :class:`Problem` themselves, such as the KV-cache, packed-sequence and ring paths, call this per step)."""
    key = (problem, name, source)
    backend = _selected.get(key)
    if backend is None:
        backend = _select(problem, name, source)
        _remember(_selected, key, backend)
    return backend


def _select(problem: Problem, name: str, source: str):
    decision = decide(problem, name, source)
    if decision.chosen is None:
        if name == AUTO:
            raise BackendUnavailableError("no backend can run this problem:\n" + str(decision))
        raise BackendUnavailableError(
            f"backend {name!r} (requested by {source}) cannot run this problem: "
            + "; ".join(decision.reasons.get(name, ["it is not registered"]))
            + f"\nproblem: {problem.describe()}"
        )
    if name == AUTO and decision.chosen == "reference" and problem.device_type == "cuda":
        _warn_reference_on_gpu(decision)
    return registry.get_backend(decision.chosen)


def _warn_reference_on_gpu(decision: Decision) -> None:
    key = frozenset(decision.problem.features), decision.problem.dtype, decision.problem.head_dim
    if key in _warned:
        return
    _warned.add(key)
    rejected = "\n".join(
        f"  {n}: " + "; ".join(decision.reasons.get(n, ["not registered"]))
        for n in decision.candidates
        if n != "reference"
    )
    warnings.warn(
        "mhattn: no fused kernel can run this problem on the GPU, falling back to the O(N^2) reference "
        f"({decision.problem.describe()}):\n{rejected}",
        stacklevel=4,
    )
