"""Repeated calls of mhattn.attention (the memo of _call_key): whatever can change between two calls with equal
arguments (MHATTN_BACKEND, use_backend, torch's global SDPA switches, strides, grad mode, requires_grad, the
dropout seed) is honoured by the second call, on the backends' own paths and on torch's SDPA alike."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import mhattn
from mhattn import dispatch, functional
from mhattn.backends import sdpa


@pytest.fixture(autouse=True)
def no_env_request(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    yield
    dispatch.clear_cache()


def rand(*shape, requires_grad=False):
    return torch.randn(*shape).requires_grad_(requires_grad)


def close(a, b, tol=1e-5):
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


def takes_torch_s_own_path(out) -> bool:
    """Whether a call's output came from torch's public SDPA (its C++ backward node) rather than mhattn's Function."""
    return out.grad_fn is not None and "EagerAttention" not in type(out.grad_fn).__name__


def test_mhattn_backend_set_changed_or_unset_between_equal_calls_is_honoured(monkeypatch, recorders):
    a, b = recorders
    q, k, v = rand(2, 3, 7, 8), rand(2, 3, 9, 8), rand(2, 3, 9, 8)
    want = F.scaled_dot_product_attention(q, k, v)
    assert close(mhattn.attention(q, k, v), want) and a.calls == b.calls == []  # auto: sdpa on the CPU
    monkeypatch.setenv(dispatch.ENV_VAR, "rec_a")
    assert close(mhattn.attention(q, k, v), want) and a.calls == ["forward"]
    monkeypatch.setenv(dispatch.ENV_VAR, " REC_B ")
    assert close(mhattn.attention(q, k, v), want) and b.calls == ["forward"]
    with mhattn.use_backend("rec_a"):  # use_backend over the environment
        mhattn.attention(q, k, v)
    assert a.calls == ["forward"] * 2
    monkeypatch.setenv(dispatch.ENV_VAR, "no_such_backend")
    with pytest.raises(mhattn.UnknownBackendError, match="no_such_backend"):
        mhattn.attention(q, k, v)
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert close(mhattn.attention(q, k, v), want)
    assert a.calls == ["forward"] * 2 and b.calls == ["forward"]


def test_torch_s_global_sdpa_switches_changed_between_equal_calls_are_honoured():
    q, k, v = (rand(1, 2, 11, 16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 11, 16)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    want_grads = torch.autograd.grad(want, (qr, kr, vr), g)
    for switches, torch_s_path in ((None, True), ([SDPBackend.MATH], False), (None, True),
                                   ([SDPBackend.FLASH_ATTENTION], True)):
        with sdpa_kernel(switches) if switches else contextlib.nullcontext():
            out = mhattn.attention(q, k, v, is_causal=True)
        # Where the switches leave torch's public op its math path only, mhattn runs torch's fused kernel itself.
        assert takes_torch_s_own_path(out) == torch_s_path
        grads = torch.autograd.grad(out, (q, k, v), g)
        assert close(out, want) and all(close(a, b) for a, b in zip(grads, want_grads))


def test_strides_changed_between_calls_of_equal_shapes_are_honoured(recorders):
    a, _ = recorders
    seen = []
    real_forward = a.forward
    a.forward = lambda q, k, v, params: seen.append((q.stride(), k.stride())) or real_forward(q, k, v, params)
    k, v = rand(2, 3, 9, 8), rand(2, 3, 9, 8)
    dense = rand(2, 3, 7, 8)
    transposed = rand(2, 7, 3, 8).transpose(1, 2)  # same shape, (B, N, H, D) memory
    every_other = rand(2, 3, 7, 16)[..., ::2]  # same shape, a last dim that is not contiguous
    for q in (dense, transposed, every_other, dense, transposed):
        for backend in ("rec_a", "sdpa"):
            assert close(mhattn.attention(q, k, v, backend=backend), F.scaled_dot_product_attention(q, k, v))
    # Each call's own strides reach the backend, a contiguous copy where the last dim is not.
    assert [s[0] for s in seen] == [(168, 56, 8, 1), (168, 8, 24, 1), (168, 56, 8, 1), (168, 56, 8, 1),
                                    (168, 8, 24, 1)]


def test_grad_mode_and_requires_grad_changed_between_equal_calls_are_honoured():
    q, k, v = (rand(2, 2, 5, 8) for _ in range(3))
    for backend in ("reference", "sdpa"):
        with torch.no_grad():
            assert mhattn.attention(q.requires_grad_(True), k, v, backend=backend).grad_fn is None
        out = mhattn.attention(q, k, v, backend=backend)  # grad mode on: tracked, by mhattn's Function or torch's
        assert takes_torch_s_own_path(out) == (backend == "sdpa")
        (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
        qr = q.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(F.scaled_dot_product_attention(qr, k, v), qr, torch.ones_like(out))
        assert close(dq, want)
        assert mhattn.attention(q.detach(), k, v, backend=backend).grad_fn is None  # nothing requires grad
        q.requires_grad_(False)


def test_repeated_dropout_calls_draw_a_fresh_seed_each(recorders):
    a, _ = recorders
    q, k, v = rand(1, 2, 6, 8), rand(1, 2, 10, 8), rand(1, 2, 10, 8)
    torch.manual_seed(5)
    outs = [mhattn.attention(q, k, v, dropout_p=0.3, backend="rec_a") for _ in range(3)]
    torch.manual_seed(5)
    seeds = [torch.randint(0, 2**32, (2,), dtype=torch.int64) for _ in range(3)]
    assert all(torch.equal(got, want) for got, want in zip(a.seeds, seeds))
    assert not torch.equal(outs[1], outs[2])


def test_repeated_calls_keep_the_caller_s_leading_dims():
    for shape in ((3, 6, 8), (2, 1, 3, 6, 8)):
        q, k, v = rand(*shape), rand(*shape), rand(*shape)
        want = F.scaled_dot_product_attention(q, k, v)
        for backend in ("sdpa", "reference", "sdpa"):
            assert close(mhattn.attention(q, k, v, backend=backend), want)
            out, lse = mhattn.attention(q, k, v, backend=backend, return_lse=True)
            assert close(out, want) and lse.shape == shape[:-1]


def test_a_repeated_call_skips_the_checks_and_the_sdpa_backend_s_own_look_up(monkeypatch):
    q, k, v = rand(1, 4, 9, 16), rand(1, 2, 9, 16), rand(1, 2, 9, 16)
    first = mhattn.attention(q, k, v, enable_gqa=True)
    prepared = []
    monkeypatch.setattr(functional, "_prepare", lambda *a: prepared.append(1))
    monkeypatch.setattr(sdpa.SdpaBackend, "native_call", lambda *a: prepared.append(1))
    assert torch.equal(mhattn.attention(q, k, v, enable_gqa=True), first) and prepared == []
    assert close(first, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_a_repeated_call_with_a_causal_alignment_object_skips_the_checks_and_keeps_its_alignment(monkeypatch):
    """causal_lower_right / causal_upper_left (a chunked prefill, a speculative decoding step) are their variant and
    sizes: a repeated call with an equal object is served from the memo, each alignment by its own plan, and one
    whose sizes do not match the tensors raises at every call."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = rand(1, 4, 5, 16), rand(1, 2, 12, 16), rand(1, 2, 12, 16)
    want = {}
    for make in (causal_lower_right, causal_upper_left):
        got = mhattn.attention(q, k, v, attn_mask=make(5, 12), enable_gqa=True)
        visible = make(5, 12)._materialize(torch.device("cpu"))
        want[make] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        assert close(got, want[make])
    assert not close(want[causal_lower_right], want[causal_upper_left])
    prepared = []
    real_prepare = functional._prepare
    monkeypatch.setattr(functional, "_prepare", lambda *a: prepared.append(1) or real_prepare(*a))
    for make in (causal_lower_right, causal_upper_left):
        assert close(mhattn.attention(q, k, v, attn_mask=make(5, 12), enable_gqa=True), want[make])
    assert prepared == []
    for _ in range(2):
        with pytest.raises(mhattn.InputError, match="causal bias for"):
            mhattn.attention(q, k, v, attn_mask=causal_lower_right(5, 13), enable_gqa=True)
    assert prepared == [1, 1]


def test_repeated_calls_with_a_window_skip_the_checks_and_keep_their_window(monkeypatch):
    """A window of ints or None is its values in the memo's key (as the Hugging Face integration passes the causal
    bound beside a padding mask): repeated calls with equal windows skip the checks, each window keeps its own plan,
    and windows the checks refuse (a bool, a negative bound other than -1) raise at every call."""
    q, k, v = rand(1, 2, 12, 16), rand(1, 2, 12, 16), rand(1, 2, 12, 16)
    keys = (torch.arange(12) >= 3).view(1, 1, 1, 12)
    windows = ((-1, 0), (3, 0), [2, None], (None, 1))
    want = {tuple(w): mhattn.attention(q, k, v, attn_mask=keys, window=w, backend="reference") for w in windows}
    assert not close(want[(-1, 0)], want[(3, 0)])
    prepared = []
    real_prepare = functional._prepare
    monkeypatch.setattr(functional, "_prepare", lambda *a: prepared.append(1) or real_prepare(*a))
    for w in windows:
        assert torch.equal(mhattn.attention(q, k, v, attn_mask=keys, window=w, backend="reference"), want[tuple(w)])
    assert prepared == []
    for bad in ((True, 0), (-2, 0)):
        for _ in range(2):
            with pytest.raises(mhattn.InputError, match="window"):
                mhattn.attention(q, k, v, window=bad, backend="reference")
    assert prepared == [1, 1, 1, 1]


@pytest.mark.parametrize("backend", ["reference", "sdpa", None])
def test_repeated_calls_with_a_mask_tensor_skip_the_checks_and_read_each_call_s_mask(monkeypatch, backend):
    """A mask tensor is its layout in the memo's key: a repeated call with another mask of the same layout (a
    key-padding mask whose padding moves, a float bias, broadcast leading dims) skips the checks and the decision and
    still attends as its own mask says, forward and backward (a float mask's gradient too); a mask of another layout
    or dtype takes the full path again."""
    q, k, v = rand(2, 3, 4, 6, 8, requires_grad=True), rand(2, 3, 4, 9, 8), rand(2, 3, 4, 9, 8)
    prepared = []
    real_prepare = functional._prepare

    def masks(step):
        keys = torch.arange(9) >= torch.tensor([[step], [3 - step], [2 * step]])  # left padding, moving
        bias = torch.randn(3, 4, 6, 9, generator=torch.Generator().manual_seed(step))
        return keys.view(3, 1, 1, 9), bias.requires_grad_(backend != "sdpa")  # (its kernels give no mask gradient)

    for step in range(3):
        padding, bias = masks(step)
        if step == 1:  # the first calls made the plans
            monkeypatch.setattr(functional, "_prepare", lambda *a: prepared.append(1) or real_prepare(*a))
        for mask in (padding, bias):
            out = mhattn.attention(q, k, v, attn_mask=mask, backend=backend)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            assert close(out, want, 1e-4)
            grads = torch.autograd.grad(out.square().sum(), (q, mask) if mask.requires_grad else (q, ))
            wants = torch.autograd.grad(want.square().sum(), (q, mask) if mask.requires_grad else (q, ))
            assert all(close(g, w, 1e-4) for g, w in zip(grads, wants))
    assert prepared == []
    mhattn.attention(q, k, v, attn_mask=padding.expand(3, 4, 6, 9).contiguous(), backend=backend)
    assert prepared == [1]


def test_a_plugged_in_backend_with_its_own_differentiable_path_serves_every_repeated_call():
    """A third-party backend that overrides only Backend.native_attention (the plug-in contract) has that path used
    at every call, repeated ones included (Backend.native_call's default), and its gradients reach the inputs."""
    from mhattn.reference import ReferenceBackend

    calls = []

    class OwnPath(ReferenceBackend):
        name = "own-path-test"

        def native_attention(self, q, k, v, params):
            calls.append(1)
            weights = torch.softmax(q @ k.transpose(-1, -2) * params.scale, dim=-1)
            return weights @ v

    mhattn.registry.register_backend(OwnPath())
    try:
        q, k, v = (rand(2, 3, 17, 8, requires_grad=True) for _ in range(3))
        for _ in range(3):
            out = mhattn.attention(q, k, v, backend="own-path-test")
        assert len(calls) == 3 and close(out, F.scaled_dot_product_attention(q, k, v))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
        assert all(close(g, w) for g, w in zip(grads, want))
    finally:
        mhattn.registry.unregister_backend("own-path-test")


def test_a_backend_s_own_path_that_declines_a_repeated_call_is_asked_once_and_its_forward_runs():
    """A repeated plain call goes to the backend's own path straight from the memo; where that path declines the call
    (None), the backend's forward runs it, without a second ask, for 4-D and 3-D inputs alike."""
    from mhattn.reference import ReferenceBackend

    asked, forwards = [], []

    class Declines(ReferenceBackend):
        name = "declines-test"

        def native_call(self, q, k, v, params):
            return lambda *args: asked.append(1)

        def forward(self, q, k, v, params):
            forwards.append(1)
            return super().forward(q, k, v, params)

    mhattn.registry.register_backend(Declines())
    try:
        for shape in ((2, 3, 17, 8), (3, 17, 8)):
            q, k, v = rand(*shape), rand(*shape), rand(*shape)
            asked.clear()
            forwards.clear()
            for _ in range(3):
                out = mhattn.attention(q, k, v, backend="declines-test")
                assert close(out, F.scaled_dot_product_attention(q, k, v))
            assert asked == forwards == [1, 1, 1], shape
    finally:
        mhattn.registry.unregister_backend("declines-test")
