"""The backend contract: capabilities declared as data, reasons as sentences, one forward and one backward.

Every backend (built-in or third-party) subclasses :class:`Backend`. The dispatcher only ever calls
``unsupported(problem)``, ``forward`` and ``backward``; the conformance suite generates its cases from
``capabilities``. A backend never sees the module, the masks in their user-facing forms or the
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

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"Capabilities.features: unknown feature names {sorted(unknown)}; known: {FEATURES}")


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
        return dataclasses.replace(self, **changes)


class Backend:
    """Base class of every attention backend.

    Subclasses set ``name`` and ``capabilities`` and implement ``forward`` and ``backward``; they may
    extend ``unavailable()`` (reasons the backend cannot run at all on this machine) and
    ``unsupported()`` (reasons it cannot run one problem).
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    description: str = ""

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

    def dropout_keep_mask(self, batch, heads, seqlen_q, seqlen_k, params: AttentionParams, device):
        """The boolean keep-mask (B, H, Nq, Nk) this backend's dropout draws for ``params.seed``.

        Every built-in backend uses the same counter-based RNG, so the default materialises it in torch.
        """
        from mhattn.dropout_rng import keep_mask

        return keep_mask(params.seed, batch, heads, seqlen_q, seqlen_k, params.dropout_p, device=device)

    def __repr__(self):
        return f"<mhattn backend {self.name!r}>"


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
