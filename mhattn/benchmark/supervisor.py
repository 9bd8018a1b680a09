"""Runs the tasks of a benchmark (``mhattn bench``, ``mhattn tune``), in a worker process that a crash cannot
take the whole run down with.

A kernel that faults (an illegal address, a device-side assert) breaks the CUDA context of its process for
good; one that hangs never returns. Either would end an in-process sweep. Here the tasks run in a worker
process through the shared isolation layer (:mod:`mhattn.isolation`, with
:class:`mhattn.benchmark.worker.Runner` in the worker); when it dies, breaks its context or overruns
``task_timeout``, the task it was on is reported with what happened and a fresh worker goes on with the
next task. Inputs are drawn from seeds fixed by the shape, so every process times the same inputs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from mhattn import isolation
from mhattn.benchmark.worker import Runner, placeholder_row

RUNNER = "mhattn.benchmark.worker:Runner"


@dataclass
class Outcome:
    results: list                     # one row per task, in task order
    interrupted: bool = False         # stopped by Ctrl-C / SIGTERM
    deadline_reached: bool = False    # stopped by the time limit
    restarts: int = 0                 # fresh worker processes started after a failure
    notes: list = field(default_factory=list)


class _NullProgress:
    def start(self, label):
        pass

    def advance(self, count=1):
        pass

    def write(self, text):
        sys.stderr.write(text.rstrip("\n") + "\n")

    def close(self):
        pass


def run_tasks(tasks, *, device="cuda", isolate=True, deadline=None, task_timeout=600.0, progress=None,
              runner=RUNNER, on_result=None) -> Outcome:
    """Run ``tasks`` and return their rows. ``deadline`` (time.time()) stops starting new tasks;
    ``on_result(index, row)`` is called as each row arrives (e.g. to save partial results). ``runner``
    ('module:Class', made with ``device=``) runs the tasks in the worker."""
    progress = progress or _NullProgress()
    outcome = Outcome(results=[None] * len(tasks))
    try:
        if isolate:
            _run_isolated(tasks, outcome, device, deadline, task_timeout, progress, runner, on_result)
        else:
            _run_in_process(tasks, outcome, device, deadline, progress, on_result)
    except KeyboardInterrupt:
        outcome.interrupted = True
    for index, row in enumerate(outcome.results):
        if row is None:
            if outcome.interrupted:
                why = "not run: the run was interrupted"
            elif outcome.deadline_reached:
                why = "not run: the time limit was reached"
            else:
                why = "not run"
            outcome.results[index] = placeholder_row(tasks[index], why)
    return outcome


def _deliver(outcome, index, row, progress, on_result):
    outcome.results[index] = row
    progress.advance()
    if on_result is not None:
        on_result(index, row)


def _run_in_process(tasks, outcome, device, deadline, progress, on_result):
    runner = Runner(device)
    for index, task in enumerate(tasks):
        if isolation.past(deadline):
            outcome.deadline_reached = True
            return
        progress.start(task.get("label", ""))
        _deliver(outcome, index, runner.run(task), progress, on_result)


def _last_lines(log: str, count: int) -> str:
    return " | ".join(line.strip() for line in log.splitlines()[-count:] if line.strip())


def _run_isolated(tasks, outcome, device, deadline, task_timeout, progress, runner, on_result):
    run = isolation.IsolatedRun(tasks, runner, {"device": str(device)}, task_timeout=task_timeout,
                                deadline=deadline, on_start=lambda i: progress.start(tasks[i].get("label", "")),
                                on_output=progress.write)
    try:
        for settled in run:
            index = settled.index
            if settled.how == isolation.NOT_RUN:
                outcome.deadline_reached = True
                continue
            if settled.how == isolation.NOT_STARTED:
                if not outcome.notes or "failed to start" not in outcome.notes[-1]:
                    outcome.notes.append(f"the benchmark worker failed to start (exit code {settled.exit_code}): "
                                         f"{_last_lines(settled.log, 10)}")
                continue
            if settled.how == isolation.DONE:
                row = settled.value
                if row.get("context_broken"):
                    outcome.notes.append(f"task {index} broke the CUDA context; a fresh worker went on after it")
            else:
                if settled.how == isolation.TIMED_OUT:
                    why = f"error: timed out after {task_timeout:.0f} s (the worker process was killed)"
                else:
                    why = f"error: the worker process died (exit code {settled.exit_code}) during this task"
                last = _last_lines(settled.log, 6)
                row = placeholder_row(tasks[index], why + (f"; its last output: {last}" if last else ""))
            _deliver(outcome, index, row, progress, on_result)
    finally:
        outcome.restarts = run.restarts
