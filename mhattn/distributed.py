"""Context parallelism: attention over a sequence sharded across the ranks of a ``torch.distributed`` group.

:func:`ring_attention` keeps each rank's queries in place and passes the key/value shards around a ring
of ranks. At step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) mod W`` and runs the local
attention of its queries against them on an mhattn backend (with ``return_lse``'s log-sum-exp); the
partial outputs are merged by their log-sum-exp into the result of attention over the whole sequence.
The backward walks the same ring: every rank forms its queries' gradient contributions for the visiting
shard (from the merged output and log-sum-exp, as a single-device backward does), and the dK/dV
accumulators travel around the ring with the shards until they come home.

Communication is point to point (``torch.distributed.batch_isend_irecv``: NCCL on GPUs, gloo on the CPU).
The next step's exchange starts before the current step's attention, on a side CUDA stream, so it runs
while the kernels compute.

Layouts (how the global sequence of N = W * N_local tokens maps to ranks), see :func:`shard_sequence`:

- ``"contiguous"``: rank r holds tokens [r * N_local, (r + 1) * N_local); or, with ``lengths`` (every rank's
  token count, for a sequence that does not split evenly), tokens [sum(lengths[:r]), sum(lengths[:r + 1])).
  The exchange then moves shards of different sizes (prefixes of buffers of the longest one's size).
- ``"zigzag"``: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W - 1 - r, in
  that order. With causal attention every rank then does the same work; with "contiguous" the last rank
  does 2W - 1 times the work of the first.

Causal attention per step (the global mask, seen from one (query shard, key shard) pair):

- contiguous: keys of an earlier rank are all visible, the rank's own keys are causal (top-left aligned),
  keys of a later rank are skipped.
- zigzag (chunks of C = N_local / 2 tokens; both halves of a shard are in global order, so within a shard
  the global causal mask is the local top-left causal mask): own keys causal; keys of an earlier rank s:
  chunk s is before both query chunks and chunk 2W - 1 - s after both, so every query sees the first half
  of the keys only; keys of a later rank s: chunk s and 2W - 1 - s both lie between the query chunks, so
  the second half of the queries sees all keys and the first half sees none. Every step but the diagonal
  is then a non-causal call of C x 2C or 2C x C: balanced, and no offset mask is needed.

A key-padding mask (``key_mask``, one bool per key token) travels with its keys, packed into the same message as
0 / 1 in K's dtype; each block call then masks its keys as ``mhattn.attention`` masks a bool ``attn_mask``.

With a sliding window (:func:`window_blocks`) a step makes one call per pair of a query chunk and a key chunk
that the band of global positions reaches: unmasked where the whole pair lies inside the band, else with the
window's bounds and the pair's offset in global positions (diag_offset), so the local call applies the global
band exactly. Pairs out of the band's reach compute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mhattn import dispatch
from mhattn.backends import layouts
from mhattn.backends.base import AttentionParams
from mhattn.errors import InputError
from mhattn.functional import _prepare, _uses_window
from mhattn.problem import Problem

LAYOUTS = ("contiguous", "zigzag")

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "LAYOUTS"]


# ---- layouts -----------------------------------------------------------------------------------------


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(repr(name) for name in LAYOUTS)}, got {layout!r}")
    return layout


def _chunks_of_rank(layout: str, rank: int, world: int) -> tuple:
    """Indices of the global chunks rank ``rank`` holds, in its local order. The sequence is cut into
    ``world`` chunks for "contiguous" and ``2 * world`` for "zigzag"."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def _chunk_count(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def _check_lengths(lengths, layout: str, world: int) -> Optional[tuple]:
    """``lengths`` (every rank's token count, in rank order) as a tuple of ints, or None for equal shards."""
    if lengths is None:
        return None
    if layout != "contiguous":
        raise InputError(f"lengths: shards of different lengths need layout 'contiguous', got {layout!r}")
    try:
        lengths = tuple(lengths)
    except TypeError:
        raise InputError(f"lengths must be a sequence of {world} ints (one per rank), got {lengths!r}") from None
    if len(lengths) != world or not all(type(n) is int and n >= 1 for n in lengths):
        raise InputError(f"lengths must be {world} ints >= 1 (each rank's token count, in rank order), got "
                         f"{lengths!r}")
    return lengths


def _starts(lengths) -> list:
    """The global position of each shard's first token."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _group_rank_and_size(group):
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                         "first, e.g. under torchrun)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise InputError("group: this process is not a member of the group it passed")
    return rank, dist.get_world_size(group)


def _seq_dim(x: torch.Tensor, dim: int, arg: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise InputError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for {arg} of shape {tuple(x.shape)}, "
                         f"got {dim!r}")
    return dim % x.dim()


def _local_part(x: torch.Tensor, dim: int, layout: str, rank: int, world: int) -> torch.Tensor:
    """The part of the full tensor ``x`` that rank ``rank`` of ``world`` holds (no communication)."""
    chunk = x.shape[dim] // _chunk_count(layout, world)
    parts = [x.narrow(dim, c * chunk, chunk) for c in _chunks_of_rank(layout, rank, world)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _from_parts(parts, dim: int, layout: str) -> torch.Tensor:
    """The full tensor from every rank's local part (``parts[r]`` from rank r)."""
    world = len(parts)
    pieces = [None] * _chunk_count(layout, world)
    for rank, part in enumerate(parts):
        chunks = _chunks_of_rank(layout, rank, world)
        for c, piece in zip(chunks, part.chunk(len(chunks), dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim)


def shard_sequence(x: torch.Tensor, *, group=None, layout: str = "contiguous", dim: int = -2,
                   lengths=None) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (every rank passes the same full tensor).

    Args:
        x: any shape and dtype; the sequence runs along ``dim`` (default -2, as in (B, H, N, D)). Its
            length N must be a multiple of W (the group size) for "contiguous" and of 2W for "zigzag", unless
            ``lengths`` gives the shards' lengths.
        group: the process group (default: the world group).
        layout: "contiguous" (rank r holds tokens [r * N / W, (r + 1) * N / W)) or "zigzag" (N cut into
            2W chunks, rank r holds chunks r and 2W - 1 - r, concatenated in that order).
        dim: the sequence dim.
        lengths: "contiguous" only: every rank's token count in rank order (W ints >= 1 summing to N), for
            shards of different lengths; rank r then holds tokens [sum(lengths[:r]), sum(lengths[:r + 1])).

    Returns:
        x's shape with N / W (or lengths[rank]) along ``dim``, x's dtype and device: a view for "contiguous", a
        new tensor for "zigzag". Differentiable (it is indexing).
    """
    layout = _check_layout(layout)
    dim = _seq_dim(x, dim, "x")
    rank, world = _group_rank_and_size(group)
    lengths = _check_lengths(lengths, layout, world)
    if lengths is not None:
        if sum(lengths) != x.shape[dim]:
            raise InputError(f"lengths sum to {sum(lengths)} tokens, but x has {x.shape[dim]} along dim {dim}")
        return x.narrow(dim, _starts(lengths)[rank], lengths[rank])
    parts = _chunk_count(layout, world)
    if x.shape[dim] % parts:
        raise InputError(f"x has {x.shape[dim]} tokens along dim {dim}: layout {layout!r} over {world} ranks needs "
                         f"a multiple of {parts}")
    return _local_part(x, dim, layout, rank, world)


def gather_sequence(x_local: torch.Tensor, *, group=None, layout: str = "contiguous", dim: int = -2,
                    lengths=None) -> torch.Tensor:
    """The full sequence from every rank's shard: the inverse of :func:`shard_sequence` (an all-gather).

    Args:
        x_local: this rank's shard; the same shape, dtype and device on every rank of ``group`` (but for its
            length along ``dim`` where ``lengths`` is given).
        group, layout, dim, lengths: as for :func:`shard_sequence`.

    Returns:
        x_local's shape with W times its length (or sum(lengths)) along ``dim``, on every rank. Not
        differentiable (for results and checks; gradients of a sharded model stay sharded).
    """
    layout = _check_layout(layout)
    dim = _seq_dim(x_local, dim, "x_local")
    rank, world = _group_rank_and_size(group)
    lengths = _check_lengths(lengths, layout, world)
    if lengths is not None:
        if x_local.shape[dim] != lengths[rank]:
            raise InputError(f"x_local has {x_local.shape[dim]} tokens along dim {dim}, but lengths gives rank "
                             f"{rank} {lengths[rank]}")
        # all_gather moves equal sizes: every shard padded to the longest, then cut back.
        padded = torch.zeros(*x_local.shape[:dim], max(lengths), *x_local.shape[dim + 1:], dtype=x_local.dtype,
                             device=x_local.device)
        padded.narrow(dim, 0, lengths[rank]).copy_(x_local.detach())
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, lengths)], dim)
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise InputError(f"x_local has {x_local.shape[dim]} tokens along dim {dim}: layout 'zigzag' needs an even "
                         "local length (two equal chunks)")
    contiguous = x_local.detach().contiguous()
    parts = [torch.empty_like(contiguous) for _ in range(world)]
    dist.all_gather(parts, contiguous, group=group)
    return _from_parts(parts, dim, layout)


# ---- which (query rows, key rows) pairs each ring step computes --------------------------------------


@dataclass(frozen=True)
class Block:
    """One local attention call of a ring step: rows of the local queries against rows of the visiting
    key/value shard, causal (top-left aligned within the two slices) or not. A block of a windowed call
    (window_blocks) also has the window's bounds and diag_offset, the global position of its first query row
    minus that of its first key row: key row j is visible from query row i when j - i - diag_offset lies in
    [-window_left, window_right] (None: unbounded), causal already folded into window_right."""

    q_rows: slice
    kv_rows: slice
    causal: bool
    diag_offset: int = 0
    window_left: Optional[int] = None
    window_right: Optional[int] = None

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None


def step_blocks(layout: str, rank: int, source: int, n_local: int, is_causal: bool,
                n_kv: Optional[int] = None) -> tuple:
    """The :class:`Block` calls of rank ``rank`` at the step where it holds the keys of rank ``source``
    (the module docstring derives them); n_kv: the visiting shard's length where shards differ ("contiguous"
    only; default n_local). An empty tuple: nothing to compute at this step."""
    every, every_kv = slice(0, n_local), slice(0, n_local if n_kv is None else n_kv)
    if not is_causal:
        return (Block(every, every_kv, False),)
    if source == rank:
        return (Block(every, every, True),)
    if layout == "contiguous":
        return (Block(every, every_kv, False),) if source < rank else ()
    half = n_local // 2
    if source < rank:  # chunk `source` precedes both query chunks, chunk 2W-1-source follows both
        return (Block(every, slice(0, half), False),)
    return (Block(slice(half, n_local), every, False),)  # both key chunks lie between the query chunks


def _spans(layout: str, rank: int, world: int, n_local: int, lengths: Optional[tuple]) -> list:
    """(global first position, size) of each chunk rank ``rank`` holds, in its local order."""
    if lengths is not None:
        return [(_starts(lengths)[rank], lengths[rank])]
    chunks = _chunks_of_rank(layout, rank, world)
    size = n_local // len(chunks)
    return [(chunk * size, size) for chunk in chunks]


def window_blocks(layout: str, rank: int, source: int, world: int, n_local: int, is_causal: bool,
                  window_left: Optional[int], window_right: Optional[int], lengths: Optional[tuple] = None) -> tuple:
    """The :class:`Block` calls of a windowed ring step: one per pair of a query chunk of rank ``rank`` and a
    key chunk of rank ``source`` that the band of global positions (key - query in [-window_left, right], right
    = min(window_right, 0) when causal) reaches; a pair wholly inside the band is a plain block (no mask).
    lengths: every rank's token count where shards differ ("contiguous"; n_local is then lengths[rank])."""
    right = (0 if window_right is None else min(window_right, 0)) if is_causal else window_right
    blocks, q_row = [], 0
    for q_start, q_size in _spans(layout, rank, world, n_local, lengths):
        k_row = 0
        for k_start, k_size in _spans(layout, source, world, n_local, lengths):
            offset = q_start - k_start  # global first query row minus global first key row
            lowest, highest = -offset - (q_size - 1), -offset + (k_size - 1)  # key - query over the pair
            rows, cols = slice(q_row, q_row + q_size), slice(k_row, k_row + k_size)
            k_row += k_size
            if (window_left is not None and highest < -window_left) or (right is not None and lowest > right):
                continue  # no pair of the two chunks is in the band
            inside = (window_left is None or lowest >= -window_left) and (right is None or highest <= right)
            blocks.append(Block(rows, cols, False) if inside else
                          Block(rows, cols, is_causal, offset, window_left, right))
        q_row += q_size
    return tuple(blocks)


# ---- the ring ----------------------------------------------------------------------------------------


class PeerRing:
    """Point-to-point exchange around the ranks of a group: send a buffer to the next rank, receive the
    previous rank's into another, with ``batch_isend_irecv`` (on a side stream for CUDA tensors)."""

    def __init__(self, group=None, device: Optional[torch.device] = None):
        self.group = group
        self.rank, self.size = _group_rank_and_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next_peer = dist.get_global_rank(whole, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(whole, (self.rank - 1) % self.size)
        self.stream = None
        if device is not None and device.type == "cuda":
            self.stream = _side_stream(device)

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> "_Pending":
        """Start sending ``send`` to the next rank and receiving the previous rank's into ``recv``.

        Call ``.wait()`` on the result before reading ``recv`` or writing ``send``. Both buffers must be
        free now: the exchange is ordered after all work already queued on the current stream."""
        if self.size == 1:
            recv.copy_(send)
            return _Pending([])
        ops = [dist.P2POp(dist.isend, send, self.next_peer, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_peer, self.group)]
        if self.stream is None:
            return _Pending(dist.batch_isend_irecv(ops))
        self.stream.wait_stream(torch.cuda.current_stream(send.device))
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        return _Pending(works)


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class _Pending:
    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        """Block the host (gloo) or the current CUDA stream (NCCL) until the exchange is complete."""
        for work in self.works:
            work.wait()


class _Travelling:
    """A buffer that moves one rank along the ring per step: ``current`` (``size`` elements at first) is what this
    rank holds now; ``pass_on(size)`` starts sending it to the next rank while receiving the previous rank's
    (``size`` elements) into the other buffer, ``arrive()`` waits for that exchange and makes the received buffer
    ``current``. Shards of different lengths travel as prefixes of two buffers of the longest's size
    (``capacity``)."""

    def __init__(self, ring, size: int, capacity: int, dtype, device):
        self.ring, self.pending, self.received = ring, None, None
        self.buffers = [torch.empty(capacity, dtype=dtype, device=device), None]
        self.held = 0  # which buffer holds current
        self.current = self.buffers[0][:size]

    def pass_on(self, size: int) -> None:
        other = 1 - self.held
        if self.buffers[other] is None:
            self.buffers[other] = torch.empty_like(self.buffers[self.held])
        self.received = self.buffers[other][:size]
        self.pending = self.ring.start(self.current, self.received)

    def arrive(self) -> torch.Tensor:
        self.pending.wait()
        self.pending = None
        self.held, self.current = 1 - self.held, self.received
        return self.current


# ---- packing K and V into one buffer (one message per step) ------------------------------------------


class _Shards:
    """The K/V shards of the ring: their lengths (every rank's, in rank order) and the shapes of K and V (and of the
    key mask, where the call has one) with each, so that a step unpacks the visiting shard and sizes the next
    exchange; ``grad_shapes`` / ``grad_sizes``: the same for the dK/dV accumulators, which travel without a mask."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, lengths, masked: bool = False):
        self.lengths = lengths
        self.grad_shapes = [((*k.shape[:2], n, k.shape[3]), (*v.shape[:2], n, v.shape[3])) for n in lengths]
        self.shapes = [pair + (((k.shape[0], n),) if masked else ()) for pair, n in zip(self.grad_shapes, lengths)]
        self.sizes = [_numel(shapes) for shapes in self.shapes]
        self.grad_sizes = [_numel(shapes) for shapes in self.grad_shapes]


def _numel(shapes) -> int:
    return sum(torch.Size(shape).numel() for shape in shapes)


def _pack_into(flat: torch.Tensor, tensors) -> torch.Tensor:
    for view, t in zip(_unpack(flat, [t.shape for t in tensors]), tensors):
        view.copy_(t)
    return flat


def _unpack(flat: torch.Tensor, shapes) -> list:
    views, start = [], 0
    for shape in shapes:
        count = torch.Size(shape).numel()
        views.append(flat[start:start + count].view(shape))
        start += count
    return views


# ---- local attention calls ---------------------------------------------------------------------------


def _block_call(block: Block, q, k, v, key_mask, scale: float, softcap: Optional[float], request):
    """(backend, params, q rows, k rows, v rows) of one block; key_mask: the visiting shard's (B, n) bool key
    mask (True = attend) or None."""
    q_b, k_b, v_b = q[:, :, block.q_rows], k[:, :, block.kv_rows], v[:, :, block.kv_rows]
    mask = None
    if key_mask is not None:  # as mhattn.attention's canonical mask: a view broadcast to (B, Hq, Nq, Nk)
        mask = key_mask[:, None, None, block.kv_rows].expand(q_b.shape[0], q_b.shape[1], q_b.shape[2], k_b.shape[2])
    # A causal block's diagonal is its right bound (a windowed block's right bound has causal folded in already).
    right = 0 if block.causal and block.window_right is None else block.window_right
    params = AttentionParams(scale=scale, diag_offset=block.diag_offset, window_left=block.window_left,
                             window_right=right, softcap=softcap, mask=mask)
    problem = Problem.from_tensors(q_b, k_b, v_b, params, causal=block.causal,
                                   window=_uses_window(block.window_left, block.window_right, block.causal))
    backend = dispatch.select(problem, *request)
    return backend, params, q_b, k_b, v_b


def _visiting(kv: "_Travelling", shards: _Shards, source: int) -> tuple:
    """(k, v, key mask or None) of the shard of rank ``source`` that ``kv`` holds now (the mask travels as 0 / 1 in
    K's dtype)."""
    views = _unpack(kv.current, shards.shapes[source])
    return views[0], views[1], (views[2] != 0 if len(views) == 3 else None)


def _merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_block: torch.Tensor, lse_block: torch.Tensor) -> None:
    """Fold one block's attention into the accumulators (in place), giving attention over both key sets:
    lse := log(e^lse_acc + e^lse_block), out_acc := out_acc e^(lse_acc_old - lse) + out_block e^(lse_block - lse).
    Rows that see no key in either part (both -inf) stay 0 / -inf."""
    lse_block = lse_block.to(lse_acc.dtype)
    merged = torch.logaddexp(lse_acc, lse_block)
    old_weight = torch.exp(lse_acc - merged).nan_to_num_(0.0).unsqueeze(-1)
    new_weight = torch.exp(lse_block - merged).nan_to_num_(0.0).unsqueeze(-1)
    out_acc.mul_(old_weight).add_(out_block.to(out_acc.dtype) * new_weight)
    lse_acc.copy_(merged)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    """q (B, Hq, n, D), k (B, Hkv, n, D), v (B, Hkv, n, Dv): this rank's shard (4-D, last dim contiguous); key_mask
    (B, n) bool (True = attend) or None, which travels with the keys. ``steps[s]``: the blocks of step s, where the
    ring holds the shard of rank (rank - s) mod W; ``shards``: every rank's K/V shard shapes (_Shards). Returns out
    (B, Hq, n, Dv) in q's dtype and lse (B, Hq, n) float32 (float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, ring, steps, shards, scale, softcap, request):
        acc = _accumulate_dtype(q.dtype)
        out_acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        sources = _sources(ring)
        kv = _shards_on_the_move(ring, shards, k, v, key_mask)
        for step, blocks in enumerate(steps):
            last = step + 1 == len(steps)
            if not last:
                kv.pass_on(shards.sizes[sources[step + 1]])  # the next step's shard moves while this step computes
            k_s, v_s, mask_s = _visiting(kv, shards, sources[step])
            for block in blocks:
                backend, params, q_b, k_b, v_b = _block_call(block, q, k_s, v_s, mask_s, scale, softcap, request)
                out_b, lse_b = backend.forward(q_b, k_b, v_b, params)
                _merge(out_acc[:, :, block.q_rows], lse_acc[:, :, block.q_rows], out_b, lse_b)
            if not last:
                kv.arrive()
        out = out_acc.to(q.dtype)
        lse = lse_acc.to(layouts.lse_dtype(q.dtype))
        ctx.set_materialize_grads(False)  # an unused lse (the usual case) sends no gradient
        ctx.ring, ctx.steps, ctx.shards, ctx.scale, ctx.softcap, ctx.request = (ring, steps, shards, scale, softcap,
                                                                                 request)
        ctx.save_for_backward(q, k, v, key_mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, key_mask, out, lse = ctx.saved_tensors
        ring, steps, shards = ctx.ring, ctx.steps, ctx.shards
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        acc = _accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        sources = _sources(ring) + [ring.rank]  # after the last step the accumulators go home
        kv = _shards_on_the_move(ring, shards, k, v, key_mask)
        # The dK/dV accumulator of the visiting shard: it travels with the shard, one step behind, and
        # reaches its owner after the last step. Summed in float32 (float64) as it goes.
        dkv = _Travelling(ring, shards.grad_sizes[ring.rank], max(shards.grad_sizes), acc, q.device)
        dkv.current.zero_()
        for step, blocks in enumerate(steps):
            last = step + 1 == len(steps)
            if not last:
                kv.pass_on(shards.sizes[sources[step + 1]])
            k_s, v_s, mask_s = _visiting(kv, shards, sources[step])
            grads = []
            for block in blocks:
                backend, params, q_b, k_b, v_b = _block_call(block, q, k_s, v_s, mask_s, ctx.scale, ctx.softcap,
                                                             ctx.request)
                rows = block.q_rows
                dq_b, dk_b, dv_b, _ = backend.backward(
                    grad_out[:, :, rows], q_b, k_b, v_b, out[:, :, rows], lse[:, :, rows], params,
                    grad_lse=None if grad_lse is None else grad_lse[:, :, rows])
                dq[:, :, rows] += dq_b
                grads.append((block.kv_rows, dk_b, dv_b))
            if step > 0:
                dkv.arrive()  # this shard's accumulator from the previous rank
            dk_acc, dv_acc = _unpack(dkv.current, shards.grad_shapes[sources[step]])
            for kv_rows, dk_b, dv_b in grads:
                dk_acc[:, :, kv_rows] += dk_b
                dv_acc[:, :, kv_rows] += dv_b
            dkv.pass_on(shards.grad_sizes[sources[step + 1]])  # after the last step: each accumulator goes home
            if not last:
                kv.arrive()
        dk, dv = _unpack(dkv.arrive(), shards.grad_shapes[ring.rank])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _shards_on_the_move(ring, shards: _Shards, k, v, key_mask) -> "_Travelling":
    """This rank's K, V (and key mask, as 0 / 1 in K's dtype) packed into one buffer that travels around the ring."""
    kv = _Travelling(ring, shards.sizes[ring.rank], max(shards.sizes), k.dtype, k.device)
    _pack_into(kv.current, (k, v) if key_mask is None else (k, v, key_mask.to(k.dtype)))
    return kv


def _sources(ring) -> list:
    """The rank whose shard this rank holds at each step."""
    return [(ring.rank - s) % ring.size for s in range(ring.size)]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    layout: str = "contiguous",
    window=None,
    softcap: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
    lengths=None,
    key_mask: Optional[torch.Tensor] = None,
):
    """Attention over a sequence sharded across the ranks of ``group``, differentiable.

    Every rank passes its shard (:func:`shard_sequence` cuts one); the result on each rank is the rows of
    ``mhattn.attention(q_full, k_full, v_full, is_causal=..., ...)`` that belong to its shard, and the
    gradients of q, k, v are those rows' gradients likewise.

    Args:
        q: (B, Hq, N_local, D), or (..., Hq, N_local, D) with any leading dims; float16, bfloat16, float32
            or float64 (what the backend takes).
        k: (B, Hkv, N_local, D), same dtype and device. v: (B, Hkv, N_local, Dv).
            N_local (unless ``lengths`` is given) and every other dim must be the same on every rank (not
            checked: a mismatch fails or hangs inside the exchange).
        group: the process group whose ranks hold the shards, in rank order (default: the world group).
            Its backend moves the shards: NCCL for CUDA tensors, gloo for CPU tensors.
        is_causal: causal over the global sequence (token i sees tokens j <= i).
        scale: score scale; default 1 / sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (K and V are never repeated).
        layout: "contiguous" or "zigzag" (see :func:`shard_sequence`); zigzag needs an even N_local.
        window: (left, right) around each token's global position, as in :func:`mhattn.attention` (-1/None
            unbounded; with ``is_causal`` the right bound is at most 0). Steps whose keys lie wholly outside
            the window compute nothing (their shards still pass through).
        softcap: scores become softcap * tanh(scores / softcap), as in :func:`mhattn.attention`.
        return_lse: also return the log-sum-exp over the whole sequence (..., Hq, N_local), float32 (float64
            for float64 inputs); its gradient is supported.
        backend: the mhattn backend that runs the local attention (as ``mhattn.attention``'s argument).
        lengths: shards of different lengths ("contiguous" only): every rank's N_local in rank order, the same
            on every rank (:func:`shard_sequence` cuts such shards); rank r holds global tokens
            [sum(lengths[:r]), sum(lengths[:r + 1])).
        key_mask: bool (..., N_local) with q's leading dims: True where this rank's key (and value) token takes
            part, False for padding, the same for every query and head (a key-padding mask, in SDPA's sense of a
            boolean attn_mask: True = attend). It travels around the ring with its keys. A query that sees no
            key gives 0 (and lse -inf), as in :func:`mhattn.attention`.

    Returns:
        (..., Hq, N_local, Dv) in q's dtype; with ``return_lse`` a tuple ``(out, lse)``.
    """
    layout = _check_layout(layout)
    if not isinstance(is_causal, bool):
        raise InputError(f"is_causal must be a bool, got {is_causal!r}")
    # The canonical call of mhattn.attention's argument handling: (q, k, v, mask, scale, ..., out_shape).
    call = _prepare(q, k, v, None, 0.0, False, scale, enable_gqa, window, softcap)
    q, k, v, scale, out_shape = call[0], call[1], call[2], call[4], call[-1]
    window_left, window_right, softcap = call[8], call[9], call[10]
    if q.shape[-2] != k.shape[-2]:
        raise InputError(f"q and k must hold the same tokens of the sequence: N_local {q.shape[-2]} for q, "
                         f"{k.shape[-2]} for k")
    n_local = q.shape[-2]
    if layout == "zigzag" and n_local % 2:
        raise InputError(f"layout 'zigzag' holds two equal chunks per rank: N_local must be even, got {n_local}")
    rank, world = _group_rank_and_size(group)
    lengths = _check_lengths(lengths, layout, world)
    if lengths is not None and lengths[rank] != n_local:
        raise InputError(f"lengths gives rank {rank} {lengths[rank]} tokens, but its q holds N_local = {n_local}")
    comm_backend = str(dist.get_backend(group)).lower()
    if comm_backend == "nccl" and q.device.type != "cuda":
        raise InputError(f"group uses NCCL, which moves CUDA tensors only; q is on {q.device}")
    key_mask = _check_key_mask(key_mask, out_shape[:-3], n_local, q)
    request = dispatch.requested(backend)
    ring = PeerRing(group, q.device)
    out, lse = _run_ring(q, k, v, ring, layout, is_causal, scale, request, (window_left, window_right), softcap,
                         lengths, key_mask)
    out = out.reshape(out_shape)
    if return_lse:
        return out, lse.reshape(out_shape[:-1])
    return out


def _check_key_mask(key_mask, leading: tuple, n_local: int, q: torch.Tensor) -> Optional[torch.Tensor]:
    """ring_attention's key_mask as (B, N_local) bool, B being q's leading dims collapsed, or None."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
        raise InputError(f"key_mask must be a bool tensor (True = attend), got "
                         f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}")
    if tuple(key_mask.shape) != (*leading, n_local):
        raise InputError(f"key_mask must have shape (..., N_local) = {(*leading, n_local)} (q's leading dims, then "
                         f"this rank's tokens), got {tuple(key_mask.shape)}")
    if key_mask.device != q.device:
        raise InputError(f"key_mask must be on q's device ({q.device}), got {key_mask.device}")
    return key_mask.reshape(q.shape[0], n_local)


def _run_ring(q, k, v, ring, layout, is_causal, scale, request, window=(None, None), softcap=None, lengths=None,
              key_mask=None):
    """The ring on canonical 4-D tensors with a given ring object (``PeerRing``, or a stand-in with the
    same ``rank``, ``size`` and ``start(send, recv)`` for timing the computation alone); lengths: every rank's
    shard length, or None for equal shards; key_mask: (B, N_local) bool or None."""
    n_local = q.shape[-2]
    shards = _Shards(k, v, lengths if lengths is not None else (n_local,) * ring.size, key_mask is not None)
    sources = _sources(ring)
    if window == (None, None):
        steps = [step_blocks(layout, ring.rank, source, n_local, is_causal, shards.lengths[source])
                 for source in sources]
    else:
        steps = [window_blocks(layout, ring.rank, source, ring.size, n_local, is_causal, *window, lengths)
                 for source in sources]
    return _RingAttention.apply(q, k, v, key_mask, ring, steps, shards, scale, softcap, request)
