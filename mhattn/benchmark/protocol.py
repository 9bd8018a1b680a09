"""The benchmark protocol of PERFORMANCE.md: shapes, FLOP counts, inputs, and the implementations timed.

Shapes follow the FlashAttention-2 paper: q, k, v of shape (B, H, N, d) drawn from randn, B * N = 16384
tokens and H = 2048 / d, so every cell moves the same number of tokens through a model of hidden size
2048. FLOPs count the two matmuls of the forward (4 * B * H * N^2 * d, halved when causal); the backward
does 2.5x the forward's work (five matmuls against two) and forward+backward 3.5x.

An implementation is anything that maps (q, k, v, causal) to an output: every registered mhattn backend
(called through the public ``mhattn.attention(..., backend=name)``), PyTorch's SDPA restricted to one of
its kernels with ``torch.nn.attention.sdpa_kernel``, and the naive reference (the mhattn backend named
``reference``). ``implementations()`` is the table name -> :class:`Implementation`.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch

# Protocol constants (PERFORMANCE.md).
TOKENS = 16384          # B * N
HIDDEN = 2048           # H * d
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
MODES = ("fwd", "bwd", "fwd_bwd")
MODE_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}
# Work of each mode relative to the forward's two matmuls.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_LONG_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def canonical_dtype(name: str) -> str:
    """'bf16' / 'bfloat16' -> 'bf16', 'fp16' / 'float16' / 'half' -> 'fp16' (and fp32 for tests)."""
    key = str(name).strip().lower().replace("torch.", "")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of bf16, fp16 (or bfloat16, float16), got {name!r}")
    return _DTYPE_NAMES[key]


@dataclass(frozen=True)
class Shape:
    """One attention problem of the sweep: q, k, v of shape (batch, heads, seqlen, head_dim)."""

    dtype: str          # canonical short name: "bf16" or "fp16"
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def label(self) -> str:
        return (f"{self.dtype} d={self.head_dim} N={self.seqlen} B={self.batch} H={self.heads} "
                f"{'causal' if self.causal else 'non-causal'}")

    def as_dict(self) -> dict:
        return asdict(self)


def protocol_shape(dtype: str, head_dim: int, seqlen: int, causal: bool, *, tokens: int = TOKENS,
                   hidden: int = HIDDEN) -> Shape:
    """The protocol's (B, H) for a sequence length and head dim: B = tokens / N, H = hidden / d (at least 1)."""
    if seqlen <= 0 or head_dim <= 0:
        raise ValueError(f"seqlen and head_dim must be positive, got seqlen={seqlen}, head_dim={head_dim}")
    return Shape(canonical_dtype(dtype), max(1, tokens // seqlen), max(1, hidden // head_dim), seqlen, head_dim,
                 bool(causal))


def forward_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    """FLOPs of the forward: two (N x N x d) matmuls per head, 2 FLOPs per multiply-add; half when causal."""
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def flops(shape: Shape, mode: str) -> float:
    """FLOPs of ``mode`` ('fwd', 'bwd', 'fwd_bwd') on ``shape`` as the FlashAttention-2 paper counts them."""
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    base = forward_flops(shape.batch, shape.heads, shape.seqlen, shape.head_dim, shape.causal)
    return MODE_FLOP_FACTOR[mode] * base


def tflops(flop_count: float, milliseconds: Optional[float]) -> Optional[float]:
    """Throughput in TFLOP/s of ``flop_count`` done in ``milliseconds``; None when there is no valid time."""
    if milliseconds is None or not milliseconds > 0:
        return None
    return flop_count / (milliseconds * 1e-3) / 1e12


def input_seed(shape: Shape) -> int:
    """A seed fixed by the shape, so every process (and every rerun) draws the same inputs for a cell."""
    key = f"{shape.dtype}/{shape.batch}/{shape.heads}/{shape.seqlen}/{shape.head_dim}"
    return zlib.crc32(key.encode())


def make_inputs(shape: Shape, device, *, requires_grad: bool = True):
    """q, k, v (B, H, N, d) ~ randn in the shape's dtype, requiring grad, and the output gradient dout
    (B, H, N, d) ~ randn, all drawn from a generator seeded by the shape."""
    generator = torch.Generator(device=device)
    generator.manual_seed(input_seed(shape))
    size = (shape.batch, shape.heads, shape.seqlen, shape.head_dim)
    tensors = [torch.randn(size, generator=generator, device=device, dtype=shape.torch_dtype) for _ in range(4)]
    q, k, v, dout = tensors
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, dout


# ---- implementations ---------------------------------------------------------------------------------


class Implementation:
    """One way of computing attention. Subclasses set ``name``, ``family`` and ``description``.

    ``__call__(q, k, v, causal)`` returns out (B, H, N, d); it runs inside ``context()``, which the timing
    harness enters once around all the calls it times (so a context manager costs nothing per call).
    """

    name: str = ""
    family: str = ""          # "mhattn" (a registered mhattn backend) or "sdpa" (a PyTorch peer)
    description: str = ""
    # Bytes of O(N^2) scratch per score element in forward and in forward+backward (0 = O(N) memory).
    scratch_bytes_per_score = {"fwd": 0, "fwd_bwd": 0}

    @property
    def is_reference(self) -> bool:
        return False

    def unsupported(self, q, k, v, causal: bool) -> list:
        """Reasons this implementation cannot run these inputs, known before running; [] = try it."""
        return []

    def context(self):
        return contextlib.nullcontext()

    def __call__(self, q, k, v, causal: bool):
        raise NotImplementedError

    def scratch_bytes(self, shape: Shape, mode: str) -> int:
        """Estimated O(N^2) scratch memory of ``mode`` ('fwd' or 'fwd_bwd') for ``shape``; 0 when O(N)."""
        per_score = self.scratch_bytes_per_score["fwd" if mode == "fwd" else "fwd_bwd"]
        return int(per_score * shape.batch * shape.heads * shape.seqlen * shape.seqlen)

    def __repr__(self):
        return f"<benchmark implementation {self.name!r}>"


class MhattnImplementation(Implementation):
    """A registered mhattn backend, called through the public ``mhattn.attention(..., backend=name)``."""

    family = "mhattn"

    def __init__(self, backend_name: str, description: str = ""):
        self.name = backend_name
        self.backend_name = backend_name
        self.description = description or f"mhattn.attention(..., backend={backend_name!r})"
        if backend_name == "reference":
            # The reference upcasts half inputs to float32 and keeps S, P (forward) and about six N^2
            # float32 buffers in its backward.
            self.scratch_bytes_per_score = {"fwd": 3 * 4, "fwd_bwd": 6 * 4}

    @property
    def is_reference(self) -> bool:
        return self.backend_name == "reference"

    def unsupported(self, q, k, v, causal):
        import mhattn

        decision = mhattn.explain(q, k, v, is_causal=causal, backend=self.backend_name)
        return list(decision.reasons.get(self.backend_name, [f"backend {self.backend_name!r} is not registered"]))

    def __call__(self, q, k, v, causal):
        import mhattn

        return mhattn.attention(q, k, v, is_causal=causal, backend=self.backend_name)


class AutoImplementation(MhattnImplementation):
    """``mhattn.attention`` on automatic selection: the column that shows what a user gets by default."""

    def __init__(self):
        super().__init__("auto", "mhattn.attention on automatic selection (the timing table, else the priority list)")

    def unsupported(self, q, k, v, causal):
        import mhattn

        decision = mhattn.explain(q, k, v, is_causal=causal, backend="auto")
        return [] if decision.chosen else ["no backend can run it"]


class SdpaImplementation(Implementation):
    """``torch.nn.functional.scaled_dot_product_attention`` restricted to one SDPA kernel."""

    family = "sdpa"

    def __init__(self, name: str, sdpa_backend: str, description: str):
        self.name = name
        self.sdpa_backend = sdpa_backend     # a member name of torch.nn.attention.SDPBackend; None = torch's choice
        self.description = description
        if sdpa_backend == "MATH":
            # The math path materialises S and P in the input dtype (and more for the backward).
            self.scratch_bytes_per_score = {"fwd": 3 * 4, "fwd_bwd": 6 * 4}

    def unsupported(self, q, k, v, causal):
        if self.sdpa_backend is None:  # torch's own choice: always there
            return []
        try:
            from torch.nn.attention import SDPBackend
        except ImportError as error:
            return [f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel ({error})"]
        if not hasattr(SDPBackend, self.sdpa_backend):
            return [f"torch {torch.__version__} has no SDPBackend.{self.sdpa_backend}"]
        return []

    def context(self):
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.sdpa_backend))

    def __call__(self, q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


class FlexImplementation(Implementation):
    """torch's FlexAttention: ``flex_attention`` under ``torch.compile`` (Inductor generates Triton kernels),
    with a causal block mask built once per shape. The first call of a shape compiles (tens of seconds)."""

    family = "flex"

    def __init__(self):
        self.name = "flex"
        self.description = "torch FlexAttention (torch.compile'd flex_attention, causal BlockMask)"
        self._compiled = None
        self._block_masks = {}

    def unsupported(self, q, k, v, causal):
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as error:
            return [f"torch {torch.__version__} has no FlexAttention ({error})"]
        if q.device.type != "cuda":
            return ["runs on CUDA tensors here (its CPU path is not a peer of the GPU kernels)"]
        return []

    def _block_mask(self, q, k):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (q.shape[-2], k.shape[-2], q.device)
        if key not in self._block_masks:
            def causal_mask(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            self._block_masks[key] = create_block_mask(causal_mask, None, None, key[0], key[1], device=q.device)
        return self._block_masks[key]

    def __call__(self, q, k, v, causal):
        from torch.nn.attention.flex_attention import flex_attention

        if self._compiled is None:
            allow_flex_recompiles()
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled(q, k, v, block_mask=self._block_mask(q, k) if causal else None)


# Compilations of flex_attention one sweep makes: a shape, a block mask and a gradient mode each (36 training
# cells, forward and backward). torch.compile recompiles a function for at most ``recompile_limit`` (8) of them
# and then runs it uncompiled, which for flex_attention is its unfused reference (5-35 TFLOP/s on an H100 where
# the compiled kernels reach 300-400).
FLEX_RECOMPILE_LIMIT = 256


def allow_flex_recompiles():
    """Raise torch.compile's per-function recompilation limits to FLEX_RECOMPILE_LIMIT (never lower them)."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))


# Peers of PERFORMANCE.md: name -> (SDPBackend member, description). sdpa-math and sdpa-default (no kernel
# forced; the baseline of the latency table) are available on request.
SDPA_PEERS = {
    "sdpa-flash": ("FLASH_ATTENTION", "PyTorch SDPA, FlashAttention-2 kernel"),
    "sdpa-cudnn": ("CUDNN_ATTENTION", "PyTorch SDPA, cuDNN attention kernel"),
    "sdpa-efficient": ("EFFICIENT_ATTENTION", "PyTorch SDPA, memory-efficient (xFormers-derived) kernel"),
    "sdpa-math": ("MATH", "PyTorch SDPA, math path (materialises S and P)"),
    "sdpa-default": (None, "PyTorch SDPA as a user calls it: torch picks the kernel"),
}
# Peers taken when no --impl filter is given (sdpa-math duplicates the naive reference; flex on request,
# its first call of every shape compiles).
DEFAULT_SDPA_PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
# The peers every ratio column is computed against (those present in the run).
RATIO_PEERS = ("sdpa-flash", "sdpa-cudnn", "flex")


def implementations() -> dict:
    """The table name -> Implementation: ``auto`` (automatic selection), every registered mhattn backend
    (the reference last), then the SDPA peers. Order is the display order of tables and plots."""
    from mhattn import registry

    table = {"auto": AutoImplementation()}
    reference = None
    for backend in registry.all_backends():
        impl = MhattnImplementation(backend.name, getattr(backend, "description", "") or "")
        if impl.is_reference:
            reference = impl
        else:
            table[impl.name] = impl
    for name, (member, description) in SDPA_PEERS.items():
        if name in table:  # a third-party mhattn backend with a peer's name keeps its own name
            continue
        table[name] = SdpaImplementation(name, member, description)
    if "flex" not in table:
        table["flex"] = FlexImplementation()
    if reference is not None:
        table[reference.name] = reference
    return table


def with_pairs(table: dict, names) -> dict:
    """``table`` and, after it, for each of ``names`` that names a pair of mhattn backends ("triton+sdpa": the forward
    of one, the backward of the other, :mod:`mhattn.backends.paired`) and is not in it, that pair's implementation."""
    from mhattn import registry
    from mhattn.backends.paired import split_pair_name

    pairs = {}
    for name in names:
        if name not in table and split_pair_name(name) and registry.is_backend_name(name):
            backend = registry.get_backend(name)
            pairs[backend.name] = MhattnImplementation(backend.name, backend.description)
    return {**table, **pairs} if pairs else table


def default_implementation_names(table: Optional[dict] = None) -> list:
    """The implementations a run takes when no filter is given: every mhattn backend but the variants of another
    (``sdpa.cudnn`` and the like: the same kernels as SDPA's peers, on request by name), the three SDPA peers of
    PERFORMANCE.md, and the reference."""
    from mhattn import registry

    table = implementations() if table is None else table
    return [name for name, impl in table.items()
            if (impl.family == "mhattn" and registry.variant_base(name) is None) or name in DEFAULT_SDPA_PEERS]


def subject_names(names) -> list:
    """The implementations whose ratios to the peers are shown: the mhattn backends other than the reference."""
    table = implementations()
    return [n for n in names if n in table and table[n].family == "mhattn" and not table[n].is_reference]
