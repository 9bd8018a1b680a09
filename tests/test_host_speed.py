"""Host loops on the fastest CPU (mhattn.benchmark.host_speed), without a GPU: which CPU is taken, that the
thread's affinity comes back, and that host loops on a GPU device run inside it."""

import os

import pytest
import torch

from mhattn.benchmark import host_speed, latency

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs os.sched_setaffinity and at least two CPUs")


@needs_affinity
def test_the_cpu_with_the_fastest_probe_is_taken_and_the_affinity_restored(monkeypatch):
    allowed = os.sched_getaffinity(0)
    slow, fast = sorted(allowed)[:2]
    # the probe reads where the thread is pinned now: every CPU but ``fast`` is slow
    monkeypatch.setattr(host_speed, "probe_ns", lambda: 50.0 if os.sched_getaffinity(0) == {fast} else 90.0)
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    with host_speed.on_fastest_cpu("cuda"):
        assert os.sched_getaffinity(0) == {fast}
    assert os.sched_getaffinity(0) == allowed
    # restored on an error too
    with pytest.raises(RuntimeError):
        with host_speed.on_fastest_cpu("cuda"):
            raise RuntimeError("in the loop")
    assert os.sched_getaffinity(0) == allowed and slow != fast


def test_nothing_is_pinned_on_the_cpu_device(monkeypatch):
    monkeypatch.setattr(host_speed, "fastest_cpu", lambda cpus: pytest.fail("pinned on the CPU device"))
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with host_speed.on_fastest_cpu("cpu"):
        pass
    with host_speed.on_fastest_cpu(torch.device("cpu")):
        pass
    assert (os.sched_getaffinity(0) if before is not None else None) == before


@needs_affinity
def test_each_host_loop_on_a_gpu_runs_on_the_cpu_fastest_as_it_starts(monkeypatch):
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    picks = iter([cpus[1], cpus[0], cpus[1], cpus[0]])
    seen = []

    def fastest_cpu(candidates):
        assert set(candidates) == allowed
        cpu = next(picks)
        os.sched_setaffinity(0, {cpu})
        return cpu

    def host_loop_us(fn, calls, device, rounds=3):
        seen.append((fn, os.sched_getaffinity(0)))
        return 1.0

    monkeypatch.setattr(host_speed, "fastest_cpu", fastest_cpu)
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    monkeypatch.setattr(latency, "host_loop_us", host_loop_us)
    loops, errors = latency.host_loops_in_turn({"a": "a", "b": "b"}, 10, "cuda", rounds=2)
    assert loops == {"a": 1.0, "b": 1.0} and not errors
    assert seen == [("a", {cpus[1]}), ("b", {cpus[0]}), ("a", {cpus[1]}), ("b", {cpus[0]})]
    assert os.sched_getaffinity(0) == allowed


def test_the_probe_times_a_loop():
    assert 0 < host_speed.probe_ns() < 1e5
