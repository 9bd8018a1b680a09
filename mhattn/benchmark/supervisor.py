"""Runs the tasks of a benchmark, in a worker process that a crash cannot take the whole run down with.

A kernel that faults (an illegal address, a device-side assert) breaks the CUDA context of its process
for good; one that hangs never returns. Either would end an in-process sweep. Here the tasks run in a
worker process (``python -m mhattn.benchmark.worker``); when it dies, breaks its context or overruns
``task_timeout``, the task it was on is reported with what happened and a fresh worker goes on with the
next task. Inputs are drawn from seeds fixed by the shape, so every process times the same inputs.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mhattn.benchmark.worker import EXIT_CONTEXT_BROKEN, Runner, placeholder_row

WORKER_COMMAND = (sys.executable, "-m", "mhattn.benchmark.worker")


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
              worker_command=WORKER_COMMAND, on_result=None) -> Outcome:
    """Run ``tasks`` and return their rows. ``deadline`` (time.time()) stops starting new tasks;
    ``on_result(index, row)`` is called as each row arrives (e.g. to save partial results)."""
    progress = progress or _NullProgress()
    outcome = Outcome(results=[None] * len(tasks))
    try:
        if isolate:
            _run_isolated(tasks, outcome, device, deadline, task_timeout, progress, worker_command, on_result)
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
        if deadline and time.time() > deadline:
            outcome.deadline_reached = True
            return
        progress.start(task.get("label", ""))
        _deliver(outcome, index, runner.run(task), progress, on_result)


class _Lines:
    """Splits bytes read from a pipe into complete lines."""

    def __init__(self):
        self._pending = b""

    def feed(self, data: bytes) -> list:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]

    def rest(self) -> list:
        rest, self._pending = self._pending, b""
        return [rest.decode("utf-8", "replace")] if rest else []


def _run_isolated(tasks, outcome, device, deadline, task_timeout, progress, worker_command, on_result):
    with tempfile.TemporaryDirectory(prefix="mhattn_bench_") as folder:
        task_file = os.path.join(folder, "tasks.json")
        with open(task_file, "w") as f:
            json.dump(tasks, f)
        start = 0
        while start < len(tasks):
            if deadline and time.time() > deadline:
                outcome.deadline_reached = True
                return
            finished, next_start = _one_worker(tasks, start, task_file, outcome, device, deadline, task_timeout,
                                               progress, worker_command, on_result)
            if finished:
                return
            if next_start <= start:  # the worker died before starting anything: it would again
                return
            outcome.restarts += 1
            start = next_start


def _one_worker(tasks, start, task_file, outcome, device, deadline, task_timeout, progress, worker_command,
                on_result):
    """Run one worker from task ``start``. Returns (finished, next start index)."""
    read_fd, write_fd = os.pipe()
    command = list(worker_command) + ["--tasks", task_file, "--start", str(start), "--result-fd", str(write_fd),
                                      "--device", str(device), "--deadline", str(deadline or 0.0)]
    proc = subprocess.Popen(command, pass_fds=(write_fd,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    os.close(write_fd)
    selector = selectors.DefaultSelector()
    selector.register(read_fd, selectors.EVENT_READ, "events")
    selector.register(proc.stdout.fileno(), selectors.EVENT_READ, "log")
    event_lines, log_lines = _Lines(), _Lines()
    tail = collections.deque(maxlen=25)
    current = None          # index of the task the worker is on
    current_since = time.monotonic()
    last_done = start - 1   # highest index with a result from this worker
    finished = False
    killed_for = None
    killed_at = 0.0
    open_streams = 2
    try:
        while open_streams:
            for key, _ in selector.select(timeout=1.0):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                    open_streams -= 1
                    lines = event_lines.rest() if key.data == "events" else log_lines.rest()
                else:
                    lines = event_lines.feed(data) if key.data == "events" else log_lines.feed(data)
                for line in lines:
                    if key.data == "log":
                        tail.append(line)
                        progress.write(line)
                        continue
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind = event.get("event")
                    if kind == "start":
                        current = event["index"]
                        current_since = time.monotonic()
                        progress.start(tasks[current].get("label", ""))
                    elif kind == "result":
                        _deliver(outcome, event["index"], event["result"], progress, on_result)
                        last_done = event["index"]
                        current = None
                    elif kind == "deadline":
                        outcome.deadline_reached = True
                        finished = True
                    elif kind == "done":
                        finished = True
            if current is not None and time.monotonic() - current_since > task_timeout and killed_for is None:
                killed_for = current
                killed_at = time.monotonic()
                _kill(proc)
            if killed_for is not None and time.monotonic() - killed_at > 10.0:
                break  # a child of the killed worker may hold the pipes open; stop waiting for them
    except KeyboardInterrupt:
        _kill(proc)
        raise
    finally:
        selector.close()
        os.close(read_fd)
        proc.stdout.close()
        returncode = proc.wait()
    if finished:
        return True, len(tasks)
    # The worker stopped early: say what happened to the task it was on, and go on after it.
    if current is not None and outcome.results[current] is None:
        if killed_for == current:
            why = f"error: timed out after {task_timeout:.0f} s (the worker process was killed)"
        else:
            why = f"error: the worker process died (exit code {returncode}) during this task"
        last_lines = " | ".join(line.strip() for line in list(tail)[-6:] if line.strip())
        row = placeholder_row(tasks[current], why + (f"; its last output: {last_lines}" if last_lines else ""))
        _deliver(outcome, current, row, progress, on_result)
        last_done = current
    elif returncode not in (0, EXIT_CONTEXT_BROKEN) and last_done < start:
        last_lines = " | ".join(line.strip() for line in list(tail)[-10:] if line.strip())
        outcome.notes.append(f"the benchmark worker failed to start (exit code {returncode}): {last_lines}")
    if returncode == EXIT_CONTEXT_BROKEN:
        outcome.notes.append(f"task {last_done} broke the CUDA context; a fresh worker went on after it")
    return False, last_done + 1


def _kill(proc):
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGKILL)
    except OSError:
        pass
