"""mhattn.attention against torch's scaled_dot_product_attention (CPU, fp32/fp64) and its error messages."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import mhattn
from mhattn.dropout_rng import keep_mask
from mhattn.reference import ReferenceBackend, naive_attention


def rand(*shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def check_against_sdpa(q, k, v, tol=1e-5, **kwargs):
    """Output and gradients of mhattn.attention and SDPA agree for the same arguments."""
    q1, k1, v1 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mask = kwargs.pop("attn_mask", None)
    m1 = m2 = mask
    if isinstance(mask, torch.Tensor) and not isinstance(mask, CausalBias) and mask.is_floating_point():
        m1, m2 = (mask.detach().clone().requires_grad_(True) for _ in range(2))
    out = mhattn.attention(q1, k1, v1, attn_mask=m1, **kwargs)
    want = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=m2, **kwargs)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert (out - want).abs().max() <= tol
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        assert (a.grad - b.grad).abs().max() <= tol
    if m1 is not mask:
        assert m1.grad.shape == m2.grad.shape
        assert (m1.grad - m2.grad).abs().max() <= tol


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 17, 16, 23), (1, 2, 1, 8, 1), (2, 1, 40, 32, 13)])
def test_plain_and_causal(shape, causal):
    b, h, nq, d, nk = shape
    check_against_sdpa(rand(b, h, nq, d), rand(b, h, nk, d), rand(b, h, nk, d), is_causal=causal)


@pytest.mark.parametrize("mask_shape", [(9, 13), (1, 1, 9, 13), (2, 1, 1, 13), (2, 3, 9, 13), (3, 9, 1)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast(mask_shape, kind):
    q, k, v = rand(2, 3, 9, 8), rand(2, 3, 13, 8), rand(2, 3, 13, 8)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
    else:
        mask = torch.randn(mask_shape)
    check_against_sdpa(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("bias", [causal_lower_right, causal_upper_left])
def test_causal_bias_objects(bias):
    q, k, v = rand(2, 2, 7, 8), rand(2, 2, 12, 8), rand(2, 2, 12, 8)
    check_against_sdpa(q, k, v, attn_mask=bias(7, 12))
    q, k, v = rand(2, 2, 12, 8), rand(2, 2, 7, 8), rand(2, 2, 7, 8)
    out = mhattn.attention(q, k, v, attn_mask=bias(12, 7))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias(12, 7))
    assert torch.isfinite(out).all()
    seen = torch.isfinite(want).all(-1)  # rows SDPA leaves NaN see no key; mhattn gives 0 there
    assert (out[seen] - want[seen]).abs().max() <= 1e-5
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))


def test_scale_gqa_3d_and_5d_inputs():
    check_against_sdpa(rand(2, 6, 9, 16), rand(2, 2, 11, 16), rand(2, 2, 11, 16), enable_gqa=True, scale=0.3)
    check_against_sdpa(rand(6, 9, 16), rand(1, 11, 16), rand(1, 11, 16), enable_gqa=True, is_causal=True)
    check_against_sdpa(rand(2, 3, 4, 9, 8), rand(2, 3, 4, 5, 8), rand(2, 3, 4, 5, 8), attn_mask=torch.rand(3, 1, 9, 5) > 0.2)


def test_value_dim_differs_and_fp64():
    check_against_sdpa(rand(2, 3, 9, 16, dtype=torch.float64), rand(2, 3, 5, 16, dtype=torch.float64),
                       rand(2, 3, 5, 24, dtype=torch.float64), tol=1e-12, is_causal=True)


def test_strided_views_reach_the_backend_without_copies():
    seen = {}

    class Spy(ReferenceBackend):
        name = "spy"

        def forward(self, q, k, v, params):
            seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            seen["strides"] = (q.stride(), k.stride())
            return super().forward(q, k, v, params)

    mhattn.register_backend(Spy())
    try:
        batch, seq, heads, dim = 2, 10, 3, 8
        qkv = torch.randn(batch, seq, 3, heads, dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views, last dim contiguous
        out = mhattn.attention(q, k, v, backend="spy")
        assert seen["ptrs"] == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        assert seen["strides"][0] == q.stride()
        assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= 1e-5
    finally:
        mhattn.unregister_backend("spy")


def test_dropout_replays_the_shared_rng():
    q, k, v = rand(2, 3, 9, 8), rand(2, 3, 13, 8), rand(2, 3, 13, 8)
    torch.manual_seed(123)
    out = mhattn.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(123)
    again = mhattn.attention(q, k, v, dropout_p=0.2)
    assert torch.equal(out, again)
    torch.manual_seed(123)
    seed = tuple(int(s) for s in torch.randint(0, 2**32, (2,), dtype=torch.int64))
    keep = keep_mask(seed, 2, 3, 9, 13, 0.2)
    params = mhattn.AttentionParams(scale=8**-0.5, dropout_p=0.2, seed=seed)
    want, _ = naive_attention(q, k, v, params, keep=keep)
    assert (out - want).abs().max() <= 1e-6
    assert not torch.equal(out, mhattn.attention(q, k, v, dropout_p=0.2))


def test_return_lse_and_its_gradient():
    q, k, v = (rand(2, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = mhattn.attention(q, k, v, is_causal=True, return_lse=True)
    want_lse = torch.logsumexp(
        (q @ k.transpose(-1, -2) * 8**-0.5).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")), -1
    )
    assert (lse - want_lse).abs().max() <= 1e-12
    g1 = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v))
    want_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g2 = torch.autograd.grad((want_out.sum() + want_lse.sum()), (q, k, v))
    for a, b in zip(g1, g2):
        assert (a - b).abs().max() <= 1e-10


def test_window_and_softcap_match_reference():
    q, k, v = rand(1, 2, 12, 8, dtype=torch.float64), rand(1, 2, 12, 8, dtype=torch.float64), rand(1, 2, 12, 8, dtype=torch.float64)
    out = mhattn.attention(q, k, v, window=(3, 1), softcap=2.0)
    scores = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 8**-0.5 / 2.0)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    scores = scores.masked_fill(~((j - i >= -3) & (j - i <= 1)), float("-inf"))
    want = torch.softmax(scores, -1) @ v
    assert (out - want).abs().max() <= 1e-12


def test_torch_compile_fullgraph():
    q, k, v = rand(2, 2, 9, 8, requires_grad=True), rand(2, 2, 9, 8), rand(2, 2, 9, 8)
    compiled = torch.compile(lambda a, b, c: mhattn.attention(a, b, c, is_causal=True).sum(), fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    want_q = q.detach().clone().requires_grad_(True)
    want = F.scaled_dot_product_attention(want_q, k, v, is_causal=True).sum()
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-4
    assert (q.grad - want_q.grad).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 16), rand(2, 2, 4, 16)), ["head dim", "8", "16"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 5, 8), rand(2, 2, 4, 8)), ["key and value", "5", "4"]),
        (lambda: mhattn.attention(rand(2, 4, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8)), ["enable_gqa"]),
        (lambda: mhattn.attention(rand(2, 4, 4, 8), rand(2, 3, 4, 8), rand(2, 3, 4, 8), enable_gqa=True), ["multiple"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8, dtype=torch.float64), rand(2, 2, 4, 8)), ["dtype", "float64"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), attn_mask=torch.ones(3, 4, dtype=torch.bool)), ["attn_mask", "(3, 4)", "broadcast"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), attn_mask=torch.ones(4, 4, dtype=torch.int32)), ["attn_mask", "int32"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), dropout_p=1.5), ["dropout_p", "1.5"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), window=(1,)), ["window"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), softcap=-1.0), ["softcap"]),
        (lambda: mhattn.attention(rand(4, 8), rand(4, 8), rand(4, 8)), ["query", "3 dims"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), attn_mask=causal_lower_right(4, 5)), ["causal", "(4, 5)"]),
        (lambda: mhattn.attention(rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True), ["is_causal"]),
    ],
)
def test_bad_input_names_the_argument(call, words):
    with pytest.raises(mhattn.InputError) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, message


def test_torch_compile_with_a_backend_whose_layouts_differ_from_the_fake():
    # A backend may return out in (B, N, H, D) memory (as the Triton backend does) or plain contiguous;
    # compiled graphs rely on the fake implementation's layouts, so the op must hand back those.
    class TokenMajor(ReferenceBackend):
        name = "token_major"

        def forward(self, q, k, v, params):
            out, lse = super().forward(q, k, v, params)
            placed = torch.empty(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
            placed.copy_(out)
            return placed, lse

    mhattn.register_backend(TokenMajor())
    try:
        for name in ("reference", "token_major"):
            qkv = torch.randn(2, 9, 3, 4, 8)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # non-dense views
            q = q.detach().requires_grad_(True)
            compiled = torch.compile(
                lambda a, b, c: mhattn.attention(a, b, c, is_causal=True, backend=name).square().sum(), fullgraph=True
            )
            compiled(q, k, v).backward()
            want_q = q.detach().clone().requires_grad_(True)
            F.scaled_dot_product_attention(want_q, k, v, is_causal=True).square().sum().backward()
            assert (q.grad - want_q.grad).abs().max() <= 1e-5
    finally:
        mhattn.unregister_backend("token_major")
