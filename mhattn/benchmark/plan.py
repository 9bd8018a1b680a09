"""What one ``mhattn bench`` run measures, as a list of tasks (plain dicts, so a worker process can take them).

Three kinds of task:
- ``attn``: one implementation on one protocol shape, the modes asked for (see timing.time_attention);
- ``memory``: peak extra memory of one implementation's forward+backward at one N (see memory.py);
- ``module``: training steps of the encoder with one attention module at one N (see module_bench.py).

Order: the memory table and the module benchmark first (a few seconds each), then the sweep, dtype by
dtype, head dim by head dim: a run cut short by its time limit loses the last cells of the sweep, not
whole sections. Within the sweep, every implementation runs on one shape's inputs before the next
shape's are drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mhattn.benchmark import memory, module_bench, protocol
from mhattn.benchmark.timing import TimingSettings


@dataclass
class Selection:
    """The filters of one run. Defaults: the full protocol of PERFORMANCE.md."""

    impls: list = field(default_factory=list)            # implementation names, display order
    dtypes: list = field(default_factory=lambda: ["bf16"])
    head_dims: list = field(default_factory=lambda: list(protocol.HEAD_DIMS))
    seqlens: list = field(default_factory=lambda: list(protocol.SEQLENS))
    causal: list = field(default_factory=lambda: [False, True])
    modes: list = field(default_factory=lambda: ["fwd", "bwd", "fwd_bwd"])
    sweep: bool = True
    memory: bool = False
    memory_seqlens: list = field(default_factory=lambda: list(memory.SEQLENS))
    module: bool = False
    module_seqlens: list = field(default_factory=lambda: list(module_bench.SEQLENS))
    module_variants: list = field(default_factory=list)  # empty: torch + one per selected mhattn backend
    module_config: module_bench.ModuleConfig = field(default_factory=module_bench.ModuleConfig)
    timing: TimingSettings = field(default_factory=TimingSettings)
    tokens: int = protocol.TOKENS
    reference_max_n: int = 0                              # 0: no cap (the memory estimate still applies)


def module_variants(selection: Selection, table: dict) -> list:
    if selection.module_variants:
        return list(selection.module_variants)
    variants = [module_bench.TORCH_VARIANT]
    for name in selection.impls:
        impl = table.get(name)
        if impl is not None and impl.family == "mhattn" and not impl.is_reference and name != "auto":
            variants.append(f"{module_bench.MHATTN_VARIANT}:{name}")
    if len(variants) == 1:
        variants.append(module_bench.MHATTN_VARIANT)
    return variants


def _identity(impl) -> dict:
    return {"impl": impl.name, "family": impl.family, "is_reference": impl.is_reference}


def sweep_tasks(selection: Selection, table: dict, dtype: str) -> list:
    tasks = []
    impls = [table[n] for n in selection.impls if n in table]
    for head_dim in selection.head_dims:
        for seqlen in selection.seqlens:
            for causal in selection.causal:
                shape = protocol.protocol_shape(dtype, head_dim, seqlen, causal, tokens=selection.tokens)
                for impl in impls:
                    task = {"kind": "attn", **_identity(impl), "shape": shape.as_dict(),
                            "modes": list(selection.modes), "timing": selection.timing.as_dict(),
                            "label": f"{shape.dtype} d={head_dim} N={seqlen} "
                                     f"{'causal' if causal else 'full'} {impl.name}"}
                    if impl.is_reference and selection.reference_max_n and seqlen > selection.reference_max_n:
                        task["skip"] = (f"skipped: reference capped at N <= {selection.reference_max_n} "
                                        "(--reference-max-n)")
                    tasks.append(task)
    return tasks


def memory_tasks(selection: Selection, table: dict) -> list:
    tasks = []
    for name in selection.impls:
        if name not in table:
            continue
        impl = table[name]
        for seqlen in sorted(selection.memory_seqlens):
            shape = memory.memory_shape(seqlen, selection.dtypes[0] if selection.dtypes else "bf16")
            tasks.append({"kind": "memory", **_identity(impl), "shape": shape.as_dict(),
                          "label": f"memory N={seqlen} {impl.name}"})
    return tasks


def module_tasks(selection: Selection, table: dict) -> list:
    tasks = []
    for seqlen in selection.module_seqlens:
        for variant in module_variants(selection, table):
            tasks.append({"kind": "module", "variant": variant, "seqlen": seqlen,
                          "config": selection.module_config.as_dict(), "label": f"module N={seqlen} {variant}"})
    return tasks


def plan_tasks(selection: Selection, table: dict) -> list:
    """Every task of the run, in the order they run (see the module docstring)."""
    tasks = []
    if selection.memory:
        tasks += memory_tasks(selection, table)
    if selection.module:
        tasks += module_tasks(selection, table)
    if selection.sweep:
        for dtype in selection.dtypes:
            tasks += sweep_tasks(selection, table, dtype)
    return tasks


def timed_calls(tasks: list) -> int:
    """How many do_bench calls the attention tasks make (for choosing warm-up/rep lengths)."""
    count = 0
    for task in tasks:
        if task["kind"] != "attn":
            continue
        modes = set(task["modes"])
        if "bwd" in modes and task["timing"]["bwd_method"] == "subtract":
            modes |= {"fwd", "fwd_bwd"}
        count += len(modes - ({"bwd"} if task["timing"]["bwd_method"] == "subtract" else set()))
    return count
