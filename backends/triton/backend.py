"""TritonBackend: FlashAttention-2 in Triton behind the backend contract.

The host side only shapes arguments: it never copies q, k, v (their strides go to the kernels), picks
the tile configuration (configs.py), sizes the grids and launches. The kernels are imported on first
use, so importing mhattn costs no Triton import; whether Triton's interpreter runs them
(``TRITON_INTERPRET=1``, CPU tensors allowed) is read once, when this module is imported, because
Triton decides it when the kernels are defined.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch

from mhattn import dropout_rng
from mhattn.backends import layouts
from mhattn.backends.base import (FEATURES, OPERATIONS, AttentionParams, Capabilities, OutputOnlyForward,
                                  new_rows_contiguous, tracked_by_autograd)
from mhattn.backends.triton import configs, decode_launch, hopper_launch, key_padding, scores, varlen_launch
from mhattn.backends.triton.launcher import CompiledLauncher
from mhattn.caches import put_bounded
from mhattn.problem import device_capability

INTERPRET = scores.INTERPRET  # (Triton's interpreter, TRITON_INTERPRET=1: read once, at import)

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
# One program per (batch, head, block) on grid axis 0, whose limit is 2**31 - 1.
MAX_GRID = 2**31 - 1
# Words each store of the backward preprocess's zeroing writes (backward.zero_words_of_program).
ZERO_BLOCK = 1024

_kernels = None


def kernels():
    """The kernel modules (imported on first use): (forward, backward, rng)."""
    global _kernels
    if _kernels is None:
        from mhattn.backends.triton import backward, forward, rng

        _kernels = (forward, backward, rng)
    return _kernels


class _Launchers:
    """The dense forward and backward kernels and the split-KV decoding kernels (with the KV cache's append), each
    behind a :class:`CompiledLauncher` (launcher.py): after the first launch of a specialisation, later ones go
    straight to the compiled handle."""

    def __init__(self, forward_module, backward_module, decode_module):
        self.forward = CompiledLauncher(forward_module.attention_forward_kernel, INTERPRET)
        self.preprocess = CompiledLauncher(backward_module.backward_preprocess_kernel, INTERPRET)
        self.dkdv = CompiledLauncher(backward_module.backward_dkdv_kernel, INTERPRET)
        self.dq = CompiledLauncher(backward_module.backward_dq_kernel, INTERPRET)
        self.short_backward = CompiledLauncher(backward_module.backward_short_kernel, INTERPRET)
        self.split_kv = CompiledLauncher(decode_module.split_kv_kernel, INTERPRET)
        self.combine_splits = CompiledLauncher(decode_module.combine_splits_kernel, INTERPRET)
        self.append_kv = CompiledLauncher(decode_module.append_kv_kernel, INTERPRET)


_launchers_made = None


def launchers() -> _Launchers:
    """The launchers of the kernel modules (made on first use, like the modules)."""
    global _launchers_made
    forward_module, backward_module, _ = kernels()
    made = _launchers_made
    if made is None or made.forward.kernel is not forward_module.attention_forward_kernel:
        from mhattn.backends.triton import decode

        made = _launchers_made = _Launchers(forward_module, backward_module, decode)
    return made


# What torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision read, without their Python
# layers (read at every float32 call).
_ALLOW_TF32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)
_MATMUL_PRECISION = getattr(torch._C, "_get_float32_matmul_precision", None) or torch.get_float32_matmul_precision
# The current CUDA device, without torch.cuda.current_device's initialisation check (asked only for CUDA tensors,
# so CUDA is initialised).
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 follows torch's matmul setting: full fp32 ("ieee") unless TF32 is allowed."""
    if dtype != torch.float32:
        return "tf32"  # ignored by tl.dot for 16-bit inputs
    tf32 = _ALLOW_TF32() or _MATMUL_PRECISION() != "highest"
    return "tf32" if tf32 else "ieee"


def _strides4(t: torch.Tensor):
    """(batch, head, row) strides; the last dim is contiguous (checked by the caller)."""
    return t.stride()[:3]


def _mask_strides(mask: torch.Tensor):
    """Strides of a (B, H, Nq, Nk) mask view, 0 along broadcast (size-1) dims."""
    return tuple(0 if mask.shape[i] == 1 else mask.stride(i) for i in range(4))


class _Plan:
    """What the launches of one call signature share, computed once per signature (see _plan_for): sizes,
    the tile configuration, the compile-time flags and the device's identity for the tile-shrink cache."""

    def __init__(self, q, k, v, mask_kind, has_left, has_right, has_softcap, has_dropout, dot_precision,
                 key_lengths=False):
        self.batch, self.heads_q, self.seqlen_q, self.head_dim = q.shape
        self.heads_kv, self.seqlen_k = k.shape[1], k.shape[2]
        self.head_dim_v = v.shape[3]
        self.kv_group = self.heads_q // self.heads_kv
        self.block_d = configs.padded_head_dim(self.head_dim)
        self.block_dv = configs.padded_head_dim(self.head_dim_v)
        self.has_left, self.has_right = has_left, has_right
        # A causal-like band (right bound only): the last query blocks carry the most keys.
        self.heavy_first = has_right and not has_left
        self.mask_kind = mask_kind
        self.has_dropout = has_dropout
        self.key_lengths = key_lengths
        self.dtype = q.dtype
        cc = device_capability(q.device)
        # The Gluon Hopper forward (hopper_forward.py) is sm_90 code: wgmma and setmaxnreg.
        self.sm90 = not INTERPRET and cc == (9, 0)
        self.hopper_schedule = None    # its schedule and launch sets (hopper_launch.forward), made on first use
        # the Gluon Hopper backward's compile-time sets, deterministic or not (hopper_launch._backward_setup)
        self.hopper_backward_constexprs = {}
        self.hopper_backward_slices = None  # its launches' (batches, key/value heads) (hopper_launch.backward_slices)
        self.hopper_reasons = {}  # hopper_launch.why_not's plan part, per setting
        self.config = configs.config_for(cc, q.dtype, self.head_dim, self.heavy_first, self.seqlen_q, dot_precision,
                                         self.seqlen_k, masked=mask_kind != 0)
        self.flags = dict(HEAD_DIM=self.head_dim, HEAD_DIM_V=self.head_dim_v, BLOCK_D=self.block_d,
                          BLOCK_DV=self.block_dv, HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SOFTCAP=has_softcap,
                          MASK_KIND=mask_kind, HAS_DROPOUT=has_dropout, DOT_PRECISION=dot_precision,
                          KEY_LENGTHS=key_lengths)
        self.has_softcap = has_softcap
        self.dot_precision = dot_precision
        # A tile that did not fit is remembered for kernels compiled alike on a device alike.
        self.shrink_key = (q.device.type, q.device.index, cc, q.dtype, tuple(sorted(self.flags.items())))
        # The Hopper paths (copy-engine loads, warp specialisation) need sm_90; the interpreter runs the
        # descriptor loads too, so CPU tests cover them.
        self.hopper = INTERPRET or (cc is not None and cc[0] >= 9)
        self.warp_specialize_ok = cc is not None and cc[0] >= 9
        # The stride half of the descriptor check (the plan is per strides); the addresses are checked per call.
        self.descriptor_strides_ok = self.hopper and _descriptor_strides_ok(q, k, v)
        self.device_index = q.device.index if q.device.index is not None else 0
        # The GPU the launches must run on (None: CPU tensors under the interpreter), see _on_device.
        self.cuda_index = self.device_index if q.device.type == "cuda" else None
        self.out_layout = layouts.rows_major_layout(self.batch, self.heads_q, self.seqlen_q, self.head_dim_v)
        # (shape, strides) of the per-row float32 buffers (lse, delta): contiguous (B, Hq, Nq).
        rows_shape = (self.batch, self.heads_q, self.seqlen_q)
        self.rows_layout = (rows_shape, layouts.contiguous_strides(rows_shape))
        # The backward's delta and lse2: the same with each row padded to 4 floats (16 bytes), so that the Hopper
        # backward's copy engine can read them.
        padded = -(-self.seqlen_q // 4) * 4
        self.padded_rows_layout = (rows_shape, (self.heads_q * padded, padded, 1))
        # Whether q, k, v are dense, for their gradient buffers (layouts.grad_buffer).
        self.dense = (layouts.is_dense(q), layouts.is_dense(k), layouts.is_dense(v))
        self._constexpr_sets: dict = {}
        self.lse_scratch = None  # where forwards whose lse nobody reads write it (layouts.scratch_rows), made once
        # The short backward's tile (configs.short_backward_tile; None: the keys do not fit one block, or the tile ran
        # out of resources here once).
        self.short_backward_tile = configs.short_backward_tile(self.seqlen_k, self.block_d, self.block_dv,
                                                               q.element_size(), INTERPRET)

    def descriptors_ok(self, q, k, v) -> bool:
        """Whether this call's q, k, v can be read through descriptors (the Hopper paths): the plan's strides and
        the call's addresses."""
        return self.descriptor_strides_ok and _addresses_aligned(q, k, v)

    def output_buffers(self, q, keep_lse: bool = True):
        """(out, lse) of a forward, uninitialised: out (B, Hq, Nq, Dv) in q's dtype rows-major as
        layouts.output_buffer lays it out, lse (B, Hq, Nq) float32 contiguous (layouts.lse_buffer's). keep_lse False:
        the lse is this plan's scratch (layouts.scratch_rows), for a forward whose lse nobody reads."""
        out = torch.empty_strided(*self.out_layout, dtype=q.dtype, device=q.device)
        if keep_lse:
            return out, torch.empty_strided(*self.rows_layout, dtype=torch.float32, device=q.device)
        if self.lse_scratch is None:
            self.lse_scratch = layouts.scratch_rows(q.device, self.rows_layout[0])
        return out, self.lse_scratch

    def backward_scratch(self, device, sums_words: int) -> tuple:
        """(delta, lse2, sums) of a backward from one float32 allocation: delta and lse2 in padded_rows_layout, then
        ``sums_words`` words for the Hopper backward's dQ sums and counters (None when 0). Every part starts on a
        16-byte boundary (the rows are padded to 4 floats), as the copy engine reads them."""
        shape, strides = self.padded_rows_layout
        rows = self.batch * strides[0]
        scratch = torch.empty(2 * rows + sums_words, dtype=torch.float32, device=device)
        return (scratch.as_strided(shape, strides, 0), scratch.as_strided(shape, strides, rows),
                scratch[2 * rows:] if sums_words else None)

    def constexprs(self, launcher: CompiledLauncher, tile: configs.KernelConfig, **kwargs):
        """The launcher's compile-time argument set for ``tile`` and ``kwargs`` (with this plan's flags), made
        once per plan: the hot path builds no dict."""
        key = (launcher.name, tile, tuple(kwargs.items()))
        found = self._constexpr_sets.get(key)
        if found is None:
            found = self._constexpr_sets[key] = launcher.constexprs(
                tile.num_warps, tile.num_stages, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, **self.flags, **kwargs)
        return found


class _Signature:
    """What a call signature (q, k, v shapes and strides, dtype, device, the mask's layout, the params' numbers)
    gives the kernels besides the tensors, worked out once per signature (see :func:`_signature_for`): the
    plan, the mask's kind and strides, the scale, softcap and dropout scalars and the band's ints; and the
    launches prepared for it (launcher.PreparedLaunch), keyed by what their other arguments come from."""

    def __init__(self, q, k, v, params: AttentionParams):
        mask = params.mask
        # A bool mask shared by heads and query rows (key padding): per-batch key bounds (key_padding.py), and the
        # kernels read one row of it per key block (scores.MASK_KEYS); a float mask shared by them (a key-padding
        # bias) one row per key block too (scores.MASK_KEYS_FLOAT), unless its gradient is asked for (the dQ kernel
        # then writes the gradient of every (row, key) entry).
        self.key_lengths = k.shape[2] > 0 and key_padding.applies(mask)
        if mask is None:
            mask_kind, mask_strides = 0, (0, 0, 0, 0)
        else:
            if mask.dtype == torch.bool:
                mask_kind = 3 if self.key_lengths else 1
            else:
                row_bias = key_padding.shared_by_heads_and_rows(mask) and not params.mask_requires_grad
                mask_kind = 4 if row_bias else 2
            mask_strides = _mask_strides(mask)
        has_dropout = params.dropout_p > 0.0
        self.has_dropout = has_dropout
        # Whether the forward runs on the split-KV decoding kernels (decode_launch.eligible, of the key's values).
        self.decode = k.shape[2] > 0 and decode_launch.eligible(q, k, params)
        self.checked = False  # whether _check_inputs passed for these shapes and strides (dense calls)
        self.sites: dict = {}
        # The FlashAttention-2 forward of a repeated call, per whether the call's addresses suit descriptors (index
        # False / True): made by the first call of a signature whose only tensors are q, k, v and the outputs.
        self.repeated_forwards = [None, None]
        # The FlashAttention-2 backward of a repeated call of a plain signature (_RepeatedBackward), by what its
        # launches' other arguments come from besides the signature (see TritonBackend._backward_key).
        self.repeated_backwards: dict = {}
        # The Gluon Hopper forward of this signature (hopper_launch.ForwardLaunch), made by its first call that ran it.
        self.hopper_forward = None
        # ... and its build that takes each sequence's first key (a left-padding key mask: key_padding.SPAN).
        self.hopper_forward_spans = None
        self.plain = mask is None and not has_dropout
        plan = self.plan = _plan_for(q, k, v, mask_kind, params.window_left is not None, params.window_right is not None,
                         params.softcap is not None, has_dropout, self.key_lengths)
        sm_scale = float(params.scale)
        if params.softcap is not None:
            softcap_in2, softcap_out2 = 2.0 * LOG2E * sm_scale / params.softcap, params.softcap * LOG2E
        else:
            softcap_in2 = softcap_out2 = 0.0
        if has_dropout:
            dropout_scale = 1.0 / (1.0 - params.dropout_p)
            threshold = _as_int32(dropout_rng.threshold(params.dropout_p))
        else:
            dropout_scale, threshold = 1.0, 0
        # What every _Launch of this signature starts from (copied in one step, see _Launch).
        self.shared = dict(plan=plan, mask_strides=mask_strides, sm_scale=sm_scale, qk_scale2=sm_scale * LOG2E,
                           softcap_in2=softcap_in2, softcap_out2=softcap_out2, dropout_scale=dropout_scale,
                           threshold=threshold, diag_offset=int(params.diag_offset),
                           window_left=int(params.window_left or 0), window_right=int(params.window_right or 0))


_signatures: dict = {}
_SIGNATURES_LIMIT = 1024


def _signature_for(q, k, v, params: AttentionParams, dense: bool, names: tuple = ("q", "k", "v")) -> _Signature:
    """The cached :class:`_Signature` of a call. ``dense``: q, k, v are the call's own tensors (``names`` in error
    messages), checked with :func:`_check_inputs` the first time their shapes and strides come (the key holds
    everything it reads)."""
    mask = params.mask
    # (whether a float mask's gradient is asked for decides how the kernels read it: _Signature)
    mask_key = None if mask is None else (mask.dtype, mask.shape, mask.stride(), params.mask_requires_grad)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, _dot_precision(q.dtype),
           configs.pinned(), mask_key, params.scale, params.diag_offset, params.window_left, params.window_right,
           params.dropout_p, params.softcap)
    try:
        found = _signatures[key]
    except KeyError:
        found = None
    if found is None or (dense and not found.checked):
        if dense:
            _check_inputs(**dict(zip(names, (q, k, v))))
        if found is None:
            found = put_bounded(_signatures, key, _Signature(q, k, v, params), _SIGNATURES_LIMIT)
        found.checked = found.checked or dense
    return found


class _Launch:
    """One call: its signature's plan and scalars (plan, mask_strides, sm_scale, qk_scale2, softcap_in2,
    softcap_out2, dropout_scale, threshold, diag_offset, window_left, window_right) and what varies per call:
    the mask as the kernels read it, the key bounds, the seed tensor, whether the addresses suit descriptors."""

    def __init__(self, q, k, v, params: AttentionParams, dense: bool = False, signature: Optional[_Signature] = None):
        signature = self.signature = signature or _signature_for(q, k, v, params, dense)
        self.__dict__.update(signature.shared)
        mask = params.mask
        if mask is None:
            self.mask = q
        else:
            self.mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        self.key_bounds = key_padding.key_bounds(mask) if signature.key_lengths else None
        # The kernels read the seed words from memory (int32 words of the int64 seed tensor).
        self.seed = dropout_rng.seed_tensor(params.seed, q.device).view(torch.int32) if signature.has_dropout else q
        self.band = (self.diag_offset, self.window_left, self.window_right, self.seed, self.threshold)
        # The Hopper paths (copy-engine loads) need every tensor the kernels read through descriptors aligned.
        self.tma_ok = self.plan.descriptors_ok(q, k, v)

    def key_padding_kind(self) -> str:
        """What the call's key-padding mask is (key_padding.padding_kind: right padding, which the key bounds say in
        full; one run of keys per sequence, which they say with each sequence's first key; or neither). The Gluon
        kernels then read no mask. One read-back per mask (kept), asked only where they could run."""
        return key_padding.padding_kind(self.mask, self.key_bounds)[0]

    def key_spans(self):
        """The (2B,) int32 bounds and first keys of a key-padding mask that is one run of keys per sequence, some
        starting past the first key (key_padding.SPAN); None for any other call."""
        if self.key_bounds is None:
            return None
        return key_padding.padding_kind(self.mask, self.key_bounds)[1]

    def key_bounds_or(self, placeholder):
        """The key bounds tensor for the kernels' CuSeqlensK argument, or a placeholder when unused."""
        return placeholder if self.key_bounds is None else self.key_bounds

    def tma(self, tile: configs.KernelConfig, *query_side) -> bool:
        """TMA for a launch of ``tile``: on only where the tile asks for it and this call can have it (sm_90, and
        every tensor the kernel reads through descriptors suitably aligned); installs the descriptors' scratch
        allocator when on."""
        tma = tile.tma and self.tma_ok and (not query_side or _descriptor_ready(*query_side))
        if tma:
            _ensure_descriptor_allocator()
        return tma

    def hopper_flags(self, tile: configs.KernelConfig, *query_side) -> dict:
        """TMA / WARP_SPECIALIZE for a launch of ``tile`` (see :meth:`tma`)."""
        return dict(TMA=self.tma(tile, *query_side),
                    WARP_SPECIALIZE=tile.warp_specialize and self.plan.warp_specialize_ok)


_plans: dict = {}
_PLANS_LIMIT = 1024


def _plan_for(q, k, v, mask_kind, has_left, has_right, has_softcap, has_dropout, key_lengths=False) -> _Plan:
    """The cached plan of a call signature (shapes, dtype, device, flags, the pinned configuration)."""
    dot_precision = _dot_precision(q.dtype)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape[3], v.stride(), q.dtype, q.device, mask_kind, has_left,
           has_right, has_softcap, has_dropout, key_lengths, dot_precision, configs.pinned())
    plan = _plans.get(key)
    if plan is None:
        plan = put_bounded(_plans, key, _Plan(q, k, v, mask_kind, has_left, has_right, has_softcap, has_dropout,
                                              dot_precision, key_lengths), _PLANS_LIMIT)
    return plan


def _descriptor_ready(*tensors) -> bool:
    """True when every (B, H, N, D) tensor can be read through per-head tensor descriptors: the copy
    engine needs a 16-byte aligned start for every head and a row stride that is a non-zero multiple
    of 16 bytes (views of a packed QKV projection usually are; a broadcast or odd-strided one falls back
    to pointer loads)."""
    return _descriptor_strides_ok(*tensors) and _addresses_aligned(*tensors)


def _descriptor_strides_ok(*tensors) -> bool:
    """The stride half of :func:`_descriptor_ready`."""
    for t in tensors:
        size = t.element_size()
        if t.stride(2) < t.shape[3] or any((stride * size) % 16 for stride in t.stride()[:3]):
            return False
        if (t.stride(0) == 0 and t.shape[0] > 1) or (t.stride(1) == 0 and t.shape[1] > 1):
            return False  # a broadcast batch or head: the Hopper kernels' 4-D tensor maps take none
    return True


def _addresses_aligned(*tensors) -> bool:
    """The address half of :func:`_descriptor_ready`: every tensor starts on a 16-byte boundary."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
    return True


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if not INTERPRET else "cpu")


_ALLOCATION = []


def _ensure_descriptor_allocator():
    """Tensor descriptors made inside a kernel live in a little global scratch memory per program, which
    Triton takes from the allocator given to ``triton.set_allocator``. Install one made of torch
    allocations (stream-ordered by torch's caching allocator) unless the caller has set their own. Checked
    at every launch: the allocator is a context variable, unset in a new thread."""
    if not _ALLOCATION:
        from triton.runtime import _allocation

        _ALLOCATION.append(_allocation)
    allocation = _ALLOCATION[0]
    if isinstance(allocation._allocator.get(), allocation.NullAllocator):
        import triton

        triton.set_allocator(_torch_scratch)


def _as_int32(word) -> int:
    """A 32-bit word as the int32 with the same bits: seeds and the dropout threshold reach the kernels
    as int32 (one argument type, one compilation) and are bitcast back to uint32 there."""
    word = int(word) & dropout_rng.MASK32
    return word - (1 << 32) if word >= (1 << 31) else word


# Tiles that ran out of shared memory or registers, and what replaced them:
# (kernel, tile, plan.shrink_key: device, compute capability, dtype, compile-time flags) -> tile.
_shrunk: dict = {}


def _run(kernel_name: str, tile: configs.KernelConfig, key, launch):
    """launch(tile) with the configured tile; on Triton's OutOfResources, retry with smaller tiles and
    remember the one that fitted for this (kernel, tile, key)."""
    cache_key = (kernel_name, tile, key)
    if _shrunk:  # none in the usual case: no key hashed per call
        tile = _shrunk.get(cache_key, tile)
    while True:
        try:
            launch(tile)
        except Exception as error:
            from triton.runtime.errors import OutOfResources

            if not isinstance(error, OutOfResources):
                raise
            smaller = configs.shrink(tile)
            if smaller is None:
                raise
            tile = smaller
            _shrunk[cache_key] = tile
            continue
        return


def _launch_site(signature: _Signature, key: tuple, launcher: CompiledLauncher, tensors: tuple, last: tuple,
                 prepare) -> tuple:
    """Launch ``launcher`` with the arguments ``tensors + middle + last`` through the launch prepared for ``key``
    on this call's signature. ``key`` holds everything ``prepare`` reads besides the signature (tile, flags,
    the strides of tensors the signature does not fix); ``prepare() -> (grid, middle, constexprs)`` runs the
    first time, ``middle`` being the arguments between the tensors and ``last`` (strides, sizes, scalars).
    Returns the site: (the PreparedLaunch, middle)."""
    site = signature.sites.get(key)
    if site is None:
        grid, middle, constexprs = prepare()
        prepared = launcher.prepare(grid, tensors + middle + last, constexprs, signature.plan.device_index)
        site = signature.sites[key] = (prepared, middle)
    prepared, middle = site
    prepared.launch(tensors + middle + last)
    return site


def _on_device(cuda_index: Optional[int], launch, args: tuple) -> None:
    """``launch(args)`` with GPU ``cuda_index`` current (Triton launches on the current device); None: CPU tensors
    (the interpreter). The device is switched only where another one is current (a comparison per call)."""
    if cuda_index is None or _CURRENT_DEVICE() == cuda_index:
        launch(args)
        return
    with torch.cuda.device(cuda_index):
        launch(args)


class _OnDevice:
    """Make q's GPU the current one for the launches inside the block (see _on_device)."""

    def __init__(self, device: torch.device):
        self.guard = None
        if device.type == "cuda" and device.index is not None and device.index != _CURRENT_DEVICE():
            self.guard = torch.cuda.device(device.index)

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


def _forward_tensors(q, k, v, out, lse, mask, key_bounds) -> tuple:
    """The FlashAttention-2 forward's leading tensor arguments (forward.py's order)."""
    return q, k, v, out, lse, mask, lse, key_bounds


def _dkdv_tensors(q, k, v, grad_out, lse2, delta, dk, dv, dq_acc, mask, key_bounds) -> tuple:
    """The dK/dV kernel's leading tensor arguments (backward.py's order; delta holds the place of the packed
    sequences' query offsets, which a dense call does not read)."""
    return q, k, v, grad_out, lse2, delta, dk, dv, dq_acc, mask, delta, key_bounds


def _dq_tensors(q, k, v, grad_out, lse2, delta, dq, mask, dmask, key_bounds) -> tuple:
    """The dQ kernel's leading tensor arguments (backward.py's order; delta holds the place of the packed sequences'
    query offsets, as in _dkdv_tensors)."""
    return q, k, v, grad_out, lse2, delta, dq, mask, dmask, delta, key_bounds


def _short_tensors(q, k, v, out, grad_out, lse, dq, dk, dv, mask, key_bounds) -> tuple:
    """The short backward's leading tensor arguments (backward.backward_short_kernel's order)."""
    return q, k, v, out, grad_out, lse, dq, dk, dv, mask, key_bounds


class _RepeatedForward:
    """The FlashAttention-2 forward of a plain signature (no mask, no dropout: q, k, v and the outputs are its only
    tensors) as its first call launched it: the prepared launch of the tile that ran and the arguments between the
    tensors, the GPU to launch on, whether the tile reads through descriptors. A repeated call allocates its outputs
    and launches; the per-call checks stay: the tensors' dtypes and address alignment (PreparedLaunch picks the
    compiled kernel by them), the current device, launch hooks, a tile out of resources. Holds what
    hopper_launch.why_not reads of a call (window_right, tma_ok, qk_scale2), so it stands for one there."""

    __slots__ = ("site", "middle", "descriptors", "cuda_index", "window_right", "tma_ok", "qk_scale2")

    def __init__(self, site: tuple, descriptors: bool, plan: _Plan, run: _Launch):
        self.site, self.middle = site
        self.descriptors, self.cuda_index = descriptors, plan.cuda_index
        self.window_right, self.tma_ok, self.qk_scale2 = run.window_right, run.tma_ok, run.qk_scale2

    def launch(self, q, k, v, out, lse) -> bool:
        """Launch into ``out`` and ``lse``; False where a new specialisation of the tile ran out of resources (the
        full path then shrinks it)."""
        if self.descriptors:
            _ensure_descriptor_allocator()
        # The mask, key bounds and seed places hold placeholders, as _Launch has them without a mask or dropout.
        args = _forward_tensors(q, k, v, out, lse, q, lse) + self.middle + (q, 0)
        try:
            _on_device(self.cuda_index, self.site.launch, args)
        except Exception as error:
            from triton.runtime.errors import OutOfResources

            if not isinstance(error, OutOfResources):
                raise
            return False
        return True


class _RepeatedLaunches:
    """A repeated backward of a plain signature (the Gluon one also of a key-padded signature: _RepeatedHopperBackward):
    what hopper_launch.why_not reads of a call (window_right, qk_scale2, tma_ok), so that it stands for one there, and
    the GPU its first call ran on. ``launch`` allocates the gradients and hands them to the subclass's ``_launch``;
    None where the launches could not run here (another current GPU, a new specialisation out of resources): the
    caller takes the full path."""

    __slots__ = ("cuda_index", "window_right", "tma_ok", "qk_scale2")
    hopper = False  # whether it launches the Gluon Hopper backward

    def __init__(self, plan: _Plan, run: _Launch):
        self.cuda_index = plan.cuda_index
        self.window_right, self.tma_ok, self.qk_scale2 = run.window_right, run.tma_ok, run.qk_scale2

    def launch(self, grad_out, q, k, v, out, lse, plan: _Plan, key_bounds=None):
        """(dq, dk, dv), or None where the launches could not run here. key_bounds: a key-padded call's bounds (or
        spans: key_padding.padding_kind), for the Gluon backward."""
        if self.cuda_index is not None and _CURRENT_DEVICE() != self.cuda_index:
            return None
        dense_q, dense_k, dense_v = plan.dense
        dq, dk, dv = layouts.grad_buffer(q, dense_q), layouts.grad_buffer(k, dense_k), layouts.grad_buffer(v, dense_v)
        try:
            self._launch(grad_out, q, k, v, out, lse, plan, dq, dk, dv, key_bounds)
        except Exception as error:
            from triton.runtime.errors import OutOfResources

            if not isinstance(error, OutOfResources):
                raise
            return None
        return dq, dk, dv

    def _launch(self, grad_out, q, k, v, out, lse, plan: _Plan, dq, dk, dv, key_bounds=None) -> None:
        raise NotImplementedError


class _RepeatedBackward(_RepeatedLaunches):
    """The FlashAttention-2 backward of a plain signature (no mask, no dropout, no lse gradient) as its first call with
    these strides and settings launched it (TritonBackend._backward_key): the prepared launches of the preprocess, the
    dK/dV kernel and (dQ from its own kernel) the dQ kernel with the arguments between their tensors, the dQ mode, and
    what hopper_launch.why_not reads of a call (window_right, qk_scale2, tma_ok), so that it stands for one there. A
    repeated backward allocates its gradients and scratch and launches; a call the Gluon backward now takes (its switch
    is read at every call), a new specialisation that runs out of resources or another current GPU take the full
    path."""

    __slots__ = ("preprocess", "dkdv", "dq", "dq_mode", "descriptors")

    def __init__(self, sites: tuple, dq_mode: int, descriptors: bool, plan: _Plan, run: _Launch):
        super().__init__(plan, run)
        self.preprocess, self.dkdv, self.dq = sites
        self.dq_mode, self.descriptors = dq_mode, descriptors

    def _launch(self, grad_out, q, k, v, out, lse, plan: _Plan, dq, dk, dv, key_bounds=None) -> None:
        delta, lse2, _ = plan.backward_scratch(q.device, 0)
        dq_acc = (torch.zeros(plan.batch, plan.heads_q, plan.seqlen_q, plan.head_dim, dtype=torch.float32,
                              device=q.device) if self.dq_mode else delta)
        if self.descriptors:
            _ensure_descriptor_allocator()
        # The mask, seed, dS and key-bound places hold placeholders, as _Launch has them without a mask or dropout.
        prepared, middle = self.preprocess
        prepared.launch((out, grad_out, lse, lse, delta, lse2, delta) + middle)
        prepared, middle = self.dkdv
        prepared.launch(_dkdv_tensors(q, k, v, grad_out, lse2, delta, dk, dv, dq_acc, q, delta) + middle + (q, 0))
        if self.dq is None:
            dq.copy_(dq_acc)
        else:
            prepared, middle = self.dq
            prepared.launch(_dq_tensors(q, k, v, grad_out, lse2, delta, dq, q, delta, delta) + middle + (q, 0))


class _RepeatedShortBackward(_RepeatedLaunches):
    """The short backward (backward.backward_short_kernel) of a plain signature as its first call launched it: the
    prepared launch and the arguments between its tensors. A repeated backward allocates its gradients and launches
    once."""

    __slots__ = ("site",)

    def __init__(self, site: tuple, plan: _Plan, run: _Launch):
        super().__init__(plan, run)
        self.site = site

    def _launch(self, grad_out, q, k, v, out, lse, plan: _Plan, dq, dk, dv, key_bounds=None) -> None:
        prepared, middle = self.site
        # The mask, key-bound and seed places hold placeholders, as _Launch has them without a mask or dropout.
        prepared.launch(_short_tensors(q, k, v, out, grad_out, lse, dq, dk, dv, q, lse) + middle + (q, 0))


class _RepeatedHopperBackward(_RepeatedLaunches):
    """The Gluon Hopper backward of a plain signature (or of a key-padded one, per padding kind: each call passes its
    mask's kept bounds or spans), run as one launch, as its first call with these strides and settings launched it:
    the preprocess's prepared launch (which zeroes the dQ sums and counters beside delta and lse2) and the backward's
    site (hopper_launch.BackwardSite). A repeated backward allocates its gradients and scratch and launches the two."""

    __slots__ = ("preprocess", "site", "sums_words")
    hopper = True

    def __init__(self, preprocess: tuple, site: hopper_launch.BackwardSite, sums_words: int, plan: _Plan,
                 run: _Launch):
        super().__init__(plan, run)
        self.preprocess, self.site, self.sums_words = preprocess, site, sums_words

    def _launch(self, grad_out, q, k, v, out, lse, plan: _Plan, dq, dk, dv, key_bounds=None) -> None:
        delta, lse2, sums = plan.backward_scratch(q.device, self.sums_words)
        prepared, middle = self.preprocess
        prepared.launch((out, grad_out, lse, lse, delta, lse2, sums) + middle)
        self.site.launch(q, k, v, grad_out, lse2, delta, dq, dk, dv, sums, key_bounds)


class _PreparedOutputOnly:
    """The output-only forward (OutputOnlyForward._output_only) for the calls of one front-end call signature without a
    mask (TritonBackend.native_call): the backend's signature of the first such call is kept, so a repeated call skips
    working out its key, which the front end's key already fixes (shapes, strides, dtype, device, params). Two settings
    the front end's key leaves out are checked at every call, a pinned tile configuration and (float32) torch's matmul
    precision: where either differs from the kept signature's, the call takes the backend's own path."""

    __slots__ = ("backend", "signature", "pinned", "precision")

    def __init__(self, backend: "TritonBackend", signature: _Signature, dtype: torch.dtype):
        self.backend, self.signature = backend, signature
        self.pinned, self.precision = configs.pinned(), _dot_precision(dtype)

    def __call__(self, q, k, v, params: AttentionParams):
        if configs.pinned() is not self.pinned or _dot_precision(q.dtype) != self.precision:
            return self.backend._output_only(q, k, v, params)
        return self.backend._forward_signed(self.signature, q, k, v, params, False)[0]


def _conditions(problem) -> str:
    """What explain adds to a Gluon kernel's path for what the Problem does not hold: a window's bounds (the Gluon
    kernels take a left bound only) and a boolean mask's values (they take one run of keys per sequence, as first keys
    and counts)."""
    text = ""
    if "window" in problem.features:
        text += ", the window's right bound is the causal diagonal or none"
    if "bool_mask" in problem.features:
        text += (", and the boolean mask is one run of keys per sequence (right or left padding: True exactly on keys "
                 "[first, last] of each, the same for every head and query; read back once per mask); other boolean "
                 "masks run the FlashAttention-2 kernels")
    return text


def _group_split(problem, deterministic: bool) -> str:
    """What explain adds to the Gluon backward's path where GQA's query heads are split over programs
    (hopper_launch.group_parts)."""
    group = problem.heads_q // max(problem.heads_kv, 1)
    if group == 1 or problem.device_type != "cuda":
        return ""
    features = problem.features
    parts = hopper_launch.group_parts(problem.batch, problem.heads_kv, group, problem.seqlen_k, problem.head_dim,
                                      "causal" in features and "window" not in features, deterministic,
                                      problem.device_index)
    if parts == 1:
        return ""
    return (f"; each key/value head's {group} query heads split over {parts} programs a key block, which add "
            "float32 partial dK and dV")


class TritonBackend(OutputOnlyForward):
    """FlashAttention-2 forward and backward written in Triton (see forward.py and backward.py)."""

    name = "triton"
    description = "FlashAttention-2 in Triton" + (
        " (TRITON_INTERPRET=1: Triton's interpreter, CPU tensors)" if INTERPRET else "")
    capabilities = Capabilities(
        device_types=frozenset({"cuda", "cpu"}) if INTERPRET else frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        min_head_dim=1,
        max_head_dim=MAX_HEAD_DIM,
        min_compute_capability=(8, 0),
        features=frozenset(FEATURES),
        operations=frozenset(OPERATIONS),
    )

    def __init__(self, deterministic: Optional[bool] = None):
        self._unavailable: Optional[list] = None
        # deterministic: True = dQ from its own kernel (bitwise reproducible), or in the Gluon Hopper backward added
        # in a fixed order; False = dQ summed with atomics inside the dK/dV kernel where the configuration asks for
        # it, and in any order in the Gluon backward; None (default) = deterministic when
        # torch.use_deterministic_algorithms(True) is on.
        self.deterministic = deterministic

    def _deterministic(self) -> bool:
        if self.deterministic is None:
            return torch.are_deterministic_algorithms_enabled()
        return self.deterministic

    def _dq_mode(self, run: "_Launch", mask_grad: bool) -> int:
        """0: the separate dQ kernel; 1: atomics; 2: the copy engine's bulk reduce-add (see configs.DQ_MODES).
        The mask gradient needs dS, which only the dQ kernel writes; a deterministic backward needs the dQ kernel."""
        mode = run.plan.config.dq_mode
        if mode == "separate" or mask_grad or self._deterministic():
            return 0
        # The bulk reduce-add needs descriptors (sm_90, aligned rows) and a real GPU (the interpreter has no
        # reduce-add through descriptors); float32 rows of D elements are 16-byte multiples when D % 4 == 0.
        if mode == "tma" and run.tma_ok and not INTERPRET and run.plan.head_dim % 4 == 0:
            _ensure_descriptor_allocator()  # the dQ buffer's descriptor, whatever the tiles' own switches
            return 2
        return 1

    # ---- availability -------------------------------------------------------------------------
    def unavailable(self) -> list:
        if self._unavailable is None:
            reasons = []
            if importlib.util.find_spec("triton") is None:
                reasons.append("the triton package is not installed (pip install 'mhattn[triton]')")
            elif not INTERPRET and not torch.cuda.is_available():
                reasons.append("no CUDA GPU is visible (with TRITON_INTERPRET=1 set before import, the kernels run "
                               "on CPU tensors through Triton's interpreter)")
            self._unavailable = reasons
        return list(self._unavailable)

    def unsupported(self, problem) -> list:
        reasons = [r for r in super().unsupported(problem) if not r.startswith("supports head dims")]
        for what, dim in (("head dim", problem.head_dim), ("value head dim", problem.head_dim_v)):
            if dim > MAX_HEAD_DIM:
                reasons.append(f"{what} {dim} > {MAX_HEAD_DIM}")
            elif dim < 1:
                reasons.append(f"{what} {dim} < 1")
        if problem.device_type == "cpu" and problem.dtype == torch.bfloat16:
            reasons.append("bfloat16 on CPU tensors: Triton's interpreter computes bfloat16 wrongly "
                           "(use float16 or float32)")
        blocks_q = problem.batch * problem.heads_q * math.ceil(problem.seqlen_q / 16)
        blocks_k = problem.batch * problem.heads_kv * math.ceil(problem.seqlen_k / 16)
        if max(blocks_q, blocks_k) > MAX_GRID:
            reasons.append(f"batch * heads * sequence blocks ({max(blocks_q, blocks_k)}) exceeds the grid limit "
                           f"{MAX_GRID}")
        return reasons

    def forward_path(self, problem) -> Optional[str]:
        if problem.operation != "attention":
            return None
        rows = problem.seqlen_q * (problem.heads_q // max(problem.heads_kv, 1))
        if 0 < rows <= decode_launch.DECODE_MAX_ROWS and problem.seqlen_k > 0 and "dropout" not in problem.features:
            split_kv = "the split-KV decoding kernels (decode.py): few query rows per key/value head"
            if not problem.features & {"bool_mask", "float_mask"}:
                return split_kv
            if "mask_grad" not in problem.features:
                return (split_kv + ", reading the mask a key block at a time (a key-padding mask (B, 1, 1, Nk) one row "
                        "for all the block's rows; a speculative step's mask or a per-head bias each row's own)")
        reason = hopper_launch.why_not_problem(problem)
        if reason is None:
            return ("the Gluon Hopper forward (hopper_forward.py), when q, k, v rows are 16-byte aligned"
                    + _conditions(problem))
        return f"the FlashAttention-2 forward (forward.py): not the Gluon Hopper forward because {reason}"

    def backward_path(self, problem) -> Optional[str]:
        if problem.operation != "attention":
            return None
        deterministic = self._deterministic()
        reason = hopper_launch.why_not_problem(problem, hopper_launch.backward_min_keys(deterministic))
        if reason is None:
            order = ", dQ's shares added in a fixed order (deterministic)" if deterministic else ""
            return ("the Gluon Hopper backward (hopper_backward.py), when q, k, v and the output gradient rows are "
                    "16-byte aligned" + _conditions(problem) + order + _group_split(problem, deterministic))
        tile = configs.short_backward_tile(problem.seqlen_k, configs.padded_head_dim(problem.head_dim),
                                           configs.padded_head_dim(problem.head_dim_v),
                                           problem.dtype.itemsize, INTERPRET)
        if tile is not None and configs.pinned() is None and "mask_grad" not in problem.features:
            return (f"the short backward in one launch (backward.py, backward_short_kernel): all {problem.seqlen_k} "
                    f"keys in one block of {tile.block_n}, unless the lse gets a gradient (then the three kernels of "
                    f"the FlashAttention-2 backward); not the Gluon Hopper backward because {reason}")
        return f"the FlashAttention-2 backward (backward.py): not the Gluon Hopper backward because {reason}"

    def native_call(self, q, k, v, params: AttentionParams):
        """For calls that autograd does not track and that return no lse (OutputOnlyForward.native_call): a decoding
        step of 16-bit inputs (the split-KV kernels) keeps its first call's launches, so a repeated step passes only
        its tensors (decode_launch.PreparedSplitStep); other calls, the forward's output alone."""
        if tracked_by_autograd(q, k, v, params):
            return None
        if q.dtype in (torch.float16, torch.bfloat16) and k.shape[2] > 0 and decode_launch.eligible(q, k, params):
            return decode_launch.PreparedSplitStep(params, None, False, False, cache=False).output
        if params.mask is None:
            return _PreparedOutputOnly(self, _signature_for(q, k, v, params, dense=True), q.dtype)
        return self._output_only

    # ---- forward ------------------------------------------------------------------------------
    def _forward(self, q, k, v, params: AttentionParams, keep_lse: bool):
        """(out, lse) of the forward; keep_lse False: lse is the plan's scratch (_Plan.output_buffers), for a caller
        that drops it."""
        return self._forward_signed(_signature_for(q, k, v, params, dense=True), q, k, v, params, keep_lse)

    def _forward_signed(self, signature: _Signature, q, k, v, params: AttentionParams, keep_lse: bool):
        """_forward of a call whose signature is ``signature``."""
        # Decoding (few query rows per key/value head): the split-KV kernels (decode.py, decode_launch.py),
        # which allocate their own outputs.
        if signature.decode:
            return decode_launch.split_kv_forward(q, k, v, params, signature=signature, keep_lse=keep_lse)
        plan = signature.plan
        # The Hopper paths need every tensor read through descriptors aligned: the plan holds the strides' half.
        tma_ok = plan.descriptors_ok(q, k, v)
        # A repeated call that the Gluon Hopper forward takes launches what its signature's first such call prepared
        # (not with dropout: each call has its own seed).
        hopper = signature.hopper_forward
        if (tma_ok and hopper is not None and not plan.key_lengths and not plan.has_dropout and hopper.current(plan)
                and hopper_launch.why_not(plan, hopper) is None):
            out, lse = plan.output_buffers(q, keep_lse)
            _on_device(plan.cuda_index, hopper.launch, (q, k, v, out, lse))
            return out, lse
        if tma_ok and plan.key_lengths and not plan.has_dropout and (hopper is not None
                                                                      or signature.hopper_forward_spans is not None):
            ran = self._key_padded_repeat(signature, q, k, v, params, keep_lse)
            if ran is not None:
                return ran
        repeat = signature.repeated_forwards[tma_ok]
        # A repeated call launches what its signature's first call prepared, unless the launchers were replaced
        # since or the Gluon Hopper forward takes this call (its switch and thresholds are read at every call).
        if repeat is not None and repeat.site.launcher is launchers().forward and not (
                plan.sm90 and hopper_launch.why_not(plan, repeat) is None):
            out, lse = plan.output_buffers(q, keep_lse)
            if repeat.launch(q, k, v, out, lse):
                return out, lse
        return self._forward_in_full(q, k, v, params, signature, keep_lse)

    def _key_padded_repeat(self, signature: _Signature, q, k, v, params: AttentionParams, keep_lse: bool):
        """(out, lse) of a repeated call with a key-padding mask that the Gluon forward takes (right padding, or one run
        of keys per sequence: key_padding.padding_kind), through the launch its signature's first such call prepared,
        with the mask's key bounds (and first keys) as kept for it; None where that does not apply (a mask met during
        graph capture, one with holes, a launch not yet prepared), for the full path."""
        plan = signature.plan
        kind, bounds = key_padding.kernel_bounds(params.mask)
        prepared = {key_padding.RIGHT_PADDING: signature.hopper_forward,
                    key_padding.SPAN: signature.hopper_forward_spans}.get(kind)
        if prepared is None or not prepared.current(plan) or hopper_launch.why_not(plan, prepared, padding=kind):
            return None
        out, lse = plan.output_buffers(q, keep_lse)
        with _OnDevice(q.device):
            prepared.launch((q, k, v, out, lse), bounds)
        return out, lse

    def _forward_in_full(self, q, k, v, params: AttentionParams, signature: _Signature, keep_lse: bool):
        """The forward with every step: this call's per-call state (_Launch), the Hopper decision, the tile (shrunk
        where it ran out of resources); leaves a plain signature the launch its repeated calls make."""
        run = _Launch(q, k, v, params, signature=signature)
        plan = run.plan
        out, lse = plan.output_buffers(q, keep_lse)
        if out.numel() == 0 and lse.numel() == 0:
            return out, lse
        if plan.seqlen_k == 0:  # no key at all: every row is empty
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        if plan.sm90 and hopper_launch.why_not(plan, run) is None:
            with _OnDevice(q.device):
                hopper_launch.forward(q, k, v, out, lse, run, plan, plan.device_index)
            return out, lse
        launcher = launchers().forward
        tensors = _forward_tensors(q, k, v, out, lse, run.mask, run.key_bounds_or(lse))
        seed = (run.seed, run.threshold)
        ran = []

        def launch(tile):
            tma = run.tma(tile)

            def prepare():
                num_m_blocks = triton_cdiv(plan.seqlen_q, tile.block_m)
                return (plan.batch * plan.heads_q * num_m_blocks,), (
                    *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out), *run.mask_strides,
                    lse.stride(0), lse.stride(1),
                    plan.heads_q, plan.kv_group, plan.seqlen_q, plan.seqlen_k, num_m_blocks,
                    run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale,
                    run.diag_offset, run.window_left, run.window_right,
                ), plan.constexprs(launcher, tile, HEAVY_FIRST=plan.heavy_first, TMA=tma,
                                   WARP_SPECIALIZE=tile.warp_specialize and plan.warp_specialize_ok)

            ran.append((_launch_site(signature, (launcher, tile, tma), launcher, tensors, seed, prepare), tma))

        with _OnDevice(q.device):
            _run("forward", plan.config.forward, plan.shrink_key + (run.tma_ok,), launch)
        if signature.plain:
            site, tma = ran[-1]
            signature.repeated_forwards[run.tma_ok] = _RepeatedForward(site, tma, plan, run)
        return out, lse

    # ---- backward -----------------------------------------------------------------------------
    def backward(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None):
        signature = _signature_for(q, k, v, params, dense=True)
        if signature.plan.key_lengths and grad_lse is None and signature.repeated_backwards:
            grads = self._key_padded_backward_repeat(signature, grad_out, q, k, v, out, lse, params)
            if grads is not None:
                return (*grads, None)
        # A repeated backward of a plain signature launches what the first such call prepared (_RepeatedBackward).
        if signature.plain and grad_lse is None and signature.repeated_backwards:
            key = self._backward_key(grad_out, q, k, v, out, lse, signature.plan)
            repeat = signature.repeated_backwards.get(key)
            # The Hopper decision is made again (its switch and a pinned tile may change between calls): a repeat
            # stands for a call only where it launches the kernels this call would.
            if repeat is not None and repeat.hopper == (signature.plan.sm90 and hopper_launch.why_not_backward(
                    signature.plan, repeat, key[-2], key[-1]) is None):
                grads = repeat.launch(grad_out, q, k, v, out, lse, signature.plan)
                if grads is not None:
                    return (*grads, None)
        return self._backward_in_full(grad_out, q, k, v, out, lse, params, grad_lse, signature)

    def _key_padded_backward_repeat(self, signature: _Signature, grad_out, q, k, v, out, lse, params: AttentionParams):
        """(dq, dk, dv) of a repeated backward with a key-padding mask that the Gluon backward takes, through the
        launches its signature's first such call (of the mask's padding kind) prepared, with the mask's kept bounds or
        spans; None where that does not apply (for the full path)."""
        plan = signature.plan
        kind, bounds = key_padding.kernel_bounds(params.mask)
        if kind == key_padding.OTHER:
            return None
        key = self._backward_key(grad_out, q, k, v, out, lse, plan) + (kind, )
        repeat = signature.repeated_backwards.get(key)
        if repeat is None or hopper_launch.why_not_backward(plan, repeat, key[-3], key[-2], padding=kind) is not None:
            return None
        return repeat.launch(grad_out, q, k, v, out, lse, plan, bounds)

    def _backward_key(self, grad_out, q, k, v, out, lse, plan: _Plan) -> tuple:
        """What a plain signature's backward launches read besides the signature: the strides of the output, its
        gradient and the lse (the launches' other arguments), whether q, k, v suit descriptors, and the two per-call
        inputs of the Hopper decision: whether the output gradient suits descriptors, a deterministic backward."""
        return (out.stride(), grad_out.stride(), lse.stride(), plan.descriptors_ok(q, k, v),
                _descriptor_ready(grad_out), self._deterministic())

    def _short_backward(self, run: _Launch, grad_out, q, k, v, out, lse, dq, dk, dv):
        """The backward in one launch (backward.backward_short_kernel) where every key fits one block and the call
        needs no lse or mask gradient: fills and returns (dq, dk, dv), or None where it does not apply (the
        three-kernel path runs). A plain signature keeps the launch for its repeated calls (_RepeatedShortBackward).
        A pinned tile configuration keeps the three kernels it names."""
        plan, signature = run.plan, run.signature
        tile = plan.short_backward_tile
        if tile is None or configs.pinned() is not None or (lse.stride(2) != 1 and plan.seqlen_q > 1):
            return None
        kernel = launchers().short_backward

        def prepare():
            return (plan.batch * plan.heads_kv,), (
                *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out), *_strides4(grad_out),
                *_strides4(dq), *_strides4(dk), *_strides4(dv), *run.mask_strides, lse.stride(0), lse.stride(1),
                plan.heads_q, plan.heads_kv, plan.kv_group, plan.seqlen_q, plan.seqlen_k,
                run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale, run.sm_scale,
                run.diag_offset, run.window_left, run.window_right,
            ), plan.constexprs(kernel, tile)

        tensors = _short_tensors(q, k, v, out, grad_out, lse, dq, dk, dv, run.mask, run.key_bounds_or(lse))
        try:
            with _OnDevice(q.device):
                site = _launch_site(signature, (kernel, tile, out.stride(), grad_out.stride(), lse.stride()), kernel,
                                    tensors, (run.seed, run.threshold), prepare)
        except Exception as error:
            from triton.runtime.errors import OutOfResources

            if not isinstance(error, OutOfResources):
                raise
            plan.short_backward_tile = None  # the three-kernel path from now on, for this plan
            return None
        if signature.plain:
            signature.repeated_backwards[self._backward_key(grad_out, q, k, v, out, lse, plan)] = (
                _RepeatedShortBackward(site, plan, run))
        return dq, dk, dv

    def _backward_in_full(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse, signature):
        """The backward with every step: this call's per-call state (_Launch), the Hopper decision, the tiles (shrunk
        where they ran out of resources); leaves a plain signature's FlashAttention-2 backward the launches its
        repeated calls make."""
        run = _Launch(q, k, v, params, signature=signature)
        _check_inputs(out=out)
        if grad_out.stride(-1) != 1 and grad_out.shape[-1] > 1:
            grad_out = grad_out.contiguous()  # a gradient buffer (e.g. expanded by .sum()), not a user input
        kernel = launchers()
        plan = run.plan
        dense_q, dense_k, dense_v = plan.dense
        dq, dk, dv = layouts.grad_buffer(q, dense_q), layouts.grad_buffer(k, dense_k), layouts.grad_buffer(v, dense_v)
        mask_grad = bool(params.mask_requires_grad) and plan.mask_kind == 2
        dmask = None
        if mask_grad:
            # Zeros: tiles outside the causal/window band are never visited and their gradient is 0.
            dmask = torch.zeros(plan.batch, plan.heads_q, plan.seqlen_q, plan.seqlen_k, dtype=torch.float32,
                                device=q.device)
        if plan.seqlen_k == 0 or plan.seqlen_q == 0 or q.numel() == 0:
            dq.zero_(), dk.zero_(), dv.zero_()
            return dq, dk, dv, (dmask.to(params.mask.dtype) if dmask is not None else None)

        deterministic = self._deterministic()
        hopper = plan.sm90 and hopper_launch.why_not_backward(plan, run, _descriptor_ready(grad_out),
                                                              deterministic) is None
        if not hopper and grad_lse is None and not mask_grad:
            grads = self._short_backward(run, grad_out, q, k, v, out, lse, dq, dk, dv)
            if grads is not None:
                return (*grads, None)
        # The Gluon Hopper backward's float32 dQ sums and counters, when it runs as one launch: in the same
        # allocation as delta and lse2, zeroed by the preprocess kernel (hopper_launch.backward).
        sums_words = hopper_launch.backward_sums_words(plan, plan.device_index, deterministic) if hopper else 0
        delta, lse2, sums = plan.backward_scratch(q.device, sums_words)
        dq_mode = 0 if hopper else self._dq_mode(run, mask_grad)
        # dQ summed inside the dK/dV kernel: a zeroed float32 buffer (B, Hq, Nq, D), converted at the end.
        dq_acc = (torch.zeros(plan.batch, plan.heads_q, plan.seqlen_q, plan.head_dim, dtype=torch.float32,
                              device=q.device) if dq_mode else delta)
        grad_lse_arg = grad_lse if grad_lse is not None else lse
        grad_out_strides = grad_out.stride()
        key_bounds = run.key_bounds_or(delta)
        seed = (run.seed, run.threshold)
        with _OnDevice(q.device):
            block_pre = 64

            def prepare_preprocess():
                num_pre_blocks = triton_cdiv(plan.seqlen_q, block_pre)
                programs = plan.batch * plan.heads_q * num_pre_blocks
                zero_block = ZERO_BLOCK if sums_words else 0
                zero_chunk = triton_cdiv(triton_cdiv(sums_words, programs), ZERO_BLOCK) * ZERO_BLOCK
                return (programs,), (
                    *_strides4(out), *_strides4(grad_out),
                    lse.stride(0), lse.stride(1), lse.stride(2),
                    grad_lse_arg.stride(0), grad_lse_arg.stride(1), grad_lse_arg.stride(2),
                    plan.heads_q, plan.seqlen_q, num_pre_blocks, delta.stride(1), sums_words, zero_chunk,
                ), kernel.preprocess.cached_constexprs(4, 1, HEAD_DIM_V=plan.head_dim_v, BLOCK_DV=plan.block_dv,
                                                       BLOCK_M=block_pre, HAS_GRAD_LSE=grad_lse is not None,
                                                       ZERO_BLOCK=zero_block)

            preprocess_site = _launch_site(
                run.signature, (kernel.preprocess, out.stride(), grad_out_strides, lse.stride(),
                                None if grad_lse is None else grad_lse.stride(), sums_words),
                kernel.preprocess, (out, grad_out, lse, grad_lse_arg, delta, lse2, delta if sums is None else sums), (),
                prepare_preprocess)
            ran = {}  # kernel -> (site, descriptors) of the tile that ran last

            def launch_dkdv(tile):
                tma = run.tma(tile, grad_out)

                def prepare():
                    num_n_blocks = triton_cdiv(plan.seqlen_k, tile.block_n)
                    return (plan.batch * plan.heads_kv * num_n_blocks,), (
                        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(grad_out),
                        *_strides4(dk), *_strides4(dv), *run.mask_strides, delta.stride(0), delta.stride(1),
                        plan.heads_q, plan.heads_kv, plan.kv_group, plan.seqlen_q, plan.seqlen_k, num_n_blocks,
                        run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale, run.sm_scale,
                        run.diag_offset, run.window_left, run.window_right,
                    ), plan.constexprs(kernel.dkdv, tile, TMA=tma,
                                       WARP_SPECIALIZE=tile.warp_specialize and plan.warp_specialize_ok,
                                       DQ_MODE=dq_mode)

                ran["dkdv"] = (_launch_site(run.signature, (kernel.dkdv, tile, tma, grad_out_strides, dq_mode),
                                            kernel.dkdv, _dkdv_tensors(q, k, v, grad_out, lse2, delta, dk, dv, dq_acc,
                                                                       run.mask, key_bounds), seed, prepare), tma)

            def launch_dq(tile):
                def prepare():
                    num_m_blocks = triton_cdiv(plan.seqlen_q, tile.block_m)
                    return (plan.batch * plan.heads_q * num_m_blocks,), (
                        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(grad_out), *_strides4(dq),
                        *run.mask_strides, delta.stride(0), delta.stride(1),
                        plan.heads_q, plan.kv_group, plan.seqlen_q, plan.seqlen_k, num_m_blocks,
                        run.qk_scale2, run.softcap_in2, run.softcap_out2, run.dropout_scale, run.sm_scale,
                        run.diag_offset, run.window_left, run.window_right,
                    ), plan.constexprs(kernel.dq, tile, MASK_GRAD=mask_grad, HEAVY_FIRST=plan.heavy_first)

                ran["dq"] = _launch_site(run.signature, (kernel.dq, tile, grad_out_strides, mask_grad), kernel.dq,
                                         _dq_tensors(q, k, v, grad_out, lse2, delta, dq, run.mask,
                                                     dmask if mask_grad else delta, key_bounds), seed, prepare)

            key = plan.shrink_key + (run.tma_ok, dq_mode)
            if hopper:
                hopper_site = hopper_launch.backward(q, k, v, grad_out, lse2, delta, dq, dk, dv, run, plan,
                                                     plan.device_index, sums, deterministic)
            elif dq_mode:
                _run("dkdv", plan.config.dkdv, key, launch_dkdv)
                dq.copy_(dq_acc)
            else:
                _run("dkdv", plan.config.dkdv, key, launch_dkdv)
                _run("dq", plan.config.dq, key, launch_dq)
        if dmask is not None:
            dmask = dmask.to(params.mask.dtype)
        elif signature.plain and grad_lse is None and hopper:
            if hopper_site is not None:  # (one launch over the whole tensors, so with the sums beside delta and lse2)
                signature.repeated_backwards[self._backward_key(grad_out, q, k, v, out, lse, plan)] = \
                    _RepeatedHopperBackward(preprocess_site, hopper_site, sums_words, plan, run)
        elif plan.key_lengths and not plan.has_dropout and grad_lse is None and hopper and hopper_site is not None:
            # A key-padded signature's, per padding kind (right padding, or spans), which each call's mask says
            # (_key_padded_backward_repeat); not with dropout (each call has its own seed).
            key = self._backward_key(grad_out, q, k, v, out, lse, plan) + (run.key_padding_kind(), )
            signature.repeated_backwards[key] = _RepeatedHopperBackward(preprocess_site, hopper_site, sums_words, plan,
                                                                        run)
        elif signature.plain and grad_lse is None:
            dkdv_site, dkdv_descriptors = ran["dkdv"]
            signature.repeated_backwards[self._backward_key(grad_out, q, k, v, out, lse, plan)] = _RepeatedBackward(
                (preprocess_site, dkdv_site, ran.get("dq") if dq_mode == 0 else None), dq_mode,
                dkdv_descriptors or dq_mode == 2, plan, run)
        return dq, dk, dv, dmask

    # ---- KV cache and packed sequences (decode_launch.py, varlen_launch.py) --------------------
    def forward_kvcache(self, q, cache, params: AttentionParams):
        signature = _signature_for(q, cache.k, cache.v, params, dense=True, names=("q", "k_cache", "v_cache"))
        return decode_launch.split_kv_forward(q, cache.k, cache.v, params, cache=cache, signature=signature)

    def append_kvcache(self, k_cache, v_cache, k, v, cache_seqlens, block_table):
        # One launch (decode.append_kv_kernel) where torch's indexing takes five to ten.
        return decode_launch.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)

    def kvcache_call(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, params: AttentionParams,
                     return_lse: bool):
        return _kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, params, return_lse)

    def forward_kvcache_appending(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                  params: AttentionParams):
        step = _kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, params, True)
        return None if step is None else step(q, k_cache, v_cache, k, v, cache_seqlens, block_table)

    def forward_varlen(self, q, k, v, packing, params: AttentionParams):
        return varlen_launch.forward(q, k, v, packing, params)

    def backward_varlen(self, grad_out, q, k, v, out, lse, packing, params: AttentionParams, grad_lse=None):
        return varlen_launch.backward(grad_out, q, k, v, out, lse, packing, params, grad_lse)

    # ---- dropout ------------------------------------------------------------------------------
    def dropout_bits(self, batch, heads, seqlen_q, seqlen_k, seed, device) -> torch.Tensor:
        """The RNG words (B, H, Nq, Nk) as int64 in [0, 2**32), drawn by the kernels' own Triton helpers
        (for checking them against :func:`mhattn.dropout_rng.random_bits`)."""
        _, _, rng = kernels()
        bits = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.int32, device=device)
        block_m, block_n = 16, 64
        with _OnDevice(torch.device(device)):
            rng.dropout_bits_kernel[(batch * heads, triton_cdiv(seqlen_q, block_m))](
                bits, heads, seqlen_q, seqlen_k, _as_int32(seed[0]), _as_int32(seed[1]),
                BLOCK_M=block_m, BLOCK_N=block_n,
            )
        return bits.to(torch.int64) & dropout_rng.MASK32


def _kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, params: AttentionParams, return_lse: bool):
    """A KV-cache step for calls like this one (Backend.kvcache_call): the launch signature worked out once, the new
    keys and values (where given) written by the split kernel itself (decode.split_kv_kernel's APPEND: no launch for
    the append), and no lse allocated for a step that does not return it. None where the split kernel does not take
    the call (no cache_seqlens; new rows whose head dims are not contiguous)."""
    appends = k is not None
    if cache_seqlens is None or (appends and not new_rows_contiguous(k, v)):
        return None
    signature = _signature_for(q, k_cache, v_cache, params, dense=True, names=("q", "k_cache", "v_cache"))
    return decode_launch.PreparedSplitStep(params, signature, return_lse, appends)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_inputs(**tensors):
    for name, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(f"triton backend: {name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"triton backend: {name} must have a contiguous last dim (stride 1), got strides "
                             f"{tuple(t.stride())}")
