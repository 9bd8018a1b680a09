"""The shared process-isolation layer (mhattn.isolation), on the CPU with a stand-in runner: a crash or a
hang costs only its task, the time limit leaves tasks not run, results come back as they finish."""

import os
import time

from mhattn import isolation
from mhattn.isolation import CRASHED, DONE, NOT_RUN, NOT_STARTED, REFUSED, TIMED_OUT, IsolatedRun, Refused


class Tasks:
    """Stands in for a real runner in a worker process. A task is a dict: ``sleep`` seconds, ``exit`` (the
    process dies with that status, after a line of output), ``refuse``, ``wait_for``/``leave`` (a file
    to wait for before returning, or to leave)."""

    def run(self, task):
        if "exit" in task:
            print("about to exit", flush=True)
            os._exit(task["exit"])
        if "refuse" in task:
            raise Refused(f"cannot run {task['refuse']} here")
        if "leave" in task:
            open(task["leave"], "w").close()
        if "wait_for" in task:
            give_up = time.monotonic() + 30
            while not os.path.exists(task["wait_for"]) and time.monotonic() < give_up:
                time.sleep(0.01)
            time.sleep(0.3)  # the other task's result is back first
        time.sleep(task.get("sleep", 0.0))
        return {"slept": task.get("sleep", 0.0), "pid": os.getpid()}


RUNNER = f"{__name__}:Tasks"


def settle(tasks, **options):
    run = IsolatedRun(tasks, RUNNER, **options)
    return run, list(run)


def test_a_task_that_kills_its_worker_fails_alone():
    run, settled = settle([{"sleep": 0}, {"exit": 7}, {"sleep": 0}, {"sleep": 0}])
    by_index = {s.index: s for s in settled}
    assert sorted(by_index) == [0, 1, 2, 3] and len(settled) == 4  # each task settled once
    assert by_index[1].how == CRASHED and by_index[1].exit_code == 7 and "about to exit" in by_index[1].log
    assert [by_index[i].how for i in (0, 2, 3)] == [DONE] * 3
    # the first worker ran task 0; a fresh one ran the rest
    assert by_index[0].value["pid"] != by_index[2].value["pid"] == by_index[3].value["pid"]
    assert run.restarts == 1


def test_a_task_that_hangs_past_its_timeout_is_killed():
    run, settled = settle([{"sleep": 60}, {"sleep": 0}, {"sleep": 0}], jobs=2, task_timeout=1.0)
    by_index = {s.index: s for s in settled}
    assert by_index[0].how == TIMED_OUT and by_index[0].seconds >= 1.0
    assert by_index[1].how == by_index[2].how == DONE
    assert run.restarts == 1


def test_the_time_limit_leaves_the_rest_not_run(monkeypatch):
    tasks = [{"sleep": 0}] * 5
    # past before the start: no worker starts, nothing runs
    assert [s.how for s in settle(tasks, deadline=time.time() - 1)[1]] == [NOT_RUN] * 5
    # a worker that reaches its first task after the limit (it takes a second or more to start) reports it
    # not run, and no other task is handed out
    assert [s.how for s in settle(tasks, deadline=time.time() + 0.2)[1]] == [NOT_RUN] * 5
    # the parent's clock says the limit is reached once two tasks are done (a worker's own check reads the
    # real clock): the task already handed out finishes, no other starts
    done = []
    monkeypatch.setattr(isolation, "past", lambda deadline: len(done) >= 2)
    for s in IsolatedRun(tasks, RUNNER, deadline=time.time() + 3600):
        done.append(s.how)
    assert done[:2] == [DONE, DONE] and set(done[2:]) == {NOT_RUN} and len(done) == 5


def test_results_arrive_in_the_order_the_tasks_finish(tmp_path):
    marker = str(tmp_path / "fast-done")
    arrived = []
    run = IsolatedRun([{"wait_for": marker}, {"leave": marker}], RUNNER, jobs=2)
    for s in run:
        arrived.append((s.index, s.how))
    assert arrived == [(1, DONE), (0, DONE)]


def test_a_refused_task_refuses_its_group_without_asking_again():
    tasks = [{"refuse": "a"}, {"refuse": "a", "n": 2}, {"sleep": 0}, {"refuse": "a", "n": 3}]
    started = []
    run = IsolatedRun(tasks, RUNNER, group=lambda task: task.get("refuse"), on_start=started.append)
    settled = {s.index: s for s in run}
    assert [settled[i].how for i in range(4)] == [REFUSED, REFUSED, DONE, REFUSED]
    assert settled[3].value == "cannot run a here" and started == [0, 2]
    assert run.restarts == 0


def test_workers_that_cannot_start_settle_every_task_once(monkeypatch):
    monkeypatch.setattr(isolation, "_BOOT", "import sys; print('no module named mhattn'); sys.exit(5)")
    settled = list(IsolatedRun([{"sleep": 0}] * 3, RUNNER, jobs=2))
    assert sorted(s.index for s in settled) == [0, 1, 2]
    assert all(s.how == NOT_STARTED and s.exit_code == 5 and "no module named" in s.log for s in settled)


def test_stopping_early_kills_the_workers():
    run = IsolatedRun([{"sleep": 0}, {"sleep": 60}, {"sleep": 60}], RUNNER, jobs=2)
    results = iter(run)
    assert next(results).index == 0
    workers = list(run._workers)
    results.close()  # as Ctrl-C in the caller's loop would
    assert workers and all(w.process.returncode is not None for w in workers)
