"""The naive reference against attention written out in float64 and against torch's SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from mhattn.backends.base import AttentionParams
from mhattn.dropout_rng import keep_mask, random_bits, threshold
from mhattn.reference import ReferenceBackend, naive_attention, visible


def loop_attention(q, k, v, params, keep=None):
    """Attention one query row at a time in Python floats: independent of the vectorised reference."""
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    out = torch.zeros(batch, heads_q, seqlen_q, v.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, heads_q, seqlen_q), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            for i in range(seqlen_q):
                scores = []
                for j in range(seqlen_k):
                    rel = j - i - params.diag_offset
                    if params.window_left is not None and rel < -params.window_left:
                        continue
                    if params.window_right is not None and rel > params.window_right:
                        continue
                    if params.mask is not None and params.mask.dtype == torch.bool and not params.mask[b, h, i, j]:
                        continue
                    s = float(q[b, h, i] @ k[b, h // group, j]) * params.scale
                    if params.softcap is not None:
                        s = params.softcap * math.tanh(s / params.softcap)
                    if params.mask is not None and params.mask.dtype != torch.bool:
                        s += float(params.mask[b, h, i, j])
                    if s != float("-inf"):
                        scores.append((j, s))
                if not scores:
                    continue
                m = max(s for _, s in scores)
                total = sum(math.exp(s - m) for _, s in scores)
                lse[b, h, i] = m + math.log(total)
                for j, s in scores:
                    p = math.exp(s - m) / total
                    if keep is not None:
                        p = p * float(keep[b, h, i, j]) / (1 - params.dropout_p)
                    out[b, h, i] += p * v[b, h // group, j]
    return out, lse


CASES = [
    dict(),
    dict(window_right=0),
    dict(window_right=0, diag_offset=4),
    dict(window_left=2, window_right=1),
    dict(softcap=2.0),
    dict(mask="bool"),
    dict(mask="float"),
    dict(dropout_p=0.3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_reference_matches_loop(case):
    gen = torch.Generator().manual_seed(1)
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, dim = 2, 4, 2, 5, 9, 8
    q = torch.randn(batch, heads_q, seqlen_q, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, seqlen_k, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, seqlen_k, dim, generator=gen, dtype=torch.float64)
    case = dict(case)
    mask = case.pop("mask", None)
    if mask == "bool":
        mask = torch.rand(batch, 1, seqlen_q, seqlen_k, generator=gen) > 0.4
        mask = mask.expand(batch, heads_q, seqlen_q, seqlen_k)
    elif mask == "float":
        mask = torch.randn(1, heads_q, seqlen_q, seqlen_k, generator=gen, dtype=torch.float64)
        mask = mask.expand(batch, heads_q, seqlen_q, seqlen_k)
    params = AttentionParams(scale=0.37, mask=mask, seed=(11, 22), **case)
    keep = keep_mask(params.seed, batch, heads_q, seqlen_q, seqlen_k, params.dropout_p) if params.dropout_p else None
    out, lse = naive_attention(q, k, v, params)
    want_out, want_lse = loop_attention(q, k, v, params, keep)
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-12, rtol=0)


def test_fully_masked_rows_give_zero_and_finite_gradients():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, 4, 6, dtype=torch.bool)
    mask[:, :, 1] = False
    out, lse = naive_attention(q, k, v, AttentionParams(scale=0.3, mask=mask))
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isinf(lse[:, :, 1]).all() and (lse[:, :, 1] < 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa_math(dtype, causal):
    q, k, v = (torch.randn(2, 3, 17, 16, dtype=dtype) for _ in range(3))
    out, _ = naive_attention(q, k, v, AttentionParams(scale=0.25, window_right=0 if causal else None))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert (out - want).abs().max() <= tol


def test_visible_bounds():
    params = AttentionParams(scale=1.0, diag_offset=2, window_left=1, window_right=0)
    got = visible(3, 5, params)
    want = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)


@pytest.mark.parametrize("feature", ["plain", "softcap", "float_mask", "dropout", "gqa", "lse_grad"])
def test_reference_backend_backward_matches_autograd(feature):
    gen = torch.Generator().manual_seed(3)
    heads_kv = 1 if feature == "gqa" else 2
    q = torch.randn(2, 2, 7, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, heads_kv, 11, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, heads_kv, 11, 6, generator=gen, dtype=torch.float64)
    kwargs = dict(scale=0.4, window_right=0, diag_offset=4)
    mask = None
    if feature == "softcap":
        kwargs["softcap"] = 1.5
    if feature == "float_mask":
        mask = torch.randn(1, 1, 7, 11, generator=gen, dtype=torch.float64).expand(2, 2, 7, 11)
        kwargs.update(mask=mask, mask_requires_grad=True)
    if feature == "dropout":
        kwargs.update(dropout_p=0.25, seed=(5, 6))
    params = AttentionParams(**kwargs)
    backend = ReferenceBackend()
    out, lse = backend.forward(q, k, v, params)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64) if feature == "lse_grad" else None
    dq, dk, dv, dmask = backend.backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)

    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    auto_mask = mask.clone().requires_grad_(True) if mask is not None else None
    want_out, want_lse = naive_attention(*inputs, params, mask=auto_mask)
    outputs, grads = [want_out], [grad_out]
    if grad_lse is not None:
        outputs.append(want_lse)
        grads.append(grad_lse)
    wanted = inputs + ([auto_mask] if auto_mask is not None else [])
    want = torch.autograd.grad(outputs, wanted, grads)
    for got, expected in zip((dq, dk, dv, dmask), want):
        assert torch.allclose(got, expected, atol=1e-10, rtol=0)


def test_dropout_rng_statistics_and_determinism():
    p = 0.17
    bits = random_bits((123, 456), 2, 3, 64, 96)
    assert bits.min() >= 0 and bits.max() < 2**32
    kept = keep_mask((123, 456), 2, 3, 64, 96, p)
    assert torch.equal(kept, bits >= threshold(p))
    rate = kept.float().mean().item()
    assert abs(rate - (1 - p)) < 0.01  # 36864 draws: 4 standard deviations ~ 0.008
    assert torch.equal(kept, keep_mask((123, 456), 2, 3, 64, 96, p))
    assert not torch.equal(kept, keep_mask((123, 457), 2, 3, 64, 96, p))
    # rows and columns are not copies of each other
    assert not torch.equal(kept[0, 0, 0], kept[0, 0, 1]) and not torch.equal(kept[0, 0, :, 0], kept[0, 0, :, 1])
