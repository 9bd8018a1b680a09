"""Which cases a conformance run has (the plan), and running them: in this process, or one worker
process per backend so a kernel that corrupts the CUDA context, hangs or crashes the interpreter costs
only its own case (``--jobs 1``; several workers at once are :mod:`mhattn.conformance.pool`).

Worker protocol: the parent writes the cases (JSON lines) to a file, or to the worker's stdin one at a
time, and starts ``mhattn.conformance.worker`` with the parent's ``sys.path``; the worker appends
``{"start": i}`` before and ``{"result": ...}`` after each case to a results file, which the parent polls.
A worker that dies or goes silent longer than the case timeout fails the case it was running; a fresh
worker goes on with the next one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from mhattn import registry
from mhattn.conformance.cases import dtype_name, full_cases, quick_cases, default_dtypes
from mhattn.conformance.runner import FAIL, CaseResult, not_run, run_case
from mhattn.cuda_health import cuda_context_ok

# Exit status of a worker whose CUDA context is unusable after a case: the parent starts a fresh one.
WORKER_CONTEXT_LOST = 3
# Exit status of a worker that does not know the backend (registered by a call in the parent only): the
# parent runs that backend's cases itself.
WORKER_UNKNOWN_BACKEND = 4
TIME_LIMIT_REASON = "the run's time limit (--time-limit) was reached first"
# Seconds a worker may take to start (import torch and the backends, initialise CUDA) before its first case.
STARTUP_TIMEOUT = 300.0


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


def past(deadline) -> bool:
    """True once ``deadline`` (seconds since the epoch, or None for none) has passed."""
    return deadline is not None and time.time() > deadline


def case_label(case) -> str:
    """What the progress bar shows while ``case`` runs."""
    return f"{case.backend} {case.feature} {case.describe()}"


def run_in_process(cases, progress=None, deadline=None) -> list:
    """Run every case here, in order. After a CUDA context is lost the rest cannot run: they fail
    with that reason. Cases not started by ``deadline`` (seconds since the epoch) are not run."""
    results = []
    lost = None
    for case in cases:
        if past(deadline):
            result = not_run(case, TIME_LIMIT_REASON)
            results.append(result)
            if progress is not None:
                progress.finish_case(result)
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
        if progress is not None:
            progress.finish_case(result)
    return results


# ---- isolated workers -----------------------------------------------------------------------------

_WORKER_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from mhattn.conformance.worker import main; sys.exit(main(sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))"
)


def log_tail(path: str, limit: int = 1500) -> str:
    """The end of a worker's output (what a crash left there)."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:].strip()


def case_entry(case) -> dict:
    """The JSON line that hands ``case`` to a worker (see mhattn.conformance.worker)."""
    entry = {"backend": case.backend, "case": case.spec()}
    factory = _factory(case.backend)
    if factory:
        entry["factory"] = factory
    return entry


def lost_case_result(case, exit_code, log: str, timed_out: bool, case_timeout: float, seconds: float) -> CaseResult:
    """The failure of a case whose worker stopped while running it: killed for silence, a lost CUDA
    context, or a crash (with the end of the worker's output)."""
    if timed_out:
        why = f"timed out: no result after {case_timeout:.0f} s (the worker was killed)"
    elif exit_code == WORKER_CONTEXT_LOST:
        why = "the CUDA context was lost during this case; a fresh worker runs the rest"
    else:
        why = f"the worker process died while running this case (exit status {exit_code}): {log}"
    return CaseResult(case, FAIL, error=why, seconds=seconds)


def not_started_result(case, exit_code, log: str) -> CaseResult:
    """The failure of a case whose worker stopped before it ran any case (it could not start)."""
    return CaseResult(case, FAIL, error=f"the worker process stopped before running any case (exit status "
                                        f"{exit_code}): {log}")


def _factory(name: str) -> str:
    """'module:Class' for a backend whose class a fresh process can import (so a backend registered by a
    call, not an entry point, still runs isolated); '' otherwise."""
    try:
        cls = type(registry.get_backend(name))
    except Exception:
        return ""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return ""
    return f"{cls.__module__}:{cls.__qualname__}"


class WorkerProcess:
    """One worker process running ``cases`` from the first; with ``cases=None`` it takes them one at a
    time through :meth:`send` and ends after :meth:`close_input`."""

    def __init__(self, cases, folder: str, attempt: int, deadline=None):
        self.results_path = os.path.join(folder, f"results{attempt}.jsonl")
        self.log_path = os.path.join(folder, f"log{attempt}.txt")
        if cases is None:
            self.cases_path = "-"
        else:
            self.cases_path = os.path.join(folder, f"cases{attempt}.jsonl")
            with open(self.cases_path, "w", encoding="utf-8") as f:
                for case in cases:
                    f.write(json.dumps(case_entry(case)) + "\n")
        open(self.results_path, "w").close()
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, json.dumps(sys.path), self.cases_path, self.results_path,
             json.dumps(deadline)],
            stdin=subprocess.PIPE if cases is None else subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, text=True,
        )
        self._offset = 0
        self._partial = ""
        self.heard = False

    def send(self, case) -> bool:
        """Hand ``case`` to a worker started with ``cases=None``; False when it has already exited."""
        try:
            self.process.stdin.write(json.dumps(case_entry(case)) + "\n")
            self.process.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def close_input(self) -> None:
        """No more cases: the worker ends after the one it is running."""
        try:
            self.process.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def new_messages(self) -> list:
        with open(self.results_path, "r", encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next read
        messages = [json.loads(line) for line in lines if line.strip()]
        self.heard = self.heard or bool(messages)
        return messages

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stdin is not None:
            self.close_input()
        self.log.close()


@dataclass
class _Attempt:
    """What one worker did: its results arrive through the callbacks; the rest is how it ended."""

    running: object = None      # index of the case it was in when it stopped, or None
    running_since: float = 0.0  # time.monotonic() when that case started
    produced: int = 0           # results it delivered
    stopped_at: object = None   # index where it stopped for the deadline
    unknown: bool = False       # it could not make the backend
    timed_out: bool = False
    exit_code: object = None
    log: str = ""


def _follow(worker, todo, cases, case_timeout, poll_seconds, on_start, on_result) -> _Attempt:
    """Watch ``worker`` (running cases[todo]) until it exits or goes silent; kills it in the end."""
    attempt = _Attempt()
    last_news = time.monotonic()

    def handle(message):
        if "unknown_backend" in message:
            attempt.unknown = True
        elif "deadline" in message:
            attempt.stopped_at = todo[message["deadline"]]
        elif "start" in message:
            attempt.running = todo[message["start"]]
            attempt.running_since = time.monotonic()
            on_start(attempt.running)
        elif "result" in message:
            attempt.running = None
            attempt.produced += 1
            on_result(todo[message["index"]], CaseResult.from_dict(message["result"]))

    try:
        while True:
            for message in worker.new_messages():
                last_news = time.monotonic()
                handle(message)
            if worker.process.poll() is not None:
                break
            # before its first message the worker is still starting (imports, CUDA init)
            allowed = case_timeout if worker.heard else max(case_timeout, STARTUP_TIMEOUT)
            if time.monotonic() - last_news > allowed:
                attempt.timed_out = True
                break
            time.sleep(poll_seconds)
        for message in worker.new_messages():  # what it wrote before it stopped
            handle(message)
    finally:
        worker.stop()
    attempt.exit_code = worker.process.returncode
    attempt.log = log_tail(worker.log_path)
    return attempt


def run_isolated(cases, progress=None, case_timeout: float = 600.0, poll_seconds: float = 0.2, deadline=None) -> list:
    """Run ``cases`` in worker processes, one at a time, one backend after another (``--jobs 1``);
    returns results in case order. Cases not started by ``deadline`` (seconds since the epoch) are not run."""
    results = [None] * len(cases)

    def on_start(i):
        if progress is not None:
            progress.start(case_label(cases[i]))

    def on_result(i, result):
        results[i] = result
        if progress is not None:
            progress.finish_case(result)

    groups = []
    for index, case in enumerate(cases):
        if groups and groups[-1][0] == case.backend:
            groups[-1][1].append(index)
        else:
            groups.append((case.backend, [index]))
    with tempfile.TemporaryDirectory(prefix="mhattn-conformance-") as folder:
        number = 0
        for _, indices in groups:
            while True:
                pending = [i for i in indices if results[i] is None]
                if not pending:
                    break
                if past(deadline):
                    for i in pending:
                        on_result(i, not_run(cases[i], TIME_LIMIT_REASON))
                    break
                number += 1
                worker = WorkerProcess([cases[i] for i in pending], folder, number, deadline)
                attempt = _follow(worker, pending, cases, case_timeout, poll_seconds, on_start, on_result)
                if attempt.unknown or attempt.exit_code == WORKER_UNKNOWN_BACKEND:
                    rest = [i for i in indices if results[i] is None]
                    for i, result in zip(rest, run_in_process([cases[i] for i in rest], progress, deadline)):
                        results[i] = result
                    break
                if attempt.stopped_at is not None:
                    continue  # the deadline check above marks the rest
                if attempt.running is not None:
                    on_result(attempt.running, lost_case_result(
                        cases[attempt.running], attempt.exit_code, attempt.log, attempt.timed_out, case_timeout,
                        time.monotonic() - attempt.running_since))
                    continue
                if attempt.produced == 0:
                    # it never got to a case: a fresh worker would fare no better
                    for i in [i for i in indices if results[i] is None]:
                        on_result(i, not_started_result(cases[i], attempt.exit_code, attempt.log))
                    break
                # it stopped between cases (a lost CUDA context after a failed case, say): a fresh one goes on
    return results
