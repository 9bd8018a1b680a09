"""Which cases a conformance run has (the plan), and running them in this process (``--in-process``, and
``--jobs 1`` on the CPU; worker processes are :mod:`mhattn.conformance.pool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mhattn import registry
from mhattn.conformance.cases import dtype_name, full_cases, quick_cases, default_dtypes
from mhattn.conformance.runner import FAIL, CaseResult, not_run, run_case
from mhattn.cuda_health import cuda_context_ok
from mhattn.isolation import past

TIME_LIMIT_REASON = "the run's time limit (--time-limit) was reached first"


@dataclass
class Plan:
    cases: list = field(default_factory=list)        # Case, grouped by backend
    unavailable: dict = field(default_factory=dict)  # backend name -> reasons nothing runs


def make_plan(backends, mode: str, device: str, dtypes=None, features=None) -> Plan:
    """The cases of a ``quick`` or ``full`` run of ``backends`` on ``device`` ("cuda" or "cpu").

    A backend that cannot run at all here (its ``unavailable()`` reasons, or a device type it does not
    declare) is listed with its reasons instead. ``dtypes`` (names) default per backend to
    :func:`default_dtypes`; ``features`` keeps only those table columns.
    """
    plan = Plan()
    for backend in backends:
        reasons = list(backend.unavailable())
        if not reasons and device not in backend.capabilities.device_types:
            reasons = [f"runs on {sorted(backend.capabilities.device_types)} tensors, this run is on {device}"]
        if reasons:
            plan.unavailable[backend.name] = reasons
            continue
        names = [dtype_name(d) for d in dtypes] if dtypes else default_dtypes(backend, device, mode == "full")
        generate = full_cases if mode == "full" else quick_cases
        cases = generate(backend, device, names)
        if features:
            cases = [c for c in cases if c.feature in features]
        plan.cases += cases
    return plan


def case_label(case) -> str:
    """What the progress bar shows while ``case`` runs."""
    return f"{case.backend} {case.feature} {case.describe()}"


def failure_text(result) -> str:
    """What the progress bar prints for ``result`` (a CaseResult) as it happens: a failure with its
    reproduce command; '' for any other status."""
    if result.status != FAIL:
        return ""
    summary = result.summary()
    summary = summary if len(summary) <= 400 else summary[:396] + " ..."
    return (f"FAIL {result.case.backend} {result.case.feature} [{result.case.describe()}]: {summary}\n"
            f"  reproduce: {result.case.command()}")


def finish_case(progress, result) -> None:
    """Count ``result`` on ``progress`` (a :class:`mhattn.progress.Progress`, or None)."""
    if progress is not None:
        progress.advance(failure=failure_text(result))


def run_in_process(cases, progress=None, deadline=None) -> list:
    """Run every case here, in order. After a CUDA context is lost the rest cannot run: they fail
    with that reason. Cases not started by ``deadline`` (seconds since the epoch) are not run."""
    results = []
    lost = None
    for case in cases:
        if past(deadline):
            result = not_run(case, TIME_LIMIT_REASON)
            results.append(result)
            finish_case(progress, result)
            continue
        if progress is not None:
            progress.start(case_label(case))
        if lost is not None:
            result = CaseResult(case, FAIL, error=f"not run: the CUDA context was lost during an earlier case ({lost})")
        else:
            result = run_case(registry.get_backend(case.backend), case)
            if result.status == FAIL and case.device == "cuda" and not cuda_context_ok():
                lost = f"{case.backend} {case.feature}: {case.spec()}"
        results.append(result)
        finish_case(progress, result)
    return results
