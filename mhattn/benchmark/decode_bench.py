"""``mhattn bench --decode``: decoding steps over long key sequences, mhattn beside PyTorch's SDPA.

One cell per (dtype, B, Nk, Nq) with Hq = 32 query heads sharing Hkv = 8 key/value heads, d = 128 (by
default). Every implementation reads the same K and V:

- ``sdpa``: torch SDPA with its default kernel choice (``enable_gqa=True``); ``sdpa-cudnn``: forced to cuDNN;
- ``triton``: ``mhattn.attention(..., backend="triton")`` (the split-KV kernels for few query rows); ``cupy``: the
  same on the CuPy backend; ``auto``: ``mhattn.attention`` with automatic selection, and its time over the
  fastest of sdpa, triton and cupy (issue 12's measure: at least 0.95 of the fastest is 1.05 or less here);
- ``kvcache``: ``mhattn.attention_with_kvcache(..., backend="triton")`` over the same tensors as a contiguous
  cache (its value checks read cache_seqlens back on the first call only: the timed calls reuse it);
- ``paged``: the same over a paged pool (blocks of ``block_size`` keys in a shuffled order).

Times are the GPU timer's medians. A call under 0.5 ms on it (``mhattn.tuning.measure.HOST_BOUND_MS``) is also timed
as a host loop, the implementations' loops taking turns (what ``mhattn tune`` does): a decoding step runs in a loop,
where a short call costs the larger of its GPU time and its host path. ``auto/best loop`` holds auto against the
fastest by that cost, the measure its timing table chose by. The same short calls are also replayed from a CUDA graph
(``timing.graph_replay_ms``: 20 calls captured, as serving stacks run decoding steps), which times the GPU's work
alone: back to back without flushing the L2 cache (K and V that fit in it, 50 MB on an H100, are read from it), and
with the L2 flushed before each call, the flushes' own time taken off (K and V read from memory, as a model's layers
find them: each layer's cache has left the L2 by its next step). Two more tables list those cells (a call that cannot
be captured says why under "not measured").

Bandwidth is FlashAttention's measure: the bytes of K and V / time. Query rows past the first sit at the bottom-right
diagonal (causal), as in speculative decoding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from mhattn.benchmark import latency, timing

HEADS = (32, 8)
BATCHES = (1, 8, 64)
SEQLENS_K = (1024, 8192, 32768, 131072)
QUERY_ROWS = (1, 4)
HEAD_DIM = 128
BLOCK_SIZE = 256
IMPLS = ("sdpa", "sdpa-cudnn", "triton", "cupy", "auto", "kvcache", "paged")
# What automatic selection is held against: SDPA's default and each mhattn backend through mhattn.attention.
AUTO_PEERS = ("sdpa", "triton", "cupy")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DecodeCell:
    dtype: str
    batch: int
    seqlen_k: int
    seqlen_q: int = 1
    heads_q: int = HEADS[0]
    heads_kv: int = HEADS[1]
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V every implementation must read once."""
        return 2 * self.batch * self.heads_kv * self.seqlen_k * self.head_dim * DTYPES[self.dtype].itemsize

    def label(self) -> str:
        return f"{self.dtype} B={self.batch} Nk={self.seqlen_k} Nq={self.seqlen_q}"


def decode_cells(dtypes=("bf16",), batches=BATCHES, seqlens_k=SEQLENS_K, query_rows=QUERY_ROWS, head_dim=HEAD_DIM,
                 block_size=BLOCK_SIZE) -> list:
    """The cells of a run, smallest caches first within each dtype (a run cut short loses the biggest)."""
    cells = [DecodeCell(dtype, b, nk, nq, head_dim=head_dim, block_size=block_size)
             for dtype in dtypes for nq in query_rows for b in batches for nk in seqlens_k]
    return sorted(cells, key=lambda c: (list(dtypes).index(c.dtype), c.seqlen_q, c.kv_bytes))


# ---- the implementations of one cell --------------------------------------------------------------------


def _causal_mask(cell: DecodeCell, device):
    """None for one query row; else the bottom-right causal bool mask (1, 1, Nq, Nk) that SDPA takes."""
    if cell.seqlen_q == 1:
        return None
    rows = torch.arange(cell.seqlen_q, device=device)[:, None] + cell.seqlen_k - cell.seqlen_q
    return (torch.arange(cell.seqlen_k, device=device)[None, :] <= rows)[None, None]


def _sdpa(q, k, v, mask, kernel=None):
    import torch.nn.functional as F

    def call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    if kernel is None:
        return call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forced():
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            return call()

    return forced


def _paged_pool(cell: DecodeCell, device, generator):
    """(k_pool, v_pool, block_table): every sequence's Nk keys in blocks of a shuffled pool."""
    dtype = DTYPES[cell.dtype]
    per_sequence = -(-cell.seqlen_k // cell.block_size)
    blocks = cell.batch * per_sequence
    shape = (blocks, cell.heads_kv, cell.block_size, cell.head_dim)
    k_pool = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    v_pool = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    order = torch.randperm(blocks, device=device, generator=generator)
    return k_pool, v_pool, order.view(cell.batch, per_sequence).to(torch.int32)


def _attention_call(q, k, v, bias, backend):
    """mhattn.attention on ``backend`` over these tensors (bound here: the host loops run after time_cell has let go
    of its own names for them)."""
    import mhattn

    return lambda: mhattn.attention(q, k, v, attn_mask=bias, enable_gqa=True, backend=backend)


def _cache_call(q, cache):
    """attention_with_kvcache over ``cache`` (no new tokens) on the Triton backend. Its value checks read
    cache_seqlens back once (the first call); the timed calls reuse the same tensors and skip them."""
    import mhattn

    return lambda: mhattn.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens,
                                                 block_table=cache.block_table, backend="triton")


def time_cell(cell: DecodeCell, impls, settings: timing.TimingSettings, device) -> dict:
    """One row: microseconds per implementation (None where it failed, with the reason in ``status``), and in
    ``loop_us`` the host loop's microseconds per call of each implementation under HOST_BOUND_MS on a GPU."""
    from mhattn.backends.base import KVCache
    from mhattn.tuning.measure import HOST_BOUND_MS, HOST_LOOP_CALLS, HOST_LOOP_ROUNDS

    device = torch.device(device)
    dtype = DTYPES[cell.dtype]
    row = {"kind": "decode", **asdict(cell), "kv_bytes": cell.kv_bytes, "us": {}, "status": {}, "loop_us": {},
           "graph_us": {}, "graph_flushed_us": {}}
    short = {}  # name -> the call, for the host loops
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(cell.batch, cell.heads_q, cell.seqlen_q, cell.head_dim, device=device, dtype=dtype,
                    generator=generator)
    seqlens = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=device)

    def measure(name, make):
        if name not in impls:
            return
        try:
            fn = make()
            fn()
            row["us"][name] = 1e3 * timing.bench_ms(fn, settings.warmup_ms, settings.rep_ms, device)
            row["status"][name] = "ok"
            if device.type == "cuda" and row["us"][name] < 1e3 * HOST_BOUND_MS:
                short[name] = fn
        except Exception as error:  # a cell an implementation cannot run stays in the table, with why
            row["us"][name] = None
            row["status"][name] = timing.describe_error(error)

    contiguous = [name for name in impls if name != "paged"]
    if contiguous:
        shape = (cell.batch, cell.heads_kv, cell.seqlen_k, cell.head_dim)
        k = torch.randn(shape, device=device, dtype=dtype, generator=generator)
        v = torch.randn(shape, device=device, dtype=dtype, generator=generator)
        mask = _causal_mask(cell, device)
        bias = None if cell.seqlen_q == 1 else torch.nn.attention.bias.causal_lower_right(cell.seqlen_q, cell.seqlen_k)
        measure("sdpa", lambda: _sdpa(q, k, v, mask))
        measure("sdpa-cudnn", lambda: _sdpa(q, k, v, mask, "CUDNN_ATTENTION"))
        for name in ("triton", "cupy", "auto"):
            measure(name, lambda name=name: _attention_call(q, k, v, bias, name))
        measure("kvcache", lambda: _cache_call(q, KVCache(k, v, seqlens)))
        del k, v
        timing.release_memory(device)
    if "paged" in impls:
        def make_paged():
            k_pool, v_pool, table = _paged_pool(cell, device, generator)
            return _cache_call(q, KVCache(k_pool, v_pool, seqlens, table))

        measure("paged", make_paged)
        timing.release_memory(device)
    if short:
        loops, errors = latency.host_loops_in_turn(short, HOST_LOOP_CALLS, device, HOST_LOOP_ROUNDS)
        row["loop_us"] = loops
        for name, error in errors.items():
            row["status"][name] = f"host loop: {timing.describe_error(error)}"
        for name, fn in short.items():
            try:
                row["graph_us"][name] = 1e3 * timing.graph_replay_ms(fn, device)
                row["graph_flushed_us"][name] = 1e3 * timing.graph_replay_ms(fn, device, flush_l2=True)
            except Exception as error:  # e.g. a host read-back inside the call: no graph, and why
                row["status"][name] = f"CUDA graph: {timing.describe_error(error)}"
    return row


# ---- the table --------------------------------------------------------------------------------------------


def _us(value) -> str:
    return "-" if value is None else (f"{value:.0f}" if value >= 10 else f"{value:.1f}")


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def decode_table(rows: list) -> str:
    """The decode table: times (us), triton's speed-up over each SDPA column (their time / triton's), its
    bandwidth (GB/s), the paged cache's time over the contiguous one's, and auto's time over the fastest of
    AUTO_PEERS, on the GPU timer and in a loop (each time the larger of it and its host loop's, where looped)."""
    header = ["dtype", "B", "Nk", "Nq", "sdpa us", "cudnn us", "triton us", "cupy us", "auto us", "kvcache us",
              "paged us", "x sdpa", "x cudnn", "triton GB/s", "paged/contig", "auto/best", "auto/best loop"]
    lines = []
    for r in rows:
        us = r["us"]
        best = min((t for t in (us.get("triton"), us.get("kvcache")) if t is not None), default=None)
        bandwidth = "-" if best is None else f"{bandwidth_gbs(r['kv_bytes'], best):.0f}"
        fastest = _fastest_peer(us)
        looped = {n: max(t, r.get("loop_us", {}).get(n, 0.0)) for n, t in us.items() if t is not None}
        fastest_looped = _fastest_peer(looped)
        lines.append([r["dtype"], str(r["batch"]), _seqlen(r["seqlen_k"]), str(r["seqlen_q"]), _us(us.get("sdpa")),
                      _us(us.get("sdpa-cudnn")), _us(us.get("triton")), _us(us.get("cupy")), _us(us.get("auto")),
                      _us(us.get("kvcache")), _us(us.get("paged")),
                      _ratio(us.get("sdpa"), us.get("triton")), _ratio(us.get("sdpa-cudnn"), us.get("triton")),
                      bandwidth, _ratio(us.get("paged"), us.get("kvcache")), _ratio(us.get("auto"), fastest),
                      _ratio(looped.get("auto"), fastest_looped)])
    out = _aligned(header, lines)
    failures = [f"{r['dtype']} B={r['batch']} Nk={r['seqlen_k']} Nq={r['seqlen_q']} {name}: {status}"
                for r in rows for name, status in r["status"].items() if status != "ok"]
    for key in ("graph_us", "graph_flushed_us"):
        graphed = [r for r in rows if r.get(key)]
        if graphed:
            out += ["", graph_table(graphed, key).rstrip("\n")]
    if failures:
        out += ["", "not measured:"] + [f"  {line[:300]}" for line in failures]
    return "\n".join(out) + "\n"


def graph_table(rows: list, key: str = "graph_us") -> str:
    """The host-bound cells replayed from a CUDA graph (us per call, the GPU's work alone; ``key`` "graph_us": back
    to back, "graph_flushed_us": the L2 flushed before each call): triton's speed-up over cuDNN, the paged cache's
    time over the contiguous one's, auto's time over the fastest of AUTO_PEERS."""
    names = ("sdpa", "sdpa-cudnn", "triton", "cupy", "auto", "kvcache", "paged")
    header = (["dtype", "B", "Nk", "Nq"] + [f"{n.replace('sdpa-', '')} graph us" for n in names]
              + ["x cudnn", "paged/contig", "auto/best"])
    lines = []
    for r in rows:
        us = r[key]
        fastest = _fastest_peer(us)
        lines.append([r["dtype"], str(r["batch"]), _seqlen(r["seqlen_k"]), str(r["seqlen_q"])]
                     + [_us(us.get(n)) for n in names]
                     + [_ratio(us.get("sdpa-cudnn"), us.get("triton")), _ratio(us.get("paged"), us.get("kvcache")),
                        _ratio(us.get("auto"), fastest)])
    flush = "the L2 flushed before each" if key == "graph_flushed_us" else "no L2 flush between them"
    out = [f"host-bound cells replayed from a CUDA graph (20 calls captured, {flush}; us per call):"]
    return "\n".join(out + _aligned(header, lines)) + "\n"


def _fastest_peer(us: dict):
    """The smallest time of AUTO_PEERS in ``us`` (None where none has one)."""
    return min((us[n] for n in AUTO_PEERS if us.get(n) is not None), default=None)


def _aligned(header: list, lines: list) -> list:
    """``header``, a rule and ``lines`` (lists of cells) as right-aligned text columns two spaces apart."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    return out + ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]


def _seqlen(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def run(args) -> int:
    """``mhattn bench --decode``: time the cells the filters select and print the table."""
    import json
    import sys

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("mhattn bench --decode needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    impls = [n for n in (getattr(args, "impl", None) and _flat(args.impl)) or IMPLS]
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        print(f"mhattn bench --decode: --impl takes {', '.join(IMPLS)}; got {', '.join(unknown)}", file=sys.stderr)
        return 2
    cells = decode_cells(dtypes=args.dtype or ["bf16"], batches=args.batch or BATCHES,
                         seqlens_k=args.seqlen or SEQLENS_K, query_rows=args.nq or QUERY_ROWS,
                         head_dim=(args.head_dim or [HEAD_DIM])[0], block_size=args.block_size or BLOCK_SIZE)
    settings = timing.TimingSettings(args.warmup or 10.0, args.rep or 40.0)
    rows = []
    for i, cell in enumerate(cells):
        if not args.no_progress:
            print(f"[{i + 1}/{len(cells)}] {cell.label()}", file=sys.stderr, flush=True)
        rows.append(time_cell(cell, impls, settings, device))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"decode": rows}, f, indent=1)
    print(decode_table(rows), end="")
    return 0


def _flat(values):
    flat = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    return list(dict.fromkeys(flat))


def bandwidth_gbs(kv_bytes: int, us: float) -> float:
    """GB/s (10^9 bytes) of reading ``kv_bytes`` in ``us`` microseconds."""
    return kv_bytes / (us * 1e-6) / 1e9 if us and math.isfinite(us) else float("nan")
