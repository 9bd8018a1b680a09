"""Running tasks in worker processes that a crash, a hang or a broken CUDA context cannot take the whole run
down with: the one process-isolation layer of ``mhattn conformance``, ``mhattn bench`` and ``mhattn tune``.

A kernel that faults (an illegal address, a device-side assert) breaks the CUDA context of its process for
good; one that hangs never returns; one that corrupts memory may kill the interpreter. Here tasks (JSON
values) run in up to ``jobs`` worker processes, each a fresh interpreter (never a fork of this one, whose
CUDA state a child could not use), handed one task at a time as soon as it is free. A worker that dies,
or takes longer than ``task_timeout`` over a task, costs only that task (reported as :data:`CRASHED` or
:data:`TIMED_OUT` with the end of the worker's output); a fresh worker goes on with the rest. After the
``deadline`` no task starts: the rest are :data:`NOT_RUN`. Every task is settled exactly once, and each
:class:`Settled` is handed back as soon as it is known, in the order the tasks finish.

What a task is and how it runs is the caller's: ``runner`` names a class ('module:Class') that a worker
makes once, from ``options``, and calls ``run(task)`` on for each task. Its ``run`` returns the task's
JSON result, or raises :class:`Refused` when this process cannot run it (the caller may run it itself);
once its ``broken`` attribute is true (a lost CUDA context) the worker ends and a fresh one goes on.

Worker protocol: ``_BOOT`` starts with the parent's ``sys.path``; tasks come on stdin, one JSON line
``{"index": i, "task": ...}`` each; the worker writes ``{"start": i}`` before a task and ``{"result": i,
"value": ...}`` (or ``{"refused": i, "why": ...}``, or ``{"deadline": i}`` when the time limit passed
before it began) after it, one JSON line each, to a pipe the parent watches; its stdout and stderr go to
another. It ends when stdin closes.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

# How a task was settled.
DONE = "done"                # the runner returned a result (``Settled.value``)
REFUSED = "refused"          # the runner cannot run it in a worker (``Settled.value`` says why)
CRASHED = "crashed"          # its worker died while running it
TIMED_OUT = "timed out"      # it ran past the task timeout; its worker was killed
NOT_STARTED = "not started"  # no worker could start (``Settled.log`` has the output of one that tried)
NOT_RUN = "not run"          # the deadline passed before it started

# Exit status of a worker whose runner is ``broken`` after a task: the parent goes on with a fresh one.
EXIT_BROKEN = 3
# Seconds a worker may take to start (import torch and the backends, initialise CUDA) before its first task.
STARTUP_TIMEOUT = 300.0

_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from mhattn.isolation import worker_main; sys.exit(worker_main(*sys.argv[2:]))"
)


class Refused(Exception):
    """Raised by a runner's ``run`` for a task this process cannot run (a backend it cannot make)."""


@dataclass
class Settled:
    """What became of task ``index``."""

    index: int
    how: str                     # DONE, REFUSED, CRASHED, TIMED_OUT, NOT_STARTED or NOT_RUN
    value: object = None         # the runner's result (DONE), or why it refused (REFUSED)
    exit_code: Optional[int] = None  # of the worker that died or was killed
    log: str = ""                # the end of that worker's output
    seconds: float = 0.0         # how long it ran before its worker died or was killed


def past(deadline) -> bool:
    """True once ``deadline`` (seconds since the epoch, or None for none) has passed."""
    return deadline is not None and time.time() > deadline


# ---- the parent ------------------------------------------------------------------------------------------


class _Worker:
    """One worker process, the task it holds (handed over, not settled) and what it has said."""

    def __init__(self, runner: str, options: dict, deadline, selector):
        events_read, events_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(sys.path), runner, json.dumps(options), str(events_write),
             json.dumps(deadline)],
            pass_fds=(events_write,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        os.close(events_write)
        self.events = events_read
        self.output = self.process.stdout.fileno()
        self.selector = selector
        for fd in (self.events, self.output):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, self)
        self.pending = {self.events: b"", self.output: b""}
        self.tail = collections.deque(maxlen=40)
        self.task: Optional[int] = None     # handed over, no result yet
        self.since = time.monotonic()       # when it was handed over, or started
        self.started = False                # it said it began self.task
        self.heard = False                  # it has said anything at all
        self.retiring = False               # its input is closed: it ends instead of taking another task

    def send(self, index: int, task) -> None:
        self.task, self.since, self.started = index, time.monotonic(), False
        try:
            self.process.stdin.write((json.dumps({"index": index, "task": task}) + "\n").encode())
            self.process.stdin.flush()
        except OSError:
            pass  # it has exited: noticed when its pipes close

    def retire(self) -> None:
        self.retiring = True
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def read(self, fd: int) -> list:
        """The complete lines now readable on ``fd`` (all that is left once the process has exited)."""
        chunks = []
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # the end: no more to wait for on it
                try:
                    self.selector.unregister(fd)
                except (KeyError, ValueError):
                    pass
                break
            chunks.append(data)
        *lines, self.pending[fd] = (self.pending[fd] + b"".join(chunks)).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]

    def log(self) -> str:
        """The end of its output (what a crash left there)."""
        rest = self.pending[self.output].decode("utf-8", "replace")
        return "\n".join([*self.tail, rest]).strip()[-1500:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for fd in (self.events, self.output):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
        os.close(self.events)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


@dataclass
class IsolatedRun:
    """Run ``tasks`` (JSON values) in up to ``jobs`` workers of ``runner`` ('module:Class', made as
    ``Class(**options)`` in each worker); iterate to get one :class:`Settled` per task as each finishes.

    ``group(task)``: after a task is refused, the tasks of its group still waiting are refused too,
    unasked. ``on_start(index)`` is called when a worker begins a task, ``on_output(line)`` for each line a
    worker prints. Stopping the iteration early (Ctrl-C) kills the workers.
    """

    tasks: list
    runner: str
    options: dict = field(default_factory=dict)
    jobs: int = 1
    task_timeout: float = 600.0
    deadline: Optional[float] = None  # seconds since the epoch
    group: Optional[Callable] = None
    on_start: Optional[Callable] = None
    on_output: Optional[Callable] = None
    restarts: int = 0                 # workers that died, were killed or ended broken (a fresh one goes on)

    def __iter__(self) -> Iterator[Settled]:
        if self.jobs < 1:
            raise ValueError(f"IsolatedRun: jobs: expected a positive integer, got {self.jobs!r}")
        self._queue = collections.deque(range(len(self.tasks)))
        self._workers = []
        self._requeued = set()      # tasks handed out again once already (their worker died before them)
        self._a_worker_started = False  # some worker has said something: workers can start on this machine
        self._selector = selectors.DefaultSelector()
        try:
            while self._queue or any(w.task is not None for w in self._workers):
                if past(self.deadline):
                    while self._queue:
                        yield Settled(self._queue.popleft(), NOT_RUN)
                self._hand_out()
                yield from self._wait()
        finally:
            # every task is settled (or the caller stopped): what a worker has left to do is the
            # interpreter's teardown, which nothing waits for
            for worker in self._workers:
                worker.stop()
            self._selector.close()

    def _hand_out(self) -> None:
        for worker in self._workers:
            if worker.task is None and not worker.retiring:
                if self._queue:
                    self._send_next(worker)
                else:
                    worker.retire()
        while self._queue and sum(not w.retiring for w in self._workers) < self.jobs:
            worker = _Worker(self.runner, self.options, self.deadline, self._selector)
            self._workers.append(worker)
            self._send_next(worker)

    def _send_next(self, worker: _Worker) -> None:
        index = self._queue.popleft()
        worker.send(index, self.tasks[index])

    def _wait(self) -> Iterator[Settled]:
        """Wait for news from the workers (at most until the next task could time out) and settle what it
        settles."""
        now = time.monotonic()
        wake = [w.since + self._allowed(w) - now for w in self._workers if w.task is not None]
        for key, _ in self._selector.select(timeout=min([0.5, *wake]) if wake else 0.5):
            yield from self._read(key.data, key.fd)
        for worker in list(self._workers):
            if worker.process.poll() is not None:
                for fd in (worker.events, worker.output):  # what it wrote before it exited
                    yield from self._read(worker, fd)
                self._workers.remove(worker)
                worker.stop()
                yield from self._ended(worker)
            elif worker.task is not None and time.monotonic() - worker.since > self._allowed(worker):
                self._workers.remove(worker)
                worker.stop()
                self.restarts += 1
                yield Settled(worker.task, TIMED_OUT, exit_code=worker.process.returncode, log=worker.log(),
                              seconds=time.monotonic() - worker.since)

    def _allowed(self, worker: _Worker) -> float:
        # before its first message the worker is still starting (imports, CUDA init)
        return self.task_timeout if worker.heard else max(self.task_timeout, STARTUP_TIMEOUT)

    def _read(self, worker: _Worker, fd: int) -> Iterator[Settled]:
        lines = worker.read(fd)
        if fd == worker.output:
            worker.tail.extend(lines)
            if self.on_output is not None:
                for line in lines:
                    self.on_output(line)
            return
        for line in lines:
            if line.strip():
                yield from self._handle(worker, json.loads(line))

    def _handle(self, worker: _Worker, message: dict) -> Iterator[Settled]:
        worker.heard = self._a_worker_started = True
        if "start" in message:
            worker.started, worker.since = True, time.monotonic()
            if self.on_start is not None:
                self.on_start(message["start"])
            return
        worker.task = None
        if "result" in message:
            yield Settled(message["result"], DONE, message["value"])
        elif "deadline" in message:
            yield Settled(message["deadline"], NOT_RUN)
        elif "refused" in message:
            index, why = message["refused"], message["why"]
            yield Settled(index, REFUSED, why)
            if self.group is not None:
                # the rest of its group would be refused too, each after a round trip to a worker
                refused = self.group(self.tasks[index])
                waiting = [i for i in self._queue if self.group(self.tasks[i]) == refused]
                self._queue = collections.deque(i for i in self._queue if i not in waiting)
                for i in waiting:
                    yield Settled(i, REFUSED, why)

    def _ended(self, worker: _Worker) -> Iterator[Settled]:
        """``worker`` has exited (its messages are handled): settle the task it held, if any."""
        code = worker.process.returncode
        if not worker.retiring:
            self.restarts += 1
        if worker.task is None:
            return  # between tasks: its input was closed, or its runner was broken by the task before
        if worker.started:
            yield Settled(worker.task, CRASHED, exit_code=code, log=worker.log(),
                          seconds=time.monotonic() - worker.since)
        elif code == EXIT_BROKEN or (self._a_worker_started and worker.task not in self._requeued):
            # It stopped before it began this task: broken by the task before (it ends then, but may have
            # been handed this one first), or it died where other workers run. Not this task's doing: it
            # goes again (once, unless a broken runner explains it).
            if code != EXIT_BROKEN:
                self._requeued.add(worker.task)
            self._queue.appendleft(worker.task)
        else:
            yield Settled(worker.task, NOT_STARTED, exit_code=code, log=worker.log())
            if not self._a_worker_started:
                # no worker has got as far as a first message: a fresh one would fare no better
                while self._queue:
                    yield Settled(self._queue.popleft(), NOT_STARTED, exit_code=code, log=worker.log())


# ---- the worker --------------------------------------------------------------------------------------------


def _import(spec: str):
    """The object that 'module:qualified.name' names."""
    module_name, _, qualname = spec.partition(":")
    obj = __import__(module_name, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def worker_main(runner: str, options: str, events_fd: str, deadline: str) -> int:
    """The body of a worker process (see the module's docstring for the protocol)."""
    events = os.fdopen(int(events_fd), "w", encoding="utf-8")

    def say(**message):
        events.write(json.dumps(message, allow_nan=False) + "\n")
        events.flush()  # at once: the parent sees how far it got even if this process dies

    instance = _import(runner)(**json.loads(options))
    deadline = json.loads(deadline)
    for line in iter(sys.stdin.readline, ""):
        if not line.strip():
            continue
        entry = json.loads(line)
        index = entry["index"]
        if past(deadline):
            say(deadline=index)
            continue
        say(start=index)
        try:
            value = instance.run(entry["task"])
        except Refused as why:
            say(refused=index, why=str(why))
            continue
        say(result=index, value=value)
        if getattr(instance, "broken", False):
            return EXIT_BROKEN
    return 0
