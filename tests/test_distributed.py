"""mhattn.distributed: which blocks each ring step computes, the layouts, argument errors, and the ring
itself in 2 and 3 gloo processes on the CPU (tests/ring_worker.py) against mhattn.attention, on the
reference, the Triton kernels (interpreter) and the CUDA kernels (emulator); the training example and the
GPU check script on two CPU ranks."""

import datetime
import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import mhattn
from mhattn.distributed import (LAYOUTS, _from_parts, _local_part, gather_sequence, ring_attention, shard_sequence,
                                step_blocks, window_blocks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "ring_worker.py")


def global_positions(layout, rank, world, n_local):
    """Global token index of each local row of rank ``rank``."""
    return _local_part(torch.arange(world * n_local), 0, layout, rank, world)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_step_blocks_cover_the_global_mask_once(layout, world, causal):
    """Over all steps, the blocks of a rank cover exactly the (query, key) pairs the global mask allows,
    each once: the blocks' own causal diagonal included."""
    n_local = 6
    for rank in range(world):
        rows = global_positions(layout, rank, world, n_local)
        for source in range(world):
            cols = global_positions(layout, source, world, n_local)
            want = (cols[None, :] <= rows[:, None]) if causal else torch.ones(n_local, n_local, dtype=torch.bool)
            covered = torch.zeros(n_local, n_local, dtype=torch.int64)
            for block in step_blocks(layout, rank, source, n_local, causal):
                part = torch.ones(block.q_rows.stop - block.q_rows.start, block.kv_rows.stop - block.kv_rows.start,
                                  dtype=torch.int64)
                if block.causal:
                    part = part.tril()
                covered[block.q_rows, block.kv_rows] += part
            assert torch.equal(covered, want.long()), (layout, world, rank, source)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(2, None), (None, 3), (3, 1), (0, 0), (7, 2), (13, None)])
def test_window_blocks_cover_the_global_band_once(layout, world, causal, window):
    """With a window, the blocks of a rank cover exactly the (query, key) pairs whose global positions lie in
    the band (causal folded in), each once; a plain block only where every pair of its chunks is in it."""
    n_local, (left, right) = 6, window
    right = (0 if right is None else min(right, 0)) if causal else right
    for rank in range(world):
        rows = global_positions(layout, rank, world, n_local)
        for source in range(world):
            rel = global_positions(layout, source, world, n_local)[None, :] - rows[:, None]
            want = torch.ones(n_local, n_local, dtype=torch.bool)
            if left is not None:
                want &= rel >= -left
            if right is not None:
                want &= rel <= right
            covered = torch.zeros(n_local, n_local, dtype=torch.int64)
            for block in window_blocks(layout, rank, source, world, n_local, causal, *window):
                nq, nk = block.q_rows.stop - block.q_rows.start, block.kv_rows.stop - block.kv_rows.start
                part = torch.ones(nq, nk, dtype=torch.bool)
                if block.windowed:  # the mask mhattn.attention applies with these params
                    block_rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - block.diag_offset
                    if block.window_left is not None:
                        part &= block_rel >= -block.window_left
                    if block.window_right is not None:
                        part &= block_rel <= block.window_right
                else:
                    assert not block.causal and bool(want[block.q_rows, block.kv_rows].all())
                covered[block.q_rows, block.kv_rows] += part.long()
            assert torch.equal(covered, want.long()), (layout, world, rank, source)


@pytest.mark.parametrize("lengths", [(5,), (4, 9), (7, 2, 5), (1, 3, 8, 2, 6)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (2, None), (None, 3), (3, 1), (0, 0), (7, 2)])
def test_blocks_of_uneven_shards_cover_the_global_mask_once(lengths, causal, window):
    """Contiguous shards of different lengths: over all steps, a rank's blocks (step_blocks, or window_blocks with a
    window) cover exactly the (query, key) pairs the global causal mask or band allows, each once."""
    world, starts = len(lengths), [sum(lengths[:r]) for r in range(len(lengths))]
    for rank in range(world):
        rows = torch.arange(starts[rank], starts[rank] + lengths[rank])
        for source in range(world):
            rel = torch.arange(starts[source], starts[source] + lengths[source])[None, :] - rows[:, None]
            want = torch.ones(lengths[rank], lengths[source], dtype=torch.bool)
            left, right = window if window is not None else (None, None)
            right = (0 if right is None else min(right, 0)) if causal else right
            if left is not None:
                want &= rel >= -left
            if right is not None:
                want &= rel <= right
            if window is None:
                blocks = step_blocks("contiguous", rank, source, lengths[rank], causal, lengths[source])
            else:
                blocks = window_blocks("contiguous", rank, source, world, lengths[rank], causal, *window, lengths)
            covered = torch.zeros(lengths[rank], lengths[source], dtype=torch.int64)
            for block in blocks:
                nq, nk = block.q_rows.stop - block.q_rows.start, block.kv_rows.stop - block.kv_rows.start
                block_rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - block.diag_offset
                part = torch.ones(nq, nk, dtype=torch.bool)
                block_right = 0 if block.causal and block.window_right is None else block.window_right
                if block.window_left is not None:
                    part &= block_rel >= -block.window_left
                if block_right is not None:
                    part &= block_rel <= block_right
                covered[block.q_rows, block.kv_rows] += part.long()
            assert torch.equal(covered, want.long()), (lengths, rank, source)


def test_zigzag_balances_causal_work():
    """Every rank computes the same number of (query, key) pairs under zigzag; contiguous does not."""
    n_local, world = 8, 4

    def work(layout, rank):
        pairs = 0
        for source in range(world):
            for block in step_blocks(layout, rank, source, n_local, True):
                nq, nk = block.q_rows.stop - block.q_rows.start, block.kv_rows.stop - block.kv_rows.start
                pairs += nq * (nk + 1) // 2 if block.causal else nq * nk
        return pairs

    assert len({work("zigzag", r) for r in range(world)}) == 1
    assert work("contiguous", world - 1) > work("contiguous", 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_local_parts_reassemble(layout, world):
    x = torch.randn(2, 4 * world, 3)
    parts = [_local_part(x, 1, layout, r, world) for r in range(world)]
    assert all(p.shape == (2, 4, 3) for p in parts)
    assert torch.equal(_from_parts(parts, 1, layout), x)
    if layout == "zigzag":  # rank 0 holds the first and the last chunk
        assert torch.equal(parts[0], torch.cat([x[:, :2], x[:, -2:]], 1))


def test_uninitialised_group_is_an_input_error():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(mhattn.InputError, match="not initialised"):
        shard_sequence(torch.zeros(4, 2))


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    """A one-rank gloo group in this process (the ring degenerates to local attention)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init_file = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_equals_attention(group_of_one, causal):
    q, k, v = (torch.randn(2, 4, 10, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, is_causal=causal, layout="zigzag")
    want = mhattn.attention(q, k, v, is_causal=causal)
    assert (out - want).abs().max() < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(grads, want_grads))


def test_input_errors(group_of_one):
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(mhattn.InputError, match="layout must be one of"):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(mhattn.InputError, match="N_local must be even"):
        ring_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5], layout="zigzag", is_causal=True)
    with pytest.raises(mhattn.InputError, match="same tokens"):
        ring_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(mhattn.InputError, match="enable_gqa"):
        ring_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(mhattn.InputError, match="is_causal must be a bool"):
        ring_attention(q, q, q, is_causal="yes")
    with pytest.raises(mhattn.InputError, match="layout must be one of"):
        shard_sequence(q, layout="striped")
    with pytest.raises(mhattn.InputError, match="needs a multiple of 2"):
        shard_sequence(q[:, :, :5], layout="zigzag")
    with pytest.raises(mhattn.InputError, match="dim must be an int"):
        gather_sequence(q, dim=4)
    with pytest.raises(mhattn.UnknownBackendError):
        ring_attention(q, q, q, backend="nonesuch")
    with pytest.raises(mhattn.InputError, match="lengths: shards of different lengths need layout 'contiguous'"):
        ring_attention(q, q, q, layout="zigzag", lengths=(6,))
    with pytest.raises(mhattn.InputError, match=r"lengths must be 1 ints >= 1"):
        ring_attention(q, q, q, lengths=(3, 3))
    with pytest.raises(mhattn.InputError, match=r"lengths must be 1 ints >= 1"):
        ring_attention(q, q, q, lengths=(6.0,))
    with pytest.raises(mhattn.InputError, match="lengths gives rank 0 5 tokens, but its q holds N_local = 6"):
        ring_attention(q, q, q, lengths=(5,))
    with pytest.raises(mhattn.InputError, match="lengths sum to 5 tokens"):
        shard_sequence(q, lengths=(5,))
    with pytest.raises(mhattn.InputError, match="x_local has 6 tokens along dim 2, but lengths gives rank 0 5"):
        gather_sequence(q, lengths=(5,))
    with pytest.raises(mhattn.InputError, match="key_mask must be a bool tensor"):
        ring_attention(q, q, q, key_mask=torch.ones(1, 6))
    with pytest.raises(mhattn.InputError, match=r"key_mask must have shape \(..., N_local\) = \(1, 6\)"):
        ring_attention(q, q, q, key_mask=torch.ones(1, 1, 6, dtype=torch.bool))


def _communicate(procs, what: str, timeout_s: float) -> list:
    """Each process's output; a hang kills every process (and its children) and fails the test."""
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout_s} s")
    return logs


def _start(command, tmp_path, **env_vars):
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path), **env_vars)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run_ranks(world: int, tmp_path, backend: str = "reference", timeout_s: float = 120.0, **env_vars):
    """Run tests/ring_worker.py as ``world`` processes."""
    init_file = tmp_path / "init"
    procs = [_start([sys.executable, WORKER, str(rank), str(world), str(init_file), backend], tmp_path, **env_vars)
             for rank in range(world)]
    logs = _communicate(procs, f"the {world} ring processes", timeout_s)
    return [p.returncode for p in procs], "\n".join(logs)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_attention_on_gloo(world, tmp_path):
    """Forward, lse and gradients of every rank's shard equal mhattn.attention over the whole sequence
    (float64, reference backend): both layouts, causal or not, GQA, Dv != D, an lse gradient, windows that cross
    the shards and softcap, contiguous shards of different lengths, and key-padding masks."""
    codes, log = _run_ranks(world, tmp_path)
    assert codes == [0] * world, log
    assert log.count(": ok") == world * 19, log


@pytest.mark.interpret
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_ring_on_triton_kernels_on_gloo(tmp_path):
    """The same with the Triton kernels under TRITON_INTERPRET=1 (float32, 2 ranks, 6 cases, one windowed with
    softcap, one on shards of different lengths, one with a key-padding mask): their backward takes the merged
    output and log-sum-exp of the whole sequence and views of the shards."""
    codes, log = _run_ranks(2, tmp_path, backend="triton", timeout_s=300.0, TRITON_INTERPRET="1")
    assert codes == [0, 0], log
    assert log.count(": ok") == 2 * 6, log


def test_ring_on_cuda_kernels_emulated_on_gloo(tmp_path):
    """The same with the CuPy backend's CUDA kernels run by their host-side emulator (bf16, judged by the
    conformance rule, 2 ranks, 6 cases)."""
    emulator = pytest.importorskip("mhattn.backends.cupy.emulator")  # in the source tree, not in a wheel
    if emulator.host_compiler() is None:
        pytest.skip("no host C++ compiler for the kernel emulator")
    codes, log = _run_ranks(2, tmp_path, backend="cupy-emulated", timeout_s=360.0)
    assert codes == [0, 0], log
    assert log.count(": ok") == 2 * 6, log


@pytest.mark.parametrize("script, args, expect", [
    ("examples/ring_train.py", ["--cpu", "--steps", "3"], "OK"),
    ("benchmarks/check_ring.py", ["--cpu-smoke", "--reps", "1"], "agreement (bf16, conformance tolerance, both "
                                                                 "layouts): PASS"),
])
def test_scripts_run_on_two_cpu_ranks(script, args, expect, tmp_path):
    """The training example and the GPU check script, on the CPU over gloo under torchrun (2 ranks)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, script), *args]
    proc = _start(command, tmp_path)
    (log,) = _communicate([proc], script, 180.0)
    assert proc.returncode == 0, log
    assert expect in log, log
