"""Timings made at the host's full speed: the calling thread pinned, for one host loop or one run of the GPU timer, to
the CPU that runs a short probe fastest at that moment.

On a shared machine the CPUs a process may use are not equally fast, and which ones are slow changes from second to
second (the H200 host, 2026-11-28: at any moment about half of its 16 CPUs ran a pure-Python loop and a small CUDA
call's host path at half the speed of the rest; a process left unpinned stayed on one kind for seconds, so the same
call's host loop read 1.5-1.95x as long in one process as in another). A host loop measures the host path of a call,
and the host's speed is then a draw: two processes (``mhattn tune`` and ``mhattn bench``) disagree about which of two
calls is cheaper. Pinned to the fastest CPU for the length of one loop or timing (milliseconds to a fraction of a
second), each runs at the host's own speed. Autograd's device thread, which runs the backward of a GPU call, is
pinned beside it to the second fastest.

Only for CUDA devices (a call on the CPU runs on torch's thread pool, which a pinned thread would confine) and where
the platform has ``os.sched_setaffinity``.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

PROBE_STEPS = 2000     # iterations of the probe loop: about 0.1 ms on a fast CPU of the H200 host
PROBE_RUNS = 2         # per CPU, the best counts (the first after a move runs on a cold cache)

_device_threads_started = False


def probe_ns() -> float:
    """Nanoseconds per iteration of a small pure-Python loop on the calling thread's CPU."""
    start = time.perf_counter()
    total = 0
    for step in range(PROBE_STEPS):
        total += step * 3 % 7
    return (time.perf_counter() - start) / PROBE_STEPS * 1e9


def cpus_by_speed(cpus) -> list:
    """``cpus`` ordered by probe_ns now, the fastest first (the calling thread is left pinned to the fastest)."""
    speeds = {}
    for cpu in sorted(cpus):
        os.sched_setaffinity(0, {cpu})
        speeds[cpu] = min(probe_ns() for _ in range(PROBE_RUNS))
    ranked = sorted(speeds, key=speeds.get)
    os.sched_setaffinity(0, {ranked[0]})
    return ranked


@contextlib.contextmanager
def on_fastest_cpu(device):
    """The body runs with the calling thread pinned to the fastest of its CPUs (cpus_by_speed), and autograd's thread
    for ``device`` (which runs the backward of a GPU call) to the second fastest, their affinities restored after;
    a no-op on the CPU device, with one CPU, or without ``os.sched_setaffinity``."""
    if torch.device(device).type != "cuda" or not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        yield
        return
    _start_device_threads(device)
    device_thread = cpus_by_speed(allowed)[1]  # (this thread is left on the fastest)
    pin_device_thread(device, {device_thread})
    try:
        yield
    except BaseException:
        os.sched_setaffinity(0, allowed)
        with contextlib.suppress(Exception):  # the body's error is the one to report (a broken CUDA context fails both)
            pin_device_thread(device, allowed)
        raise
    os.sched_setaffinity(0, allowed)
    pin_device_thread(device, allowed)


def pin_device_thread(device, cpus) -> None:
    """Set the affinity of autograd's thread for ``device`` to ``cpus``: from a gradient hook, which that thread runs
    (the backward of a call on a GPU runs there, not on the thread that called backward(); on the CPU device the hook
    runs on the calling thread). Works inside ``torch.no_grad()`` and ``torch.inference_mode()`` (a timing may be
    made in either)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros(1, device=device, requires_grad=True)
        product = leaf * 2
        product.register_hook(lambda grad: os.sched_setaffinity(0, cpus))
        product.sum().backward()


def _start_device_threads(device) -> None:
    """Have torch's autograd engine start its device threads (at its first backward) while this thread is unpinned:
    a thread takes its creator's affinity, and a device thread started pinned would be confined to that one CPU
    (pin_device_thread moves it after)."""
    global _device_threads_started
    if not _device_threads_started:
        pin_device_thread(device, os.sched_getaffinity(0))  # (its first backward starts them, with this affinity)
        _device_threads_started = True
