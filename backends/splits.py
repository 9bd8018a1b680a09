"""How many programs split one sequence's keys in split-KV decoding (the Triton and CuPy backends' shared rule)."""

from __future__ import annotations


def split_count(programs: int, keys: int, sm_count: int, min_keys: int, per_sm: int, max_splits: int,
                within: bool = False) -> int:
    """How many programs share the keys of one (sequence, head, row block): enough to put ``per_sm`` programs on
    every one of ``sm_count`` SMs, each with at least ``min_keys`` keys, at most ``max_splits``. One when the
    unsplit grid of ``programs`` already fills the GPU or the keys are few. ``within``: as many as keep the grid
    within ``per_sm`` programs an SM (the count rounded down), not the fewest that reach it (rounded up)."""
    if programs >= sm_count or keys <= min_keys:
        return 1
    slots = per_sm * sm_count
    wanted = slots // programs if within else -(-slots // programs)
    return max(1, min(wanted, -(-keys // min_keys), max_splits))
