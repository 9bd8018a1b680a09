"""End-to-end checks on a GPU: automatic choice, torch.compile, CUDA graph capture, the module on CUDA."""

import pytest
import torch
import torch.nn.functional as F

import mhattn
import mhattn.backends.base

pytestmark = pytest.mark.gpu


def _fused_backends():
    return [b.name for b in mhattn.registry.all_backends() if b.name != "reference" and not b.unavailable()]


def _skip_unless_it_runs(backend, q, k, v):
    """Skip for a registered backend that declares it cannot run this CUDA problem (the sdpa backend with its
    CUDA path turned off, say), with its reasons."""
    reasons = mhattn.explain(q, k, v, is_causal=True, backend="reference").reasons.get(backend, [])
    if reasons:
        pytest.skip(f"{backend} cannot run it: " + "; ".join(reasons))


def test_auto_picks_a_fused_kernel_for_the_common_case():
    q = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    decision = mhattn.explain(q, q, q, is_causal=True)
    assert decision.chosen != "reference", str(decision)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_fp32_module_default_does_not_land_on_reference(dtype):
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=dtype)
    decision = mhattn.explain(q, q, q)
    assert decision.chosen != "reference", str(decision)


@pytest.mark.parametrize("backend", _fused_backends() or ["none"])
def test_torch_compile_fullgraph_on_gpu(backend):
    if backend == "none":
        pytest.skip("no fused backend available")
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    _skip_unless_it_runs(backend, q, k, v)

    def loss(a, b, c):
        return mhattn.attention(a, b, c, is_causal=True, backend=backend).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    value = compiled(q, k, v)
    value.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = loss(q, k, v)
    eager.backward()
    assert torch.allclose(value, eager, rtol=1e-3)
    native = type(mhattn.registry.get_backend(backend)).native_attention is not mhattn.backends.base.Backend.native_attention
    for got, t in zip(grads, (q, k, v)):
        if native:  # eager calls take the backend's own autograd path (torch's SDPA), compiled ones mhattn's op
            assert (got.float() - t.grad.float()).abs().max() <= 0.02 * t.grad.float().abs().max() + 1e-2
        else:
            assert torch.equal(got, t.grad)  # same kernels, same inputs: bitwise equal


@pytest.mark.parametrize("backend", _fused_backends() or ["none"])
def test_cuda_graph_capture_replays_the_forward(backend):
    if backend == "none":
        pytest.skip("no fused backend available")
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    _skip_unless_it_runs(backend, q, k, v)
    mhattn.attention(q, k, v, is_causal=True, backend=backend)  # compile and cache outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mhattn.attention(q, k, v, is_causal=True, backend=backend)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert (out.float() - want).abs().max() < 2e-2


def test_module_on_cuda_matches_torch_in_bf16():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(256, 4, batch_first=True, device="cuda", dtype=torch.bfloat16)
    ours = mhattn.MultiheadAttention(256, 4, batch_first=True, device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    pad = torch.zeros(2, 300, dtype=torch.bool, device="cuda")
    pad[1, 250:] = True
    want, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    got, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
    assert (got.float() - want.float()).abs().max() < 5e-2
