"""The problem shapes ``mhattn tune`` times: one :class:`Cell` per shape, in a quick and a full grid.

A cell is plain data (it travels to a worker process as a dict). The grids cover what users run:
training shapes (B * N = 16k tokens, H = 2048 / d, as the benchmark protocol), short sequences,
decoding (Nq = 1 against a long key cache, grouped-query heads), a chunked prefill (bottom-right
causal, Nq << Nk), grouped-query training shapes and masked attention (key padding, a float bias).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

CAUSAL_KINDS = ("none", "top_left", "bottom_right")
MASK_KINDS = ("none", "bool", "float")
TOKENS = 16384
HIDDEN = 2048
# The training shapes' sequence lengths: the quick grid's, the full grid's.
QUICK_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FULL_SEQLENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class Cell:
    """One timed problem: q (batch, heads_q, seqlen_q, head_dim), k and v (batch, heads_kv, seqlen_k, head_dim).

    ``causal``: "none", "top_left" (SDPA's is_causal) or "bottom_right" (causal_lower_right);
    ``mask``: "none", "bool" (a key-padding mask, (B, 1, 1, Nk), the last eighth of the keys masked)
    or "float" (an additive bias (1, 1, Nq, Nk)); ``grad``: also time forward+backward.
    """

    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: str = "none"
    mask: str = "none"
    grad: bool = True

    def __post_init__(self):
        if self.causal not in CAUSAL_KINDS:
            raise ValueError(f"Cell.causal: expected one of {CAUSAL_KINDS}, got {self.causal!r}")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"Cell.mask: expected one of {MASK_KINDS}, got {self.mask!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"Cell: heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")

    def label(self) -> str:
        heads = f"H={self.heads_q}" + (f"/{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        n = f"N={self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"N={self.seqlen_q}x{self.seqlen_k}"
        extra = "".join(f" {x}" for x in (self.causal, self.mask + "-mask") if not x.startswith("none"))
        return f"{self.dtype} d={self.head_dim} B={self.batch} {heads} {n}{extra}"

    def as_dict(self) -> dict:
        return asdict(self)


def training(dtype, head_dim, seqlen, causal="none", group=1, mask="none") -> Cell:
    """A training-like cell: B * N = 16k tokens, Hq = 2048 / d, Hkv = Hq / group."""
    heads = max(1, HIDDEN // head_dim)
    return Cell(dtype, max(1, TOKENS // seqlen), heads, max(1, heads // group), seqlen, seqlen, head_dim, causal, mask)


def decode(dtype, batch, seqlen_k, heads_q=32, heads_kv=8, head_dim=128, seqlen_q=1) -> Cell:
    """``seqlen_q`` new queries (1: a decoding step; a few: speculative decoding) against a key cache of
    ``seqlen_k``, bottom-right causal; forward only (decoding keeps no graph)."""
    return Cell(dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, "bottom_right", "none", grad=False)


def latency_cells() -> list:
    """The shapes of ``mhattn bench --latency`` (B=1 H=16 N=128, ViT-B/16 at batch 32, B=8 H=16 N=512 in bf16 and
    fp32), where the host path of a call costs as much as its kernels: the backend measured fastest there is
    often not the one of the larger shapes nearby (forward+backward especially), so they are cells of their own."""
    from mhattn.benchmark.latency import SHAPES

    return [Cell(s.dtype, s.batch, s.heads, s.heads, s.seqlen, s.seqlen, s.head_dim) for s in SHAPES]


def quick_grid() -> list:
    """67 cells: every training shape of ``mhattn bench`` (bf16), its latency shapes, and one of each other kind,
    fp32 included."""
    cells = latency_cells()
    cells += training_cells(("bf16", ), (64, 128, 256), QUICK_SEQLENS)
    for d in (64, 128):
        cells.append(training("bf16", d, 128))
        cells.append(training("fp16", d, 2048, "top_left"))
    # Decoding at the batches and cache lengths of `mhattn bench --decode`: short caches are host-bound and long
    # ones bandwidth-bound, so the winner changes along Nk and B, and a cell three octaves away decides badly.
    # (At B = 64 a 1k cache is GPU-bound where B = 8's is host-bound, and at B = 1 an 8k cache is host-bound where
    # B = 8's is not: cells of their own.)
    for batch, nk in ((1, 1024), (8, 1024), (64, 1024), (1, 2048), (1, 8192), (8, 8192), (1, 32768), (8, 32768),
                      (64, 8192)):
        cells.append(decode("bf16", batch, nk))
    for batch, nk in ((1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (1, 32768), (8, 32768)):  # speculative
        cells.append(decode("bf16", batch, nk, seqlen_q=4))
    cells.append(training("bf16", 128, 2048, "top_left", group=4))
    cells.append(Cell("bf16", 1, 32, 8, 512, 32768, 128, "bottom_right"))    # chunked prefill
    cells.append(training("bf16", 64, 1024, mask="bool"))
    cells.append(training("bf16", 128, 1024, mask="float"))
    # float32: torch's kernels and mhattn's take different paths (TF32 or not, no flash kernel), so the choice
    # differs from the 16-bit one.
    cells.append(training("fp32", 64, 512))
    cells.append(training("fp32", 64, 2048, "top_left"))
    cells.append(training("fp32", 128, 1024))
    return cells


def full_grid() -> list:
    """Every combination the quick grid samples, and more sequence lengths, head dims and GQA ratios."""
    cells = latency_cells()
    for dtype in ("bf16", "fp16"):
        for d in (32, 64, 128, 256):
            cells += training_cells((dtype, ), (d, ), FULL_SEQLENS)
            for n in (1024, 4096):
                for group in (4, 8):
                    if HIDDEN // d >= group:
                        cells.append(training(dtype, d, n, "top_left", group=group))
                for mask in ("bool", "float"):
                    cells.append(training(dtype, d, n, mask=mask))
        for batch in (1, 8, 32):
            for nk in (512, 2048, 8192, 32768):
                cells.append(decode(dtype, batch, nk))
                cells.append(decode(dtype, batch, nk, seqlen_q=4))
        for nk in (4096, 32768):
            cells.append(Cell(dtype, 1, 32, 8, 512, nk, 128, "bottom_right"))
    cells.append(training("fp32", 64, 1024))
    cells.append(training("fp32", 64, 1024, "top_left"))
    return cells


def training_cells(dtypes, head_dims, seqlens) -> list:
    """Training shapes at every dtype, head dim and sequence length given, causal (top-left) and not."""
    return [training(dtype, d, n, causal) for dtype in dtypes for d in head_dims for n in seqlens
            for causal in ("none", "top_left")]


def head_dim_cells(device_type: str, quick: bool, head_dims) -> list:
    """``mhattn tune --head-dim``: the grid's training shapes at ``head_dims`` (the head dims a model uses that the
    grids lack, such as 96 or 192, whose kernels differ from their neighbours'): on a GPU bf16 (the full grid fp16 too)
    at each of the grid's sequence lengths, causal and not; on the CPU the CPU grid's shapes."""
    if device_type == "cpu":
        return [replace(c, head_dim=d) for d in head_dims for c in cpu_grid(quick)]
    if quick:
        return training_cells(("bf16", ), head_dims, QUICK_SEQLENS)
    return training_cells(("bf16", "fp16"), head_dims, FULL_SEQLENS)


def cpu_grid(quick: bool) -> list:
    """The CPU's shapes: fp32, B=1, H=8, d=64 (torch's fused CPU kernel against the reference)."""
    seqlens = (128, 512, 2048) if quick else (128, 256, 512, 1024, 2048, 4096)
    return [Cell("fp32", 1, 8, 8, n, n, 64, causal) for n in seqlens for causal in ("none", "top_left")]


def cells_for(device_type: str, quick: bool) -> list:
    if device_type == "cpu":
        return cpu_grid(quick)
    return quick_grid() if quick else full_grid()


def limit(cells, max_seqlen=None) -> list:
    """``cells`` without those whose Nq or Nk exceeds ``max_seqlen`` (None: all)."""
    if not max_seqlen:
        return list(cells)
    return [c for c in cells if max(c.seqlen_q, c.seqlen_k) <= max_seqlen]
