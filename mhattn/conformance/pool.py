"""Running a plan's cases in worker processes (``mhattn conformance --jobs N``, and ``--jobs 1`` on a GPU),
through the shared isolation layer (:mod:`mhattn.isolation`): a case that crashes its worker, hangs past
``--case-timeout`` or breaks the CUDA context fails alone, and a fresh worker goes on.

With ``--jobs N`` the cases wait in one queue, costliest first (:func:`case_cost`), so the long ones start
early and the end of the run is made of short ones spread over every worker. ``--jobs 1`` runs one worker
per backend, one backend after another. Results come back in the plan's order; the progress bar is updated
from this process. A backend that a worker cannot make (registered by a call in this process, from a class
a fresh process cannot import) runs here, after the workers are done.
"""

from __future__ import annotations

import os

from mhattn.conformance.runner import FAIL, CaseResult, not_run
from mhattn.conformance.suite import TIME_LIMIT_REASON, case_label, finish_case, run_in_process
from mhattn.isolation import (
    CRASHED, DONE, EXIT_BROKEN, NOT_RUN, NOT_STARTED, REFUSED, TIMED_OUT, IsolatedRun, Refused,
)


def auto_jobs(device: str) -> int:
    """The number of workers ``--jobs auto`` means on ``device`` ("cuda" or "cpu").

    The cases are small, so their time goes to Python, kernel compiles and the float64 gold, on the CPU:
    half the cores leaves room for the compilers' own threads. On a GPU at most 8 workers (each holds a
    CUDA context and a memory cache); on the CPU at most 4, and one on a machine of two cores or fewer,
    where the workers' start-up (importing torch) costs more than the cases.
    """
    cores = os.cpu_count() or 1
    if device == "cuda":
        return min(8, max(1, cores // 2))
    return 1 if cores <= 2 else min(4, cores // 2)


def case_cost(case) -> float:
    """A rough estimate of the work of ``case``, to start the costly cases first: the score matrix times
    the head dims, times the passes over it (the backend's forward and backward, the float64 gold, the
    reference in the input dtype, and each repeated backward of a determinism case)."""
    size = case.batch * case.heads_q * case.seqlen_q * case.seqlen_k * (case.head_dim + case.value_dim)
    return float(size) * (3 + max(case.det_runs - 1, 0))


# ---- in the worker -------------------------------------------------------------------------------------------


class CaseRunner:
    """Runs cases (``{"backend", "case", "factory"}``, see :func:`_task`) in a worker process."""

    def __init__(self):
        self.broken = False  # the CUDA context is lost: the worker ends, a fresh one runs the rest

    def run(self, task: dict) -> dict:
        import torch

        from mhattn.conformance.cases import parse_spec
        from mhattn.conformance.runner import run_case
        from mhattn.cuda_health import cuda_context_ok

        case = parse_spec(task["case"], task["backend"])
        backend = _backend(case.backend, task.get("factory", ""))
        if backend is None:
            raise Refused(f"this process cannot make the backend {case.backend!r}")
        if case.device == "cpu" and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # small CPU cases: threads only spin
        result = run_case(backend, case)
        self.broken = result.status == FAIL and case.device == "cuda" and not cuda_context_ok()
        return result.to_dict()


def _backend(name: str, factory: str):
    """The registered backend ``name``; else one made from ``factory`` ('module:Class') and registered
    here; None when neither works."""
    from mhattn import registry
    from mhattn.errors import UnknownBackendError
    from mhattn.isolation import _import

    try:
        registered = registry.get_backend(name)
    except UnknownBackendError:
        registered = None
    if registered is not None:
        cls = type(registered)
        if not factory or factory == f"{cls.__module__}:{cls.__qualname__}":
            return registered
    if not factory:
        return None
    try:
        backend = _import(factory)()
    except Exception:
        return None
    if getattr(backend, "name", None) != name:
        return None
    return registry.register_backend(backend, replace=True)


# ---- in the parent -------------------------------------------------------------------------------------------


def _factory(name: str) -> str:
    """'module:Class' for a backend whose class a fresh process can import (so a backend registered by a
    call, not an entry point, still runs isolated); '' otherwise."""
    from mhattn import registry

    try:
        cls = type(registry.get_backend(name))
    except Exception:
        return ""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return ""
    return f"{cls.__module__}:{cls.__qualname__}"


def _task(case) -> dict:
    task = {"backend": case.backend, "case": case.spec()}
    factory = _factory(case.backend)
    if factory:
        task["factory"] = factory
    return task


def _result(case, settled, case_timeout: float):
    """The CaseResult of a case the isolation layer settled; None when it must run in this process."""
    if settled.how == DONE:
        return CaseResult.from_dict(settled.value)
    if settled.how == NOT_RUN:
        return not_run(case, TIME_LIMIT_REASON)
    if settled.how == TIMED_OUT:
        why = f"timed out: no result after {case_timeout:.0f} s (the worker was killed)"
    elif settled.how == CRASHED and settled.exit_code == EXIT_BROKEN:
        why = "the CUDA context was lost during this case; a fresh worker runs the rest"
    elif settled.how == CRASHED:
        why = f"the worker process died while running this case (exit status {settled.exit_code}): {settled.log}"
    elif settled.how == NOT_STARTED:
        why = f"the worker process stopped before running any case (exit status {settled.exit_code}): {settled.log}"
    else:
        assert settled.how == REFUSED, settled.how
        return None
    return CaseResult(case, FAIL, error=why, seconds=settled.seconds)


def _run_in_workers(cases, jobs: int, progress, case_timeout: float, deadline) -> list:
    """Run ``cases`` in up to ``jobs`` workers, in the given order; results in that order."""
    results = [None] * len(cases)
    running = set()

    def on_start(index):
        running.add(index)
        if progress is not None:
            others = f" (+{len(running) - 1} running)" if len(running) > 1 else ""
            progress.start(case_label(cases[index]) + others)

    run = IsolatedRun([_task(c) for c in cases], "mhattn.conformance.pool:CaseRunner", jobs=jobs,
                      task_timeout=case_timeout, deadline=deadline, group=lambda task: task["backend"],
                      on_start=on_start)
    here = []  # cases of backends the workers cannot make
    for settled in run:
        running.discard(settled.index)
        result = _result(cases[settled.index], settled, case_timeout)
        if result is None:
            here.append(settled.index)
        else:
            results[settled.index] = result
            finish_case(progress, result)
    here.sort()
    for index, result in zip(here, run_in_process([cases[i] for i in here], progress, deadline)):
        results[index] = result
    return results


def run_parallel(cases, jobs: int, progress=None, case_timeout: float = 600.0, deadline=None) -> list:
    """Run ``cases`` in up to ``jobs`` worker processes at once, costliest first; returns results in case
    order. Cases not started by ``deadline`` (seconds since the epoch) are not run."""
    if jobs < 1:
        raise ValueError(f"run_parallel: jobs: expected a positive integer, got {jobs!r}")
    # sorted() is stable: cases of equal cost keep the plan's order
    order = sorted(range(len(cases)), key=lambda i: -case_cost(cases[i]))
    ran = _run_in_workers([cases[i] for i in order], jobs, progress, case_timeout, deadline)
    results = [None] * len(cases)
    for index, result in zip(order, ran):
        results[index] = result
    return results


def run_isolated(cases, progress=None, case_timeout: float = 600.0, deadline=None) -> list:
    """Run ``cases`` in worker processes, one at a time, a fresh worker for each backend (``--jobs 1``);
    returns results in case order. Cases not started by ``deadline`` (seconds since the epoch) are not run."""
    results = []
    start = 0
    while start < len(cases):
        end = start
        while end < len(cases) and cases[end].backend == cases[start].backend:
            end += 1
        results += _run_in_workers(cases[start:end], 1, progress, case_timeout, deadline)
        start = end
    return results
