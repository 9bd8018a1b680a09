"""The ``sdpa`` backend: PyTorch's own fused attention kernels behind mhattn's backend contract.

It calls the kernels that ``torch.nn.functional.scaled_dot_product_attention`` dispatches to, through
torch's private ops that also return the per-row log-sum-exp (the public function does not), so the
forward can honour the contract's ``(out, lse)`` and the backward runs torch's own backward kernel on the
saved lse, with no recomputation:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): torch's fused CPU kernel,
  O(N) memory without a mask, any head dim, fp16/bf16/fp32/fp64, GQA without repeating K and V;
- CUDA: ``flash`` (FlashAttention-2), ``efficient`` (memory-efficient, xFormers-derived) and ``cudnn``,
  each through its ``aten._scaled_dot_product_<kernel>_attention`` op and that op's backward.

Which kernel runs: the constructor's ``kernel=`` argument, else ``MHATTN_SDPA_KERNEL`` (read once, when
the backend is built) = ``auto`` (default: torch's own choice among the kernels that can run the call,
made by ``torch._fused_sdp_choice`` with every kernel enabled) or ``flash``, ``efficient``, ``cudnn``
(pinned; on the CPU only ``flash`` and ``auto`` exist). SDPA's ``math`` path is not offered: it returns
no lse and is the same algorithm as the ``reference`` backend.

The registry also holds the backend pinned to each CUDA kernel under a name of its own, ``sdpa.flash``,
``sdpa.efficient`` and ``sdpa.cudnn`` (:func:`pinned_backends`; ``variant_of = "sdpa"``), which ``mhattn tune``
times where calls are short and automatic selection may take where a timing table measured one fastest. Their
calls that return no lse run the kernel's private op binding directly (``torch._scaled_dot_product_<kernel>_attention``,
a differentiable op with torch's C++ backward node): no per-call kernel choice, a host path several microseconds
shorter than the public op's (the memory-efficient kernel's the shortest of all, where a call is too short for
its slower GPU time to count).

What SDPA cannot do exactly as mhattn defines it is a reason in ``unsupported``: softcap, sliding
windows, mhattn's shared counter-based dropout mask (SDPA draws its own), a value head dim different
from the query's, the gradient of a float mask; on CUDA also attn_mask (not wired through the private
ops here), GQA except on the flash kernel, and causal alignments a kernel lacks (flash aligns causal
bottom-right, efficient top-left, cudnn only when Nq == Nk). A query row that sees no key gives 0 and
lse -inf, as in every mhattn backend (SDPA itself gives NaN there).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from mhattn.backends import layouts
from mhattn.backends.base import FEATURE_SENTENCES, AttentionParams, Backend, Capabilities
from mhattn.caches import put_bounded
from mhattn.errors import InputError

__all__ = ["SdpaBackend", "KERNEL_ENV", "KERNEL_CHOICES", "pinned_backends"]

KERNEL_ENV = "MHATTN_SDPA_KERNEL"
KERNEL_CHOICES = ("auto", "flash", "efficient", "cudnn")

_HALF = frozenset({torch.float16, torch.bfloat16})
_NEVER = {
    "dropout": "dropout with mhattn's shared counter-based mask (SDPA's kernels draw a different mask)",
    "window": "a sliding window (SDPA has none)",
    "softcap": "softcap (SDPA has none)",
    "value_dim": "a value head dim different from the query head dim (torch's fused kernels need equal dims)",
    "mask_grad": "the gradient of a float attn_mask (these private ops return none)",
}


@dataclass(frozen=True)
class TorchKernel:
    """What one of torch's fused kernels can run, as data (checked by :meth:`reasons`)."""

    name: str                      # as in MHATTN_SDPA_KERNEL
    device_type: str
    sdp_backend: str               # member of torch.nn.attention.SDPBackend
    dtypes: frozenset
    head_dim_multiple: int
    max_head_dim: int
    min_compute_capability: Optional[tuple]
    masks: bool                    # bool / float attn_mask
    gqa: bool                      # fewer key/value heads without repeating them
    causal: str                    # "any" alignment, "bottom_right", "top_left" or "square" (Nq == Nk only)

    def reasons(self, problem) -> list:
        why = []
        if problem.device_type != self.device_type:
            return [f"runs on {self.device_type}, got {problem.device_type}"]
        if problem.dtype not in self.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            why.append(f"supports dtypes {names}")
        if problem.head_dim % self.head_dim_multiple or problem.head_dim > self.max_head_dim:
            why.append(f"needs a head dim that is a multiple of {self.head_dim_multiple} up to {self.max_head_dim}")
        cc = problem.compute_capability
        if self.min_compute_capability and cc is not None and tuple(cc) < self.min_compute_capability:
            why.append("needs sm_%d%d or newer" % self.min_compute_capability)
        if not self.masks and problem.features & {"bool_mask", "float_mask"}:
            why.append("takes no attn_mask here")
        if not self.gqa and "gqa" in problem.features:
            why.append("would repeat K and V for GQA")
        if problem.causal_hides_keys and not self._aligns(problem):
            why.append(f"aligns causal masks {self.causal.replace('_', '-')} only")
        return why

    def _aligns(self, problem) -> bool:
        square = problem.seqlen_q == problem.seqlen_k and problem.diag_offset == 0
        return (self.causal == "any" or square
                or (self.causal == "bottom_right" and problem.diag_offset == problem.seqlen_k - problem.seqlen_q)
                or (self.causal == "top_left" and problem.diag_offset == 0))


KERNELS = (
    TorchKernel("flash", "cpu", "FLASH_ATTENTION", frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                1, 1 << 20, None, masks=True, gqa=True, causal="any"),
    TorchKernel("cudnn", "cuda", "CUDNN_ATTENTION", _HALF, 8, 256, (9, 0), masks=False, gqa=False, causal="square"),
    TorchKernel("flash", "cuda", "FLASH_ATTENTION", _HALF, 8, 256, (8, 0), masks=False, gqa=True, causal="bottom_right"),
    TorchKernel("efficient", "cuda", "EFFICIENT_ATTENTION", _HALF | {torch.float32}, 8, 256, (5, 0),
                masks=False, gqa=False, causal="top_left"),
)


CUDA_ENV = "MHATTN_SDPA_CUDA"
_NATIVE_CALLS_LIMIT = 4096


def kernel_from_env(value: Optional[str]) -> str:
    name = (value if value is not None else os.environ.get(KERNEL_ENV, "auto")).strip().lower() or "auto"
    if name not in KERNEL_CHOICES:
        source = "kernel" if value is not None else KERNEL_ENV
        raise InputError(f"{source}={name!r} is not an SDPA kernel; valid: {', '.join(KERNEL_CHOICES)}")
    return name


class SdpaBackend(Backend):
    name = "sdpa"
    description = ("PyTorch's fused attention kernels (CPU flash; CUDA cuDNN / FlashAttention-2 / memory-efficient) "
                   "through torch's private ops that return the log-sum-exp")
    # The union over the kernels above; unsupported() applies each kernel's own limits.
    capabilities = Capabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        min_head_dim=1,
        max_head_dim=1 << 20,
        min_compute_capability=None,
        features=frozenset({"causal", "gqa", "bool_mask", "float_mask"}),
    )

    def __init__(self, kernel: Optional[str] = None, cuda: Optional[bool] = None, name: Optional[str] = None):
        self.kernel = kernel_from_env(kernel)
        if name is not None:  # a registered kernel-pinned form (pinned_backends)
            self.name, self.variant_of = name, SdpaBackend.name
            self.description = f"{SdpaBackend.description}, pinned to torch's {self.kernel} kernel"
        # The CUDA path is on unless turned off (``cuda=False`` or MHATTN_SDPA_CUDA=0), e.g. to keep automatic
        # selection on mhattn's own kernels where a timing table prefers torch's.
        if cuda is None:
            cuda = os.environ.get(CUDA_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        self.cuda = bool(cuda)
        self._choices = {}   # call signature -> kernel, so forward and backward skip the choice after the first
        self._native = {}    # call signature -> native_call's answer (_TorchSdpaCall)
        self._out_strides = {}  # (kernel, q and v layouts) -> the strides of the output the kernel wrote

    def _kernels(self, device_type: str):
        return [k for k in KERNELS if k.device_type == device_type and self.kernel in ("auto", k.name)]

    def unsupported(self, problem) -> list:
        if problem.device_type == "cuda" and not self.cuda:
            return [f"its CUDA path is turned off ({CUDA_ENV}=0 or SdpaBackend(cuda=False))"]
        # The base class's generic sentence for a missing feature gives way to the specific one above.
        generic = {f"does not support {FEATURE_SENTENCES.get(f, f)}" for f in _NEVER}
        reasons = [_NEVER[f] for f in sorted(problem.features & set(_NEVER))]
        reasons += [r for r in super().unsupported(problem) if r not in generic]
        if reasons:
            return reasons
        kernels = self._kernels(problem.device_type)
        if not kernels:
            if self.variant_of is not None:
                return [f"torch's {self.kernel} kernel has no {problem.device_type} form"]
            return [f"{KERNEL_ENV}={self.kernel} names no {problem.device_type} kernel"]
        why = {k.name: k.reasons(problem) for k in kernels}
        if any(not w for w in why.values()):
            return []
        return ["no torch kernel fits: " + "; ".join(f"{n}: {', '.join(w)}" for n, w in why.items())]

    # ---- which kernel runs a call ------------------------------------------------------------------------
    def _choose(self, q, k, v, params: AttentionParams, plan: "_Plan") -> TorchKernel:
        """The kernel for these tensors: the pinned one, or torch's choice among those that fit.

        Called by forward and backward alike with the same tensors, so both use one kernel."""
        signature = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, plan.is_causal,
                     params.diag_offset, None if plan.mask is None else plan.mask.dtype)
        kern = self._choices.get(signature)
        if kern is None:
            if len(self._choices) > 4096:  # many distinct shapes: start over rather than grow without bound
                self._choices.clear()
            kern = self._choices[signature] = self._choose_uncached(q, k, v, params, plan)
        return kern

    def _choose_uncached(self, q, k, v, params, plan) -> TorchKernel:
        from mhattn.problem import Problem

        problem = Problem.from_tensors(q, k, v, params, causal=plan.causal_in_problem, window=False)
        fitting = [kern for kern in self._kernels(q.device.type) if not kern.reasons(problem)]
        if not fitting:
            raise RuntimeError(f"sdpa backend: no torch kernel fits {problem.describe()}")
        if len(fitting) == 1 or q.device.type != "cuda":
            return fitting[0]
        return _torch_choice(q, k, v, plan, fitting)

    # ---- the contract ------------------------------------------------------------------------------------
    def native_attention(self, q, k, v, params: AttentionParams):
        """The output through torch's public ``scaled_dot_product_attention``, whose backward is a C++ autograd
        node: a forward+backward then costs what torch's own does on the host, where mhattn's Python autograd
        Function runs its backward on the autograd engine's device thread (several hundred microseconds on
        an H100 host at small shapes). Only where that is exactly this backend's attention: automatic kernel
        choice, no mask, causal only top-left (``is_causal``'s alignment) or with a diagonal that hides no key
        (a decoding step's bottom-right mask: no mask at all), no row that could see no key
        (SDPA gives NaN there, mhattn 0), and torch's choice a fused kernel (not its math path, which the
        global enable flags could leave it)."""
        call = self.native_call(q, k, v, params)
        return None if call is None else call(q, k, v, params)

    def native_call(self, q, k, v, params: AttentionParams):
        """:meth:`native_attention` prepared for calls like this one: a callable of ``(q, k, v, params)`` giving
        the output, or None where torch's global SDPA switches now leave it no fused kernel; None where calls
        like this one have no such path. It serves every call with this one's params (the seed aside), shapes,
        strides, dtype, device, inputs' ``requires_grad`` and grad mode, which is what torch's kernel choice
        reads besides the switches (those it reads at each call), so a caller that keeps those equal (the
        front end's memo of repeated calls) skips this method's checks and look-up."""
        if params.mask is not None or (q.device.type == "cuda" and not self.cuda):
            return None
        if self.kernel != "auto" and q.device.type != "cuda":
            return None
        causal = _is_causal(params)
        if params.window_right is not None and not causal:
            return None
        # A diagonal at or past the last key (decoding with a bottom-right mask) hides nothing: not causal at all.
        causal = causal and params.diag_offset < k.shape[2] - 1
        if causal and params.diag_offset != 0:
            return None
        requires_grad, grad_mode = q.requires_grad or k.requires_grad or v.requires_grad, torch.is_grad_enabled()
        signature = (params.scale, causal, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                     q.device, requires_grad, grad_mode)
        call = self._native.get(signature)
        if call is None:
            call = put_bounded(self._native, signature,
                               self._native_for(q, k, v, params, causal, requires_grad and grad_mode),
                               _NATIVE_CALLS_LIMIT)
        return call

    def _native_for(self, q, k, v, params: AttentionParams, causal: bool, tracked: bool):
        """native_call's callable for a new signature: torch's public op on ``auto``; the pinned kernel's private op
        binding where that kernel runs the call exactly as top-left causal (or not causal at all), else None."""
        if self.kernel == "auto":
            return _TorchSdpaCall(q, k, params.scale, causal)
        from mhattn.problem import Problem

        kern = self._kernels("cuda")[0]
        if kern.reasons(Problem.from_tensors(q, k, v, params, causal=causal, window=False)):
            return None
        return _PinnedKernelCall(kern.name, q.shape[-1], params.scale, causal, tracked)

    def forward(self, q, k, v, params: AttentionParams):
        plan = _Plan.make(q, k, params)
        kern = self._choose(q, k, v, params, plan)
        out, lse = _OPS[(kern.device_type, kern.name)].forward(q, k, v, params.scale, plan)
        layout = _layout_key(kern, q, v)
        if layout not in self._out_strides:
            if len(self._out_strides) > 4096:
                self._out_strides.clear()
            self._out_strides[layout] = out.stride()
        if plan.empty_rows is not None:
            out = out.masked_fill(plan.empty_rows[..., None], 0.0)
            lse = lse.masked_fill(plan.empty_rows, -math.inf)
        elif plan.may_have_empty_rows:
            empty = ~torch.isfinite(lse)
            out = out.masked_fill(empty[..., None], 0.0)
            lse = lse.masked_fill(empty, -math.inf)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None):
        plan = _Plan.make(q, k, params)
        kern = self._choose(q, k, v, params, plan)
        ops = _OPS[(kern.device_type, kern.name)]
        # torch's own autograd hands these backward kernels the output as the forward kernel wrote it and an
        # output gradient laid out like it. Under torch.compile, out arrives in the layout mhattn's custom op
        # promises (a copy, where the kernel wrote another): both go back to the kernel's own layout.
        kernel_strides = self._out_strides.get(_layout_key(kern, q, v))
        if kernel_strides is None and kern.name == "cudnn":
            # Another backend's forward (a pair): torch caches a cuDNN backward graph by q, k and v's strides
            # alone, so out and grad_out must always come in one layout per q layout, or a graph built for
            # another out layout is reused and reads out wrongly. cuDNN's own forward writes q's layout.
            kernel_strides = layouts.strides_in_order_of(q, out.shape)
        if kernel_strides is not None:
            out = layouts.placed(out, kernel_strides)
        grad_out = _laid_out_like(grad_out, out)
        # A row that sees no key has lse -inf; +inf makes every kernel's P = exp(S - lse) exactly 0 there.
        lse_k = lse.masked_fill(lse == -math.inf, math.inf)
        dq, dk, dv = ops.backward(grad_out, q, k, v, out, lse_k, params.scale, plan)
        if grad_lse is not None:
            dq, dk = _add_lse_gradient(ops, grad_lse, q, k, lse, lse_k, params.scale, plan, dq, dk)
        return dq, dk, dv, None


def _is_causal(params: AttentionParams) -> bool:
    """A causal band (right bound 0 on the diagonal, no left bound): what torch's is_causal flag can express."""
    return params.window_right == 0 and params.window_left is None


def _layout_key(kern: "TorchKernel", q: torch.Tensor, v: torch.Tensor) -> tuple:
    return kern.name, q.device.type, q.shape, q.stride(), v.shape, v.stride()


def _laid_out_like(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """grad_out in out's memory layout (a copy only when the strides differ): torch's CUDA backward kernels
    are handed it that way by torch's own autograd and misread another layout."""
    if grad_out.stride() != out.stride() and layouts.is_dense(out):
        return torch.empty_like(out).copy_(grad_out)
    return grad_out


def _add_lse_gradient(ops, grad_lse, q, k, lse, lse_k, scale, plan, dq, dk):
    """Add the gradient flowing into the returned lse, which torch's backward kernels do not take.

    d lse_i / d s_ij = P_ij, so the extra dS is g_i * P_ij (g = grad_lse, 0 on rows that see no key):
    dQ_i += scale * g_i * (P K)_i, the output of attention with K as the values; and
    dK += scale * P^T (g * Q), the value gradient of that same attention for an output gradient
    scale * g * Q. One more forward and backward of the kernel, only when the lse carries a gradient.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = grad_lse.masked_fill(lse == -math.inf, 0.0).to(compute)[..., None]
    out_k, _ = ops.forward(q, k, k, scale, plan)
    out_k = out_k.masked_fill((lse == -math.inf)[..., None], 0.0)
    dq = (dq.to(compute) + scale * g * out_k.to(compute)).to(dq.dtype)
    grad_k_as_value = _laid_out_like((scale * g * q.to(compute)).to(q.dtype), out_k)
    _, _, dk_extra = ops.backward(grad_k_as_value, q, k, k, out_k, lse_k, scale, plan)
    return dq, (dk.to(compute) + dk_extra.to(compute)).to(dk.dtype)


# ---- one call's plan: causal flag, mask and the rows that see no key ---------------------------------------


@dataclass
class _Plan:
    is_causal: bool                      # the is_causal flag the kernel gets
    causal_in_problem: bool              # whether the diagonal hides anything (for kernel choice)
    mask: Optional[torch.Tensor]         # additive float mask for the kernel (CPU), broadcast dims kept at 1
    empty_rows: Optional[torch.Tensor]   # bool (B or 1, H or 1, Nq): rows that see no key, known from the mask
    may_have_empty_rows: bool            # rows may see no key without a mask (bottom-right causal, Nq > Nk)

    @classmethod
    def make(cls, q, k, params: AttentionParams) -> "_Plan":
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        causal = _is_causal(params)
        hides = causal and params.diag_offset < seqlen_k - 1
        mask = params.mask
        if q.device.type == "cpu" and hides and (params.diag_offset != 0 or mask is not None):
            # The CPU kernel aligns is_causal top-left and does not combine it with a mask: other
            # alignments, and causal with a mask, become one (Nq, Nk) mask.
            from mhattn.reference.naive import visible

            allowed = visible(seqlen_q, seqlen_k, params, device=q.device)[None, None]
            if mask is None:
                mask = allowed
            elif mask.dtype == torch.bool:
                mask = _compact(mask) & allowed
            else:
                mask = _compact(mask).masked_fill(~allowed, -math.inf)
            return cls(False, True, _additive(mask, q.dtype), _no_key_rows(mask), False)
        if mask is not None:
            compact = _compact(mask)
            return cls(False, False, _additive(compact, q.dtype), _no_key_rows(compact), False)
        return cls(hides, hides, None, None, hides and params.diag_offset < 0)


def _compact(mask: torch.Tensor) -> torch.Tensor:
    """The broadcast 4-D mask with each stride-0 dim narrowed to size 1 (the kernel broadcasts it)."""
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    compute = torch.float32 if dtype in _HALF else dtype
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=compute, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.to(compute)


def _no_key_rows(mask: torch.Tensor) -> Optional[torch.Tensor]:
    hidden = ~mask if mask.dtype == torch.bool else (mask == -math.inf)
    rows = hidden.all(-1)
    return rows if bool(rows.any()) else None


# ---- torch's kernels --------------------------------------------------------------------------------------


def _torch_choice(q, k, v, plan, fitting) -> TorchKernel:
    """torch's own pick (``torch._fused_sdp_choice``) among ``fitting``, the global enable flags aside."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    members = [getattr(SDPBackend, kern.sdp_backend) for kern in fitting]
    gqa = q.shape[1] != k.shape[1]
    try:
        with sdpa_kernel(members):
            choice = torch._fused_sdp_choice(q, k, v, None, 0.0, plan.is_causal, enable_gqa=gqa)
    except Exception:  # torch found none of them usable: keep mhattn's order
        return fitting[0]
    for kern, member in zip(fitting, members):
        if choice == _member_value(member):
            return kern
    return fitting[0]


_torch_c = torch._C
_priority_order = getattr(_torch_c, "_get_sdp_priority_order", list)  # (torch < 2.6 has no priority order)


def _scale_kwargs(head_dim: int, scale: float) -> dict:
    """The keyword arguments that pass ``scale`` to torch's ops: none where it is their default, 1 / sqrt(D) (the same
    double either way), so the call parses one keyword less."""
    return {} if head_dim > 0 and scale == 1.0 / math.sqrt(head_dim) else {"scale": scale}


class _TorchSdpaCall:
    """torch's public SDPA for one call signature (see SdpaBackend.native_call): its arguments, and whether torch
    runs such a call on a fused kernel under each state of its global switches met so far."""

    __slots__ = ("_sdpa", "_kwargs", "_fused")

    def __init__(self, q, k, scale: float, causal: bool):
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        # Only the arguments that differ from SDPA's defaults (each keyword passed costs the call's parsing).
        self._kwargs = _scale_kwargs(q.shape[-1], scale)
        if causal:
            self._kwargs["is_causal"] = True
        if q.shape[1] != k.shape[1]:
            self._kwargs["enable_gqa"] = True
        self._fused = {}  # state of the switches -> whether torch's choice is a fused kernel

    def __call__(self, q, k, v, params):  # (params: those of the signature; the seed, the one difference, is unused)
        # torch's global SDPA switches, which its public op obeys: the kernels' enable flags
        # (torch.backends.cuda.enable_*_sdp, read without their Python wrappers) and their priority order
        # (sdpa_kernel(..., set_priority=True)).
        switches = (_torch_c._get_flash_sdp_enabled(), _torch_c._get_mem_efficient_sdp_enabled(),
                    _torch_c._get_cudnn_sdp_enabled(), _torch_c._get_math_sdp_enabled(), *_priority_order())
        fused = self._fused.get(switches)
        if fused is None:
            fused = self._fused[switches] = torch._fused_sdp_choice(q, k, v, **self._kwargs) not in _NOT_FUSED
        return self._sdpa(q, k, v, **self._kwargs) if fused else None


class _PinnedKernelCall:
    """One CUDA kernel's private op binding for one call signature (see SdpaBackend._native_for): what the public op
    runs once it has chosen that kernel, with the lse computed only where autograd will need it."""

    __slots__ = ("_op", "_args", "_kwargs")

    def __init__(self, kernel: str, head_dim: int, scale: float, causal: bool, tracked: bool):
        # (attn_bias, compute_log_sumexp, dropout_p, is_causal) for efficient and cuDNN, (dropout_p, is_causal) for flash
        if kernel == "flash":
            self._op, self._args = torch._scaled_dot_product_flash_attention, (0.0, causal)
        elif kernel == "efficient":
            self._op, self._args = torch._scaled_dot_product_efficient_attention, (None, tracked, 0.0, causal)
        else:
            self._op, self._args = torch._scaled_dot_product_cudnn_attention, (None, tracked, 0.0, causal)
        self._kwargs = _scale_kwargs(head_dim, scale)

    def __call__(self, q, k, v, params):  # (params: those of the signature; the seed, the one difference, is unused)
        return self._op(q, k, v, *self._args, **self._kwargs)[0]


def pinned_backends() -> list:
    """The sdpa backend pinned to each of torch's CUDA kernels, named ``sdpa.<kernel>`` (registered as built-ins)."""
    return [SdpaBackend(kernel=name, name=f"{SdpaBackend.name}.{name}") for name in ("flash", "efficient", "cudnn")]


def _not_fused_values() -> frozenset:
    from torch.nn.attention import SDPBackend

    return frozenset(_member_value(getattr(SDPBackend, name)) for name in ("MATH", "ERROR") if hasattr(SDPBackend, name))


def _member_value(member) -> int:
    value = getattr(member, "value", member)
    return int(value)


class _CpuFlash:
    @staticmethod
    def forward(q, k, v, scale, plan):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, plan.is_causal, attn_mask=plan.mask, scale=scale)
        return out, lse.contiguous()   # the kernel writes it (B, Nq, H)-major; the contract's is (B, H, Nq)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, scale, plan):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, plan.is_causal, attn_mask=plan.mask, scale=scale)


def _placeholder_rng(device):
    # The philox seed and offset are read only when dropout_p > 0, which this backend never runs.
    return torch.zeros((), dtype=torch.long, device=device), torch.zeros((), dtype=torch.long, device=device)


class _CudaFlash:
    @staticmethod
    def forward(q, k, v, scale, plan):
        # With Nq != Nk, FlashAttention-2's is_causal is aligned bottom-right.
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, plan.is_causal, False, scale=scale)
        return result[0], result[1]

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, scale, plan):
        seed, offset = _placeholder_rng(q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, plan.is_causal,
            seed, offset, scale=scale)


class _CudaEfficient:
    @staticmethod
    def forward(q, k, v, scale, plan):
        out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, plan.is_causal, scale=scale)
        return out, lse[..., : q.shape[2]]    # its lse rows are padded to a multiple of 32

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, scale, plan):
        padded = -(-q.shape[2] // 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - q.shape[2])).contiguous()
        seed, offset = _placeholder_rng(q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], plan.is_causal,
            scale=scale)
        return dq, dk, dv


class _CudaCudnn:
    @staticmethod
    def forward(q, k, v, scale, plan):
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, plan.is_causal, False,
                                                                    scale=scale)
        lse = result[1]
        return result[0], lse.reshape(lse.shape[:3])   # cuDNN's lse is (B, H, Nq, 1)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, scale, plan):
        seed, offset = _placeholder_rng(q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None,
            q.shape[2], k.shape[2], 0.0, plan.is_causal, scale=scale)


_NOT_FUSED = _not_fused_values()

_OPS = {
    ("cpu", "flash"): _CpuFlash,
    ("cuda", "flash"): _CudaFlash,
    ("cuda", "efficient"): _CudaEfficient,
    ("cuda", "cudnn"): _CudaCudnn,
}
