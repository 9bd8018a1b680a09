"""One rank of the CPU ring-attention check (run by tests/test_distributed.py, one process per rank):

    python tests/ring_worker.py RANK WORLD INIT_FILE [BACKEND]

Joins a gloo group through INIT_FILE, then for each case compares ring_attention on this rank's shard
with mhattn.attention over the whole sequence in float64 (reference backend): output, log-sum-exp and the
gradients of q, k, v, with shards of equal lengths and of different ones (UNEVEN), and with a key-padding mask.
Every rank draws the same full inputs from one seed. Prints one line per case and exits 1 if any differs. BACKEND: "reference" (default; float64 inputs, every case) or "triton" (run with
TRITON_INTERPRET=1: float32 inputs, a few cases; the kernels' backward then gets the merged output and
log-sum-exp of the whole sequence, and views of the shards, as on a GPU).
"""

import datetime
import sys

import torch
import torch.distributed as dist

import mhattn
from mhattn.conformance.tolerance import compare
from mhattn.distributed import gather_sequence, ring_attention, shard_sequence

# (layout, is_causal, Hq, Hkv, D, Dv, with an lse gradient, leading batch dims[, window and softcap])
CASES = [
    ("contiguous", False, 4, 4, 8, 8, False, (2,)),
    ("contiguous", True, 4, 4, 8, 8, False, (2,)),
    ("contiguous", True, 4, 2, 8, 8, True, (2,)),
    ("contiguous", False, 6, 2, 8, 5, False, ()),
    ("zigzag", False, 4, 4, 8, 8, True, (2,)),
    ("zigzag", True, 4, 4, 8, 8, False, (2,)),
    ("zigzag", True, 6, 2, 8, 8, True, (1, 2)),
    ("zigzag", True, 4, 1, 8, 5, False, (2,)),
    # Windows around the global positions that cross shard boundaries (6 tokens a rank), with softcap.
    ("contiguous", True, 4, 2, 8, 8, True, (2,), dict(window=(4, -1), softcap=3.0)),
    ("contiguous", False, 4, 4, 8, 8, False, (2,), dict(window=(2, 5))),
    ("zigzag", True, 6, 2, 8, 8, True, (1, 2), dict(window=(7, 0), softcap=2.0)),
    ("zigzag", False, 4, 4, 8, 5, False, (2,), dict(window=(3, 3))),
    ("zigzag", False, 4, 4, 8, 8, False, (2,), dict(softcap=1.5)),
    # Shards of different lengths (UNEVEN: every rank's token count), plain, causal, and windowed across them.
    ("contiguous", False, 4, 2, 8, 5, True, (2,), dict(lengths="uneven")),
    ("contiguous", True, 4, 4, 8, 8, False, (2,), dict(lengths="uneven")),
    ("contiguous", True, 6, 2, 8, 8, True, (1, 2), dict(lengths="uneven", window=(5, 0), softcap=2.0)),
    # A key-padding mask (key_mask) that travels with its keys; one batch entry sees no key at all.
    ("contiguous", True, 4, 2, 8, 8, True, (3,), dict(key_mask=True)),
    ("zigzag", False, 4, 4, 8, 5, False, (3,), dict(key_mask=True, window=(4, 2))),
    ("contiguous", False, 6, 2, 8, 8, True, (1, 3), dict(key_mask=True, lengths="uneven")),
]
# Shard lengths of the uneven cases, by group size.
UNEVEN = {1: (7,), 2: (9, 4), 3: (5, 11, 3)}


# The cases run through the kernels on the CPU (Triton's interpreter, the CUDA kernels' emulator): slow, so
# few and small; head dim 32 (the CUDA kernels' smallest).
KERNEL_CASES = [("contiguous", True, 4, 4, 32, 32, False, (2,)), ("zigzag", False, 4, 4, 32, 32, True, (2,)),
                ("zigzag", True, 6, 2, 32, 32, True, (1, 2)),
                ("zigzag", True, 4, 2, 32, 32, False, (2,), dict(window=(11, 0), softcap=4.0)),
                ("contiguous", True, 4, 2, 32, 32, True, (2,), dict(lengths="uneven")),
                ("zigzag", True, 4, 2, 32, 32, True, (3,), dict(key_mask=True))]


def register_emulated_cupy():
    """The CuPy backend's CUDA kernels on CPU tensors through their host-side emulator, as "cupy-emulated"."""
    from mhattn.backends.base import Capabilities
    from mhattn.backends.cupy import CupyBackend
    from mhattn.backends.cupy.emulator import EmulatorLauncher

    class EmulatedCupy(CupyBackend):
        name = "cupy-emulated"
        capabilities = Capabilities(**{**CupyBackend.capabilities.__dict__, "device_types": frozenset({"cpu"}),
                                       "min_compute_capability": None})

        def unavailable(self):
            return []

    mhattn.register_backend(EmulatedCupy(launcher=EmulatorLauncher(), compute_capability=(9, 0), deterministic=False))


def check_case(case, world: int, chunk: int, dtype=torch.float64, backend: str = "reference") -> list:
    layout, causal, heads_q, heads_kv, dim, dim_v, lse_grad, batch, *rest = case
    features = dict(rest[0]) if rest else {}  # window, softcap, lengths, key_mask
    lengths = UNEVEN[world] if features.pop("lengths", None) else None
    masked = features.pop("key_mask", False)
    n = sum(lengths) if lengths else 2 * world * chunk
    gen = torch.Generator().manual_seed(1234)
    key_mask = None
    if masked:  # about a quarter of the keys padded out; the first batch entry's keys all
        key_mask = torch.rand(*batch, n, generator=gen) > 0.25
        key_mask.view(-1, n)[0] = False
    q = torch.randn(*batch, heads_q, n, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(*batch, heads_kv, n, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(*batch, heads_kv, n, dim_v, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(*batch, heads_q, n, dim_v, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(*batch, heads_q, n, generator=gen, dtype=torch.float64) if lse_grad else None
    gqa = heads_q != heads_kv

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if key_mask is not None:  # the same mask as mhattn.attention's attn_mask, broadcast over heads and queries
        features_full = dict(features, attn_mask=key_mask[..., None, None, :])
        if causal:  # a causal mask object and an attn_mask do not mix: the causal part as a bool mask too
            rows = torch.arange(n)
            features_full["attn_mask"] = features_full["attn_mask"] & (rows[None, :] <= rows[:, None])
    else:
        features_full = features
    out, lse = mhattn.attention(*full, is_causal=causal and key_mask is None, enable_gqa=gqa, return_lse=True,
                                backend="reference", **features_full)
    _backward(out, lse, grad_out, grad_lse)

    def shard(t, dim=-2):
        return shard_sequence(t, layout=layout, dim=dim, lengths=lengths)

    local = [shard(t).detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    local_mask = None if key_mask is None else shard(key_mask, -1)
    out_l, lse_l = ring_attention(*local, is_causal=causal, enable_gqa=gqa, layout=layout, return_lse=True,
                                  backend=backend, lengths=lengths, key_mask=local_mask, **features)
    _backward(out_l, lse_l, shard(grad_out).to(dtype), None if grad_lse is None else shard(grad_lse, -1).to(dtype))

    golds = [out, lse] + [t.grad for t in full]
    lowps = [None] * 5
    if dtype in (torch.float16, torch.bfloat16):  # CONFORMANCE.md's rule: the reference in dtype sets the bar
        low = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        low_out, low_lse = mhattn.attention(*low, is_causal=causal and key_mask is None, enable_gqa=gqa,
                                            return_lse=True, backend="reference", **features_full)
        _backward(low_out, low_lse, grad_out.to(dtype), None if grad_lse is None else grad_lse.to(dtype))
        lowps = [low_out, low_lse] + [t.grad for t in low]
    results = []
    for name, mine, gold, lowp in zip(("out", "lse", "dq", "dk", "dv"), [out_l, lse_l] + [t.grad for t in local],
                                      golds, lowps):
        seq_dim = -1 if name == "lse" else -2
        results.append(compare(name, mine, shard(gold, seq_dim), None if lowp is None else shard(lowp, seq_dim),
                               dtype=dtype))
    return results


def _backward(out, lse, grad_out, grad_lse):
    loss = (out * grad_out).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse).sum()
    loss.backward()


def check_round_trip(world: int) -> list:
    failures = []
    x = torch.arange(2 * 3 * 4 * world * 5, dtype=torch.float32).view(2, 3, 4 * world, 5)
    for layout in ("contiguous", "zigzag"):
        for dim in (-2, 2, 0 if world <= 2 else -2):
            if x.shape[dim] % (2 * world if layout == "zigzag" else world):
                continue
            part = shard_sequence(x, layout=layout, dim=dim)
            back = gather_sequence(part, layout=layout, dim=dim)
            if not torch.equal(back, x):
                failures.append(f"gather_sequence(shard_sequence(x)) != x for layout {layout}, dim {dim}")
    lengths = UNEVEN[world]
    x = torch.arange(2 * sum(lengths) * 3, dtype=torch.float32).view(2, sum(lengths), 3)
    part = shard_sequence(x, dim=1, lengths=lengths)
    if part.shape[1] != lengths[dist.get_rank()] or not torch.equal(gather_sequence(part, dim=1, lengths=lengths), x):
        failures.append(f"gather_sequence(shard_sequence(x)) != x for lengths {lengths}")
    return failures


def main() -> int:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    backend = sys.argv[4] if len(sys.argv) > 4 else "reference"
    failed = check_round_trip(world)
    if backend == "cupy-emulated":
        register_emulated_cupy()
    for case in CASES if backend == "reference" else KERNEL_CASES:
        if backend == "reference":
            results = check_case(case, world, chunk=3)
        elif backend == "triton":
            results = check_case(case, world, chunk=8, dtype=torch.float32, backend=backend)
        else:
            results = check_case(case, world, chunk=8, dtype=torch.bfloat16, backend=backend)
        bad = [str(r) for r in results if not r.ok]
        print(f"rank {rank}: {case}: {'ok' if not bad else 'FAIL ' + '; '.join(bad)}", flush=True)
        failed += bad
    dist.barrier()
    dist.destroy_process_group()
    for line in failed:
        print(f"rank {rank}: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
