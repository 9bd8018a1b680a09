"""Running a plan's cases in several worker processes at once (``mhattn conformance --jobs N``).

The cases wait in one queue, costliest first (:func:`case_cost`), so the long ones start early and the
end of the run is made of short ones spread over every worker. A worker is handed one case at a time on
its stdin as soon as it is free, so no case waits behind a long one while another worker is idle.

The guarantees of the one-worker run (:func:`mhattn.conformance.suite.run_isolated`) hold: a worker that
dies, loses its CUDA context or goes silent past the case timeout fails only the case it was running, and
a fresh worker takes its place; cases not started by the deadline are not run; results come back in the
plan's order; the progress bar is updated from this process. A backend that a worker cannot make
(registered by a call in this process, from a class a fresh process cannot import) runs here, after the
workers are done.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from mhattn.conformance.runner import CaseResult, not_run
from mhattn.conformance.suite import (
    STARTUP_TIMEOUT, TIME_LIMIT_REASON, WORKER_CONTEXT_LOST, WORKER_UNKNOWN_BACKEND, WorkerProcess, case_label,
    log_tail, lost_case_result, not_started_result, past, run_in_process,
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


@dataclass
class _Slot:
    """One worker of the pool and the case it holds (an index into the plan), if any."""

    worker: WorkerProcess
    case: Optional[int] = None      # handed to the worker, no result yet
    started: Optional[float] = None  # time.monotonic() when the worker said it began that case
    sent: list = field(default_factory=list)  # plan index of every case handed to it, in order
    last_news: float = field(default_factory=time.monotonic)
    retiring: bool = False          # its input is closed: it ends instead of taking another case


class _Pool:
    def __init__(self, cases, jobs: int, folder: str, progress, case_timeout: float, deadline):
        self.cases = cases
        self.jobs = jobs
        self.folder = folder
        self.progress = progress
        self.case_timeout = case_timeout
        self.deadline = deadline
        self.results = [None] * len(cases)
        # sorted() is stable: cases of equal cost keep the plan's order
        self.queue = deque(sorted(range(len(cases)), key=lambda i: -case_cost(cases[i])))
        self.slots = []
        self.workers_started = 0
        self.a_worker_started = False  # some worker has said something: workers can start on this machine
        self.requeued = set()          # cases handed out again once already (their worker died before them)
        self.parent_backends = set()   # backends the workers cannot make
        self.in_parent = []            # their cases, run in this process at the end

    # ---- the loop ----

    def run(self, poll_seconds: float) -> list:
        try:
            while self.queue or any(slot.case is not None for slot in self.slots):
                for slot in list(self.slots):
                    self._watch(slot)
                if past(self.deadline):
                    while self.queue:
                        index = self.queue.popleft()
                        self._deliver(index, not_run(self.cases[index], TIME_LIMIT_REASON))
                self._hand_out()
                time.sleep(poll_seconds)
        finally:
            # every case is settled: what a worker has left to do is the interpreter's teardown (a second
            # or more with torch loaded), which nothing waits for
            for slot in self.slots:
                slot.worker.stop()
        if self.in_parent:
            rest = sorted(self.in_parent)
            for index, result in zip(rest, run_in_process([self.cases[i] for i in rest], self.progress,
                                                          self.deadline)):
                self.results[index] = result
        return self.results

    def _hand_out(self):
        for slot in self.slots:
            if slot.case is None and not slot.retiring:
                if self.queue:
                    self._send(slot, self.queue.popleft())
                else:
                    slot.worker.close_input()
                    slot.retiring = True
        while self.queue and sum(not slot.retiring for slot in self.slots) < self.jobs:
            self.workers_started += 1
            slot = _Slot(WorkerProcess(None, self.folder, self.workers_started, self.deadline))
            self.slots.append(slot)
            self._send(slot, self.queue.popleft())

    def _send(self, slot: _Slot, index: int):
        slot.case, slot.started, slot.last_news = index, None, time.monotonic()
        slot.sent.append(index)
        # a worker that has exited is noticed by _watch on the next round
        slot.worker.send(self.cases[index])

    # ---- one worker ----

    def _watch(self, slot: _Slot):
        exited = slot.worker.process.poll() is not None  # asked first: what it wrote before exiting is read below
        for message in slot.worker.new_messages():
            slot.last_news = time.monotonic()
            self.a_worker_started = True
            self._handle(slot, message)
        if exited:
            self.slots.remove(slot)
            slot.worker.stop()
            self._worker_ended(slot)
        elif slot.case is not None and self._silent_too_long(slot):
            self.slots.remove(slot)
            slot.worker.stop()
            # silent since the case started, or since it was handed over when it never started
            self._deliver(slot.case, lost_case_result(self.cases[slot.case], slot.worker.process.returncode, "",
                                                      True, self.case_timeout, time.monotonic() - slot.last_news))

    def _silent_too_long(self, slot: _Slot) -> bool:
        # before its first message the worker is still starting (imports, CUDA init)
        allowed = self.case_timeout if slot.worker.heard else max(self.case_timeout, STARTUP_TIMEOUT)
        return time.monotonic() - slot.last_news > allowed

    def _handle(self, slot: _Slot, message: dict):
        if "unknown_backend" in message:
            slot.retiring = True  # the worker ends after this message: it must not be handed another case
            self._run_backend_here(message["unknown_backend"], slot)
        elif "deadline" in message:
            slot.retiring = True  # likewise
            index = slot.sent[message["deadline"]]
            self._deliver(index, not_run(self.cases[index], TIME_LIMIT_REASON))
            slot.case = None
        elif "start" in message:
            slot.started = time.monotonic()
            if self.progress is not None:
                running = sum(s.started is not None for s in self.slots)
                others = f" (+{running - 1} running)" if running > 1 else ""
                self.progress.start(case_label(self.cases[slot.sent[message["start"]]]) + others)
        elif "result" in message:
            slot.case, slot.started = None, None
            self._deliver(slot.sent[message["index"]], CaseResult.from_dict(message["result"]))

    def _worker_ended(self, slot: _Slot):
        """``slot``'s worker has exited (its messages are handled): settle the case it held, if any."""
        if slot.case is None:
            return  # between cases: its input was closed, the deadline passed, or its CUDA context was lost
        code = slot.worker.process.returncode
        if code == WORKER_UNKNOWN_BACKEND:
            self._run_backend_here(self.cases[slot.case].backend, slot)
        elif slot.started is not None:
            self._deliver(slot.case, lost_case_result(self.cases[slot.case], code, log_tail(slot.worker.log_path),
                                                      False, self.case_timeout, time.monotonic() - slot.started))
        elif code == WORKER_CONTEXT_LOST or (self.a_worker_started and slot.case not in self.requeued):
            # It stopped before it began this case: its CUDA context broke in the case before (the worker
            # ends then, but it may have been handed this one first), or it died where other workers run.
            # Not this case's doing: it goes again (once, unless a lost context explains it).
            if code != WORKER_CONTEXT_LOST:
                self.requeued.add(slot.case)
            self.queue.appendleft(slot.case)
        else:
            log = log_tail(slot.worker.log_path)
            self._deliver(slot.case, not_started_result(self.cases[slot.case], code, log))
            if not self.a_worker_started:
                # no worker has got as far as a first message: a fresh one would fare no better
                while self.queue:
                    index = self.queue.popleft()
                    self._deliver(index, not_started_result(self.cases[index], code, log))

    def _run_backend_here(self, backend: str, slot: _Slot):
        """The workers cannot make ``backend``: its cases, the one ``slot`` holds included, run here later."""
        self.parent_backends.add(backend)
        if slot.case is not None:
            self.in_parent.append(slot.case)
            slot.case = None
        self.in_parent += [i for i in self.queue if self.cases[i].backend in self.parent_backends]
        self.queue = deque(i for i in self.queue if self.cases[i].backend not in self.parent_backends)

    def _deliver(self, index: int, result):
        self.results[index] = result
        if self.progress is not None:
            self.progress.finish_case(result)


def run_parallel(cases, jobs: int, progress=None, case_timeout: float = 600.0, poll_seconds: float = 0.05,
                 deadline=None) -> list:
    """Run ``cases`` in up to ``jobs`` worker processes at once; returns results in case order. Cases not
    started by ``deadline`` (seconds since the epoch) are not run."""
    if jobs < 1:
        raise ValueError(f"run_parallel: jobs: expected a positive integer, got {jobs!r}")
    with tempfile.TemporaryDirectory(prefix="mhattn-conformance-") as folder:
        return _Pool(cases, jobs, folder, progress, case_timeout, deadline).run(poll_seconds)
