"""Host loops on the fastest CPU (mhattn.benchmark.host_speed), without a GPU: which CPU is taken, that the
thread's affinity comes back, and that host loops on a GPU device run inside it."""

import os

import pytest
import torch

from mhattn.benchmark import host_speed, latency

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs os.sched_setaffinity and at least two CPUs")


@needs_affinity
def test_the_cpus_with_the_fastest_probes_are_taken_and_the_affinities_restored(monkeypatch):
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    fast, second = cpus[-1], cpus[0]
    # the probe reads where the thread is pinned now: ``fast`` is the fastest CPU, ``second`` the next
    speed = {fast: 50.0, second: 60.0}
    monkeypatch.setattr(host_speed, "probe_ns", lambda: speed.get(next(iter(os.sched_getaffinity(0))), 90.0)
                        if len(os.sched_getaffinity(0)) == 1 else pytest.fail("probed unpinned"))
    assert host_speed.cpus_by_speed(allowed)[:2] == [fast, second] and os.sched_getaffinity(0) == {fast}
    os.sched_setaffinity(0, allowed)
    device_thread = []
    monkeypatch.setattr(host_speed, "pin_device_thread", lambda device, cpus: device_thread.append(set(cpus)))
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    with host_speed.on_fastest_cpu("cuda"):
        assert os.sched_getaffinity(0) == {fast}
        assert device_thread == [{second}]
    assert os.sched_getaffinity(0) == allowed and device_thread == [{second}, allowed]
    # restored on an error too
    with pytest.raises(RuntimeError):
        with host_speed.on_fastest_cpu("cuda"):
            raise RuntimeError("in the loop")
    assert os.sched_getaffinity(0) == allowed and device_thread[-1] == allowed


def test_nothing_is_pinned_on_the_cpu_device(monkeypatch):
    monkeypatch.setattr(host_speed, "cpus_by_speed", lambda cpus: pytest.fail("pinned on the CPU device"))
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

    def cpus_by_speed(candidates):
        assert set(candidates) == allowed
        cpu = next(picks)
        os.sched_setaffinity(0, {cpu})
        return [cpu] + [other for other in cpus if other != cpu]

    def host_loop_us(fn, calls, device, rounds=3):
        seen.append((fn, os.sched_getaffinity(0)))
        return 1.0

    monkeypatch.setattr(host_speed, "cpus_by_speed", cpus_by_speed)
    monkeypatch.setattr(host_speed, "pin_device_thread", lambda device, cpus: None)
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    monkeypatch.setattr(latency, "host_loop_us", host_loop_us)
    loops, errors = latency.host_loops_in_turn({"a": "a", "b": "b"}, 10, "cuda", rounds=2)
    assert loops == {"a": 1.0, "b": 1.0} and not errors
    assert seen == [("a", {cpus[1]}), ("b", {cpus[0]}), ("a", {cpus[1]}), ("b", {cpus[0]})]
    assert os.sched_getaffinity(0) == allowed


@needs_affinity
def test_the_gpu_timer_runs_from_the_fastest_cpu(monkeypatch):
    from mhattn.benchmark import timing

    allowed = os.sched_getaffinity(0)
    fast = sorted(allowed)[-1]
    seen = []

    def cpus_by_speed(candidates):
        os.sched_setaffinity(0, {fast})
        return [fast] + sorted(set(candidates) - {fast})

    monkeypatch.setattr(host_speed, "cpus_by_speed", cpus_by_speed)
    monkeypatch.setattr(host_speed, "pin_device_thread", lambda device, cpus: None)
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    monkeypatch.setattr(timing, "_triton_do_bench", lambda: lambda fn, **_: seen.append(os.sched_getaffinity(0)) or 0.5)
    assert timing.bench_ms(lambda: None, 1, 1, "cuda") == 0.5
    assert seen == [{fast}] and os.sched_getaffinity(0) == allowed


@needs_affinity
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_the_hook_that_pins_a_thread_runs_in_any_grad_mode(mode):
    """On the CPU device the hook runs on the calling thread, so pinning "autograd's thread" pins this one."""
    allowed = os.sched_getaffinity(0)
    one = {sorted(allowed)[0]}
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    try:
        with context():
            host_speed.pin_device_thread("cpu", one)
            assert os.sched_getaffinity(0) == one
    finally:
        os.sched_setaffinity(0, allowed)


@needs_affinity
def test_an_error_in_the_body_is_the_one_reported_and_the_affinity_restored(monkeypatch):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(host_speed, "_start_device_threads", lambda device: None)
    monkeypatch.setattr(host_speed, "cpus_by_speed", lambda cpus: sorted(cpus))
    restores = []

    def pin_device_thread(device, cpus):
        if cpus == allowed:
            restores.append(cpus)
            raise RuntimeError("the CUDA context is gone")

    monkeypatch.setattr(host_speed, "pin_device_thread", pin_device_thread)
    with pytest.raises(ValueError, match="the kernel's own error"):
        with host_speed.on_fastest_cpu("cuda"):
            os.sched_setaffinity(0, {sorted(allowed)[0]})
            raise ValueError("the kernel's own error")
    assert os.sched_getaffinity(0) == allowed and restores == [allowed]
    # without an error in the body a failed restore is reported
    with pytest.raises(RuntimeError, match="context is gone"):
        with host_speed.on_fastest_cpu("cuda"):
            pass
    assert os.sched_getaffinity(0) == allowed


def test_the_probe_times_a_loop():
    assert 0 < host_speed.probe_ns() < 1e5


@pytest.mark.gpu
@needs_affinity
def test_gpu_autograd_s_device_thread_is_pinned_and_released():
    """pin_device_thread reaches the thread that runs a GPU call's backward: a hook there reads the affinity set."""
    allowed = os.sched_getaffinity(0)
    one = {sorted(allowed)[-1]}
    seen = []

    def backward_reads_affinity():
        leaf = torch.zeros(1, device="cuda", requires_grad=True)
        product = leaf * 2
        product.register_hook(lambda grad: seen.append(os.sched_getaffinity(0)))
        product.sum().backward()

    host_speed.pin_device_thread("cuda", one)
    backward_reads_affinity()
    host_speed.pin_device_thread("cuda", allowed)
    backward_reads_affinity()
    assert seen == [one, allowed] and os.sched_getaffinity(0) == allowed
