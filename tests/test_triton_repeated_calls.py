"""Repeated forward calls of the Triton backend (backends/triton/backend.py, _RepeatedForward): a call whose signature
ran before launches what that first call prepared, and still takes the path its own tensors call for. CPU only:
the kernels' launches are recorded (test_triton_launcher's recording launchers), nothing runs."""

import pytest
import torch

pytest.importorskip("triton")
from test_triton_launcher import _recorded_launch, _recording_backend_launchers  # noqa: E402

from mhattn.backends.base import AttentionParams  # noqa: E402
from mhattn.backends.triton import backend as tb  # noqa: E402
from mhattn.backends.triton import configs  # noqa: E402

SHAPE = (2, 4, 40, 16)


def at_offset(elements: int) -> torch.Tensor:
    """A float32 tensor of SHAPE with contiguous strides starting ``elements`` past a fresh allocation's start."""
    size = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    return torch.randn(size + elements)[elements:].view(SHAPE)


def forward_launches(jit, launchers, call) -> list:
    """The forward kernel's launches that ``call()`` made: ("triton" or "handle", grid, arguments, constexprs)."""
    kernel = jit["attention_forward_kernel"]
    before = len(kernel.log)
    call()
    return [(entry[0], *_recorded_launch(entry, launchers.forward)) for entry in kernel.log[before:]]


@pytest.fixture
def fresh_signatures(monkeypatch):
    monkeypatch.setattr(tb, "_signatures", {})
    monkeypatch.setattr(tb, "_plans", {})


def test_a_repeated_call_whose_addresses_change_alignment_takes_its_own_path(monkeypatch, fresh_signatures):
    """With descriptors possible (the interpreter's plans allow them) and a tile that asks for them, TMA is on exactly
    for the calls whose q, k, v start on 16 bytes, repeated or not, in any order of aligned and misaligned calls."""
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=True)
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25, window_right=0)
    tma_index = launchers.forward.constexpr_names.index("TMA")
    aligned = [torch.randn(SHAPE) for _ in range(3)]
    misaligned = [at_offset(1) for _ in range(3)]  # 4 bytes past a boundary, the same shape and strides
    with configs.pin("16,16,4,1,tma"):
        for inputs, tma in ((aligned, True), (misaligned, False), (aligned, True), (misaligned, False)):
            launches = forward_launches(jit, launchers, lambda: backend.forward(*inputs, params))
            assert [launch[3][tma_index] for launch in launches] == [tma]
            # What a call worked out from scratch passes.
            tb._signatures.clear()
            assert [launch[1:] for launch in forward_launches(jit, launchers, lambda: backend.forward(*inputs, params))
                    ] == [launch[1:] for launch in launches]
        tb._signatures.clear()
        for inputs in (aligned, misaligned, aligned, misaligned):
            backend.forward(*inputs, params)
        signature = tb._signature_for(*aligned, params, dense=True)
        assert all(signature.repeated_forwards)  # one prepared launch per alignment


def test_a_repeated_call_out_of_resources_on_a_new_specialisation_shrinks_its_tile(monkeypatch, fresh_signatures):
    """A repeated call whose addresses need a new compilation that runs out of shared memory goes the full path:
    the tile shrinks, and later calls launch the smaller tile."""
    from triton.runtime.errors import OutOfResources

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    kernel = jit["attention_forward_kernel"]
    compile_launch = type(kernel).__getitem__
    failing = []

    def launch_or_fail(self, grid):
        launch = compile_launch(self, grid)

        def run(*args, **kwargs):
            if failing and kwargs["num_stages"] == 2:
                raise OutOfResources(1 << 20, 1 << 16, "shared memory")
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(type(kernel), "__getitem__", launch_or_fail)
    monkeypatch.setattr(tb, "_shrunk", {})
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25)
    aligned, misaligned = [torch.randn(SHAPE) for _ in range(3)], [at_offset(1) for _ in range(3)]
    with configs.pin("16,16,4,2"):
        assert [launch[0] for launch in forward_launches(jit, launchers, lambda: backend.forward(*aligned, params))
                ] == ["triton"]
        failing.append(True)
        # The repeated call's new specialisation fails; the full path shrinks num_stages to 1 and compiles that.
        launches = forward_launches(jit, launchers, lambda: backend.forward(*misaligned, params))
        assert [launch[0] for launch in launches] == ["triton"]
        assert launchers.forward.kernel.log[-1][4]["num_stages"] == 1
        assert list(tb._shrunk.values()) == [configs.KernelConfig(16, 16, 4, 1)]
        again = forward_launches(jit, launchers, lambda: backend.forward(*[at_offset(1) for _ in range(3)], params))
        assert [launch[0] for launch in again] == ["handle"]  # the smaller tile, through its kept handle


def test_launches_switch_to_the_tensors_gpu_only_when_another_is_current(monkeypatch):
    """_on_device: a launch for GPU 1 while GPU 0 is current runs inside torch.cuda.device(1); for the current GPU or
    CPU tensors (None) no device is switched."""
    entered = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(tb, "_CURRENT_DEVICE", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    launched = []

    def launch(args):
        launched.append((args, list(entered)))

    tb._on_device(1, launch, ("a",))
    tb._on_device(0, launch, ("b",))
    tb._on_device(None, launch, ("c",))
    assert launched == [(("a",), [1]), (("b",), [1, "exit"]), (("c",), [1, "exit"])]


def test_a_repeated_forward_answers_the_hopper_rule_as_its_call_does(monkeypatch, fresh_signatures):
    """hopper_launch.why_not reads a call's right window bound, alignment and scale: the _RepeatedForward standing for
    a repeated call gives the same answer as the call worked out in full, and a scale <= 0 keeps the Gluon forward
    (which takes row maxima of unscaled scores) out, on a plan marked sm_90."""
    from mhattn.backends.triton import hopper_launch

    _recording_backend_launchers(monkeypatch, interpret=True)
    backend = tb.TritonBackend()
    q = torch.randn(SHAPE)
    for scale in (0.25, -0.25, 0.0):
        params = AttentionParams(scale=scale, window_right=0)
        backend.forward(q, q, q, params)
        signature = tb._signature_for(q, q, q, params, dense=True)
        repeated = [found for found in signature.repeated_forwards if found is not None]
        run = tb._Launch(q, q, q, params, dense=True)
        monkeypatch.setattr(run.plan, "sm90", True)
        assert repeated and hopper_launch.why_not(run.plan, repeated[0]) == hopper_launch.why_not(run.plan, run)
        if scale <= 0:
            assert "scale" in hopper_launch.why_not(run.plan, run)


def test_a_repeated_gluon_forward_launches_its_prepared_launch_and_follows_the_switch(monkeypatch, fresh_signatures):
    """On a plan marked sm_90 whose calls the Gluon forward takes: the first call prepares the signature's launch
    (hopper_launch.ForwardLaunch, through hopper_launch.forward), a repeated call launches it directly with its own
    tensors, and with the Gluon kernels switched off (MHATTN_TRITON_HOPPER=0) the same signature runs the
    FlashAttention-2 forward instead."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from test_triton_backend import RecordingLauncher

    from mhattn.backends.triton import hopper_forward, hopper_launch

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=True)
    gluon_launches = []
    monkeypatch.setattr(hopper_launch, "_launcher", [RecordingLauncher(
        hopper_forward.hopper_forward_kernel, lambda grid, named, constexprs: gluon_launches.append(named))])
    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "always")
    prepared_here = []
    real_forward = hopper_launch.forward
    monkeypatch.setattr(hopper_launch, "forward", lambda *args: prepared_here.append(1) or real_forward(*args))
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.125, window_right=0)
    calls = [[torch.randn(2, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3)] for _ in range(3)]
    plan = tb._signature_for(*calls[0], params, dense=True).plan
    monkeypatch.setattr(plan, "sm90", True)
    monkeypatch.setattr(plan, "descriptor_strides_ok", True)
    outputs = [backend.forward(*qkv, params) for qkv in calls]
    assert len(prepared_here) == 1 and len(gluon_launches) == 3
    for (q, k, v), (out, lse), named in zip(calls, outputs, gluon_launches):
        assert named["q_desc"].base is q and named["k_desc"].base is k and named["v_desc"].base is v
        assert named["o_desc"].base is out and named["Out"] is out and named["Lse"] is lse
        assert named["qk_scale2"] == 0.125 * tb.LOG2E
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "0")
    fa2 = forward_launches(jit, launchers, lambda: backend.forward(*calls[0], params))
    assert len(fa2) == 1 and len(gluon_launches) == 3
