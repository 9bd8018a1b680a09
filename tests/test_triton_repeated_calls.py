"""Repeated forward calls of the Triton backend (backends/triton/backend.py, _RepeatedForward): a call whose signature
ran before launches what that first call prepared, and still takes the path its own tensors call for. CPU only:
the kernels' launches are recorded (test_triton_launcher's recording launchers), nothing runs."""

import pytest
import torch

pytest.importorskip("triton")
from test_triton_launcher import _recorded_launch, _recording_backend_launchers  # noqa: E402

from mhattn.backends import layouts  # noqa: E402
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


def test_a_short_backward_out_of_resources_takes_the_three_kernels_from_then_on(monkeypatch, fresh_signatures):
    """Where the short backward's tile runs out of resources, that backward takes the three FlashAttention-2 kernels
    (with their gradients), and so do the plan's later backwards, first or repeated: no second try of the tile."""
    from triton.runtime.errors import OutOfResources

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    kernel = jit["backward_short_kernel"]
    compile_launch = type(kernel).__getitem__

    def launch_or_fail(self, grid):
        launch = compile_launch(self, grid)
        if self is not kernel:
            return launch

        def run(*args, **kwargs):
            raise OutOfResources(1 << 20, 1 << 16, "registers")

        return run

    monkeypatch.setattr(type(kernel), "__getitem__", launch_or_fail)
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25)
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    out, lse = backend.forward(q, k, v, params)
    grad_out = torch.randn_like(out)
    plan = tb._signature_for(q, k, v, params, dense=True).plan
    assert plan.short_backward_tile is not None
    for _ in range(3):
        grads = []
        launches = backward_launches(jit, launchers,
                                     lambda: grads.extend(backend.backward(grad_out, q, k, v, out, lse, params)))
        assert launches["backward_dkdv_kernel"] and not launches["backward_short_kernel"]
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape] and grads[3] is None
        assert plan.short_backward_tile is None


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


def backward_launches(jit, launchers, call) -> dict:
    """The backward kernels' launches that ``call()`` made, by kernel: (grid, arguments, constexprs) each."""
    names = ("backward_preprocess_kernel", "backward_dkdv_kernel", "backward_dq_kernel", "backward_short_kernel")
    by_name = {launcher.kernel.__name__: launcher for launcher in vars(launchers).values()}
    before = {name: len(jit[name].log) for name in names}
    call()
    return {name: [_recorded_launch(entry, by_name[name]) for entry in jit[name].log[before[name]:]] for name in names}


def plain_signatures() -> list:
    """(q, k, v), params of five plain signatures (no mask, no dropout) of 40 keys: none, a causal window, softcap,
    GQA with a wider value head, strided views of a packed projection."""
    qkv = torch.randn(2, 40, 3, 4, 16)
    packed = tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))  # strided views
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    return [((q, k, v), AttentionParams(scale=0.25)),
            ((q, k, v), AttentionParams(scale=0.5, window_left=7, window_right=0)),
            ((q, k, v), AttentionParams(scale=0.5, softcap=20.0)),
            ((q, torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 24)), AttentionParams(scale=0.5, window_right=0)),
            (packed, AttentionParams(scale=0.25))]


def counting_repeats(monkeypatch) -> list:
    """A list that gets one entry per backward that ran through a _RepeatedBackward."""
    ran = []
    real = tb._RepeatedBackward.launch

    def launch(self, *args):
        grads = real(self, *args)
        ran.append(grads is not None)
        return grads

    monkeypatch.setattr(tb._RepeatedBackward, "launch", launch)
    return ran


@pytest.mark.parametrize("pinned", [None, "fwd=16,16,4,1;dkdv=16,16,4,1;dq=atomic"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_repeated_backward_launches_what_a_call_worked_out_in_full_launches(monkeypatch, fresh_signatures, pinned,
                                                                             deterministic):
    """Plain signatures (no mask, no dropout, no lse gradient): a repeated backward goes through the launches its
    signature's first backward prepared (_RepeatedBackward) and passes the kernels what a call worked out from
    scratch passes, with dQ from its own kernel or summed in the dK/dV kernel (dq=atomic), deterministic or not;
    new gradient buffers every call."""
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    ran = counting_repeats(monkeypatch)
    backend = tb.TritonBackend(deterministic=deterministic)
    cases = plain_signatures()

    def run_case(inputs, params, fresh=False):
        if fresh:
            tb._signatures.clear()
        out, lse = backend.forward(*inputs, params)
        grad_out = torch.randn_like(out)
        grads = []
        launches = backward_launches(jit, launchers,
                                     lambda: grads.extend(backend.backward(grad_out, *inputs, out, lse, params)))
        return launches, grads

    with configs.pin(pinned or "16,16,4,1"):
        for inputs, params in cases:
            first, _ = run_case(inputs, params)
            assert not ran  # a first call works everything out
            again, grads = run_case(inputs, params)
            assert ran == [True]
            ran.clear()
            fresh, _ = run_case(inputs, params, fresh=True)
            assert again == fresh
            assert again["backward_preprocess_kernel"] and again["backward_dkdv_kernel"]
            assert bool(again["backward_dq_kernel"]) == (deterministic or pinned is None)
            dq, dk, dv, dmask = grads
            assert dmask is None and dq.shape == inputs[0].shape and dk.shape == inputs[1].shape
            assert dv.shape == inputs[2].shape
            ran.clear()


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_repeated_short_backward_launches_what_a_call_worked_out_in_full_launches(monkeypatch, fresh_signatures,
                                                                                   deterministic):
    """Plain signatures whose keys fit one block, on the backend's own tiles: the backward is the short kernel's one
    launch, deterministic or not; a repeated one goes through the launch its signature's first backward prepared
    (_RepeatedShortBackward) and passes the kernel what a call worked out from scratch passes, with new gradient
    buffers every call. A gradient into the lse takes the three kernels."""
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    ran = []
    real = tb._RepeatedShortBackward.launch
    monkeypatch.setattr(tb._RepeatedShortBackward, "launch",
                        lambda self, *args: ran.append(1) or real(self, *args))
    backend = tb.TritonBackend(deterministic=deterministic)
    cases = plain_signatures()

    def run_case(inputs, params, fresh=False, **kwargs):
        if fresh:
            tb._signatures.clear()
        out, lse = backend.forward(*inputs, params)
        grad_out = torch.randn_like(out)
        grads = []
        launches = backward_launches(
            jit, launchers, lambda: grads.extend(backend.backward(grad_out, *inputs, out, lse, params, **kwargs)))
        return launches, grads, lse

    for inputs, params in cases:
        first, _, _ = run_case(inputs, params)
        assert not ran and len(first["backward_short_kernel"]) == 1
        again, grads, _ = run_case(inputs, params)
        assert ran == [1]
        fresh, _, lse = run_case(inputs, params, fresh=True)
        assert again == fresh
        assert len(again["backward_short_kernel"]) == 1
        assert not (again["backward_preprocess_kernel"] or again["backward_dkdv_kernel"] or again["backward_dq_kernel"])
        dq, dk, dv, dmask = grads
        assert dmask is None and dq.shape == inputs[0].shape and dk.shape == inputs[1].shape
        assert dv.shape == inputs[2].shape
        with_lse, _, _ = run_case(inputs, params, grad_lse=torch.randn_like(lse))
        assert with_lse["backward_preprocess_kernel"] and not with_lse["backward_short_kernel"]
        ran.clear()


def test_a_repeated_backward_follows_the_deterministic_setting_and_the_lse_gradient(monkeypatch, fresh_signatures):
    """The repeated backward is kept per deterministic setting (read at every call): with dQ summed in the dK/dV
    kernel by default, turning torch's deterministic algorithms on brings the dQ kernel back at the next call of
    the same signature; a call with a gradient for the lse takes the full path."""
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    ran = counting_repeats(monkeypatch)
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25)
    q = torch.randn(SHAPE)
    out, lse = backend.forward(q, q, q, params)
    grad_out = torch.randn_like(out)
    step = lambda **kwargs: backward_launches(  # noqa: E731
        jit, launchers, lambda: backend.backward(grad_out, q, q, q, out, lse, params, **kwargs))
    was = torch.are_deterministic_algorithms_enabled()
    with configs.pin("fwd=16,16,4,1;dkdv=16,16,4,1;dq=atomic"):
        try:
            assert not step()["backward_dq_kernel"] and not step()["backward_dq_kernel"] and ran == [True]
            torch.use_deterministic_algorithms(True)
            assert step()["backward_dq_kernel"] and ran == [True]  # a new key: the full path
            assert step()["backward_dq_kernel"] and ran == [True, True]
            torch.use_deterministic_algorithms(False)
            assert not step()["backward_dq_kernel"] and ran == [True, True, True]
            assert step(grad_lse=torch.randn_like(lse))["backward_dkdv_kernel"] and len(ran) == 3
        finally:
            torch.use_deterministic_algorithms(was)


def test_a_repeated_backward_gives_way_to_the_gluon_backward_when_it_applies(monkeypatch, fresh_signatures):
    """On a plan marked sm_90 below the Gluon backward's key count, a repeated backward runs the FlashAttention-2
    launches; with the Gluon kernels at any length (MHATTN_TRITON_HOPPER=always) the same signature's next
    backward is the Gluon one (hopper_launch.backward), whose decision the _RepeatedBackward answers as its call."""
    from mhattn.backends.triton import hopper_launch

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    ran = counting_repeats(monkeypatch)
    gluon = []
    monkeypatch.setattr(hopper_launch, "backward", lambda *args: gluon.append(args))
    monkeypatch.setattr(hopper_launch, "backward_sums_words", lambda plan, device_index, deterministic: 0)
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "1")
    backend = tb.TritonBackend(deterministic=False)
    params = AttentionParams(scale=0.125, window_right=0)
    # 160 keys: more than the short backward's one block at d = 64, fewer than the Gluon backward's threshold.
    assert 128 < 160 < hopper_launch.BACKWARD_MIN_KEYS[64]
    q, k, v = (torch.randn(2, 4, 160, 64, dtype=torch.bfloat16) for _ in range(3))
    plan = tb._signature_for(q, k, v, params, dense=True).plan
    monkeypatch.setattr(plan, "sm90", True)
    monkeypatch.setattr(plan, "descriptor_strides_ok", True)
    out, lse = torch.randn_like(q), torch.randn(2, 4, 160)
    grad_out = torch.randn_like(out)
    for _ in range(2):
        backend.backward(grad_out, q, k, v, out, lse, params)
    assert ran == [True] and not gluon
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "always")
    backend.backward(grad_out, q, k, v, out, lse, params)
    assert ran == [True] and len(gluon) == 1


def test_a_repeated_gluon_backward_launches_what_its_first_call_prepared(monkeypatch, fresh_signatures):
    """On a plan marked sm_90 whose backward the Gluon kernel takes as one launch: the first call works it out in full
    (hopper_launch.backward, which prepares the signature's site); a repeated call launches the preprocess and that
    site with its own tensors (the Gluon kernel reads this call's q, k, v, output gradient and writes the gradients it
    returns, its dQ sums in the scratch the preprocess zeroes); with the Gluon kernels switched off
    (MHATTN_TRITON_HOPPER=0) the same signature runs the FlashAttention-2 kernels instead."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from test_triton_backend import RecordingLauncher

    from mhattn.backends.triton import hopper_backward, hopper_launch

    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    gluon_launches = []
    monkeypatch.setattr(hopper_launch, "_backward_launcher", [RecordingLauncher(
        hopper_backward.hopper_backward_kernel, lambda grid, named, constexprs: gluon_launches.append(named))])
    sm_counts = []
    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: sm_counts.append(index) or 132)
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "1")
    worked_out = []
    real_backward = hopper_launch.backward
    monkeypatch.setattr(hopper_launch, "backward", lambda *args: worked_out.append(1) or real_backward(*args))
    backend = tb.TritonBackend(deterministic=False)
    params = AttentionParams(scale=0.125, window_right=0)
    seqlen = hopper_launch.BACKWARD_MIN_KEYS[64]
    calls = [[torch.randn(2, 4, seqlen, 64, dtype=torch.bfloat16) for _ in range(5)] for _ in range(3)]
    plan = tb._signature_for(*calls[0][:3], params, dense=True).plan
    monkeypatch.setattr(plan, "sm90", True)
    monkeypatch.setattr(plan, "descriptor_strides_ok", True)
    lse = torch.randn(2, 4, seqlen)
    grads = []
    sums_words = 2 * 4 * (seqlen * 64 + 1)  # each (batch, head)'s float32 dQ sums and its counter
    for q, k, v, out, grad_out in calls:
        launched = backward_launches(jit, launchers, lambda: grads.append(
            backend.backward(grad_out, q, k, v, out, lse, params)))
        assert len(launched["backward_preprocess_kernel"]) == 1 and not launched["backward_dkdv_kernel"]
        # The preprocess zeroes the sums and counters (its seventh tensor), laid out after delta and lse2.
        assert launched["backward_preprocess_kernel"][0][1][6][0] == (sums_words,)
    assert len(worked_out) == 1 and len(gluon_launches) == 3
    # The Hopper decision is worked out once per plan and setting, not at every call (nor the SM count it may read).
    assert len(plan.hopper_reasons) == 1 and len(sm_counts) == 1
    for (q, k, v, out, grad_out), (dq, dk, dv, _), named in zip(calls, grads, gluon_launches):
        assert named["q_desc"].base is q and named["k_desc"].base is k and named["v_desc"].base is v
        assert named["do_desc"].base is grad_out and named["dQ"] is dq
        assert named["dk_desc"].base is dk and named["dv_desc"].base is dv
        assert named["dQacc"].shape == q.shape and named["dQacc"].dtype == torch.float32
        assert named["DqCounters"].data_ptr() == named["dQacc"].data_ptr() + q.numel() * 4
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "0")
    q, k, v, out, grad_out = calls[0]
    launched = backward_launches(jit, launchers, lambda: backend.backward(grad_out, q, k, v, out, lse, params))
    assert launched["backward_dkdv_kernel"] and len(gluon_launches) == 3


def _lse_launched(entry) -> torch.Tensor:
    """The lse tensor a recorded forward launch wrote into (argument 4 of attention_forward_kernel)."""
    if entry[0] == "triton":
        return entry[3][4]
    return entry[2][9 + 4].tensor


def test_an_output_only_forward_keeps_its_signature_while_the_settings_stay(monkeypatch, fresh_signatures):
    """native_call's output-only forward of a call without a mask keeps the backend's signature of that call: a
    repeated call passes the kernel what the backend's own path passes without working out its key again. A pinned
    tile configuration or (float32) another matmul precision since then sends the call the backend's own way, which
    launches what that setting gives; a call with a mask gets the backend's own path from the start."""
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=False)
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25, window_right=0)
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    prepared = backend.native_call(q, k, v, params)
    assert isinstance(prepared, tb._PreparedOutputOnly)
    own = forward_launches(jit, launchers, lambda: backend._output_only(q, k, v, params))
    looked_up = []
    real = tb._signature_for
    monkeypatch.setattr(tb, "_signature_for", lambda *a, **kw: looked_up.append(1) or real(*a, **kw))
    again = forward_launches(jit, launchers, lambda: prepared(q, k, v, params))
    assert [launch[1:] for launch in again] == [launch[1:] for launch in own] and not looked_up
    with configs.pin("32,16,4,1"):
        pinned = forward_launches(jit, launchers, lambda: prepared(q, k, v, params))
    assert looked_up and pinned[0][1:] != own[0][1:]  # the pinned tile's launch
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        prepared_fp32 = backend.native_call(q, k, v, params)  # float32, full precision
        del looked_up[:]
        prepared_fp32(q, k, v, params)
        assert not looked_up
        torch.backends.cuda.matmul.allow_tf32 = True
        prepared_fp32(q, k, v, params)
        assert looked_up  # a TF32 signature now: the backend's own path
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    mask = torch.ones(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[2], dtype=torch.bool)
    assert backend.native_call(q, k, v, params.replace(mask=mask)) == backend._output_only


def test_calls_autograd_does_not_track_write_their_lse_into_one_kept_scratch(monkeypatch, fresh_signatures):
    """native_call gives the forward's output alone for calls without a gradient (none asked for, or grad mode
    off) and nothing for calls autograd tracks. Its launches, first or repeated, write the lse into the plan's scratch
    view (the same tensor at every call), where the backend's forward gives each call an lse of its own; plans of one
    device share a buffer until one needs more, and an older view stays where it was."""
    monkeypatch.setattr(layouts, "_scratch_buffers", {})
    jit, launchers = _recording_backend_launchers(monkeypatch, interpret=True)
    kernel = jit["attention_forward_kernel"]
    backend = tb.TritonBackend()
    params = AttentionParams(scale=0.25, window_right=0)
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    output_only = backend.native_call(q, k, v, params)
    assert output_only is not None
    tracked = [t.clone().requires_grad_() for t in (q, k, v)]
    assert backend.native_call(*tracked, params) is None
    with torch.no_grad():
        assert backend.native_call(*tracked, params) is not None
    assert backend.native_call(q, k, v, params.replace(mask_requires_grad=True)) is None

    plan = tb._signature_for(q, k, v, params, dense=True).plan
    written = []
    for _ in range(3):  # the first call worked out in full, then the repeated launch
        before = len(kernel.log)
        out = output_only(q, k, v, params)
        assert out.shape == SHAPE and len(kernel.log) == before + 1
        written.append(_lse_launched(kernel.log[-1]))
    assert all(lse is plan.lse_scratch for lse in written)
    assert plan.lse_scratch.shape == SHAPE[:3] and plan.lse_scratch.is_contiguous()
    kept = [backend.forward(q, k, v, params)[1] for _ in range(2)]
    assert [_lse_launched(entry) for entry in kernel.log[-2:]] == kept
    assert all(lse.data_ptr() != plan.lse_scratch.data_ptr() for lse in kept)

    smaller = [t[:1] for t in (q, k, v)]  # another signature, fewer rows: the same buffer
    backend.native_call(*smaller, params)(*smaller, params)
    smaller_plan = tb._signature_for(*smaller, params, dense=True).plan
    assert smaller_plan.lse_scratch.data_ptr() == plan.lse_scratch.data_ptr()
    larger = [torch.randn(4, *SHAPE[1:]) for _ in range(3)]  # more rows: a new buffer, the old view untouched
    backend.native_call(*larger, params)(*larger, params)
    larger_plan = tb._signature_for(*larger, params, dense=True).plan
    buffers = layouts._scratch_buffers[("cpu", None)]
    assert len(buffers) == 2 and larger_plan.lse_scratch.data_ptr() == buffers[1].data_ptr()
    assert plan.lse_scratch.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()


def test_scratch_made_under_inference_mode_is_an_ordinary_tensor(monkeypatch):
    """A scratch view made by a first call under torch.inference_mode can still be written in place by later calls
    outside it (an inference tensor could not)."""
    monkeypatch.setattr(layouts, "_scratch_buffers", {})
    with torch.inference_mode():
        view = layouts.scratch_rows(torch.device("cpu"), (2, 3, 4))
    assert not view.is_inference()
    view.fill_(1.0)
    with torch.inference_mode():
        layouts.scratch_rows(torch.device("cpu"), (2, 3, 4)).fill_(2.0)
    assert bool((view == 2.0).all())
