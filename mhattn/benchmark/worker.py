"""Runs benchmark tasks (see plan.py; ``mhattn tune`` adds ``tune`` tasks) and turns each into a result row.

:class:`Runner` runs tasks, in this process or in a worker process of the supervisor (see supervisor.py).
When a failure has broken the CUDA context (an illegal address, a device-side assert), every later CUDA
call in the process would fail too: the runner says so (``broken``), and its worker ends right after
reporting that task, the supervisor going on in a fresh process.
"""

from __future__ import annotations

import math

import torch

from mhattn.benchmark import memory, module_bench, protocol, timing
from mhattn.cuda_health import cuda_context_ok

CHECK_AGAINST = "torch SDPA with its default kernel choice, same inputs"


def clean_for_json(value):
    """``value`` with non-finite floats replaced by None, so the JSON is strict."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean_for_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_for_json(v) for v in value]
    return value


def placeholder_row(task: dict, status: str) -> dict:
    """The result row of a task that did not run (or whose process died): its identity and ``status``."""
    if task["kind"] == "tune":
        return dict(task["cell"], kind="tune", fwd_ms={}, fwd_bwd_ms={}, skipped={}, status=status)
    if task["kind"] == "module":
        config = module_bench.ModuleConfig(**task["config"])
        row = module_bench.module_row(task["variant"], task["seqlen"], config)
        row["status"] = status
        return row
    shape = protocol.Shape(**task["shape"])
    row = {
        "kind": task["kind"], "impl": task["impl"], "family": task.get("family", ""),
        "is_reference": bool(task.get("is_reference", False)), "dtype": protocol.DTYPE_LONG_NAMES[shape.dtype],
        "d": shape.head_dim, "h": shape.heads, "b": shape.batch, "n": shape.seqlen, "causal": shape.causal,
    }
    if task["kind"] == "memory":
        row.update(peak_extra_bytes=None, beyond_outputs_bytes=None, status=status)
    else:
        row["status"] = {m: status for m in protocol.MODES if m in task["modes"]}
        for m in protocol.MODES:
            if m in task["modes"]:
                row[f"{m}_ms"] = None
                row[f"{m}_tflops"] = None
    return row


def row_failed(row: dict) -> bool:
    status = row.get("status")
    entries = status.values() if isinstance(status, dict) else [status]
    return any(isinstance(e, str) and e.startswith("error") for e in entries)


class Runner:
    """Runs tasks in this process, keeping one shape's inputs (and its check output) between tasks."""

    def __init__(self, device="cuda"):
        self.device = torch.device(device)
        self.context_broken = False
        self._table = None
        self._inputs_shape = None
        self._inputs = None
        self._check = None
        self._memory_oom = {}   # implementation -> smallest N at which its memory task ran out of memory

    @property
    def broken(self) -> bool:
        """No task can run in this process any more (see mhattn.isolation)."""
        return self.context_broken

    @property
    def table(self) -> dict:
        if self._table is None:
            self._table = protocol.implementations()
        return self._table

    def run(self, task: dict) -> dict:
        """The result row of ``task``; never raises for a failure of what is measured."""
        if self.context_broken:
            return placeholder_row(task, "skipped: an earlier failure broke the CUDA context of this process")
        if task.get("skip"):
            return placeholder_row(task, task["skip"])
        try:
            if task["kind"] == "attn":
                row = self._attention(task)
            elif task["kind"] == "memory":
                row = self._memory(task)
            elif task["kind"] == "module":
                row = self._module(task)
            elif task["kind"] == "tune":
                row = self._tune(task)
            else:
                raise ValueError(f"task kind: expected attn, memory, module or tune, got {task['kind']!r}")
        except Exception as error:  # a bug of the harness itself still leaves a row
            row = placeholder_row(task, timing.describe_error(error))
        if row_failed(row) and self.device.type == "cuda" and not cuda_context_ok():
            self.context_broken = True
            row["context_broken"] = True
        return clean_for_json(row)

    # ---- attention cells ---------------------------------------------------------------------------------
    def _implementation(self, task):
        impl = protocol.with_pairs(self.table, [task["impl"]]).get(task["impl"])
        if impl is None:
            raise LookupError(f"no implementation named {task['impl']!r}; known: {', '.join(self.table)}")
        return impl

    def _inputs_for(self, shape: protocol.Shape):
        if shape != self._inputs_shape:
            self._inputs = self._check = None
            self._inputs_shape = None
            timing.release_memory(self.device)
            self._inputs = protocol.make_inputs(shape, self.device)
            self._inputs_shape = shape
            self._check = self._check_output(shape, self._inputs)
        return self._inputs, self._check

    def _check_output(self, shape, inputs):
        q, k, v, _ = inputs
        try:
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(
                    q.detach(), k.detach(), v.detach(), is_causal=shape.causal)
        except Exception:
            return None

    def _attention(self, task):
        impl = self._implementation(task)
        shape = protocol.Shape(**task["shape"])
        settings = timing.TimingSettings(**task["timing"])
        inputs, check = self._inputs_for(shape)
        row = timing.time_attention(impl, shape, inputs, task["modes"], settings, self.device, check=check)
        row["check_against"] = CHECK_AGAINST if check is not None else None
        return row

    # ---- memory and module -------------------------------------------------------------------------------
    def _memory(self, task):
        impl = self._implementation(task)
        shape = protocol.Shape(**task["shape"])
        self._inputs = self._check = self._inputs_shape = None
        smallest_oom = self._memory_oom.get(impl.name)
        if smallest_oom is not None and shape.seqlen > smallest_oom:
            row = memory.memory_row(impl, shape)
            row["status"] = f"OOM (ran out of memory at N={smallest_oom} already; not tried)"
            return row
        row = memory.measure_peak_memory(impl, shape, self.device)
        if row["status"].startswith("OOM"):
            self._memory_oom[impl.name] = min(shape.seqlen, smallest_oom or shape.seqlen)
        return row

    def _tune(self, task):
        from mhattn.tuning.grid import Cell
        from mhattn.tuning.measure import time_cell

        self._inputs = self._check = self._inputs_shape = None
        settings = task["timing"]
        row = time_cell(Cell(**task["cell"]), self.device, settings["warmup_ms"], settings["rep_ms"], task.get("backends"))
        # An error (not a declared gap) may have broken the CUDA context: the caller checks it.
        status = next((w for w in row["skipped"].values() if w.startswith("error")), "ok")
        return dict(row, kind="tune", status=status)

    def _module(self, task):
        self._inputs = self._check = self._inputs_shape = None
        config = module_bench.ModuleConfig(**task["config"])
        return module_bench.measure_training_step(task["variant"], task["seqlen"], config, self.device)
