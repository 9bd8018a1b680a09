"""The sdpa backend (torch's fused kernels): on the CPU against the float64 reference and through the
conformance suite; its declared gaps as reasons; its kernel setting; on a GPU (marked gpu) each CUDA kernel."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import mhattn
from mhattn.backends import sdpa
from mhattn.backends.base import AttentionParams
from mhattn.conformance.cases import full_cases
from mhattn.conformance.runner import PASS, run_case
from mhattn.problem import Problem

SDPA = sdpa.SdpaBackend(cuda=True)  # the kernel-choice logic of both devices, whatever MHATTN_SDPA_CUDA says


def draw(batch, heads_q, heads_kv, seqlen_q, seqlen_k, dim, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(batch, heads_q, seqlen_q, dim), (batch, heads_kv, seqlen_k, dim), (batch, heads_kv, seqlen_k, dim)]
    return [torch.randn(s, generator=gen, device=device, dtype=dtype).requires_grad_() for s in shapes]


def out_lse_and_grads(backend, q, k, v, **kwargs):
    """out, lse and (dq, dk, dv) of a loss that sends gradients into both the output and the lse. The loss's
    weights are drawn in float32 and rounded to the output's dtype, so runs in different dtypes (a bf16 kernel,
    the float64 reference) weigh the same outputs alike up to that rounding."""
    out, lse = mhattn.attention(q, k, v, return_lse=True, backend=backend, enable_gqa=q.shape[1] != k.shape[1],
                                **kwargs)
    gen = torch.Generator(device=q.device).manual_seed(7)
    g_out = torch.randn(out.shape, generator=gen, device=q.device, dtype=torch.float32).to(out.dtype)
    g_lse = torch.randn(lse.shape, generator=gen, device=q.device, dtype=torch.float32).to(lse.dtype)
    loss = (out * g_out).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * g_lse).sum()
    return (out, lse) + torch.autograd.grad(loss, (q, k, v))


def assert_matches_reference(q, k, v, atol, **kwargs):
    got = out_lse_and_grads("sdpa", q, k, v, **kwargs)
    want = out_lse_and_grads("reference", q, k, v, **kwargs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        finite = ~torch.isinf(b)
        assert torch.allclose(a[finite].double(), b[finite].double(), atol=atol, rtol=0), name


def bool_mask(seqlen_q, seqlen_k):
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, seqlen_q, seqlen_k, generator=gen) > 0.3
    mask[0, 0, 2] = False  # a row that sees no key
    return mask


def float_mask(seqlen_q, seqlen_k):
    gen = torch.Generator().manual_seed(4)
    mask = torch.randn(seqlen_q, seqlen_k, generator=gen, dtype=torch.float64)
    mask[1] = -math.inf
    return mask


CASES = {
    "plain": dict(),
    "causal top-left": dict(is_causal=True),
    "causal top-left Nq>Nk": dict(nq=41, nk=19, is_causal=True),
    "causal bottom-right": dict(mask=causal_lower_right),
    "causal bottom-right Nq>Nk (rows without keys)": dict(nq=41, nk=19, mask=causal_lower_right),
    "decode (Nq=1) bottom-right": dict(nq=1, mask=causal_lower_right),
    "gqa": dict(hq=6, hkv=2),
    "gqa causal": dict(hq=6, hkv=3, is_causal=True),
    "bool mask": dict(mask=bool_mask),
    "float mask": dict(mask=float_mask),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_matches_the_reference_in_float64(case):
    spec = dict(CASES[case])
    nq, nk, hq, hkv = spec.pop("nq", 23), spec.pop("nk", 37), spec.pop("hq", 4), spec.pop("hkv", 4)
    make_mask = spec.pop("mask", None)
    q, k, v = draw(2, hq, hkv, nq, nk, 16)
    if make_mask is not None:
        spec["attn_mask"] = make_mask(nq, nk)
    assert mhattn.explain(q, k, v, enable_gqa=hq != hkv, **spec).chosen == "sdpa"
    assert_matches_reference(q, k, v, atol=1e-10, **spec)


def test_cpu_float32_is_the_fused_kernel_with_linear_memory():
    q, k, v = draw(1, 2, 2, 300, 300, 32, dtype=torch.float32)
    assert_matches_reference(q, k, v, atol=2e-5, is_causal=True)


def test_conformance_suite_passes_on_the_cpu():
    cases = full_cases(SDPA, "cpu", ["fp16", "fp32"])
    results = [run_case(SDPA, c) for c in cases]
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status not in (PASS, "unsupported")]
    assert not failed, "\n".join(failed)
    assert sum(r.status == PASS for r in results) >= 100


def problem(**overrides):
    fields = dict(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=1,
                  heads_q=8, heads_kv=8, seqlen_q=512, seqlen_k=512, head_dim=128, head_dim_v=128,
                  features=frozenset())
    fields.update(overrides)
    return Problem(**fields)


@pytest.mark.parametrize("feature, words", [("dropout", "dropout"), ("window", "sliding window"),
                                            ("softcap", "softcap"), ("mask_grad", "gradient"),
                                            ("value_dim", "value head dim")])
def test_what_sdpa_cannot_do_is_a_reason(feature, words):
    for device in ("cpu", "cuda"):
        reasons = SDPA.unsupported(problem(device_type=device, features=frozenset({feature})))
        assert len(reasons) == 1 and words in reasons[0]


def test_cuda_kernels_declare_their_limits():
    assert SDPA.unsupported(problem()) == []
    assert SDPA.unsupported(problem(dtype=torch.float64))                       # no CUDA kernel takes float64
    assert SDPA.unsupported(problem(head_dim=59, head_dim_v=59))                # multiples of 8 only
    assert "attn_mask" in " ".join(SDPA.unsupported(problem(features=frozenset({"bool_mask"}))))
    rect = dict(seqlen_q=128, seqlen_k=512, features=frozenset({"causal"}))
    assert SDPA.unsupported(problem(diag_offset=384, **rect)) == []             # bottom-right: flash
    assert SDPA.unsupported(problem(diag_offset=0, **rect)) == []               # top-left: efficient
    assert SDPA.unsupported(problem(seqlen_q=128, seqlen_k=512, diag_offset=0, heads_kv=2,
                                    features=frozenset({"causal", "gqa"})))      # top-left GQA: none of them
    pinned = {name: sdpa.SdpaBackend(kernel=name, cuda=True) for name in ("flash", "efficient", "cudnn")}
    assert pinned["flash"].unsupported(problem(diag_offset=0, **rect))
    assert pinned["efficient"].unsupported(problem(diag_offset=384, **rect))
    assert pinned["cudnn"].unsupported(problem(heads_kv=2, features=frozenset({"gqa"})))
    assert pinned["cudnn"].unsupported(problem(compute_capability=(8, 0)))
    assert pinned["flash"].unsupported(problem(heads_kv=2, features=frozenset({"gqa"}))) == []
    decode = problem(seqlen_q=1, seqlen_k=4096, diag_offset=4095, features=frozenset({"causal"}))
    assert pinned["cudnn"].unsupported(decode) == []                            # causal that hides nothing
    assert "cudnn" in pinned["cudnn"].unsupported(problem(device_type="cpu", compute_capability=None))[0]


def test_kernel_setting(monkeypatch):
    monkeypatch.setenv(sdpa.KERNEL_ENV, "FLASH")
    assert sdpa.SdpaBackend().kernel == "flash"
    monkeypatch.setenv(sdpa.KERNEL_ENV, "math")
    with pytest.raises(mhattn.InputError, match="MHATTN_SDPA_KERNEL='math'.*auto, flash, efficient, cudnn"):
        sdpa.SdpaBackend()
    with pytest.raises(mhattn.InputError, match="kernel='bogus'"):
        sdpa.SdpaBackend(kernel="bogus")


def test_sdpa_is_a_backend_name_and_first_on_the_cpu():
    assert "sdpa" in mhattn.backend_names()
    with pytest.raises(mhattn.UnknownBackendError, match="sdpa"):
        mhattn.attention(*draw(1, 1, 1, 4, 4, 8), backend="nope")
    mha = mhattn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch_mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    torch_mha.load_state_dict(mha.state_dict())
    out, _ = mha(x, x, x, need_weights=False)
    want, _ = torch_mha(x, x, x, need_weights=False)
    assert torch.allclose(out, want, atol=1e-12)


def test_the_registry_holds_sdpa_pinned_to_each_cuda_kernel_as_a_variant():
    """sdpa.flash, sdpa.efficient and sdpa.cudnn: the sdpa backend pinned to one of torch's CUDA kernels, each
    with that kernel's limits as its reasons, selectable by name, and a variant of sdpa (automatic selection weighs
    them only through a timing table)."""
    for name in ("flash", "efficient", "cudnn"):
        backend = mhattn.get_backend(f"sdpa.{name}")
        assert isinstance(backend, sdpa.SdpaBackend) and backend.kernel == name and backend.variant_of == "sdpa"
        assert f"pinned to torch's {name} kernel" in backend.description
    assert mhattn.get_backend("sdpa").variant_of is None
    gqa = problem(heads_kv=2, features=frozenset({"gqa"}))
    assert mhattn.get_backend("sdpa.flash").unsupported(gqa) == []
    assert "would repeat K and V for GQA" in " ".join(mhattn.get_backend("sdpa.cudnn").unsupported(gqa))
    assert "needs sm_90" in " ".join(mhattn.get_backend("sdpa.cudnn").unsupported(problem(compute_capability=(8, 0))))
    cpu = problem(device_type="cpu", compute_capability=None)
    assert mhattn.get_backend("sdpa.efficient").unsupported(cpu) == ["torch's efficient kernel has no cpu form"]
    from mhattn import dispatch

    assert not [n for n in dispatch.priority_for(problem()) if n.startswith("sdpa.")]  # never in the priority list


@pytest.mark.parametrize("kernel, args", [("efficient", (None, True, 0.0, True)), ("cudnn", (None, True, 0.0, True)),
                                          ("flash", (0.0, True))])
def test_a_pinned_kernel_s_call_runs_its_private_op_binding_with_the_lse_only_where_autograd_needs_it(
        kernel, args, monkeypatch):
    seen = []
    binding = f"_scaled_dot_product_{kernel}_attention"
    monkeypatch.setattr(torch, binding, lambda *a, **kw: seen.append((a[3:], kw)) or ("out", "lse"))
    q = torch.zeros(1, 2, 3, 16)
    assert sdpa._PinnedKernelCall(kernel, 16, 0.25, True, True)(q, q, q, None) == "out"
    assert seen == [(args, {})]  # 1 / sqrt(16): SDPA's default scale, not passed
    sdpa._PinnedKernelCall(kernel, 16, 0.5, False, False)(q, q, q, None)
    untracked = args[:1] + (False,) + args[2:3] + (False,) if kernel != "flash" else (0.0, False)
    assert seen[1] == (untracked, {"scale": 0.5})


# ---- GPU: each CUDA kernel against the reference --------------------------------------------------------


def test_cuda_path_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(sdpa.CUDA_ENV, raising=False)
    assert sdpa.SdpaBackend().unsupported(problem()) == []
    for off in ("0", "off", "False"):
        monkeypatch.setenv(sdpa.CUDA_ENV, off)
        reasons = sdpa.SdpaBackend().unsupported(problem())
        assert len(reasons) == 1 and sdpa.CUDA_ENV in reasons[0], off
        assert sdpa.SdpaBackend().unsupported(problem(device_type="cpu", compute_capability=None)) == []
    assert sdpa.SdpaBackend(cuda=False).unsupported(problem()) != []
    monkeypatch.setenv(sdpa.CUDA_ENV, "1")
    assert sdpa.SdpaBackend().unsupported(problem()) == []


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "flash", "efficient", "cudnn"])
@pytest.mark.parametrize("case", ["plain", "causal", "bottom-right", "gqa", "decode"])
def test_cuda_kernels_match_the_reference(kernel, case):
    backend = sdpa.SdpaBackend(kernel=kernel, cuda=True)
    nq, nk, hkv, kwargs = 256, 256, 4, {}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "bottom-right":
        nq, nk = 96, 300
        kwargs["attn_mask"] = causal_lower_right(nq, nk)
    elif case == "gqa":
        hkv = 2
    elif case == "decode":
        nq, nk, kwargs["attn_mask"] = 1, 1000, causal_lower_right(1, 1000)
    q, k, v = draw(2, 4, hkv, nq, nk, 64, dtype=torch.bfloat16, device="cuda")
    params_problem = mhattn.explain(q, k, v, enable_gqa=hkv != 4, backend="reference", **kwargs).problem
    if backend.unsupported(params_problem):
        pytest.skip("; ".join(backend.unsupported(params_problem)))
    mhattn.register_backend(backend, replace=True)
    try:
        got = out_lse_and_grads("sdpa", q, k, v, **kwargs)
    finally:
        mhattn.register_backend(sdpa.SdpaBackend(), replace=True)  # back to the default
    want = out_lse_and_grads("reference", *(t.detach().double().requires_grad_() for t in (q, k, v)), **kwargs)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all() or name == "lse", name
        finite = ~torch.isinf(b)
        err = (a.double()[finite] - b[finite]).abs().max().item()
        assert err <= 0.02 * b[finite].abs().max().item() + 0.01, (name, err)


def test_backward_hands_the_kernels_an_output_gradient_laid_out_like_the_output(monkeypatch):
    """torch's backward kernels get grad_out in out's layout (as torch's own autograd gives it), whatever
    layout the caller's gradient has."""
    seen = {}

    class Ops:
        @staticmethod
        def backward(grad_out, q, k, v, out, lse, scale, plan):
            seen["grad_out"], seen["out"] = grad_out.stride(), out.stride()
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    backend = sdpa.SdpaBackend()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    out = torch.randn(1, 8, 2, 16).transpose(1, 2)          # (B, H, N, D) with (B, N, H, D) memory
    monkeypatch.setitem(sdpa._OPS, ("cpu", "flash"), Ops)
    monkeypatch.setattr(backend, "_choose", lambda *a: sdpa.KERNELS[0])
    backend.backward(torch.randn(1, 2, 8, 16), q, k, v, out, torch.zeros(1, 2, 8), AttentionParams(scale=0.25))
    assert seen["grad_out"] == seen["out"] == out.stride()


def test_cudnn_backward_after_another_backend_s_forward_gets_out_in_q_s_layout(monkeypatch):
    """torch caches a cuDNN backward graph by q, k and v's strides alone: out and grad_out from another backend's
    forward (a pair's) reach the cuDNN backward in q's layout, the one cuDNN's own forward writes, whatever layout
    they come in, so no graph built for one out layout is used for another."""
    from mhattn.backends import layouts

    seen = []

    class Ops:
        @staticmethod
        def backward(grad_out, q, k, v, out, lse, scale, plan):
            seen.append((out.stride(), grad_out.stride()))
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    backend = sdpa.SdpaBackend()
    cudnn = next(kern for kern in sdpa.KERNELS if kern.name == "cudnn")
    monkeypatch.setitem(sdpa._OPS, ("cuda", "cudnn"), Ops)
    monkeypatch.setattr(backend, "_choose", lambda *a: cudnn)
    q_layouts = (torch.randn(1, 2, 8, 16), torch.randn(1, 8, 2, 16).transpose(1, 2))
    out_layouts = (torch.randn(1, 2, 8, 16), torch.randn(1, 8, 2, 16).transpose(1, 2))
    for q in q_layouts:
        k = v = torch.randn(1, 2, 8, 16)
        for out in out_layouts:
            backend.backward(torch.randn(1, 2, 8, 16), q, k, v, out, torch.zeros(1, 2, 8), AttentionParams(scale=0.25))
        assert seen == [(q.stride(), q.stride())] * 2
        seen.clear()
    assert layouts.strides_in_order_of(q_layouts[1], (3, 2, 8, 5)) == (80, 5, 10, 1)


@pytest.mark.gpu
def test_cuda_cudnn_backward_gives_the_reference_s_gradients_for_outputs_in_any_layout():
    """On a GPU: one q layout, out handed to the cuDNN backward first in q's layout and then in the row-major heads
    layout (as the Triton and CuPy forwards write it): both give the float64 reference's gradients (torch's graph
    cache would reuse the first call's graph for the second)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")
    backend = sdpa.SdpaBackend(kernel="cudnn", cuda=True)
    q, k, v = (t.detach() for t in draw(2, 3, 3, 384, 384, 64, dtype=torch.bfloat16, device="cuda", seed=5))
    if backend.unsupported(Problem.from_tensors(q, k, v, AttentionParams(scale=0.125), causal=False, window=False)):
        pytest.skip("cuDNN attention cannot run here")
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, scale=0.125)
    lse = torch.logsumexp(ref[0].detach() @ ref[1].detach().transpose(-1, -2) * 0.125, -1).float()
    grad_out = torch.randn(ref_out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    want = torch.autograd.grad(ref_out, ref, grad_out)
    from mhattn.backends import layouts

    out = ref_out.detach().to(torch.bfloat16)
    for placed_out in (out.contiguous(), layouts.placed(out, layouts.rows_major_strides(*out.shape))):
        got = backend.backward(grad_out.to(torch.bfloat16), q, k, v, placed_out, lse, AttentionParams(scale=0.125))
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            err = (a.double() - b).abs().max().item()
            assert err <= 0.02 * b.abs().max().item() + 0.01, (name, placed_out.stride(), err)


# ---- torch's own autograd for calls that return no lse ------------------------------------------------------


@pytest.mark.parametrize("case", ["plain", "causal", "gqa"])
def test_calls_without_lse_take_torch_s_own_autograd_and_match_the_reference(case):
    kwargs = {"is_causal": True} if case == "causal" else {}
    q, k, v = draw(2, 4, 2 if case == "gqa" else 4, 33, 33, 16, dtype=torch.float32)
    out = mhattn.attention(q, k, v, backend="sdpa", enable_gqa=case == "gqa", **kwargs)
    assert "EagerAttention" not in type(out.grad_fn).__name__  # torch's C++ backward node, not mhattn's
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = (out,) + torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mhattn.attention(qd, kd, vd, backend="reference", enable_gqa=case == "gqa", **kwargs)
    want = (ref,) + torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("case", ["return_lse", "mask", "bottom_right", "pinned_kernel", "window"])
def test_calls_torch_s_public_op_cannot_run_exactly_keep_mhattn_s_path(case, monkeypatch):
    q, k, v = draw(1, 2, 2, 20, 30, 16, dtype=torch.float32)
    kwargs, backend = {}, sdpa.SdpaBackend()
    if case == "mask":
        kwargs["attn_mask"] = bool_mask(20, 30)[:1]
    elif case == "bottom_right":
        kwargs["attn_mask"] = causal_lower_right(20, 30)
    elif case == "pinned_kernel":
        backend = sdpa.SdpaBackend(kernel="flash")
    elif case == "window":
        kwargs["window"] = (4, 4)
        backend = None  # sdpa cannot run windows: the reference gets the call, which has no native path
    if backend is not None:
        mhattn.register_backend(backend, replace=True)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or pytest.fail("torch's public op was called"))
    try:
        result = mhattn.attention(q, k, v, return_lse=case == "return_lse", **kwargs)
    finally:
        mhattn.register_backend(sdpa.SdpaBackend(), replace=True)
    out = result[0] if case == "return_lse" else result
    assert calls == [] and "EagerAttention" in type(out.grad_fn).__name__


def test_a_decoding_step_s_bottom_right_mask_hides_nothing_and_takes_torch_s_public_op():
    """One query row under causal_lower_right (a diagonal at the last key) sees every key: the call goes to torch's public op without a mask, with torch's own autograd, and matches the
    reference, output and gradients."""
    q, k, v = draw(1, 4, 2, 1, 30, 16, dtype=torch.float32)
    out = mhattn.attention(q, k, v, attn_mask=causal_lower_right(1, 30), enable_gqa=True, backend="sdpa")
    assert "EagerAttention" not in type(out.grad_fn).__name__
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = (out,) + torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mhattn.attention(qd, kd, vd, attn_mask=causal_lower_right(1, 30), enable_gqa=True, backend="reference")
    want = (ref,) + torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=0), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "sdpa.flash", "sdpa.efficient", "sdpa.cudnn"])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa"])
def test_cuda_calls_without_lse_take_torch_s_own_autograd_and_match_the_reference(case, backend):
    """torch's public op (sdpa) or the pinned kernel's private op binding (sdpa.<kernel>), with torch's own autograd
    node, against the float64 reference; a pinned kernel's output and gradients also equal the same kernel's through
    mhattn's own path (the backend's forward and backward), which runs that kernel's private ops too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")
    kwargs = {"is_causal": True} if case == "causal" else {}
    q, k, v = draw(2, 4, 2 if case == "gqa" else 4, 256, 256, 64, dtype=torch.bfloat16, device="cuda")
    reasons = mhattn.explain(q, k, v, backend=backend, enable_gqa=case == "gqa", **kwargs).reasons[backend]
    if reasons:
        pytest.skip("; ".join(reasons))
    out = mhattn.attention(q, k, v, backend=backend, enable_gqa=case == "gqa", **kwargs)
    assert "EagerAttention" not in type(out.grad_fn).__name__
    g = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                    dtype=torch.float32).to(out.dtype)
    got = (out,) + torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mhattn.attention(qd, kd, vd, backend="reference", enable_gqa=case == "gqa", **kwargs)
    want = (ref,) + torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.double() - b).abs().max().item()
        assert err <= 0.02 * b.abs().max().item() + 0.01, (name, err)
    if backend == "sdpa":
        return
    own, _ = mhattn.attention(q, k, v, backend=backend, enable_gqa=case == "gqa", return_lse=True, **kwargs)
    assert "EagerAttention" in type(own.grad_fn).__name__
    mine = (own,) + torch.autograd.grad(own, (q, k, v), g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, mine):
        # the same kernels, their inputs laid out alike or not: a few bf16 roundings apart at most
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2 ** -6 * b.float().abs().max().item() + 1e-3, (name, err)


def test_backward_hands_the_kernel_its_own_output_layout_back(monkeypatch):
    """Under torch.compile the output reaches the backward in the custom op's promised layout (a copy); the
    backend gives torch's backward kernel the output as the forward kernel wrote it, and a matching gradient."""
    from mhattn.backends import layouts

    backend = sdpa.SdpaBackend()
    q, k, v = (t.detach() for t in draw(1, 2, 2, 24, 24, 16, dtype=torch.float32))
    params = AttentionParams(scale=0.25)
    out, lse = backend.forward(q, k, v, params)
    promised = layouts.placed(out, layouts.rows_major_strides(1, 2, 24, 16))
    assert promised.stride() != out.stride()
    seen = []
    kernel_ops = sdpa._OPS[("cpu", "flash")]
    original = kernel_ops.backward
    monkeypatch.setattr(kernel_ops, "backward", staticmethod(
        lambda grad_out, q_, k_, v_, out_, *rest: seen.append((out_.stride(), grad_out.stride()))
        or original(grad_out, q_, k_, v_, out_, *rest)))
    grad_out = torch.randn(out.shape)
    got = backend.backward(grad_out, q, k, v, promised, lse, params)
    assert seen == [(out.stride(), out.stride())]
    want = backend.backward(grad_out, q, k, v, out, lse, params)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)


def test_native_call_is_prepared_once_per_signature_and_asks_torch_again_when_its_switches_change(monkeypatch):
    """SdpaBackend.native_call: one prepared call per signature (everything torch's kernel choice reads but its
    global switches), and torch's choice asked once per state of the switches."""
    backend = sdpa.SdpaBackend()
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    params = AttentionParams(scale=0.25)
    call = backend.native_call(q, k, v, params)
    assert backend.native_call(q.clone(), k.clone(), v.clone(), params) is call
    transposed = torch.randn(1, 9, 2, 16).transpose(1, 2)
    with torch.no_grad():
        no_grad_mode = backend.native_call(q, k, v, params)
    others = [
        backend.native_call(transposed, k, v, params),
        no_grad_mode,
        backend.native_call(q.detach().requires_grad_(True), k, v, params),
        backend.native_call(q, k, v, params.replace(scale=0.5)),
        backend.native_call(q, k, v, params.replace(window_right=0)),  # causal
    ]
    assert len({id(c) for c in others + [call]}) == 6
    assert backend.native_call(q, k, v, params.replace(window_right=0, diag_offset=2)) is None  # bottom-right
    # a diagonal that hides no key (a decoding step's bottom-right mask) is the call without a mask
    for offset in (8, 12):
        assert backend.native_call(q, k, v, params.replace(window_right=0, diag_offset=offset)) is call
    one_key = backend.native_call(q, k[:, :, :1], v[:, :, :1], params.replace(window_right=0))  # top-left, Nk = 1
    assert one_key is backend.native_call(q, k[:, :, :1], v[:, :, :1], params)

    asked = []
    real_choice = torch._fused_sdp_choice
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: asked.append(1) or real_choice(*a, **kw))
    fresh = sdpa.SdpaBackend().native_call(q, k, v, params)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert torch.equal(fresh(q, k, v, params), want) and torch.equal(fresh(q, k, v, params), want) and len(asked) == 1
    with sdpa_kernel([SDPBackend.MATH]):
        assert fresh(q, k, v, params) is None and len(asked) == 2  # torch would run its math path
    order = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(order, set_priority=True):  # every kernel enabled, in another order
        assert torch.equal(fresh(q, k, v, params), want) and len(asked) == 3
    assert torch.equal(fresh(q, k, v, params), want) and len(asked) == 3


def test_native_call_passes_a_scale_only_where_it_is_not_sdpas_default(monkeypatch):
    """The prepared call leaves out SDPA's scale keyword where the scale is SDPA's own default 1 / sqrt(D) (D = 16
    and 80) and passes any other; the outputs equal SDPA's either way."""
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(sorted(kw)) or real_sdpa(*a, **kw))
    for head_dim in (16, 80):
        q, k, v = (torch.randn(1, 2, 9, head_dim) for _ in range(3))
        for scale, keywords in ((1.0 / math.sqrt(head_dim), []), (0.3, ["scale"])):
            params = AttentionParams(scale=scale)
            seen.clear()
            out = sdpa.SdpaBackend().native_call(q, k, v, params)(q, k, v, params)
            assert seen == [keywords] and torch.equal(out, real_sdpa(q, k, v, scale=scale))
