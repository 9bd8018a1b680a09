"""FlashAttention-2 in CUDA C++ (tensor-core mma.sync, ldmatrix, cp.async), compiled at run time by NVRTC
through CuPy and launched on PyTorch's current stream; on sm_90 GPUs a Hopper forward and backward (TMA, wgmma, a
producer warpgroup; compiled for sm_90a) where they cover the problem.

Kernels: ``kernels/*.cu`` (forward; backward preprocess, dK/dV, dQ; ``hopper_fwd.cu``, ``hopper_bwd.cu``). Tensor maps:
:mod:`.tensor_maps`. Variants and tile shapes:
:mod:`.variants`. Compilation and the cubin cache: :mod:`.compiler`. Launch: :mod:`.launcher`.
Host logic: :mod:`.ops` (dense attention), :mod:`.packed` (KV cache and packed sequences: the mma.sync kernels with
per-sequence addressing, kernels/sequences.cuh). ``mhattn build`` (:mod:`.build`) compiles every variant without a GPU.

Install: ``pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12`` (CUDA 12 drivers) or ``pip install
cupy-cuda13x`` with a CUDA 13 NVRTC; no CUDA toolkit or headers are needed.
"""

from __future__ import annotations

import functools

import torch

from mhattn import environment
from mhattn.backends.base import AttentionParams, Capabilities, KVCache, OutputOnlyForward, Packing
from mhattn.backends.cupy import ops, packed, variants

__all__ = ["CupyBackend"]

# The backward forms dQ with float32 atomics by default (as FlashAttention-2 and SDPA's flash backend do:
# fastest, not bitwise reproducible). Set to 0 for the deterministic backward (the mma.sync kernels: dQ from its own
# kernel; the Hopper backward: the key blocks add dQ in a fixed order), which torch.use_deterministic_algorithms(True)
# and CupyBackend(deterministic=True) also select.
FAST_BACKWARD_ENV = "MHATTN_CUPY_FAST_BACKWARD"
_fast_backward_store, _fast_backward_key = environment.raw_store(FAST_BACKWARD_ENV)


@functools.lru_cache(maxsize=16)
def _fast_backward_off(raw) -> bool:
    """Whether MHATTN_CUPY_FAST_BACKWARD's raw value (environment.raw_store) turns the fast backward off."""
    return environment.decoded(raw).strip().lower() in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def _unavailable_reasons() -> tuple:
    try:
        import cupy  # noqa: F401
    except Exception as error:
        return (f"CuPy is not installed or fails to import ({type(error).__name__}: {error}); "
                "pip install cupy-cuda12x (or cupy-cuda13x)",)
    try:
        from mhattn.backends.cupy import compiler

        compiler.nvrtc_version()
    except Exception as error:
        return (f"NVRTC cannot be loaded ({type(error).__name__}: {error}); "
                "pip install nvidia-cuda-nvrtc-cu12 (CUDA 12) or the NVRTC matching your CuPy",)
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible (CuPy and NVRTC are installed: `mhattn build` compiles the kernels "
                "without a GPU)",)
    return ()


class CupyBackend(OutputOnlyForward):
    name = "cupy"
    description = "FlashAttention-2 in CUDA C++ (mma.sync, ldmatrix, cp.async), compiled at run time by NVRTC through CuPy"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        min_head_dim=1,
        max_head_dim=variants.HEAD_DIM_BUCKETS[-1],
        min_compute_capability=(8, 0),
        features=frozenset({"causal", "gqa", "bool_mask", "float_mask", "mask_grad", "dropout", "window", "softcap",
                            "deterministic", "value_dim"}),
        operations=frozenset({"attention", "kvcache", "paged_kvcache", "varlen"}),
    )

    def __init__(self, launcher=None, compute_capability=None, deterministic=None):
        # launcher: an object with prepare(variant, grid, template, device, cc) returning launch(pointers) (see
        # launcher.py), or only launch(variant, grid, args, device, cc); default: CuPy on torch's stream.
        # compute_capability: fixed (major, minor) instead of the device's (the host-side emulator uses it).
        # deterministic: True = bitwise-reproducible backward (dQ from its own kernel, or on sm_90 the Hopper
        # backward's key blocks adding dQ in a fixed order); False = dQ through float32
        # atomics in the dK/dV kernel (faster, summation order varies between runs); None = False unless
        # torch.use_deterministic_algorithms(True) is on or MHATTN_CUPY_FAST_BACKWARD=0. Head dims whose tiles
        # cannot form dQ in the dK/dV kernel (the 96 and 192 buckets) always run the deterministic kernels.
        self._launcher = launcher
        self.deterministic = deterministic
        self._fixed_cc = None if compute_capability is None else tuple(compute_capability)
        self._cc_cache = {}

    @property
    def launcher(self):
        if self._launcher is None:
            from mhattn.backends.cupy.launcher import CupyLauncher

            self._launcher = CupyLauncher()
        return self._launcher

    def unavailable(self):
        return list(_unavailable_reasons())

    def unsupported(self, problem):
        reasons = super().unsupported(problem)
        if not 1 <= problem.head_dim_v <= variants.HEAD_DIM_BUCKETS[-1]:
            reasons.append(f"supports value head dims 1..{variants.HEAD_DIM_BUCKETS[-1]}, got {problem.head_dim_v}")
        longest = max(problem.seqlen_q, problem.seqlen_k)
        if longest > ops.MAX_SEQLEN:
            reasons.append(f"supports sequences up to {ops.MAX_SEQLEN} (32-bit index arithmetic), got {longest}")
        fwd_ctas = -(-problem.seqlen_q // ops.MIN_FWD_BLOCK_M) * problem.batch * problem.heads_q
        if fwd_ctas > ops.MAX_GRID_X:
            reasons.append(f"supports up to {ops.MAX_GRID_X} (query block, batch, head) triples in the forward "
                           f"grid, got {fwd_ctas} (seqlen_q {problem.seqlen_q}, batch {problem.batch}, heads "
                           f"{problem.heads_q})")
        if max(problem.batch, problem.heads_q) > ops.MAX_GRID_YZ:
            reasons.append(f"supports batch and heads up to {ops.MAX_GRID_YZ} each (CUDA grid y/z limits), got "
                           f"batch {problem.batch}, heads {problem.heads_q}")
        return reasons

    def _cc(self, device: torch.device):
        if self._fixed_cc is not None:
            return self._fixed_cc
        index = device.index if device.index is not None else torch.cuda.current_device()
        cc = self._cc_cache.get(index)
        if cc is None:
            properties = torch.cuda.get_device_properties(index)
            cc = (properties.major, properties.minor)
            limit = getattr(properties, "shared_memory_per_block_optin", 0)
            if limit:  # the tiles are sized for this GPU's shared memory, not the table's
                variants.note_device_smem_limit(cc, limit)
            self._cc_cache[index] = cc
        return cc

    def _forward(self, q, k, v, params: AttentionParams, keep_lse: bool):
        """(out, lse) of the forward; keep_lse False: lse is the plan's scratch (ops.forward), for a caller that drops
        it (a decoding step allocates its own)."""
        if packed.decodes_dense(q, k, v, params):
            return packed.forward_dense_decoding(self.launcher, self._cc(q.device), q, k, v, params)
        return ops.forward(self.launcher, self._cc(q.device), q, k, v, params, keep_lse=keep_lse)

    def forward_path(self, problem):
        if problem.operation != "attention":
            if problem.operation == "varlen":
                kernels = "kernels/fwd.cu with VARLEN"
            else:
                kernels = ("kernels/fwd.cu with KV_CACHE; for a decoding step (at most 16 query rows) KV_SPLIT, the "
                           "keys split over CTAs where the grid would not fill the GPU and merged by "
                           "kernels/kv_combine.cu")
            return (f"the mma.sync forward ({kernels}; kernels/sequences.cuh) on every GPU: the Hopper forward takes "
                    "dense attention only")
        if packed.problem_decodes_dense(problem):
            return ("the mma.sync forward of a decoding step (kernels/fwd.cu with KV_CACHE and KV_SPLIT: k and v as a "
                    "full cache, the keys split over CTAs where the grid would not fill the GPU), when q, k, v rows "
                    "have their last dim contiguous")
        reason = ops.hopper_problem_refusal(problem)
        if reason is None:
            float_mask = (f", and a float mask broadcast over the queries (key padding; else {ops.FLOAT_MASK_BY_QUERY})"
                          if "float_mask" in problem.features else "")
            return ("the Hopper forward (kernels/hopper_fwd.cu: TMA, wgmma, warp-specialised), when q, k, v rows "
                    f"are 16-byte aligned and no dim is broadcast{float_mask}")
        return f"the mma.sync forward (kernels/fwd.cu): not the Hopper forward because {reason}"

    def backward_path(self, problem):
        if problem.operation == "varlen":
            return ("the mma.sync backward (kernels/bwd_*.cu with VARLEN, dQ from its own kernel: deterministic) on "
                    "every GPU: the Hopper backward takes dense attention only")
        if problem.operation != "attention":
            return None  # forward only
        reason = ops.hopper_problem_refusal(problem, backward=True, deterministic=self._deterministic())
        if reason is None:
            tiles = variants.HOPPER_BWD_TILES[problem.head_dim]
            dq = "dQ by the copy engine's bulk reduce-add" if tiles.dq_bulk else "dQ with atomics"
            if self._deterministic():
                dq += ", the key blocks in turns: deterministic"
            if ops.hopper_bwd_stores_dq(problem.seqlen_k):
                dq = "dQ stored directly, every key in one CTA, where dQ is (B, Hq, Nq, D) contiguous (else " + dq + ")"
            return (f"the Hopper backward (kernels/hopper_bwd.cu: TMA, wgmma, {dq}), when q, k, v and the output "
                    "gradient rows are 16-byte aligned and no dim is broadcast")
        return f"the mma.sync backward (kernels/bwd_*.cu): not the Hopper backward because {reason}"

    def _deterministic(self) -> bool:
        if self.deterministic is not None:
            return bool(self.deterministic)
        if torch.are_deterministic_algorithms_enabled():
            return True
        raw = _fast_backward_store.get(_fast_backward_key)  # read at every backward: it may change between calls
        return raw is not None and _fast_backward_off(raw)

    def backward(self, grad_out, q, k, v, out, lse, params: AttentionParams, grad_lse=None):
        return ops.backward(self.launcher, self._cc(q.device), grad_out, q, k, v, out, lse, params, grad_lse,
                            deterministic=self._deterministic())

    def forward_kvcache(self, q, cache: KVCache, params: AttentionParams):
        return packed.forward_kvcache(self.launcher, self._cc(q.device), q, cache, params)

    def append_kvcache(self, k_cache, v_cache, k, v, cache_seqlens, block_table):
        # One launch (kernels/kv_append.cu) where torch's indexing takes several.
        return packed.append_kvcache(self.launcher, self._cc(k.device), k_cache, v_cache, k, v, cache_seqlens,
                                     block_table)

    def forward_varlen(self, q, k, v, packing: Packing, params: AttentionParams):
        return packed.forward_varlen(self.launcher, self._cc(q.device), q, k, v, packing, params)

    def backward_varlen(self, grad_out, q, k, v, out, lse, packing: Packing, params: AttentionParams,
                        grad_lse=None):
        return packed.backward_varlen(self.launcher, self._cc(q.device), grad_out, q, k, v, out, lse, packing,
                                      params, grad_lse)
